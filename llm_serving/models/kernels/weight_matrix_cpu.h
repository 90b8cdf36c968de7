// A weight matrix as the kernels read it (Matrix: its rows dequantized, or split into AMX's operands straight
// from the decoders), and the products for few rows of x: qdot (blocks decoded in registers per use) and matvec
// (a dequantized tile of 4 rows against every row of x).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "gemm_amx.h"
#include "gemm_amx_int.h"
#include "float_products_cpu.h"
#include "weight_formats_cpu.h"

namespace {

// (GCC deletes a loop of nothing but __builtin_prefetch; an asm statement it keeps)
inline void prefetch_line(const uint8_t* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht0 %0" : : "m"(*p));
#else
  __builtin_prefetch(p);
#endif
}

// The decoders (qdot, dequantize_row) ask for the bytes they will read next as they go: the same columns of the
// row a tile (4 rows) on, a line or so per block, so memory is read while blocks are decoded rather than in
// turn with it. On a stream of 1.5 GB of rows, one thread, one row of x: Q4_K 7.3 -> 9.8 GB/s in registers,
// 6.3 -> 10.7 dequantized (Q4_0 3.9 -> 9.6); into L2 (prefetcht1), a little faster than into L1.
constexpr int64_t kAheadRows = 4;
inline void prefetch_ahead(const uint8_t* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht1 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// A weight matrix as the kernels read it: `rows` rows of k weights of `type`, row_bytes bytes each.
struct Matrix {
  const uint8_t* data;
  int32_t type;
  int64_t rows, k, row_bytes;

  // Rows [r, r + n) are about to be read: nothing to do now, kept for the products that say so. The decoders
  // prefetch a tile ahead themselves, spread over the blocks (prefetch_ahead); this used to ask for the whole
  // tile at once, which on top of that made a stream of Q4_K rows slower (9.4 -> 6.8 GB/s in registers, 10.7 ->
  // 8.7 dequantized, one thread), and was worth less than the spread requests alone. Float32 rows are left to
  // the hardware prefetchers.
  void prefetch(int64_t r, int64_t n) const {
    (void)r;
    (void)n;
  }

  // Rows [r, r + n) as float32, n <= 4: float32 rows are read in place, others dequantized into tile (n*k).
  const float* tile_rows(int64_t r, int64_t n, float* tile) const {
    if (type == kF32) return reinterpret_cast<const float*>(data) + r * k;
    for (int64_t i = 0; i < n; ++i) dequantize_row(data + (r + i) * row_bytes, tile + i * k);
    return tile;
  }

  // Not inlined: one compiled copy, so a weight's float is the same whichever product asked for it.
  __attribute__((noinline)) void dequantize_row(const uint8_t* row, float* dst) const {
    switch (type) {
      case kQ4_0: dequantize_blocks<kQ4_0>(row, dst); break;
      case kQ4_1: dequantize_blocks<kQ4_1>(row, dst); break;
      case kQ5_0: dequantize_blocks<kQ5_0>(row, dst); break;
      case kQ5_1: dequantize_blocks<kQ5_1>(row, dst); break;
      case kQ8_0: dequantize_blocks<kQ8_0>(row, dst); break;
      case kQ4_K: dequantize_super<kQ4_K>(row, dst); break;
      case kQ5_K: dequantize_super<kQ5_K>(row, dst); break;
      case kQ6_K: dequantize_super<kQ6_K>(row, dst); break;
      case kMXFP4: dequantize_blocks<kMXFP4>(row, dst); break;
      case kF16: dequantize_blocks<kF16>(row, dst); break;
      case kBF16: dequantize_blocks<kBF16>(row, dst); break;
      default: break;                                                  // refused before any call
    }
  }

#if defined(LLM_SERVING_AMX)
  // k blocks [b0, b1) of a row (b0, b1 multiples of 8 or b1 the row's last), split into their bfloat16 pieces
  // (gemm_amx.h) straight from the decoders' registers: k block b's 32 values at out + (b - b0) * 3 tiles.
  // Float32 rows (and F16/BF16 rows of k not a multiple of 32) read the floats; k past the row reads as zero.
  void split_slice(const uint8_t* row, int64_t b0, int64_t b1, float* scratch, uint16_t* out) const {
    namespace amx = llm_serving::amx;
    switch (type) {
      case kQ4_0: split_blocks<kQ4_0>(row, b0, b1, out); return;
      case kQ4_1: split_blocks<kQ4_1>(row, b0, b1, out); return;
      case kQ5_0: split_blocks<kQ5_0>(row, b0, b1, out); return;
      case kQ5_1: split_blocks<kQ5_1>(row, b0, b1, out); return;
      case kQ8_0: split_blocks<kQ8_0>(row, b0, b1, out); return;
      case kQ4_K: split_super<kQ4_K>(row, b0, b1, out); return;
      case kQ5_K: split_super<kQ5_K>(row, b0, b1, out); return;
      case kQ6_K: split_super<kQ6_K>(row, b0, b1, out); return;
      case kF16:
        if (k % 32 == 0) { split_blocks<kF16>(row, b0, b1, out); return; }
        break;
      case kBF16:
        if (k % 32 == 0) { split_blocks<kBF16>(row, b0, b1, out); return; }
        break;
      default: break;
    }
    const float* v = reinterpret_cast<const float*>(row);
    if (type != kF32) {                                  // F16/BF16 of a ragged k: the whole row, then the slice
      dequantize_row(row, scratch);
      v = scratch;
    }
    for (int64_t b = b0; b < b1; ++b) amx::split32(v + 32 * b, k - 32 * b, out + (b - b0) * amx::kPieces * amx::kTile, amx::kTile);
  }

  template <int32_t T>
  void split_blocks(const uint8_t* row, int64_t b0, int64_t b1, uint16_t* out) const {
    namespace amx = llm_serving::amx;
    row += b0 * block_bytes<T>();
    for (int64_t b = b0; b < b1; ++b, row += block_bytes<T>(), out += amx::kPieces * amx::kTile) {
      v16 lo, hi;
      prefetch_ahead(row + kAheadRows * row_bytes);
      decode_block<T>(row, &lo, &hi);
      amx::split_regs((__m512)lo, (__m512)hi, out, amx::kTile);
    }
  }

  template <int32_t T>
  void split_super(const uint8_t* row, int64_t b0, int64_t b1, uint16_t* out) const {
    namespace amx = llm_serving::amx;
    constexpr int G = group_weights<T>();
    for (int64_t e = b0 * 32; e < b1 * 32; e += 256) {
      const uint8_t* p = row + e / 256 * super_bytes<T>();
      SuperScales u;
      for (int64_t at = 0; at < super_bytes<T>(); at += 64) prefetch_ahead(p + kAheadRows * row_bytes + at);
      unpack_scales<T>(p, &u);
      for (int g = 0; g < 256 / G; ++g) {
        v16 w[G / 16];
        decode_group<T>(p, u, g, w);
        for (int v = 0; v < G / 16; v += 2, out += amx::kPieces * amx::kTile)
          amx::split_regs((__m512)w[v], (__m512)w[v + 1], out, amx::kTile);
      }
    }
  }
#endif

#if defined(LLM_SERVING_AMX_INT)
  // Whether the integer products (gemm_amx_int.h) read this type: the blocks of 32 and the K-quants, as stored
  // (rows repacked into gemm_avx2_int.h's panels are that library's alone).
  bool integer_codes() const {
    return type != kF32 && type != kF16 && type != kBF16 && type != kMXFP4 && !repacked(type);
  }

  // A row's blocks as gemm_amx_int.h's A operand: row r (< 16) of the row block at dst (its first k block;
  // blocks kBlockBytes apart): per block of 32 its int8 codes, the second pieces (Q6_K; zeros for other types
  // when high), the scale and the offset.
  void int_row(const uint8_t* row, uint8_t* dst, int r, bool high) const {
    switch (type) {
      case kQ4_0: int_blocks<kQ4_0>(row, dst, r, high); return;
      case kQ4_1: int_blocks<kQ4_1>(row, dst, r, high); return;
      case kQ5_0: int_blocks<kQ5_0>(row, dst, r, high); return;
      case kQ5_1: int_blocks<kQ5_1>(row, dst, r, high); return;
      case kQ8_0: int_blocks<kQ8_0>(row, dst, r, high); return;
      case kQ4_K: int_super<kQ4_K>(row, dst, r, high); return;
      case kQ5_K: int_super<kQ5_K>(row, dst, r, high); return;
      case kQ6_K: int_super<kQ6_K>(row, dst, r, high); return;
      default: return;                                   // not integer_codes(): never called
    }
  }

  // Q6_K sub-block j (32 weights, 0..7) of the super-block at p as its codes times their 8-bit scales, v = sc (q -
  // 32) (|v| <= 4096), split into two exact int8 pieces v = 64 hi + lo, lo in [-32, 31]
  static void q6k_pieces(const uint8_t* p, int j, __m256i* lo, __m256i* hi) {
    const __m256i nibble = _mm256_set1_epi8(15);
    const int g = j / 4, i = j % 4;                      // its half of 128 weights, and its place there
    const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * g + 32 * (i & 1)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * g));
    const __m256i low = i < 2 ? _mm256_and_si256(ql, nibble) : _mm256_and_si256(_mm256_srli_epi16(ql, 4), nibble);
    const __m256i top = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * i), _mm256_set1_epi8(3));
    const __m256i code = _mm256_or_si256(low, _mm256_slli_epi16(top, 4));       // 0..63 (no carries)
    const __m512i sc = _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int8_t>(p[192 + 2 * j])),
                                          _mm256_set1_epi16(static_cast<int8_t>(p[192 + 2 * j + 1])), 1);
    const __m512i bias = _mm512_set1_epi16(32);
    const __m512i v = _mm512_mullo_epi16(_mm512_sub_epi16(_mm512_cvtepu8_epi16(code), bias), sc);
    const __m512i h = _mm512_srai_epi16(_mm512_add_epi16(v, bias), 6);
    *lo = _mm512_cvtepi16_epi8(_mm512_sub_epi16(v, _mm512_slli_epi16(h, 6)));
    *hi = _mm512_cvtepi16_epi8(h);
  }

  // Whether the super-block products read this type (the K-quants).
  bool super_codes() const { return type == kQ4_K || type == kQ5_K || type == kQ6_K; }

  // A K-quant row as gemm_amx_int.h's super-block A operand: row r (< 16) of the row block at dst (its first
  // super-block; super-blocks kSuperWeightBytes apart).
  void super_row(const uint8_t* row, uint8_t* dst, int r) const {
    namespace ai = llm_serving::amx_int;
    const __m256i nibble = _mm256_set1_epi8(15);
    const int64_t super = row_bytes / (k / 256);         // bytes of a super-block
    const ProductTables& tables = product_tables();
    for (int64_t e = 0; e < k; e += 256, row += super, dst += ai::kSuperWeightBytes) {
      for (int64_t at = 0; at < super; at += 64) prefetch_ahead(row + kAheadRows * row_bytes + at);
      float* d = reinterpret_cast<float*>(dst + ai::kSuperD);
      float* f = reinterpret_cast<float*>(dst + ai::kSuperF);
      float* mw = reinterpret_cast<float*>(dst + ai::kSuperMins);
      if (type == kQ6_K) {
        d[r] = half_to_float(row + 208);
        f[r] = 64.f;
        _mm256_storeu_ps(mw + 8 * r, _mm256_setzero_ps());
        for (int j = 0; j < 8; ++j) {                    // sub-block j: half of its chunk's A tiles' row r
          __m256i lo, hi;
          q6k_pieces(row, j, &lo, &hi);
          uint8_t* tile = dst + 2048 * (j / 2) + 64 * r + 32 * (j % 2);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(tile), lo);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(tile + 1024), hi);
        }
        continue;
      }
      // Q4_K / Q5_K: the 6-bit sub-block scales sc[j] and minimums m[j] (bytes 0..7 and 8..15 of six_bits)
      alignas(16) uint8_t six[16];
      _mm_store_si128(reinterpret_cast<__m128i*>(six), six_bits(row));
      d[r] = half_to_float(row);
      f[r] = 128.f;
      _mm256_storeu_ps(mw + 8 * r, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                                                     reinterpret_cast<const __m128i*>(six + 8)))),
                                                 _mm256_set1_ps(-half_to_float(row + 2))));
      // a chunk of 64 weights (sub-blocks 2c, 2c + 1: the low and high nibbles of the same 32 bytes) at a time:
      // their codes index the two sub-blocks' rows of the split products' tables (byte permutes, no multiplies)
      const __m256i qh = type == kQ5_K ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16)) : _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + (type == kQ4_K ? 16 : 48) + 32 * c));
        __m256i low = _mm256_and_si256(b, nibble), high = _mm256_and_si256(_mm256_srli_epi16(b, 4), nibble);
        if (type == kQ5_K) {
          const __m256i sixteen = _mm256_set1_epi8(16);
          low = _mm256_mask_add_epi8(low, _mm256_test_epi8_mask(qh, _mm256_set1_epi8(static_cast<char>(1 << (2 * c)))), low, sixteen);
          high = _mm256_mask_add_epi8(high, _mm256_test_epi8_mask(qh, _mm256_set1_epi8(static_cast<char>(2 << (2 * c)))), high, sixteen);
        }
        // index: the code, plus 32 for the second sub-block (the upper half of the 64-byte tables)
        const __m512i index = _mm512_inserti64x4(_mm512_castsi256_si512(low), _mm256_add_epi8(high, _mm256_set1_epi8(32)), 1);
        const uint8_t s0 = six[2 * c], s1 = six[2 * c + 1];
        const __m512i lo_table = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256(reinterpret_cast<const __m256i*>(tables.lo[s0]))),
                                                    _mm256_load_si256(reinterpret_cast<const __m256i*>(tables.lo[s1])), 1);
        const __m512i hi_table = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256(reinterpret_cast<const __m256i*>(tables.hi[s0]))),
                                                    _mm256_load_si256(reinterpret_cast<const __m256i*>(tables.hi[s1])), 1);
        uint8_t* tile = dst + 2048 * c + 64 * r;
        _mm512_storeu_si512(tile, _mm512_permutexvar_epi8(index, lo_table));
        _mm512_storeu_si512(tile + 1024, _mm512_permutexvar_epi8(index, hi_table));
      }
    }
  }

  // The pieces of v = sc q (Q4_K/Q5_K: sc < 64, q < 32) for every scale and code: lo[sc][q] = v mod 128,
  // hi[sc][q] = v / 128.
  struct ProductTables {
    alignas(64) uint8_t lo[64][32];
    alignas(64) uint8_t hi[64][32];
    ProductTables() {
      for (int sc = 0; sc < 64; ++sc)
        for (int q = 0; q < 32; ++q) {
          lo[sc][q] = static_cast<uint8_t>(sc * q % 128);
          hi[sc][q] = static_cast<uint8_t>(sc * q / 128);
        }
    }
  };
  static const ProductTables& product_tables() {
    static const ProductTables tables;
    return tables;
  }

  static void put_int(uint8_t* dst, int r, __m256i lo, const __m256i* hi, float sw, float mw) {
    namespace ai = llm_serving::amx_int;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32 * r), lo);
    if (hi != nullptr) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + ai::kHigh + 32 * r), *hi);
    reinterpret_cast<float*>(dst + ai::kScales)[r] = sw;
    reinterpret_cast<float*>(dst + ai::kOffsets)[r] = mw;
  }

  // the 16 bytes at p as 32 codes: the low nibbles (weights 0..15), then the high ones (16..31)
  static __m256i nibbles32(const uint8_t* p) {
    const __m128i v = load_bytes16(p), mask = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
  }

  template <int32_t T>
  void int_blocks(const uint8_t* row, uint8_t* dst, int r, bool high) const {
    const __m256i zero = _mm256_setzero_si256();
    for (int64_t e = 0; e < k; e += 32, row += block_bytes<T>(), dst += llm_serving::amx_int::kBlockBytes) {
      prefetch_ahead(row + kAheadRows * row_bytes);
      const float d = half_to_float(row);
      __m256i q;
      float m = 0.f;
      if constexpr (T == kQ8_0) {
        q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2));
      } else if constexpr (T == kQ4_0 || T == kQ4_1) {
        q = nibbles32(row + (T == kQ4_0 ? 2 : 4));
        if constexpr (T == kQ4_0) q = _mm256_sub_epi8(q, _mm256_set1_epi8(8));
        else m = half_to_float(row + 2);
      } else {                                           // Q5_0 / Q5_1: the fifth bit of weight i is bit i
        constexpr bool with_min = T == kQ5_1;
        uint32_t qh;
        std::memcpy(&qh, row + (with_min ? 4 : 2), 4);
        q = nibbles32(row + (with_min ? 8 : 6));
        q = _mm256_mask_add_epi8(q, static_cast<__mmask32>(qh), q, _mm256_set1_epi8(16));
        if constexpr (with_min) m = half_to_float(row + 2);
        else q = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
      }
      put_int(dst, r, q, high ? &zero : nullptr, d, m);
    }
  }

  template <int32_t T>
  void int_super(const uint8_t* row, uint8_t* dst, int r, bool high) const {
    namespace ai = llm_serving::amx_int;
    const __m256i zero = _mm256_setzero_si256(), nibble = _mm256_set1_epi8(15);
    for (int64_t e = 0; e < k; e += 256, row += super_bytes<T>()) {
      for (int64_t at = 0; at < super_bytes<T>(); at += 64) prefetch_ahead(row + kAheadRows * row_bytes + at);
      if constexpr (T == kQ6_K) {
        const float d = half_to_float(row + 208);
        for (int j = 0; j < 8; ++j, dst += ai::kBlockBytes) {
          __m256i lo, hi;
          q6k_pieces(row, j, &lo, &hi);
          put_int(dst, r, lo, high ? &hi : nullptr, d, 0.f);
        }
      } else {
        SuperScales u;
        unpack_scales<T>(row, &u);
        const __m256i qh = T == kQ5_K ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16)) : zero;
        for (int j = 0; j < 8; ++j, dst += ai::kBlockBytes) {
          const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + (T == kQ4_K ? 16 : 48) + 32 * (j / 2)));
          __m256i q = j % 2 == 0 ? _mm256_and_si256(b, nibble) : _mm256_and_si256(_mm256_srli_epi16(b, 4), nibble);
          if constexpr (T == kQ5_K)
            q = _mm256_mask_add_epi8(q, _mm256_test_epi8_mask(qh, _mm256_set1_epi8(static_cast<char>(1 << j))), q,
                                     _mm256_set1_epi8(16));
          put_int(dst, r, q, high ? &zero : nullptr, u.s[j], -u.s[8 + j]);
        }
      }
    }
  }
