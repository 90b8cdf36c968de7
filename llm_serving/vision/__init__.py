"""Images in: a request's image bytes decoded and checked (`images.decode`), and made into the pixel array a model's
vision tower reads, as its processor's config says (`images.ImageSpec`, `images.pixels`). Pure Python over Pillow
and numpy: the master decodes and checks what a request carries, the agent's tower reads the pixels
(models/vision_tower.py).
"""
from .images import ImageError, ImageSpec, decode, decode_data_url, pixels

__all__ = ["ImageError", "ImageSpec", "decode", "decode_data_url", "pixels"]
