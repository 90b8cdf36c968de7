"""Which reader a checkpoint needs (`detect_format`, `READERS`) and what every reader's result goes through: the
shapes checked (`expected_shapes`), a draft's first layers kept, a tensor-parallel rank's part read
(`load_llama_weights`), or the matrices kept as stored (`load_quantized`).
"""
from __future__ import annotations

import dataclasses
import glob
import logging
import os
from typing import Callable, Optional

import numpy as np

from ..parallel import TensorParallel
from .common import LlamaConfig, QuantizedTensor, StoredTensor, WeightLoadError, check_tensors, expected_shapes
from .gguf import KEPT_QUANTIZED, gguf_config, load_gguf
from .hf import load_hf
from .llama2c import load_llama2c
from .mindformers import load_mindformers, mindformers_dir_config

logger = logging.getLogger(__name__)

__all__ = ["READERS", "checkpoint_config", "detect_format", "kernel_types", "load_llama_weights", "load_quantized",
           "model_shape", "stored_types"]

# detect_format's name -> the reader of that format: path -> (config, {HF name: StoredTensor}), not read yet
READERS: dict[str, Callable[[str], tuple[LlamaConfig, dict[str, StoredTensor]]]] = {
    "hf": load_hf, "gguf": load_gguf, "llama2c": load_llama2c, "mindformers": load_mindformers}


def detect_format(path: str) -> str:
    """'hf', 'gguf', 'llama2c' or 'mindformers' for a checkpoint path; WeightLoadError if it is none of them."""
    if os.path.isfile(path):
        if path.endswith(".bin"):
            return "llama2c"
        if path.endswith(".ckpt"):
            return "mindformers"
        if path.endswith(".gguf"):
            return "gguf"
        raise WeightLoadError(f"{path}: a model file must be a GGUF .gguf, a llama2.c .bin or a MindFormers .ckpt")
    if not os.path.isdir(path):
        raise WeightLoadError(f"{path}: no such file or directory")
    if (os.path.exists(os.path.join(path, "model.safetensors"))
            or os.path.exists(os.path.join(path, "model.safetensors.index.json"))):
        return "hf"
    if glob.glob(os.path.join(path, "*.ckpt")):
        return "mindformers"
    raise WeightLoadError(f"{path}: not a model directory: expected config.json with model.safetensors (or "
                          "a safetensors index), or a MindFormers *.ckpt; or pass a llama2.c .bin file")


def model_shape(path: str) -> LlamaConfig:
    """The LlamaConfig of any supported checkpoint without reading its tensors (sizing the KV cache before the
    agents load it). A GGUF's comes from `load_gguf`'s cache (`gguf_config`), which this fills on a first start."""
    path = os.fspath(path)
    fmt = detect_format(path)
    if fmt == "mindformers":        # (its reader loads the whole checkpoint)
        return mindformers_dir_config(path if os.path.isdir(path) else os.path.dirname(path))
    if fmt == "gguf":               # (not its tensors' maps: 0.18 s of a SmolLM2's load)
        return gguf_config(path)
    return READERS[fmt](path)[0]


def _checked_stored(path: str, num_layers: Optional[int]) -> tuple[LlamaConfig, dict[str, StoredTensor]]:
    """The checkpoint's config and tensors (not read yet), `lm_head.weight` present (a model that generates), every
    shape checked."""
    cfg, stored = READERS[detect_format(path)](path)
    if num_layers is not None:
        if not 1 <= num_layers <= cfg.num_layers:
            raise WeightLoadError(f"cannot keep the first {num_layers} layers of {path}: it has {cfg.num_layers}")
        cfg = dataclasses.replace(cfg, num_layers=num_layers,
                                  layer_types=None if cfg.layer_types is None else tuple(cfg.layer_types[:num_layers]),
                                  nope_layers=tuple(i for i in cfg.nope_layers if i < num_layers))
    if cfg.generates and ("lm_head.weight" not in stored or cfg.tie_word_embeddings):
        if "model.embed_tokens.weight" in stored:
            stored["lm_head.weight"] = stored["model.embed_tokens.weight"]
    check_tensors(stored, expected_shapes(cfg), f"the checkpoint in {path}")
    return cfg, stored


def stored_llama_weights(path: str) -> tuple[LlamaConfig, dict[str, StoredTensor]]:
    """(config, {hf_name: StoredTensor}) of any supported checkpoint, every shape checked, nothing read yet: for a
    reader that takes a few tensors at a time (the float64 reference of a model whose float64 copy would not fit)."""
    return _checked_stored(os.fspath(path), None)


def checkpoint_config(path: str) -> LlamaConfig:
    """The LlamaConfig of any supported checkpoint (its tensors checked but not read)."""
    return _checked_stored(os.fspath(path), None)[0]


