"""The MindSpore graphs a runner calls, and how it calls them (`RunnerGraphs`).

The model, one graph per bucket, returning greedy ids/logprobs and the logits Tensor; a decode run's graph (K greedy
steps in one call); the Embedder (hidden states, no logits); the sampler, one per batch size (two variants: with and
without top-k/top-p; the temperature-only one is the layer kernel library's SampleLogits where there is one), run on
those logits only when some row has temperature > 0; top log-probabilities and penalties, each one per batch size,
when some row asks. `call` runs one, through `GraphCalls` (a compiled graph without Cell.__call__'s per-call Python),
after a staged warmup's entries that hold its graph (warmup.py), after pointing the layer stack at the matrices repacked
since the last call (kernels/repack.py's LaterRepacks), and under tensor parallelism as the group's.
"""
from __future__ import annotations

import logging

import numpy as np

from llm_serving.cache_dir import default_cache_dir

from llm_serving.shm.layout import TOP_LOGPROBS

from ..kernels.panel_store import PanelStore
from ..kernels.repack import LaterRepacks
from ..mindspore_env import GraphCalls
from ..parallel import TensorParallel, TensorParallelError, make_all_reduce
from ..pooling import embedding_spec
from ..runner_spec import RunnerSpec
from ..weights import LlamaConfig
from .kernels import KernelChoice
from .kv_inputs import KvLayout

__all__ = ["RunnerGraphs"]

logger = logging.getLogger(__name__)


