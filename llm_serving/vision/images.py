"""An image as a request carries it, made into what a vision tower reads.

- `decode_data_url`: a `data:image/...;base64,` URL (OpenAI's `image_url`) to its bytes.
- `decode`: bytes to a Pillow image, every way they can be wrong an `ImageError` (the HTTP layer's 400): not an
  image, truncated or corrupt, or more pixels than the cap (checked from the header, before the pixels are decoded).
- `ImageSpec.from_dir`: the model's image processor, from `preprocessor_config.json` (transformers 4.x) or
  `processor_config.json`'s `image_processor` (5.x): the size the tower takes, the resampling filter, the rescale
  factor, the per-channel mean and standard deviation.
- `pixels`: the image as the tower reads it, float32 (3, height, width): converted to RGB, resized to the spec's
  fixed size (Gemma 3's SigLIP: 896 x 896), rescaled, normalized.
- Gemma 3's pan-and-scan (`ImageSpec.pan_and_scan`, transformers' do_pan_and_scan): a wide (or tall) image, its
  aspect at least `min_ratio` (1.2), also cut into 2 to `max_crops` (4) side-by-side (or stacked) crops of equal
  width (height), their number its aspect rounded half up, none narrower than `min_crop` (256) pixels (`crop_boxes`,
  from the size alone: the prompt's expansion needs the count); `frames` gives the whole image, then each crop, each
  resized to the tower's size as `pixels` resizes the image.
- `frames`: SmolVLM's (Idefics3's) image splitting, as transformers' PIL image processor does it: the image resized
  so that its longest edge is `size.longest_edge`, then to whole tiles of `max_image_size.longest_edge` (the aspect
  kept, each edge rounded up), cut into its rows x cols tiles, and the whole image resized to one tile after them
  (the global frame); an image of one tile is that tile alone (0 x 0). Every resize on the 8-bit RGB image, with
  the spec's filter (LANCZOS); each frame then rescaled and normalized. `grid` gives (rows, cols) from the image's
  size alone: the prompt's expansion needs it before the pixels are made.
- `qwen_patches`: Qwen2-VL's and Qwen2.5-VL's processor (transformers' PIL Qwen2VLImageProcessor): the image resized
  so that each edge is a whole number of merge units (`patch` x `merge` pixels) and its area within
  [min_pixels, max_pixels], the aspect kept as nearly as that allows (`qwen_grid`, from the size alone); rescaled,
  normalized, and cut into patches grouped by merge unit, each patch's values repeated `temporal` times (a still
  image is a clip of that many equal frames to the tower's 3-D patch embedding).
- Pixtral's (Mistral 3's; `ImageSpec.pixtral`): the image scaled down, each edge floored, until neither is past
  `size.longest_edge`, then each edge rounded up to whole merge units, resized (bicubic) to that; its patches cut as
  Qwen2-VL's are, one frame (`temporal` 1): merge units row by row, each unit's patches, each patch C x P x P.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Optional

import numpy as np

__all__ = ["DEFAULT_MAX_PIXELS", "PAN_AND_SCAN", "ImageError", "ImageSpec", "crop_boxes", "decode", "decode_data_url",
           "frames", "grid", "image_size", "pixels", "qwen_grid", "qwen_patches"]

# an image's pixels at most (width x height) unless the operator sets otherwise: a 32-megapixel photo decodes to
# 96 MB of RGB before it is resized, and Pillow's own guard (89 M pixels) is far above what a request should cost
DEFAULT_MAX_PIXELS = 32 * 1024 * 1024

_DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,",
                       re.ASCII)


# Gemma 3's pan-and-scan where its processor config leaves them unset (transformers' defaults): the least crop side
# in pixels, the most crops, the least aspect ratio (long edge over short) that crops an image
PAN_AND_SCAN = (256, 4, 1.2)


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
    """A model's image processor: what `pixels` (or, with a `tile`, `frames`; with a `patch`, `qwen_patches`) makes
    of an image for its tower."""
    height: int
    width: int
    resample: int = 2                     # Pillow's filter code (1: LANCZOS, 2: bilinear, 3: bicubic)
    rescale: float = 1 / 255
    mean: tuple = (0.5, 0.5, 0.5)
    std: tuple = (0.5, 0.5, 0.5)
    tile: Optional[int] = None            # SmolVLM's frames: the tower's image (max_image_size.longest_edge) ...
    longest_edge: Optional[int] = None    # ... the longest edge an image is first resized to (size.longest_edge)
    split: bool = True                    # ... cut into tiles (do_image_splitting), else the image as one tile
    patch: Optional[int] = None           # Qwen2-VL's (height and width then 0: the size follows the image): the
    merge: int = 2                        # patch side in pixels, merge x merge patches one token (spatial_merge_size),
    temporal: int = 2                     # the frames a patch spans (temporal_patch_size), and the bounds of the
    min_pixels: int = 56 * 56             # resized image's area
    max_pixels: int = 28 * 28 * 1280
    pan_and_scan: bool = False            # Gemma 3's crops of a wide or tall image (do_pan_and_scan), by `scan`:
    scan: tuple = PAN_AND_SCAN            # (min crop side, max crops, min aspect ratio), as PAN_AND_SCAN
    shortest_edge: Optional[int] = None   # CLIP's (LLaVA 1.5's): the short edge resized to this, then the middle
                                          # height x width cropped (size.shortest_edge, crop_size); with
    pad_square: bool = False              # LlavaImageProcessor's do_pad, the image first padded to a square of its
                                          # long edge, centred, in the mean's colour (its values times 255, floored)

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

    @property
    def pixtral(self) -> bool:
        """Whether this is Pixtral's processor (Mistral 3's): an image's size bounded by its longest edge, then each
        edge rounded up to whole merge units (`_pixtral_size`), one frame of patches as Qwen2-VL's are cut."""
        return self.patch is not None and self.longest_edge is not None

    @classmethod
    def from_config(cls, raw: dict, where: str = "the processor config") -> "ImageSpec":
        if "Pixtral" in str(raw.get("image_processor_type", "")):
            return cls._pixtral(raw, where)
        if _is_qwen(raw):
            return cls._qwen(raw, where)
        size = raw.get("size") or {}
        if isinstance(size, int):
            size = {"height": size, "width": size}
        own = {}
        if isinstance(size, dict) and "shortest_edge" in size:         # CLIP's (LLaVA 1.5's)
            crop = raw.get("crop_size") if raw.get("do_center_crop", True) else None
            crop = {"height": crop, "width": crop} if isinstance(crop, int) else crop
            try:
                own = {"shortest_edge": int(size["shortest_edge"]),
                       "pad_square": bool(raw.get("do_pad")) and "Llava" in str(raw.get("image_processor_type", ""))}
                size = crop or {"height": own["shortest_edge"], "width": own["shortest_edge"]}
            except (TypeError, ValueError):
                raise ValueError(f"{where}: size.shortest_edge must be a number of pixels") from None
            if own["shortest_edge"] < 1:
                raise ValueError(f"{where}: size.shortest_edge must be positive")
        if isinstance(size, dict) and "longest_edge" in size:          # SmolVLM's, Idefics3's
            try:
                tile = int((raw.get("max_image_size") or {})["longest_edge"])
                own = {"tile": tile, "longest_edge": int(size["longest_edge"]),
                          "split": bool(raw.get("do_image_splitting", True))}
                size = {"height": tile, "width": tile}
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"{where}: size.longest_edge needs max_image_size.longest_edge (the tile)") from None
        try:
            height, width = int(size["height"]), int(size["width"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{where}: size must give height and width, not {size!r}") from None
        if not own:                                                     # (Gemma 3's pan-and-scan)
            try:
                scan = (int(raw.get("pan_and_scan_min_crop_size") or PAN_AND_SCAN[0]),
                        int(raw.get("pan_and_scan_max_num_crops") or PAN_AND_SCAN[1]),
                        float(raw.get("pan_and_scan_min_ratio_to_activate") or PAN_AND_SCAN[2]))
            except (TypeError, ValueError):
                raise ValueError(f"{where}: the pan_and_scan_* settings must be numbers") from None
            if scan[0] < 1 or scan[1] < 2 or scan[2] < 1.0:
                raise ValueError(f"{where}: pan-and-scan needs a least crop side of 1 pixel or more, 2 crops or "
                                 f"more, and an aspect ratio of 1 or more to activate (not {scan})")
            own = {"pan_and_scan": bool(raw.get("do_pan_and_scan")), "scan": scan}
        mean = tuple(float(v) for v in raw.get("image_mean", (0.5, 0.5, 0.5))) if raw.get("do_normalize", True) \
            else (0.0, 0.0, 0.0)
        std = tuple(float(v) for v in raw.get("image_std", (0.5, 0.5, 0.5))) if raw.get("do_normalize", True) \
            else (1.0, 1.0, 1.0)
        rescale = float(raw.get("rescale_factor", 1 / 255)) if raw.get("do_rescale", True) else 1.0
        if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
            raise ValueError(f"{where}: image_mean and image_std must be three values each, the std positive")
        return cls(height, width, int(raw.get("resample", 2)), rescale, mean, std, **own)

    @classmethod
    def _qwen(cls, raw: dict, where: str) -> "ImageSpec":
        """Qwen2-VL's processor config: the area bounds from `min_pixels` / `max_pixels` (the Hub's files), else from
        `size` as {"shortest_edge": min, "longest_edge": max} (what transformers 5.x writes; areas, despite the
        names) or {"min_pixels", "max_pixels"} (early 4.x); the keys beside `size` win, as transformers reads
        them. Bicubic and CLIP's mean and std when the file does not say."""
        size = raw.get("size") if isinstance(raw.get("size"), dict) else {}
        bounds = {"min_pixels": size.get("shortest_edge", size.get("min_pixels", 56 * 56)),
                  "max_pixels": size.get("longest_edge", size.get("max_pixels", 28 * 28 * 1280))}
        bounds.update({key: raw[key] for key in bounds if raw.get(key) is not None})
        try:
            fields = {"patch": int(raw.get("patch_size", 14)), "merge": int(raw.get("merge_size", 2)),
                      "temporal": int(raw.get("temporal_patch_size", 2)),
                      **{key: int(value) for key, value in bounds.items()}}
        except (TypeError, ValueError):
            raise ValueError(f"{where}: patch_size, merge_size, temporal_patch_size, min_pixels and max_pixels must "
                             "be whole numbers") from None
        if min(fields.values()) < 1 or fields["min_pixels"] > fields["max_pixels"]:
            raise ValueError(f"{where}: patch_size, merge_size, temporal_patch_size and the pixel bounds must be "
                             f"positive, min_pixels at most max_pixels ({fields})")
        normalize, rescaled = raw.get("do_normalize", True), raw.get("do_rescale", True)
        mean = tuple(float(v) for v in raw.get("image_mean", _CLIP_MEAN)) if normalize else (0.0, 0.0, 0.0)
        std = tuple(float(v) for v in raw.get("image_std", _CLIP_STD)) if normalize else (1.0, 1.0, 1.0)
        if len(mean) != 3 or len(std) != 3 or min(std) <= 0:
            raise ValueError(f"{where}: image_mean and image_std must be three values each, the std positive")
        rescale = float(raw.get("rescale_factor", 1 / 255)) if rescaled else 1.0
        return cls(0, 0, int(raw.get("resample", 3)), rescale, mean, std, **fields)


    @classmethod
    def _pixtral(cls, raw: dict, where: str) -> "ImageSpec":
        """Pixtral's processor config (PixtralImageProcessor): `size.longest_edge` (or a square height and width),
        `patch_size` an int or {"height", "width"} alike; one patch a merge unit here (`merge` 1: Mistral 3's merge
        is its model config's, vision/model.py sets it); bicubic and CLIP's mean and std when the file does not
        say."""
        size, patch = raw.get("size") or {}, raw.get("patch_size", 16)
        try:
            if isinstance(patch, dict):
                patch = int(patch["height"]) if int(patch["height"]) == int(patch["width"]) else -1
            longest = int(size["longest_edge"]) if "longest_edge" in size else (
                int(size["height"]) if int(size["height"]) == int(size["width"]) else -1)
            patch = int(patch)
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{where}: a Pixtral processor needs size.longest_edge and patch_size (whole "
                             "numbers)") from None
        if min(patch, longest) < 1:
            raise ValueError(f"{where}: a Pixtral processor's patch_size and size.longest_edge must be positive and "
                             f"square ({raw.get('patch_size')!r}, {raw.get('size')!r})")
        spec = cls._qwen({**raw, "patch_size": patch, "merge_size": 1, "temporal_patch_size": 1,
                          "min_pixels": 1, "max_pixels": longest * longest}, where)
        return dataclasses.replace(spec, longest_edge=longest)


# OpenAI CLIP's per-channel mean and standard deviation: Qwen2-VL's processor's when its file gives none
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def _is_qwen(raw: dict) -> bool:
    """Whether a processor config is Qwen2-VL's (Qwen2.5-VL's is the same processor): by its type, or by the keys
    only it has (the temporal patch beside the patch or merge size)."""
    if "Qwen2VL" in str(raw.get("image_processor_type", "")):
        return True
    return "temporal_patch_size" in raw and ("merge_size" in raw or "patch_size" in raw)


def image_size(data: bytes) -> tuple:
    """(width, height) of an image's file, from its header (nothing decoded); ImageError when it is not one."""
    from PIL import Image, UnidentifiedImageError

    try:
        return Image.open(io.BytesIO(data)).size
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
        raise ImageError("the data is not an image (PNG, JPEG, WebP, GIF, BMP and the other formats Pillow "
                         "reads)") from None


def _rgb(image):
    """`image` as RGB, transparent parts over white (as the models' processors do)."""
    if image.mode == "RGB":
        return image
    from PIL import Image

    rgba = image.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255)), rgba).convert("RGB")


