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
// residual. The work is split over a persistent pool of threads (the calling thread and `threads - 1` workers)
// that stay between kernels: each kernel is one dispatch and a few spin barriers, not a thread start per call. A
// product's output rows are handed out in chunks to whichever thread is free (`claim_rows`), and a barrier's
// waiter yields its core after a short spin: on two cores shared with the master and a load client, one thread
// losing its core for a while then delays a step by a chunk, not by half of every product.
//
// Loaded by MindSpore as `ops.Custom(func_type="aot")` kernels (inputs then the output in `params`, in the order
// of DECODER_LAYER_PARAMS / FINAL_LOGITS_PARAMS below, which kernels/signatures.py declares again by name and
// the build checks); built and cached by kernels/__init__.py. The weights are layer_weights.py's load-time
// forms: q/k/v fused, gate/up fused.
//
// Weight matrices come in two forms, chosen per matrix by a type code in iconfig (GGML's numbering):
//   0 (F32)   float32 (rows, K), the MindSpore graphs' own tensors (norm gains folded in: the gains passed are 1)
//   1 (F16), 30 (BF16), 2 (Q4_0), 3 (Q4_1), 6 (Q5_0), 7 (Q5_1), 8 (Q8_0), 12 (Q4_K), 13 (Q5_K), 14 (Q6_K)
//             a GGUF tensor's own bytes, uint8 (rows, row_bytes): each row K weights in blocks of 32 (F16/BF16:
//             K halves; the K-quants: super-blocks of 256, so K a multiple of 256), decoded in registers for one
//             or two rows of x (qdot) or a tile of rows at a time into a thread's scratch for more, so a decode
//             step reads 4.5-8.5 bits per weight from memory instead of 32. Gains are not folded into
//             quantized rows: the normalized activations are multiplied by them instead (the same product).
//
// Products by batch size: 1-2 rows decode quantized blocks in registers (qdot); up to kGemmRows share a
// dequantized tile of 4 rows (matvec); from kGemmRows rows on (big decode batches, verify rows, prefill steps of
// hundreds of tokens) x is packed once per product and multiplied by groups of dequantized weight rows with a
// register-blocked kernel (gemm_cpu.h), so that the weights are dequantized once per call and x is not re-read for
// every few weight rows. Where the CPU has AMX (and Linux grants the tile state) the batched products run on its
// tiles instead (gemm_amx.h: bfloat16 pieces of float32, float32's precision), from kAmxGemmRows rows;
// LLM_SERVING_KERNEL_AMX=0 in the environment (read once per process) or KernelAmx(0) keeps the FMA kernel.
// Products whose weights all have integer codes (the Q-types, not F32/F16/BF16) run on integer multiply-adds
// instead, x rounded to 16 bits per block: on AVX2 at every row count (gemm_avx2_int.h: the codes as int16
// against x's int16, each block's sum exact in int32, then one order of float scaling per output, so a row's
// outputs are the same bits among any rows: batch-invariant by construction, for invariant steps and the others
// alike), and where the CPU has AMX's int8 tiles, steps that are not batch-invariant run those from kIntGemmRows (3)
// rows (gemm_amx_int.h: per super-block for the K-quants). LLM_SERVING_KERNEL_INT=0 or KernelInt(0) keeps them
// on the float paths (the weights decoded to float32). Batch-invariant steps (iconfig's last entry;
// model_config.batch_invariant, on by default) run one order of sums for every row count on the float paths too:
// dot_gemm for few rows, lane_units (the same floats) for many.
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
//                                                row attends)
//   tree_bits    (B,)                   int32    token-tree visibility of the last 32 keys (-1: all)
//   cos, sin     (P, D)                 float32  rope tables, rotate_half layout, sin signed [-sin, sin]
//   lora         (B,)                   int32    each row's LoRA adapter slot (0: none; < S)
//   q_w (NH*D, H), k_w (KVH*D, H), v_w (KVH*D, H)   each in its own type (a Q4_K_M file stores some layers' v
//                                                as Q6_K beside Q4_K q and k); they run as one product, q/k/v
//   qkv_bias     ((NH+2KVH)*D,)         float32  zeros for models without one
//   o_w          (H, NH*D)
//   o_bias       (H,)                   float32  added to o's product (zeros for models without one)
//   sinks        (NH,)                  float32  each query head's sink logit (iconfig[17]; else unread)
//   gate_up_bias (2I,)                  float32  gate's then up's biases, added before the activation, and
//   down_bias    (H,)                   float32  down's, added to its product (iconfig[21]; else unread)
//   norm_bias    (4, H)                 float32  LayerNorm's biases (iconfig[18]) of the input, post-attention,
//                                                attention-output and MLP-output norms, in that order (else unread)
//   gate_w, up_w (I, H)                          down_w (H, I)    (weights: float32, or uint8 rows as above; an
//                                                ungated MLP's gate_w a (1, H) placeholder, not read)
//   input_gain, post_gain (H,)          float32  the norms' gains for q/k/v and for gate/up (1 where folded)
//   q_norm, k_norm (D,)                 float32  qk norm (iconfig[13]): the gains of each query's and key's head
//                                                RMSNorm, after q/k/v (+ bias, + LoRA), before RoPE (else unread)
//   attn_out_gain, mlp_out_gain (H,)    float32  sandwich norms (iconfig[14]): the gains of the RMSNorm of the o
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
//   iconfig      (11,), (12,), (16-22,) int32    [block_size, num_heads, num_kv_heads, threads,
//                                                 q type, k type, v type, o type, gate type, up type, down type,
//                                                 batch-invariant: 1 on, 0 off, -1 or absent: the process's
//                                                 setting (KernelInvariant, for tests and benchmarks),
//                                                 activation: 0 SiLU, 1 GELU (tanh approximation), 2 GELU (erf),
//                                                 qk norm: 1 on, 0 off, sandwich norms: 1 on, 0 off,
//                                                 window: W > 0, each row sees the last W of its visible keys
//                                                 (sliding-window attention), 0 all,
//                                                 MLP: 1 the layer's gate/up/down, 0 none (out = x + attention: a
//                                                 mixture-of-experts layer, MoeMlp next; gate_w, up_w (1, H) and
//                                                 down_w (H, 1) placeholders, not read),
//                                                 attention sinks: 1 each query head's softmax has sinks[head] in its
//                                                 denominator (gpt-oss), 0 none,
//                                                 norm: 0 RMSNorm, 1 LayerNorm (every norm of the layer; BERT),
//                                                 post norms: 1 out = norm(x + attention) then norm(out + MLP), the
//                                                 input and post-attention norms not applied (BERT; the gains are
//                                                 attn_out_gain and mlp_out_gain), 0 pre norms,
//                                                 gated MLP: 1 f(gate) * up, 0 f(up) (BERT),
//                                                 MLP biases: 1 gate_up_bias and down_bias added, 0 none];
//                                                 activation 2: GELU (erf); absent entries: SiLU, no qk norm, no
//                                                 sandwich norms, no window, the MLP, no sinks, RMSNorm, pre norms, a
//                                                 gated MLP without biases
//   fconfig      (1,) or (2,)           float32  [rms_norm_eps (every norm's), attention scale (the queries'
//                                                 factor; absent: 1/sqrt(D))]
//   out          (B, H)                 float32
// FinalLogits(x (R, H), slots (R,), lm_head (V, H), gain (H,), iconfig [threads, lm_head type(, batch-invariant
//             as DecoderLayer's)], fconfig [eps])
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

namespace {

namespace gemm = llm_serving::gemm;

// ------------------------------------------------------------------------------------------- thread pool

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// How long an idle worker spins for the next kernel before it sleeps: the kernels of one step follow each
// other within tens of microseconds; between steps the worker sleeps (and leaves the core to the master).
int64_t spin_microseconds() {
  const char* env = std::getenv("LLM_SERVING_KERNEL_SPIN_US");
  return env != nullptr ? std::max<int64_t>(0, std::atoll(env)) : 300;
}

class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void wait() {
    if (n_ == 1) return;
    const int phase = phase_.load(std::memory_order_acquire);
    if (count_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {
      count_.store(0, std::memory_order_relaxed);
      phase_.store(phase + 1, std::memory_order_release);
    } else {
      // spin, then give the core away between looks: on a machine where other processes run too (the master,
      // a load client) the thread being waited for may be the one without a core
      for (int spins = 0; phase_.load(std::memory_order_acquire) == phase; ++spins) {
        if (spins < 4096) {
          cpu_relax();
        } else {
          std::this_thread::yield();
        }
      }
    }
  }

