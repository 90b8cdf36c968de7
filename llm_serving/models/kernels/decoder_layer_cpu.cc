// A whole LLaMA-family decoder layer (LLaMA, Qwen2/3, Mistral, Phi-3, Gemma 3, gpt-oss; and a BERT encoder's layer:
// LayerNorms after the residual adds, biases, an ungated GELU MLP), and the final norm + lm_head, as single CPU
// kernels for small decode batches.
//
// At batch 1..16 a decode step is a chain of matrix-vector products (the weights are read once per step,
// the rows of the batch are few), and MindSpore's kernel-by-kernel CPU runtime spends more time between
// its ~30 kernels per layer than in them (docs/benchmarks/JOURNAL.md: 3.1 ms of runtime in an 11.9 ms step of the
// bench model). Here one kernel per layer does all of it: RMSNorm, the fused q/k/v product (+ bias),
// (Qwen3/Gemma 3: RMSNorm of each q and k head), RoPE, the K/V write into the paged cache, paged attention
// (cpu_kernel_common.h, as the decode kernel; Mistral/Gemma 3: a sliding window), o_proj (+ Gemma 3's sandwich
// RMSNorm) + residual, RMSNorm, gate/up with SiLU (Gemma: GELU, tanh form), down_proj (+ sandwich norm) +
// residual. The work is split over a persistent pool of threads (thread_pool_cpu.h).
//
// Loaded by MindSpore as `ops.Custom(func_type="aot")` kernels (inputs then the output in `params`, in the order
// of DECODER_LAYER_PARAMS / FINAL_LOGITS_PARAMS below, which kernels/signatures.py declares again by name and
// the build checks); built and cached by kernels/__init__.py. The weights are layer_weights.py's load-time
// forms: q/k/v fused, gate/up fused.
//
// Weight matrices come in two forms, chosen per matrix by a type code in iconfig (GGML's numbering; weight_types.h):
//   F32       float32 (rows, K), the MindSpore graphs' own tensors (norm gains folded in: the gains passed are 1)
//   the other types of weight_types.h (MXFP4: MoeMlp's only)
//             a GGUF tensor's own bytes, uint8 (rows, row_bytes): each row K weights in blocks of 32 (F16/BF16:
//             K halves; the K-quants: super-blocks of 256, so K a multiple of 256), decoded in registers for one
//             or two rows of x (qdot) or a tile of rows at a time into a thread's scratch for more, so a decode
//             step reads 4.5-8.5 bits per weight from memory instead of 32. Gains are not folded into
//             quantized rows: the normalized activations are multiplied by them instead (the same product).
//
// Products by batch size, and which path each takes: product_routes_cpu.h.
//
// DecoderLayer(x, positions, slots, block_tables, context_lens, tree_bits, cos, sin, lora, q_w, k_w, v_w, qkv_bias,
//              o_w, o_bias, gate_w, up_w, down_w, input_gain, post_gain, q_norm, k_norm, attn_out_gain, mlp_out_gain,
//              sinks, gate_up_bias, down_bias, norm_bias, key_cache, value_cache, lora_qkv_a, lora_qkv_b, lora_o_a,
//              lora_o_b, lora_gate_up_a, lora_gate_up_b, lora_down_a, lora_down_b, iconfig, fconfig) -> out
//   x            (B, H)                 float32  the layer's input hidden states, one decode token per row
//   positions    (B,)                   int32    each token's position (< P)
//   slots        (B,)                   int32    the cache slot its K/V go to; < 0: the row sits this step out
//                                                (no K/V written, no attention; its output is not meaningful);
//                                                such rows at the end of the batch are not computed at all
//                                                (out = x there), so padding costs nothing
//   block_tables (B, W)                 int32    as the decode kernel takes them
//   context_lens (B,)                   int32    keys 0 .. context_len-1 visible (the new token included; a
//                                                bidirectional encoder's tokens each see their whole input: the
//                                                input's length, its keys all written by this call before any
//                                                row attends; an image's tokens see up to its last, and a sliding
//                                                window still counts back from the token's own position)
//   tree_bits    (B,)                   int32    token-tree visibility of the last 32 keys (-1: all)
//   cos, sin     (P, D)                 float32  rope tables, rotate_half layout, sin signed [-sin, sin]
//   lora         (B,)                   int32    each row's LoRA adapter slot (0: none; < S)
//   q_w (NH*D, H), k_w (KVH*D, H), v_w (KVH*D, H)   each in its own type (a Q4_K_M file stores some layers' v
//                                                as Q6_K beside Q4_K q and k); they run as one product, q/k/v
//   qkv_bias     ((NH+2KVH)*D,)         float32  zeros for models without one
//   o_w          (H, NH*D)
//   o_bias       (H,)                   float32  added to o's product (zeros for models without one)
//   sinks        (NH,)                  float32  each query head's sink logit (iconfig's attention_sinks; else
//                                                unread)
//   gate_up_bias (2I,)                  float32  gate's then up's biases, added before the activation, and
//   down_bias    (H,)                   float32  down's, added to its product (iconfig's mlp_biases; else unread)
//   norm_bias    (4, H)                 float32  LayerNorm's biases (iconfig's norm) of the input, post-attention,
//                                                attention-output and MLP-output norms, in that order (else unread)
//   gate_w, up_w (I, H)                          down_w (H, I)    (weights: float32, or uint8 rows as above; an
//                                                ungated MLP's gate_w a (1, H) placeholder, not read)
//   input_gain, post_gain (H,)          float32  the norms' gains for q/k/v and for gate/up (1 where folded)
//   q_norm, k_norm (D,)                 float32  iconfig's qk_norm: the gains of each query's and key's head
//                                                RMSNorm, after q/k/v (+ bias, + LoRA), before RoPE (else unread)
//   attn_out_gain, mlp_out_gain (H,)    float32  iconfig's sandwich_norms: the gains of the RMSNorm of the o
//                                                product's and of the down product's result (+ LoRA) before each
//                                                residual: out = x + rmsnorm(o) * attn_out_gain (else unread)
//   key_cache, value_cache (N*KVH, D)   float32, float16 or bfloat16 (both the same; pa_config.kv_cache_dtype)
//                       (N*KVH, D+4)    int8 (codes, then the head vector's float32 scale)  flat [slots, KVH, D];
//                                                this step's K/V are written in place (rounded to the cache's
//                                                type), then read back by the attention
//   lora_*_a     (S, P*R, K)            float32  per slot, the product's A matrices of its P parts (q/k/v: 3,
//                                                gate/up: 2, o and down: 1) stacked; K its input width
//   lora_*_b     (S, R, N)              float32  per slot, B transposed (scale folded in): column j for output
//                                                row j, which reads its part's R-wide slice of A x (slot 0 and
//                                                modules an adapter leaves alone: zeros)
//   iconfig      (11,), (12,), (16-22,) int32    DECODER_LAYER_ICONFIG's entries (below: what each says), in
//                                                its order; an iconfig may end after down_type, after
//                                                batch_invariant or anywhere from window on: absent entries take
//                                                their defaults (a LLaMA layer)
//   fconfig      (1,) or (2,)           float32  [rms_norm_eps (every norm's), attention scale (the queries'
//                                                 factor; absent: 1/sqrt(D))]
//   out          (B, H)                 float32
// FinalLogits(x (R, H), slots (R,), lm_head (V, H), gain (H,), iconfig (FINAL_LOGITS_ICONFIG's entries, the last
//             optional), fconfig [eps])
//   -> logits (R, V), the greedy token (R,) int32 (the first index of the largest logit) and its
//   log-probability (R,) float32; rows whose slot is < 0 at the end of the batch (padding; a decode run's rows
//   that ended) are not computed: tokens and log-probabilities 0, logits left as they are
//
// Return codes (MindSpore reports a nonzero one as the kernel's failure): 1 bad arity/ranks/dtypes, 2 shapes
// that do not agree, 3 a position, slot or block id out of range.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <pthread.h>
#include <thread>
#include <unistd.h>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "cpu_kernel_common.h"
#include "gemm_amx.h"
#include "gemm_amx_int.h"
#include "gemm_avx2_int.h"
#include "gemm_cpu.h"
#include "kernel_params.h"

// The kernels' parts, each header one job, in the order they build on each other (all of them in an anonymous
// namespace: this file is their only includer, so the library exports the kernels below and nothing else)
#include "thread_pool_cpu.h"          // the persistent pool, and a product's rows claimed by its threads
#include "float_products_cpu.h"       // float32 dot products in registers (v16, reduce16, dot_tile)
#include "weight_formats_cpu.h"       // the GGUF types: row bytes, and each type's blocks decoded to floats
#include "weight_matrix_cpu.h"        // Matrix (a weight parameter), its rows dequantized; qdot and matvec
#include "invariant_products_cpu.h"   // batch-invariant products: dot_gemm, lane_units
#include "product_routes_cpu.h"       // the process's settings, the batched products, each product's route
#include "layer_parts_cpu.h"          // norms, LoRA, the MLP's activation
#include "layer_stack_cpu.h"          // the decoder layers registered as one call (DecoderStack)

// The kernels' parameters in the order ops.Custom passes them (inputs, then outputs): (index, name, rank, dtype).
// The inputs a step gives come first, then those the model holds (weights, caches, config). kernels/signatures.py
// declares the same lists (llama.py calls the kernels by them) and the build checks the two against each other
// through DecoderLayerParams() and FinalLogitsParams() below (kernel_params.h).
#define DECODER_LAYER_PARAMS(P)                                                                                  \
  P(X, "x", 2, "float32") P(POS, "positions", 1, "int32") P(SLOTS, "slots", 1, "int32")                          \
  P(TABLES, "block_tables", 2, "int32") P(CONTEXT, "context_lens", 1, "int32") P(TREE, "tree_bits", 1, "int32")  \
  P(COS, "cos", 2, "float32") P(SIN, "sin", 2, "float32") P(LORA, "lora", 1, "int32")                            \
  P(Q_W, "q_w", 2, "weight") P(K_W, "k_w", 2, "weight") P(V_W, "v_w", 2, "weight")                                \
  P(QKV_B, "qkv_bias", 1, "float32") P(O_W, "o_w", 2, "weight") P(O_B, "o_bias", 1, "float32")                   \
  P(GATE_W, "gate_w", 2, "weight")                                                                               \
  P(UP_W, "up_w", 2, "weight") P(DOWN_W, "down_w", 2, "weight") P(IN_GAIN, "input_gain", 1, "float32")            \
  P(POST_GAIN, "post_gain", 1, "float32") P(Q_NORM, "q_norm", 1, "float32") P(K_NORM, "k_norm", 1, "float32")   \
  P(ATTN_OUT_GAIN, "attn_out_gain", 1, "float32") P(MLP_OUT_GAIN, "mlp_out_gain", 1, "float32")                  \
  P(SINKS, "sinks", 1, "float32")                                                                                \
  P(GATE_UP_B, "gate_up_bias", 1, "float32") P(DOWN_B, "down_bias", 1, "float32")                                \
  P(NORM_B, "norm_bias", 2, "float32")                                                                           \
  P(KEYS, "key_cache", 2, "cache") P(VALUES, "value_cache", 2, "cache")                                          \
  P(LORA_QKV_A, "lora_qkv_a", 3, "float32") P(LORA_QKV_B, "lora_qkv_b", 3, "float32")                            \
  P(LORA_O_A, "lora_o_a", 3, "float32") P(LORA_O_B, "lora_o_b", 3, "float32")                                    \
  P(LORA_GATE_UP_A, "lora_gate_up_a", 3, "float32") P(LORA_GATE_UP_B, "lora_gate_up_b", 3, "float32")            \
  P(LORA_DOWN_A, "lora_down_a", 3, "float32") P(LORA_DOWN_B, "lora_down_b", 3, "float32")                        \
  P(ICFG, "iconfig", 1, "int32") P(FCFG, "fconfig", 1, "float32")                                                \
  P(OUT, "out", 2, "float32")
#define FINAL_LOGITS_PARAMS(P)                                                                                   \
  P(X, "x", 2, "float32") P(SLOTS, "slots", 1, "int32") P(W, "lm_head", 2, "weight") P(GAIN, "gain", 1, "float32") \
  P(ICFG, "iconfig", 1, "int32") P(FCFG, "fconfig", 1, "float32")                                                \
  P(LOGITS, "logits", 2, "float32") P(TOKEN, "token", 1, "int32") P(LOGPROB, "logprob", 1, "float32")


