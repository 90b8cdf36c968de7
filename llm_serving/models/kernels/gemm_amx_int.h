// The batched matrix product of decoder_layer_cpu.cc for quantized weights on AMX's integer tiles: C = W X^T
// with TDPBSSD (16 x 16 int32 sums of 32-long int8 dot products per instruction), as llama.cpp multiplies
// quantized rows, but with 16-bit activations so that the results stay within ~1e-5 of float32's.
//
// Weights: every GGUF block of 32 weights is an integer code per weight times a scale plus an offset, w = sw q +
// mw (Q4_0: q - 8 and d; Q4_1: q, d and m; Q4_K: q, d sc[j] and -dmin m[j]; ...), so the codes go to the tiles as
// they are, int8, and the scales are applied per block to the tile's int32 sums. Q6_K's 16-weight sub-blocks
// have their own int8 scales: its code times its scale (|v| <= 4096) is split into two int8 pieces, v = 64 hi +
// lo (lo in [-32, 31]), both exact, and multiplied separately (a row block with any Q6_K row runs the second
// product; for its other rows hi is zero).
//
// Activations: each row of x is quantized per block of 32 to 16 bits, x = sx n with sx = max |x| / 32512, and n
// is split into two int8 pieces, n = 256 nh + nl (nl in [-128, 127]). Per block the tile computes w . nh and w .
// nl, recombined exactly in int32 (sum << 8 + sum): one int8 product's speed costs two tile products, which are
// cheap next to the per-block scaling. The error is x's rounding to 16 bits (at most 2^-16 of the block's
// largest value); the tests compare with a float64 product of the dequantized weights and x rounded the same way.
//
// Per (16-row block, k block) a block of kBlockBytes: for weights [lo codes: A tile, 16 rows x 32 bytes][hi
// codes: A tile][sw: 16 floats][mw: 16 floats]; for x [nh: B tile, 8 rows of 4-byte groups x 16 rows of x][nl:
// B tile][sx: 16 floats][xs = sx sum(n): 16 floats] (the offsets' term, mw xs, summed with the products). A
// block of rows' blocks are contiguous along k. C: as gemm_amx.h's (weight rows x x rows, c_stride(m)).
#pragma once

#include "gemm_amx.h"

#if defined(LLM_SERVING_AMX) && defined(__AMX_INT8__) && defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define LLM_SERVING_AMX_INT 1

namespace llm_serving {
namespace amx_int {

using amx::c_stride;
using amx::rows16;

constexpr int64_t kBlockBytes = 1152;              // two 512-byte tiles, two 16-float vectors
constexpr int64_t kScales = 1024, kOffsets = 1088;  // where a block's scales and offsets start
constexpr int64_t kHigh = 512;                      // where the second tile starts
constexpr float kRange = 32512.f;                   // 127 x 256: n's high piece stays within int8

inline int64_t kblocks(int64_t k) { return k / 32; }
inline int64_t packed_floats(int64_t m, int64_t k) { return rows16(m) / 16 * kblocks(k) * kBlockBytes / 4; }
inline int64_t group_floats(int64_t g, int64_t k) { return rows16(g) / 16 * kblocks(k) * kBlockBytes / 4; }

// Palette 1: tiles 0..3 C (16 x 16 int32), 4..5 A (16 rows x 32 int8), 6..7 B (8 rows of 16 x 4 int8).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 32, 32, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 8, 8};
};

using Tiles = amx::ConfiguredTiles<TileConfig>;
// the super-block products' tiles are all 16 rows x 64 bytes: gemm_amx.h's configuration
using SuperTiles = amx::Tiles;

// 16 values of x times inv rounded to integers n (returned), and n's two int8 pieces, n = 256 hi + lo (lo in
// [-128, 127]), stored as 16 bytes each at hi and lo
inline __m512i split16(__m512 v, __m512 inv, void* hi, void* lo) {
  const __m512i n = _mm512_cvtps_epi32(_mm512_mul_ps(v, inv));
  const __m512i h = _mm512_srai_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(128)), 8);
  _mm_storeu_si128(static_cast<__m128i*>(hi), _mm512_cvtepi32_epi8(h));
  _mm_storeu_si128(static_cast<__m128i*>(lo), _mm512_cvtepi32_epi8(_mm512_sub_epi32(n, _mm512_slli_epi32(h, 8))));
  return n;
}

