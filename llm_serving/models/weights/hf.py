"""HuggingFace checkpoints: a directory with `config.json` (`load_config`: LlamaForCausalLM, Qwen2ForCausalLM,
MistralForCausalLM, their differences kept as data in `LlamaConfig`) and `model.safetensors` or shards listed in
`model.safetensors.index.json` (`stored_safetensors`). F16/F32/F64 read with `safetensors`; BF16 (no numpy dtype)
widened to float32 by hand. Embeddings tied (`tie_word_embeddings`, or no `lm_head.weight`) or not.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Callable, Optional

import numpy as np

from .common import LlamaConfig, StoredTensor, WeightLoadError, expected_shapes, first_id

__all__ = ["llama3_rope_factors", "load_config", "load_hf", "stored_safetensors"]

# config.json "architectures" entry -> the family member's name; each is this one model with data differences
_HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}


def llama3_rope_factors(head_dim: int, theta: float, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_max_position_embeddings: int) -> tuple:
    """Llama-3.1's RoPE scaling as a divisor per frequency: long wavelengths are slowed by `factor`, short ones
    kept, the band between blended smoothly (transformers' `rope_type: llama3`, llama.cpp's rope_freqs)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)      # (D/2,)
    wavelen = 2 * np.pi / inv_freq
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    divisor = 1.0 / ((1.0 - smooth) / factor + smooth)                                     # blended band
    divisor = np.where(wavelen > low_wavelen, factor, divisor)                               # slowed
    divisor = np.where(wavelen < high_wavelen, 1.0, divisor)                                 # kept
    return tuple(float(v) for v in divisor)


def _rope_settings(raw: dict, path: str, head_dim: int) -> tuple[float, Optional[tuple]]:
    """(rope_theta, rope_freq_factors) from a config.json as transformers 4.x writes it (`rope_theta`,
    `rope_scaling`) or 5.x (`rope_parameters` with `rope_type` and `rope_theta`)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:    # 5.x per-layer-type form
        params = params["full_attention"]
    scaling = params if isinstance(params, dict) else raw.get("rope_scaling")
    theta = float((params or {}).get("rope_theta") or raw.get("rope_theta") or 10000.0)
    if not scaling:
        return theta, None
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, (float(scaling["factor"]),) * (head_dim // 2)
    if kind == "llama3":
        try:
            return theta, llama3_rope_factors(head_dim, theta, float(scaling["factor"]),
                                              float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"]),
                                              int(scaling["original_max_position_embeddings"]))
        except KeyError as e:
            raise WeightLoadError(f"{path}: llama3 RoPE scaling needs {e.args[0]!r}") from None
    raise WeightLoadError(f"{path}: RoPE scaling type {kind!r} is not supported (supported: llama3, linear)")


def load_config(model_dir: str) -> LlamaConfig:
    """The LlamaConfig of a HuggingFace directory's config.json: LlamaForCausalLM (Llama-1/2/3, SmolLM2, ...),
    Qwen2ForCausalLM (q/k/v biases), MistralForCausalLM. Anything else fails naming the architecture."""
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

    names = raw.get("architectures") or ["LlamaForCausalLM"]
    arch = _HF_ARCHITECTURES.get(names[0])
    if arch is None:
        raise WeightLoadError(f"{path}: architecture {names[0]!r} is not supported (supported: "
                              f"{', '.join(_HF_ARCHITECTURES)})")
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
    if arch == "llama" and (raw.get("attention_bias") or raw.get("mlp_bias")):
        raise WeightLoadError(f"{path}: a LLaMA with attention_bias/mlp_bias (o_proj or MLP biases) is not "
                              "supported; only Qwen2's q/k/v biases are")
    theta, factors = _rope_settings(raw, path, head_dim)
    window = raw.get("sliding_window")
    if arch == "qwen2" and not raw.get("use_sliding_window", False):
        window = None                       # Qwen2 configs name a window they do not use
    return LlamaConfig(
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        bos_token_id=first_id(raw.get("bos_token_id", 1)),
        eos_token_id=first_id(raw.get("eos_token_id", 2)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        architecture=arch,
        attention_bias=arch == "qwen2",
        rope_freq_factors=factors,
        sliding_window=int(window) if window else None,
    )



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


def _safetensors_header(fpath: str) -> tuple[int, dict]:
    """(header length, header) of a safetensors file: each tensor's dtype, shape and data offsets."""
    with open(fpath, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        return header_len, json.loads(f.read(header_len))


def _bf16_reader(fpath: str, header_len: int, info: dict) -> Callable[[tuple], np.ndarray]:
    """read(index) of one BF16 tensor (numpy has no bfloat16): the file is memory-mapped as uint16 for the
    read only, and just the selected part is widened to float32 (a bfloat16 is the top half of a float32)."""
    def read(index: tuple) -> np.ndarray:
        offset = 8 + header_len + info["data_offsets"][0]
        raw = np.memmap(fpath, dtype="<u2", mode="r", offset=offset, shape=tuple(info["shape"]))
        return (np.asarray(raw[index]).astype(np.uint32) << 16).view(np.float32)
    return read


_FLOAT_SAFETENSORS = ("F16", "BF16", "F32", "F64")


def stored_safetensors(files: dict[str, str], wanted: set[str]) -> dict[str, StoredTensor]:
    """Every wanted tensor of the files, unread: `safetensors` slices (reading only the part asked for),
    BF16 through a memory map. A non-float dtype fails here, before anything is read."""
    from safetensors import safe_open

    by_file: dict[str, Optional[list[str]]] = {}
    if "" in files:  # single file: take whatever it holds
        by_file[files[""]] = None
    else:
        for name, fpath in files.items():
            if name in wanted:
                by_file.setdefault(fpath, []).append(name)  # type: ignore[union-attr]
    out: dict[str, StoredTensor] = {}
    for fpath, names in by_file.items():
        try:
            f = safe_open(fpath, framework="np")      # the slices keep the file open until they are dropped
            header = None
            for name in (f.keys() if names is None else names):
                if name not in wanted:
                    continue
                part = f.get_slice(name)
                dtype = part.get_dtype()
                if dtype not in _FLOAT_SAFETENSORS:
                    raise WeightLoadError(f"tensor {name!r} in {fpath} has dtype {dtype}; expected a float "
                                          f"type ({', '.join(_FLOAT_SAFETENSORS)})")
                if dtype == "BF16":
                    header = header or _safetensors_header(fpath)
                    read = _bf16_reader(fpath, header[0], header[1][name])
                else:
                    read = lambda index, part=part: part[index]         # noqa: E731
                out[name] = StoredTensor(tuple(part.get_shape()), read)
        except WeightLoadError:
            raise
        except Exception as e:  # corrupt / unreadable file
            raise WeightLoadError(f"{fpath}: cannot read safetensors file: {e}") from e
    return out


def load_hf(model_dir: str) -> tuple[LlamaConfig, dict[str, StoredTensor]]:
    """The config and tensors (not read yet) of a HuggingFace directory."""
    cfg = load_config(model_dir)
    return cfg, stored_safetensors(_shard_files(model_dir), set(expected_shapes(cfg)))

