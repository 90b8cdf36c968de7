// A vision tower's encoder-layer kernels for the CPU (models/vision_tower.py), loaded by MindSpore as
// `ops.Custom(func_type="aot")` kernels; built and cached by kernels/__init__.py. The work MindSpore's ops did in
// many passes over (patches x width) tensors is done here in one:
//   VisionLinear:    the layer's four products, on the matrices in the checkpoint's own type (float16, bfloat16 or
//                    float32) packed in panels at load, or quantized to int16 panels (AVX2's faster products), the
//                    bias added and fc1's tanh GELU applied as each block of the result is made (as MindSpore's ops,
//                    the bias and GELU alone took 0.23 s a layer at Gemma 3's 4,096 x 4,304 on two Zen 3 cores, and
//                    the matrices were float32 copies: twice an F16 tower);
//   VisionAttention: self-attention, every patch of an image attending to every patch of it (no mask), read from
//                    the q|k|v product's rows with its bias added as they are read, written as the output
//                    projection reads it;
//   VisionLayerNorm: the layer's two LayerNorms (0.09 s each as MindSpore's ops at 4,096 x 1,152).
//
// VisionAttention (MindSpore passes inputs then outputs in `params`):
//   qkv       (N*T, 3*D) float32  each patch's row of the q, k and v projections, q then k then v, each H heads of
//                                 hd = D/H values side by side (SigLIP's layout), before their bias
//   qkv_bias  (3*D,)     float32
//   config    (3,) (4,)  int32    [T (patches an image), H (heads), threads(, level)]: level 1 the values'
//                                 product in int16, 2 the scores' too (the int16 path below), 0 or none float32
//   rope      (N*T, 2*hd) float32 (optional) each patch's cos then sin: q and k, their bias added, rotated by them
//                                 (rotate_half, as a Qwen-VL tower's 2-D rotary positions) as they are read, so
//                                 that the rotation costs no pass of its own (as MindSpore's ops, the rotation and
//                                 the q|k|v concatenation took 0.15 s a block at Qwen3-VL's 3,072 patches of 1,024
//                                 on two Zen 5 cores, more than the attention itself)
//   keys      (N,)       int32    (optional, after rope) image n's keys: its first keys[n] patches, 1 to T (the
//                                 rest padding, never attended to: a Qwen2.5-VL window at the grid's edge, each
//                                 window one "image" of T patches); its padding rows are queries all the same
//   out       (N*T, D)   float32  softmax(q k^T / sqrt(hd)) v of each image and head, the heads side by side
//
// Why a kernel: as MindSpore ops the attention split q|k|v into (3, N, H, T, hd) (a transpose of every value),
// wrote the (N, H, T, T) scores (1 GiB at Gemma 3's 4,096 patches and 16 heads), read them back for the
// softmax, wrote the probabilities, and transposed the result back: about half of an encoder layer's time beside
// the products. Here a block of kQueries queries of one head runs over the image's keys kKeyBlock at a time,
// with an online softmax (each query's running maximum and sum, as flash attention does): the scores of one
// block live in L1/L2, and nothing of size T^2 is ever written.
//
// Everything runs transposed, queries along the vectors' lanes: S^T = K Q^T and O^T += V^T P^T, each a
// register-blocked product of kRows rows (keys, or head dims) x 2 vectors of queries, broadcasting a scalar of K
// or V (read as the rows store them) into every FMA with a vector of Q^T or P^T. The softmax then runs down a
// block's key rows lane by lane (each query's maximum, exponentials and sum are vector operations: no
// horizontal reductions), and a query block's output is transposed once, when it is written. The scores are
// taken in log2 units (Q scaled by log2(e) / sqrt(hd)) so that the softmax's exponentials are 2^x
// (exp2_nonpositive: six FMAs a vector, the rest on the add and integer pipes).
//
// Two phases, each spread over `threads` threads (the calling one included):
//   1. each (image, head)'s keys copied out in panels of kRows keys and its values to (T', hd) rows (T' = T
//      rounded up to kKeyBlock, zeros past the end), their biases added;
//   2. each (image, head, query block) task: Q^T scaled, then for each key block S^T, the online softmax,
//      O^T += V^T P^T; then O^T / sum written out.
// Sums run in float32 along hd (scores) and along the keys in order (outputs), a query's the same whatever the
// other queries, images and threads: the result does not depend on the batch.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu_kernel_common.h"
#include "gemm_amx.h"            // AMX's tile configuration, permission and bfloat16 split (LLM_SERVING_AMX)
#include "layer_parts_cpu.h"     // layer_normalize_row, gelu_times: the decoder layer's own

namespace {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
constexpr int kRows = 12;          // 12 x 2 accumulators of 32 registers
#else
constexpr int64_t kLanes = 8;
#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__)
#define VISION_ASM_6X2 1
constexpr int kRows = 6;           // 6 x 2 accumulators of 16 registers, in assembly (fma_6x16): as C++, GCC
                                   // spilled one of 6 x 2 and 4 x 2 left the FMA pipes idle on their latency
#else
constexpr int kRows = 4;           // (AVX2 without an x86-64 assembler: 4 x 2, which GCC keeps in registers)
#endif
#endif
typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));

constexpr int64_t kQueries = 4 * kLanes;   // queries per task: 2 passes of the micro-kernel's 2 vectors
constexpr int64_t kKeyBlock = 96;          // keys per block (a whole number of kRows-key panels)
static_assert(kKeyBlock % kRows == 0, "a key block is whole panels");

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }

typedef int32_t vi __attribute__((vector_size(kLanes * sizeof(int32_t))));
inline vf max(vf a, vf b) {
#if defined(__AVX512F__)
  return (vf)_mm512_max_ps((__m512)a, (__m512)b);
#elif defined(__AVX__)
  return (vf)_mm256_max_ps((__m256)a, (__m256)b);
#else
  return a > b ? a : b;
#endif
}
// v kept as computed: -fassociative-math would otherwise fold x - ((x + magic) - magic) to 0
inline void opaque(vf& v) {
#if defined(__AVX512F__)
  asm("" : "+v"(v));
#elif defined(__AVX__)
  asm("" : "+x"(v));
#else
  asm("" : "+m"(v));
#endif
}

// 2^x for x <= 0 (or -inf), lanewise: x clamped to -125 (2^-125 ~ 2e-38: a normal float), n = round(x) by the
// 1.5 * 2^23 trick (its low bits hold n), 2^(x - n) on [-0.5, 0.5] by a degree-6 polynomial (relative error
// ~2e-7), times 2^n by adding n to the exponent field. Six FMAs of the two FMA pipes, the rest on the add and
// integer pipes: the softmax's exponentials cost a third of what exp_nonpositive's did beside the products.
inline vf exp2_nonpositive(vf x) {
  const vf magic = vf{} + 12582912.f;
  x = max(x, vf{} + -125.f);
  vf t = x + magic;
  opaque(t);
  vf n = t - magic;
  opaque(n);
  const vf f = x - n;
  vf p = vf{} + 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.f;
  return (vf)((vi)p + ((vi)t << 23));
}

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

constexpr int64_t kMaxHeadDims = 256;     // (a head's values copied to the stack: SigLIP's 72, Qwen-VL's 64 and 80)

struct Shape {
  int64_t n, t, h, hd, d;   // images, patches an image, heads, head dim, H * hd
  int64_t tp;               // T rounded up to kKeyBlock
  const float* rope;        // (N T, 2 hd): each patch's cos then sin of its 2-D rotary positions, or null
  const int32_t* keys;      // (N,): image n's first keys[n] patches are its keys (the rest padding), or null: all T

  int64_t keys_of(int64_t n) const { return keys == nullptr ? t : keys[n]; }
};

// Patch `row`'s q or k of one head (src: its hd values in the q|k|v row, b: their bias): src + b, rotated as a
// Qwen-VL tower's q and k are (rotate_half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), by the patch's
// rows of sh.rope) where sh.rope is given; into dst.
inline void head_values(const float* src, const float* b, const Shape& sh, int64_t row, float* dst) {
  if (sh.rope == nullptr) {
    for (int64_t e = 0; e < sh.hd; ++e) dst[e] = src[e] + b[e];
    return;
  }
  const int64_t half = sh.hd / 2;
  const float* cos = sh.rope + row * 2 * sh.hd;
  const float* sin = cos + sh.hd;
  for (int64_t e = 0; e < half; ++e) {
    const float x1 = src[e] + b[e], x2 = src[e + half] + b[e + half];
    dst[e] = x1 * cos[e] - x2 * sin[e];
    dst[e + half] = x2 * cos[e + half] + x1 * sin[e + half];
  }
}