// Packs the block of x rows nb (rows 16 nb .. 16 nb + 15 of m, stride ldx, k a multiple of 32) into xp
// (packed_floats(m, k)); rows past m are zeros.
inline void pack_block(const float* x, int64_t ldx, int64_t m, int64_t k, int64_t nb, float* xp) {
  const int64_t kb = kblocks(k);
  uint8_t* out = reinterpret_cast<uint8_t*>(xp) + nb * kb * kBlockBytes;
  alignas(64) uint32_t pieces[2][16][8];           // per row of x: its 32 high, then low, bytes
  alignas(64) float sx[16], xs[16];
  const __m512 sign = _mm512_set1_ps(-0.f);
  for (int64_t b = 0; b < kb; ++b, out += kBlockBytes) {
    for (int n = 0; n < 16; ++n) {
      const int64_t row = nb * 16 + n;
      if (row >= m) {
        std::memset(pieces[0][n], 0, 32);
        std::memset(pieces[1][n], 0, 32);
        sx[n] = xs[n] = 0.f;
        continue;
      }
      const float* v = x + row * ldx + 32 * b;
      const __m512 a = _mm512_loadu_ps(v), c = _mm512_loadu_ps(v + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, a), _mm512_andnot_ps(sign, c)));
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? kRange / amax : 0.f);
      const __m512i na = split16(a, inv, pieces[0][n], pieces[1][n]);
      const __m512i nc = split16(c, inv, pieces[0][n] + 4, pieces[1][n] + 4);
      sx[n] = amax / kRange;
      xs[n] = sx[n] * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(na, nc)));
    }
    // the B layout: tile row g holds k 4g..4g+3 of each of the 16 rows of x, 4 bytes per row
    for (int piece = 0; piece < 2; ++piece) {
      uint32_t* tile = reinterpret_cast<uint32_t*>(out + piece * kHigh);
      for (int g = 0; g < 8; ++g)
        for (int n = 0; n < 16; ++n) tile[g * 16 + n] = pieces[piece][n][g];
    }
    std::memcpy(out + kScales, sx, sizeof sx);
    std::memcpy(out + kOffsets, xs, sizeof xs);
  }
}

// The tile products of one k block (w, x at it) into C tiles a, b (x's two pieces times the codes; High: tiles
// c, d the second pieces'), stored as int32 16 x 16 at t[0..1] (t[2..3]). (The tile intrinsics take their tile
// numbers as literal tokens: one function per set of tiles, written out by the macro.)
#define LLM_SERVING_INT_PRODUCTS(name, a, b, c, d)                           \
  template <bool High>                                                       \
  inline void name(const uint8_t* w, const uint8_t* x, int32_t (*t)[256]) {  \
    _tile_loadd(4, w, 32);                                                   \
    _tile_loadd(6, x, 64);                                                   \
    _tile_loadd(7, x + kHigh, 64);                                           \
    _tile_zero(a);                                                           \
    _tile_zero(b);                                                           \
    _tile_dpbssd(a, 4, 6);                                                   \
    _tile_dpbssd(b, 4, 7);                                                   \
    if (High) {                                                              \
      _tile_loadd(5, w + kHigh, 32);                                         \
      _tile_zero(c);                                                         \
      _tile_zero(d);                                                         \
      _tile_dpbssd(c, 5, 6);                                                 \
      _tile_dpbssd(d, 5, 7);                                                 \
    }                                                                        \
    _tile_stored(a, t[0], 64);                                               \
    _tile_stored(b, t[1], 64);                                               \
    if (High) {                                                              \
      _tile_stored(c, t[2], 64);                                             \
      _tile_stored(d, t[3], 64);                                             \
    }                                                                        \
  }
LLM_SERVING_INT_PRODUCTS(products, 0, 1, 2, 3)
LLM_SERVING_INT_PRODUCTS(products_other, 2, 3, 0, 1)      // (without High only: the other pair of C tiles)
#undef LLM_SERVING_INT_PRODUCTS

// acc[i] += the k block's sums (t) for weight row i, scaled: sw[i] sx (n . codes) + mw[i] xs
template <bool High>
inline void scale(const uint8_t* w, const uint8_t* x, const int32_t (*t)[256], __m512* acc) {
  const __m512 sx = _mm512_load_ps(reinterpret_cast<const float*>(x + kScales));
  const __m512 xs = _mm512_load_ps(reinterpret_cast<const float*>(x + kOffsets));
  const float* sw = reinterpret_cast<const float*>(w + kScales);
  const float* mw = reinterpret_cast<const float*>(w + kOffsets);
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) {
    const __m512i l = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(t[0] + 16 * i), 8),
                                       _mm512_load_si512(t[1] + 16 * i));
    __m512 v = _mm512_cvtepi32_ps(l);
    if (High) {
      const __m512i h = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(t[2] + 16 * i), 8),
                                         _mm512_load_si512(t[3] + 16 * i));
      v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(h), _mm512_set1_ps(64.f), v);
    }
    acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(v, sx), _mm512_set1_ps(sw[i]), acc[i]);
    acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(mw[i]), xs, acc[i]);
  }
}