#endif

  template <int32_t T>
  void dequantize_blocks(const uint8_t* row, float* dst) const {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__F16C__)
    if constexpr (T == kQ8_0 || T == kF16) {        // AVX2: 8 floats at a time straight into dst, the values
      for (int64_t e = 0; e < k; e += 32, row += block_bytes<T>(), dst += 32) {   // decode_block's (through
        prefetch_ahead(row + kAheadRows * row_bytes);                           // v16s they spilled: a 1-row
        if constexpr (T == kQ8_0) {                                             // Q8_0 layer ran 3.7x slower)
          const __m256 d = _mm256_set1_ps(half_to_float(row));
          for (int j = 0; j < 4; ++j) {
            const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 2 + 8 * j));
            _mm256_storeu_ps(dst + 8 * j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d));
          }
        } else {
          for (int j = 0; j < 4; ++j)
            _mm256_storeu_ps(dst + 8 * j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * j))));
        }
      }
      return;
    }
#endif
    for (int64_t e = 0; e < k; e += 32, row += block_bytes<T>(), dst += 32) {
      v16 lo, hi;
      prefetch_ahead(row + kAheadRows * row_bytes);
      decode_block<T>(row, &lo, &hi);
      store16(dst, lo);
      store16(dst + 16, hi);
    }
  }

  template <int32_t T>
  void dequantize_super(const uint8_t* row, float* dst) const {
    constexpr int G = group_weights<T>();
    for (int64_t e = 0; e < k; e += 256, row += super_bytes<T>()) {
      SuperScales u;
      for (int64_t at = 0; at < super_bytes<T>(); at += 64) prefetch_ahead(row + kAheadRows * row_bytes + at);
      unpack_scales<T>(row, &u);
      for (int g = 0; g < 256 / G; ++g, dst += G) {
        v16 w[G / 16];
        decode_group<T>(row, u, g, w);
        for (int v = 0; v < G / 16; ++v) store16(dst + 16 * v, w[v]);
      }
    }
  }
};

