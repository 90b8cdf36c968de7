"""An image as a request carries it, made into what a vision tower reads.

- `decode_data_url`: a `data:image/...;base64,` URL (OpenAI's `image_url`) to its bytes.
- `decode`: bytes to a Pillow image, every way they can be wrong an `ImageError` (the HTTP layer's 400): not an
  image, truncated or corrupt, or more pixels than the cap (checked from the header, before the pixels are decoded).
- `ImageSpec.from_dir`: the model's image processor, from `preprocessor_config.json` (transformers 4.x) or
  `processor_config.json`'s `image_processor` (5.x): the size the tower takes, the resampling filter, the rescale
  factor, the per-channel mean and standard deviation.
- `pixels`: the image as the tower reads it, float32 (3, height, width): converted to RGB, resized to the spec's
  fixed size (Gemma 3's SigLIP: 896 x 896), rescaled, normalized.
"""
from __future__ import annotations

import base64
import binascii
import io
import json
import os
import re
from dataclasses import dataclass
from typing import Optional

import numpy as np

__all__ = ["DEFAULT_MAX_PIXELS", "ImageError", "ImageSpec", "decode", "decode_data_url", "pixels"]

# an image's pixels at most (width x height) unless the operator sets otherwise: a 32-megapixel photo decodes to
# 96 MB of RGB before it is resized, and Pillow's own guard (89 M pixels) is far above what a request should cost
DEFAULT_MAX_PIXELS = 32 * 1024 * 1024

_DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,",
                       re.ASCII)


class ImageError(ValueError):
    """An image a request carries that cannot be read: its message says why, for the client (a 400)."""


def decode_data_url(url: str, max_bytes: Optional[int] = None) -> bytes:
    """The bytes of a base64 `data:` URL (`data:image/png;base64,...`). ImageError for another scheme, a media type
    that is not an image, a URL that is not base64 or whose base64 is broken, or more than `max_bytes`."""
    if not isinstance(url, str):
        raise ImageError("an image URL must be a string")
    match = _DATA_URL.match(url)
    if match is None:
        scheme = url.split(":", 1)[0] if ":" in url[:16] else url[:16]
        raise ImageError(f"an image must be given as a base64 data: URL (data:image/png;base64,...), not {scheme!r}")
    kind = match.group("type")
    if kind is not None and not kind.lower().startswith("image/"):
        raise ImageError(f"a data: URL of type {kind!r} is not an image")
    if match.group("b64") is None:
        raise ImageError("an image's data: URL must be base64 (data:image/png;base64,...)")
    payload = url[match.end():]
    if max_bytes is not None and len(payload) * 3 // 4 > max_bytes:
        raise ImageError(f"the image is larger than {max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the image's base64 is not valid") from None


def decode(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS):
    """A Pillow image of `data`, its pixels read (so a truncated file fails here). ImageError when `data` is empty,
    is not an image Pillow reads, is cut short or corrupt, or has more than `max_pixels` pixels."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise ImageError("the image is empty")
    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ImageError("the data is not an image (PNG, JPEG, WebP, GIF, BMP and the other formats Pillow "
                         "reads)") from None
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise ImageError(f"the image cannot be read: {e}") from None
    width, height = image.size
    if width < 1 or height < 1:
        raise ImageError(f"the image is {width} x {height} pixels")
    if width * height > max_pixels:
        raise ImageError(f"the image is {width} x {height} pixels, more than the {max_pixels} allowed")
    try:
        image.load()
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise ImageError(f"the image is truncated or corrupt: {e}") from None
    return image


@dataclass(frozen=True)
class ImageSpec:
    """A model's image processor: what `pixels` makes of an image for its tower."""
    height: int
    width: int
    resample: int = 2                     # Pillow's filter code (2: bilinear, 3: bicubic)
    rescale: float = 1 / 255
    mean: tuple = (0.5, 0.5, 0.5)
    std: tuple = (0.5, 0.5, 0.5)

    @classmethod
    def from_dir(cls, model_dir: str) -> Optional["ImageSpec"]:
        """The processor of a HF model directory, or None when it has none (a text model); a config that cannot be
        read is a ValueError naming the file."""
        raw, where = None, None
        for name in ("preprocessor_config.json", "processor_config.json"):
            path = os.path.join(model_dir, name)
            if os.path.isfile(path):
                try:
                    with open(path, encoding="utf-8") as f:
                        raw = json.load(f)
                except (OSError, json.JSONDecodeError) as e:
                    raise ValueError(f"{path}: not a readable processor config ({e})") from None
                raw, where = raw.get("image_processor", raw), path
                break
        if raw is None:
            return None
        return cls.from_config(raw, where)

    @classmethod
    def from_config(cls, raw: dict, where: str = "the processor config") -> "ImageSpec":
        size = raw.get("size") or {}
        if isinstance(size, int):
            size = {"height": size, "width": size}
        try:
            height, width = int(size["height"]), int(size["width"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{where}: size must give height and width, not {size!r}") from None
        if raw.get("do_pan_and_scan"):
            raise ValueError(f"{where}: do_pan_and_scan (Gemma 3's crops of a wide image) is not supported yet")
        mean = tuple(float(v) for v in raw.get("image_mean", (0.5, 0.5, 0.5))) if raw.get("do_normalize", True) \
            else (0.0, 0.0, 0.0)
        std = tuple(float(v) for v in raw.get("image_std", (0.5, 0.5, 0.5))) if raw.get("do_normalize", True) \
            else (1.0, 1.0, 1.0)
        rescale = float(raw.get("rescale_factor", 1 / 255)) if raw.get("do_rescale", True) else 1.0
        if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
            raise ValueError(f"{where}: image_mean and image_std must be three values each, the std positive")
        return cls(height, width, int(raw.get("resample", 2)), rescale, mean, std)


def pixels(image, spec: ImageSpec) -> np.ndarray:
    """`image` (a Pillow image) as the tower reads it: float32 (3, spec.height, spec.width), RGB (transparency over
    white), resized with the spec's filter, times its rescale factor, less its mean, over its standard deviation."""
    rgb = image
    if image.mode != "RGB":                 # transparent parts over white, as the models' processors do
        from PIL import Image

        rgba = image.convert("RGBA")
        rgb = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255)), rgba).convert("RGB")
    if rgb.size != (spec.width, spec.height):
        rgb = rgb.resize((spec.width, spec.height), resample=spec.resample)
    array = np.asarray(rgb, dtype=np.float32) * np.float32(spec.rescale)
    array = (array - np.asarray(spec.mean, np.float32)) / np.asarray(spec.std, np.float32)
    return np.ascontiguousarray(array.transpose(2, 0, 1))
