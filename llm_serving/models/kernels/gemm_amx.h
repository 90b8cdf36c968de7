// The batched matrix product of decoder_layer_cpu.cc on AMX tiles (Sapphire Rapids and later): C = W X^T for
// many rows of x, as gemm_cpu.h computes it with float32 FMAs, here with TDPBF16PS (16 x 16 float32 sums of
// 32-long bfloat16 dot products per instruction: ~3.4 TFLOP/s on one core here, against ~160 GFLOP/s of float32
// FMA peak).
//
// Precision (bf16x6): bfloat16 keeps 8 bits of mantissa, far too few for the products (the tests compare with
// float64 at 1e-4). Every float v is split into three bfloat16 pieces, v0 = bf16(v), v1 = bf16(v - v0), v2 =
// bf16(v - v0 - v1) (each difference exact in float32; 3 x 8 bits hold a float32's 24: v = v0 + v1 + v2 exactly),
// and each product is summed from the six piece products of order 2^-16 and above, w0x0 + w0x1 + w1x0 + w0x2 +
// w1x1 + w2x0, into float32 tiles: what is dropped is ~2^-24 of the product, so the result is float32's. Two
// pieces (bf16x3: w0x0 + w0x1 + w1x0) cost half as much but leave ~2^-17 of |w| |x| per product (measured
// 2^-18 against float32 FMA's 2^-22 on FinalLogits), and a layer's outputs then missed the float64 reference by
// up to 1e-2 (outputs of ~100, cancellations in the attention and the FFN): 20-50x float32's error.
//
// Operands: the weights are the A operand (rows of C), x the B operand (columns of C), so that a C tile is
// C[weight row][x row], the layout the products' `done` callbacks read, and the weights (converted a group at a
// time, every call) need no interleaving: an A tile is 16 rows of 32 consecutive k as bfloat16, a plain copy.
// x (packed once per product, shared by the threads) takes the B layout: a tile is 16 pairs of k (rows of 64
// bytes) x 16 rows of x, [k/2][n][2].
//
// Shapes: kb = ceil(k / 32) blocks of depth, x padded to rows16(m) = a multiple of 16 rows (zeros), k to kb * 32
// (zeros). Packed x: rows16(m) / 16 blocks of rows x kb blocks of k x 3 pieces, tiles of 512 bfloat16, [n block]
// [k block][piece][16][32] (a block of x rows' tiles contiguous along k, a k block's pieces side by side). A
// group's weights: [row block][k block][piece][16][32], rows16(g) / 16 row blocks (a depth slice's: its k blocks
// only). C (g rows, ldc = c_stride(m) floats per row).
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512F__)
#define LLM_SERVING_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace llm_serving {
namespace amx {

constexpr int64_t kTile = 512;          // bfloat16 per tile: 16 rows x 64 bytes

inline int64_t rows16(int64_t m) { return (m + 15) / 16 * 16; }
inline int64_t kblocks(int64_t k) { return (k + 31) / 32; }
// C's row stride in floats: rows16(m), plus 16 when that is an even number of cache lines, so that the 16 rows of
// a C tile do not share a few L1 sets (at m = 512 rows 2 KB apart fell into 2 sets: loading and storing the C
// tiles between depth blocks then cost as much as the products)
inline int64_t c_stride(int64_t m) { return rows16(m) / 16 % 2 == 0 ? rows16(m) + 16 : rows16(m); }
constexpr int kPieces = 3;
// the three bfloat16 pieces of a packed x, in floats (2 bytes each)
inline int64_t packed_floats(int64_t m, int64_t k) { return rows16(m) * kblocks(k) * 16 * kPieces; }
// a group's converted weights (three pieces), in floats
inline int64_t group_floats(int64_t g, int64_t k) { return rows16(g) * kblocks(k) * 16 * kPieces; }

// Asks Linux for the tile data state (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): without it the first tile
// instruction kills the process. The permission is the process's (all its threads); true when granted.
inline bool request_permission() {
  return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
}

// Whether a library's AMX path runs: its `setting` (-1: not read yet, then LLM_SERVING_KERNEL_AMX=0 in the
// environment turns it off; 0 off; 1 on, as a library's switch sets it) and Linux's tile permission, asked once per
// process (a forked child asks again).
inline bool enabled(std::atomic<int>& setting) {
  static std::atomic<pid_t> asked_by{-1};
  static std::atomic<bool> granted{false};
  if (setting.load(std::memory_order_relaxed) < 0) {
    const char* env = std::getenv("LLM_SERVING_KERNEL_AMX");
    int expected = -1;
    setting.compare_exchange_strong(expected, env != nullptr && std::strcmp(env, "0") == 0 ? 0 : 1);
  }
  if (setting.load(std::memory_order_relaxed) == 0) return false;
  const pid_t pid = getpid();
  if (asked_by.load(std::memory_order_acquire) != pid) {
    granted.store(request_permission(), std::memory_order_relaxed);
    asked_by.store(pid, std::memory_order_release);
  }
  return granted.load(std::memory_order_relaxed);
}

// Palette 1, all 8 tiles 16 rows x 64 bytes (the C tiles 16 x 16 float32, A and B tiles 16 x 32 bfloat16).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// Holds a tile configuration for its lifetime: the tiles are configured for one thread's part of one product
// and released after it, so that a thread idle between kernels (the pool's workers sleep there) carries no tile
// state (the kernel would save and restore 8 KB of it on every context switch).
template <typename Config>
struct ConfiguredTiles {
  ConfiguredTiles() {
    static const Config config;
    _tile_loadconfig(&config);
  }
  ~ConfiguredTiles() { _tile_release(); }
  ConfiguredTiles(const ConfiguredTiles&) = delete;
  ConfiguredTiles& operator=(const ConfiguredTiles&) = delete;
};
using Tiles = ConfiguredTiles<TileConfig>;

// 32 floats (a, b: 16 each) as their bfloat16 rounding (32 values in k order) and what remains of them
inline __m512i round_bf16(__m512* a, __m512* b) {
  const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(*b, *a);           // a -> low 16, b -> high 16 (round to nearest)
  // h back as float32: the bfloat16 bits in the top half of each float; the remainders are exact
  *a = _mm512_sub_ps(*a, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16)));
  *b = _mm512_sub_ps(*b, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16)));
  return h;
}

