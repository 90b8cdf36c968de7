"""gpt-oss: biases on q/k/v/o, attention sinks, sliding and full layers by `layer_types` (every other one in a GGUF),
YaRN RoPE, a mixture in every layer with biased experts, top-k then softmax routing and its clamped SwiGLU; its
experts fused in one tensor per part (gate and up interleaved; MXFP4 as openai ships them); its chat format harmony.
"""
from . import Family, Refusal

SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0       # its clamped SwiGLU's defaults (llama.cpp's constants for a GGUF)


def experts(raw: dict, num_layers: int, path: str) -> dict:
    """The experts' size (the config's intermediate_size), biases and clamped SwiGLU; top-k of the logits, then
    their softmax: the renormalized form."""
    return {"expert_intermediate_size": int(raw["intermediate_size"]), "norm_topk_prob": True, "moe_bias": True,
            "expert_act": "swiglu_oai", "swiglu_alpha": float(raw.get("swiglu_alpha", SWIGLU_ALPHA)),
            "swiglu_limit": float(raw.get("swiglu_limit", SWIGLU_LIMIT))}


FAMILY = Family(
    name="gptoss", title="gpt-oss",
    hf_architectures=("GptOssForCausalLM",), gguf_architecture="gpt-oss",
    config_keys=("num_local_experts", "num_experts_per_tok", "sliding_window", "layer_types", "swiglu_alpha",
                 "swiglu_limit", "attention_bias", "quantization_config"),
    attention_bias=True, o_bias=True, attention_sinks=True,
    refusals=(Refusal("attention_bias", "false", "attention_bias=false is not supported for gpt-oss (its projections "
                      "have biases)", default=True),),
    window="layer_types",
    moe_routing="the top k of the router's logits (with its bias), weighted by their softmax (renormalized)",
    experts=experts, fused_experts="interleaved",
    # its post_attention_norm is its MLP's input norm (Gemma 3's is a sandwich norm)
    gguf_layer_names={"post_attention_norm.weight": "post_attention_layernorm.weight"},
    gguf_window_pattern=2,
    gguf_expert_fields={"norm_topk_prob": True, "moe_bias": True, "expert_act": "swiglu_oai",
                        "swiglu_alpha": SWIGLU_ALPHA, "swiglu_limit": SWIGLU_LIMIT},
    chat_format="harmony (channels: analysis as reasoning, final as content, messages to functions as tool calls), "
                "told by its template's <|start|> and <|message|>",
    chat_code=("llm_serving/tokenization/chat_template.py:harmony", "llm_serving/server/harmony.py:HarmonyStream"),
    readme_row="gpt-oss",
    tests=("tests/integration/test_families.py",
           "tests/integration/test_families.py"
           "::test_gptoss_with_mxfp4_experts_from_safetensors_gives_transformers_greedy_tokens",
           "tests/unit/test_mxfp4_safetensors.py", "tests/unit/test_harmony.py",
           "tests/integration/test_reasoning.py::test_a_gpt_oss_reply_comes_apart_by_its_channels_whole_and_streamed"),
    test_models=("gptoss",),
)