def _normalized(rgb, spec: ImageSpec) -> np.ndarray:
    array = np.asarray(rgb, dtype=np.float32) * np.float32(spec.rescale)
    array = (array - np.asarray(spec.mean, np.float32)) / np.asarray(spec.std, np.float32)
    return np.ascontiguousarray(array.transpose(2, 0, 1))


def pixels(image, spec: ImageSpec) -> np.ndarray:
    """`image` (a Pillow image) as the tower reads it: float32 (3, spec.height, spec.width), RGB (transparency over
    white), resized with the spec's filter (CLIP's: the short edge to `shortest_edge`, the long one in proportion,
    rounded down, then the middle cropped, as transformers' CLIPImageProcessor; LLaVA's with `pad_square` padded to a
    square first, as its LlavaImageProcessor), times its rescale factor, less its mean, over its standard
    deviation."""
    rgb = _rgb(image)
    if spec.pad_square and rgb.size[0] != rgb.size[1]:
        from PIL import Image

        side = max(rgb.size)
        square = Image.new("RGB", (side, side), tuple(int(m * 255) for m in spec.mean))
        square.paste(rgb, ((side - rgb.size[0]) // 2, (side - rgb.size[1]) // 2))
        rgb = square
    if spec.shortest_edge is not None:
        width, height = rgb.size
        short, long = sorted((width, height))
        edge = spec.shortest_edge
        size = (edge, int(edge * long / short)) if width <= height else (int(edge * long / short), edge)
        if rgb.size != size:
            rgb = rgb.resize(size, resample=spec.resample)
        left, top = (size[0] - spec.width) // 2, (size[1] - spec.height) // 2
        rgb = rgb.crop((left, top, left + spec.width, top + spec.height))
    if rgb.size != (spec.width, spec.height):
        rgb = rgb.resize((spec.width, spec.height), resample=spec.resample)
    return _normalized(rgb, spec)


_MAX_EDGE = 4096        # transformers' SmolVLM processors: no edge beyond this after the first resize


def _resized_sizes(width: int, height: int, spec: ImageSpec) -> tuple:
    """((w1, h1), (w2, h2)): the size of the first resize (the longest edge made spec.longest_edge, the other edge
    even, none past 4,096), then of the resize to whole tiles (each edge rounded up to spec.tile)."""
    aspect = width / height
    if width >= height:
        w1 = spec.longest_edge
        h1 = int(w1 / aspect)
        h1 += h1 % 2
    else:
        h1 = spec.longest_edge
        w1 = int(h1 * aspect)
        w1 += w1 % 2
    w1, h1 = max(w1, 1), max(h1, 1)
    aspect = w1 / h1
    if w1 >= h1 and w1 > _MAX_EDGE:
        w1, h1 = _MAX_EDGE, max(int(_MAX_EDGE / aspect), 1)
    elif h1 > w1 and h1 > _MAX_EDGE:
        h1, w1 = _MAX_EDGE, max(int(_MAX_EDGE * aspect), 1)
    tile, aspect = spec.tile, w1 / h1
    if w1 >= h1:
        w2 = -(-w1 // tile) * tile
        h2 = -(-int(w2 / aspect) // tile) * tile
    else:
        h2 = -(-h1 // tile) * tile
        w2 = -(-int(h2 * aspect) // tile) * tile
    return (w1, h1), (w2, h2)


def grid(width: int, height: int, spec: ImageSpec) -> tuple:
    """(rows, cols) of tiles an image of this size is cut into by `frames` ((0, 0): one frame, the whole image)."""
    if spec.tile is None or not spec.split:
        return 0, 0
    _, (w2, h2) = _resized_sizes(width, height, spec)
    return (h2 // spec.tile, w2 // spec.tile) if w2 > spec.tile or h2 > spec.tile else (0, 0)


def crop_boxes(width: int, height: int, spec: ImageSpec) -> list:
    """Gemma 3's pan-and-scan crops of an image of this size (transformers' Gemma 3 image processor's `pan_and_scan`),
    as (left, top, right, bottom) boxes, left to right or top to bottom: none where the spec does not pan and scan or
    the image is not long enough (its aspect below the least ratio), or where the crops would be narrower than the
    least side; else 2 to the most crops, their number the aspect rounded half up and at most the long edge over the
    least side, each the long edge over their number rounded up (the last one what is left)."""
    if not spec.pan_and_scan:
        return []
    least, most, ratio = spec.scan
    long, short = max(width, height), min(width, height)
    if long / short < ratio:
        return []
    count = min(most, max(2, min(int(math.floor(long / least)), int(math.floor(long / short + 0.5)))))
    side = int(math.ceil(long / count))
    if min(side, short) < least:
        return []
    starts = [side * i for i in range(count) if side * i < long]
    if width >= height:
        return [(x, 0, min(x + side, width), height) for x in starts]
    return [(0, y, width, min(y + side, height)) for y in starts]


def frames(image, spec: ImageSpec) -> list:
    """The float32 (3, tile, tile) frames of `image` the tower reads, in the prompt's order: its tiles row by row,
    then the whole image (see the module docstring); one frame for a spec without tiles (`pixels`), and then, with
    pan-and-scan, each crop's (`crop_boxes`); for Qwen2-VL's, one frame of the whole image's merge units
    (`qwen_patches`)."""
    if spec.patch is not None:
        return [qwen_patches(image, spec)]
    if spec.tile is None:
        boxes = crop_boxes(*image.size, spec)
        rgb = _rgb(image) if boxes else image
        return [pixels(rgb, spec)] + [pixels(rgb.crop(box), spec) for box in boxes]
    rgb = _rgb(image)
    tile = spec.tile
    if not spec.split:
        return [_normalized(rgb.resize((tile, tile), resample=spec.resample), spec)]
    first, whole = _resized_sizes(*rgb.size, spec)
    rgb = rgb.resize(first, resample=spec.resample).resize(whole, resample=spec.resample)
    rows, cols = grid(*image.size, spec)
    if (rows, cols) == (0, 0):
        return [_normalized(rgb, spec)]
    out = [_normalized(rgb.crop((c * tile, r * tile, (c + 1) * tile, (r + 1) * tile)), spec)
           for r in range(rows) for c in range(cols)]
    return out + [_normalized(rgb.resize((tile, tile), resample=spec.resample), spec)]


# transformers' Qwen2-VL processors refuse an image whose long edge is more than this many times its short one
_QWEN_MAX_ASPECT = 200


def _qwen_size(width: int, height: int, spec: ImageSpec) -> tuple:
    """(width, height) the image is resized to (transformers' smart_resize): each edge rounded to the nearest whole
    number of merge units (Python's round: halves to even), then, if the area is past max_pixels, both edges scaled
    by the same factor and rounded down (at least one unit), or, if short of min_pixels, scaled and rounded up."""
    if spec.patch is None:
        raise ValueError("a Qwen2-VL size needs a Qwen2-VL image processor (ImageSpec.patch)")
    if spec.pixtral:
        return _pixtral_size(width, height, spec)
    if max(width, height) / min(width, height) > _QWEN_MAX_ASPECT:
        raise ImageError(f"the image is {width} x {height} pixels: its long edge may be at most "
                         f"{_QWEN_MAX_ASPECT} times its short one")
    unit = spec.patch * spec.merge
    h, w = round(height / unit) * unit, round(width / unit) * unit
    if h * w > spec.max_pixels:
        beta = math.sqrt(height * width / spec.max_pixels)
        h = max(unit, math.floor(height / beta / unit) * unit)
        w = max(unit, math.floor(width / beta / unit) * unit)
    elif h * w < spec.min_pixels:
        beta = math.sqrt(spec.min_pixels / (height * width))
        h = math.ceil(height * beta / unit) * unit
        w = math.ceil(width * beta / unit) * unit
    return w, h


def _pixtral_size(width: int, height: int, spec: ImageSpec) -> tuple:
    """(width, height) Pixtral's processor resizes the image to: scaled down (each edge floored) so that neither edge
    is past the longest edge, then each edge rounded up to whole merge units (at least one)."""
    unit = spec.patch * spec.merge
    ratio = max(height / spec.longest_edge, width / spec.longest_edge)
    if ratio > 1:
        height, width = max(int(math.floor(height / ratio)), 1), max(int(math.floor(width / ratio)), 1)
    return ((width - 1) // unit + 1) * unit, ((height - 1) // unit + 1) * unit


def qwen_grid(width: int, height: int, spec: ImageSpec) -> tuple:
    """(gh, gw): the patch grid (in patches of spec.patch pixels) of an image of this size after its resize, from
    the size alone (the prompt's expansion needs its token count, (gh // merge) * (gw // merge), before the pixels
    are made). ImageError for an image transformers refuses (an aspect ratio past 200)."""
    w, h = _qwen_size(width, height, spec)
    return h // spec.patch, w // spec.patch


def qwen_patches(image, spec: ImageSpec) -> np.ndarray:
    """`image` (a Pillow image) as Qwen2-VL's tower reads it: float32 (gh // m, gw // m, m * m, C * T * P * P) for
    merge m, temporal T and patch P. RGB (transparency over white), resized on its 8-bit values to `qwen_grid`'s size
    with the spec's filter, rescaled (in float64, then float32, as transformers), normalized; then the merge units
    row by row, each unit's m x m patches row by row, each patch's values channel by channel, the T equal frames of
    a channel one after the other, a frame's P x P pixels row by row: transformers' `pixel_values` rows of the image
    (gh * gw of them), in their order."""
    rgb = _rgb(image)
    w, h = _qwen_size(*rgb.size, spec)
    if rgb.size != (w, h):
        rgb = rgb.resize((w, h), resample=spec.resample)
    array = (np.asarray(rgb, np.float64) * spec.rescale).astype(np.float32)
    array = (array - np.asarray(spec.mean, np.float32)) / np.asarray(spec.std, np.float32)       # (H, W, C)
    p, m, t, c = spec.patch, spec.merge, spec.temporal, array.shape[2]
    gh2, gw2 = h // (p * m), w // (p * m)
    units = array.reshape(gh2, m, p, gw2, m, p, c).transpose(0, 3, 1, 4, 6, 2, 5)    # (gh2, gw2, m, m, C, P, P)
    clip = np.broadcast_to(units[:, :, :, :, :, None], units.shape[:5] + (t, p, p))         # (..., C, T, P, P)
    return np.ascontiguousarray(clip, np.float32).reshape(gh2, gw2, m * m, c * t * p * p)