def load_llama_weights(path: str, tp: Optional[TensorParallel] = None, num_layers: Optional[int] = None,
                       skip: frozenset = frozenset()) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """Return (config, {hf_name: float32 array}) for any supported checkpoint, with every tensor checked.

    skip: names not read as float32 (their shapes are still checked): matrices the caller runs as the checkpoint
    stores them (load_quantized's), which then have no float32 copy at all.

    num_layers: keep only the first N decoder layers (with the final norm and head): a draft model cut from
    the checkpoint (speculative decoding); the other layers are not read.

    tp: read only what that tensor-parallel rank holds (default: one agent, which holds everything): each
    tensor's shard (`TensorParallel.part`), and no logits tensors on ranks other than 0. A model whose heads
    or MLP units do not split over tp.world fails before anything is read (ValueError naming them)."""
    path = os.fspath(path)
    cfg, stored = _checked_stored(path, num_layers)
    shapes = expected_shapes(cfg)
    tp = tp if tp is not None else TensorParallel()        # one agent: every tensor, whole
    tp.check(cfg)
    out, done = {}, {}
    for name, shape in shapes.items():
        if not tp.needs(name) or name in skip:
            continue
        index = tp.part(name, shape)
        key = (id(stored[name]), repr(index))       # tied embeddings: one tensor under two names, read once
        if key not in done:
            try:
                done[key] = np.ascontiguousarray(stored[name].read(index), dtype=np.float32)
            except (OSError, ValueError) as e:      # data its header promised but the file does not hold
                raise WeightLoadError(f"tensor {name!r} in {path}: cannot read it: {e}") from e
        out[name] = done[key]
    _log_float32_copies(stored, out, skip)
    return cfg, out


def _log_float32_copies(stored: dict, read: dict, skip: frozenset) -> None:
    """One line per stored type of the matrices just converted to float32 (a GGUF's quantized or F16 ones), with
    the memory the copies take: a type the CPU kernels do not read as stored, or a path that computes in float32
    (no layer kernel, tensor parallelism, Ascend, keep_quantized off)."""
    by_type, seen = {}, set()
    for name, array in read.items():
        kind = stored[name].stored_type
        if kind is None or array.ndim != 2 or id(array) in seen or name in skip:
            continue
        seen.add(id(array))
        count, nbytes = by_type.get(kind, (0, 0))
        by_type[kind] = (count + 1, nbytes + array.nbytes)
    for kind, (count, nbytes) in sorted(by_type.items()):
        logger.info("%d %s matrices dequantized to float32: %.1f MB in memory (the CPU kernels read F32, %s as "
                    "stored)", count, kind, nbytes / 1e6, ", ".join(sorted(KEPT_QUANTIZED)))


def stored_types(path: str) -> Optional[frozenset]:
    """The GGUF type names of the block-quantized tensors the checkpoint at `path` stores (what load_quantized and
    a mixture's expert stacks keep: {"Q4_1", "Q8_0"} for SmolLM2's Q4_1 GGUF, none for a float checkpoint), from its
    header and index alone (0.1 s for a 30B GGUF), so that the CPU layer kernel can be built for those types before
    the load; None when the checkpoint cannot be read (the load says why)."""
    names = {code: name for name, code in KEPT_QUANTIZED.items()}
    try:
        cfg, stored = _checked_stored(os.fspath(path), None)
    except (OSError, ValueError, KeyError, WeightLoadError):
        return None
    return frozenset(names.get(t.qtype, str(t.qtype)) for t in stored.values() if t.read_blocks is not None)


def kernel_types(path: str, keep_quantized: bool) -> Optional[frozenset]:
    """The stored types the CPU layer kernel is built for (kernels.build_kernel's `types`): the checkpoint's
    (stored_types) when the runner keeps its matrices as stored (model_config.keep_quantized), else none. The
    runner, the master's build ahead of it and its read-ahead all ask here, so they name one library."""
    return stored_types(path) if keep_quantized else frozenset()


def load_quantized(path: str, num_layers: Optional[int] = None) -> dict[str, QuantizedTensor]:
    """{hf_name: QuantizedTensor} of the model's 2-D weight matrices that the checkpoint stores block-quantized
    (a GGUF's block-quantized and F16 tensors, see gguf.KEPT_QUANTIZED; gpt-oss's MXFP4 experts from safetensors,
    hf.py's), whole (one agent); {} for a checkpoint that has none. The embedding among them (the CPU kernels
    gather its rows from the stored blocks); a tied lm_head is the embedding's stored tensor, the same object."""
    path = os.fspath(path)
    cfg, stored = _checked_stored(path, num_layers)
    out, done = {}, {}
    for name, shape in expected_shapes(cfg).items():
        tensor = stored[name]
        if tensor.read_blocks is None or len(shape) != 2:
            continue
        if id(tensor) not in done:
            try:
                data = np.ascontiguousarray(tensor.read_blocks(slice(None)), dtype=np.uint8)
            except (OSError, ValueError) as e:
                raise WeightLoadError(f"tensor {name!r} in {path}: cannot read its blocks: {e}") from e
            if data.ndim != 2 or data.shape[0] != shape[0]:
                raise WeightLoadError(f"tensor {name!r} in {path}: its blocks are {data.shape}, not {shape[0]} rows")
            done[id(tensor)] = QuantizedTensor(tensor.qtype, tuple(shape), data)
        out[name] = done[id(tensor)]
    return out