#if defined(VISION_ASM_6X2)
// The AVX2 micro-kernel of both products here (the attention's and VisionLinear's), in assembly: 6 rows x 16
// columns of c in 12 accumulators, the 2 vectors of b and 2 broadcasts (16 registers; as C++, GCC spilled one).
// Per k: b's 16 values at b + k * b_step floats, the 6 rows' scalars side by side at a + k * a_step floats.
// c's rows ldc floats apart start as init's 16 values (each row alike) or, init null, as c holds them.
inline void fma_6x16(const float* a, int64_t a_step, const float* b, int64_t b_step, int64_t depth, float* c,
                     int64_t ldc, const float* init) {
  const int64_t a_bytes = a_step * 4, b_bytes = b_step * 4, ldc_bytes = ldc * 4;
  float* c3 = c + 3 * ldc;
  asm volatile(
      "testq %[init], %[init]\n\t"
      "jz 3f\n\t"
      "vmovups (%[init]), %%ymm0\n\t vmovups 32(%[init]), %%ymm1\n\t"
      "vmovaps %%ymm0, %%ymm2\n\t vmovaps %%ymm1, %%ymm3\n\t vmovaps %%ymm0, %%ymm4\n\t vmovaps %%ymm1, %%ymm5\n\t"
      "vmovaps %%ymm0, %%ymm6\n\t vmovaps %%ymm1, %%ymm7\n\t vmovaps %%ymm0, %%ymm8\n\t vmovaps %%ymm1, %%ymm9\n\t"
      "vmovaps %%ymm0, %%ymm10\n\t vmovaps %%ymm1, %%ymm11\n\t"
      "jmp 4f\n"
      "3:\n\t"
      "vmovups (%[c]), %%ymm0\n\t vmovups 32(%[c]), %%ymm1\n\t"
      "vmovups (%[c],%[ldc],1), %%ymm2\n\t vmovups 32(%[c],%[ldc],1), %%ymm3\n\t"
      "vmovups (%[c],%[ldc],2), %%ymm4\n\t vmovups 32(%[c],%[ldc],2), %%ymm5\n\t"
      "vmovups (%[c3]), %%ymm6\n\t vmovups 32(%[c3]), %%ymm7\n\t"
      "vmovups (%[c3],%[ldc],1), %%ymm8\n\t vmovups 32(%[c3],%[ldc],1), %%ymm9\n\t"
      "vmovups (%[c3],%[ldc],2), %%ymm10\n\t vmovups 32(%[c3],%[ldc],2), %%ymm11\n"
      "4:\n\t"
      "testq %[n], %[n]\n\t"
      "jz 2f\n"
      "1:\n\t"
      "vmovups (%[b]), %%ymm12\n\t vmovups 32(%[b]), %%ymm13\n\t"
      "vbroadcastss (%[a]), %%ymm14\n\t"
      "vfmadd231ps %%ymm12, %%ymm14, %%ymm0\n\t vfmadd231ps %%ymm13, %%ymm14, %%ymm1\n\t"
      "vbroadcastss 4(%[a]), %%ymm15\n\t"
      "vfmadd231ps %%ymm12, %%ymm15, %%ymm2\n\t vfmadd231ps %%ymm13, %%ymm15, %%ymm3\n\t"
      "vbroadcastss 8(%[a]), %%ymm14\n\t"
      "vfmadd231ps %%ymm12, %%ymm14, %%ymm4\n\t vfmadd231ps %%ymm13, %%ymm14, %%ymm5\n\t"
      "vbroadcastss 12(%[a]), %%ymm15\n\t"
      "vfmadd231ps %%ymm12, %%ymm15, %%ymm6\n\t vfmadd231ps %%ymm13, %%ymm15, %%ymm7\n\t"
      "vbroadcastss 16(%[a]), %%ymm14\n\t"
      "vfmadd231ps %%ymm12, %%ymm14, %%ymm8\n\t vfmadd231ps %%ymm13, %%ymm14, %%ymm9\n\t"
      "vbroadcastss 20(%[a]), %%ymm15\n\t"
      "vfmadd231ps %%ymm12, %%ymm15, %%ymm10\n\t vfmadd231ps %%ymm13, %%ymm15, %%ymm11\n\t"
      "addq %[ab], %[a]\n\t"
      "addq %[bb], %[b]\n\t"
      "decq %[n]\n\t"
      "jnz 1b\n"
      "2:\n\t"
      "vmovups %%ymm0, (%[c])\n\t vmovups %%ymm1, 32(%[c])\n\t"
      "vmovups %%ymm2, (%[c],%[ldc],1)\n\t vmovups %%ymm3, 32(%[c],%[ldc],1)\n\t"
      "vmovups %%ymm4, (%[c],%[ldc],2)\n\t vmovups %%ymm5, 32(%[c],%[ldc],2)\n\t"
      "vmovups %%ymm6, (%[c3])\n\t vmovups %%ymm7, 32(%[c3])\n\t"
      "vmovups %%ymm8, (%[c3],%[ldc],1)\n\t vmovups %%ymm9, 32(%[c3],%[ldc],1)\n\t"
      "vmovups %%ymm10, (%[c3],%[ldc],2)\n\t vmovups %%ymm11, 32(%[c3],%[ldc],2)\n\t"
      // (outputs early-clobber: a "+r" without it may share its register with an input of equal value)
      : [a] "+&r"(a), [b] "+&r"(b), [n] "+&r"(depth)
      : [c] "r"(c), [c3] "r"(c3), [ldc] "r"(ldc_bytes), [init] "r"(init), [ab] "r"(a_bytes), [bb] "r"(b_bytes)
      : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
        "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
}
alignas(32) constexpr float kZeros16[16] = {};
#endif

// ---- The int16 micro-kernel: VisionLinear's int16 panels, VisionAttention's int16 path ----
//
// AVX2's float FMA does 8 multiply-adds an instruction; vpmaddwd does 16 on int16 pairs (two depths' products of 8
// columns summed into int32), and with the vpaddd that accumulates them a panel loop runs about 1.5x FMA's on Zen 3
// (measured in L1, broadcasts included: 53-58 against 36 GMAC/s a core). The integer sums are exact; each chunk of
// pairs is kept short enough that its sums cannot overflow int32, then widened to float32, times its row's step,
// and added to c's (in order along the depth, whatever the batch).
constexpr int64_t kMaddRows = 6;      // rows of c a tile (12 int32 accumulators with the 16 columns)
constexpr int64_t kMaddCols = 16;

#if defined(VISION_ASM_6X2)
// 6 rows x 16 columns of c (rows ldc floats apart) = (first: nothing; else c) + the sum over `chunks` chunks of
// `chunk_pairs` pairs of steps[row] * (a . b), steps moving s_step floats a chunk. Per pair: the 6 rows' int16 pairs
// side by side at a (a_step int16 to the next pair), the 16 columns' pairs at b (b_step). 12 int32 accumulators,
// the 2 vectors of b, a broadcast and a product (16 registers). The broadcasts are vbroadcastss (the same 32
// bits): on Zen 3 vpbroadcastd took 10% longer.
inline void madd_6x16(const int16_t* a, int64_t a_step, const int16_t* b, int64_t b_step, const float* steps,
                      int64_t s_step, int64_t chunks, int64_t chunk_pairs, float* c, int64_t ldc, int64_t first) {
  const int64_t a_bytes = a_step * 2, b_bytes = b_step * 2, s_bytes = s_step * 4, ldc_bytes = ldc * 4;
  float* c3 = c + 3 * ldc;
  int64_t left;
#define VL_ROW(off, lo, hi)                                                              \
  "vbroadcastss " #off "(%[a]), %%ymm14\n\t"                                              \
  "vpmaddwd %%ymm12, %%ymm14, %%ymm15\n\t vpaddd %%ymm15, %%ymm" #lo ", %%ymm" #lo "\n\t" \
  "vpmaddwd %%ymm13, %%ymm14, %%ymm15\n\t vpaddd %%ymm15, %%ymm" #hi ", %%ymm" #hi "\n\t"
#define VL_STORE(off, lo, hi, at_lo, at_hi)                                                                    \
  "vbroadcastss " #off "(%[s]), %%ymm14\n\t"                                                                    \
  "vcvtdq2ps %%ymm" #lo ", %%ymm" #lo "\n\t vmulps %%ymm14, %%ymm" #lo ", %%ymm" #lo "\n\t"                      \
  "vmovups %%ymm" #lo ", " at_lo "\n\t"                                                                         \
  "vcvtdq2ps %%ymm" #hi ", %%ymm" #hi "\n\t vmulps %%ymm14, %%ymm" #hi ", %%ymm" #hi "\n\t"                      \
  "vmovups %%ymm" #hi ", " at_hi "\n\t"
#define VL_ADD(off, lo, hi, at_lo, at_hi)                                                                      \
  "vbroadcastss " #off "(%[s]), %%ymm14\n\t"                                                                    \
  "vcvtdq2ps %%ymm" #lo ", %%ymm" #lo "\n\t vfmadd213ps " at_lo ", %%ymm14, %%ymm" #lo "\n\t"                    \
  "vmovups %%ymm" #lo ", " at_lo "\n\t"                                                                         \
  "vcvtdq2ps %%ymm" #hi ", %%ymm" #hi "\n\t vfmadd213ps " at_hi ", %%ymm14, %%ymm" #hi "\n\t"                    \
  "vmovups %%ymm" #hi ", " at_hi "\n\t"
#define VL_EACH(op)                                                                                            \
  op(0, 0, 1, "(%[c])", "32(%[c])") op(4, 2, 3, "(%[c],%[ldc],1)", "32(%[c],%[ldc],1)")                          \
  op(8, 4, 5, "(%[c],%[ldc],2)", "32(%[c],%[ldc],2)") op(12, 6, 7, "(%[c3])", "32(%[c3])")                       \
  op(16, 8, 9, "(%[c3],%[ldc],1)", "32(%[c3],%[ldc],1)") op(20, 10, 11, "(%[c3],%[ldc],2)", "32(%[c3],%[ldc],2)")
  asm volatile(
      "testq %[n], %[n]\n\t"
      "jz 9f\n"
      "1:\n\t"
      "vpxor %%xmm0, %%xmm0, %%xmm0\n\t vpxor %%xmm1, %%xmm1, %%xmm1\n\t vpxor %%xmm2, %%xmm2, %%xmm2\n\t"
      "vpxor %%xmm3, %%xmm3, %%xmm3\n\t vpxor %%xmm4, %%xmm4, %%xmm4\n\t vpxor %%xmm5, %%xmm5, %%xmm5\n\t"
      "vpxor %%xmm6, %%xmm6, %%xmm6\n\t vpxor %%xmm7, %%xmm7, %%xmm7\n\t vpxor %%xmm8, %%xmm8, %%xmm8\n\t"
      "vpxor %%xmm9, %%xmm9, %%xmm9\n\t vpxor %%xmm10, %%xmm10, %%xmm10\n\t vpxor %%xmm11, %%xmm11, %%xmm11\n\t"
      "movq %[cp], %[left]\n"
      "2:\n\t"
      "vmovdqu (%[b]), %%ymm12\n\t vmovdqu 32(%[b]), %%ymm13\n\t"
      VL_ROW(0, 0, 1) VL_ROW(4, 2, 3) VL_ROW(8, 4, 5) VL_ROW(12, 6, 7) VL_ROW(16, 8, 9) VL_ROW(20, 10, 11)
      "addq %[ab], %[a]\n\t"
      "addq %[bb], %[b]\n\t"
      "decq %[left]\n\t"
      "jnz 2b\n\t"
      "testq %[first], %[first]\n\t"
      "jz 3f\n\t"
      VL_EACH(VL_STORE)
      "xorq %[first], %[first]\n\t"
      "jmp 4f\n"
      "3:\n\t"
      VL_EACH(VL_ADD)
      "4:\n\t"
      "addq %[sb], %[s]\n\t"
      "decq %[n]\n\t"
      "jnz 1b\n"
      "9:\n\t"
      : [a] "+&r"(a), [b] "+&r"(b), [s] "+&r"(steps), [n] "+&r"(chunks), [first] "+&r"(first), [left] "=&r"(left)
      : [c] "r"(c), [c3] "r"(c3), [ldc] "r"(ldc_bytes), [ab] "r"(a_bytes), [bb] "r"(b_bytes), [sb] "m"(s_bytes),
        [cp] "m"(chunk_pairs)
      : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
        "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
#undef VL_ROW
#undef VL_STORE
#undef VL_ADD
#undef VL_EACH
}
#endif

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define VISION_VNNI_6X16 1
// madd_6x16 on AVX-512 VNNI: vpdpwssd multiplies the 16 columns' int16 pairs (one zmm) by a row's pair and adds
// them into its int32 accumulator in one instruction, 32 multiply-adds where AVX-512's float FMA does 16 (on Zen 4
// both issue once a cycle). The 6 rows' accumulators and b's one vector; a row's pair is a 32-bit broadcast folded
// into vpdpwssd's memory operand ({1to16}). The pair loop is assembly: as intrinsics GCC copied every accumulator
// through another register at each instruction. The chunk's flush as madd_6x16's.
inline void madd_6x16_vnni(const int16_t* a, int64_t a_step, const int16_t* b, int64_t b_step, const float* steps,
                           int64_t s_step, int64_t chunks, int64_t chunk_pairs, float* c, int64_t ldc, bool first) {
  const int64_t a_bytes = a_step * 2, b_bytes = b_step * 2;
  for (int64_t chunk = 0; chunk < chunks; ++chunk, first = false, steps += s_step) {
    __m512i c0 = _mm512_setzero_si512(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, bv;
    int64_t left = chunk_pairs;
    asm volatile(
        "1:\n\t"
        "vmovdqu64 (%[b]), %[bv]\n\t"
        "vpdpwssd (%[a])%{1to16%}, %[bv], %[c0]\n\t"
        "vpdpwssd 4(%[a])%{1to16%}, %[bv], %[c1]\n\t"
        "vpdpwssd 8(%[a])%{1to16%}, %[bv], %[c2]\n\t"
        "vpdpwssd 12(%[a])%{1to16%}, %[bv], %[c3]\n\t"
        "vpdpwssd 16(%[a])%{1to16%}, %[bv], %[c4]\n\t"
        "vpdpwssd 20(%[a])%{1to16%}, %[bv], %[c5]\n\t"
        "addq %[ab], %[a]\n\t"
        "addq %[bb], %[b]\n\t"
        "decq %[left]\n\t"
        "jnz 1b\n\t"
        // (every output early-clobber: a "+r" without it may share its register with an input of equal value)
        : [c0] "+&v"(c0), [c1] "+&v"(c1), [c2] "+&v"(c2), [c3] "+&v"(c3), [c4] "+&v"(c4), [c5] "+&v"(c5),
          [bv] "=&v"(bv), [a] "+&r"(a), [b] "+&r"(b), [left] "+&r"(left)
        : [ab] "r"(a_bytes), [bb] "r"(b_bytes)
        : "memory", "cc");
    const __m512i acc[kMaddRows] = {c0, c1, c2, c3, c4, c5};
    for (int r = 0; r < kMaddRows; ++r) {
      const __m512 v = _mm512_cvtepi32_ps(acc[r]), step = _mm512_set1_ps(steps[r]);
      float* row = c + r * ldc;
      _mm512_storeu_ps(row, first ? _mm512_mul_ps(v, step) : _mm512_fmadd_ps(v, step, _mm512_loadu_ps(row)));
    }
  }
}
#endif

// c (kMaddRows rows, stride ldc) (+)= the sum over `chunks` chunks of `chunk_pairs` pairs of steps[row] * (a . b)
// (madd_6x16's operands; chunk_pairs >= 1): the assembly on AVX2, vpdpwssd on AVX-512 VNNI, else the same sums in
// plain C++
inline void madd_tile(const int16_t* a, int64_t a_step, const int16_t* b, int64_t b_step, const float* steps,
                      int64_t s_step, int64_t chunks, int64_t chunk_pairs, float* c, int64_t ldc, bool first) {
#if defined(VISION_ASM_6X2)
  madd_6x16(a, a_step, b, b_step, steps, s_step, chunks, chunk_pairs, c, ldc, first ? 1 : 0);
#elif defined(VISION_VNNI_6X16)
  madd_6x16_vnni(a, a_step, b, b_step, steps, s_step, chunks, chunk_pairs, c, ldc, first);
#else
  for (int64_t chunk = 0; chunk < chunks; ++chunk, first = false, steps += s_step) {
    int32_t acc[kMaddRows][kMaddCols] = {};
    for (int64_t p = 0; p < chunk_pairs; ++p, a += a_step, b += b_step) {
      for (int r = 0; r < kMaddRows; ++r) {
        for (int j = 0; j < kMaddCols; ++j) {
          acc[r][j] += int32_t{a[2 * r]} * b[2 * j] + int32_t{a[2 * r + 1]} * b[2 * j + 1];
        }
      }
    }
    for (int r = 0; r < kMaddRows; ++r) {
      for (int j = 0; j < kMaddCols; ++j) {
        const float v = static_cast<float>(acc[r][j]) * steps[r];
        c[r * ldc + j] = first ? v : c[r * ldc + j] + v;
      }
    }
  }
#endif
}

// x rounded to the nearest integer, halves away from zero (vectorizes where nearbyint may not)
inline int32_t rounded(float x) { return static_cast<int32_t>(x + (x >= 0.f ? 0.5f : -0.5f)); }

// c (R rows, stride kQueries)[.. 2 vectors from q0] (+)= a (R rows of `depth`: a[r][k] at a[r + k * ks]) .
// b (depth rows of kQueries)[.. from q0]: a's R scalars of each k side by side, each broadcast; b's 2 vectors
// loaded once for all R rows and kept in registers (GCC otherwise reloads them as every FMA's memory operand: 18
// loads for 12 FMAs, which Zen 3 issues at 2 a cycle)

template <int R>
inline void rows_by_queries(const float* a, int64_t ks, const float* b, int64_t depth, float* c, int64_t q0,
                            bool accumulate) {
#if defined(VISION_ASM_6X2)
  if constexpr (R == 6) {
    fma_6x16(a, ks, b + q0, kQueries, depth, c + q0, kQueries, accumulate ? nullptr : kZeros16);
    return;
  }
#endif
  vf acc[R][2];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    acc[r][0] = accumulate ? load(c + r * kQueries + q0) : vf{};
    acc[r][1] = accumulate ? load(c + r * kQueries + q0 + kLanes) : vf{};
  }
  for (int64_t k = 0; k < depth; ++k) {
    vf b0 = load(b + k * kQueries + q0), b1 = load(b + k * kQueries + q0 + kLanes);
    opaque(b0);
    opaque(b1);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const vf x = vf{} + a[r + k * ks];
      acc[r][0] += x * b0;
      acc[r][1] += x * b1;
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    store(c + r * kQueries + q0, acc[r][0]);
    store(c + r * kQueries + q0 + kLanes, acc[r][1]);
  }
}

// O^T (hd, kQueries) += V^T P^T: V's key block (kKeyBlock, hd) read in place, kRows head dims (side by side in
// each key's row) at a time, the rest one at a time
void values_product(const float* v, int64_t hd, const float* pt, float* ot) {
  for (int64_t q0 = 0; q0 < kQueries; q0 += 2 * kLanes) {
    int64_t e = 0;
    for (; e + kRows <= hd; e += kRows) rows_by_queries<kRows>(v + e, hd, pt, kKeyBlock, ot + e * kQueries, q0, true);
    for (; e + 4 <= hd; e += 4) rows_by_queries<4>(v + e, hd, pt, kKeyBlock, ot + e * kQueries, q0, true);
    for (; e + 2 <= hd; e += 2) rows_by_queries<2>(v + e, hd, pt, kKeyBlock, ot + e * kQueries, q0, true);
    for (; e < hd; ++e) rows_by_queries<1>(v + e, hd, pt, kKeyBlock, ot + e * kQueries, q0, true);
  }
}

// S^T (kKeyBlock, kQueries) = K Q^T: the key block's panels of kRows keys (pack_head's), each (hd, kRows)
void scores_product(const float* panels, int64_t hd, const float* qt, float* st) {
  for (int64_t q0 = 0; q0 < kQueries; q0 += 2 * kLanes) {
    for (int64_t j = 0; j < kKeyBlock; j += kRows) {
      rows_by_queries<kRows>(panels + j * hd, kRows, qt, hd, st + j * kQueries, q0, false);
    }
  }
}

// Phase 1: image n's head h: its keys in panels of kRows keys, each panel (hd, kRows) (the scores' product
// broadcasts a panel's kRows keys of one dim from one place), then its values as (tp, hd) rows; zero past the last
// patch.
void pack_head(const float* qkv, const float* bias, const Shape& sh, int64_t n, int64_t h, float* k, float* v) {
  const int64_t stride = 3 * sh.d, keys = sh.keys_of(n), last_panel = keys / kRows * kRows * sh.hd;
  const float* rows = qkv + n * sh.t * stride + sh.d + h * sh.hd;
  const float* kb = bias + sh.d + h * sh.hd;
  const float* vb = kb + sh.d;
  std::memset(k + last_panel, 0, sizeof(float) * (sh.tp * sh.hd - last_panel));
  std::memset(v + keys * sh.hd, 0, sizeof(float) * (sh.tp - keys) * sh.hd);
  float key[kMaxHeadDims];
  for (int64_t j = 0; j < keys; ++j) {
    const float* src = rows + j * stride;
    float* panel = k + j / kRows * kRows * sh.hd + j % kRows;
    head_values(src, kb, sh, n * sh.t + j, key);
    for (int64_t e = 0; e < sh.hd; ++e) {
      panel[e * kRows] = key[e];
      v[j * sh.hd + e] = src[sh.d + e] + vb[e];
    }
  }
}

// O^T's first `rows` rows (kQueries each) times alpha: each query's rescale when its running maximum rose
inline void rescale_rows(float* ot, int64_t rows, const float* alpha) {
  for (int64_t e = 0; e < rows; ++e) {
    float* o = ot + e * kQueries;
    for (int64_t i = 0; i < kQueries; i += kLanes) store(o + i, load(o + i) * load(alpha + i));
  }
}

// A query block's outputs, O^T / (sum * divisor), into out's rows of image n's queries i0 .. i0 + queries, head h
inline void write_queries(const float* ot, const float* sum, float divisor, const Shape& sh, int64_t n, int64_t h,
                          int64_t i0, int64_t queries, float* out) {
  for (int64_t i = 0; i < queries; ++i) {
    float* dst = out + (n * sh.t + i0 + i) * sh.d + h * sh.hd;
    const float inv = 1.f / (sum[i] * divisor);
    for (int64_t e = 0; e < sh.hd; ++e) dst[e] = ot[e * kQueries + i] * inv;
  }
}

// A key block's scores S^T (kKeyBlock, kQueries; log2 units) to its probabilities P^T in place, the block's first
// `valid` keys real (the rest padding: -inf, whose 2^(-inf - m) is 2^-125, exp2_nonpositive's floor, on value rows
// of zeros): each query's running maximum mx and sum brought up to date, alpha the factor its O^T rows take (its
// old maximum's 2^(old - new); 2^-125 on the first block, where mx is -inf and the sum and O^T are 0)
inline void online_softmax(float* st, int64_t valid, float* mx, float* sum, float* alpha) {
  for (int64_t j = std::max<int64_t>(0, std::min(kKeyBlock, valid)); j < kKeyBlock; ++j) {
    std::fill(st + j * kQueries, st + (j + 1) * kQueries, -INFINITY);
  }
  for (int64_t i = 0; i < kQueries; i += kLanes) {
    vf m = load(mx + i);
    for (int64_t j = 0; j < kKeyBlock; ++j) m = max(m, load(st + j * kQueries + i));
    const vf a = exp2_nonpositive(load(mx + i) - m);
    vf total = load(sum + i) * a;
    for (int64_t j = 0; j < kKeyBlock; ++j) {
      const vf p = exp2_nonpositive(load(st + j * kQueries + i) - m);
      store(st + j * kQueries + i, p);
      total += p;
    }
    store(sum + i, total);
    store(mx + i, m);
    store(alpha + i, a);
  }
}

struct Scratch {   // a thread's: Q^T (hd, kQueries), S^T and P^T (kKeyBlock, kQueries), O^T (hd, kQueries)
  std::vector<float> qt, st, ot, mx, sum;
  explicit Scratch(const Shape& sh)
      : qt(sh.hd * kQueries), st(kKeyBlock * kQueries), ot(sh.hd * kQueries), mx(kQueries), sum(kQueries) {}
};

// Phase 2: image n, head h, queries i0 .. i0 + kQueries (those past T computed on zeros, never written).
void attend_block(const float* qkv, const float* bias, const float* k, const float* v, const Shape& sh, int64_t n,
                  int64_t h, int64_t i0, float scale, Scratch* w, float* out) {
  const int64_t stride = 3 * sh.d, queries = std::min(kQueries, sh.t - i0);
  std::fill(w->qt.begin(), w->qt.end(), 0.f);
  float query[kMaxHeadDims];
  for (int64_t i = 0; i < queries; ++i) {
    head_values(qkv + (n * sh.t + i0 + i) * stride + h * sh.hd, bias + h * sh.hd, sh, n * sh.t + i0 + i, query);
    for (int64_t e = 0; e < sh.hd; ++e) w->qt[e * kQueries + i] = query[e] * scale;
  }
  std::fill(w->ot.begin(), w->ot.end(), 0.f);
  std::fill(w->mx.begin(), w->mx.end(), -INFINITY);
  std::fill(w->sum.begin(), w->sum.end(), 0.f);
  float* st = w->st.data();
  for (int64_t j0 = 0; j0 < sh.tp; j0 += kKeyBlock) {
    scores_product(k + j0 * sh.hd, sh.hd, w->qt.data(), st);
    alignas(64) float alpha[kQueries];
    online_softmax(st, sh.keys_of(n) - j0, w->mx.data(), w->sum.data(), alpha);
    rescale_rows(w->ot.data(), sh.hd, alpha);
    values_product(v + j0 * sh.hd, sh.hd, st, w->ot.data());
  }
  write_queries(w->ot.data(), w->sum.data(), 1.f, sh, n, h, i0, queries, out);
}

// ---- VisionAttention in int16: its config's level 1 (vision_int16) or 2 (vision_int16_scores) ----
//
// The same blocks and online softmax, the products on madd_tile:
//   S^T = K Q^T (level 2; level 1 keeps the float32 scores_product): each key (its hd values) rounded to kKeyMax
//     steps of its largest, each query (scaled to log2 units) to kQueryMax steps of its own: a score is the exact
//     integer sum times the key's step (madd_tile's row step) times the query's (in the softmax). hd x 4,095^2 <
//     2^31 for hd <= kInt16HeadDims: one chunk. A score's error is then a fraction (~3e-4) of q.k, which the
//     softmax exponentiates: opt-in.
//   O^T += V^T P^T (levels 1 and 2): each head dim's values over the image rounded to kValueMax steps of that
//     dim's largest, the probabilities (<= 1: relative to the query's running maximum) to steps of 1 / kProbMax,
//     in chunks of kValuePairs key pairs (48 keys x 16,383 x 2,047 < 2^31); O^T / kProbMax at the end.
// Head dims are padded with zeros to hdp, a multiple of kMaddRows (72: 72; 64: 66). Layouts, per (image, head):
//   keys:   (tp / 6 panels, hdp / 2 pairs, 6 keys, 2) int16, and a step per key
//   values: (hdp / 6 groups of dims, tp / 2 key pairs, 6 dims, 2) int16, and a step per dim
//   Q^T:    (hdp / 2 pairs, kQueries, 2) int16;  P^T: (kKeyBlock / 2 key pairs, kQueries, 2) int16
constexpr int kKeyMax = 4095, kQueryMax = 4095, kProbMax = 16383, kValueMax = 2047;
constexpr int64_t kInt16HeadDims = 128;
constexpr int64_t kValuePairs = 24;
static_assert(kInt16HeadDims * int64_t{kKeyMax} * kQueryMax < (int64_t{1} << 31), "a score fits int32");
static_assert(2 * kValuePairs * int64_t{kProbMax} * kValueMax < (int64_t{1} << 31), "a values chunk fits int32");
static_assert(kKeyBlock % (2 * kValuePairs) == 0 && kKeyBlock % kMaddRows == 0, "a key block is whole chunks");
static_assert(kQueries % kMaddCols == 0, "a query block is whole tiles");

inline int64_t padded_head_dims(int64_t hd) { return round_up(hd, kMaddRows); }

// x's n values rounded to `top_steps` steps of their largest magnitude into out; returns the step
inline float quantize_span(const float* x, int64_t n, int top_steps, int16_t* out) {
  float top = 0.f;
  for (int64_t e = 0; e < n; ++e) top = std::max(top, std::fabs(x[e]));
  const float inverse = top > 0.f ? top_steps / top : 0.f;
  for (int64_t e = 0; e < n; ++e) out[e] = static_cast<int16_t>(rounded(x[e] * inverse));
  return top > 0.f ? top / top_steps : 1.f;
}

// Phase 1 of the int16 path: image n's head h, its keys and values rounded and packed (the layouts above)
void pack_head_int16(const float* qkv, const float* bias, const Shape& sh, int64_t n, int64_t h, int16_t* k,
                     float* k_steps, float* k_float, int16_t* v, float* v_steps) {
  const int64_t stride = 3 * sh.d, hdp = padded_head_dims(sh.hd), pairs = sh.tp / 2;
  const float* rows = qkv + n * sh.t * stride + sh.d + h * sh.hd;
  const float* kb = bias + sh.d + h * sh.hd;
  const float* vb = kb + sh.d;
  if (k != nullptr) std::fill(k, k + sh.tp * hdp, int16_t{0});
  std::fill(v, v + sh.tp * hdp, int16_t{0});
  std::fill(k_steps, k_steps + sh.tp, 1.f);
  if (k_float != nullptr) std::fill(k_float, k_float + sh.tp * sh.hd, 0.f);
  float row[kInt16HeadDims], top[kInt16HeadDims] = {}, inverse[kInt16HeadDims];
  const int64_t keys = sh.keys_of(n);
  for (int64_t j = 0; j < keys; ++j) {
    const float* src = rows + j * stride;
    head_values(src, kb, sh, n * sh.t + j, row);
    for (int64_t e = 0; e < sh.hd; ++e) top[e] = std::max(top[e], std::fabs(src[sh.d + e] + vb[e]));
    if (k_float != nullptr) {                          // float keys: pack_head's panels
      float* panel = k_float + j / kRows * kRows * sh.hd + j % kRows;
      for (int64_t e = 0; e < sh.hd; ++e) panel[e * kRows] = row[e];
      continue;
    }
    int16_t codes[kInt16HeadDims];
    k_steps[j] = quantize_span(row, sh.hd, kKeyMax, codes);
    int16_t* panel = k + j / kMaddRows * kMaddRows * hdp + j % kMaddRows * 2;     // dim e at (e / 2, key, e % 2)
    for (int64_t e = 0; e < sh.hd; ++e) panel[e / 2 * 2 * kMaddRows + e % 2] = codes[e];
  }
  for (int64_t e = 0; e < hdp; ++e) {
    v_steps[e] = e < sh.hd && top[e] > 0.f ? top[e] / kValueMax : 1.f;
    inverse[e] = e < sh.hd && top[e] > 0.f ? kValueMax / top[e] : 0.f;
  }
  for (int64_t j = 0; j < keys; ++j) {
    const float* src = rows + j * stride + sh.d;
    for (int64_t e = 0; e < sh.hd; ++e) {
      v[((e / kMaddRows * pairs + j / 2) * kMaddRows + e % kMaddRows) * 2 + j % 2] =
          static_cast<int16_t>(rounded((src[e] + vb[e]) * inverse[e]));
    }
  }
}

struct AttentionScratch16 {   // a thread's: Q^T (int16, or float) and P^T, S^T and O^T, the queries' steps, maxima
                              // and sums
  std::vector<int16_t> qt, pt;
  std::vector<float> qt_float, st, ot, q_steps, mx, sum;
  explicit AttentionScratch16(const Shape& sh)
      : qt(padded_head_dims(sh.hd) * kQueries), pt(kKeyBlock * kQueries), qt_float(sh.hd * kQueries),
        st(kKeyBlock * kQueries), ot(padded_head_dims(sh.hd) * kQueries), q_steps(kQueries), mx(kQueries),
        sum(kQueries) {}
};

// Phase 2 of the int16 path: image n, head h, queries i0 .. i0 + kQueries
void attend_block_int16(const float* qkv, const float* bias, const int16_t* k, const float* k_steps,
                        const float* k_float, const int16_t* v, const float* v_steps, const Shape& sh, int64_t n,
                        int64_t h, int64_t i0, float scale, AttentionScratch16* w, float* out) {
  const int64_t stride = 3 * sh.d, queries = std::min(kQueries, sh.t - i0), hdp = padded_head_dims(sh.hd);
  const int64_t pairs = sh.tp / 2;
  std::fill(w->qt.begin(), w->qt.end(), int16_t{0});
  std::fill(w->qt_float.begin(), w->qt_float.end(), 0.f);
  std::fill(w->q_steps.begin(), w->q_steps.end(), 1.f);
  for (int64_t i = 0; i < queries; ++i) {
    float row[kInt16HeadDims];
    head_values(qkv + (n * sh.t + i0 + i) * stride + h * sh.hd, bias + h * sh.hd, sh, n * sh.t + i0 + i, row);
    for (int64_t e = 0; e < sh.hd; ++e) row[e] *= scale;
    if (k_float != nullptr) {
      for (int64_t e = 0; e < sh.hd; ++e) w->qt_float[e * kQueries + i] = row[e];
      continue;
    }
    int16_t codes[kInt16HeadDims];
    w->q_steps[i] = quantize_span(row, sh.hd, kQueryMax, codes);
    for (int64_t e = 0; e < sh.hd; ++e) w->qt[(e / 2 * kQueries + i) * 2 + e % 2] = codes[e];
  }
  std::fill(w->ot.begin(), w->ot.end(), 0.f);
  std::fill(w->mx.begin(), w->mx.end(), -INFINITY);
  std::fill(w->sum.begin(), w->sum.end(), 0.f);
  float* st = w->st.data();
  float* mx = w->mx.data();
  float* sum = w->sum.data();
  int16_t* pt = w->pt.data();
  for (int64_t j0 = 0; j0 < sh.tp; j0 += kKeyBlock) {
    if (k_float != nullptr) scores_product(k_float + j0 * sh.hd, sh.hd, w->qt_float.data(), st);
    for (int64_t q0 = 0; q0 < kQueries && k_float == nullptr; q0 += kMaddCols) {   // S^T: integer sums x steps
      for (int64_t j = 0; j < kKeyBlock; j += kMaddRows) {
        madd_tile(k + (j0 + j) * hdp, 2 * kMaddRows, w->qt.data() + 2 * q0, 2 * kQueries, k_steps + j0 + j, 0, 1,
                  hdp / 2, st + j * kQueries + q0, kQueries, true);
      }
    }
    for (int64_t j = std::max<int64_t>(0, std::min(kKeyBlock, sh.keys_of(n) - j0)); j < kKeyBlock; ++j) {
      std::fill(st + j * kQueries, st + (j + 1) * kQueries, -INFINITY);
    }
    alignas(64) float alpha[kQueries];
    for (int64_t i = 0; i < kQueries; i += kLanes) {
      const vf q_step = load(w->q_steps.data() + i);
      vf m = load(mx + i);
      for (int64_t j = 0; j < kKeyBlock; ++j) m = max(m, load(st + j * kQueries + i) * q_step);
      const vf a = exp2_nonpositive(load(mx + i) - m);
      vf total = load(sum + i) * a;
      for (int64_t j = 0; j < kKeyBlock; j += 2) {                    // P^T as int16 pairs of keys, one word each
        const vf p0 = exp2_nonpositive(load(st + j * kQueries + i) * q_step - m);
        const vf p1 = exp2_nonpositive(load(st + (j + 1) * kQueries + i) * q_step - m);
        total += p0;
        total += p1;
        const vi c0 = __builtin_convertvector(p0 * static_cast<float>(kProbMax) + 0.5f, vi);
        const vi c1 = __builtin_convertvector(p1 * static_cast<float>(kProbMax) + 0.5f, vi);
        const vi word = c0 | (c1 << 16);
        std::memcpy(pt + (j / 2 * kQueries + i) * 2, &word, sizeof word);
      }
      store(sum + i, total);
      store(mx + i, m);
      store(alpha + i, a);
    }
    rescale_rows(w->ot.data(), sh.hd, alpha);
    for (int64_t q0 = 0; q0 < kQueries; q0 += kMaddCols) {          // O^T += V^T P^T, chunks of kValuePairs pairs
      for (int64_t e = 0; e < hdp; e += kMaddRows) {
        madd_tile(v + (e / kMaddRows * pairs + j0 / 2) * 2 * kMaddRows, 2 * kMaddRows, pt + 2 * q0, 2 * kQueries,
                  v_steps + e, 0, kKeyBlock / (2 * kValuePairs), kValuePairs, w->ot.data() + e * kQueries + q0,
                  kQueries, false);
      }
    }
  }
  write_queries(w->ot.data(), sum, kProbMax, sh, n, h, i0, queries, out);
}

// body() on `threads` threads at once (the calling one included), until each returns
template <typename Body>
void on_threads(int64_t threads, Body body) {
  std::vector<std::thread> pool;
  for (int64_t t = 1; t < threads; ++t) pool.emplace_back(body);
  body();
  for (auto& th : pool) th.join();
}

// work(i) for i < tasks on up to `threads` threads, each claiming `chunk` consecutive tasks at a time
template <typename Work>
void for_each_task(int64_t threads, int64_t tasks, int64_t chunk, Work work) {
  std::atomic<int64_t> next{0};
  on_threads(std::min(threads, (tasks + chunk - 1) / chunk), [&] {
    for (int64_t i0 = next.fetch_add(chunk); i0 < tasks; i0 = next.fetch_add(chunk)) {
      for (int64_t i = i0; i < std::min(tasks, i0 + chunk); ++i) work(i);
    }
  });
}

// ---- VisionLinear's product: out (R, N) = x (R, K) W^T + bias, W packed in panels of 16 output columns ----
//
// The layout, as the runner packs the checkpoint's (N, K) matrix once at load (vision_tower.py's _panels):
// (P, K, 16), P = ceil(N / 16), panel j holding columns 16 j .. 16 j + 15 k-major (zeros past N), in the
// checkpoint's own type (float16, bfloat16 or float32: nothing is widened in memory). A task is a block of kBlockRows
// rows of x: for each depth block of kDepth columns it packs its rows into tiles of kTileRows rows (kDepth, kTileRows),
// and for each panel widens the panel's (kDepth, 16) slice to float32 (16 KB: L1) once and multiplies every tile of
// the block by it (the tiles, 288 x 256 floats, stay in L2). The micro-kernel keeps a kTileRows x 16 block of out in
// registers: per k, the panel's 16 values (2 vectors on AVX2, 1 on AVX-512) and each row's x broadcast, one FMA per
// vector (AVX2: 6 x 2 accumulators in assembly, fma_6x16; AVX-512: 12 x 1). out starts as the bias; each row's sums
// run along k in order, whatever the other rows and the threads: a row's result does not depend on the batch.
#if defined(VISION_ASM_6X2)
constexpr int64_t kTileRows = 6;
#elif defined(__AVX512F__)
constexpr int64_t kTileRows = 12;
#else
constexpr int64_t kTileRows = 4;
#endif
constexpr int64_t kPanelCols = 16;
constexpr int64_t kGemmDepth = 256;
constexpr int64_t kBlockRows = 48 * kTileRows;

// c (kTileRows rows, stride ldc) = (init: each row starts as its 16 values; null: as c holds) + a (depth x
// kTileRows, k-major) . b (depth x 16, k-major)
inline void tile_product(const float* a, const float* b, int64_t depth, float* c, int64_t ldc, const float* init) {
#if defined(VISION_ASM_6X2)
  fma_6x16(a, kTileRows, b, kPanelCols, depth, c, ldc, init);
#else
  constexpr int V = kPanelCols / kLanes;
  vf acc[kTileRows][V];
  for (int r = 0; r < kTileRows; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = load(init != nullptr ? init + v * kLanes : c + r * ldc + v * kLanes);
  for (int64_t k = 0; k < depth; ++k) {
    vf bv[V];
    for (int v = 0; v < V; ++v) {
      bv[v] = load(b + k * kPanelCols + v * kLanes);
      opaque(bv[v]);
    }
    for (int r = 0; r < kTileRows; ++r) {
      const vf x = vf{} + a[k * kTileRows + r];
      for (int v = 0; v < V; ++v) acc[r][v] += x * bv[v];
    }
  }
  for (int r = 0; r < kTileRows; ++r)
    for (int v = 0; v < V; ++v) store(c + r * ldc + v * kLanes, acc[r][v]);
#endif
}

// n panel values (a panel's slice of depth rows) as float32: in place, or widened into buf
inline const float* widened_panel(const float* src, int64_t, float*) { return src; }
inline const float* widened_panel(const llm_serving::Half* src, int64_t n, float* buf) {
  return llm_serving::widened(src, n, buf);
}
inline const float* widened_panel(const llm_serving::BFloat16* src, int64_t n, float* buf) {
  return llm_serving::widened(src, n, buf);
}

// VisionLinear's activation code for none: layer_parts_cpu.h's 0 is SiLU, which a product alone never applies
constexpr int32_t kNoActivation = 0;

// Rows [r0, r1) of out = x W^T + bias (act: then that activation of each value, VisionLinear's kNoActivation or one
// of layer_parts_cpu.h's).
template <typename W>
void linear_rows(const float* x, int64_t k, const W* w, const float* bias, int64_t n, int32_t act, int64_t r0,
                 int64_t r1, float* out, std::vector<float>* scratch) {
  const int64_t rows = r1 - r0, tiles = (rows + kTileRows - 1) / kTileRows, panels = (n + kPanelCols - 1) / kPanelCols;
  scratch->resize(tiles * kTileRows * kGemmDepth + kGemmDepth * kPanelCols + 2 * kTileRows * kPanelCols);
  float* ap = scratch->data();
  float* bp = ap + tiles * kTileRows * kGemmDepth;
  float* edge = bp + kGemmDepth * kPanelCols;       // a tile that runs past the last row or column
  std::vector<float> bias_panels(panels * kPanelCols, 0.f);     // (the last panel's columns past n: zeros)
  std::copy(bias, bias + n, bias_panels.begin());
  for (int64_t k0 = 0; k0 < k; k0 += kGemmDepth) {
    const int64_t depth = std::min(kGemmDepth, k - k0);
    for (int64_t t = 0; t < tiles; ++t) {                // the block's rows of this depth block, tile by tile
      float* dst = ap + t * kTileRows * kGemmDepth;
      for (int64_t i = 0; i < kTileRows; ++i) {
        const int64_t r = r0 + t * kTileRows + i;
        for (int64_t e = 0; e < depth; ++e) dst[e * kTileRows + i] = r < r1 ? x[r * k + k0 + e] : 0.f;
      }
    }
    for (int64_t j = 0; j < panels; ++j) {
      const W* slice = w + (j * k + k0) * kPanelCols;
      if (j + 1 < panels) {                               // the next panel's slice, on its way during this one's
        const char* next = reinterpret_cast<const char*>(slice + k * kPanelCols);
        for (int64_t at = 0; at < static_cast<int64_t>(depth * kPanelCols * sizeof(W)); at += 64) {
          __builtin_prefetch(next + at, 0, 3);
        }
      }
      const float* panel = widened_panel(slice, depth * kPanelCols, bp);
      const int64_t c0 = j * kPanelCols, cols = std::min(kPanelCols, n - c0);
      const float* init = k0 == 0 ? bias_panels.data() + c0 : nullptr;      // out starts as the bias
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t first = r0 + t * kTileRows, valid = std::min(kTileRows, r1 - first);
        // the next tile's rows of out, asked for now: the block's out (288 rows x N) is out of L2 by the next
        // depth block, and the micro-kernel would otherwise start on 12 cache misses
        for (int64_t i = 0; i < kTileRows && first + kTileRows + i < r1; ++i) {
          __builtin_prefetch(out + (first + kTileRows + i) * n + c0, 1, 3);
          __builtin_prefetch(out + (first + kTileRows + i) * n + c0 + kPanelCols - 1, 1, 3);
        }
        if (valid == kTileRows && cols == kPanelCols) {
          tile_product(ap + t * kTileRows * kGemmDepth, panel, depth, out + first * n + c0, n, init);
          continue;
        }
        std::fill(edge, edge + kTileRows * kPanelCols, 0.f);
        for (int64_t i = 0; i < valid && init == nullptr; ++i) {
          std::memcpy(edge + i * kPanelCols, out + (first + i) * n + c0, cols * 4);
        }
        tile_product(ap + t * kTileRows * kGemmDepth, panel, depth, edge, kPanelCols, init);
        for (int64_t i = 0; i < valid; ++i) std::memcpy(out + (first + i) * n + c0, edge + i * kPanelCols, cols * 4);
      }
    }
  }
  if (act != kNoActivation) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t c = 0; c < n; ++c) out[r * n + c] = activation_times(act, out[r * n + c], 1.f);
    }
  }
}