// One 16 x 16 block of C (weight row block w, x row block x, each at its first k block) summed over nblocks k
// blocks: from zero (first) or from what C holds. High: the weights' second pieces are multiplied too. Without
// them the tile products of block b + 1 are issued (into the other pair of C tiles) before block b's sums are
// scaled, so that the tiles and the vector units work at once.
template <bool High>
inline void kernel(const uint8_t* w, const uint8_t* x, int64_t nblocks, float* c, int64_t ldc, bool first) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + i * ldc);
  alignas(64) int32_t t[4][256];
  if (High) {
    for (int64_t b = 0; b < nblocks; ++b, w += kBlockBytes, x += kBlockBytes) {
      products<true>(w, x, t);
      scale<true>(w, x, t, acc);
    }
  } else {
    products<false>(w, x, t);
    for (int64_t b = 0; b < nblocks; ++b, w += kBlockBytes, x += kBlockBytes) {
      if (b + 1 < nblocks) {
        if (b % 2 == 0) products_other<false>(w + kBlockBytes, x + kBlockBytes, t + 2);
        else products<false>(w + kBlockBytes, x + kBlockBytes, t);
      }
      scale<false>(w, x, t + (b % 2) * 2, acc);
    }
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(c + i * ldc, acc[i]);
}

// Blocking as gemm_amx.h's product(): a depth block of the group's rows and a slab of x rows stay in L2 while
// every (row block, x block) pair runs along it.
constexpr int64_t kDepthBlocks = 64;
constexpr int64_t kSlabBlocks = 4;

// C (g rows, c_stride(m)) = the group's converted rows (wg: group_floats(g, k)) times the packed x (m rows).
// high: some row of the group has second pieces (the others' are zero). The caller holds Tiles.
inline void product(const float* wg, int64_t g, bool high, const float* xp, int64_t m, int64_t k, float* c) {
  const int64_t kb = kblocks(k), mb = rows16(m) / 16, gb = rows16(g) / 16, ldc = c_stride(m);
  const uint8_t* w = reinterpret_cast<const uint8_t*>(wg);
  const uint8_t* x = reinterpret_cast<const uint8_t*>(xp);
  for (int64_t b0 = 0; b0 < kb; b0 += kDepthBlocks) {
    const int64_t b1 = std::min(kb, b0 + kDepthBlocks);
    for (int64_t s0 = 0; s0 < mb; s0 += kSlabBlocks) {
      const int64_t s1 = std::min(mb, s0 + kSlabBlocks);
      for (int64_t r = 0; r < gb; ++r) {
        for (int64_t n = s0; n < s1; ++n) {
          const uint8_t *wr = w + (r * kb + b0) * kBlockBytes, *xn = x + (n * kb + b0) * kBlockBytes;
          float* cc = c + 16 * r * ldc + 16 * n;
          if (high) kernel<true>(wr, xn, b1 - b0, cc, ldc, b0 == 0);
          else kernel<false>(wr, xn, b1 - b0, cc, ldc, b0 == 0);
        }
      }
    }
  }
}