// DecoderLayer's iconfig, entry by entry: I(index, name). kernels/signatures.py declares the same names (the model
// builds the iconfig by them) and the build checks the two through DecoderLayerIconfig() below.
#define DECODER_LAYER_ICONFIG(I)                                                                                  \
  I(BLOCK_SIZE, "block_size") I(NUM_HEADS, "num_heads") I(NUM_KV_HEADS, "num_kv_heads") I(THREADS, "threads")    \
  /* each matrix's type code (weight_types.h) */                                                                 \
  I(Q_TYPE, "q_type") I(K_TYPE, "k_type") I(V_TYPE, "v_type") I(O_TYPE, "o_type") I(GATE_TYPE, "gate_type")      \
  I(UP_TYPE, "up_type") I(DOWN_TYPE, "down_type")                                                                \
  /* 1 on, 0 off, -1 or absent: the process's setting (KernelInvariant, for tests and benchmarks) */             \
  I(INVARIANT, "batch_invariant")                                                                                \
  /* 0 SiLU (absent), 1 GELU (tanh approximation), 2 GELU (erf) */                                               \
  I(ACTIVATION, "activation")                                                                                    \
  /* 1 on, 0 off (absent): each query's and key's head RMSNorm; the o and down products' RMSNorm */               \
  I(QK_NORM, "qk_norm") I(SANDWICH, "sandwich_norms")                                                            \
  /* W > 0: each row sees the last W of its visible keys (sliding-window attention); 0 (absent) all */           \
  I(WINDOW, "window")                                                                                            \
  /* 1 (absent) the layer's gate/up/down; 0 none, out = x + attention: a mixture-of-experts layer, MoeMlp next   \
     (gate_w, up_w (1, H) and down_w (H, 1) placeholders, not read) */                                           \
  I(MLP, "mlp")                                                                                                  \
  /* 1: each query head's softmax has sinks[head] in its denominator (gpt-oss); 0 (absent) none */               \
  I(SINKS, "attention_sinks")                                                                                    \
  /* 0 RMSNorm (absent), 1 LayerNorm (every norm of the layer; BERT) */                                          \
  I(NORM, "norm")                                                                                                \
  /* 1: out = norm(x + attention), then norm(out + MLP), the input and post-attention norms not applied (BERT;   \
     the gains are attn_out_gain and mlp_out_gain); 0 (absent) pre norms */                                      \
  I(POST_NORMS, "post_norms")                                                                                    \
  /* 1 (absent) f(gate) * up, 0 f(up) (BERT) */                                                                  \
  I(GATED, "gated_mlp")                                                                                          \
  /* 1: gate_up_bias and down_bias added, 0 (absent) none */                                                     \
  I(MLP_BIASES, "mlp_biases")
// FinalLogits' iconfig: threads, the lm_head's type code, batch-invariant as DecoderLayer's (absent: the process's)
#define FINAL_LOGITS_ICONFIG(I) I(THREADS, "threads") I(LM_HEAD_TYPE, "lm_head_type") I(INVARIANT, "batch_invariant")

namespace {

const llm_serving::ParamSpec kDecoderLayerParams[] = {DECODER_LAYER_PARAMS(LLM_SERVING_PARAM_SPEC)};
const llm_serving::ParamSpec kFinalLogitsParams[] = {FINAL_LOGITS_PARAMS(LLM_SERVING_PARAM_SPEC)};
// the iconfigs' entries by name: layer_cfg::WINDOW, logits_cfg::LM_HEAD_TYPE
namespace layer_cfg {
enum : int64_t { DECODER_LAYER_ICONFIG(LLM_SERVING_FIELD_ENUM) COUNT };
const char* const kNames[] = {DECODER_LAYER_ICONFIG(LLM_SERVING_FIELD_NAME)};
}  // namespace layer_cfg
namespace logits_cfg {
enum : int64_t { FINAL_LOGITS_ICONFIG(LLM_SERVING_FIELD_ENUM) COUNT };
const char* const kNames[] = {FINAL_LOGITS_ICONFIG(LLM_SERVING_FIELD_NAME)};
}  // namespace logits_cfg
}  // namespace

// A kernel's list as text, built once per kernel (each expansion is its own lambda, with its own static).
#define LLM_SERVING_DESCRIBED(spec)                                                                       \
  ([] {                                                                                                  \
    static const std::string text = llm_serving::describe_params(spec, sizeof(spec) / sizeof(spec[0])); \
    return text.c_str();                                                                                 \
  }())

extern "C" const char* DecoderLayerParams() { return LLM_SERVING_DESCRIBED(kDecoderLayerParams); }
extern "C" const char* FinalLogitsParams() { return LLM_SERVING_DESCRIBED(kFinalLogitsParams); }

// An iconfig's entries as text ("name,name,..."), built once per kernel, for the build to check
#define LLM_SERVING_NAMED(names)                                                                          \
  ([] {                                                                                                  \
    static const std::string text = llm_serving::describe_fields(names, sizeof(names) / sizeof(names[0])); \
    return text.c_str();                                                                                 \
  }())

extern "C" const char* DecoderLayerIconfig() { return LLM_SERVING_NAMED(layer_cfg::kNames); }
extern "C" const char* FinalLogitsIconfig() { return LLM_SERVING_NAMED(logits_cfg::kNames); }

// The weight types' table (weight_types.h) as text: kernels/repack.py reads what may be repacked from it
extern "C" const char* WeightTypes() {
  static const std::string text = describe_weight_types();
  return text.c_str();
}

// `rows` rows of k weights of GGML type `type` at data (row_bytes_of(type, k) bytes each), dequantized into out
// (rows, k) float32, as the kernels read them (for tests and benchmarks). 0, or 2: a type the kernels do not
// read, or k not whole blocks of it.
extern "C" int DequantizeRows(int32_t type, const uint8_t* data, int64_t rows, int64_t k, float* out) {
  const int64_t bytes = row_bytes_of(type, k);
  if (bytes < 0 || rows < 0) return 2;
  if (type == kF32) {
    std::memcpy(out, data, rows * k * sizeof(float));
    return 0;
  }
  const Matrix m{data, type, rows, k, bytes};
  for (int64_t r = 0; r < rows; ++r) m.dequantize_row(data + r * bytes, out + r * k);
  return 0;
}

// out (m, rows) = x (m, k) times `rows` weight rows of GGML type `type` at w (row_bytes_of(type, k) bytes each) on
// the integer path of gemm_avx2_int.h, x rounded as the kernels round it, on the calling thread (for tests and
// benchmarks: the kernels' products without the norms around them). 0, or 2: a type that path does not read, k
// not whole blocks, or a build without it.
extern "C" int IntegerProduct(int32_t type, const uint8_t* w, int64_t rows, int64_t k, const float* x, int64_t m,
                              float* out) {
#if defined(LLM_SERVING_AVX2_INT)
  namespace ai = llm_serving::avx2_int;
  const int64_t bytes = row_bytes_of(type, k);
  if (bytes < 0 || !ai::reads(type) || rows < 0 || m < 0) return 2;
  std::vector<float> xbuf, wbuf, tile;
  float* xp = sized_aligned(xbuf, m * ai::x_bytes(k) / 4);
  float* wp = sized_aligned(wbuf, ai::buffer_bytes(k, m) / 4);
  const int64_t step = ai::tile_rows_of(type);
  float* c = Scratch::sized(tile, step * m);
  ai::pack_rows(x, k, k, m, 0, m, reinterpret_cast<uint8_t*>(xp));
  for (int64_t r = 0; r < rows; r += step) {
    const int64_t n = std::min(step, rows - r);
    ai::product(type, w + r * bytes, bytes, k, n, reinterpret_cast<const uint8_t*>(xp), m,
                reinterpret_cast<uint8_t*>(wp), c, m);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t b = 0; b < m; ++b) out[b * rows + r + i] = c[i * m + b];
  }
  return 0;
#else
  (void)type, (void)w, (void)rows, (void)k, (void)x, (void)m, (void)out;
  return 2;
#endif
}

// `rows` stored rows of GGML type `type` (row_bytes bytes each) at src repacked for this library's products
// (gemm_avx2_int.h's row-interleaved layout, the same bytes in another order) into dst (as many bytes; nullptr:
// only ask): returns the repacked type that DecoderLayer's iconfig then names, or 0 where they stay as stored: a
// type not repacked (Q4_K, Q6_K, Q8_0, Q4_0 and Q4_1 are; a row of blocks of 32 must be whole groups of 256), rows
// not a multiple of 8, products that would not read it (the integer products off), or LLM_SERVING_KERNEL_REPACK=0
// in the environment (read once: the stored rows' products, for comparisons; the same floats either way).
// invariant: whether the steps that read these rows are batch-invariant (1) or not (0). It matters only in a build
// with AMX's integer tiles, which read the stored rows and take only steps that are not batch-invariant: there the
// rows stay as stored for a model whose steps are not (when this process has the tiles: the CPU has them, Linux
// grants them and the integer products are on), and are repacked for one whose steps are, which would otherwise run
// gemm_avx2_int.h's products on the stored rows (1.4-1.6x slower than the panels at 1 to 256 rows of x on a Zen 5,
// bench/repack.py).
extern "C" int32_t RepackRows(int32_t type, const uint8_t* src, int64_t rows, int64_t row_bytes, uint8_t* dst,
                              int32_t invariant) {
#if defined(LLM_SERVING_AVX2_INT)
  namespace ai = llm_serving::avx2_int;
#if defined(LLM_SERVING_AMX_INT)
  if (invariant == 0 && int_enabled(amx_enabled())) return 0;        // the integer tiles read the stored rows
#else
  (void)invariant;
#endif
  static const bool allowed = [] {
    const char* env = std::getenv("LLM_SERVING_KERNEL_REPACK");
    return env == nullptr || std::strcmp(env, "0") != 0;
  }();
  if (!allowed) return 0;
  const int64_t group = row_bytes_of(type, 256);                      // bytes per 256 weights
  const int64_t k = group > 0 && row_bytes % group == 0 ? row_bytes / group * 256 : 0;
  const int32_t to = avx2_int_enabled() && k > 0 ? ai::repacked_type(type, rows, k) : 0;
  if (to != 0 && dst != nullptr) ai::repack_rows(type, src, rows, k, dst);
  return to;
#else
  (void)type, (void)src, (void)rows, (void)row_bytes, (void)dst, (void)invariant;
  return 0;
#endif
}

// Turns the AMX path of the batched products off (0) or back on (1; when the CPU and Linux allow it), or only
// asks (-1): returns whether the next kernel call runs them on AMX. For tests and benchmarks, which compare the
// two paths in one process (a server sets LLM_SERVING_KERNEL_AMX=0 instead, if ever).
extern "C" int KernelAmx(int enable) {
  if (enable >= 0) {
    amx_enabled();                                   // the environment read first, then overridden
    amx_setting.store(enable > 0 ? 1 : 0);
  }
  return amx_enabled() ? 1 : 0;
}

// Whether a call is batch-invariant: its iconfig's entry at `at` (1 on, 0 off) where it has one, else the
// process's setting
inline bool invariant_of(const int32_t* icfg, int64_t n, int64_t at) {
  return n > at && icfg[at] >= 0 ? icfg[at] == 1 : invariant_enabled();
}

// Turns batch invariance (invariant_enabled) off (0) or back on (1), or only asks (-1): returns whether the next
// kernel call that does not say (an iconfig without the entry, or -1 there) is batch-invariant. The runner says
// in every call's iconfig (model_config.batch_invariant), so that runners in one process keep their own; tests and
// benchmarks switch this to compare the two in one library.
extern "C" int KernelInvariant(int enable) {
  if (enable >= 0) {
    invariant_enabled();                             // the environment read first, then overridden
    invariant_setting.store(enable > 0 ? 1 : 0);
  }
  return invariant_enabled() ? 1 : 0;
}

// Turns the integer products off (0) or back on (1), or only asks (-1): returns which the next kernel call runs
// products of integer-code weights on, bits: 1 AMX's integer tiles (gemm_amx_int.h, where AMX is), 2 AVX2's
// multiply-adds (gemm_avx2_int.h); 0 none (the float paths). For tests and benchmarks (which compare the two).
extern "C" int KernelInt(int enable) {
  if (enable >= 0) {
    int_allowed();                                   // the environment read first, then overridden
    int_setting.store(enable > 0 ? 1 : 0);
  }
  return (int_enabled(amx_enabled()) ? 1 : 0) | (avx2_int_enabled() ? 2 : 0);
}

// Wall time spent in each kernel since the library was loaded, in nanoseconds: [DecoderLayer, FinalLogits]
// (benchmarks read it through ctypes to split a step into kernel time and everything else).
extern "C" {
std::atomic<int64_t> llm_serving_kernel_ns[2];
}

namespace {

struct Timed {
  explicit Timed(int which) : which_(which), start_(std::chrono::steady_clock::now()) {}
  ~Timed() {
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start_);
    llm_serving_kernel_ns[which_].fetch_add(ns.count(), std::memory_order_relaxed);
  }
  const int which_;
  const std::chrono::steady_clock::time_point start_;
};
}  // namespace

