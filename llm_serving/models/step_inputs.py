"""One step's inputs to the ModelRunner, converted and checked in one place (`StepInputs.make`), from the step
object the runner takes (shm/layout.py's `StepView`: the step buffers' arrays by name).

Shapes: n rows, s new tokens per row at most, w block-table entries per row.
  input_ids, positions, slot_mapping  int32 (n, s): new tokens left-aligned (padding: id 0, position 0, slot -1)
  block_tables                        int32 (n, w <= max_blocks_per_seq), padded with 0
  window_slots, window_tables         int32 (n, s), (n, w' <= max_blocks_per_seq) or None: the window pool's
                                      slot_mapping and block_tables (shm/layout.py), read by the sliding-window
                                      layers; None when the runner has no window pool (StepLimits.window_blocks
                                      0), whatever the step holds. A token has a window slot exactly when it has a
                                      slot (-1 both, or neither)
  context_lens                        int32 (n,): tokens in the cache once this step's are written
  query_lens                          int32 (n,): valid new tokens; the sampled token follows token query_lens-1
  temperature (0 = greedy), top_k (0 = off), top_p (1 = off), random_u (uniform [0, 1)), top_n (top
  log-probabilities wanted, 0 = none): per row
  penalties (kept only when some row has one): per row history int32 (n, <= max_context), history_len,
  prompt_len, and the repetition_penalty, presence_penalty and frequency_penalty (see sampler.Penalizer)
  logit controls (kept only when some row has one; logit_controls.py): controls_on and row_index (n,) (the rows'
  masks and bias entries are read from `live`, the step view, when they are sampled), min_p
  verify_random_u (verify_u)          float32 (n, s): a verify step's uniform number per new token
                                      (speculative decoding; such a step has no top_n and no penalties)
  verify_parent                       int32 (n, s) or None: a verify step's token tree — each new token's parent
                                      among its row's new tokens (-1 for the first; None or j-1 everywhere: a
                                      chain). A node attends to the committed keys, its ancestors and itself.
  lora                                int32 (n,) or None: each row's LoRA adapter slot (0 or None: the base model;
                                      at most the runner's lora_slots)
  prompt_target, prompt_top           int32 (n, s), (n,) or None: a prefill step's prompt log-probabilities — after
                                      new token j of a row with prompt_top >= 0, the log-probability (its rank, and
                                      the prompt_top most likely tokens) of token prompt_target[i, j] (-1: none)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from llm_serving.shm.layout import TOP_LOGPROBS, StepKind

from .logit_controls import logit_rows, uses_controls


@dataclass(frozen=True)
class StepLimits:
    """What a runner accepts: ids below vocab_size, positions and contexts within max_context, block ids
    below num_blocks, slots below scratch_slot (the scratch block is the runner's own); with a window pool
    (window_blocks > 0), its block ids up to window_blocks (its scratch block: what entries below a row's window
    point at) and its slots below window_scratch_slot (the scratch block's first)."""
    vocab_size: int
    max_context: int
    num_blocks: int
    max_blocks_per_seq: int
    scratch_slot: int
    lora_slots: int = 0
    window_blocks: int = 0
    window_scratch_slot: int = 0


def _fail(what: str) -> None:
    raise ValueError(f"ModelRunner.execute: {what}")


@dataclass
class StepInputs:
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    block_tables: np.ndarray
    context_lens: np.ndarray
    query_lens: np.ndarray
    per_row: dict                 # sampling arrays (n,) by name, and the penalty arrays when some row has one
    verify_u: Optional[np.ndarray] = None     # (n, s): a verify step
    verify_parent: Optional[np.ndarray] = None    # (n, s): a verify step's token trees (None: chains)
    lora: Optional[np.ndarray] = None         # (n,): each row's LoRA adapter slot (None: all 0, no adapter)
    prompt_target: Optional[np.ndarray] = None    # (n, s): a prefill step's prompt tokens to score (-1: none)
    prompt_top: Optional[np.ndarray] = None       # (n,): top log-probabilities wanted per scored position
    window_slots: Optional[np.ndarray] = None     # (n, s): the window pool's slots (None: no pool)
    window_tables: Optional[np.ndarray] = None    # (n, w'): the window pool's block tables (None: no pool)
    live: object = None                       # the step view (its logit controls are written while the model runs)
    rope_delta: Optional[np.ndarray] = None   # (n,): multimodal RoPE's offset of each row's positions (None: all 0)

    def __post_init__(self) -> None:
        if self.lora is None:
            self.lora = np.zeros(self.input_ids.shape[0], np.int32)

    def rope_positions(self, positions: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """`positions` (KV positions of tokens of rows `rows`, any shape alike) as the RoPE positions: each plus its
        row's rope_delta (multimodal RoPE after an image; the same array when no row has one)."""
        if self.rope_delta is None:
            return positions
        return (positions + self.rope_delta[rows]).astype(np.int32)

    @property
    def n(self) -> int:
        return self.input_ids.shape[0]

    @property
    def s(self) -> int:
        return self.input_ids.shape[1]

    @property
    def penalized(self) -> bool:
        return "history" in self.per_row

    @property
    def scores_prompt(self) -> bool:
        """Some row wants its prompt tokens' log-probabilities from this (prefill) step."""
        return self.prompt_target is not None and bool((self.prompt_target >= 0).any())

    @property
    def controlled(self) -> bool:
        """Some row has a logit control (a mask, bias entries, min_p)."""
        return uses_controls(self.per_row)

    @property
    def wants_top(self) -> bool:
        return bool((self.per_row["top_n"] > 0).any())

    @classmethod
    def make(cls, limits: StepLimits, step, sampler: bool = True) -> "StepInputs":
        """A step object's arrays (numpy or nested lists; a StepView) converted to their dtypes and checked
        against each other and `limits`; ValueError naming the first that is malformed. sampler=False (a
        tensor-parallel rank other than 0, which samples nothing) leaves the penalties out."""
        input_ids = np.asarray(step.input_ids, np.int32)
        if input_ids.ndim != 2 or input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
            _fail(f"input_ids must be (n, s) with n, s >= 1, got {input_ids.shape}")
        n, s = input_ids.shape
        positions = np.asarray(step.positions, np.int32)
        slot_mapping = np.asarray(step.slot_mapping, np.int32)
        block_tables = _table(step.block_tables, n)
        cl, ql = np.asarray(step.context_lens, np.int32), np.asarray(step.query_lens, np.int32)
        top_n = step.top_n
        per_row = {"temperature": np.asarray(step.temperature, np.float32), "top_k": np.asarray(step.top_k, np.int32),
                   "top_p": np.asarray(step.top_p, np.float32), "random_u": np.asarray(step.random_u, np.float32),
                   "top_n": np.zeros(n, np.int32) if top_n is None else np.asarray(top_n, np.int32)}
        verify = step.kind is StepKind.VERIFY
        if sampler and not verify and step.history is not None:
            per_row.update(_penalty_rows(limits, n, step))
        if sampler and not verify:
            per_row.update(logit_rows(step, n))
        verify_u = verify_parent = None
        for name in ("verify_random_u", "verify_parent"):
            if not verify and getattr(step, name) is not None:
                _fail(f"{name} is given for a step that is not a verify step")
        if verify:
            verify_u, verify_parent = step.verify_random_u, step.verify_parent
            if verify_u is None:
                _fail("a verify step needs verify_random_u")
        for name, arr in (("positions", positions), ("slot_mapping", slot_mapping)):
            if arr.shape != (n, s):
                _fail(f"{name} has shape {arr.shape}, expected {(n, s)}")
        _check_table("block_tables", block_tables, n, limits)
        for name, arr in (("context_lens", cl), ("query_lens", ql), *per_row.items()):
            if name not in _PER_ROW_2D and arr.shape != (n,):
                _fail(f"{name} has shape {arr.shape}, expected ({n},)")
        if ql.min() < 1 or ql.max() > s:
            _fail(f"query_lens must be in [1, {s}], got {ql.tolist()}")
        if cl.min() < 1 or cl.max() > limits.max_context:
            _fail(f"context_lens must be in [1, {limits.max_context}], got {cl.tolist()}")
        for name, arr, low, high in (("positions", positions, 0, limits.max_context),
                                     ("slot_mapping", slot_mapping, -1, limits.scratch_slot),
                                     ("token ids", input_ids, 0, limits.vocab_size),
                                     ("block ids", block_tables, 0, limits.num_blocks)):
            _check_range(name, arr, low, high)
        window_slots, window_tables = _window_pair(limits, step, slot_mapping)
        if verify_u is not None:
            verify_u = np.asarray(verify_u, np.float32)
            if verify_u.shape != (n, s):
                _fail(f"verify_u has shape {verify_u.shape}, expected {(n, s)}")
            if "history" in per_row or (per_row["top_n"] > 0).any() or any(
                    getattr(step, key) is not None and np.any(getattr(step, key)) for key in ("controls_on", "min_p")):
                _fail("a verify step cannot have rows with top log-probabilities, sampling penalties or logit controls")
        if verify_parent is not None:
            verify_parent = np.asarray(verify_parent, np.int32)
            if verify_parent.shape != (n, s):
                _fail(f"verify_parent has shape {verify_parent.shape}, expected {(n, s)}")
            j = np.arange(s)[None, :]
            valid = j < ql[:, None]
            ok = np.where(j == 0, verify_parent == -1, (verify_parent >= 0) & (verify_parent < j))
            if not ok[valid].all():
                _fail("verify_parent must be -1 for a row's first new token and in [0, j) for token j")
            if (verify_parent[valid] == (j - 1).repeat(n, 0)[valid]).all():
                verify_parent = None                  # every row a chain: plain causal attention
        lora = np.zeros(n, np.int32) if step.lora is None else np.asarray(step.lora, np.int32)
        if lora.shape != (n,):
            _fail(f"lora has shape {lora.shape}, expected ({n},)")
        if lora.min() < 0 or lora.max() > limits.lora_slots:
            _fail(f"lora (adapter slots) must be in [0, {limits.lora_slots}], got {lora.tolist()}")
        prompt_target = prompt_top = None
        if sampler and step.kind is StepKind.PREFILL and step.prompt_top is not None \
                and (np.asarray(step.prompt_top) >= 0).any():
            prompt_top = np.asarray(step.prompt_top, np.int32)
            prompt_target = np.asarray(step.prompt_target, np.int32)
            if prompt_top.shape != (n,) or prompt_target.shape != (n, s):
                _fail(f"prompt_top / prompt_target have shapes {prompt_top.shape}, {prompt_target.shape}, "
                      f"expected ({n},), {(n, s)}")
            prompt_target = np.where((prompt_top >= 0)[:, None] & (np.arange(s)[None, :] < ql[:, None]),
                                     prompt_target, -1)
            if prompt_target.min() < -1 or prompt_target.max() >= limits.vocab_size or prompt_top.max() > TOP_LOGPROBS:
                _fail(f"prompt_target must be token ids or -1 and prompt_top at most {TOP_LOGPROBS}")
        rope_delta = None
        if step.rope_delta is not None and np.any(np.asarray(step.rope_delta)):
            rope_delta = np.asarray(step.rope_delta, np.int32)
            if rope_delta.shape != (n,):
                _fail(f"rope_delta has shape {rope_delta.shape}, expected ({n},)")
            shifted = positions + np.where(np.arange(s)[None, :] < ql[:, None], rope_delta[:, None], 0)
            if shifted.min() < 0:
                _fail(f"rope_delta {rope_delta.tolist()} takes a position below 0")
        return cls(input_ids, positions, slot_mapping, block_tables, cl, ql, per_row, verify_u, verify_parent, lora,
                   prompt_target, prompt_top, window_slots=window_slots, window_tables=window_tables, live=step,
                   rope_delta=rope_delta)

    def tree_bits(self) -> np.ndarray:
        """(t,) int32 for the step's real tokens in row-major order: which of its last 32 keys each token sees
        (the CPU kernel's tree_bits; bit m = the key m places before the token): all set except, for a tree
        node, the row's earlier nodes that are not its ancestors."""
        n, s = self.n, self.s
        out = []
        for i in range(n):
            parent = self.verify_parent[i] if self.verify_parent is not None else np.arange(-1, s - 1)
            for j in range(int(self.query_lens[i])):
                ancestors, a = set(), j
                while a >= 0:
                    ancestors.add(a)
                    a = int(parent[a])
                bits = -1
                for m in range(1, j + 1):
                    if j - m not in ancestors:
                        bits &= ~(1 << m)
                out.append(bits)
        return np.asarray(out, np.int64).astype(np.int32)


_PER_ROW_2D = frozenset({"history"})            # (n, width): checked where made


def _table(arr, n: int) -> np.ndarray:
    """A block-table array as int32 (n, w) (a flat one reshaped)."""
    table = np.asarray(arr, np.int32)
    return table.reshape(n, -1) if table.ndim == 1 else table


def _check_table(name: str, table: np.ndarray, n: int, limits: StepLimits) -> None:
    if table.ndim != 2 or table.shape[0] != n or not 1 <= table.shape[1] <= limits.max_blocks_per_seq:
        _fail(f"{name} has shape {table.shape}, expected ({n}, w) with 1 <= w <= "
              f"max_blocks_per_seq={limits.max_blocks_per_seq}")


def _check_range(name: str, arr: np.ndarray, low: int, high: int) -> None:
    """arr's values in [low, high) (low -1: -1 means none)."""
    if arr.min() < low or arr.max() >= high:
        _fail(f"{name} must be in [{low}, {high}){' or -1' if low == -1 else ''}, got range [{arr.min()}, {arr.max()}]")


def _window_pair(limits: StepLimits, step, slot_mapping: np.ndarray) -> tuple:
    """The window pool's (window_slots (n, s), window_tables (n, w)), checked against the step's slot_mapping
    and the pool's limits; (None, None) without a pool (the step's window arrays are not read: the master
    writes none)."""
    if limits.window_blocks <= 0:
        return None, None
    missing = [name for name in ("window_slots", "window_tables") if getattr(step, name) is None]
    if missing:
        _fail(f"the window pool is on (window_blocks={limits.window_blocks}): the step needs "
              f"{' and '.join(missing)}")
    n = slot_mapping.shape[0]
    slots, tables = np.asarray(step.window_slots, np.int32), _table(step.window_tables, n)
    if slots.shape != slot_mapping.shape:
        _fail(f"window_slots has shape {slots.shape}, expected {slot_mapping.shape}")
    _check_table("window_tables", tables, n, limits)
    _check_range("window_slots", slots, -1, limits.window_scratch_slot)
    # (the pool's scratch block too: the master points a row's entries below its window there)
    _check_range("window block ids", tables, 0, limits.window_blocks + 1)
    if ((slots < 0) != (slot_mapping < 0)).any():
        _fail("window_slots must be -1 exactly where slot_mapping is (a token writes its K/V to both caches, or "
              "to neither)")
    return slots, tables


def _penalty_rows(limits: StepLimits, n: int, step) -> dict:
    """The penalty arrays, with the history widened to max_context; none when no row has a penalty."""
    pen = {k: np.asarray(getattr(step, f"{k}_penalty"), np.float32) for k in ("repetition", "presence", "frequency")}
    if not ((pen["repetition"] != 1.0) | (pen["presence"] != 0.0) | (pen["frequency"] != 0.0)).any():
        return {}
    history = np.asarray(step.history, np.int32)
    if history.ndim != 2 or history.shape[0] != n or history.shape[1] > limits.max_context:
        _fail(f"penalties history has shape {history.shape}, expected ({n}, <= {limits.max_context})")
    history = history[:, :int(np.max(step.history_len, initial=0))]    # the part the rows hold
    full = np.zeros((n, limits.max_context), np.int32)
    full[:, :history.shape[1]] = np.clip(history, 0, limits.vocab_size - 1)
    return {**pen, "history": full,
            "history_len": np.minimum(np.asarray(step.history_len, np.int32), history.shape[1]),
            "prompt_len": np.asarray(step.prompt_len, np.int32)}