// ---- VisionLinear on int16 panels: the same product in 16-bit integers (madd_tile), for AVX2 and AVX-512 VNNI ----
//
// The matrix is quantized once at load, each column to kWeightMax steps of its largest value (13 bits); x at each
// call, each row's chunk of 2 kChunkPairs values to kActivationMax steps of the chunk's largest (14 bits: a channel
// of outliers costs only the chunks it sits in, as the text kernels' 16-bit x per block of 32). A chunk's sums
// cannot overflow int32 (64 x 8,191 x 4,095 < 2^31). At the end, times the column's step, plus the bias. The layout
// (kernels/vision_panels.py's int16_panels): (P, Kp, 16), Kp = K rounded up to 2 kChunkPairs (zeros past K), each
// panel pair-major: pair p's 32 values are the 16 columns' (k = 2p, 2p + 1) side by side, as vpmaddwd takes them.
// A tile of x: (pairs, kMaddRows, 2) int16, a row's pair one 32-bit broadcast; its steps (chunks, kMaddRows).
constexpr int kActivationMax = 8191;
constexpr int kWeightMax = 4095;
constexpr int64_t kChunkPairs = 32;
static_assert(2 * kChunkPairs * int64_t{kActivationMax} * kWeightMax < (int64_t{1} << 31), "a chunk fits int32");
constexpr int64_t kPairBlock = kGemmDepth / 2;      // pairs a panel's slice holds (8 KB of int16)
static_assert(kPairBlock % kChunkPairs == 0, "a slice is whole chunks");
static_assert(kPanelCols == kMaddCols, "a panel is a tile's columns");
constexpr float kOnes16[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};