// out[r][b] = w[r] . x[b] for RB consecutive quantized rows from `rows` (row_bytes apart) and BB rows of x
// (stride ldx), each block decoded in registers and used at once: for a few rows of x, cheaper than
// dequantizing the tile to memory and reading it back.
template <int32_t T, int RB, int BB>
inline void qdot_tile(const uint8_t* rows, int64_t row_bytes, int64_t k, const float* x, int64_t ldx,
                      float out[4][4]) {
  v16 acc[RB][BB];
  for (int r = 0; r < RB; ++r)
    for (int b = 0; b < BB; ++b) acc[r][b] = v16{};
  const uint8_t* blk = rows;
  for (int64_t e = 0; e < k; e += 32, blk += block_bytes<T>()) {
    v16 x0[BB], x1[BB];
    for (int b = 0; b < BB; ++b) {
      x0[b] = load16(x + b * ldx + e);
      x1[b] = load16(x + b * ldx + e + 16);
    }
    for (int r = 0; r < RB; ++r) {
      v16 lo, hi;
      prefetch_ahead(blk + (r + kAheadRows) * row_bytes);
      decode_block<T>(blk + r * row_bytes, &lo, &hi);
      for (int b = 0; b < BB; ++b) acc[r][b] = fmadd16(hi, x1[b], fmadd16(lo, x0[b], acc[r][b]));
    }
  }
  sum_lanes<RB, BB>(acc, out);
}

