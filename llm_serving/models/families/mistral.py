"""Mistral: LLaMA whose config's `sliding_window` slides every layer (its `layer_types`, if any, are not read); and
Mistral 3's text model (Mistral3ForConditionalGeneration's `text_config`: Mistral Small 3.1, no window), and Pixtral
12B's (LlavaForConditionalGeneration's: a Mistral NeMo; a LLaVA whose tower is not Pixtral's is refused by the
vision reader, weights/vision.py).

Its GGUF is llama.cpp's `llama`, read as LLaMA's (LlamaConfig.architecture "llama"): the file names the window in
`llama.attention.sliding_window`.
"""
from . import Family

FAMILY = Family(
    name="mistral", title="Mistral",
    # Mistral 3's text model (Mistral Small 3.1's) and Pixtral 12B's (their Pixtral towers: weights/vision.py)
    hf_architectures=("MistralForCausalLM", "Mistral3ForConditionalGeneration", "LlavaForConditionalGeneration"),
    gguf_architecture=None,
    gguf_as="llama",
    config_keys=("sliding_window",),
    window="always",
    readme_row="Mistral, Qwen2",
    tests=("tests/integration/test_families.py", "tests/unit/test_weights_formats.py"
           "::test_architectures_and_sliding_windows_from_config_json"),
    test_models=("mistral-swa",),
)
