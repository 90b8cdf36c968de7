// Batch-invariant products: one order of sums per output whatever the rows of x, dot_gemm for few rows and
// lane_units (the same FMAs as outer products on x packed lane by lane) for many.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "gemm_cpu.h"
#include "float_products_cpu.h"
#include "weight_matrix_cpu.h"

namespace {

namespace gemm = llm_serving::gemm;

// With batch invariance on (invariant_enabled), every product of every step runs dot_gemm, whatever its rows:
// each output (weight row r, x row b) has its own vector of 16 lane sums, lane l the weights at k = l (mod 16)
// in order, one FMA each (fmadd16, or AVX2's halves), then reduce16's tree (tree16) and the columns past the last
// whole 16 in order (dot_finish). Nothing in that depends on the other rows, the tile an output fell in, the
// thread that took it or where a depth block ended (the lane sums are kept whole in a buffer between blocks),
// and quantized rows are dequantized by one compiled copy of dequantize_row, so a row of x gets the same float
// alone or among 2,000. Weight rows go kDotGroup at a time (quantized: dequantized once into the thread's
// buffer), x kDotRows rows at a time.
constexpr int64_t kDotGroup = 16;     // weight rows per group (dequantized together: 16 k floats a thread)
constexpr int64_t kDotRows = 64;      // rows of x whose lane sums are kept at once
constexpr int64_t kDotDepth = 4096;    // columns per depth block (fewer cost more in calls and lane traffic)
#if defined(__AVX512F__)
constexpr int kDotRB = 4, kDotBB = 4;   // 16 accumulators of 16 floats
#else
constexpr int kDotRB = 2, kDotBB = 3;   // AVX2: a v16 of lanes is two of its 16 registers: 12 accumulate
#endif

inline int64_t dot_w_floats(int64_t k) { return kDotGroup * k; }
inline int64_t dot_lane_floats() { return kDotGroup * kDotRows * 16; }

// lanes[r][b] (v16s, kDotRows per weight row) += w[r] . x[b] over columns [e0, e1) lane by lane, for RB weight
// rows (stride ldw) and BB rows of x (stride ldx); First: the lanes start from zero. Not inlined, and First a
// template parameter: inlined into the products' lambdas, or with `first ? zero : load` in the loop's set-up, GCC
// kept the accumulators on the stack and moved them through general registers (6 GFLOP/s a core on AVX2).
template <int RB, int BB, bool First>
__attribute__((noinline)) void dot_span(const float* w, int64_t ldw, const float* x, int64_t ldx, int64_t e0,
                                        int64_t e1, float* lanes) {
#if defined(__AVX512F__)
  v16 acc[RB][BB];
  for (int r = 0; r < RB; ++r)
    for (int b = 0; b < BB; ++b) {
      if constexpr (First) acc[r][b] = v16{};
      else acc[r][b] = load16(lanes + (r * kDotRows + b) * 16);
    }
  for (int64_t e = e0; e < e1; e += 16) {
    v16 xv[BB];
    for (int b = 0; b < BB; ++b) xv[b] = load16(x + b * ldx + e);
    for (int r = 0; r < RB; ++r) {
      const v16 wv = load16(w + r * ldw + e);
      for (int b = 0; b < BB; ++b) acc[r][b] = fmadd16(wv, xv[b], acc[r][b]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int b = 0; b < BB; ++b) store16(lanes + (r * kDotRows + b) * 16, acc[r][b]);
#else
  // AVX2: a v16 of lanes as its two halves in registers of 8 (lanes 0-7, 8-15), each the same FMA chain
  __m256 acc[RB][BB][2];
  for (int r = 0; r < RB; ++r)
    for (int b = 0; b < BB; ++b)
      for (int h = 0; h < 2; ++h)
        acc[r][b][h] = First ? _mm256_setzero_ps() : _mm256_loadu_ps(lanes + (r * kDotRows + b) * 16 + 8 * h);
  for (int64_t e = e0; e < e1; e += 16) {
    for (int h = 0; h < 2; ++h) {
      __m256 xv[BB];
      for (int b = 0; b < BB; ++b) xv[b] = _mm256_loadu_ps(x + b * ldx + e + 8 * h);
      for (int r = 0; r < RB; ++r) {
        const __m256 wv = _mm256_loadu_ps(w + r * ldw + e + 8 * h);
        for (int b = 0; b < BB; ++b) acc[r][b][h] = _mm256_fmadd_ps(wv, xv[b], acc[r][b][h]);
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int b = 0; b < BB; ++b)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(lanes + (r * kDotRows + b) * 16 + 8 * h, acc[r][b][h]);
#endif
}

template <int RB, int BB>
inline void dot_span_first(const float* w, int64_t ldw, const float* x, int64_t ldx, int64_t e0, int64_t e1,
                           float* lanes, bool first) {
  if (first) dot_span<RB, BB, true>(w, ldw, x, ldx, e0, e1, lanes);
  else dot_span<RB, BB, false>(w, ldw, x, ldx, e0, e1, lanes);
}

template <int RB>
inline void dot_span_rows(const float* w, int64_t ldw, const float* x, int64_t ldx, int bb, int64_t e0, int64_t e1,
                          float* lanes, bool first) {
  switch (bb) {                                        // bb <= kDotBB
    case 1: dot_span_first<RB, 1>(w, ldw, x, ldx, e0, e1, lanes, first); break;
    case 2: dot_span_first<RB, kDotBB >= 2 ? 2 : 1>(w, ldw, x, ldx, e0, e1, lanes, first); break;
    case 3: dot_span_first<RB, kDotBB >= 3 ? 3 : 1>(w, ldw, x, ldx, e0, e1, lanes, first); break;
    default: dot_span_first<RB, kDotBB >= 4 ? 4 : 1>(w, ldw, x, ldx, e0, e1, lanes, first); break;
  }
}

// A dot product's value from its lane sums: reduce16's tree, then the columns [k16, k) in order. Not inlined (one
// compiled copy: the order of the last columns' additions is this loop's wherever a product ends).
__attribute__((noinline)) float dot_finish(const float* lanes, const float* w, const float* x, int64_t k16, int64_t k) {
  float v = k16 > 0 ? tree16(load16(lanes)) : 0.f;
  for (int64_t t = k16; t < k; ++t) v += w[t] * x[t];
  return v;
}

// For weight rows [r0, r1) of w and every row b of x (m rows of w.k): w[r] . x[b] to `out`, each the same
// float whatever m and [r0, r1). wbuf: dot_w_floats(k), lanes: dot_lane_floats(), the calling thread's.
inline void dot_gemm(const Matrix& w, const float* x, int64_t m, int64_t r0, int64_t r1, float* wbuf, float* lanes,
                     const Outputs& out) {
  const int64_t k = w.k, k16 = k / 16 * 16;
  float done[kDotGroup * kDotRows];
  for (int64_t g0 = r0; g0 < r1; g0 += kDotGroup) {
    const int64_t n = std::min(kDotGroup, r1 - g0);
    const float* wg = reinterpret_cast<const float*>(w.data) + g0 * k;
    if (w.type != kF32) {
      for (int64_t i = 0; i < n; ++i) w.dequantize_row(w.data + (g0 + i) * w.row_bytes, wbuf + i * k);
      wg = wbuf;
    }
    for (int64_t x0 = 0; x0 < m; x0 += kDotRows) {
      const int64_t xm = std::min(kDotRows, m - x0);
      const float* xb = x + x0 * k;
      for (int64_t e0 = 0; e0 < k16; e0 += kDotDepth) {
        const int64_t e1 = std::min(k16, e0 + kDotDepth);
        for (int64_t i = 0; i < n; i += kDotRB) {
          const int rb = static_cast<int>(std::min<int64_t>(kDotRB, n - i));
          for (int64_t b = 0; b < xm; b += kDotBB) {
            const int bb = static_cast<int>(std::min<int64_t>(kDotBB, xm - b));
            float* at = lanes + (i * kDotRows + b) * 16;
            if (rb == kDotRB) {
              dot_span_rows<kDotRB>(wg + i * k, k, xb + b * k, k, bb, e0, e1, at, e0 == 0);
            } else {
              for (int r = 0; r < rb; ++r)
                dot_span_rows<1>(wg + (i + r) * k, k, xb + b * k, k, bb, e0, e1, at + r * kDotRows * 16, e0 == 0);
            }
          }
        }
      }
      for (int64_t i = 0; i < n; ++i)
        for (int64_t b = 0; b < xm; ++b)
          done[i * xm + b] = dot_finish(lanes + (i * kDotRows + b) * 16, wg + i * k, xb + b * k, k16, k);
      out(g0, n, x0, xm, done, xm, 1);
    }
  }
}

// The same sums for many rows of x, as an outer product (lane_units): dot_gemm's loads (a weight vector and an x
// vector per FMA pair, 10 loads for 12 FMAs on AVX2) left it about 1.4x slower than gemm_cpu.h's kernel at 64
// rows in the layer (bench/batch_invariance.py). An output's lane l is a plain sum along k of its own: the
// columns k = 16 t + l, t = 0, 1, ... So x is packed per lane (pack_lanes: panel p's columns of lane l, t-major,
// 32 rows side by side), and for each lane a gemm_cpu.h-shaped kernel (lane_span) broadcasts the weight
// w[r][16 t + l] against the panel's vectors, an FMA into each output's lane-l accumulator in t order: the same
// FMAs, on the same values, in the same order as dot_span's lane l. The 16 lane sums of a block of outputs are
// kept in the thread's buffer and reduced by reduce16's tree as vectors across outputs (lane_tree), which is
// tree16's order; columns past the last whole 16 go through dot_finish itself. So a row's outputs are the same
// floats here as through dot_gemm, which every step of fewer rows runs (tests/unit/test_batch_invariance.py).
constexpr int64_t kLaneRows = 16;         // rows of x from which products run lane_units (dot_gemm below)
constexpr int64_t kLaneGroup = 48;        // weight rows per group (dequantized together: 48 k floats a thread)
constexpr int64_t kLaneDepth = 64;        // t steps per call of lane_span: 16 x 64 columns of a lane's panel

inline int64_t lane_w_floats(int64_t k) { return kLaneGroup * k; }
// a group's lane sums for one panel: 16 lanes x kLaneGroup weight rows x 32 rows of x
inline int64_t lane_sum_floats() { return 16 * kLaneGroup * gemm::kPanel; }

// Packs panel p of x (m rows of k, stride ldx; the columns up to the last whole 16) lane by lane into
// xp + p * 32 * k: column 16 t + l of the panel's rows at [(l * T + t) * width, + width), T = k / 16, zero past
// the last row (width: gemm::panel_width, 32 or 16).
inline void pack_lanes(const float* x, int64_t ldx, int64_t m, int64_t k, int64_t p, float* xp) {
  const int64_t width = gemm::panel_width(m, p), m0 = p * gemm::kPanel, T = k / 16;
  const int64_t valid = std::min<int64_t>(width, m - m0);
  float* dst = xp + p * gemm::kPanel * k;
  alignas(64) float tile[16][16];
  for (int64_t half = 0; half < width; half += 16) {
    const int64_t rows = std::max<int64_t>(0, std::min<int64_t>(16, valid - half));
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t j = 0; j < 16; ++j) {                             // tile[lane][row]
        if (j < rows) {
          const float* src = x + (m0 + half + j) * ldx + 16 * t;
          for (int64_t l = 0; l < 16; ++l) tile[l][j] = src[l];
        } else {
          for (int64_t l = 0; l < 16; ++l) tile[l][j] = 0.f;
        }
      }
      for (int64_t l = 0; l < 16; ++l) std::memcpy(dst + (l * T + t) * width + half, tile[l], 16 * sizeof(float));
    }
  }
}

inline gemm::vreg fma_lanes(gemm::vreg a, gemm::vreg b, gemm::vreg c) {
#if defined(__AVX512F__)
  return (gemm::vreg)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
  return (gemm::vreg)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#endif
}

inline gemm::vreg broadcast_lanes(float v) {
#if defined(__AVX512F__)
  return (gemm::vreg)_mm512_set1_ps(v);
#else
  return (gemm::vreg)_mm256_set1_ps(v);
#endif
}

// sums[r][b] (R weight rows x V vectors of x rows) continue lane l's FMA chains over t in [t0, t1): xl the
// panel's lane l (t-major, V * kLanes floats a step), w the R weight rows (stride ldw). First: from zero.
// gemm::vreg rather than __m256 arrays: with those, GCC stored every accumulator to the stack each step.
template <int V, int R, bool First>
__attribute__((noinline)) void lane_span(const float* xl, const float* w, int64_t ldw, int64_t t0, int64_t t1,
                                         int l, float* sums) {
  using gemm::vreg;
  constexpr int64_t width = V * gemm::kLanes;
  vreg acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = First ? vreg{} : gemm::load(sums + r * width + gemm::kLanes * v);
  const float* wl = w + l;
  for (int64_t t = t0; t < t1; ++t) {
    vreg s[R];
    for (int r = 0; r < R; ++r) s[r] = broadcast_lanes(wl[r * ldw + 16 * t]);
    for (int v = 0; v < V; ++v) {
      const vreg xv = gemm::load(xl + t * width + gemm::kLanes * v);
      for (int r = 0; r < R; ++r) acc[r][v] = fma_lanes(s[r], xv, acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) gemm::store(sums + r * width + gemm::kLanes * v, acc[r][v]);
}

typedef void (*LaneFn)(const float*, const float*, int64_t, int64_t, int64_t, int, float*);

template <int V, bool First, int... R>
constexpr std::array<LaneFn, sizeof...(R)> lane_spans_of(std::integer_sequence<int, R...>) {
  return {&lane_span<V, R + 1, First>...};
}

// lane_span for a panel `width` floats wide and `rows` weight rows (1..gemm::kernel_rows(width))
inline LaneFn lane_span_for(int64_t width, int rows, bool first) {
  constexpr int wide = gemm::kernel_rows(gemm::kPanel), narrow = gemm::kernel_rows(16);
  static constexpr auto wide0 = lane_spans_of<gemm::kPanel / gemm::kLanes, true>(std::make_integer_sequence<int, wide>{});
  static constexpr auto wide1 = lane_spans_of<gemm::kPanel / gemm::kLanes, false>(std::make_integer_sequence<int, wide>{});
  static constexpr auto narrow0 = lane_spans_of<16 / gemm::kLanes, true>(std::make_integer_sequence<int, narrow>{});
  static constexpr auto narrow1 = lane_spans_of<16 / gemm::kLanes, false>(std::make_integer_sequence<int, narrow>{});
  if (width == gemm::kPanel) return (first ? wide0 : wide1)[rows - 1];
  return (first ? narrow0 : narrow1)[rows - 1];
}

// out[i] = reduce16's tree over the 16 lanes (lanes[l * stride + i], l = 0..15) for i < n (a multiple of 8):
// lane i + lane i+8, then +4, +2, +1, as tree16 adds them. Compiled without -fassociative-math, which may regroup
// these adds (tree16 keeps its order through shuffles).
__attribute__((noinline, optimize("no-associative-math"))) void lane_tree(const float* lanes, int64_t stride,
                                                                          int64_t n, float* out) {
  for (int64_t i = 0; i < n; i += 8) {
    __m256 a[8], b[4], c[2];
    for (int j = 0; j < 8; ++j)
      a[j] = _mm256_add_ps(_mm256_loadu_ps(lanes + j * stride + i), _mm256_loadu_ps(lanes + (j + 8) * stride + i));
    for (int j = 0; j < 4; ++j) b[j] = _mm256_add_ps(a[j], a[j + 4]);
    for (int j = 0; j < 2; ++j) c[j] = _mm256_add_ps(b[j], b[j + 2]);
    _mm256_storeu_ps(out + i, _mm256_add_ps(c[0], c[1]));
  }
}

// Floats of a thread's buffer for lane_units (c): the lane sums of a group, then its C (kLaneGroup rows of ldc)
inline int64_t lane_c_floats(int64_t m) { return lane_sum_floats() + kLaneGroup * gemm::panels(m) * gemm::kPanel; }

// gemm_units' contract on these sums: units [u0, u1) of `parts` matrices (1-3, each w.k columns) times
// every row of x (m rows; xp: x packed by pack_lanes), a group of units at a time: C row q * n + i = matrix q's
// row u + i, C[.][b] its product with x row b, the same float as dot_gemm's; done(u, n, C, ldc) after each group.
// wbuf: lane_w_floats(k), c: lane_c_floats(m), the calling thread's.
template <typename Done>
void lane_units(const Matrix* const* ws, int parts, int64_t u0, int64_t u1, const float* x, const float* xp,
                int64_t m, float* wbuf, float* c, Done done) {
  const int64_t k = ws[0]->k, k16 = k / 16 * 16, T = k16 / 16, per = kLaneGroup / parts;
  const int64_t ldc = gemm::panels(m) * gemm::kPanel;
  float* sums = c;
  float* out = c + lane_sum_floats();
  alignas(64) float lanes16[16];
  for (int64_t u = u0; u < u1; u += per) {
    const int64_t n = std::min(per, u1 - u);
    const float* rows_of[3];                       // each part's rows of the group as float32 (stride k)
    for (int q = 0; q < parts; ++q) {
      const Matrix& w = *ws[q];
      if (w.type == kF32) {
        rows_of[q] = reinterpret_cast<const float*>(w.data) + u * k;
      } else {
        for (int64_t i = 0; i < n; ++i) w.dequantize_row(w.data + (u + i) * w.row_bytes, wbuf + (q * n + i) * k);
        rows_of[q] = wbuf + q * n * k;
      }
    }
    for (int64_t p = 0; p < gemm::panels(m); ++p) {
      const int64_t width = gemm::panel_width(m, p), b0 = p * gemm::kPanel;
      const int step = gemm::kernel_rows(width);
      const float* panel = xp + p * gemm::kPanel * k;
      // lane l of rows [i, i + rows) of part q: sums + ((q * n + i) * 16 + l * rows) * width
      for (int64_t t0 = 0; t0 < T; t0 += kLaneDepth) {
        const int64_t t1 = std::min(T, t0 + kLaneDepth);
        for (int q = 0; q < parts; ++q) {
          for (int64_t i = 0; i < n; i += step) {
            const int rows = static_cast<int>(std::min<int64_t>(step, n - i));
            const LaneFn fn = lane_span_for(width, rows, t0 == 0);
            for (int l = 0; l < 16; ++l)
              fn(panel + l * T * width, rows_of[q] + i * k, k, t0, t1, l, sums + ((q * n + i) * 16 + l * rows) * width);
          }
        }
      }
      for (int q = 0; q < parts; ++q) {
        for (int64_t i = 0; i < n; i += step) {
          const int rows = static_cast<int>(std::min<int64_t>(step, n - i));
          const float* s = sums + (q * n + i) * 16 * width;
          for (int r = 0; r < rows; ++r) {
            float* cr = out + (q * n + i + r) * ldc + b0;
            if (k16 == k && T > 0) {
              lane_tree(s + r * width, rows * width, width, cr);
            } else {                                   // columns past the last 16: dot_finish, output by output
              const float* wr = rows_of[q] + (i + r) * k;
              for (int64_t b = 0; b < std::min<int64_t>(width, m - b0); ++b) {
                for (int l = 0; l < 16; ++l) lanes16[l] = T > 0 ? s[(l * rows + r) * width + b] : 0.f;
                cr[b] = dot_finish(lanes16, wr, x + (b0 + b) * k, k16, k);
              }
            }
          }
        }
      }
    }
    done(u, n, static_cast<const float*>(out), ldc);
  }
}

}  // namespace