// ---- The K-quants a super-block at a time
//
// A K-quant row's 256-weight super-block has one float scale d (and dmin) and small integer sub-block scales, so
// its weights are d times integers: v = sc q (Q4_K: <= 945, Q5_K: <= 1953, minus dmin m[j] per 32) or v = sc (q -
// 32) (Q6_K: |v| <= 4096). With x quantized per super-block too (16 bits, one scale sx per 256), the integer sums
// of a whole super-block share one scale d sx: the tiles sum 64-deep products (TDPBSSD's full depth) over all
// four 64-weight chunks into int32 before anything is scaled, a quarter of the per-block path's instructions per
// weight and an eighth of its scaling. v is split into int8 pieces, v = f vh + vl (Q4_K/Q5_K: f = 128, vl in
// [0, 127]; Q6_K: f = 64, vl in [-32, 31]), and n = 256 nh + nl as before: four products (tiles 0..3: vh nh, vh
// nl, vl nh, vl nl), recombined per row (f per row: one group can hold Q4_K and Q6_K rows). The minimums'
// term, -dmin m[j] times the sum of x over sub-block j, is 8 multiply-adds per row and super-block (xs[j] = sx
// times that sum).
//
// Per (16-row block, super-block): weights [chunk 0: vl tile (16 rows x 64 int8), vh tile][chunk 1] .. [chunk 3]
// then d[16], f[16], mw[16][8] floats (row i's minimums' weights, 8 per row); x [chunk 0: nh tile (B layout: 16 rows of 4-byte groups x 16 rows of x),
// nl tile] .. [chunk 3], then sx[16], xs[8][16] floats.
constexpr int64_t kSuperTiles = 8192;
constexpr int64_t kSuperWeightBytes = kSuperTiles + 10 * 64;
constexpr int64_t kSuperXBytes = kSuperTiles + 9 * 64;
constexpr int64_t kSuperD = kSuperTiles, kSuperF = kSuperTiles + 64, kSuperMins = kSuperTiles + 128;
constexpr int64_t kSuperSx = kSuperTiles, kSuperXs = kSuperTiles + 64;

inline int64_t supers(int64_t k) { return k / 256; }
inline int64_t super_packed_floats(int64_t m, int64_t k) { return rows16(m) / 16 * supers(k) * kSuperXBytes / 4; }
inline int64_t super_group_floats(int64_t g, int64_t k) {
  return rows16(g) / 16 * supers(k) * kSuperWeightBytes / 4;
}

// Packs the block of x rows nb (k a multiple of 256) into xp (super_packed_floats(m, k)); rows past m are zeros.
inline void super_pack_block(const float* x, int64_t ldx, int64_t m, int64_t k, int64_t nb, float* xp) {
  const int64_t ns = supers(k);
  uint8_t* out = reinterpret_cast<uint8_t*>(xp) + nb * ns * kSuperXBytes;
  alignas(64) uint32_t pieces[2][16][64];          // per row of x: its 256 high, then low, bytes
  alignas(64) float sx[16], xs[8][16];
  const __m512 sign = _mm512_set1_ps(-0.f);
  for (int64_t sb = 0; sb < ns; ++sb, out += kSuperXBytes) {
    for (int r = 0; r < 16; ++r) {
      const int64_t row = nb * 16 + r;
      if (row >= m) {
        std::memset(pieces[0][r], 0, 256);
        std::memset(pieces[1][r], 0, 256);
        sx[r] = 0.f;
        for (int j = 0; j < 8; ++j) xs[j][r] = 0.f;
        continue;
      }
      const float* v = x + row * ldx + 256 * sb;
      __m512 mx = _mm512_setzero_ps();
      for (int e = 0; e < 256; e += 16) mx = _mm512_max_ps(mx, _mm512_andnot_ps(sign, _mm512_loadu_ps(v + e)));
      const float amax = _mm512_reduce_max_ps(mx);
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? kRange / amax : 0.f);
      sx[r] = amax / kRange;
      uint8_t* hi = reinterpret_cast<uint8_t*>(pieces[0][r]);
      uint8_t* lo = reinterpret_cast<uint8_t*>(pieces[1][r]);
      for (int j = 0; j < 8; ++j) {
        __m512i sum = _mm512_setzero_si512();
        for (int e = 32 * j; e < 32 * j + 32; e += 16) sum = _mm512_add_epi32(sum, split16(_mm512_loadu_ps(v + e), inv, hi + e, lo + e));
        xs[j][r] = sx[r] * static_cast<float>(_mm512_reduce_add_epi32(sum));
      }
    }
    // chunk c's B tiles: row g holds k 64c + 4g .. 64c + 4g + 3 of each of the 16 rows of x
    for (int c = 0; c < 4; ++c)
      for (int piece = 0; piece < 2; ++piece) {
        uint32_t* tile = reinterpret_cast<uint32_t*>(out + (2 * c + piece) * 1024);
        for (int g = 0; g < 16; ++g)
          for (int r = 0; r < 16; ++r) tile[g * 16 + r] = pieces[piece][r][16 * c + g];
      }
    std::memcpy(out + kSuperSx, sx, sizeof sx);
    std::memcpy(out + kSuperXs, xs, sizeof xs);
  }
}

