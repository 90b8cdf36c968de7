"""GGUF checkpoints (llama.cpp's format) for `load_llama_weights` (loader.py), read through the `gguf` package.

Architectures `llama` and `qwen2`; hyperparameters from the `<arch>.*` metadata; tensors renamed to HF names and
dequantized to float32 by `gguf.quants.dequantize` as they are read (F32, F16, BF16, Q4_0/1, Q5_0/1, Q8_0, the
K-quants and whatever else that package dequantizes; a tensor-parallel rank's rows are cut before). llama.cpp's
converter interleaves the rotary pairs of a llama model's q/k rows (as llama2.c does): undone here. A Llama-3.1
file's `rope_freqs` tensor becomes `LlamaConfig.rope_freq_factors`. An unsupported architecture or tensor type is
a WeightLoadError naming it. `load_gguf` keeps the float32 result in the cache directory for the next start.

Matrices stored in a type of KEPT_QUANTIZED (the block formats the CPU kernels read) also offer their stored bytes
(`StoredTensor.read_blocks`, rows permuted as the float32 rows are). The cache keeps only those bytes for them (no
float32 copy on disk): a path that computes in float32 dequantizes them when it reads them.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from typing import Callable

import numpy as np

from .common import LlamaConfig, StoredTensor, WeightLoadError, rotate_half_rows

logger = logging.getLogger(__name__)

__all__ = ["load_gguf", "GGUF_CACHE_ENV", "KEPT_QUANTIZED"]

# GGML type name -> code (GGML's numbering, which the layer kernel's iconfig uses)
KEPT_QUANTIZED = {"F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13,
                  "Q6_K": 14, "BF16": 30}

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_GGUF_LAYER_NAMES = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
                     "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
                     "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
                     "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
                     "attn_v.bias": "self_attn.v_proj.bias", "ffn_gate.weight": "mlp.gate_proj.weight",
                     "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight"}
_GGUF_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
               "output.weight": "lm_head.weight"}
_GGUF_ARCHITECTURES = ("llama", "qwen2")
_gguf_types_checked: dict = {}


def _gguf_dequantizes(qtype) -> bool:
    """Whether the `gguf` package can dequantize tensor type `qtype` (tried once on a zero block)."""
    if qtype not in _gguf_types_checked:
        from gguf import GGML_QUANT_SIZES
        from gguf.quants import dequantize

        try:
            block, size = GGML_QUANT_SIZES[qtype]
            dequantize(np.zeros((1, size), np.uint8), qtype)
            _gguf_types_checked[qtype] = True
        except (NotImplementedError, KeyError, ValueError):
            _gguf_types_checked[qtype] = False
    return _gguf_types_checked[qtype]


def _gguf_reader(tensor) -> Callable[[tuple], np.ndarray]:
    """read(index) of one GGUF tensor (its data is a view of the file's memory map), dequantized to float32 by
    the `gguf` package. Quantized blocks run along a row, so a slice of whole rows is cut before dequantizing."""
    from gguf.quants import dequantize

    def read(index: tuple) -> np.ndarray:
        data = tensor.data
        rows_only = len(index) > 1 and all(i == slice(None) for i in index[1:])
        if rows_only or len(index) == 1:
            return np.asarray(dequantize(np.asarray(data[index[0]]), tensor.tensor_type), np.float32)
        return np.asarray(dequantize(np.asarray(data), tensor.tensor_type), np.float32)[index]
    return read


def _block_reader(tensor) -> Callable[[slice], np.ndarray]:
    """read_blocks(rows) of one GGUF matrix: the stored bytes of those rows, uint8 (rows, bytes per row)."""
    def read(rows: slice) -> np.ndarray:
        part = np.asarray(tensor.data[rows])
        return np.ascontiguousarray(part).view(np.uint8).reshape(part.shape[0], -1)
    return read


def _load_gguf(path: str) -> tuple[LlamaConfig, dict[str, StoredTensor]]:
    """A GGUF file (llama.cpp's format): hyperparameters from `<arch>.*` metadata, tensors renamed to HF names
    and dequantized as they are read. llama.cpp's converter interleaves the rotary pairs of a llama model's
    q/k rows (as llama2.c does); that is undone here. qwen2 files keep HF's layout."""
    from llm_serving.gguf_file import open_gguf

    try:
        reader = open_gguf(path)
    except Exception as e:          # not GGUF, truncated, unknown version
        raise WeightLoadError(f"{path}: cannot read GGUF file: {e}") from e

    def meta(key, default=None, required=True):
        field = reader.fields.get(key)
        if field is None:
            if required and default is None:
                raise WeightLoadError(f"{path}: GGUF metadata {key!r} is missing")
            return default
        return field.contents()

    arch = meta("general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise WeightLoadError(f"{path}: GGUF architecture {arch!r} is not supported (supported: "
                              f"{', '.join(_GGUF_ARCHITECTURES)})")
    tensors = {t.name: t for t in reader.tensors}
    hidden, heads = int(meta(f"{arch}.embedding_length")), int(meta(f"{arch}.attention.head_count"))
    kv_heads = int(meta(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(meta(f"{arch}.attention.key_length", hidden // heads))
    if "token_embd.weight" not in tensors:
        raise WeightLoadError(f"{path}: GGUF tensor 'token_embd.weight' is missing")
    vocab = int(meta(f"{arch}.vocab_size", tensors["token_embd.weight"].shape[-1]))
    factors = None
    if "rope_freqs.weight" in tensors:      # Llama-3.1's RoPE scaling, as llama.cpp stores it: a divisor per frequency
        factors = tuple(float(v) for v in _gguf_reader(tensors["rope_freqs.weight"])((slice(None),)))
    scaling = meta(f"{arch}.rope.scaling.type", required=False)
    if scaling == "linear":                 # every frequency slowed by the same factor, as HF's "linear"
        factors = (float(meta(f"{arch}.rope.scaling.factor")),) * (head_dim // 2)
    elif scaling not in (None, "none"):
        raise WeightLoadError(f"{path}: GGUF RoPE scaling {scaling!r} is not supported (supported: linear, and "
                              "Llama-3.1's rope_freqs)")
    window = meta(f"{arch}.attention.sliding_window", required=False)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(meta(f"{arch}.feed_forward_length")),
                      num_layers=int(meta(f"{arch}.block_count")), num_heads=heads, num_kv_heads=kv_heads,
                      head_dim=head_dim, rms_norm_eps=float(meta(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
                      rope_theta=float(meta(f"{arch}.rope.freq_base", 10000.0)),
                      max_position_embeddings=int(meta(f"{arch}.context_length", 2048)),
                      bos_token_id=meta("tokenizer.ggml.bos_token_id", required=False),
                      eos_token_id=meta("tokenizer.ggml.eos_token_id", required=False),
                      tie_word_embeddings="output.weight" not in tensors, architecture=arch,
                      attention_bias="blk.0.attn_q.bias" in tensors, rope_freq_factors=factors,
                      sliding_window=int(window) if window else None)
    if heads % kv_heads or head_dim % 2:
        raise WeightLoadError(f"{path}: head_count={heads}, head_count_kv={kv_heads}, head_dim={head_dim} are "
                              "inconsistent")
    out: dict[str, StoredTensor] = {}
    for name, tensor in tensors.items():
        if name.startswith("blk."):
            _, layer, rest = name.split(".", 2)
            hf = _GGUF_LAYER_NAMES.get(rest)
            hf = hf and f"model.layers.{layer}.{hf}"
        else:
            hf = _GGUF_NAMES.get(name)
        if hf is None:
            continue                        # rope_freqs (read above), or tensors this model has no use for
        if not _gguf_dequantizes(tensor.tensor_type):
            raise WeightLoadError(f"{path}: tensor {name!r} has type {tensor.tensor_type.name}, which the gguf "
                                  "package cannot dequantize (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, "
                                  "Q8_0, the K-quants, ...)")
        shape = tuple(int(n) for n in reversed(tensor.shape))      # GGUF lists dimensions innermost first
        read = _gguf_reader(tensor)
        qtype = KEPT_QUANTIZED.get(tensor.tensor_type.name) if len(shape) == 2 else None
        blocks = _block_reader(tensor) if qtype is not None else None
        if arch == "llama" and hf.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            read = _interleaved_to_halves(read, head_dim)
            if blocks is not None:
                blocks = _interleaved_to_halves_rows(blocks, head_dim)
        kind = tensor.tensor_type.name
        out[hf] = StoredTensor(shape, read, qtype, blocks, None if kind == "F32" else kind)
    return cfg, out


def _interleaved_to_halves(read: Callable[[tuple], np.ndarray], head_dim: int) -> Callable[[tuple], np.ndarray]:
    """A q/k reader whose rows come back in rotate-half order (see `rotate_half_rows`); read in whole heads."""
    def rotated(index: tuple) -> np.ndarray:
        part = read(index)
        if part.ndim != 2 or part.shape[0] % head_dim:
            raise ValueError(f"a GGUF q/k tensor is read in whole heads of {head_dim} rows, not {index}")
        return rotate_half_rows(part, part.shape[0] // head_dim)
    return rotated


def _interleaved_to_halves_rows(read_blocks: Callable[[slice], np.ndarray], head_dim: int):
    """read_blocks of a q/k matrix whose rows come back in rotate-half order, as `_interleaved_to_halves`'s."""
    rotated = _interleaved_to_halves(lambda index: read_blocks(index[0]), head_dim)
    return lambda rows: rotated((rows,))


GGUF_CACHE_ENV = "LLM_SERVING_GGUF_CACHE"     # "0": dequantize the GGUF at every start instead


def load_gguf(path: str) -> tuple[LlamaConfig, dict[str, StoredTensor]]:
    """`_load_gguf` through a cache of what it read: parsing a GGUF's metadata and dequantizing the tensors the
    kernels do not read as stored costs seconds of every start, memory-mapping last time's arrays almost nothing.
    The cache is `<cache>/gguf/<key>/` (key: the file's path, size and modification time): `config.json`, one
    float32 `.npy` per tensor the kernels do not read as stored (norms, types outside KEPT_QUANTIZED), and for the
    others only their stored bytes (`<name>.blocks.npy`, q/k rows already in rotate-half order; types in
    `quantized.json`), written into a temporary directory that is then renamed into place."""
    from dataclasses import asdict

    from llm_serving.cache_dir import default_cache_dir

    if os.environ.get(GGUF_CACHE_ENV, "1") == "0":
        return _load_gguf(path)
    st = os.stat(path)
    key = hashlib.sha1(repr((os.path.abspath(path), st.st_size, st.st_mtime_ns, 4)).encode()).hexdigest()[:16]
    folder = default_cache_dir() / "gguf" / key
    if not (folder / "config.json").is_file():
        cfg, stored = _load_gguf(path)
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent)
            try:
                for name, tensor in stored.items():
                    if tensor.read_blocks is not None:      # the stored bytes only: float32 is made from them
                        np.save(os.path.join(tmp, name + ".blocks.npy"), tensor.read_blocks(slice(None)))
                    else:
                        np.save(os.path.join(tmp, name + ".npy"),
                                np.ascontiguousarray(tensor.read((slice(None),) * len(tensor.shape)), np.float32))
                with open(os.path.join(tmp, "quantized.json"), "w", encoding="utf-8") as f:
                    json.dump({n: t.qtype for n, t in stored.items() if t.read_blocks is not None}, f)
                with open(os.path.join(tmp, "types.json"), "w", encoding="utf-8") as f:
                    json.dump({n: t.stored_type for n, t in stored.items() if t.stored_type is not None}, f)
                with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
                    json.dump(asdict(cfg), f)
                os.rename(tmp, folder)
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)
                if not (folder / "config.json").is_file():     # not another process's copy, just in place
                    raise
        except OSError as e:
            logger.warning("GGUF not cached as float32 (%s): it is dequantized at every start", e)
            return cfg, stored
    with open(folder / "config.json", encoding="utf-8") as f:
        raw = json.load(f)
    if raw.get("rope_freq_factors") is not None:
        raw["rope_freq_factors"] = tuple(raw["rope_freq_factors"])
    cfg = LlamaConfig(**raw)
    with open(folder / "quantized.json", encoding="utf-8") as f:
        qtypes = json.load(f)
    with open(folder / "types.json", encoding="utf-8") as f:
        kinds = json.load(f)
    stored = {}
    for npy in folder.glob("*.npy"):
        name = npy.name[:-len(".npy")]
        if name.endswith(".blocks"):
            name = name[:-len(".blocks")]
            blocks = np.load(npy, mmap_mode="r")
            qtype = qtypes[name]
            shape = (blocks.shape[0], _row_length(qtype, blocks.shape[1]))
            stored[name] = StoredTensor(shape, _dequantizing_reader(blocks, qtype, shape),
                                        qtype, lambda rows, b=blocks: np.array(b[rows]), kinds.get(name))
            continue
        array = np.load(npy, mmap_mode="r")
        stored[name] = StoredTensor(array.shape, lambda index, a=array: np.array(a[index]),
                                    stored_type=kinds.get(name))
    return cfg, stored


def _row_length(qtype: int, row_bytes: int) -> int:
    """Weights per row of `row_bytes` stored bytes of GGML type `qtype`."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    return row_bytes // size * block


def _dequantizing_reader(blocks: np.ndarray, qtype: int, shape: tuple) -> Callable[[tuple], np.ndarray]:
    """read(index) of a cached matrix kept only as its stored blocks: the rows `index` selects, dequantized to
    float32 (for the paths that compute in float32: no layer kernel, tensor parallelism, Ascend)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    def read(index: tuple) -> np.ndarray:
        rows = index[0] if index else slice(None)
        part = np.asarray(dequantize(np.asarray(blocks[rows]), GGMLQuantizationType(qtype)), np.float32)
        part = part.reshape(-1, shape[1])
        return part[(slice(None),) + tuple(index[1:])] if len(index) > 1 else part
    return read
