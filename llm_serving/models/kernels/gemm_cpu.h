// The batched matrix product of decoder_layer_cpu.cc: C = W X^T for many rows of x (prefill steps of 512-2048
// token rows, decode batches of 16-64) on weight rows that are float32 or dequantized a group at a time.
//
// Why this layout: the old path took 4 weight rows at a time and swept every row of x past them with a 4x4
// dot-product tile, so for a big batch x was re-read from L2/L3 for every 4 weight rows and each tile ended in
// horizontal reductions. Here x is packed once per product into panels of 32 rows stored k-major (a panel's 32
// values of column t side by side), and the micro-kernel keeps a block of C in half of the CPU's vector registers:
// per column t it loads the panel's vectors and broadcasts each weight w[r][t] of its rows (read straight from
// row-major weight rows: no transposed copy of the weights is ever made) into one FMA per vector. AVX-512 (32
// registers of 16 floats): 12 weight rows x 32 x rows, 24 accumulators. AVX2 (16 registers of 8 floats): 3
// weight rows x 32 x rows (6 x 16 for a panel of 16), 12 accumulators, the rest for the broadcasts and x; the
// AVX-512 shape there kept 48 half-vectors of C on the stack and ran at a tenth of the FMA rate (1.9 GFLOP/s per
// core, bench/layer_kernel_gemm.py on a Zen 3). The sums run along k in plain order per output (no horizontal
// reductions), float32 throughout, so both shapes give the same sums.
//
// Blocking: a thread's chunk of weight rows is taken a group (24-48 rows) at a time; quantized rows are
// dequantized once per group into the thread's buffer (float32 rows are read in place). For each depth block of
// kDepth columns the group's slice of weights (group x kDepth floats) and one panel's slice of x (32 x kDepth)
// stay in L1 while the panel is multiplied by all of the group's 12-row sub-groups; the group's C (group x M)
// accumulates across depth blocks in a per-thread buffer. x is therefore streamed from L2/L3 once per group of
// weight rows (24-48 flops per byte of it), and the weights are read from memory and dequantized once per call.
//
// Shapes: x (M, k) row-major with row stride ldx -> packed (panels(M) * 32 * k floats); a panel of 16 when 16 or
// fewer rows are left (the rest of a panel is zero: computed, never emitted). C (rows, ldc) with ldc >=
// panels(M) * 32: C[i][b] = w_row_i . x_b.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