 private:
  const int n_;
  std::atomic<int> count_{0};
  std::atomic<int> phase_{0};
};

// A pool's scratch space, reused from call to call (grown on demand); guarded by the pool's call mutex.
struct Scratch {
  std::vector<float> qkv, attn, act, normed, scores, tiles, lora, lora_gate_up;
  std::vector<float> attn_tiles;                 // per thread: attend_tile's query, output and key tiles
  std::vector<float> packed, gemm_w, gemm_c;     // gemm_cpu.h: x's panels (shared), per thread weights and C
  std::vector<float> silu;                       // per thread: one unit's gate, up and f(gate) * up, every row
  std::vector<float> up;                         // batch-invariant steps of few rows: up's sums (rows x I)
  std::vector<float> sandwich;                   // sandwich norms: the o product's result, then the down one's
  static float* sized(std::vector<float>& v, size_t n) {
    if (v.size() < n) v.resize(n);
    return v.data();
  }
};

// The calling thread is thread 0; workers 1..n-1 run the same job with their own index. run() returns when
// every thread has finished the job. One job at a time (a mutex), so kernels called from several threads
// take turns.
class Pool {
 public:
  explicit Pool(int threads) : threads_(std::max(1, threads)), spin_us_(spin_microseconds()) {
    for (int t = 1; t < threads_; ++t) workers_.emplace_back([this, t] { work(t, 0); });
  }
  int threads() const { return threads_; }
  std::mutex& call_mutex() { return call_; }
  Scratch& scratch() { return scratch_; }

  // job(tid, nthreads); the caller holds call_mutex(). last_of_step: no kernel follows soon (the step's
  // last), so the workers sleep as soon as they finish instead of spinning: the cores go to the processes
  // that handle the step's results (the agent's own Python, the master).
  void run(const std::function<void(int, int)>& job, bool last_of_step = false) {
    if (threads_ == 1) {
      job(0, 1);
      return;
    }
    job_ = &job;
    spin_next_us_ = last_of_step ? 0 : spin_us_;
    done_.store(0, std::memory_order_relaxed);
    generation_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(sleep_);
      wake_.notify_all();
    }
    job(0, threads_);
    while (done_.load(std::memory_order_acquire) != threads_ - 1) cpu_relax();
  }

 private:
  // `seen` is the generation the worker was created at (0: the pool's first), so a job dispatched before the
  // worker first looks is not missed.
  void work(int tid, uint64_t seen) {
    int64_t spin_us = spin_us_;
    for (;;) {
      const auto start = std::chrono::steady_clock::now();
      int64_t spins = 0;
      while (generation_.load(std::memory_order_acquire) == seen) {
        cpu_relax();
        if ((++spins & 255) == 0 &&
            std::chrono::steady_clock::now() - start > std::chrono::microseconds(spin_us)) {
          std::unique_lock<std::mutex> lock(sleep_);
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          wake_.wait(lock, [&] { return generation_.load(std::memory_order_seq_cst) != seen; });
          sleepers_.fetch_sub(1, std::memory_order_relaxed);
          break;
        }
      }
      seen = generation_.load(std::memory_order_acquire);
      spin_us = spin_next_us_;                      // written before the generation was published
      (*job_)(tid, threads_);
      done_.fetch_add(1, std::memory_order_acq_rel);
    }
  }

  const int threads_;
  const int64_t spin_us_;
  std::vector<std::thread> workers_;
  std::mutex call_;
  Scratch scratch_;
  std::mutex sleep_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<int> done_{0};
  const std::function<void(int, int)>* job_ = nullptr;
  int64_t spin_next_us_ = 0;          // how long workers spin after the current job
};

// One pool per thread count in the process (a server uses one), made by the first call that asks for it and
// never destroyed: its workers sleep until the process exits. A child forked from a process that has pools
// has none of their workers, so it starts with no pools (the parent's are forgotten, never run).
std::mutex* pools_mutex = new std::mutex();
std::vector<Pool*>* pools = new std::vector<Pool*>();

Pool& pool(int threads) {
  static const bool fork_handler = [] {
    pthread_atfork(nullptr, nullptr, [] {
      pools_mutex = new std::mutex();
      pools = new std::vector<Pool*>();
    });
    return true;
  }();
  (void)fork_handler;
  std::lock_guard<std::mutex> lock(*pools_mutex);
  for (Pool* p : *pools) {
    if (p->threads() == threads) return *p;
  }
  pools->push_back(new Pool(threads));
  return *pools->back();
}

// ------------------------------------------------------------------------------------- matrix products

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

