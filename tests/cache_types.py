"""KV-cache element types in the kernel tests: numpy's float32 and float16; bfloat16, which numpy lacks, kept as
its bits (uint16) and named "bfloat16" to the kernels (aot_call's (array, name) entries); int8, each head vector
(a row of the flat cache) as its codes then its float32 scale's 4 bytes."""
from __future__ import annotations

import numpy as np


def bfloat16_bits(x) -> np.ndarray:
    """float32 values as bfloat16 (their upper 16 bits, rounded to nearest even), the bits as uint16."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bfloat16(bits) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def int8_rows(x) -> np.ndarray:
    """Rows of float32 values (each a head vector) as the int8 cache keeps them: codes = round(x / scale), scale =
    max |x| / 127 (float32), the scale's 4 bytes after the codes."""
    x = np.asarray(x, np.float32)
    flat = x.reshape(-1, x.shape[-1])
    amax = np.abs(flat).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    codes = np.rint(flat * inv).astype(np.int8)
    scale = np.ascontiguousarray((amax / np.float32(127)).astype(np.float32))
    return np.concatenate([codes, scale.view(np.int8).reshape(len(flat), 4)], -1).reshape(*x.shape[:-1], -1)


def from_int8_rows(rows) -> np.ndarray:
    flat = rows.reshape(-1, rows.shape[-1])
    scale = np.ascontiguousarray(flat[:, -4:]).view(np.float32)
    return (flat[:, :-4].astype(np.float32) * scale).reshape(*rows.shape[:-1], -1)


class Cache:
    """A KV cache's element type in the tests: numpy's float32 or float16; bfloat16 kept as its bits (uint16,
    passed to the kernel under the name "bfloat16"); int8 rows of codes and scale (int8_rows)."""

    def __init__(self, name: str):
        self.name, self.bf16, self.int8 = name, name == "bfloat16", name == "int8"

    def store(self, x) -> np.ndarray:
        if self.int8:
            return int8_rows(x)
        return bfloat16_bits(x) if self.bf16 else np.asarray(x).astype(self.name)

    def values(self, cache) -> np.ndarray:                     # float64
        if self.int8:
            return from_int8_rows(cache).astype(np.float64)
        return (from_bfloat16(cache) if self.bf16 else cache).astype(np.float64)

    def arg(self, cache):
        return (cache, "bfloat16") if self.bf16 else cache

    @property
    def step(self) -> float:                                  # its relative rounding step
        return {"float32": 1e-5, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "int8": 1 / 127}[self.name]
