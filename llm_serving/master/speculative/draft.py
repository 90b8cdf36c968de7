"""Draft-model speculation (spec_config.method draft): a smaller model proposes each speculating request's
next k tokens, greedily; the target then checks them in one verify step (speculative.py says why that keeps
the target's output exactly).

The draft is served by an agent process of its own (the same agent code, its own AgentGroup, shared-memory
step buffers and supervision), loaded once, as NSL-Spec found it must be: passing a model per iteration
makes the messages the bottleneck. Its KV cache has the target's blocks, and the master gives it the
target's block tables: the draft's KV of position p sits in the same slot as the target's, so no second
block manager and no second allocation exist, and a request's blocks hold both models' KV.

Per round, for the rows of a decode step that may speculate (limits planned and blocks reserved by
planner.SpeculativePlanner):
- one *catch-up* step feeds each row the tokens the draft has not seen (`Request.num_draft_computed` up
  to the request's last token: the whole prompt on the first round, chunked to the step budget; one or
  two tokens afterwards) and samples the draft's token after the last: proposal 1;
- then k-1 decode steps feed proposal j and sample proposal j+1, rows leaving as their limit is reached.
With spec_config.method draft_tree (width w > 1) the catch-up step also returns the draft's w most likely
tokens; each starts a branch that decode steps continue greedily, branches one after another (they share
positions, so the same slots), the most likely last. The branches, merged by `tree_from_paths` with the
most likely as the first-child chain, are verified as one token tree (SpecInfer's top-k tree, expanded at
the first depth only: the depth where a draft is least sure of its own choice pays most for a second one).
The draft wrote KV for its proposals; after verification only the positions the target agreed with stay
valid (the scheduler lowers num_draft_computed to the request's computed tokens), and the next catch-up
overwrites the rest. A request that is preempted or recomputed starts again at 0 (prefix-cache blocks
are written again with the same values: harmless).

Each draft step is a `ScheduledBatch` like the target's, written and read by a StepIO of the draft's own; its
rows are `DraftRow`s, each request as the draft sees it (the request's tokens, then the branch being drafted;
computed: what the draft's cache holds), so StepIO writes them as it writes any request.

A draft that fails costs speed, never output: its round proposes nothing (plain decoding goes on), a
lost draft agent is restarted in the background with the target's back-off rules, and a draft whose KV
cache was reset behind the master's back (agent-ctl reset) makes every request catch up from scratch.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Callable, Optional

from llm_serving.agents import protocol as proto
from llm_serving.master.agent_group import AgentError, AgentGroup
from llm_serving.master.batch import ScheduledBatch
from llm_serving.master.block_manager import BlockManager
from llm_serving.master.request import Request, SamplingParams
from llm_serving.master.speculative.tree import tree_from_paths
from llm_serving.master.step_io import StepIO, StepOutputs
from llm_serving.master.supervisor import Supervisor

logger = logging.getLogger(__name__)


class DraftRow:
    """A request as the draft model sees it in a round: the request's tokens followed by `branch`, the tokens
    the draft has proposed on it so far; `num_computed_tokens` of them are in the draft's KV cache. It has the
    attributes StepIO reads of a request (same id, number and block table; greedy, `top_n` top tokens, no
    adapter, no logit controls), so a draft step is written like any other."""

    logits = None                       # no logit controls
    prompt_scores = None                # no prompt scores
    lora_slot = 0                       # the draft has no adapters

    def __init__(self, request: Request, num_computed_tokens: int, top_n: int = 0, branch: Optional[list] = None):
        self.request = request
        self.req_id, self.number, self.prompt_ids = request.req_id, request.number, request.prompt_ids
        self.branch = branch if branch is not None else []     # (the round's list: proposals append to it)
        self.num_computed_tokens = num_computed_tokens
        self.sampling = SamplingParams(max_new_tokens=1, top_logprobs=top_n)    # greedy

    @property
    def num_tokens(self) -> int:
        return self.request.num_tokens + len(self.branch)

    def token_at(self, index: int) -> int:
        n = self.request.num_tokens
        return self.request.token_at(index) if index < n else self.branch[index - n]

    def tokens(self, start: int, stop: int) -> list:
        n = self.request.num_tokens
        return self.request.tokens(start, min(stop, n)) + self.branch[max(start - n, 0):max(stop - n, 0)]


class DraftProposer:
    """The draft model's agent and the rounds it runs: the planner's Proposer for a draft model. `propose` never
    raises: on any failure a round proposes nothing."""

    reserves_blocks = True            # the draft writes its proposals' KV into the target's blocks: reserved first
    agent_step_kind = "draft"         # its rounds are agent steps (the engine's step_time_s["draft"])

    def __init__(self, draft_config, model_dir: str, block_manager: BlockManager,
                 forget_all: Callable[[], None], width: int = 1):
        self.config = draft_config
        self.width = width                # branches per request: the draft's `width` most likely first tokens
        self.model_dir = model_dir
        self.bm = block_manager
        self.forget_all = forget_all      # every request's draft KV is gone (sets num_draft_computed = 0)
        self.agents = AgentGroup(draft_config, model_dir, on_lost=self._lost, role="draft agent")
        self.step_io = StepIO(block_manager, window=False)     # (its layers read the main tables only)
        self.supervisor = Supervisor(draft_config.serving_config, self.agents, what="draft agent")
        self.max_step_tokens = draft_config.serving_config.max_num_batched_tokens
        self.max_chunk = draft_config.max_chunk_tokens
        self._recovery: Optional[asyncio.Task] = None
        self.num_steps = 0
        self.step_time_s = 0.0            # in draft steps, summed (round trips)
        self.model_time_s: Counter = Counter()   # in the draft agent's model, by step kind (catch-up, decode)
        self.steps_by_kind: Counter = Counter()
        self.num_cache_resets = 0
        self.num_failed_rounds = 0

    # --- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.agents.start()

    async def stop(self) -> None:
        if self._recovery is not None:
            self._recovery.cancel()
            try:
                await self._recovery
            except (asyncio.CancelledError, Exception):
                pass
            self._recovery = None
        await self.agents.stop()

    @property
    def vocab_size(self) -> Optional[int]:
        agents = self.agents.agents
        return agents[0].info.vocab_size if agents and agents[0].info is not None else None

    @property
    def unavailable_reason(self) -> Optional[str]:
        """Why the draft proposes nothing right now (restarting, given up), or None."""
        sup = self.supervisor
        if sup.failed_reason:
            return sup.failed_reason
        if sup.failure or sup.down_reason:
            return f"draft agent restarting after a failure: {sup.down_reason or sup.failure}"
        dead = self.agents.dead_agents()
        return "; ".join(dead) if dead else (None if self.agents.agents else "draft agent not started")

    def describe(self) -> list:
        return [{**a, "role": "draft"} for a in self.agents.describe()]

    def stats(self) -> dict:
        return {"model": self.model_dir, "num_layers": self.config.model_config.num_layers,
                "steps": self.num_steps, "step_time_s": round(self.step_time_s, 6),
                "steps_by_kind": dict(self.steps_by_kind),
                "model_time_s": {k: round(v, 6) for k, v in self.model_time_s.items()},
                "restarts": self.supervisor.num_restarts, "cache_resets": self.num_cache_resets,
                "failed_rounds": self.num_failed_rounds, "unavailable_reason": self.unavailable_reason}

    def _lost(self, reason: str) -> None:
        """The draft agent is gone: restart it in the background (the target serves on, without proposals)."""
        self.supervisor.agent_lost(reason)
        if self._recovery is None or self._recovery.done():
            self._recovery = asyncio.ensure_future(self._recover())

    async def _recover(self) -> None:
        def lose_running(_reason: str) -> None:      # no request fails: they decode on without proposals
            self.forget_all()
        if await self.supervisor.recover(lose_running, lambda _reason: None):
            self.forget_all()           # fresh KV cache

    # --- a round -----------------------------------------------------------------------------------

    async def propose(self, requests: list, limits: list) -> list:
        """Each request i's proposals as a token tree (nodes, parents): its branches (`propose_branches`) merged,
        the most likely the first-child chain."""
        return [tree_from_paths(paths) for paths in await self.propose_branches(requests, limits)]

    async def propose_branches(self, requests: list, limits: list) -> list:
        """Each request i's proposals: a list of branches, each up to limits[i] greedy draft tokens, the first
        the draft's most likely continuation (width 1: that one only). [] where limits[i] is 0, or on any
        failure."""
        empty = [[] for _ in requests]
        if self.unavailable_reason is not None or not any(limits):
            return empty
        try:
            return await self._round(requests, limits)
        except AgentError as exc:
            self.num_failed_rounds += 1
            if exc.fatal:
                self._lost(str(exc))
            else:
                logger.warning("draft step failed (this round proposes nothing): %s", exc)
            return empty
        except _CacheReset:
            return empty

    async def _round(self, requests: list, limits: list) -> list:
        branches = [[] for _ in requests]
        budget = self.max_step_tokens
        rows, fed = [], []                          # the catch-up step: each row from what the draft holds
        for req, k in zip(requests, limits):
            if k <= 0:
                continue
            end = req.num_tokens
            start = min(req.num_draft_computed, end - 1)
            q = min(end - start, budget, self.max_chunk)
            if q <= 0:
                break
            top = self.width if self.width > 1 and start + q == end else 0    # its likeliest first tokens too
            rows.append(DraftRow(req, start, top_n=top))
            fed.append(q)
            budget -= q
        if not rows:
            return branches
        out = await self._step(ScheduledBatch(rows, fed))
        index = {id(req): i for i, req in enumerate(requests)}
        caught_up = []
        for r, (row, q) in enumerate(zip(rows, fed)):
            req = row.request
            req.num_draft_computed = row.num_computed_tokens + q
            if req.num_draft_computed == req.num_tokens:    # caught up: the draft's next token is proposal 1
                first = out.token_ids[r]
                runners_up = [t for t in out.top_ids[r, :self.width].tolist() if t != first] \
                    if row.sampling.top_logprobs else []
                branches[index[id(req)]] = [[t] for t in [first] + runners_up[:self.width - 1]]
                caught_up.append(index[id(req)])
        # Each branch continues greedily, one decode step per depth. Branches share positions (the same slots
        # of the request's blocks), so they run one after another, the first (most likely) last: its KV is
        # what stays, and after the target's verify step the kept nodes of the first branch are exactly the
        # ones whose KV the target kept in place, so the output processor's clamp of num_draft_computed holds.
        for branch in list(range(1, self.width)) + [0]:
            live = [DraftRow(requests[i], requests[i].num_tokens, branch=branches[i][branch], top_n=0)
                    for i in caught_up if len(branches[i]) > branch]
            for j in range(1, max(limits)):
                # (a request aborted meanwhile has no blocks any more: it leaves the round)
                live = [row for row in live if limits[index[id(row.request)]] > j and not row.request.finished]
                if not live:
                    break
                for row in live:                    # feed proposal j at the position after the last
                    row.num_computed_tokens = row.num_tokens - 1
                out = await self._step(ScheduledBatch(live, [1] * len(live)))
                for r, row in enumerate(live):
                    row.branch.append(out.token_ids[r])
                    if branch == 0:                 # other branches' KV is overwritten by the first's
                        row.request.num_draft_computed = row.request.num_tokens + j
        return branches

    async def _step(self, batch: ScheduledBatch) -> StepOutputs:
        """One draft step: written by the draft's StepIO, run on the draft agent, its outputs read back."""
        b = self.agents.buffers
        self.step_io.write_inputs(b, batch)
        command = proto.Step(batch.kind, self.num_steps, batch.num_rows, batch.max_query_len)
        t0 = time.perf_counter()
        try:
            replies, cache_reset = await self.agents.step(command)
            kind = "catch_up" if batch.is_prefill else "decode"
            self.model_time_s[kind] += replies[0].model_ms / 1e3
            self.steps_by_kind[kind] += 1
        finally:
            self.num_steps += 1
            self.step_time_s += time.perf_counter() - t0
        if cache_reset:
            self.num_cache_resets += 1
            logger.warning("the draft agent's KV cache was reset: every request's draft catches up from scratch")
            self.forget_all()
            raise _CacheReset()
        return self.step_io.read_outputs(b, batch)


class _CacheReset(Exception):
    """The draft's KV cache was reset during a round: its proposals are worthless."""
