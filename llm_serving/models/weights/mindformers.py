"""MindFormers checkpoints: a directory with one `*.ckpt` (read whole with `mindspore.load_checkpoint`; names like
`model.layers.0.attention.wq.weight`, optionally fused `attention.w_qkv` and `feed_forward.w_gate_hidden`) and
either a `config.json` or a MindFormers `*.yaml` (`model.model_config`). MindFormers keeps HF's rotate-half
layout, so no permutation.
"""
from __future__ import annotations

import glob
import os
from typing import Optional

import numpy as np

from .common import LlamaConfig, StoredTensor, WeightLoadError, check_shape, first_id
from .hf_config import load_config

__all__ = ["load_mindformers", "mindformers_dir_config"]

_MF_RENAMES = (  # MindFormers name fragment -> HF fragment, applied in order
    ("model.tok_embeddings.embedding_weight", "model.embed_tokens.weight"),
    ("model.norm_out.", "model.norm."),
    (".attention.wq.", ".self_attn.q_proj."), (".attention.wk.", ".self_attn.k_proj."),
    (".attention.wv.", ".self_attn.v_proj."), (".attention.wo.", ".self_attn.o_proj."),
    (".attention_norm.", ".input_layernorm."), (".ffn_norm.", ".post_attention_layernorm."),
    (".feed_forward.w1.", ".mlp.gate_proj."), (".feed_forward.w3.", ".mlp.up_proj."),
    (".feed_forward.w2.", ".mlp.down_proj."),
)


def _mindformers_config(path: str) -> LlamaConfig:
    """LlamaConfig from a MindFormers yaml's `model.model_config` section."""
    import yaml

    try:
        with open(path, "r", encoding="utf-8") as f:
            raw = (yaml.safe_load(f) or {}).get("model", {}).get("model_config")
    except (yaml.YAMLError, AttributeError) as e:
        raise WeightLoadError(f"{path}: not a MindFormers model yaml ({e})") from None
    if not isinstance(raw, dict):
        raise WeightLoadError(f"{path}: no model.model_config section")

    def need(key):
        if raw.get(key) is None:
            raise WeightLoadError(f"{path}: model.model_config.{key} is missing")
        return int(raw[key])

    hidden, heads = need("hidden_size"), need("num_heads")
    kv_heads = int(raw.get("n_kv_heads") or heads)
    inter = raw.get("intermediate_size")
    if inter is None:   # LLaMA's rule: 2/3 of 4*hidden, times ffn_dim_multiplier, rounded up to multiple_of
        multiple_of = int(raw.get("multiple_of", 256))
        inter = int(2 * 4 * hidden / 3)
        if raw.get("ffn_dim_multiplier") is not None:
            inter = int(float(raw["ffn_dim_multiplier"]) * inter)
        inter = multiple_of * ((inter + multiple_of - 1) // multiple_of)
    if heads % kv_heads or (hidden // heads) % 2:
        raise WeightLoadError(f"{path}: num_heads={heads}, n_kv_heads={kv_heads}, hidden_size={hidden} "
                              "are inconsistent")
    return LlamaConfig(vocab_size=need("vocab_size"), hidden_size=hidden, intermediate_size=int(inter),
                       num_layers=need("num_layers"), num_heads=heads, num_kv_heads=kv_heads,
                       head_dim=hidden // heads, rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
                       rope_theta=float(raw.get("theta", 10000.0)),
                       max_position_embeddings=int(raw.get("max_position_embedding") or raw.get("seq_length")
                                                   or 2048),
                       bos_token_id=first_id(raw.get("bos_token_id", 1)),
                       eos_token_id=first_id(raw.get("eos_token_id", 2)),
                       tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)))


def _one(pattern: str, what: str) -> Optional[str]:
    found = sorted(glob.glob(pattern))
    if len(found) > 1:
        raise WeightLoadError(f"{os.path.dirname(pattern)}: {len(found)} {what} files ({', '.join(map(os.path.basename, found))}); "
                              "expected one")
    return found[0] if found else None


def mindformers_dir_config(model_dir: str) -> LlamaConfig:
    """The LlamaConfig of a MindFormers directory: its config.json, else its one MindFormers *.yaml."""
    if os.path.exists(os.path.join(model_dir, "config.json")):
        return load_config(model_dir)
    yaml_path = _one(os.path.join(model_dir, "*.yaml"), "yaml") or _one(os.path.join(model_dir, "*.yml"), "yaml")
    if yaml_path is None:
        raise WeightLoadError(f"{model_dir}: a MindFormers checkpoint needs a config.json or a MindFormers "
                              "*.yaml next to it")
    return _mindformers_config(yaml_path)


def load_mindformers(path: str) -> tuple[LlamaConfig, dict[str, StoredTensor]]:
    """The config and tensors of a MindFormers checkpoint, renamed to HF names and fused projections split.
    (MindSpore's load_checkpoint reads the whole file: a tensor-parallel rank cuts its part afterwards.)"""
    model_dir = path if os.path.isdir(path) else os.path.dirname(path)
    ckpt = path if os.path.isfile(path) else _one(os.path.join(model_dir, "*.ckpt"), "checkpoint (*.ckpt)")
    cfg = mindformers_dir_config(model_dir)
    import mindspore as ms

    try:
        params = ms.load_checkpoint(ckpt)
    except Exception as e:
        raise WeightLoadError(f"{ckpt}: cannot read MindSpore checkpoint: {e}") from e
    floats = (ms.float16, ms.float32, ms.float64, ms.bfloat16)
    out: dict[str, np.ndarray] = {}
    for name, param in params.items():
        if not (name.startswith("model.") or name.startswith("lm_head.")):
            continue   # optimizer state, step counters, ...
        if param.dtype not in floats:
            raise WeightLoadError(f"tensor {name!r} in {ckpt} has dtype {param.dtype}; expected a float type")
        arr = (ms.ops.cast(param, ms.float32) if param.dtype == ms.bfloat16 else param).asnumpy()
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        hf = name
        for old, new in _MF_RENAMES:
            hf = hf.replace(old, new)
        out[hf] = arr
    d, nh, kvh, inter = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    for i in range(cfg.num_layers):   # fused projections (qkv_concat) are split back into HF tensors
        p = f"model.layers.{i}."
        fused = out.pop(p + "attention.w_qkv.weight", None)
        if fused is not None:
            check_shape(p + "attention.w_qkv.weight", fused,
                         ((nh + 2 * kvh) * d, cfg.hidden_size))
            q, k, v = np.split(fused, [nh * d, (nh + kvh) * d])
            out.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                        p + "self_attn.v_proj.weight": v})
        fused = out.pop(p + "feed_forward.w_gate_hidden.weight", None)
        if fused is not None:
            check_shape(p + "feed_forward.w_gate_hidden.weight", fused, (2 * inter, cfg.hidden_size))
            out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = np.split(fused, [inter])
    return cfg, {k: StoredTensor.of(v) for k, v in out.items()}