// qdot_tile for super-block rows: each row's scales unpacked once per super-block, its groups decoded in
// registers. One row of x gets two accumulators per weight row, so that consecutive multiply-adds do not wait
// on each other.
template <int32_t T, int RB, int BB>
inline void qdot_tile_super(const uint8_t* rows, int64_t row_bytes, int64_t k, const float* x, int64_t ldx,
                            float out[4][4]) {
  constexpr int G = group_weights<T>(), NV = G / 16, NA = BB == 1 ? 4 : BB == 2 ? 2 : 1;
  v16 acc[NA][RB][BB];
  for (int a = 0; a < NA; ++a)
    for (int r = 0; r < RB; ++r)
      for (int b = 0; b < BB; ++b) acc[a][r][b] = v16{};
  for (int64_t e = 0, off = 0; e < k; e += 256, off += super_bytes<T>()) {
    SuperScales u[RB];
    for (int r = 0; r < RB; ++r) {
      const uint8_t* ahead = rows + (r + kAheadRows) * row_bytes + off;
      for (int64_t at = 0; at < super_bytes<T>(); at += 64) prefetch_ahead(ahead + at);
      unpack_scales<T>(rows + r * row_bytes + off, &u[r]);
    }
#pragma GCC unroll 4
    for (int g = 0; g < 256 / G; ++g) {
      const float* xg = x + e + g * G;
#pragma GCC unroll 4
      for (int r = 0; r < RB; ++r) {
        v16 w[NV];
        decode_group<T>(rows + r * row_bytes + off, u[r], g, w);
        for (int v = 0; v < NV; ++v)
          for (int b = 0; b < BB; ++b)
            acc[v % NA][r][b] = fmadd16(w[v], load16(xg + b * ldx + 16 * v), acc[v % NA][r][b]);
      }
    }
  }
  for (int a = 1; a < NA; ++a)
    for (int r = 0; r < RB; ++r)
      for (int b = 0; b < BB; ++b) acc[0][r][b] += acc[a][r][b];
  sum_lanes<RB, BB>(acc[0], out);
}

