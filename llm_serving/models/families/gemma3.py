"""Gemma 3 (Gemma3ForCausalLM, and Gemma3ForConditionalGeneration's text model): gains of (1 + w), sandwich norms,
q/k norms, the embedding times sqrt(hidden), GeGLU (GELU-tanh), `query_pre_attn_scalar`, sliding layers (`layer_types`
or every 6th layer full) with their own RoPE base; transformers' defaults where its config is silent.
"""
from . import Family, Refusal

# what transformers' Gemma3TextConfig assumes for a key a config.json leaves out (Gemma 3 4B/12B/27B's text_config
# names only what differs from these)
DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
            "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
            "bos_token_id": 2, "eos_token_id": 1, "tie_word_embeddings": True, "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": 256, "sliding_window": 4096}
# its norms (after "model.layers.N.") -> the internal names; each gain is read as 1 + the stored weight
HF_LAYER_NAMES = {"input_layernorm.weight": "input_layernorm.weight",
                  "pre_feedforward_layernorm.weight": "post_attention_layernorm.weight",
                  "post_attention_layernorm.weight": "attn_output_norm.weight",
                  "post_feedforward_layernorm.weight": "mlp_output_norm.weight",
                  "self_attn.q_norm.weight": "self_attn.q_norm.weight",
                  "self_attn.k_norm.weight": "self_attn.k_norm.weight"}


def window_layers(raw: dict, num_layers: int, path: str) -> list:
    """The sliding layers without `layer_types`: all but every `sliding_window_pattern`-th (default 6)."""
    every = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
    return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(num_layers)]


def query_scale(raw: dict) -> float:
    """The attention's score scale: query_pre_attn_scalar ** -0.5 (not head_dim's)."""
    return float(raw["query_pre_attn_scalar"]) ** -0.5


def gguf_query_scale(meta, arch: str, hidden: int, heads: int, head_dim: int, num_layers: int) -> float:
    """A GGUF's `attention.scale`, else llama.cpp's rule: 1/sqrt(hidden/heads) for Gemma 3 27B (62 layers), else
    1/sqrt(head_dim)."""
    return float(meta(f"{arch}.attention.scale", 0.0, required=False)) or \
        float(hidden // heads if num_layers == 62 else head_dim) ** -0.5


_SOFTCAPPING = "{key}={value} is not supported (softcapping is not computed)"

FAMILY = Family(
    name="gemma3", title="Gemma 3",
    hf_architectures=("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"), gguf_architecture="gemma3",
    config_keys=("text_config", "hidden_activation", "query_pre_attn_scalar", "sliding_window", "layer_types",
                 "sliding_window_pattern", "rope_local_base_freq"),
    hf_defaults=DEFAULTS,
    qk_norm=True, sandwich_norms=True, hidden_act="gelu_tanh", scaled_embedding=True, norm_gain_plus_one=True,
    activation_key="hidden_activation", activations=("gelu_pytorch_tanh",),
    refusals=(Refusal("final_logit_softcapping", "set", _SOFTCAPPING, before_activation=True),
              Refusal("attn_logit_softcapping", "set", _SOFTCAPPING, before_activation=True),
              Refusal("use_bidirectional_attention", "true", "use_bidirectional_attention=true is not supported (a "
                      "causal model only)", before_activation=True),
              Refusal("attention_bias", "true", "attention_bias=true (q/k/v/o biases) is not supported for gemma3")),
    window="layer_types", sliding_layers=window_layers, query_scale=query_scale,
    hf_layer_names=HF_LAYER_NAMES,
    gguf_window_pattern=6, gguf_local_rope_base=10000.0, gguf_query_scale=gguf_query_scale,
    readme_row="Gemma 3",
    tests=("tests/integration/test_families.py",
           "tests/unit/test_weights_formats.py"
           "::test_a_gemma3_config_that_names_only_what_differs_has_transformers_defaults",
           "tests/unit/test_weights_formats.py::test_gemma3_multimodal_text_model_under_either_transformers_naming",
           "tests/unit/test_weights_formats.py::test_gguf_gemma3_without_the_keys_llama_cpp_hardcodes"),
    test_models=("gemma3", "gemma3-mm"),
)