extern "C" int DecoderLayer(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                            void* stream, void* extra) {
  (void)stream;
  (void)extra;
  enum { DECODER_LAYER_PARAMS(LLM_SERVING_PARAM_ENUM) NPARAM };
  if (!llm_serving::params_match(kDecoderLayerParams, NPARAM, nparam, ndims, dtypes)) return 1;
  namespace c = layer_cfg;
  const int64_t icfg_len = shapes[ICFG][0], fcfg_len = shapes[FCFG][0];
  // an iconfig ends after the types, after batch_invariant, or anywhere from window on (the rest: defaults)
  const bool icfg_whole = icfg_len == c::DOWN_TYPE + 1 || icfg_len == c::INVARIANT + 1 ||
                          (icfg_len > c::WINDOW && icfg_len <= c::COUNT);
  if (!icfg_whole || (fcfg_len != 1 && fcfg_len != 2)) {
    return 2;
  }
  const auto* x = static_cast<const float*>(params[X]);
  const auto* positions = static_cast<const int32_t*>(params[POS]);
  const auto* slots = static_cast<const int32_t*>(params[SLOTS]);
  const auto* tables = static_cast<const int32_t*>(params[TABLES]);
  const auto* context = static_cast<const int32_t*>(params[CONTEXT]);
  const auto* tree = static_cast<const int32_t*>(params[TREE]);
  const auto* cos = static_cast<const float*>(params[COS]);
  const auto* sin = static_cast<const float*>(params[SIN]);
  const auto* qkv_b = static_cast<const float*>(params[QKV_B]);
  const auto* o_b = static_cast<const float*>(params[O_B]);
  const auto* in_gain = static_cast<const float*>(params[IN_GAIN]);
  const auto* post_gain = static_cast<const float*>(params[POST_GAIN]);
  const auto* q_norm = static_cast<const float*>(params[Q_NORM]);
  const auto* k_norm = static_cast<const float*>(params[K_NORM]);
  const auto* attn_out_gain = static_cast<const float*>(params[ATTN_OUT_GAIN]);
  const auto* mlp_out_gain = static_cast<const float*>(params[MLP_OUT_GAIN]);
  const auto* gate_up_b = static_cast<const float*>(params[GATE_UP_B]);
  const auto* down_b = static_cast<const float*>(params[DOWN_B]);
  const auto* norm_b = static_cast<const float*>(params[NORM_B]);
  void* const key_cache = params[KEYS];
  void* const value_cache = params[VALUES];
  const llm_serving::CacheType cache_type = llm_serving::cache_type(dtypes[KEYS]);
  if (std::strcmp(dtypes[VALUES], dtypes[KEYS]) != 0 || cache_type == llm_serving::kCacheUnknown) return 1;
  const auto* lora = static_cast<const int32_t*>(params[LORA]);
  const auto* icfg = static_cast<const int32_t*>(params[ICFG]);
  const auto* fcfg = static_cast<const float*>(params[FCFG]);
  const float eps = fcfg[0];
  auto* out = static_cast<float*>(params[OUT]);
  // the model family's parts (an iconfig that ends before them: LLaMA's)
  const int32_t activation = icfg_len > c::ACTIVATION ? icfg[c::ACTIVATION] : kSiLU;
  const bool qk_norm = icfg_len > c::QK_NORM && icfg[c::QK_NORM] == 1;
  const bool sandwich = icfg_len > c::SANDWICH && icfg[c::SANDWICH] == 1;
  const int64_t window = icfg_len > c::WINDOW ? icfg[c::WINDOW] : 0;
  // the layer's own MLP (1 or absent), or none (0: out = x + attention; a mixture-of-experts layer, whose MLP is
  // MoeMlp's, passes placeholder gate/up/down matrices, which are not read)
  const bool mlp = icfg_len <= c::MLP || icfg[c::MLP] == 1;
  const bool has_sinks = icfg_len > c::SINKS && icfg[c::SINKS] == 1;
  const float* sinks = has_sinks ? static_cast<const float*>(params[SINKS]) : nullptr;
  // a BERT encoder's parts: LayerNorm, post norms, an ungated MLP, MLP biases
  const int32_t norm = icfg_len > c::NORM ? icfg[c::NORM] : kRmsNorm;
  const bool post = icfg_len > c::POST_NORMS && icfg[c::POST_NORMS] == 1;
  const bool gated = icfg_len <= c::GATED || icfg[c::GATED] == 1;
  const bool mlp_biased = icfg_len > c::MLP_BIASES && icfg[c::MLP_BIASES] == 1;
  auto is_flag = [](int32_t v) { return v == 0 || v == 1; };
  bool flags_valid = icfg_len <= c::QK_NORM || (is_flag(icfg[c::QK_NORM]) && is_flag(icfg[c::SANDWICH]));
  for (int64_t at = c::MLP; at < icfg_len; ++at) flags_valid = flags_valid && is_flag(icfg[at]);
  if ((activation != kSiLU && activation != kGeluTanh && activation != kGeluErf) || !flags_valid || window < 0 ||
      (post && sandwich)) {
    return 2;
  }

  const int64_t batch = shapes[X][0], h = shapes[X][1];
  const int64_t bs = icfg[c::BLOCK_SIZE], nh = icfg[c::NUM_HEADS], kvh = icfg[c::NUM_KV_HEADS];
  const int64_t d = shapes[COS][1], max_pos = shapes[COS][0], width = shapes[TABLES][1];
  const int64_t nqkv = (nh + 2 * kvh) * d, inter = shapes[UP_W][0];
  const int64_t cache_rows = shapes[KEYS][0];
  Matrix q_w, k_w, v_w, o_w, gate_w, up_w, down_w;
  const int64_t vec = llm_serving::cache_vector(cache_type, d);   // cache elements per head vector
  if (bs < 1 || nh < 1 || kvh < 1 || nh % kvh != 0 || d % 2 != 0 || shapes[KEYS][1] != vec ||
      shapes[VALUES][0] != cache_rows || shapes[VALUES][1] != vec || cache_rows % (kvh * bs) != 0 ||
      shapes[POS][0] != batch || shapes[SLOTS][0] != batch || shapes[TABLES][0] != batch ||
      shapes[CONTEXT][0] != batch || shapes[TREE][0] != batch || shapes[SIN][0] != max_pos ||
      shapes[SIN][1] != d || shapes[QKV_B][0] != nqkv || shapes[IN_GAIN][0] != h || shapes[POST_GAIN][0] != h ||
      shapes[Q_NORM][0] != d || shapes[K_NORM][0] != d || shapes[ATTN_OUT_GAIN][0] != h ||
      shapes[MLP_OUT_GAIN][0] != h || shapes[O_B][0] != h || shapes[SINKS][0] != nh ||
      shapes[GATE_UP_B][0] != 2 * inter || shapes[DOWN_B][0] != h || shapes[NORM_B][0] != 4 || shapes[NORM_B][1] != h ||
      !as_matrix(params[Q_W], dtypes[Q_W], shapes[Q_W], icfg[c::Q_TYPE], nh * d, h, &q_w) ||
      !as_matrix(params[K_W], dtypes[K_W], shapes[K_W], icfg[c::K_TYPE], kvh * d, h, &k_w) ||
      !as_matrix(params[V_W], dtypes[V_W], shapes[V_W], icfg[c::V_TYPE], kvh * d, h, &v_w) ||
      !as_matrix(params[O_W], dtypes[O_W], shapes[O_W], icfg[c::O_TYPE], h, nh * d, &o_w) ||
      !as_matrix(params[GATE_W], dtypes[GATE_W], shapes[GATE_W], icfg[c::GATE_TYPE], gated ? inter : 1, h, &gate_w) ||
      !as_matrix(params[UP_W], dtypes[UP_W], shapes[UP_W], icfg[c::UP_TYPE], inter, h, &up_w) ||
      !as_matrix(params[DOWN_W], dtypes[DOWN_W], shapes[DOWN_W], icfg[c::DOWN_TYPE], h, inter, &down_w) ||
      !layer_type(q_w.type) || !layer_type(k_w.type) || !layer_type(v_w.type) || !layer_type(o_w.type) ||
      !layer_type(gate_w.type) || !layer_type(up_w.type) || !layer_type(down_w.type) ||
      shapes[OUT][0] != batch || shapes[OUT][1] != h || shapes[LORA][0] != batch) {
    return 2;
  }
  LoraProduct lora_qkv, lora_o, lora_gate_up, lora_down;
  if (!lora_qkv.set(params[LORA_QKV_A], shapes[LORA_QKV_A], params[LORA_QKV_B], shapes[LORA_QKV_B], 3, nqkv, h,
                    nh * d, (nh + kvh) * d) ||
      !lora_o.set(params[LORA_O_A], shapes[LORA_O_A], params[LORA_O_B], shapes[LORA_O_B], 1, h, nh * d, h, h) ||
      !lora_gate_up.set(params[LORA_GATE_UP_A], shapes[LORA_GATE_UP_A], params[LORA_GATE_UP_B],
                        shapes[LORA_GATE_UP_B], 2, 2 * inter, h, inter, 2 * inter) ||
      !lora_down.set(params[LORA_DOWN_A], shapes[LORA_DOWN_A], params[LORA_DOWN_B], shapes[LORA_DOWN_B], 1, h, inter,
                     h, h) ||
      lora_o.slots != lora_qkv.slots || lora_gate_up.slots != lora_qkv.slots || lora_down.slots != lora_qkv.slots) {
    return 2;
  }
  const int64_t num_slots = cache_rows / kvh, num_blocks = num_slots / bs;
  for (int64_t b = 0; b < batch; ++b) {
    if (slots[b] < 0) continue;                       // sits this step out
    if (positions[b] < 0 || positions[b] >= max_pos || slots[b] >= num_slots) return 3;
    if (lora[b] < 0 || lora[b] >= lora_qkv.slots) return 3;
    const int64_t used = std::min<int64_t>(width, (std::max(0, context[b]) + bs - 1) / bs);
    for (int64_t j = 0; j < used; ++j) {
      if (tables[b * width + j] < 0 || tables[b * width + j] >= num_blocks) return 3;
    }
  }
  // rows that sit out at the end of the batch (a bucket's padding, a decode run's finished rows) are not
  // computed at all: at 64 rows the products are compute-bound, and a padding row costs as much as a real one
  int64_t rows = batch;
  while (rows > 0 && slots[rows - 1] < 0) --rows;
  if (rows < batch) std::memcpy(out + rows * h, x + rows * h, (batch - rows) * h * sizeof(float));
  if (rows == 0) return 0;                            // a decode run's step after all its rows ended

  const Timed timed(0);
  Pool& p = pool(std::max(1, icfg[c::THREADS]));
  std::lock_guard<std::mutex> lock(p.call_mutex());
  const int threads = p.threads();
  Scratch& s = p.scratch();
  float* qkv = Scratch::sized(s.qkv, rows * nqkv);
  float* attn = Scratch::sized(s.attn, rows * nh * d);
  float* act = Scratch::sized(s.act, rows * inter);
  float* normed = Scratch::sized(s.normed, threads * rows * std::max(h, d));
  float* scores = Scratch::sized(s.scores, threads * nh * width * bs);
  const int64_t kmax = std::max(std::max(h, inter), nh * d);
  float* tiles = Scratch::sized(s.tiles, threads * 8 * kmax);        // per thread: gate's and up's tiles
  // batched products (gemm_cpu.h): x packed once per product (shared), each thread's dequantized group and C
  // (gemm_amx.h on AMX)
  const bool amx = amx_enabled();
  const bool float32 = q_w.type == kF32 && k_w.type == kF32 && v_w.type == kF32 && o_w.type == kF32 &&
                       (!mlp || (gate_w.type == kF32 && up_w.type == kF32 && down_w.type == kF32));
  // which products run on the integer tiles (gemm_amx_int.h): q/k/v, o, gate/up, down
  const Matrix* gate_up[2] = {&gate_w, &up_w};
  // the MLP's first product: gate and up, or up alone (an ungated MLP: gate_w is a placeholder, not read)
  const Matrix* const* mlp_w = gated ? gate_up : gate_up + 1;
  const int mlp_parts = gated ? 2 : 1;
  const Matrix* qkv_parts[3] = {&q_w, &k_w, &v_w};
  const Matrix* o_part[1] = {&o_w};
  const Matrix* down_part[1] = {&down_w};
  const bool ints = int_enabled(amx);
  int int_qkv = integer_product(qkv_parts, 3, ints), int_o = integer_product(o_part, 1, ints),
      int_gate_up = integer_product(mlp_w, mlp_parts, ints), int_down = integer_product(down_part, 1, ints);
  const bool all_int = int_qkv != kNoInt && int_o != kNoInt && (!mlp || (int_gate_up != kNoInt && int_down != kNoInt));
  const bool invariant = invariant_of(icfg, shapes[ICFG][0], c::INVARIANT);
  const bool batched = !invariant && rows >= (all_int ? kIntGemmRows : gemm_rows(amx, float32));
  const Route route = route_of(invariant, batched, rows);
  const bool lanes = route == Route::kLanes;
  if (!batched) int_qkv = int_o = int_gate_up = int_down = kNoInt;
  // each product's route: the step's, or kInt where its parts all have integer codes (and AMX's tiles do not
  // take it)
  const bool avx2_ints = avx2_int_enabled();
  auto route_for = [&](const Matrix* const* parts, int n, int amx_ints) {
    return amx_ints == kNoInt && avx2_int_product(parts, n, avx2_ints) ? Route::kInt : route;
  };
  const Route route_qkv = route_for(qkv_parts, 3, int_qkv), route_o = route_for(o_part, 1, int_o),
              route_gu = route_for(mlp_w, mlp_parts, int_gate_up), route_down = route_for(down_part, 1, int_down);
  const Route routes[4] = {route_qkv, route_o, route_gu, route_down};
  // the routes' buffers: x packed (shared), per thread a group of weight rows and C (or lane sums, or kInt's)
  RouteFloats sizes{0, 0, 0};
  for (const Route r : {route, Route::kInt})
    if (std::find(routes, routes + 4, r) != routes + 4) sizes = widest(sizes, route_floats(r, rows, kmax, amx));
  const int64_t w_floats = sizes.w, c_floats = sizes.c;
  float* xp = sizes.x ? sized_aligned(s.packed, sizes.x) : nullptr;
  float* gemm_w = w_floats ? sized_aligned(s.gemm_w, threads * w_floats) : nullptr;
  float* gemm_c = c_floats ? sized_aligned(s.gemm_c, threads * c_floats) : nullptr;
  const int64_t dot_align = lanes ? kLaneGroup : invariant ? kDotGroup : 4;     // the chunks of a product's rows
  // a product's chunks of rows: whole groups (batched), kInt's tiles, or dot_align
  auto align_of = [&](Route r, int64_t k) {
    return r == Route::kBatched ? gemm_group(k, amx) : r == Route::kInt ? kIntTileRows : dot_align;
  };
  // gate/up: together in groups of units (batched, lanes), or each product by rows, then f (invariant, kInt)
  const bool gate_up_units = route_gu != Route::kInt && (batched || lanes);
  float* silu = gate_up_units ? Scratch::sized(s.silu, threads * 3 * rows) : nullptr;
  // an ungated MLP's f(up) is f(up) * 1: the activations' second factor, ones
  std::vector<float> ones(gated ? 0 : std::max(rows, inter), 1.f);
  float* up_sums = !gate_up_units && (invariant || route_gu == Route::kInt) ? Scratch::sized(s.up, rows * inter)
                                                                            : nullptr;
  // the computed rows that have a LoRA adapter, sorted by slot; thread t takes a contiguous share of them, so
  // that each slot's matrices are read once per thread and product however many rows use it
  std::vector<int64_t> lora_rows;
  for (int64_t b = 0; b < rows; ++b)
    if (slots[b] >= 0 && lora[b] > 0) lora_rows.push_back(b);
  std::stable_sort(lora_rows.begin(), lora_rows.end(), [&](int64_t p, int64_t q) { return lora[p] < lora[q]; });
  const bool adapted = !lora_rows.empty();
  const int64_t lora_width = 3 * lora_qkv.r;        // the widest u (q/k/v: 3 R)
  float* lora_u = adapted ? Scratch::sized(s.lora, rows * lora_width) : nullptr;    // A x of adapted rows
  float* lora_gu = adapted ? Scratch::sized(s.lora_gate_up, rows * 2 * inter) : nullptr;    // gate/up deltas
  const llm_serving::AttentionShape ash{kvh, nh / kvh, d, width, bs, vec};
  // step 3's work: consecutive rows of one sequence (a prompt's chunk: contexts growing by one, each row's block
  // table starting with the previous row's blocks, no token tree) go as tiles of up to kTileRows rows per KV
  // head (attend_tile: each key read once per tile); so does a lone row with a long context, a tile of one row
  // per KV head (its G query heads share each key tile: 1.6x attend_row's speed at 4k keys on the 1B); other
  // rows one at a time (attend_row), or a (row, KV head) each when rows are fewer than threads (a single decode
  // row would leave the other threads waiting). Largest first, so the threads finish together. Batch-invariant
  // (invariant_enabled): every row is a tile, a lone one (a decode row, a verify step's token) of one row per KV
  // head, a token tree's with its visible keys; attend_row only where the head size takes no tiles, for all.
  // A sliding window bounds the keys an item reads (and so its cost): its rows' windows, which overlap but for
  // one key a row.
  struct AttnItem { int64_t b, n, k0, k1, cost; bool tile; };
  std::vector<AttnItem> attn_items;
  {
    const int64_t parts = rows < threads ? kvh : 1;
    const bool tiled = llm_serving::tile_head_dim(d);
    auto keys_read = [&](int64_t c, int64_t n) { return window > 0 ? std::min<int64_t>(c, window + n - 1) : c; };
    auto follows = [&](int64_t e) {                 // row e continues row e - 1's sequence
      if (slots[e] < 0 || tree[e] != -1 || tree[e - 1] != -1 || context[e] != context[e - 1] + 1) return false;
      const int64_t used = std::min<int64_t>(width, (std::max(0, context[e - 1]) + bs - 1) / bs);
      return std::memcmp(tables + e * width, tables + (e - 1) * width, used * sizeof(int32_t)) == 0;
    };
    for (int64_t b = 0; b < rows;) {
      if (slots[b] < 0) { ++b; continue; }
      int64_t e = b + 1;
      while (tiled && e < rows && e - b < llm_serving::kTileRows && follows(e)) ++e;
      const int64_t cost = (e - b) * (keys_read(context[e - 1], e - b) + 1);
      if (e - b > 1) {
        for (int64_t k = 0; k < kvh; ++k) attn_items.push_back({b, e - b, k, k + 1, cost, true});
      } else if (tiled && (invariant || (tree[b] == -1 && keys_read(context[b], 1) >= llm_serving::kDecodeTileKeys))) {
        for (int64_t k = 0; k < kvh; ++k) attn_items.push_back({b, 1, k, k + 1, cost, true});
      } else {
        for (int64_t part = 0; part < parts; ++part)
          attn_items.push_back({b, 1, part * kvh / parts, (part + 1) * kvh / parts, cost, false});
      }
      b = e;
    }
    std::stable_sort(attn_items.begin(), attn_items.end(),
                     [](const AttnItem& x, const AttnItem& y) { return x.cost > y.cost; });
  }
  const int64_t tile_floats = llm_serving::tile_scratch_floats(nh / kvh, d);
  float* attn_tiles = Scratch::sized(s.attn_tiles, threads * tile_floats);
  const float q_scale = fcfg_len > 1 ? fcfg[1] : 1.f / std::sqrt(static_cast<float>(d));   // the attention scale
  float* sandwiched = sandwich ? Scratch::sized(s.sandwich, rows * h) : nullptr;   // o's, then down's result
  Barrier barrier(threads);
  std::atomic<int64_t> next_row{0};
  std::atomic<int64_t> next_qkv[3] = {{0}, {0}, {0}};                           // each product's rows handed out
  std::atomic<int64_t> next_o{0}, next_unit{0}, next_down{0};
  const int64_t qkv_first[3] = {0, nh * d, (nh + kvh) * d};                      // each part's first output row
  std::atomic<int64_t> next_pack[4] = {{0}, {0}, {0}, {0}};                      // and its x's panels

  p.run([&](int tid, int nthreads) {
    float* xn = normed + tid * rows * std::max(h, d);
    float* tile = tiles + tid * 8 * kmax;
    float* wbuf = gemm_w ? gemm_w + tid * w_floats : nullptr;
    float* cbuf = gemm_c ? gemm_c + tid * c_floats : nullptr;
    float* silu_row = silu ? silu + tid * 3 * rows : nullptr;     // and the unit's gate and up sums
    // batched, lanes or kInt: the product's x packed into xp by all threads (a barrier after), then read by every
    // chunk
    auto packed = [&](int which, Route r, const float* in, int64_t k_in, int integer) -> const float* {
      if (!packs_x(r)) return nullptr;
      pack_for(r, next_pack[which], in, rows, k_in, xp, amx, integer);
      barrier.wait();
      return xp;
    };
    // units [u0, u1) of several matrices together (gate and up): gemm_units, or lane_units where invariant
    auto units = [&](const Matrix* const* ws, int parts, int64_t u0, int64_t u1, const float* in, const float* x_packed,
                     auto&& done, int integer) {
      if (lanes) lane_units(ws, parts, u0, u1, in, x_packed, rows, wbuf, cbuf, done);
      else gemm_units(ws, parts, u0, u1, x_packed, rows, wbuf, cbuf, amx, done, integer);
    };
    // 1. q/k/v of every row (each thread normalizes the inputs itself: no barrier for it)
    // LoRA: this thread's share of the adapted rows computes their u = A x (before a product) and adds their
    // B u (after it, once every thread's part of the product is written), a run of rows of one slot at a time
    const int64_t mine0 = static_cast<int64_t>(lora_rows.size()) * tid / nthreads;
    const int64_t mine1 = static_cast<int64_t>(lora_rows.size()) * (tid + 1) / nthreads;
    auto by_slot = [&](auto&& fn) {
      for (int64_t at = mine0, end; at < mine1; at = end) {
        for (end = at + 1; end < mine1 && lora[lora_rows[end]] == lora[lora_rows[at]];) ++end;
        fn(lora[lora_rows[at]], lora_rows.data() + at, end - at);
      }
    };
    auto project = [&](const LoraProduct& lp, const float* in, int64_t k_in) {
      by_slot([&](int32_t slot, const int64_t* rs, int64_t count) {
        lp.project(slot, rs, count, in, k_in, lora_u, lora_width);
      });
    };
    auto add_rows = [&](const LoraProduct& lp, float* y, int64_t stride) {
      by_slot([&](int32_t slot, const int64_t* rs, int64_t count) { lp.add(slot, rs, count, lora_u, lora_width, y, stride); });
    };
    // (post norms: the layer's input is normalized already, the previous layer's last norm)
    if (!post) normalize(norm, x, rows, h, eps, in_gain, norm_b, xn);
    const float* xin = post ? x : xn;
    project(lora_qkv, xin, h);
    const float* xq = packed(0, route_qkv, xin, h, int_qkv);
    for (int part = 0; part < 3; ++part) {           // q, k then v rows: no barrier between them
      const Matrix& w = *qkv_parts[part];
      const int64_t first = qkv_first[part];
      claim_rows(next_qkv[part], w.rows, nthreads, [&](int64_t r0, int64_t r1) {
        product_rows(route_qkv, w, xin, xq, rows, r0, r1, tile, wbuf, cbuf, amx, [&](int64_t b, int64_t r, float v) {
          qkv[b * nqkv + first + r] = v + qkv_b[first + r];
        }, int_qkv);
      }, align_of(route_qkv, h));
    }
    barrier.wait();
    if (adapted) {
      add_rows(lora_qkv, qkv, nqkv);
      barrier.wait();
    }
    // 2. (qk norm: each q and k head RMS-normalized) RoPE on q and k (q also scaled by the attention scale), then k
    // and v into the cache at the token's slot
    for (int64_t b = tid; b < rows; b += nthreads) {
      if (slots[b] < 0) {
        std::memset(attn + b * nh * d, 0, nh * d * sizeof(float));
        continue;
      }
      const float* c = cos + positions[b] * d;
      const float* sn = sin + positions[b] * d;
      float* rot = xn;                                  // (D,) scratch: this row is done with xn
      if (qk_norm) {
        normalize_heads(qkv + b * nqkv, nh, d, eps, q_norm);
        normalize_heads(qkv + b * nqkv + nh * d, kvh, d, eps, k_norm);
      }
      for (int64_t head = 0; head < nh + kvh; ++head) {
        float* v = qkv + b * nqkv + head * d;
        const float scale = head < nh ? q_scale : 1.f;
        for (int64_t e = 0; e < d; ++e) rot[e] = (v[e] * c[e] + v[(e + d / 2) % d] * sn[e]) * scale;
        std::memcpy(v, rot, d * sizeof(float));
      }
      const float* kv = qkv + b * nqkv + nh * d;        // this row's K then V, (2, KVH, D)
      llm_serving::with_cache(cache_type, key_cache, value_cache, [&](auto* kc, auto* vc) {
        for (int64_t k = 0; k < kvh; ++k) {
          llm_serving::store_vector(kc + (slots[b] * kvh + k) * vec, kv + k * d, d);
          llm_serving::store_vector(vc + (slots[b] * kvh + k) * vec, kv + (kvh + k) * d, d);
        }
      });
    }
    barrier.wait();
    // 3. attention: the items (attn_items, above) taken one at a time
    const int64_t num_items = static_cast<int64_t>(attn_items.size());
    for (int64_t i = next_row.fetch_add(1); i < num_items; i = next_row.fetch_add(1)) {
      const AttnItem& it = attn_items[i];
      const int64_t b = it.b;
      // a lone row that sees keys past its own (an image's token: its image's later tokens) counts its window back
      // from its own position, as the causal rows do
      const int64_t window_keys = it.n == 1 && tree[b] == -1 && positions[b] + 1 < context[b] ? positions[b] + 1 : -1;
      llm_serving::with_cache(cache_type, key_cache, value_cache, [&](const auto* kc, const auto* vc) {
        if (it.tile) {
          llm_serving::attend_tile(qkv + b * nqkv, nqkv, it.n, context[b], kc, vc, tables + (b + it.n - 1) * width,
                                   it.k0, attn + b * nh * d, nh * d, ash, attn_tiles + tid * tile_floats,
                                   it.n == 1 ? static_cast<uint32_t>(tree[b]) : 0xFFFFFFFFu, window, sinks,
                                   window_keys);
        } else {
          llm_serving::attend_row(qkv + b * nqkv, kc, vc, tables + b * width, context[b],
                                  static_cast<uint32_t>(tree[b]), attn + b * nh * d, ash,
                                  scores + tid * nh * width * bs, it.k0, it.k1, window, sinks, window_keys);
        }
      });
    }
    barrier.wait();
    // 4. out = x + attn . o_w^T (sandwich: x + rmsnorm(attn . o_w^T) * attn_out_gain, the product's result whole
    // first, the rows normalized after a barrier)
    project(lora_o, attn, nh * d);
    const float* xo = packed(1, route_o, attn, nh * d, int_o);
    claim_rows(next_o, h, nthreads, [&](int64_t r0, int64_t r1) {
      if (sandwich) {
        product_rows(route_o, o_w, attn, xo, rows, r0, r1, tile, wbuf, cbuf, amx,
                     [&](int64_t b, int64_t r, float v) { sandwiched[b * h + r] = v + o_b[r]; }, int_o);
      } else {
        product_rows(route_o, o_w, attn, xo, rows, r0, r1, tile, wbuf, cbuf, amx,
                     [&](int64_t b, int64_t r, float v) { out[b * h + r] = x[b * h + r] + (v + o_b[r]); }, int_o);
      }
    }, align_of(route_o, nh * d));
    barrier.wait();
    if (adapted) {
      add_rows(lora_o, sandwich ? sandwiched : out, h);
      barrier.wait();
    }
    if (sandwich) {
      add_normalized(norm, sandwiched, x, tid, nthreads, rows, h, eps, attn_out_gain, norm_b + 2 * h, out, xn);
      barrier.wait();
    }
    if (post) {                                     // out = norm(x + o) (BERT)
      normalize_in_place(norm, out, tid, nthreads, rows, h, eps, attn_out_gain, norm_b + 2 * h);
      barrier.wait();
    }
    if (!mlp) return;                               // (MoeMlp follows)
    // 5. act = f(gate) * up (f: SiLU or GELU), each chunk of units j (gate row j, up row I + j) by one thread; an
    // ungated MLP's act = f(up) (its products' rows: up's); with MLP biases, gate's and up's added before f
    if (!post) normalize(norm, out, rows, h, eps, post_gain, norm_b + h, xn);
    const float* xm = post ? out : xn;              // the MLP's input
    const float* gate_b = mlp_biased && gated ? gate_up_b : nullptr;
    const float* up_b = mlp_biased ? gate_up_b + inter : nullptr;
    if (adapted) {                                  // each adapted row's gate/up deltas, whole, before the tiles
      project(lora_gate_up, xm, h);
      by_slot([&](int32_t, const int64_t* rs, int64_t count) {
        for (int64_t at = 0; at < count; ++at) std::fill(lora_gu + rs[at] * 2 * inter, lora_gu + (rs[at] + 1) * 2 * inter, 0.f);
      });
      add_rows(lora_gate_up, lora_gu, 2 * inter);
      barrier.wait();
    }
    if (gate_up_units) {                            // gate and up rows of a group of units together, then f
      const float* xg = packed(2, route_gu, xm, h, int_gate_up);
      claim_rows(next_unit, inter, nthreads, [&](int64_t r0, int64_t r1) {
        units(mlp_w, mlp_parts, r0, r1, xm, xg, [&](int64_t j, int64_t n, const float* c, int64_t ldc) {
          // unit by unit: its gate and up sums of every row are contiguous in C (one vectorized pass), then
          // written to each row of act (a row's strided access rather than C's)
          // (LoRA rows' deltas and the biases added first; activation_span, as the few-row invariant steps)
          float* g = silu_row + rows;
          float* v = silu_row + 2 * rows;
          for (int64_t i = 0; i < n; ++i) {
            // an ungated MLP's sums are up's (its one part): f's argument, times ones
            const float* gate = c + i * ldc;
            const float* up = gated ? c + (n + i) * ldc : nullptr;
            const float bias = gated ? (gate_b ? gate_b[j + i] : 0.f) : (up_b ? up_b[j + i] : 0.f);
            const int64_t delta = gated ? j + i : inter + j + i;     // gate's LoRA delta, or up's
            for (int64_t b = 0; b < rows; ++b) {
              const bool lora_row = adapted && lora[b] > 0 && slots[b] >= 0;
              g[b] = lora_row ? gate[b] + lora_gu[b * 2 * inter + delta] : gate[b];
              if (mlp_biased) g[b] += bias;
              if (gated) {
                v[b] = lora_row ? up[b] + lora_gu[b * 2 * inter + inter + j + i] : up[b];
                if (up_b) v[b] += up_b[j + i];
              }
            }
            activation_span(activation, g, gated ? v : ones.data(), rows, silu_row);
            for (int64_t b = 0; b < rows; ++b) act[b * inter + j + i] = silu_row[b];
          }
        }, int_gate_up);
      }, lanes ? kLaneGroup / 2 : gemm_group(h, amx) / 2);
    } else if (up_sums != nullptr) {                // gate's sums into act, up's beside, then f by row
      const float* xg = packed(2, route_gu, xm, h, kNoInt);
      claim_rows(next_unit, inter, nthreads, [&](int64_t r0, int64_t r1) {
        // (an ungated MLP: up's sums into act, f's argument)
        product_rows(route_gu, gated ? gate_w : up_w, xm, xg, rows, r0, r1, tile, wbuf, cbuf, amx,
                     [&](int64_t b, int64_t j, float v) { act[b * inter + j] = v; });
        if (gated) {
          product_rows(route_gu, up_w, xm, xg, rows, r0, r1, tile, wbuf, cbuf, amx,
                       [&](int64_t b, int64_t j, float v) { up_sums[b * inter + j] = v; });
        }
        for (int64_t b = 0; b < rows; ++b) {
          float* g = act + b * inter + r0;
          float* v = gated ? up_sums + b * inter + r0 : nullptr;
          if (adapted && lora[b] > 0 && slots[b] >= 0) {
            const float* delta = lora_gu + b * 2 * inter + r0;
            for (int64_t j = 0; j < r1 - r0; ++j) {
              if (gated) {
                g[j] += delta[j];
                v[j] += delta[inter + j];
              } else {
                g[j] += delta[inter + j];
              }
            }
          }
          if (mlp_biased) {
            const float* gb = gated ? gate_b : up_b;
            for (int64_t j = 0; j < r1 - r0; ++j) g[j] += gb[r0 + j];
            if (gated)
              for (int64_t j = 0; j < r1 - r0; ++j) v[j] += up_b[r0 + j];
          }
          activation_span(activation, g, gated ? v : ones.data(), r1 - r0, g);
        }
      }, align_of(route_gu, h));
    } else {
      claim_rows(next_unit, inter, nthreads, [&](int64_t r0, int64_t r1) {
        for (int64_t j = r0; j < r1; j += 4) {
          const int64_t n = std::min<int64_t>(4, r1 - j);
          // rows j .. j+n-1 of gate and of up (each in its own type): decoded in registers, or from a tile (an
          // ungated MLP: up's, as `gate`, f's argument)
          const Matrix& first_w = gated ? gate_w : up_w;
          const bool gate_fused = first_w.type != kF32 && rows <= kFusedRows;
          const bool up_fused = up_w.type != kF32 && rows <= kFusedRows;
          const float* gate_rows = gate_fused ? nullptr : first_w.tile_rows(j, n, tile);
          const float* up_rows = up_fused || !gated ? nullptr : up_w.tile_rows(j, n, tile + 4 * kmax);
          auto dots = [&](const Matrix& w, bool fused, const float* tiled, const float* xb, int bb, float out4[4][4]) {
            if (fused) {
              qdot(w, j, static_cast<int>(n), xb, bb, out4);
            } else if (n == 4) {
              dot_rows<4>(tiled, h, xb, h, bb, out4);
            } else {
              for (int64_t i = 0; i < n; ++i) dot_rows<1>(tiled + i * h, h, xb, h, bb, out4 + i);
            }
          };
          float gate[4][4], up[4][4];
          for (int64_t b0 = 0; b0 < rows; b0 += 4) {
            const int bb = static_cast<int>(std::min<int64_t>(4, rows - b0));
            dots(first_w, gate_fused, gate_rows, xm + b0 * h, bb, gate);
            if (gated) {
              dots(up_w, up_fused, up_rows, xm + b0 * h, bb, up);
            } else {
              for (int64_t i = 0; i < n; ++i)
                for (int b = 0; b < bb; ++b) up[i][b] = 1.f;
            }
            for (int b = 0; adapted && b < bb; ++b) {
              const int64_t row = b0 + b;
              if (lora[row] <= 0 || slots[row] < 0) continue;
              const float* g = lora_gu + row * 2 * inter + j;
              for (int64_t i = 0; i < n; ++i) {
                if (gated) {
                  gate[i][b] += g[i];
                  up[i][b] += g[inter + i];
                } else {
                  gate[i][b] += g[inter + i];
                }
              }
            }
            if (mlp_biased) {
              const float* gb = gated ? gate_b : up_b;
              for (int64_t i = 0; i < n; ++i)
                for (int b = 0; b < bb; ++b) {
                  gate[i][b] += gb[j + i];
                  if (gated) up[i][b] += up_b[j + i];
                }
            }
            if (activation != kSiLU) {
              gelu_block(activation, gate, up, n, bb, act + b0 * inter + j, inter);
            } else {
              for (int64_t i = 0; i < n; ++i)
                for (int b = 0; b < bb; ++b) act[(b0 + b) * inter + j + i] = silu_times(gate[i][b], up[i][b]);
            }
          }
        }
      });
    }
    barrier.wait();
    // 6. out += act . down_w^T (+ its bias) (sandwich: out += norm(act . down_w^T) * mlp_out_gain, as step 4; post
    // norms: out = norm(out + act . down_w^T))
    project(lora_down, act, inter);
    const float* xd = packed(3, route_down, act, inter, int_down);
    const float* db = mlp_biased ? down_b : nullptr;
    claim_rows(next_down, h, nthreads, [&](int64_t r0, int64_t r1) {
      if (sandwich) {
        product_rows(route_down, down_w, act, xd, rows, r0, r1, tile, wbuf, cbuf, amx,
                     [&](int64_t b, int64_t r, float v) { sandwiched[b * h + r] = db ? v + db[r] : v; }, int_down);
      } else if (db) {
        product_rows(route_down, down_w, act, xd, rows, r0, r1, tile, wbuf, cbuf, amx,
                     [&](int64_t b, int64_t r, float v) { out[b * h + r] += v + db[r]; }, int_down);
      } else {
        product_rows(route_down, down_w, act, xd, rows, r0, r1, tile, wbuf, cbuf, amx,
                     [&](int64_t b, int64_t r, float v) { out[b * h + r] += v; }, int_down);
      }
    }, align_of(route_down, inter));
    if (adapted) {
      barrier.wait();
      add_rows(lora_down, sandwich ? sandwiched : out, h);
    }
    if (sandwich) {
      barrier.wait();
      add_normalized(norm, sandwiched, out, tid, nthreads, rows, h, eps, mlp_out_gain, norm_b + 3 * h, out, xn);
    }
    if (post) {
      barrier.wait();
      normalize_in_place(norm, out, tid, nthreads, rows, h, eps, mlp_out_gain, norm_b + 3 * h);
    }
  });
  return 0;
}