// 32 floats (a: the first 16, b: the rest) as their three bfloat16 pieces, in k order: piece p at out + p * piece
// (uint16 units)
inline void split_regs(__m512 a, __m512 b, uint16_t* out, int64_t piece) {
  for (int p = 0; p < kPieces; ++p) _mm512_storeu_si512(out + p * piece, round_bf16(&a, &b));
}

// 32 floats at v (only the first `valid`: the rest read as zero) as their three bfloat16 pieces, in k order:
// piece p at out + p * piece (uint16 units)
inline void split32(const float* v, int64_t valid, uint16_t* out, int64_t piece) {
  __m512 a, b;
  if (valid >= 32) {
    a = _mm512_loadu_ps(v);
    b = _mm512_loadu_ps(v + 16);
  } else {
    const int n0 = static_cast<int>(std::min<int64_t>(16, valid)), n1 = static_cast<int>(std::max<int64_t>(0, valid - 16));
    a = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n0) - 1), v);
    b = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n1) - 1), v + 16);
  }
  split_regs(a, b, out, piece);
}

// Packs the block of x rows nb (rows 16 nb .. 16 nb + 15 of m, stride ldx, k columns) into xp (packed_floats(m,
// k) floats, three pieces) in the B layout: element (row n, column t) at tile (nb, t / 32), row (t % 32) / 2, bytes
// 4n + 2 (t % 2). Rows past m are zeros.
inline void pack_block(const float* x, int64_t ldx, int64_t m, int64_t k, int64_t nb, float* xp) {
  const int64_t kb = kblocks(k);
  uint16_t* x0 = reinterpret_cast<uint16_t*>(xp) + nb * kb * kPieces * kTile;
  // a tile's 16 rows split in a local buffer (rows of x: 16 pairs of k each), then transposed pair by pair into
  // the tile (16 pairs x 16 rows): whole-line reads and writes, where scattering each row's pairs cost 2-3 ns a
  // value
  alignas(64) uint32_t split[kPieces][16][16];
  for (int64_t b = 0; b < kb; ++b) {
    for (int64_t n = 0; n < 16; ++n) {
      const int64_t row = nb * 16 + n;
      if (row < m) {
        split32(x + row * ldx + 32 * b, k - 32 * b, reinterpret_cast<uint16_t*>(split[0][n]), 16 * 16 * 2);
      } else {
        for (int p = 0; p < kPieces; ++p) std::memset(split[p][n], 0, 64);
      }
    }
    for (int p = 0; p < kPieces; ++p) {
      uint32_t* tile = reinterpret_cast<uint32_t*>(x0 + (b * kPieces + p) * kTile);
      for (int pair = 0; pair < 16; ++pair)
        for (int n = 0; n < 16; ++n) tile[pair * 16 + n] = split[p][n][pair];
    }
  }
}

