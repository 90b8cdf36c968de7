"""Qwen3-MoE: Qwen3's attention with a mixture of experts in the layers that are not dense: `num_experts` (5.x:
`num_local_experts`) of `moe_intermediate_size` units, the router's softmax over all of them, renormalized over the
chosen k when `norm_topk_prob`; the dense layers are `mlp_only_layers` and those off `decoder_sparse_step`.
"""
from ..weights.common import WeightLoadError
from . import Family, Refusal
from .qwen2 import window_layers

# its experts, one tensor each: after "model.layers.N.mlp.experts.E." each part's name -> the part
EXPERT_PARTS = {"gate_proj.weight": "gate_proj", "up_proj.weight": "up_proj", "down_proj.weight": "down_proj"}


def experts(raw: dict, num_layers: int, path: str) -> dict:
    """The experts' size, routing and the dense layers (as transformers builds them)."""
    step = int(raw.get("decoder_sparse_step") or 1)
    only = {int(i) for i in raw.get("mlp_only_layers") or ()}
    dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
    if "moe_intermediate_size" not in raw:
        raise WeightLoadError(f"{path}: missing key 'moe_intermediate_size'")
    return {"expert_intermediate_size": int(raw["moe_intermediate_size"]),
            "norm_topk_prob": bool(raw.get("norm_topk_prob", False)), "dense_layers": dense}


FAMILY = Family(
    name="qwen3moe", title="Qwen3-MoE",
    hf_architectures=("Qwen3MoeForCausalLM",), gguf_architecture="qwen3moe",
    config_keys=("head_dim", "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                 "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "use_sliding_window", "sliding_window",
                 "max_window_layers", "layer_types"),
    qk_norm=True,
    refusals=(Refusal("attention_bias", "true",
                      "attention_bias=true (q/k/v/o biases) is not supported for qwen3moe"),),
    window="optional", sliding_layers=window_layers,
    moe_routing="softmax over all experts, the top k kept (renormalized over them when norm_topk_prob)",
    experts=experts,
    hf_layer_names={"mlp.gate.weight": "mlp.router.weight"},
    hf_expert_prefix="mlp.experts.", hf_expert_parts=EXPERT_PARTS,
    chat_format="ChatML; reasoning in <think> ... </think>, switched by the template's enable_thinking (as Qwen3)",
    chat_code=("llm_serving/server/reasoning.py:<think>", "llm_serving/server/reasoning.py:enable_thinking"),
    readme_row="Qwen3-MoE, Mixtral (mixtures of experts)",
    tests=("tests/integration/test_families.py",
           "tests/integration/test_families.py::test_rows_routed_to_different_experts_in_one_step_get_their_own_tokens",
           "tests/unit/test_weights_formats.py"
           "::test_a_family_loads_the_same_from_its_hf_directory_and_its_gguf"),
    test_models=("qwen3moe",),
)
