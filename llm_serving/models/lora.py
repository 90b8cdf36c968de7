"""LoRA adapters in PEFT's format, checked against the base model they are to be served on.

An adapter is a directory with `adapter_config.json` (PEFT's LoraConfig: `r`, `lora_alpha`, `target_modules`,
`use_rslora`, `rank_pattern`, `alpha_pattern`, ...) and `adapter_model.safetensors`, whose tensors PEFT names
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` (r, in) and `...lora_B.weight` (out, r). The
adapted projection computes W x + scale * B (A x), scale = alpha / r (alpha / sqrt(r) with `use_rslora`), per
module (`rank_pattern` / `alpha_pattern` may give a module its own r and alpha).

Only what this server can apply is accepted: the seven linear projections of a decoder layer (q/k/v/o,
gate/up/down), and the fused ones a checkpoint may store instead (Phi-3's `qkv_proj` and `gate_up_proj`: their
lora_B's rows are cut into the parts' deltas, which share lora_A). An adapter that does not fit the base model (a shape that does not match it, a rank above
`max_rank`, a layer it does not have, a module it cannot adapt, DoRA, trained biases, modules saved whole) is a
`LoraError` naming the file and the tensor or key, raised before anything is kept. The fused q/k/v and gate/up
products of the model (llama.py) take each part's delta for its own rows: `LoraAdapter.deltas` is keyed by the
HF name of the part's weight.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .weights import LlamaConfig, WeightLoadError, stored_safetensors

__all__ = ["LoraAdapter", "LoraDelta", "LoraError", "TARGET_MODULES", "load_lora_adapter", "merge_lora",
           "module_shape", "random_lora_tensors", "write_peft_adapter"]

# module -> its block in a decoder layer (HF names: model.layers.{i}.{block}.{module}.weight)
TARGET_MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                  "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# a fused projection some checkpoints store (Phi-3) -> the parts the model keeps, in the order of its output rows
FUSED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_TENSOR = re.compile(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])"
                     r"(?:\.[\w-]+)?\.weight")


class LoraError(ValueError):
    """An adapter that cannot be served on this base model; the message says which file and tensor or key."""


def module_shape(cfg: LlamaConfig, module: str) -> tuple[int, int]:
    """(out, in) of a decoder layer's projection `module` in this model."""
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    return {"q_proj": (cfg.num_heads * d, h), "k_proj": (cfg.num_kv_heads * d, h),
            "v_proj": (cfg.num_kv_heads * d, h), "o_proj": (h, cfg.num_heads * d),
            "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}[module]


@dataclass(frozen=True)
class LoraDelta:
    """One adapted projection: its output changes by scale * B (A x)."""

    a: np.ndarray           # (r, in) float32
    b: np.ndarray           # (out, r) float32
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class LoraAdapter:
    """A checked adapter: `deltas` maps the HF name of each adapted weight (`model.layers.0.self_attn.q_proj.weight`)
    to its LoraDelta."""

    name: str
    path: str
    deltas: dict = field(repr=False)

    @property
    def rank(self) -> int:
        """The largest rank among its modules."""
        return max(d.rank for d in self.deltas.values())

    @property
    def target_modules(self) -> tuple:
        return tuple(m for m in TARGET_MODULES if any(n.endswith(f".{m}.weight") for n in self.deltas))

    @property
    def nbytes(self) -> int:
        return sum(d.a.nbytes + d.b.nbytes for d in self.deltas.values())


def _config(path: str) -> dict:
    cfg_path = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isdir(path):
        raise LoraError(f"{path}: not a directory (a LoRA adapter is a directory with {ADAPTER_CONFIG} and "
                        f"{ADAPTER_WEIGHTS}, as PEFT's save_pretrained writes it)")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise LoraError(f"{cfg_path}: missing (a LoRA adapter directory holds {ADAPTER_CONFIG} and "
                        f"{ADAPTER_WEIGHTS})") from None
    except (OSError, json.JSONDecodeError) as e:
        raise LoraError(f"{cfg_path}: cannot read it: {e}") from None
    if not isinstance(raw, dict):
        raise LoraError(f"{cfg_path}: not a JSON object")
    return raw


def _refuse_unsupported(raw: dict, cfg_path: str) -> None:
    def bad(key, why):
        raise LoraError(f"{cfg_path}: {key} = {raw.get(key)!r}: {why}")

    if raw.get("peft_type", "LORA") not in ("LORA", None):
        bad("peft_type", "only LoRA adapters are served")
    if raw.get("use_dora"):
        bad("use_dora", "DoRA adapters are not supported")
    if raw.get("bias", "none") not in ("none", None):
        bad("bias", "adapters that train biases are not supported (bias must be 'none')")
    if raw.get("fan_in_fan_out"):
        bad("fan_in_fan_out", "transposed (Conv1D) weights are not LLaMA's")
    if raw.get("modules_to_save"):
        bad("modules_to_save", "modules saved whole (e.g. a new lm_head) are not supported")
    for key in ("r", "lora_alpha"):
        v = raw.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            bad(key, "must be a positive number")


def _targets(raw: dict, cfg_path: str) -> Optional[re.Pattern]:
    """A pattern of the module names the config targets (None: whatever the file holds)."""
    targets = raw.get("target_modules")
    if targets is None:
        return None
    if isinstance(targets, str):
        if targets == "all-linear":
            return re.compile(r".*\.(%s)" % "|".join(TARGET_MODULES))
        try:
            return re.compile(targets)
        except re.error as e:
            raise LoraError(f"{cfg_path}: target_modules {targets!r} is not a regular expression: {e}") from None
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise LoraError(f"{cfg_path}: target_modules must be a list of module names or a regular expression")
    unknown = [t for t in targets if t.rsplit(".", 1)[-1] not in TARGET_MODULES
               and t.rsplit(".", 1)[-1] not in FUSED_MODULES]
    if unknown:
        raise LoraError(f"{cfg_path}: target_modules {unknown} cannot be adapted here (supported: "
                        f"{', '.join(TARGET_MODULES)})")
    return re.compile(r"(.*\.)?(%s)" % "|".join(re.escape(t) for t in targets))


def _pattern_value(patterns: dict, module_name: str, default):
    """PEFT's rank_pattern / alpha_pattern: the value of the first key that names this module (the whole name
    or a suffix of it after a dot), else default."""
    for key, value in (patterns or {}).items():
        if module_name == key or module_name.endswith("." + key) or re.fullmatch(rf"(.*\.)?{key}", module_name):
            return value
    return default


def load_lora_adapter(name: str, path: str, cfg: LlamaConfig, max_rank: Optional[int] = None) -> LoraAdapter:
    """Read and check the PEFT adapter in directory `path` against base model `cfg`; LoraError if it cannot be
    served on it (or is larger than `max_rank`)."""
    path = os.fspath(path)
    raw = _config(path)
    cfg_path = os.path.join(path, ADAPTER_CONFIG)
    _refuse_unsupported(raw, cfg_path)
    targeted = _targets(raw, cfg_path)
    weights_path = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(weights_path):
        other = [f for f in ("adapter_model.bin", "adapter_model.pt") if os.path.isfile(os.path.join(path, f))]
        hint = (f" ({other[0]} is a pickle, which is not loaded: save the adapter with safe_serialization=True)"
                if other else "")
        raise LoraError(f"{weights_path}: missing{hint}")
    try:
        stored = stored_safetensors({"": weights_path}, _TensorNames())
    except WeightLoadError as e:
        raise LoraError(str(e)) from None

    pairs: dict[tuple[int, str, str], dict] = {}
    for tname, tensor in stored.items():
        m = _TENSOR.fullmatch(tname)
        part = FUSED_MODULES.get(m.group(3), (m.group(3),))[0] if m else None
        if m is None or part not in TARGET_MODULES or TARGET_MODULES[part] != m.group(2):
            raise LoraError(f"{weights_path}: tensor {tname!r} is not a LoRA A/B matrix of a decoder layer's "
                            f"{'/'.join(TARGET_MODULES)} projection, which is all this server can apply")
        layer, block, module, which = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if layer >= cfg.num_layers:
            raise LoraError(f"{weights_path}: tensor {tname!r} adapts layer {layer}; the base model has "
                            f"{cfg.num_layers} layers")
        if block == "mlp" and cfg.layer_moe(layer):
            raise LoraError(f"{weights_path}: tensor {tname!r} adapts layer {layer}'s MLP, a mixture of experts: "
                            "adapters are applied to its attention projections (q/k/v/o_proj) only")
        if len(tensor.shape) != 2:
            raise LoraError(f"{weights_path}: tensor {tname!r} has shape {tensor.shape}; LoRA matrices are 2-D")
        pairs.setdefault((layer, block, module), {})[which] = (tname, tensor)
    if not pairs:
        raise LoraError(f"{weights_path}: holds no LoRA tensors")

    rank_default, alpha_default = raw["r"], raw["lora_alpha"]
    deltas = {}
    for (layer, block, module), ab in sorted(pairs.items()):
        module_name = f"model.layers.{layer}.{block}.{module}"
        if set(ab) != {"A", "B"}:
            have = next(iter(ab.values()))[0]
            raise LoraError(f"{weights_path}: tensor {have!r} has no lora_{'B' if 'A' in ab else 'A'} partner")
        if targeted is not None and not targeted.fullmatch(module_name):
            raise LoraError(f"{weights_path}: tensor {ab['A'][0]!r} adapts {module_name}, which the adapter's "
                            f"target_modules do not name")
        (a_name, a_t), (b_name, b_t) = ab["A"], ab["B"]
        parts = FUSED_MODULES.get(module, (module,))
        out, inp = sum(module_shape(cfg, part)[0] for part in parts), module_shape(cfg, parts[0])[1]
        r = a_t.shape[0]
        if a_t.shape != (r, inp):
            raise LoraError(f"{weights_path}: tensor {a_name!r} has shape {a_t.shape}; {module_name} of the base "
                            f"model takes {inp} inputs, so lora_A must be (r, {inp})")
        if b_t.shape != (out, r):
            raise LoraError(f"{weights_path}: tensor {b_name!r} has shape {b_t.shape}; expected ({out}, {r}) "
                            f"({module_name} has {out} outputs, lora_A has rank {r})")
        if max_rank is not None and r > max_rank:
            raise LoraError(f"{weights_path}: tensor {a_name!r} has rank {r}, above lora_config.max_lora_rank "
                            f"({max_rank})")
        want_r = _pattern_value(raw.get("rank_pattern"), module_name, rank_default)
        if want_r != r:
            raise LoraError(f"{weights_path}: tensor {a_name!r} has rank {r} but {ADAPTER_CONFIG} says {want_r}")
        alpha = _pattern_value(raw.get("alpha_pattern"), module_name, alpha_default)
        scale = float(alpha) / (math.sqrt(r) if raw.get("use_rslora") else r)
        read = lambda t: np.ascontiguousarray(t.read((slice(None), slice(None))), dtype=np.float32)  # noqa: E731
        a, b = read(a_t), read(b_t)
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise LoraError(f"{weights_path}: tensor {a_name if not np.isfinite(a).all() else b_name!r} holds "
                            f"NaN or infinite values")
        row = 0
        for part in parts:                       # a fused module's B cut into its parts' rows (A shared)
            rows = module_shape(cfg, part)[0]
            deltas[f"model.layers.{layer}.{block}.{part}.weight"] = LoraDelta(a, np.ascontiguousarray(b[row:row + rows]),
                                                                              scale)
            row += rows
    return LoraAdapter(name, path, deltas)


class _TensorNames(set):
    """`wanted` for stored_safetensors that takes every tensor of the file (each is checked by name after)."""

    def __contains__(self, name) -> bool:
        return True


def merge_lora(weights: dict, adapter: LoraAdapter) -> dict:
    """A copy of HF-named float32 `weights` with each adapted matrix replaced by W + scale * B A: the plain
    model an adapted request must behave like."""
    out = dict(weights)
    for name, d in adapter.deltas.items():
        out[name] = (weights[name] + d.scale * (d.b.astype(np.float64) @ d.a.astype(np.float64))).astype(np.float32)
    return out


def random_lora_tensors(cfg: LlamaConfig, rank: int, target_modules=tuple(TARGET_MODULES), seed: int = 0,
                        layers: Optional[list] = None, std: float = 0.05) -> dict:
    """Random float32 LoRA matrices for `cfg`, named as PEFT saves them (B is not zero, unlike a fresh PEFT
    adapter's, so the adapter changes the model)."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(cfg.num_layers) if layers is None else layers:
        for module in target_modules:
            o, n = module_shape(cfg, module)
            prefix = f"base_model.model.model.layers.{i}.{TARGET_MODULES[module]}.{module}"
            out[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, n)) * std).astype(np.float32)
            out[f"{prefix}.lora_B.weight"] = (rng.standard_normal((o, rank)) * std).astype(np.float32)
    return out


def write_peft_adapter(out_dir, tensors: dict, *, r: int, lora_alpha: float, target_modules=None,
                       base_model: str = "", **config) -> str:
    """Write an adapter directory as PEFT's save_pretrained does (adapter_config.json + adapter_model.safetensors);
    extra `config` keys (use_rslora, rank_pattern, ...) go into the config as given. Returns the directory."""
    from safetensors.numpy import save_file

    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    if target_modules is None:
        target_modules = sorted({m.group(3) for m in map(_TENSOR.fullmatch, tensors) if m})
    body = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": r,
            "lora_alpha": lora_alpha, "lora_dropout": 0.0, "target_modules": target_modules, "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
            "rank_pattern": {}, "alpha_pattern": {}, "inference_mode": True, **config}
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
        json.dump(body, f, indent=2)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(out_dir, ADAPTER_WEIGHTS))
    return out_dir