// Row x's k values in chunks of 2 kChunkPairs, each to kActivationMax steps of its largest magnitude: kp int16 into
// q (zeros past k), each chunk's step into steps[chunk * stride] (1 for a chunk of zeros).
inline void quantize_row(const float* x, int64_t k, int64_t kp, int16_t* q, float* steps, int64_t stride) {
  constexpr int64_t kChunk = 2 * kChunkPairs;
  for (int64_t e0 = 0, chunk = 0; e0 < kp; e0 += kChunk, ++chunk) {
    const int64_t count = std::max<int64_t>(0, std::min(kChunk, k - e0));
    float v[kChunk] = {};
    std::memcpy(v, x + e0, count * sizeof(float));
    float top = 0.f;
#if defined(__AVX2__)
    __m256 m = _mm256_setzero_ps();
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t e = 0; e < kChunk; e += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(v + e), magnitude));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    top = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
#else
    for (int64_t e = 0; e < kChunk; ++e) top = std::max(top, std::fabs(v[e]));
#endif
    const float inverse = top > 0.f ? kActivationMax / top : 0.f;
    steps[chunk * stride] = top > 0.f ? top / kActivationMax : 1.f;
#if defined(__AVX2__)
    const __m256 scale = _mm256_set1_ps(inverse);
    for (int64_t e = 0; e < kChunk; e += 16) {         // rounded to nearest even; |v| * inverse <= kActivationMax
      const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + e), scale));
      const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + e + 8), scale));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + e0 + e),
                          _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xd8));
    }
