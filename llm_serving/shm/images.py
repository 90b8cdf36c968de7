"""An image's pixels in shared memory: the master writes them once when the request arrives (`PixelSegment.create`),
the agent that encodes the image reads them (`read_pixels`) when a prefill step first holds its tokens, and the
master unlinks the segment once the request has ended. Named as the step buffers' segments are (shm/buffers.py:
the master's pid in the name, so a later start sweeps those of a master that died), one segment per image, float32
(3, H, W) as vision/images.py's `pixels` gives them.
"""
from __future__ import annotations

import secrets
from multiprocessing import shared_memory

import numpy as np

from llm_serving.shm.buffers import AttachedSegment, segment_stem

__all__ = ["PixelSegment", "read_pixels"]


class PixelSegment:
    """One image's pixels in a segment this process created; `unlink` removes it (idempotent)."""

    def __init__(self, segment: shared_memory.SharedMemory, shape: tuple):
        self._segment = segment
        self.name = segment.name
        self.shape = tuple(int(d) for d in shape)

    @classmethod
    def create(cls, pixels: np.ndarray) -> "PixelSegment":
        pixels = np.ascontiguousarray(pixels, np.float32)
        segment = shared_memory.SharedMemory(name=f"{segment_stem()}_img{secrets.token_hex(4)}", create=True,
                                             size=max(pixels.nbytes, 1))
        np.ndarray(pixels.shape, np.float32, buffer=segment.buf)[...] = pixels
        return cls(segment, pixels.shape)

    def unlink(self) -> None:
        if self._segment is None:
            return
        segment, self._segment = self._segment, None
        segment.close()
        try:
            segment.unlink()
        except FileNotFoundError:
            pass


def read_pixels(name: str, shape: tuple) -> np.ndarray:
    """A copy of the float32 pixels of shape `shape` in the segment `name` (another process's). ValueError when the
    segment is gone (its request ended) or smaller than the shape says."""
    try:
        segment = AttachedSegment(name)
    except FileNotFoundError:
        raise ValueError(f"the image's pixels ({name}) are gone: its request ended") from None
    try:
        need = int(np.prod(shape)) * 4
        if segment.size < need:
            raise ValueError(f"the image segment {name} holds {segment.size} bytes, not the {need} of {tuple(shape)}")
        view = np.ndarray(tuple(shape), np.float32, buffer=segment.buf)
        out = view.copy()
        del view
        return out
    finally:
        segment.close()
