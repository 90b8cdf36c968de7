"""One scheduled step: its rows and how many tokens each feeds, fixed once scheduled.

A `ScheduledBatch` is made by the scheduler (master/scheduler.py) and never changed afterwards (frozen; its
lists are never edited in place): a step that becomes a decode run (`Scheduler.make_run`) or a verify step (`SpeculativePlanner.attach`) is a new batch made
with `dataclasses.replace`, so whoever holds a batch holds the step as it was decided. StepIO writes it into the
step buffers (master/step_io.py) and the OutputProcessor applies its outputs (master/output_processor.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from llm_serving.master.request import RequestStatus
from llm_serving.shm.layout import StepKind


@dataclass(frozen=True)
class ScheduledBatch:
    """One step: its rows, and how many tokens each row feeds (from its num_computed_tokens on)."""

    requests: list
    num_new_tokens: list = field(default_factory=list)     # fed tokens per row, proposals included
    proposals: list = field(default_factory=list)          # a verify step: the tokens proposed per row ([]: none)
    spec_limits: list = field(default_factory=list)        # tokens each row may propose (empty: none may)
    parents: list = field(default_factory=list)            # a verify step: per row, each proposal's parent among
                                                           # the row's proposals (-1: its last token); a chain
                                                           # is the tree [-1, 0, 1, ...]
    steps: int = 1                                         # > 1: a decode run (each row's greedy token is fed
                                                           # to the next of `steps` steps on the agent)
    run_lens: list = field(default_factory=list)           # a decode run: the steps each row takes (1..steps;
                                                           # a row that ends sooner sits the rest out)
    may_speculate: bool = False                            # a decode step left to speculative planning
                                                           # (speculative/planner.py): a verify step, a run, or
                                                           # as it is
    kind: Optional[StepKind] = None                        # what the step does: from the rows when made (prefill
                                                           # or decode, `StepKind.of_rows`), then a decode run
                                                           # (make_run) or a verify step (attach)

    def __post_init__(self) -> None:
        if self.kind is None:
            object.__setattr__(self, "kind", StepKind.of_rows(max(self.num_new_tokens, default=1)))

    @property
    def num_rows(self) -> int:
        return len(self.requests)

    @property
    def max_query_len(self) -> int:
        return max(self.num_new_tokens)

    @property
    def is_verify(self) -> bool:
        """Some row checks proposed tokens (every new token is sampled after)."""
        return self.kind is StepKind.VERIFY

    @property
    def is_prefill(self) -> bool:
        """Runs in a prefill graph (some row feeds more than one token of its own)."""
        return self.kind is StepKind.PREFILL

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def running_rows(self) -> list:
        """The rows whose request still runs (those `drop_finished` keeps, in order)."""
        return [i for i, r in enumerate(self.requests) if r.status is RequestStatus.RUNNING]

    def drop_finished(self) -> "ScheduledBatch":
        """This step without the rows whose request ended since it was scheduled (e.g. aborted while a draft
        model proposed for it: its blocks are already free)."""
        keep = self.running_rows()
        if len(keep) == len(self.requests):
            return self
        pick = lambda xs: [xs[i] for i in keep] if xs else []     # noqa: E731
        return dataclasses.replace(self, requests=pick(self.requests), num_new_tokens=pick(self.num_new_tokens),
                                   proposals=pick(self.proposals), spec_limits=pick(self.spec_limits),
                                   parents=pick(self.parents), run_lens=pick(self.run_lens))
