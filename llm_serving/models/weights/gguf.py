"""GGUF checkpoints (llama.cpp's format) for `load_llama_weights` (loader.py), read through the `gguf` package.

The architectures the families own (`models/families/`: `llama`, which Mistral's and Mixtral's files are too,
`qwen2`, `qwen3`, `smollm3`, `phi3`, `gemma3`, `qwen3moe`, `gpt-oss` and `bert`, an encoder whose config its family
reads from `bert.*`), as llama.cpp's converter (convert_hf_to_gguf.py) writes them: hyperparameters from the
`<arch>.*` metadata, and where the converter writes nothing, llama.cpp's own fixed rules, which the family states
(Gemma 3: every 6th layer full, a local RoPE base of 10000, the attention scale; SmolLM3: every 4th layer without
RoPE; gpt-oss: every other layer full, its experts' constants); tensors renamed to the internal (LLaMA HF) names and
dequantized to float32 by `gguf.quants.dequantize` as they are read (F32, F16, BF16, Q4_0/1, Q5_0/1, Q8_0, the
K-quants and whatever else that package dequantizes; a tensor-parallel rank's rows are cut before). The converter
interleaves the rotary pairs of q/k rows for the architectures whose llama.cpp RoPE pairs neighbours
(`gguf_interleaved_rope`: llama, smollm3; as llama2.c does): undone here; the NEOX-RoPE ones keep HF's layout. Fused
`attn_qkv` and Phi-3's `ffn_up` (gate and up) are split into row parts. Gemma's norm gains are stored already as the
multiplier (1 + w). A Llama-3.1 file's `rope_freqs` tensor and linear scaling become
`LlamaConfig.rope_freq_factors`, Phi-3's `rope_factors_short/long` its longrope factors. An unsupported
architecture, RoPE type, softcapping or tensor type is a WeightLoadError naming it. `load_gguf` keeps what it read
in the cache directory for the next start: where the stored bytes lie in the file, and float32 arrays of the rest.

Matrices stored in a type of KEPT_QUANTIZED (the block formats the CPU kernels read) also offer their stored bytes
(`StoredTensor.read_blocks`, rows permuted as the float32 rows are). The cache keeps only those bytes for them (no
float32 copy on disk): a path that computes in float32 dequantizes them when it reads them.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
from typing import Callable, Optional

import numpy as np

from .. import families
from .common import LlamaConfig, StoredTensor, WeightLoadError, rotate_half_rows, split_fused
from .hf_config import yarn_attention_factor, yarn_rope_factors

logger = logging.getLogger(__name__)

__all__ = ["gguf_config", "load_gguf", "GGUF_CACHE_ENV", "KEPT_QUANTIZED"]

# GGML type name -> code (GGML's numbering, which the layer kernel's iconfig uses)
KEPT_QUANTIZED = {"F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13,
                  "Q6_K": 14, "BF16": 30, "MXFP4": 39}
# types the CPU kernels read as stored only in a mixture's expert stacks (MoeMlp): gpt-oss's MXFP4
EXPERTS_ONLY = ("MXFP4",)

# GGUF tensor name (after "blk.N.") -> internal name (after "model.layers.N."); the fused ones are split later
_GGUF_LAYER_NAMES = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
                     "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
                     "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
                     "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
                     "attn_v.bias": "self_attn.v_proj.bias", "ffn_gate.weight": "mlp.gate_proj.weight",
                     "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
                     "attn_qkv.weight": "self_attn.qkv_proj.weight", "attn_qkv.bias": "self_attn.qkv_proj.bias",
                     "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
                     "post_attention_norm.weight": "attn_output_norm.weight",     # Gemma's sandwich norms
                     "post_ffw_norm.weight": "mlp_output_norm.weight",
                     # a mixture's router and expert stacks (3-D (E, rows, cols) in the file, read as E * rows rows)
                     "ffn_gate_inp.weight": "mlp.router.weight", "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight",
                     "ffn_up_exps.weight": "mlp.experts.up_proj.weight",
                     "ffn_down_exps.weight": "mlp.experts.down_proj.weight",
                     # gpt-oss's: o_proj's bias, the attention sinks, the router's and experts' biases (2-D (E, rows)
                     # in the file, read as E * rows)
                     "attn_output.bias": "self_attn.o_proj.bias", "attn_sinks.weight": "self_attn.sinks",
                     "ffn_gate_inp.bias": "mlp.router.bias", "ffn_gate_exps.bias": "mlp.experts.gate_proj.bias",
                     "ffn_up_exps.bias": "mlp.experts.up_proj.bias", "ffn_down_exps.bias": "mlp.experts.down_proj.bias",
                     # a BERT encoder's: its post norms (LayerNorms: gain and bias) and the MLP's biases
                     "attn_output_norm.weight": "attn_output_norm.weight", "attn_output_norm.bias": "attn_output_norm.bias",
                     "layer_output_norm.weight": "mlp_output_norm.weight",
                     "layer_output_norm.bias": "mlp_output_norm.bias", "ffn_up.bias": "mlp.up_proj.bias",
                     "ffn_down.bias": "mlp.down_proj.bias"}
_GGUF_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
               "output.weight": "lm_head.weight",
               # a BERT encoder's embedding: its position and token type rows, its LayerNorm
               "position_embd.weight": "model.embed_positions.weight", "token_types.weight": "model.embed_token_types.weight",
               "token_embd_norm.weight": "model.embed_norm.weight", "token_embd_norm.bias": "model.embed_norm.bias"}
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
    """A GGUF file (llama.cpp's format): the config from its metadata (`_gguf_config`), the tensors renamed to the
    internal names and dequantized as they are read; fused ones split, q/k rows of the interleaved-RoPE
    architectures put back in HF's (rotate-half) order."""
    from llm_serving.gguf_file import read_gguf

    try:
        reader = read_gguf(path)
    except Exception as e:          # not GGUF, truncated, unknown version
        raise WeightLoadError(f"{path}: cannot read GGUF file: {e}") from e

    def meta(key, default=None, required=True):
        value = reader.fields.get(key)
        if value is None:
            if required and default is None:
                raise WeightLoadError(f"{path}: GGUF metadata {key!r} is missing")
            return default
        return value

    arch = meta("general.architecture")
    family = families.by_gguf_architecture(arch)
    if family is None:
        raise WeightLoadError(f"{path}: GGUF architecture {arch!r} is not supported (supported: "
                              f"{', '.join(families.supported_gguf_architectures())})")
    tensors = {t.name: t for t in reader.tensors}
    cfg = _gguf_config(path, arch, family, meta, tensors)
    out: dict[str, StoredTensor] = {}
    for name, tensor in tensors.items():
        if name.startswith("blk."):
            _, layer, rest = name.split(".", 2)
            hf = family.gguf_layer_names.get(rest) or _GGUF_LAYER_NAMES.get(rest)
            hf = hf and f"model.layers.{layer}.{hf}"
        else:
            hf = _GGUF_NAMES.get(name)
        if hf is None:
            continue                        # rope_freqs, rope_factors_* (read above), or tensors the model does not use
        if not _gguf_dequantizes(tensor.tensor_type):
            raise WeightLoadError(f"{path}: tensor {name!r} has type {tensor.tensor_type.name}, which the gguf "
                                  "package cannot dequantize (supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, "
                                  "Q8_0, the K-quants, ...)")
        shape = tuple(int(n) for n in reversed(tensor.shape))      # GGUF lists dimensions innermost first
        if len(shape) == 3:                 # a mixture's experts: (E, rows, cols) as E * rows rows of cols
            tensor = _Stacked(tensor)
            shape = (shape[0] * shape[1], shape[2])
        elif len(shape) == 2 and name.endswith("_exps.bias"):       # their biases (E, rows) as E * rows
            tensor = _Stacked(tensor)
            shape = (shape[0] * shape[1],)
        # (a router is read as float32 whatever its type: MoeMlp takes float32 logits weights; so are a BERT's
        # position and token type rows, which the embedding adds as float32 tables)
        qtype = (KEPT_QUANTIZED.get(tensor.tensor_type.name) if len(shape) == 2 and not hf.endswith("router.weight")
                 and not hf.startswith(("model.embed_positions", "model.embed_token_types"))
                 and (tensor.tensor_type.name not in EXPERTS_ONLY or ".mlp.experts." in hf) else None)
        kind = tensor.tensor_type.name
        region = (int(tensor.data_offset), shape[0], int(tensor.n_bytes) // shape[0]) if qtype is not None else None
        out[hf] = StoredTensor(shape, _gguf_reader(tensor), qtype, _block_reader(tensor) if qtype is not None else None,
                               None if kind == "F32" else kind, region)
    for i in range(cfg.num_layers):         # Phi-3's ffn_up: gate and up, 2I rows (gate first)
        p = f"model.layers.{i}."
        up = out.get(p + "mlp.up_proj.weight")
        if up is not None and p + "mlp.gate_proj.weight" not in out and up.shape[0] == 2 * cfg.intermediate_size:
            out[p + "mlp.gate_up_proj.weight"] = out.pop(p + "mlp.up_proj.weight")
    split_fused(cfg, out)
    if family.gguf_interleaved_rope:
        for name, t in out.items():
            if name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
                blocks = t.read_blocks and _interleaved_to_halves_rows(t.read_blocks, cfg.head_dim)
                out[name] = StoredTensor(t.shape, _interleaved_to_halves(t.read, cfg.head_dim), t.qtype, blocks,
                                         t.stored_type)
    return cfg, out


class _Stacked:
    """A GGUF tensor of a mixture's experts with their first two dimensions as one: (E, rows, cols) as E * rows
    rows, (E, rows) biases as E * rows values."""

    def __init__(self, tensor):
        self.name, self.tensor_type = tensor.name, tensor.tensor_type
        self.data_offset, self.n_bytes = tensor.data_offset, tensor.n_bytes
        data = tensor.data
        self.data = data.reshape(data.shape[0] * data.shape[1], *data.shape[2:])



def _gguf_experts(path: str, arch: str, family: families.Family, meta: Callable, tensors: dict,
                  num_layers: int) -> dict:
    """The LlamaConfig fields of a mixture of experts (`<arch>.expert_count` > 0; Mixtral is `llama` with them):
    the experts used per token, their size (`expert_feed_forward_length`, else the layers' `feed_forward_length`),
    renormalized unless `expert_weights_norm` says not (llama.cpp renormalizes qwen3moe and Mixtral), the layers
    without a router (dense), and what the family fixes that the file does not say (gpt-oss's SwiGLU, biases)."""
    experts = int(meta(f"{arch}.expert_count", 0, required=False) or 0)
    if not experts:
        return {}
    size = meta(f"{arch}.expert_feed_forward_length", required=False) or meta(f"{arch}.feed_forward_length")
    dense = tuple(i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors)
    if len(dense) == num_layers:
        raise WeightLoadError(f"{path}: GGUF {arch}.expert_count={experts} but no layer has a router "
                              "(blk.N.ffn_gate_inp.weight)")
    out = {"num_experts": experts, "experts_per_token": int(meta(f"{arch}.expert_used_count")),
           "expert_intermediate_size": int(size),
           "norm_topk_prob": bool(meta(f"{arch}.expert_weights_norm", True, required=False)), "dense_layers": dense}
    return {**out, **family.gguf_expert_fields}        # (llama.cpp's constants for gpt-oss: the file names none)


def _gguf_config(path: str, arch: str, family: families.Family, meta: Callable, tensors: dict) -> LlamaConfig:
    """The LlamaConfig of a GGUF's `<arch>.*` metadata and tensors (biases, sinks and q/k norms by the tensors
    present), with the family's llama.cpp rules where its converter writes nothing (Gemma 3's attention scale and
    local RoPE base, SmolLM3's NoPE layers); a family whose config is its own kind (BERT's) reads it itself."""
    if family.gguf_config is not None:
        return family.gguf_config(path, meta, tensors)
    hidden, heads = int(meta(f"{arch}.embedding_length")), int(meta(f"{arch}.attention.head_count"))
    kv_heads = int(meta(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(meta(f"{arch}.attention.key_length", hidden // heads))
    num_layers = int(meta(f"{arch}.block_count"))
    if "token_embd.weight" not in tensors:
        raise WeightLoadError(f"{path}: GGUF tensor 'token_embd.weight' is missing")
    if heads % kv_heads or head_dim % 2:
        raise WeightLoadError(f"{path}: head_count={heads}, head_count_kv={kv_heads}, head_dim={head_dim} are "
                              "inconsistent")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if meta(f"{arch}.{key}", required=False):
            raise WeightLoadError(f"{path}: GGUF {arch}.{key}={meta(f'{arch}.{key}')} is not supported (softcapping "
                                  "is not computed)")
    rope = _gguf_rope(path, arch, meta, tensors, head_dim)
    window, layer_types = _gguf_sliding_layers(path, arch, family.gguf_window_pattern, meta, num_layers)
    if family.gguf_local_rope_base is not None and window:      # (llama.cpp's base for a file that does not say)
        rope["local_rope_theta"] = float(meta(f"{arch}.rope.freq_base_swa", family.gguf_local_rope_base))
    query_scale = family.gguf_query_scale(meta, arch, hidden, heads, head_dim, num_layers) \
        if family.gguf_query_scale else None
    every = family.gguf_nope_interval
    if "mrope_section" in rope:             # (llama.cpp's qwen3vl: interleaved, which its file does not say)
        rope["mrope_interleaved"] = family.gguf_mrope_interleaved
    return LlamaConfig(
        vocab_size=int(meta(f"{arch}.vocab_size", tensors["token_embd.weight"].shape[-1])), hidden_size=hidden,
        intermediate_size=int(meta(f"{arch}.feed_forward_length")), num_layers=num_layers, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=float(meta(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(meta(f"{arch}.context_length", 2048)),
        bos_token_id=meta("tokenizer.ggml.bos_token_id", required=False),
        eos_token_id=meta("tokenizer.ggml.eos_token_id", required=False),
        tie_word_embeddings="output.weight" not in tensors, architecture=family.name,
        o_bias="blk.0.attn_output.bias" in tensors, attention_sinks="blk.0.attn_sinks.weight" in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors,
        sliding_window=window, layer_types=layer_types, qk_norm="blk.0.attn_q_norm.weight" in tensors,
        sandwich_norms=family.sandwich_norms, embed_scale=math.sqrt(hidden) if family.scaled_embedding else 1.0,
        **_gguf_experts(path, arch, family, meta, tensors, num_layers),
        hidden_act=family.hidden_act, query_scale=query_scale,
        nope_layers=tuple(i for i in range(num_layers) if (i + 1) % every == 0) if every else (),
        deepstack_layers=int(meta(f"{arch}.n_deepstack_layers", 0)),
        **rope)


def _gguf_rope(path: str, arch: str, meta: Callable, tensors: dict, head_dim: int) -> dict:
    """rope_theta, rotary_dim (`rope.dimension_count`), multimodal RoPE's mrope_section (`rope.dimension_sections`),
    and the scaling: Llama-3.1's `rope_freqs`, linear `rope.scaling.*`, Phi-3's longrope (`rope_factors_short/long`,
    the original context and attention factor)."""
    rotary = int(meta(f"{arch}.rope.dimension_count", head_dim))
    out = {"rope_theta": float(meta(f"{arch}.rope.freq_base", 10000.0)),
           "rotary_dim": rotary if rotary != head_dim else None}
    sections = meta(f"{arch}.rope.dimension_sections", required=False)
    if sections is not None and any(int(v) for v in sections):    # multimodal RoPE (Qwen2.5-VL's: t, h, w, 0)
        if len(sections) < 3 or any(int(v) for v in sections[3:]):
            raise WeightLoadError(f"{path}: GGUF rope.dimension_sections {list(sections)}: three sections (time, "
                                  "row, column) are computed, not a fourth")
        out["mrope_section"] = tuple(int(v) for v in sections[:3])

    def vector(name):
        return tuple(float(v) for v in _gguf_reader(tensors[name])((slice(None),)))

    if "rope_freqs.weight" in tensors:      # Llama-3.1's RoPE scaling, as llama.cpp stores it: a divisor per frequency
        out["rope_freq_factors"] = vector("rope_freqs.weight")
    scaling = meta(f"{arch}.rope.scaling.type", required=False)
    if scaling == "linear":                 # every frequency slowed by the same factor, as HF's "linear"
        out["rope_freq_factors"] = (float(meta(f"{arch}.rope.scaling.factor")),) * (rotary // 2)
    elif scaling == "yarn":                 # as llama.cpp computes it (its correction range rounded outwards)
        factor = float(meta(f"{arch}.rope.scaling.factor"))
        out["rope_freq_factors"] = yarn_rope_factors(
            rotary, out["rope_theta"], factor, int(meta(f"{arch}.rope.scaling.original_context_length")),
            float(meta(f"{arch}.rope.scaling.yarn_beta_fast", 32.0, required=False)),
            float(meta(f"{arch}.rope.scaling.yarn_beta_slow", 1.0, required=False)), truncate=True)
        out["rope_scale"] = float(meta(f"{arch}.rope.scaling.yarn_attn_factor", 0.0, required=False)
                                  or yarn_attention_factor(factor))
    elif scaling not in (None, "none", "longrope"):
        raise WeightLoadError(f"{path}: GGUF RoPE scaling {scaling!r} is not supported (supported: linear, yarn, "
                              "Phi-3's longrope factors, and Llama-3.1's rope_freqs)")
    longrope = ("rope_factors_short.weight", "rope_factors_long.weight")
    if any(name in tensors for name in longrope):
        if not all(name in tensors for name in longrope):
            raise WeightLoadError(f"{path}: longrope needs both GGUF tensors {longrope[0]!r} and {longrope[1]!r}")
        out.update(rope_freq_factors=vector(longrope[0]), rope_long_factors=vector(longrope[1]),
                   rope_original_context=int(meta(f"{arch}.rope.scaling.original_context_length")),
                   rope_scale=float(meta(f"{arch}.rope.scaling.attn_factor", 1.0)))
    elif scaling == "longrope":
        raise WeightLoadError(f"{path}: GGUF RoPE scaling 'longrope' without its rope_factors_short/long tensors")
    return out


def _gguf_sliding_layers(path: str, arch: str, default: Optional[int], meta: Callable, num_layers: int):
    """(sliding_window, layer_types) of LlamaConfig from `attention.sliding_window` (0, or the context's length:
    none) and `attention.sliding_window_pattern` (a flag per layer, or n: every n-th layer full); without a pattern
    the family's `default` (llama.cpp's: Gemma 3's 6, gpt-oss's 2), or every layer slides."""
    window = int(meta(f"{arch}.attention.sliding_window", 0))
    if window <= 0 or window >= int(meta(f"{arch}.context_length", 2048)):
        return None, None                   # (a window as long as the context is none: Phi-4-mini's 262144)
    pattern = meta(f"{arch}.attention.sliding_window_pattern", default, required=False)
    if pattern is None:
        return window, None
    if isinstance(pattern, list):
        kinds = tuple("sliding" if flag else "full" for flag in pattern)
    else:
        every = int(pattern)
        kinds = tuple("sliding" if every == 0 or i % every < every - 1 else "full" for i in range(num_layers))
    if len(kinds) != num_layers:
        raise WeightLoadError(f"{path}: GGUF {arch}.attention.sliding_window_pattern has {len(kinds)} flags for "
                              f"{num_layers} layers")
    if "sliding" not in kinds:
        return None, None
    return window, None if "full" not in kinds else kinds


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


def _blocks_tensor(blocks: np.ndarray, qtype: int, kind, region=None) -> StoredTensor:
    """A matrix read from its stored bytes (uint8 (rows, bytes per row), memory-mapped, read-only): read_blocks gives
    the rows asked for as a view of the map (no copy: the kernels read them, or their repacked copy, where they lie),
    read dequantizes them."""
    shape = (blocks.shape[0], _row_length(qtype, blocks.shape[1]))
    return StoredTensor(shape, _dequantizing_reader(blocks, qtype, shape), qtype,
                        lambda rows, b=blocks: b[rows].view(np.ndarray), kind, region)


def load_gguf(path: str) -> tuple[LlamaConfig, dict[str, StoredTensor]]:
    """`_load_gguf` through a cache of what it read: parsing a GGUF's metadata and dequantizing the tensors the
    kernels do not read as stored costs seconds of every start, memory-mapping last time's arrays almost nothing.
    The cache is `<cache>/gguf/<key>/` (key: the file's path, size and modification time): `config.json`, one
    float32 `.npy` per tensor the kernels do not read as stored (norms, types outside KEPT_QUANTIZED), and for the
    others (types in `quantized.json`) where their stored bytes lie in the file, memory-mapped from it at load
    (`regions.json`: no second copy of them on disk), or, for rows the reader reorders (q/k rows of the
    interleaved-RoPE architectures, put in rotate-half order), those bytes (`<name>.blocks.npy`); written into a
    temporary directory that is then renamed into place."""
    from dataclasses import asdict

    if os.environ.get(GGUF_CACHE_ENV, "1") == "0":
        return _load_gguf(path)
    folder = _cache_folder(path)
    if not (folder / "config.json").is_file():
        cfg, stored = _load_gguf(path)
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent)
            try:
                regions = {}
                for name, tensor in stored.items():
                    if tensor.region is not None:           # its bytes as they lie in the file: their place only
                        regions[name] = list(tensor.region)
                    elif tensor.read_blocks is not None:    # the stored bytes only: float32 is made from them
                        np.save(os.path.join(tmp, name + ".blocks.npy"), tensor.read_blocks(slice(None)))
                    else:
                        np.save(os.path.join(tmp, name + ".npy"),
                                np.ascontiguousarray(tensor.read((slice(None),) * len(tensor.shape)), np.float32))
                with open(os.path.join(tmp, "quantized.json"), "w", encoding="utf-8") as f:
                    json.dump({n: t.qtype for n, t in stored.items() if t.read_blocks is not None}, f)
                with open(os.path.join(tmp, "regions.json"), "w", encoding="utf-8") as f:
                    json.dump(regions, f)
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
    try:
        st = os.stat(folder / "config.json")
    except OSError as e:
        raise WeightLoadError(f"{path}: its cache entry {folder} went away while it was read: {e}") from e
    global _last_read
    key = (str(folder), st.st_ino, st.st_mtime_ns)
    if _last_read is None or _last_read[0] != key:
        _last_read = (key, *_read_cached(folder, path))
    return _last_read[1], dict(_last_read[2])        # (a dict of its own: a caller may add the tied lm_head)


# the last cache entry `load_gguf` read: (key, config, tensors). A load asks three times (the kernel's types, the
# matrices kept as stored, the rest as float32); mapping SmolLM2's 272 arrays once is 0.15 s of CPU.
_last_read: Optional[tuple] = None


def _read_cached(folder, path: str) -> tuple[LlamaConfig, dict[str, StoredTensor]]:
    """A cache entry's config and tensors, memory-mapped."""
    cfg = _cached_config(folder)
    with open(folder / "quantized.json", encoding="utf-8") as f:
        qtypes = json.load(f)
    with open(folder / "types.json", encoding="utf-8") as f:
        kinds = json.load(f)
    regions = {}
    if (folder / "regions.json").is_file():          # (a cache written before regions were kept has none)
        with open(folder / "regions.json", encoding="utf-8") as f:
            regions = json.load(f)
    stored = {}
    for name, (offset, rows, row_bytes) in regions.items():     # the file's own bytes, memory-mapped where they lie
        blocks = np.memmap(path, np.uint8, "r", offset, (rows, row_bytes))
        stored[name] = _blocks_tensor(blocks, qtypes[name], kinds.get(name), (offset, rows, row_bytes))
    for npy in folder.glob("*.npy"):
        name = npy.name[:-len(".npy")]
        if name.endswith(".blocks"):
            name = name[:-len(".blocks")]
            stored[name] = _blocks_tensor(np.load(npy, mmap_mode="r"), qtypes[name], kinds.get(name))
            continue
        array = np.load(npy, mmap_mode="r")
        stored[name] = StoredTensor(array.shape, lambda index, a=array: np.array(a[index]),
                                    stored_type=kinds.get(name))
    return cfg, stored


def gguf_config(path: str) -> LlamaConfig:
    """A GGUF's LlamaConfig from `load_gguf`'s cache alone (its config.json: none of the tensors' maps), which a
    first start fills. The master sizes a model's KV cache with it before every load."""
    if os.environ.get(GGUF_CACHE_ENV, "1") != "0":
        folder = _cache_folder(path)
        if (folder / "config.json").is_file():
            return _cached_config(folder)
    return load_gguf(path)[0]


def _cache_folder(path: str):
    """`load_gguf`'s cache folder of this file: keyed on its path, size and modification time."""
    from llm_serving.cache_dir import default_cache_dir

    st = os.stat(path)
    key = hashlib.sha1(repr((os.path.abspath(path), st.st_size, st.st_mtime_ns, 5)).encode()).hexdigest()[:16]
    return default_cache_dir() / "gguf" / key


def _cached_config(folder) -> LlamaConfig:
    with open(folder / "config.json", encoding="utf-8") as f:
        raw = json.load(f)
    return LlamaConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})


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
