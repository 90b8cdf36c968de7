"""Qwen3-VL's vision tower (models/vision_qwen.py, `family` "qwen3_vl") against transformers' on a tiny random
Qwen3VLForConditionalGeneration (tests/families.py's `make_qwen3_vl`: 4 full-attention blocks of width 32, 16-pixel
patches, a learned 4 x 4 grid of position rows, DeepStack mergers after blocks 1 and 2): images decoded and cut into
patches here (vision/images.py's `qwen_patches`, the PIL processor's pixel values to the bit), then the tower and
mergers in MindSpore graphs; each image's rows (the merger's, then the two DeepStack mergers', side by side) within
1e-5 (relative to the largest) of transformers' `model.model.visual` pooler_output and deepstack_features, for
grids equal to the position grid, larger, smaller on one side and not square; on MindSpore's ops, on the CPU
kernels' float panels, and on their int16 panels within their level. An image's layers run in parts, through
ImageEncoder.advance a layer a step (its DeepStack rows carried between steps as numpy), give the bits of one go,
for Qwen2.5-VL's tower too."""
from __future__ import annotations

import io

import numpy as np
import pytest

from tests.families import make_qwen3_vl, make_qwen25_vl, needs_transformers, qwen2vl_pil_processor

pytest.importorskip("mindspore")
pytest.importorskip("PIL", reason="Pillow reads the images (pip install -e .)")

# (width, height, mode) -> the patch grid (gh, gw) at the test processor's bounds (32-pixel merge units, 4 to 16 of
# them); the learned position grid is 4 x 4 patches
IMAGES = {"square": ((128, 128, "RGB"), (8, 8)),            # 4 x 4 units: the position grid stretched both ways
          "wide": ((200, 60, "RGB"), (4, 12)),              # 2 x 6 units: as high as the position grid, 3x as wide
          "tall": ((90, 200, "RGB"), (10, 4)),              # 5 x 2 units
          "the position grid": ((64, 64, "RGB"), (4, 4)),   # 2 x 2 units: the position rows as learned
          "tiny, transparent": ((9, 7, "RGBA"), (4, 6))}    # raised to min_pixels: 2 x 3 units
WIDTH = 64                                                  # the text model's (out_hidden_size)


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory):
    """The model's directory, and per image (IMAGES' order) its patches and transformers' rows of it."""
    needs_transformers()
    directory = tmp_path_factory.mktemp("qwen3_vl")
    model = make_qwen3_vl(directory, tokenizer=False)
    patches = _patches(directory, list(IMAGES))
    return directory, patches, _theirs(model, patches)


def _png(name: str) -> bytes:
    from PIL import Image

    (width, height, mode), _ = IMAGES[name]
    rng = np.random.default_rng(width * height)
    image = Image.fromarray(rng.integers(0, 256, (height, width, len(mode)), dtype=np.uint8), mode)
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def _patches(directory, names) -> list:
    from llm_serving.vision import ImageSpec, decode, qwen_patches

    spec = ImageSpec.from_dir(str(directory))
    return [qwen_patches(decode(_png(name)), spec) for name in names]


def _theirs(model, patches: list) -> list:
    """transformers' rows of the images, in one batch (model.model.visual): each image's pooler_output and its
    deepstack_features side by side, (tokens, 3 x 64)."""
    torch, _ = needs_transformers()
    rows = np.concatenate([p.reshape(-1, p.shape[-1]) for p in patches])
    grids = torch.tensor([[1, p.shape[0] * 2, p.shape[1] * 2] for p in patches])
    with torch.no_grad():
        out = model.model.visual(torch.from_numpy(rows), grids)
    assert len(out.deepstack_features) == 2
    merged = torch.cat([out.pooler_output, *out.deepstack_features], 1).numpy()
    return np.split(merged, np.cumsum([p.shape[0] * p.shape[1] for p in patches])[:-1])


def _tower(directory, **kernels):
    from llm_serving.models.mindspore_env import setup_mindspore
    from llm_serving.models.vision_qwen import QwenVisionTower
    from llm_serving.models.weights.vision import vision_checkpoint

    setup_mindspore("CPU", 0, None, None)
    cfg, weights = vision_checkpoint(str(directory))
    return cfg, QwenVisionTower(cfg, weights, **kernels)


