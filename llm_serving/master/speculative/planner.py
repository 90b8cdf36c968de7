"""Speculative planning: what a decode step the scheduler left to speculation becomes, in one order for every
proposer: schedule, propose, run.

`Scheduler.schedule` marks a decode step of at most `spec_max_rows` rows `may_speculate` and makes no decode
run of it. `SpeculativePlanner.speculate` then
1. plans how many tokens each row may propose (`plan`: within max_new_tokens, the model length and the step's
   token budget; 0 for a request that may not speculate; none at all when a row needs top log-probabilities,
   penalties or logit controls), reserving their blocks first (through the scheduler, never preempting) when
   the proposer writes KV there (a draft model);
2. asks the `Proposer` for a token tree per row (a chain is the one-branch tree [-1, 0, 1, ...]);
3. drops the rows whose request ended meanwhile (an abort while a draft model ran) and attaches what is left
   (`attach`: trimmed to each row's depth and room, blocks taken only when free), which makes a new batch: a
   verify step.
A step left without proposals by a proposer that reserved nothing (a lookup finding no match) may become a
decode run instead (`Scheduler.make_run`); one that reserved blocks for a draft stays as it is (requests may
have arrived while the draft ran). Pure Python: only the proposer's call is awaited.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Protocol

from llm_serving.master.batch import ScheduledBatch
from llm_serving.master.request import Request
from llm_serving.master.scheduler import Scheduler
from llm_serving.master.speculative.tree import trim_tree
from llm_serving.shm.layout import StepKind


class Proposer(Protocol):
    """Proposes the next tokens of decoding requests. ngram.NgramProposer (prompt lookup) and draft.DraftProposer
    (a draft model) are the two."""

    reserves_blocks: bool           # blocks for limits[i] tokens are reserved before `propose` (it writes KV there)
    agent_step_kind: Optional[str]  # the step kind its time counts as in the engine's step_time_s (a draft model's
                                    # agent steps); None: it runs on the master (the schedule phase)

    async def propose(self, requests: list, limits: list) -> list:
        """(nodes, parents) per row, at most limits[i] deep: nodes depth-first, parents[j] the index of node j's
        parent (-1: the request's last token), the first-child chain the likeliest; ([], []) for none."""


@dataclass(frozen=True)
class SpeculativeSpec:
    """How much a row proposes (the rest of spec_config is the proposers')."""

    num_tokens: int                 # most tokens a row proposes per step (a tree: its depth)
    tree_width: int = 0             # > 0: proposals are token trees of up to this many branches

    @classmethod
    def from_config(cls, config) -> "SpeculativeSpec":
        spec = config.spec_config
        return cls(spec.num_speculative_tokens, spec.tree_width if spec.is_tree else 0)


def can_speculate(req: Request) -> bool:
    """The request may speculate: it asks for it and needs nothing only its last token's logits give."""
    sp = req.sampling
    return sp.speculative and not sp.top_logprobs and not sp.adjusts_logits


class SpeculativePlanner:
    """Plans the speculating decode steps of one scheduler with one proposer (see the module docstring)."""

    def __init__(self, spec: SpeculativeSpec, proposer: Proposer, scheduler: Scheduler):
        self.spec = spec
        self.proposer = proposer
        self.scheduler = scheduler

    async def speculate(self, batch: ScheduledBatch) -> ScheduledBatch:
        """Batch (marked may_speculate) as a verify step, a decode run or as it is; without the rows whose request
        ended while the proposer ran."""
        limits = self.plan(batch)
        if not limits:
            return self.scheduler.make_run(batch)
        trees = await self.proposer.propose(batch.requests, limits)
        keep = batch.running_rows()                 # the rows drop_finished keeps
        batch = dataclasses.replace(batch, spec_limits=limits).drop_finished()
        batch = self.attach(batch, [trees[i] for i in keep])
        if not batch.proposals and not self.proposer.reserves_blocks:
            batch = self.scheduler.make_run(batch)
        return batch

    def plan(self, batch: ScheduledBatch) -> list:
        """How many tokens each row may propose: as many as fit its max_new_tokens, the model length and the step's
        token budget, 0 for a request that may not speculate; [] when no row may (a row needing top
        log-probabilities, penalties or logit controls keeps the whole step plain). For a proposer that reserves
        blocks they are allocated here, as many as are free (never preempting)."""
        if any(r.sampling.top_logprobs or r.sampling.adjusts_logits for r in batch.requests):
            return []
        sched = self.scheduler
        budget = sched.token_budget_left(batch)
        max_model_len = sched.spec.max_model_len
        limits = []
        for req in batch.requests:
            k = min(self.spec.num_tokens, budget, req.sampling.max_new_tokens - len(req.output_ids) - 1) \
                if can_speculate(req) else 0
            if max_model_len is not None:
                k = min(k, max_model_len - req.num_tokens - 1)
            k = max(k, 0)
            if k and self.proposer.reserves_blocks and not sched.allocate_ahead(req, req.num_tokens + k):
                k = max(min(k, sched.token_capacity(req) - req.num_tokens), 0)   # what its blocks already hold
            budget -= k
            limits.append(k)
        return limits if any(limits) else []

    def attach(self, batch: ScheduledBatch, trees: list) -> ScheduledBatch:
        """The decode step as a verify step: row i also feeds trees[i] = (nodes, parents), kept within depth
        spec_limits[i], spec_limits[i] x tree_width nodes and what the model length leaves; a row whose blocks
        cannot be had without preempting proposes nothing. The batch as it is when no row proposes anything."""
        sched = self.scheduler
        max_model_len = sched.spec.max_model_len
        kept, kept_parents, fed = [], [], []
        for req, (nodes, parents), k, q in zip(batch.requests, trees, batch.spec_limits, batch.num_new_tokens):
            room = k * max(self.spec.tree_width, 1)
            if max_model_len is not None:           # a node's slot is the row's next free one
                room = min(room, max_model_len - req.num_tokens - 1)
            nodes, parents = trim_tree(nodes, parents, k, room)
            if not (nodes and sched.allocate_ahead(req, req.num_tokens + len(nodes))):
                nodes, parents = [], []
            kept.append(nodes)
            kept_parents.append(parents)
            fed.append(q + len(nodes))
        if not any(kept):
            return batch
        return dataclasses.replace(batch, num_new_tokens=fed, proposals=kept, parents=kept_parents,
                                   kind=StepKind.VERIFY)