template <int32_t T, int RB>
inline void qdot_rows(const uint8_t* rows, int64_t row_bytes, int64_t k, const float* x, int64_t ldx, int bb,
                      float out[4][4]) {
  if constexpr (is_super<T>()) {
    switch (bb) {
      case 1: qdot_tile_super<T, RB, 1>(rows, row_bytes, k, x, ldx, out); break;
      case 2: qdot_tile_super<T, RB, 2>(rows, row_bytes, k, x, ldx, out); break;
      case 3: qdot_tile_super<T, RB, 3>(rows, row_bytes, k, x, ldx, out); break;
      default: qdot_tile_super<T, RB, 4>(rows, row_bytes, k, x, ldx, out); break;
    }
  } else {
    switch (bb) {
      case 1: qdot_tile<T, RB, 1>(rows, row_bytes, k, x, ldx, out); break;
      case 2: qdot_tile<T, RB, 2>(rows, row_bytes, k, x, ldx, out); break;
      case 3: qdot_tile<T, RB, 3>(rows, row_bytes, k, x, ldx, out); break;
      default: qdot_tile<T, RB, 4>(rows, row_bytes, k, x, ldx, out); break;
    }
  }
}

// out[i][b] = w[r + i] . x[b0 + b] for i < rb (<= 4) and b < bb (<= 4), straight from quantized rows
template <int32_t T>
inline void qdot_typed(const Matrix& w, int64_t r, int rb, const float* x, int bb, float out[4][4]) {
  const uint8_t* rows = w.data + r * w.row_bytes;
  if (rb == 4) {
    qdot_rows<T, 4>(rows, w.row_bytes, w.k, x, w.k, bb, out);
  } else {
    for (int i = 0; i < rb; ++i) qdot_rows<T, 1>(rows + i * w.row_bytes, w.row_bytes, w.k, x, w.k, bb, out + i);
  }
}

