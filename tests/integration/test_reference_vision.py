"""The float64 references for images (llm_serving/reference_vision.py's tower, reference_llama.py's forward with image
rows) against transformers run in float64 on tiny random Gemma 3 and SmolVLM models: the tower's rows and every
position's logits of an image prompt agree to 2e-6 (relative: transformers' norms run in float32), and dropping Gemma 3's bidirectional image mask
changes them. Qwen2.5-VL's tower and merger on a tiny random model, images of several shapes: its rows are
transformers' to 2e-6, and to 1e-10 once transformers' float32 steps are float64, whether its weights are read from
the HF directory or from llama.cpp's mmproj. Qwen3-VL's tower, mergers and DeepStack mergers likewise: its rows
transformers' to 2e-6, and to 1e-10 with transformers' float32 rotary steps in float64 where the position rows'
weights are exact in float32. Qwen2-VL's (LayerNorms, quick GELU, full attention) from the directory and the mmproj:
transformers' to 2e-6, and to 1e-10 with its rotary steps in float64. No MindSpore: these are the precision gate's
yardsticks, not the served model."""
from __future__ import annotations

import copy

import numpy as np
import pytest

from tests.families import (make_gemma3_vl, make_qwen2_vl, make_qwen3_vl, make_qwen25_vl, make_smolvlm,
                            needs_transformers)


def _float64_model(tmp_path_factory, make, name: str) -> tuple:
    """The tiny model `make` writes (its directory), and a float64 copy of it for the comparisons."""
    torch, _ = needs_transformers()
    directory = tmp_path_factory.mktemp(name)
    return directory, copy.deepcopy(make(directory, tokenizer=False)).to(torch.float64)


@pytest.fixture(scope="module")
def gemma3_vl(tmp_path_factory):
    return _float64_model(tmp_path_factory, make_gemma3_vl, "gemma3_vl_reference")


@pytest.fixture(scope="module")
def smolvlm(tmp_path_factory):
    return _float64_model(tmp_path_factory, make_smolvlm, "smolvlm_reference")


@pytest.fixture(scope="module")
def qwen25_vl(tmp_path_factory):
    return _float64_model(tmp_path_factory, make_qwen25_vl, "qwen25_vl_reference")


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory):
    return _float64_model(tmp_path_factory, make_qwen2_vl, "qwen2_vl_reference")


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory):
    return _float64_model(tmp_path_factory, make_qwen3_vl, "qwen3_vl_reference")


# transformers' RMS norms compute in float32 whatever the model's dtype (Gemma's `x.float()`, Llama's `.to(float32)`):
# its float64 model is float64 but for those, about 1e-7 apart
TOLERANCE = 2e-6


