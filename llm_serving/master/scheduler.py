"""Continuous batching: which requests run in the next step, and how many tokens each one feeds.

A request has `num_tokens` (prompt + output so far) of which the first `num_computed_tokens` are in the KV
cache. A step feeds each of its rows some of the rest, and samples a token for every row that reaches the
end; a new prompt, a chunk of a long prompt, a decode and a preempted request's recompute are all that
one operation. Every step keeps to the budgets: `max_num_seqs` running requests, `max_num_batched_tokens`
fed tokens, and the rows of the graph bucket it runs in (a step where some row feeds more than one token
runs in a prefill graph, at most `max_prefill_rows` rows; a decode step at most `max_decode_rows`).

Policies (`scheduler_config.policy`), each one ordering plus one step rule:
- `prefill_first` (the contest entry's priority): waiting prompts run in prefill steps, several per step,
  before any decode step, so new requests join the running batch at once. The starvation bound: once
  running requests have been left out of `max_decode_wait_steps` steps in a row, the next step decodes.
  With `prefill_wait_ms`, prompts that arrive while requests decode wait up to that long (or until a
  prefill bucket's rows are waiting) so that prefill steps come fuller and rarer.
- `longest_output_first` (the contest winner's ordering): prefill_first with the queue ordered by
  `max_new_tokens`, longest first, so the longest jobs start early and the run has no long tail.
- `fcfs`: the queue in arrival order and no priority. Each step serves the running requests and, when the
  rows fit one prefill bucket, admits waiting ones into the same step (prefill and decode rows together,
  ORCA's selective batching); when they do not, decode and prefill steps take turns.
With `chunked_prefill`, a prompt longer than what is left of the step's token budget is split across
steps (at most `max_chunk_tokens` per step); without it a prompt is fed whole.

Embedding requests (`Request.pooling`) are prompt work of their own: a step's rows are all embeddings (an embed
step, `StepKind.EMBED`, up to `max_embed_rows` rows) or none are, and the queue's order holds across both (the head
of the queue blocks the rest). An embedding's input is fed in chunks of `max_chunk_tokens` from its first token,
whatever the step's budget (a chunk waits for a step with room, or runs alone), so its pooled sums are the same
reductions over the same tokens whatever else runs; it never adopts cached blocks (every token's hidden state is
needed) and its blocks are freed when it ends. An embedding model's (`whole_embeddings`: model_config.task embed, a
bidirectional encoder's) input is fed whole, in one step: a chunk's tokens could not attend to later ones.

Speculative decoding is planned by speculative/planner.py: a decode step of at most `spec_max_rows` rows is
marked `may_speculate` and left as it is; the planner makes it a verify step (proposals attached), a decode run
(`make_run`, when nothing was proposed) or leaves it plain. Blocks for proposals are taken through the scheduler
too (`allocate_ahead`: only when free, never preempting).

A step's outcome (tokens appended, stops, computed tokens advanced, full blocks cached, finished requests freed)
is the OutputProcessor's (master/output_processor.py); the scheduler reads each request's progress from it.

Decode runs: while no request waits, a decode step of at most `decode_steps_max_rows` greedy rows becomes a
run of `decode_steps` steps that the agent does in one call, feeding each row's token to the next step
itself (one round trip and one graph launch per K tokens instead of per token; see `make_run`).

Images ahead (`encode_ahead`): an image's vision tower takes tens of seconds on a CPU, all inside the prefill step
that feeds the image. While requests decode, that would stall them, so an image whose tower has not run is not fed
then: its request's chunk ends before it, and the engine has the agent run the tower a slice at a time ahead of it,
in the decode steps (`image_to_encode`; the agent's reply says when it is done: `mark_encoded`).
With no request decoding, an image is fed at once, its tower inside the step (nothing is waiting on tokens). A
waiting request whose first token to feed is an image is fed so too (it cannot be admitted with nothing to feed).

The budgets and rules are one frozen `SchedulerSpec`, built from the config in one place
(`SchedulerSpec.from_config`).

Memory: a row is in a step only once its KV blocks are allocated; admission never takes the blocks that
running requests are about to need (`watermark_blocks`). When a running request needs a block and none
is left, the lowest-priority running request (the one the queue would serve last) is preempted: its
blocks are freed and it goes back to the queue, keeping its outputs, to be recomputed later (prompt +
outputs, as one prefill); nothing is dropped. With prefix caching, admission first adopts the cached
blocks of the longest matching prefix and feeds only the rest.
"""
from __future__ import annotations

