"""A HuggingFace directory's config.json as the one LlamaConfig (`load_config`).

`load_config` reads config.json as transformers 4.x writes it (`rope_theta`, `rope_scaling`, `rope_local_base_freq`)
and as 5.x does (`rope_parameters`, per layer type for Gemma 3), into a LlamaConfig, the family's differences as data.
Which family a config is, and what that family reads, fixes and refuses, is the family's (`models/families/`: its
`architectures` or model_type, its sliding-window rule, its NoPE layers, its experts, its defaults, its whole config
for an encoder); this module reads what every family shares: the shape, RoPE and its scaling (llama3, linear,
Phi-3's longrope, YaRN as a divisor per frequency), the sliding layers by the family's rule, a multimodal config's
text model (`text_config`; the vision tower's tensors are not read).
Anything else fails naming the architecture; an option the model would compute wrong without (a RoPE type, an
activation, softcapping, biases) fails naming the option.
"""
from __future__ import annotations

import json
import math
import os
from typing import Optional

import numpy as np

from .. import families
from .common import LlamaConfig, WeightLoadError, first_id

__all__ = ["llama3_rope_factors", "load_config", "yarn_attention_factor", "yarn_rope_factors"]

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
    if full.get("mrope_section") is not None or full.get("type") == "mrope":    # (Qwen2.5-VL's: 4.x names the type
        try:                                                                      # mrope, 5.x keeps rope_type default)
            out["mrope_section"] = tuple(int(v) for v in full["mrope_section"])
        except (KeyError, TypeError, ValueError):
            raise WeightLoadError(f"{path}: mrope RoPE needs mrope_section (three lengths)") from None
        kind = "default" if kind == "mrope" else kind
        out["mrope_interleaved"] = bool(full.get("mrope_interleaved"))               # (Qwen3-VL's)
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


def _sliding_layers(raw: dict, family: families.Family, num_layers: int,
                    path: str) -> tuple[Optional[int], Optional[tuple]]:
    """(sliding_window, layer_types) of LlamaConfig by the family's window rule: None, None when no layer slides (a
    window as long as the model's context is none: Phi-4-mini's 262144); layer_types None when all do."""
    window = raw.get("sliding_window")
    if family.window == "none" or (family.window == "optional" and not raw.get("use_sliding_window", False)):
        window = None
    if not window or int(window) >= int(raw.get("max_position_embeddings", 2048)):
        return None, None
    types = raw.get("layer_types") if family.window != "always" else None
    if types is None and family.sliding_layers is not None:
        types = family.sliding_layers(raw, num_layers, path)
    if types is None:
        return int(window), None
    unknown = sorted(set(types) - set(_LAYER_TYPES))
    if unknown or len(types) != num_layers:
        raise WeightLoadError(f"{path}: layer_types must name sliding_attention or full_attention for each of the "
                              f"{num_layers} layers; got {types}")
    kinds = tuple(_LAYER_TYPES[t] for t in types)
    if "sliding" not in kinds:
        return None, None
    return int(window), None if "full" not in kinds else kinds


def _activation(raw: dict, family: families.Family, path: str) -> str:
    """The activation (LlamaConfig.hidden_act); a WeightLoadError naming any option the family refuses or an
    activation it does not compute."""
    def refuse(before_activation: bool):
        refused = family.refusal(raw, before_activation)
        if refused:
            raise WeightLoadError(f"{path}: {refused}")

    refuse(before_activation=True)
    key, accepted = family.activation_key, family.activations
    act = raw.get(key, accepted[0])
    if act not in accepted:
        raise WeightLoadError(f"{path}: {key}={act!r} is not supported (only {accepted[0]})")
    refuse(before_activation=False)
    return family.hidden_act


def _experts(raw: dict, family: families.Family, num_layers: int, path: str) -> dict:
    """The LlamaConfig fields of a mixture of experts (none for a dense family): `num_experts` (or
    `num_local_experts`), `num_experts_per_tok`, and the family's own (its experts' size, routing, dense layers)."""
    if family.experts is None:
        return {}
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    if experts < 1:
        raise WeightLoadError(f"{path}: a {family.name} config needs num_experts (or num_local_experts) of at least 1")
    return {"num_experts": experts, "experts_per_token": int(raw.get("num_experts_per_tok") or 0),
            **family.experts(raw, num_layers, path)}


