"""Qwen2-VL's and Qwen2.5-VL's image processor (llm_serving/vision/images.py: `qwen_grid`, `qwen_patches`): the
patch rows of decoded images equal transformers' PIL Qwen2VLImageProcessor's `pixel_values`, and the grid its
`image_grid_thw`, for images resized up, down and to another aspect; the processor config read in the Hub's 4.x
keys and transformers 5.x's `size`."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.families import needs_transformers, qwen2vl_pil_processor

pytest.importorskip("PIL", reason="Pillow reads the images (pip install -e .)")
from PIL import Image  # noqa: E402

from llm_serving.vision import ImageError, ImageSpec, frames, qwen_grid, qwen_patches  # noqa: E402
from llm_serving.vision.images import grid  # noqa: E402

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# the Hub's Qwen2.5-VL preprocessor_config.json (transformers 4.x): the area bounds as keys of their own, no resample
HUB_4X = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
          "image_mean": list(CLIP_MEAN), "image_std": list(CLIP_STD), "image_processor_type": "Qwen2VLImageProcessor",
          "processor_class": "Qwen2_5_VLProcessor"}


def _image(seed: int, width: int, height: int, mode: str = "RGB"):
    channels = len(mode)
    array = np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(array, mode)


# (width, height, mode, why): the test processor's bounds are 4 to 16 merge units (56 x 56 to 28 x 28 x 16 pixels)
IMAGES = [(56, 56, "RGB", "square, one resize-free unit grid"), (200, 60, "RGB", "wide"),
          (40, 130, "RGB", "tall"), (9, 7, "RGB", "tiny: raised to min_pixels"),
          (900, 700, "RGB", "big: cut to max_pixels"), (101, 77, "RGBA", "transparent"),
          (3000, 20, "RGB", "long and thin: past max_pixels even so (one unit high at least)")]


@pytest.mark.parametrize("width,height,mode", [i[:3] for i in IMAGES], ids=[i[3].split(":")[0] for i in IMAGES])
def test_patches_are_transformers_pixel_values(width, height, mode):
    """Each image alone: its rows, in transformers' order, within 1e-6 (they agree to the bit: the same Pillow resize
    on the 8-bit image, the rescale in float64, the normalization in float32)."""
    processor = qwen2vl_pil_processor(min_pixels=56 * 56, max_pixels=28 * 28 * 16)
    spec = ImageSpec.from_config(processor.to_dict())
    image = _image(width * height, width, height, mode)
    theirs = processor(images=[image], return_tensors="np")
    ours = qwen_patches(image, spec)
    (t, gh, gw), = theirs["image_grid_thw"].tolist()
    assert t == 1 and qwen_grid(width, height, spec) == (gh, gw)
    assert ours.shape == (gh // 2, gw // 2, 4, 3 * 2 * 14 * 14) and ours.dtype == np.float32
    np.testing.assert_allclose(ours.reshape(gh * gw, -1), theirs["pixel_values"], atol=1e-6, rtol=0)
    assert [a.shape for a in frames(image, spec)] == [ours.shape]           # one frame: the whole image
    assert grid(width, height, spec) == (0, 0)                               # (no tiles)


def test_the_default_bounds_and_the_hub_s_config_give_transformers_rows():
    """The Hub's 4.x file (its bounds; bicubic, as transformers defaults) on a photo-sized image."""
    processor = qwen2vl_pil_processor(min_pixels=HUB_4X["min_pixels"], max_pixels=HUB_4X["max_pixels"])
    spec = ImageSpec.from_config(HUB_4X)
    image = _image(5, 333, 250)
    theirs = processor(images=[image], return_tensors="np")
    ours = qwen_patches(image, spec)
    assert theirs["image_grid_thw"].tolist() == [[1, *qwen_grid(333, 250, spec)]] == [[1, 18, 24]]
    np.testing.assert_allclose(ours.reshape(18 * 24, -1), theirs["pixel_values"], atol=1e-6, rtol=0)


