"""A step's outcome, in one place: what each request got from a step the agents ran.

`OutputProcessor.update_from_output(batch, outputs)` takes the batch as it was scheduled and its outputs as
StepIO read them, and for each row whose request still runs (one that ended while the step ran is skipped):
1. a prefill step scoring prompts: the row's prompt tokens' scores, kept per position before the row advances;
2. the row's fed tokens count as computed (a verify row's proposals not yet) and its newly full blocks join the
   prefix cache;
3. a row that reached its end gets its tokens (a chunk that stops inside the prompt gets none): a plain step's
   sampled token; a decode run's, one per step the row took (`run_lens`); a verify step's, the path of its
   proposals the target agrees with and the target's token after it (`speculative.tree.accept`), with the
   round recorded in the speculation statistics;
4. they are appended to the request one by one until a token-level stop: a stop token or the grammar's end
   ("stop"), a token the grammar refuses ("error"), max_new_tokens, the model length or a grammar that cannot go
   on (master/logits.py: "length");
5. a request that goes on has the tokens whose KV the step already wrote counted as computed (a run's tokens fed
   back on the agent, a verify step's kept proposals on the first branch); one that stopped is finished, its
   blocks free for the next step.
It returns a `RequestOutput` per request that got tokens or ended. The engine does the rest, which needs text:
detokenizing, stop strings and streaming (master/engine.py); a stop string inside a step's tokens ends the
request there, and the tokens after it leave its output (`drop_last`). Pure Python, unit-tested with a fake
runner.

An embed step's rows get no tokens: each one's pooled hidden state joins its request's, and a request whose input
is all fed ends with its embedding (`_pool`). Every other step kind has its rule in `_TOKENS` (a new step kind adds
one): which tokens a row that reached its end gets, and how many of them beyond the first already have their KV in place. (The loop runs for every row of
every step, 64 rows a few hundred times a second: rules return plain tuples, and a row's common case, one
token, takes no slicing or second pass.)
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import numpy as np

from llm_serving.master.batch import ScheduledBatch
from llm_serving.master.request import Request, RequestStatus
from llm_serving.master.scheduler import Scheduler
from llm_serving.master.speculative.stats import SpecStats
from llm_serving.master.speculative.tree import accept
from llm_serving.master.step_io import StepOutputs
from llm_serving.shm.layout import StepKind


@dataclass
class RequestOutput:
    """What one request got from a step: the tokens appended to its output (in order), their log-probabilities,
    each one's top log-probabilities when it asked for them (plain steps), and, when the step ended it, why
    (`finish_reason` "stop", "length" or "error"; `error` says what failed, or why a "length" came before
    max_tokens: its grammar could not go on). The scheduler has already freed an ended request's blocks."""

    request: Request
    token_ids: list
    logprobs: list
    tops: Optional[list] = None
    finish_reason: Optional[str] = None
    error: Optional[str] = None