// out[r][b] = w[r] . x[b] for RB consecutive weight rows (row length k) and BB rows of x (stride ldx).
template <int RB, int BB>
inline void dot_tile(const float* w, int64_t k, const float* x, int64_t ldx, float out[4][4]) {
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

// ----------------------------------------------------------------------------------------- weight formats

enum WeightType : int32_t {
  kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
  kBF16 = 30, kMXFP4 = 39,
  // repacked at load, 8 rows interleaved (gemm_avx2_int.h; RepackRows): the GGML type + 100, products only
  kQ4_0_R8 = 102, kQ4_1_R8 = 103, kQ8_0_R8 = 108, kQ4_K_R8 = 112, kQ6_K_R8 = 114
};

// Whether DecoderLayer and FinalLogits take a matrix of this type (MXFP4, gpt-oss's experts' type, only MoeMlp
// and the dequantizing readers: the few-row decoders below have no MXFP4 case)
inline bool layer_type(int32_t type) { return type != kMXFP4; }

// A type this library repacked at load (RepackRows), which only gemm_avx2_int.h's products read
inline bool repacked(int32_t type) {
  return type == kQ4_K_R8 || type == kQ6_K_R8 || type == kQ8_0_R8 || type == kQ4_0_R8 || type == kQ4_1_R8;
}

// Bytes of one row of k weights of `type`, or -1: a type these kernels do not read, or k not whole blocks.
int64_t row_bytes_of(int32_t type, int64_t k) {
  switch (type) {
    case kF32: return 4 * k;
    case kF16: return 2 * k;
    case kBF16: return 2 * k;
    case kQ4_0: return k % 32 ? -1 : k / 32 * 18;      // f16 scale, 16 bytes of nibbles
    case kQ4_1: return k % 32 ? -1 : k / 32 * 20;      // f16 scale, f16 minimum, 16 bytes of nibbles
    case kQ5_0: return k % 32 ? -1 : k / 32 * 22;      // f16 scale, 4 bytes of fifth bits, 16 bytes of nibbles
    case kQ5_1: return k % 32 ? -1 : k / 32 * 24;      // f16 scale, f16 minimum, fifth bits, nibbles
    case kQ8_0: return k % 32 ? -1 : k / 32 * 34;      // f16 scale, 32 signed bytes
    // super-blocks of 256 weights (8 or 16 sub-blocks, each with its own quantized scale)
    case kQ4_K: return k % 256 ? -1 : k / 256 * 144;   // f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, nibbles
    case kQ4_K_R8: return k % 256 ? -1 : k / 256 * 144;   // the same bytes, 8 rows' panels (a row-block: 8 rows)
    case kQ6_K_R8: return k % 256 ? -1 : k / 256 * 210;
    case kQ8_0_R8: return k % 256 ? -1 : k / 32 * 34;
    case kQ4_0_R8: return k % 256 ? -1 : k / 32 * 18;
    case kQ4_1_R8: return k % 256 ? -1 : k / 32 * 20;
    case kQ5_K: return k % 256 ? -1 : k / 256 * 176;   // as Q4_K, plus 32 bytes of fifth bits before the nibbles
    case kQ6_K: return k % 256 ? -1 : k / 256 * 210;   // 128 bytes low nibbles, 64 of 2-bit highs, 16 int8 scales, f16 d
    case kMXFP4: return k % 32 ? -1 : k / 32 * 17;     // E8M0 scale byte, 16 bytes of E2M1 nibbles
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

// One block of 32 weights of type T (F16: 32 halves) at p as two vectors: weights 0..15 and 16..31.
template <int32_t T>
constexpr int64_t block_bytes() {
  return T == kQ4_0 ? 18 : T == kQ4_1 ? 20 : T == kQ5_0 ? 22 : T == kQ5_1 ? 24 : T == kQ8_0 ? 34 : T == kMXFP4 ? 17 : 64;
}

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
constexpr bool is_super() { return T == kQ4_K || T == kQ5_K || T == kQ6_K; }
template <int32_t T>
constexpr int64_t super_bytes() { return T == kQ4_K ? 144 : T == kQ5_K ? 176 : 210; }
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
  // Whether the integer products (gemm_amx_int.h) read this type: the blocks of 32 and the K-quants.
  bool integer_codes() const { return type != kF32 && type != kF16 && type != kBF16 && type != kMXFP4; }

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

// For weight rows [r0, r1) of w and every row b of x (B, w.k): emit(b, r, w[r] . x[b]). tile: 4*k floats of
// the calling thread's own (quantized rows are dequantized there, a tile of 4 at a time).
template <typename Emit>
void matvec(const Matrix& w, const float* x, int64_t batch, int64_t r0, int64_t r1, float* tile, Emit emit) {
  // weight rows outer: a tile of 4 rows (4 k floats) stays in L1 while every row of x passes over it, so the
  // weights are read from memory (and dequantized) once per call whatever the batch
  const int64_t k = w.k;
  float out[4][4];
  for (int64_t r = r0; r < r1; r += 4) {
    const int rb = static_cast<int>(std::min<int64_t>(4, r1 - r));
    w.prefetch(r + 4, std::min<int64_t>(4, r1 - r - 4));
    if (w.type != kF32 && batch <= kFusedRows) {
      for (int64_t b0 = 0; b0 < batch; b0 += 4) {
        const int bb = static_cast<int>(std::min<int64_t>(4, batch - b0));
        qdot(w, r, rb, x + b0 * k, bb, out);
        for (int i = 0; i < rb; ++i)
          for (int b = 0; b < bb; ++b) emit(b0 + b, r + i, out[i][b]);
      }
      continue;
    }
    const float* rows = w.tile_rows(r, rb, tile);
    for (int64_t b0 = 0; b0 < batch; b0 += 4) {
      const int bb = static_cast<int>(std::min<int64_t>(4, batch - b0));
      if (rb == 4) {
        dot_rows<4>(rows, k, x + b0 * k, k, bb, out);
      } else {
        for (int i = 0; i < rb; ++i) dot_rows<1>(rows + i * k, k, x + b0 * k, k, bb, out + i);
      }
      for (int i = 0; i < rb; ++i)
        for (int b = 0; b < bb; ++b) emit(b0 + b, r + i, out[i][b]);
    }
  }
}

// ------------------------------------------------------------------- batch-invariant products (dot_gemm)
//
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

// For weight rows [r0, r1) of w and every row b of x (m rows of w.k): emit(b, r, w[r] . x[b]), each the same
// float whatever m and [r0, r1). wbuf: dot_w_floats(k), lanes: dot_lane_floats(), the calling thread's.
template <typename Emit>
void dot_gemm(const Matrix& w, const float* x, int64_t m, int64_t r0, int64_t r1, float* wbuf, float* lanes,
              Emit emit) {
  const int64_t k = w.k, k16 = k / 16 * 16;
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
      for (int64_t i = 0; i < n; ++i) {
        for (int64_t b = 0; b < xm; ++b) {
          emit(x0 + b, g0 + i, dot_finish(lanes + (i * kDotRows + b) * 16, wg + i * k, xb + b * k, k16, k));
        }
      }
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

// Rows [0, n) of a product handed out in chunks of whole tiles (about 8 per thread) to whichever thread asks
// next: fn(begin, end) per chunk. A thread that runs slower (its core shared with the master or a client) takes
// fewer chunks, so the barrier after waits for one chunk of it, not for the rest of a fixed half.
// align: chunks are whole multiples of it (4: matvec's tiles; a gemm group's rows for the batched path).
inline int64_t chunk_rows(int64_t n, int threads, int64_t align = 4) {
  return threads == 1 ? n : std::max<int64_t>(std::max<int64_t>(16, align), (n / (8 * threads) + align - 1) / align * align);
}

template <typename F>
void claim_rows(std::atomic<int64_t>& next, int64_t n, int threads, F&& fn, int64_t align = 4) {
  const int64_t chunk = chunk_rows(n, threads, align);
  for (int64_t r0 = next.fetch_add(chunk); r0 < n; r0 = next.fetch_add(chunk)) fn(r0, std::min(n, r0 + chunk));
}

// ------------------------------------------------------------------------------ batched products (gemm_cpu.h)

// From this many rows of x on, a product packs x into panels and runs gemm_cpu.h's register-blocked kernel;
// fewer rows go through matvec's tiles (no packing, and a 16-row panel would be mostly padding). Where they
// cross (bench/layer_kernel_gemm.py, one thread, CPU time per layer, Q8_0 and F32): 8 rows 0.88x, 10 rows
// 1.02-1.04x, 12 rows 1.08-1.11x, 16 rows 1.2x.
constexpr int64_t kGemmRows = 10;
// With AMX (gemm_amx.h) the batched path wins from about as many rows: every weight is split into three bfloat16
// pieces whatever the rows (for few rows a depth slice at a time, in cache), which the tiles repay from ~10-12
// rows (bench, Q8_0, 2 threads, AMX against matvec or the FMA kernel: 8 rows 0.84x, 12 1.10x, 16 1.32x, 24 1.56x,
// 32 1.77x, 64 2.10x).
constexpr int64_t kAmxGemmRows = 12;
// Float32 weights are read in place by matvec's tiles (nothing to dequantize), which keeps them ahead for more
// rows: the bench model (float32, 512 wide) served 16 streams 20% slower through the batched path at 16 rows
// than through the tiles, and 17% faster at 64 (bench/peers.py, A/B in one session).
constexpr int64_t kFloatGemmRows = 32;
// Layers (and lm_heads) whose weights all have integer codes, where the integer tiles run (gemm_amx_int.h), from
// this many rows: 2 rows stay in registers (qdot: 2x faster there), from 3 the tiles win (bench/layer_kernel_gemm.py,
// CPU time of a Q4_K layer against the dequantized tiles: 3 rows 1.23x, 4 1.6x, 8 1.57x, 10 1.73x; Q6_K 3-4 rows
// 1.2x).
constexpr int64_t kIntGemmRows = 3;
// The chunks of a product's rows on gemm_avx2_int.h (Route::kInt): whole tiles of its weight rows
#if defined(LLM_SERVING_AVX2_INT)
constexpr int64_t kIntTileRows = llm_serving::avx2_int::kTileRows;
#else
constexpr int64_t kIntTileRows = 16;
#endif
inline int64_t gemm_rows(bool amx, bool float32) {
  return float32 ? kFloatGemmRows : amx ? kAmxGemmRows : kGemmRows;
}

// Whether the batched products run on AMX tiles (gemm_amx.h): compiled for a CPU that has them, allowed
// (LLM_SERVING_KERNEL_AMX=0 in the environment, read once, or KernelAmx(0) below turn it off: the float32 FMA
// path of gemm_cpu.h, as on CPUs without AMX) and granted by Linux (the tile data permission, asked once per
// process: a forked child asks again). Asked once per kernel call by the calling thread.
std::atomic<int> amx_setting{-1};        // -1: not read yet; 0 off; 1 on
std::atomic<pid_t> amx_asked_by{-1};     // the process that asked for the permission, and its answer
std::atomic<bool> amx_granted{false};

bool amx_enabled() {
#if defined(LLM_SERVING_AMX)
  if (amx_setting.load(std::memory_order_relaxed) < 0) {
    const char* env = std::getenv("LLM_SERVING_KERNEL_AMX");
    int expected = -1;
    amx_setting.compare_exchange_strong(expected, env != nullptr && std::strcmp(env, "0") == 0 ? 0 : 1);
  }
  if (amx_setting.load(std::memory_order_relaxed) == 0) return false;
  const pid_t pid = getpid();
  if (amx_asked_by.load(std::memory_order_acquire) != pid) {
    amx_granted.store(llm_serving::amx::request_permission(), std::memory_order_relaxed);
    amx_asked_by.store(pid, std::memory_order_release);
  }
  return amx_granted.load(std::memory_order_relaxed);
#else
  return false;
#endif
}

// Whether a step is batch-invariant: the call's iconfig says (the runner's model_config.batch_invariant);
// without that entry, this process setting (KernelInvariant below; LLM_SERVING_KERNEL_INVARIANT=1 in the
// environment, read once), off by default. Invariant, a row's outputs are the same to the bit whatever else the
// step holds (other rows, how a prompt is chunked, decode, prefill or verify, the thread count's split of the
// work): products run dot_gemm or lane_units, or on integer codes gemm_avx2_int.h's products (invariant by
// construction), never qdot, matvec's tiles or the batched kernels whose sums run along k (gemm_cpu.h) or on AMX
// tiles; the activation runs activation_span; attention always runs attend_tile
// where the head size takes it (a token tree's row over its visible keys; a window's key tiles where they fall
// without one), attend_row otherwise, for every row alike. Not invariant, each product takes the fastest path for
// its row count.
std::atomic<int> invariant_setting{-1};  // -1: not read yet; 0 off; 1 on

bool invariant_enabled() {
  if (invariant_setting.load(std::memory_order_relaxed) < 0) {
    const char* env = std::getenv("LLM_SERVING_KERNEL_INVARIANT");
    int expected = -1;
    invariant_setting.compare_exchange_strong(expected, env != nullptr && std::strcmp(env, "1") == 0 ? 1 : 0);
  }
  return invariant_setting.load(std::memory_order_relaxed) == 1;
}

// Whether products whose weights all have integer codes (the Q-types) run on the integer paths, x rounded to 16
// bits per block: AMX's integer tiles (gemm_amx_int.h, where the CPU has its int8 tiles; steps that are not
// batch-invariant, from kIntGemmRows rows) and AVX2's multiply-adds (gemm_avx2_int.h: every other such product,
// any rows, batch-invariant by construction). On unless LLM_SERVING_KERNEL_INT=0 in the environment (read once) or
// KernelInt(0), which keep them on the float paths (dequantized weights).
std::atomic<int> int_setting{-1};        // -1: not read yet; 0 off; 1 on

bool int_allowed() {
  if (int_setting.load(std::memory_order_relaxed) < 0) {
    const char* env = std::getenv("LLM_SERVING_KERNEL_INT");
    int expected = -1;
    int_setting.compare_exchange_strong(expected, env != nullptr && std::strcmp(env, "0") == 0 ? 0 : 1);
  }
  return int_setting.load(std::memory_order_relaxed) == 1;
}

bool int_enabled(bool amx) {             // AMX's integer tiles
#if defined(LLM_SERVING_AMX_INT)
  return amx && int_allowed();
#else
  (void)amx;
  return false;
#endif
}

bool avx2_int_enabled() {                // gemm_avx2_int.h
#if defined(LLM_SERVING_AVX2_INT)
  return int_allowed();
#else
  return false;
#endif
}

// Whether a product of these parts runs gemm_avx2_int.h: enabled, and every part's type one it reads
bool avx2_int_product(const Matrix* const* ws, int parts, bool enabled) {
#if defined(LLM_SERVING_AVX2_INT)
  for (int q = 0; q < parts && enabled; ++q) enabled = llm_serving::avx2_int::reads(ws[q]->type);
  return enabled;
#else
  (void)ws;
  (void)parts;
  (void)enabled;
  return false;
#endif
}

// How a product of these parts runs on the integer tiles: not at all (kNoInt: disabled, or a part of float
// weights), a block of 32 at a time (kIntBlocks), or a super-block at a time (kIntSupers: every part a K-quant).
enum IntPath : int { kNoInt = 0, kIntBlocks = 1, kIntSupers = 2 };

int integer_product(const Matrix* const* ws, int parts, bool ints) {
#if defined(LLM_SERVING_AMX_INT)
  bool supers = ints;
  for (int q = 0; q < parts && ints; ++q) {
    ints = ws[q]->integer_codes();
    supers = supers && ws[q]->super_codes();
  }
  return !ints ? kNoInt : supers ? kIntSupers : kIntBlocks;
#else
  (void)ws;
  (void)parts;
  (void)ints;
  return kNoInt;
#endif
}

// Weight rows dequantized (and multiplied) together: the group's float rows (group x k) stay in L2 while every
// panel of x passes, and x is streamed once per group; a wider row halves the group to keep it there. AMX: 64
// rows (four blocks of 16, two 2x2 kernels per pair of x blocks), its three bfloat16 pieces 6 bytes a weight; the
// depth blocks (gemm_amx.h) keep what is read in L2 whatever k.
constexpr int64_t kAmxGroup = 64;
inline int64_t gemm_group(int64_t k, bool amx) { return amx ? kAmxGroup : k <= 4096 ? 48 : 24; }

// The batched buffers start on a cache line: an AMX tile row read across two lines (std::vector's 16-byte
// alignment) halved TDPBF16PS's rate (2.2 -> 1.0-1.3 TFLOP/s on one core). Sized 16 floats more than asked.
inline float* line_aligned(float* p) {
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~static_cast<uintptr_t>(63));
}
inline float* sized_aligned(std::vector<float>& v, size_t n) { return line_aligned(Scratch::sized(v, n + 16)); }

// Sizes in floats (multiples of 16, so that each thread's part stays on a cache line): the packed x (shared), a
// thread's weight buffer, a thread's C
inline int64_t gemm_x_floats(int64_t m, int64_t k, bool amx) {
#if defined(LLM_SERVING_AMX)
  if (amx) return llm_serving::amx::packed_floats(m, k);
#endif
  (void)amx;
  return gemm::packed_floats(m, k);
}
inline int64_t gemm_w_floats(int64_t k, bool amx) {
#if defined(LLM_SERVING_AMX)
  if (amx) return 32 * llm_serving::amx::kblocks(k) + llm_serving::amx::group_floats(kAmxGroup, k);   // a row, the group
#endif
  (void)amx;
  return 48 * k;
}
inline int64_t gemm_c_floats(int64_t m, bool amx) {
#if defined(LLM_SERVING_AMX)
  if (amx) return kAmxGroup * llm_serving::amx::c_stride(m);
#endif
  (void)amx;
  return 48 * gemm::panels(m) * gemm::kPanel;
}

// Every thread packs the panels (AMX: blocks of 16 rows) it claims from x (m rows of k, stride k) into the
// shared xp; a barrier must follow before any thread reads xp.
// ints: for gemm_amx_int.h (integer products; its packed x is smaller than the bfloat16 pieces' that the sizes
// above allow for).
inline void pack_x(std::atomic<int64_t>& next, const float* x, int64_t m, int64_t k, float* xp, bool amx,
                   int ints = kNoInt) {
#if defined(LLM_SERVING_AMX_INT)
  if (ints != kNoInt) {
    for (int64_t b = next.fetch_add(1); b < llm_serving::amx::rows16(m) / 16; b = next.fetch_add(1)) {
      if (ints == kIntSupers) llm_serving::amx_int::super_pack_block(x, k, m, k, b, xp);
      else llm_serving::amx_int::pack_block(x, k, m, k, b, xp);
    }
    return;
  }
#endif
  (void)ints;
#if defined(LLM_SERVING_AMX)
  if (amx) {
    for (int64_t b = next.fetch_add(1); b < llm_serving::amx::rows16(m) / 16; b = next.fetch_add(1))
      llm_serving::amx::pack_block(x, k, m, k, b, xp);
    return;
  }
#endif
  (void)amx;
  for (int64_t p = next.fetch_add(1); p < gemm::panels(m); p = next.fetch_add(1)) gemm::pack_panel(x, k, m, k, p, xp);
}

// pack_x for lane_units: every thread packs the panels it claims (pack_lanes); a barrier must follow.
inline void pack_x_lanes(std::atomic<int64_t>& next, const float* x, int64_t m, int64_t k, float* xp) {
  for (int64_t p = next.fetch_add(1); p < gemm::panels(m); p = next.fetch_add(1)) pack_lanes(x, k, m, k, p, xp);
}

// pack_x for gemm_avx2_int.h: every thread rounds the rows of x it claims (4 at a time) to their int16 records; a
// barrier must follow. (Each row is rounded alone: the same record whichever thread takes it, among any rows.)
inline void pack_x_int(std::atomic<int64_t>& next, const float* x, int64_t m, int64_t k, float* xp) {
#if defined(LLM_SERVING_AVX2_INT)
  constexpr int64_t kRows = 4;
  for (int64_t b = next.fetch_add(kRows); b < m; b = next.fetch_add(kRows))
    llm_serving::avx2_int::pack_rows(x, k, k, m, b, std::min(m, b + kRows), reinterpret_cast<uint8_t*>(xp));
#else
  (void)next, (void)x, (void)m, (void)k, (void)xp;
#endif
}

// Weight rows [r0, r1) of w (its type one gemm_avx2_int.h reads) times the m rows of x packed by pack_x_int:
// emit(b, r, w[r] . x[b]), a tile of kTileRows weight rows at a time (out: kTileRows x m floats, wbuf: the tile's
// unpacked rows, both the calling thread's).
template <typename Emit>
void int_rows(const Matrix& w, const float* xp, int64_t m, int64_t r0, int64_t r1, float* wbuf, float* out,
              Emit emit) {
#if defined(LLM_SERVING_AVX2_INT)
  namespace ai = llm_serving::avx2_int;
  for (int64_t r = r0; r < r1; r += ai::kTileRows) {
    const int64_t n = std::min(ai::kTileRows, r1 - r);
    ai::product(w.type, w.data + r * w.row_bytes, w.row_bytes, w.k, n, reinterpret_cast<const uint8_t*>(xp), m,
                reinterpret_cast<uint8_t*>(wbuf), out, m);
    for (int64_t b = 0; b < m; ++b)
      for (int64_t i = 0; i < n; ++i) emit(b, r + i, out[i * m + b]);
  }
#else
  (void)w, (void)xp, (void)m, (void)r0, (void)r1, (void)wbuf, (void)out, (void)emit;
#endif
}

#if defined(LLM_SERVING_AMX)
// gemm_units on AMX: per group of 64 rows (parts x n), each row dequantized into a float row (L1) and split into
// its bfloat16 halves in the group's A operand, rows past parts x n up to a multiple of 16 zeros; C (ldc =
// c_stride(m)) in the layout `done` reads. The tiles are configured for this call only (amx::Tiles).
template <typename Done>
void gemm_units_amx(const Matrix* const* ws, int parts, int64_t u0, int64_t u1, const float* xp, int64_t m,
                    float* wbuf, float* c, Done done) {
  namespace amx = llm_serving::amx;
  const int64_t k = ws[0]->k, per = kAmxGroup / parts, ldc = amx::c_stride(m);
  float* row = wbuf;
  float* wg = wbuf + 32 * amx::kblocks(k);
  const amx::Tiles tiles;
  if (amx::rows16(m) <= amx::kSliceRows) {              // few rows: the weights split a depth slice at a time
    uint16_t* slice = reinterpret_cast<uint16_t*>(wg);
    const int64_t kb = amx::kblocks(k);
    for (int64_t u = u0; u < u1; u += per) {
      const int64_t n = std::min(per, u1 - u), g = parts * n;
      for (int64_t b0 = 0; b0 < kb; b0 += amx::kSliceBlocks) {
        const int64_t b1 = std::min(kb, b0 + amx::kSliceBlocks), tiles_per_row = (b1 - b0) * amx::kPieces * amx::kTile;
        for (int q = 0; q < parts; ++q) {
          const Matrix& w = *ws[q];
          for (int64_t i = 0; i < n; ++i) {
            const int64_t at = q * n + i;                // the group's row: block at / 16, tile row at % 16
            w.split_slice(w.data + (u + i) * w.row_bytes, b0, b1, row, slice + at / 16 * tiles_per_row + at % 16 * 32);
          }
        }
        for (int64_t at = g; at < amx::rows16(g); ++at)
          for (int64_t b = 0; b < b1 - b0; ++b)
            for (int p = 0; p < amx::kPieces; ++p)
              std::memset(slice + at / 16 * tiles_per_row + (b * amx::kPieces + p) * amx::kTile + at % 16 * 32, 0, 64);
        amx::product_slice(slice, g, xp, m, k, b0, b1, c);
      }
      done(u, n, static_cast<const float*>(c), ldc);
    }
    return;
  }
  for (int64_t u = u0; u < u1; u += per) {
    const int64_t n = std::min(per, u1 - u), g = parts * n;
    for (int q = 0; q < parts; ++q) {
      const Matrix& w = *ws[q];
      for (int64_t i = 0; i < n; ++i) {
        const float* src = reinterpret_cast<const float*>(w.data) + (u + i) * k;
        if (w.type != kF32) {
          w.dequantize_row(w.data + (u + i) * w.row_bytes, row);
          src = row;
        }
        amx::convert_row(src, k, g, q * n + i, wg);
      }
    }
    for (int64_t i = g; i < amx::rows16(g); ++i) amx::convert_row(nullptr, k, g, i, wg);
    amx::product(wg, g, xp, m, k, c);
    done(u, n, static_cast<const float*>(c), ldc);
  }
}
#endif

#if defined(LLM_SERVING_AMX_INT)
// gemm_units on the integer tiles: per group of 64 rows (parts x n), each row's codes, scales and offsets into the
// group's A operand (the whole depth: a block of 32 at a time, or a super-block for ints == kIntSupers), then the
// product; C as gemm_units_amx's.
template <typename Done>
void gemm_units_int(const Matrix* const* ws, int parts, int64_t u0, int64_t u1, const float* xp, int64_t m,
                    float* wbuf, float* c, int ints, Done done) {
  namespace ai = llm_serving::amx_int;
  const int64_t k = ws[0]->k, per = kAmxGroup / parts, ldc = ai::c_stride(m);
  const bool supers = ints == kIntSupers;
  bool high = false;                                     // (blocks of 32: some part's rows have second pieces)
  for (int q = 0; q < parts; ++q) high = high || ws[q]->type == kQ6_K;
  // bytes of a block of 16 rows in the group's A operand
  const int64_t row_block = supers ? ai::supers(k) * ai::kSuperWeightBytes : ai::kblocks(k) * ai::kBlockBytes;
  uint8_t* wg = reinterpret_cast<uint8_t*>(wbuf);
  auto groups = [&]() {
    for (int64_t u = u0; u < u1; u += per) {
      const int64_t n = std::min(per, u1 - u), g = parts * n;
      for (int q = 0; q < parts; ++q) {
        const Matrix& w = *ws[q];
        for (int64_t i = 0; i < n; ++i) {
          const int64_t at = q * n + i;
          const uint8_t* row = w.data + (u + i) * w.row_bytes;
          if (supers) w.super_row(row, wg + at / 16 * row_block, static_cast<int>(at % 16));
          else w.int_row(row, wg + at / 16 * row_block, static_cast<int>(at % 16), high);
        }
      }
      if (supers) ai::super_product(wbuf, g, xp, m, k, c);
      else ai::product(wbuf, g, high, xp, m, k, c);
      done(u, n, static_cast<const float*>(c), ldc);
    }
  };
  if (supers) {                                          // (the two kinds of products configure the tiles apart)
    const ai::SuperTiles tiles;
    groups();
  } else {
    const ai::Tiles tiles;
    groups();
  }
}
#endif

// Rows u of `parts` matrices ws[q] (q < parts, gate/up: 2, each in its own type, all of width k) for units u in
// [u0, u1) times every row of the packed x (m rows): a group of units at a time, done(u, n, c, ldc) with C row
// q * n + i = matrix q's row u + i and C[.][b] its product with x row b. wbuf: gemm_w_floats(k) floats, c:
// gemm_c_floats(m), both the calling thread's. amx: x was packed for gemm_amx.h.
template <typename Done>
void gemm_units(const Matrix* const* ws, int parts, int64_t u0, int64_t u1, const float* xp, int64_t m, float* wbuf,
                float* c, bool amx, Done done, int ints = kNoInt) {
#if defined(LLM_SERVING_AMX_INT)
  if (ints != kNoInt) {
    gemm_units_int(ws, parts, u0, u1, xp, m, wbuf, c, ints, done);
    return;
  }
#endif
  (void)ints;
#if defined(LLM_SERVING_AMX)
  if (amx) {
    gemm_units_amx(ws, parts, u0, u1, xp, m, wbuf, c, done);
    return;
  }
#endif
  (void)amx;
  const int64_t k = ws[0]->k, per = gemm_group(k, false) / parts, ldc = gemm::panels(m) * gemm::kPanel;
  gemm::Segment segs[3];
  for (int64_t u = u0; u < u1; u += per) {
    const int64_t n = std::min(per, u1 - u);
    for (int q = 0; q < parts; ++q) {
      const Matrix& w = *ws[q];
      const int64_t first = u;
      if (w.type == kF32) {
        segs[q] = {reinterpret_cast<const float*>(w.data) + first * k, n};
      } else {
        for (int64_t i = 0; i < n; ++i) w.dequantize_row(w.data + (first + i) * w.row_bytes, wbuf + (q * n + i) * k);
        segs[q] = {wbuf + q * n * k, n};
      }
    }
    gemm::product(segs, parts, xp, m, k, c, ldc);
    done(u, n, static_cast<const float*>(c), ldc);
  }
}

// How a step's products run, chosen once per kernel call from its rows: matvec's tiles (few rows), the batched
// kernels (gemm_cpu.h, AMX), or with batch invariance dot_gemm (fewer than kLaneRows rows) or lane_units, whose
// sums are dot_gemm's. A product whose parts all have integer codes runs kInt instead (gemm_avx2_int.h, any rows,
// invariant or not), unless AMX's integer tiles take it (int_enabled: not invariant, from kIntGemmRows rows).
enum class Route { kTiles, kBatched, kDot, kLanes, kInt };

// batched: the fastest paths' batched products (the call's rows reach their threshold)
inline Route route_of(bool invariant, bool batched, int64_t rows) {
  return batched ? Route::kBatched : !invariant ? Route::kTiles : rows >= kLaneRows ? Route::kLanes : Route::kDot;
}

// Floats of a route's buffers for m rows of x of k columns: the packed x (shared; 0: none), and a thread's
// weight group and C (or lane sums)
struct RouteFloats {
  int64_t x, w, c;
};
inline RouteFloats route_floats(Route route, int64_t m, int64_t k, bool amx) {
  switch (route) {
    case Route::kBatched: return {gemm_x_floats(m, k, amx), gemm_w_floats(k, amx), gemm_c_floats(m, amx)};
    case Route::kLanes: return {gemm::packed_floats(m, k), lane_w_floats(k), lane_c_floats(m)};
    case Route::kDot: return {0, dot_w_floats(k), dot_lane_floats()};
#if defined(LLM_SERVING_AVX2_INT)
    case Route::kInt: {              // the rows of x as int16 records, a tile's unpacked rows and its outputs
      namespace ai = llm_serving::avx2_int;
      return {m * ai::x_bytes(k) / 4, ai::buffer_bytes(k, m) / 4, ai::kTileRows * ((m + 15) / 16 * 16)};
    }
#else
    case Route::kInt: break;
#endif
    case Route::kTiles: break;
  }
  return {0, 0, 0};
}

// Buffers for the products of a call that run on either route (each the larger)
inline RouteFloats widest(RouteFloats a, RouteFloats b) {
  return {std::max(a.x, b.x), std::max(a.w, b.w), std::max(a.c, b.c)};
}

// Whether a route's products read x packed (by pack_for)
inline bool packs_x(Route route) { return route == Route::kBatched || route == Route::kLanes || route == Route::kInt; }

// Every thread packs the panels of x it claims, as the route reads them (pack_x or pack_x_lanes); a barrier must
// follow
inline void pack_for(Route route, std::atomic<int64_t>& next, const float* x, int64_t m, int64_t k, float* xp,
                     bool amx, int ints) {
  if (route == Route::kLanes) pack_x_lanes(next, x, m, k, xp);
  else if (route == Route::kInt) pack_x_int(next, x, m, k, xp);
  else pack_x(next, x, m, k, xp, amx, ints);
}

// Rows [r0, r1) of w times every row of x (batch rows of w.k): emit(b, r, w[r] . x[b]), by the product's route:
// matvec with tile, gemm_units (xp: x packed by pack_x), or, batch-invariant, dot_gemm or lane_units (xp: x
// packed by pack_lanes; wbuf and c: the route's buffers), or int_rows (xp: x packed by pack_x_int).
template <typename Emit>
void product_rows(Route route, const Matrix& w, const float* x, const float* xp, int64_t batch, int64_t r0,
                  int64_t r1, float* tile, float* wbuf, float* c, bool amx, Emit emit, int ints = kNoInt) {
  switch (route) {
    case Route::kTiles: matvec(w, x, batch, r0, r1, tile, emit); return;
    case Route::kDot: dot_gemm(w, x, batch, r0, r1, wbuf, c, emit); return;
    case Route::kInt: int_rows(w, xp, batch, r0, r1, wbuf, c, emit); return;
    case Route::kLanes: {
      const Matrix* ws[1] = {&w};
      lane_units(ws, 1, r0, r1, x, xp, batch, wbuf, c, [&](int64_t u, int64_t n, const float* cc, int64_t ldc) {
        for (int64_t b = 0; b < batch; ++b)
          for (int64_t i = 0; i < n; ++i) emit(b, u + i, cc[i * ldc + b]);
      });
      return;
    }
    case Route::kBatched: break;
  }
  const Matrix* ws[1] = {&w};
  gemm_units(ws, 1, r0, r1, xp, batch, wbuf, c, amx, [&](int64_t u, int64_t n, const float* cc, int64_t ldc) {
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t i = 0; i < n; ++i) emit(b, u + i, cc[i * ldc + b]);
  }, ints);
}

// y[b] = x[b] / sqrt(mean(x[b]^2) + eps) * gain for rows b of x (B, h)
void rms_normalize(const float* x, int64_t batch, int64_t h, float eps, const float* gain, float* y) {
  for (int64_t b = 0; b < batch; ++b) {
    const float* xb = x + b * h;
    float ss = 0.f;
    for (int64_t e = 0; e < h; ++e) ss += xb[e] * xb[e];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
    for (int64_t e = 0; e < h; ++e) y[b * h + e] = xb[e] * inv * gain[e];
  }
}

// The layer's norm (iconfig[18]): RMSNorm (a gain) or LayerNorm (the mean subtracted, a gain and a bias: BERT)
enum Norm : int32_t { kRmsNorm = 0, kLayerNorm = 1 };

// One row of h: y = (x - mean) / sqrt(var + eps) * gain + bias, mean and variance summed in double (BERT's eps is
// 1e-12: the variance's rounding must not dominate it); y may be x
inline void layer_normalize_row(const float* x, int64_t h, float eps, const float* gain, const float* bias, float* y) {
  double sum = 0.0;
  for (int64_t e = 0; e < h; ++e) sum += x[e];
  const double mean = sum / static_cast<double>(h);
  double ss = 0.0;
  for (int64_t e = 0; e < h; ++e) ss += (x[e] - mean) * (x[e] - mean);
  const double inv = 1.0 / std::sqrt(ss / static_cast<double>(h) + static_cast<double>(eps));
  for (int64_t e = 0; e < h; ++e) y[e] = static_cast<float>((x[e] - mean) * inv) * gain[e] + bias[e];
}

// y[b] = norm(x[b]) * gain (+ bias: LayerNorm) for rows b of x (B, h): rms_normalize's bits for RMSNorm
void normalize(int32_t norm, const float* x, int64_t batch, int64_t h, float eps, const float* gain, const float* bias,
               float* y) {
  if (norm == kRmsNorm) {
    rms_normalize(x, batch, h, eps, gain, y);
    return;
  }
  for (int64_t b = 0; b < batch; ++b) layer_normalize_row(x + b * h, h, eps, gain, bias, y + b * h);
}

// One product's LoRA adapters, stacked by slot: A (S, parts*R, K) and B transposed, (S, R, N), the scale folded
// into B. Output row j belongs to part part_of(j) (q/k/v of the q/k/v product, gate/up of gate_up; one part for
// o and down), whose R-wide slice of u = A[slot] x it reads: out[j] += sum_k u[part][k] B[slot][k][j], summed
// across outputs (16 at a time) rather than along R. Slot 0 is the base model (no adapter): its rows are not
// touched, and a step whose rows are all slot 0 costs nothing more.
struct LoraProduct {
  const float* a = nullptr;
  const float* b = nullptr;
  int64_t slots = 0, parts = 1, r = 0, k = 0, n = 0;
  int64_t bound1 = 0, bound2 = 0;             // first output row of parts 1 and 2

  bool set(void* a_ptr, const int64_t* a_shape, void* b_ptr, const int64_t* b_shape, int64_t nparts, int64_t rows,
           int64_t cols, int64_t first1, int64_t first2) {
    a = static_cast<const float*>(a_ptr);
    b = static_cast<const float*>(b_ptr);
    slots = a_shape[0], parts = nparts, k = cols, n = rows, r = b_shape[1];
    bound1 = first1, bound2 = first2;
    return slots >= 1 && r >= 1 && a_shape[1] == parts * r && a_shape[2] == k && b_shape[0] == slots &&
           b_shape[2] == n;
  }
  int64_t part_of(int64_t j) const { return j < bound1 ? 0 : j < bound2 ? 1 : 2; }

  // u[row] (parts*R, at u + row * ldu) = A[slot] x[row] for rows[0..count) that all use `slot`: each tile of
  // A's rows is read once for all of them
  void project(int32_t slot, const int64_t* rows_of, int64_t count, const float* x, int64_t ldx, float* u,
               int64_t ldu) const {
    const int64_t w = parts * r;
    const float* ab = a + slot * w * k;
    for (int64_t i = 0; i < w; i += 4)
      for (int64_t at = 0; at < count; ++at)
        dot4(ab + i * k, std::min<int64_t>(4, w - i), x + rows_of[at] * ldx, u + rows_of[at] * ldu + i);
  }
  // y[row][j] += B[slot][j] . u[row][part(j)] for every output j of rows[0..count) (all using `slot`): each row
  // of B^T is read once for all of them, and the runs over j are long (vectorized)
  void add(int32_t slot, const int64_t* rows_of, int64_t count, const float* u, int64_t ldu, float* y,
           int64_t ldy) const {
    const float* bt = b + slot * r * n;
    const int64_t ends[3] = {bound1, bound2, n};
    for (int64_t part = 0, j0 = 0; part < parts; j0 = ends[part], ++part) {
      for (int64_t at = 0; at < count; ++at) {
        const float* ur = u + rows_of[at] * ldu + part * r;
        float* yr = y + rows_of[at] * ldy;
        int64_t j = j0;
        for (; j + 16 <= ends[part]; j += 16) {      // 16 outputs in a register across all R
          v16 acc = load16(yr + j);
          for (int64_t kk = 0; kk < r; ++kk) acc += ur[kk] * load16(bt + kk * n + j);
          std::memcpy(yr + j, &acc, sizeof(acc));
        }
        for (; j < ends[part]; ++j)
          for (int64_t kk = 0; kk < r; ++kk) yr[j] += ur[kk] * bt[kk * n + j];
      }
    }
  }
  // out[i] = A row i . x for the n (<= 4) rows of A from `rows` on: four accumulators, x read once
  void dot4(const float* rows, int64_t n, const float* x, float* out) const {
    v16 acc[4] = {};
    int64_t e = 0;
    for (; e + 16 <= k; e += 16) {
      const v16 xv = load16(x + e);
      for (int64_t i = 0; i < n; ++i) acc[i] += load16(rows + i * k + e) * xv;
    }
    for (int64_t i = 0; i < n; ++i) {
      float tail = 0.f;
      for (int64_t t = e; t < k; ++t) tail += rows[i * k + t] * x[t];
      out[i] = hsum(acc[i]) + tail;
    }
  }

};

// The MLP's activation (iconfig[12]): act = f(gate) * up (an ungated MLP: f(up), up = 1 here)
enum Activation : int32_t { kSiLU = 0, kGeluTanh = 1, kGeluErf = 2 };

// g * sigmoid(z) * u, with the exponential of a non-positive argument only
inline float sigmoid_times(float g, float z, float u) {
  const float e = llm_serving::exp_nonpositive(-std::fabs(z));     // e^-|z|
  const float sigmoid = z >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
  return g * sigmoid * u;
}

// silu(g) * u = g sigmoid(g) u
inline float silu_times(float g, float u) { return sigmoid_times(g, g, u); }

// gelu_tanh(g) * u: 0.5 g (1 + tanh(y)) = g sigmoid(2y), y = sqrt(2/pi) (g + 0.044715 g^3) (GELU's tanh
// approximation, Gemma's gelu_pytorch_tanh), as a sigmoid: no cancellation in 1 + tanh for negative g
inline float gelu_times(float g, float u) {
  return sigmoid_times(g, 1.5957691216057308f * (g + 0.044715f * g * g * g), u);
}

// gelu(g) * u with GELU's exact form, 0.5 g (1 + erf(g / sqrt(2))) (BERT's "gelu")
inline float gelu_erf_times(float g, float u) { return 0.5f * g * (1.f + std::erf(g * 0.7071067811865476f)) * u; }

// silu_times, gelu_times and gelu_erf_times of 8 values (not inlined: one compiled copy each)
__attribute__((noinline)) void silu8(const float* g, const float* u, float* out) {
  for (int i = 0; i < 8; ++i) out[i] = silu_times(g[i], u[i]);
}
__attribute__((noinline)) void gelu8(const float* g, const float* u, float* out) {
  for (int i = 0; i < 8; ++i) out[i] = gelu_times(g[i], u[i]);
}
__attribute__((noinline)) void gelu_erf8(const float* g, const float* u, float* out) {
  for (int i = 0; i < 8; ++i) out[i] = gelu_erf_times(g[i], u[i]);
}

// out[i] = f(g[i]) * u[i] for the activation f, i < n, 8 at a time through silu8 or gelu8 (the last ones
// padded): the same float for a value wherever it sits. Every MLP but the few-row fast path's takes it:
// silu_times inlined into a loop is vectorized there and its remainder not, and the two need not agree to the bit
// (batch-invariant steps would then differ between their few-row and many-row routes).
void activation_span(int32_t activation, const float* g, const float* u, int64_t n, float* out) {
  void (*const act8)(const float*, const float*, float*) = activation == kGeluTanh ? gelu8
                                                            : activation == kGeluErf ? gelu_erf8 : silu8;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) act8(g + i, u + i, out + i);
  if (i < n) {
    float gp[8] = {}, up[8] = {}, op[8];
    std::memcpy(gp, g + i, (n - i) * sizeof(float));
    std::memcpy(up, u + i, (n - i) * sizeof(float));
    act8(gp, up, op);
    std::memcpy(out + i, op, (n - i) * sizeof(float));
  }
}

// act[b * ld + i] = f(gate[i][b]) * up[i][b] for i < n, b < bb, f GELU (tanh approximation or erf): the few-row MLP's
// GELU, out of line (inlined beside that loop's SiLU, it made GCC compile the SiLU models' few-row steps 4-8% slower)
__attribute__((noinline)) void gelu_block(int32_t activation, const float gate[4][4], const float up[4][4], int64_t n,
                                          int bb, float* act, int64_t ld) {
  for (int64_t i = 0; i < n; ++i)
    for (int b = 0; b < bb; ++b)
      act[b * ld + i] = activation == kGeluErf ? gelu_erf_times(gate[i][b], up[i][b]) : gelu_times(gate[i][b], up[i][b]);
}

// out[b] = res[b] + norm(y[b]) * gain (+ bias: LayerNorm) for rows b = first, first + step, ... < rows of (rows, h)
// (a sandwich norm on a product's result before the residual); out may be res
void add_normalized(int32_t norm, const float* y, const float* res, int64_t first, int64_t step, int64_t rows,
                    int64_t h, float eps, const float* gain, const float* bias, float* out, float* scratch) {
  for (int64_t b = first; b < rows; b += step) {
    const float* yb = y + b * h;
    if (norm == kLayerNorm) {
      layer_normalize_row(yb, h, eps, gain, bias, scratch);
      for (int64_t e = 0; e < h; ++e) out[b * h + e] = res[b * h + e] + scratch[e];
      continue;
    }
    float ss = 0.f;
    for (int64_t e = 0; e < h; ++e) ss += yb[e] * yb[e];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
    for (int64_t e = 0; e < h; ++e) out[b * h + e] = res[b * h + e] + yb[e] * inv * gain[e];
  }
}

// x[b] = norm(x[b]) * gain (+ bias) in place for rows b = first, first + step, ... < rows of (rows, h): a post norm
// after the residual add (BERT: x = LayerNorm(x + attention), x = LayerNorm(x + mlp))
void normalize_in_place(int32_t norm, float* x, int64_t first, int64_t step, int64_t rows, int64_t h, float eps,
                        const float* gain, const float* bias) {
  for (int64_t b = first; b < rows; b += step) normalize(norm, x + b * h, 1, h, eps, gain, bias, x + b * h);
}

// v (n, d): each d-vector v / sqrt(mean(v^2) + eps) * gain, in place (Qwen3's and Gemma 3's q and k norms)
void normalize_heads(float* v, int64_t n, int64_t d, float eps, const float* gain) {
  for (int64_t i = 0; i < n; ++i) {
    float* vi = v + i * d;
    float ss = 0.f;
    for (int64_t e = 0; e < d; ++e) ss += vi[e] * vi[e];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
    for (int64_t e = 0; e < d; ++e) vi[e] = vi[e] * inv * gain[e];
  }
}

}  // namespace

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