import bisect
import dataclasses
import time
from dataclasses import dataclass
from typing import Optional

from llm_serving.config import SCHEDULING_POLICIES
from llm_serving.master.batch import ScheduledBatch
from llm_serving.master.block_manager import BlockManager
from llm_serving.master.request import Request, RequestStatus
from llm_serving.shm.layout import StepKind

POLICIES = SCHEDULING_POLICIES      # named in config.py, which validates scheduler_config.policy


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the HTTP layer answers 429."""


@dataclass(frozen=True)
class SchedulerSpec:
    """What the scheduler keeps to: the budgets, the policy and the step rules (see the module docstring).
    Built from the config in one place (`from_config`); tests build one and `dataclasses.replace` fields."""

    max_num_seqs: int                        # running requests
    max_num_batched_tokens: int              # fed tokens per step
    max_prefill_rows: int                    # rows of the largest prefill graph
    max_waiting_requests: int                # queue bound (QueueFullError past it)
    max_decode_rows: Optional[int] = None    # rows of the largest decode graph (None: max_num_seqs)
    max_waiting_tokens: Optional[int] = None     # queue bound in prompt tokens (None: none)
    policy: str = "prefill_first"            # one of POLICIES
    chunked_prefill: bool = False
    max_chunk_tokens: Optional[int] = None   # tokens per chunk (None: max_num_batched_tokens)
    max_decode_wait_steps: int = 8           # starvation bound
    watermark_blocks: int = 0                # blocks admission leaves free for running requests
    prefill_wait_s: float = 0.0              # prefill_first: let prompts gather this long while others decode
    spec_max_rows: int = 0                   # decode steps of at most this many rows are left to speculative
                                             # planning (0: speculation off)
    decode_steps: int = 1                    # steps of a decode run (1: none); the engine lowers it to the agents'
    decode_steps_max_rows: int = 0           # decode runs for steps of at most this many rows
    max_model_len: Optional[int] = None      # tokens a request may hold
    max_embed_rows: Optional[int] = None     # rows of an embed step (None: max_prefill_rows)
    whole_embeddings: bool = False           # an embedding's input in one step (an embedding model: task embed)
    max_step_images: int = 1                 # images a prefill step may feed (the agent may run its vision tower
                                             # on each, tens of seconds: one at a time lets decode steps between)
    encode_ahead: bool = False               # while requests decode, an image is fed only once its tower ran
                                             # ahead of it (see the module docstring)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {self.policy!r}; one of {', '.join(POLICIES)}")

    @classmethod
    def from_config(cls, config) -> "SchedulerSpec":
        """The scheduler a config describes: budgets from serving_config and the graph buckets, rules from
        scheduler_config, and which decode steps speculation may take from spec_config."""
        sc, mc, sched, spec = config.serving_config, config.model_config, config.scheduler_config, config.spec_config
        return cls(max_num_seqs=sc.max_num_seqs, max_num_batched_tokens=sc.max_num_batched_tokens,
                   max_prefill_rows=mc.prefill_batch_size[-1], max_waiting_requests=sc.max_waiting_requests,
                   max_decode_rows=mc.decode_batch_size[-1], max_waiting_tokens=sched.max_waiting_tokens,
                   policy=sched.policy, chunked_prefill=sched.chunked_prefill,
                   max_chunk_tokens=config.max_chunk_tokens, max_decode_wait_steps=sched.max_decode_wait_steps,
                   watermark_blocks=int(sched.kv_watermark * config.pa_config.num_blocks),
                   prefill_wait_s=sched.prefill_wait_ms / 1e3,
                   spec_max_rows=spec.max_batch_size if spec.enabled else 0, decode_steps=sched.decode_steps,
                   decode_steps_max_rows=sched.decode_steps_max_rows or mc.decode_batch_size[-1],
                   max_model_len=config.max_model_len,
                   max_embed_rows=max(mc.prefill_batch_size[-1], mc.decode_batch_size[-1]),
                   whole_embeddings=mc.task == "embed", encode_ahead=sched.image_encode_ms > 0)


class Scheduler:
    def __init__(self, spec: SchedulerSpec, block_manager: BlockManager, clock=time.monotonic):
        self.spec = spec                 # replaced, not edited (the engine lowers decode runs to the agents')
        self.bm = block_manager
        self.clock = clock
        self.num_decode_runs = 0
        self.waiting: list = []          # in policy order (see _key): waiting[0] is served next
        self.running: list = []          # in admission order
        self.num_waiting_tokens = 0
        self.decode_wait = 0             # steps in a row that left a decode-ready running request out
        self._last_was_decode = False    # fcfs: whose turn it is when decode and prefill cannot share a step
        self.num_preemptions = 0
        self.num_admitted_tokens = 0     # tokens of admitted requests, and of those, tokens found in the
        self.num_cached_tokens = 0       # prefix cache (the prefix-cache hit rate is their ratio)
        self.encoded: dict = {}          # content keys of the images the agents have encoded ahead (oldest first)
        self._defer = False              # this step feeds no image that is not in `encoded` (encode_ahead)

    # --- requests in and out -----------------------------------------------------------------------

    def _key(self, req: Request) -> tuple:
        """Priority: smaller is served first (and preempted last)."""
        if self.spec.policy == "longest_output_first":
            return (-req.sampling.max_new_tokens, req.number)
        return (req.number,)

    def _enqueue(self, req: Request) -> None:
        bisect.insort(self.waiting, req, key=self._key)
        self.num_waiting_tokens += req.num_tokens

    def add(self, req: Request) -> None:
        """Queue a new request; QueueFullError past either bound (nothing is changed then)."""
        if len(self.waiting) >= self.spec.max_waiting_requests:
            raise QueueFullError(f"server overloaded: {len(self.waiting)} requests already waiting "
                                 f"(serving_config.max_waiting_requests={self.spec.max_waiting_requests}); retry later")
        max_tokens = self.spec.max_waiting_tokens
        if max_tokens is not None and self.num_waiting_tokens + req.num_tokens > max_tokens:
            raise QueueFullError(f"server overloaded: {self.num_waiting_tokens} prompt tokens already waiting "
                                 f"(scheduler_config.max_waiting_tokens={max_tokens}); retry later")
        self._enqueue(req)

    def _unqueue(self, req: Request) -> None:
        self.waiting.remove(req)
        self.num_waiting_tokens -= req.num_tokens

    def finish(self, req: Request, reason: str) -> None:
        """Mark req finished and free its blocks now (they are reusable in the very next step); a finished
        request stays as it ended."""
        if req.status is RequestStatus.FINISHED:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING and req in self.waiting:
            self._unqueue(req)
        self.bm.free(req.req_id)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason

    def set_lora(self, adapter: str, slot: int, root: int) -> None:
        """The waiting requests of LoRA adapter `adapter` run in the agents' `slot` with prefix-cache root
        `root` (slot -1: it is in no slot now, and they are not admitted until the engine loads it again)."""
        for req in self.waiting:
            if req.lora_adapter == adapter:
                req.lora_slot, req.lora_root = slot, root

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- the step ----------------------------------------------------------------------------------

    def schedule(self) -> Optional[ScheduledBatch]:
        """The next step, or None when there is nothing to run (never None while requests are running or can
        be admitted). Composing a step may preempt every row it was going to run (a decode step whose only
        decode-ready request is the lowest-priority one and needs the last block); the state has changed then
        (fewer running, more waiting), so the step is composed again. A step that comes back empty admitted
        nothing, so each retry has fewer running requests and the loop ends."""
        while True:
            preempted = self.num_preemptions
            batch = self._compose()
            if batch is not None or self.num_preemptions == preempted:
                break
        if batch is None:
            return None
        in_step = set(map(id, batch.requests))
        left_out = any(_decoding(r) and id(r) not in in_step for r in self.running)
        self.decode_wait = self.decode_wait + 1 if left_out else 0
        self._last_was_decode = batch.kind not in (StepKind.PREFILL, StepKind.EMBED)
        return batch

    def _compose(self) -> Optional[ScheduledBatch]:
        decoding = any(map(_decoding, self.running))
        self._defer = self.spec.encode_ahead and decoding
        if self.spec.policy == "fcfs":
            return self._fcfs_step()
        starving = decoding and self.decode_wait >= self.spec.max_decode_wait_steps
        batch = None if starving or (decoding and self._hold_prefill()) else self._prefill_step()
        return batch if batch is not None else self._decode_step()

    # --- step kinds --------------------------------------------------------------------------------

    def _prefill_step(self) -> Optional[ScheduledBatch]:
        """Prompt work only: running requests' next chunks first, then waiting requests; embeddings or
        generation, as the first of them is."""
        first = next((r for r in self.running if _prompt_work(r)), self.waiting[0] if self.waiting else None)
        if first is None:
            return None
        embed = first.pooling is not None
        rows, counts = [], []
        max_rows = self._prompt_rows(embed)
        budget = self._add_running(rows, counts, self.spec.max_num_batched_tokens, max_rows, prompts=True,
                                   embed=embed)
        self._admit(rows, counts, budget, max_rows, embed=embed)
        return self._batch(rows, counts, embed)

    def _prompt_rows(self, embed: bool) -> int:
        return (self.spec.max_embed_rows or self.spec.max_prefill_rows) if embed else self.spec.max_prefill_rows

    @staticmethod
    def _batch(rows: list, counts: list, embed: bool = False) -> Optional[ScheduledBatch]:
        if not rows:
            return None
        return ScheduledBatch(rows, counts, kind=StepKind.EMBED if embed else None)

    def _decode_step(self) -> Optional[ScheduledBatch]:
        rows, counts = [], []
        max_rows = self.spec.max_decode_rows or self.spec.max_num_seqs
        self._add_running(rows, counts, self.spec.max_num_batched_tokens, max_rows, prompts=False)
        if not rows:
            return None
        # the planner decides: a verify step, a run, or as it is; but a step that carries an image's tower ahead
        # (seconds) is a decode run where it can be, whose K tokens a row make the most of the step
        if len(rows) <= self.spec.spec_max_rows and not (self._defer and self._image_ahead({}) is not None):
            return ScheduledBatch(rows, counts, may_speculate=True)
        return self.make_run(ScheduledBatch(rows, counts))

    def token_budget_left(self, batch: ScheduledBatch) -> int:
        """Tokens a step may still feed (what proposals may take)."""
        return self.spec.max_num_batched_tokens - batch.num_tokens

    def make_run(self, batch: ScheduledBatch) -> ScheduledBatch:
        """While nothing waits, a plain decode step of at most decode_steps_max_rows rows as a decode run of
        decode_steps (K) steps when every row is greedy, with no top log-probabilities, penalties or logit controls,
        and some row has 2 or more tokens left; else the step as it is. Each row takes as many of the K steps as
        max_new_tokens and the model length leave it (`run_lens`; it sits the rest out, and a run every row has left
        ends there at almost no cost), with blocks for their K/V taken only when free: a run never preempts anyone.
        A token after a row's stop is computed and dropped; a request that arrives waits for the run to end."""
        k = self.spec.decode_steps
        if k <= 1 or batch.num_rows > self.spec.decode_steps_max_rows or self.waiting or batch.proposals:
            return batch
        lens = []
        for req in batch.requests:
            sp = req.sampling
            if not sp.greedy or sp.top_logprobs or sp.adjusts_logits:
                return batch
            n = min(k, sp.max_new_tokens - len(req.output_ids))
            if self.spec.max_model_len is not None:
                n = min(n, self.spec.max_model_len - req.num_tokens)
            lens.append(max(n, 1))
        if max(lens) < 2:
            return batch
        for req, n in zip(batch.requests, lens):    # K/V of its n tokens: positions num_tokens - 1 .. + n - 2
            if not self.allocate_ahead(req, req.num_tokens + n - 1):
                return batch            # (blocks already taken stay with their request: it needs them next)
        self.num_decode_runs += 1
        return dataclasses.replace(batch, steps=k, run_lens=lens, kind=StepKind.DECODE_RUN, spec_limits=[])

    def allocate_ahead(self, req: Request, num_tokens: int) -> bool:
        """Blocks for req's first num_tokens tokens, taken now if they are free (a decode run's later steps, a
        draft's or a verify step's proposals); False, and nothing taken, if they are not: this never preempts."""
        if not self.bm.can_allocate(req.req_id, num_tokens):
            return False
        self.bm.allocate(req.req_id, num_tokens)
        return True

    def token_capacity(self, req: Request) -> int:
        """Tokens req's blocks hold."""
        return len(self.bm.block_tables.get(req.req_id, ())) * self.bm.block_size

    def _hold_prefill(self) -> bool:
        """prefill_wait_s > 0: while requests are decoding, let new prompts gather into fuller prefill
        steps (llm-serving's batch_waiting_time): no prefill step until a prefill bucket's rows are waiting
        or the oldest has waited prefill_wait_s. Prompts being chunked are never held."""
        if self.spec.prefill_wait_s <= 0 or any(map(_prompt_work, self.running)):
            return False
        if len(self.waiting) >= self.spec.max_prefill_rows or not self.waiting:
            return False
        oldest = min(r.arrival_time for r in self.waiting)
        return self.clock() - oldest < self.spec.prefill_wait_s

    def _fcfs_step(self) -> Optional[ScheduledBatch]:
        """Everything in one step when the rows fit a prefill bucket; else decode and prefill take turns."""
        pending = len(self.running) + (1 if self.waiting else 0)
        embeds = any(r.pooling is not None for r in self.running) or (self.waiting and
                                                                      self.waiting[0].pooling is not None)
        if pending <= self.spec.max_prefill_rows and not embeds:
            rows, counts = [], []
            budget = self._add_running(rows, counts, self.spec.max_num_batched_tokens, self.spec.max_prefill_rows,
                                       prompts=None)
            if len(rows) == len(self.running):          # nothing running was left out: admit behind it
                self._admit(rows, counts, budget, self.spec.max_prefill_rows)
            return self._batch(rows, counts)
        has_decode = any(map(_decoding, self.running))
        if self._last_was_decode or not has_decode:
            batch = self._prefill_step()
            if batch is not None:
                return batch
        return self._decode_step()

    # --- composing a step --------------------------------------------------------------------------

    def _chunk(self, need: int, budget: int, first_row: bool, embed: bool = False) -> int:
        """Tokens a row needing `need` may feed with `budget` left (0 = it does not fit this step); an embedding's
        next chunk is fixed by its input alone (see the module docstring)."""
        if embed:
            q = need if self.spec.whole_embeddings else min(need, self.spec.max_chunk_tokens
                                                            or self.spec.max_num_batched_tokens)
            return q if q <= budget or first_row else 0
        if need == 1:
            return 1 if budget >= 1 else 0
        if self.spec.chunked_prefill:
            return max(min(need, budget, self.spec.max_chunk_tokens or self.spec.max_num_batched_tokens), 0)
        if need <= budget or first_row:     # a whole prompt; a lone long one may exceed the budget
            return need
        return 0

    def _add_running(self, rows: list, counts: list, budget: int, max_rows: int, prompts: Optional[bool],
                     embed: bool = False) -> int:
        """Add running requests in admission order: those with prompt work (prompts=True), decode-ready
        ones (False) or both (None), embeddings or not (`embed`), each with the blocks for what it feeds,
        preempting the lowest-priority running request when blocks run out. Returns the token budget left."""
        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING or len(rows) >= max_rows or (req.pooling is not None) != embed:
                continue
            need = req.num_new_tokens
            if prompts is not None and _prompt_work(req) != prompts:
                continue
            q = self._chunk(need, budget, first_row=not rows, embed=embed)
            if req.images:          # (an image whole, one a step; the room is counted only for these rows)
                room = self._image_room(rows, counts)
                whole = _whole_images(req, req.num_computed_tokens, q, budget, not rows, room)
                q = _whole_images(req, req.num_computed_tokens, q, budget, not rows, room, self._not_encoded)
                if q == 0 < whole:
                    continue        # (its next image is being encoded ahead: the rows behind it go on)
            if q == 0:
                break
            if not self._reserve(req, req.num_computed_tokens + q, rows, counts):
                continue                                   # req itself was preempted
            rows.append(req)
            counts.append(q)
            budget -= q
        return budget

    def _image_room(self, rows: list, counts: list) -> int:
        """Images the step being composed may still feed (max_step_images less those its rows feed)."""
        fed = sum(len(r.image_at(r.num_computed_tokens, r.num_computed_tokens + c))
                  for r, c in zip(rows, counts) if r.images)
        return self.spec.max_step_images - fed

    def _reserve(self, req: Request, num_tokens: int, rows: list, counts: list) -> bool:
        """Allocate req's blocks for num_tokens, preempting from the lowest priority up until they exist;
        False if req itself had to go. A preempted request already in this step leaves it."""
        while not self.bm.can_allocate(req.req_id, num_tokens):
            victim = max(self.running, key=self._key)
            if victim in rows:
                i = rows.index(victim)
                del rows[i], counts[i]
            self._preempt(victim)
            if victim is req:
                return False
        self.bm.allocate(req.req_id, num_tokens)
        return True

    def _admit(self, rows: list, counts: list, budget: int, max_rows: int, embed: bool = False) -> int:
        """Move waiting requests into the step in queue order while they fit and are embeddings or not as the
        step is (`embed`; the head blocks the rest, so nothing overtakes it); returns the budget left."""
        while self.waiting and len(rows) < max_rows and len(self.running) < self.spec.max_num_seqs:
            req = self.waiting[0]
            if req.lora_slot < 0 or (req.pooling is not None) != embed:   # (lora_slot < 0: its LoRA adapter is
                break                                                     # not in a slot yet; the engine loads it)
            # (a prompt still to be scored, or an embedding, is computed whole: cached blocks would skip its
            # log-probabilities or hidden states)
            whole = req.pooling is not None or (req.prompt_scores is not None and req.prompt_scores[-1] is None)
            prefix = [] if whole else self.bm.match_prefix(req.cache_tokens(0, req.num_tokens), req.lora_root)
            cached = len(prefix) * self.bm.block_size
            q = self._chunk(req.num_tokens - cached, budget, first_row=not rows, embed=embed)
            if req.images:          # (an image starting what it feeds is fed now, encoded ahead or not)
                room = self._image_room(rows, counts)
                q = (_whole_images(req, cached, q, budget, not rows, room, self._not_encoded)
                     or _whole_images(req, cached, q, budget, not rows, room))
            reserve = self.spec.watermark_blocks if self.running else 0
            if q == 0 or not self.bm.can_allocate(req.req_id, cached + q, prefix, reserve=reserve):
                break
            self.bm.allocate(req.req_id, cached + q, prefix)
            self._unqueue(req)
            req.num_computed_tokens = cached
            req.num_cached_tokens += cached
            self.num_admitted_tokens += req.num_tokens
            self.num_cached_tokens += cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            rows.append(req)
            counts.append(q)
            budget -= q
        return budget

    # --- images encoded ahead (encode_ahead) ---------------------------------------------------------

    def _not_encoded(self, key: str) -> bool:
        """This step leaves out the image `key` (see the module docstring)."""
        return self._defer and key not in self.encoded

    def image_to_encode(self, batch: ScheduledBatch):
        """(request, PromptImage): the image whose tower the agent should run some of with `batch`, a step that
        decodes: the next image of the first running request (admission order) that steps leave out for it; None if
        there is none, or if `batch` decodes no row (a prompt's step is long enough: the tower waits for the next)."""
        if not self._defer or all(map(_prompt_work, batch.requests)):
            return None
        return self._image_ahead({id(r): q for r, q in zip(batch.requests, batch.num_new_tokens)})

    def _image_ahead(self, in_step: dict):
        """The first running request's next image not yet encoded ahead, past the tokens `in_step` feeds it
        ({id(request): tokens}); None if there is none."""
        for req in self.running:
            if not req.images or req.status is not RequestStatus.RUNNING or not _prompt_work(req):
                continue
            done = req.num_computed_tokens + in_step.get(id(req), 0)
            image = next((im for im in req.images if im.start + im.length > done), None)
            if image is not None and image.key not in self.encoded:
                return req, image
        return None

    def mark_encoded(self, key: str) -> None:
        """The agent's reply: the image `key`'s tower is done (its rows are ready, or were cached)."""
        self.encoded.pop(key, None)
        self.encoded[key] = None
        while len(self.encoded) > _ENCODED_KEYS:
            del self.encoded[next(iter(self.encoded))]

    def recompute_all(self) -> int:
        """The KV cache's contents are gone (an agent's cache was reset): every running request goes back to
        the queue to compute its KV again from its tokens, as a preempted one does. Returns how many."""
        running = list(self.running)
        for req in running:
            self._preempt(req)
        return len(running)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.bm.free(req.req_id)
        req.num_computed_tokens = req.num_draft_computed = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(req)

    # --- observability -----------------------------------------------------------------------------

    @property
    def prefix_cache_hit_rate(self) -> Optional[float]:
        """Share of admitted tokens whose KV came from the prefix cache."""
        return self.num_cached_tokens / self.num_admitted_tokens if self.num_admitted_tokens else None


