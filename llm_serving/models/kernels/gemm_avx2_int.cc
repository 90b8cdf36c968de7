// gemm_avx2_int.h's integer products, the weights' repacking and x's rounding: the file's header says how they
// work. Compiled beside decoder_layer_cpu.cc on other cores (kernels/__init__.py: SOURCES), in two ways:
//   - as it is: x's rounding (pack_rows), and the entry points that find a type's code in the table of the types
//     linked (reads, product, repacked_type, repack_rows, stored_row);
//   - with -DLLM_SERVING_INT_TYPE=<a type's code>, once per type a library reads: that type's code (the templates
//     below, instantiated for it alone), entered in the table when the library loads.
// The entry points are declared in the header; everything here is hidden.
#include "gemm_avx2_int.h"

#if defined(LLM_SERVING_AVX2_INT)

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#pragma GCC visibility push(hidden)

// Everything below: no -fassociative-math (the sums above in the order written; the command line's other
// relaxations stay). One set of options for the whole file, so that its functions inline into each other.
#pragma GCC push_options
#pragma GCC optimize("no-associative-math")

namespace llm_serving {
namespace avx2_int {

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}
inline uint16_t u16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}
inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// ---- decoding: a group's blocks of 32 as int16 codes, two vectors of 16 per block (its weights 0, 2, .., 30,
// then 1, 3, .., 31; x is packed the same way), without the codes' offset (Q4_0's 8, Q5_0's 16, Q6_K's 32:
// bias_of, taken off the integer sums), a pair of blocks at a time (decode_pair), and the group's scales a, b (the
// epilogue's: group_scales). Even and odd: a 16-bit lane of the stored bytes holds weights 2i and 2i + 1, so
// shifts and masks in place give both (the widening instructions cost 1.5-2 cycles of shuffle unit a vector on a
// Zen 3).

// bytes of a group in a row of this type
constexpr int64_t group_bytes(int32_t type) { return kGroup / block_weights_of(type) * block_bytes_of(type); }

// The offset inside the codes, taken off each block's sum as bias x sum(n) (exact in int32)
constexpr int bias_of(int32_t type) { return type == kQ4_0 ? 8 : type == kQ5_0 ? 16 : type == kQ6_K ? 32 : 0; }

inline __m256i low_nibbles(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi16(15)); }

// Q5_0/Q5_1's fifth bits (bit l: weight l) as 16 where set, in the even (Odd: odd) weights' order
template <bool Odd>
inline __m256i fifth_bits(uint32_t qh) {
  // 16-bit lane k (weight 2k (+ 1)) reads qh's low half (k < 8) or its high half, bit 2k (+ 1) mod 16
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(qh)),
                                        _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                                         2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3));
  const __m256i sel = Odd ? _mm256_setr_epi16(2, 8, 32, 128, 512, 2048, 8192, -32768, 2, 8, 32, 128, 512, 2048,
                                              8192, -32768)
                          : _mm256_setr_epi16(1, 4, 16, 64, 256, 1024, 4096, 16384, 1, 4, 16, 64, 256, 1024, 4096,
                                              16384);
  return _mm256_and_si256(_mm256_cmpeq_epi16(_mm256_and_si256(v, sel), sel), _mm256_set1_epi16(16));
}

// The f16 at p + j * stride for j < nv (0 past), as 8 floats
inline __m256 halves8(const uint8_t* p, int64_t stride, int nv) {
  if (nv == 8) {
    return _mm256_cvtph_ps(_mm_setr_epi16(u16(p), u16(p + stride), u16(p + 2 * stride), u16(p + 3 * stride),
                                          u16(p + 4 * stride), u16(p + 5 * stride), u16(p + 6 * stride),
                                          u16(p + 7 * stride)));
  }
  alignas(16) uint16_t h[8] = {};
  for (int j = 0; j < nv; ++j) h[j] = u16(p + j * stride);
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(h)));
}

// A row's group g as the decoders take it: its bytes, and how many of its 8 blocks of 32 the row has (8 but in
// a row of blocks of 32 whose last group is short)
template <int32_t T>
inline const uint8_t* group_at(const uint8_t* row, int64_t g) {
  return row + g * group_bytes(T);
}
template <int32_t T>
inline int valid_blocks(int64_t g, int64_t k) {
  return T == kQ4_K || T == kQ5_K || T == kQ6_K ? 8 : static_cast<int>(std::min<int64_t>(8, k / 32 - 8 * g));
}

// The scales a, b of the group at p (nv valid blocks)
//   blocks of 32: a = d, b = m (Q4_1, Q5_1; else 0)
//   Q4_K / Q5_K: a = d sc[j], b = -(dmin m[j]) (12 bytes of 6-bit sc[j] and m[j] after the f16 d and dmin)
//   Q6_K: a = d sc[2j], b = d sc[2j + 1] (16 int8 scales at 192, one per 16 weights; f16 d at 208)
template <int32_t T>
inline void group_scales(const uint8_t* p, int nv, __m256* a, __m256* b) {
  if constexpr (T == kQ4_K || T == kQ5_K) {
    uint32_t u0, u1, u2;                   // bytes 4-7: sc[0..3] (low 6 bits), 8-11: m[0..3], 12-15: low 4 bits of
    std::memcpy(&u0, p + 4, 4);            // sc[4..7] and m[4..7] (low and high nibbles), whose top 2 bits are the
    std::memcpy(&u1, p + 8, 4);            // top bits of bytes 4-7 (sc) and 8-11 (m)
    std::memcpy(&u2, p + 12, 4);
    const uint64_t sc = static_cast<uint64_t>(u0 & 0x3f3f3f3fu) |
                        static_cast<uint64_t>((u2 & 0x0f0f0f0fu) | ((u0 >> 6) & 0x03030303u) << 4) << 32;
    const uint64_t mn = static_cast<uint64_t>(u1 & 0x3f3f3f3fu) |
                        static_cast<uint64_t>(((u2 >> 4) & 0x0f0f0f0fu) | ((u1 >> 6) & 0x03030303u) << 4) << 32;
    // the 16 bytes [sc | m] in both halves, spread to 32-bit lanes in place (no widening across halves)
    const __m256i bytes = _mm256_broadcastsi128_si256(_mm_set_epi64x(static_cast<int64_t>(mn), static_cast<int64_t>(sc)));
    const __m256i to_a = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                          4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
    const __m256i to_b = _mm256_setr_epi8(8, -1, -1, -1, 9, -1, -1, -1, 10, -1, -1, -1, 11, -1, -1, -1,
                                          12, -1, -1, -1, 13, -1, -1, -1, 14, -1, -1, -1, 15, -1, -1, -1);
    *a = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_shuffle_epi8(bytes, to_a)), _mm256_set1_ps(half(p)));
    *b = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_shuffle_epi8(bytes, to_b)), _mm256_set1_ps(-half(p + 2)));
  } else if constexpr (T == kQ6_K) {
    const __m128i sc = _mm_shuffle_epi8(load16(p + 192), _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
    const __m256 d = _mm256_set1_ps(half(p + 208));
    *a = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), d);
    *b = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))), d);
  } else if constexpr (T == kMXFP4) {     // each block's E8M0 byte e as 2^(e - 128) (half the power of two: its
                                          // codes are E2M1 values doubled, as ggml_e8m0_to_fp32_half; denormal for
                                          // e < 2), 0 past nv
    constexpr int64_t B = block_bytes_of(T);
    const __m256i e = nv == 8 ? _mm256_setr_epi32(p[0], p[B], p[2 * B], p[3 * B], p[4 * B], p[5 * B], p[6 * B], p[7 * B])
                              : _mm256_setr_epi32(p[0], nv > 1 ? p[B] : 0, nv > 2 ? p[2 * B] : 0, nv > 3 ? p[3 * B] : 0,
                                                  nv > 4 ? p[4 * B] : 0, nv > 5 ? p[5 * B] : 0, nv > 6 ? p[6 * B] : 0,
                                                  0);
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);            // e < 2: denormal
    const __m256i bits = _mm256_blendv_epi8(normal, tiny, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e));
    const __m256i valid = _mm256_cmpgt_epi32(_mm256_set1_epi32(nv), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    *a = _mm256_castsi256_ps(_mm256_and_si256(bits, valid));
    *b = _mm256_setzero_ps();
  } else {
    constexpr int64_t B = block_bytes_of(T);
    *a = halves8(p, B, nv);
    *b = T == kQ4_1 || T == kQ5_1 ? halves8(p + 2, B, nv) : _mm256_setzero_ps();
  }
}

