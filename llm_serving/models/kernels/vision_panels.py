"""The vision tower's matrices as kernels/vision_layer_cpu.cc's VisionLinear reads them, packed once at load
(models/vision_tower.py): numpy in, numpy out, no MindSpore (the kernel's tests and benchmarks pack with these too).

- `float_panels`: an (N, K) matrix as (ceil(N / 16), K, 16), panel j holding columns 16 j .. 16 j + 15 k-major
  (zeros past N), in the caller's type (the checkpoint's float16, bfloat16 or float32: the kernel widens a panel's
  slice at a time);
- `int16_panels`: the same matrix quantized for the kernel's int16 products (its kWeightMax, 2 kChunkPairs)."""
from __future__ import annotations

import numpy as np

__all__ = ["INT16_DEPTH", "INT16_WEIGHT_MAX", "PANEL_COLUMNS", "float_panels", "int16_panels"]

PANEL_COLUMNS = 16        # vision_layer_cpu.cc's kPanelCols
INT16_DEPTH = 64          # its 2 kChunkPairs: int16 panels' depth is whole chunks of x
INT16_WEIGHT_MAX = 4095   # its kWeightMax: each column in steps of its largest magnitude / 4,095 (13 bits)


def float_panels(matrix: np.ndarray) -> np.ndarray:
    """(N, K) float32 -> (ceil(N / 16), K, 16) float32, panel j holding columns 16 j .. 16 j + 15 k-major, zeros
    past N (the caller casts it to the stored type)."""
    n, k = matrix.shape
    count = -(-n // PANEL_COLUMNS)
    padded = np.zeros((count * PANEL_COLUMNS, k), np.float32)
    padded[:n] = matrix
    return np.ascontiguousarray(padded.reshape(count, PANEL_COLUMNS, k).transpose(0, 2, 1))


def int16_panels(matrix: np.ndarray) -> tuple:
    """(N, K) -> (the panels (ceil(N / 16), Kp, 16) int16, each column's step (N,) float32). Kp is K rounded up to
    INT16_DEPTH, zeros past K and N. Column c is rounded to multiples of its step, max |w_c| / 4,095 (1 for a column
    of zeros). Panel j holds columns 16 j .. 16 j + 15 depth-pair-major: pair p's 32 values are the 16 columns'
    (w[c, 2p], w[c, 2p + 1]) side by side, as vpmaddwd multiplies them. The same bytes as float16 panels."""
    n, k = matrix.shape
    top = np.abs(matrix).max(axis=1)
    steps = np.where(top > 0, top / INT16_WEIGHT_MAX, 1.0).astype(np.float32)
    codes = np.clip(np.rint(matrix / steps.astype(np.float64)[:, None]), -INT16_WEIGHT_MAX, INT16_WEIGHT_MAX)
    count, depth = -(-n // PANEL_COLUMNS), -(-k // INT16_DEPTH) * INT16_DEPTH
    padded = np.zeros((count * PANEL_COLUMNS, depth), np.int16)
    padded[:n, :k] = codes
    pairs = padded.reshape(count, PANEL_COLUMNS, depth // 2, 2).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(pairs.reshape(count, depth, PANEL_COLUMNS)), steps