inline void qdot(const Matrix& w, int64_t r, int rb, const float* x, int bb, float out[4][4]) {
  switch (w.type) {
    case kQ4_0: qdot_typed<kQ4_0>(w, r, rb, x, bb, out); break;
    case kQ4_1: qdot_typed<kQ4_1>(w, r, rb, x, bb, out); break;
    case kQ5_0: qdot_typed<kQ5_0>(w, r, rb, x, bb, out); break;
    case kQ5_1: qdot_typed<kQ5_1>(w, r, rb, x, bb, out); break;
    case kQ8_0: qdot_typed<kQ8_0>(w, r, rb, x, bb, out); break;
    case kQ4_K: qdot_typed<kQ4_K>(w, r, rb, x, bb, out); break;
    case kQ5_K: qdot_typed<kQ5_K>(w, r, rb, x, bb, out); break;
    case kQ6_K: qdot_typed<kQ6_K>(w, r, rb, x, bb, out); break;
    case kBF16: qdot_typed<kBF16>(w, r, rb, x, bb, out); break;
    default: qdot_typed<kF16>(w, r, rb, x, bb, out); break;
  }
}

// Up to this many rows of x, quantized weights are decoded in registers per use (qdot); more rows share one
// dequantized tile in memory.
constexpr int64_t kFusedRows = 2;

