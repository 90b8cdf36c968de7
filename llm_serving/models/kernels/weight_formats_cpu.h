// The weight types DecoderLayer, FinalLogits, MoeMlp and EmbedTokens read (GGML's type codes; the repacked ones
// this library's own), a row's bytes of each, and each type's blocks decoded to floats in registers: blocks of 32
// (decode_block) and the K-quants' super-blocks of 256 (unpack_scales, decode_group).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "float_products_cpu.h"
#include "weight_types.h"

namespace {

using namespace llm_serving::weight_types;      // the types' codes (kQ4_K, kQ4_K_R8, ...) and blocks

// Whether DecoderLayer and FinalLogits take a matrix of this type (MXFP4, gpt-oss's experts' type, only MoeMlp
// and the dequantizing readers: the few-row decoders of weight_matrix_cpu.h have no MXFP4 case)
inline bool layer_type(int32_t type) { return type != kMXFP4; }

// A type this library repacked at load (RepackRows), which only gemm_avx2_int.h's products read
inline bool repacked(int32_t type) { return is_repacked(type); }

// Bytes of one row of k weights of `type`, or -1: a type these kernels do not read, or k not whole blocks (a
// repacked type: not whole groups of its panels)
int64_t row_bytes_of(int32_t type, int64_t k) {
  switch (type) {
#define LLM_SERVING_ROW_BYTES(name, code, block, bytes, repacked)                                               \
  case code: return k % block ? -1 : k / block * bytes;                                                        \
  LLM_SERVING_ROW_BYTES_##repacked(code, block, bytes)
#define LLM_SERVING_ROW_BYTES_R8(code, block, bytes) \
  case code + kRepacked: return k % kRepackGroup ? -1 : k / block * bytes;
#define LLM_SERVING_ROW_BYTES_NONE(code, block, bytes)
    LLM_SERVING_WEIGHT_TYPES(LLM_SERVING_ROW_BYTES)
    default: return -1;
  }
}

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);                     // inf, nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);             // normal
  } else if (man == 0) {
    bits = sign;                                                 // zero
  } else {                                                       // subnormal: renormalize
    int e = -1;
    uint32_t m = man;
    do { ++e; m <<= 1; } while ((m & 0x400u) == 0);
    bits = sign | ((112 - e) << 23) | ((m & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// 16 bytes at p as 16 floats: the low nibbles, the high nibbles, or signed bytes (GCC's generic vector
// conversions go through scalar code here, so the x86 widening instructions are named where they exist)
#if defined(__AVX512F__) && defined(__AVX512BW__)
inline v16 low_nibbles(const uint8_t* p) {
  const __m128i q = _mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), _mm_set1_epi8(15));
  return (v16)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q));
}
inline v16 high_nibbles(const uint8_t* p) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (v16)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(15))));
}
inline v16 signed_bytes(const uint8_t* p) {
  return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline v16 halves(const uint8_t* p) {
  return (v16)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline v16 bfloats(const uint8_t* p) {           // 16 bfloat16s: the top halves of float32s
  const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return (v16)_mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
}
#elif defined(__AVX2__) && defined(__F16C__)
// AVX2: each half of 8 through its 256-bit widening, the halves joined (the scalar loops below ran a Q4_1 row at
// 0.8 GB/s on a Zen 3)
inline v16 join(__m256 lo, __m256 hi) {
  v16 v;
  std::memcpy(&v, &lo, sizeof lo);
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof lo, &hi, sizeof hi);
  return v;
}
inline v16 bytes_as_floats(__m128i q) {                   // 16 unsigned bytes
  return join(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8))));
}
inline v16 low_nibbles(const uint8_t* p) {
  return bytes_as_floats(_mm_and_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), _mm_set1_epi8(15)));
}
inline v16 high_nibbles(const uint8_t* p) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return bytes_as_floats(_mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(15)));
}
inline v16 signed_bytes(const uint8_t* p) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return join(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))));
}
inline v16 halves(const uint8_t* p) {
  return join(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
              _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
}
inline v16 bfloats(const uint8_t* p) {           // 16 bfloat16s: the top halves of float32s
  auto eight = [](const uint8_t* q) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
  };
  return join(eight(p), eight(p + 16));
}
#else
inline v16 low_nibbles(const uint8_t* p) {
  v16 v;
  for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(p[i] & 15);
  return v;
}
inline v16 high_nibbles(const uint8_t* p) {
  v16 v;
  for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(p[i] >> 4);
  return v;
}
inline v16 signed_bytes(const uint8_t* p) {
  v16 v;
  for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(static_cast<int8_t>(p[i]));
  return v;
}
inline v16 halves(const uint8_t* p) {
  v16 v;
  for (int i = 0; i < 16; ++i) v[i] = half_to_float(p + 2 * i);
  return v;
}
inline v16 bfloats(const uint8_t* p) {
  v16 v;
  for (int i = 0; i < 16; ++i) {
    const uint32_t bits = static_cast<uint32_t>(p[2 * i] | p[2 * i + 1] << 8) << 16;
    std::memcpy(&v[i], &bits, 4);
  }
  return v;
}
#endif