// Row i (< rows16(g)) of a group's A operand (wg: group_floats(g, k) floats, three pieces) from the float row w
// (k values; null: a padding row of zeros).
inline void convert_row(const float* w, int64_t k, int64_t g, int64_t i, float* wg) {
  const int64_t kb = kblocks(k);
  uint16_t* w0 = reinterpret_cast<uint16_t*>(wg) + (i / 16) * kb * kPieces * kTile + (i % 16) * 32;
  for (int64_t b = 0; b < kb; ++b) {
    if (w != nullptr) {
      split32(w + 32 * b, k - 32 * b, w0 + b * kPieces * kTile, kTile);
    } else {
      for (int p = 0; p < kPieces; ++p) std::memset(w0 + (b * kPieces + p) * kTile, 0, 64);
    }
  }
}

// C tiles (R weight blocks x N x blocks, R, N <= 2) over k blocks [b0, b1): tiles 0..3 are C (r * 2 + n), 4..5
// A (weight blocks), 6..7 B (x blocks). Per k block the six piece products w0x0, w0x1, w0x2, w1x1, w1x0, w2x0,
// ordered so that one operand stays loaded between them: 16 tile loads for 24 products at 2x2 (8 tiles cannot
// hold six operands and four sums). a, b: piece 0 of the first block's tiles, the pieces a_piece / b_piece and
// the blocks a_block / b_block apart (uint16 units). first: the sums start at zero, otherwise at what C holds
// (an earlier depth block's).
// a_first: the k block a's first tiles hold (a slice of the weights' depth; b always starts at block 0).
template <int R, int N>
inline void kernel(const uint16_t* a, int64_t a_piece, int64_t a_block, const uint16_t* b, int64_t b_piece,
                   int64_t b_block, int64_t b0, int64_t b1, float* c, int64_t ldc, bool first, int64_t a_first = 0) {
  const int64_t stride = ldc * 4;
  // (the tile intrinsics take their tile numbers as literal tokens: t is r * 2 + n written out)
#define LLM_SERVING_C_TILE(r, n, t, op)                                    \
  if (R > r && N > n) {                                                    \
    if (op == 0) {                                                         \
      if (first) _tile_zero(t);                                            \
      else _tile_loadd(t, c + (16 * r) * ldc + 16 * n, stride);           \
    } else {                                                               \
      _tile_stored(t, c + (16 * r) * ldc + 16 * n, stride);               \
    }                                                                      \
  }
  LLM_SERVING_C_TILE(0, 0, 0, 0) LLM_SERVING_C_TILE(0, 1, 1, 0) LLM_SERVING_C_TILE(1, 0, 2, 0)
  LLM_SERVING_C_TILE(1, 1, 3, 0)
#define LLM_SERVING_LOAD_A(p)                                    \
  _tile_loadd(4, a + (p) * a_piece + at_a, 64);                    \
  if (R > 1) _tile_loadd(5, a + (p) * a_piece + a_block + at_a, 64);
#define LLM_SERVING_LOAD_B(p)                                    \
  _tile_loadd(6, b + (p) * b_piece + at, 64);                    \
  if (N > 1) _tile_loadd(7, b + (p) * b_piece + b_block + at, 64);
#define LLM_SERVING_DP()                                   \
  _tile_dpbf16ps(0, 4, 6);                                 \
  if (N > 1) _tile_dpbf16ps(1, 4, 7);                      \
  if (R > 1) _tile_dpbf16ps(2, 5, 6);                      \
  if (R > 1 && N > 1) _tile_dpbf16ps(3, 5, 7);
  for (int64_t blk = b0; blk < b1; ++blk) {
    const int64_t at = blk * kPieces * kTile, at_a = (blk - a_first) * kPieces * kTile;
    LLM_SERVING_LOAD_A(0) LLM_SERVING_LOAD_B(0) LLM_SERVING_DP()      // w0 x0
    LLM_SERVING_LOAD_B(1) LLM_SERVING_DP()                            // w0 x1
    LLM_SERVING_LOAD_B(2) LLM_SERVING_DP()                            // w0 x2
    LLM_SERVING_LOAD_A(1) LLM_SERVING_LOAD_B(1) LLM_SERVING_DP()      // w1 x1
    LLM_SERVING_LOAD_B(0) LLM_SERVING_DP()                            // w1 x0
    LLM_SERVING_LOAD_A(2) LLM_SERVING_DP()                            // w2 x0
  }
  LLM_SERVING_C_TILE(0, 0, 0, 1) LLM_SERVING_C_TILE(0, 1, 1, 1) LLM_SERVING_C_TILE(1, 0, 2, 1)
  LLM_SERVING_C_TILE(1, 1, 3, 1)
#undef LLM_SERVING_DP
#undef LLM_SERVING_LOAD_B
#undef LLM_SERVING_LOAD_A
#undef LLM_SERVING_C_TILE
}

