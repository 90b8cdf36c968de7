"""The agent's model runner: numpy in, numpy out, over static-shape MindSpore graphs (`ModelRunner`), in rooms of one
job each:

- `model_runner.py`: `ModelRunner`, which composes the rooms below from a RunnerSpec and a model directory, and hands a
  step to the room of its kind;
- `kernels.py`: which CPU kernels it runs on (`choose_kernels` → `KernelChoice`: the paged-attention and layer
  kernels, the steps the layer kernel serves, batch invariance, decode runs) and what the layer kernel reads as
  stored;
- `graphs.py`: the MindSpore cells (model, decode run, Embedder, samplers, top log-probabilities, penalties) and
  `RunnerGraphs.call`, how every graph is called (the staged warmup's hook, tensor parallelism's failures);
- `kv_inputs.py` (pure numpy): a step's slot mappings and block tables padded to its bucket (`KvLayout`: the caches'
  scratch blocks), a packed step's tokens side by side (`flat_tokens`);
- `outputs.py`: a step's outputs from its logits (`StepOutputs`: greedy, sampled, penalized, controlled, top
  log-probabilities; `PromptScores`);
- the step kinds: `token_steps.py` (prefill, decode, verify: padded or packed), `decode_runs.py` (K greedy steps in
  one graph), `embed_steps.py` (hidden states pooled on the host);
- `warm.py`: the warmup plan's entries for this runner's buckets and the padding steps that run them;
- `lora_slots.py`: the LoRA adapter slots.

The shapes are in ../buckets.py, a step's inputs are converted and checked by ../step_inputs.py, the process's
MindSpore set-up and compile cache are ../mindspore_env.py's, the warmup plan's order ../warmup.py's, and what the
runner is built from ../runner_spec.py's (`RunnerSpec`, its one mapping from the config).

The KV cache lives in the model's Parameters: per layer, key and value holding [(num_blocks + 1) * block_size,
num_kv_heads, head_dim] in the cache's type (stored flat as [slots * num_kv_heads, head_dim], same memory order; see
attention.py). The last block is scratch: padding tokens (slot -1) and padding rows write there, so real blocks are
never touched by padding. On one CPU agent every model graph (or, with layer_kernel_rows set, those of up to that
many tokens) runs each decoder layer as one C++ kernel on the weights as the checkpoint stores them
(kernels/decoder_layer_cpu.cc; see llama.py). Figures for all of these are in docs/benchmarks/JOURNAL.md.
"""
from .model_runner import ModelRunner

__all__ = ["ModelRunner"]
