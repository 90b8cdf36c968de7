// Shared by the CPU kernels (paged_attention_cpu.cc, decoder_layer_cpu.cc): the exponential their softmaxes
// use and the paged attention of one row. kernels/__init__.py hashes this header into every kernel's build.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace llm_serving {

// e^x for x <= 0 (a score minus the row's maximum), in plain arithmetic the compiler vectorises (std::exp is
// a scalar library call: ~2 ms per layer at B=128, 8 heads, 129 keys). Cody-Waite reduction x = n ln2 + r,
// |r| <= ln2/2, then Cephes' degree-6 polynomial for e^r: relative error ~1e-7. Below -87, e^x -> 0.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;   // 2^n, n in [-126, 0]
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// A float16 KV-cache element (IEEE binary16, as MindSpore's and numpy's float16). Converted 16 (AVX-512) or 8
// (F16C) at a time: GCC leaves a loop of _Float16 <-> float casts scalar, 25x slower than the float32 attention.
using Half = _Float16;

// n values into a cache slot of element type Cache (rounded to nearest even for Half).
inline void store_cache(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store_cache(Half* dst, const float* src, int64_t n) {
  int64_t e = 0;
#if defined(__AVX512F__)
  for (; e + 16 <= n; e += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + e),
                        _mm512_cvtps_ph(_mm512_loadu_ps(src + e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
#elif defined(__F16C__)
  for (; e + 8 <= n; e += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + e),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
#endif
  for (; e < n; ++e) dst[e] = static_cast<Half>(src[e]);
}

// n cache values as float32: the values themselves for a float cache, else widened into buf.
inline const float* widened(const float* src, int64_t, float*) { return src; }
inline const float* widened(const Half* src, int64_t n, float* buf) {
  int64_t e = 0;
#if defined(__AVX512F__)
  for (; e + 16 <= n; e += 16) {
    _mm512_storeu_ps(buf + e, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + e))));
  }
#elif defined(__F16C__)
  for (; e + 8 <= n; e += 8) {
    _mm256_storeu_ps(buf + e, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + e))));
  }
#endif
  for (; e < n; ++e) buf[e] = static_cast<float>(src[e]);
  return buf;
}

// Whether a kernel call's cache dtype (MindSpore's name) is float16; float32 otherwise (params_match allows only
// the two for a "cache" parameter).
inline bool is_half(const char* dtype) { return std::strcmp(dtype, "float16") == 0; }

// fn(keys, values) on the caches as their element type: Half* when `half`, else float*.
template <typename Fn>
inline void with_cache(bool half, void* keys, void* values, Fn&& fn) {
  if (half) {
    fn(static_cast<Half*>(keys), static_cast<Half*>(values));
  } else {
    fn(static_cast<float*>(keys), static_cast<float*>(values));
  }
}

struct AttentionShape {
  int64_t kvh, g, d, w, bs;   // KV heads, query heads per KV head, head dim, block-table width, block size
};

// One row's decode attention: its NH = KVH*G query heads qb (NH, D), pre-scaled by 1/sqrt(D), over keys
// 0 .. context-1 read in place through its block table from the flat caches [slots, KVH, D]; tree_bits: of the
// row's last 32 keys, which are visible (bit m = the key m places before the last; -1 = all). Writes ob (NH, D).
// scores: room for NH * W * BS floats. Only KV heads [kv_begin, kv_end) (and their query heads) when given.
// Cache is the cache's element type: float, or Half (pa_config.kv_cache_dtype float16), widened as it is read.
template <typename Cache>
inline void attend_row(const float* qb, const Cache* kc, const Cache* vc, const int32_t* table, int64_t context,
                       uint32_t tree_bits, float* ob, const AttentionShape& sh, float* scores,
                       int64_t kv_begin = 0, int64_t kv_end = -1) {
  const int64_t kvh = sh.kvh, g = sh.g, d = sh.d, bs = sh.bs;
  const int64_t row = kvh * d;                        // floats per cache slot
  const int64_t h0 = kv_begin * g, h1 = (kv_end < 0 ? kvh : kv_end) * g;   // this call's query heads [h0, h1)
  const int64_t n = std::max<int64_t>(0, std::min<int64_t>(context, sh.w * bs));
  auto hidden = [&](int64_t j) {                      // key j masked out by the token tree
    const int64_t m = n - 1 - j;
    return m < 32 && !((tree_bits >> m) & 1u);
  };
  const int64_t k0 = h0 / g, k1 = h1 / g;             // this call's KV heads
  thread_local std::vector<float> buf;                // a Half slot's K or V, widened (kept across calls)
  if (!std::is_same<Cache, float>::value && static_cast<int64_t>(buf.size()) < row) buf.resize(row);
  auto slot_values = [&](const Cache* cache, int64_t j) -> const float* {  // key j's floats of KV heads [k0, k1)
    const Cache* at = cache + (static_cast<int64_t>(table[j / bs]) * bs + j % bs) * row;
    return widened(at + k0 * d, (k1 - k0) * d, buf.data() + k0 * d) - k0 * d;
  };
  for (int64_t j = 0; j < n; ++j) {                   // scores[head][j] = q_head . k_j (KV head of head)
    if (hidden(j)) {
      for (int64_t hq = h0; hq < h1; ++hq) scores[hq * n + j] = -INFINITY;
      continue;
    }
    const float* kj = slot_values(kc, j);
    for (int64_t hq = h0; hq < h1; ++hq) {
      const float* qh = qb + hq * d;
      const float* kh = kj + (hq / g) * d;
      float dot = 0.f;
      for (int64_t e = 0; e < d; ++e) dot += qh[e] * kh[e];
      scores[hq * n + j] = dot;
    }
  }
  for (int64_t hq = h0; hq < h1; ++hq) {              // softmax over the row's keys, per head
    float* s = scores + hq * n;
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[j]);
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      s[j] = s[j] == -INFINITY ? 0.f : exp_nonpositive(s[j] - mx);
      sum += s[j];
    }
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    for (int64_t j = 0; j < n; ++j) s[j] *= inv;
  }
  std::fill(ob + h0 * d, ob + h1 * d, 0.f);
  for (int64_t j = 0; j < n; ++j) {                   // out[head] = sum_j p[head][j] v_j
    if (hidden(j)) continue;
    const float* vj = slot_values(vc, j);
    for (int64_t hq = h0; hq < h1; ++hq) {
      const float p = scores[hq * n + j];
      const float* vh = vj + (hq / g) * d;
      float* o = ob + hq * d;
      for (int64_t e = 0; e < d; ++e) o[e] += p * vh[e];
    }
  }
}

}  // namespace llm_serving