def test_the_grid_is_transformers_from_the_size_alone():
    """smart_resize's rounding (halves to even), its max_pixels cut (rounded down) and min_pixels raise (rounded
    up), and its refusal of an aspect ratio past 200, for sizes whose pixels are never made."""
    needs_transformers()
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    for bounds in ((56 * 56, 28 * 28 * 16), (HUB_4X["min_pixels"], HUB_4X["max_pixels"]),
                   (56 * 56, 28 * 28 * 1280)):
        spec = ImageSpec.from_config({"image_processor_type": "Qwen2VLImageProcessor",
                                      "size": {"shortest_edge": bounds[0], "longest_edge": bounds[1]}})
        for width, height in ((42, 42), (70, 14), (14, 70), (1, 1), (4000, 20), (20, 4000), (1920, 1080),
                              (1080, 1920), (8000, 6000), (3, 599), (518, 518), (531, 517), (98, 42)):
            h, w = smart_resize(height, width, 28, *bounds)
            assert qwen_grid(width, height, spec) == (h // 14, w // 14), (bounds, width, height)
    for width, height in ((4001, 20), (20, 4001)):
        with pytest.raises(ValueError, match="aspect ratio"):
            smart_resize(height, width, 28)
        with pytest.raises(ImageError, match="at most 200 times its short one"):
            qwen_grid(width, height, spec)


def test_the_spec_is_read_from_either_key_style(tmp_path):
    """The Hub's 4.x keys (min_pixels, max_pixels beside the sizes; no resample: bicubic), transformers 5.x's `size`
    (shortest_edge and longest_edge are areas there), early 4.x's size {min_pixels, max_pixels}, 5.x's
    processor_config.json; the other families' configs untouched."""
    want = ImageSpec(0, 0, 3, 1 / 255, CLIP_MEAN, CLIP_STD, patch=14, merge=2, temporal=2, min_pixels=3136,
                     max_pixels=12845056)
    assert ImageSpec.from_config(HUB_4X) == want
    v5 = {"size": {"shortest_edge": 3136, "longest_edge": 12845056}, "patch_size": 14, "temporal_patch_size": 2,
          "merge_size": 2, "resample": 3, "rescale_factor": 1 / 255, "image_mean": list(CLIP_MEAN),
          "image_std": list(CLIP_STD), "image_processor_type": "Qwen2VLImageProcessorFast"}
    assert ImageSpec.from_config(v5) == want
    early = {"size": {"min_pixels": 3136, "max_pixels": 12845056}, "temporal_patch_size": 2, "merge_size": 2}
    assert ImageSpec.from_config(early) == want                 # (recognized by its keys; CLIP's mean and std)
    # the keys beside `size` win, as transformers' constructor applies them after it
    assert ImageSpec.from_config({**v5, "max_pixels": 28 * 28 * 16}).max_pixels == 28 * 28 * 16
    assert ImageSpec.from_config({"patch_size": 16, "temporal_patch_size": 1, "merge_size": 4}) == ImageSpec(
        0, 0, 3, 1 / 255, CLIP_MEAN, CLIP_STD, patch=16, merge=4, temporal=1)
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": v5, "processor_class": "X"}))
    assert ImageSpec.from_dir(str(tmp_path)) == want
    for bad, why in (({**HUB_4X, "min_pixels": 10 ** 8}, "min_pixels at most max_pixels"),
                     ({**HUB_4X, "patch_size": 0}, "positive"),
                     ({**HUB_4X, "merge_size": "two"}, "whole numbers"),
                     ({**HUB_4X, "image_std": [1, 0, 1]}, "the std positive")):
        with pytest.raises(ValueError, match=why):
            ImageSpec.from_config(bad, "qwen.json")
    # Gemma 3's and SmolVLM's configs read as before: no patch
    assert ImageSpec.from_config({"size": {"height": 28, "width": 42}, "patch_size": 14}).patch is None
    smol = ImageSpec.from_config({"size": {"longest_edge": 64}, "max_image_size": {"longest_edge": 32}})
    assert (smol.tile, smol.patch) == (32, None)
    with pytest.raises(ValueError, match="Qwen2-VL image processor"):
        qwen_grid(10, 10, smol)


def test_patches_hold_each_patch_where_the_tower_reads_it():
    """Worked by hand: a unit's patches row by row, each patch's channels, its T equal frames, its pixels row by
    row; the values rescaled and normalized per channel."""
    spec = ImageSpec.from_config({"patch_size": 2, "merge_size": 2, "temporal_patch_size": 3, "min_pixels": 1,
                                  "max_pixels": 10 ** 6, "image_mean": [0, 0, 0], "image_std": [1, 1, 1],
                                  "rescale_factor": 1.0})
    values = np.arange(8 * 4 * 3, dtype=np.uint8).reshape(4, 8, 3)        # (H, W, C): 8 x 4 pixels, a 2 x 4 grid
    out = qwen_patches(Image.fromarray(values), spec)                      # (the size is whole units: no resize)
    assert out.shape == (1, 2, 4, 3 * 3 * 2 * 2)
    for unit_col in range(2):
        for k in range(4):                                                # the unit's patches row by row
            row, col = k // 2, unit_col * 2 + k % 2                       # the patch's place in the grid
            patch = values[row * 2:row * 2 + 2, col * 2:col * 2 + 2].transpose(2, 0, 1)        # (C, P, P)
            want = np.repeat(patch[:, None], 3, axis=1).reshape(-1)        # (C, T, P, P)
            np.testing.assert_array_equal(out[0, unit_col, k], want.astype(np.float32))
