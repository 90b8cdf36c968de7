// A kernel's parameters declared once, as one list (an X-macro) per kernel, from which come its enum of
// parameter indices, the ranks and dtypes checked on each call, and an exported description of the list that
// kernels/__init__.py compares with the list kernels/signatures.py builds the ops.Custom call from, by name,
// when the library is built. A new parameter: one line in the kernel's list and one in signatures.py.
//
//   #define MY_KERNEL_PARAMS(P) P(X, "x", 2, "float32") P(OUT, "out", 2, "float32")
//   enum { MY_KERNEL_PARAMS(LLM_SERVING_PARAM_ENUM) NPARAM };                       // X = 0, OUT = 1, NPARAM = 2
//   static const ParamSpec kMyKernel[] = {MY_KERNEL_PARAMS(LLM_SERVING_PARAM_SPEC)};
//
// dtype "weight": float32, or a GGUF type's stored bytes (uint8); the kernel checks it with its type code.
// dtype "cache": a KV cache's element type, float32, float16, bfloat16 or int8 (pa_config.kv_cache_dtype); the
// kernel reads it from the call's dtype.
//
// A kernel's iconfig (its int32 settings, one entry each) is declared the same way: a list of its entries, from
// which come their indices and an exported list of their names (<Kernel>Iconfig(): "name,name,..."), which the
// build compares with the names kernels/signatures.py builds the iconfig from. A new entry: one line in each, at
// the same place.
//
//   #define MY_KERNEL_ICONFIG(I) I(THREADS, "threads") I(W_TYPE, "w_type")
//   namespace my_cfg { enum : int64_t { MY_KERNEL_ICONFIG(LLM_SERVING_FIELD_ENUM) COUNT }; }   // icfg[my_cfg::W_TYPE]
//   const char* const kNames[] = {MY_KERNEL_ICONFIG(LLM_SERVING_FIELD_NAME)};
#pragma once

#include <cstring>
#include <string>

namespace llm_serving {

struct ParamSpec {
  const char* name;
  int ndims;
  const char* dtype;   // "float32", "int32", "weight" or "cache"
};

#define LLM_SERVING_PARAM_ENUM(id, name, ndims, dtype) id,
#define LLM_SERVING_PARAM_SPEC(id, name, ndims, dtype) {name, ndims, dtype},
#define LLM_SERVING_FIELD_ENUM(id, name) id,
#define LLM_SERVING_FIELD_NAME(id, name) name,

// The call passes exactly `count` parameters with the declared ranks and dtypes.
inline bool params_match(const ParamSpec* spec, int count, int nparam, const int* ndims, const char** dtypes) {
  if (nparam != count) return false;
  for (int i = 0; i < count; ++i) {
    if (ndims[i] != spec[i].ndims) return false;
    if (std::strcmp(spec[i].dtype, "weight") == 0) continue;
    if (std::strcmp(spec[i].dtype, "cache") == 0) {
      if (std::strcmp(dtypes[i], "float32") != 0 && std::strcmp(dtypes[i], "float16") != 0 &&
          std::strcmp(dtypes[i], "bfloat16") != 0 && std::strcmp(dtypes[i], "int8") != 0) {
        return false;
      }
      continue;
    }
    if (std::strcmp(dtypes[i], spec[i].dtype) != 0) return false;
  }
  return true;
}

// "name:ndims:dtype,..." in order: what a kernel's exported <Kernel>Params() returns.
inline std::string describe_params(const ParamSpec* spec, int count) {
  std::string out;
  for (int i = 0; i < count; ++i) {
    if (i > 0) out += ',';
    out += std::string(spec[i].name) + ':' + std::to_string(spec[i].ndims) + ':' + spec[i].dtype;
  }
  return out;
}

// "name,name,..." in order: what a kernel's exported <Kernel>Iconfig() returns.
inline std::string describe_fields(const char* const* names, int count) {
  std::string out;
  for (int i = 0; i < count; ++i) {
    if (i > 0) out += ',';
    out += names[i];
  }
  return out;
}

}  // namespace llm_serving
