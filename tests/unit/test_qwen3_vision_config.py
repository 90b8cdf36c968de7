"""Qwen3-VL's vision config and tensors (llm_serving/models/weights/vision.py): the Hub's config.json
(Qwen/Qwen3-VL-4B-Instruct's) and transformers 5.x's (as tests/families.py's make_qwen3_vl saves it) read to the same
kind of QwenVisionConfig (every block full, no windows, the position grid, the DeepStack layers and the rows' width);
the tensors under `model.visual.` read as `visual.`, the text model's left; a config the tower cannot run named;
the Hub's processor config read with its 16-pixel patches. No MindSpore, no transformers."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from llm_serving.models.weights import WeightLoadError
from llm_serving.models.weights.vision import QwenVisionConfig, _qwen_config, qwen_vision_shapes, vision_checkpoint
from llm_serving.vision import ImageSpec, qwen_grid

# Qwen/Qwen3-VL-4B-Instruct's config.json (transformers 4.57): text_config nested, no vision rotary parameters
HUB_4B = {
    "architectures": ["Qwen3VLForConditionalGeneration"], "image_token_id": 151655, "model_type": "qwen3_vl",
    "text_config": {"attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128,
                    "hidden_act": "silu", "hidden_size": 2560, "intermediate_size": 9728,
                    "max_position_embeddings": 262144, "model_type": "qwen3_vl_text", "num_attention_heads": 32,
                    "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
                    "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
                    "rope_theta": 5000000, "tie_word_embeddings": True, "vocab_size": 151936},
    "tie_word_embeddings": True, "transformers_version": "4.57.0.dev0", "video_token_id": 151656,
    "vision_config": {"deepstack_visual_indexes": [5, 11, 17], "depth": 24, "hidden_act": "gelu_pytorch_tanh",
                      "hidden_size": 1024, "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4096,
                      "model_type": "qwen3_vl", "num_heads": 16, "num_position_embeddings": 2304,
                      "out_hidden_size": 2560, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2},
    "vision_end_token_id": 151653, "vision_start_token_id": 151652}

# make_qwen3_vl's config.json (transformers 5.24): the vision rotary base in vision_config.rope_parameters
TINY_5X = {
    "architectures": ["Qwen3VLForConditionalGeneration"], "dtype": "float32", "image_token_id": 5,
    "model_type": "qwen3_vl",
    "text_config": {"head_dim": 16, "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 128,
                    "model_type": "qwen3_vl_text", "num_attention_heads": 4, "num_hidden_layers": 3,
                    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "vocab_size": 300,
                    "rope_parameters": {"mrope_interleaved": True, "mrope_section": [2, 3, 3], "rope_theta": 5e6,
                                        "rope_type": "default"}},
    "tie_word_embeddings": False, "transformers_version": "5.24.0", "video_token_id": 6,
    "vision_config": {"deepstack_visual_indexes": [1, 2], "depth": 4, "hidden_act": "gelu_pytorch_tanh",
                      "hidden_size": 32, "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 64,
                      "model_type": "qwen3_vl_vision", "num_heads": 2, "num_position_embeddings": 16,
                      "out_hidden_size": 64, "patch_size": 16,
                      "rope_parameters": {"rope_theta": 10000.0, "rope_type": "axial"},
                      "spatial_merge_size": 2, "temporal_patch_size": 2},
    "vision_end_token_id": 4, "vision_start_token_id": 3}

# Qwen/Qwen3-VL-4B-Instruct's preprocessor_config.json: Qwen2-VL's processor with 16-pixel patches, areas as `size`
HUB_PROCESSOR = {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
                 "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                 "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor",
                 "image_processor_type": "Qwen2VLImageProcessorFast"}


def _write(directory, config: dict) -> None:
    """config.json and a model.safetensors of zeros in every shape the tower reads, under 5.x's names
    (`model.visual.*`), beside a text tensor the tower must leave."""
    from safetensors.numpy import save_file

    (directory / "config.json").write_text(json.dumps(config))
    cfg = _qwen_config(config, "config.json", "qwen3_vl")
    tensors = {"model." + name: np.zeros(shape, np.float32) for name, shape in qwen_vision_shapes(cfg).items()}
    tensors["model.language_model.embed_tokens.weight"] = np.zeros((300, 64), np.float32)
    save_file(tensors, str(directory / "model.safetensors"))


def test_the_hub_s_config_json_is_a_qwen3_tower_of_full_blocks_and_deepstack_rows():
    cfg = _qwen_config(copy.deepcopy(HUB_4B), "config.json", "qwen3_vl")
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads) == \
        ("qwen3_vl", 24, 1024, 4096, 16)
    assert (cfg.patch_size, cfg.temporal_patch_size, cfg.spatial_merge_size, cfg.patch_features) == \
        (16, 2, 2, 3 * 2 * 16 * 16)
    assert cfg.window_units == 1 and cfg.fullatt_block_indexes == tuple(range(24))      # every block full
    assert (cfg.num_position_embeddings, cfg.position_side) == (2304, 48)
    assert cfg.deepstack_visual_indexes == (5, 11, 17) and cfg.deepstack_layers == 3
    assert (cfg.out_hidden_size, cfg.row_width) == (2560, 2560 * 4)
    assert (cfg.rope_theta, cfg.eps, cfg.bidirectional) == (10000.0, 1e-6, False)
    assert (cfg.image_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id) == (151655, 151652, 151653)
    shapes = qwen_vision_shapes(cfg)
    assert shapes["visual.patch_embed.proj.weight"] == (1024, 3, 2, 16, 16)
    assert shapes["visual.patch_embed.proj.bias"] == (1024,) and shapes["visual.pos_embed.weight"] == (2304, 1024)
    assert shapes["visual.blocks.23.norm2.bias"] == (1024,)
    assert shapes["visual.blocks.0.mlp.linear_fc1.weight"] == (4096, 1024)
    assert shapes["visual.merger.norm.weight"] == (1024,)
    assert shapes["visual.deepstack_merger_list.2.norm.weight"] == (4096,)         # (over a unit's 4 patches)
    assert shapes["visual.deepstack_merger_list.2.linear_fc2.weight"] == (2560, 4096)
    assert not any("gate_proj" in n or "ln_q" in n or n.startswith("visual.deepstack_merger_list.3") for n in shapes)
    # 24 blocks of 12 tensors, the embedding's 3, the merger's 6 and 3 DeepStack mergers' 6 each
    assert len(shapes) == 24 * 12 + 3 + 6 + 3 * 6


def test_5x_s_config_and_tensors_read_under_the_tower_s_names(tmp_path):
    _write(tmp_path, TINY_5X)
    cfg, tensors = vision_checkpoint(str(tmp_path))
    assert isinstance(cfg, QwenVisionConfig)
    assert cfg == QwenVisionConfig(
        hidden_size=32, intermediate_size=64, num_layers=4, num_heads=2, patch_size=16, temporal_patch_size=2,
        spatial_merge_size=2, window_size=32, fullatt_block_indexes=(0, 1, 2, 3), out_hidden_size=64,
        image_token_id=5, vision_start_token_id=3, vision_end_token_id=4, rope_theta=10000.0, family="qwen3_vl",
        num_position_embeddings=16, deepstack_visual_indexes=(1, 2))
    assert cfg.row_width == 192 and cfg.position_side == 4
    assert set(tensors) == set(qwen_vision_shapes(cfg))                 # (model.visual.* read as visual.*)
    # no architectures: the model type says which
    config = {k: v for k, v in TINY_5X.items() if k != "architectures"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert vision_checkpoint(str(tmp_path))[0] == cfg


@pytest.mark.parametrize("change, why", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'.*tanh GELU only"),
    ({"deepstack_visual_indexes": [1, 4]}, r"deepstack_visual_indexes \[1, 4\] name a layer outside the 4"),
    ({"deepstack_visual_indexes": [2, 1]}, r"deepstack_visual_indexes \[2, 1\] are not increasing"),
    ({"deepstack_visual_indexes": [1, 1]}, r"deepstack_visual_indexes \[1, 1\] are not increasing"),
    ({"num_position_embeddings": 15}, "num_position_embeddings 15 is not a square grid"),
    ({"num_position_embeddings": 0}, "num_position_embeddings 0 is not a square grid"),
    ({"out_hidden_size": 48}, "out_hidden_size 48 is not the text model's hidden_size 64"),
    ({"num_heads": 3}, "3 heads of hidden_size 32"),
    ({"depth": 0}, "every size must be positive"),
    ({"num_position_embeddings": None}, "lacks or mistypes"),
    ({"deepstack_visual_indexes": None}, "lacks or mistypes"),
])
def test_a_config_the_tower_cannot_run_is_named(tmp_path, change, why):
    _write(tmp_path, TINY_5X)
    config = copy.deepcopy(TINY_5X)
    config["vision_config"].update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightLoadError, match=why):
        vision_checkpoint(str(tmp_path))


def test_a_missing_tensor_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    _write(tmp_path, TINY_5X)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.visual.deepstack_merger_list.1.norm.bias"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightLoadError, match="'visual.deepstack_merger_list.1.norm.bias' is missing"):
        vision_checkpoint(str(tmp_path))


def test_the_hub_s_processor_config_cuts_16_pixel_patches():
    spec = ImageSpec.from_config(HUB_PROCESSOR)
    assert (spec.patch, spec.merge, spec.temporal, spec.min_pixels, spec.max_pixels) == (16, 2, 2, 65536, 16777216)
    assert (spec.mean, spec.std, spec.resample) == ((0.5,) * 3, (0.5,) * 3, 3)
    # transformers' smart_resize with factor 32: each edge rounded to whole 32-pixel units, the area in bounds
    assert qwen_grid(1000, 700, spec) == (44, 62)          # 704 x 992 pixels, as they are
    assert qwen_grid(100, 100, spec) == (16, 16)           # raised to 65,536 pixels: 256 x 256
