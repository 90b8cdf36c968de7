// The batched matrix product of decoder_layer_cpu.cc: C = W X^T for many rows of x (prefill steps of 512-2048
// token rows, decode batches of 16-64) on weight rows that are float32 or dequantized a group at a time.
//
// Why this layout: the old path took 4 weight rows at a time and swept every row of x past them with a 4x4
// dot-product tile, so for a big batch x was re-read from L2/L3 for every 4 weight rows and each tile ended in
// horizontal reductions. Here x is packed once per product into panels of 32 rows stored k-major (a panel's 32
// values of column t side by side: two vectors), and the micro-kernel keeps a 12-weight-row x 32-x-row block of
// C in 24 vector registers: per column t it loads the panel's two vectors and broadcasts each of the 12 weights
// w[r][t] (read straight from row-major weight rows: no transposed copy of the weights is ever made) into 24
// FMAs. The sums run along k in plain order per output (no horizontal reductions), float32 throughout.
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

typedef float vf16 __attribute__((vector_size(64)));

constexpr int64_t kPanel = 32;      // rows of x per packed panel: two vectors
constexpr int kKernelRows = 12;     // weight rows per micro-kernel call: 12 x 2 accumulators of 24 vector registers
constexpr int64_t kDepth = 64;      // columns per depth block: 32 x 64 floats of x + 48 x 64 of weights in L1

inline int64_t panels(int64_t m) { return (m + kPanel - 1) / kPanel; }
// panel p's width in floats per column: 32, or 16 for a last panel of 16 rows or fewer
inline int64_t panel_width(int64_t m, int64_t p) { return m - p * kPanel > 16 ? kPanel : 16; }
inline int64_t packed_floats(int64_t m, int64_t k) { return panels(m) * kPanel * k; }

inline vf16 load(const float* p) {
  vf16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vf16 v) { std::memcpy(p, &v, sizeof v); }

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

// C[r][b] (+)= sum over t < depth of w[r * ldw + t] * xp[t * 16V + b] for r < R weight rows and the panel's
// 16V rows of x (V = 1 or 2 vectors); first: C starts at zero instead of at what c holds. The block is summed
// from zero and then added to C (blocked summation): the rounding error grows with the block's length plus the
// number of blocks, not with k (a sum straight along k = 8192 had twice the old dot tiles' error).
// next: the x block (depth x 16V floats) the following calls read, asked into L1 a column per column here, or
// null (panels are 32 k floats apart, 256 KB at k = 2048: too far apart for the hardware to see that stream).
template <int V, int R>
void kernel(const float* xp, int64_t depth, const float* w, int64_t ldw, float* c, int64_t ldc, bool first,
            const float* next) {
  vf16 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = vf16{};
  for (int64_t t = 0; t < depth; ++t) {
    vf16 xv[V];
    for (int v = 0; v < V; ++v) xv[v] = load(xp + t * 16 * V + 16 * v);
    if (next != nullptr) {
      for (int v = 0; v < V; ++v) __builtin_prefetch(next + t * 16 * V + 16 * v, 0, 3);
    }
    for (int r = 0; r < R; ++r) {
      const float s = w[r * ldw + t];                             // broadcast into the FMA
      for (int v = 0; v < V; ++v) acc[r][v] += s * xv[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) store(c + r * ldc + 16 * v, first ? acc[r][v] : load(c + r * ldc + 16 * v) + acc[r][v]);
}

typedef void (*KernelFn)(const float*, int64_t, const float*, int64_t, float*, int64_t, bool, const float*);

template <int V, int... R>
constexpr std::array<KernelFn, sizeof...(R)> kernels_of(std::integer_sequence<int, R...>) {
  return {&kernel<V, R + 1>...};
}

// kernel<V, R> for V = width / 16 and R = rows (1..12)
inline KernelFn kernel_for(int64_t width, int rows) {
  static constexpr auto one = kernels_of<1>(std::make_integer_sequence<int, kKernelRows>{});
  static constexpr auto two = kernels_of<2>(std::make_integer_sequence<int, kKernelRows>{});
  return (width == kPanel ? two : one)[rows - 1];
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
      int64_t row = 0;
      for (int s = 0; s < nseg; ++s) {
        for (int64_t i = 0; i < segs[s].rows; i += kKernelRows) {
          const int n = static_cast<int>(std::min<int64_t>(kKernelRows, segs[s].rows - i));
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