def _relative(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


def test_gemma3_s_tower_and_image_prompt_logits_are_transformers(gemma3_vl):
    torch, _ = needs_transformers()
    from llm_serving.reference_llama import ReferenceLlama
    from llm_serving.reference_vision import ReferenceVision

    directory, model = gemma3_vl
    vision = ReferenceVision(str(directory))
    cfg = vision.config
    pixels = np.random.default_rng(0).standard_normal((2, 3, 56, 56))
    with torch.no_grad():
        theirs = model.model.get_image_features(torch.from_numpy(pixels)).pooler_output.numpy()
    ours = np.stack([vision.encode(p) for p in pixels])
    assert ours.shape == theirs.shape == (2, 4, 64)
    assert _relative(ours, theirs) < TOLERANCE
    assert vision.bidirectional

    # a prompt of two images: text, <start_of_image>, 4 image tokens, <end_of_image>, ... (the processor's layout)
    image, boi, eoi = cfg.image_token_id, cfg.boi_token_id, cfg.eoi_token_id
    ids = [2, 40, 41, boi] + [image] * 4 + [eoi, 42, 43, 44, boi] + [image] * 4 + [eoi, 45, 46]
    x = torch.tensor([ids])
    with torch.no_grad():
        want = model(input_ids=x, pixel_values=torch.from_numpy(pixels), token_type_ids=(x == image).long(),
                     use_cache=False).logits[0].numpy()
    text = ReferenceLlama(str(directory))
    first, second = [i for i in range(len(ids)) if ids[i] == image and ids[i - 1] != image]
    images = [(first, ours[0], True), (second, ours[1], True)]
    got = text.forward(text.new_sequence(), ids, 0, images)
    assert _relative(got, want) < TOLERANCE
    # fed in two parts, the second image's tokens in the second: the same logits from the cached keys
    seq = text.new_sequence()
    head = text.forward(seq, ids[:second], 0, images[:1])
    tail = text.forward(seq, ids[second:], second, [(0, ours[1], True)])
    assert _relative(np.concatenate([head, tail]), want) < TOLERANCE
    # causal image tokens are another model: the test can tell
    causal = text.forward(text.new_sequence(), ids, 0, [(o, r, False) for o, r, _ in images])
    assert _relative(causal, want) > 1e-3


def test_smolvlm_s_tower_and_image_prompt_logits_are_transformers(smolvlm):
    torch, _ = needs_transformers()
    from llm_serving.reference_llama import ReferenceLlama
    from llm_serving.reference_vision import ReferenceVision

    directory, model = smolvlm
    vision = ReferenceVision(str(directory))
    assert not vision.bidirectional and vision.config.projector == "shuffle"
    frames = np.random.default_rng(1).standard_normal((1, 3, 3, 32, 32))      # one image of three frames
    with torch.no_grad():
        features = model.model.get_image_features(torch.from_numpy(frames)).pooler_output
    theirs = torch.cat([f.reshape(-1, 64) for f in features]).numpy()       # (each frame's 4 tokens, in order)
    ours = np.stack([vision.encode(f) for f in frames[0]])
    assert ours.shape == (3, 4, 64) and theirs.shape == (12, 64)
    assert _relative(ours.reshape(12, 64), theirs) < TOLERANCE

    image = vision.config.image_token_id
    ids = [1, 40, 3] + [image] * 4 + [3] + [image] * 4 + [3, 41] + [image] * 4 + [42, 43]
    with torch.no_grad():
        want = model(input_ids=torch.tensor([ids]), pixel_values=torch.from_numpy(frames),
                     use_cache=False).logits[0].numpy()
    starts = [i for i in range(len(ids)) if ids[i] == image and ids[i - 1] != image]
    text = ReferenceLlama(str(directory))
    got = text.forward(text.new_sequence(), ids, 0, [(s, rows, False) for s, rows in zip(starts, ours)])
    assert _relative(got, want) < TOLERANCE


def _float64_rotary(monkeypatch, module, embedding) -> None:
    """A Qwen-VL tower's float32 rotary steps in float64 (transformers' module `module`, its rotary class
    `embedding`): the angles (float32 frequencies times float32 positions) and their application (q and k cast to
    float32)."""
    torch, _ = needs_transformers()

    def rotary(self, x, position_ids):          # compute_axial_rope_parameters' frequencies, in float64
        width = getattr(self.config, "embed_dim", None) or self.config.hidden_size      # (Qwen2-VL's: embed_dim)
        base, half = self.config.rope_parameters["rope_theta"], width // self.config.num_heads // 2
        inv_freq = 1.0 / base ** (torch.arange(0, half, 2, dtype=torch.float64) / half)
        angles = position_ids[..., None].double() * inv_freq
        return self.recomposition_frequencies(angles.cos()), self.recomposition_frequencies(angles.sin())

    def rotate(q, k, cos, sin):
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        return q * cos + module.rotate_half(q) * sin, k * cos + module.rotate_half(k) * sin

    monkeypatch.setattr(embedding, "forward", rotary)
    monkeypatch.setattr(module, "apply_rotary_pos_emb_vision", rotate)


def _float64_qwen_tower(monkeypatch) -> None:
    """transformers' Qwen2.5-VL tower with its float32 steps in float64: the RMS norms (cast to float32 and back) and
    the rotary steps (`_float64_rotary`). The rest of its code runs as it is."""
    torch, _ = needs_transformers()
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as qwen

    def rms_norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(qwen.Qwen2_5_VLRMSNorm, "forward", rms_norm)
    _float64_rotary(monkeypatch, qwen, qwen.Qwen2_5_VLVisionRotaryEmbedding)


def test_qwen25_vl_s_tower_is_transformers_from_the_directory_and_the_mmproj(qwen25_vl, tmp_path, monkeypatch):
    torch, _ = needs_transformers()
    from PIL import Image

    from llm_serving.reference_vision import ReferenceVision
    from llm_serving.vision.images import ImageSpec, qwen_patches
    from tests.integration.test_images_qwen import write_qwen_mmproj

    directory, model = qwen25_vl
    vision = ReferenceVision(str(directory))
    write_qwen_mmproj(directory, tmp_path / "mmproj.gguf")
    from_mmproj = ReferenceVision(None, mmproj=str(tmp_path / "mmproj.gguf"))
    assert not vision.bidirectional and vision.config.window_units == 2
    rng = np.random.default_rng(4)
    # (height, width, channels) -> merge units (windows of 2 x 2 units): square 4 x 4 (four whole windows), wide
    # 2 x 7 and tall 7 x 2 (a half window at the end), 3 x 5 (partial windows right and below), a transparent 4 x 4
    shapes = {(112, 112, 3): (4, 4), (60, 200, 3): (2, 7), (200, 60, 3): (7, 2), (84, 140, 3): (3, 5),
              (100, 100, 4): (4, 4)}
    images = [Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), "RGBA" if shape[2] == 4 else "RGB")
              for shape in shapes]
    patches = [qwen_patches(image, ImageSpec.from_dir(str(directory))) for image in images]
    assert [p.shape[:2] for p in patches] == list(shapes.values())

    def transformers_rows(p):
        gh2, gw2, units, features = p.shape         # transformers' pixel_values: the same rows, in the same order
        with torch.no_grad():
            found = model.model.get_image_features(torch.from_numpy(p.reshape(gh2 * gw2 * units, features)),
                                                   torch.tensor([[1, 2 * gh2, 2 * gw2]]))
        return found.pooler_output[0].numpy()       # (one image's tokens, 64)

    ours = [vision.encode(p) for p in patches]
    as_they_run = [transformers_rows(p) for p in patches]
    _float64_qwen_tower(monkeypatch)
    in_float64 = [transformers_rows(p) for p in patches]
    for p, rows, theirs, exact in zip(patches, ours, as_they_run, in_float64):
        assert rows.dtype == np.float64 and rows.shape == theirs.shape == (p.shape[0] * p.shape[1], 64)
        assert _relative(rows, theirs) < TOLERANCE
        assert _relative(rows, exact) < 1e-10
        assert _relative(from_mmproj.encode(p), rows) < 1e-12