def _kernels():
    from llm_serving.models.runner.kernels import build_vision_kernels

    return build_vision_kernels("CPU", "on")


def float_kernels_bound(kernels: str, fma: float) -> float:
    """The float kernels' bound against transformers, of the largest value: `fma` where they run on FMAs, 1e-4 where
    they run on AMX tiles (kernels/vision_layer_cpu.cc's bfloat16 pieces: products within ~4e-6 each, the
    attention's values' product ~2^-16, through the blocks)."""
    import ctypes

    return 1e-4 if ctypes.CDLL(kernels).VisionAmx(-1) else fma


def served_towers(tower_class, cfg, tensors) -> list:
    """(name, tower, bound of its largest value against transformers' float64 features) of each way the server
    runs `tower_class` (VisionTower, QwenVisionTower): MindSpore's ops, and where the vision kernels build, their
    float32 products (float_kernels_bound) and their int16 ones."""
    from llm_serving.models.runner.kernels import build_vision_kernels

    kernels = build_vision_kernels("CPU", "auto")
    towers = [("mindspore", tower_class(cfg, tensors), 2e-6)]
    if kernels is not None:
        towers += [("kernels", tower_class(cfg, tensors, kernels=kernels, threads=2),
                    float_kernels_bound(kernels, 2e-6)),
                   ("int16", tower_class(cfg, tensors, kernels=kernels, threads=2, int16=True), 3e-3)]
    return towers


def test_the_processor_s_pixels_are_transformers(qwen3_vl):
    from llm_serving.vision import decode

    directory, patches, _ = qwen3_vl
    names = list(IMAGES)
    processor = qwen2vl_pil_processor(patch_size=16, min_pixels=64 * 64, max_pixels=32 * 32 * 16,
                                      image_mean=[0.5] * 3, image_std=[0.5] * 3)
    theirs = processor(images=[decode(_png(n)) for n in names], return_tensors="np")
    assert theirs["image_grid_thw"].tolist() == [[1, *IMAGES[n][1]] for n in names]
    np.testing.assert_array_equal(np.concatenate([p.reshape(-1, p.shape[-1]) for p in patches]),
                                  theirs["pixel_values"])


