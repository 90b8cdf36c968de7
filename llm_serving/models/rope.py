"""Rotary position embeddings as the model applies them (pure numpy): each layer's kind of RoPE (`LlamaConfig.
layer_rope`: the model's own, a sliding layer's local base, or none), their cos/sin tables, and the order of a
head's dimensions that lets a partial rotation run as a whole one.

Every path (the layer kernel, MindSpore's ops) applies RoPE the same way, over a head's D dimensions in the HF
rotate_half layout: rope(x) = x * cos + swap_halves(x) * sin_signed, pairing dimension e with e + D/2. A model
that rotates only its first r dimensions (Phi-4-mini: r = 3D/4; transformers pairs e with e + r/2 there) has its
q and k rows reordered at load (`rotary_permutation`) so that those pairs sit D/2 apart, and its tables hold
cos 1, sin 0 at the dimensions that pass through. Attention compares q and k only through their dot product,
which the same reordering of both leaves as it is; v is not reordered.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from .weights import LlamaConfig

__all__ = ["ROPE_KINDS", "mrope_axes", "mrope_rows", "rope_tables", "rotary_permutation"]

# the kinds of RoPE a layer applies (LlamaConfig.layer_rope), in the order the model keeps their tables
ROPE_KINDS = ("global", "local", "none")


def rotary_permutation(cfg: LlamaConfig) -> Optional[np.ndarray]:
    """The order of a q or k head's D dimensions as the model keeps them (new dimension e holds the checkpoint's
    dimension perm[e]), or None when RoPE rotates the whole head: [rotated first half | passed first half |
    rotated second half | passed second half], so that transformers' pairs (e, e + r/2) sit D/2 apart."""
    d, r = cfg.head_dim, cfg.rotary_dims
    if r == d:
        return None
    half, rest = r // 2, (d - r) // 2
    return np.concatenate([np.arange(0, half), np.arange(r, r + rest), np.arange(half, r),
                           np.arange(r + rest, d)])


def rope_tables(cfg: LlamaConfig, max_positions: int, kind: str = "global") -> tuple[np.ndarray, np.ndarray]:
    """cos and signed sin, each (max_positions, head_dim) float32, of the layers of `kind` in the rotate_half
    layout (with rotary_permutation's order for a partial rotation): rope(x) = x * cos + swap_halves(x) * sin,
    sin signed [-sin, sin]. "global": rope_theta, divided per frequency by rope_freq_factors (longrope: its long
    factors when the served context `max_positions` is longer than the original one, as llama.cpp chooses), cos
    and sin times rope_scale; "local": local_rope_theta, unscaled; "none": cos 1, sin 0."""
    d = cfg.head_dim
    if kind == "none":
        return np.ones((max_positions, d), np.float32), np.zeros((max_positions, d), np.float32)
    inv_freq, scale = _frequencies(cfg, max_positions, kind)
    angles = np.arange(max_positions, dtype=np.float64)[:, None] * inv_freq[None, :]            # (P, r/2)
    return _tables(cfg, angles, scale)


def mrope_rows(cfg: LlamaConfig, max_positions: int, t: np.ndarray, h: np.ndarray,
               w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Multimodal RoPE (cfg.mrope_section): the cos and signed sin rows, each (n, head_dim) float32 in
    rope_tables' layout, of n tokens at positions (t, h, w): the head's first mrope_section[0] frequencies turned by
    t, the next mrope_section[1] by h, the last by w (`mrope_axes`). A token whose three are one number p gets
    rope_tables' row p to the bit (the same float64 angles, cast once)."""
    inv_freq, scale = _frequencies(cfg, max_positions, "global")
    which = mrope_axes(cfg)                                                                    # (r/2,)
    pos = np.stack([np.asarray(t), np.asarray(h), np.asarray(w)]).astype(np.float64)           # (3, n)
    return _tables(cfg, pos[which].T * inv_freq[None, :], scale)                               # (n, r/2) angles


def mrope_axes(cfg: LlamaConfig) -> np.ndarray:
    """Which of a token's three positions (0 t, 1 h, 2 w) turns each of a head's r/2 rotary frequencies: three runs
    of mrope_section's lengths (Qwen2.5-VL), or with cfg.mrope_interleaved (Qwen3-VL) in turn t, h, w, t, h, w, ...
    for as long as h and w have frequencies left (mrope_section[1] and [2] each), t the rest."""
    t, h, w = cfg.mrope_section
    if not cfg.mrope_interleaved:
        return np.repeat([0, 1, 2], cfg.mrope_section)
    which = np.zeros(t + h + w, np.int64)
    which[1:3 * h:3] = 1
    which[2:3 * w:3] = 2
    return which


def _frequencies(cfg: LlamaConfig, max_positions: int, kind: str) -> tuple[np.ndarray, float]:
    """(the rotated frequencies (r/2,) float64, the cos/sin multiplier) of the layers of `kind`."""
    r = cfg.rotary_dims
    theta = cfg.local_rope_theta if kind == "local" else cfg.rope_theta
    inv_freq = 1.0 / (theta ** (np.arange(0, r, 2, dtype=np.float64) / r))                      # (r/2,)
    scale = 1.0
    if kind == "global":
        factors = cfg.rope_freq_factors
        if cfg.rope_long_factors is not None and max_positions > (cfg.rope_original_context or 0):
            factors = cfg.rope_long_factors
        if factors is not None:                   # RoPE scaling (Llama-3.1, linear, longrope): a divisor per frequency
            inv_freq = inv_freq / np.asarray(factors, np.float64)
        scale = cfg.rope_scale
    return inv_freq, scale


def _tables(cfg: LlamaConfig, angles: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and signed sin rows (n, head_dim) float32 of angles (n, r/2), in the rotate_half layout."""
    n, d, r = len(angles), cfg.head_dim, cfg.rotary_dims
    rest = (d - r) // 2
    ones, zeros = np.ones((n, rest)), np.zeros((n, rest))
    cos, sin = np.cos(angles) * scale, np.sin(angles) * scale
    cos_t = np.concatenate([cos, ones, cos, ones], axis=-1)                                      # (P, D)
    sin_t = np.concatenate([-sin, zeros, sin, zeros], axis=-1)                                   # (P, D)
    return cos_t.astype(np.float32), sin_t.astype(np.float32)
