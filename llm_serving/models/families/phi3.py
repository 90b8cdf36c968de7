"""Phi-3 (Phi-3, Phi-4-mini): LLaMA with fused `qkv_proj` / `gate_up_proj` (split at load by their shapes, in every
format), `partial_rotary_factor` and longrope scaling (read for every family by `weights/hf_config.py`); a
`sliding_window` slides every layer (Phi-3-mini-4k's 2047; Phi-4-mini's as long as its context is none).
"""
from . import Family

FAMILY = Family(
    name="phi3", title="Phi-3",
    hf_architectures=("Phi3ForCausalLM",), gguf_architecture="phi3",
    config_keys=("partial_rotary_factor", "original_max_position_embeddings", "sliding_window"),
    window="always",
    readme_row="Phi-3, Phi-4-mini",
    tests=("tests/integration/test_families.py",
           "tests/unit/test_weights_formats.py::test_phi3_split_parts_read_only_their_rows"),
    test_models=("phi3",),
)