@pytest.mark.parametrize("on", ["mindspore", "kernels"])
def test_the_tower_s_rows_are_transformers_for_decoded_images(qwen3_vl, on):
    """Every image's rows, in the prompt's order (merge units row by row), the merger's then the DeepStack
    mergers', against transformers' of a batch of all of them."""
    directory, patches, theirs = qwen3_vl
    cfg, tower = _tower(directory, **({"kernels": _kernels(), "threads": 2} if on == "kernels" else {}))
    assert (cfg.family, cfg.row_width, cfg.deepstack_visual_indexes, cfg.window_units) == ("qwen3_vl", 192, (1, 2), 1)
    assert cfg.patch_features == 3 * 2 * 16 * 16 and tower.nbytes > 0 and tower.int16 is False
    for name, image, want in zip(IMAGES, patches, theirs):
        gh, gw = IMAGES[name][1]
        ours = tower.encode(image)
        assert ours.shape == (1, gh // 2 * gw // 2, 3 * WIDTH) and ours.dtype == np.float32
        scale = np.abs(want).max()
        assert scale > 1.0                              # (random weights: not a projection of zeros)
        for part in range(3):                           # (the merger's, each DeepStack merger's: each its own scale)
            assert np.abs(want[:, part * WIDTH:(part + 1) * WIDTH]).max() > 0.1 * scale
        bound = float_kernels_bound(_kernels(), 1e-5) if on == "kernels" else 1e-5
        np.testing.assert_allclose(ours[0], want, atol=bound * scale, rtol=0, err_msg=f"{name} on {on}")
    tower.warm()                                        # (one merge unit: block 0's graph, the mergers')


def test_int16_products_are_transformers_within_their_level(qwen3_vl):
    """The blocks' products on int16 panels (13-bit columns, 14-bit x) and the attention's values in int16: within
    the level the other towers' int16 paths keep (about 1e-3 of the largest)."""
    directory, patches, theirs = qwen3_vl
    _, tower = _tower(directory, kernels=_kernels(), threads=2, int16=True)
    assert tower.int16 is True
    for name, image, want in zip(IMAGES, patches, theirs):
        error = float(np.abs(tower.encode(image)[0] - want).max() / np.abs(want).max())
        assert error < 5e-3, (name, error)


def test_layers_run_in_parts_give_the_bits_of_one_go(qwen3_vl):
    """embed, blocks 0-1, 1-1, 1-3, 3-4 with the state kept as numpy between (as the runner keeps it), project: the
    rows of `encode`, to the bit, on MindSpore's ops and on the kernels; the DeepStack rows made as their blocks run;
    a state without the DeepStack rows of the blocks before, or not through every block, is refused."""
    from llm_serving.models.vision_qwen import QwenState

    directory, patches, _ = qwen3_vl
    for kernels in ({}, {"kernels": _kernels(), "threads": 2, "int16": True}):
        _, tower = _tower(directory, **kernels)
        for image in patches[:2]:
            whole = tower.encode(image)
            state = tower.kept(tower.embed(image))
            assert isinstance(state, QwenState) and isinstance(state.x, np.ndarray) and state.deepstack == ()
            assert state.x.shape == image.shape[:3] + (32,)
            for (start, stop), made in zip(((0, 1), (1, 1), (1, 3), (3, 4)), (0, 0, 2, 2)):
                state = tower.kept(tower.run_layers(state, start, stop))
                assert len(state.deepstack) == made and state.x.shape == image.shape[:3] + (32,)
                assert all(r.shape == (image.shape[0] * image.shape[1], WIDTH) for r in state.deepstack)
            assert np.array_equal(tower.project(state), whole)
            with pytest.raises(ValueError, match="holds 0 DeepStack rows, not the 1 of the blocks before it"):
                tower.run_layers(state.x, 2, 4)
            with pytest.raises(ValueError, match="holds 1 DeepStack rows, not 2"):
                tower.project(QwenState(state.x, state.deepstack[:1]))


def encode_ahead(tower, patches: list) -> None:
    """ImageEncoder.advance (runner/images.py) with no time budget runs one block a call from the patches' shared
    memory and says done after the last; `rows` then adds the mergers: the rows `encode` gives in one go, to the
    bit. Two images under way at once, interleaved; nothing of either kept past its rows."""
    from llm_serving.models.runner.images import ImageEncoder
    from llm_serving.shm.images import PixelSegment

    whole = [tower.encode(p)[0] for p in patches]
    segments = [PixelSegment.create(p) for p in patches]
    try:
        encoder = ImageEncoder(tower, cache_bytes=1 << 20)
        layers = tower.cfg.num_layers
        done = [[encoder.advance(key, seg.name, seg.shape, 0.0) for key, seg in zip("ab", segments)]
                for _ in range(layers)]
        assert done == [[False, False]] * (layers - 1) + [[True, True]]
        for key, seg, want in zip("ab", segments, whole):
            assert np.array_equal(encoder.rows(key, seg.name, seg.shape), want), key
        assert not encoder._partial                              # nothing kept per image past its rows
    finally:
        for seg in segments:
            seg.unlink()


def test_images_encoded_ahead_a_layer_a_step_give_the_rows_of_one_go(qwen3_vl):
    directory, patches, _ = qwen3_vl
    encode_ahead(_tower(directory, kernels=_kernels(), threads=2, int16=True)[1], patches[1:3])
    encode_ahead(_tower(directory)[1], patches[3:5])


def test_qwen25_vl_s_images_encoded_ahead_give_the_rows_of_one_go(tmp_path):
    """The same for Qwen2.5-VL's tower (windowed blocks, no DeepStack: its state the patches alone)."""
    needs_transformers()
    make_qwen25_vl(tmp_path, tokenizer=False)
    rng = np.random.default_rng(5)
    _, tower = _tower(tmp_path, kernels=_kernels(), threads=2)
    encode_ahead(tower, [rng.standard_normal((2, 7, 4, 3 * 2 * 14 * 14)).astype(np.float32),
                         rng.standard_normal((3, 4, 4, 3 * 2 * 14 * 14)).astype(np.float32)])