// Blocking: the group's weights (A: 64 rows x depth) and a slab of 64 rows of x (B: 64 x depth), 6 bytes a
// value (three pieces), stay in L2 (2 MB a core) while every (row pair, x pair) of 2x2 tiles runs the kernel
// along the whole depth block: depth up to 64 k blocks (2048 k, 768 KB each), so that a kernel call is long
// (1536 products at 2x2: its C loads, stores and the pipeline's drain at the end are a small part of it) and
// the slab is read from L3 once per group of weight rows. (Depth blocks of 8 with all of x per block ran at
// half the rate: short streams, and C through memory every 192 products.) The blocking depends on k only, and
// the sums go through C in float32 between depth blocks: the results do not depend on it, nor on the thread.
constexpr int64_t kDepthBlocks = 64;
constexpr int64_t kSlabBlocks = 4;       // 16-row blocks of x per slab

// C (g rows, ldc = c_stride(m)) = the group's converted rows (wg, g rows, k) times the packed x (m rows).
// The caller holds Tiles.
inline void product(const float* wg, int64_t g, const float* xp, int64_t m, int64_t k, float* c) {
  const int64_t kb = kblocks(k), mb = rows16(m) / 16, gb = rows16(g) / 16, ldc = c_stride(m);
  const uint16_t* w = reinterpret_cast<const uint16_t*>(wg);
  const uint16_t* x = reinterpret_cast<const uint16_t*>(xp);
  const int64_t block = kb * kPieces * kTile;
  for (int64_t b0 = 0; b0 < kb; b0 += kDepthBlocks) {
    const int64_t b1 = std::min(kb, b0 + kDepthBlocks);
    for (int64_t s0 = 0; s0 < mb; s0 += kSlabBlocks) {
      const int64_t s1 = std::min(mb, s0 + kSlabBlocks);
      for (int64_t r = 0; r < gb; r += 2) {
        const bool two_r = r + 1 < gb;
        for (int64_t n = s0; n < s1; n += 2) {
          const bool two_n = n + 1 < s1;
          const uint16_t *wr = w + r * block, *xn = x + n * block;
          float* cc = c + 16 * r * ldc + 16 * n;
          if (two_r && two_n) kernel<2, 2>(wr, kTile, block, xn, kTile, block, b0, b1, cc, ldc, b0 == 0);
          else if (two_r) kernel<2, 1>(wr, kTile, block, xn, kTile, block, b0, b1, cc, ldc, b0 == 0);
          else if (two_n) kernel<1, 2>(wr, kTile, block, xn, kTile, block, b0, b1, cc, ldc, b0 == 0);
          else kernel<1, 1>(wr, kTile, block, xn, kTile, block, b0, b1, cc, ldc, b0 == 0);
        }
      }
    }
  }
}

