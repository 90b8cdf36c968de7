"""A HuggingFace directory's config.json as the one LlamaConfig (`load_config`).

`load_config` reads config.json as transformers 4.x writes it (`rope_theta`, `rope_scaling`, `rope_local_base_freq`)
and as 5.x does (`rope_parameters`, per layer type for Gemma 3), into a LlamaConfig, the family's differences as data:
- LlamaForCausalLM (Llama-1/2/3, SmolLM2, ...), MistralForCausalLM (`sliding_window`: every layer);
- Qwen2ForCausalLM (q/k/v biases) and Qwen3ForCausalLM (q/k norms, explicit head_dim): `use_sliding_window` slides
  the layers from `max_window_layers` on (or those `layer_types` names);
- SmolLM3ForCausalLM: `no_rope_layers` (1 = the layer uses RoPE) or every `no_rope_layer_interval`-th layer NoPE;
- Qwen3MoeForCausalLM (Qwen3's attention, a mixture of experts in the layers `mlp_only_layers` leaves sparse) and
  MixtralForCausalLM (Mistral's attention, a mixture in every layer): `_experts`;
- GptOssForCausalLM: biases on q/k/v/o, attention sinks, sliding layers by `layer_types`, YaRN RoPE, a mixture in
  every layer with biases, top-k then softmax routing and its clamped SwiGLU;
- Phi3ForCausalLM (Phi-3, Phi-4-mini): `partial_rotary_factor`, longrope scaling, fused qkv_proj and gate_up_proj;
- Gemma3ForCausalLM and Gemma3ForConditionalGeneration's text model (`text_config`; the vision tower's tensors are
  not read): GeGLU, embeddings times sqrt(hidden), query_pre_attn_scalar, q/k norms and sandwich norms, sliding
  layers (`layer_types` or every 6th layer full) with their own RoPE base; its defaults where the config is silent;
- BERT encoders (`model_type: bert`: BertModel as sentence-transformers ships all-MiniLM and bge, or a head's
  checkpoint of one, BertForMaskedLM, ...): bidirectional, post-LayerNorm (`layer_norm_eps`), biases on every
  product, an ungated GELU MLP, learned absolute positions and token types, an embedding LayerNorm (`_bert`).
  nomic-bert (`nomic_bert`, rotary and SwiGLU, shipped as remote code) is refused by name.
Anything else fails naming the architecture; an option the model would compute wrong without (a RoPE type, an
activation, softcapping, biases) fails naming the option.
"""
from __future__ import annotations

import json
import math
import os
from typing import Optional

import numpy as np

from .common import LlamaConfig, WeightLoadError, first_id

__all__ = ["HF_ARCHITECTURES", "llama3_rope_factors", "load_config", "yarn_attention_factor", "yarn_rope_factors"]

# config.json "architectures" entry -> the family member's name; each is this one model with data differences
HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral",
                     "Qwen3ForCausalLM": "qwen3", "SmolLM3ForCausalLM": "smollm3", "Phi3ForCausalLM": "phi3",
                     "Gemma3ForCausalLM": "gemma3", "Gemma3ForConditionalGeneration": "gemma3",
                     "Qwen3MoeForCausalLM": "qwen3moe", "MixtralForCausalLM": "mixtral", "GptOssForCausalLM": "gptoss",
                     "BertModel": "bert"}
# config.json model_types that are BERT encoders whatever head the checkpoint names (BertForMaskedLM, ...)
_BERT_TYPES = ("bert",)
# BERT's hidden_act -> LlamaConfig.hidden_act (transformers' "gelu" is the exact, erf form)
_BERT_ACTS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
# what transformers' Gemma3TextConfig assumes for a key a config.json leaves out (Gemma 3 4B/12B/27B's text_config
# names only what differs from these)
_GEMMA3_DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
                    "bos_token_id": 2, "eos_token_id": 1, "tie_word_embeddings": True, "rope_theta": 1_000_000.0,
                    "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": 256, "sliding_window": 4096}
# the architectures whose config's sliding_window applies only with use_sliding_window
_OPTIONAL_WINDOW = ("qwen2", "qwen3", "qwen3moe", "smollm3")
_LAYER_TYPES = {"sliding_attention": "sliding", "full_attention": "full"}


