// How a product runs: the process's settings (AMX, batch invariance, the integer paths), the batched products
// (gemm_cpu.h's FMA kernel, AMX's tiles, the integer paths) and the route each product of a call takes by its rows.
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
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <unistd.h>
#include <vector>

#include "gemm_amx.h"
#include "gemm_amx_int.h"
#include "gemm_avx2_int.h"
#include "gemm_cpu.h"
#include "invariant_products_cpu.h"
#include "weight_matrix_cpu.h"

namespace {

namespace gemm = llm_serving::gemm;

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
// (LLM_SERVING_KERNEL_AMX=0 in the environment, read once, or decoder_layer_cpu.cc's KernelAmx(0) turn it off: the
// float32 FMA path of gemm_cpu.h, as on CPUs without AMX) and granted by Linux (the tile data permission, asked once
// per process: a forked child asks again). Asked once per kernel call by the calling thread.
std::atomic<int> amx_setting{-1};        // -1: not read yet; 0 off; 1 on

bool amx_enabled() {
#if defined(LLM_SERVING_AMX)
  return llm_serving::amx::enabled(amx_setting);
#else
  return false;
#endif
}

// Whether a step is batch-invariant: the call's iconfig says (the runner's model_config.batch_invariant); without that
// entry, this process setting (decoder_layer_cpu.cc's KernelInvariant; LLM_SERVING_KERNEL_INVARIANT=1 in the
// environment, read once), off by default. Invariant, a row's outputs are the same to the bit whatever else the step
// holds (other rows, how a prompt is chunked, decode, prefill or verify, the thread count's split of the work):
// products run dot_gemm or lane_units, or on integer codes gemm_avx2_int.h's products (invariant by construction),
// never qdot, matvec's tiles or the batched kernels whose sums run along k (gemm_cpu.h) or on AMX tiles; the activation
// runs activation_span; attention always runs attend_tile where the head size takes it (a token tree's row over its
// visible keys; a window's key tiles where they fall without one), attend_row otherwise, for every row alike. Not
// invariant, each product takes the fastest path for its row count.
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
// w[r] . x[b] to `to`, a tile of kTileRows weight rows at a time (out: kTileRows x m floats, wbuf: the tile's
// unpacked rows, both the calling thread's).
inline void int_rows(const Matrix& w, const float* xp, int64_t m, int64_t r0, int64_t r1, float* wbuf, float* out,
                     const Outputs& to) {
#if defined(LLM_SERVING_AVX2_INT)
  namespace ai = llm_serving::avx2_int;
  const int64_t tile = ai::tile_rows_of(w.type);
  for (int64_t r = r0; r < r1; r += tile) {
    const int64_t n = std::min(tile, r1 - r);
    ai::product(w.type, w.data + r * w.row_bytes, w.row_bytes, w.k, n, reinterpret_cast<const uint8_t*>(xp), m,
                reinterpret_cast<uint8_t*>(wbuf), out, m);
    to(r, n, 0, m, out, m, 1);
  }
#else
  (void)w, (void)xp, (void)m, (void)r0, (void)r1, (void)wbuf, (void)out, (void)to;
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
      return {m * ai::x_bytes(k) / 4, ai::buffer_bytes(k, m) / 4, ai::kPanelTileRows * ((m + 15) / 16 * 16)};
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
// (product_rows' routes, compiled once: see Outputs)
__attribute__((noinline)) void route_rows(Route route, const Matrix& w, const float* x, const float* xp,
                                          int64_t batch, int64_t r0, int64_t r1, float* tile, float* wbuf, float* c,
                                          bool amx, const Outputs& out, int ints) {
  switch (route) {
    case Route::kTiles: matvec(w, x, batch, r0, r1, tile, out); return;
    case Route::kDot: dot_gemm(w, x, batch, r0, r1, wbuf, c, out); return;
    case Route::kInt: int_rows(w, xp, batch, r0, r1, wbuf, c, out); return;
    case Route::kLanes: {
      const Matrix* ws[1] = {&w};
      lane_units(ws, 1, r0, r1, x, xp, batch, wbuf, c, [&](int64_t u, int64_t n, const float* cc, int64_t ldc) {
        out(u, n, 0, batch, cc, ldc, 1);
      });
      return;
    }
    case Route::kBatched: break;
  }
  const Matrix* ws[1] = {&w};
  gemm_units(ws, 1, r0, r1, xp, batch, wbuf, c, amx, [&](int64_t u, int64_t n, const float* cc, int64_t ldc) {
    out(u, n, 0, batch, cc, ldc, 1);
  }, ints);
}

template <typename Emit>
void product_rows(Route route, const Matrix& w, const float* x, const float* xp, int64_t batch, int64_t r0,
                  int64_t r1, float* tile, float* wbuf, float* c, bool amx, Emit emit, int ints = kNoInt) {
  route_rows(route, w, x, xp, batch, r0, r1, tile, wbuf, c, amx, outputs_of(emit), ints);
}

}  // namespace
