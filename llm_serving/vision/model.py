"""What the master knows of a served model's images (`ImageFacts`, read by `image_facts` from the model's files and
its tokenizer, no tensor read): how many tokens an image becomes, the tokens that hold its place in the prompt, and
the processor that makes its pixels. None for a text model.

Gemma 3 (the family served): the chat template puts `<start_of_image>` where an image goes; its processor replaces
each with "\\n\\n" + `<start_of_image>` + tokens_per_image x `<image_soft_token>` + `<end_of_image>` + "\\n\\n" before
tokenizing (`ImageFacts.expand`), and the model's embedding of each `<image_soft_token>` is replaced by a row of the
tower's output for that image. Read from a HF directory (config.json's `vision_config` and token ids, the processor
config beside it) or from llama.cpp's mmproj GGUF beside a GGUF model (its `clip.vision.*` keys; the token ids from
the vocabulary).

With pan-and-scan (`ImageSpec.pan_and_scan`: the processor config's do_pan_and_scan, or the operator's
`model_config.pan_and_scan`, `ImageFacts.with_pan_and_scan`), a wide or tall Gemma 3 image's mark becomes, as
transformers' Gemma3Processor writes it, "Here is the original image " + the sequence above + " and here are some crops
to help you see better " + the sequence once per crop, joined by spaces (vision/images.py's `crop_boxes`: the count
from the image's size); each crop is a frame of its own, as SmolVLM's tiles are below.

SmolVLM and Idefics3 (`family` "smolvlm", from a HF directory or an idefics3 mmproj GGUF): the template puts `<image>`
where an image goes; the image is cut into frames (vision/images.py's `frames`: rows x cols tiles and the whole
image), and the mark becomes, as transformers' SmolVLMProcessor writes it, each tile's
`<fake_token_around_image><row_R_col_C>` + image_seq_len x `<image>` (a newline after each row of tiles), then "\\n" +
`<fake_token_around_image><global-img>` + image_seq_len x `<image>` + `<fake_token_around_image>` (an image of one
tile: that last part alone). Each frame's run of placeholders is an image to the rest of the server (its own pixels,
tower rows and cache key); the expansion needs each image's size (`expand(text, sizes)`), which the file's header
gives.

Qwen2-VL, Qwen2.5-VL and Qwen3-VL (`family` "qwen2_5_vl", from a HF directory or a qwen2vl_merger /
qwen2.5vl_merger / qwen3vl_merger mmproj GGUF): the template puts `<|vision_start|><|image_pad|>
<|vision_end|>` where an image goes; the image is resized to whole merged patches within the processor's pixel bounds
(vision/images.py's `qwen_grid`, `qwen_patches`), and its one `<|image_pad|>` becomes one per token of its grid of
merged patches, rows x cols of them (`tokens_per_image` -1: as many as its size makes). Its text model's multimodal
RoPE places the image's tokens by their row and column, and the tokens after it go on from the larger side of its
grid, not from its token count (`rope_advance`). The agents hold an image within one graph call, so the largest
image is the largest call's tokens (`within`: the processor's max_pixels lowered to it, where transformers' would
make more tokens).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Optional

from .images import ImageSpec, crop_boxes, frames, grid, qwen_grid

__all__ = ["ImageFacts", "image_facts"]

# Gemma 3's placeholder tokens, by their text (a GGUF's vocabulary has them under these names too)
_GEMMA3 = {"boi": "<start_of_image>", "eoi": "<end_of_image>", "image": "<image_soft_token>"}
_SMOLVLM = {"fake": "<fake_token_around_image>", "image": "<image>", "global": "<global-img>"}
_QWEN_VL = {"start": "<|vision_start|>", "end": "<|vision_end|>", "image": "<|image_pad|>"}
_PIXTRAL = {"image": "[IMG]", "break": "[IMG_BREAK]", "end": "[IMG_END]"}
_LLAVA = "<image>"          # LLaVA 1.5's placeholder: its template's mark, each image that many of it
_ARCHITECTURES = ("Gemma3ForConditionalGeneration",)
_SMOLVLM_ARCHITECTURES = ("SmolVLMForConditionalGeneration", "Idefics3ForConditionalGeneration")
_QWEN_VL_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                          "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration")
_PIXTRAL_ARCHITECTURES = ("Mistral3ForConditionalGeneration", "LlavaForConditionalGeneration")     # (Pixtral 12B's)
# llama.cpp's projector types of the Qwen-VL mmprojs, and each one's mean and std where the file gives none
_CLIP_MEAN, _CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
_QWEN_MMPROJ_NORMALIZE = {
    "qwen2vl_merger": (_CLIP_MEAN, _CLIP_STD), "qwen2.5vl_merger": (_CLIP_MEAN, _CLIP_STD),
    "qwen3vl_merger": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))}


@dataclass(frozen=True)
class ImageFacts:
    """A vision-language model's images as the master sees them (the module docstring)."""
    tokens_per_image: int        # (of a frame, for SmolVLM; -1: by the image's size, Qwen2.5-VL's)
    image_token_id: int          # the placeholder the prompt holds once per image token
    boi: str                     # the text the chat template marks an image with (Gemma 3: and the token before
    eoi: str                     # its tokens, eoi the one after; SmolVLM: the placeholder itself)
    image_token: str
    spec: ImageSpec              # the model's image processor
    family: str = "gemma3"       # or "smolvlm", "qwen2_5_vl", "pixtral", "llava"
    fake: str = ""               # SmolVLM's token around a frame's placeholders, and its global frame's tag
    global_tag: str = ""
    row_break_id: int = -1       # Pixtral's tokens that end a row of an image's placeholders, and the image
    image_end_id: int = -1

    @property
    def needs_sizes(self) -> bool:
        """Whether `expand` needs the images' sizes (SmolVLM's: its grid of tiles; Qwen2.5-VL's: its tokens; Gemma 3's
        with pan-and-scan: its crops)."""
        return self.family in ("smolvlm", "qwen2_5_vl", "pixtral") or self.spec.pan_and_scan

    def expand(self, text: str, sizes=()) -> str:
        """`text` with every image mark made the image's full placeholder sequence; sizes: the images' (width,
        height) in order (SmolVLM's, Qwen2.5-VL's; a mark past them is left as it is)."""
        if self.family == "gemma3" and not self.spec.pan_and_scan:
            return text.replace(self.boi, self._gemma3_sequence())
        if self.family == "llava":
            return text.replace(self.boi, self.image_token * self.tokens_per_image)
        parts = text.split(self.boi)
        out = [parts[0]]
        for k, part in enumerate(parts[1:]):
            if self.family == "gemma3":
                crops = len(crop_boxes(*sizes[k], self.spec)) if k < len(sizes) else 0
                full = self._gemma3_sequence()
                out.append(f"Here is the original image {full} and here are some crops to help you see better "
                           + " ".join([full] * crops) if crops else full)
            elif k >= len(sizes):
                out.append(self.boi)
            elif self.family == "smolvlm":
                out.append(self._smolvlm_prompt(*grid(*sizes[k], self.spec)))
            elif self.family == "pixtral":
                rows, cols = self._units(*sizes[k])
                out.append(((self.image_token * cols + _PIXTRAL["break"]) * rows)[:-len(_PIXTRAL["break"])]
                           + _PIXTRAL["end"])
            else:
                out.append(self.image_token * self.tokens_of_size(*sizes[k]))
            out.append(part)
        return "".join(out)

    @property
    def mark(self) -> str:
        """The text a chat template writes where an image goes (what `expand` makes the image's placeholders): a
        raw prompt (TGI's markdown images) gets it in the image's place."""
        if self.family == "qwen2_5_vl":
            return f"{_QWEN_VL['start']}{self.boi}{_QWEN_VL['end']}"
        return self.boi

    def _gemma3_sequence(self) -> str:
        # a Gemma 3 frame's: its mark, its placeholders and its end, between blank lines
        return f"\n\n{self.boi}{self.image_token * self.tokens_per_image}{self.eoi}\n\n"

    def with_pan_and_scan(self, setting: str) -> "ImageFacts":
        """These facts with Gemma 3's pan-and-scan as `setting` (model_config.pan_and_scan) says: 'auto' as the
        processor config says, 'on' or 'off'; a family without it as it is (its processor has no such crops)."""
        if setting == "auto" or self.family != "gemma3":
            return self
        return dataclasses.replace(self, spec=dataclasses.replace(self.spec, pan_and_scan=setting == "on"))

    def tokens_of_size(self, width: int, height: int) -> int:
        """The tokens an image of this size becomes (a frame's, for SmolVLM)."""
        if self.tokens_per_image > 0:
            return self.tokens_per_image
        rows, cols = self._units(width, height)
        return rows * (cols + (self.family == "pixtral"))

    def _units(self, width: int, height: int) -> tuple:
        # (rows, cols) of merge units of an image of this size (Qwen2.5-VL's, Pixtral's: a token each)
        gh, gw = qwen_grid(width, height, self.spec)
        return gh // self.spec.merge, gw // self.spec.merge

    def tokens_of(self, pixels) -> int:
        """The tokens a frame's pixels (as `frames` made them) become (Pixtral's: a token a merge unit and one after
        each row of them)."""
        if self.tokens_per_image > 0:
            return self.tokens_per_image
        rows, cols = int(pixels.shape[0]), int(pixels.shape[1])
        return rows * (cols + (self.family == "pixtral"))

    def placeholder_ids(self, pixels) -> list:
        """The ids a frame's placeholder run holds: tokens_of(pixels) image tokens; Pixtral's rows of them, each but
        the last ended by its break token, the last by its end token."""
        if self.family != "pixtral":
            return [self.image_token_id] * self.tokens_of(pixels)
        rows, cols = int(pixels.shape[0]), int(pixels.shape[1])
        return ([self.image_token_id] * cols + [self.row_break_id]) * (rows - 1) + [self.image_token_id] * cols + [
            self.image_end_id]

    def rope_advance(self, pixels) -> int:
        """How much further than its token count an image moves the RoPE positions of the tokens after it: its
        grid's larger side less its tokens for multimodal RoPE (Qwen2.5-VL), else 0."""
        if self.family != "qwen2_5_vl":
            return 0
        rows, cols = int(pixels.shape[0]), int(pixels.shape[1])
        return max(rows, cols) - rows * cols

    def within(self, max_tokens: int) -> "ImageFacts":
        """These facts for agents that take an image of at most `max_tokens` tokens: a Qwen2.5-VL processor's
        max_pixels lowered so that no image makes more (an image over it is resized down, as one over the
        processor's own bound is); the others as they are."""
        if self.tokens_per_image > 0 or max_tokens <= 0:
            return self
        if self.family == "pixtral":         # (a square image of s x s units is the most: s (s + 1) tokens)
            unit, side = self.spec.patch * self.spec.merge, math.isqrt(max_tokens)
            side -= side * (side + 1) > max_tokens
            if self.spec.longest_edge <= max(side, 1) * unit:
                return self
            return dataclasses.replace(self, spec=dataclasses.replace(self.spec, longest_edge=max(side, 1) * unit))
        unit = (self.spec.patch * self.spec.merge) ** 2
        if self.spec.max_pixels <= max_tokens * unit:
            return self
        return dataclasses.replace(self, spec=dataclasses.replace(
            self.spec, max_pixels=max(max_tokens * unit, self.spec.min_pixels)))

    def _smolvlm_prompt(self, rows: int, cols: int) -> str:
        frame = self.image_token * self.tokens_per_image
        whole = f"{self.fake}{self.global_tag}{frame}{self.fake}"
        if rows == 0:
            return whole
        tiles = "".join("".join(f"{self.fake}<row_{r + 1}_col_{c + 1}>{frame}" for c in range(cols)) + "\n"
                        for r in range(rows))
        return f"{tiles}\n{whole}"

    def frames(self, image) -> list:
        """The float32 frames of a decoded image the tower reads, one per run of placeholders `expand` makes."""
        return frames(image, self.spec)

    def spans(self, ids: list) -> list:
        """(start, length) of each image's placeholder run in prompt ids, in order: runs of image_token_id, each
        tokens_per_image long (any length for -1: the caller holds each to its image's); Pixtral's from an image
        token through its rows' breaks to the image's end token. ValueError for a run of another length, or a
        Pixtral run that does not end with its end token (a prompt that spells placeholders itself)."""
        if self.family == "pixtral":
            return self._pixtral_spans(ids)
        out, k, n = [], 0, len(ids)
        while k < n:
            if ids[k] != self.image_token_id:
                k += 1
                continue
            start = k
            while k < n and ids[k] == self.image_token_id:
                k += 1
            run, each = k - start, self.tokens_per_image
            if self.family == "llava" and run % each == 0:      # (LLaVA's images side by side: one run of them)
                out.extend((at, each) for at in range(start, k, each))
                continue
            if each > 0 and run != each:
                raise ValueError(f"the prompt holds {run} image placeholder tokens in a row at {start}; an image is "
                                 f"{each}")
            out.append((start, run))
        return out


    def _pixtral_spans(self, ids: list) -> list:
        out, k, n = [], 0, len(ids)
        inside = (self.image_token_id, self.row_break_id)
        while k < n:
            if ids[k] not in (self.image_token_id, self.row_break_id, self.image_end_id):
                k += 1
                continue
            start = k
            while k < n and ids[k] in inside:
                k += 1
            if ids[start] != self.image_token_id or k == n or ids[k] != self.image_end_id:
                raise ValueError(f"the prompt holds image placeholder tokens at {start} that are not an image's "
                                 f"({_PIXTRAL['image']} rows, each but the last ended by {_PIXTRAL['break']}, the "
                                 f"last by {_PIXTRAL['end']})")
            k += 1
            out.append((start, k - start))
        return out