def llama3_rope_factors(head_dim: int, theta: float, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_max_position_embeddings: int) -> tuple:
    """Llama-3.1's RoPE scaling as a divisor per frequency: long wavelengths are slowed by `factor`, short ones
    kept, the band between blended smoothly (transformers' `rope_type: llama3`, llama.cpp's rope_freqs).
    `head_dim`: the dimensions RoPE rotates."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)      # (D/2,)
    wavelen = 2 * np.pi / inv_freq
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    divisor = 1.0 / ((1.0 - smooth) / factor + smooth)                                     # blended band
    divisor = np.where(wavelen > low_wavelen, factor, divisor)                               # slowed
    divisor = np.where(wavelen < high_wavelen, 1.0, divisor)                                 # kept
    return tuple(float(v) for v in divisor)


def yarn_rope_factors(rotary: int, theta: float, factor: float, original_context: int, beta_fast: float = 32.0,
                      beta_slow: float = 1.0, truncate: bool = True) -> tuple:
    """YaRN's RoPE scaling as a divisor per frequency (transformers' `rope_type: yarn`): frequencies that turn more
    than `beta_fast` times over the original context are kept, those turning fewer than `beta_slow` times slowed by
    `factor`, a linear ramp between (its ends rounded outwards when `truncate`). `rotary`: the dimensions rotated."""
    def correction_dim(rotations: float) -> float:
        return rotary * math.log(original_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(rotary // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    kept = 1.0 - ramp                                          # the share of each frequency left unscaled
    return tuple(float(v) for v in 1.0 / ((1.0 - kept) / factor + kept))


def yarn_attention_factor(factor: float) -> float:
    """YaRN's default cos/sin multiplier (its mscale): 0.1 ln(factor) + 1, 1 when not extending."""
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def _rope_parameters(raw: dict) -> tuple[dict, Optional[dict]]:
    """(the full-attention layers' RoPE parameters, the sliding layers' own or None) in transformers 5.x's form, from
    a config.json of either form: 4.x's `rope_theta`, `rope_scaling`, `partial_rotary_factor` and Gemma's
    `rope_local_base_freq` moved into them."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        full, local = dict(params.get("full_attention") or {}), params.get("sliding_attention")
    else:
        full, local = dict(params or raw.get("rope_scaling") or {}), None
    if local is None and raw.get("rope_local_base_freq") is not None:
        local = {"rope_theta": raw["rope_local_base_freq"]}
    full.setdefault("rope_theta", raw.get("rope_theta"))
    full.setdefault("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if raw.get("original_max_position_embeddings"):     # (transformers prefers Phi-3's top-level value)
        full["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
    return full, local


def _rope_settings(raw: dict, path: str, head_dim: int) -> dict:
    """The LlamaConfig fields of the config's RoPE: rope_theta, rotary_dim, rope_freq_factors (llama3, linear,
    longrope's short factors), longrope's rope_long_factors / rope_original_context / rope_scale (its attention
    factor, as transformers' _compute_longrope_parameters), and the sliding layers' local_rope_theta."""
    full, local = _rope_parameters(raw)
    theta = float(full.get("rope_theta") or 10000.0)
    rotary = int(head_dim * float(full.get("partial_rotary_factor") or 1.0))
    out = {"rope_theta": theta, "rotary_dim": rotary if rotary != head_dim else None}
    kind = full.get("rope_type") or full.get("type") or "default"
    if kind == "linear":
        out["rope_freq_factors"] = (float(full["factor"]),) * (rotary // 2)
    elif kind == "llama3":
        try:
            out["rope_freq_factors"] = llama3_rope_factors(
                rotary, theta, float(full["factor"]), float(full["low_freq_factor"]), float(full["high_freq_factor"]),
                int(full["original_max_position_embeddings"]))
        except KeyError as e:
            raise WeightLoadError(f"{path}: llama3 RoPE scaling needs {e.args[0]!r}") from None
    elif kind in ("longrope", "su"):                      # ("su": Phi-3's first name for it)
        out.update(_longrope(full, raw, path, rotary))
    elif kind == "yarn":
        if full.get("mscale") or full.get("mscale_all_dim"):
            raise WeightLoadError(f"{path}: yarn RoPE scaling with mscale/mscale_all_dim is not supported")
        factor = float(full.get("factor") or 1.0)
        original = int(full.get("original_max_position_embeddings") or raw.get("max_position_embeddings", 2048))
        out["rope_freq_factors"] = yarn_rope_factors(rotary, theta, factor, original,
                                                     float(full.get("beta_fast") or 32.0),
                                                     float(full.get("beta_slow") or 1.0),
                                                     bool(full.get("truncate", True)))
        out["rope_scale"] = float(full.get("attention_factor") or yarn_attention_factor(factor))
    elif kind != "default":
        raise WeightLoadError(f"{path}: RoPE scaling type {kind!r} is not supported (supported: linear, llama3, "
                              "longrope, yarn)")
    if local is not None:
        local_kind = local.get("rope_type") or local.get("type") or "default"
        if local_kind != "default":
            raise WeightLoadError(f"{path}: RoPE scaling type {local_kind!r} on the sliding layers is not supported "
                                  "(their RoPE is unscaled)")
        out["local_rope_theta"] = float(local.get("rope_theta") or 10000.0)
    return out


def _longrope(params: dict, raw: dict, path: str, rotary: int) -> dict:
    """Phi-3's longrope: a divisor per frequency for contexts up to original_max_position_embeddings (short) and
    another beyond (long), and cos/sin multiplied by the attention factor (given, or from the extension ratio)."""
    original = params.get("original_max_position_embeddings") or raw.get("max_position_embeddings", 2048)
    try:
        short, long = [tuple(float(v) for v in params[key]) for key in ("short_factor", "long_factor")]
    except KeyError as e:
        raise WeightLoadError(f"{path}: longrope RoPE scaling needs {e.args[0]!r}") from None
    if len(short) != rotary // 2 or len(long) != rotary // 2:
        raise WeightLoadError(f"{path}: longrope short_factor and long_factor need {rotary // 2} values each (one per "
                              f"rotated frequency), got {len(short)} and {len(long)}")
    scale = params.get("attention_factor")
    if scale is None:
        factor = float(params.get("factor") or int(raw.get("max_position_embeddings", original)) / int(original))
        scale = math.sqrt(1 + math.log(factor) / math.log(int(original))) if factor > 1.0 else 1.0
    return {"rope_freq_factors": short, "rope_long_factors": long, "rope_original_context": int(original),
            "rope_scale": float(scale)}


def _sliding_layers(raw: dict, arch: str, num_layers: int, path: str) -> tuple[Optional[int], Optional[tuple]]:
    """(sliding_window, layer_types) of LlamaConfig: None, None when no layer slides (a window as long as the
    model's context is none: Phi-4-mini's 262144); layer_types None when all do."""
    window = raw.get("sliding_window")
    if arch == "llama" or (arch in _OPTIONAL_WINDOW and not raw.get("use_sliding_window", False)):
        window = None                           # (Qwen2 configs name a window they do not use; LLaMA has none)
    if not window or int(window) >= int(raw.get("max_position_embeddings", 2048)):
        return None, None
    types = raw.get("layer_types") if arch not in ("mistral", "mixtral", "phi3") else None     # (every layer)
    if types is None and arch == "gemma3":
        every = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(num_layers)]
    elif types is None and arch == "smollm3":   # (transformers: the NoPE layers slide)
        nope = _nope_layers(raw, arch, num_layers, path)
        types = ["sliding_attention" if i in nope else "full_attention" for i in range(num_layers)]
    elif types is None and arch in ("qwen2", "qwen3", "qwen3moe"):
        first = int(raw.get("max_window_layers", 28))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    elif types is None:
        return int(window), None
    unknown = sorted(set(types) - set(_LAYER_TYPES))
    if unknown or len(types) != num_layers:
        raise WeightLoadError(f"{path}: layer_types must name sliding_attention or full_attention for each of the "
                              f"{num_layers} layers; got {types}")
    kinds = tuple(_LAYER_TYPES[t] for t in types)
    if "sliding" not in kinds:
        return None, None
    return int(window), None if "full" not in kinds else kinds


def _nope_layers(raw: dict, arch: str, num_layers: int, path: str) -> tuple:
    """The layers without RoPE: SmolLM3's `no_rope_layers` flags (1: the layer uses RoPE) or, without them, every
    `no_rope_layer_interval`-th layer (transformers' rule)."""
    if arch != "smollm3":
        return ()
    flags = raw.get("no_rope_layers")
    if flags is None:
        every = int(raw.get("no_rope_layer_interval", 4))
        return tuple(i for i in range(num_layers) if (i + 1) % every == 0)
    if len(flags) != num_layers:
        raise WeightLoadError(f"{path}: no_rope_layers has {len(flags)} entries for {num_layers} layers")
    return tuple(i for i, uses_rope in enumerate(flags) if not uses_rope)


def _refuse_unsupported(raw: dict, arch: str, path: str) -> str:
    """The activation (LlamaConfig.hidden_act); a WeightLoadError naming any option this model cannot compute."""
    if arch == "gemma3":
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if raw.get(key) is not None:
                raise WeightLoadError(f"{path}: {key}={raw[key]} is not supported (softcapping is not computed)")
        if raw.get("use_bidirectional_attention"):
            raise WeightLoadError(f"{path}: use_bidirectional_attention=true is not supported (a causal model only)")
        act = raw.get("hidden_activation")
        if act != "gelu_pytorch_tanh":
            raise WeightLoadError(f"{path}: hidden_activation={act!r} is not supported (only gelu_pytorch_tanh)")
        act = "gelu_tanh"
    else:
        act = raw.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise WeightLoadError(f"{path}: hidden_act={act!r} is not supported (only silu)")
        act = "silu"
    if arch in ("llama", "smollm3") and (raw.get("attention_bias") or raw.get("mlp_bias")):
        raise WeightLoadError(f"{path}: attention_bias/mlp_bias (o_proj or MLP biases) are not supported for "
                              f"{arch}; only Qwen2's q/k/v biases are")
    if arch == "gptoss" and not raw.get("attention_bias", True):
        raise WeightLoadError(f"{path}: attention_bias=false is not supported for gpt-oss (its projections have "
                              "biases)")
    if arch in ("qwen3", "qwen3moe", "gemma3", "mixtral") and raw.get("attention_bias"):
        raise WeightLoadError(f"{path}: attention_bias=true (q/k/v/o biases) is not supported for {arch}")
    return act


def _experts(raw: dict, arch: str, num_layers: int, path: str) -> dict:
    """The LlamaConfig fields of a mixture of experts (none for a dense model): Qwen3-MoE's `num_experts` (5.x:
    `num_local_experts`), `moe_intermediate_size`, `norm_topk_prob` and its dense layers (`mlp_only_layers`, and
    those off `decoder_sparse_step`, as transformers builds them); Mixtral's `num_local_experts` of
    `intermediate_size` units, always renormalized; gpt-oss's likewise, with biases and its clamped SwiGLU
    (`swiglu_alpha`, `swiglu_limit`)."""
    if arch not in ("qwen3moe", "mixtral", "gptoss"):
        return {}
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    if experts < 1:
        raise WeightLoadError(f"{path}: a {arch} config needs num_experts (or num_local_experts) of at least 1")
    out = {"num_experts": experts, "experts_per_token": int(raw.get("num_experts_per_tok") or 0)}
    if arch == "mixtral":
        return {**out, "expert_intermediate_size": int(raw["intermediate_size"]), "norm_topk_prob": True}
    if arch == "gptoss":                # (top-k of the logits, then their softmax: the renormalized form)
        return {**out, "expert_intermediate_size": int(raw["intermediate_size"]), "norm_topk_prob": True,
                "moe_bias": True, "expert_act": "swiglu_oai", "swiglu_alpha": float(raw.get("swiglu_alpha", 1.702)),
                "swiglu_limit": float(raw.get("swiglu_limit", 7.0))}
    step = int(raw.get("decoder_sparse_step") or 1)
    only = {int(i) for i in raw.get("mlp_only_layers") or ()}
    dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
    if "moe_intermediate_size" not in raw:
        raise WeightLoadError(f"{path}: missing key 'moe_intermediate_size'")
    return {**out, "expert_intermediate_size": int(raw["moe_intermediate_size"]),
            "norm_topk_prob": bool(raw.get("norm_topk_prob", False)), "dense_layers": dense}


def _text_config(raw: dict, arch: str) -> dict:
    """The config of the text model: a multimodal config's `text_config` (with the outer config's token ids), over
    transformers' Gemma 3 defaults for a Gemma 3."""
    text = raw
    if isinstance(raw.get("text_config"), dict):
        outer = {k: raw[k] for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings") if k in raw}
        text = {**outer, **raw["text_config"], "architectures": raw.get("architectures")}
    return {**_GEMMA3_DEFAULTS, **text} if arch == "gemma3" else text


def _bert(raw: dict, path: str) -> LlamaConfig:
    """A BERT encoder's LlamaConfig: every difference from LLaMA switched (LlamaConfig's encoder fields); an option
    it would compute wrong without (relative positions, a decoder, another activation) fails naming it."""
    kind = raw.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise WeightLoadError(f"{path}: position_embedding_type={kind!r} is not supported (only absolute)")
    if raw.get("is_decoder") or raw.get("add_cross_attention"):
        raise WeightLoadError(f"{path}: a BERT decoder (is_decoder / add_cross_attention) is not supported; only "
                              "the bidirectional encoder")
    act = raw.get("hidden_act", "gelu")
    if act not in _BERT_ACTS:
        raise WeightLoadError(f"{path}: hidden_act={act!r} is not supported for bert (supported: "
                              f"{', '.join(_BERT_ACTS)})")
    try:
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        return LlamaConfig(
            vocab_size=int(raw["vocab_size"]), hidden_size=hidden, intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]), num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
            rms_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 512)), bos_token_id=None,
            eos_token_id=None, architecture="bert", attention_bias=True, o_bias=True, causal=False, norm="layer",
            post_norm=True, gated_mlp=False, mlp_bias=True, hidden_act=_BERT_ACTS[act], learned_positions=True,
            type_vocab_size=int(raw.get("type_vocab_size", 2)), embed_norm=True)
    except KeyError as e:
        raise WeightLoadError(f"{path}: missing key {e.args[0]!r}") from None


