"""Decode runs (`DecodeRuns`): K greedy decode steps of a batch in one graph call, the layer kernel's, for batches of
up to KernelChoice.decode_run_rows rows (scheduler_config.decode_steps)."""
from __future__ import annotations

import bisect
from typing import Optional

import numpy as np

from llm_serving.shm.layout import StepKind, StepView

from ..buckets import Buckets
from ..step_inputs import StepInputs, StepLimits
from .graphs import RunnerGraphs
from .kernels import KernelChoice
from .kv_inputs import KvLayout

__all__ = ["DecodeRuns"]


class DecodeRuns:
    """A runner's decode runs: `steps` (K; 1 without runs), `batch_sizes`, `max_rows`, `execute` a run step, `run`
    its graph (warmup's too)."""

    def __init__(self, buckets: Buckets, limits: StepLimits, layout: KvLayout, kernels: KernelChoice,
                 graphs: RunnerGraphs):
        self.buckets, self.limits, self.layout, self.graphs = buckets, limits, layout, graphs
        self.steps, self.rows = kernels.decode_run_steps, kernels.decode_run_rows
        self.kernel_rows = kernels.layer_kernel_rows

    def batch_sizes(self) -> list:
        """The decode batch buckets decode runs have graphs for (empty: no decode runs): those the layer kernel
        takes, up to the first that holds decode_run_rows rows."""
        if self.graphs.decode_run is None:
            return []
        sizes = [s for s in self.buckets.decode_batch_sizes if s <= self.kernel_rows]
        return sizes[:bisect.bisect_left(sizes, self.rows) + 1]

    def max_rows(self) -> int:
        """The most rows a decode run takes (0: no decode runs)."""
        sizes = self.batch_sizes()
        return min(self.rows, sizes[-1]) if sizes else 0

    def execute(self, step: StepView):
        """K = decode_run_steps greedy decode steps of n rows in one graph call: row i feeds input_ids[i, 0] at
        positions[i, 0] (context_lens[i] keys visible, itself included), then the token it gets at
        positions[i, 0] + 1, and so on; step j writes row i's K/V at slot_mapping[i, j] (n, K). A row may end
        before the run does: its slots are -1 from some step j >= 1 on, and it sits out those steps (a step
        every row sits out costs almost nothing, so a run of fewer than K steps is a run of K whose last slots
        are -1). The step's sampling arrays are not read (a run is greedy). Returns (token_ids int32 (n, K),
        logprobs float32 (n, K)): each step's greedy token (the first index of the largest logit) and its
        log-probability, as K single decode steps would give; -1 and 0 where the row sat out. With a window pool,
        window_slots (n, K) are the sliding layers' slots of each step, >= 0 exactly where slot_mapping's are.
        ValueError if runs are off, n is more than a run's largest bucket, or an argument is malformed."""
        input_ids, positions = (np.asarray(a).reshape(len(a), -1) for a in (step.input_ids, step.positions))
        k, n = self.steps, input_ids.shape[0]
        if self.graphs.decode_run is None:
            raise ValueError("ModelRunner.execute (decode run): this runner has no decode runs (decode_run_steps "
                             "<= 1, decode_run_rows 0, or no layer kernel)")
        sizes = self.batch_sizes()
        if not 1 <= n <= sizes[-1]:
            raise ValueError(f"ModelRunner.execute (decode run): {n} rows; runs take 1..{sizes[-1]}")
        slot_mapping = np.asarray(step.slot_mapping, np.int32)
        if slot_mapping.shape != (n, k):
            raise ValueError(f"ModelRunner.execute (decode run): slot_mapping has shape {slot_mapping.shape}, "
                             f"expected {(n, k)}")
        active = slot_mapping >= 0
        if not active[:, 0].all() or (active[:, 1:] > active[:, :-1]).any():
            raise ValueError("ModelRunner.execute (decode run): each row's slots are >= 0 for its first steps (at "
                             "least one) and -1 for the rest of the run")
        first, window_slots = self._first_step(step, input_ids, positions, slot_mapping, active)
        self._check_lengths(first, slot_mapping, active)
        nb = sizes[bisect.bisect_left(sizes, n)]
        tokens, logprobs = self.run(nb, first, slot_mapping, window_slots)
        tokens, logprobs = tokens[:, :n].T.astype(np.int32), logprobs[:, :n].T.astype(np.float32)
        tokens[~active], logprobs[~active] = -1, 0.0
        return tokens, logprobs

    def _first_step(self, step: StepView, input_ids, positions, slot_mapping, active) -> tuple:
        """(the run's first step as a decode step's StepInputs, checked as one; the window slots of all its steps,
        None without a window pool)."""
        n = input_ids.shape[0]
        window_slots = None if step.window_slots is None else np.asarray(step.window_slots, np.int32)
        zeros = np.zeros(n, np.float32)
        first = StepInputs.make(self.limits, StepView(
            StepKind.DECODE, input_ids=input_ids[:, :1], positions=positions[:, :1], slot_mapping=slot_mapping[:, :1],
            block_tables=step.block_tables, context_lens=step.context_lens, query_lens=np.ones(n, np.int32),
            temperature=zeros, top_k=np.zeros(n, np.int32), top_p=np.ones(n, np.float32), random_u=zeros,
            lora=step.lora, window_slots=None if window_slots is None else window_slots[:, :1],
            window_tables=step.window_tables, rope_delta=step.rope_delta))
        if first.window_slots is None:
            return first, None                  # (no window pool: not read)
        if (window_slots.shape != slot_mapping.shape or ((window_slots >= 0) != active).any()
                or window_slots.max() >= self.limits.window_scratch_slot):
            raise ValueError(f"ModelRunner.execute (decode run): window_slots must be {slot_mapping.shape}, >= 0 "
                             f"exactly where slot_mapping is and below {self.limits.window_scratch_slot}")
        return first, window_slots

    def _check_lengths(self, first: StepInputs, slot_mapping, active) -> None:
        """Each row's steps within the model's length and the cache: a row of s steps needs positions <= max_context
        - s. (Row by row: positions are (n, 1), and compared with `last` (n,) as they are each row's position met
        every row's limit, so a run of rows of different lengths near the model's length was refused.)"""
        steps = active.sum(1)                                                   # (n,) each row's steps
        last = self.limits.max_context - steps
        position = first.positions[:, 0]
        bad = (position > last) | (first.context_lens > last + 1) | (slot_mapping.max(1) >= self.limits.scratch_slot)
        if bad.any():
            r = int(np.flatnonzero(bad)[0])
            raise ValueError(f"ModelRunner.execute (decode run): a row of s steps needs positions <= "
                             f"{self.limits.max_context} - s, context_lens one more, and slots in "
                             f"[0, {self.limits.scratch_slot}); row {r} has s={int(steps[r])}, position "
                             f"{int(position[r])}, context {int(first.context_lens[r])}, slots "
                             f"{slot_mapping[r].tolist()}")

    def run(self, nb: int, step: Optional[StepInputs], slot_mapping, window_slots=None) -> tuple:
        """The decode-run graph of nb rows on step's rows (None: none, for warmup); (K, nb) outputs. Padding rows
        sit the run out (slots -1), so a warmup call compiles the graph and computes nothing."""
        k = self.steps
        n = 0 if step is None else step.n
        # the keys of each row's last step it takes (a row near the model's length takes fewer than k)
        need = 1 if step is None else int((step.context_lens + (slot_mapping >= 0).sum(1) - 1).max())
        w = self.buckets.width(1, -(-need // self.layout.block_size))
        pos = np.zeros((k, nb), np.int32)
        context = np.ones((k, nb), np.int32)
        ids = np.zeros(nb, np.int32)
        lora = np.zeros(nb, np.int32)
        if step is None:                        # warmup: every row padding (the window pair too, with a pool)
            kv = self.layout.padding_inputs((nb, k), w, True)
        else:
            kv = self.layout.inputs(slot_mapping, step.block_tables, window_slots, step.window_tables, (nb, k), w,
                                    True)
        slots, tables, window_slots, window_tables = kv                 # slots (nb, k): a row's steps
        if step is not None:
            lora[:n] = step.lora
            offsets = np.arange(k, dtype=np.int32)[:, None]
            pos[:, :n] = step.rope_positions(step.positions[:, 0], np.arange(n)) + offsets
            context[:, :n] = step.context_lens + offsets
            sat_out = slots.T < 0               # positions and contexts of steps sat out stay in range
            pos[sat_out], context[sat_out] = 0, 1
            ids[:n] = step.input_ids[:, 0]
        by_step = slots.T.copy()                                        # (k, nb): a step's rows
        window_by_step = by_step if window_slots is slots else window_slots.T.copy()
        g, T = self.graphs, self.graphs.ms.Tensor
        slots_t, tables_t, window_slots_t, window_tables_t = g.tensors(
            (by_step, tables, window_by_step, window_tables), (k, nb))
        tokens, logprobs = g.call("decode_run", (nb, k), g.decode_run, T(ids), T(pos), slots_t, tables_t, T(context),
                                  T(np.full(nb, -1, np.int32)), T(lora), window_slots_t, window_tables_t)
        return tokens.asnumpy(), logprobs.asnumpy()
