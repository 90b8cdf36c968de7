"""The model families: one place that says what each member of the LLaMA family is (`Family`, `FAMILIES`).

A family is LLaMA with differences that are data: the names its checkpoints go by (config.json's `architectures`,
a GGUF's `general.architecture`), the config keys it reads, its tensor names where they differ, the LlamaConfig
fields it fixes (biases, norms, activation, sliding-window rule, mixture routing), the options it refuses, its chat
format, and where it is tested and documented. The readers in `models/weights/` ask a family for these instead of
branching on its name; one model (`models/llama.py`, the CPU kernels, `reference_llama.py`) computes them all.

Each family is a module here defining `FAMILY` (llama.py, gemma3.py, ...), with whatever it computes from a config
of its own (Gemma 3's defaults, SmolLM3's NoPE layers, BERT's whole config); `FAMILIES` is every module's, found
when this package is imported, in the modules' order (which the readers' lists of supported architectures follow).

A new family that differs from one here only in data is one module and its test, nothing else in llm_serving:
- `families/<name>.py` defining `FAMILY = Family(name="<name>", ...)` (start from the nearest one: qwen3.py for a
  dense model with q/k norms; `tests` and `test_models` name the next two);
- its tiny model in `tests/families.py` (`FAMILIES`: a config.json at test size; for its GGUF twin, its
  architecture in `_GGUF_ARCH`) and that name in `tests/integration/test_families.py`'s lists;
- its row in README.md's family table (`readme_row`) and its architecture in the HuggingFace-directory (and GGUF)
  row: `tests/unit/test_families_registry.py` fails until README names it, or while a tiny model has no family.
A family that computes something new (a new LlamaConfig field) also needs that field in `models/weights/common.py`,
the model and kernels that compute it and `reference_llama.py`.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

__all__ = ["FAMILIES", "FIXED_FIELDS", "REFERENCE", "WINDOW_RULES", "Family", "Refusal", "by_gguf_architecture",
           "by_hf_architecture", "by_hf_model_type", "refused_model_type", "supported_gguf_architectures",
           "supported_hf_architectures"]

# the float64 reference every family is checked against (the precision gate's): it computes LlamaConfig's fields,
# so every family, mixtures of experts and encoders too
REFERENCE = "llm_serving/reference_llama.py"
# config.json's sliding_window: "none" ignored (LLaMA's configs name none it uses); "always" every layer slides;
# "layer_types" the layers `layer_types` names (else the family's `sliding_layers` rule, else every one);
# "optional" as layer_types, only with `use_sliding_window` (Qwen's configs name a window they do not use)
WINDOW_RULES = ("none", "always", "layer_types", "optional")
# the LlamaConfig fields a family fixes whatever its config says (Family's fields of the same names)
FIXED_FIELDS = ("attention_bias", "o_bias", "attention_sinks", "qk_norm", "sandwich_norms", "hidden_act", "causal")
_REFUSED_WHEN = ("set", "true", "false")


@dataclass(frozen=True)
class Refusal:
    """A config.json option the family's model would compute wrong, refused naming it: `key`'s value (`default`
    when absent) is refused when it is `set` (not None), `true` or `false`; `message` is formatted with the key and
    the value. `before_activation`: checked before the activation is (the first refusal met is the one named)."""

    key: str
    when: str
    message: str
    default: object = None
    before_activation: bool = False

    def __post_init__(self):
        if self.when not in _REFUSED_WHEN:
            raise ValueError(f"Refusal.when must be one of {_REFUSED_WHEN}, not {self.when!r}")

    def refuses(self, raw: dict) -> Optional[str]:
        """The message if config `raw` sets the option this refuses, else None."""
        value = raw.get(self.key, self.default)
        hit = {"set": value is not None, "true": bool(value), "false": not value}[self.when]
        return self.message.format(key=self.key, value=value) if hit else None


@dataclass(frozen=True)
class Family:
    """One member of the LLaMA family, as data the weight readers ask (see the module's docstring)."""

    name: str                               # LlamaConfig.architecture, and this module's name
    title: str                              # how its makers name it
    hf_architectures: tuple                 # config.json "architectures" entries that are this family
    gguf_architecture: Optional[str]        # the `general.architecture` it owns; None: its GGUFs are `gguf_as`'s
    # the family whose GGUF architecture this one's files name, and as which they are read (LlamaConfig.architecture
    # that family's): Mistral and Mixtral are llama.cpp's `llama` (Mixtral's experts from `llama.expert_count`)
    gguf_as: Optional[str] = None
    hf_model_types: tuple = ()              # config.json model_types that are this family whatever head is named
    # config.json model_types near it that are refused: model_type -> why
    refused_model_types: Mapping[str, str] = field(default_factory=dict)
    config_keys: tuple = ()                 # config.json keys it reads beyond the common ones
    # what transformers assumes for a key its config.json omits
    hf_defaults: Mapping[str, object] = field(default_factory=dict)
    # what it fixes (FIXED_FIELDS: the LlamaConfig fields of the same names)
    attention_bias: bool = False            # q/k/v biases
    o_bias: bool = False                    # o_proj's bias
    attention_sinks: bool = False           # a learned logit per head in the softmax's denominator
    qk_norm: bool = False                   # RMSNorm of each query and key head before RoPE
    sandwich_norms: bool = False            # the attention's and MLP's outputs normalized before the residual adds
    hidden_act: str = "silu"                # the gated MLP's activation (LlamaConfig.hidden_act)
    causal: bool = True                     # False: a bidirectional encoder
    scaled_embedding: bool = False          # the embedding times sqrt(hidden)
    norm_gain_plus_one: bool = False        # HF stores each norm's w of the gain 1 + w (a GGUF stores the gain)
    tied_by_default: bool = False           # tie_word_embeddings when config.json does not say
    # config.json's activation key and the values it may have (the first names it in a refusal)
    activation_key: str = "hidden_act"
    activations: tuple = ("silu", "swish")
    refusals: tuple = ()                    # Refusal: options it refuses, in the order they are checked
    window: str = "none"                    # WINDOW_RULES
    # the sliding layers' kinds when config.json has a window but no layer_types: (raw, num_layers, path) -> list
    sliding_layers: Optional[Callable[[dict, int, str], list]] = None
    nope_layers: Optional[Callable[[dict, int, str], tuple]] = None     # the layers without RoPE
    query_scale: Optional[Callable[[dict], float]] = None               # the attention's score scale
    # a mixture of experts: how the router weighs the chosen experts, and the LlamaConfig fields of its experts
    # beyond their count and experts per token: (raw, num_layers, path) -> dict
    moe_routing: Optional[str] = None
    experts: Optional[Callable[[dict, int, str], dict]] = None
    hf_config: Optional[Callable] = None    # (raw, path) -> LlamaConfig: a config of its own kind (an encoder)
    # tensor names: a whole renaming of its checkpoint's names (str -> str); its names after "model.layers.N." that
    # differ from LLaMA's; a mixture's experts, one tensor each (the prefix after "model.layers.N." and each part's
    # name after "<prefix>E." -> the part); its experts fused in one 3-D tensor per part (gate and up interleaved)
    hf_tensor_name: Optional[Callable[[str], str]] = None
    hf_layer_names: Mapping[str, str] = field(default_factory=dict)
    hf_expert_prefix: Optional[str] = None
    hf_expert_parts: Mapping[str, str] = field(default_factory=dict)
    # its experts fused in one 3-D tensor per part: "interleaved" (gpt-oss's: gate_up (E, H, 2I) its gate and up
    # columns alternating, biases, MXFP4 as openai ships them) or "halves" (Qwen3-VL-MoE's: gate_up's gate then up,
    # no biases; (E, H, 2I) and down (E, I, H) as the Hub's files store them, (E, 2I, H) and (E, H, I) as
    # transformers 5 saves them); None: one tensor an expert and part
    fused_experts: Optional[str] = None
    # its GGUF: names after "blk.N." that mean something else than gguf.py's table says; q/k rows interleaved for
    # llama.cpp's RoPE of neighbouring pairs; llama.cpp's rules where the converter writes nothing (every n-th layer
    # full, every n-th without RoPE, the sliding layers' RoPE base, the score scale, the experts' constants, a
    # multimodal RoPE's frequencies taken in turn t, h, w)
    gguf_layer_names: Mapping[str, str] = field(default_factory=dict)
    gguf_interleaved_rope: bool = False
    gguf_mrope_interleaved: bool = False
    gguf_window_pattern: Optional[int] = None
    gguf_nope_interval: Optional[int] = None
    gguf_local_rope_base: Optional[float] = None
    gguf_query_scale: Optional[Callable] = None         # (meta, arch, hidden, heads, head_dim, num_layers) -> float
    gguf_expert_fields: Mapping[str, object] = field(default_factory=dict)
    gguf_config: Optional[Callable] = None  # (path, meta, tensors) -> LlamaConfig: a config of its own kind
    # its chat format, as the server finds it from the template (the server imports no model code: this is the
    # record), and "file:word" places that read it
    chat_format: str = "the chat template's own"
    chat_code: tuple = ()
    # its row in README's family table (the row's first cell; several families may share one); None: LLaMA, the
    # table's baseline ("what differs from LLaMA")
    readme_row: Optional[str] = None
    tests: tuple = ()                       # "file" or "file::test" that check it
    test_models: tuple = ()                 # its tiny models: keys of tests/families.py's FAMILIES or ENCODERS
    reference: str = REFERENCE

    def __post_init__(self):
        if self.window not in WINDOW_RULES:
            raise ValueError(f"{self.name}: window must be one of {WINDOW_RULES}, not {self.window!r}")
        if (self.gguf_architecture is None) == (self.gguf_as is None):
            raise ValueError(f"{self.name}: name either its own gguf_architecture or the family it is read as")

    def refusal(self, raw: dict, before_activation: bool) -> Optional[str]:
        """The first of its refusals checked before (or after) the activation that config `raw` meets (its
        message), or None."""
        checked = (r.refuses(raw) for r in self.refusals if r.before_activation == before_activation)
        return next((message for message in checked if message), None)


def _discover() -> dict:
    """Every module here's FAMILY by its name, in the modules' order (a new family is a new module)."""
    out = {}
    for module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
        family = importlib.import_module(f"{__name__}.{module}").FAMILY
        if family.name != module:
            raise ValueError(f"families/{module}.py names its family {family.name!r}: a family's module is its name")
        out[module] = family
    return out


# name -> Family (found below Family and Refusal, which each module imports)
FAMILIES: dict[str, Family] = _discover()
_BY_HF = {arch: f for f in FAMILIES.values() for arch in f.hf_architectures}
_BY_GGUF = {f.gguf_architecture: f for f in FAMILIES.values() if f.gguf_architecture}
_BY_MODEL_TYPE = {kind: f for f in FAMILIES.values() for kind in f.hf_model_types}


def by_hf_architecture(name: str) -> Optional[Family]:
    """The family of a config.json `architectures` entry, or None (the reader names `supported_hf_architectures`)."""
    return _BY_HF.get(name)


def by_hf_model_type(kind: Optional[str]) -> Optional[Family]:
    """The family a config.json `model_type` decides alone (BERT's, whatever head the checkpoint names), or None."""
    return _BY_MODEL_TYPE.get(kind)


def refused_model_type(kind: Optional[str]) -> Optional[str]:
    """Why a config.json `model_type` near a family is not served (nomic_bert), or None."""
    return next((f.refused_model_types[kind] for f in FAMILIES.values() if kind in f.refused_model_types), None)


def by_gguf_architecture(name: str) -> Optional[Family]:
    """The family a GGUF's `general.architecture` is read as (`llama`: LLaMA's, Mistral's and Mixtral's files), or
    None (the reader names `supported_gguf_architectures`)."""
    return _BY_GGUF.get(name)


def supported_hf_architectures() -> tuple:
    """Every config.json architecture a family claims, in FAMILIES' order."""
    return tuple(_BY_HF)


def supported_gguf_architectures() -> tuple:
    """Every GGUF architecture a family owns, in FAMILIES' order."""
    return tuple(_BY_GGUF)
