// Float32 dot products in registers: v16 (16 floats, one AVX-512 register or two AVX2 ones), the tree of
// shuffle-adds that sums 16 vectors' lanes at once (reduce16, tree16), and dot_tile: up to 4 weight rows by 4 rows
// of x, the float products of matvec's tiles.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

typedef float v16 __attribute__((vector_size(64)));

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// One level of a tree reduction: x and y each hold groups of `w` partial sums; the result holds twice as many
// groups of w/2 (each group's two halves added), x's and y's groups interleaved.
inline v16 fold16(v16 x, v16 y) {    // 1 group of 16 -> 2 groups of 8: [x | y]
  return __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
inline v16 fold8(v16 x, v16 y) {     // 2 groups of 8 -> 4 groups of 4: [x0 y0 x1 y1]
  return __builtin_shufflevector(x, y, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
         __builtin_shufflevector(x, y, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
}
inline v16 fold4(v16 x, v16 y) {     // 4 groups of 4 -> 8 groups of 2
  return __builtin_shufflevector(x, y, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
         __builtin_shufflevector(x, y, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
}
inline v16 fold2(v16 x, v16 y) {     // 8 groups of 2 -> 16 sums
  return __builtin_shufflevector(x, y, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         __builtin_shufflevector(x, y, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

// a * b + c, rounded once where the CPU has FMA (-std=c++17 keeps GCC from contracting a * b + c itself)
inline v16 fmadd16(v16 a, v16 b, v16 c) {
#if defined(__AVX512F__)
  return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
  return a * b + c;
#endif
}

// The 16 horizontal sums of v[0..15] in one vector (15 shuffle-adds instead of 16 scalar reductions); lane
// lane_of()[i] holds the sum of v[i].
inline v16 reduce16(const v16 v[16]) {
  v16 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) a[i] = fold16(v[2 * i], v[2 * i + 1]);
  for (int i = 0; i < 4; ++i) b[i] = fold8(a[2 * i], a[2 * i + 1]);
  for (int i = 0; i < 2; ++i) c[i] = fold4(b[2 * i], b[2 * i + 1]);
  return fold2(c[0], c[1]);
}

const int* lane_of() {               // found once by reducing vectors whose every lane is their index
  static const int* table = [] {
    static int lanes[16];
    v16 v[16];
    for (int i = 0; i < 16; ++i)
      for (int l = 0; l < 16; ++l) v[i][l] = static_cast<float>(i);
    const v16 sums = reduce16(v);
    for (int l = 0; l < 16; ++l) lanes[static_cast<int>(sums[l] / 16.f + 0.5f)] = l;
    return lanes;
  }();
  return table;
}

inline float hsum(v16 v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

// The sum of v's lanes by reduce16's tree (lane i + lane i+8, then +4, +2, +1), vector shuffles whose order the
// compiler keeps (a scalar sum could be regrouped under -fassociative-math).
inline float tree16(v16 v) {
  const v16 zero{};
  return fold2(fold4(fold8(fold16(v, zero), zero), zero), zero)[0];
}

// out[r][b] = the sum of acc[r][b]'s lanes
template <int RB, int BB>
inline void sum_lanes(v16 acc[RB][BB], float out[4][4]) {
  if (RB == 4 && BB == 4) {
    const v16 sums = reduce16(&acc[0][0]);
    const int* lane = lane_of();
    for (int r = 0; r < RB; ++r)
      for (int b = 0; b < BB; ++b) out[r][b] = sums[lane[r * BB + b]];
  } else {
    for (int r = 0; r < RB; ++r)
      for (int b = 0; b < BB; ++b) out[r][b] = hsum(acc[r][b]);
  }
}

// out[r][b] = w[r] . x[b] for RB consecutive weight rows (row length k) and BB rows of x (stride ldx). Never
// inlined: inlined into a caller's loop (the layer's fused gate/up tiles) its 16 accumulators spilled, and the
// layer's float32 step at 16 rows ran 0.8x as fast
template <int RB, int BB>
__attribute__((noinline)) void dot_tile(const float* w, int64_t k, const float* x, int64_t ldx, float out[4][4]) {
  v16 acc[RB][BB];
  for (int r = 0; r < RB; ++r)
    for (int b = 0; b < BB; ++b) acc[r][b] = v16{};
  int64_t e = 0;
  for (; e + 16 <= k; e += 16) {
    v16 xv[BB];
    for (int b = 0; b < BB; ++b) xv[b] = load16(x + b * ldx + e);
    for (int r = 0; r < RB; ++r) {
      const v16 wv = load16(w + r * k + e);
      for (int b = 0; b < BB; ++b) acc[r][b] += wv * xv[b];
    }
  }
  sum_lanes<RB, BB>(acc, out);
  for (int r = 0; r < RB; ++r)
    for (int b = 0; b < BB; ++b)
      for (int64_t t = e; t < k; ++t) out[r][b] += w[r * k + t] * x[b * ldx + t];
}

template <int RB>
inline void dot_rows(const float* w, int64_t k, const float* x, int64_t ldx, int bb, float out[4][4]) {
  switch (bb) {
    case 1: dot_tile<RB, 1>(w, k, x, ldx, out); break;
    case 2: dot_tile<RB, 2>(w, k, x, ldx, out); break;
    case 3: dot_tile<RB, 3>(w, k, x, ldx, out); break;
    default: dot_tile<RB, 4>(w, k, x, ldx, out); break;
  }
}

}  // namespace