def _one_token(tokenizer, text: str, where: str) -> int:
    ids = tokenizer.encode(text, add_bos=False)
    if len(ids) != 1:
        raise ValueError(f"{where}: the tokenizer has no single token {text!r} (it gives {ids[:8]})")
    return ids[0]


def image_facts(model_path: str, mmproj: Optional[str], tokenizer) -> Optional[ImageFacts]:
    """The ImageFacts of the model at `model_path` (a HF directory, or a GGUF with `mmproj` beside it), or None
    when it takes no images. ValueError naming the file for a vision model whose facts do not agree (a placeholder
    the tokenizer lacks, a processor config that cannot be read)."""
    if mmproj is not None:
        return _mmproj_facts(mmproj, tokenizer)
    config = os.path.join(model_path, "config.json")
    if not os.path.isdir(model_path) or not os.path.isfile(config):
        return None
    try:
        with open(config, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None                  # (the weight loader says what is wrong with it)
    arch = (raw.get("architectures") or [None])[0]
    if not isinstance(raw.get("vision_config"), dict) or \
            arch not in _ARCHITECTURES + _SMOLVLM_ARCHITECTURES + _QWEN_VL_ARCHITECTURES + _PIXTRAL_ARCHITECTURES:
        return None
    if arch in _SMOLVLM_ARCHITECTURES:
        return _smolvlm_facts(model_path, raw, tokenizer, config)
    if arch in _QWEN_VL_ARCHITECTURES:
        return _qwen_vl_facts(model_path, raw, tokenizer, config)
    if arch == "LlavaForConditionalGeneration" and raw["vision_config"].get("model_type") == "clip_vision_model":
        return _llava_facts(model_path, raw, tokenizer, config)
    if arch in _PIXTRAL_ARCHITECTURES:
        return _pixtral_facts(model_path, raw, tokenizer, config)
    ids = {"boi": raw.get("boi_token_index"), "eoi": raw.get("eoi_token_index"),
           "image": raw.get("image_token_index", raw.get("image_token_id"))}
    found = {key: _one_token(tokenizer, text, config) for key, text in _GEMMA3.items()}
    for key, given in ids.items():
        if given is not None and given != found[key]:
            raise ValueError(f"{config}: its {key} token is {given}, but the tokenizer's {_GEMMA3[key]!r} is "
                             f"{found[key]}")
    size = int(raw["vision_config"].get("image_size", 896))
    spec = ImageSpec.from_dir(model_path) or ImageSpec(size, size)
    return ImageFacts(int(raw.get("mm_tokens_per_image", 256)), found["image"], _GEMMA3["boi"], _GEMMA3["eoi"],
                      _GEMMA3["image"], spec)


def _smolvlm_facts(model_path: str, raw: dict, tokenizer, config: str) -> ImageFacts:
    """SmolVLM's and Idefics3's: a frame's tokens from the tower's grid over scale_factor squared (the processor
    config's image_seq_len must agree), the tokens from the tokenizer, the tiling from the image processor."""
    vision = raw["vision_config"]
    try:
        side = int(vision["image_size"]) // int(vision["patch_size"])
        tokens = side * side // int(raw.get("scale_factor", 1)) ** 2
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        raise ValueError(f"{config}: vision_config needs image_size and patch_size, and scale_factor a positive "
                         "number") from None
    spec = ImageSpec.from_dir(model_path)
    if spec is None or spec.tile is None:
        raise ValueError(f"{model_path}: a SmolVLM needs its image processor's config (preprocessor_config.json "
                         "with size.longest_edge and max_image_size.longest_edge)")
    processor = os.path.join(model_path, "processor_config.json")
    if os.path.isfile(processor):
        try:
            with open(processor, encoding="utf-8") as f:
                seq_len = json.load(f).get("image_seq_len", tokens)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{processor}: not a readable processor config ({e})") from None
        if seq_len != tokens:
            raise ValueError(f"{processor}: image_seq_len {seq_len}, but the tower makes {tokens} tokens a frame")
    ids = {key: _one_token(tokenizer, text, config) for key, text in _SMOLVLM.items()}
    given = raw.get("image_token_id")
    if given is not None and given != ids["image"]:
        raise ValueError(f"{config}: its image token is {given}, but the tokenizer's <image> is {ids['image']}")
    return ImageFacts(tokens, ids["image"], _SMOLVLM["image"], "", _SMOLVLM["image"], spec, family="smolvlm",
                      fake=_SMOLVLM["fake"], global_tag=_SMOLVLM["global"])


def _qwen_vl_facts(model_path: str, raw: dict, tokenizer, config: str) -> ImageFacts:
    """Qwen2.5-VL's: its tokens from the tokenizer (the config's ids must agree), its image processor from the
    processor config (Qwen2VLImageProcessor's pixel bounds, patches and merge)."""
    ids = {key: _one_token(tokenizer, text, config) for key, text in _QWEN_VL.items()}
    for key, name in (("image", "image_token_id"), ("start", "vision_start_token_id"), ("end", "vision_end_token_id")):
        given = raw.get(name)
        if given is not None and given != ids[key]:
            raise ValueError(f"{config}: its {name} is {given}, but the tokenizer's {_QWEN_VL[key]!r} is {ids[key]}")
    spec = ImageSpec.from_dir(model_path)
    if spec is None or spec.patch is None:
        raise ValueError(f"{model_path}: a Qwen2.5-VL needs its image processor's config (preprocessor_config.json "
                         "of a Qwen2VLImageProcessor: patch_size, merge_size, min_pixels, max_pixels)")
    vision = raw["vision_config"]
    if (int(vision.get("patch_size", spec.patch)), int(vision.get("spatial_merge_size", spec.merge))) != \
            (spec.patch, spec.merge):
        raise ValueError(f"{model_path}: the image processor's patches ({spec.patch}, merged {spec.merge} x "
                         f"{spec.merge}) are not the tower's ({vision.get('patch_size')}, "
                         f"{vision.get('spatial_merge_size')})")
    return ImageFacts(-1, ids["image"], _QWEN_VL["image"], "", _QWEN_VL["image"], spec, family="qwen2_5_vl")


def _pixtral_facts(model_path: str, raw: dict, tokenizer, config: str) -> ImageFacts:
    """Mistral 3's (Pixtral's tower): its tokens from the tokenizer (config.json's image_token_index must agree),
    its image processor's (PixtralImageProcessor: the longest edge, the patch) with config.json's
    spatial_merge_size and the tower's patch, which must be the processor's. Pixtral 12B's (a LLaVA) the same with
    no merge: each patch a token."""
    ids = {key: _one_token(tokenizer, text, config) for key, text in _PIXTRAL.items()}
    given = raw.get("image_token_index", raw.get("image_token_id"))
    if given is not None and given != ids["image"]:
        raise ValueError(f"{config}: its image_token_index is {given}, but the tokenizer's {_PIXTRAL['image']!r} is "
                         f"{ids['image']}")
    spec = ImageSpec.from_dir(model_path)
    if spec is None or not spec.pixtral:
        raise ValueError(f"{model_path}: a Mistral 3 needs its image processor's config (preprocessor_config.json "
                         "of a PixtralImageProcessor: size.longest_edge, patch_size)")
    patch = raw["vision_config"].get("patch_size", spec.patch)
    if patch != spec.patch:
        raise ValueError(f"{model_path}: the image processor's patches ({spec.patch} pixels) are not the tower's "
                         f"({patch})")
    llava = (raw.get("architectures") or [None])[0] == "LlavaForConditionalGeneration"
    spec = dataclasses.replace(spec, merge=1 if llava else int(raw.get("spatial_merge_size", 2)))
    return ImageFacts(-1, ids["image"], _PIXTRAL["image"], "", _PIXTRAL["image"], spec, family="pixtral",
                      row_break_id=ids["break"], image_end_id=ids["end"])


def _llava_facts(model_path: str, raw: dict, tokenizer, config: str) -> ImageFacts:
    """LLaVA 1.5's (a CLIP tower): its <image> token from the tokenizer (config.json's image_token_index must agree),
    an image's tokens its patches (the class token's row dropped), its image processor's (CLIPImageProcessor: the
    short edge resized, the middle cropped to the tower's image)."""
    image = _one_token(tokenizer, _LLAVA, config)
    given = raw.get("image_token_index", raw.get("image_token_id"))
    if given is not None and given != image:
        raise ValueError(f"{config}: its image_token_index is {given}, but the tokenizer's {_LLAVA!r} is {image}")
    vision = raw["vision_config"]
    size, patch = int(vision.get("image_size", 224)), int(vision.get("patch_size", 32))
    spec = ImageSpec.from_dir(model_path)
    if spec is None or spec.shortest_edge is None:
        raise ValueError(f"{model_path}: a LLaVA 1.5 needs its image processor's config (preprocessor_config.json of "
                         "a CLIPImageProcessor: size.shortest_edge, crop_size)")
    if (spec.height, spec.width) != (size, size):
        raise ValueError(f"{model_path}: the image processor's crop ({spec.width} x {spec.height}) is not the tower's "
                         f"{size}-pixel image")
    return ImageFacts((size // patch) ** 2, image, _LLAVA, "", _LLAVA, spec, family="llava")


# a Qwen2.5-VL mmproj's image bounds, in tokens, where the file gives none: llama.cpp's (8 to 4,096), not the
# processor's own (its Hub file's max_pixels make 16,384)
_QWEN_MMPROJ_TOKENS = (8, 4096)


def _mmproj_facts(path: str, tokenizer) -> ImageFacts:
    """An mmproj GGUF's: Gemma 3's (projector type gemma3) or SmolVLM's (idefics3: its tiles of image_size, the
    longest edge `clip.vision.preproc_image_size`, LANCZOS as its processor; its tokens from the text model's
    vocabulary); Qwen2.5-VL's and Qwen3-VL's (qwen2.5vl_merger, qwen3vl_merger: bicubic, its pixel bounds
    `clip.vision.image_min_pixels` / `image_max_pixels` or llama.cpp's 8 to 4,096 tokens); LLaVA 1.5's (mlp: the
    image padded to a square in the mean's colour, as llama.cpp does for it, then resized to image_size, bicubic;
    a token a patch)."""
    from llm_serving.gguf_file import read_gguf

    fields = read_gguf(path).fields             # (a header scan: the tensors' data is not read)
    if fields.get("clip.projector_type") == "mlp":
        return _llava_mmproj_facts(path, fields, tokenizer)
    if fields.get("clip.projector_type") in _QWEN_MMPROJ_NORMALIZE:
        return _qwen_mmproj_facts(path, fields, tokenizer)
    if fields.get("clip.projector_type") == "pixtral":
        return _pixtral_mmproj_facts(path, fields, tokenizer)
    size, patch, normalize = _mmproj_image(path, fields, ((0.5,) * 3, (0.5,) * 3))
    pool = int(fields.get("clip.vision.projector.scale_factor", 4))
    side = size // patch // pool
    if fields.get("clip.projector_type") == "idefics3":
        longest = int(fields.get("clip.vision.preproc_image_size", size))
        spec = ImageSpec.from_config({"size": {"longest_edge": longest}, "max_image_size": {"longest_edge": size},
                                      "resample": 1, **normalize}, path)
        ids = {key: _one_token(tokenizer, text, path) for key, text in _SMOLVLM.items()}
        return ImageFacts(side * side, ids["image"], _SMOLVLM["image"], "", _SMOLVLM["image"], spec,
                          family="smolvlm", fake=_SMOLVLM["fake"], global_tag=_SMOLVLM["global"])
    spec = ImageSpec.from_config({"size": size, **normalize}, path)
    return ImageFacts(side * side, _one_token(tokenizer, _GEMMA3["image"], path), _GEMMA3["boi"], _GEMMA3["eoi"],
                      _GEMMA3["image"], spec)


def _pixtral_mmproj_facts(path: str, fields: dict, tokenizer) -> ImageFacts:
    """A Mistral 3 mmproj's: Pixtral's processor with the longest edge `clip.vision.image_size` (the config's
    image_size, which is its processor's longest edge: Mistral Small 3.1's 1,540), bicubic, the file's mean and std;
    the merge `spatial_merge_size` (none where the file sets none, as llama.cpp reads it: Pixtral 12B's); the
    tokens from the text model's vocabulary."""
    longest, patch, normalize = _mmproj_image(path, fields, (_CLIP_MEAN, _CLIP_STD))
    spec = ImageSpec.from_config({"image_processor_type": "PixtralImageProcessor", "patch_size": patch,
                                  "size": {"longest_edge": longest}, "resample": 3, **normalize}, path)
    spec = dataclasses.replace(spec, merge=int(fields.get("clip.vision.spatial_merge_size", 1)))
    ids = {key: _one_token(tokenizer, text, path) for key, text in _PIXTRAL.items()}
    return ImageFacts(-1, ids["image"], _PIXTRAL["image"], "", _PIXTRAL["image"], spec, family="pixtral",
                      row_break_id=ids["break"], image_end_id=ids["end"])


def _mmproj_image(path: str, fields: dict, normalize: tuple) -> tuple:
    """(image_size, patch_size, {image_mean, image_std}) of an mmproj's `clip.vision.*` keys, the mean and std
    `normalize` where the file gives none; ValueError naming the file without the two sizes."""
    try:
        size, patch = int(fields["clip.vision.image_size"]), int(fields["clip.vision.patch_size"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{path}: an mmproj GGUF without clip.vision.image_size and patch_size") from None
    return size, patch, {"image_mean": [float(v) for v in fields.get("clip.vision.image_mean", normalize[0])],
                         "image_std": [float(v) for v in fields.get("clip.vision.image_std", normalize[1])]}


def _llava_mmproj_facts(path: str, fields: dict, tokenizer) -> ImageFacts:
    size, patch, normalize = _mmproj_image(path, fields, (_CLIP_MEAN, _CLIP_STD))
    spec = ImageSpec.from_config({
        "image_processor_type": "LlavaImageProcessor", "do_pad": True, "size": {"shortest_edge": size},
        "crop_size": {"height": size, "width": size}, "resample": 3, **normalize}, path)
    return ImageFacts((size // patch) ** 2, _one_token(tokenizer, _LLAVA, path), _LLAVA, "", _LLAVA, spec,
                      family="llava")


def _qwen_mmproj_facts(path: str, fields: dict, tokenizer) -> ImageFacts:
    try:
        patch, merge = int(fields["clip.vision.patch_size"]), int(fields.get("clip.vision.spatial_merge_size", 2))
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{path}: an mmproj GGUF without clip.vision.patch_size") from None
    unit = (patch * merge) ** 2
    mean, std = _QWEN_MMPROJ_NORMALIZE[fields["clip.projector_type"]]
    spec = ImageSpec.from_config({
        "image_processor_type": "Qwen2VLImageProcessor", "patch_size": patch, "merge_size": merge,
        "temporal_patch_size": 2, "resample": 3,
        "min_pixels": int(fields.get("clip.vision.image_min_pixels", _QWEN_MMPROJ_TOKENS[0] * unit)),
        "max_pixels": int(fields.get("clip.vision.image_max_pixels", _QWEN_MMPROJ_TOKENS[1] * unit)),
        "image_mean": [float(v) for v in fields.get("clip.vision.image_mean", mean)],
        "image_std": [float(v) for v in fields.get("clip.vision.image_std", std)]},
        path)
    image = _one_token(tokenizer, _QWEN_VL["image"], path)
    for key in ("start", "end"):
        _one_token(tokenizer, _QWEN_VL[key], path)
    return ImageFacts(-1, image, _QWEN_VL["image"], "", _QWEN_VL["image"], spec, family="qwen2_5_vl")
