"""A runner's warmup (`RunnerWarmup`): the plan's entries for this runner's buckets, in compile order (warmup.py
says why the order is fixed and which come first), each a step of padding that writes only to the scratch blocks;
`warmup` runs the plan (staged or whole), `warm_next` its next pending entry."""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from llm_serving.shm.layout import StepKind, StepView

from ..warmup import Entry, WarmupPlan
from .decode_runs import DecodeRuns
from .embed_steps import EmbedSteps
from .graphs import RunnerGraphs
from .kv_inputs import KvLayout
from .token_steps import TokenSteps

__all__ = ["WARMUP_ORDER", "RunnerWarmup"]

# the order in which RunnerWarmup.entries lists the graphs (part of the compile-cache key: cached graphs are named by
# their compile index)
WARMUP_ORDER = "first request's graphs, prefill buckets, the first verify bucket, the rest (warmup.py)"


class RunnerWarmup:
    """The warmup of one runner. `plan` is the WarmupPlan once `warmup` made it; `warming` whether entries are left
    (the graphs' `plan` hook, which a step's graph call checks, is cleared when none is)."""

    plan: Optional[WarmupPlan] = None

    def __init__(self, execute: Callable[[StepView], object], generates: bool, layout: KvLayout, max_context: int,
                 graphs: RunnerGraphs, tokens: TokenSteps, runs: DecodeRuns, embeds: EmbedSteps):
        self.execute, self.generates, self.layout, self.max_context = execute, generates, layout, max_context
        self.graphs, self.tokens, self.runs, self.embeds = graphs, tokens, runs, embeds
        self.buckets = tokens.buckets

    @property
    def warming(self) -> bool:
        return self.graphs.plan is not None

    def warmup(self, cache_dir: Optional[str], staged: bool, progress: Optional[Callable[[str], None]],
               peer_timeout_s: Optional[float], step_timeout_s: float) -> None:
        """Compile and run once every bucket, in the plan's order; staged: only the first entries (see
        ModelRunner.warmup). Under tensor parallelism the all-reduce waits peer_timeout_s for the peers meanwhile,
        then step_timeout_s again."""
        all_reduce = self.graphs.all_reduce
        if all_reduce is not None and peer_timeout_s is not None:
            all_reduce.set_timeout(peer_timeout_s)
        plan = WarmupPlan(self.entries(), cache_dir)
        self.plan = self.graphs.plan = plan
        try:
            plan.run(staged, progress)
        except BaseException:
            plan.abandon()
            raise
        finally:
            if all_reduce is not None:
                all_reduce.set_timeout(step_timeout_s)
            if not plan.pending:
                self.graphs.plan = None

    def warm_next(self, progress: Optional[Callable[[str], None]] = None) -> bool:
        """Run the next pending entry; whether any is left. An entry that fails ends the plan (its graphs and the
        rest's compile when a step needs them, outside the cache) and raises."""
        plan = self.graphs.plan
        if plan is None:
            return False
        try:
            plan.warm_next(progress)
        except BaseException:
            plan.abandon()
            raise
        finally:
            if not plan.pending:
                self.graphs.plan = None
        return self.graphs.plan is not None

    def entries(self) -> list:
        """The plan's entries in compile order: the graphs a first request needs (the smallest decode run, decode
        bucket and prefill bucket), then what a first request's longer prompt needs (the other prefill buckets,
        smallest first: a chat template's system prompt alone fills SmolLM2's smallest), then the smallest verify
        bucket (prompt lookup, on by default, verifies as soon as a reply repeats itself), then what concurrent
        requests need (the other decode runs and decode buckets, the other verify buckets). Read on demand, a first
        request's longer prompt or first verify step costs one entry or a few. A decode run's compile leaves ~80 MiB
        of freed heap behind (glibc keeps it, among live blocks), which the later graphs' compile state then fills
        instead of growing the heap: one comes first."""
        if not self.generates:           # an embedding model: its embed graphs, the smallest first
            return [Entry(f"embed bucket (T={tb} tokens)", lambda tb=tb, i=i: self.embeds.warm(tb, compile_only=i > 0),
                          first=i == 0) for i, tb in enumerate(self.buckets.prefill_token_sizes)]
        ranked = []         # (0: a first request's, 1: the other prefill buckets, 2: the first verify one, 3: the rest)
        for i, b in enumerate(self.runs.batch_sizes()):
            ranked.append((0 if i == 0 else 3, Entry(f"decode run ({self.runs.steps} steps, B={b})",
                                                     lambda b=b: self.runs.run(b, None, None), first=i == 0)))
        seen_kinds = set()
        for kind, b, s, w in self.buckets.graphs():
            name = kind if kind in ("decode", "verify") else "prefill"
            shape = (f"T={b} tokens, {self.buckets.prefill_batch_sizes[-1]} rows" if kind == "packed"
                     else f"T={b} tokens" if kind == "verify" and s is None
                     else f"B={b}, S={s}" + (f", W={w}" if w is not None else ""))
            rank = (0 if kind not in seen_kinds and kind != "verify" else 1 if kind in ("packed", "prefill")
                    else 2 if kind not in seen_kinds else 3)
            seen_kinds.add(kind)
            ranked.append((rank, Entry(f"{name} bucket ({shape})", lambda k=(kind, b, s, w): self._bucket(*k),
                                       first=rank == 0)))
        return [entry for _, entry in sorted(ranked, key=lambda r: r[0])]      # (stable: each part's order kept)

    def _bucket(self, kind: str, b: int, s: Optional[int], w: Optional[int]) -> None:
        if kind == "packed" and b != self.buckets.prefill_token_sizes[0]:
            # a larger bucket's model graph is compiled (or loaded from the cache) but not run: running the largest
            # buckets of a deep model costs seconds each
            self.packed(b, 0.0, compile_only=True)
        elif kind == "packed":
            for temperature in (0.0, 1.0):          # greedy, then the temperature sampler for its rows
                self.packed(b, temperature)
        elif kind == "verify":
            for temperature in (0.0, 1.0):
                self.verify(b, temperature)
        else:
            self.step(b, s, 0.0, w)       # the model graph (greedy)
            if w is None or w == self.buckets.decode_block_widths[0]:   # the sampler depends on the batch size only
                self.step(b, s, 1.0, w)   # + the temperature-only sampler for this batch size

    def step(self, b: int, s: int, temperature: float, width: Optional[int] = None) -> None:
        """One step of bucket (b, s) [and decode width] that writes only to the scratch block."""
        pos = np.minimum(np.arange(s, dtype=np.int32), self.max_context - 1)
        context = pos[-1] + 1 if width is None else width * self.layout.block_size
        kind = StepKind.DECODE if s == 1 else StepKind.PREFILL
        slots, tables = np.full((b, s), -1, np.int32), np.zeros((b, 1), np.int32)
        self.execute(StepView(kind, input_ids=np.zeros((b, s), np.int32), positions=np.tile(pos, (b, 1)),
                              slot_mapping=slots, block_tables=tables, window_slots=slots, window_tables=tables,
                              context_lens=np.full((b,), context, np.int32), query_lens=np.full((b,), s, np.int32),
                              temperature=np.full((b,), temperature, np.float32), top_k=np.zeros((b,), np.int32),
                              top_p=np.ones((b,), np.float32), random_u=np.full((b,), 0.5, np.float32)))

    def packed(self, tokens: int, temperature: float, compile_only: bool = False) -> None:
        """One packed prefill step of `tokens` padding tokens (scratch block only, nothing attended); with
        compile_only its model graph is only compiled."""
        rows = self.buckets.prefill_batch_sizes[-1]
        kv = self.layout.padding_inputs((tokens,), self.tokens.limits.max_blocks_per_seq,
                                        self.tokens.layer_kernel_runs(tokens))
        zeros = np.zeros(tokens, np.int32)
        outputs = self.tokens.run_packed(tokens, zeros, zeros, kv, zeros, np.zeros(rows, np.int32),
                                         compile_only=compile_only)
        if compile_only:
            return
        per_row = {"temperature": np.full(rows, temperature, np.float32), "top_k": np.zeros(rows, np.int32),
                   "top_p": np.ones(rows, np.float32), "random_u": np.full(rows, 0.5, np.float32),
                   "top_n": np.zeros(rows, np.int32)}
        self.tokens.outputs.finish(outputs, rows, rows, per_row, False)

    def verify(self, size: int, temperature: float) -> None:
        """One verify step filling verify bucket `size` (its tokens packed, its rows unpacked) with padding tokens
        (scratch block only)."""
        s = self.buckets.verify_width
        n = size // s if self.buckets.packed else size
        pos = np.tile(np.arange(s, dtype=np.int32), (n, 1))
        slots, tables = np.full((n, s), -1, np.int32), np.zeros((n, 1), np.int32)
        self.execute(StepView(StepKind.VERIFY, input_ids=np.zeros((n, s), np.int32), positions=pos,
                              slot_mapping=slots, block_tables=tables, window_slots=slots, window_tables=tables,
                              context_lens=np.full((n,), s, np.int32), query_lens=np.full((n,), s, np.int32),
                              temperature=np.full((n,), temperature, np.float32), top_k=np.zeros((n,), np.int32),
                              top_p=np.ones((n,), np.float32), random_u=np.zeros((n,), np.float32),
                              verify_random_u=np.full((n, s), 0.5, np.float32)))
