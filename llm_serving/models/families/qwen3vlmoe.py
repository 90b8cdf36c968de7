"""Qwen3-VL-MoE's text model (Qwen3VLMoeForConditionalGeneration: Qwen3-VL-30B-A3B, -235B-A22B; llama.cpp's
`qwen3vlmoe` GGUF): Qwen3-VL's text model (interleaved multimodal RoPE, DeepStack) with Qwen3-MoE's mixture of
experts in the layers that are not dense, its experts fused in one tensor per part, gate and up as halves of one
(`fused_experts` "halves", read in either orientation transformers has stored them). Its vision tower is Qwen3-VL's
(models/vision_qwen.py), its images' tokens vision/model.py's.
"""
from . import Family, Refusal
from .qwen2 import window_layers
from .qwen3moe import experts as qwen3moe_experts


def experts(raw: dict, num_layers: int, path: str) -> dict:
    """Qwen3-MoE's experts, the chosen k's weights always renormalized (transformers' Qwen3-VL-MoE router does so
    whatever norm_topk_prob says)."""
    return qwen3moe_experts({**raw, "norm_topk_prob": True}, num_layers, path)


FAMILY = Family(
    name="qwen3vlmoe", title="Qwen3-VL-MoE",
    hf_architectures=("Qwen3VLMoeForConditionalGeneration",), gguf_architecture="qwen3vlmoe",
    config_keys=("head_dim", "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                 "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "use_sliding_window", "sliding_window",
                 "max_window_layers", "layer_types", "text_config", "rope_scaling", "rope_parameters",
                 "mrope_section", "mrope_interleaved", "vision_config"),
    qk_norm=True,
    refusals=(Refusal("attention_bias", "true", "attention_bias=true (q/k/v/o biases) is not supported for "
                                                 "qwen3vlmoe"),),
    window="optional", sliding_layers=window_layers,
    moe_routing="softmax over all experts, the top k kept and renormalized over them",
    experts=experts, fused_experts="halves",
    hf_layer_names={"mlp.gate.weight": "mlp.router.weight"},
    gguf_mrope_interleaved=True,
    chat_format="ChatML (the template's own), an image as <|vision_start|><|image_pad|><|vision_end|>",
    readme_row="Qwen3-VL",
    tests=("tests/integration/test_images_qwen3.py",),
    test_models=(),
)
