"""Load a HuggingFace LLaMA checkpoint directory into numpy float32 arrays.

Supported layouts: `config.json` plus either `model.safetensors` or sharded
`model-0000x-of-0000y.safetensors` files listed in `model.safetensors.index.json`.
Embeddings may be tied (`tie_word_embeddings: true`, or simply no `lm_head.weight`).
Tensors stored as F32/F16/F64 are read with `safetensors`; BF16 (which numpy cannot
represent) is widened to float32 by hand.

Returned names are the HF names with the `model.` prefix kept, e.g.
`model.layers.0.self_attn.q_proj.weight`; `lm_head.weight` is always present.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Optional

import numpy as np

__all__ = ["LlamaConfig", "WeightLoadError", "load_config", "load_llama_weights", "expected_shapes"]


class WeightLoadError(ValueError):
    """A checkpoint file or tensor is missing, unreadable or has the wrong shape; the message names it."""


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    bos_token_id: Optional[int] = 1
    eos_token_id: Optional[int] = 2
    tie_word_embeddings: bool = False


def _first_id(value) -> Optional[int]:
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def load_config(model_dir: str) -> LlamaConfig:
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, "r", encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise WeightLoadError(f"{path}: config.json not found (expected a HuggingFace LLaMA directory)") from None
    except json.JSONDecodeError as e:
        raise WeightLoadError(f"{path}: invalid JSON: {e}") from None

    def need(key):
        if key not in raw:
            raise WeightLoadError(f"{path}: missing key {key!r}")
        return raw[key]

    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    head_dim = int(raw.get("head_dim") or hidden // heads)
    if heads % kv_heads != 0:
        raise WeightLoadError(f"{path}: num_attention_heads={heads} not divisible by num_key_value_heads={kv_heads}")
    if head_dim % 2 != 0:
        raise WeightLoadError(f"{path}: head_dim={head_dim} must be even for rotary embeddings")
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise WeightLoadError(f"{path}: hidden_act={act!r} is not supported (only silu)")
    rope_scaling = raw.get("rope_scaling")
    if rope_scaling not in (None, {}):
        raise WeightLoadError(f"{path}: rope_scaling={rope_scaling!r} is not supported")
    return LlamaConfig(
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        bos_token_id=_first_id(raw.get("bos_token_id", 1)),
        eos_token_id=_first_id(raw.get("eos_token_id", 2)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
    )


def expected_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs (HF names) and its shape."""
    h, d = cfg.hidden_size, cfg.head_dim
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,),
              "lm_head.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (cfg.num_heads * d, h)
        shapes[p + "self_attn.k_proj.weight"] = (cfg.num_kv_heads * d, h)
        shapes[p + "self_attn.v_proj.weight"] = (cfg.num_kv_heads * d, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, cfg.num_heads * d)
        shapes[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, cfg.intermediate_size)
    return shapes


def _shard_files(model_dir: str) -> dict[str, str]:
    """Map tensor name -> safetensors file path (for index-less single files: name -> that file, filled lazily)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(index):
        try:
            with open(index, "r", encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise WeightLoadError(f"{index}: not a valid safetensors index ({e})") from None
        out = {}
        for name, fname in weight_map.items():
            fpath = os.path.join(model_dir, fname)
            if not os.path.exists(fpath):
                raise WeightLoadError(f"{fpath}: shard listed in the index (for tensor {name!r}) is missing")
            out[name] = fpath
        return out
    if os.path.exists(single):
        return {"": single}
    raise WeightLoadError(f"{model_dir}: neither model.safetensors nor model.safetensors.index.json found")


def _read_bf16(fpath: str, name: str) -> np.ndarray:
    """Read one BF16 tensor straight from the safetensors layout and widen it to float32."""
    with open(fpath, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        info = header[name]
        start, end = info["data_offsets"]
        f.seek(8 + header_len + start)
        raw = np.frombuffer(f.read(end - start), dtype="<u2")
    return (raw.astype(np.uint32) << 16).view(np.float32).reshape(info["shape"])


def _load_all(files: dict[str, str], wanted: set[str]) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    if "" in files:  # single file: take whatever it holds
        by_file[files[""]] = None  # type: ignore[assignment]
    else:
        for name, fpath in files.items():
            if name in wanted:
                by_file.setdefault(fpath, []).append(name)
    out: dict[str, np.ndarray] = {}
    for fpath, names in by_file.items():
        try:
            with safe_open(fpath, framework="np") as f:
                keys = list(f.keys()) if names is None else names
                for name in keys:
                    if name not in wanted:
                        continue
                    if f.get_slice(name).get_dtype() == "BF16":
                        arr = _read_bf16(fpath, name)
                    else:
                        arr = f.get_tensor(name)
                    out[name] = np.ascontiguousarray(arr, dtype=np.float32)
        except WeightLoadError:
            raise
        except Exception as e:  # corrupt / unreadable file
            raise WeightLoadError(f"{fpath}: cannot read safetensors file: {e}") from e
    return out


def load_llama_weights(model_dir: str) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """Return (config, {hf_name: float32 array}) with shapes checked; `lm_head.weight` filled if tied."""
    cfg = load_config(model_dir)
    shapes = expected_shapes(cfg)
    tensors = _load_all(_shard_files(model_dir), set(shapes))
    if "lm_head.weight" not in tensors or cfg.tie_word_embeddings:
        if "model.embed_tokens.weight" in tensors:
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    for name, shape in shapes.items():
        if name not in tensors:
            raise WeightLoadError(f"tensor {name!r} is missing from the checkpoint in {model_dir} "
                                  f"(expected shape {shape})")
        if tuple(tensors[name].shape) != shape:
            raise WeightLoadError(f"tensor {name!r} has shape {tuple(tensors[name].shape)}, expected {shape}")
    return cfg, tensors