// Blocks 2c and 2c + 1 of the group at p (nv valid blocks; zeros past them): v[0], v[1] block 2c's even and odd
// weights, v[2], v[3] block 2c + 1's.
//   blocks of 32: Q8_0 32 signed bytes after the f16 d; the others 16 bytes of nibbles (weight l < 16 byte l's low
//     nibble, l >= 16 byte l - 16's high one; Q5_0/Q5_1 plus 16 x bit l of the 32-bit word before them)
//   Q4_K / Q5_K: sub-block j (weights 32j..32j+31) is the low (j even) or high (j odd) nibbles of bytes
//     32(j/2)..32(j/2)+31 of the 128 at 16 (Q5_K: at 48, plus 16 x bit j of byte l of the 32 at 16)
//   Q6_K: each half h of 128 weights reads ql[64h ..] and qh[32h ..]: weight 128h + 32i + l (i < 4, l < 32) is
//     ql[64h + l + 32(i & 1)]'s low (i < 2) or high nibble, plus bits 2i..2i+1 of qh[128 + 32h + l] as bits 4..5
template <int32_t T>
inline void decode_pair(const uint8_t* p, int c, int nv, __m256i* v) {
  if constexpr (T == kQ4_K || T == kQ5_K) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + (T == kQ4_K ? 16 : 48) + 32 * c));
    v[0] = low_nibbles(q);
    v[1] = low_nibbles(_mm256_srli_epi16(q, 8));
    v[2] = low_nibbles(_mm256_srli_epi16(q, 4));
    v[3] = _mm256_srli_epi16(q, 12);
    if constexpr (T == kQ5_K) {            // bit j of byte l: of an even weight at bit j, of an odd one at 8 + j
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16)), sixteen = _mm256_set1_epi16(16);
      for (int t = 0; t < 2; ++t) {
        const int j = 2 * c + t;
        const __m256i even = j <= 4 ? _mm256_slli_epi16(h, 4 - j) : _mm256_srli_epi16(h, j - 4);
        v[2 * t] = _mm256_or_si256(v[2 * t], _mm256_and_si256(even, sixteen));
        v[2 * t + 1] = _mm256_or_si256(v[2 * t + 1], _mm256_and_si256(_mm256_srli_epi16(h, 4 + j), sixteen));
      }
    }
  } else if constexpr (T == kQ6_K) {
    const int h = c / 2, i0 = 2 * (c % 2);             // blocks 4h + i0 (ql bytes 0..31) and 4h + i0 + 1 (32..63)
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 128 + 32 * h));
    const __m256i top = _mm256_set1_epi16(0x30);
    for (int t = 0; t < 2; ++t) {
      const int i = i0 + t;
      const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * h + 32 * t));
      const __m256i low_e = i < 2 ? low_nibbles(l) : low_nibbles(_mm256_srli_epi16(l, 4));
      const __m256i low_o = i < 2 ? low_nibbles(_mm256_srli_epi16(l, 8)) : _mm256_srli_epi16(l, 12);
      // bits 2i..2i+1 of the even weight's byte (bits 0..7 of the lane) and of the odd one's (8..15) to 4..5
      const __m256i high_e = i < 2 ? _mm256_slli_epi16(qh, 4 - 2 * i) : _mm256_srli_epi16(qh, 2 * i - 4);
      const __m256i high_o = _mm256_srli_epi16(qh, 4 + 2 * i);
      v[2 * t] = _mm256_or_si256(low_e, _mm256_and_si256(high_e, top));
      v[2 * t + 1] = _mm256_or_si256(low_o, _mm256_and_si256(high_o, top));
    }
  } else {
    constexpr int64_t B = block_bytes_of(T);
    for (int t = 0; t < 2; ++t) {
      const int j = 2 * c + t;
      const uint8_t* q = p + j * B;
      if (j >= nv) {
        v[2 * t] = v[2 * t + 1] = _mm256_setzero_si256();
      } else if constexpr (T == kQ8_0) {
        const __m256i s = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 2));
        v[2 * t] = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8);
        v[2 * t + 1] = _mm256_srai_epi16(s, 8);
      } else if constexpr (T == kMXFP4) {   // the nibbles as bytes (low half: weights 0..15, high: 16..31), each
        const __m256i table = _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,   // its
                                               0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);  // doubled
        const __m256i s = _mm256_broadcastsi128_si256(load16(q + 1));                                // E2M1 value,
        const __m256i n = _mm256_and_si256(_mm256_srlv_epi32(s, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
                                           _mm256_set1_epi8(15));
        const __m256i w = _mm256_shuffle_epi8(table, n);                    // then split as Q8_0's bytes
        v[2 * t] = _mm256_srai_epi16(_mm256_slli_epi16(w, 8), 8);
        v[2 * t + 1] = _mm256_srai_epi16(w, 8);
      } else {                             // the 16 bytes in both halves, shifted per 32-bit lane (low half: the
        constexpr int at = T == kQ4_0 ? 2 : T == kQ4_1 ? 4 : T == kQ5_0 ? 6 : 8;      // low nibbles, high: high)
        const __m256i s = _mm256_broadcastsi128_si256(load16(q + at));
        __m256i e = low_nibbles(_mm256_srlv_epi32(s, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)));
        __m256i o = low_nibbles(_mm256_srlv_epi32(s, _mm256_setr_epi32(8, 8, 8, 8, 12, 12, 12, 12)));
        if constexpr (T == kQ5_0 || T == kQ5_1) {
          uint32_t qh;
          std::memcpy(&qh, q + (T == kQ5_0 ? 2 : 4), 4);
          e = _mm256_or_si256(e, fifth_bits<false>(qh));
          o = _mm256_or_si256(o, fifth_bits<true>(qh));
        }
        v[2 * t] = e;
        v[2 * t + 1] = o;
      }
    }
  }
}

// Group g of a row of k weights of type T: its 16 vectors (w[2j], w[2j + 1]: block j's even and odd weights) and
// scales
template <int32_t T>
inline void decode_group(const uint8_t* row, int64_t g, int64_t k, __m256i* w, __m256* a, __m256* b) {
  const uint8_t* p = group_at<T>(row, g);
  const int nv = valid_blocks<T>(g, k);
  group_scales<T>(p, nv, a, b);
  for (int c = 0; c < 4; ++c) decode_pair<T>(p, c, nv, w + 4 * c);
}

// ---- the sums

// The products of block j (P[j]: 8 int32 lanes, 0-3 from the block's first 16 weights, 4-7 from its second):
// lo[j] = the sum of lanes 0-3, hi[j] of 4-7 (exact: int32). Unpacks and adds within halves, one exchange of
// halves at the end (the horizontal adds cost 2 cycles of shuffle unit each). pair_sums: blocks 2c and 2c + 1
// (p0, p1) to [p0_0+p0_2, p1_0+p1_2, p0_1+p0_3, p1_1+p1_3 | the same of lanes 4-7]; then finish_halves on the 4.
inline __m256i pair_sums(__m256i p0, __m256i p1) {
  return _mm256_add_epi32(_mm256_unpacklo_epi32(p0, p1), _mm256_unpackhi_epi32(p0, p1));
}
inline void finish_halves(const __m256i* s, __m256i* lo, __m256i* hi) {
  __m256i t[2];
  for (int i = 0; i < 2; ++i)   // [p0 lo, p1 lo, p2 lo, p3 lo | p0 hi, p1 hi, p2 hi, p3 hi] (p0 = block 4i)
    t[i] = _mm256_add_epi32(_mm256_unpacklo_epi64(s[2 * i], s[2 * i + 1]), _mm256_unpackhi_epi64(s[2 * i], s[2 * i + 1]));
  *lo = _mm256_permute2x128_si256(t[0], t[1], 0x20);
  *hi = _mm256_permute2x128_si256(t[0], t[1], 0x31);
}

// P[j]: block j's codes (its even and odd vectors) times x's (its two vectors of n)
inline __m256i block_products(__m256i we, __m256i wo, __m256i xe, __m256i xo) {
  return _mm256_add_epi32(_mm256_madd_epi16(we, xe), _mm256_madd_epi16(wo, xo));
}

// The epilogue of one group from its blocks' integer sums over their first 16 weights (lo) and their second (hi)
// (xf: the x record's floats: sx, xs, then the int32 sums of n over each block's first and second 16): acc as the
// header says. The same float operations on the same values whichever way lo and hi were summed.
template <int K, int Bias>
inline __m256 scale_sums(__m256i lo, __m256i hi, const float* xf, __m256 a, __m256 b, __m256 acc) {
  static_assert(Bias == 0 || Bias == 8 || Bias == 16 || Bias == 32, "a power of two: bias x n is a shift");
  constexpr int kLog2Bias = Bias == 8 ? 3 : Bias == 16 ? 4 : 5;
  const __m256 sx = _mm256_load_ps(xf);
  if constexpr (K == kSplit) {
    if constexpr (Bias != 0) {
      lo = _mm256_sub_epi32(lo, _mm256_slli_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(xf + 16)), kLog2Bias));
      hi = _mm256_sub_epi32(hi, _mm256_slli_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(xf + 24)), kLog2Bias));
    }
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(sx, a), acc);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(sx, b), acc);
  } else {
    __m256i t = _mm256_add_epi32(lo, hi);
    if constexpr (Bias != 0) {
      const __m256i n = _mm256_add_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(xf + 16)),
                                         _mm256_load_si256(reinterpret_cast<const __m256i*>(xf + 24)));
      t = _mm256_sub_epi32(t, _mm256_slli_epi32(n, kLog2Bias));
    }
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(sx, a), acc);
    if constexpr (K == kOffset) acc = _mm256_fmadd_ps(b, _mm256_load_ps(xf + 8), acc);
    return acc;
  }
}

// ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// ---- the lanes layout (more rows of x than kFusedRows): a group's 16 vectors transposed, so that 32-bit lane j
// of every vector holds 2 codes (or 2 values of x) of block j: a multiply-add's lane j adds to block j's sum and
// the 8 lanes of an accumulator are the group's 8 block sums, with no reduction across lanes. Vector 8h + 4f + d
// holds, in lane j, 32-bit word 4h + d of block j's even (f = 0) or odd (f = 1) vector: vectors 0..7 are the
// first 16 weights of every block (h = 0), 8..15 the second (Q6_K's two scales).

// r[j] (j < 8) transposed in place: 32-bit word d of r[j] -> word j of r[d]
inline void transpose8(__m256i* r) {
  __m256i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm256_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm256_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm256_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
  }
}