// The 5-bit and super-block decoders below also use masks, byte tests and lane permutes (AVX-512 VL/BW): a
// 4-bit code becomes its weight by one permute of a 16-float table (the code's value times the block's scale,
// minus its minimum), computed once per (sub-)block, instead of a widening, a conversion and a multiply-add.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define LLM_SERVING_AVX512 1
inline __m128i load_bytes16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m512 iota16() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
#endif


inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }

// A block of 32 weights of type T (F16: 32 halves): its bytes, and (decode_block) at p as two vectors: weights
// 0..15 and 16..31.
template <int32_t T>
constexpr int64_t block_bytes() { return bytes_per_32(T); }

// Q5_0 (f16 d, 32 fifth bits, 16 bytes of nibbles: w = d * (q - 16)) and Q5_1 (f16 d, f16 m, fifth bits,
// nibbles: w = d * q + m). Weight i's low 4 bits are byte i's low nibble (i < 16) or byte i-16's high one; its
// fifth bit is bit i of the 32-bit word.
template <int32_t T>
inline void decode_q5(const uint8_t* p, v16* lo, v16* hi) {
  constexpr bool with_min = T == kQ5_1;
  const float d = half_to_float(p);
  const float m = with_min ? half_to_float(p + 2) : -16.f * d;
  uint32_t qh;
  std::memcpy(&qh, p + (with_min ? 4 : 2), 4);
  const uint8_t* qs = p + (with_min ? 8 : 6);
#if defined(LLM_SERVING_AVX512)
  const __m512 table = _mm512_fmadd_ps(iota16(), _mm512_set1_ps(d), _mm512_set1_ps(m));     // q = 0..15
  const __m512 sixteen = _mm512_set1_ps(16.f * d);                                            // the fifth bit
  const __m512i codes = _mm512_cvtepu8_epi32(load_bytes16(qs));    // the permute reads a lane's low 4 bits
  const __m512 l = _mm512_permutexvar_ps(codes, table);
  const __m512 h = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table);
  *lo = (v16)_mm512_mask_add_ps(l, static_cast<__mmask16>(qh & 0xffffu), l, sixteen);
  *hi = (v16)_mm512_mask_add_ps(h, static_cast<__mmask16>(qh >> 16), h, sixteen);
#else
  for (int i = 0; i < 16; ++i) {
    (*lo)[i] = d * static_cast<float>((qs[i] & 15) | ((qh >> i) & 1) << 4) + m;
    (*hi)[i] = d * static_cast<float>((qs[i] >> 4) | ((qh >> (i + 16)) & 1) << 4) + m;
  }
#endif
}

