"""Qwen3: LLaMA with an explicit `head_dim` and an RMSNorm of each query and key head before RoPE; Qwen2's sliding
rule; no biases. Its chat template reasons in `<think>` unless `enable_thinking` is false.
"""
from . import Family, Refusal
from .qwen2 import window_layers

FAMILY = Family(
    name="qwen3", title="Qwen3",
    hf_architectures=("Qwen3ForCausalLM",), gguf_architecture="qwen3",
    config_keys=("head_dim", "use_sliding_window", "sliding_window", "max_window_layers", "layer_types"),
    qk_norm=True,
    refusals=(Refusal("attention_bias", "true", "attention_bias=true (q/k/v/o biases) is not supported for qwen3"),),
    window="optional", sliding_layers=window_layers,
    chat_format="ChatML; reasoning in <think> ... </think>, switched by the template's enable_thinking",
    chat_code=("llm_serving/server/reasoning.py:<think>", "llm_serving/server/reasoning.py:enable_thinking"),
    readme_row="Qwen3",
    tests=("tests/integration/test_families.py", "tests/unit/test_weights_formats.py"
           "::test_a_family_loads_the_same_from_its_hf_directory_and_its_gguf",
           "tests/integration/test_reasoning.py"),
    test_models=("qwen3",),
)
