"""Qwen2.5-VL's vision tower (models/vision_qwen.py) against transformers' on a tiny random
Qwen2_5_VLForConditionalGeneration (tests/families.py's `make_qwen25_vl`: windows of 2 x 2 merge units, full attention
in blocks 1 and 3): images decoded and cut into patches here (vision/images.py's `qwen_patches`), then the tower and
merger in MindSpore graphs, each image's tokens within 1e-5 (relative to the largest) of `get_image_features`'s for
grids that fill their windows and grids that leave the last row or column of windows partial; an image's layers run
in parts give the bits of one go; the checkpoint read under transformers 5.x's names and config and the Hub's 4.x
ones; the checkpoint's faults named."""
from __future__ import annotations

import io
import json

import numpy as np
import pytest

from tests.families import make_qwen25_vl, needs_transformers, qwen2vl_pil_processor

pytest.importorskip("mindspore")
pytest.importorskip("PIL", reason="Pillow reads the images (pip install -e .)")

# (width, height, mode) -> the patch grid (gh, gw) at the test processor's bounds, and its windows of merge units
IMAGES = {"square": ((56, 56, "RGB"), (4, 4)),              # 2 x 2 units: one whole window
          "wide": ((200, 60, "RGB"), (4, 14)),              # 2 x 7 units: 1 x 4 windows, the last half empty
          "tall": ((40, 130, "RGB"), (10, 2)),              # 5 x 1 units: 3 x 1 windows, each half empty
          "partial both ways": ((101, 77, "RGBA"), (6, 8)),  # 3 x 4 units, transparent: the bottom windows partial
          "tiny": ((9, 7, "RGB"), (4, 6))}                  # raised to min_pixels: 2 x 3 units


@pytest.fixture(scope="module")
def qwen_vl(tmp_path_factory):
    needs_transformers()
    directory = tmp_path_factory.mktemp("qwen25_vl")
    return directory, make_qwen25_vl(directory, tokenizer=False)


def _png(name: str) -> bytes:
    from PIL import Image

    (width, height, mode), _ = IMAGES[name]
    rng = np.random.default_rng(width * height)
    image = Image.fromarray(rng.integers(0, 256, (height, width, len(mode)), dtype=np.uint8), mode)
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def _tower(directory, **kernels):
    from llm_serving.models.mindspore_env import setup_mindspore
    from llm_serving.models.vision_qwen import QwenVisionTower
    from llm_serving.models.weights.vision import vision_checkpoint

    setup_mindspore("CPU", 0, None, None)
    cfg, weights = vision_checkpoint(str(directory))
    return cfg, QwenVisionTower(cfg, weights, **kernels)


def _patches(directory, names) -> list:
    from llm_serving.vision import ImageSpec, decode, qwen_patches

    spec = ImageSpec.from_dir(str(directory))
    return [qwen_patches(decode(_png(name)), spec) for name in names]


def _theirs(model, patches: list) -> list:
    """transformers' image features of the images in one batch (get_image_features), each image's rows."""
    torch, _ = needs_transformers()
    rows = np.concatenate([p.reshape(-1, p.shape[-1]) for p in patches])
    grids = torch.tensor([[1, p.shape[0] * 2, p.shape[1] * 2] for p in patches])
    with torch.no_grad():
        out = model.model.get_image_features(torch.from_numpy(rows), grids).pooler_output
    return [o.numpy() for o in out]