#else
    for (int64_t e = 0; e < kChunk; ++e) q[e0 + e] = static_cast<int16_t>(std::nearbyint(v[e] * inverse));
#endif
  }
}

struct LinearScratch16 {
  std::vector<int16_t> tiles, row;
  std::vector<float> steps, edge;
};

// Rows [r0, r1) of out = (x W^T) + bias (act: then that activation), W int16 panels of depth kp, each column's step
// in w_step.
void linear_rows_int16(const float* x, int64_t k, const int16_t* w, int64_t kp, const float* w_step,
                       const float* bias, int64_t n, int32_t act, int64_t r0, int64_t r1, float* out,
                       LinearScratch16* s) {
  const int64_t rows = r1 - r0, tiles = (rows + kMaddRows - 1) / kMaddRows, panels = (n + kPanelCols - 1) / kPanelCols;
  const int64_t pairs = kp / 2, chunks = pairs / kChunkPairs;
  s->tiles.resize(tiles * kMaddRows * kp);
  s->row.resize(kp);
  s->steps.assign(tiles * chunks * kMaddRows, 1.f);
  s->edge.resize(kMaddRows * kPanelCols);
  // every row of the block quantized once, into its tile: (pairs, kMaddRows, 2), a pair one 32-bit word
  auto* words = reinterpret_cast<int32_t*>(s->tiles.data());
  const auto* row_words = reinterpret_cast<const int32_t*>(s->row.data());
  for (int64_t i = 0; i < tiles * kMaddRows; ++i) {
    const int64_t r = r0 + i, t = i / kMaddRows, at = i % kMaddRows;
    if (r < r1) {
      quantize_row(x + r * k, k, kp, s->row.data(), s->steps.data() + t * chunks * kMaddRows + at, kMaddRows);
    } else {
      std::fill(s->row.begin(), s->row.end(), int16_t{0});
    }
    int32_t* dst = words + t * pairs * kMaddRows + at;
    for (int64_t p = 0; p < pairs; ++p) dst[p * kMaddRows] = row_words[p];
  }
  float* edge = s->edge.data();
  for (int64_t p0 = 0; p0 < pairs; p0 += kPairBlock) {
    const int64_t block = std::min(kPairBlock, pairs - p0);
    const bool first = p0 == 0, last = p0 + block == pairs;
    for (int64_t j = 0; j < panels; ++j) {
      const int16_t* slice = w + (j * pairs + p0) * kPanelCols * 2;
      if (j + 1 < panels) {                               // the next panel's slice, on its way during this one's
        const char* next = reinterpret_cast<const char*>(slice + pairs * kPanelCols * 2);
        for (int64_t at = 0; at < block * kPanelCols * 2 * 2; at += 64) __builtin_prefetch(next + at, 0, 3);
      }
      const int64_t c0 = j * kPanelCols, cols = std::min(kPanelCols, n - c0);
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t row0 = r0 + t * kMaddRows, valid = std::min(kMaddRows, r1 - row0);
        for (int64_t i = 0; i < kMaddRows && row0 + kMaddRows + i < r1; ++i) {
          __builtin_prefetch(out + (row0 + kMaddRows + i) * n + c0, 1, 3);
          __builtin_prefetch(out + (row0 + kMaddRows + i) * n + c0 + kPanelCols - 1, 1, 3);
        }
        const int16_t* a = s->tiles.data() + (t * pairs + p0) * kMaddRows * 2;
        const float* steps = s->steps.data() + (t * chunks + p0 / kChunkPairs) * kMaddRows;
        const bool whole = valid == kMaddRows && cols == kPanelCols;
        float* c = whole ? out + row0 * n + c0 : edge;
        const int64_t ldc = whole ? n : kPanelCols;
        if (!whole && !first) {
          for (int64_t i = 0; i < valid; ++i) std::memcpy(edge + i * kPanelCols, out + (row0 + i) * n + c0, cols * 4);
        }
        madd_tile(a, 2 * kMaddRows, slice, 2 * kPanelCols, steps, kMaddRows, block / kChunkPairs, kChunkPairs, c, ldc,
                  first);
        if (last) {                                       // the columns' steps, the bias, the GELU: the tile is in L1
          for (int64_t i = 0; i < valid; ++i) {
            float* y = c + i * ldc;
            for (int64_t e = 0; e < cols; ++e) y[e] = y[e] * w_step[c0 + e] + bias[c0 + e];
            if (act != kNoActivation) activation_span(act, y, kOnes16, cols, y);
          }
        }
        if (!whole) {
          for (int64_t i = 0; i < valid; ++i) std::memcpy(out + (row0 + i) * n + c0, edge + i * kPanelCols, cols * 4);
        }
      }
    }
  }
}

#if defined(LLM_SERVING_AMX)
// ---- VisionLinear's float panels on AMX tiles (Sapphire Rapids and later) ----
//
// The same product as linear_rows, out = x W^T + bias (then fc1's GELU), on TDPBF16PS: each tile product is 16 x 16
// float32 sums of 32-long bfloat16 dot products (~16 times the multiply-adds of AVX-512's FMAs a cycle). Both
// operands are split into two bfloat16 pieces, v = v0 + v1 + (what is left): a stored float16 or bfloat16 weight
// is exactly w0 + w1 (11 bits of mantissa in two 8-bit pieces), x to 16 bits. Three piece products are summed in
// float32, x0 w1 + x0 w0 + x1 w0 (x1 w1 is below 2^-16 of each product and dropped): a product's error ~2^-17 of
// |x| |w|, about 6e-6 where the int16 panels' is 3e-4 of the largest and float32 FMA's 1e-7 (the product's
// float32 rounding is the same order as the int16 path's none: the gate's 0.5% is far).
//
// Operands: x is the A operand (rows of C are rows of out), a tile 16 rows of 32 consecutive k (its rows as they
// are, two pieces); W the B operand, a tile 16 pairs of k x the panel's 16 columns ([k/2][column][2]), converted
// from the stored panels once per call into a buffer of the calling thread (2 pieces x 2 bytes a weight: 20 MB at
// Gemma 3's fc1, kept between calls), so that the weights stay in memory as stored. Tasks of kAmxTaskRows rows of
// x: for each depth slice of kAmxSliceBlocks k blocks, the task's rows are split into pieces (256 x 1,152 x 4
// bytes: L2) and every 32-column panel pair's slice (L1) runs over them in 32 x 32 blocks of C held in four tiles.
// A row's sums run in one order (k blocks, then the three pieces, each slice's sums through out in float32),
// whatever the other rows, the tasks and the threads: its result does not depend on the batch.
namespace vamx = llm_serving::amx;
constexpr int64_t kAmxSliceBlocks = 36;     // k blocks (32 k) of a depth slice: 1,152 k
constexpr int64_t kAmxTaskRows = 256;
constexpr int64_t kAmxPieces = 2;
constexpr int64_t kAmxBlock = kAmxPieces * vamx::kTile;     // uint16 of a k block's pieces (one 16-row tile each)

