"""Continuous batching: which requests run in the next step, and how many tokens each feeds.

Every step is either a prefill step (rows that feed several tokens: new prompts, or preempted requests
being recomputed) or a decode step (every running request feeds its one newest token). Prefill goes
first whenever a waiting request fits, so new requests join the running batch at the next step and
their first token comes early; the decode step then carries everyone together. Finished requests free
their blocks at once. When the cache cannot hold the next token of every running request, the most
recently admitted request is preempted: its blocks are freed and it waits at the head of the queue to
be recomputed (prompt + output so far, in one prefill), so nothing is dropped.
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import Optional

from llm_serving.master.block_manager import BlockManager
from llm_serving.master.request import Request, RequestStatus


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the HTTP layer answers 429."""


@dataclass
class ScheduledBatch:
    is_prefill: bool
    requests: list

    @property
    def num_rows(self) -> int:
        return len(self.requests)

    @property
    def max_query_len(self) -> int:
        return max(r.num_new_tokens for r in self.requests)


class Scheduler:
    def __init__(self, *, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_prefill_rows: int, max_waiting_requests: int):
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_rows = max_prefill_rows
        self.max_waiting_requests = max_waiting_requests
        self.waiting: deque = deque()
        self.running: list = []          # in admission order; the last is preempted first
        self.num_preemptions = 0
        self.batch_sizes: Counter = Counter()   # (kind, rows) -> steps, for stats and tests

    # --- requests in and out -----------------------------------------------------------------------

    def add(self, req: Request) -> None:
        if len(self.waiting) >= self.max_waiting_requests:
            raise QueueFullError(f"server overloaded: {len(self.waiting)} requests already waiting "
                                 f"(serving_config.max_waiting_requests={self.max_waiting_requests})")
        self.waiting.append(req)

    def finish(self, req: Request, reason: str) -> None:
        """Mark req finished and free its blocks now (they are reusable in the very next step)."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.bm.free(req.req_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- the step ----------------------------------------------------------------------------------

    def schedule(self) -> Optional[ScheduledBatch]:
        batch = self._schedule_prefill() or self._schedule_decode()
        if batch is not None:
            self.batch_sizes[("prefill" if batch.is_prefill else "decode", batch.num_rows)] += 1
        return batch

    def _schedule_prefill(self) -> Optional[ScheduledBatch]:
        rows: list = []
        num_tokens = 0
        while (self.waiting and len(rows) < self.max_prefill_rows
               and len(self.running) + len(rows) < self.max_num_seqs):
            req = self.waiting[0]
            need = req.num_new_tokens
            if rows and num_tokens + need > self.max_num_batched_tokens:
                break
            if not self.bm.can_allocate(req.req_id, req.num_tokens):
                break
            self.bm.allocate(req.req_id, req.num_tokens)
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            rows.append(req)
            num_tokens += need
        if not rows:
            return None
        self.running.extend(rows)
        return ScheduledBatch(is_prefill=True, requests=rows)

    def _schedule_decode(self) -> Optional[ScheduledBatch]:
        rows: list = []
        candidates = deque(self.running)
        while candidates:
            req = candidates.popleft()
            while not self.bm.can_allocate(req.req_id, req.num_tokens):
                victim = candidates.pop() if candidates else req
                self._preempt(victim)
                if victim is req:
                    break
            else:
                self.bm.allocate(req.req_id, req.num_tokens)
                rows.append(req)
        return ScheduledBatch(is_prefill=False, requests=rows) if rows else None

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.bm.free(req.req_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
