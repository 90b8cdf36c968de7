// decoder_layer_cpu.cc's products on weights of integer codes (GGUF's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
// Q6_K, and MXFP4: its E2M1 codes doubled are the integers 0, +-1, .., +-12, its E8M0 scale a power of two) with AVX2's integer multiply-adds, at every row count, batch-invariant by construction: an output is the
// same float whether its row of x is alone in the call or among hundreds, wherever it sits, on any thread.
//
// Why: dequantizing the codes to float32 and running float FMAs (the other paths, without AMX) was ~10x slower
// than llama.cpp on a Zen 3 (a Q4_K layer at 0.7 GB/s at one row: the decoders and FMAs, not memory, bound it).
// Here the codes stay integers: as int16 they are multiplied with _mm256_madd_epi16 against x rounded to int16,
// each block's sum exact in int32, and only then scaled in float32.
//
// Rounding of x (pack_rows): each row of x per block of 32 values, x = sx n with sx = max |x| / 32512 and n an
// int16 (|n| <= 32512), rounded to nearest even, as gemm_amx_int.h rounds it per block of 32 (the tests' float64
// reference rounds the same way). Per block of 32 for every type, the K-quants too (their sub-blocks are 32 or
// 16 wide): the rounding depends on x alone, so one packed x serves a product whose parts have different types
// (a Q4_K_M layer's q/k Q4_K and v Q6_K), and it is finer than gemm_amx_int.h's 256 for the K-quants.
// Why 16 bits, not llama.cpp's 8 (which would let _mm256_maddubs_epi16 do 32 products an instruction, twice
// these): x rounded to 8 bits per block of 32 put SmolLM2-135M's logits 3.8% from the float64 reference, against
// the precision gate's 0.5% (docs/benchmarks/JOURNAL.md, issue 49's third session).
// Exactness: a block's sum of code x n is at most 32 x 128 x 32512 = 1.3e8 (Q8_0) in int32; Q6_K's 16-weight
// sub-blocks (their own int8 scales, not folded into the codes) are summed apart, at most 16 x 32 x 32512. Codes
// with an offset inside (Q4_0's q - 8, Q5_0's q - 16, Q6_K's q - 32) are multiplied as q, and bias x sum(n) is
// taken off the sum (the same integer). So every block's integer sum T is exact, whatever order the
// instructions add it in.
//
// The float epilogue, one order for every output whatever the path: the weights go 256 at a time (a group: a
// K-quant super-block, or 8 blocks of 32; a row's last group may have fewer blocks, the rest zeros), and a group's
// 8 block sums T (lane j: block j of the group; Q6_K: TA, TB of the first and second 16 of each block) are scaled
// as 8 lanes:
//     acc = fma(float(T), sx * a, acc)                   a: the block's scale (d; K-quants d * sc[j])
//     Q6_K: acc = fma(float(TB), sx * b, acc)            b: the second 16's scale d * sc[2j + 1] (a: sc[2j])
//     offsets (Q4_1, Q5_1: + m; Q4_K, Q5_K: - dmin m[j]): acc = fma(b, xs, acc), xs = sx * sum(n) of the block
// with acc starting at zero and the groups in k order, and the output is sum8(acc): ((l0 + l4) + (l2 + l6)) +
// ((l1 + l5) + (l3 + l7)). Nothing there depends on the other rows of x, the tile an output fell in or the thread
// that took it, and gemm_avx2_int.cc is compiled without -fassociative-math (its pragma), so that GCC keeps these
// sums in the order written.
//
// Two ways to the same T (product, called by whichever thread claimed a tile of kTileRows weight rows:
// thread_pool_cpu.h's claim_rows splits each product's output rows among the pool's threads):
//   - up to kFusedRows rows of x (decode: memory-bound, every weight byte read once per call), each weight row is
//     decoded a group at a time in registers and used at once; a block's products land in the 8 lanes of one
//     vector and are summed across lanes (halves): x and the codes in the "natural" layout below.
//   - more rows, the tile's rows are unpacked once into the thread's buffer and multiplied by every row of x,
//     kRB weight rows x kBB rows of x in registers, a depth block of kDepthGroups groups at a time (the x rows'
//     slice stays in L1 while the weight rows pass): codes and x in the "lanes" layout, lane j of every vector
//     holding block j, so that each block's sum accumulates in one lane with no reduction across lanes.
// Rows repacked at load (gemm_avx2_int.cc's row-interleaved layout: 8 rows a panel) take a third way, at every row
// count: 8 rows' block sums a vector, or on AVX-512 VNNI builds two panels' 16 a 512-bit vector; the same T and
// the same epilogue, lane by lane.
//
// Layouts (per group, 32-byte aligned when the buffer is). Natural: per block of 32, a vector of its 16 even
// weights (0, 2, .., 30) then one of its 16 odd ones, as int16 (a 16-bit lane of the stored bytes holds weights 2i
// and 2i + 1, so shifts and masks in place split them: no widening across 128-bit halves). Lanes: the same 16
// vectors transposed (store_lanes). A packed row of x is [n: 16 vectors][sx: 8 floats][xs: 8 floats][sums of n
// over each block's first and second 16: 8 + 8 int32] (640 bytes), an unpacked weight row [codes][a: 8][b: 8]
// (576 bytes).
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LLM_SERVING_AVX2_INT 1

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "weight_types.h"

