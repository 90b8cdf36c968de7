"""What the image tests share: seeded PNG pictures, OpenAI chat messages that carry them as `data:` URLs, chat
requests sent together (so that they share the engine's steps), and the settings under which a tiny
vision-language model's server cuts its prompts into chunks of 16 tokens, through an image's embeddings, with the
prefix cache and the encoded-image cache in play."""
from __future__ import annotations

import asyncio
import base64
import io

import numpy as np

from tests.integration.server_harness import http


def png(seed: int, shape=(70, 91, 3)) -> bytes:
    """A PNG of seeded random pixels, (height, width, 3: RGB or 4: RGBA)."""
    from PIL import Image

    mode = "RGBA" if shape[-1] == 4 else "RGB"
    image = Image.fromarray(np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8), mode)
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def user_message(text: str, *images: bytes, image_first: bool = False) -> dict:
    """A chat user message: the text, then (or, image_first: before it) an image_url part per image."""
    parts = [{"type": "image_url", "image_url": {"url": data_url(d)}} for d in images]
    text_part = [{"type": "text", "text": text}]
    return {"role": "user", "content": parts + text_part if image_first else text_part + parts}


async def send_chats(url: str, bodies: list) -> list:
    """The chat requests sent together, their (status, body) in order."""
    return await asyncio.gather(*(asyncio.to_thread(http, "POST", url + "/v1/chat/completions", body)
                                  for body in bodies))


def chunked_image_args(model_dir, model_name: str, max_generate_length: int = 256) -> list:
    """`llm-serving start` arguments for model_dir: prompts prefilled in chunks of 16 tokens (so that chunks cut
    through an image's embeddings), up to 8 sequences a step, the prefix cache on, a float32 KV cache (so that the
    replies compare with transformers' float32 forward)."""
    sets = [f"model_config.model_name={model_name}", f"model_config.max_generate_length={max_generate_length}",
            "pa_config.block_size=8", "scheduler_config.chunked_prefill=true", "scheduler_config.max_chunk_tokens=16",
            "serving_config.max_num_batched_tokens=32", "serving_config.max_num_seqs=8",
            "scheduler_config.enable_prefix_caching=true", "pa_config.kv_cache_dtype=float32"]
    return ["--model", str(model_dir)] + [a for s in sets for a in ("--set", s)]
