"""Gemma 3's pan-and-scan (vision/images.py's `crop_boxes` and `frames`, vision/model.py's expansion) against
transformers' own Gemma 3 processor: the crops of images of many sizes and settings, their pixels, and the text an
image's mark becomes. Pure Python over Pillow and numpy; transformers is the reference."""
from __future__ import annotations

import dataclasses
import itertools
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("PIL", reason="Pillow reads the images (pip install -e .)")

from PIL import Image  # noqa: E402

from llm_serving.vision.images import PAN_AND_SCAN, ImageSpec, crop_boxes, frames  # noqa: E402
from llm_serving.vision.model import ImageFacts  # noqa: E402
from tests.families import needs_transformers  # noqa: E402

SIZES = [(w, h) for w, h in itertools.product((20, 56, 67, 130, 300, 999, 1500), (20, 41, 56, 230, 700, 1024))]
SETTINGS = [PAN_AND_SCAN, (16, 4, 1.2), (30, 3, 1.5), (1, 2, 1.0), (100, 6, 2.0)]


def _processor(**kwargs):
    _, transformers = needs_transformers()
    kind = getattr(transformers, "Gemma3ImageProcessorPil", transformers.Gemma3ImageProcessor)
    return kind(**kwargs)


def _image(width: int, height: int, seed: int = 0, mode: str = "RGB"):
    rng = np.random.default_rng(seed + width * 7 + height)
    return Image.fromarray(rng.integers(0, 256, (height, width, len(mode)), dtype=np.uint8), mode)


def _spec(scan: tuple, on: bool = True) -> ImageSpec:
    return ImageSpec(56, 56, 2, 1 / 255, (0.5,) * 3, (0.5,) * 3, pan_and_scan=on, scan=scan)


@pytest.mark.parametrize("scan", SETTINGS)
def test_the_crops_are_transformers_for_every_size(scan):
    """transformers' `pan_and_scan` on a (3, H, W) array gives the crops; ours are the same boxes of the same image
    (their count, and each crop's pixels), none when the spec does not pan and scan."""
    processor = _processor()
    least, most, ratio = scan
    crops_seen = set()
    for width, height in SIZES:
        array = np.arange(height * width, dtype=np.int64).reshape(1, height, width)       # each pixel its own value
        theirs = processor.pan_and_scan(array, least, most, ratio)
        boxes = crop_boxes(width, height, _spec(scan))
        assert len(boxes) == len(theirs), (width, height, scan)
        for (left, top, right, bottom), crop in zip(boxes, theirs):
            np.testing.assert_array_equal(array[:, top:bottom, left:right], crop, err_msg=str((width, height, scan)))
        assert crop_boxes(width, height, _spec(scan, on=False)) == []
        crops_seen.add(len(boxes))
    assert max(crops_seen) >= 2, crops_seen                 # (the sizes reach crops: the check is not vacuous)
    if scan[2] > 1.0:
        assert 0 in crops_seen, crops_seen                  # (and images near square, uncropped)


def test_the_frames_are_the_processors_pixels_and_crops():
    """An image's frames (the whole image, then each crop, each resized to the tower's 56 x 56) are the pixel_values
    transformers' processor makes with do_pan_and_scan, and its num_crops is the count of our boxes: a wide image,
    a tall transparent one, one near square (no crops)."""
    processor = _processor(size={"height": 56, "width": 56}, do_pan_and_scan=True, pan_and_scan_min_crop_size=16,
                           pan_and_scan_max_num_crops=4, pan_and_scan_min_ratio_to_activate=1.2)
    spec = ImageSpec.from_config(processor.to_dict())
    assert spec.pan_and_scan and spec.scan == (16, 4, 1.2)
    for image in (_image(130, 40), _image(50, 120, mode="RGBA"), _image(60, 55)):
        theirs = processor(images=[image], return_tensors="np")
        ours = frames(image, spec)
        assert theirs["num_crops"].tolist() == [len(ours) - 1] == [len(crop_boxes(*image.size, spec))]
        np.testing.assert_allclose(np.stack(ours), theirs["pixel_values"], atol=1e-6, err_msg=str(image.size))
    assert [len(frames(image, spec)) for image in (_image(130, 40), _image(50, 120), _image(60, 55))] == [4, 3, 1]


def test_an_images_mark_becomes_the_processors_text_and_the_setting_decides():
    """Gemma3Processor's own replace_image_token (with our frame's sequence as its full_image_sequence) is the text a
    mark becomes for each image's crop count; without pan-and-scan (the setting 'off', or the processor's config
    without it and 'auto') every mark is the one sequence; 'on' turns it on with the processor's settings; another
    family's facts are left as they are."""
    _, transformers = needs_transformers()
    spec = _spec((16, 4, 1.2))
    facts = ImageFacts(4, 9, "<start_of_image>", "<end_of_image>", "<image_soft_token>", spec)
    full = facts._gemma3_sequence()
    assert full == "\n\n<start_of_image>" + "<image_soft_token>" * 4 + "<end_of_image>\n\n"
    sizes = [(130, 40), (60, 55), (50, 120)]
    text = "Look:<start_of_image> and<start_of_image>, then<start_of_image>."
    stub = SimpleNamespace(full_image_sequence=full)
    pieces = [transformers.Gemma3Processor.replace_image_token(stub, {"num_crops": [len(crop_boxes(*s, spec))]}, 0)
              for s in sizes]
    assert [p.count("<start_of_image>") for p in pieces] == [4, 1, 3]
    assert facts.needs_sizes and facts.expand(text, sizes) == (
        f"Look:{pieces[0]} and{pieces[1]}, then{pieces[2]}.")
    off = facts.with_pan_and_scan("off")
    assert not off.needs_sizes and off.expand(text, sizes) == text.replace("<start_of_image>", full)
    assert facts.with_pan_and_scan("auto") is facts and off.with_pan_and_scan("on").spec == spec
    qwen = dataclasses.replace(facts, family="qwen2_5_vl")
    assert qwen.with_pan_and_scan("on") is qwen
    # the Hub's processor config leaves it unset (null): off, transformers' settings for 'on'
    hub = ImageSpec.from_config({"size": {"height": 896, "width": 896}, "do_pan_and_scan": None,
                                 "pan_and_scan_max_num_crops": None, "pan_and_scan_min_crop_size": None})
    assert (hub.pan_and_scan, hub.scan) == (False, PAN_AND_SCAN)
    assert ImageSpec.from_config({"size": 896, "do_pan_and_scan": True}).pan_and_scan