// Whether VisionLinear's float panels and VisionAttention's float path run on AMX tiles: compiled for a CPU that
// has them, allowed (LLM_SERVING_KERNEL_AMX=0 in the environment, read once, or VisionAmx(0) turns it off) and
// granted by Linux (the tile data permission, asked once per process): gemm_amx.h's enabled, as for the decoder
// layer's products (product_routes_cpu.h).
std::atomic<int> amx_vision_setting{-1};          // -1: not read yet; 0 off; 1 on

bool vision_amx_enabled() { return vamx::enabled(amx_vision_setting); }

// An A operand's row: 32 consecutive k (the first `valid` of v, the rest zeros) as its P bfloat16 pieces, piece p's
// tile row at dst + p kTile
template <int P = kAmxPieces>
inline void a_row(const float* v, int64_t valid, uint16_t* dst) {
  __m512 lo, hi;
  if (valid >= 32) {
    lo = _mm512_loadu_ps(v);
    hi = _mm512_loadu_ps(v + 16);
  } else {
    const int n0 = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(16, valid)));
    const int n1 = static_cast<int>(std::max<int64_t>(0, valid - 16));
    lo = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n0) - 1), v);
    hi = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n1) - 1), v + 16);
  }
  for (int p = 0; p < P; ++p) _mm512_storeu_si512(dst + p * vamx::kTile, vamx::round_bf16(&lo, &hi));
}

// A B operand's k block: 32 rows of 16 floats (k = r at rows + r * stride) as its P piece tiles at out + p kTile,
// tile row q holding the 16 columns' pairs (k = 2 q, 2 q + 1) side by side
template <int P = kAmxPieces>
inline void b_tiles(const float* rows, int64_t stride, uint16_t* out) {
  alignas(64) static const uint16_t kInterleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i order = _mm512_load_si512(kInterleave);
  for (int q = 0; q < 16; ++q) {
    __m512 a = _mm512_loadu_ps(rows + 2 * q * stride), c = _mm512_loadu_ps(rows + (2 * q + 1) * stride);
    for (int p = 0; p < P; ++p) {
      _mm512_storeu_si512(out + p * vamx::kTile + q * 32, _mm512_permutexvar_epi16(order, vamx::round_bf16(&a, &c)));
    }
  }
}

// k block b of a panel (its k-major (k, 16) slice in the stored type) as the B operand's two piece tiles at out
template <typename W>
void convert_panel_block(const W* panel, int64_t k, int64_t b, uint16_t* out) {
  alignas(64) float buf[32 * kPanelCols];
  const int64_t valid = std::min<int64_t>(32, k - 32 * b) * kPanelCols;
  const float* rows = widened_panel(panel + 32 * b * kPanelCols, valid, buf);
  if (valid < 32 * kPanelCols) {                         // the last block of a depth not a multiple of 32: zeros
    if (rows != buf) std::memcpy(buf, rows, valid * sizeof(float));
    std::fill(buf + valid, buf + 32 * kPanelCols, 0.f);
    rows = buf;
  }
  b_tiles(rows, kPanelCols, out);
}

// Rows [r0, r1) of x, k blocks [b0, b1), as the A operand: row block rb's k block b's two piece tiles at
// xa + (rb * (b1 - b0) + b - b0) * kAmxBlock; rows past r1 and k past the depth zeros
void pack_rows_amx(const float* x, int64_t k, int64_t r0, int64_t r1, int64_t row_blocks, int64_t b0, int64_t b1,
                   uint16_t* xa) {
  const int64_t nb = b1 - b0;
  for (int64_t rb = 0; rb < row_blocks; ++rb) {
    for (int64_t i = 0; i < 16; ++i) {
      const int64_t r = r0 + rb * 16 + i;
      for (int64_t b = b0; b < b1; ++b) {
        a_row(r < r1 ? x + r * k + 32 * b : x, r < r1 ? k - 32 * b : 0, xa + (rb * nb + b - b0) * kAmxBlock + i * 32);
      }
    }
  }
}

// C (R row blocks x N panels of 16 x 16, R, N <= 2; stride ldc floats) over nb k blocks: tiles 0..3 C (r * 2 + n),
// 4..5 x's row blocks, 6..7 the panels. Per k block x0 w1, x0 w0, x1 w0 (x0 stays loaded for two). xa: the first
// row block's k block 0 (the second row_step further), wb: the first panel's (the second panel_step further).
// first: C starts at zero, else at what c holds (an earlier depth slice's sums).
template <int R, int N>
void amx_block(const uint16_t* xa, int64_t row_step, const uint16_t* wb, int64_t panel_step, int64_t nb, float* c,
               int64_t ldc, bool first) {
  const int64_t stride = ldc * 4;
#define LLM_SERVING_V_C(r, n, t, load)                                       \
  if (R > r && N > n) {                                                      \
    if (load) {                                                              \
      if (first) _tile_zero(t);                                              \
      else _tile_loadd(t, c + 16 * r * ldc + 16 * n, stride);               \
    } else {                                                                 \
      _tile_stored(t, c + 16 * r * ldc + 16 * n, stride);                   \
    }                                                                        \
  }
  LLM_SERVING_V_C(0, 0, 0, true) LLM_SERVING_V_C(0, 1, 1, true) LLM_SERVING_V_C(1, 0, 2, true)
  LLM_SERVING_V_C(1, 1, 3, true)
#define LLM_SERVING_V_DP()                                 \
  _tile_dpbf16ps(0, 4, 6);                                 \
  if (N > 1) _tile_dpbf16ps(1, 4, 7);                      \
  if (R > 1) _tile_dpbf16ps(2, 5, 6);                      \
  if (R > 1 && N > 1) _tile_dpbf16ps(3, 5, 7);
  for (int64_t b = 0; b < nb; ++b) {
    const uint16_t* a = xa + b * kAmxBlock;
    const uint16_t* w = wb + b * kAmxBlock;
    _tile_loadd(4, a, 64);                                                  // x0
    if (R > 1) _tile_loadd(5, a + row_step, 64);
    _tile_loadd(6, w + vamx::kTile, 64);                                    // w1
    if (N > 1) _tile_loadd(7, w + panel_step + vamx::kTile, 64);
    LLM_SERVING_V_DP()
    _tile_loadd(6, w, 64);                                                  // w0
    if (N > 1) _tile_loadd(7, w + panel_step, 64);
    LLM_SERVING_V_DP()
    _tile_loadd(4, a + vamx::kTile, 64);                                    // x1
    if (R > 1) _tile_loadd(5, a + row_step + vamx::kTile, 64);
    LLM_SERVING_V_DP()
  }
  LLM_SERVING_V_C(0, 0, 0, false) LLM_SERVING_V_C(0, 1, 1, false) LLM_SERVING_V_C(1, 0, 2, false)
  LLM_SERVING_V_C(1, 1, 3, false)
#undef LLM_SERVING_V_DP
#undef LLM_SERVING_V_C
}

// out (rows, n) = x W^T + bias (act: then that activation), W float panels (P, k, 16) in the stored type, on
// `threads` threads (the calling one included)
template <typename W>
void linear_amx(const float* x, int64_t rows, int64_t k, const W* w, const float* bias, int64_t n, int32_t act,
                int64_t threads, float* out) {
  const int64_t panels = (n + kPanelCols - 1) / kPanelCols, kb = (k + 31) / 32;
  thread_local std::vector<uint16_t> converted;          // (the calling thread's, kept: no page faults per call)
  converted.resize(panels * kb * kAmxBlock);
  uint16_t* wb = converted.data();
  for_each_task(threads, panels, 4, [&](int64_t j) {
    for (int64_t b = 0; b < kb; ++b) convert_panel_block(w + j * k * kPanelCols, k, b, wb + (j * kb + b) * kAmxBlock);
  });
  const int64_t tasks = (rows + kAmxTaskRows - 1) / kAmxTaskRows, panel_step = kb * kAmxBlock;
  std::atomic<int64_t> next{0};
  on_threads(std::min(threads, tasks), [&] {
    vamx::Tiles tiles;
    std::vector<uint16_t> xa(kAmxTaskRows / 16 * std::min(kb, kAmxSliceBlocks) * kAmxBlock);
    alignas(64) float edge[32 * 32];
    for (int64_t t = next.fetch_add(1); t < tasks; t = next.fetch_add(1)) {
      const int64_t r0 = t * kAmxTaskRows, r1 = std::min(rows, r0 + kAmxTaskRows), row_blocks = (r1 - r0 + 15) / 16;
      for (int64_t b0 = 0; b0 < kb; b0 += kAmxSliceBlocks) {
        const int64_t b1 = std::min(kb, b0 + kAmxSliceBlocks), nb = b1 - b0;
        const bool first = b0 == 0, last = b1 == kb;
        pack_rows_amx(x, k, r0, r1, row_blocks, b0, b1, xa.data());
        for (int64_t j = 0; j < panels; j += 2) {
          const int64_t c0 = j * kPanelCols, cols = std::min<int64_t>(32, n - c0);
          const uint16_t* wj = wb + (j * kb + b0) * kAmxBlock;
          const bool two_n = j + 1 < panels;
          for (int64_t rb = 0; rb < row_blocks; rb += 2) {
            const int64_t row0 = r0 + rb * 16, valid = std::min<int64_t>(32, r1 - row0);
            const bool two_r = rb + 1 < row_blocks, whole = valid == 32 && cols == 32;
            float* c = whole ? out + row0 * n + c0 : edge;
            const int64_t ldc = whole ? n : 32;
            if (!whole && !first) {
              for (int64_t i = 0; i < valid; ++i) std::memcpy(edge + i * 32, out + (row0 + i) * n + c0, cols * 4);
            }
            const uint16_t* xr = xa.data() + rb * nb * kAmxBlock;
            if (two_r && two_n) amx_block<2, 2>(xr, nb * kAmxBlock, wj, panel_step, nb, c, ldc, first);
            else if (two_r) amx_block<2, 1>(xr, nb * kAmxBlock, wj, panel_step, nb, c, ldc, first);
            else if (two_n) amx_block<1, 2>(xr, nb * kAmxBlock, wj, panel_step, nb, c, ldc, first);
            else amx_block<1, 1>(xr, nb * kAmxBlock, wj, panel_step, nb, c, ldc, first);
            if (last) {                                   // the bias and the GELU while the block is in L1
              for (int64_t i = 0; i < valid; ++i) {
                float* y = c + i * ldc;
                for (int64_t e = 0; e < cols; ++e) y[e] += bias[c0 + e];
                for (int64_t e = 0; act != kNoActivation && e < cols; e += 16) {     // (kOnes16: 16 columns a call)
                  activation_span(act, y + e, kOnes16, std::min<int64_t>(16, cols - e), y + e);
                }
              }
            }
            if (!whole) {
              for (int64_t i = 0; i < valid; ++i) std::memcpy(out + (row0 + i) * n + c0, edge + i * 32, cols * 4);
            }
          }
        }
      }
    }
  });
}

// ---- VisionAttention's float path on AMX tiles ----
//
// The float path's computation (attend_block: S^T = K Q^T a key block at a time, the online softmax down its key
// rows, O^T += V^T P^T), its two products on TDPBF16PS: K and V^T the A operands (packed once per head), Q^T and
// P^T the B operands (a query block's, and each key block's probabilities), S^T and O^T float32 in memory between
// the products, the softmax between them on AVX-512 as the float path runs it (online_softmax). The scores keep
// float32's precision (q and k in three pieces, the six piece products of gemm_amx.h's kernel: what is dropped is
// ~2^-24 of sum |q_e k_e|), since the softmax exponentiates a score's error; the values' product takes two pieces
// and three products (as linear_amx: ~2^-16 of sum p |v|, an error that does not grow with the scores). A query's
// sums run in one order whatever the other queries, images and threads.
constexpr int64_t kScoreBlock = vamx::kPieces * vamx::kTile;    // uint16 of a score operand's k block (3 pieces)
struct AmxHeadShape {
  int64_t kb, db, cb;        // q/k's depth in k blocks (hd rounded up to 32); V^T's 16-row blocks; the keys' k blocks
  int64_t k_codes, v_codes;  // uint16 of a head's packed K and V^T
  explicit AmxHeadShape(const Shape& sh)
      : kb((sh.hd + 31) / 32), db((sh.hd + 15) / 16), cb(sh.tp / 32), k_codes(sh.tp / 16 * kb * kScoreBlock),
        v_codes(db * cb * kAmxBlock) {}
};
static_assert(kKeyBlock % 32 == 0 && kQueries % 32 == 0, "a key block and a query block are whole tile pairs");