// Hidden: a process may load two builds of the library (the tests load the AVX2 build beside the native one), and
// each build's calls must reach its own definitions, never the other's of the same name
#pragma GCC visibility push(hidden)

namespace llm_serving {
namespace avx2_int {

// The types' codes and blocks (weight_types.h); the repacked ones (k<name>_R8, below: "row-interleaved layout")
// only product() reads
using namespace llm_serving::weight_types;

// The stored types these products read, and those repack_rows repacks (the one list of each)
constexpr bool integer_type(int32_t type) {
  return type == kQ4_0 || type == kQ4_1 || type == kQ5_0 || type == kQ5_1 || type == kQ8_0 || type == kQ4_K ||
         type == kQ5_K || type == kQ6_K || type == kMXFP4;
}
constexpr bool repackable(int32_t type) {
  return type == kQ4_K || type == kQ6_K || type == kQ8_0 || type == kQ4_0 || type == kQ4_1;
}

constexpr int64_t kGroup = 256;            // weights per group
static_assert(kGroup == kRepackGroup, "a repacked row is whole groups");
constexpr int64_t kXRecord = 640;          // bytes of a group of x: 512 of int16, 8 + 8 floats, 8 + 8 int32
constexpr int64_t kXFloats = 512;          // where its floats start
constexpr int64_t kWRecord = 576;          // bytes of an unpacked weight group: 512 of int16, 8 + 8 floats
constexpr int64_t kWFloats = 512;
constexpr float kRange = 32512.f;          // |n| at most this (as gemm_amx_int.h)
constexpr int64_t kFusedRows = 2;          // up to this many rows of x, weights decoded in registers per use
constexpr int64_t kTileRows = 16;          // weight rows per product() call (the claim_rows unit)
// Repacked rows per product() call (panels read in place: no buffer): each pass of rows of x then serves this
// many weight rows while it is in L1, where a tile of 16 re-read all of x (a prefill's 275 rows at k = 2560: 1.8
// MB, beyond L2) for every 16 weight rows
constexpr int64_t kPanelTileRows = 128;
inline int64_t tile_rows_of(int32_t type) { return is_repacked(type) ? kPanelTileRows : kTileRows; }
constexpr int kRB = 2, kBB = 4;            // unpacked path: weight rows x rows of x per register tile
constexpr int64_t kDepthGroups = 4;        // unpacked path: groups per depth block (kBB rows of x: 10 KB)

inline int64_t groups(int64_t k) { return (k + kGroup - 1) / kGroup; }
inline int64_t x_bytes(int64_t k) { return groups(k) * kXRecord; }   // a packed row of x of k values
inline int64_t w_bytes(int64_t k) { return groups(k) * kWRecord; }   // an unpacked weight row
// a thread's buffer for product(): a tile's unpacked rows, then their running sums (8 floats per output)
inline int64_t buffer_bytes(int64_t k, int64_t m) { return kTileRows * (w_bytes(k) + m * 32); }

// How a type's group is scaled (the epilogue above): plain (a), with offsets (a, then b xs), or split in 16s
// (Q6_K: a on the first 16 of each block, b on the second)
enum Kind : int { kPlain = 0, kOffset = 1, kSplit = 2 };
constexpr int kind_of(int32_t type) {
  return type == kQ4_1 || type == kQ5_1 || type == kQ4_K || type == kQ5_K ? kOffset : type == kQ6_K ? kSplit : kPlain;
}

// ---- defined in gemm_avx2_int.cc, compiled beside decoder_layer_cpu.cc (on other cores) and linked into the same
// library: once as it is (the entry points below, and the table of the types linked), and once more for each type
// the library reads (-DLLM_SERVING_INT_TYPE=<its code>: that type's products, repacking and rows read back,
// entered into the table when the library loads). A library links the units of its model's types only
// (kernels/__init__.py: a Q4_1 model's compiles in a fifth of the time of all nine types').

// Whether this library reads `type` (a stored or repacked type): integer_type, and its unit linked
bool reads(int32_t type);

// A type's entry points, as its unit enters them in the table (repack, stored_row, product_repacked: nullptr
// for a type not repacked)
struct TypeOps {
  void (*product)(const uint8_t* rows, int64_t row_bytes, int64_t k, int64_t n, const uint8_t* xp, int64_t m,
                  uint8_t* wbuf, float* out, int64_t ldo);
  void (*product_repacked)(const uint8_t* rows, int64_t row_bytes, int64_t k, int64_t n, const uint8_t* xp,
                           int64_t m, uint8_t* wbuf, float* out, int64_t ldo);
  void (*repack)(const uint8_t* src, int64_t rows, int64_t k, uint8_t* dst);
  void (*stored_row)(const uint8_t* rows, int64_t row_bytes, int64_t k, int64_t r, uint8_t* out);
};
// Enters a type's unit in the table (its static initializer, when the library loads); true
bool enter_type(int32_t type, const TypeOps& ops);

// Rows [b0, b1) of m rows of x (stride ldx floats, k values, k a multiple of 32) into xp: row b at xp + b *
// x_bytes(k), a record per group: [n: per block of 32, its 16 even then 16 odd values (int16); for more rows than
// kFusedRows in the lanes layout][sx: 8 floats][xs = sx sum(n): 8 floats][sum of n over each block's first 16,
// then second 16: 8 + 8 int32]; past the row's last block, zeros.
void pack_rows(const float* x, int64_t ldx, int64_t k, int64_t m, int64_t b0, int64_t b1, uint8_t* xp);

// out[i * ldo + b] = weight row i . x row b for i < n (<= tile_rows_of(type)) weight rows of `type` (reads(type))
// at rows, row_bytes apart, k wide, and b < m rows of x packed by pack_rows. wbuf: buffer_bytes(k, m), the calling
// thread's (32-byte aligned), for m > kFusedRows.
void product(int32_t type, const uint8_t* rows, int64_t row_bytes, int64_t k, int64_t n, const uint8_t* xp,
             int64_t m, uint8_t* wbuf, float* out, int64_t ldo);

// What repack_rows makes of `type`, or 0: the types it repacks (Q4_K, Q6_K, Q8_0, Q4_0, Q4_1), rows a multiple
// of 8, k of whole groups (a row of blocks of 32 whose last group is short stays as stored)
int32_t repacked_type(int32_t type, int64_t rows, int64_t k);

// rows x k stored rows of `type` (src) into panels of 8 rows (dst, as many bytes): the row-interleaved layout
// that product() reads as repacked_type(type); once, at load
void repack_rows(int32_t type, const uint8_t* src, int64_t rows, int64_t k, uint8_t* dst);

// Row r of rows repacked by repack_rows back as its stored bytes (out); type: a repacked type (repacked_type's),
// k a multiple of kGroup
void stored_row(int32_t type, const uint8_t* rows, int64_t row_bytes, int64_t k, int64_t r, uint8_t* out);

}  // namespace avx2_int
}  // namespace llm_serving

#pragma GCC visibility pop

#endif