def _float64_qwen3_tower(monkeypatch) -> None:
    """transformers' Qwen3-VL tower with its float32 rotary steps in float64: the angles (float32 frequencies times
    float32 positions) and their application (q and k cast to float32). The position rows' interpolation weights
    stay float32 (vision_utils computes them so): exact where an axis of n patches samples the 4-row grid at
    i 3 / (n - 1) for n of 2 or 4."""
    needs_transformers()
    from transformers.models.qwen3_vl import modeling_qwen3_vl as qwen3

    _float64_rotary(monkeypatch, qwen3, qwen3.Qwen3VLVisionRotaryEmbedding)


def test_qwen3_vl_s_tower_and_deepstack_rows_are_transformers(qwen3_vl, monkeypatch):
    torch, _ = needs_transformers()
    from llm_serving.reference_vision import ReferenceVision

    directory, model = qwen3_vl
    vision = ReferenceVision(str(directory))
    cfg = vision.config
    assert not vision.bidirectional and cfg.family == "qwen3_vl" and cfg.row_width == 3 * 64
    rng = np.random.default_rng(6)
    # merge units (gh2, gw2), the patch grid twice each: 1 and 2 units a side sample the 4 x 4 position grid at its
    # rows (weights 0 and 1), 3 to 5 between them; square, wide, tall
    units = [(1, 1), (2, 2), (1, 2), (2, 1), (3, 5), (4, 4), (5, 2)]
    patches = [rng.standard_normal((gh2, gw2, 4, cfg.patch_features)) for gh2, gw2 in units]

    def transformers_rows(p):
        gh2, gw2, _, features = p.shape             # transformers' pixel_values: the same rows, in the same order
        with torch.no_grad():
            out = model.model.visual(torch.from_numpy(p.reshape(-1, features)), torch.tensor([[1, 2 * gh2, 2 * gw2]]))
        return torch.cat([out.pooler_output, *out.deepstack_features], 1).numpy()   # (tokens, 3 x 64)

    ours = [vision.encode(p) for p in patches]
    as_they_run = [transformers_rows(p) for p in patches]
    _float64_qwen3_tower(monkeypatch)
    in_float64 = [transformers_rows(p) for p in patches]
    for (gh2, gw2), rows, theirs, exact in zip(units, ours, as_they_run, in_float64):
        assert rows.dtype == np.float64 and rows.shape == theirs.shape == (gh2 * gw2, 3 * 64)
        for part in range(3):                       # the merger's, then each DeepStack merger's
            assert _relative(rows[:, 64 * part:64 * (part + 1)], theirs[:, 64 * part:64 * (part + 1)]) < TOLERANCE
        if max(gh2, gw2) <= 2:
            assert _relative(rows, exact) < 1e-10, (gh2, gw2)