// Phase 1: image n's head h: its keys (bias added, rotated) as S^T's A operand in three pieces (key block kt of 16,
// depth block b: tiles at k + (kt * kb + b) * kScoreBlock) and its values transposed as O^T's in two (dims block dt
// of 16, keys block c of 32: at v + (dt * cb + c) * kAmxBlock); zeros past the keys and the dims. vt: tp x hd
// floats of scratch.
void pack_head_amx(const float* qkv, const float* bias, const Shape& sh, const AmxHeadShape& hs, int64_t n,
                   int64_t h, uint16_t* k, uint16_t* v, float* vt) {
  const int64_t stride = 3 * sh.d, keys = sh.keys_of(n);
  const float* rows = qkv + n * sh.t * stride + sh.d + h * sh.hd;
  const float* kbias = bias + sh.d + h * sh.hd;
  const float* vbias = kbias + sh.d;
  float key[kMaxHeadDims];
  for (int64_t j = 0; j < sh.tp; ++j) {
    const bool real = j < keys;
    if (real) head_values(rows + j * stride, kbias, sh, n * sh.t + j, key);
    for (int64_t b = 0; b < hs.kb; ++b) {
      a_row<vamx::kPieces>(key + 32 * b, real ? sh.hd - 32 * b : 0,
                           k + (j / 16 * hs.kb + b) * kScoreBlock + j % 16 * 32);
    }
    for (int64_t e = 0; e < sh.hd; ++e) vt[e * sh.tp + j] = real ? rows[j * stride + sh.d + e] + vbias[e] : 0.f;
  }
  for (int64_t e = 0; e < hs.db * 16; ++e) {
    for (int64_t c = 0; c < hs.cb; ++c) {
      a_row(e < sh.hd ? vt + e * sh.tp + 32 * c : vt, e < sh.hd ? 32 : 0,
            v + (e / 16 * hs.cb + c) * kAmxBlock + e % 16 * 32);
    }
  }
}

// Query blocks of kQueries a task runs together (512 queries): each key block's K and V^T tiles are read once for
// all of them (a head's packed K alone is 2.3 MB at Gemma 3's 4,096 patches: read per query block, K and V^T came
// from L3 every time)
constexpr int64_t kAmxQueryBlocks = 8;

struct AmxScratch {   // a thread's: S^T / P^T, Q^T, and each of its query blocks' O^T, maxima, sums and Q^T's pieces
  std::vector<float> qt, st, ot, mx, sum;
  std::vector<uint16_t> q, p;
  int64_t o_floats, q_codes;
  AmxScratch(const AmxHeadShape& hs)
      : qt(hs.kb * 32 * kQueries), st(kKeyBlock * kQueries), ot(kAmxQueryBlocks * hs.db * 16 * kQueries),
        mx(kAmxQueryBlocks * kQueries), sum(kAmxQueryBlocks * kQueries),
        q(kAmxQueryBlocks * kQueries / 16 * hs.kb * kScoreBlock), p(kQueries / 16 * (kKeyBlock / 32) * kAmxBlock),
        o_floats(hs.db * 16 * kQueries), q_codes(kQueries / 16 * hs.kb * kScoreBlock) {}
};

// Phase 2: image n, head h, query blocks i0 .. i0 + count kQueries (those past T computed on zeros, never written).
// The calling thread holds the tiles.
void attend_blocks_amx(const float* qkv, const float* bias, const uint16_t* k, const uint16_t* v, const Shape& sh,
                       const AmxHeadShape& hs, int64_t n, int64_t h, int64_t i0, int64_t count, float scale,
                       AmxScratch* w, float* out) {
  const int64_t stride = 3 * sh.d, qblocks = kQueries / 16;
  const int64_t kc = kKeyBlock / 32, q_step = hs.kb * kScoreBlock, p_step = kc * kAmxBlock;
  float query[kMaxHeadDims];
  for (int64_t s = 0; s < count; ++s) {              // each block's Q^T in pieces: query block qb, depth block b
    const int64_t first = i0 + s * kQueries, queries = std::min(kQueries, sh.t - first);
    std::fill(w->qt.begin(), w->qt.end(), 0.f);
    for (int64_t i = 0; i < queries; ++i) {
      head_values(qkv + (n * sh.t + first + i) * stride + h * sh.hd, bias + h * sh.hd, sh, n * sh.t + first + i,
                  query);
      for (int64_t e = 0; e < sh.hd; ++e) w->qt[e * kQueries + i] = query[e] * scale;
    }
    for (int64_t qb = 0; qb < qblocks; ++qb) {
      for (int64_t b = 0; b < hs.kb; ++b) {
        b_tiles<vamx::kPieces>(w->qt.data() + 32 * b * kQueries + 16 * qb, kQueries,
                               w->q.data() + s * w->q_codes + qb * q_step + b * kScoreBlock);
      }
    }
  }
  std::fill(w->ot.begin(), w->ot.begin() + count * w->o_floats, 0.f);
  std::fill(w->mx.begin(), w->mx.begin() + count * kQueries, -INFINITY);
  std::fill(w->sum.begin(), w->sum.begin() + count * kQueries, 0.f);
  float* st = w->st.data();
  for (int64_t j0 = 0; j0 < sh.tp; j0 += kKeyBlock) {
    const uint16_t* kj = k + j0 / 16 * q_step;
    const uint16_t* vj = v + j0 / 32 * kAmxBlock;
    for (int64_t s = 0; s < count; ++s) {
      const uint16_t* qs = w->q.data() + s * w->q_codes;
      float* ot = w->ot.data() + s * w->o_floats;
      for (int64_t kt = 0; kt < kKeyBlock / 16; kt += 2) {    // S^T = K Q^T, 32 keys x 32 queries a call
        for (int64_t qb = 0; qb < qblocks; qb += 2) {
          vamx::kernel<2, 2>(kj + kt * q_step, vamx::kTile, q_step, qs + qb * q_step, vamx::kTile, q_step, 0, hs.kb,
                             st + kt * 16 * kQueries + qb * 16, kQueries, true);
        }
      }
      alignas(64) float alpha[kQueries];
      online_softmax(st, sh.keys_of(n) - j0, w->mx.data() + s * kQueries, w->sum.data() + s * kQueries, alpha);
      rescale_rows(ot, hs.db * 16, alpha);
      for (int64_t qb = 0; qb < qblocks; ++qb) {      // P^T's pieces: query block qb, keys block c
        for (int64_t c = 0; c < kc; ++c) b_tiles(st + 32 * c * kQueries + 16 * qb, kQueries,
                                                 w->p.data() + qb * p_step + c * kAmxBlock);
      }
      for (int64_t dt = 0; dt < hs.db; dt += 2) {              // O^T += V^T P^T
        for (int64_t qb = 0; qb < qblocks; qb += 2) {
          float* c = ot + dt * 16 * kQueries + qb * 16;
          if (dt + 1 < hs.db) {
            amx_block<2, 2>(vj + dt * hs.cb * kAmxBlock, hs.cb * kAmxBlock, w->p.data() + qb * p_step, p_step, kc,
                            c, kQueries, false);
          } else {
            amx_block<1, 2>(vj + dt * hs.cb * kAmxBlock, hs.cb * kAmxBlock, w->p.data() + qb * p_step, p_step, kc,
                            c, kQueries, false);
          }
        }
      }
    }
  }
  for (int64_t s = 0; s < count; ++s) {
    const int64_t first = i0 + s * kQueries;
    write_queries(w->ot.data() + s * w->o_floats, w->sum.data() + s * kQueries, 1.f, sh, n, h, first,
                  std::min(kQueries, sh.t - first), out);
  }
}
#endif

}  // namespace

extern "C" int VisionAttention(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                               void* stream, void* extra) {
  (void)stream;
  (void)extra;
  const int o = nparam - 1;     // the output's index: 3, 4 after the rotary tables, 5 after the images' keys
  if (nparam < 4 || nparam > 6 || ndims[0] != 2 || ndims[1] != 1 || ndims[2] != 1 || ndims[o] != 2 ||
      std::strcmp(dtypes[0], "float32") != 0 || std::strcmp(dtypes[1], "float32") != 0 ||
      std::strcmp(dtypes[2], "int32") != 0 || std::strcmp(dtypes[o], "float32") != 0 ||
      (shapes[2][0] != 3 && shapes[2][0] != 4) ||
      (nparam >= 5 && (ndims[3] != 2 || std::strcmp(dtypes[3], "float32") != 0)) ||
      (nparam == 6 && (ndims[4] != 1 || std::strcmp(dtypes[4], "int32") != 0))) {
    return 1;
  }
  const auto* qkv = static_cast<const float*>(params[0]);
  const auto* bias = static_cast<const float*>(params[1]);
  const auto* cfg = static_cast<const int32_t*>(params[2]);
  const auto* rope = nparam >= 5 ? static_cast<const float*>(params[3]) : nullptr;
  const auto* keys = nparam == 6 ? static_cast<const int32_t*>(params[4]) : nullptr;
  auto* out = static_cast<float*>(params[o]);
  const int64_t t = cfg[0], h = cfg[1], threads = std::max<int32_t>(1, cfg[2]);
  const int64_t d = shapes[o][1];
  if (t < 1 || h < 1 || d % h != 0 || d / h > kMaxHeadDims || shapes[0][1] != 3 * d || shapes[1][0] != 3 * d ||
      shapes[0][0] % t != 0 || shapes[o][0] != shapes[0][0] ||
      (rope != nullptr && (shapes[3][0] != shapes[0][0] || shapes[3][1] != 2 * (d / h) || (d / h) % 2 != 0)) ||
      (keys != nullptr && shapes[4][0] != shapes[0][0] / t)) {
    return 2;
  }
  for (int64_t n = 0; keys != nullptr && n < shapes[0][0] / t; ++n) {
    if (keys[n] < 1 || keys[n] > t) return 2;
  }
  Shape sh{shapes[0][0] / t, t, h, d / h, d, round_up(t, kKeyBlock), rope, keys};
  const int64_t heads = sh.n * sh.h, blocks = (t + kQueries - 1) / kQueries;
  const float scale = 1.4426950408889634f / std::sqrt(static_cast<float>(sh.hd));   // scores in log2 units
  std::atomic<int64_t> next{0};
  const int32_t level = shapes[2][0] == 4 ? cfg[3] : 0;    // 0: float; 1: the values' product in int16; 2: both
  if (level < 0 || level > 2) return 2;
  if (level > 0 && padded_head_dims(sh.hd) <= kInt16HeadDims) {      // the int16 path
    const int64_t hdp = padded_head_dims(sh.hd), codes = sh.tp * hdp, floats = level == 1 ? sh.tp * sh.hd : 0;
    std::vector<int16_t> keys(level == 2 ? heads * codes : 0), values(heads * codes);
    std::vector<float> key_steps(heads * sh.tp), value_steps(heads * hdp), float_keys(heads * floats);
    for_each_task(threads, heads, 1, [&](int64_t i) {
      pack_head_int16(qkv, bias, sh, i / sh.h, i % sh.h, level == 2 ? keys.data() + i * codes : nullptr,
                      key_steps.data() + i * sh.tp, level == 1 ? float_keys.data() + i * floats : nullptr,
                      values.data() + i * codes, value_steps.data() + i * hdp);
    });
    on_threads(std::min(threads, heads * blocks), [&] {
      AttentionScratch16 w(sh);
      for (int64_t i = next.fetch_add(1); i < heads * blocks; i = next.fetch_add(1)) {
        const int64_t head = i / blocks;
        attend_block_int16(qkv, bias, level == 2 ? keys.data() + head * codes : nullptr,
                           key_steps.data() + head * sh.tp, level == 1 ? float_keys.data() + head * floats : nullptr,
                           values.data() + head * codes, value_steps.data() + head * hdp, sh, head / sh.h,
                           head % sh.h, i % blocks * kQueries, scale, &w, out);
      }
    });
    return 0;
  }
#if defined(LLM_SERVING_AMX)
  if (vision_amx_enabled()) {                                        // the float path on AMX tiles
    const AmxHeadShape hs(sh);
    const int64_t codes = hs.k_codes + hs.v_codes;
    std::vector<uint16_t> packed(static_cast<size_t>(heads * codes));
    on_threads(std::min(threads, heads), [&] {
      std::vector<float> vt(sh.tp * sh.hd);
      for (int64_t i = next.fetch_add(1); i < heads; i = next.fetch_add(1)) {
        uint16_t* kv = packed.data() + i * codes;
        pack_head_amx(qkv, bias, sh, hs, i / sh.h, i % sh.h, kv, kv + hs.k_codes, vt.data());
      }
    });
    next.store(0);
    const int64_t groups = (blocks + kAmxQueryBlocks - 1) / kAmxQueryBlocks;      // a task: up to 8 query blocks
    on_threads(std::min(threads, heads * groups), [&] {
      vamx::Tiles tiles;
      AmxScratch w(hs);
      for (int64_t i = next.fetch_add(1); i < heads * groups; i = next.fetch_add(1)) {
        const uint16_t* kv = packed.data() + i / groups * codes;
        const int64_t first = i % groups * kAmxQueryBlocks;
        attend_blocks_amx(qkv, bias, kv, kv + hs.k_codes, sh, hs, i / groups / sh.h, i / groups % sh.h,
                          first * kQueries, std::min(kAmxQueryBlocks, blocks - first), scale, &w, out);
      }
    });
    return 0;
  }
#endif
  const int64_t head_floats = 2 * sh.tp * sh.hd;
  std::vector<float> packed(static_cast<size_t>(heads * head_floats));
  for_each_task(threads, heads, 1, [&](int64_t i) {
    float* kv = packed.data() + i * head_floats;
    pack_head(qkv, bias, sh, i / sh.h, i % sh.h, kv, kv + sh.tp * sh.hd);
  });
  on_threads(std::min(threads, heads * blocks), [&] {
    Scratch w(sh);
    for (int64_t i = next.fetch_add(1); i < heads * blocks; i = next.fetch_add(1)) {
      const float* kv = packed.data() + i / blocks * head_floats;
      attend_block(qkv, bias, kv, kv + sh.tp * sh.hd, sh, i / blocks / sh.h, i / blocks % sh.h,
                   i % blocks * kQueries, scale, &w, out);
    }
  });
  return 0;
}