// A group's 16 vectors (v[2j], v[2j + 1]: block j's even and odd) in the lanes layout, stored at out
inline void store_lanes(const __m256i* v, __m256i* out) {
  __m256i e[8], o[8];
  for (int j = 0; j < 8; ++j) {
    e[j] = v[2 * j];
    o[j] = v[2 * j + 1];
  }
  transpose8(e);                           // e[d]: word d (weights 4d, 4d + 2 of the even ones) of every block
  transpose8(o);
  for (int h = 0; h < 2; ++h)
    for (int d = 0; d < 4; ++d) {
      _mm256_store_si256(out + 8 * h + d, e[4 * h + d]);
      _mm256_store_si256(out + 8 * h + 4 + d, o[4 * h + d]);
    }
}

// ---- x

// Whether a product of m rows of x runs the lanes layout (x packed so, weights unpacked so)
inline bool lanes_layout(int64_t m) { return m > kFusedRows; }

#if !defined(LLM_SERVING_INT_TYPE)
// (gemm_avx2_int.h says what it does)
void pack_rows(const float* x, int64_t ldx, int64_t k, int64_t m, int64_t b0, int64_t b1, uint8_t* xp) {
  const int64_t nb = k / 32, ng = groups(k), stride = x_bytes(k);
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t r = b0; r < b1; ++r) {
    const float* v = x + r * ldx;
    uint8_t* out = xp + r * stride;
    for (int64_t g = 0; g < ng; ++g, out += kXRecord) {
      __m256i* n = reinterpret_cast<__m256i*>(out);
      alignas(32) float sx[8] = {}, xs[8] = {};
      alignas(32) int32_t na[8] = {}, nb16[8] = {};
      for (int j = 0; j < 8; ++j) {
        const int64_t blk = 8 * g + j;
        if (blk >= nb) {
          _mm256_store_si256(n + 2 * j, _mm256_setzero_si256());
          _mm256_store_si256(n + 2 * j + 1, _mm256_setzero_si256());
          continue;
        }
        const float* e = v + 32 * blk;
        __m256 f[4], mx = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) {
          f[i] = _mm256_loadu_ps(e + 8 * i);
          mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, f[i]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        const __m256 inv = _mm256_set1_ps(amax > 0.f ? kRange / amax : 0.f);
        __m256i q[4];
        for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(f[i], inv));   // to nearest even
        // values 0..15 and 16..31 as int16 pairs, then the even ones (low halves) and odd ones (high halves) as
        // int32, packed back to int16 and their pairs put in order
        const __m256i lo = _mm256_packs_epi32(q[0], q[1]), hi = _mm256_packs_epi32(q[2], q[3]);
        auto even = [](__m256i t) { return _mm256_srai_epi32(_mm256_slli_epi32(t, 16), 16); };
        auto odd = [](__m256i t) { return _mm256_srai_epi32(t, 16); };
        _mm256_store_si256(n + 2 * j, _mm256_permutevar8x32_epi32(_mm256_packs_epi32(even(lo), even(hi)), order));
        _mm256_store_si256(n + 2 * j + 1, _mm256_permutevar8x32_epi32(_mm256_packs_epi32(odd(lo), odd(hi)), order));
        auto total = [](__m256i t) {
          __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
          s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
          return _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
        };
        na[j] = total(_mm256_add_epi32(q[0], q[1]));
        nb16[j] = total(_mm256_add_epi32(q[2], q[3]));
        sx[j] = amax / kRange;
        xs[j] = sx[j] * static_cast<float>(na[j] + nb16[j]);
      }
      if (lanes_layout(m)) {
        __m256i v[16];
        for (int i = 0; i < 16; ++i) v[i] = _mm256_load_si256(n + i);
        store_lanes(v, n);
      }
      std::memcpy(out + kXFloats, sx, sizeof sx);
      std::memcpy(out + kXFloats + 32, xs, sizeof xs);
      std::memcpy(out + kXFloats + 64, na, sizeof na);
      std::memcpy(out + kXFloats + 96, nb16, sizeof nb16);
    }
  }
}
#endif

// ---- products

// Up to kFusedRows rows of x: out[i * ldo + b] for RB weight rows (row_bytes apart) and BB rows of x (packed,
// stride xstride), decoded in registers a pair of blocks at a time and used at once, x's vectors loaded once for
// the RB rows (x is 2 bytes a weight: two weight rows a pass ran 1.1-1.3x faster for 2 rows of x on a Zen 3,
// about even for one). Asks for the rows a few ahead as it goes (as weight_matrix_cpu.h's decoders: memory read
// while blocks are decoded).
template <int32_t T, int RB, int BB>
void fused_rows(const uint8_t* rows, int64_t row_bytes, int64_t k, const uint8_t* xp, int64_t xstride, float* out,
                int64_t ldo) {
  constexpr int K = kind_of(T), Bias = bias_of(T);
  constexpr int64_t kAhead = 4;
  const int64_t ng = groups(k);
  __m256 acc[RB][BB];
  for (int r = 0; r < RB; ++r)
    for (int b = 0; b < BB; ++b) acc[r][b] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    const int nv = valid_blocks<T>(g, k);
    const uint8_t* p[RB];
    __m256 a[RB], bs[RB];
    for (int r = 0; r < RB; ++r) {
      p[r] = group_at<T>(rows + r * row_bytes, g);
      const uint8_t* ahead = p[r] + kAhead * row_bytes;
      for (int64_t at = 0; at < group_bytes(T); at += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + at), _MM_HINT_T1);
      group_scales<T>(p[r], nv, &a[r], &bs[r]);
    }
    __m256i s[RB][BB][4];
    for (int c = 0; c < 4; ++c) {
      __m256i v[RB][4];
      for (int r = 0; r < RB; ++r) decode_pair<T>(p[r], c, nv, v[r]);
      for (int b = 0; b < BB; ++b) {
        const __m256i* xv = reinterpret_cast<const __m256i*>(xp + b * xstride + g * kXRecord) + 4 * c;
        const __m256i x0 = _mm256_load_si256(xv), x1 = _mm256_load_si256(xv + 1);
        const __m256i x2 = _mm256_load_si256(xv + 2), x3 = _mm256_load_si256(xv + 3);
        for (int r = 0; r < RB; ++r)
          s[r][b][c] = pair_sums(block_products(v[r][0], v[r][1], x0, x1), block_products(v[r][2], v[r][3], x2, x3));
      }
    }
    for (int b = 0; b < BB; ++b) {
      const float* xf = reinterpret_cast<const float*>(xp + b * xstride + g * kXRecord + kXFloats);
      for (int r = 0; r < RB; ++r) {
        __m256i lo, hi;
        finish_halves(s[r][b], &lo, &hi);
        acc[r][b] = scale_sums<K, Bias>(lo, hi, xf, a[r], bs[r], acc[r][b]);
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int b = 0; b < BB; ++b) out[r * ldo + b] = sum8(acc[r][b]);
}

// fused_rows over n weight rows, two at a time
template <int32_t T, int BB>
void fused(const uint8_t* rows, int64_t row_bytes, int64_t k, int64_t n, const uint8_t* xp, int64_t xstride,
           float* out, int64_t ldo) {
  int64_t r = 0;
  for (; r + 2 <= n; r += 2) fused_rows<T, 2, BB>(rows + r * row_bytes, row_bytes, k, xp, xstride, out + r * ldo, ldo);
  for (; r < n; ++r) fused_rows<T, 1, BB>(rows + r * row_bytes, row_bytes, k, xp, xstride, out + r * ldo, ldo);
}

// n weight rows of type T unpacked into records (wbuf: n x w_bytes(k)): [codes, lanes layout][a][b] per group
template <int32_t T>
void unpack(const uint8_t* rows, int64_t row_bytes, int64_t k, int64_t n, uint8_t* wbuf) {
  const int64_t ng = groups(k);
  for (int64_t r = 0; r < n; ++r) {
    const uint8_t* row = rows + r * row_bytes;
    uint8_t* rec = wbuf + r * w_bytes(k);
    for (int64_t g = 0; g < ng; ++g, rec += kWRecord) {
      __m256i w[16];
      __m256 a, b;
      decode_group<T>(row, g, k, w, &a, &b);
      store_lanes(w, reinterpret_cast<__m256i*>(rec));
      _mm256_store_ps(reinterpret_cast<float*>(rec + kWFloats), a);
      _mm256_store_ps(reinterpret_cast<float*>(rec + kWFloats + 32), b);
    }
  }
}