def test_qwen2_vl_s_tower_is_transformers_from_the_directory_and_the_mmproj(qwen2_vl, tmp_path, monkeypatch):
    """Qwen2-VL's tower and merger (random patches of merge-unit grids square, wide, tall and one unit) from the HF
    directory: transformers' rows to 2e-6 as it runs, to 1e-10 with its float32 rotary steps in float64; from the
    mmproj llama.cpp's converter writes, the same rows."""
    torch, _ = needs_transformers()
    from transformers.models.qwen2_vl import modeling_qwen2_vl as qwen2

    from llm_serving.reference_vision import ReferenceVision
    from tests.integration.test_images_qwen2 import write_qwen2_mmproj

    directory, model = qwen2_vl
    vision = ReferenceVision(str(directory))
    write_qwen2_mmproj(directory, tmp_path / "mmproj.gguf")
    from_mmproj = ReferenceVision(None, mmproj=str(tmp_path / "mmproj.gguf"))
    cfg = vision.config
    assert not vision.bidirectional and (cfg.family, cfg.row_width) == ("qwen2_vl", 64)
    rng = np.random.default_rng(8)
    units = [(1, 1), (2, 2), (1, 4), (3, 2)]
    patches = [rng.standard_normal((gh2, gw2, 4, cfg.patch_features)) for gh2, gw2 in units]

    def transformers_rows(p):
        gh2, gw2, _, features = p.shape
        with torch.no_grad():
            out = model.model.visual(torch.from_numpy(p.reshape(-1, features)), torch.tensor([[1, 2 * gh2, 2 * gw2]]))
        return out.pooler_output.numpy()

    ours = [vision.encode(p) for p in patches]
    as_they_run = [transformers_rows(p) for p in patches]
    _float64_rotary(monkeypatch, qwen2, qwen2.Qwen2VLVisionRotaryEmbedding)
    in_float64 = [transformers_rows(p) for p in patches]
    for (gh2, gw2), p, rows, theirs, exact in zip(units, patches, ours, as_they_run, in_float64):
        assert rows.dtype == np.float64 and rows.shape == theirs.shape == (gh2 * gw2, 64)
        assert _relative(rows, theirs) < TOLERANCE
        assert _relative(rows, exact) < 1e-10, (gh2, gw2)
        assert _relative(from_mmproj.encode(p), rows) < 1e-12
