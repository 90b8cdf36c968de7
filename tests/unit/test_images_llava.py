"""LLaVA 1.5's images, the pure logic (issue 67): CLIP's processor (vision/images.py's `pixels` with
`ImageSpec.shortest_edge`: the short edge resized, the middle cropped) against transformers' PIL CLIPImageProcessor,
and the prompt's runs of <image> (vision/model.py's `ImageFacts`: `expand`, `spans`), images side by side one run."""
from __future__ import annotations

import numpy as np
import pytest

from tests.families import needs_transformers

pytest.importorskip("PIL", reason="Pillow reads the images (pip install -e .)")
from PIL import Image  # noqa: E402

from llm_serving.vision import ImageSpec  # noqa: E402
from llm_serving.vision.images import pixels  # noqa: E402
from llm_serving.vision.model import ImageFacts  # noqa: E402

CLIP = {"size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336}, "do_center_crop": True,
        "resample": 3, "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711], "image_processor_type": "CLIPImageProcessor"}


def _image(seed: int, width: int, height: int, mode: str = "RGB"):
    array = np.random.default_rng(seed).integers(0, 256, (height, width, len(mode)), dtype=np.uint8)
    return Image.fromarray(array, mode)


@pytest.mark.parametrize("width,height,mode", [(336, 336, "RGB"), (640, 480, "RGB"), (300, 700, "RGB"),
                                               (50, 20, "RGB"), (1001, 337, "RGBA"), (336, 1000, "RGB")])
def test_pixels_are_transformers_clip_processor_s(width, height, mode):
    """LLaVA 1.5's preprocessor_config.json: the image's short edge made 336 (the long one in proportion, rounded
    down), the middle 336 x 336 cropped, CLIP's mean and std: transformers' pixel_values within float32's rounding."""
    _, transformers = needs_transformers()
    spec = ImageSpec.from_config(CLIP)
    assert (spec.height, spec.width, spec.shortest_edge, spec.resample) == (336, 336, 336, 3)
    image = _image(width * height, width, height, mode)
    kind = getattr(transformers, "CLIPImageProcessorPil", transformers.CLIPImageProcessor)
    theirs = kind(**{k: v for k, v in CLIP.items() if k != "image_processor_type"})(images=[image],
                                                                                   return_tensors="np")
    ours = pixels(image, spec)
    assert ours.shape == (3, 336, 336) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, theirs["pixel_values"][0], rtol=0, atol=2e-6)


@pytest.mark.parametrize("width,height,mode", [(640, 480, "RGB"), (300, 701, "RGB"), (21, 50, "RGBA"),
                                               (336, 336, "RGB")])
def test_padded_pixels_are_transformers_llava_processor_s(width, height, mode):
    """LlavaImageProcessor with do_pad (LLaVA 1.5's own preprocessing, which llama.cpp's mmprojs keep too): the image
    padded to a square of its long edge, centred, in the mean's colour, then as CLIP's: transformers' pixel_values
    within float32's rounding."""
    _, transformers = needs_transformers()
    raw = {**CLIP, "image_processor_type": "LlavaImageProcessor", "do_pad": True}
    spec = ImageSpec.from_config(raw)
    assert spec.pad_square and not ImageSpec.from_config({**CLIP, "do_pad": True}).pad_square   # (CLIP's has none)
    image = _image(width + height, width, height, mode)
    kind = getattr(transformers, "LlavaImageProcessorPil", transformers.LlavaImageProcessor)
    theirs = kind(**{k: v for k, v in raw.items() if k != "image_processor_type"})(images=[image], return_tensors="np")
    np.testing.assert_allclose(pixels(image, spec), theirs["pixel_values"][0], rtol=0, atol=2e-6)


def test_a_bad_shortest_edge_is_refused_naming_it():
    with pytest.raises(ValueError, match="shortest_edge"):
        ImageSpec.from_config({**CLIP, "size": {"shortest_edge": "big"}})
    with pytest.raises(ValueError, match="shortest_edge"):
        ImageSpec.from_config({**CLIP, "size": {"shortest_edge": 0}})


def test_the_prompt_s_image_runs():
    """Each <image> mark becomes tokens_per_image placeholders; two images side by side are one run of twice that,
    read as two images; a run of another length is a ValueError naming it."""
    facts = ImageFacts(4, 7, "<image>", "", "<image>", ImageSpec.from_config(CLIP), family="llava")
    assert facts.expand("a<image>b<image><image>") == "a" + "<image>" * 4 + "b" + "<image>" * 8
    ids = [1, 7, 7, 7, 7, 5, 7, 7, 7, 7, 7, 7, 7, 7, 9]
    assert facts.spans(ids) == [(1, 4), (6, 4), (10, 4)]
    with pytest.raises(ValueError, match="6 image placeholder tokens"):
        facts.spans([1, 7, 7, 7, 7, 7, 7, 2])