// RB unpacked weight rows (w: records, stride ws) x BB packed rows of x (stride xstride), both in the lanes
// layout, over ng groups: acc[r * BB + b] (8 floats each, from where the previous depth block left them) +=
// the groups' epilogues. Per group, each (weight row, x row) pair's block sums accumulate in the lanes of one
// register, its first 16 weights' vectors then the second's (apart for Q6_K), each weight and x vector loaded
// once for the RB x BB pairs.
template <int K, int Bias, int RB, int BB>
void tile(const uint8_t* w, int64_t ws, const uint8_t* x, int64_t xstride, int64_t ng, float* accs) {
  __m256 acc[RB][BB];
  for (int r = 0; r < RB; ++r)
    for (int b = 0; b < BB; ++b) acc[r][b] = _mm256_load_ps(accs + 8 * (r * BB + b));
  for (int64_t g = 0; g < ng; ++g) {
    const uint8_t* wg = w + g * kWRecord;
    const uint8_t* xg = x + g * kXRecord;
    __m256i sum[RB][BB], first[RB][BB];
    for (int r = 0; r < RB; ++r)
      for (int b = 0; b < BB; ++b) sum[r][b] = _mm256_setzero_si256();
    for (int v = 0; v < 16; ++v) {
      if (K == kSplit && v == 8) {
        for (int r = 0; r < RB; ++r)
          for (int b = 0; b < BB; ++b) {
            first[r][b] = sum[r][b];
            sum[r][b] = _mm256_setzero_si256();
          }
      }
      __m256i wv[RB];
      for (int r = 0; r < RB; ++r) wv[r] = _mm256_load_si256(reinterpret_cast<const __m256i*>(wg + r * ws) + v);
      for (int b = 0; b < BB; ++b) {
        const __m256i xv = _mm256_load_si256(reinterpret_cast<const __m256i*>(xg + b * xstride) + v);
        for (int r = 0; r < RB; ++r) sum[r][b] = _mm256_add_epi32(sum[r][b], _mm256_madd_epi16(wv[r], xv));
      }
    }
    for (int r = 0; r < RB; ++r) {
      const float* wf = reinterpret_cast<const float*>(wg + r * ws + kWFloats);
      const __m256 a = _mm256_load_ps(wf), bs = _mm256_load_ps(wf + 8);
      for (int b = 0; b < BB; ++b) {
        const float* xf = reinterpret_cast<const float*>(xg + b * xstride + kXFloats);
        acc[r][b] = K == kSplit ? scale_sums<K, Bias>(first[r][b], sum[r][b], xf, a, bs, acc[r][b])
                                : scale_sums<K, Bias>(sum[r][b], _mm256_setzero_si256(), xf, a, bs, acc[r][b]);
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int b = 0; b < BB; ++b) _mm256_store_ps(accs + 8 * (r * BB + b), acc[r][b]);
}

template <int K, int Bias, int RB>
void tile_rows(const uint8_t* w, int64_t ws, const uint8_t* x, int64_t xstride, int bb, int64_t ng, float* accs) {
  switch (bb) {
    case 1: tile<K, Bias, RB, 1>(w, ws, x, xstride, ng, accs); break;
    case 2: tile<K, Bias, RB, 2>(w, ws, x, xstride, ng, accs); break;
    case 3: tile<K, Bias, RB, 3>(w, ws, x, xstride, ng, accs); break;
    default: tile<K, Bias, RB, kBB>(w, ws, x, xstride, ng, accs); break;
  }
}

// n unpacked rows (wbuf) times m packed rows of x, kRB x kBB at a time; a depth block of kDepthGroups groups at a
// time, so that a tile's rows of x (kBB x 10 KB) stay in L1 while the n weight rows pass over them (from L2; a
// row of x of k = 8192 alone is 20 KB). accs: n x m x 8 floats, the running sums between depth blocks.
template <int K, int Bias>
void tiles(const uint8_t* wbuf, int64_t k, int64_t n, const uint8_t* xp, int64_t m, float* accs, float* out,
           int64_t ldo) {
  const int64_t ws = w_bytes(k), xstride = x_bytes(k), ng = groups(k);
  std::memset(accs, 0, n * m * 8 * sizeof(float));
  for (int64_t d0 = 0; d0 < ng; d0 += kDepthGroups) {
    const int64_t depth = std::min(kDepthGroups, ng - d0);
    const uint8_t* wd = wbuf + d0 * kWRecord;
    const uint8_t* xd = xp + d0 * kXRecord;
    for (int64_t b0 = 0; b0 < m; b0 += kBB) {
      const int bb = static_cast<int>(std::min<int64_t>(kBB, m - b0));
      int64_t r = 0;          // (the accumulators of weight rows r.. and x rows b0..: a tile's, in order)
      for (; r + kRB <= n; r += kRB)
        tile_rows<K, Bias, kRB>(wd + r * ws, ws, xd + b0 * xstride, xstride, bb, depth, accs + 8 * (r * m + kRB * b0));
      for (; r < n; ++r) tile_rows<K, Bias, 1>(wd + r * ws, ws, xd + b0 * xstride, xstride, bb, depth, accs + 8 * (r * m + b0));
    }
  }
  for (int64_t b0 = 0; b0 < m; b0 += kBB) {
    const int bb = static_cast<int>(std::min<int64_t>(kBB, m - b0));
    int64_t r = 0;
    for (; r + kRB <= n; r += kRB)
      for (int i = 0; i < kRB; ++i)
        for (int b = 0; b < bb; ++b) out[(r + i) * ldo + b0 + b] = sum8(_mm256_load_ps(accs + 8 * (r * m + kRB * b0 + i * bb + b)));
    for (; r < n; ++r)
      for (int b = 0; b < bb; ++b) out[r * ldo + b0 + b] = sum8(_mm256_load_ps(accs + 8 * (r * m + b0 + b)));
  }
}


// ---- the row-interleaved layout (weights repacked once, at load: repack_rows): rows read 8 at a time
//
// Why: the products above take one weight row at a time, so a block's 32 products land in the lanes of a vector
// and must be summed across them (pair_sums, finish_halves), and the codes are split into even and odd weights.
// With 8 rows interleaved, 32-bit lane r of every vector is row r: a multiply-add of a row-interleaved code vector
// by a broadcast word of x (2 values) adds to the 8 rows' block sums at once, so no sum crosses lanes, and the
// epilogue scales 8 rows with one instruction.
//
// A panel: 8 rows (8i .. 8i + 7) x one group of 256 weights, 8 stored groups' bytes (the same codes and scales,
// nothing lost), a row-block's ng panels in k order. The codes' low 4 bits, both types:
//   1024 bytes, 32 chunks of 32: chunk 4j + l holds block j's weights 8l .. 8l + 7 of the 8 rows: 32-bit lane r
//   holds row r's 8 as 4 int16 pairs of nibbles, pair i (bits 4i..4i+3 of the low half, and of the high half)
//   matching 32-bit word W_i of x's block j record (pack_rows, natural layout: its even vector's words E_t =
//   (n_4t, n_4t+2), then its odd one's O_t = (n_4t+1, n_4t+3)): W_0 = E_2l, W_1 = E_2l+1, W_2 = O_2l, W_3 =
//   O_2l+1. So (lane >> 4i) & 0x000F000F is a vector whose multiply-add with W_i broadcast gives each row's 2
//   products of those weights.
// Q4_K (1152 bytes = 8 x 144):
//   [0, 16) d of each row (f16, lane r: row r), [16, 32) dmin
//   [32, 64) lo03: 32-bit lane r, byte j (j < 4): sc[j] & 15 | (m[j] & 15) << 4 (row r's 6-bit scale and min of
//   sub-block j); [64, 96) lo47: the same for j = 4..7; [96, 128) hi: lane r, byte j (j < 4): sc[j] >> 4 |
//   (m[j] >> 4) << 2 | (sc[j + 4] >> 4) << 4 | (m[j + 4] >> 4) << 6
//   [128, 1152) the codes
// Q6_K (1680 bytes = 8 x 210):
//   [0, 16) d of each row (f16); [16, 144) the int8 scales, 8 bytes per 16 weights s (s = 0..15: byte r row r's)
//   [144, 1680) the 6-bit codes, 32 chunks of 48 bytes (the same weights and pairs as above, other bits): 32 bytes
//   A whose 16-bit half t (lane t / 2's low or high half) holds pair 0's code at bits 0-5, pair 1's at 6-11 and
//   the low 4 bits of pair 3's at 12-15, then 16 bytes B whose byte t holds pair 2's code at bits 0-5 and the top
//   2 bits of pair 3's at 6-7. Decoding a chunk's 4 vectors takes 9 instructions (A & 63; A >> 6 & 63; B widened
//   to 16 bits, & 63; A >> 12 | B >> 2 & 48), against 17 when the top bits were a vector of their own
// The epilogue is the header's, per output, in the same order (8 accumulators of the block positions j, the groups
// in k order; Q6_K's first 16 then second 16 of each block; sum8's tree at the end, as vertical adds): the outputs
// are the same floats as the stored rows' products (tests/unit/test_kernel_repack.py checks them to the bit), so
// batch invariance holds across the layouts.

constexpr int64_t kPanelRows = 8;
template <int32_t T>
constexpr int64_t panel_bytes() { return kPanelRows * group_bytes(T); }
template <int32_t T>
constexpr int64_t panel_codes() { return T == kQ6_K ? 144 : T == kQ4_1 ? 256 : 128; }   // where the codes start
// bytes of a chunk's codes: Q8_0's 8 bits a code take two vectors, Q6_K's 6 one and a half, the others' 4 one
template <int32_t T>
constexpr int64_t chunk_bytes() { return T == kQ8_0 ? 64 : T == kQ6_K ? 48 : 32; }

// rows x k stored rows of type T (src) into panels (dst, as many bytes), once at load: each row's group of codes
// unpacked to bytes (stored_codes: the 256 codes of a group at p in weight order, without the offset the
// epilogue takes off), then placed by a table of the panel's order (about 1 ns a weight: a 4B model in 2-3 s)
template <int32_t T>
inline void stored_codes(const uint8_t* p, uint8_t* codes) {
  if constexpr (T == kQ4_K) {
    for (int half = 0; half < 4; ++half)             // bytes 32h.. hold sub-blocks 2h (low nibbles), 2h + 1 (high)
      for (int l = 0; l < 32; ++l) {
        const uint8_t q = p[16 + 32 * half + l];
        codes[64 * half + l] = q & 15;
        codes[64 * half + 32 + l] = q >> 4;
      }
  } else if constexpr (T == kQ8_0 || T == kQ4_0 || T == kQ4_1) {   // block j's 32 at 32j (Q8_0: int8 as a byte)
    constexpr int64_t B = block_bytes_of(T), at = T == kQ8_0 ? 2 : T == kQ4_0 ? 2 : 4;
    for (int j = 0; j < 8; ++j) {
      const uint8_t* q = p + j * B + at;
      if constexpr (T == kQ8_0) {
        std::memcpy(codes + 32 * j, q, 32);
      } else {
        for (int l = 0; l < 16; ++l) {
          codes[32 * j + l] = q[l] & 15;
          codes[32 * j + 16 + l] = q[l] >> 4;
        }
      }
    }
  } else {                                           // Q6_K (as decode_pair), a byte of each of ql and qh at a time
    for (int h = 0; h < 2; ++h)
      for (int l = 0; l < 32; ++l) {
        const uint8_t q0 = p[64 * h + l], q1 = p[64 * h + 32 + l], qh = p[128 + 32 * h + l];
        codes[128 * h + l] = static_cast<uint8_t>((q0 & 15) | (qh & 3) << 4);
        codes[128 * h + 32 + l] = static_cast<uint8_t>((q1 & 15) | (qh >> 2 & 3) << 4);
        codes[128 * h + 64 + l] = static_cast<uint8_t>((q0 >> 4) | (qh >> 4 & 3) << 4);
        codes[128 * h + 96 + l] = static_cast<uint8_t>((q1 >> 4) | (qh >> 6) << 4);
      }
  }
}

template <int32_t T>
void repack_typed(const uint8_t* src, int64_t rows, int64_t k, uint8_t* dst) {
  const int64_t ng = k / kGroup, row_bytes = ng * group_bytes(T), pb = panel_bytes<T>();
  // order[c][2i + h]: the position of pair i's weight h of chunk c (x word W_i's: its first weight, then 2 on)
  static const auto order = [] {
    std::array<std::array<uint8_t, 8>, 32> o{};
    for (int c = 0; c < 32; ++c)
      for (int i = 0; i < 4; ++i) {
        const int j = c / 4, l = c % 4, first = i < 2 ? 8 * l + 4 * i : 8 * l + 4 * (i - 2) + 1;
        o[c][2 * i] = static_cast<uint8_t>(32 * j + first);
        o[c][2 * i + 1] = static_cast<uint8_t>(32 * j + first + 2);
      }
    return o;
  }();
  for (int64_t rb = 0; rb < rows / kPanelRows; ++rb) {
    for (int64_t g = 0; g < ng; ++g) {
      uint8_t* panel = dst + (rb * ng + g) * pb;
      std::memset(panel, 0, pb);
      for (int r = 0; r < kPanelRows; ++r) {
        const uint8_t* p = src + (rb * kPanelRows + r) * row_bytes + g * group_bytes(T);
        if constexpr (T == kQ4_K) {
          std::memcpy(panel + 2 * r, p, 2);                // d
          std::memcpy(panel + 16 + 2 * r, p + 2, 2);       // dmin
          const uint8_t* q = p + 4;                        // the 12 bytes of 6-bit scales and mins
          for (int j = 0; j < 8; ++j) {
            const int sc = j < 4 ? q[j] & 63 : (q[j + 4] & 15) | (q[j - 4] >> 6) << 4;
            const int mn = j < 4 ? q[j + 4] & 63 : (q[j + 4] >> 4) | (q[j] >> 6) << 4;
            panel[(j < 4 ? 32 : 64) + 4 * r + j % 4] = static_cast<uint8_t>((sc & 15) | (mn & 15) << 4);
            panel[96 + 4 * r + j % 4] |= static_cast<uint8_t>(((sc >> 4) | (mn >> 4) << 2) << (j < 4 ? 0 : 4));
          }
        } else if constexpr (T == kQ6_K) {
          std::memcpy(panel + 2 * r, p + 208, 2);          // d
          for (int sub = 0; sub < 16; ++sub) panel[16 + 8 * sub + r] = p[192 + sub];
        } else {                                           // blocks of 32: d (and Q4_1's m) of block j at 16j
          for (int j = 0; j < 8; ++j) {
            std::memcpy(panel + 16 * j + 2 * r, p + j * block_bytes_of(T), 2);
            if constexpr (T == kQ4_1) std::memcpy(panel + 128 + 16 * j + 2 * r, p + j * block_bytes_of(T) + 2, 2);
          }
        }
        alignas(32) uint8_t codes[256];
        stored_codes<T>(p, codes);
        if constexpr (T != kQ8_0 && T != kQ6_K) {   // 4-bit codes: each chunk's lane at once, 4 chunks a vector
          // chunk c = 4j + l takes block j's codes 8l..8l+7 (q0..q7, `order`), its lane's bytes q0 | q4 << 4,
          // q1 | q5 << 4, q2 | q6 << 4, q3 | q7 << 4: a shuffle to q0 q4 q1 q5 q2 q6 q3 q7, then each pair's
          // first + 16 x its second (codes < 16: exact), packed back to bytes. The scalar loop's lanes, 4x faster
          const __m128i to_pairs = _mm_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
          const __m128i one_sixteen = _mm_set1_epi16(0x1001);
          alignas(16) uint8_t lanes[128];
          for (int j = 0; j < 8; ++j) {
            const __m128i* at = reinterpret_cast<const __m128i*>(codes + 32 * j);
            const __m128i a = _mm_maddubs_epi16(_mm_shuffle_epi8(_mm_load_si128(at), to_pairs), one_sixteen);
            const __m128i b = _mm_maddubs_epi16(_mm_shuffle_epi8(_mm_load_si128(at + 1), to_pairs), one_sixteen);
            _mm_store_si128(reinterpret_cast<__m128i*>(lanes + 16 * j), _mm_packus_epi16(a, b));
          }
          uint8_t* out = panel + panel_codes<T>() + 4 * r;
          for (int c = 0; c < 32; ++c) std::memcpy(out + c * chunk_bytes<T>(), lanes + 4 * c, 4);
          continue;
        }
        if constexpr (T == kQ6_K) {   // 6-bit codes: chunk c's half h takes c0..c3 = q(2h), q(2h + 4), q(2h + 1),
          // q(2h + 5) of its 8 codes (`order`): the same shuffle gives each half's four as one 32-bit lane x, whose
          // A = c0 | c1 << 6 | (c3 & 15) << 12 and B = c2 | (c3 >> 4) << 6 are shifts and masks, 4 halves a vector
          const __m128i to_pairs = _mm_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
          const __m128i six = _mm_set1_epi32(63), four = _mm_set1_epi32(15);
          alignas(16) uint32_t a32[64], b32[64];
          for (int v = 0; v < 16; ++v) {
            const __m128i x = _mm_shuffle_epi8(_mm_load_si128(reinterpret_cast<const __m128i*>(codes + 16 * v)),
                                               to_pairs);
            const __m128i a = _mm_or_si128(
                _mm_or_si128(_mm_and_si128(x, six), _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(x, 8), six), 6)),
                _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(x, 24), four), 12));
            const __m128i b = _mm_or_si128(_mm_and_si128(_mm_srli_epi32(x, 16), six),
                                           _mm_slli_epi32(_mm_srli_epi32(x, 28), 6));
            _mm_store_si128(reinterpret_cast<__m128i*>(a32 + 4 * v), a);
            _mm_store_si128(reinterpret_cast<__m128i*>(b32 + 4 * v), b);
          }
          for (int c = 0; c < 32; ++c) {
            uint8_t* chunk = panel + panel_codes<T>() + c * chunk_bytes<T>();
            const uint16_t a[2] = {static_cast<uint16_t>(a32[2 * c]), static_cast<uint16_t>(a32[2 * c + 1])};
            std::memcpy(chunk + 4 * r, a, 4);
            chunk[32 + 2 * r] = static_cast<uint8_t>(b32[2 * c]);
            chunk[32 + 2 * r + 1] = static_cast<uint8_t>(b32[2 * c + 1]);
          }
          continue;
        }
        for (int c = 0; c < 32; ++c) {             // Q8_0: 2 pairs a vector: bytes first(i), first(i + 1),
          const uint8_t* o = order[c].data();      // second(i), second(i + 1) (i = 2v): a shift pair sign-extends
          for (int v = 0; v < 2; ++v) {
            const uint8_t bytes[4] = {codes[o[4 * v]], codes[o[4 * v + 2]], codes[o[4 * v + 1]], codes[o[4 * v + 3]]};
            std::memcpy(panel + panel_codes<T>() + c * 64 + 32 * v + 4 * r, bytes, 4);
          }
        }
      }
    }
  }
}