def test_the_tower_s_tokens_are_transformers_for_decoded_images(qwen_vl):
    """Every image's tokens, in the prompt's order (merge units row by row), against transformers' of a batch of all
    of them; its pixels too (the PIL processor's, to the bit)."""
    from llm_serving.vision import decode

    directory, model = qwen_vl
    cfg, tower = _tower(directory)
    assert (cfg.out_hidden_size, cfg.window_units, cfg.fullatt_block_indexes, cfg.image_token_id) == (64, 2, (1, 3), 5)
    assert cfg.patch_features == 3 * 2 * 14 * 14 and tower.nbytes > 0 and tower.int16 is False
    names = list(IMAGES)
    patches = _patches(directory, names)
    processor = qwen2vl_pil_processor(min_pixels=56 * 56, max_pixels=28 * 28 * 16)
    theirs_pixels = processor(images=[decode(_png(n)) for n in names], return_tensors="np")
    assert theirs_pixels["image_grid_thw"].tolist() == [[1, *IMAGES[n][1]] for n in names]
    np.testing.assert_array_equal(np.concatenate([p.reshape(-1, p.shape[-1]) for p in patches]),
                                  theirs_pixels["pixel_values"])
    for name, ours_patches, theirs in zip(names, patches, _theirs(model, patches)):
        gh, gw = IMAGES[name][1]
        ours = tower.encode(ours_patches)
        assert ours.shape == (1, gh // 2 * gw // 2, 64) and ours.dtype == np.float32
        scale = np.abs(theirs).max()
        assert scale > 1.0                              # (random weights: not a projection of zeros)
        np.testing.assert_allclose(ours[0], theirs, atol=1e-5 * scale, rtol=0, err_msg=name)


def test_layers_run_in_parts_give_the_bits_of_one_go(qwen_vl, monkeypatch):
    """embed, layers 0-1, 1-3, 3-4 with numpy between (as the agent keeps an image between steps), project: the
    rows of `encode`, to the bit; the same with the full layers' queries in chunks of two windows (QUERY_ROWS),
    which are transformers' rows too."""
    from llm_serving.models import vision_qwen

    directory, model = qwen_vl
    names = ["wide", "partial both ways"]
    patches = _patches(directory, names)
    monkeypatch.setattr(vision_qwen, "QUERY_ROWS", 32)         # (2 windows of 16 patches a chunk)
    _, chunked = _tower(directory)
    assert chunked.full_block.chunk_windows == 2
    monkeypatch.undo()
    _, tower = _tower(directory)
    for name, image, theirs in zip(names, patches, _theirs(model, patches)):
        for t in (tower, chunked):
            whole = t.encode(image)
            x = t.embed(image)
            assert tuple(x.shape) == image.shape[:3] + (32,)
            for start, stop in ((0, 1), (1, 1), (1, 3), (3, 4)):
                x = t.run_layers(x.asnumpy(), start, stop)
                assert tuple(x.shape) == image.shape[:3] + (32,)
            assert np.array_equal(t.project(x.asnumpy()), whole), name
            np.testing.assert_allclose(whole[0], theirs, atol=1e-5 * np.abs(theirs).max(), rtol=0, err_msg=name)
    tower.warm()                                                  # (one merge unit: the graphs of one window)


def test_the_products_on_the_cpu_kernels_are_transformers_within_their_level(qwen_vl):
    """The blocks' four products on the vision kernels' VisionLinear: on the checkpoint's own float panels as near
    transformers as MindSpore's matmuls; on int16 panels (13-bit columns, 14-bit x) within the level the SigLIP
    towers' int16 products keep (about 1e-3 of the largest); in parts the bits of one go either way."""
    from llm_serving.models.runner.kernels import build_vision_kernels

    directory, model = qwen_vl
    kernels = build_vision_kernels("CPU", "on")
    names = ["wide", "partial both ways"]
    patches = _patches(directory, names)
    for int16, tolerance in ((False, 1e-5), (True, 5e-3)):
        _, tower = _tower(directory, kernels=kernels, threads=2, int16=int16)
        assert tower.int16 is int16
        for name, image, theirs in zip(names, patches, _theirs(model, patches)):
            whole = tower.encode(image)
            scale = np.abs(theirs).max()
            error = float(np.abs(whole[0] - theirs).max() / scale)
            assert error < tolerance, (name, int16, error)
            x = tower.embed(image)
            for start, stop in ((0, 2), (2, 4)):
                x = tower.run_layers(x.asnumpy(), start, stop)
            assert np.array_equal(tower.project(x.asnumpy()), whole), (name, int16)


def _v4_config(config: dict) -> dict:
    """A 5.x Qwen2.5-VL config.json as the Hub's 4.x files have it: the text model's keys at the top (rope_theta,
    rope_scaling), the vision config's channels as in_chans, no rotary parameters of its own."""
    text = dict(config["text_config"])
    rope = text.pop("rope_parameters")
    vision = {k: v for k, v in config["vision_config"].items() if k not in ("rope_parameters", "in_channels")}
    return {**{k: v for k, v in config.items() if k != "text_config"}, **text, "rope_theta": rope["rope_theta"],
            "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]},
            "vision_config": {**vision, "in_chans": 3, "model_type": "qwen2_5_vl"}, "model_type": "qwen2_5_vl"}


def test_both_name_and_config_styles_read_the_same_tower(qwen_vl, tmp_path):
    """transformers 5.24 saves `visual.*` (the Hub's 4.x names) with a nested text_config; a 5.x file may hold
    `model.visual.*` (and `model.language_model.*`), a 4.x config.json is flat: the same tower from each."""
    from safetensors.numpy import load_file, save_file

    from llm_serving.models.weights.vision import vision_checkpoint

    directory, _ = qwen_vl
    tensors = load_file(str(directory / "model.safetensors"))
    assert any(n.startswith("visual.") for n in tensors) and not any(n.startswith("model.visual.") for n in tensors)
    save_file({("model." + n if n.startswith("visual.") else n): a for n, a in tensors.items()},
              str(tmp_path / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(_v4_config(config)))
    cfg, weights = vision_checkpoint(str(tmp_path))
    want_cfg, want_weights = vision_checkpoint(str(directory))
    assert cfg == want_cfg and set(weights) == set(want_weights)
    assert all(n.startswith("visual.") for n in weights)
    image = _patches(directory, ["wide"])[0]
    np.testing.assert_array_equal(_tower(tmp_path)[1].encode(image), _tower(directory)[1].encode(image))


def test_the_checkpoint_s_faults_are_named(qwen_vl, tmp_path):
    from safetensors.numpy import load_file, save_file

    from llm_serving.models.weights import WeightLoadError
    from llm_serving.models.weights.vision import vision_checkpoint

    directory, _ = qwen_vl
    config = json.loads((directory / "config.json").read_text())
    tensors = load_file(str(directory / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({n: a for n, a in tensors.items() if n != "visual.blocks.2.mlp.up_proj.bias"},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightLoadError, match=r"'visual.blocks.2.mlp.up_proj.bias' is missing from the vision tower"):
        vision_checkpoint(str(tmp_path))
    save_file({n: (a.T.copy() if n == "visual.merger.mlp.2.weight" else a) for n, a in tensors.items()},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightLoadError, match=r"'visual.merger.mlp.2.weight' has shape \(128, 64\), expected "
                                              r"\(64, 128\)"):
        vision_checkpoint(str(tmp_path))
    vision = config["vision_config"]
    for change, why in (({"hidden_act": "gelu"}, "hidden_act 'gelu'.*silu"),
                        ({"out_hidden_size": 48}, "out_hidden_size 48 is not the text model's hidden_size 64"),
                        ({"fullatt_block_indexes": [1, 4]}, r"\[1, 4\] name a layer outside the 4"),
                        ({"window_size": 60}, "window_size 60 is not a whole number of merge units of 28"),
                        ({"num_heads": 3}, "3 heads of hidden_size 32"),
                        ({"depth": 0}, "every size must be positive"),
                        ({"window_size": None}, "lacks or mistypes")):
        (tmp_path / "config.json").write_text(json.dumps({**config, "vision_config": {**vision, **change}}))
        with pytest.raises(WeightLoadError, match=why):
            vision_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**config,
                                                      "architectures": ["Qwen2_5OmniForConditionalGeneration"]}))
    with pytest.raises(WeightLoadError, match="vision tower of Qwen2_5OmniForConditionalGeneration is not read here"):
        vision_checkpoint(str(tmp_path))
    _, tower = _tower(directory)
    with pytest.raises(ValueError, match=r"patches of shape \(gh2, gw2, 4, 1176\)"):
        tower.encode(np.zeros((2, 2, 4, 588), np.float32))
