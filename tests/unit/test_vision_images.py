"""Images in (llm_serving/vision/images.py): a request's image decoded and checked, every bad one an ImageError
saying why; the model's processor config read from either file transformers writes; the pixels a tower reads,
their values worked out by hand for images of known colours."""
from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest

PIL = pytest.importorskip("PIL", reason="Pillow reads the images (pip install -e .)")
from PIL import Image  # noqa: E402

from llm_serving.vision import ImageError, ImageSpec, decode, decode_data_url, pixels  # noqa: E402


def _png(image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def test_a_data_url_gives_its_bytes_and_every_other_url_says_why():
    data = _png(Image.new("RGB", (3, 2), (10, 20, 30)))
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    assert decode_data_url(url) == data
    assert decode_data_url("data:;base64," + base64.b64encode(data).decode()) == data     # (no media type)
    for bad, why in (("https://example.com/cat.png", "base64 data: URL"),
                     ("data:text/plain;base64,aGVsbG8=", "not an image"),
                     ("data:image/png,rawbytes", "must be base64"),
                     ("data:image/png;base64,@@@@", "base64 is not valid"),
                     (42, "must be a string")):
        with pytest.raises(ImageError, match=why):
            decode_data_url(bad)
    with pytest.raises(ImageError, match="larger than 10 bytes"):
        decode_data_url(url, max_bytes=10)


def test_decode_reads_an_image_and_refuses_what_is_not_one():
    image = decode(_png(Image.new("RGBA", (5, 4), (1, 2, 3, 4))))
    assert image.size == (5, 4) and image.getpixel((0, 0)) == (1, 2, 3, 4)
    whole = _png(Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)))
    for bad, why in ((b"", "empty"), (b"GIF89a but not really", "cannot be read|not an image"),
                     (b"hello, world", "not an image"), (whole[: len(whole) // 2], "truncated or corrupt")):
        with pytest.raises(ImageError, match=why):
            decode(bad)
    with pytest.raises(ImageError, match="64 x 64 pixels, more than the 4095 allowed"):
        decode(whole, max_pixels=4095)
    assert decode(whole, max_pixels=4096).size == (64, 64)


def test_the_spec_is_read_from_either_processor_file(tmp_path):
    raw = {"size": {"height": 28, "width": 42}, "resample": 3, "rescale_factor": 0.5, "image_mean": [0.1, 0.2, 0.3],
           "image_std": [1, 2, 4], "do_normalize": True}
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir(), new.mkdir()
    (old / "preprocessor_config.json").write_text(json.dumps(raw))
    (new / "processor_config.json").write_text(json.dumps({"image_processor": raw, "processor_class": "X"}))
    want = ImageSpec(28, 42, 3, 0.5, (0.1, 0.2, 0.3), (1.0, 2.0, 4.0))
    assert ImageSpec.from_dir(str(old)) == want == ImageSpec.from_dir(str(new))
    assert ImageSpec.from_dir(str(tmp_path)) is None                                   # a text model: none
    assert ImageSpec.from_config({"size": 7, "do_normalize": False, "do_rescale": False}) == \
        ImageSpec(7, 7, 2, 1.0, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    for bad, why in (({"size": {"height": 5}}, "height and width"),
                     ({"size": 5, "do_pan_and_scan": True, "pan_and_scan_max_num_crops": 1}, "2 crops or more"),
                     ({"size": 5, "image_std": [1, 0, 1]}, "positive")):
        with pytest.raises(ValueError, match=why):
            ImageSpec.from_config(bad)
    (old / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a readable processor config"):
        ImageSpec.from_dir(str(old))


def test_pixels_are_resized_rescaled_and_normalized_per_channel():
    spec = ImageSpec(4, 6, 2, 1 / 255, (0.5, 0.25, 0.0), (0.5, 0.25, 2.0))
    out = pixels(Image.new("RGB", (9, 3), (255, 0, 51)), spec)       # one colour: any resize keeps it
    assert out.shape == (3, 4, 6) and out.dtype == np.float32 and out.flags.c_contiguous
    np.testing.assert_allclose(out[0], (1.0 - 0.5) / 0.5, rtol=1e-6)
    np.testing.assert_allclose(out[1], (0.0 - 0.25) / 0.25, rtol=1e-6)
    np.testing.assert_allclose(out[2], (0.2 - 0.0) / 2.0, rtol=1e-6)
    # transparency over white, grey to three equal channels
    clear = pixels(Image.new("RGBA", (4, 4), (0, 0, 0, 0)), ImageSpec(4, 4))
    np.testing.assert_allclose(clear, 1.0, rtol=1e-6)
    grey = pixels(Image.new("L", (4, 4), 51), ImageSpec(4, 4))
    np.testing.assert_allclose(grey, 0.2 / 0.5 - 1.0, rtol=1e-6)
    # a left-to-right ramp at the spec's own size is not resized: each column its own value
    ramp = np.tile(np.arange(6, dtype=np.uint8) * 50, (4, 1))
    out = pixels(Image.fromarray(np.stack([ramp] * 3, -1)), ImageSpec(4, 6))
    np.testing.assert_allclose(out[0, 2], ramp[2] / 255 / 0.5 - 1.0, rtol=1e-6)