bool avx2_int_enabled();

// The Matrix of a kernel parameter: float32 (rows, k) when type is F32, else uint8 (rows, row_bytes_of(type,
// k)); false if the dtype, type or shape does not fit.
bool as_matrix(const void* data, const char* dtype, const int64_t* shape, int32_t type, int64_t rows, int64_t k,
               Matrix* m) {
  const int64_t bytes = row_bytes_of(type, k);
  if (bytes < 0 || shape[0] != rows) return false;
  if (repacked(type) && (rows % 8 != 0 || !avx2_int_enabled())) return false;    // only gemm_avx2_int.h reads it
  if (type == kF32 ? (std::strcmp(dtype, "float32") != 0 || shape[1] != k)
                   : (std::strcmp(dtype, "uint8") != 0 || shape[1] != bytes)) {
    return false;
  }
  *m = Matrix{static_cast<const uint8_t*>(data), type, rows, k, bytes};
  return true;
}

// Where a product's outputs go, a block at a time: (*this)(r, n, b0, nb, v, ldi, ldb) hands over v[i * ldi + b *
// ldb] = weight row r + i (i < n) times x row b0 + b (b < nb). `outputs_of(emit)` calls a caller's emit(b, r, value)
// for each: the products below take an Outputs, not the caller's lambda, so that they are compiled once, not once
// per lambda (5 s of the library's 37 s of compile), and its call per block costs nothing measurable.
struct Outputs {
  void* ctx;
  void (*fn)(void* ctx, int64_t r, int64_t n, int64_t b0, int64_t nb, const float* v, int64_t ldi, int64_t ldb);
  void operator()(int64_t r, int64_t n, int64_t b0, int64_t nb, const float* v, int64_t ldi, int64_t ldb) const {
    fn(ctx, r, n, b0, nb, v, ldi, ldb);
  }
};

