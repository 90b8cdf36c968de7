// A model's decoder layers as one kernel call (DecoderStack, decoder_layer_cpu.cc): the layers' kernel calls
// (DecoderLayer, then MoeMlp for a mixture-of-experts layer) registered once at load, each with the parameters the
// model holds (weights, gains, RoPE tables, LoRA stacks, iconfig: pointers into memory the Python side keeps alive)
// and, for each parameter a step gives, where it comes from: a parameter of the stack's call (the step's inputs and
// the KV caches, which stay MindSpore Parameters), the running hidden state, or the output.
//
// Why: a MindSpore graph's compile time grows with its operators and their inputs (about 6 ms an operator and 0.5
// ms an input on a 2-core Zen 4), and a model graph held one DecoderLayer of ~40 inputs per layer (a decode run:
// per layer and step): 1-1.5 s a graph for SmolLM2's 30 layers, 6 s a decode run. As one operator whose inputs
// are the step's and the caches, a graph compiles in a time that does not grow with the weights' count.
//
// Included by decoder_layer_cpu.cc only, after the kernels it calls.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace llm_serving {
namespace layer_stack {

// where a call's parameter comes from (StackCall::source): >= 0 the stack call's parameter of that index
constexpr int32_t kHeld = -1;      // the registered pointer
constexpr int32_t kHidden = -2;    // the running hidden state (T, H): the stack's x, then each call's output
constexpr int32_t kOutput = -3;    // this call's output (T, H)

enum Kernel : int32_t { kDecoderLayer = 0, kMoeMlp = 1 };

struct Param {
  void* ptr = nullptr;
  int ndims = 0;
  int64_t shape[4] = {0, 0, 0, 0};
  std::string dtype;
};

struct Call {
  int32_t kernel = kDecoderLayer;
  std::vector<int32_t> source;      // per parameter
  std::vector<Param> held;          // per parameter (read where source is kHeld)
};

struct Stack {
  std::vector<Call> calls;
  int32_t inputs = 0;               // the stack call's parameters it reads: the highest source + 1
};

inline std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}

inline std::unordered_map<int32_t, std::shared_ptr<Stack>>& registry() {
  static std::unordered_map<int32_t, std::shared_ptr<Stack>> stacks;
  return stacks;
}

inline std::shared_ptr<Stack> find(int32_t handle) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = registry().find(handle);
  return it == registry().end() ? nullptr : it->second;
}

// Splits "float32,uint8,..." into its names.
inline std::vector<std::string> split_names(const char* text) {
  std::vector<std::string> out;
  std::string cur;
  for (const char* c = text; *c != '\0'; ++c) {
    if (*c == ',') {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += *c;
    }
  }
  out.push_back(cur);
  return out;
}

}  // namespace layer_stack
}  // namespace llm_serving