_ENCODED_KEYS = 256      # images the scheduler remembers as encoded ahead (a key forgotten is only encoded again)


def _whole_images(req: Request, computed: int, q: int, budget: int, first_row: bool, room: int = 1 << 30,
                  left_out=None) -> int:
    """A chunk of q tokens from `computed` on, cut so that it ends at no point inside an image's placeholders (an
    image's tokens attend to each other: they are computed in one step): it ends before the image, or (when the
    image starts it) takes the image whole if the budget allows (a lone row: whatever it is), else nothing; and it
    feeds at most `room` images (the step's others count against max_step_images), ending before the next one,
    and none whose key `left_out` (a predicate) names."""
    if not req.images or q == 0:
        return q
    stop = computed + q
    for image in req.image_at(computed, stop):
        end = image.start + image.length
        if room <= 0 or (left_out is not None and left_out(image.key)):
            return max(image.start - computed, 0)
        room -= 1
        if image.start < stop < end:
            if image.start > computed:
                return image.start - computed
            whole = end - computed
            return whole if whole <= budget or first_row else 0
    return q


def _prompt_work(req: Request) -> bool:
    """req's next step feeds prompt tokens (a decode-ready request feeds one token and samples; an embedding is
    prompt work to its last token)."""
    return req.num_new_tokens > 1 or req.pooling is not None


def _decoding(req: Request) -> bool:
    return not _prompt_work(req)
