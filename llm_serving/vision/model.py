"""What the master knows of a served model's images (`ImageFacts`, read by `image_facts` from the model's files and
its tokenizer, no tensor read): how many tokens an image becomes, the tokens that hold its place in the prompt, and
the processor that makes its pixels. None for a text model.

Gemma 3 (the family served): the chat template puts `<start_of_image>` where an image goes; its processor replaces
each with "\\n\\n" + `<start_of_image>` + tokens_per_image x `<image_soft_token>` + `<end_of_image>` + "\\n\\n" before
tokenizing (`ImageFacts.expand`), and the model's embedding of each `<image_soft_token>` is replaced by a row of the
tower's output for that image. Read from a HF directory (config.json's `vision_config` and token ids, the processor
config beside it) or from llama.cpp's mmproj GGUF beside a GGUF model (its `clip.vision.*` keys; the token ids from
the vocabulary).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

from .images import ImageSpec

__all__ = ["ImageFacts", "image_facts"]

# Gemma 3's placeholder tokens, by their text (a GGUF's vocabulary has them under these names too)
_GEMMA3 = {"boi": "<start_of_image>", "eoi": "<end_of_image>", "image": "<image_soft_token>"}
_ARCHITECTURES = ("Gemma3ForConditionalGeneration",)


@dataclass(frozen=True)
class ImageFacts:
    """A vision-language model's images as the master sees them (the module docstring)."""
    tokens_per_image: int
    image_token_id: int          # the placeholder the prompt holds once per image token
    boi: str                     # the text the chat template marks an image with, and the token before its tokens
    eoi: str
    image_token: str
    spec: ImageSpec              # the model's image processor

    def expand(self, text: str) -> str:
        """`text` with every image mark made the image's full placeholder sequence."""
        full = f"\n\n{self.boi}{self.image_token * self.tokens_per_image}{self.eoi}\n\n"
        return text.replace(self.boi, full)

    def spans(self, ids: list) -> list:
        """(start, length) of each image's placeholder run in prompt ids, in order: runs of image_token_id, each
        tokens_per_image long. ValueError for a run of another length (a prompt that spells placeholders itself)."""
        out, k, n = [], 0, len(ids)
        while k < n:
            if ids[k] != self.image_token_id:
                k += 1
                continue
            start = k
            while k < n and ids[k] == self.image_token_id:
                k += 1
            if k - start != self.tokens_per_image:
                raise ValueError(f"the prompt holds {k - start} image placeholder tokens in a row at {start}; an "
                                 f"image is {self.tokens_per_image}")
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
    if not isinstance(raw.get("vision_config"), dict) or (raw.get("architectures") or [None])[0] not in _ARCHITECTURES:
        return None
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


def _mmproj_facts(path: str, tokenizer) -> ImageFacts:
    from llm_serving.gguf_file import read_gguf

    fields = read_gguf(path).fields             # (a header scan: the tensors' data is not read)
    try:
        size, patch = int(fields["clip.vision.image_size"]), int(fields["clip.vision.patch_size"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{path}: an mmproj GGUF without clip.vision.image_size and patch_size") from None
    pool = int(fields.get("clip.vision.projector.scale_factor", 4))
    side = size // patch // pool
    spec = ImageSpec.from_config({"size": size,
                                  "image_mean": [float(v) for v in fields.get("clip.vision.image_mean", [0.5] * 3)],
                                  "image_std": [float(v) for v in fields.get("clip.vision.image_std", [0.5] * 3)]},
                                 path)
    return ImageFacts(side * side, _one_token(tokenizer, _GEMMA3["image"], path), _GEMMA3["boi"], _GEMMA3["eoi"],
                      _GEMMA3["image"], spec)