namespace llm_serving {
namespace gemm {

// The vector the micro-kernel works in: one register (AVX-512: 16 floats; otherwise 8, AVX2's), and how many of
// them hold a block of C (half the registers, see above).
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
constexpr int kAccumulators = 24;
#else
constexpr int64_t kLanes = 8;
constexpr int kAccumulators = 12;
#endif
typedef float vreg __attribute__((vector_size(kLanes * sizeof(float))));

constexpr int64_t kPanel = 32;      // rows of x per packed panel
constexpr int64_t kDepth = 64;      // columns per depth block: 32 x 64 floats of x + 48 x 64 of weights in L1

// weight rows per micro-kernel call on a panel `width` floats wide (32, or 16 for a last panel of 16 rows or
// fewer): as many as fill the accumulators, at most 12 (AVX-512 runs 12 on either width)
constexpr int kernel_rows(int64_t width) {
  return static_cast<int>(std::min<int64_t>(12, kAccumulators / (width / kLanes)));
}

inline int64_t panels(int64_t m) { return (m + kPanel - 1) / kPanel; }
// panel p's width in floats per column: 32, or 16 for a last panel of 16 rows or fewer
inline int64_t panel_width(int64_t m, int64_t p) { return m - p * kPanel > 16 ? kPanel : 16; }
inline int64_t packed_floats(int64_t m, int64_t k) { return panels(m) * kPanel * k; }

inline vreg load(const float* p) {
  vreg v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vreg v) { std::memcpy(p, &v, sizeof v); }

// Packs panel p of x (m rows, stride ldx, k columns) into xp + p * 32 * k: column t's values of the panel's rows
// at [t * width, (t + 1) * width), zero past the last row. 16 x 16 blocks go through a local tile so that both the
// reads (rows of x) and the writes (columns of the panel) are whole vectors.
inline void pack_panel(const float* x, int64_t ldx, int64_t m, int64_t k, int64_t p, float* xp) {
  const int64_t width = panel_width(m, p), m0 = p * kPanel;
  const int64_t valid = std::min<int64_t>(width, m - m0);
  float* dst = xp + p * kPanel * k;
  alignas(64) float tile[16][16];
  for (int64_t half = 0; half < width; half += 16) {                 // rows m0 + half .. + 16 of the panel
    const int64_t rows = std::max<int64_t>(0, std::min<int64_t>(16, valid - half));
    for (int64_t t0 = 0; t0 < k; t0 += 16) {
      const int64_t cols = std::min<int64_t>(16, k - t0);
      for (int64_t j = 0; j < 16; ++j) {                             // tile[col][row]
        if (j < rows) {
          const float* src = x + (m0 + half + j) * ldx + t0;
          for (int64_t c = 0; c < 16; ++c) tile[c][j] = c < cols ? src[c] : 0.f;
        } else {
          for (int64_t c = 0; c < 16; ++c) tile[c][j] = 0.f;
        }
      }
      for (int64_t c = 0; c < cols; ++c) std::memcpy(dst + (t0 + c) * width + half, tile[c], 16 * sizeof(float));
    }
  }
}

// C[r][b] (+)= sum over t < depth of w[r * ldw + t] * xp[t * width + b] for r < R weight rows and the panel's
// width = V * kLanes rows of x; first: C starts at zero instead of at what c holds. The block is summed
// from zero and then added to C (blocked summation): the rounding error grows with the block's length plus the
// number of blocks, not with k (a sum straight along k = 8192 had twice the old dot tiles' error).
// next: the x block (depth x width floats) the following calls read, asked into L1 a cache line per column here,
// or null (panels are 32 k floats apart, 256 KB at k = 2048: too far apart for the hardware to see that stream).
template <int V, int R>
void kernel(const float* xp, int64_t depth, const float* w, int64_t ldw, float* c, int64_t ldc, bool first,
            const float* next) {
  constexpr int64_t width = V * kLanes;
  vreg acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = vreg{};
  for (int64_t t = 0; t < depth; ++t) {
    if (next != nullptr) {
      for (int64_t at = 0; at < width; at += 16) __builtin_prefetch(next + t * width + at, 0, 3);
    }
    if constexpr (kLanes == 16) {                                 // AVX-512: the panel's 2 vectors, then each
      vreg xv[V];                                                 // weight broadcast into V FMAs (24 + 2 + 1
      for (int v = 0; v < V; ++v) xv[v] = load(xp + t * width + kLanes * v);                // registers)
      for (int r = 0; r < R; ++r) {
        const float s = w[r * ldw + t];
        for (int v = 0; v < V; ++v) acc[r][v] += s * xv[v];
      }
    } else {                                                      // AVX2: the R weights broadcast, then x a
      vreg s[R];                                                  // vector at a time (12 + 3 + 1 registers)
      for (int r = 0; r < R; ++r) s[r] = vreg{} + w[r * ldw + t];
      for (int v = 0; v < V; ++v) {
        const vreg xv = load(xp + t * width + kLanes * v);
        for (int r = 0; r < R; ++r) acc[r][v] += s[r] * xv;
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v)
      store(c + r * ldc + kLanes * v, first ? acc[r][v] : load(c + r * ldc + kLanes * v) + acc[r][v]);
}

typedef void (*KernelFn)(const float*, int64_t, const float*, int64_t, float*, int64_t, bool, const float*);

template <int V, int... R>
constexpr std::array<KernelFn, sizeof...(R)> kernels_of(std::integer_sequence<int, R...>) {
  return {&kernel<V, R + 1>...};
}

// kernel<V, R> for a panel `width` floats wide (V = width / kLanes) and R = rows (1..kernel_rows(width))
inline KernelFn kernel_for(int64_t width, int rows) {
  static constexpr auto wide = kernels_of<kPanel / kLanes>(std::make_integer_sequence<int, kernel_rows(kPanel)>{});
  static constexpr auto narrow = kernels_of<16 / kLanes>(std::make_integer_sequence<int, kernel_rows(16)>{});
  return (width == kPanel ? wide.data() : narrow.data())[rows - 1];
}

// A run of weight rows as float32, row-major with stride k.
struct Segment {
  const float* w;
  int64_t rows;
};

// C = the segments' rows (in order, row i of C) times the packed x (m rows, k columns): C (rows, ldc).
inline void product(const Segment* segs, int nseg, const float* xp, int64_t m, int64_t k, float* c, int64_t ldc) {
  const int64_t np = panels(m);
  for (int64_t k0 = 0; k0 < k; k0 += kDepth) {
    const int64_t depth = std::min<int64_t>(kDepth, k - k0);
    for (int64_t p = 0; p < np; ++p) {
      const int64_t width = panel_width(m, p);
      const float* xb = xp + p * kPanel * k + k0 * width;
      // the next panel's block, or after the last panel the first one's next depth block: fetched during the
      // first kernel on this block (the others find theirs in L1 by then)
      const float* next = p + 1 < np ? xp + (p + 1) * kPanel * k + k0 * panel_width(m, p + 1)
                          : k0 + kDepth < k ? xp + (k0 + kDepth) * panel_width(m, 0) : nullptr;
      const int step = kernel_rows(width);
      int64_t row = 0;
      for (int s = 0; s < nseg; ++s) {
        for (int64_t i = 0; i < segs[s].rows; i += step) {
          const int n = static_cast<int>(std::min<int64_t>(step, segs[s].rows - i));
          kernel_for(width, n)(xb, depth, segs[s].w + i * k + k0, k, c + (row + i) * ldc + p * kPanel, ldc,
                               k0 == 0, s == 0 && i == 0 ? next : nullptr);
        }
        row += segs[s].rows;
      }
    }
  }
}

}  // namespace gemm
}  // namespace llm_serving
