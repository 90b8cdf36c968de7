"""LLaMA (Llama-1/2/3, SmolLM2, ...): the family's baseline, whose differences the others are.

Llama-3.1's `rope_scaling` (llama3) and linear scaling are read for every family (`weights/hf_config.py`); LLaMA's
configs name no sliding window it uses, and no biases it computes. Its GGUF (`llama`) is Mistral's and Mixtral's too:
llama.cpp's converter interleaves the q/k rows of each head for its RoPE of neighbouring pairs.
"""
from . import Family, Refusal

_BIASES = "attention_bias/mlp_bias (o_proj or MLP biases) are not supported for llama; only Qwen2's q/k/v biases are"

FAMILY = Family(
    name="llama", title="LLaMA",
    # SmolVLM's and Idefics3's text models (their towers: weights/vision.py)
    hf_architectures=("LlamaForCausalLM", "SmolVLMForConditionalGeneration", "Idefics3ForConditionalGeneration"),
    gguf_architecture="llama",
    refusals=(Refusal("attention_bias", "true", _BIASES), Refusal("mlp_bias", "true", _BIASES)),
    window="none", gguf_interleaved_rope=True,
    readme_row=None,
    tests=("tests/unit/test_weights_formats.py::test_f32_gguf_loads_to_its_safetensors_twin",
           "tests/unit/test_weights_formats.py::test_llama3_rope_scaling_in_transformers_4_and_5_forms",
           "tests/integration/test_architectures.py"),
)