template <int32_t T>
inline void decode_block(const uint8_t* p, v16* lo, v16* hi) {
  if constexpr (T == kQ4_0 || T == kQ4_1) {
    // Q4_0: f16 d, 16 bytes of nibbles: w = d * (q - 8); Q4_1: f16 d, f16 m, 16 bytes: w = d * q + m. The low
    // nibbles are weights 0..15, the high ones 16..31.
    constexpr int at = T == kQ4_0 ? 2 : 4;
    const float d = half_to_float(p), m = T == kQ4_0 ? -8.f * d : half_to_float(p + 2);
#if defined(LLM_SERVING_AVX512)
    const __m512 table = _mm512_fmadd_ps(iota16(), _mm512_set1_ps(d), _mm512_set1_ps(m));     // the 16 weights
    const __m512i codes = _mm512_cvtepu8_epi32(load_bytes16(p + at));    // the permute reads the low 4 bits
    *lo = (v16)_mm512_permutexvar_ps(codes, table);
    *hi = (v16)_mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table);
#else
    *lo = low_nibbles(p + at) * d + m;
    *hi = high_nibbles(p + at) * d + m;
#endif
  } else if constexpr (T == kQ8_0) {                            // f16 d, 32 signed bytes: w = d * q
    const float d = half_to_float(p);
    *lo = signed_bytes(p + 2) * d;
    *hi = signed_bytes(p + 18) * d;
  } else if constexpr (T == kMXFP4) {   // E8M0 e, 16 bytes of nibbles (low: weights 0..15): w = 2^(e-128) * kv[q]
    static const float kv[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};   // E2M1 doubled
    const uint32_t bits = p[0] < 2 ? 0x00200000u << p[0] : static_cast<uint32_t>(p[0] - 1) << 23;
    float d;
    std::memcpy(&d, &bits, 4);
    for (int i = 0; i < 16; ++i) {
      (*lo)[i] = kv[p[1 + i] & 15] * d;
      (*hi)[i] = kv[p[1 + i] >> 4] * d;
    }
  } else if constexpr (T == kQ5_0 || T == kQ5_1) {
    decode_q5<T>(p, lo, hi);
  } else if constexpr (T == kBF16) {
    *lo = bfloats(p);
    *hi = bfloats(p + 32);
  } else {                                                      // F16
    *lo = halves(p);
    *hi = halves(p + 32);
  }
}

// ---- K-quants: super-blocks of 256 weights
//
// Q4_K (144 bytes): f16 d, f16 dmin, 12 bytes packing 8 six-bit scales sc[j] and mins m[j], then 128 bytes of
//   nibbles; sub-block j (weights 32j..32j+31) reads the low (j even) or high (j odd) nibbles of bytes
//   32(j/2)..32(j/2)+31: w = d*sc[j] * q - dmin*m[j].
// Q5_K (176 bytes): as Q4_K with 32 bytes of fifth bits between the scales and the nibbles: weight 32j+l's
//   fifth bit is bit j of byte l; w = d*sc[j] * (q + 16 * bit) - dmin*m[j].
// Q6_K (210 bytes): 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, f16 d. Each half of 128
//   weights reads 64 nibble bytes ql and 32 high bytes qh: weight 32i+l (i < 4, l < 32) is ql[l + 32(i&1)]'s
//   low (i < 2) or high nibble, plus bits 2i..2i+1 of qh[l] as bits 4..5; w = d*sc[16-weight group] * (q - 32).
// A super-block's scales are unpacked once per row (unpack_scales), then its groups decoded (decode_group: 64
// weights for Q4_K/Q5_K, a pair of sub-blocks sharing their bytes; 128 for Q6_K, a half).

template <int32_t T>
constexpr bool is_super() { return super_blocks(T); }
template <int32_t T>
constexpr int64_t super_bytes() { return block_bytes_of(T); }
template <int32_t T>
constexpr int group_weights() { return T == kQ6_K ? 128 : 64; }

// Q4_K/Q5_K: s[j] = d * sc[j], s[8 + j] = dmin * m[j], t[j] = 16 s[j] (the fifth bit's weight);
// Q6_K: s[i] = d * scales[i], t[i] = -32 s[i]
struct alignas(64) SuperScales {
  float s[16];
  float t[16];
};

#if defined(LLM_SERVING_AVX512)
// A Q4_K/Q5_K super-block's 6-bit scales sc[0..7] (bytes 0..7) and minimums m[0..7] (bytes 8..15): bytes 4..15 of
// the block: S0-3 hold sc[0..3] (low 6 bits), S4-7 m[0..3], S8-11 the low 4 bits of sc[4..7] (low nibbles) and
// m[4..7] (high nibbles), whose top 2 bits are the top bits of S0-3 (sc) and S4-7 (m)
inline __m128i six_bits(const uint8_t* p) {
  const __m128i v = load_bytes16(p);
  const __m128i a = _mm_shuffle_epi8(v, _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15));
  const __m128i b = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11));
  const __m128i low = _mm_and_si128(a, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0));
  const __m128i high = _mm_and_si128(_mm_srli_epi16(a, 4), _mm_setr_epi32(0, 0, 0, 0x0f0f0f0f));
  const __m128i top = _mm_and_si128(_mm_srli_epi16(b, 2), _mm_set1_epi8(0x30));      // bits 6-7 -> 4-5
  return _mm_ternarylogic_epi32(low, high, top, 0xFE);                                // low | high | top
}
#endif

