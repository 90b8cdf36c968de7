"""The master's step loop: schedule, write the step into shared memory, run it on the agents, read the
sampled tokens back, detokenize and stream them. Runs as one task on the HTTP server's event loop and
never blocks it (the agent round-trip is awaited on a socket).

Supervision lives here too. A step an agent answers with a failure ends exactly the requests in it. An
agent that dies (its connection drops) or does not answer a step within `step_timeout_s` is lost, and
so is its KV cache: every running request ends at once with finish_reason "error" and the reason,
waiting requests stay queued, and the agent group is killed and started again (fresh KV cache, every
block free, prefix cache forgotten) after a back-off that doubles per failure. More than
`max_agent_restarts` failures within `agent_restart_window_s` and the engine gives up: it fails what is
queued, refuses new requests and says why on /health. While agents are down /health answers 503 with
the reason; new requests queue (up to the usual bounds) and run once they are back."""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from typing import Optional

import numpy as np

from llm_serving.agents import protocol as proto
from llm_serving.chat import load_chat_template
from llm_serving.master.agent_group import AgentError, AgentGroup
from llm_serving.master.block_manager import BlockManager
from llm_serving.master.request import Request, SamplingParams, TokenEvent
from llm_serving.master.scheduler import ScheduledBatch, Scheduler

logger = logging.getLogger(__name__)


class EngineStoppedError(RuntimeError):
    """The engine is not running (starting, stopped, or its agents are down)."""


class DuplicateRequestError(ValueError):
    """A client-chosen request id is already in use; the HTTP layer answers 409."""