// ----------------------------------------------------------------------------------------- mixture of experts
//
// MoeMlp(x, slots, router, router_bias, gate_w, up_w, down_w, post_gain, iconfig, fconfig) -> out: a
// mixture-of-experts layer's MLP (Qwen3-MoE, Mixtral), run after its DecoderLayer without an MLP (iconfig[16] 0).
//   x            (B, H)        float32  the hidden states after the layer's attention (and its residual)
//   slots        (B,)          int32    < 0 at the end of the batch: padding, not computed (out = x there)
//   router       (E, H)        float32  one row of logits weights per expert; router_bias (E,) added (zeros
//                                       for a router without one)
//   gate_w, up_w (E*I, H)      weight   expert e's rows e*I .. e*I + I - 1, each expert in the file's type
//   down_w       (E*H, I)      weight   expert e's rows e*H .. e*H + H - 1
//   gate_bias, up_bias (E*I,), down_bias (E*H,)  float32  the experts' biases, stacked alike (zeros: none)
//   post_gain    (H,)          float32  the post-attention norm's gain
//   iconfig      (7,)          int32    MOE_MLP_ICONFIG's entries (below)
//   fconfig      (3,)          float32  [rms_norm_eps, alpha, limit (the clamped SwiGLU's)]
//   out          (B, H)        float32  x + sum over the row's K experts e of w_e * down_e(act(gate_e(xn), up_e(xn))),
//                                       xn = rmsnorm(x) * post_gain; act SiLU(g) * u, or gpt-oss's
//                                       g' sigmoid(alpha g') (u' + 1), g' = min(g, limit), u' = u clamped to
//                                       +-limit (each product + its bias)
// A row's experts are its K largest logits (ties: the lower expert first). The rows are then grouped by expert,
// so that each chosen expert's rows are read once per call for all the rows that chose it, and no other
// expert's rows are read at all: a decode row reads K of E experts. The work is split over the pool's threads
// as units of (expert, a chunk of its output rows), the gate/up units first, then the down units, handed out
// to whichever thread is free (a barrier between: the down product reads every unit's activations).
// Batch-invariant by construction: each (row, expert) product runs gemm_avx2_int.h (integer codes: every row's
// outputs the same bits among any rows) or dot_gemm (float weights: one order of sums per output), and a row's
// K results are added in its top-K order, so a row's output does not depend on the other rows of the call.
#define MOE_MLP_PARAMS(P)                                                                                        \
  P(X, "x", 2, "float32") P(SLOTS, "slots", 1, "int32") P(ROUTER, "router", 2, "float32")                        \
  P(ROUTER_B, "router_bias", 1, "float32") P(GATE_W, "gate_w", 2, "weight") P(UP_W, "up_w", 2, "weight")         \
  P(DOWN_W, "down_w", 2, "weight") P(GATE_B, "gate_bias", 1, "float32") P(UP_B, "up_bias", 1, "float32")        \
  P(DOWN_B, "down_bias", 1, "float32") P(POST_GAIN, "post_gain", 1, "float32") P(ICFG, "iconfig", 1, "int32")     \
  P(FCFG, "fconfig", 1, "float32") P(OUT, "out", 2, "float32")