template <int32_t T>
inline void unpack_scales(const uint8_t* p, SuperScales* u) {
#if defined(LLM_SERVING_AVX512)
  __m512 s;
  if constexpr (T == kQ6_K) {
    s = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load_bytes16(p + 192))),
                      _mm512_set1_ps(half_to_float(p + 208)));
    _mm512_store_ps(u->t, _mm512_mul_ps(s, _mm512_set1_ps(-32.f)));
  } else {
    const __m128i v = load_bytes16(p);
    const __m128i six = six_bits(p);
    const __m512 dm = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                            _mm512_castps128_ps512(_mm_cvtph_ps(v)));    // [d x 8, dmin x 8]
    s = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(six)), dm);
    if constexpr (T == kQ5_K) _mm512_store_ps(u->t, _mm512_mul_ps(s, _mm512_set1_ps(16.f)));
  }
  _mm512_store_ps(u->s, s);
  // the decoders broadcast single scales: from memory (a load) rather than out of a register (a shuffle each)
  asm volatile("" : "+m"(*u));
#else
  if constexpr (T == kQ6_K) {
    const float d = half_to_float(p + 208);
    for (int i = 0; i < 16; ++i) {
      u->s[i] = d * static_cast<float>(static_cast<int8_t>(p[192 + i]));
      u->t[i] = -32.f * u->s[i];
    }
  } else {
    const float d = half_to_float(p), dmin = half_to_float(p + 2);
    uint32_t a, b, c;                     // bytes 0-3: sc[0..3] (low 6 bits), 4-7: m[0..3], 8-11: low 4 bits of
    std::memcpy(&a, p + 4, 4);            // sc[4..7] and m[4..7] (low and high nibbles), whose top 2 bits are the
    std::memcpy(&b, p + 8, 4);            // top bits of bytes 0-3 (sc) and 4-7 (m)
    std::memcpy(&c, p + 12, 4);
    const uint32_t six[4] = {a & 0x3f3f3f3fu, (c & 0x0f0f0f0fu) | ((a >> 6) & 0x03030303u) << 4,
                             b & 0x3f3f3f3fu, ((c >> 4) & 0x0f0f0f0fu) | ((b >> 6) & 0x03030303u) << 4};
    uint8_t bytes[16];
    std::memcpy(bytes, six, 16);
    for (int i = 0; i < 16; ++i) u->s[i] = (i < 8 ? d : dmin) * static_cast<float>(bytes[i]);
    for (int i = 0; i < 16; ++i) u->t[i] = 16.f * u->s[i];
  }
#endif
}