// VisionLinear: out = x W^T + bias, or an activation of it (fc1's: the tanh GELU, Qwen2-VL's quick GELU), W as the
// runner packed it (linear_rows, or linear_rows_int16 for int16 panels).
//   x       (R, K)      float32
//   w       (P, K, 16)  float16, bfloat16 or float32   the (N, K) matrix in panels of 16 output columns
//           (P, Kp, 16) int16                           or quantized, depth pairs side by side (Kp: K rounded up
//                                                       to 32)
//   bias    (N,)        float32
//           (2, N)      float32   with int16 panels: the bias, then each column's step
//   config  (2,)        int32     [threads, activation: kNoActivation (0), or layer_parts_cpu.h's kGeluTanh (1),
//                                  kGeluErf (2) or kQuickGelu (3)]
//   out     (R, N)      float32
// Tasks of at most kBlockRows rows spread over the threads (the calling one included).
extern "C" int VisionLinear(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                            void* stream, void* extra) {
  (void)stream;
  (void)extra;
  if (nparam != 5 || ndims[0] != 2 || ndims[1] != 3 || ndims[2] < 1 || ndims[2] > 2 || ndims[3] != 1 ||
      ndims[4] != 2 || std::strcmp(dtypes[0], "float32") != 0 || std::strcmp(dtypes[2], "float32") != 0 ||
      std::strcmp(dtypes[3], "int32") != 0 || std::strcmp(dtypes[4], "float32") != 0 || shapes[3][0] != 2) {
    return 1;
  }
  const bool int16 = std::strcmp(dtypes[1], "int16") == 0;
  const int64_t rows = shapes[0][0], k = shapes[0][1], n = shapes[2][ndims[2] - 1];
  const int64_t depth = int16 ? round_up(k, 2 * kChunkPairs) : k;
  if (shapes[1][0] != (n + kPanelCols - 1) / kPanelCols || shapes[1][1] != depth || shapes[1][2] != kPanelCols ||
      shapes[4][0] != rows || shapes[4][1] != n || ndims[2] != (int16 ? 2 : 1) || (int16 && shapes[2][0] != 2)) {
    return 2;
  }
  const auto* x = static_cast<const float*>(params[0]);
  const auto* bias = static_cast<const float*>(params[2]);
  const auto* cfg = static_cast<const int32_t*>(params[3]);
  auto* out = static_cast<float*>(params[4]);
  const int64_t threads = std::max<int32_t>(1, cfg[0]);
  const int32_t act = cfg[1];
  if (act < kNoActivation || act > kQuickGelu) return 3;
  // blocks of at most kBlockRows rows, as many as a multiple of the threads (15 blocks of 288 rows on two threads
  // left one idle for a block's time: 16 of 258)
  const int64_t tasks = round_up((rows + kBlockRows - 1) / kBlockRows, threads);
  const int64_t block = round_up((rows + tasks - 1) / tasks, kTileRows), blocks = (rows + block - 1) / block;
  auto run = [&](auto* w) {
#if defined(LLM_SERVING_AMX)
    if (vision_amx_enabled()) {
      linear_amx(x, rows, k, w, bias, n, act, threads, out);
      return;
    }
#endif
    std::atomic<int64_t> next{0};
    on_threads(std::min(threads, blocks), [&] {
      std::vector<float> scratch;
      for (int64_t b = next.fetch_add(1); b < blocks; b = next.fetch_add(1)) {
        linear_rows(x, k, w, bias, n, act, b * block, std::min(rows, (b + 1) * block), out, &scratch);
      }
    });
  };
  if (int16) {
    const auto* w = static_cast<const int16_t*>(params[1]);
    std::atomic<int64_t> next{0};
    on_threads(std::min(threads, blocks), [&] {
      LinearScratch16 scratch;
      for (int64_t b = next.fetch_add(1); b < blocks; b = next.fetch_add(1)) {
        linear_rows_int16(x, k, w, depth, bias + n, bias, n, act, b * block, std::min(rows, (b + 1) * block), out,
                          &scratch);
      }
    });
  } else if (std::strcmp(dtypes[1], "float32") == 0) {
    run(static_cast<const float*>(params[1]));
  } else if (std::strcmp(dtypes[1], "float16") == 0) {
    run(static_cast<const llm_serving::Half*>(params[1]));
  } else if (std::strcmp(dtypes[1], "bfloat16") == 0) {
    run(static_cast<const llm_serving::BFloat16*>(params[1]));
  } else {
    return 1;
  }
  return 0;
}

// VisionLayerNorm: out = (x - mean) / sqrt(var + eps) * gain + bias over each row, one pass to read it and one to
// write (MindSpore's composed LayerNorm made several over 4,096 x 1,152: 0.09 s of a layer, twice).
//   x       (R, D) float32
//   gain    (D,)   float32
//   bias    (D,)   float32
//   eps     (1,)   float32
//   config  (1,)   int32    [threads]
//   out     (R, D) float32
// The decoder layer's layer_normalize_row (layer_parts_cpu.h: the mean and variance in float64).
extern "C" int VisionLayerNorm(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                               void* stream, void* extra) {
  (void)stream;
  (void)extra;
  if (nparam != 6 || ndims[0] != 2 || ndims[1] != 1 || ndims[2] != 1 || ndims[3] != 1 || ndims[4] != 1 ||
      ndims[5] != 2 || std::strcmp(dtypes[4], "int32") != 0) {
    return 1;
  }
  for (int i : {0, 1, 2, 3, 5}) {
    if (std::strcmp(dtypes[i], "float32") != 0) return 1;
  }
  const int64_t rows = shapes[0][0], d = shapes[0][1];
  if (shapes[1][0] != d || shapes[2][0] != d || shapes[3][0] != 1 || shapes[4][0] != 1 || shapes[5][0] != rows ||
      shapes[5][1] != d) {
    return 2;
  }
  const auto* x = static_cast<const float*>(params[0]);
  const auto* gain = static_cast<const float*>(params[1]);
  const auto* bias = static_cast<const float*>(params[2]);
  const float eps = static_cast<const float*>(params[3])[0];
  const int64_t threads = std::max<int32_t>(1, static_cast<const int32_t*>(params[4])[0]);
  auto* out = static_cast<float*>(params[5]);
  for_each_task(threads, rows, 32, [&](int64_t r) { layer_normalize_row(x + r * d, d, eps, gain, bias, out + r * d); });
  return 0;
}

// 1 when VisionLinear's int16 panels run on a native loop (AVX2 without AVX-512: madd_6x16; AVX-512 VNNI:
// madd_6x16_vnni), where they beat the float panels; 0 where they run as plain C++ (correct, slower): the runner's
// 'auto' asks (vision_int16).
// VisionRmsNorm: out = x / sqrt(mean(x^2) + eps) * gain, row by row (Qwen2.5-VL's tower's norms; as MindSpore's ops
// 12 ms a norm at 4,480 x 1,280 on two Zen 5 cores).
//   x (R, D) float32, gain (D,) float32, eps (1,) float32, threads (1,) int32, out (R, D) float32
extern "C" int VisionRmsNorm(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                             void* stream, void* extra) {
  (void)stream;
  (void)extra;
  if (nparam != 5 || ndims[0] != 2 || ndims[1] != 1 || ndims[2] != 1 || ndims[3] != 1 || ndims[4] != 2 ||
      std::strcmp(dtypes[3], "int32") != 0) {
    return 1;
  }
  for (int i : {0, 1, 2, 4}) {
    if (std::strcmp(dtypes[i], "float32") != 0) return 1;
  }
  const int64_t rows = shapes[0][0], d = shapes[0][1];
  if (shapes[1][0] != d || shapes[2][0] != 1 || shapes[3][0] != 1 || shapes[4][0] != rows || shapes[4][1] != d) {
    return 2;
  }
  const auto* x = static_cast<const float*>(params[0]);
  const auto* gain = static_cast<const float*>(params[1]);
  const float eps = static_cast<const float*>(params[2])[0];
  const int64_t threads = std::max<int32_t>(1, static_cast<const int32_t*>(params[3])[0]);
  auto* out = static_cast<float*>(params[4]);
  for_each_task(threads, rows, 32, [&](int64_t r) {
    const float* row = x + r * d;
    float sum = 0.f;
    for (int64_t e = 0; e < d; ++e) sum += row[e] * row[e];
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(d) + eps);
    for (int64_t e = 0; e < d; ++e) out[r * d + e] = row[e] * inv * gain[e];
  });
  return 0;
}

// VisionGated: out = act(gate) * up of a gate|up product's rows (Qwen2.5-VL's SwiGLU: as MindSpore's ops 25 ms at
// 4,480 x 3,420 on two Zen 5 cores).
//   gate_up (R, 2 I) float32   each row's gate values, then its up values
//   config  (2,) int32         [threads, activation (layer_parts_cpu.h's: 0 SiLU, 1 GELU-tanh, 2 GELU-erf)]
//   out     (R, I) float32
extern "C" int VisionGated(int nparam, void** params, int* ndims, int64_t** shapes, const char** dtypes,
                           void* stream, void* extra) {
  (void)stream;
  (void)extra;
  if (nparam != 3 || ndims[0] != 2 || ndims[1] != 1 || ndims[2] != 2 || std::strcmp(dtypes[0], "float32") != 0 ||
      std::strcmp(dtypes[1], "int32") != 0 || std::strcmp(dtypes[2], "float32") != 0) {
    return 1;
  }
  const int64_t rows = shapes[0][0], inner = shapes[2][1];
  const auto* cfg = static_cast<const int32_t*>(params[1]);
  if (shapes[1][0] != 2 || shapes[0][1] != 2 * inner || shapes[2][0] != rows || cfg[1] < kSiLU || cfg[1] > kGeluErf) {
    return 2;
  }
  const auto* gu = static_cast<const float*>(params[0]);
  auto* out = static_cast<float*>(params[2]);
  for_each_task(std::max<int32_t>(1, cfg[0]), rows, 16, [&](int64_t r) {
    activation_span(cfg[1], gu + r * 2 * inner, gu + r * 2 * inner + inner, inner, out + r * inner);
  });
  return 0;
}

// Turns the AMX paths off (0) or back on (1; where the CPU and Linux allow it), or only asks (-1): returns whether
// the next VisionLinear call on float panels and VisionAttention call on its float path run on AMX tiles (the
// runner's vision_int16 'auto' keeps the float paths there; tests and benchmarks compare the paths in one process).
extern "C" int VisionAmx(int enable) {
#if defined(LLM_SERVING_AMX)
  if (enable >= 0) {
    vision_amx_enabled();                            // the environment read first, then overridden
    amx_vision_setting.store(enable > 0 ? 1 : 0);
  }
  return vision_amx_enabled() ? 1 : 0;
#else
  (void)enable;
  return 0;
#endif
}

extern "C" int VisionLinearInt16Native() {
#if defined(VISION_ASM_6X2) || defined(VISION_VNNI_6X16)
  return 1;
#else
  return 0;
#endif
}