#define MOE_MLP_ICONFIG(I)                                                                                       \
  I(THREADS, "threads") I(EXPERTS_PER_TOKEN, "experts_per_token")                                                \
  I(GATE_TYPE, "gate_type") I(UP_TYPE, "up_type") I(DOWN_TYPE, "down_type")                                      \
  /* 1: the chosen K's weights are a softmax over their own logits (Mixtral; Qwen3-MoE's norm_topk_prob;         \
     gpt-oss), 0 their probabilities among all E (Qwen3-MoE without it) */                                       \
  I(RENORMALIZE, "renormalize")                                                                                  \
  /* 0 SiLU, 1 gpt-oss's clamped SwiGLU */                                                                       \
  I(ACTIVATION, "activation")

namespace {
const llm_serving::ParamSpec kMoeMlpParams[] = {MOE_MLP_PARAMS(LLM_SERVING_PARAM_SPEC)};
namespace moe_cfg {
enum : int64_t { MOE_MLP_ICONFIG(LLM_SERVING_FIELD_ENUM) COUNT };
const char* const kNames[] = {MOE_MLP_ICONFIG(LLM_SERVING_FIELD_NAME)};
}  // namespace moe_cfg

// x . w over k values, 8 running sums (one compiled copy: the same float for a row whoever calls it)
__attribute__((noinline)) float router_logit(const float* x, const float* w, int64_t k) {
  float acc[8] = {};
  int64_t e = 0;
  for (; e + 8 <= k; e += 8)
    for (int i = 0; i < 8; ++i) acc[i] += x[e + i] * w[e + i];
  for (int i = 0; e + i < k; ++i) acc[i] += x[e + i] * w[e + i];
  return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

// A row's K experts (largest logits first, ties to the lower index) and their weights
void route_row(const float* logits, int64_t experts, int64_t k, bool renormalize, int32_t* chosen, float* weight) {
  float top = logits[0];
  for (int64_t e = 1; e < experts; ++e) top = std::max(top, logits[e]);
  double all = 0.0;
  for (int64_t e = 0; e < experts; ++e) all += std::exp(static_cast<double>(logits[e]) - top);
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < experts; ++e) {
      bool taken = false;
      for (int64_t i = 0; i < j && !taken; ++i) taken = chosen[i] == e;
      if (!taken && (best < 0 || logits[e] > logits[best])) best = e;
    }
    chosen[j] = static_cast<int32_t>(best);
  }
  double kept = 0.0;
  for (int64_t j = 0; j < k; ++j) kept += std::exp(static_cast<double>(logits[chosen[j]]) - top);
  for (int64_t j = 0; j < k; ++j)
    weight[j] = static_cast<float>(std::exp(static_cast<double>(logits[chosen[j]]) - top) / (renormalize ? kept : all));
}