def load_config(model_dir: str) -> LlamaConfig:
    """The LlamaConfig of a HuggingFace directory's config.json (the architectures above); anything else fails
    naming the architecture, an option the model does not compute naming the option."""
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, "r", encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise WeightLoadError(f"{path}: config.json not found (expected a HuggingFace LLaMA directory)") from None
    except json.JSONDecodeError as e:
        raise WeightLoadError(f"{path}: invalid JSON: {e}") from None
    if raw.get("model_type") in _BERT_TYPES:
        return _bert(raw, path)
    if raw.get("model_type") == "nomic_bert":
        raise WeightLoadError(f"{path}: nomic_bert (rotary, SwiGLU; its modelling code ships with the checkpoint) is "
                              "not supported; BERT encoders (model_type bert: all-MiniLM, bge, ...) are")
    names = raw.get("architectures") or ["LlamaForCausalLM"]
    arch = HF_ARCHITECTURES.get(names[0])
    if arch is None:
        raise WeightLoadError(f"{path}: architecture {names[0]!r} is not supported (supported: "
                              f"{', '.join(HF_ARCHITECTURES)})")
    if arch == "bert":
        return _bert(raw, path)
    raw = _text_config(raw, arch)

    def need(key):
        if key not in raw:
            raise WeightLoadError(f"{path}: missing key {key!r}")
        return raw[key]

    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    head_dim = int(raw.get("head_dim") or hidden // heads)
    num_layers = int(need("num_hidden_layers"))
    if heads % kv_heads != 0:
        raise WeightLoadError(f"{path}: num_attention_heads={heads} not divisible by num_key_value_heads={kv_heads}")
    if head_dim % 2 != 0:
        raise WeightLoadError(f"{path}: head_dim={head_dim} must be even for rotary embeddings")
    act = _refuse_unsupported(raw, arch, path)
    rope = _rope_settings(raw, path, head_dim)
    window, layer_types = _sliding_layers(raw, arch, num_layers, path)
    if window is None:
        rope.pop("local_rope_theta", None)      # (no sliding layer to use it)
    gemma = arch == "gemma3"
    return LlamaConfig(
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        bos_token_id=first_id(raw.get("bos_token_id", 1)),
        eos_token_id=first_id(raw.get("eos_token_id", 2)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", arch == "smollm3")),
        architecture=arch,
        attention_bias=arch in ("qwen2", "gptoss"),
        o_bias=arch == "gptoss",
        attention_sinks=arch == "gptoss",
        sliding_window=window,
        layer_types=layer_types,
        qk_norm=arch in ("qwen3", "qwen3moe", "gemma3"),
        sandwich_norms=gemma,
        embed_scale=math.sqrt(hidden) if gemma else 1.0,
        hidden_act=act,
        query_scale=float(raw["query_pre_attn_scalar"]) ** -0.5 if gemma else None,
        nope_layers=_nope_layers(raw, arch, num_layers, path),
        **_experts(raw, arch, num_layers, path),
        **rope,
    )
