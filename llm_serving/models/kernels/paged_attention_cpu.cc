// Paged decode attention for the CPU: the CPU twin of Ascend's PagedAttention kernel.
//
// Each row's single new query attends over the keys/values its block table points to, read in place
// from the layer's cache (no gather of the keys into a padded (B, KVH, L, D) tensor first). Loaded by
// MindSpore as an `ops.Custom(func_type="aot")` kernel; built and cached by kernels/__init__.py.
//
// Inputs (MindSpore passes inputs then outputs in `params`):
//   q            (B, KVH, G, D) float32  query heads grouped by the KV head they share, pre-scaled by the
//                                        attention scale (1/sqrt(D), or the model's own)
//   key_cache    (N*KVH, D)     float32, float16 or bfloat16 (pa_config.kv_cache_dtype)  flat view of [slots, KVH, D];
//                (N*KVH, D+4)   int8: each head vector's codes, then its float32 scale (cpu_kernel_common.h)
//                                        slot = block * block_size + offset
//   value_cache  (N*KVH, D)     the key cache's dtype
//   block_tables (B, W)         int32
//   context_lens (B,)           int32    keys 0 .. context_len-1 are visible (the new token included)
//   tree_bits    (B,)           int32    of the row's last 32 keys, which are visible: bit m set = the key m
//                                        places before the last (m = 0: the query's own); keys further back
//                                        are always visible. -1 (all set) for an ordinary token; a node of a
//                                        speculative token tree sees only itself and its ancestors.
//   config       (2,) or (3,)   int32    [block_size, threads(, window)]: window > 0, sliding-window attention
//                                        (each row sees the last `window` of its visible keys); 0 or absent: all
// Output:
//   out          (B, KVH, G, D) float32
//
// Work item = one row: all its heads at once, so each cache slot's KVH*D floats are read as one contiguous
// run (per-(row, head) items would read small pieces far apart).
// Two passes over the row's keys (scores, then the softmax-weighted sum of values), the scores in a small
// per-thread buffer. `threads` threads (the calling thread included) take rows one at a time, so rows of
// different lengths still share the work evenly. At B=128 and 129 keys a layer streams 68 MB of K/V in
// ~5 ms (~13 GB/s, about what one of this machine's cores reads); a float16 cache, widened with F16C as it is
// read, measured the same at half the memory.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "cpu_kernel_common.h"

namespace {

using llm_serving::AttentionShape;

template <typename Cache>
void attend(const float* q, const Cache* kc, const Cache* vc, const int32_t* bt, const int32_t* cl,
            const int32_t* tree, float* out, const AttentionShape& sh, int64_t window, int64_t rows,
            std::atomic<int64_t>* next_row) {
  const int64_t nh = sh.kvh * sh.g, d = sh.d;
  std::vector<float> scores(static_cast<size_t>(nh * sh.w * sh.bs));
  for (int64_t b = next_row->fetch_add(1); b < rows; b = next_row->fetch_add(1)) {
    llm_serving::attend_row(q + b * nh * d, kc, vc, bt + b * sh.w, cl[b], static_cast<uint32_t>(tree[b]),
                            out + b * nh * d, sh, scores.data(), 0, -1, window);
  }
}

}  // namespace

extern "C" int PagedDecodeAttention(int nparam, void** params, int* ndims, int64_t** shapes,
                                    const char** dtypes, void* stream, void* extra) {
  (void)stream;
  (void)extra;
  if (nparam != 8 || ndims[0] != 4 || ndims[1] != 2 || ndims[3] != 2 || ndims[4] != 1 || ndims[5] != 1 ||
      ndims[6] != 1 || ndims[7] != 4 || std::strcmp(dtypes[0], "float32") != 0 ||
      std::strcmp(dtypes[2], dtypes[1]) != 0 || llm_serving::cache_type(dtypes[1]) == llm_serving::kCacheUnknown) {
    return 1;
  }
  const auto* q = static_cast<const float*>(params[0]);
  const auto* bt = static_cast<const int32_t*>(params[3]);
  const auto* cl = static_cast<const int32_t*>(params[4]);
  const auto* tree = static_cast<const int32_t*>(params[5]);
  const auto* cfg = static_cast<const int32_t*>(params[6]);
  auto* out = static_cast<float*>(params[7]);
  const AttentionShape sh{shapes[0][1], shapes[0][2], shapes[0][3], shapes[3][1], cfg[0],
                          llm_serving::cache_vector(llm_serving::cache_type(dtypes[1]), shapes[0][3])};
  if (shapes[6][0] != 2 && shapes[6][0] != 3) return 2;
  const int64_t window = shapes[6][0] == 3 ? cfg[2] : 0;
  if (window < 0 || sh.bs < 1 || shapes[1][1] != sh.vec || shapes[2][1] != sh.vec || shapes[3][0] != shapes[0][0] ||
      shapes[5][0] != shapes[0][0]) {
    return 2;
  }
  const int64_t rows = shapes[0][0];
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(cfg[1], rows));
  auto run = [&](const auto* kc, const auto* vc) {
    std::atomic<int64_t> next_row{0};
    std::vector<std::thread> pool;
    for (int64_t t = 1; t < threads; ++t) {
      pool.emplace_back([&] { attend(q, kc, vc, bt, cl, tree, out, sh, window, rows, &next_row); });
    }
    attend(q, kc, vc, bt, cl, tree, out, sh, window, rows, &next_row);
    for (auto& th : pool) th.join();
  };
  llm_serving::with_cache(llm_serving::cache_type(dtypes[1]), params[1], params[2], run);
  return 0;
}