// gpt-oss's activation of one unit: min(g, limit) sigmoid(alpha min(g, limit)) (clamp(u, -limit, limit) + 1)
__attribute__((noinline)) float clamped_swiglu(float g, float u, float alpha, float limit) {
  const float gc = std::min(g, limit), uc = std::min(std::max(u, -limit), limit);
  return sigmoid_times(gc, alpha * gc, uc + 1.f);
}

// Rows [e * per, (e + 1) * per) of a stacked experts' matrix as a Matrix of its own
inline Matrix expert_rows(const Matrix& w, int64_t e, int64_t per) {
  return Matrix{w.data + e * per * w.row_bytes, w.type, per, w.k, w.row_bytes};
}
}  // namespace

extern "C" const char* MoeMlpParams() { return LLM_SERVING_DESCRIBED(kMoeMlpParams); }
extern "C" const char* MoeMlpIconfig() { return LLM_SERVING_NAMED(moe_cfg::kNames); }

extern "C" int MoeMlp(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes, void* stream,
                      void* extra) {
  (void)stream;
  (void)extra;
  enum { MOE_MLP_PARAMS(LLM_SERVING_PARAM_ENUM) NPARAM };
  if (!llm_serving::params_match(kMoeMlpParams, NPARAM, nparam, ndims, dtypes)) return 1;
  if (shapes[ICFG][0] != 7 || shapes[FCFG][0] != 3) return 2;
  const auto* x = static_cast<const float*>(params[X]);
  const auto* slots = static_cast<const int32_t*>(params[SLOTS]);
  const auto* router = static_cast<const float*>(params[ROUTER]);
  const auto* router_b = static_cast<const float*>(params[ROUTER_B]);
  const auto* gain = static_cast<const float*>(params[POST_GAIN]);
  const auto* gate_b = static_cast<const float*>(params[GATE_B]);
  const auto* up_b = static_cast<const float*>(params[UP_B]);
  const auto* down_b = static_cast<const float*>(params[DOWN_B]);
  namespace c = moe_cfg;
  const auto* icfg = static_cast<const int32_t*>(params[ICFG]);
  const auto* fcfg = static_cast<const float*>(params[FCFG]);
  const float eps = fcfg[0], alpha = fcfg[1], limit = fcfg[2];
  const bool clamped = icfg[c::ACTIVATION] == 1;
  auto* out = static_cast<float*>(params[OUT]);
  const int64_t batch = shapes[X][0], h = shapes[X][1], experts = shapes[ROUTER][0], k = icfg[c::EXPERTS_PER_TOKEN];
  const int64_t inter = experts > 0 ? shapes[GATE_W][0] / experts : 0;
  Matrix gate_w, up_w, down_w;
  if (shapes[ICFG][0] != c::COUNT || experts < 1 || k < 1 || k > experts || inter < 1 ||
      shapes[GATE_W][0] != experts * inter ||
      (icfg[c::RENORMALIZE] != 0 && icfg[c::RENORMALIZE] != 1) ||
      (icfg[c::ACTIVATION] != 0 && icfg[c::ACTIVATION] != 1) || shapes[GATE_B][0] != experts * inter ||
      shapes[UP_B][0] != experts * inter || shapes[DOWN_B][0] != experts * h ||
      shapes[SLOTS][0] != batch || shapes[ROUTER][1] != h ||
      shapes[ROUTER_B][0] != experts || shapes[POST_GAIN][0] != h || shapes[OUT][0] != batch ||
      shapes[OUT][1] != h ||
      !as_matrix(params[GATE_W], dtypes[GATE_W], shapes[GATE_W], icfg[c::GATE_TYPE], experts * inter, h, &gate_w) ||
      !as_matrix(params[UP_W], dtypes[UP_W], shapes[UP_W], icfg[c::UP_TYPE], experts * inter, h, &up_w) ||
      !as_matrix(params[DOWN_W], dtypes[DOWN_W], shapes[DOWN_W], icfg[c::DOWN_TYPE], experts * h, inter, &down_w)) {
    return 2;
  }
  const bool renormalize = icfg[c::RENORMALIZE] == 1;
  int64_t rows = batch;
  while (rows > 0 && slots[rows - 1] < 0) --rows;
  if (rows < batch) std::memcpy(out + rows * h, x + rows * h, (batch - rows) * h * sizeof(float));
  if (rows == 0) return 0;

  const Timed timed(0);
  Pool& p = pool(std::max(1, icfg[c::THREADS]));
  std::lock_guard<std::mutex> lock(p.call_mutex());
  const int threads = p.threads();
  Scratch& s = p.scratch();
  const int64_t entries = rows * k;                  // (row, chosen expert) pairs, grouped by expert
  float* xn = Scratch::sized(s.normed, rows * h);
  float* logits = Scratch::sized(s.scores, rows * experts);
  float* xg = Scratch::sized(s.qkv, entries * h);    // each entry's xn, by expert
  float* gate = Scratch::sized(s.act, entries * inter);
  float* up = Scratch::sized(s.up, entries * inter);
  float* y = Scratch::sized(s.attn, entries * h);    // each entry's down product
  std::vector<int32_t> chosen(entries), first(experts + 1, 0), entry_of(entries);
  std::vector<float> weight(entries);
  struct Unit { int64_t e, r0, r1; };
  std::vector<Unit> gate_units, down_units;
  // the products' routes: integer codes on gemm_avx2_int.h, float weights by dot_gemm
  const bool ints = avx2_int_enabled();
  const Matrix* gate_up[2] = {&gate_w, &up_w};
  const Matrix* down_part[1] = {&down_w};
  const Route route_gu = avx2_int_product(gate_up, 2, ints) ? Route::kInt : Route::kDot;
  const Route route_down = avx2_int_product(down_part, 1, ints) ? Route::kInt : Route::kDot;
  // buffers for the most entries an expert can have (every row): x packed (shared), a thread's weights and sums
  RouteFloats sizes = widest(route_floats(route_gu, rows, h, false), route_floats(route_down, rows, inter, false));
  const int64_t x_floats = std::max(route_floats(route_gu, entries, h, false).x,
                                    route_floats(route_down, entries, inter, false).x);
  float* xp = x_floats ? sized_aligned(s.packed, x_floats) : nullptr;
  float* gemm_w = sizes.w ? sized_aligned(s.gemm_w, threads * sizes.w) : nullptr;
  float* gemm_c = sizes.c ? sized_aligned(s.gemm_c, threads * sizes.c) : nullptr;
  // packed x of `count` entries from entry `at`, as the route reads it (kInt: a record per row; dot_gemm: none)
  auto packed_at = [&](Route r, int64_t at, int64_t width) -> const float* {
    if (r != Route::kInt) return nullptr;
#if defined(LLM_SERVING_AVX2_INT)
    return xp + at * llm_serving::avx2_int::x_bytes(width) / 4;
#else
    (void)at, (void)width;
    return nullptr;
#endif
  };
  // units of (expert, chunk of output rows): about 8 a thread, whole tiles of 16
  auto make_units = [&](int64_t per, std::vector<Unit>& units) {
    int64_t active = 0;
    for (int64_t e = 0; e < experts; ++e) active += first[e + 1] > first[e];
    const int64_t chunk = std::min(per, std::max<int64_t>(16, (per * active / (8 * threads) + 15) / 16 * 16));
    for (int64_t e = 0; e < experts; ++e)
      if (first[e + 1] > first[e])
        for (int64_t r0 = 0; r0 < per; r0 += chunk) units.push_back({e, r0, std::min(per, r0 + chunk)});
  };
  // src's entries (width values each) packed for gemm_avx2_int.h, each expert's group as the product of its own
  // rows reads it (the record's layout depends on the rows: gemm_avx2_int.h's lanes_layout); thread tid's share
  std::vector<int32_t> expert_of(entries);
  auto pack_entries = [&](int tid, int nthreads, const float* src, int64_t width) {
#if defined(LLM_SERVING_AVX2_INT)
    const int64_t stride = llm_serving::avx2_int::x_bytes(width);
    for (int64_t i = tid; i < entries; i += nthreads) {
      const int64_t at = first[expert_of[i]], m = first[expert_of[i] + 1] - at;
      llm_serving::avx2_int::pack_rows(src + at * width, width, width, m, i - at, i - at + 1,
                                       reinterpret_cast<uint8_t*>(xp) + at * stride);
    }
#else
    (void)tid, (void)nthreads, (void)src, (void)width;
#endif
  };
  Barrier barrier(threads);
  std::atomic<int64_t> next_gate{0}, next_down{0};

  p.run([&](int tid, int nthreads) {
    float* wbuf = gemm_w ? gemm_w + tid * sizes.w : nullptr;
    float* cbuf = gemm_c ? gemm_c + tid * sizes.c : nullptr;
    // 1. each row normalized, its router logits
    for (int64_t b = tid; b < rows; b += nthreads) {
      rms_normalize(x + b * h, 1, h, eps, gain, xn + b * h);
      for (int64_t e = 0; e < experts; ++e)
        logits[b * experts + e] = router_logit(xn + b * h, router + e * h, h) + router_b[e];
    }
    barrier.wait();
    // 2. (thread 0) each row's experts and weights; the entries grouped by expert, rows in order within each
    if (tid == 0) {
      for (int64_t b = 0; b < rows; ++b) {
        route_row(logits + b * experts, experts, k, renormalize, chosen.data() + b * k, weight.data() + b * k);
        for (int64_t j = 0; j < k; ++j) ++first[chosen[b * k + j] + 1];
      }
      for (int64_t e = 0; e < experts; ++e) {
        first[e + 1] += first[e];
        for (int64_t i = first[e]; i < first[e + 1]; ++i) expert_of[i] = static_cast<int32_t>(e);
      }
      std::vector<int64_t> fill(first.begin(), first.end() - 1);
      for (int64_t b = 0; b < rows; ++b)
        for (int64_t j = 0; j < k; ++j) entry_of[b * k + j] = static_cast<int32_t>(fill[chosen[b * k + j]]++);
      make_units(inter, gate_units);
      make_units(h, down_units);
    }
    barrier.wait();
    // 3. each entry's xn in its expert's group, then packed for the gate/up products
    for (int64_t i = tid; i < entries; i += nthreads)
      std::memcpy(xg + entry_of[i] * h, xn + (i / k) * h, h * sizeof(float));
    barrier.wait();
    if (route_gu == Route::kInt) {
      pack_entries(tid, nthreads, xg, h);
      barrier.wait();
    }
    // 4. gate and up: unit (e, rows r0..r1) for each of expert e's entries, then act = f(gate) * up in place of gate
    const int64_t ngate = static_cast<int64_t>(gate_units.size());
    for (int64_t u = next_gate.fetch_add(1); u < ngate; u = next_gate.fetch_add(1)) {
      const Unit& unit = gate_units[u];
      const int64_t at = first[unit.e], m = first[unit.e + 1] - at;
      const Matrix gw = expert_rows(gate_w, unit.e, inter), uw = expert_rows(up_w, unit.e, inter);
      const float* in = xg + at * h;
      const float* in_packed = packed_at(route_gu, at, h);
      const float* gb = gate_b + unit.e * inter;
      const float* ub = up_b + unit.e * inter;
      product_rows(route_gu, gw, in, in_packed, m, unit.r0, unit.r1, nullptr, wbuf, cbuf, false,
                   [&](int64_t b, int64_t r, float v) { gate[(at + b) * inter + r] = v + gb[r]; });
      product_rows(route_gu, uw, in, in_packed, m, unit.r0, unit.r1, nullptr, wbuf, cbuf, false,
                   [&](int64_t b, int64_t r, float v) { up[(at + b) * inter + r] = v + ub[r]; });
      for (int64_t b = 0; b < m; ++b) {
        float* g = gate + (at + b) * inter + unit.r0;
        const float* u = up + (at + b) * inter + unit.r0;
        if (clamped) {
          for (int64_t r = 0; r < unit.r1 - unit.r0; ++r) g[r] = clamped_swiglu(g[r], u[r], alpha, limit);
        } else {
          activation_span(kSiLU, g, u, unit.r1 - unit.r0, g);
        }
      }
    }
    barrier.wait();
    if (route_down == Route::kInt) {
      pack_entries(tid, nthreads, gate, inter);
      barrier.wait();
    }
    // 5. down: unit (e, rows r0..r1) of expert e's entries' activations
    const int64_t ndown = static_cast<int64_t>(down_units.size());
    for (int64_t u = next_down.fetch_add(1); u < ndown; u = next_down.fetch_add(1)) {
      const Unit& unit = down_units[u];
      const int64_t at = first[unit.e], m = first[unit.e + 1] - at;
      const Matrix dw = expert_rows(down_w, unit.e, h);
      const float* db = down_b + unit.e * h;
      product_rows(route_down, dw, gate + at * inter, packed_at(route_down, at, inter), m, unit.r0, unit.r1, nullptr,
                   wbuf, cbuf, false, [&](int64_t b, int64_t r, float v) { y[(at + b) * h + r] = v + db[r]; });
    }
    barrier.wait();
    // 6. each row: x + its experts' results weighted, added in its top-K order
    for (int64_t b = tid; b < rows; b += nthreads) {
      float* o = out + b * h;
      std::fill(o, o + h, 0.f);
      for (int64_t j = 0; j < k; ++j) {
        const float wj = weight[b * k + j];
        const float* yj = y + static_cast<int64_t>(entry_of[b * k + j]) * h;
        for (int64_t e = 0; e < h; ++e) o[e] += wj * yj[e];
      }
      for (int64_t e = 0; e < h; ++e) o[e] += x[b * h + e];
    }
  });
  return 0;
}