// Up to kSliceRows rows of x (decode batches, verify steps, short prefills): the weights are split a depth slice
// at a time (kSliceBlocks k blocks of the group's rows, 96 KB, into a buffer that stays near the core) and
// multiplied at once, instead of all of the group's depth first (786 KB at k = 2048, written to L2 and read back:
// 0.32 ns a weight against 0.13, the most of a decode batch's time: a 16-row Q8_0 layer 18.9 -> 13.3 ms on 2
// threads). Past ~128 rows the split is a small part and x's slice for all rows (m x 256 x 6 bytes) no longer
// stays in L2 beside it: the whole-depth product() is faster there (512 rows: 0.97x sliced; 96-128 rows 1.11x). C (g rows, c_stride(m)) += the slice [b0, b1) (ws: its A operand, row
// blocks (b1 - b0) * 3 tiles apart) times x's k blocks [b0, b1); first: b0 == 0. The caller holds Tiles. The
// sums go through C in float32 between slices: the same results as product().
constexpr int64_t kSliceBlocks = 8;        // 256 k: a super-block of the K-quants
constexpr int64_t kSliceRows = 128;
inline int64_t slice_floats(int64_t g) { return rows16(g) * kSliceBlocks * 16 * kPieces; }

inline void product_slice(const uint16_t* ws, int64_t g, const float* xp, int64_t m, int64_t k, int64_t b0,
                          int64_t b1, float* c) {
  const int64_t kb = kblocks(k), mb = rows16(m) / 16, gb = rows16(g) / 16, ldc = c_stride(m);
  const uint16_t* x = reinterpret_cast<const uint16_t*>(xp);
  const int64_t block = kb * kPieces * kTile, a_block = (b1 - b0) * kPieces * kTile;
  for (int64_t r = 0; r < gb; r += 2) {
    const bool two_r = r + 1 < gb;
    for (int64_t n = 0; n < mb; n += 2) {
      const bool two_n = n + 1 < mb;
      const uint16_t *wr = ws + r * a_block, *xn = x + n * block;
      float* cc = c + 16 * r * ldc + 16 * n;
      if (two_r && two_n) kernel<2, 2>(wr, kTile, a_block, xn, kTile, block, b0, b1, cc, ldc, b0 == 0, b0);
      else if (two_r) kernel<2, 1>(wr, kTile, a_block, xn, kTile, block, b0, b1, cc, ldc, b0 == 0, b0);
      else if (two_n) kernel<1, 2>(wr, kTile, a_block, xn, kTile, block, b0, b1, cc, ldc, b0 == 0, b0);
      else kernel<1, 1>(wr, kTile, a_block, xn, kTile, block, b0, b1, cc, ldc, b0 == 0, b0);
    }
  }
}

}  // namespace amx
}  // namespace llm_serving

#endif
