"""Qwen3-VL's text model (Qwen3VLForConditionalGeneration; llama.cpp's `qwen3vl` GGUF): Qwen3 (q/k norms, no biases)
with interleaved multimodal RoPE (LlamaConfig.mrope_section with mrope_interleaved: `text_config.rope_parameters`
(5.x) or `rope_scaling` (the Hub's) `mrope_section` and `mrope_interleaved`; a GGUF's `rope.dimension_sections`,
interleaved as llama.cpp's qwen3vl computes it) and DeepStack (LlamaConfig.deepstack_layers: vision_config's
deepstack_visual_indexes counted, or the GGUF's `n_deepstack_layers`): the tower's rows for an image token carry
further rows, each added to the token's hidden state after one of the first decoder layers. Its vision tower is
models/vision_qwen.py's, its images' tokens vision/model.py's (as Qwen2.5-VL's).
"""
from . import Family, Refusal
from .qwen2 import window_layers

FAMILY = Family(
    name="qwen3vl", title="Qwen3-VL",
    hf_architectures=("Qwen3VLForConditionalGeneration",), gguf_architecture="qwen3vl",
    config_keys=("head_dim", "use_sliding_window", "sliding_window", "max_window_layers", "layer_types",
                 "text_config", "rope_scaling", "rope_parameters", "mrope_section", "mrope_interleaved",
                 "vision_config"),
    qk_norm=True,
    refusals=(Refusal("attention_bias", "true", "attention_bias=true (q/k/v/o biases) is not supported for "
                                                 "qwen3vl"),),
    window="optional", sliding_layers=window_layers,
    gguf_mrope_interleaved=True,
    chat_format="ChatML (the template's own), an image as <|vision_start|><|image_pad|><|vision_end|>",
    readme_row="Qwen3-VL",
    tests=("tests/integration/test_images_qwen.py", "tests/unit/test_mrope.py"),
)