class Engine:
    def __init__(self, config, tokenizer, model_dir: str, model_name: str):
        self.config = config
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.model_path = model_dir
        self.max_model_len = config.max_model_len
        self.block_manager = BlockManager(config.pa_config.num_blocks, config.pa_config.block_size,
                                          enable_prefix_caching=config.scheduler_config.enable_prefix_caching)
        self.scheduler = make_scheduler(config, self.block_manager)
        mc = config.model_config
        self.stop_token_ids = frozenset(mc.end_token_ids or tokenizer.eos_ids)
        self.agents = AgentGroup(config, model_dir, on_lost=self._on_agent_lost)
        self.chat_template = load_chat_template(config.tokenizer.chat_template, model_dir, tokenizer)
        self.requests: dict = {}
        self._detok: dict = {}
        self._wakeup = asyncio.Event()
        self._loop_task: Optional[asyncio.Task] = None
        self.running = False
        self.start_time = time.time()
        self.num_steps = 0
        self.step_time_s: Counter = Counter()     # kind -> total seconds spent in agent steps
        self.step_time_by_batch: Counter = Counter()  # (kind, rows) -> total seconds, for benchmarks
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0                # of every admitted request
        self.num_finished: Counter = Counter()    # finish_reason -> requests
        self.finish_listeners: list = []          # callables(request), called as each request ends (metrics)
        # seconds per phase of the step loop, summed over steps (see step_profile in stats())
        self.profile: Counter = Counter()
        self._rows: list = []                 # per shm row: [request, its block table, entries written,
        #                                       history tokens written]
        self._rows_buffers = None
        # supervision (see the module docstring)
        self._agent_failure: Optional[str] = None   # set when an agent failed; the step loop recovers
        self.down_reason: Optional[str] = None      # agents down (restarting) and why
        self.failed_reason: Optional[str] = None    # gave up restarting: the engine serves nothing more
        self.draining_reason: Optional[str] = None  # shutting down: no new requests
        self.agent_failures: deque = deque()        # monotonic times of recent agent failures
        self.num_agent_restarts = 0

    # --- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        t0 = time.perf_counter()
        await self.agents.start()
        self.running = True
        self._loop_task = asyncio.create_task(self._step_loop(), name="engine-step-loop")
        self._loop_task.add_done_callback(self._step_loop_ended)
        logger.info("engine ready in %.1f s: %d agent(s), %d KV blocks of %d tokens, max %d tokens per request; "
                    "chat template: %s", time.perf_counter() - t0, len(self.agents.agents),
                    self.block_manager.num_blocks, self.block_manager.block_size, self.max_model_len,
                    self.chat_template.source)

    async def stop(self) -> None:
        """Stop the step loop, abort what is still in flight, stop the agents."""
        self.running = False
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, Exception):
                pass
        self.abort_all("server shutting down")
        await self.agents.stop()

    def _step_loop_ended(self, task: asyncio.Task) -> None:
        """A bug that ends the step loop must not leave requests hanging and /health green: say so, end them."""
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        logger.error("engine step loop crashed", exc_info=(type(exc), exc, exc.__traceback__))
        self.failed_reason = f"engine step loop crashed: {type(exc).__name__}: {exc}"
        for req in list(self.requests.values()):
            self._finish(req, "error", error=self.failed_reason)

    def drain(self, reason: str) -> None:
        """Stop admitting requests (they get 503 with reason); those in flight go on."""
        self.draining_reason = reason
        logger.info("draining: %s; %d request(s) in flight", reason, len(self.requests))

    def abort_all(self, reason: str) -> int:
        """End every request in flight with finish_reason "abort" and reason; returns how many."""
        reqs = list(self.requests.values())
        for req in reqs:
            self._finish(req, "abort", error=reason)
        return len(reqs)

    def unavailable_reason(self) -> Optional[str]:
        """Why the engine cannot serve right now (/health answers 503 with it), or None when it can."""
        if self.failed_reason:
            return self.failed_reason
        if self.draining_reason:
            return self.draining_reason
        if not self.running:
            return "engine is not running"
        if self.down_reason:
            return f"agents restarting after a failure: {self.down_reason}"
        dead = self.agents.dead_agents()
        return "; ".join(dead) if dead else None

    # --- requests ----------------------------------------------------------------------------------

    def submit(self, prompt_ids: list, sampling: SamplingParams, req_id: Optional[str] = None) -> Request:
        """Queue a validated request (see server/schemas.py). Raises QueueFullError past the queue bounds,
        DuplicateRequestError when req_id names a request still in flight."""
        if self.failed_reason or self.draining_reason or not self.running:
            raise EngineStoppedError(self.failed_reason or self.draining_reason or "engine is not running")
        if req_id is not None and req_id in self.requests:
            raise DuplicateRequestError(f"request id {req_id!r} is already in use by a request in flight")
        req = Request(prompt_ids, sampling, self.stop_token_ids, req_id=req_id)
        self.scheduler.add(req)
        self.num_prompt_tokens += len(req.prompt_ids)
        self.requests[req.req_id] = req
        self._detok[req.req_id] = self.tokenizer.detokenizer(prompt_ids)
        self._wakeup.set()
        return req

    def abort(self, req_id: str, reason: str = "client aborted the request") -> bool:
        """Stop a request now (asked by id); its KV blocks are free for the next step. False if no such
        request is in flight."""
        req = self.requests.get(req_id)
        if req is None or req.finished:
            return False
        self._finish(req, "abort", error=reason)
        return True

    def release(self, req: Request) -> None:
        """The client of req is gone (or done): abort it if it is still in flight (no-op otherwise)."""
        if self.requests.get(req.req_id) is req and not req.finished:
            self._finish(req, "abort", error="client disconnected")

    def _finish(self, req: Request, reason: str, error: Optional[str] = None,
                last: Optional[TokenEvent] = None) -> None:
        """Free req's blocks and send its final event: the last token (if any) carrying the finish reason."""
        self.scheduler.finish(req, reason)
        self.requests.pop(req.req_id, None)
        detok = self._detok.pop(req.req_id, None)
        tail = detok.flush() if detok is not None else ""
        if req.stop_strings is not None:          # release what was held back (never a stop string)
            tail = req.stop_strings.push(tail) + req.stop_strings.flush()
        event = last or TokenEvent(-1, "", 0.0, True)
        event.text += tail
        event.finish_reason, event.error = reason, error
        req.events.put_nowait(event)
        req.finish_time = time.monotonic()
        self.num_finished[reason] += 1
        for listener in self.finish_listeners:
            listener(req)

    # --- the step loop -----------------------------------------------------------------------------

    async def _step_loop(self) -> None:
        prof = self.profile
        while self.running:
            if self._agent_failure is not None:
                if not await self._recover():
                    return
                continue
            t0 = time.perf_counter()
            batch = self.scheduler.schedule()
            prof["schedule"] += time.perf_counter() - t0
            if batch is None:
                if self.scheduler.has_work:       # cannot happen (the scheduler always makes progress),
                    await asyncio.sleep(0.001)    # but never spin the event loop if it did
                else:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                continue
            # No yield between steps: the HTTP handlers stream step N's tokens while the agents compute
            # step N+1 (they run whenever the loop awaits the agents' reply).
            await self._run_step(batch)
            prof["loop"] += time.perf_counter() - t0

    async def _run_step(self, batch: ScheduledBatch) -> None:
        n, s = batch.num_rows, batch.max_query_len
        prof = self.profile
        t_write = time.perf_counter()
        self._write_inputs(batch, s)
        t0 = time.perf_counter()
        prof["shm_write"] += t0 - t_write
        try:
            replies = await self.agents.step(proto.PREFILL if batch.is_prefill else proto.DECODE, self.num_steps,
                                             n, s)
            model_s = replies[0].get("model_ms", 0.0) / 1e3
            agent_s = replies[0].get("agent_ms", 0.0) / 1e3
            prof["model"] += model_s
            prof["agent_other"] += agent_s - model_s
            prof["round_trip"] += time.perf_counter() - t0 - agent_s
        except AgentError as exc:
            logger.error("step %d failed: %s", self.num_steps, exc)
            if exc.fatal:                         # the agent is lost: _recover fails every running request
                self._agent_failure = self._agent_failure or str(exc)
            else:                                 # the agent answered "failed": only this step's requests end
                for req in batch.requests:
                    if not req.finished:
                        self._finish(req, "error", error=str(exc))
            return
        finally:
            self.num_steps += 1
            kind, elapsed = ("prefill" if batch.is_prefill else "decode"), time.perf_counter() - t0
            self.step_time_s[kind] += elapsed
            self.step_time_by_batch[(kind, n)] += elapsed
        t_read = time.perf_counter()
        self._read_outputs(batch)
        prof["output"] += time.perf_counter() - t_read

    # --- supervision -------------------------------------------------------------------------------

    def _on_agent_lost(self, reason: str) -> None:
        """An agent's connection dropped while serving (called from its reader task)."""
        if self._agent_failure is None:
            logger.error("%s", reason)
            self._agent_failure = reason
        self._wakeup.set()

    async def _recover(self) -> bool:
        """Fail the running requests, kill and restart the agents (with back-off); False when giving up."""
        sc = self.config.serving_config
        reason, self.down_reason = self._agent_failure, self._agent_failure
        while True:
            running = list(self.scheduler.running)
            for req in running:
                self._finish(req, "error", error=f"agent failure: {reason}")
            dropped = self.block_manager.forget_cached()
            now = time.monotonic()
            self.agent_failures.append(now)
            while self.agent_failures and now - self.agent_failures[0] > sc.agent_restart_window_s:
                self.agent_failures.popleft()
            failures = len(self.agent_failures)
            logger.error("agent failure (%s): %d running request(s) failed, %d waiting kept, %d cached "
                         "block(s) dropped", reason, len(running), len(self.scheduler.waiting), dropped)
            await self.agents.stop(grace_s=5.0, kill=True)
            if failures > sc.max_agent_restarts:
                self.failed_reason = (f"agents failed {failures} times within {sc.agent_restart_window_s:g} s "
                                      f"(serving_config.max_agent_restarts={sc.max_agent_restarts}); not "
                                      f"restarting. Last failure: {reason}")
                logger.error("%s", self.failed_reason)
                for req in list(self.requests.values()):
                    self._finish(req, "error", error=self.failed_reason)
                self.down_reason = None
                return False
            delay = sc.agent_restart_backoff_s * 2 ** (failures - 1)
            logger.warning("restarting the agents in %.1f s (failure %d of at most %d within %g s)", delay,
                           failures, sc.max_agent_restarts, sc.agent_restart_window_s)
            await asyncio.sleep(delay)
            self._agent_failure = None
            t0 = time.perf_counter()
            try:
                await self.agents.start()
            except (AgentError, OSError) as exc:
                reason = self.down_reason = f"restart failed: {exc}"
                logger.error("%s", reason)
                continue
            if self._agent_failure is not None:     # died again while starting
                reason = self.down_reason = self._agent_failure
                continue
            self.num_agent_restarts += 1
            self.down_reason = None
            logger.info("agents restarted in %.1f s; serving again (%d waiting)", time.perf_counter() - t0,
                        len(self.scheduler.waiting))
            return True

    def _write_inputs(self, batch: ScheduledBatch, s: int) -> None:
        """Write the step's inputs into shared memory. Per-row state that rarely changes (block table,
        sampling parameters, request id) is rewritten only when the row's request or table changed since
        the last step; a decode step writes one id, position and slot per row."""
        b = self.agents.buffers
        if self._rows_buffers is not b:           # new buffers (first step, or agents restarted)
            self._rows, self._rows_buffers = [], b
        bm, bs = self.block_manager, self.block_manager.block_size
        n = batch.num_rows
        tables = bm.block_tables
        if s == 1:                                # decode: token i feeds position num_computed_tokens
            ids, pos, slots = [], [], []
            for i, req in enumerate(batch.requests):
                p = req.num_computed_tokens
                table = tables[req.req_id]
                ids.append(req.token_at(p))
                pos.append(p)
                slots.append(table[p // bs] * bs + p % bs)
                self._write_row_state(b, i, req, table)
            b.input_ids[:n, 0] = ids
            b.positions[:n, 0] = pos
            b.slot_mapping[:n, 0] = slots
            b.context_lens[:n] = b.positions[:n, 0] + 1
            b.query_lens[:n] = 1
        else:
            b.input_ids[:n, :s] = 0
            b.positions[:n, :s] = 0
            b.slot_mapping[:n, :s] = -1
            for i, (req, q) in enumerate(zip(batch.requests, batch.num_new_tokens)):
                start = req.num_computed_tokens
                stop = start + q
                table = tables[req.req_id]
                self._write_row_state(b, i, req, table)
                b.input_ids[i, :q] = req.tokens(start, stop)
                positions = np.arange(start, stop, dtype=np.int32)
                b.positions[i, :q] = positions
                b.slot_mapping[i, :q] = b.block_tables[i, positions // bs] * bs + positions % bs
                b.context_lens[i] = stop
                b.query_lens[i] = q
        for i, req in enumerate(batch.requests):
            if not req.sampling.greedy:
                b.random_u[i] = req.random_u()
            if req.sampling.penalized:            # the tokens the penalties count, appended as they come
                state = self._rows[i]
                have, total = state[3], req.num_tokens
                if have < total:
                    b.history[i, have:total] = req.tokens(have, total)
                    b.history_len[i] = state[3] = total

    def _write_row_state(self, b, i: int, req: Request, table: list) -> None:
        rows = self._rows
        if i == len(rows):
            rows.append(None)
        state = rows[i]
        if state is not None and state[0] is req and state[1] is table:
            if state[2] != len(table):            # tables only grow while a request holds them
                b.block_tables[i, state[2]:len(table)] = table[state[2]:]
                state[2] = len(table)
            return
        b.block_tables[i] = 0
        b.block_tables[i, :len(table)] = table
        sp = req.sampling
        b.temperature[i] = sp.temperature
        b.top_k[i] = sp.top_k
        b.top_p[i] = sp.top_p
        b.random_u[i] = 0.0
        b.top_n[i] = sp.top_logprobs
        b.repetition_penalty[i] = sp.repetition_penalty
        b.presence_penalty[i] = sp.presence_penalty
        b.frequency_penalty[i] = sp.frequency_penalty
        b.history_len[i] = 0                      # written per step for rows with a penalty
        b.prompt_len[i] = len(req.prompt_ids)
        b.request_ids[i] = req.number
        rows[i] = [req, table, len(table), 0]

    def _read_outputs(self, batch: ScheduledBatch) -> None:
        b = self.agents.buffers
        n = batch.num_rows
        token_ids = b.out_token_ids[:n].tolist()
        logprobs = b.out_logprobs[:n].tolist()
        wants_top = bool(b.top_n[:n].any())
        now = time.monotonic()
        for row, req in self.scheduler.complete_step(batch):
            token_id, logprob = token_ids[row], logprobs[row]
            req.output_ids.append(token_id)
            req.output_logprobs.append(logprob)
            if req.first_token_time is None:
                req.first_token_time = now
            self.num_generated_tokens += 1
            reason = self._stop_reason(req, token_id)
            special = token_id in req.stop_token_ids or self.tokenizer.is_special(token_id)
            t_detok = time.perf_counter()
            text = "" if reason == "stop" else self._detok[req.req_id].push(token_id)
            if req.stop_strings is not None:
                text = req.stop_strings.push(text)
                if req.stop_strings.stopped:
                    reason = "stop"
            self.profile["detokenize"] += time.perf_counter() - t_detok
            event = TokenEvent(token_id, text, logprob, special)
            if wants_top and req.sampling.top_logprobs:
                k = req.sampling.top_logprobs
                event.top = list(zip(b.out_top_ids[row, :k].tolist(), b.out_top_logprobs[row, :k].tolist()))
            if reason is None:
                req.events.put_nowait(event)
            else:
                self._finish(req, reason, last=event)

    def _stop_reason(self, req: Request, token_id: int) -> Optional[str]:
        if token_id in req.stop_token_ids:
            return "stop"
        if len(req.output_ids) >= req.sampling.max_new_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    # --- observability -----------------------------------------------------------------------------

    def step_profile(self) -> dict:
        """Mean milliseconds per step of each phase: schedule, shm_write (master writes the inputs),
        model (the agent's ModelRunner.execute), agent_other (the agent's queueing, shm reads and output
        writes around the model), round_trip (frames to and from the agent, and the master's event loop
        getting to the reply), output (read ids, advance requests, events; includes
        detokenize), stream (HTTP handlers writing SSE, which mostly runs while the agent computes), loop
        (wall time of the whole step loop iteration)."""
        steps = max(self.num_steps, 1)
        return {k: round(v * 1e3 / steps, 4) for k, v in sorted(self.profile.items())}

    def stats(self) -> dict:
        sched = self.scheduler
        return {
            "num_steps": self.num_steps,
            "num_running": len(sched.running),
            "num_waiting": len(sched.waiting),
            "num_free_blocks": self.block_manager.num_free_blocks,
            "num_blocks": self.block_manager.num_blocks,
            "num_preemptions": sched.num_preemptions,
            "num_agent_restarts": self.num_agent_restarts,
            "unavailable_reason": self.unavailable_reason(),
            "policy": sched.policy,
            "chunked_prefill": sched.chunked_prefill,
            "prefix_caching": self.block_manager.enable_prefix_caching,
            "prefix_cache_hit_rate": sched.prefix_cache_hit_rate if self.block_manager.enable_prefix_caching else None,
            "num_cached_prompt_tokens": sched.num_cached_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "step_time_s": dict(self.step_time_s),
            "step_profile_ms": self.step_profile(),
            "step_profile_total_s": {k: round(v, 6) for k, v in sorted(self.profile.items())},
            "batch_sizes": _by_kind(sched.batch_sizes),
            "step_time_s_by_batch": _by_kind(self.step_time_by_batch),
        }


def make_scheduler(config, block_manager: BlockManager) -> Scheduler:
    """The scheduler a config describes (its budgets come from serving_config and the graph buckets)."""
    sc, mc, sched = config.serving_config, config.model_config, config.scheduler_config
    return Scheduler(block_manager=block_manager, max_num_seqs=sc.max_num_seqs,
                     max_num_batched_tokens=sc.max_num_batched_tokens,
                     max_prefill_rows=mc.prefill_batch_size[-1], max_decode_rows=mc.decode_batch_size[-1],
                     max_waiting_requests=sc.max_waiting_requests, max_waiting_tokens=sched.max_waiting_tokens,
                     policy=sched.policy, chunked_prefill=sched.chunked_prefill,
                     max_chunk_tokens=config.max_chunk_tokens, max_decode_wait_steps=sched.max_decode_wait_steps,
                     watermark_blocks=int(sched.kv_watermark * config.pa_config.num_blocks),
                     prefill_wait_s=sched.prefill_wait_ms / 1e3)


def _by_kind(counter: Counter) -> dict:
    """{(kind, rows): v} -> {"prefill": {"rows": v}, "decode": {...}} (JSON keys are strings)."""
    return {kind: {str(rows): v for (k, rows), v in sorted(counter.items()) if k == kind}
            for kind in ("prefill", "decode")}
