"""A step's KV inputs as a graph call takes them (pure numpy): each cache's slot mapping and block tables padded to
the graph's bucket, padding written to the cache's scratch block (or sat out where the layer kernel runs), and a
packed step's real tokens laid out side by side (`flat_tokens`).

The KV cache has a scratch block after its `num_blocks` real ones: padding tokens (slot -1) and padding rows write
there, so real blocks are never touched by padding. With a window pool (a model with sliding-window layers) the
sliding layers' caches have their own scratch block after `window_blocks` blocks, written and read through the
step's window_slots and window_tables, padded alike.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..step_inputs import StepInputs

__all__ = ["KvLayout", "flat_tokens", "pad"]


def pad(arr: np.ndarray, size: int, fill) -> np.ndarray:
    """arr (n, ...) padded with `fill` to (size, ...)."""
    out = np.full((size,) + arr.shape[1:], fill, arr.dtype)
    out[:len(arr)] = arr
    return out


def flat_tokens(step: StepInputs) -> tuple:
    """The step's real tokens in row-major order: valid (n, s) marks them; row_of, ids, positions, slots, context
    (keys each token sees) and window slots (None without a window pool), (t,) each."""
    valid = np.arange(step.s)[None, :] < step.query_lens[:, None]                  # (n, s)
    row_of = np.repeat(np.arange(step.n), step.query_lens)                          # (t,)
    context = ((step.context_lens - step.query_lens)[row_of] + np.nonzero(valid)[1] + 1).astype(np.int32)
    window_slots = None if step.window_slots is None else step.window_slots[valid]
    return (valid, row_of, step.input_ids[valid], step.positions[valid], step.slot_mapping[valid], context,
            window_slots)


@dataclass(frozen=True)
class KvLayout:
    """Where a runner's caches keep their scratch blocks: the main cache's `num_blocks` blocks of `block_size`
    slots, then its scratch block; the window pool's `window_blocks` (0: none), then its own."""

    num_blocks: int
    block_size: int
    window_blocks: int = 0

    @property
    def num_slots(self) -> int:
        """The main cache's slots, its scratch block's included."""
        return (self.num_blocks + 1) * self.block_size

    @property
    def scratch_slot(self) -> int:
        """The first slot of the main cache's scratch block."""
        return self.num_blocks * self.block_size

    @property
    def window_num_slots(self) -> int:
        """The window pool's slots, its scratch block's included (0: no pool)."""
        return (self.window_blocks + 1) * self.block_size if self.window_blocks else 0

    @property
    def window_scratch_slot(self) -> int:
        """The first slot of the window pool's scratch block."""
        return self.window_blocks * self.block_size

    def inputs(self, slots, tables, window_slots: Optional[np.ndarray], window_tables, shape: tuple, width: int,
               kernel: bool) -> tuple:
        """(slot_mapping, block_tables, window_slots, window_tables) as a graph call takes them (`pair`: each
        cache's padded, with its own scratch block); without a window pool (window_slots None) the main pair again,
        the same arrays."""
        main = self.pair(slots, tables, shape, width, kernel, self.scratch_slot)
        if window_slots is None:
            return main + main
        return main + self.pair(window_slots, window_tables, shape, width, kernel, self.window_scratch_slot)

    def padding_inputs(self, shape: tuple, width: int, kernel: bool) -> tuple:
        """`inputs` of a step whose every token is padding (warmup's), the window pair too where there is a pool."""
        none, no_tables = np.zeros((0,) + tuple(shape[1:]), np.int32), np.zeros((0, 1), np.int32)
        return self.inputs(none, no_tables, none if self.window_blocks else None, no_tables, shape, width, kernel)

    def pair(self, slots, tables, shape: tuple, width: int, kernel: bool, scratch_slot: int) -> tuple:
        """One cache's slots and block tables padded for a graph call: slots (m, ...) of the real rows or tokens to
        `shape`, tables (m, w) of their rows to (shape[0], width) with 0 (entries past the longest row's blocks are
        padding). A token without a slot, and the padding: -1 where the layer kernel runs (its rows sit it out:
        warmup's steps then compute nothing), else a slot of the cache's scratch block (from scratch_slot on), where
        MindSpore's ops write it."""
        scratch = scratch_slot + (np.arange(int(np.prod(shape)), dtype=np.int32) % self.block_size).reshape(shape)
        padded = np.full(shape, -1, np.int32) if kernel else scratch
        real = tuple(slice(0, d) for d in slots.shape)
        padded[real] = np.where(slots < 0, -1 if kernel else scratch[real], slots)
        used = min(tables.shape[1], width)
        padded_tables = np.zeros((shape[0], width), np.int32)
        padded_tables[:len(tables), :used] = tables[:, :used]
        return padded, padded_tables
