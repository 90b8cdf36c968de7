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

// A bfloat16 KV-cache element (float32's upper 16 bits, as MindSpore's bfloat16): integer shifts, which GCC
// vectorises, convert it.
struct BFloat16 {
  uint16_t bits;
};

inline void store_cache(BFloat16* dst, const float* src, int64_t n) {   // rounded to nearest even
  for (int64_t e = 0; e < n; ++e) {
    uint32_t u;
    std::memcpy(&u, src + e, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);          // (NaN cannot occur here: K and V are finite)
    dst[e].bits = static_cast<uint16_t>(u >> 16);
  }
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

inline const float* widened(const BFloat16* src, int64_t n, float* buf) {
  for (int64_t e = 0; e < n; ++e) {
    const uint32_t u = static_cast<uint32_t>(src[e].bits) << 16;
    std::memcpy(buf + e, &u, sizeof u);
  }
  return buf;
}

// An int8 KV cache keeps each head vector (one token's D values of one KV head) as D int8 codes followed by the
// float32 scale they are multiples of (D + 4 bytes): value = code x scale, scale = max |value| / 127, codes
// rounded to nearest (llama.cpp's q8_0 idea, with one block per head vector).
constexpr int64_t kInt8ScaleBytes = 4;

inline void store_vector(int8_t* dst, const float* src, int64_t d) {
  float amax = 0.f;
  for (int64_t e = 0; e < d; ++e) amax = std::max(amax, std::fabs(src[e]));
  const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int64_t e = 0; e < d; ++e) dst[e] = static_cast<int8_t>(std::nearbyint(src[e] * inv));
  std::memcpy(dst + d, &scale, sizeof scale);
}

// One head vector of D values into the cache (a float, Half or BFloat16 cache: the values, rounded to it).
template <typename Cache>
inline void store_vector(Cache* dst, const float* src, int64_t d) { store_cache(dst, src, d); }

// The D values of an int8 head vector: codes x scale, into buf.
inline const float* widened(const int8_t* src, int64_t d, float* buf) {
  float scale;
  std::memcpy(&scale, src + d, sizeof scale);
  for (int64_t e = 0; e < d; ++e) buf[e] = static_cast<float>(src[e]) * scale;
  return buf;
}

// A KV cache's element type, from a kernel call's dtype (MindSpore's name); kCacheUnknown for any other.
enum CacheType { kCacheFloat32, kCacheFloat16, kCacheBFloat16, kCacheInt8, kCacheUnknown };
inline CacheType cache_type(const char* dtype) {
  if (std::strcmp(dtype, "float32") == 0) return kCacheFloat32;
  if (std::strcmp(dtype, "float16") == 0) return kCacheFloat16;
  if (std::strcmp(dtype, "bfloat16") == 0) return kCacheBFloat16;
  if (std::strcmp(dtype, "int8") == 0) return kCacheInt8;
  return kCacheUnknown;
}

// Elements of a cache of this type per head vector of D values (its row width in the flat [slots x KVH, row] cache).
inline int64_t cache_vector(CacheType type, int64_t d) { return type == kCacheInt8 ? d + kInt8ScaleBytes : d; }

// fn(keys, values) on the caches as their element type (float*, Half*, BFloat16* or int8_t*); type is not
// kCacheUnknown.
template <typename Fn>
inline void with_cache(CacheType type, void* keys, void* values, Fn&& fn) {
  if (type == kCacheFloat16) {
    fn(static_cast<Half*>(keys), static_cast<Half*>(values));
  } else if (type == kCacheBFloat16) {
    fn(static_cast<BFloat16*>(keys), static_cast<BFloat16*>(values));
  } else if (type == kCacheInt8) {
    fn(static_cast<int8_t*>(keys), static_cast<int8_t*>(values));
  } else {
    fn(static_cast<float*>(keys), static_cast<float*>(values));
  }
}

struct AttentionShape {
  int64_t kvh, g, d, w, bs;   // KV heads, query heads per KV head, head dim, block-table width, block size
  int64_t vec;                // cache elements per head vector: D, or D + kInt8ScaleBytes for an int8 cache
};

