"""Qwen2: LLaMA with q/k/v biases, and sliding layers only with `use_sliding_window`: those from
`max_window_layers` on (transformers 4.x's rule, which Qwen3 and Qwen3-MoE share), or those `layer_types` names.
Qwen2.5-VL's text model is Qwen2 with multimodal RoPE: qwen2vl.py.
"""
from . import Family


def window_layers(raw: dict, num_layers: int, path: str) -> list:
    """Qwen's sliding layers without `layer_types`: every layer from `max_window_layers` (default 28) on."""
    first = int(raw.get("max_window_layers", 28))
    return ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]


FAMILY = Family(
    name="qwen2", title="Qwen2",
    hf_architectures=("Qwen2ForCausalLM",), gguf_architecture="qwen2",
    config_keys=("use_sliding_window", "sliding_window", "max_window_layers", "layer_types"),
    attention_bias=True,
    window="optional", sliding_layers=window_layers,
    chat_format="ChatML (the template's own)",
    readme_row="Mistral, Qwen2",
    tests=("tests/integration/test_families.py",
           "tests/unit/test_weights_formats.py::test_qwen2_safetensors_biases_are_required_and_loaded",
           "tests/unit/test_weights_formats.py::test_qwen2_gguf_keeps_hf_layout_and_biases",
           "tests/integration/test_architectures.py"),
    test_models=("qwen2-swa",),
)
