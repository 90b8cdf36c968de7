"""The master's step loop: schedule, write the step into shared memory, run it on the agents, read the
sampled tokens back, detokenize and stream them. Runs as one task on the HTTP server's event loop and
never blocks it (the agent round-trip is awaited on a socket).

The engine owns the requests and the step loop; its helpers own the rest: the Scheduler (which rows run
next, master/scheduler.py), speculative planning (master/speculative/), StepIO (the step buffers,
master/step_io.py), the AgentGroup (the agent processes, master/agent_group.py), the OutputProcessor (a
step's outcome: tokens appended, token-level stops, KV counted, finished requests freed,
master/output_processor.py), the RequestStreams (each request's events: detokenizing, stop strings, the final
event, master/request_streams.py), the Supervisor (restarts after an agent is lost, master/supervisor.py) and the
LoraLoader (adapters loaded on the agents, master/lora_loader.py). A step an agent answers with a failure ends exactly the
requests in it; a reply saying an agent's KV cache was reset behind the master's back (agent-ctl reset)
discards the step and computes every running request again from its tokens, with the prefix cache forgotten."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from typing import Optional

from llm_serving.agents import protocol as proto
from llm_serving.tokenization import load_chat_template
from llm_serving.master.agent_group import AgentError, AgentGroup
from llm_serving.master.batch import ScheduledBatch
from llm_serving.master.block_manager import BlockManager
from llm_serving.master.grammar import GrammarError, GrammarSpec, Grammars
from llm_serving.master.images import ImageTable
from llm_serving.master.logits import LogitsState
from llm_serving.master.lora_loader import LoraLoader
from llm_serving.master.lora_registry import (LoraConflictError, LoraRefusedError,  # noqa: F401 (server/app.py's)
                                             LoraRegistry)
from llm_serving.master.output_processor import OutputProcessor
from llm_serving.master.request import Request, SamplingParams, TokenEvent
from llm_serving.master.request_streams import RequestStreams
from llm_serving.master.scheduler import Scheduler, SchedulerSpec
from llm_serving.master.speculative.setup import build_speculation, unsupported
from llm_serving.master.speculative.stats import SpecStats
from llm_serving.master.step_io import StepIO
from llm_serving.master.supervisor import Supervisor
from llm_serving.models.pooling import EmbeddingSpec, embedding_spec, score_method
from llm_serving.vision import image_facts

logger = logging.getLogger(__name__)


class EngineStoppedError(RuntimeError):
    """The engine is not running (starting, stopped, or its agents are down)."""


class UnsupportedRequestError(ValueError):
    """The request asks for what these agents cannot do (prompt log-probabilities without the CPU kernel's packed
    prefill); answered with 400 naming the field."""

    def __init__(self, message: str, param=None):
        super().__init__(message)
        self.param = param


class DuplicateRequestError(ValueError):
    """A client-chosen request id is already in use; the HTTP layer answers 409."""


class Engine:
    def __init__(self, config, tokenizer, model_dir: str, model_name: str):
        self.config = config
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.model_path = model_dir
        lc = config.lora_config
        self.lora = LoraRegistry(lc.adapters, lc.slot_of(), lc.max_loras)   # the LoRA adapters served
        self.max_model_len = config.max_model_len
        self.default_max_tokens = config.serving_config.default_max_tokens   # a reply's length when none is asked
        pa = config.pa_config
        self.block_manager = BlockManager(pa.num_blocks, pa.block_size,
                                          enable_prefix_caching=config.scheduler_config.enable_prefix_caching,
                                          window=pa.window_tokens or 0, window_blocks=config.window_blocks)
        self.scheduler = Scheduler(SchedulerSpec.from_config(config), self.block_manager)
        self.spec_stats = SpecStats(config.spec_config.num_speculative_tokens)
        self.outputs = OutputProcessor(self.scheduler, self.spec_stats)
        mc = config.model_config
        self.stop_token_ids = frozenset(mc.end_token_ids or tokenizer.eos_ids)
        self.agents = AgentGroup(config, model_dir, on_lost=self._on_agent_lost, lora_snapshot=self.lora.snapshot)
        self.supervisor = Supervisor(config.serving_config, self.agents)
        self.lora_loader = LoraLoader(lc, model_dir, model_name, self.lora, self.agents, self.scheduler,
                                      lambda req, error: self._finish(req, "error", error=error))
        self.step_io = StepIO(self.block_manager)
        # one proposer behind the planner, n-gram lookup or a draft model (its agent: drafter); None with it off
        self.drafter, self.speculation = build_speculation(config, model_dir, self.block_manager, self.scheduler,
                                                           self._forget_draft)
        vocab = config.model_config.vocab_size         # (decided at start: startup/kv_memory.py)
        # token ids a request may name: the tokenizer's that the model has too
        self.vocab_size = min(tokenizer.vocab_size, vocab) if vocab else tokenizer.vocab_size
        self.grammars = (Grammars(tokenizer, vocab, eos_ids=sorted(self.stop_token_ids)) if vocab
                         else None)             # structured outputs (grammar.py)
        self.chat_template = load_chat_template(config.tokenizer.chat_template, model_dir, tokenizer)
        # embeddings (models/pooling.py): the pooling and widths, None without the hidden size (decided at start)
        hidden = mc.hidden_size
        self.embedding: Optional[EmbeddingSpec] = (embedding_spec(mc.pooling, model_dir, hidden) if hidden
                                                   else None)
        # an embedding model (model_config.task embed, decided at start: a bidirectional encoder) does not generate,
        # so it scores by similarity (a yes/no judgement is generated)
        self.generates = mc.task != "embed"
        self.score_method = score_method(mc.score_method, model_dir, model_name) if self.generates else "similarity"
        # what its images are (vision/model.py; None: it takes none)
        self.image_facts = self._image_facts(model_dir, mc.mmproj, mc.pan_and_scan)
        self.image_table = ImageTable()
        self.requests: dict = {}
        self._wakeup = asyncio.Event()
        self._loop_task: Optional[asyncio.Task] = None
        self.running = False
        self.start_time = time.time()
        self.num_steps = 0
        self.num_encode_ahead_steps = 0      # steps that ran some of an image's tower ahead (scheduler.py)
        self.step_time_s: Counter = Counter()     # kind -> total seconds spent in agent steps
        self.step_time_by_batch: Counter = Counter()  # (kind, rows) -> total seconds, for benchmarks
        self.num_prompt_tokens = 0                # of every admitted request
        # seconds per phase of the step loop, summed over steps (see step_profile in stats())
        self.profile: Counter = Counter()
        # each request's events: tokens detokenized, stop strings, the final event (request_streams.py)
        self.streams = RequestStreams(tokenizer, self.scheduler, self.outputs, self.profile, self._forget)
        self.num_finished = self.streams.num_finished            # finish_reason -> requests
        self.finish_listeners = self.streams.finish_listeners    # callables(request), as each request ends (metrics)
        self.num_cache_resets = 0                   # agents' KV caches reset behind the master's back
        self.failed_reason: Optional[str] = None    # the engine serves nothing more (agents given up, a bug)
        self.draining_reason: Optional[str] = None  # shutting down: no new requests

    # --- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        t0 = time.perf_counter()
        groups = [self.agents] + ([self.drafter] if self.drafter is not None else [])
        started = await asyncio.gather(*(g.start() for g in groups), return_exceptions=True)
        failed = [r for r in started if isinstance(r, BaseException)]
        if not failed and (why := unsupported(self.config, self.drafter, self.agents.agents[0].info)) is not None:
            failed = [why]
        if failed:
            for g in groups:
                await g.stop()
            raise failed[0]
        info, spec = self.agents.agents[0].info, self.scheduler.spec
        decode_steps = spec.decode_steps
        if decode_steps != info.decode_steps or info.decode_run_rows < 1:
            logger.info("decode runs off: the agents run %d step(s) per decode call (they need the CPU layer "
                        "kernel)", info.decode_steps)
            decode_steps = 1
        self.scheduler.spec = dataclasses.replace(spec, decode_steps=decode_steps, decode_steps_max_rows=min(
            spec.decode_steps_max_rows, info.decode_run_rows))
        if self.image_facts is not None and info.image_tokens != self.image_facts.tokens_per_image:
            logger.warning("images off: the agents encode %s (the model's images are %d tokens each); image "
                           "requests are refused", f"{info.image_tokens} tokens an image" if info.image_tokens
                           else "no images", self.image_facts.tokens_per_image)
            self.image_facts = None
        elif self.image_facts is not None:      # (an image's tokens by its size: at most one graph call's)
            self.image_facts = self.image_facts.within(info.max_image_tokens)
        self.running = True
        self._loop_task = asyncio.create_task(self._step_loop(), name="engine-step-loop")
        self._loop_task.add_done_callback(self._step_loop_ended)
        logger.info("engine ready in %.1f s: %d agent(s), %d KV blocks of %d tokens, max %d tokens per request; "
                    "batch-invariant steps: %s; chat template: %s", time.perf_counter() - t0, len(self.agents.agents),
                    self.block_manager.num_blocks, self.block_manager.block_size, self.max_model_len,
                    "on" if self.batch_invariant else "off", self.chat_template.source)

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
        if self.drafter is not None:
            await self.drafter.stop()
        self.image_table.step_done()                 # (no step runs now: every spent image's pixels go)

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
        if self.supervisor.down_reason:
            return f"agents restarting after a failure: {self.supervisor.down_reason}"
        dead = self.agents.dead_agents()
        return "; ".join(dead) if dead else None

    @property
    def num_generated_tokens(self) -> int:
        """Tokens appended to requests' outputs (the OutputProcessor counts them)."""
        return self.outputs.num_generated_tokens

    @property
    def num_agent_restarts(self) -> int:
        return self.supervisor.num_restarts

    def agent_info(self) -> list:
        """rank, pid and port of every agent (for /health)."""
        return self.agents.describe()

    def draft_agent_info(self) -> list:
        """The draft model's agent (spec_config.method draft), as agent_info; [] without one."""
        return self.drafter.describe() if self.drafter is not None else []

    @property
    def batch_invariant(self) -> bool:
        """Whether the agents' steps are batch-invariant (model_config.batch_invariant as it resolved there)."""
        agents = self.agents.agents
        return bool(agents) and all(a.info is not None and a.info.batch_invariant for a in agents)

    @property
    def tensor_parallel(self) -> dict:
        """The agent group's size and all-reduce ('shm' or 'mindspore'; None for one agent)."""
        return {"size": len(self.config.serving_config.agent_ports), "all_reduce": self.agents.all_reduce}

    # --- requests ----------------------------------------------------------------------------------

    def submit(self, prompt_ids: list, sampling: SamplingParams, req_id: Optional[str] = None,
               adapter: Optional[str] = None, grammar=None, images: Optional[list] = None) -> Request:
        """Queue a validated request (see server/translate.py), on the base model or LoRA adapter `adapter` (a
        name in self.lora_paths); `grammar`: its grammar's matcher as `compile_grammar` gave it (copied: one per
        request). Raises QueueFullError past the queue bounds, DuplicateRequestError when req_id names a request
        still in flight, KeyError for an adapter not served here, UnsupportedRequestError for what the agents
        cannot do, or when the model does not generate (`check_generates`). `images`: master/images.py's
        PromptImageInput's of the prompt's images (their placeholders already in prompt_ids)."""
        self._check_open(req_id)
        self.check_generates()
        if images and self.image_facts is None:
            raise UnsupportedRequestError(f"model {self.model_name!r} does not take images", "messages")
        if sampling.prompt_logprobs is not None and self.agents.agents and self.agents.agents[0].info is not None \
                and not self.agents.agents[0].info.scores_prompts:
            raise UnsupportedRequestError("prompt log-probabilities (echo with logprobs, prompt_logprobs, "
                                          "decoder_input_details) need the CPU kernel's packed prefill; these agents "
                                          "pad prefill steps (attention_kernel off, or Ascend)", "prompt_logprobs")
        logits = LogitsState.of_request(sampling, self.grammars, self.stop_token_ids, grammar)
        slot, root = self.lora.place(adapter) if adapter is not None else (0, 0)   # slot -1: loaded before admitted
        req = Request(prompt_ids, sampling, self.stop_token_ids, req_id=req_id, lora_slot=slot, lora_root=root,
                      lora_adapter=adapter)
        req.logits = logits
        if images:
            self.image_table.attach(req, images)
        self.scheduler.add(req)
        if adapter is not None:
            self.lora.hold(adapter)
        self.num_prompt_tokens += len(req.prompt_ids)
        self.requests[req.req_id] = req
        self.streams.open(req)
        self._wakeup.set()
        return req

    def submit_embedding(self, prompt_ids: list, req_id: Optional[str] = None) -> Request:
        """Queue an embedding of prompt_ids: fed in embed steps on the same step loop as generation (the scheduler
        keeps a step's rows all embeddings or none), its final hidden states pooled as `self.embedding` says;
        its final event ends it ("stop": `req.embedding` holds the normalized vector). Raises as `submit` does,
        and UnsupportedRequestError when these agents cannot pool."""
        self._check_open(req_id)
        if self.embedding is None:
            raise UnsupportedRequestError("embeddings need the model's hidden size, which this server was started "
                                          "without (model_config.hidden_size)", "input")
        info = self.agents.agents[0].info if self.agents.agents else None
        if info is not None and not info.scores_prompts:
            raise UnsupportedRequestError("embeddings need the CPU kernel's packed prefill; these agents pad prefill "
                                          "steps (attention_kernel off, or Ascend)", "input")
        if not prompt_ids:
            raise UnsupportedRequestError("an embedding's input has no tokens", "input")
        req = Request(prompt_ids, SamplingParams(max_new_tokens=1), frozenset(), req_id=req_id,
                      pooling=self.embedding.pooling)
        self.scheduler.add(req)
        self.num_prompt_tokens += len(req.prompt_ids)
        self.requests[req.req_id] = req
        self._wakeup.set()
        return req

    def _image_facts(self, model_dir: str, mmproj: Optional[str], pan_and_scan: str = "auto"):
        """What the served model's images are (vision/model.py's ImageFacts, with Gemma 3's pan-and-scan as the
        setting says), or None: a text model, or a vision model whose files disagree (said in the log)."""
        if not self.generates:
            return None
        try:
            facts = image_facts(model_dir, mmproj, self.tokenizer)
        except ValueError as e:
            logger.warning("images off: %s", e)
            return None
        if facts is None:
            return None
        if pan_and_scan == "on" and facts.family != "gemma3":
            logger.warning("model_config.pan_and_scan on: pan-and-scan is Gemma 3's; this model's images are taken "
                           "as its own processor takes them")
        facts = facts.with_pan_and_scan(pan_and_scan)
        if facts.spec.pan_and_scan:
            logger.info("images: pan-and-scan on (crops of at least %d pixels, at most %d, from an aspect of %g)",
                        *facts.spec.scan)
        return facts

    def check_generates(self) -> None:
        """UnsupportedRequestError (400, naming the model) when the served model is an embedding model."""
        if not self.generates:
            raise UnsupportedRequestError(f"model {self.model_name!r} is an embedding model; it does not generate "
                                          "(it serves /v1/embeddings, /api/embed, rerank and score)", "model")

    def _check_open(self, req_id: Optional[str]) -> None:
        if self.failed_reason or self.draining_reason or not self.running:
            raise EngineStoppedError(self.failed_reason or self.draining_reason or "engine is not running")
        if req_id is not None and req_id in self.requests:
            raise DuplicateRequestError(f"request id {req_id!r} is already in use by a request in flight")

    async def compile_grammar(self, spec: GrammarSpec):
        """A request's grammar compiled before it is submitted (in a worker thread): the matcher to pass to
        `submit`; GrammarError when it does not compile or this server cannot constrain output."""
        if self.grammars is None:
            raise GrammarError("structured outputs need the model's vocabulary size, which this server was started "
                               "without (model_config.vocab_size)", spec.field)
        return await self.grammars.compile(spec)

    def served_models(self) -> list:
        """The names requests may give: the model's, then its LoRA adapters'."""
        return [self.model_name, *self.lora_paths]

    @property
    def lora_paths(self) -> dict:
        """Every LoRA adapter served: name -> its directory."""
        return self.lora.paths

    async def load_lora(self, name: str, path: str) -> dict:
        """Serve the PEFT adapter at `path` as model `name` from now on (LoraLoader.load)."""
        return await self.lora_loader.load(name, path)

    async def unload_lora(self, name: str) -> None:
        """Stop serving adapter `name` (LoraLoader.unload)."""
        await self.lora_loader.unload(name)

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
        """End req now: free its blocks and close its stream."""
        self.scheduler.finish(req, reason)
        self.streams.close(req, reason, error, last)

    def _forget(self, req: Request) -> None:
        """A request's stream is closing: it is no longer in flight, and its LoRA adapter is free again."""
        if self.requests.pop(req.req_id, None) is req and req.lora_adapter is not None:
            self.lora.release(req.lora_adapter)
        if req.images:
            self.image_table.release(req)

    # --- the step loop -----------------------------------------------------------------------------

    async def _step_loop(self) -> None:
        prof = self.profile
        while self.running:
            if self.supervisor.failure is not None:
                if not await self.supervisor.recover(self._lose_running, self._fail_all):
                    self.failed_reason = self.supervisor.failed_reason
                    return
                continue
            if self.lora.wants_loads:
                await self.lora_loader.make_resident()
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
            if batch.may_speculate:
                batch = await self._speculate(batch)
                if not batch.requests:
                    continue
            # No yield between steps: the HTTP handlers stream step N's tokens while the agents compute
            # step N+1 (they run whenever the loop awaits the agents' reply).
            await self._run_step(batch)
            prof["loop"] += time.perf_counter() - t0

    async def _run_step(self, batch: ScheduledBatch) -> None:
        n = batch.num_rows
        prof = self.profile
        t_write = time.perf_counter()
        self.step_io.write_inputs(self.agents.buffers, batch)
        t0 = time.perf_counter()
        prof["shm_write"] += t0 - t_write
        images = self.image_table.step_images(batch) if batch.kind is proto.StepKind.PREFILL else None
        ahead = self.scheduler.image_to_encode(batch) if self.image_facts is not None else None
        encode = None if ahead is None else proto.EncodeSlice(
            ahead[1].key, ahead[1].pixels.name, list(ahead[1].pixels.shape),
            self.config.scheduler_config.image_encode_ms).payload()
        command = proto.Step(batch.kind, self.num_steps, n, batch.max_query_len, batch.steps, images, encode)
        self.image_table.in_flight = True
        try:
            replies, cache_reset = await self.agents.step(command, after_send=self._write_controls)
            if ahead is not None:
                self._encoded_ahead(*ahead, replies[0])
            model_s, agent_s = replies[0].model_ms / 1e3, replies[0].agent_ms / 1e3
            prof["model"] += model_s
            prof["agent_other"] += agent_s - model_s
            prof["round_trip"] += time.perf_counter() - t0 - agent_s
        except AgentError as exc:
            logger.error("step %d failed: %s", self.num_steps, exc)
            if exc.fatal:                         # the agent is lost: the supervisor fails every running request
                self.supervisor.agent_lost(str(exc))
            else:                                 # the agent answered "failed": only this step's requests end
                for req in batch.requests:
                    if not req.finished:
                        self._finish(req, "error", error=str(exc))
            return
        finally:
            self.image_table.step_done()
            self.num_steps += 1
            kind, elapsed = batch.kind.stats_name, time.perf_counter() - t0
            self.step_time_s[kind] += elapsed
            self.step_time_by_batch[(kind, n)] += elapsed
        if cache_reset:
            self._cache_was_reset(command.step)
            return
        t_read = time.perf_counter()
        for result in self.outputs.update_from_output(batch, self.step_io.read_outputs(self.agents.buffers, batch)):
            self.streams.stream(result)
        prof["output"] += time.perf_counter() - t_read

    def _encoded_ahead(self, req: Request, image, reply) -> None:
        """What the agent did with the image it encoded ahead with the step (scheduler.py's `image_to_encode`)."""
        self.num_encode_ahead_steps += 1
        if reply.encode_error is not None:
            if not req.finished:
                self._finish(req, "error", error=f"its image could not be encoded: {reply.encode_error}")
        elif reply.encoded:
            self.scheduler.mark_encoded(image.key)

    def _write_controls(self) -> None:
        """The step's logit controls (grammar masks, bias entries), written while the agents run the model."""
        t0 = time.perf_counter()
        self.step_io.write_controls()
        self.profile["controls"] += time.perf_counter() - t0

    async def _speculate(self, batch: ScheduledBatch) -> ScheduledBatch:
        """The speculative planner plans the step, its proposer proposes (a draft model runs its round), and the
        proposals are attached (speculative/planner.py); requests that ended meanwhile leave the step."""
        t0 = time.perf_counter()
        batch = await self.speculation.speculate(batch)
        elapsed = time.perf_counter() - t0
        # a proposer's round is an agent step when it runs one (a draft model); planning alone is scheduling
        kind = self.speculation.proposer.agent_step_kind if batch.spec_limits else None
        self.profile[kind or "schedule"] += elapsed
        if kind is not None:
            self.step_time_s[kind] += elapsed
        return batch

    def _forget_draft(self) -> None:
        """The draft model's KV cache is gone (restarted, reset): every request catches up from scratch."""
        for req in self.scheduler.running:
            req.num_draft_computed = 0

    # --- when the KV cache is gone -----------------------------------------------------------------

    def _on_agent_lost(self, reason: str) -> None:
        """An agent's connection dropped while serving (called from its reader task)."""
        self.supervisor.agent_lost(reason)
        self._wakeup.set()

    def _lose_running(self, reason: str) -> int:
        """The agents are lost with their KV cache: end the running requests, forget the prefix cache."""
        running = list(self.scheduler.running)
        for req in running:
            self._finish(req, "error", error=reason)
        dropped = self.block_manager.forget_cached()
        logger.error("%d running request(s) failed, %d waiting kept, %d cached block(s) dropped", len(running),
                     len(self.scheduler.waiting), dropped)
        return len(running)

    def _fail_all(self, reason: str) -> None:
        for req in list(self.requests.values()):
            self._finish(req, "error", error=reason)

    def _cache_was_reset(self, step: int) -> None:
        """An agent's KV cache was zeroed behind the master's back (agent-ctl reset) before or during this
        step: its outputs may come from zeros. Discard them; every running request computes its KV again
        from its tokens (as after a preemption) and the prefix cache forgets every block."""
        self.num_cache_resets += 1
        recomputed = self.scheduler.recompute_all()
        dropped = self.block_manager.forget_cached()
        logger.warning("an agent's KV cache was reset: step %d discarded, %d running request(s) computed again, "
                       "%d cached block(s) forgotten", step, recomputed, dropped)

    # --- observability -----------------------------------------------------------------------------

    def step_profile(self) -> dict:
        """Mean milliseconds per step of each phase: schedule, shm_write (master writes the inputs),
        model (the agent's ModelRunner.execute), agent_other (the agent's queueing, shm reads and output
        writes around the model), round_trip (frames to and from the agent, and the master's event loop
        getting to the reply), controls (the step's grammar masks and bias entries, written while the agents
        run the model), output (read ids, advance requests, events; includes
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
            "num_cached_blocks": self.block_manager.num_cached_blocks,
            "window_pool": None if self.block_manager.window_pool is None else {
                "window": self.block_manager.window, "num_blocks": self.block_manager.window_pool.num_blocks,
                "num_free_blocks": self.block_manager.num_free_window_blocks},
            "num_preemptions": sched.num_preemptions,
            "num_agent_restarts": self.num_agent_restarts,
            "num_cache_resets": self.num_cache_resets,
            "unavailable_reason": self.unavailable_reason(),
            "policy": sched.spec.policy,
            "chunked_prefill": sched.spec.chunked_prefill,
            "prefix_caching": self.block_manager.enable_prefix_caching,
            "prefix_cache_hit_rate": sched.prefix_cache_hit_rate if self.block_manager.enable_prefix_caching else None,
            "num_cached_prompt_tokens": sched.num_cached_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "decode_runs": {"steps": sched.spec.decode_steps, "max_rows": sched.spec.decode_steps_max_rows,
                            "runs": sched.num_decode_runs},
            "image_encode_ahead_steps": self.num_encode_ahead_steps,
            "step_time_s": dict(self.step_time_s),
            "step_profile_ms": self.step_profile(),
            "step_profile_total_s": {k: round(v, 6) for k, v in sorted(self.profile.items())},
            "speculative": {"method": self.config.spec_config.method, **self.spec_stats.as_dict(),
                            **({"draft": self.drafter.stats()} if self.drafter is not None else {})},
            "batch_sizes": _by_kind(self.outputs.batch_sizes),
            "step_time_s_by_batch": _by_kind(self.step_time_by_batch),
        }


def _by_kind(counter: Counter) -> dict:
    """{(kind, rows): v} -> {"prefill": {"rows": v}, "decode": {...}, "verify": {...}} (JSON keys are strings)."""
    return {kind: {str(rows): v for (k, rows), v in sorted(counter.items()) if k == kind}
            for kind in ("prefill", "decode", "verify")}
