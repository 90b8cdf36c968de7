"""Qwen2-VL's and Qwen2.5-VL's text model (Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration;
llama.cpp's `qwen2vl` GGUF, both): Qwen2 (q/k/v biases, sliding layers only with `use_sliding_window`) with multimodal
RoPE, LlamaConfig.mrope_section: from config.json's
`rope_scaling` (4.x) or `text_config.rope_parameters` (5.x) `mrope_section`, or the GGUF's `rope.dimension_sections`.
Its vision tower is models/vision_qwen.py's, its images' tokens vision/model.py's.
"""
from . import Family
from .qwen2 import window_layers

FAMILY = Family(
    name="qwen2vl", title="Qwen2-VL, Qwen2.5-VL",
    hf_architectures=("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"),
    gguf_architecture="qwen2vl",
    config_keys=("use_sliding_window", "sliding_window", "max_window_layers", "layer_types", "text_config",
                 "rope_scaling", "mrope_section"),
    attention_bias=True,
    window="optional", sliding_layers=window_layers,
    chat_format="ChatML (the template's own), an image as <|vision_start|><|image_pad|><|vision_end|>",
    readme_row="Qwen2-VL, Qwen2.5-VL",
    tests=("tests/integration/test_images_qwen.py", "tests/integration/test_images_qwen2.py",
           "tests/unit/test_mrope.py"),
)
