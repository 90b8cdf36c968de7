"""Load a LLaMA checkpoint into numpy float32 arrays under HuggingFace tensor names, all of it or one
tensor-parallel rank's part (`load_llama_weights(path, tp)`). This package's interface: import from here.

A module per format, each a reader `path -> (LlamaConfig, {HF name: StoredTensor})`, told apart by
`loader.detect_format` and named in `loader.READERS`:

- **hf** (`hf.py`): a HuggingFace directory, `config.json` plus safetensors, of any family `models/families/` names
  (its `architectures`), the family's differences kept as data in `LlamaConfig` (`load_config`).
- **gguf** (`gguf.py`): a llama.cpp `.gguf` file of a family's `general.architecture`, dequantized per tensor,
  cached as float32.
- **llama2c** (`llama2c.py`): a llama2.c `.bin` file, legacy (v0) export; q/k rows permuted to rotate-half.
- **mindformers** (`mindformers.py`): a directory with one MindFormers `*.ckpt` and a `config.json` or `*.yaml`.

What they share is in `common.py` (`LlamaConfig`, `StoredTensor`, `WeightLoadError`, `expected_shapes`,
`rotate_half_rows`), which imports no format; `loader.py` imports the formats. Every reader returns HF names
(`model.layers.0.self_attn.q_proj.weight`, ...), each a `StoredTensor` not read yet (safetensors slices and
memory-mapped llama2.c files read only the part asked for; a MindSpore checkpoint is read whole by MindSpore),
checked once against `expected_shapes` before anything is read: a missing tensor, a wrong shape or a non-float
dtype fails with a `WeightLoadError` naming the tensor. The model concatenates Q/K/V and gate/up itself when it
builds its parameters (`llama.py`).

A GGUF's block-quantized matrices (and gpt-oss's MXFP4 experts from safetensors) are also available as the file
stores them (`load_quantized`): the CPU layer kernel reads those rows directly, 4.25-8.5 bits per weight instead of
float32's 32 (docs/benchmarks/JOURNAL.md).

A new format: a module here with its reader (importing `common` only), its case in `detect_format` and its
entry in `READERS`.
"""
from .common import LlamaConfig, QuantizedTensor, StoredTensor, WeightLoadError, expected_shapes, rotate_half_rows
from .hf import llama3_rope_factors, load_config, stored_safetensors
from .loader import (checkpoint_config, detect_format, kernel_types, load_llama_weights, load_quantized, model_shape,
                     stored_llama_weights, stored_types)
from .page_cache import read_ahead, weight_files

__all__ = ["LlamaConfig", "QuantizedTensor", "StoredTensor", "WeightLoadError", "checkpoint_config", "detect_format",
           "expected_shapes", "kernel_types", "llama3_rope_factors", "load_config", "load_llama_weights",
           "load_quantized", "model_shape", "read_ahead", "rotate_half_rows", "stored_llama_weights",
           "stored_safetensors", "stored_types", "weight_files"]
