"""KV-cache element types in the kernel tests: numpy's float32 and float16, and bfloat16, which numpy lacks, kept
as its bits (uint16) and named "bfloat16" to the kernels (aot_call's (array, name) entries)."""
from __future__ import annotations

import numpy as np


def bfloat16_bits(x) -> np.ndarray:
    """float32 values as bfloat16 (their upper 16 bits, rounded to nearest even), the bits as uint16."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bfloat16(bits) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


class Cache:
    """A KV cache's element type in the tests: numpy's float32 or float16, or bfloat16 kept as its bits (uint16,
    passed to the kernel under the name "bfloat16")."""

    def __init__(self, name: str):
        self.name, self.bf16 = name, name == "bfloat16"

    def store(self, x) -> np.ndarray:
        return bfloat16_bits(x) if self.bf16 else np.asarray(x).astype(self.name)

    def values(self, cache) -> np.ndarray:                     # float64
        return (from_bfloat16(cache) if self.bf16 else cache).astype(np.float64)

    def arg(self, cache):
        return (cache, "bfloat16") if self.bf16 else cache

    @property
    def step(self) -> float:                                  # its relative rounding step
        return {"float32": 1e-5, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}[self.name]