namespace {

const llm_serving::ParamSpec kDecoderLayerParams[] = {DECODER_LAYER_PARAMS(LLM_SERVING_PARAM_SPEC)};
const llm_serving::ParamSpec kFinalLogitsParams[] = {FINAL_LOGITS_PARAMS(LLM_SERVING_PARAM_SPEC)};
}  // namespace

// A kernel's list as text, built once per kernel (each expansion is its own lambda, with its own static).
#define LLM_SERVING_DESCRIBED(spec)                                                                       \
  ([] {                                                                                                  \
    static const std::string text = llm_serving::describe_params(spec, sizeof(spec) / sizeof(spec[0])); \
    return text.c_str();                                                                                 \
  }())

extern "C" const char* DecoderLayerParams() { return LLM_SERVING_DESCRIBED(kDecoderLayerParams); }
extern "C" const char* FinalLogitsParams() { return LLM_SERVING_DESCRIBED(kFinalLogitsParams); }

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
  float* c = Scratch::sized(tile, ai::kTileRows * m);
  ai::pack_rows(x, k, k, m, 0, m, reinterpret_cast<uint8_t*>(xp));
  for (int64_t r = 0; r < rows; r += ai::kTileRows) {
    const int64_t n = std::min(ai::kTileRows, rows - r);
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
// type not repacked (Q4_K, Q6_K, Q8_0, Q4_0 and Q4_1 are; a row of blocks of 32 must be whole groups of 256), rows not a multiple of 8, products that would not read it (the integer
// products off, or a build with AMX's integer tiles, which read the stored rows), or LLM_SERVING_KERNEL_REPACK=0 in
// the environment (read once: the stored rows' products, for comparisons; the same floats either way).
extern "C" int32_t RepackRows(int32_t type, const uint8_t* src, int64_t rows, int64_t row_bytes, uint8_t* dst) {
#if defined(LLM_SERVING_AVX2_INT) && !defined(LLM_SERVING_AMX_INT)
  namespace ai = llm_serving::avx2_int;
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
  (void)type, (void)src, (void)rows, (void)row_bytes, (void)dst;
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
  const int64_t icfg_len = shapes[ICFG][0], fcfg_len = shapes[FCFG][0];
  if ((icfg_len != 11 && icfg_len != 12 && (icfg_len < 16 || icfg_len > 22)) || (fcfg_len != 1 && fcfg_len != 2)) {
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
  // the model family's parts (iconfig[12..15]; an iconfig of 11 or 12 entries: LLaMA's)
  const int32_t activation = icfg_len > 12 ? icfg[12] : kSiLU;
  const bool qk_norm = icfg_len > 13 && icfg[13] == 1, sandwich = icfg_len > 14 && icfg[14] == 1;
  const int64_t window = icfg_len > 15 ? icfg[15] : 0;
  // the layer's own MLP (iconfig[16]: 1 or absent), or none (0: out = x + attention; a mixture-of-experts layer,
  // whose MLP is MoeMlp's, passes placeholder gate/up/down matrices, which are not read)
  const bool mlp = icfg_len <= 16 || icfg[16] == 1;
  const bool has_sinks = icfg_len > 17 && icfg[17] == 1;           // attention sinks (iconfig[17])
  const float* sinks = has_sinks ? static_cast<const float*>(params[SINKS]) : nullptr;
  // a BERT encoder's parts (iconfig[18..21]): LayerNorm, post norms, an ungated MLP, MLP biases
  const int32_t norm = icfg_len > 18 ? icfg[18] : kRmsNorm;
  const bool post = icfg_len > 19 && icfg[19] == 1;
  const bool gated = icfg_len <= 20 || icfg[20] == 1;
  const bool mlp_biased = icfg_len > 21 && icfg[21] == 1;
  auto is_flag = [](int32_t v) { return v == 0 || v == 1; };
  bool flags_valid = icfg_len <= 13 || (is_flag(icfg[13]) && is_flag(icfg[14]));
  for (int64_t at = 16; at < icfg_len; ++at) flags_valid = flags_valid && is_flag(icfg[at]);
  if ((activation != kSiLU && activation != kGeluTanh && activation != kGeluErf) || !flags_valid || window < 0 ||
      (post && sandwich)) {
    return 2;
  }

  const int64_t batch = shapes[X][0], h = shapes[X][1];
  const int64_t bs = icfg[0], nh = icfg[1], kvh = icfg[2];
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
      !as_matrix(params[Q_W], dtypes[Q_W], shapes[Q_W], icfg[4], nh * d, h, &q_w) ||
      !as_matrix(params[K_W], dtypes[K_W], shapes[K_W], icfg[5], kvh * d, h, &k_w) ||
      !as_matrix(params[V_W], dtypes[V_W], shapes[V_W], icfg[6], kvh * d, h, &v_w) ||
      !as_matrix(params[O_W], dtypes[O_W], shapes[O_W], icfg[7], h, nh * d, &o_w) ||
      !as_matrix(params[GATE_W], dtypes[GATE_W], shapes[GATE_W], icfg[8], gated ? inter : 1, h, &gate_w) ||
      !as_matrix(params[UP_W], dtypes[UP_W], shapes[UP_W], icfg[9], inter, h, &up_w) ||
      !as_matrix(params[DOWN_W], dtypes[DOWN_W], shapes[DOWN_W], icfg[10], h, inter, &down_w) ||
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
  Pool& p = pool(std::max(1, icfg[3]));
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
  const bool invariant = invariant_of(icfg, shapes[ICFG][0], 11);
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
      llm_serving::with_cache(cache_type, key_cache, value_cache, [&](const auto* kc, const auto* vc) {
        if (it.tile) {
          llm_serving::attend_tile(qkv + b * nqkv, nqkv, it.n, context[b], kc, vc, tables + (b + it.n - 1) * width,
                                   it.k0, attn + b * nh * d, nh * d, ash, attn_tiles + tid * tile_floats,
                                   it.n == 1 ? static_cast<uint32_t>(tree[b]) : 0xFFFFFFFFu, window, sinks);
        } else {
          llm_serving::attend_row(qkv + b * nqkv, kc, vc, tables + b * width, context[b],
                                  static_cast<uint32_t>(tree[b]), attn + b * nh * d, ash,
                                  scores + tid * nh * width * bs, it.k0, it.k1, window, sinks);
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
//   iconfig      (7,)          int32    [threads, experts per token K, gate type, up type, down type,
//                                        renormalize: 1 the chosen K's weights are a softmax over their own
//                                        logits (Mixtral; Qwen3-MoE's norm_topk_prob; gpt-oss), 0 their
//                                        probabilities among all E (Qwen3-MoE without it),
//                                        activation: 0 SiLU, 1 gpt-oss's clamped SwiGLU]
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

namespace {
const llm_serving::ParamSpec kMoeMlpParams[] = {MOE_MLP_PARAMS(LLM_SERVING_PARAM_SPEC)};

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
  const auto* icfg = static_cast<const int32_t*>(params[ICFG]);
  const auto* fcfg = static_cast<const float*>(params[FCFG]);
  const float eps = fcfg[0], alpha = fcfg[1], limit = fcfg[2];
  const bool clamped = icfg[6] == 1;
  auto* out = static_cast<float*>(params[OUT]);
  const int64_t batch = shapes[X][0], h = shapes[X][1], experts = shapes[ROUTER][0], k = icfg[1];
  const int64_t inter = experts > 0 ? shapes[GATE_W][0] / experts : 0;
  Matrix gate_w, up_w, down_w;
  if (experts < 1 || k < 1 || k > experts || inter < 1 || shapes[GATE_W][0] != experts * inter ||
      (icfg[5] != 0 && icfg[5] != 1) || (icfg[6] != 0 && icfg[6] != 1) || shapes[GATE_B][0] != experts * inter ||
      shapes[UP_B][0] != experts * inter || shapes[DOWN_B][0] != experts * h ||
      shapes[SLOTS][0] != batch || shapes[ROUTER][1] != h ||
      shapes[ROUTER_B][0] != experts || shapes[POST_GAIN][0] != h || shapes[OUT][0] != batch ||
      shapes[OUT][1] != h ||
      !as_matrix(params[GATE_W], dtypes[GATE_W], shapes[GATE_W], icfg[2], experts * inter, h, &gate_w) ||
      !as_matrix(params[UP_W], dtypes[UP_W], shapes[UP_W], icfg[3], experts * inter, h, &up_w) ||
      !as_matrix(params[DOWN_W], dtypes[DOWN_W], shapes[DOWN_W], icfg[4], experts * h, inter, &down_w)) {
    return 2;
  }
  const bool renormalize = icfg[5] == 1;
  int64_t rows = batch;
  while (rows > 0 && slots[rows - 1] < 0) --rows;
  if (rows < batch) std::memcpy(out + rows * h, x + rows * h, (batch - rows) * h * sizeof(float));
  if (rows == 0) return 0;

  const Timed timed(0);
  Pool& p = pool(std::max(1, icfg[0]));
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
  if ((shapes[ICFG][0] != 2 && shapes[ICFG][0] != 3) || !as_matrix(params[W], dtypes[W], shapes[W], icfg[1], vocab, h, &w) ||
      !layer_type(w.type) ||
      shapes[GAIN][0] != h || shapes[SLOTS][0] != rows || shapes[LOGITS][0] != rows ||
      shapes[LOGITS][1] != vocab || shapes[TOKEN][0] != rows || shapes[LOGPROB][0] != rows || vocab < 1) {
    return 2;
  }
  const auto* x = static_cast<const float*>(params[X]);
  const auto* gain = static_cast<const float*>(params[GAIN]);
  const auto* slots = static_cast<const int32_t*>(params[SLOTS]);
  const int threads = std::max(1, icfg[0]);
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
  const bool invariant = invariant_of(icfg, shapes[ICFG][0], 2);
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

// EmbedTokens(ids (T,) int32, table (V, K) weight, iconfig [table type]) -> out (T, K) float32: each token's row
// of the embedding, read from the table as stored (a GGUF's quantized rows dequantized one row per token), so
// the embedding needs no float32 copy; a tied lm_head's repacked panels (a repacked type) give each row's stored
// bytes back first (avx2_int::stored_row), the same floats. Ids outside [0, V) return 3.
#define EMBED_TOKENS_PARAMS(P) \
  P(IDS, "ids", 1, "int32") P(TABLE, "table", 2, "weight") P(ICFG, "iconfig", 1, "int32") P(OUT, "out", 2, "float32")

namespace {
const llm_serving::ParamSpec kEmbedTokensParams[] = {EMBED_TOKENS_PARAMS(LLM_SERVING_PARAM_SPEC)};
}  // namespace

extern "C" const char* EmbedTokensParams() { return LLM_SERVING_DESCRIBED(kEmbedTokensParams); }

extern "C" int EmbedTokens(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                           void* stream, void* extra) {
  (void)stream;
  (void)extra;
  enum { EMBED_TOKENS_PARAMS(LLM_SERVING_PARAM_ENUM) NPARAM };
  if (!llm_serving::params_match(kEmbedTokensParams, NPARAM, nparam, ndims, dtypes)) return 1;
  const int64_t tokens = shapes[IDS][0], vocab = shapes[TABLE][0], k = shapes[OUT][1];
  const auto* icfg = static_cast<const int32_t*>(params[ICFG]);
  Matrix table;
  if (shapes[ICFG][0] != 1 || shapes[OUT][0] != tokens ||
      !as_matrix(params[TABLE], dtypes[TABLE], shapes[TABLE], icfg[0], vocab, k, &table)) {
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
    stored.type = table.type - llm_serving::avx2_int::kRepacked;
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

namespace {
const llm_serving::ParamSpec kSampleLogitsParams[] = {SAMPLE_LOGITS_PARAMS(LLM_SERVING_PARAM_SPEC)};
}  // namespace

extern "C" const char* SampleLogitsParams() { return LLM_SERVING_DESCRIBED(kSampleLogitsParams); }

extern "C" int SampleLogits(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                            void* stream, void* extra) {
  (void)stream;
  (void)extra;
  enum { SAMPLE_LOGITS_PARAMS(LLM_SERVING_PARAM_ENUM) NPARAM };
  if (!llm_serving::params_match(kSampleLogitsParams, NPARAM, nparam, ndims, dtypes)) return 1;
  const int64_t rows = shapes[LOGITS][0], vocab = shapes[LOGITS][1];
  if (shapes[TEMPERATURE][0] != rows || shapes[RANDOM_U][0] != rows || shapes[ICFG][0] != 1 ||
      shapes[TOKEN][0] != rows || shapes[LOGPROB][0] != rows || vocab < 1) {
    return 2;
  }
  const auto* logits = static_cast<const float*>(params[LOGITS]);
  const auto* temperature = static_cast<const float*>(params[TEMPERATURE]);
  const auto* random_u = static_cast<const float*>(params[RANDOM_U]);
  const int threads = std::max(1, static_cast<const int32_t*>(params[ICFG])[0]);
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