extern "C" int FinalLogits(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                           void* stream, void* extra) {
  (void)stream;
  (void)extra;
  enum { FINAL_LOGITS_PARAMS(LLM_SERVING_PARAM_ENUM) NPARAM };
  if (!llm_serving::params_match(kFinalLogitsParams, NPARAM, nparam, ndims, dtypes)) return 1;
  const int64_t rows = shapes[X][0], h = shapes[X][1], vocab = shapes[W][0];
  const auto* icfg = static_cast<const int32_t*>(params[ICFG]);
  Matrix w;
  namespace c = logits_cfg;
  if ((shapes[ICFG][0] != c::INVARIANT && shapes[ICFG][0] != c::COUNT) ||
      !as_matrix(params[W], dtypes[W], shapes[W], icfg[c::LM_HEAD_TYPE], vocab, h, &w) ||
      !layer_type(w.type) ||
      shapes[GAIN][0] != h || shapes[SLOTS][0] != rows || shapes[LOGITS][0] != rows ||
      shapes[LOGITS][1] != vocab || shapes[TOKEN][0] != rows || shapes[LOGPROB][0] != rows || vocab < 1) {
    return 2;
  }
  const auto* x = static_cast<const float*>(params[X]);
  const auto* gain = static_cast<const float*>(params[GAIN]);
  const auto* slots = static_cast<const int32_t*>(params[SLOTS]);
  const int threads = std::max(1, icfg[c::THREADS]);
  const float eps = static_cast<const float*>(params[FCFG])[0];
  auto* logits = static_cast<float*>(params[LOGITS]);
  auto* token = static_cast<int32_t*>(params[TOKEN]);
  auto* logprob = static_cast<float*>(params[LOGPROB]);
  // rows that sit out at the end (padding, a decode run's finished rows) are not computed: token 0, logprob 0
  int64_t live = rows;
  while (live > 0 && slots[live - 1] < 0) --live;
  std::fill(token + live, token + rows, 0);
  std::fill(logprob + live, logprob + rows, 0.f);
  if (live == 0) return 0;                        // a decode run's step after all its rows ended
  const Timed timed(1);
  Pool& p = pool(threads);
  std::lock_guard<std::mutex> lock(p.call_mutex());
  Scratch& s = p.scratch();
  float* normed = Scratch::sized(s.normed, p.threads() * live * h);
  // per chunk of the vocabulary and row: [max, its first index, sum of e^(logit - max)], merged in chunk order
  // after (whichever thread took a chunk, the result is the same to the bit)
  // batched (gemm_cpu.h): chunks of whole groups of rows, x packed once (shared) after every thread normalized it
  const bool amx = amx_enabled();
  const Matrix* lm_part[1] = {&w};
  const int lm_ints = integer_product(lm_part, 1, int_enabled(amx));
  // batch-invariant: dot_gemm or lane_units, and chunks of the vocabulary of one size whatever the rows (a row's
  // log-probability sums its chunks' parts in order)
  const bool invariant = invariant_of(icfg, shapes[ICFG][0], c::INVARIANT);
  const bool batched = !invariant && live >= (lm_ints != kNoInt ? kIntGemmRows : gemm_rows(amx, w.type == kF32));
  const int ints = batched ? lm_ints : kNoInt;
  // integer codes that AMX's tiles do not take: gemm_avx2_int.h, at any rows (chunks of one size whatever the rows)
  const Route route = ints == kNoInt && avx2_int_product(lm_part, 1, avx2_int_enabled())
                          ? Route::kInt : route_of(invariant, batched, live);
  const int64_t align = route == Route::kBatched ? gemm_group(h, amx)
                        : route == Route::kInt ? kIntTileRows : invariant ? kDotGroup : 4;
  const int64_t chunk = chunk_rows(vocab, p.threads(), align), chunks = (vocab + chunk - 1) / chunk;
  float* partial = Scratch::sized(s.scores, chunks * live * 3);
  float* tiles = Scratch::sized(s.tiles, p.threads() * 4 * h);
  const RouteFloats sizes = route_floats(route, live, h, amx);
  const int64_t w_floats = sizes.w, c_floats = sizes.c;
  float* xp = sizes.x ? sized_aligned(s.packed, sizes.x) : nullptr;
  float* gemm_w = w_floats ? sized_aligned(s.gemm_w, p.threads() * w_floats) : nullptr;
  float* gemm_c = c_floats ? sized_aligned(s.gemm_c, p.threads() * c_floats) : nullptr;
  Barrier barrier(p.threads());
  std::atomic<int64_t> next_vocab{0}, next_pack{0};
  p.run([&](int tid, int nthreads) {
    float* xn = normed + tid * live * h;
    rms_normalize(x, live, h, eps, gain, xn);
    if (xp != nullptr) {
      pack_for(route, next_pack, xn, live, h, xp, amx, ints);
      barrier.wait();
    }
    claim_rows(next_vocab, vocab, nthreads, [&](int64_t r0, int64_t r1) {
      product_rows(route, w, xn, xp, live, r0, r1, tiles + tid * 4 * h, gemm_w ? gemm_w + tid * w_floats : nullptr,
                   gemm_c ? gemm_c + tid * c_floats : nullptr, amx,
                   [&](int64_t b, int64_t r, float v) { logits[b * vocab + r] = v; }, ints);
      for (int64_t b = 0; b < live; ++b) {          // the chunk's max, first index of it, and sum of exps
        const float* l = logits + b * vocab;
        float mx = -INFINITY;
        int64_t at = r0;
        for (int64_t r = r0; r < r1; ++r) {
          if (l[r] > mx) {
            mx = l[r];
            at = r;
          }
        }
        float sum = 0.f;
        for (int64_t r = r0; r < r1; ++r) sum += llm_serving::exp_nonpositive(l[r] - mx);
        float* part = partial + ((r0 / chunk) * live + b) * 3;
        part[0] = mx;
        part[1] = static_cast<float>(at);
        part[2] = sum;
      }
    }, align);
    barrier.wait();
    for (int64_t b = tid; b < live; b += nthreads) {  // greedy token = the first index of the largest logit
      float mx = -INFINITY, at = 0.f;
      for (int64_t c = 0; c < chunks; ++c) {
        const float* part = partial + (c * live + b) * 3;
        if (part[0] > mx) {
          mx = part[0];
          at = part[1];
        }
      }
      float sum = 0.f;
      for (int64_t c = 0; c < chunks; ++c) {
        const float* part = partial + (c * live + b) * 3;
        sum += part[2] * llm_serving::exp_nonpositive(part[0] - mx);
      }
      token[b] = static_cast<int32_t>(at);
      logprob[b] = -std::log(sum);                    // log_softmax at the max: 0 - log(sum e^(l - max))
    }
  }, /*last_of_step=*/true);
  return 0;
}

// EmbedTokens(ids (T,) int32, table (V, K) weight, iconfig [table_type]) -> out (T, K) float32: each token's row
// of the embedding, read from the table as stored (a GGUF's quantized rows dequantized one row per token), so
// the embedding needs no float32 copy; a tied lm_head's repacked panels (a repacked type) give each row's stored
// bytes back first (avx2_int::stored_row), the same floats. Ids outside [0, V) return 3.
#define EMBED_TOKENS_PARAMS(P) \
  P(IDS, "ids", 1, "int32") P(TABLE, "table", 2, "weight") P(ICFG, "iconfig", 1, "int32") P(OUT, "out", 2, "float32")
#define EMBED_TOKENS_ICONFIG(I) I(TABLE_TYPE, "table_type")

namespace {
const llm_serving::ParamSpec kEmbedTokensParams[] = {EMBED_TOKENS_PARAMS(LLM_SERVING_PARAM_SPEC)};
namespace embed_cfg {
enum : int64_t { EMBED_TOKENS_ICONFIG(LLM_SERVING_FIELD_ENUM) COUNT };
const char* const kNames[] = {EMBED_TOKENS_ICONFIG(LLM_SERVING_FIELD_NAME)};
}  // namespace embed_cfg
}  // namespace

extern "C" const char* EmbedTokensParams() { return LLM_SERVING_DESCRIBED(kEmbedTokensParams); }
extern "C" const char* EmbedTokensIconfig() { return LLM_SERVING_NAMED(embed_cfg::kNames); }

