"""One agent's model work: read a step's inputs from shared memory, run the model, write the outputs.

Logits capture (the `c` command, rank 0 only): while on, every step also writes
<dir>/step_<NNNNNNNN>.npz (written to a temporary name, then renamed, so a reader never sees half a file)
holding, for rows 0..n-1: request_ids (n,) int64, input_ids / positions (n, s) int32, query_lens,
context_lens, prompt_lens (n,) int32, token_ids (n,) int32, and logits (n, vocab) float32 at each row's last
new token; a prefill step with images also image_places (m, 5) int32 (each image's row, offset in the row's new
tokens, first of its tokens there, count, length: protocol.StepImage's), image_keys (m,) and, the first time a key
is captured, image_pixels_<j> (its float32 pixels). `llm-serving precision` replays these through a float64
reference. Verify steps (speculative decoding) are not captured: precision's requests do not speculate. A decode
run is captured step by step (the agent runs its steps one at a time while capturing).
"""
from __future__ import annotations

import logging
import os
import time

import numpy as np

from llm_serving.shm.buffers import StepBuffers
from llm_serving.shm.images import read_pixels
from llm_serving.shm.layout import StepKind, StepLayout, StepView

logger = logging.getLogger(__name__)


class Worker:
    """Owns the ModelRunner (MindSpore graphs + paged KV cache) and the attached step buffers."""

    def __init__(self, config, model_dir: str, rank: int, device_id: int, tp_comm: str | None = None):
        from llm_serving.models.parallel import StepInputBroadcast, TensorParallel, all_reduce_backend, pin_cpu_cores
        from llm_serving.models.lora import load_lora_adapter
        from llm_serving.models.runner import ModelRunner  # MindSpore is imported only in agents
        from llm_serving.models.runner_spec import RunnerSpec

        mc, sc = config.model_config, config.serving_config
        self.rank = rank
        self.config = config
        self.tp = TensorParallel(rank, len(sc.agent_ports), tp_comm,
                                 all_reduce_backend(mc.device_target, mc.all_reduce, bool(sc.remote_ranks)),
                                 across_nodes=bool(sc.remote_ranks))
        num_threads = mc.num_threads
        if self.tp.world > 1 and mc.device_target == "CPU":
            cores = pin_cpu_cores(*sc.local_rank(rank))     # the CPU's 'devices': a share of its node's cores each
            if num_threads is None:
                num_threads = cores or 1
        self.layout = StepLayout.from_config(config)
        self.buffers = None
        self.num_steps = 0
        self.cache_epoch = 0       # KV-cache resets so far; every step reply carries it (see protocol.py)
        self.capture_dir: str | None = None
        self.captured_images: set = set()     # the keys of the images whose pixels this capture has written
        self.capture_left = 0
        self.captured = 0
        # one runner per agent process, warmed up in a fixed order: it keeps the compile cache
        spec = RunnerSpec.from_config(config, device_id=device_id, num_threads=num_threads, compile_cache=True)
        self.runner = ModelRunner(model_dir, spec, tp=self.tp)
        self._load_lora_adapter = load_lora_adapter
        for name, slot in config.lora_config.slot_of().items():
            self.load_lora(slot, name, config.lora_config.adapters[name])
        self._start_timeout_s = sc.agent_start_timeout_s
        # a group across nodes: rank 0 alone reads the master's shared memory and broadcasts each step's inputs;
        # the other ranks keep them in buffers of their own
        self.broadcast = (StepInputBroadcast(self.tp, self.layout.max_step_inputs_size)
                          if self.tp.across_nodes else None)
        if self.broadcast is not None and rank != 0:
            self.buffers = StepBuffers.private(self.layout)

    def warmup(self) -> None:
        if self.broadcast is not None:     # before the first all-reduce: the ranks' graphs must be the same
            self.broadcast.check_same(self.group_sections())
        # logs one line per compiled bucket; tensor-parallel peers may still be loading: wait as long as start-up
        self.runner.warmup(peer_timeout_s=self._start_timeout_s,
                           staged=self.config.serving_config.warmup == "staged" and self.tp.world == 1)
        if self.broadcast is not None:
            times = self.broadcast.warmup()
            logger.info("step-input broadcast from rank 0 (words: ms): %s",
                        ", ".join(f"{w}: {t * 1e3:.2f}" for w, t in times.items()))

    # serving_config keys that shape every rank's graphs and steps (the rest are the master's or each node's own)
    GROUP_SERVING_KEYS = ("agent_ports", "agent_hosts", "max_num_seqs", "max_num_batched_tokens")

    def group_sections(self) -> dict:
        """What must be the same on every rank of a group, by section: the configuration but for what is the
        master's or each node's own (addresses, paths, the API key, budgets, the LoRA registry), the model's
        shape as loaded, and the graphs built."""
        raw = self.config.to_dict()
        raw["serving_config"] = {k: raw["serving_config"][k] for k in self.GROUP_SERVING_KEYS}
        raw["model_config"]["model_path"] = None
        raw.pop("tokenizer", None)
        raw["spec_config"].pop("draft_model", None)        # the master's draft agent's, not the group's
        # which adapter is in which slot is the master's (it loads them into every rank after each start)
        raw["lora_config"] = {k: v for k, v in raw["lora_config"].items() if k not in ("adapters", "slots")}
        raw["model"] = repr(self.runner.config)
        r = self.runner       # the graphs this rank built (a kernel that did not build here changes them)
        raw["graphs"] = repr((r.graph_buckets(), r.buckets.packed, r.decode_kernel is not None,
                              r.layer_kernel is not None, r.decode_run_steps, r.decode_run_max_rows(), r.lora_slots,
                              r.lora_rank))
        return raw

    def attach(self, names: dict) -> None:
        if self.broadcast is not None and self.rank != 0:
            raise ValueError(f"rank {self.rank} of a group across nodes takes its step inputs from rank 0's "
                             "broadcast, not from shared memory")
        self.detach()
        self.buffers = StepBuffers.attach(self.layout, names)

    def detach(self) -> None:
        if self.buffers is not None and self.buffers.shared:
            self.buffers.close()
            self.buffers = None

    def _share_inputs(self, kind: StepKind, n: int, s: int, steps: int) -> None:
        """Rank 0 broadcasts the step's inputs from shared memory; the other ranks write them into their own
        buffers, so that the step below reads the same values on every rank."""
        size = self.layout.step_inputs_size(kind, n, s, steps)
        if self.rank == 0:
            self.broadcast(self.buffers.pack_inputs(kind, n, s, steps), size)
        else:
            self.buffers.unpack_inputs(self.broadcast(None, size), kind, n, s, steps)

    def step(self, kind: StepKind, n: int, s: int = 1, steps: int = 1, images: tuple = ()) -> float:
        """Run a step of `kind` over rows 0..n-1 with s new tokens per row (s = 1 for decode); returns the
        seconds spent in the model (ModelRunner.execute: padding, graphs, copying ids back). A verify step
        samples after every new token (out_verify_ids, out_verify_logprobs); a decode run (`steps` steps) puts
        each step's greedy token there. `images`: a prefill step's (protocol.StepImage's)."""
        kind = StepKind(kind)
        b = self.buffers
        if b is None:
            raise RuntimeError("no shared memory attached: connect with shm names first")
        if not (1 <= n <= self.layout.max_rows and 1 <= s <= self.layout.max_tokens):
            raise ValueError(f"step shape n={n}, s={s} outside 1..{self.layout.max_rows} x "
                             f"1..{self.layout.max_tokens}")
        if kind is StepKind.VERIFY and s > self.layout.max_verify:
            raise ValueError(f"verify step with {s} tokens per row; the buffers hold {self.layout.max_verify}")
        run = kind is StepKind.DECODE_RUN
        if run != (steps > 1) or (run and (s != 1 or steps != self.runner.decode_run_steps)):
            raise ValueError(f"a decode run has {self.runner.decode_run_steps} steps of one token per row "
                             f"on this agent, got a {kind.value} step with steps={steps}, s={s}")
        shared_s = 0.0
        if self.broadcast is not None:      # (after the checks above, which every rank makes alike from the frame)
            t0 = time.perf_counter()
            self._share_inputs(kind, n, s, steps)
            shared_s = time.perf_counter() - t0
        view = b.view(kind, n, s, steps)
        view.images = images
        return shared_s + self._HANDLERS[kind](self, view)

    def encode_ahead(self, ahead) -> tuple:
        """Run some of an image's tower layers ahead of its prefill step (protocol.EncodeSlice): (done, error,
        seconds). A failure is the image's alone: it is reported (error), and the step it came with runs on."""
        t0 = time.perf_counter()
        encoder = self.runner.images
        try:
            if encoder is None:
                raise ValueError("this model takes no images")
            done = encoder.advance(ahead.key, ahead.segment, tuple(ahead.shape), ahead.budget_ms / 1e3)
        except Exception as exc:            # (the pixels' segment gone, a malformed shape: the image's own fault)
            logger.warning("image %s: encoding ahead failed: %s", ahead.key[:12], exc)
            return False, f"{type(exc).__name__}: {exc}", time.perf_counter() - t0
        return done, None, time.perf_counter() - t0

    def _step(self, view: StepView) -> float:
        """A prefill or decode step."""
        capture = self.capture_dir is not None and self.rank == 0
        view.return_logits = capture
        n, s = view.num_rows, view.input_ids.shape[1]
        t0 = time.perf_counter()
        token_ids, logprobs, *more = self.runner.execute(view)
        model_s = time.perf_counter() - t0
        logits = more.pop(0) if capture else None
        if self.tp.writes_outputs:
            view.out_token_ids[:] = np.asarray(token_ids, dtype=np.int32)
            view.out_logprobs[:] = np.asarray(logprobs, dtype=np.float32)
            if more:                  # some row asked for top log-probabilities
                top_ids, top_lps = more
                k = top_ids.shape[1]
                view.out_top_ids[:, :k] = top_ids
                view.out_top_logprobs[:, :k] = top_lps
        if capture:
            self._write_capture(slice(None, n), s, token_ids, logits, view.images or ())
        self.num_steps += 1
        return model_s

    def _decode_run(self, view: StepView) -> float:
        """A decode run: in one graph, or, while logits are captured, as single steps (one capture file each),
        the agent feeding each step's tokens to the next itself."""
        t0 = time.perf_counter()
        if self.capture_dir is not None and self.rank == 0:
            tokens, logprobs = self._decode_run_stepwise(view)
        else:
            tokens, logprobs = self.runner.execute(view)
            self.num_steps += 1
        model_s = time.perf_counter() - t0
        if self.tp.writes_outputs:
            view.out_verify_ids[...] = tokens
            view.out_verify_logprobs[...] = logprobs
        return model_s

    def _decode_run_stepwise(self, run: StepView) -> tuple:
        """The run as single decode steps of the rows still in it (slot >= 0), as the run's outputs."""
        n, k = run.slot_mapping.shape
        slots = run.slot_mapping.copy()
        window_slots = run.window_slots.copy()      # (the window pool's: written only when there is one)
        step = self.buffers.view(StepKind.DECODE, n, 1, return_logits=True)
        tokens, logprobs = np.full((n, k), -1, np.int32), np.zeros((n, k), np.float32)
        for j in range(k):
            rows = np.flatnonzero(slots[:, j] >= 0)
            if rows.size == 0:
                break
            if j:                       # step j: the previous step's tokens, one position on
                step.input_ids[:, 0] = tokens[:, j - 1]
                step.positions[:, 0] += 1
                step.context_lens[:] += 1
            step.slot_mapping[:, 0] = slots[:, j]
            step.window_slots[:, 0] = window_slots[:, j]
            token_ids, lps, logits = self.runner.execute(step.rows(rows))
            tokens[rows, j], logprobs[rows, j] = token_ids, lps
            if self.capture_dir is not None:
                self._write_capture(rows, 1, token_ids, logits)
            self.num_steps += 1
        return tokens, logprobs

    def _verify_step(self, view: StepView) -> float:
        t0 = time.perf_counter()
        token_ids, logprobs = self.runner.execute(view)
        model_s = time.perf_counter() - t0
        if self.tp.writes_outputs:
            view.out_verify_ids[...] = token_ids
            view.out_verify_logprobs[...] = logprobs
        self.num_steps += 1
        return model_s

    def _embed(self, view: StepView) -> float:
        """An embed step: each row's pooled hidden state into out_pooled (models/runner/embed_steps.py)."""
        if view.out_pooled is None or view.out_pooled.shape[1] != self.runner.config.hidden_size:
            raise ValueError(f"embed step: the step buffers hold pooled states of "
                             f"{0 if view.out_pooled is None else view.out_pooled.shape[1]} values, the model's hidden "
                             f"size is {self.runner.config.hidden_size} (model_config.hidden_size)")
        t0 = time.perf_counter()
        pooled = self.runner.execute(view)
        model_s = time.perf_counter() - t0
        if self.tp.writes_outputs:
            view.out_pooled[...] = pooled
        self.num_steps += 1
        return model_s

    _HANDLERS = {StepKind.PREFILL: _step, StepKind.DECODE: _step, StepKind.VERIFY: _verify_step,
                 StepKind.DECODE_RUN: _decode_run, StepKind.EMBED: _embed}

    def load_lora(self, slot: int, name: str | None, path: str | None) -> dict:
        """LoRA slot `slot` holds the adapter at `path` (read and checked against the model: LoraError, and the
        slot unchanged, if it does not fit), or nothing (path None)."""
        if self.runner.lora_slots == 0:
            raise ValueError("this agent has no LoRA adapter slots (start the server with lora_config.enable_lora)")
        adapter = None
        if path is not None:
            adapter = self._load_lora_adapter(name or path, path, self.runner.config, self.runner.lora_rank)
        self.runner.set_lora(slot, adapter)
        slot_mb = self.runner.lora_slot_bytes / 1e6
        if adapter is not None:
            logger.info("LoRA adapter %r (rank %d, %s) in slot %d: %.1f MB as read, %.1f MB per slot of rank %d",
                        name, adapter.rank, "/".join(adapter.target_modules), slot, adapter.nbytes / 1e6, slot_mb,
                        self.runner.lora_rank)
        else:
            logger.info("LoRA slot %d emptied (%s)", slot, name)
        return {"slot": slot, "name": name, "rank": adapter.rank if adapter else 0, "slot_mb": slot_mb}

    def set_capture(self, directory: str | None, max_steps: int) -> dict:
        """Start (directory) or stop (None) logits capture; returns what was captured so far."""
        if directory is not None:
            if self.rank != 0:
                raise ValueError("logits capture runs on rank 0 only")
            os.makedirs(directory, mode=0o700, exist_ok=True)
            self.captured = 0
            self.captured_images = set()
        self.capture_dir, self.capture_left = directory, (max_steps if directory is not None else 0)
        return {"dir": directory, "steps": self.captured}

    def _write_capture(self, rows, s: int, token_ids, logits, images=()) -> None:
        """One capture file: the step's rows (a slice or index array of shm rows), s tokens each, and a prefill
        step's images (protocol.StepImage's: where their tokens are, and each image's pixels the first time its
        key is captured)."""
        b = self.buffers
        path = os.path.join(self.capture_dir, f"step_{self.num_steps:08d}.npz")
        extra = {}
        if images:
            extra = {"image_places": np.array([[im.row, im.offset, im.first, im.count, im.length] for im in images],
                                              np.int32),
                     "image_keys": np.array([im.key for im in images])}
            for j, im in enumerate(images):
                if im.key not in self.captured_images:
                    extra[f"image_pixels_{j}"] = read_pixels(im.segment, tuple(im.shape))
                    self.captured_images.add(im.key)
        with open(path + ".tmp", "wb") as f:
            np.savez(f, request_ids=b.request_ids[rows], input_ids=b.input_ids[rows, :s],
                     positions=b.positions[rows, :s], query_lens=b.query_lens[rows],
                     context_lens=b.context_lens[rows], prompt_lens=b.prompt_len[rows],
                     token_ids=np.asarray(token_ids, np.int32),
                     logits=np.asarray(logits, np.float32), **extra)
        os.replace(path + ".tmp", path)
        self.captured += 1
        self.capture_left -= 1
        if self.capture_left <= 0:
            logger.info("logits capture: %d steps written to %s; stopping (max_steps reached)",
                        self.captured, self.capture_dir)
            self.capture_dir = None

    def reset(self) -> None:
        """Zero the KV cache: whatever the master's blocks held is gone, which the next step reply says."""
        self.runner.reset()
        self.cache_epoch += 1