// A stored row back from its panels (row r of rows repacked by repack_rows; out: the stored row's bytes), for what
// reads rows one at a time: the embedding, when its table is the tied lm_head's repacked rows. repack_typed moves
// bits and computes none (each panel bit is one stored bit: codes, scales, d), so a table per type, made once by
// repacking one-hot groups, gives each stored bit of a panel's row r its place in the panel: about 2 ns a bit,
// 20 us for a 2,560-wide Q6_K row.
template <int32_t T>
const std::vector<uint16_t>& stored_bit_places() {
  static const std::vector<uint16_t> places = [] {
    const int64_t gb = group_bytes(T), pb = panel_bytes<T>();
    std::vector<uint16_t> at(pb * 8, 0xFFFF);             // [(row * gb + byte) * 8 + bit]: a bit of the panel
    std::vector<uint8_t> src(pb), dst(pb);
    for (int64_t i = 0; i < pb * 8; ++i) {
      std::fill(src.begin(), src.end(), 0);
      src[i / 8] = static_cast<uint8_t>(1u << (i % 8));
      repack_typed<T>(src.data(), kPanelRows, kGroup, dst.data());
      for (int64_t b = 0; b < pb; ++b)
        if (dst[b] != 0) at[i] = static_cast<uint16_t>(8 * b + __builtin_ctz(dst[b]));
    }
    return at;
  }();
  return places;
}