// Group g of the super-block at p (scales unpacked in u) as group_weights<T>() / 16 vectors, in weight order.
template <int32_t T>
inline void decode_group(const uint8_t* p, const SuperScales& u, int g, v16* w) {
  if constexpr (T == kQ4_K || T == kQ5_K) {
    const int j0 = 2 * g, j1 = 2 * g + 1;                    // the sub-blocks of the low and high nibbles
    const uint8_t* q = p + (T == kQ4_K ? 16 : 48) + 32 * g;
#if defined(LLM_SERVING_AVX512)
    const __m512 table0 = _mm512_fmsub_ps(iota16(), _mm512_set1_ps(u.s[j0]), _mm512_set1_ps(u.s[8 + j0]));
    const __m512 table1 = _mm512_fmsub_ps(iota16(), _mm512_set1_ps(u.s[j1]), _mm512_set1_ps(u.s[8 + j1]));
    const __m512i b0 = _mm512_cvtepu8_epi32(load_bytes16(q)), b1 = _mm512_cvtepu8_epi32(load_bytes16(q + 16));
    __m512 w0 = _mm512_permutexvar_ps(b0, table0), w1 = _mm512_permutexvar_ps(b1, table0);   // low 4 bits only
    __m512 w2 = _mm512_permutexvar_ps(_mm512_srli_epi32(b0, 4), table1);
    __m512 w3 = _mm512_permutexvar_ps(_mm512_srli_epi32(b1, 4), table1);
    if constexpr (T == kQ5_K) {          // the fifth bit adds 16 d sc[j]: a masked add (fewer operations than
      const __m128i h0 = load_bytes16(p + 16), h1 = load_bytes16(p + 32);    // building 5-bit table indices)
      const __m128i bit0 = _mm_set1_epi8(static_cast<char>(1 << j0)), bit1 = _mm_set1_epi8(static_cast<char>(1 << j1));
      const __m512 sixteen0 = _mm512_set1_ps(u.t[j0]), sixteen1 = _mm512_set1_ps(u.t[j1]);
      w0 = _mm512_mask_add_ps(w0, _mm_test_epi8_mask(h0, bit0), w0, sixteen0);
      w1 = _mm512_mask_add_ps(w1, _mm_test_epi8_mask(h1, bit0), w1, sixteen0);
      w2 = _mm512_mask_add_ps(w2, _mm_test_epi8_mask(h0, bit1), w2, sixteen1);
      w3 = _mm512_mask_add_ps(w3, _mm_test_epi8_mask(h1, bit1), w3, sixteen1);
    }
    w[0] = (v16)w0;
    w[1] = (v16)w1;
    w[2] = (v16)w2;
    w[3] = (v16)w3;
#else
    const uint8_t* qh = p + 16;
    for (int l = 0; l < 32; ++l) {
      int lo = q[l] & 15, hi = q[l] >> 4;
      if (T == kQ5_K) {
        lo |= ((qh[l] >> j0) & 1) << 4;
        hi |= ((qh[l] >> j1) & 1) << 4;
      }
      w[l / 16][l % 16] = u.s[j0] * static_cast<float>(lo) - u.s[8 + j0];
      w[2 + l / 16][l % 16] = u.s[j1] * static_cast<float>(hi) - u.s[8 + j1];
    }
#endif
  } else {                                                   // Q6_K, half g
    const uint8_t* ql = p + 64 * g;
    const uint8_t* qh = p + 128 + 32 * g;
    const float* s = u.s + 8 * g;                            // vector v (weights 16v..16v+15 of the half): s[v]
#if defined(LLM_SERVING_AVX512)
    const __m512i h0 = _mm512_cvtepu8_epi32(load_bytes16(qh)), h1 = _mm512_cvtepu8_epi32(load_bytes16(qh + 16));
    const __m512i nibble = _mm512_set1_epi32(15), top = _mm512_set1_epi32(0x30);
    for (int v = 0; v < 8; ++v) {                            // unrolled: the shifts are constants
      const __m512i b = _mm512_cvtepu8_epi32(load_bytes16(ql + 16 * (v & 3)));
      const __m512i low = v < 4 ? _mm512_and_si512(b, nibble) : _mm512_srli_epi32(b, 4);
      const __m512i h = v & 1 ? h1 : h0;
      const int shift = 2 * (v >> 1);                        // the 2 bits at 2i..2i+1 (i = v / 2) go to bits 4..5
      const __m512i high = shift <= 4 ? _mm512_slli_epi32(h, 4 - shift) : _mm512_srli_epi32(h, shift - 4);
      const __m512i code = _mm512_ternarylogic_epi32(low, high, top, 0xF8);     // low | (high & 0x30)
      w[v] = (v16)_mm512_fmadd_ps(_mm512_cvtepi32_ps(code), _mm512_set1_ps(s[v]), _mm512_set1_ps(u.t[8 * g + v]));
    }
#else
    for (int v = 0; v < 8; ++v) {
      for (int l = 0; l < 16; ++l) {
        const int at = 16 * (v & 1) + l;                       // the byte of qh, and of ql's 32-byte half
        const uint8_t b = ql[at + 32 * ((v >> 1) & 1)];
        const int code = (v < 4 ? b & 15 : b >> 4) | ((qh[at] >> (2 * (v >> 1))) & 3) << 4;
        w[v][l] = s[v] * static_cast<float>(code - 32);
      }
    }
#endif
  }
}

}  // namespace
