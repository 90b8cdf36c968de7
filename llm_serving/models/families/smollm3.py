"""SmolLM3: LLaMA with layers that apply no RoPE (NoPE): `no_rope_layers` flags, or every
`no_rope_layer_interval`-th layer (transformers' rule; llama.cpp's every 4th); the NoPE layers are the ones that
slide with `use_sliding_window`. Its embeddings are tied unless the config says not.
"""
from ..weights.common import WeightLoadError
from . import Family, Refusal


def nope_layers(raw: dict, num_layers: int, path: str) -> tuple:
    """The layers without RoPE: the `no_rope_layers` flags (1: the layer uses RoPE) or, without them, every
    `no_rope_layer_interval`-th layer (default 4)."""
    flags = raw.get("no_rope_layers")
    if flags is None:
        every = int(raw.get("no_rope_layer_interval", 4))
        return tuple(i for i in range(num_layers) if (i + 1) % every == 0)
    if len(flags) != num_layers:
        raise WeightLoadError(f"{path}: no_rope_layers has {len(flags)} entries for {num_layers} layers")
    return tuple(i for i, uses_rope in enumerate(flags) if not uses_rope)


def window_layers(raw: dict, num_layers: int, path: str) -> list:
    """The sliding layers without `layer_types`: the NoPE ones (transformers')."""
    nope = nope_layers(raw, num_layers, path)
    return ["sliding_attention" if i in nope else "full_attention" for i in range(num_layers)]


_BIASES = "attention_bias/mlp_bias (o_proj or MLP biases) are not supported for smollm3; only Qwen2's q/k/v biases are"

FAMILY = Family(
    name="smollm3", title="SmolLM3",
    hf_architectures=("SmolLM3ForCausalLM",), gguf_architecture="smollm3",
    config_keys=("no_rope_layers", "no_rope_layer_interval", "use_sliding_window", "sliding_window", "layer_types"),
    tied_by_default=True,
    refusals=(Refusal("attention_bias", "true", _BIASES), Refusal("mlp_bias", "true", _BIASES)),
    window="optional", sliding_layers=window_layers, nope_layers=nope_layers,
    gguf_interleaved_rope=True, gguf_nope_interval=4,
    readme_row="SmolLM3",
    tests=("tests/integration/test_families.py",
           "tests/unit/test_weights_formats.py::test_smollm3_nope_layers_from_the_flags_or_the_interval",
           "tests/unit/test_weights_formats.py::test_gguf_gemma3_without_the_keys_llama_cpp_hardcodes"),
    test_models=("smollm3",),
)