template <int32_t T>
void stored_row_typed(const uint8_t* rows, int64_t row_bytes, int64_t k, int64_t r, uint8_t* out) {
  const int64_t gb = group_bytes(T), pb = panel_bytes<T>(), ng = k / kGroup;
  const uint16_t* at = stored_bit_places<T>().data() + (r % kPanelRows) * gb * 8;
  const uint8_t* block = rows + (r / kPanelRows) * kPanelRows * row_bytes;
  for (int64_t g = 0; g < ng; ++g) {
    const uint8_t* panel = block + g * pb;
    uint8_t* o = out + g * gb;
    for (int64_t byte = 0; byte < gb; ++byte) {
      unsigned v = 0;
      for (int bit = 0; bit < 8; ++bit) {
        const uint16_t p = at[8 * byte + bit];
        v |= ((panel[p >> 3] >> (p & 7)) & 1u) << bit;
      }
      o[byte] = static_cast<uint8_t>(v);
    }
  }
}

// Byte offset of 32-bit word w (0..7: the even vector's, 8..15: the odd one's) of block j in a group's x record:
// natural (2 rows or fewer) or lanes layout
template <bool Lanes>
constexpr int64_t x_word(int j, int w) {
  return Lanes ? 32 * (8 * ((w % 8) / 4) + 4 * (w / 8) + w % 4) + 4 * j : 64 * j + 4 * w;
}

// s + the pairs' products of a and b (int16) summed in 32-bit lanes: one VNNI instruction where the CPU has it
// (AVX512-VNNI with VL, or AVX-VNNI), else a multiply-add and an add (the same exact integers)
inline __m256i dot_add(__m256i s, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(s, a, b);
#elif defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(s, a, b);
#else
  return _mm256_add_epi32(s, _mm256_madd_epi16(a, b));
#endif
}

// Independent sums a block's products go to (then added: exact integers, any order), so that the adds' chain is
// not the bound: VNNI's multiply-add-accumulate has a few cycles' latency (one sum a panel kept Zen 4 at a third
// of its rate), AVX2's add one (kChains in all, over a tile's P x BB sums: more would spill)
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
constexpr int kChains = 8;
#else
constexpr int kChains = 4;
#endif

// A panel's scales for the epilogue (8 rows each): Q4_K ab[j] = d sc[j], ab[8 + j] = -(dmin m[j]); Q6_K ab[j] =
// d sc[2j], ab[8 + j] = d sc[2j + 1] (as group_scales gives them, lane j there)
template <int32_t T>
inline void panel_scales(const uint8_t* panel, __m256* ab) {
  if constexpr (T == kQ8_0 || T == kQ4_0 || T == kQ4_1) {   // d (Q4_1: and m) of each block, 0 for the others'
    for (int j = 0; j < 8; ++j) {
      ab[j] = _mm256_cvtph_ps(load16(panel + 16 * j));
      ab[8 + j] = T == kQ4_1 ? _mm256_cvtph_ps(load16(panel + 128 + 16 * j)) : _mm256_setzero_ps();
    }
    return;
  }
  const __m256 d = _mm256_cvtph_ps(load16(panel));
  if constexpr (T == kQ6_K) {
    for (int j = 0; j < 8; ++j)
      for (int h = 0; h < 2; ++h) {
        const __m128i sc = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(panel + 16 + 8 * (2 * j + h)));
        ab[8 * h + j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), d);
      }
    return;
  }
  const __m256 neg_dmin = _mm256_xor_ps(_mm256_cvtph_ps(load16(panel + 16)), _mm256_set1_ps(-0.f));
  const __m256i lo03 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + 32));
  const __m256i lo47 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + 64));
  const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + 96));
  const __m256i f = _mm256_set1_epi8(15), t = _mm256_set1_epi8(0x30);
  const __m256i sc03 = _mm256_or_si256(_mm256_and_si256(lo03, f), _mm256_and_si256(_mm256_slli_epi16(hi, 4), t));
  const __m256i m03 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo03, 4), f),
                                      _mm256_and_si256(_mm256_slli_epi16(hi, 2), t));
  const __m256i sc47 = _mm256_or_si256(_mm256_and_si256(lo47, f), _mm256_and_si256(hi, t));
  const __m256i m47 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo47, 4), f),
                                      _mm256_and_si256(_mm256_srli_epi16(hi, 2), t));
  const __m256i byte = _mm256_set1_epi32(255);
  auto at = [&](__m256i v, int b) {
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8 * b), byte));
  };
  for (int b = 0; b < 4; ++b) {
    ab[b] = _mm256_mul_ps(at(sc03, b), d);
    ab[4 + b] = _mm256_mul_ps(at(sc47, b), d);
    ab[8 + b] = _mm256_mul_ps(at(m03, b), neg_dmin);
    ab[12 + b] = _mm256_mul_ps(at(m47, b), neg_dmin);
  }
}