// A sliding window of `window` keys (0: none) over a row's n keys 0 .. n-1 (its own the last): the first key it
// sees, that of the last `window` keys the token tree leaves visible (tree_bits as attend_row's; all ones for an
// ordinary row: n - window). Only the last 32 keys can be hidden, so this counts at most 32 of them.
inline int64_t window_start(int64_t n, uint32_t tree_bits, int64_t window) {
  if (window <= 0 || n <= window) return 0;
  int64_t seen = 0;
  const int64_t tail = std::min<int64_t>(32, n);
  for (int64_t m = 0; m < tail; ++m) {                // key n - 1 - m
    if (((tree_bits >> m) & 1u) && ++seen == window) return n - 1 - m;
  }
  return std::max<int64_t>(0, n - tail - (window - seen));   // the keys before the tail are all visible
}

// One row's decode attention: its NH = KVH*G query heads qb (NH, D), pre-scaled by the attention scale, over keys
// 0 .. context-1 read in place through its block table from the flat caches [slots, KVH, D]; tree_bits: of the
// row's last 32 keys, which are visible (bit m = the key m places before the last; -1 = all); window > 0: only
// the last `window` of its visible keys (sliding-window attention; window_start), read from there on, so a long
// context costs the window. Writes ob (NH, D). scores: room for NH * W * BS floats. Only KV heads
// [kv_begin, kv_end) (and their query heads) when given. sinks (NH,), when given: each head's learned logit in its
// softmax's denominator (gpt-oss: exp(sink) more weight on no key at all). window_keys >= 0: the window counts back
// from key window_keys - 1 rather than from the last visible key (an image token, which sees its image's later
// tokens: its own position + 1). Cache is the cache's element type: float, Half, BFloat16 or int8_t
// (pa_config.kv_cache_dtype), widened as it is read.
template <typename Cache>
inline void attend_row(const float* qb, const Cache* kc, const Cache* vc, const int32_t* table, int64_t context,
                       uint32_t tree_bits, float* ob, const AttentionShape& sh, float* scores,
                       int64_t kv_begin = 0, int64_t kv_end = -1, int64_t window = 0, const float* sinks = nullptr,
                       int64_t window_keys = -1) {
  const int64_t kvh = sh.kvh, g = sh.g, d = sh.d, bs = sh.bs;
  const int64_t row = kvh * sh.vec;                   // cache elements per slot
  const int64_t h0 = kv_begin * g, h1 = (kv_end < 0 ? kvh : kv_end) * g;   // this call's query heads [h0, h1)
  const int64_t last = std::max<int64_t>(0, std::min<int64_t>(context, sh.w * bs));   // keys 0 .. last-1
  const int64_t first = window_start(window_keys < 0 ? last : std::min(window_keys, last), tree_bits, window);
  const int64_t n = last - first;                     // keys first .. last-1, scores[head][j - first]
  auto hidden = [&](int64_t j) {                      // key j masked out by the token tree
    const int64_t m = last - 1 - j;
    return m < 32 && !((tree_bits >> m) & 1u);
  };
  const int64_t k0 = h0 / g, k1 = h1 / g;             // this call's KV heads
  thread_local std::vector<float> buf;                // a slot's K or V, widened (kept across calls)
  if (!std::is_same<Cache, float>::value && static_cast<int64_t>(buf.size()) < kvh * d) buf.resize(kvh * d);
  auto slot_values = [&](const Cache* cache, int64_t j) -> const float* {  // key j's floats of KV heads [k0, k1)
    const Cache* at = cache + (static_cast<int64_t>(table[j / bs]) * bs + j % bs) * row;
    if constexpr (std::is_same<Cache, int8_t>::value) {   // head by head: each has its own scale
      for (int64_t k = k0; k < k1; ++k) widened(at + k * sh.vec, d, buf.data() + k * d);
      return buf.data();
    }
    return widened(at + k0 * d, (k1 - k0) * d, buf.data() + k0 * d) - k0 * d;
  };
  for (int64_t j = first; j < last; ++j) {            // scores[head][j] = q_head . k_j (KV head of head)
    if (hidden(j)) {
      for (int64_t hq = h0; hq < h1; ++hq) scores[hq * n + j - first] = -INFINITY;
      continue;
    }
    const float* kj = slot_values(kc, j);
    for (int64_t hq = h0; hq < h1; ++hq) {
      const float* qh = qb + hq * d;
      const float* kh = kj + (hq / g) * d;
      float dot = 0.f;
      for (int64_t e = 0; e < d; ++e) dot += qh[e] * kh[e];
      scores[hq * n + j - first] = dot;
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
    if (sinks != nullptr && mx != -INFINITY) sum += std::exp(sinks[hq] - mx);     // the sink's share
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    for (int64_t j = 0; j < n; ++j) s[j] *= inv;
  }
  std::fill(ob + h0 * d, ob + h1 * d, 0.f);
  for (int64_t j = first; j < last; ++j) {            // out[head] = sum_j p[head][j] v_j
    if (hidden(j)) continue;
    const float* vj = slot_values(vc, j);
    for (int64_t hq = h0; hq < h1; ++hq) {
      const float p = scores[hq * n + j - first];
      const float* vh = vj + (hq / g) * d;
      float* o = ob + hq * d;
      for (int64_t e = 0; e < d; ++e) o[e] += p * vh[e];
    }
  }
}


// --- a prompt's rows together: causal attention tiles -------------------------------------------------------
//
// attend_row reads every key once per query row and reduces each q.k over D (horizontal sums): ~30 GFLOP/s a
// core, so a prompt of n tokens costs O(n^2) at that rate (8k tokens of SmolLM2: ~60 s). attend_tile takes up
// to kTileRows consecutive rows of one sequence (a prompt's chunk) and one KV head together: each key tile of
// kKeyTile keys is widened and transposed once, then scores S = Q K^T and the output P V are register-blocked
// products (4 query vectors x 64 keys or dims a block: every loaded key or value feeds 4 queries) with an
// online softmax over the key tiles (the running maximum and sum of each query, as flash attention does).

constexpr int64_t kKeyTile = 64;     // keys per tile
constexpr int64_t kTileRows = 32;    // query rows per tile (x the KV head's G query heads)
constexpr int64_t kDecodeTileKeys = 256;   // a lone row (decode) attends as a tile from this many keys on
constexpr int64_t kPrefetchKeys = 8;       // attend_tile asks for a key's K and V this many keys ahead

// Floats of attend_tile's scratch for a KV head's G query heads of up to kTileRows rows, head dim D.
inline int64_t tile_scratch_floats(int64_t g, int64_t d) {
  const int64_t mq = (kTileRows * g + 3) / 4 * 4;
  return 2 * mq * d + mq * kKeyTile + 2 * mq + 2 * kKeyTile * d + kKeyTile * d + d;
}

// dst[c * stride + r] = rows[r][c] for an 8 x 8 block: 8 loads, 24 shuffles, 8 stores (a tile's keys transposed
// a scalar at a time took most of a lone decode row's attention)
inline void transpose8(const float* const rows[8], float* dst, int64_t stride) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(rows[i]);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  // r[0..3]: columns 0, 1, 2, 3 of rows 0-3 (low half) and columns 4-7 (high half); r[4..7] the same of rows 4-7
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(dst + i * stride, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(dst + (i + 4) * stride, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}

// Whether attend_tile's blocked products take this head size (64 dims a block); others run attend_row.
inline bool tile_head_dim(int64_t d) { return d % 64 == 0; }

// S[r][0..64) = Q[r] . KT[:, 0..64) for 4 query vectors Q (stride d); KT: (d, kKeyTile).
inline void tile_scores4(const float* q, int64_t d, const float* kt, float* s) {
#if defined(__AVX512F__)
  __m512 a[4][4];
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < 4; ++c) a[r][c] = _mm512_setzero_ps();
  for (int64_t e = 0; e < d; ++e) {
    const float* k = kt + e * kKeyTile;
    const __m512 k0 = _mm512_loadu_ps(k), k1 = _mm512_loadu_ps(k + 16), k2 = _mm512_loadu_ps(k + 32),
                 k3 = _mm512_loadu_ps(k + 48);
    for (int r = 0; r < 4; ++r) {
      const __m512 qv = _mm512_set1_ps(q[r * d + e]);
      a[r][0] = _mm512_fmadd_ps(qv, k0, a[r][0]);
      a[r][1] = _mm512_fmadd_ps(qv, k1, a[r][1]);
      a[r][2] = _mm512_fmadd_ps(qv, k2, a[r][2]);
      a[r][3] = _mm512_fmadd_ps(qv, k3, a[r][3]);
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + r * kKeyTile + c * 16, a[r][c]);
#elif defined(__AVX2__) && defined(__FMA__)
  // 16 vector registers: 16 keys (two vectors) x 4 queries a pass, each pass over all of d (the same FMAs, in
  // the same order per score, as the 64-key blocks above: the same floats)
  for (int64_t c0 = 0; c0 < kKeyTile; c0 += 16) {
    __m256 a[4][2];
    for (int r = 0; r < 4; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
    for (int64_t e = 0; e < d; ++e) {
      const float* k = kt + e * kKeyTile + c0;
      const __m256 k0 = _mm256_loadu_ps(k), k1 = _mm256_loadu_ps(k + 8);
      for (int r = 0; r < 4; ++r) {
        const __m256 qv = _mm256_broadcast_ss(q + r * d + e);
        a[r][0] = _mm256_fmadd_ps(qv, k0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(qv, k1, a[r][1]);
      }
    }
    for (int r = 0; r < 4; ++r) {
      _mm256_storeu_ps(s + r * kKeyTile + c0, a[r][0]);
      _mm256_storeu_ps(s + r * kKeyTile + c0 + 8, a[r][1]);
    }
  }
#else
  for (int r = 0; r < 4; ++r) {
    float* sr = s + r * kKeyTile;
    for (int64_t j = 0; j < kKeyTile; ++j) sr[j] = 0.f;
    for (int64_t e = 0; e < d; ++e) {
      const float qv = q[r * d + e];
      const float* k = kt + e * kKeyTile;
      for (int64_t j = 0; j < kKeyTile; ++j) sr[j] += qv * k[j];
    }
  }
#endif
}

// O[r][0..d) += sum_j P[r][j] V[j][0..d) for 4 query vectors, keys j < kn; P: (4, kKeyTile), V: (kKeyTile, d).
inline void tile_values4(const float* p, const float* v, int64_t kn, int64_t d, float* o) {
#if defined(__AVX512F__)
  for (int64_t c0 = 0; c0 < d; c0 += 64) {
    __m512 a[4][4];
    for (int r = 0; r < 4; ++r)
      for (int c = 0; c < 4; ++c) a[r][c] = _mm512_loadu_ps(o + r * d + c0 + c * 16);
    for (int64_t j = 0; j < kn; ++j) {
      const float* vj = v + j * d + c0;
      const __m512 v0 = _mm512_loadu_ps(vj), v1 = _mm512_loadu_ps(vj + 16), v2 = _mm512_loadu_ps(vj + 32),
                   v3 = _mm512_loadu_ps(vj + 48);
      for (int r = 0; r < 4; ++r) {
        const __m512 pv = _mm512_set1_ps(p[r * kKeyTile + j]);
        a[r][0] = _mm512_fmadd_ps(pv, v0, a[r][0]);
        a[r][1] = _mm512_fmadd_ps(pv, v1, a[r][1]);
        a[r][2] = _mm512_fmadd_ps(pv, v2, a[r][2]);
        a[r][3] = _mm512_fmadd_ps(pv, v3, a[r][3]);
      }
    }
    for (int r = 0; r < 4; ++r)
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o + r * d + c0 + c * 16, a[r][c]);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  for (int64_t c0 = 0; c0 < d; c0 += 16) {                  // 16 dims x 4 queries a pass (as tile_scores4)
    __m256 a[4][2];
    for (int r = 0; r < 4; ++r) {
      a[r][0] = _mm256_loadu_ps(o + r * d + c0);
      a[r][1] = _mm256_loadu_ps(o + r * d + c0 + 8);
    }
    for (int64_t j = 0; j < kn; ++j) {
      const float* vj = v + j * d + c0;
      const __m256 v0 = _mm256_loadu_ps(vj), v1 = _mm256_loadu_ps(vj + 8);
      for (int r = 0; r < 4; ++r) {
        const __m256 pv = _mm256_broadcast_ss(p + r * kKeyTile + j);
        a[r][0] = _mm256_fmadd_ps(pv, v0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(pv, v1, a[r][1]);
      }
    }
    for (int r = 0; r < 4; ++r) {
      _mm256_storeu_ps(o + r * d + c0, a[r][0]);
      _mm256_storeu_ps(o + r * d + c0 + 8, a[r][1]);
    }
  }
#else
  for (int r = 0; r < 4; ++r) {
    float* orow = o + r * d;
    for (int64_t j = 0; j < kn; ++j) {
      const float pj = p[r * kKeyTile + j];
      const float* vj = v + j * d;
      for (int64_t e = 0; e < d; ++e) orow[e] += pj * vj[e];
    }
  }
#endif
}

// Causal attention of `rows` (<= kTileRows) consecutive query rows of one sequence for KV head kh: row r has
// context ctx0 + r (keys 0 .. ctx0 + r - 1, read in place through its block table from the flat caches
// [slots, KVH, D]). Row r's NH query heads, pre-scaled by the attention scale, are at q + r * q_stride; its output
// heads at out + r * o_stride (only kh's G heads are written). scratch: tile_scratch_floats(G, D) floats.
// tree_bits (a lone row of a token tree, rows == 1): of its last 32 keys, which are visible (as attend_row's); the
// visible keys are taken in order as if they were consecutive, so a tree node's attention is the same float as
// the same tokens' decode step's once they are its only keys (the hidden ones are not skipped over in place: a key
// tile's boundaries would then fall elsewhere and the online softmax would rescale at other keys).
// sinks (NH,), when given: each query head's learned logit in its softmax's denominator (as attend_row's).
// window > 0 (sliding-window attention): row r sees only keys from ctx0 + r - window on (of a tree's row, the last
// `window` of its visible keys). The walk over the key tiles starts at the first row's bound rounded down to a
// whole tile, so that the tiles keep the boundaries they have without a window: a row's keys fall in the same
// tiles, masked alike, alone or in any chunk (the tiles below its own bound are no-ops for it), and a long
// context costs the window. window_ctx0 >= 0 (an ordinary row's, not a tree's): the window's bounds count from it
// instead of ctx0 (attend_row's window_keys).
template <typename Cache>
inline void attend_tile(const float* q, int64_t q_stride, int64_t rows, int64_t ctx0, const Cache* kc, const Cache* vc,
                        const int32_t* table, int64_t kh, float* out, int64_t o_stride, const AttentionShape& sh,
                        float* scratch, uint32_t tree_bits = 0xFFFFFFFFu, int64_t window = 0,
                        const float* sinks = nullptr, int64_t window_ctx0 = -1) {
  const int64_t g = sh.g, d = sh.d, bs = sh.bs, row = sh.kvh * sh.vec;
  const int64_t mq = rows * g, mq4 = (mq + 3) / 4 * 4;       // query vectors: i = r * G + head within kh
  float* qb = scratch;                                       // (mq4, D)
  float* ob = qb + mq4 * d;                                  // (mq4, D)
  float* sc = ob + mq4 * d;                                  // (mq4, kKeyTile)
  float* mx = sc + mq4 * kKeyTile;                           // running maximum per query vector
  float* sum = mx + mq4;                                     // running sum of exponentials
  float* kt = sum + mq4;                                     // a key tile transposed, (D, kKeyTile)
  float* vt = kt + d * kKeyTile;                             // its values, (kKeyTile, D)
  float* keys = vt + kKeyTile * d;                           // the tile's widened keys (kKeyTile, D)
  float* zeros = keys + kKeyTile * d;                        // (D): the keys past the tile's last
  std::fill(zeros, zeros + d, 0.f);
  const float* key_rows[kKeyTile];
  for (int64_t i = 0; i < mq4; ++i) {
    float* qi = qb + i * d;
    if (i < mq) {
      std::memcpy(qi, q + (i / g) * q_stride + (kh * g + i % g) * d, d * sizeof(float));
    } else {
      std::fill(qi, qi + d, 0.f);
    }
    std::fill(ob + i * d, ob + (i + 1) * d, 0.f);
    mx[i] = -INFINITY;
    sum[i] = 0.f;
  }
  int64_t nkeys = std::min<int64_t>(ctx0 + rows - 1, sh.w * bs);   // the last row's context
  // the walk's key i -> the key's index: itself, or for a token tree's row past `start` its visible keys in order
  int64_t start = nkeys, tail[32];
  if (rows == 1 && tree_bits != 0xFFFFFFFFu) {
    start = std::max<int64_t>(0, nkeys - 32);
    int64_t kept = 0;
    for (int64_t j = start; j < nkeys; ++j)
      if ((tree_bits >> (nkeys - 1 - j)) & 1u) tail[kept++] = j;
    nkeys = start + kept;
    ctx0 = nkeys;
  }
  auto key_at = [&](int64_t i) { return i < start ? i : tail[i - start]; };
  const bool tree_row = rows == 1 && tree_bits != 0xFFFFFFFFu;
  const int64_t w0 = window_ctx0 >= 0 && !tree_row ? std::min(window_ctx0, ctx0) : ctx0;   // the window's anchor
  const int64_t walk0 = window > 0 ? std::max<int64_t>(0, w0 - window) / kKeyTile * kKeyTile : 0;
  for (int64_t j0 = walk0; j0 < nkeys; j0 += kKeyTile) {
    const int64_t kn = std::min<int64_t>(kKeyTile, nkeys - j0);
    auto slot_at = [&](int64_t j) { return (static_cast<int64_t>(table[j / bs]) * bs + j % bs) * row + kh * sh.vec; };
    for (int64_t jj = 0; jj < kKeyTile; ++jj) {             // the tile's keys (widened) and values
      if (jj >= kn) {
        key_rows[jj] = zeros;
        continue;
      }
      // this head's K and V of the key kPrefetchKeys on (its own slot, in another block as often as not: the
      // hardware's prefetchers do not follow a block table), asked for while this one is widened: a decode row
      // reads each key once, from memory, and waited on each in turn (half of its attention's time)
      if (j0 + jj + kPrefetchKeys < nkeys) {
        const int64_t ahead = slot_at(key_at(j0 + jj + kPrefetchKeys));
        for (int64_t b = 0; b < static_cast<int64_t>(sh.vec * sizeof(*kc)); b += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(kc + ahead) + b, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(vc + ahead) + b, _MM_HINT_T0);
        }
      }
      const int64_t j = key_at(j0 + jj);
      const int64_t at = slot_at(j);
      key_rows[jj] = widened(kc + at, d, keys + jj * d);
      const float* v = widened(vc + at, d, vt + jj * d);
      if (v != vt + jj * d) std::memcpy(vt + jj * d, v, d * sizeof(float));
    }
    for (int64_t jj = 0; jj < kKeyTile; jj += 8) {          // transposed: kt[e][jj], 8 x 8 at a time
      for (int64_t e = 0; e < d; e += 8) {
        const float* block[8];
        for (int i = 0; i < 8; ++i) block[i] = key_rows[jj + i] + e;
        transpose8(block, kt + e * kKeyTile + jj, kKeyTile);
      }
    }
    for (int64_t i = 0; i < mq4; i += 4) tile_scores4(qb + i * d, d, kt, sc + i * kKeyTile);
    for (int64_t i = 0; i < mq4; ++i) {                      // mask, then the online softmax of each query
      float* s = sc + i * kKeyTile;
      // the query's keys in this tile: [from, visible) (its window's bound, its causal one)
      const int64_t visible = i < mq ? std::min<int64_t>(kn, ctx0 + i / g - j0) : 0;
      const int64_t from = window > 0 ? std::max<int64_t>(0, w0 + i / g - window - j0) : 0;
      if (visible <= from) {
        std::fill(s, s + kKeyTile, 0.f);
        continue;
      }
      float m = mx[i];
      for (int64_t jj = from; jj < visible; ++jj) m = std::max(m, s[jj]);
      const float alpha = mx[i] == -INFINITY ? 0.f : exp_nonpositive(mx[i] - m);
      float add = 0.f;
      for (int64_t jj = from; jj < visible; ++jj) {
        s[jj] = exp_nonpositive(s[jj] - m);
        add += s[jj];
      }
      std::fill(s, s + from, 0.f);
      std::fill(s + visible, s + kKeyTile, 0.f);
      mx[i] = m;
      sum[i] = sum[i] * alpha + add;
      if (alpha != 1.f) {
        float* o = ob + i * d;
        for (int64_t e = 0; e < d; ++e) o[e] *= alpha;
      }
    }
    for (int64_t i = 0; i < mq4; i += 4) tile_values4(sc + i * kKeyTile, vt, kn, d, ob + i * d);
  }
  for (int64_t i = 0; i < mq; ++i) {
    if (sinks != nullptr && mx[i] != -INFINITY) sum[i] += std::exp(sinks[kh * g + i % g] - mx[i]);   // the sink
    const float inv = sum[i] > 0.f ? 1.f / sum[i] : 0.f;
    float* dst = out + (i / g) * o_stride + (kh * g + i % g) * d;
    const float* o = ob + i * d;
    for (int64_t e = 0; e < d; ++e) dst[e] = o[e] * inv;
  }
}

}  // namespace llm_serving
