// The weight types the CPU kernels read, described once: each type's code, its block (weights and bytes) and
// whether this library repacks its rows at load. decoder_layer_cpu.cc's parts (weight_formats_cpu.h: a row's
// bytes, the decoders' block strides) and gemm_avx2_int.h (its groups and panels) take their numbers from here, and
// the library exports the table as text (WeightTypes()), from which kernels/repack.py learns what it may repack
// and against which a test holds models/weights/gguf.py's KEPT_QUANTIZED.
//
// LLM_SERVING_WEIGHT_TYPES(T): T(name, code, block weights, block bytes, repacked) per type
//   name      GGML's; the enum below names the type k<name>
//   code      GGML's number for it, as a GGUF file and the kernels' iconfig carry it
//   block     weights per block: 32, or 256 for the K-quants' super-blocks (sub-blocks of 32 or 16 with their own
//             quantized scales); 1 for F32/F16/BF16, whose rows are any length
//   bytes     bytes per block
//   repacked  R8: rows of a multiple of 8 with whole groups of 256 weights may be repacked at load
//             (gemm_avx2_int.h: 8 rows interleaved, the same bytes in another order) into the type
//             k<name>_R8 = code + kRepacked, which only gemm_avx2_int.h's products read; NONE: kept as stored
#pragma once

#define LLM_SERVING_WEIGHT_TYPES(T)                                                                               \
  T(F32, 0, 1, 4, NONE)                                                                                          \
  T(F16, 1, 1, 2, NONE)                                                                                          \
  T(BF16, 30, 1, 2, NONE)                                                                                        \
  T(Q4_0, 2, 32, 18, R8)      /* f16 scale, 16 bytes of nibbles */                                             \
  T(Q4_1, 3, 32, 20, R8)      /* f16 scale, f16 minimum, 16 bytes of nibbles */                                \
  T(Q5_0, 6, 32, 22, NONE)    /* f16 scale, 4 bytes of fifth bits, 16 bytes of nibbles */                      \
  T(Q5_1, 7, 32, 24, NONE)    /* f16 scale, f16 minimum, fifth bits, nibbles */                                \
  T(Q8_0, 8, 32, 34, R8)      /* f16 scale, 32 signed bytes */                                                 \
  T(Q4_K, 12, 256, 144, R8)   /* f16 d, f16 dmin, 12 bytes of 6-bit scales and minimums, 128 of nibbles */     \
  T(Q5_K, 13, 256, 176, NONE) /* as Q4_K, plus 32 bytes of fifth bits before the nibbles */                    \
  T(Q6_K, 14, 256, 210, R8)   /* 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, f16 d */         \
  T(MXFP4, 39, 32, 17, NONE)  /* E8M0 scale byte, 16 bytes of E2M1 nibbles */

#include <cstdint>
#include <string>

namespace llm_serving {
namespace weight_types {

constexpr int32_t kRepacked = 100;     // a repacked type's code: its stored type's + this
constexpr int64_t kRepackGroup = 256;  // a repacked row is whole groups of this many (gemm_avx2_int.h's kGroup)

#define LLM_SERVING_TYPE_CODE(name, code, block, bytes, repacked) k##name = code,
#define LLM_SERVING_TYPE_R8_CODE(name, code, block, bytes, repacked) LLM_SERVING_R8_CODE_##repacked(name, code)
#define LLM_SERVING_R8_CODE_R8(name, code) k##name##_R8 = code + kRepacked,
#define LLM_SERVING_R8_CODE_NONE(name, code)
enum WeightType : int32_t {
  LLM_SERVING_WEIGHT_TYPES(LLM_SERVING_TYPE_CODE) LLM_SERVING_WEIGHT_TYPES(LLM_SERVING_TYPE_R8_CODE)
};

#define LLM_SERVING_R8_CASE_R8(code) case code + kRepacked:
#define LLM_SERVING_R8_CASE_NONE(code)

// The block of `type`: its weights and bytes (a repacked type: its stored type's); {0, 0}: not a type of the table
struct TypeBlock {
  int64_t weights, bytes;
};
constexpr TypeBlock block_of(int32_t type) {
  switch (type) {
#define LLM_SERVING_TYPE_CASE(name, code, block, bytes, repacked) \
  case code: LLM_SERVING_R8_CASE_##repacked(code) return TypeBlock{block, bytes};
    LLM_SERVING_WEIGHT_TYPES(LLM_SERVING_TYPE_CASE)
#undef LLM_SERVING_TYPE_CASE
    default: return TypeBlock{0, 0};
  }
}
constexpr int64_t block_weights_of(int32_t type) { return block_of(type).weights; }
constexpr int64_t block_bytes_of(int32_t type) { return block_of(type).bytes; }

// Whether `type` is a repacked one (k<name>_R8)
constexpr bool is_repacked(int32_t type) {
  switch (type) {
#define LLM_SERVING_TYPE_CASE(name, code, block, bytes, repacked) LLM_SERVING_R8_CASE_##repacked(code)
    LLM_SERVING_WEIGHT_TYPES(LLM_SERVING_TYPE_CASE)
#undef LLM_SERVING_TYPE_CASE
      return true;
    default: return false;
  }
}

// Whether `type`'s blocks are super-blocks of 256 (the K-quants)
constexpr bool super_blocks(int32_t type) { return block_weights_of(type) == 256; }

// Bytes of 32 weights of `type` (F16: 32 halves), the stride of the decoders that go a block of 32 at a time
constexpr int64_t bytes_per_32(int32_t type) { return 32 / block_weights_of(type) * block_bytes_of(type); }

// "name:code:block weights:block bytes:repacked code (0: none),..." in the table's order: what WeightTypes() returns
inline std::string describe_weight_types() {
  std::string out;
#define LLM_SERVING_R8_OF_R8(code) code + kRepacked
#define LLM_SERVING_R8_OF_NONE(code) 0
#define LLM_SERVING_TYPE_TEXT(name, code, block, bytes, repacked)                                                \
  out += std::string(out.empty() ? "" : ",") + #name ":" + std::to_string(code) + ":" + std::to_string(block) + \
         ":" + std::to_string(bytes) + ":" + std::to_string(LLM_SERVING_R8_OF_##repacked(code));
  LLM_SERVING_WEIGHT_TYPES(LLM_SERVING_TYPE_TEXT)
#undef LLM_SERVING_TYPE_TEXT
  return out;
}

}  // namespace weight_types
}  // namespace llm_serving