class OutputProcessor:
    """The one owner of a step's outcome (see the module docstring), for one scheduler."""

    def __init__(self, scheduler: Scheduler, spec_stats: Optional[SpecStats] = None, clock=time.monotonic):
        self.scheduler = scheduler
        self.bm = scheduler.bm
        self.spec_stats = spec_stats if spec_stats is not None else SpecStats(0)
        self.clock = clock
        self.batch_sizes: Counter = Counter()   # (kind, rows) -> steps applied, for /stats and tests
        self.num_generated_tokens = 0           # appended to requests' outputs

    def update_from_output(self, batch: ScheduledBatch, out: StepOutputs) -> list:
        """Apply one step's outputs (see the module docstring): a RequestOutput per request that got tokens or
        ended, in row order."""
        self.batch_sizes[(batch.kind.stats_name, batch.num_rows)] += 1
        if batch.kind is StepKind.VERIFY:
            self.spec_stats.verify_steps += 1
        if out.prompt is not None:
            self._score_prompts(batch, out)
        if batch.kind is StepKind.EMBED:
            return self._pool(batch, out)
        rule = self._TOKENS[batch.kind]
        now = self.clock()
        results = []
        for row, (req, fed) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            if req.status is not RequestStatus.RUNNING:
                continue
            proposed = len(batch.proposals[row]) if batch.proposals else 0
            self._advance(req, fed - proposed, draft_may_hold=proposed)
            if req.num_computed_tokens < req.num_tokens:     # a prompt chunk: nothing sampled yet
                continue
            token_ids, logprobs, tops, in_place = rule(self, batch, out, row)
            if req.first_token_time is None:
                req.first_token_time = now
            count, reason, error = self._append(req, token_ids, logprobs)
            if reason is not None:
                self.scheduler.finish(req, reason)
            elif in_place or proposed:      # (a verify row's draft KV is clamped to what was kept, in place or not)
                self._advance(req, in_place)
            if count < len(token_ids):
                token_ids, logprobs, tops = token_ids[:count], logprobs[:count], tops and tops[:count]
            results.append(RequestOutput(req, token_ids, logprobs, tops, reason, error))
        return results

    # --- each step kind's tokens -------------------------------------------------------------------

    # Each returns (token ids, their log-probabilities, each one's top log-probabilities or None, how many of the
    # tokens after the first already have their KV in place).

    def _sampled(self, batch: ScheduledBatch, out: StepOutputs, row: int) -> tuple:
        """A plain step (prefill, decode): the token sampled after the row's last."""
        k = batch.requests[row].sampling.top_logprobs
        tops = [out.top(row, k)] if k and out.top_ids is not None else None
        return [out.token_ids[row]], [out.logprobs[row]], tops, 0

    def _run(self, batch: ScheduledBatch, out: StepOutputs, row: int) -> tuple:
        """A decode run: a token per step the row took; the agent fed all but the last back (their KV is in)."""
        steps = batch.run_lens[row]
        return out.token_ids[row][:steps], out.logprobs[row][:steps], None, steps - 1

    def _verified(self, batch: ScheduledBatch, out: StepOutputs, row: int) -> tuple:
        """A verify step: the kept path's tokens and the target's after it; the kept proposals on the first branch
        have their KV in place (others are fed again in the row's next step: their KV is in other slots)."""
        proposal, targets, logprobs = batch.proposals[row], out.token_ids[row], out.logprobs[row]
        acceptance = accept(proposal, batch.parents[row], targets)
        if proposal:
            self.spec_stats.record(len(proposal), len(acceptance.kept), other_branch=acceptance.off_first_branch)
        return ([targets[j] for j in acceptance.emit], [logprobs[j] for j in acceptance.emit], None,
                acceptance.in_place)

    _TOKENS = {StepKind.PREFILL: _sampled, StepKind.DECODE: _sampled, StepKind.DECODE_RUN: _run,
               StepKind.VERIFY: _verified}

    # --- embeddings --------------------------------------------------------------------------------

    def _pool(self, batch: ScheduledBatch, out: StepOutputs) -> list:
        """An embed step: each row's pooled part joins its request's (a part from the input's first token starts
        it again: a preempted request computes it again); a request whose input is all fed ends ("stop") with its
        embedding, normalized (mean pooling: the sum over its tokens divided by their count first). Its blocks are
        never cached for other prompts: they are free once it ends."""
        results = []
        now = self.clock()
        for row, (req, fed) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            if req.status is not RequestStatus.RUNNING:
                continue
            part = out.pooled[row].astype(np.float64)
            if req.num_computed_tokens == 0 or req.pooled is None or req.pooling == "last":
                req.pooled = part
            elif req.pooling == "mean":
                req.pooled += part          # (cls: the first part's)
            req.num_computed_tokens += fed
            self.bm.release_window(req.req_id, req.num_computed_tokens)
            if req.num_computed_tokens < req.num_tokens:
                continue
            pooled = req.pooled / req.num_tokens if req.pooling == "mean" else req.pooled
            norm = float(np.linalg.norm(pooled))
            req.embedding = (pooled / norm if norm > 0 else pooled).astype(np.float32)
            req.first_token_time = now
            self.scheduler.finish(req, "stop")
            results.append(RequestOutput(req, [], [], None, "stop"))
        return results

    # --- the request's side ------------------------------------------------------------------------

    def _advance(self, req: Request, num_tokens: int, draft_may_hold: int = 0) -> None:
        """num_tokens more of req's tokens have their KV in the cache: count them, register the blocks they
        filled for prefix caching, free the window-pool blocks its window left. The draft model's KV (speculative/draft.py) holds at most what the target may
        keep: its computed tokens, and `draft_may_hold` proposals of this step still to be judged."""
        if num_tokens:
            req.num_computed_tokens += num_tokens
            self.bm.cache_full_blocks(req.req_id, req.cache_tokens, req.num_computed_tokens, req.lora_root)
            self.bm.release_window(req.req_id, req.num_computed_tokens)
        req.num_draft_computed = min(req.num_draft_computed, req.num_computed_tokens + draft_may_hold)

    def _append(self, req: Request, token_ids: list, logprobs: list) -> tuple:
        """Append tokens to req's output until a token-level stop: (how many were appended, the finish reason or
        None, an error or None)."""
        max_len = self.scheduler.spec.max_model_len
        state = req.logits
        for k, (token_id, logprob) in enumerate(zip(token_ids, logprobs)):
            if state is not None and state.cut_short:     # its grammar failed the mask: this token is not its own
                return k, "length", state.cut_short
            req.output_ids.append(token_id)
            req.output_logprobs.append(logprob)
            self.num_generated_tokens += 1
            if token_id in req.stop_token_ids:
                reason = "stop"
            elif len(req.output_ids) >= req.sampling.max_new_tokens or (max_len is not None and
                                                                          req.num_tokens >= max_len):
                reason = "length"
            else:
                reason = None
            if state is not None and (reason != "stop" or state.error):   # a stop token needs no grammar's leave
                if state.error or not state.accept(token_id):
                    if state.cut_short:     # the token is the grammar's, which cannot go on after it
                        return k + 1, "length", state.cut_short
                    return k + 1, "error", state.error
                if state.complete:          # the grammar is matched: this token is the output's last
                    reason = "stop"
            if reason is not None:
                return k + 1, reason, None
        return len(token_ids), None, None

    def drop_last(self, req: Request, num_tokens: int) -> None:
        """The engine ended req at a stop string inside the tokens a step gave it: its last num_tokens output tokens
        (after the stop) are not part of its output."""
        if num_tokens:
            del req.output_ids[-num_tokens:], req.output_logprobs[-num_tokens:]
            self.num_generated_tokens -= num_tokens

    def _score_prompts(self, batch: ScheduledBatch, out: StepOutputs) -> None:
        """A prefill step scoring prompts: each row's score of the prompt token after each of its new tokens."""
        for row, (req, q) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            if req.prompt_scores is not None and req.status is RequestStatus.RUNNING:
                start, p = req.num_computed_tokens, len(req.prompt_ids)
                for j in range(min(q, p - 1 - start)):
                    req.prompt_scores[start + j + 1] = out.prompt_logprob(row, j, req.sampling.prompt_logprobs)