template <typename Emit>
Outputs outputs_of(Emit& emit) {
  return {&emit, [](void* ctx, int64_t r, int64_t n, int64_t b0, int64_t nb, const float* v, int64_t ldi,
                    int64_t ldb) {
    Emit& e = *static_cast<Emit*>(ctx);
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t i = 0; i < n; ++i) e(b0 + b, r + i, v[i * ldi + b * ldb]);
  }};
}

// For weight rows [r0, r1) of w and every row b of x (B, w.k): w[r] . x[b] to `out`. tile: 4*k floats of
// the calling thread's own (quantized rows are dequantized there, a tile of 4 at a time).
inline void matvec(const Matrix& w, const float* x, int64_t batch, int64_t r0, int64_t r1, float* tile,
                   const Outputs& out) {
  // weight rows outer: a tile of 4 rows (4 k floats) stays in L1 while every row of x passes over it, so the
  // weights are read from memory (and dequantized) once per call whatever the batch
  const int64_t k = w.k;
  float o[4][4];
  for (int64_t r = r0; r < r1; r += 4) {
    const int rb = static_cast<int>(std::min<int64_t>(4, r1 - r));
    w.prefetch(r + 4, std::min<int64_t>(4, r1 - r - 4));
    if (w.type != kF32 && batch <= kFusedRows) {
      for (int64_t b0 = 0; b0 < batch; b0 += 4) {
        const int bb = static_cast<int>(std::min<int64_t>(4, batch - b0));
        qdot(w, r, rb, x + b0 * k, bb, o);
        out(r, rb, b0, bb, &o[0][0], 4, 1);
      }
      continue;
    }
    const float* rows = w.tile_rows(r, rb, tile);
    for (int64_t b0 = 0; b0 < batch; b0 += 4) {
      const int bb = static_cast<int>(std::min<int64_t>(4, batch - b0));
      if (rb == 4) {
        dot_rows<4>(rows, k, x + b0 * k, k, bb, o);
      } else {
        for (int i = 0; i < rb; ++i) dot_rows<1>(rows + i * k, k, x + b0 * k, k, bb, o + i);
      }
      out(r, rb, b0, bb, &o[0][0], 4, 1);
    }
  }
}

}  // namespace