// ---- the panels' vectors: panel_tile is written once for two widths. Vec8: a 256-bit vector holds one panel's 8
// rows (32-bit lane r: row r). Vec16 (AVX-512 VNNI builds): a 512-bit vector holds two panels' 16 rows (lanes 0-7
// the first panel's, 8-15 the next one's), so a multiply-add of two panels' codes by a broadcast word of x adds to
// 16 rows' block sums at once: a core whose VPDPWSSD runs as many 512-bit instructions a cycle as 256-bit ones
// (Zen 5: 2 of either, a microbenchmark here) takes twice the products a cycle, and every decoding instruction
// serves 16 rows. The integer sums are the same exact integers at either width, and the epilogue the same
// instructions lane by lane (each lane's floats in the same order), so the outputs are the same bits.
struct Vec8 {
  using I = __m256i;
  using F = __m256;
  static constexpr int kPanels = 1;           // panels a vector holds
  static constexpr int kSums = kChains;       // accumulators a pass keeps apart per sum
  static I zero() { return _mm256_setzero_si256(); }
  static I set16(int16_t v) { return _mm256_set1_epi16(v); }
  static I set32(int32_t v) { return _mm256_set1_epi32(v); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I srli16(I a, int n) { return _mm256_srli_epi16(a, n); }
  static I slli16(I a, int n) { return _mm256_slli_epi16(a, n); }
  static I srai16(I a, int n) { return _mm256_srai_epi16(a, n); }
  static I add32(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub32(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I srai32(I a, int n) { return _mm256_srai_epi32(a, n); }
  static I dot(I s, I a, I b) { return dot_add(s, a, b); }
  // (a sum kept in its register where it is made: else GCC re-associates a block's 16 adds into a tree whose 16
  // products, all live at once, spill to the stack: 1.5x slower)
  static void keep(I& s) { asm("" : "+x"(s)); }
  static F fzero() { return _mm256_setzero_ps(); }
  static F fset(float v) { return _mm256_set1_ps(v); }
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  // A chunk's code vectors (the chunk at byte `at` of each panel) as codes_of takes them: q its first 32 bytes; hv
  // Q8_0's next 32, Q6_K's 16 bytes B widened to 16-bit halves (byte t to half t), else unused
  template <int32_t T>
  static void chunk(const uint8_t* const* panel, int64_t at, I* q, I* hv) {
    const uint8_t* c = panel[0] + at;
    *q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
    *hv = T == kQ6_K ? _mm256_cvtepu8_epi16(load16(c + 32))
          : T == kQ8_0 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32)) : _mm256_setzero_si256();
  }
  template <int32_t T>
  static void scales(const uint8_t* const* panel, F* ab) { panel_scales<T>(panel[0], ab); }
  // The rows' outputs (y[r]: lane r) from their 8 accumulators: sum8's tree, lane by lane
  static void sums(const F* a, float* y) {
    _mm256_store_ps(y, _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a[0], a[4]), _mm256_add_ps(a[2], a[6])),
                                     _mm256_add_ps(_mm256_add_ps(a[1], a[5]), _mm256_add_ps(a[3], a[7]))));
  }
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define LLM_SERVING_PANELS_512 1
inline __m512i pair512(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
inline __m512 pair512(__m256 lo, __m256 hi) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

struct Vec16 {
  using I = __m512i;
  using F = __m512;
  static constexpr int kPanels = 2;
  static constexpr int kSums = 12;            // (VPDPWSSD's latency against its two a cycle)
  static I zero() { return _mm512_setzero_si512(); }
  static I set16(int16_t v) { return _mm512_set1_epi16(v); }
  static I set32(int32_t v) { return _mm512_set1_epi32(v); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static I srli16(I a, int n) { return _mm512_srli_epi16(a, n); }
  static I slli16(I a, int n) { return _mm512_slli_epi16(a, n); }
  static I srai16(I a, int n) { return _mm512_srai_epi16(a, n); }
  static I add32(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub32(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I srai32(I a, int n) { return _mm512_srai_epi32(a, n); }
  static I dot(I s, I a, I b) { return _mm512_dpwssd_epi32(s, a, b); }
  static void keep(I& s) { asm("" : "+v"(s)); }
  static F fzero() { return _mm512_setzero_ps(); }
  static F fset(float v) { return _mm512_set1_ps(v); }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  // Vec8::chunk of two panels (panel[0]'s chunk: lanes 0-7, panel[1]'s: 8-15), each half loaded as Vec8's
  template <int32_t T>
  static void chunk(const uint8_t* const* panel, int64_t at, I* q, I* hv) {
    auto v32 = [](const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
    const uint8_t *c0 = panel[0] + at, *c1 = panel[1] + at;
    *q = pair512(v32(c0), v32(c1));
    if constexpr (T == kQ6_K)
      *hv = _mm512_cvtepu8_epi16(_mm256_inserti128_si256(_mm256_castsi128_si256(load16(c0 + 32)), load16(c1 + 32), 1));
    else if constexpr (T == kQ8_0) *hv = pair512(v32(c0 + 32), v32(c1 + 32));
    else *hv = _mm512_setzero_si512();
  }
  template <int32_t T>
  static void scales(const uint8_t* const* panel, F* ab) {
    __m256 lo[16], hi[16];
    panel_scales<T>(panel[0], lo);
    panel_scales<T>(panel[1], hi);
    for (int q = 0; q < 16; ++q) ab[q] = pair512(lo[q], hi[q]);
  }
  static void sums(const F* a, float* y) {
    _mm512_store_ps(y, _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[4]), _mm512_add_ps(a[2], a[6])),
                                     _mm512_add_ps(_mm512_add_ps(a[1], a[5]), _mm512_add_ps(a[3], a[7]))));
  }
};
#endif

// Pair i's codes of a chunk (lanes: rows), from its vectors (V::chunk)
template <class V, int32_t T>
inline typename V::I codes_of(typename V::I q, typename V::I hv, int i) {
  if constexpr (T == kQ8_0) {                    // q: pairs 0, 1; hv: pairs 2, 3 (bytes sign-extended in place)
    const typename V::I v = i < 2 ? q : hv;
    return i % 2 == 0 ? V::srai16(V::slli16(v, 8), 8) : V::srai16(v, 8);
  } else if constexpr (T == kQ6_K) {
    const typename V::I six = V::set16(63);
    if (i == 0) return V::and_(q, six);
    if (i == 1) return V::and_(V::srli16(q, 6), six);
    if (i == 2) return V::and_(hv, six);
    return V::or_(V::srli16(q, 12), V::and_(V::srli16(hv, 2), V::set16(48)));
  } else {
    (void)hv;
    const typename V::I nib = V::set16(15);
    return i == 3 ? V::srli16(q, 12) : V::and_(i == 0 ? q : V::srli16(q, 4 * i), nib);
  }
}

// Up to this many rows of x, a 4-bit type's panels take pair i's codes in place, times 16^i (an and each; pair 3 a
// shift): 4 instructions a chunk where codes_of takes 6. Each pair's sums are kept apart (pair 0 and 3's
// together), exact in int32 (15 x 256 x 2^15 x 2 x 4 chunks < 2^31), and shifted back once a block (panel_tile's total).
// One row of x on a Zen 4 built for AVX2, Q4_K in cache: 22.3 -> 20.5 cycles per 256 weights; on Vec16's passes
// there (bench/repack.py --m 1, three rounds, ratios to the stored rows) Q4_K 1.58-1.64x -> 1.69-1.77x, Q4_0
// 1.89-1.92x -> 1.96-2.11x. With more rows the decoding is shared by the rows and the extra sums cost more than it
// saves (2 rows: 34.3 -> 35.8-38.2 cycles).
constexpr int kAndOnlyRows = 1;

template <int32_t T>
constexpr bool and_only(int bb) { return (T == kQ4_K || T == kQ4_0 || T == kQ4_1) && bb <= kAndOnlyRows; }

template <class V>
inline typename V::I nibbles_in_place(typename V::I q, int i) {
  if (i == 3) return V::srli16(q, 12);
  return V::and_(q, V::set16(static_cast<int16_t>(15 << (4 * i))));
}

// P vectors of panels (P x V::kPanels panels of 8 weight rows; panel p's row-block at w + p * pstride) times BB
// rows of x (packed in the Lanes layout or not, stride xstride) over the ng groups: acc[(z * BB + b) * 8 + j] (lane
// r: row r of vector z's panels) the epilogue's 8 accumulators, from zero. Per chunk of codes: one load, its 4
// vectors decoded once for the BB rows of x.
template <class V, int32_t T, int P, int BB, bool Lanes>
void panel_tile(const uint8_t* w, int64_t pstride, int64_t ng, const uint8_t* xp, int64_t xstride,
                typename V::F* acc) {
  using I = typename V::I;
  using F = typename V::F;
  constexpr int NP = P * V::kPanels;
  constexpr bool AO = and_only<T>(BB);   // sums: pairs 0 and 3, pair 1 (x 16), pair 2 (x 256)
  constexpr int C = AO ? 3 : V::kSums / (P * BB) > 1 ? V::kSums / (P * BB) : 1;      // each sum's chains
  constexpr int64_t PB = panel_bytes<T>();
  for (int i = 0; i < P * BB * 8; ++i) acc[i] = V::fzero();
  for (int64_t g = 0; g < ng; ++g) {
    const uint8_t* panel[NP];
    F ab[P][16];
    for (int z = 0; z < P; ++z) {
      for (int h = 0; h < V::kPanels; ++h) {
        const int p = z * V::kPanels + h;
        panel[p] = w + p * pstride + g * PB;
        // the same group of the row-blocks the next call takes (NP row-blocks on; the rows of a thread's chunk are
        // consecutive), asked for a call ahead as the stored rows' decoders do (kAhead rows): a row-block's own
        // next panels, a few hundred bytes on, are the hardware prefetcher's. One row of x only: with more, the
        // call makes a pass per few rows of x over the same panels, and asking each pass for the next call's bytes
        // again gained nothing (bench/repack.py, 4-256 rows)
        if constexpr (BB == 1)
          for (int at = 0; at < PB; at += 64)
            _mm_prefetch(reinterpret_cast<const char*>(panel[p] + NP * pstride + at), _MM_HINT_T1);
      }
      V::template scales<T>(panel + z * V::kPanels, ab[z]);
    }
    const uint8_t* xg = xp + g * kXRecord;
    for (int j = 0; j < 8; ++j) {
      I s[P][BB][C];
      auto clear = [&] {
        for (int z = 0; z < P; ++z)
          for (int b = 0; b < BB; ++b)
            for (int q = 0; q < C; ++q) s[z][b][q] = V::zero();
      };
      auto total = [&](int z, int b) {
        if constexpr (AO)
          return V::add32(V::add32(s[z][b][0], V::srai32(s[z][b][1], 4)), V::srai32(s[z][b][2], 8));
        I t = s[z][b][0];
        for (int q = 1; q < C; ++q) t = V::add32(t, s[z][b][q]);
        return t;
      };
      clear();
      // (every loop below unrolled: its indices pick registers, shifts and offsets at compile time; GCC left
      // Q6_K's rolled, its sums in memory: 3x slower)
#pragma GCC unroll 4
      for (int l = 0; l < 4; ++l) {
        const int64_t at = panel_codes<T>() + (4 * j + l) * chunk_bytes<T>();
        I v[P], hv[P];
        for (int z = 0; z < P; ++z) V::template chunk<T>(panel + z * V::kPanels, at, &v[z], &hv[z]);
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
          I cv[P];
          for (int z = 0; z < P; ++z) cv[z] = AO ? nibbles_in_place<V>(v[z], i) : codes_of<V, T>(v[z], hv[z], i);
          const int word = i < 2 ? 2 * l + i : 8 + 2 * l + i - 2;
          for (int b = 0; b < BB; ++b) {
            int32_t xw;
            std::memcpy(&xw, xg + b * xstride + x_word<Lanes>(j, word), 4);
            const I xb = V::set32(xw);
            for (int z = 0; z < P; ++z) {
              I& sum = s[z][b][AO ? i % 3 : i % C];
              sum = V::dot(sum, cv[z], xb);
              V::keep(sum);
            }
          }
        }
        if (T == kQ6_K && l == 1) {
          // the block's first 16 weights (their own scale): scaled into the accumulators at once, before the
          // second 16's, the header's order, so that no second set of sums holds registers through the block
          for (int b = 0; b < BB; ++b) {
            const float* xf = reinterpret_cast<const float*>(xg + b * xstride + kXFloats);
            const F sx = V::fset(xf[j]);
            int32_t na;
            std::memcpy(&na, xf + 16 + j, 4);
            for (int z = 0; z < P; ++z) {
              const I lo = V::sub32(total(z, b), V::set32(na << 5));   // q - 32: 32 sum(n) off
              F& a = acc[(z * BB + b) * 8 + j];
              a = V::fmadd(V::cvt(lo), V::mul(sx, ab[z][j]), a);
            }
          }
          clear();
        }
      }
      for (int b = 0; b < BB; ++b) {
        const float* xf = reinterpret_cast<const float*>(xg + b * xstride + kXFloats);
        const F sx = V::fset(xf[j]);
        for (int z = 0; z < P; ++z) {
          F& a = acc[(z * BB + b) * 8 + j];
          if constexpr (T == kQ6_K) {          // the second 16 weights
            int32_t nb;
            std::memcpy(&nb, xf + 24 + j, 4);
            const I hi = V::sub32(total(z, b), V::set32(nb << 5));
            a = V::fmadd(V::cvt(hi), V::mul(sx, ab[z][8 + j]), a);
          } else if constexpr (kind_of(T) == kOffset) {    // Q4_K, Q4_1: + b xs
            a = V::fmadd(V::cvt(total(z, b)), V::mul(sx, ab[z][j]), a);
            a = V::fmadd(ab[z][8 + j], V::fset(xf[8 + j]), a);
          } else {                                          // Q8_0; Q4_0: q - 8, 8 x (the block's sum of n) off
            I t = total(z, b);
            if constexpr (bias_of(T) != 0) {
              int32_t na, nb;
              std::memcpy(&na, xf + 16 + j, 4);
              std::memcpy(&nb, xf + 24 + j, 4);
              t = V::sub32(t, V::set32((na + nb) * bias_of(T)));
            }
            a = V::fmadd(V::cvt(t), V::mul(sx, ab[z][j]), a);
          }
        }
      }
    }
  }
}

// out[i * ldo + b] for P vectors of panels from row-block w (row_bytes: a stored row's bytes, so a row-block is 8
// x row_bytes) and BB rows of x
template <class V, int32_t T, int P, int BB, bool Lanes>
void panel_out(const uint8_t* w, int64_t row_bytes, int64_t ng, const uint8_t* xp, int64_t xstride, float* out,
               int64_t ldo) {
  constexpr int R = V::kPanels * kPanelRows;          // rows a vector holds
  typename V::F acc[P * BB * 8];
  panel_tile<V, T, P, BB, Lanes>(w, kPanelRows * row_bytes, ng, xp, xstride, acc);
  for (int z = 0; z < P; ++z)
    for (int b = 0; b < BB; ++b) {
      alignas(64) float y[R];
      V::sums(acc + (z * BB + b) * 8, y);
      for (int r = 0; r < R; ++r) out[(z * R + r) * ldo + b] = y[r];
    }
}

// Rows of x a pass of panel_tile takes at most: each chunk of codes is decoded once for them.
// - Vec8: six, not four, where the registers allow (two panels' 12 sums): 3-5% faster for Q4_K, Q8_0, Q4_0, Q4_1
//   on a Zen 4, AVX2 or VNNI (bench/repack.py); Q6_K's decoding wants the registers (6 rows: 0.94x with VNNI; no
//   faster than 4 on a Zen 3 built for AVX2, where 4 ran 1.18-1.23x the stored rows' tiles at 256 rows and 6
//   1.09-1.12x).
// - Vec16: six for every type, two pairs of panels' 12 sums in registers of the 32. On a Zen 5 (bench/repack.py at
//   k = 2,560, 128-row tiles, ratios to the stored rows), 8 rows ran the same within the machine's noise (Q4_K at
//   275 rows 2.18x against 2.10x, at 64 rows 1.78x against 1.92x).
template <class V, int32_t T>
constexpr int64_t pass_rows() { return V::kPanels == 1 && T == kQ6_K ? 4 : 6; }

// P vectors of panels from row-block w times bb (1..pass_rows) rows of x, x in the lanes layout or not
template <class V, int32_t T, int P>
void panels_x(bool lanes, int64_t bb, const uint8_t* w, int64_t row_bytes, int64_t ng, const uint8_t* x,
              int64_t xstride, float* o, int64_t ldo) {
  auto run = [&](auto lanes_c, auto rows_c) {
    panel_out<V, T, P, decltype(rows_c)::value, decltype(lanes_c)::value>(w, row_bytes, ng, x, xstride, o, ldo);
  };
  auto rows = [&](auto lanes_c) {
    switch (bb) {
      case 1: run(lanes_c, std::integral_constant<int, 1>{}); break;
      case 2: run(lanes_c, std::integral_constant<int, 2>{}); break;
      case 3: run(lanes_c, std::integral_constant<int, 3>{}); break;
      case 4: run(lanes_c, std::integral_constant<int, 4>{}); break;
      case 5: if constexpr (pass_rows<V, T>() >= 5) run(lanes_c, std::integral_constant<int, 5>{}); break;
      default: if constexpr (pass_rows<V, T>() >= 6) run(lanes_c, std::integral_constant<int, 6>{}); break;
    }
  };
  if (lanes) rows(std::true_type{});
  else rows(std::false_type{});
}

// out[i * ldo + b] for n (a multiple of 8, <= kPanelTileRows) repacked rows of type T (+ kRepacked) from row-block
// `rows` and m rows of x, pass_rows rows of x at a time, two vectors of panels at a time (x's words broadcast once
// for their rows), the panels read in place at every row count (no buffer: the stored rows' products take wbuf).
// AVX-512 VNNI builds take Vec16's passes at every row count (on a Zen 5, 1.2-1.6x Vec8's from 1 to 256 rows,
// bench/repack.py), a last panel alone (n not a multiple of 16) Vec8's.
template <int32_t T>
void product_repacked(const uint8_t* rows, int64_t row_bytes, int64_t k, int64_t n, const uint8_t* xp, int64_t m,
                      uint8_t* /*wbuf*/, float* out, int64_t ldo) {
#if defined(LLM_SERVING_PANELS_512)
  using V = Vec16;
#else
  using V = Vec8;
#endif
  constexpr int64_t pass = pass_rows<V, T>(), R = V::kPanels * kPanelRows;
  const int64_t ng = groups(k), xstride = x_bytes(k);
  const bool lanes = lanes_layout(m);                 // (how pack_rows packed x for m rows)
  for (int64_t b0 = 0; b0 < m; b0 += pass) {
    const int64_t bb = std::min<int64_t>(pass, m - b0);
    const uint8_t* x = xp + b0 * xstride;
    float* o = out + b0;
    int64_t r = 0;
    for (; r + 2 * R <= n; r += 2 * R)
      panels_x<V, T, 2>(lanes, bb, rows + r * row_bytes, row_bytes, ng, x, xstride, o + r * ldo, ldo);
    for (; r + R <= n; r += R)
      panels_x<V, T, 1>(lanes, bb, rows + r * row_bytes, row_bytes, ng, x, xstride, o + r * ldo, ldo);
    if constexpr (V::kPanels > 1) {
      constexpr int64_t pass8 = pass_rows<Vec8, T>();
      for (; r < n; r += kPanelRows)
        for (int64_t b1 = 0; b1 < bb; b1 += pass8)
          panels_x<Vec8, T, 1>(lanes, std::min<int64_t>(pass8, bb - b1), rows + r * row_bytes, row_bytes, ng,
                               x + b1 * xstride, xstride, o + r * ldo + b1, ldo);
    }
  }
}

template <int32_t T>
void product_typed(const uint8_t* rows, int64_t row_bytes, int64_t k, int64_t n, const uint8_t* xp, int64_t m,
                   uint8_t* wbuf, float* out, int64_t ldo) {
  const int64_t xstride = x_bytes(k);
  if (m == 1) {
    fused<T, 1>(rows, row_bytes, k, n, xp, xstride, out, ldo);
  } else if (m == 2 && kFusedRows >= 2) {
    fused<T, 2>(rows, row_bytes, k, n, xp, xstride, out, ldo);
  } else {
    unpack<T>(rows, row_bytes, k, n, wbuf);
    tiles<kind_of(T), bias_of(T)>(wbuf, k, n, xp, m, reinterpret_cast<float*>(wbuf + n * w_bytes(k)), out, ldo);
  }
}

#if defined(LLM_SERVING_INT_TYPE)

// ---- this unit's type: its entry points, entered in the library's table when it loads

namespace {
constexpr int32_t kUnitType = LLM_SERVING_INT_TYPE;
static_assert(integer_type(kUnitType), "LLM_SERVING_INT_TYPE: a type these products read");

TypeOps unit_ops() {
  TypeOps ops{&product_typed<kUnitType>, nullptr, nullptr, nullptr};
  if constexpr (repackable(kUnitType)) {
    ops.product_repacked = &product_repacked<kUnitType>;
    ops.repack = &repack_typed<kUnitType>;
    ops.stored_row = &stored_row_typed<kUnitType>;
  }
  return ops;
}

const bool entered = enter_type(kUnitType, unit_ops());
}  // namespace

#else

// ---- the table of the types linked, and the entry points that look a type up in it

namespace {
constexpr int32_t kTableTypes = 64;               // stored types' codes (MXFP4's 39 the largest read)
static_assert(kMXFP4 < kTableTypes, "a stored type's code indexes the table");
TypeOps table[kTableTypes];                       // (zeros until the types' units enter themselves, at load)

// The entry of stored type `type`, or nullptr: not one these products read, or its unit not linked
const TypeOps* ops_of(int32_t type) {
  return type >= 0 && type < kTableTypes && table[type].product != nullptr ? &table[type] : nullptr;
}
}  // namespace

bool enter_type(int32_t type, const TypeOps& ops) {
  table[type] = ops;
  return true;
}

bool reads(int32_t type) {
  const bool repacked = type >= kRepacked;
  const TypeOps* ops = ops_of(repacked ? type - kRepacked : type);
  return ops != nullptr && (!repacked || ops->product_repacked != nullptr);
}

int32_t repacked_type(int32_t type, int64_t rows, int64_t k) {
  const TypeOps* ops = ops_of(type);
  return ops != nullptr && ops->repack != nullptr && rows > 0 && rows % kPanelRows == 0 && k > 0 &&
                 k % kGroup == 0 ? type + kRepacked : 0;
}

void repack_rows(int32_t type, const uint8_t* src, int64_t rows, int64_t k, uint8_t* dst) {
  ops_of(type)->repack(src, rows, k, dst);                  // (a type repacked_type repacks)
}

// type: a repacked type (repacked_type's); k a multiple of kGroup
void stored_row(int32_t type, const uint8_t* rows, int64_t row_bytes, int64_t k, int64_t r, uint8_t* out) {
  ops_of(type - kRepacked)->stored_row(rows, row_bytes, k, r, out);
}

void product(int32_t type, const uint8_t* rows, int64_t row_bytes, int64_t k, int64_t n, const uint8_t* xp,
             int64_t m, uint8_t* wbuf, float* out, int64_t ldo) {       // (reads(type))
  if (type >= kRepacked) {
    ops_of(type - kRepacked)->product_repacked(rows, row_bytes, k, n, xp, m, wbuf, out, ldo);
  } else {
    ops_of(type)->product(rows, row_bytes, k, n, xp, m, wbuf, out, ldo);
  }
}

#endif

}  // namespace avx2_int
}  // namespace llm_serving

#pragma GCC pop_options

#pragma GCC visibility pop

#endif