// The tile products of one super-block (w, x at it): the four int32 sums, stored at t.
inline void super_products(const uint8_t* w, const uint8_t* x, int32_t (*t)[256]) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int ch = 0; ch < 4; ++ch) {
    _tile_loadd(4, w + 2048 * ch, 64);               // vl
    _tile_loadd(5, w + 2048 * ch + 1024, 64);        // vh
    _tile_loadd(6, x + 2048 * ch, 64);               // nh
    _tile_loadd(7, x + 2048 * ch + 1024, 64);        // nl
    _tile_dpbssd(0, 5, 6);
    _tile_dpbssd(1, 5, 7);
    _tile_dpbssd(2, 4, 6);
    _tile_dpbssd(3, 4, 7);
  }
  _tile_stored(0, t[0], 64);
  _tile_stored(1, t[1], 64);
  _tile_stored(2, t[2], 64);
  _tile_stored(3, t[3], 64);
}

// acc[i] += weight row i's part of the super-block's sums t, scaled
inline void super_scale(const uint8_t* w, const uint8_t* x, const int32_t (*t)[256], __m512* acc) {
  const __m512 sx = _mm512_load_ps(reinterpret_cast<const float*>(x + kSuperSx));
  const float* xs = reinterpret_cast<const float*>(x + kSuperXs);
  const float* d = reinterpret_cast<const float*>(w + kSuperD);
  const float* f = reinterpret_cast<const float*>(w + kSuperF);
  const float* mw = reinterpret_cast<const float*>(w + kSuperMins);
#pragma GCC unroll 4
  for (int i = 0; i < 16; ++i) {
    const __m512i hv = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(t[0] + 16 * i), 8),
                                        _mm512_load_si512(t[1] + 16 * i));
    const __m512i lv = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(t[2] + 16 * i), 8),
                                        _mm512_load_si512(t[3] + 16 * i));
    const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hv), _mm512_set1_ps(f[i]), _mm512_cvtepi32_ps(lv));
    __m512 a = _mm512_fmadd_ps(_mm512_mul_ps(v, sx), _mm512_set1_ps(d[i]), acc[i]);
    for (int j = 0; j < 8; ++j) a = _mm512_fmadd_ps(_mm512_set1_ps(mw[8 * i + j]), _mm512_load_ps(xs + 16 * j), a);
    acc[i] = a;
  }
}

// One 16 x 16 block of C (weight row block w, x row block x, each at its first super-block) over ns
// super-blocks: from zero (first) or from what C holds. The products of super-block s + 1 are issued before
// super-block s's sums are scaled (into the other half of t), so that the tiles and the vector units overlap.
inline void super_kernel(const uint8_t* w, const uint8_t* x, int64_t ns, float* c, int64_t ldc, bool first) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + i * ldc);
  alignas(64) int32_t t[2][4][256];
  super_products(w, x, t[0]);
  for (int64_t sb = 0; sb < ns; ++sb, w += kSuperWeightBytes, x += kSuperXBytes) {
    if (sb + 1 < ns) super_products(w + kSuperWeightBytes, x + kSuperXBytes, t[(sb + 1) % 2]);
    super_scale(w, x, t[sb % 2], acc);
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(c + i * ldc, acc[i]);
}

// C (g rows, c_stride(m)) = the group's converted rows (wg: super_group_floats(g, k)) times the packed x (m rows),
// blocked as product(): 8 super-blocks (2048 of depth, 70 KB of a row block) by a slab of 4 blocks of x rows.
// The caller holds SuperTiles.
constexpr int64_t kSuperDepth = 8;
inline void super_product(const float* wg, int64_t g, const float* xp, int64_t m, int64_t k, float* c) {
  const int64_t ns = supers(k), mb = rows16(m) / 16, gb = rows16(g) / 16, ldc = c_stride(m);
  const uint8_t* w = reinterpret_cast<const uint8_t*>(wg);
  const uint8_t* x = reinterpret_cast<const uint8_t*>(xp);
  for (int64_t s0 = 0; s0 < ns; s0 += kSuperDepth) {
    const int64_t s1 = std::min(ns, s0 + kSuperDepth);
    for (int64_t n0 = 0; n0 < mb; n0 += kSlabBlocks) {
      const int64_t n1 = std::min(mb, n0 + kSlabBlocks);
      for (int64_t r = 0; r < gb; ++r)
        for (int64_t n = n0; n < n1; ++n)
          super_kernel(w + (r * ns + s0) * kSuperWeightBytes, x + (n * ns + s0) * kSuperXBytes, s1 - s0,
                       c + 16 * r * ldc + 16 * n, ldc, s0 == 0);
    }
  }
}

}  // namespace amx_int
}  // namespace llm_serving

#endif
