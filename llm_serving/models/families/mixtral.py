"""Mixtral: Mistral's attention with a mixture of experts in every layer: `num_local_experts` of `intermediate_size`
units (`block_sparse_moe.experts.E.w1/w3/w2`), the top k by the router's logits weighted by their softmax (always
renormalized). Its GGUF is llama.cpp's `llama` with `llama.expert_count`, read as LLaMA's.
"""
from . import Family, Refusal

# its experts, one tensor each: after "model.layers.N.block_sparse_moe.experts.E." each part's name -> the part
EXPERT_PARTS = {"w1.weight": "gate_proj", "w3.weight": "up_proj", "w2.weight": "down_proj"}


def experts(raw: dict, num_layers: int, path: str) -> dict:
    """The experts' size (the config's intermediate_size) and routing (always renormalized)."""
    return {"expert_intermediate_size": int(raw["intermediate_size"]), "norm_topk_prob": True}


FAMILY = Family(
    name="mixtral", title="Mixtral",
    hf_architectures=("MixtralForCausalLM",), gguf_architecture=None, gguf_as="llama",
    config_keys=("num_local_experts", "num_experts_per_tok", "sliding_window"),
    refusals=(Refusal("attention_bias", "true", "attention_bias=true (q/k/v/o biases) is not supported for mixtral"),),
    window="always",
    moe_routing="the top k of the router's logits, weighted by their softmax (renormalized)",
    experts=experts,
    hf_layer_names={"block_sparse_moe.gate.weight": "mlp.router.weight"},
    hf_expert_prefix="block_sparse_moe.experts.", hf_expert_parts=EXPERT_PARTS,
    readme_row="Qwen3-MoE, Mixtral (mixtures of experts)",
    tests=("tests/integration/test_families.py", "tests/unit/test_weights_formats.py"
           "::test_a_family_loads_the_same_from_its_hf_directory_and_its_gguf"),
    test_models=("mixtral",),
)