# transformers' LlamaConfig defaults, which a nested Llama text_config leaves to them (the Hub's llava-hf LLaVA 1.5
# files name little more than the vocabulary and the context)
_LLAMA_TEXT_DEFAULTS = {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                        "num_attention_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
                        "rope_theta": 10000.0, "vocab_size": 32000}


def _text_config(raw: dict, family: families.Family) -> dict:
    """The config of the text model: a multimodal config's `text_config` (with the outer config's token ids; a Llama
    one's silent keys LlamaConfig's defaults), over the family's defaults (transformers' for Gemma 3)."""
    text = raw
    if isinstance(raw.get("text_config"), dict):
        outer = {k: raw[k] for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings") if k in raw}
        nested = raw["text_config"]
        defaults = _LLAMA_TEXT_DEFAULTS if nested.get("model_type") == "llama" else {}
        text = {**defaults, **outer, **nested, "architectures": raw.get("architectures")}
        vision = raw.get("vision_config")
        if isinstance(vision, dict) and vision.get("deepstack_visual_indexes"):     # (Qwen3-VL's DeepStack)
            text["deepstack_layers"] = len(vision["deepstack_visual_indexes"])
    return {**family.hf_defaults, **text}


def _family(raw: dict, path: str) -> families.Family:
    """The family of a config.json: by its model_type where that decides (BERT), else by its first architecture
    (LLaMA's when it names none); anything else fails naming it."""
    kind = raw.get("model_type")
    family = families.by_hf_model_type(kind)
    if family is not None:
        return family
    refused = families.refused_model_type(kind)
    if refused:
        raise WeightLoadError(f"{path}: {refused}")
    names = raw.get("architectures") or ["LlamaForCausalLM"]
    family = families.by_hf_architecture(names[0])
    if family is None:
        raise WeightLoadError(f"{path}: architecture {names[0]!r} is not supported (supported: "
                              f"{', '.join(families.supported_hf_architectures())})")
    return family


def load_config(model_dir: str) -> LlamaConfig:
    """The LlamaConfig of a HuggingFace directory's config.json (the families' architectures); anything else fails
    naming the architecture, an option the model does not compute naming the option."""
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, "r", encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise WeightLoadError(f"{path}: config.json not found (expected a HuggingFace LLaMA directory)") from None
    except json.JSONDecodeError as e:
        raise WeightLoadError(f"{path}: invalid JSON: {e}") from None
    family = _family(raw, path)
    if family.hf_config is not None:            # a config of its own kind (an encoder's)
        return family.hf_config(raw, path)
    return _decoder_config(_text_config(raw, family), family, path)


def _decoder_config(raw: dict, family: families.Family, path: str) -> LlamaConfig:
    """The LlamaConfig of a decoder's (text) config: its shape, RoPE and sliding layers, and what its family fixes."""
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
    act = _activation(raw, family, path)
    rope = _rope_settings(raw, path, head_dim)
    window, layer_types = _sliding_layers(raw, family, num_layers, path)
    if window is None:
        rope.pop("local_rope_theta", None)      # (no sliding layer to use it)
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
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", family.tied_by_default)),
        architecture=family.name,
        attention_bias=family.attention_bias,
        o_bias=family.o_bias,
        attention_sinks=family.attention_sinks,
        sliding_window=window,
        layer_types=layer_types,
        qk_norm=family.qk_norm,
        sandwich_norms=family.sandwich_norms,
        embed_scale=math.sqrt(hidden) if family.scaled_embedding else 1.0,
        hidden_act=act,
        query_scale=family.query_scale(raw) if family.query_scale else None,
        nope_layers=family.nope_layers(raw, num_layers, path) if family.nope_layers else (),
        deepstack_layers=int(raw.get("deepstack_layers", 0)),
        **_experts(raw, family, num_layers, path),
        **rope,
    )
