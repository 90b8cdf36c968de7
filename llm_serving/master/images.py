"""The images of the requests in flight, as the engine keeps them (`ImageTable`): each image's pixels written once
into shared memory when its request is queued (shm/images.py), the step frame's entries that tell the agent where a
prefill step's image tokens are (`step_images`), and the segments unlinked once their request has ended and no step
in flight can still read them.

Where an image's placeholder tokens are and what its key is come from the request's `PromptImage`s
(master/request.py); the scheduler never splits an image across steps (scheduler.py's `_whole_images`), so an entry
names all of an image's tokens but those a prefix-cache hit already holds.
"""
from __future__ import annotations

from typing import Optional

from llm_serving.master.batch import ScheduledBatch
from llm_serving.master.request import PromptImage, Request
from llm_serving.shm.images import PixelSegment

__all__ = ["ImageTable", "PromptImageInput"]


class PromptImageInput:
    """An image a prepared request carries: its placeholders' (start, length) in the prompt, its content key, its
    float32 pixels (as the family's processor makes them: (3, H, W), or Qwen2.5-VL's patches), and how far it
    advances the RoPE positions after it past its token count (PromptImage.rope_advance)."""

    def __init__(self, start: int, length: int, key: str, pixels, rope_advance: int = 0):
        self.start, self.length, self.key, self.pixels = start, length, key, pixels
        self.rope_advance = rope_advance


class ImageTable:
    """The pixel segments of the requests in flight (the module docstring)."""

    def __init__(self):
        self._spent: list = []           # segments whose request ended while a step was in flight
        self.in_flight = False           # a step is running (its agents may read any request's pixels)

    @staticmethod
    def attach(req: Request, images: list) -> None:
        """Give `req` its images (PromptImageInput's), their pixels in shared memory."""
        made = []
        try:
            for image in images:
                made.append(PromptImage(image.start, image.length, image.key, PixelSegment.create(image.pixels),
                                        image.rope_advance))
        except BaseException:
            for image in made:
                image.pixels.unlink()
            raise
        req.images = tuple(made)

    def release(self, req: Request) -> None:
        """`req` has ended: its segments go now, or after the step in flight."""
        segments = [image.pixels for image in req.images]
        req.images = ()
        if self.in_flight:
            self._spent += segments
        else:
            for segment in segments:
                segment.unlink()

    def step_done(self) -> None:
        """The step in flight has ended: the segments of requests that ended meanwhile go."""
        self.in_flight = False
        spent, self._spent = self._spent, []
        for segment in spent:
            segment.unlink()

    @staticmethod
    def step_images(batch: ScheduledBatch) -> Optional[list]:
        """The step frame's images (agents/protocol.py's StepImage fields) of a prefill step; None when it has none."""
        out = []
        for row, (req, q) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            c = req.num_computed_tokens
            for image in req.image_at(c, c + q):
                first = max(c, image.start) - image.start
                count = min(c + q, image.start + image.length) - (image.start + first)
                out.append({"row": row, "offset": image.start + first - c, "first": first, "count": count,
                            "length": image.length, "key": image.key, "segment": image.pixels.name,
                            "shape": list(image.pixels.shape)})
        return out or None