extern "C" int EmbedTokens(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                           void* stream, void* extra) {
  (void)stream;
  (void)extra;
  enum { EMBED_TOKENS_PARAMS(LLM_SERVING_PARAM_ENUM) NPARAM };
  if (!llm_serving::params_match(kEmbedTokensParams, NPARAM, nparam, ndims, dtypes)) return 1;
  const int64_t tokens = shapes[IDS][0], vocab = shapes[TABLE][0], k = shapes[OUT][1];
  const auto* icfg = static_cast<const int32_t*>(params[ICFG]);
  Matrix table;
  if (shapes[ICFG][0] != embed_cfg::COUNT || shapes[OUT][0] != tokens ||
      !as_matrix(params[TABLE], dtypes[TABLE], shapes[TABLE], icfg[embed_cfg::TABLE_TYPE], vocab, k, &table)) {
    return 2;
  }
  const auto* ids = static_cast<const int32_t*>(params[IDS]);
  auto* out = static_cast<float*>(params[OUT]);
  for (int64_t t = 0; t < tokens; ++t) {
    if (ids[t] < 0 || ids[t] >= vocab) return 3;
  }
#if defined(LLM_SERVING_AVX2_INT)
  if (repacked(table.type)) {                  // the tied lm_head's panels: each row's stored bytes back first
    Matrix stored = table;
    stored.type = table.type - kRepacked;
    std::vector<uint8_t> row(table.row_bytes);
    for (int64_t t = 0; t < tokens; ++t) {
      llm_serving::avx2_int::stored_row(table.type, table.data, table.row_bytes, k, ids[t], row.data());
      stored.dequantize_row(row.data(), out + t * k);
    }
    return 0;
  }
#endif
  for (int64_t t = 0; t < tokens; ++t) {
    const uint8_t* row = table.data + ids[t] * table.row_bytes;
    if (table.type == kF32) {
      std::memcpy(out + t * k, row, k * sizeof(float));
    } else {
      table.dequantize_row(row, out + t * k);
    }
  }
  return 0;
}

// SampleLogits(logits (R, V) float32, temperature (R,) float32, random_u (R,) float32, iconfig [threads]) ->
// token (R,) int32, logprob (R,) float32: sampler.py's Sampler(filters=False) as one kernel. A row of
// temperature > 0 samples from softmax(logits / temperature) by inverse CDF with its uniform u (the first token
// whose cumulative probability, summed in id order, exceeds u times the total; a token of probability 0 there
// falls back to greedy); other rows are greedy (the first index of the largest logit). logprob is
// log_softmax(logits) at the token (temperature 1). As a kernel its (R, V) intermediates live in each thread's
// reused scratch: as MindSpore's ops they were ~7 logits-sized buffers that every compiled sampler graph (one
// per batch size) kept for the life of the process.
#define SAMPLE_LOGITS_PARAMS(P)                                                                                  \
  P(LOGITS, "logits", 2, "float32") P(TEMPERATURE, "temperature", 1, "float32")                                  \
  P(RANDOM_U, "random_u", 1, "float32") P(ICFG, "iconfig", 1, "int32")                                           \
  P(TOKEN, "token", 1, "int32") P(LOGPROB, "logprob", 1, "float32")
#define SAMPLE_LOGITS_ICONFIG(I) I(THREADS, "threads")

namespace {
const llm_serving::ParamSpec kSampleLogitsParams[] = {SAMPLE_LOGITS_PARAMS(LLM_SERVING_PARAM_SPEC)};
namespace sample_cfg {
enum : int64_t { SAMPLE_LOGITS_ICONFIG(LLM_SERVING_FIELD_ENUM) COUNT };
const char* const kNames[] = {SAMPLE_LOGITS_ICONFIG(LLM_SERVING_FIELD_NAME)};
}  // namespace sample_cfg
}  // namespace

extern "C" const char* SampleLogitsParams() { return LLM_SERVING_DESCRIBED(kSampleLogitsParams); }
extern "C" const char* SampleLogitsIconfig() { return LLM_SERVING_NAMED(sample_cfg::kNames); }

extern "C" int SampleLogits(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                            void* stream, void* extra) {
  (void)stream;
  (void)extra;
  enum { SAMPLE_LOGITS_PARAMS(LLM_SERVING_PARAM_ENUM) NPARAM };
  if (!llm_serving::params_match(kSampleLogitsParams, NPARAM, nparam, ndims, dtypes)) return 1;
  const int64_t rows = shapes[LOGITS][0], vocab = shapes[LOGITS][1];
  if (shapes[TEMPERATURE][0] != rows || shapes[RANDOM_U][0] != rows || shapes[ICFG][0] != sample_cfg::COUNT ||
      shapes[TOKEN][0] != rows || shapes[LOGPROB][0] != rows || vocab < 1) {
    return 2;
  }
  const auto* logits = static_cast<const float*>(params[LOGITS]);
  const auto* temperature = static_cast<const float*>(params[TEMPERATURE]);
  const auto* random_u = static_cast<const float*>(params[RANDOM_U]);
  const int threads = std::max(1, static_cast<const int32_t*>(params[ICFG])[sample_cfg::THREADS]);
  auto* token = static_cast<int32_t*>(params[TOKEN]);
  auto* logprob = static_cast<float*>(params[LOGPROB]);
  if (rows == 0) return 0;
  Pool& p = pool(threads);
  std::lock_guard<std::mutex> lock(p.call_mutex());
  Scratch& s = p.scratch();
  float* probs_all = Scratch::sized(s.scores, static_cast<size_t>(p.threads()) * vocab);
  p.run([&](int tid, int nthreads) {
    float* probs = probs_all + tid * vocab;
    for (int64_t b = tid; b < rows; b += nthreads) {
      const float* l = logits + b * vocab;
      float mx = l[0];
      int64_t at = 0;
      for (int64_t i = 1; i < vocab; ++i) {
        if (l[i] > mx) {
          mx = l[i];
          at = i;
        }
      }
      int64_t tok = at;
      const float t = temperature[b];
      float sum1 = -1.f;                       // sum of e^(logit - max), for the logprob
      if (t > 0.f) {
        // softmax(logits / t): its max is the greedy logit's
        const float smx = mx / t;
        float sum = 0.f;
        for (int64_t i = 0; i < vocab; ++i) {
          probs[i] = llm_serving::exp_nonpositive(l[i] / t - smx);
          sum += probs[i];
        }
        if (t == 1.f) sum1 = sum;              // (l / 1 - mx / 1 is l - mx exactly)
        const float inv = 1.f / sum;
        float total = 0.f;
        for (int64_t i = 0; i < vocab; ++i) {
          probs[i] *= inv;
          total += probs[i];
        }
        const float threshold = random_u[b] * total;
        int64_t pick = vocab - 1;
        float cdf = 0.f;
        for (int64_t i = 0; i < vocab; ++i) {
          cdf += probs[i];
          if (cdf > threshold) {
            pick = i;
            break;
          }
        }
        if (probs[pick] > 0.f) tok = pick;
      }
      if (sum1 < 0.f) {
        sum1 = 0.f;
        for (int64_t i = 0; i < vocab; ++i) sum1 += llm_serving::exp_nonpositive(l[i] - mx);
      }
      token[b] = static_cast<int32_t>(tok);
      logprob[b] = (l[tok] - mx) - std::log(sum1);
    }
  }, /*last_of_step=*/true);
  return 0;
}

// ---------------------------------------------------------------------------------------------------------------
// The decoder layers as one call (layer_stack_cpu.h says why). The Python side registers a stack once at load
// (StackCreate, then StackAddCall per layer kernel call, in order) and releases it with the model (StackRelease);
// DecoderStack runs it: its parameters are x (T, H), the step's inputs and the KV caches (whatever the calls' sources
// name), then the stack's handle (int32 (1,)), then out (T, H). Each call's output feeds the next (two buffers in
// turn), the last call's is out.

extern "C" int32_t StackCreate() {
  namespace ls = llm_serving::layer_stack;
  static int32_t next = 1;
  std::lock_guard<std::mutex> lock(ls::registry_mutex());
  const int32_t handle = next++;
  ls::registry()[handle] = std::make_shared<ls::Stack>();
  return handle;
}

// Adds a call of `kernel` (0 DecoderLayer, 1 MoeMlp) with `nparam` parameters: source[i] (>= 0 the stack call's
// parameter, -1 held, -2 the hidden state, -3 the output); for held ones ptrs[i], ndims[i], shapes[4 i ..] and the
// i-th of the comma-separated dtypes. 0, or 1 for an unknown stack, kernel or parameter count.
extern "C" int StackAddCall(int32_t handle, int32_t kernel, int32_t nparam, const int32_t* source, void* const* ptrs,
                            const int32_t* ndims, const int64_t* shapes, const char* dtypes) {
  namespace ls = llm_serving::layer_stack;
  auto stack = ls::find(handle);
  const std::vector<std::string> names = ls::split_names(dtypes);
  if (!stack || (kernel != ls::kDecoderLayer && kernel != ls::kMoeMlp) || nparam < 2 ||
      static_cast<int32_t>(names.size()) != nparam) {
    return 1;
  }
  ls::Call call;
  call.kernel = kernel;
  call.source.assign(source, source + nparam);
  call.held.resize(nparam);
  int32_t inputs = 0;
  for (int32_t i = 0; i < nparam; ++i) {
    if (source[i] >= 0) inputs = std::max(inputs, source[i] + 1);
    if (source[i] != ls::kHeld) continue;
    if (ndims[i] < 0 || ndims[i] > 4) return 1;
    ls::Param& p = call.held[i];
    p.ptr = ptrs[i];
    p.ndims = ndims[i];
    for (int d = 0; d < ndims[i]; ++d) p.shape[d] = shapes[4 * i + d];
    p.dtype = names[i];
  }
  std::lock_guard<std::mutex> lock(ls::registry_mutex());
  stack->inputs = std::max(stack->inputs, inputs);
  stack->calls.push_back(std::move(call));
  return 0;
}

// Points call `call`'s held parameter `param` at `ptr`: memory of the same shape and dtype as the one registered
// (a matrix repacked after the load, kernels/repack.py's LaterRepacks). The caller makes sure no DecoderStack call
// runs meanwhile. 0, or 1 for an unknown stack, call or a parameter that is not held.
extern "C" int StackSetHeld(int32_t handle, int32_t call, int32_t param, void* ptr) {
  namespace ls = llm_serving::layer_stack;
  auto stack = ls::find(handle);
  std::lock_guard<std::mutex> lock(ls::registry_mutex());
  if (!stack || call < 0 || call >= static_cast<int32_t>(stack->calls.size())) return 1;
  ls::Call& c = stack->calls[static_cast<size_t>(call)];
  if (param < 0 || param >= static_cast<int32_t>(c.source.size()) || c.source[param] != ls::kHeld) return 1;
  c.held[static_cast<size_t>(param)].ptr = ptr;
  return 0;
}

extern "C" int StackRelease(int32_t handle) {
  namespace ls = llm_serving::layer_stack;
  std::lock_guard<std::mutex> lock(ls::registry_mutex());
  return ls::registry().erase(handle) == 1 ? 0 : 1;
}

extern "C" int DecoderStack(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                            void* stream, void* extra) {
  namespace ls = llm_serving::layer_stack;
  if (nparam < 3 || ndims[0] != 2 || std::strcmp(dtypes[0], "float32") != 0 || ndims[nparam - 2] != 1 ||
      std::strcmp(dtypes[nparam - 2], "int32") != 0) {
    return 1;
  }
  const auto stack = ls::find(static_cast<const int32_t*>(params[nparam - 2])[0]);
  if (!stack || stack->inputs > nparam - 2) return 1;
  const int64_t t = shapes[0][0], h = shapes[0][1];
  auto* out = static_cast<float*>(params[nparam - 1]);
  if (stack->calls.empty()) {
    std::memcpy(out, params[0], static_cast<size_t>(t * h) * sizeof(float));
    return 0;
  }
  thread_local std::vector<float> buffers[2];
  for (auto& b : buffers) {
    if (static_cast<int64_t>(b.size()) < t * h) b.resize(static_cast<size_t>(t * h));
  }
  void* hidden = params[0];
  thread_local std::vector<void*> p;            // a call's parameters, assembled per call (kept: no allocation a step)
  thread_local std::vector<int> nd;
  thread_local std::vector<int64_t*> sh;
  thread_local std::vector<const char*> dt;
  for (size_t c = 0; c < stack->calls.size(); ++c) {
    ls::Call& call = stack->calls[c];
    const bool last = c + 1 == stack->calls.size();
    void* output = last ? static_cast<void*>(out) : (hidden == buffers[0].data() ? buffers[1].data()
                                                                                : buffers[0].data());
    const size_t n = call.source.size();
    p.resize(n);
    nd.resize(n);
    sh.resize(n);
    dt.resize(n);
    for (size_t i = 0; i < n; ++i) {
      const int32_t s = call.source[i];
      if (s >= 0) {
        p[i] = params[s], nd[i] = ndims[s], sh[i] = shapes[s], dt[i] = dtypes[s];
      } else if (s == ls::kHeld) {
        ls::Param& held = call.held[i];
        p[i] = held.ptr, nd[i] = held.ndims, sh[i] = held.shape, dt[i] = held.dtype.c_str();
      } else {
        p[i] = s == ls::kHidden ? hidden : output, nd[i] = 2, sh[i] = shapes[0], dt[i] = dtypes[0];
      }
    }
    const int rc = call.kernel == ls::kDecoderLayer
                       ? DecoderLayer(static_cast<int>(n), p.data(), nd.data(), sh.data(), dt.data(), stream, extra)
                       : MoeMlp(static_cast<int>(n), p.data(), nd.data(), sh.data(), dt.data(), stream, extra);
    if (rc != 0) return 100 * static_cast<int>(c + 1) + rc;     // which call failed, and its own code
    hidden = output;
  }
  return 0;
}
