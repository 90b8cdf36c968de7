"""Images in: a request's image bytes decoded and checked (`images.decode`), and made into the pixel array a model's
vision tower reads, as its processor's config says (`images.ImageSpec`, `images.pixels`, or SmolVLM's tiles
`images.frames`, or Qwen2-VL's merge units `images.qwen_patches`). Pure Python over Pillow and numpy: the master
decodes and checks what a request carries, the agent's tower reads the pixels (models/vision_tower.py,
models/vision_qwen.py). `model.image_facts`: what the master knows of a served model's images
(how many tokens an image becomes, its placeholders, its processor).
"""
from .images import ImageError, ImageSpec, decode, decode_data_url, frames, image_size, pixels, qwen_grid, qwen_patches
from .model import ImageFacts, image_facts

__all__ = ["ImageError", "ImageFacts", "ImageSpec", "decode", "decode_data_url", "frames", "image_facts",
           "image_size", "pixels", "qwen_grid", "qwen_patches"]