class RunnerGraphs:
    """The runner's cells, built once from the weights (`build`); `call` runs one.

    model (LlamaForCausalLM), decode_run (DecodeRun, or None without decode runs), embedder (Embedder), sampler,
    plain_sampler, top_logprobs, penalizer; all_reduce (the group's, None for one agent); collective_calls (model
    graph calls completed: all-reduces made with the peers); final_norm_gain (H,) float32 (None on tensor-parallel
    ranks but 0, which never pool) and pooling (models/pooling.py) for embed steps; plan (warmup.py's WarmupPlan
    while a staged warmup's entries are left); later (LaterRepacks while some matrix repacked after the load is not
    in use yet)."""

    plan = None
    later = None

    @classmethod
    def build(cls, cfg: LlamaConfig, weights: dict, quantized: dict, *, spec: RunnerSpec, model_dir: str,
              tp: TensorParallel, kernels: KernelChoice, layout: KvLayout, max_context: int, kernel_threads: int,
              reduce_kernel, image_rows: int = 0) -> "RunnerGraphs":
        import mindspore as ms
        from ..llama import DecodeRun, Embedder, LlamaForCausalLM
        from ..sampler import KernelSampler, Penalizer, Sampler, TopLogprobs

        self = cls()
        self.ms, self.vocab_size = ms, cfg.vocab_size
        # the group's all-reduce (None for one agent); its wait for peers is start-up-sized until warmup ends
        self.all_reduce = make_all_reduce(tp, spec.device_target, timeout_s=spec.tp_timeout_s, kernel=reduce_kernel)
        self.collective_calls = 0
        panels = (PanelStore.open(model_dir, kernels.layer_kernel, default_cache_dir())
                  if kernels.layer_kernel is not None else None)
        self.later = (LaterRepacks(kernels.layer_kernel, panels, invariant=kernels.batch_invariant)
                      if kernels.layer_kernel is not None and spec.repack_after_load else None)
        self.model = LlamaForCausalLM(cfg, weights, num_slots=layout.num_slots, block_size=layout.block_size,
                                      max_positions=max_context, device_target=spec.device_target,
                                      decode_kernel=kernels.decode_kernel, kernel_threads=kernel_threads, tp=tp,
                                      all_reduce=self.all_reduce, layer_kernel=kernels.layer_kernel,
                                      layer_kernel_rows=spec.layer_kernel_rows, quantized=quantized,
                                      lora_slots=spec.lora_slots, lora_rank=spec.lora_rank, kv_cache=spec.kv_cache,
                                      batch_invariant=kernels.batch_invariant,
                                      window_pool_slots=layout.window_num_slots, panels=panels,
                                      later=self.later, image_rows=image_rows)
        later_bytes = self.later.bytes if self.later is not None else 0
        if panels is not None and (panels.read or panels.written or later_bytes):
            logger.info("repacked weights: %.2f GB memory-mapped as an earlier start kept them, %.2f GB repacked "
                        "into files kept for the next (%s)", panels.read / 1e9, panels.written / 1e9, panels.folder)
        if later_bytes:
            logger.info("%.2f GB to repack after the load, on background threads; the stored rows serve until then",
                        later_bytes / 1e9)
            self.later.start()             # (then the panels kept are written on its threads)
        else:
            self.later = None
            if panels is not None:
                panels.finish_later()      # (flushed and put in place on a thread: the start does not wait)
        self.decode_run = DecodeRun(self.model, kernels.decode_run_steps) if kernels.decode_run_steps > 1 else None
        self.embedder = Embedder(self.model)
        # embed steps normalize and pool on the host: the final norm's gain and how to pool (models/pooling.py)
        norm = weights.get("model.norm.weight")
        self.final_norm_gain = None if norm is None else np.array(norm, np.float32)             # (H,)
        self.pooling = embedding_spec(spec.pooling, model_dir, cfg.hidden_size).pooling
        self.sampler = Sampler(cfg.vocab_size, filters=True)          # some sampling row uses top-k/top-p
        # temperature only: the layer kernel library's SampleLogits where there is one (MindSpore's graph of it keeps
        # ~7 logits-sized buffers per batch size for the life of the process)
        self.plain_sampler = (KernelSampler(kernels.layer_kernel, kernel_threads) if kernels.layer_kernel is not None
                              else Sampler(cfg.vocab_size, filters=False))
        self.top_k_logprobs = min(TOP_LOGPROBS, cfg.vocab_size)      # each row's top log-probabilities, when asked
        self.top_logprobs = TopLogprobs(self.top_k_logprobs)
        self.penalizer = Penalizer()                                    # some row has a sampling penalty
        for cell in (self.model, self.embedder, self.sampler, self.plain_sampler, self.top_logprobs, self.penalizer):
            cell.set_train(False)
        self.caches = [p for layer in self.model.layers for p in (layer.attn.key_cache, layer.attn.value_cache)]
        self.graph_calls = GraphCalls()
        return self

    def call(self, kind: str, shape: tuple, cell, *args):
        """Run a graph (kind and bucket shape name it in logs and errors).

        Under tensor parallelism the model graph all-reduces with the peers, so its failure on this rank, for
        whatever reason, leaves the group out of step (the peers wait in an all-reduce this rank never reaches, or
        the counts of calls no longer agree): it becomes a TensorParallelError, fatal for the group, saying why (the
        all-reduce's own reason when it was the cause; MindSpore only says that a kernel failed). The graph is
        waited for here (a device may run it asynchronously), so that a failure surfaces in this step, and every
        completed one is counted in `collective_calls`, which each step's reply carries: ranks that report the same
        count are in step."""
        if self.plan is not None:           # a staged warmup's entries left: this graph's may come first
            self.plan.before_call((kind, shape))
        if self.later is not None:
            self.use_repacked()
        if self.all_reduce is None or (cell is not self.model and cell is not self.embedder):
            return self.graph_calls(cell, *args)
        try:
            out = self.graph_calls(cell, *args)
            self.ms.runtime.synchronize()
        except Exception as exc:                  # noqa: BLE001 - any failure here is the group's
            why = self.all_reduce.error() or f"{type(exc).__name__}: {exc}"
            raise TensorParallelError(f"{kind} graph {shape}: {why}") from exc
        self.collective_calls += 1
        return out

    def use_repacked(self) -> None:
        """Point the layer stack at the matrices LaterRepacks finished since the last graph call (a step of this
        thread has finished: its outputs were read); None once all are."""
        if self.later.ready:
            self.ms.runtime.synchronize()
            self.later.apply()
        if not self.later.pending:
            self.later = None

    def compile(self, kind: str, shape: tuple, cell, *args) -> None:
        """Compile a graph (or load it from the compile cache) without running it: warmup's larger buckets."""
        if self.plan is not None:
            self.plan.before_call((kind, shape))
        cell.compile(*args)

    def tensors(self, kv: tuple, slot_shape: tuple) -> tuple:
        """KvLayout.inputs' arrays as Tensors, the slots shaped `slot_shape`; the main pair's Tensors again without a
        window pool."""
        T = self.ms.Tensor
        slots, tables, window_slots, window_tables = kv
        main = (T(slots.reshape(slot_shape)), T(tables))
        return main + (main if window_slots is slots else (T(window_slots.reshape(slot_shape)), T(window_tables)))

    def reset(self) -> None:
        """Zero the KV cache."""
        for p in self.caches:
            p.set_data(self.ms.ops.zeros(p.shape, p.dtype))

