"""ModelRunner: numpy in, numpy out, over static-shape MindSpore graphs. It only runs: the graph shapes are
in buckets.py, the process's MindSpore set-up and compile cache in mindspore_env.py, and a step's inputs
are converted and checked by step_inputs.StepInputs.

The KV cache lives in the model's Parameters: per layer, key and value holding
[(num_blocks + 1) * block_size, num_kv_heads, head_dim] float32 (stored flat as
[slots * num_kv_heads, head_dim], same memory order; see attention.py). The last block is scratch:
padding tokens (slot -1) and padding rows write there, so real blocks are never touched by padding. With a
window pool (RunnerSpec.window_blocks > 0, a model with sliding-window layers) the sliding layers' caches are
(window_blocks + 1) * block_size slots instead, the last block their own scratch, written and read through the
step's window_slots and window_tables (padded alike: `_kv_inputs`); the other layers keep the main cache.

Graphs: the model, one per bucket, returning greedy ids/logprobs and the logits Tensor; the sampler, one
per batch size (two variants: with and without top-k/top-p), run on those logits only when some row has
temperature > 0; top log-probabilities and penalties, each one per batch size, when some row asks. With
the CPU paged-attention kernel, prefill steps are *packed* (buckets.py): the step's real tokens side by
side, each attending through its own row's block table like a decode row, max(prefill_batch_sizes) rows
sampled. Without the kernel (no compiler, or Ascend) prefill runs per (batch, seq) bucket. On one CPU agent
every model graph (or, with layer_kernel_rows set, those of up to that many tokens) runs each decoder layer as
one C++ kernel on the weights as the checkpoint stores them (kernels/decoder_layer_cpu.cc; see llama.py). Figures for all of these are in docs/benchmarks/JOURNAL.md.
"""
from __future__ import annotations

import bisect
import logging
import os
import time
from typing import Callable, Optional

import numpy as np

from llm_serving.config import ATTENTION_KERNELS, KERNEL_ONLY_CACHES
from llm_serving.shm.layout import TOP_LOGPROBS, StepKind, StepView

from .buckets import Buckets
from .kernels.repack import repacked_types
from .logit_controls import apply_controls, read_controls, uses_controls
from .mindspore_env import GraphCalls, claim_compile_cache, setup_mindspore
from .pooling import embedding_spec
from .parallel import TensorParallel, TensorParallelError, all_reduce_kernel, make_all_reduce
from .runner_spec import KERNEL_ONLY_ROWS, RunnerSpec
from .step_inputs import StepInputs, StepLimits
from .warmup import Entry, WarmupPlan
from .weights import LlamaConfig, load_llama_weights, load_quantized
from .weights.gguf import KEPT_QUANTIZED

logger = logging.getLogger(__name__)

__all__ = ["ModelRunner"]


def _step_error(message: str) -> None:
    raise ValueError(f"ModelRunner.execute: {message}")


class PromptScores:
    """A prefill step's prompt log-probabilities, as the packed calls give every token's logits: after new token j
    of row i, the log-probability of its prompt_target, its rank (1 = the likeliest) and the `top` most likely
    tokens (rank 0 of top: the likeliest). Written into the step's out_prompt_* arrays."""

    BLOCK = 64                          # tokens scored at once (a block's log-softmax is BLOCK x vocab floats)

    def __init__(self, n: int, s: int, top: int):
        self.logprobs = np.zeros((n, s), np.float32)
        self.ranks = np.zeros((n, s), np.int32)
        self.top = top
        self.top_ids = np.zeros((n, s, top), np.int32)
        self.top_logprobs = np.zeros((n, s, top), np.float32)

    def add(self, logits: np.ndarray, rows: np.ndarray, cols: np.ndarray, targets: np.ndarray, tops: np.ndarray):
        """logits (k, V) of k tokens, token t at (rows[t], cols[t]) of the step; the tokens with a target scored in
        blocks of BLOCK rows (float32 log-softmax, vectorised)."""
        want = np.nonzero(targets[rows, cols] >= 0)[0]
        for b0 in range(0, len(want), self.BLOCK):
            t = want[b0:b0 + self.BLOCK]
            i, j = rows[t], cols[t]
            block = logits[t].astype(np.float32)
            block -= block.max(axis=1, keepdims=True)
            block -= np.log(np.exp(block).sum(axis=1, keepdims=True))          # log-softmax, (b, V)
            target = targets[i, j]
            chosen = block[np.arange(len(t)), target]
            self.logprobs[i, j] = chosen
            self.ranks[i, j] = (block > chosen[:, None]).sum(axis=1) + 1
            k = int(tops[i].max()) if len(t) else 0
            if k:
                ids = np.argpartition(-block, k - 1, axis=1)[:, :k]                   # (b, k), unordered
                lps = np.take_along_axis(block, ids, axis=1)
                order = np.argsort(-lps, axis=1, kind="stable")
                self.top_ids[i, j, :k] = np.take_along_axis(ids, order, axis=1)
                self.top_logprobs[i, j, :k] = np.take_along_axis(lps, order, axis=1)

    def write(self, view: StepView) -> None:
        n, s = self.logprobs.shape
        view.out_prompt_logprobs[:n, :s] = self.logprobs
        view.out_prompt_ranks[:n, :s] = self.ranks
        if self.top:
            view.out_prompt_top_ids[:n, :s, :self.top] = self.top_ids
            view.out_prompt_top_logprobs[:n, :s, :self.top] = self.top_logprobs


def _pad(arr: np.ndarray, size: int, fill) -> np.ndarray:
    """arr (n, ...) padded with `fill` to (size, ...)."""
    out = np.full((size,) + arr.shape[1:], fill, arr.dtype)
    out[:len(arr)] = arr
    return out


# the order in which _warmup_entries lists the graphs (part of the compile-cache key: cached graphs are named by
# their compile index)
_WARMUP_ORDER = "first request's graphs, prefill buckets, the first verify bucket, the rest (warmup.py)"

_GGML_TYPE_NAMES = {code: name for name, code in KEPT_QUANTIZED.items()}


def _describe_quantized(quantized: dict, float32_copy: bool) -> Optional[str]:
    """'Q4_1 x211: 96.3 MB instead of 537.2 MB of float32' for the matrices the CPU kernels read as stored
    (float32_copy: MindSpore's graphs keep a float32 copy beside them), logged once; None when there are none."""
    if not quantized:
        return None
    counts, stored, f32, seen = {}, 0, 0, set()
    for name, t in sorted(quantized.items()):
        if id(t) in seen:                   # a tied lm_head: the embedding's tensor
            continue
        seen.add(id(t))
        label = _GGML_TYPE_NAMES.get(t.qtype, str(t.qtype))
        counts[label] = counts.get(label, 0) + 1
        stored += t.data.nbytes
        f32 += 4 * int(np.prod(t.shape))
    summary = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
    if float32_copy:
        return f"{summary}: {stored / 1e6:.1f} MB, and a float32 copy of {f32 / 1e6:.1f} MB for MindSpore's graphs"
    return f"{summary}: {stored / 1e6:.1f} MB instead of {f32 / 1e6:.1f} MB of float32"


class ModelRunner:
    """Runs the LLaMA in `model_dir` over a paged KV cache; see `execute` for one step.

    Attributes: config (LlamaConfig), buckets (Buckets), num_blocks, block_size, max_blocks_per_seq,
    num_slots ((num_blocks + 1) * block_size), max_context (max_blocks_per_seq * block_size), window_blocks (the
    window pool's blocks: spec.window_blocks for a model with sliding-window layers, else 0, the pool off).

    spec (RunnerSpec, runner_spec.py; an agent's from `RunnerSpec.from_config`): the cache, buckets, kernels
    and step kinds. Its num_layers runs only the checkpoint's first N layers with its final norm and head (a
    draft model cut from it; see weights.load_llama_weights). Its compile_cache=True (the agent's runner)
    keeps compiled graphs under the project cache dir, keyed by everything that decides warmup's compile
    sequence; only the first runner of a process can use it. tp: this rank of a tensor-parallel group.
    """

    warmup_plan: Optional[WarmupPlan] = None    # warmup's entries and how far they have run (warmup.py)
    _plan: Optional[WarmupPlan] = None          # the same while entries are left (checked at every graph call)

    def __init__(self, model_dir: str, spec: RunnerSpec, tp: Optional["TensorParallel"] = None):
        num_blocks, block_size, max_blocks_per_seq = spec.num_blocks, spec.block_size, spec.max_blocks_per_seq
        attention_kernel, layer_kernel, device_target = spec.attention_kernel, spec.layer_kernel, spec.device_target
        decode_run_steps, decode_run_rows = spec.decode_run_steps, spec.decode_run_rows
        lora_slots, lora_rank, num_layers = spec.lora_slots, spec.lora_rank, spec.num_layers
        num_threads = spec.num_threads
        self.spec = spec
        self.model_dir = model_dir
        for key, val in (("num_blocks", num_blocks), ("block_size", block_size),
                         ("max_blocks_per_seq", max_blocks_per_seq)):
            if not isinstance(val, (int, np.integer)) or val < 1:
                raise ValueError(f"ModelRunner: {key} must be a positive integer, got {val!r}")
        for key, val in (("attention_kernel", attention_kernel), ("layer_kernel", layer_kernel)):
            if val not in ATTENTION_KERNELS:
                raise ValueError(f"ModelRunner: {key} must be one of {ATTENTION_KERNELS}, got {val!r}")
        self.num_blocks, self.block_size = int(num_blocks), int(block_size)
        self.max_blocks_per_seq = int(max_blocks_per_seq)
        self.device_target = device_target
        self.num_slots = (self.num_blocks + 1) * self.block_size
        self.scratch_slot = self.num_blocks * self.block_size     # first slot of the scratch block
        self.max_context = self.max_blocks_per_seq * self.block_size
        self.decode_kernel = self._build_decode_kernel(device_target, attention_kernel)
        self.tp = tp if tp is not None else TensorParallel()
        self.layer_kernel = self._build_layer_kernel(device_target, layer_kernel, self.tp, self.decode_kernel)
        # the layer kernel serves every step (layer_kernel_rows None, the default), or steps of up to that many
        # tokens, MindSpore's ops (on float32 copies of the weights) the larger ones
        self.kernel_serves_all = self.layer_kernel is not None and spec.layer_kernel_rows is None
        self.layer_kernel_rows = (0 if self.layer_kernel is None else KERNEL_ONLY_ROWS if self.kernel_serves_all
                                  else int(spec.layer_kernel_rows))
        if spec.kv_cache_dtype in KERNEL_ONLY_CACHES and not self.kernel_serves_all:
            raise ValueError(f"pa_config.kv_cache_dtype {spec.kv_cache_dtype} is read by the CPU layer kernel only, "
                             "which does not serve every step here (layer_kernel off or unavailable, "
                             "layer_kernel_max_tokens set, tensor parallelism, or Ascend): MindSpore's CPU "
                             "ScatterUpdate has no bfloat16, and its ops do not read an int8 cache's scales; use "
                             "float16 (the default) or float32")
        # batch invariance: 'auto' where the layer kernel serves every step (MindSpore's op-by-op graphs pick
        # their products by shape); the kernels' iconfig carries it into every call
        if spec.batch_invariant is True and not self.kernel_serves_all:
            raise ValueError("model_config.batch_invariant=true needs the CPU layer kernel on every step (a CPU "
                             "agent without tensor parallelism, layer_kernel not off and built, "
                             "layer_kernel_max_tokens null): MindSpore's op-by-op graphs pick their products by "
                             "shape; leave it 'auto' to have it wherever it can be")
        self.batch_invariant = self.kernel_serves_all and spec.batch_invariant is not False
        # decode runs (_execute_decode_run): K greedy steps in one graph, for batches of up to decode_run_rows
        # (None: every batch the layer kernel takes)
        if decode_run_rows is None:
            decode_run_rows = self.layer_kernel_rows
        runs = self.layer_kernel is not None and decode_run_steps > 1 and decode_run_rows >= 1
        self.decode_run_steps = int(decode_run_steps) if runs else 1
        self.decode_run_rows = min(int(decode_run_rows), self.layer_kernel_rows) if runs else 0
        lists = {name: list(v) if isinstance(v, tuple) else v for name, v in (
            ("decode_batch_sizes", spec.decode_batch_sizes), ("prefill_batch_sizes", spec.prefill_batch_sizes),
            ("prefill_seq_lens", spec.prefill_seq_lens), ("decode_block_widths", spec.decode_block_widths))}
        self.buckets = Buckets.make(**lists, max_blocks_per_seq=self.max_blocks_per_seq,
                                    max_step_tokens=spec.max_step_tokens,
                                    verify_width=spec.verify_width, verify_rows=spec.verify_rows,
                                    packed=self.decode_kernel is not None,
                                    one_width=self.decode_kernel is not None or device_target == "Ascend")

        for key, val in (("lora_slots", lora_slots), ("lora_rank", lora_rank)):
            if not isinstance(val, (int, np.integer)) or val < (0 if key == "lora_slots" else 1):
                raise ValueError(f"ModelRunner: {key} must be an integer >= {0 if key == 'lora_slots' else 1}, "
                                 f"got {val!r}")
        self.lora_slots, self.lora_rank = int(lora_slots), int(lora_rank)
        # the CPU kernels read a GGUF's quantized matrices as stored (llama.py); MindSpore's graphs a float32 copy,
        # made only when some step runs them
        quantized = (load_quantized(model_dir, num_layers) if self.layer_kernel is not None and spec.keep_quantized
                     else {})
        skip = frozenset(quantized) if self.kernel_serves_all else frozenset()
        self.config, weights = load_llama_weights(model_dir, self.tp, num_layers, skip=skip)   # this rank's part
        cfg: LlamaConfig = self.config
        if not cfg.generates:
            # a bidirectional encoder only embeds: no lm_head, so no decode runs; its whole input in one graph call
            # (_execute_embed), which tensor parallelism's step pieces do not keep to
            if self.tp.world > 1:
                raise ValueError(f"ModelRunner: {cfg.architecture} is an embedding model (a bidirectional encoder); "
                                 "tensor parallelism does not serve it (serve it on one agent)")
            if not self.buckets.packed:
                raise ValueError(f"ModelRunner: {cfg.architecture} is an embedding model, and embeddings need the "
                                 "CPU kernel's packed steps (attention_kernel on, a CPU agent)")
            self.decode_run_steps, self.decode_run_rows = 1, 0
        # the window pool: the sliding layers' own cache, of window_blocks blocks and a scratch block
        if not isinstance(spec.window_blocks, (int, np.integer)) or spec.window_blocks < 0:
            raise ValueError(f"ModelRunner: window_blocks must be an integer >= 0, got {spec.window_blocks!r}")
        windows = [w for w in (cfg.layer_window(i) for i in range(cfg.num_layers)) if w is not None]
        self.window_blocks = int(spec.window_blocks) if windows else 0
        if self.window_blocks and spec.window_tokens is not None and spec.window_tokens != max(windows):
            # the master frees a row's window blocks by pa_config.window_tokens: a smaller one would free keys the
            # sliding layers still read
            raise ValueError(f"ModelRunner: pa_config.window_tokens={spec.window_tokens} is not the model's sliding "
                             f"window ({max(windows)} tokens); leave it unset: it is read from the model at start")
        self.window_num_slots = (self.window_blocks + 1) * self.block_size if self.window_blocks else 0
        self.window_scratch_slot = self.window_blocks * self.block_size     # first slot of its scratch block
        self.quantized_matrices = _describe_quantized(quantized, float32_copy=not self.kernel_serves_all)
        # the stored types the layer kernel's library repacks at load (kernels/repack.py), where the model has some
        stored_types = {_GGML_TYPE_NAMES.get(t.qtype) for t in (quantized or {}).values()}
        self.repacked = tuple(t for t in repacked_types(self.layer_kernel) if t in stored_types) \
            if self.layer_kernel is not None and device_target == "CPU" else ()
        if self.quantized_matrices:
            logger.info("the layer kernel reads the checkpoint's quantized matrices as stored (%s)%s",
                        self.quantized_matrices, f"; {', '.join(self.repacked)} rows repacked at load, 8 rows "
                        "interleaved, for its integer products" if self.repacked else "")
        self.limits = StepLimits(vocab_size=cfg.vocab_size, max_context=self.max_context,
                                 num_blocks=self.num_blocks, max_blocks_per_seq=self.max_blocks_per_seq,
                                 scratch_slot=self.scratch_slot, lora_slots=self.lora_slots,
                                 window_blocks=self.window_blocks, window_scratch_slot=self.window_scratch_slot)
        reduce_kernel = all_reduce_kernel(self.tp, device_target)
        kernel_threads = num_threads or len(os.sched_getaffinity(0))      # the CPU kernels' pool
        # everything that decides which graphs warmup() compiles, and in which order, the kernel libraries the
        # graphs name, and the kernels' config tensors, which a compiled graph holds as constants (the thread count
        # and batch invariance: a cache compiled with batch-invariant steps served a server started without them)
        cache_key = claim_compile_cache(
            (cfg, self.num_blocks, self.window_blocks, self.block_size, self.buckets, device_target,
             (self.tp.rank, self.tp.world, self.tp.backend, self.tp.across_nodes) if self.tp.world > 1 else None,
             self.decode_kernel, reduce_kernel, self.layer_kernel, self.layer_kernel_rows, self.decode_run_steps,
             self.decode_run_rows, self.quantized_matrices, self.repacked, self.lora_slots, self.lora_rank,
             spec.kv_cache_dtype, kernel_threads, self.batch_invariant, _WARMUP_ORDER)
            if spec.compile_cache else None)
        self._cache_dir = setup_mindspore(device_target, spec.device_id, num_threads, cache_key,
                                          wait_for_cache=self.tp.world == 1)
        self._build_graphs(weights, quantized, kernel_threads, reduce_kernel, spec.tp_timeout_s)

    @staticmethod
    def _build_decode_kernel(device_target: str, attention_kernel: str) -> Optional[str]:
        """CPU decode attends through the paged-attention kernel (kernels/) when it builds; 'auto' falls back
        to gathering the keys (attention.py) when there is no C++ compiler, 'on' makes that an error."""
        if device_target != "CPU" or attention_kernel == "off":
            return None
        from .kernels import KernelBuildError, build_kernel
        try:
            return build_kernel("paged_attention_cpu", "PagedDecodeAttention")
        except KernelBuildError as e:
            if attention_kernel == "on":
                raise
            logger.warning("CPU paged-attention kernel unavailable; decode steps gather keys instead: %s", e)
            return None

    @staticmethod
    def _build_layer_kernel(device_target: str, layer_kernel: str, tp: TensorParallel,
                            decode_kernel: Optional[str]) -> Optional[str]:
        """The library of the whole-layer CPU kernel (kernels/decoder_layer_cpu.cc) that serves every step (or
        those of up to layer_kernel_rows tokens), or None: 'off', not a CPU, tensor parallel (its all-reduces sit
        inside the layer), no paged-attention kernel (the padded path), or it does not build ('auto')."""
        if layer_kernel == "off" or device_target != "CPU" or tp.world > 1 or decode_kernel is None:
            if layer_kernel == "on":
                raise ValueError("ModelRunner: layer_kernel 'on' needs a CPU agent without tensor parallelism "
                                 "and the paged-attention kernel")
            return None
        from .kernels import KernelBuildError, build_kernel
        try:
            return build_kernel("decoder_layer_cpu", "DecoderLayer").rsplit(":", 1)[0]
        except KernelBuildError as e:
            if layer_kernel == "on":
                raise
            logger.warning("CPU layer kernel unavailable; small decode steps run layer by layer: %s", e)
            return None

    def _build_graphs(self, weights, quantized: dict, kernel_threads: int, reduce_kernel,
                      tp_timeout_s: float) -> None:
        import mindspore as ms
        from .llama import DecodeRun, Embedder, LlamaForCausalLM
        from .sampler import KernelSampler, Penalizer, Sampler, TopLogprobs

        cfg = self.config
        self._ms = ms
        # the group's all-reduce (None for one agent); its wait for peers is start-up-sized until warmup ends
        self.all_reduce = make_all_reduce(self.tp, self.device_target, timeout_s=tp_timeout_s, kernel=reduce_kernel)
        self.tp_timeout_s = tp_timeout_s
        self.collective_calls = 0        # model graph calls completed (all-reduces made with the peers)
        self.model = LlamaForCausalLM(cfg, weights, num_slots=self.num_slots, block_size=self.block_size,
                                      max_positions=self.max_context, device_target=self.device_target,
                                      decode_kernel=self.decode_kernel,
                                      kernel_threads=kernel_threads,
                                      tp=self.tp, all_reduce=self.all_reduce, layer_kernel=self.layer_kernel,
                                      layer_kernel_rows=self.spec.layer_kernel_rows, quantized=quantized,
                                      lora_slots=self.lora_slots, lora_rank=self.lora_rank,
                                      kv_cache_dtype=self.spec.kv_cache_dtype, batch_invariant=self.batch_invariant,
                                      window_pool_slots=self.window_num_slots)
        self.decode_run = DecodeRun(self.model, self.decode_run_steps) if self.decode_run_steps > 1 else None
        self.embedder = Embedder(self.model)        # embed steps: the hidden states, no logits (_execute_embed)
        self.embedder.set_train(False)
        # embed steps normalize and pool on the host: the final norm's gain and how to pool (models/pooling.py)
        norm = weights.get("model.norm.weight")     # (tensor-parallel ranks but 0 hold none: they never pool)
        self.final_norm_gain = None if norm is None else np.array(norm, np.float32)             # (H,)
        self.pooling = embedding_spec(self.spec.pooling, self.model_dir, cfg.hidden_size).pooling
        self.final_norm = not cfg.post_norm        # (post norms: the last layer's output is normalized already)
        self.sampler = Sampler(cfg.vocab_size, filters=True)          # some sampling row uses top-k/top-p
        # temperature only: the layer kernel library's SampleLogits where there is one (MindSpore's graph of it keeps
        # ~7 logits-sized buffers per batch size for the life of the process)
        self.plain_sampler = (KernelSampler(self.layer_kernel, kernel_threads) if self.layer_kernel is not None
                              else Sampler(cfg.vocab_size, filters=False))
        self.top_k_logprobs = min(TOP_LOGPROBS, cfg.vocab_size)
        self.top_logprobs = TopLogprobs(self.top_k_logprobs)             # some row asks for top logprobs
        self.penalizer = Penalizer()                                    # some row has a sampling penalty
        for cell in (self.model, self.sampler, self.plain_sampler, self.top_logprobs, self.penalizer):
            cell.set_train(False)
        self._caches = [p for layer in self.model.layers for p in (layer.attn.key_cache, layer.attn.value_cache)]
        self._graphs = GraphCalls()     # a compiled graph runs without Cell.__call__'s per-call Python

    # the bucket lists, as the runner's own (tests and tools read them)
    decode_batch_sizes = property(lambda self: self.buckets.decode_batch_sizes)
    decode_block_widths = property(lambda self: self.buckets.decode_block_widths)
    prefill_batch_sizes = property(lambda self: self.buckets.prefill_batch_sizes)
    prefill_seq_lens = property(lambda self: self.buckets.prefill_seq_lens)
    prefill_token_sizes = property(lambda self: self.buckets.prefill_token_sizes)
    packed_prefill = property(lambda self: self.buckets.packed)

    # ------------------------------------------------------------------ execution
    def execute(self, step: StepView):
        """One step over n sequences: `step` (shm/layout.py's StepView) names its kind and its input arrays
        (described in step_inputs.py), as the worker reads them from the step buffers; each kind has its
        handler (`_EXECUTE`).

        Prefill and decode steps return (next_token_ids int32 (n,), logprobs float32 (n,)), and with
        step.return_logits also the model's logits float32 (n, vocab) at each row's last new token (before
        temperature; copied to the host only when asked, for logits capture), and when some row of top_n (n,)
        is > 0 also (top_ids int32 (n, K), top_logprobs float32 (n, K)): each row's K = min(TOP_LOGPROBS,
        vocab) most likely tokens under log_softmax(logits), most likely first. Rows with a penalty choose
        from (and report the logprobs and top logprobs of) the penalized logits. n is padded to the smallest
        batch bucket >= n, s to 1 (decode) or the smallest prefill_seq_len >= s, w to the graph's block-table
        width. ValueError if no bucket fits or an argument is malformed.

        A verify step (speculative decoding) samples a token after every new token of every row, token j of
        row i with uniform verify_random_u[i, j] (random_u is unused); returns (token_ids int32 (n, s),
        logprobs float32 (n, s)), zero past each row's query length. Rows must not ask for top
        log-probabilities or penalties (the master does not speculate for them). verify_parent int32 (n, s)
        makes each row's new tokens a token tree (speculative decoding with several candidates): token j
        attends to the committed keys, its ancestors and itself (its position is its depth's, its slot its
        own); the CPU kernel's packed path only.

        A decode run: see `_execute_decode_run`.

        With a window pool (`window_blocks` > 0) every step also brings window_slots and window_tables, the sliding
        layers' slot_mapping and block_tables in the pool (step_inputs.py); without one they are not read.

        Logit controls (logit_controls.py): a row with controls_on is picked from its logits with its bias entries,
        token mask and min_p applied (read when it is sampled: the master writes them while the model runs);
        verify steps and decode runs have none. A prefill step with rows of prompt_top >= 0 (packed only) also
        writes into the step's out_prompt_logprobs / _ranks / _top_ids / _top_logprobs the log-probability after
        each new token of that row's prompt_target (`PromptScores`).
        """
        if not self.config.generates and step.kind is not StepKind.EMBED:
            raise ValueError(f"ModelRunner.execute: {self.config.architecture} is an embedding model; it runs embed "
                             f"steps only, not {step.kind.name.lower()} steps")
        return self._EXECUTE[step.kind](self, step)

    def _execute_step(self, step: StepView):
        """A prefill or decode step."""
        inputs = StepInputs.make(self.limits, step, sampler=self.tp.writes_outputs)
        nb, sb = self.buckets.bucket(inputs.n, inputs.s)
        if inputs.scores_prompt:             # (rank 0's: other ranks have no logits and run the step plainly)
            if not self.buckets.packed:
                raise ValueError("ModelRunner.execute: prompt log-probabilities need the CPU kernel's packed prefill "
                                 "(attention_kernel on)")
            scores = PromptScores(inputs.n, inputs.s, int(inputs.prompt_top.max()))
            out = self._execute_packed(inputs, step.return_logits, scores)
            if step.out_prompt_logprobs is not None:
                scores.write(step)
            return out
        if inputs.s > 1 and self.buckets.packed:
            return self._execute_packed(inputs, step.return_logits)
        return self._execute_padded(inputs, nb, sb, step.return_logits)

    @property
    def lora_slot_bytes(self) -> int:
        """Memory one LoRA adapter slot takes on this agent (the layer kernel's and MindSpore's forms, every
        layer, at lora_rank); 0 without slots."""
        return sum(st.slot_nbytes for layer in self.model.layers for st in layer.lora_stacks.values())

    def set_lora(self, slot: int, adapter) -> None:
        """LoRA adapter slot `slot` (1..lora_slots) now holds `adapter` (lora.load_lora_adapter's, checked
        against this model), or nothing (None): rows of later steps whose `lora` is `slot` run with it. The
        stacks are written in place (no graph is compiled again); the caller makes sure no step in flight uses
        the slot. ValueError for a slot out of range or an adapter of a rank above lora_rank."""
        if not isinstance(slot, (int, np.integer)) or not 1 <= slot <= self.lora_slots:
            raise ValueError(f"ModelRunner.set_lora: slot must be in 1..{self.lora_slots}, got {slot!r}")
        if adapter is not None:
            if adapter.rank > self.lora_rank:
                raise ValueError(f"ModelRunner.set_lora: adapter {adapter.name!r} has rank {adapter.rank}, above "
                                 f"this runner's lora_rank {self.lora_rank}")
            unknown = [n for n in adapter.deltas if int(n.split(".")[2]) >= self.config.num_layers]
            if unknown:
                raise ValueError(f"ModelRunner.set_lora: adapter {adapter.name!r} adapts {unknown[0]}, a layer this "
                                 f"model does not have")
        self.model.write_lora(int(slot), adapter)

    def decode_run_batch_sizes(self) -> list:
        """The decode batch buckets decode runs have graphs for (empty: no decode runs): those the layer kernel
        takes, up to the first that holds decode_run_rows rows."""
        if self.decode_run is None:
            return []
        sizes = [s for s in self.decode_batch_sizes if s <= self.layer_kernel_rows]
        return sizes[:bisect.bisect_left(sizes, self.decode_run_rows) + 1]

    def decode_run_max_rows(self) -> int:
        """The most rows a decode run takes (0: no decode runs)."""
        sizes = self.decode_run_batch_sizes()
        return min(self.decode_run_rows, sizes[-1]) if sizes else 0

    def _execute_decode_run(self, step: StepView):
        """K = decode_run_steps greedy decode steps of n rows in one graph call: row i feeds input_ids[i, 0] at
        positions[i, 0] (context_lens[i] keys visible, itself included), then the token it gets at
        positions[i, 0] + 1, and so on; step j writes row i's K/V at slot_mapping[i, j] (n, K). A row may end
        before the run does: its slots are -1 from some step j >= 1 on, and it sits out those steps (a step
        every row sits out costs almost nothing, so a run of fewer than K steps is a run of K whose last slots
        are -1). The step's sampling arrays are not read (a run is greedy). Returns (token_ids int32 (n, K),
        logprobs float32 (n, K)): each step's greedy token (the first index of the largest logit) and its
        log-probability, as K single decode steps would give; -1 and 0 where the row sat out. With a window pool,
        window_slots (n, K) are the sliding layers' slots of each step, >= 0 exactly where slot_mapping's are.
        ValueError if runs are off, n is more than a run's largest bucket, or an argument is malformed."""
        input_ids, positions = (np.asarray(a).reshape(len(a), -1) for a in (step.input_ids, step.positions))
        slot_mapping, block_tables, context_lens, lora = (step.slot_mapping, step.block_tables, step.context_lens,
                                                          step.lora)
        window_slots = None if step.window_slots is None else np.asarray(step.window_slots, np.int32)
        k = self.decode_run_steps
        n = input_ids.shape[0]
        if self.decode_run is None:
            raise ValueError("ModelRunner.execute (decode run): this runner has no decode runs (decode_run_steps "
                             "<= 1, decode_run_rows 0, or no layer kernel)")
        sizes = self.decode_run_batch_sizes()
        if not 1 <= n <= sizes[-1]:
            raise ValueError(f"ModelRunner.execute (decode run): {n} rows; runs take 1..{sizes[-1]}")
        slot_mapping = np.asarray(slot_mapping, np.int32)
        if slot_mapping.shape != (n, k):
            raise ValueError(f"ModelRunner.execute (decode run): slot_mapping has shape {slot_mapping.shape}, "
                             f"expected {(n, k)}")
        active = slot_mapping >= 0
        if not active[:, 0].all() or (active[:, 1:] > active[:, :-1]).any():
            raise ValueError("ModelRunner.execute (decode run): each row's slots are >= 0 for its first steps (at "
                             "least one) and -1 for the rest of the run")
        zeros = np.zeros(n, np.float32)
        step = StepInputs.make(self.limits, StepView(
            StepKind.DECODE, input_ids=input_ids[:, :1], positions=positions[:, :1], slot_mapping=slot_mapping[:, :1],
            block_tables=block_tables, context_lens=context_lens, query_lens=np.ones(n, np.int32), temperature=zeros,
            top_k=np.zeros(n, np.int32), top_p=np.ones(n, np.float32), random_u=zeros, lora=lora,
            window_slots=None if window_slots is None else window_slots[:, :1], window_tables=step.window_tables))
        if step.window_slots is None:
            window_slots = None                 # (no window pool: not read)
        elif (window_slots.shape != (n, k) or ((window_slots >= 0) != active).any()
              or window_slots.max() >= self.limits.window_scratch_slot):
            raise ValueError(f"ModelRunner.execute (decode run): window_slots must be {(n, k)}, >= 0 exactly where "
                             f"slot_mapping is and below {self.limits.window_scratch_slot}")
        steps = active.sum(1)                                                   # (n,) each row's steps
        last = self.limits.max_context - steps
        # (row by row: positions are (n, 1), and compared with `last` (n,) as they are each row's position met
        # every row's limit, so a run of rows of different lengths near the model's length was refused)
        position = step.positions[:, 0]
        bad = (position > last) | (step.context_lens > last + 1) | (slot_mapping.max(1) >= self.limits.scratch_slot)
        if bad.any():
            r = int(np.flatnonzero(bad)[0])
            raise ValueError(f"ModelRunner.execute (decode run): a row of s steps needs positions <= "
                             f"{self.limits.max_context} - s, context_lens one more, and slots in "
                             f"[0, {self.limits.scratch_slot}); row {r} has s={int(steps[r])}, position "
                             f"{int(position[r])}, context {int(step.context_lens[r])}, slots "
                             f"{slot_mapping[r].tolist()}")
        nb = sizes[bisect.bisect_left(sizes, n)]
        tokens, logprobs = self._run_decode_run(nb, step, slot_mapping, window_slots)
        tokens, logprobs = tokens[:, :n].T.astype(np.int32), logprobs[:, :n].T.astype(np.float32)
        tokens[~active], logprobs[~active] = -1, 0.0
        return tokens, logprobs

    def _run_decode_run(self, nb: int, step: Optional[StepInputs], slot_mapping, window_slots=None) -> tuple:
        """The decode-run graph of nb rows on step's rows (None: none, for warmup); (K, nb) outputs. Padding rows
        sit the run out (slots -1), so a warmup call compiles the graph and computes nothing."""
        k = self.decode_run_steps
        n = 0 if step is None else step.n
        # the keys of each row's last step it takes (a row near the model's length takes fewer than k)
        need = 1 if step is None else int((step.context_lens + (slot_mapping >= 0).sum(1) - 1).max())
        w = self.buckets.width(1, -(-need // self.block_size))
        pos = np.zeros((k, nb), np.int32)
        context = np.ones((k, nb), np.int32)
        ids = np.zeros(nb, np.int32)
        lora = np.zeros(nb, np.int32)
        if step is None:                        # warmup: every row padding (the window pair too, with a pool)
            none, no_tables = np.zeros((0, k), np.int32), np.zeros((0, 1), np.int32)
            kv = self._kv_inputs(none, no_tables, none if self.window_blocks else None, no_tables, (nb, k), w, True)
        else:
            kv = self._kv_inputs(slot_mapping, step.block_tables, window_slots, step.window_tables, (nb, k), w, True)
        slots, tables, window_slots, window_tables = kv                 # slots (nb, k): a row's steps
        if step is not None:
            lora[:n] = step.lora
            offsets = np.arange(k, dtype=np.int32)[:, None]
            pos[:, :n] = step.positions[:, 0] + offsets
            context[:, :n] = step.context_lens + offsets
            sat_out = slots.T < 0               # positions and contexts of steps sat out stay in range
            pos[sat_out], context[sat_out] = 0, 1
            ids[:n] = step.input_ids[:, 0]
        by_step = slots.T.copy()                                        # (k, nb): a step's rows
        window_by_step = by_step if window_slots is slots else window_slots.T.copy()
        slots_t, tables_t, window_slots_t, window_tables_t = self._kv_tensors(
            (by_step, tables, window_by_step, window_tables), (k, nb))
        T = self._ms.Tensor
        tokens, logprobs = self._call("decode_run", (nb, k), self.decode_run, T(ids), T(pos), slots_t, tables_t,
                                      T(context), T(np.full(nb, -1, np.int32)), T(lora), window_slots_t,
                                      window_tables_t)
        return tokens.asnumpy(), logprobs.asnumpy()

    def _execute_padded(self, step: StepInputs, nb: int, sb: int, return_logits: bool):
        """The step padded to its (batch, seq) bucket and block-table width: padding rows and tokens write to
        the scratch block."""
        outputs = self._call_padded(step, nb, sb, all_tokens=False)
        return self._finish(outputs, step.n, nb, step.per_row, return_logits, step.live)

    def _call_padded(self, step: StepInputs, nb: int, sb: int, all_tokens: bool):
        """The model graph on the step padded to (nb, sb): outputs at each row's last new token, or with
        all_tokens at every token (nb * sb rows, row-major)."""
        n, s = step.n, step.s
        cl, ql = step.context_lens, step.query_lens
        w = self.buckets.width(sb, -(-int(cl.max()) // self.block_size))
        ids_p = np.zeros((nb, sb), np.int32)
        pos_p = np.zeros((nb, sb), np.int32)
        ids_p[:n, :s] = step.input_ids
        pos_p[:n, :s] = step.positions
        kernel = sb == 1 and self._layer_kernel_runs(nb)
        slot_p, bt_p, window_slot_p, window_bt_p = self._kv_tensors(self._kv_inputs(
            step.slot_mapping, step.block_tables, step.window_slots, step.window_tables, (nb, sb), w, kernel), (nb, sb))
        T = self._ms.Tensor
        sample_index = np.arange(nb * sb if all_tokens else nb, dtype=np.int32)
        return self._call("verify" if all_tokens else "model", (nb, sb), self.model, T(ids_p), T(pos_p), slot_p,
                          bt_p, T(_pad(cl, nb, 1)), T(_pad(ql, nb, 1)), T(sample_index),
                          T(np.full(nb, -1, np.int32)), T(_pad(step.lora, nb, 0)), window_slot_p, window_bt_p)

    def _kv_inputs(self, slots, tables, window_slots, window_tables, shape: tuple, width: int, kernel: bool) -> tuple:
        """(slot_mapping, block_tables, window_slots, window_tables) as a graph call takes them (`_kv_pair`: each
        cache's pair padded, with its own scratch block); without a window pool (window_slots None) the main pair
        again, the same arrays."""
        main = self._kv_pair(slots, tables, shape, width, kernel, self.scratch_slot)
        if window_slots is None:
            return main + main
        return main + self._kv_pair(window_slots, window_tables, shape, width, kernel, self.window_scratch_slot)

    def _kv_pair(self, slots, tables, shape: tuple, width: int, kernel: bool, scratch_slot: int) -> tuple:
        """One cache's slots and block tables padded for a graph call: slots (m, ...) of the real rows or tokens
        to `shape`, tables (m, w) of their rows to (shape[0], width) with 0 (entries past the longest row's blocks
        are padding). A token without a slot, and the padding: -1 where the layer kernel runs (its rows sit it out:
        warmup's steps then compute nothing), else a slot of the cache's scratch block (from scratch_slot on), where
        MindSpore's ops write it."""
        scratch = scratch_slot + (np.arange(int(np.prod(shape)), dtype=np.int32) % self.block_size).reshape(shape)
        padded = np.full(shape, -1, np.int32) if kernel else scratch
        real = tuple(slice(0, d) for d in slots.shape)
        padded[real] = np.where(slots < 0, -1 if kernel else scratch[real], slots)
        used = min(tables.shape[1], width)
        padded_tables = np.zeros((shape[0], width), np.int32)
        padded_tables[:len(tables), :used] = tables[:, :used]
        return padded, padded_tables

    def _kv_tensors(self, kv: tuple, slot_shape: tuple) -> tuple:
        """`_kv_inputs`' arrays as Tensors, the slots shaped `slot_shape`; the main pair's Tensors again without a
        window pool."""
        T = self._ms.Tensor
        slots, tables, window_slots, window_tables = kv
        main = (T(slots.reshape(slot_shape)), T(tables))
        return main + (main if window_slots is slots else (T(window_slots.reshape(slot_shape)), T(window_tables)))

    def _execute_verify_step(self, step: StepView):
        return self._execute_verify(StepInputs.make(self.limits, step))

    def _execute_verify(self, step: StepInputs):
        """A verify step: the rows' new tokens run as in a prefill step (packed, or padded to (batch,
        verify_width)), and the sampler sees every token's logits, each token with its row's sampling
        parameters and its own uniform number."""
        n, s = step.n, step.s
        tokens = self._flat_tokens(step)
        valid, row_of = tokens[:2]                                                      # (n, s), (t,)
        t = len(row_of)
        size = self.buckets.verify_bucket(n, t)
        per_token = {key: arr[row_of] for key, arr in step.per_row.items() if key != "random_u"}
        per_token["random_u"] = step.verify_u[valid]                                     # (t,) each
        if self.buckets.packed:
            rows, flat = size, np.arange(t)
            bits = step.tree_bits() if step.verify_parent is not None else None
            outputs = self._call_packed(step, tokens, 0, t, size, np.arange(size, dtype=np.int32), bits)
        elif step.verify_parent is not None:
            raise ValueError("ModelRunner.execute: token trees need the CPU paged-attention kernel (packed verify "
                             "steps); this runner pads verify steps (attention_kernel off, or Ascend)")
        else:
            sb = self.buckets.verify_width
            if s > sb:
                raise ValueError(f"ModelRunner.execute: a verify row feeds at most {sb} tokens, got {s}")
            rows, flat = size * sb, (np.arange(n)[:, None] * sb + np.arange(s)[None, :])[valid]   # (t,)
            outputs = self._call_padded(step, size, sb, all_tokens=True)
        padded = {key: np.zeros(rows, arr.dtype) for key, arr in per_token.items()}
        padded["top_p"][:] = 1.0
        for key, arr in per_token.items():
            padded[key][flat] = arr
        token, logprob = self._finish(outputs, rows, rows, padded, False)
        ids, lps = np.zeros((n, s), np.int32), np.zeros((n, s), np.float32)
        ids[valid], lps[valid] = token[flat], logprob[flat]
        return ids, lps

    def _execute_embed(self, step: StepView) -> np.ndarray:
        """An embed step: every token's final hidden state, through the Embedder graph in packed pieces as a packed
        prefill runs them (their K/V written as any step's: a row's later chunk attends to them), then on the host the
        final norm (RMS; a model of post norms has none) and each row's pooling (`self.pooling`): mean, the sum of
        its new tokens' states (the master divides the whole input's sum by its count); last, its last new token's;
        cls, its first token's when the step feeds position 0. Returns (n, H) float32 (zeros on tensor-parallel ranks
        other than 0, which run the graph for its all-reduces). Each row's sum is one reduction over its own tokens in
        order, so it is the same whatever else the step holds (with batch-invariant steps, to the bit).
        A bidirectional encoder's rows are whole inputs (the scheduler feeds them whole), each token seeing all of
        its input's keys (its context: the row's), and each row runs within one graph call (`Buckets.row_pieces`):
        its keys must all be written before any of its tokens attends."""
        if not self.buckets.packed:
            raise ValueError("ModelRunner.execute: embeddings need the CPU kernel's packed prefill (attention_kernel "
                             "on)")
        inputs = StepInputs.make(self.limits, step, sampler=False)
        cfg = self.config
        h = cfg.hidden_size
        flat = self._flat_tokens(inputs)
        t = int(inputs.query_lens.sum())
        if cfg.causal:
            pieces, start = [], 0
            for tb in self.buckets.token_pieces(t):
                pieces.append((start, min(start + tb, t), tb))
                start += tb
        else:
            if (inputs.context_lens != inputs.query_lens).any():
                raise ValueError("ModelRunner.execute: a bidirectional encoder's embed step feeds whole inputs (each "
                                 "row's context its query length)")
            flat = flat[:5] + (inputs.context_lens[flat[1]].astype(np.int32),) + flat[6:]    # every key of its input
            pieces = self.buckets.row_pieces(inputs.query_lens)
        states = np.empty((t, h), np.float32)
        for start, stop, tb in pieces:
            states[start:stop] = self._call_embed(inputs, flat, start, stop, tb)[:stop - start]
        pooled = np.zeros((inputs.n, h), np.float32)
        if not self.tp.writes_outputs:
            return pooled
        if self.final_norm:
            eps = cfg.rms_norm_eps
            states *= (1.0 / np.sqrt(np.mean(states * states, axis=1, keepdims=True, dtype=np.float64) + eps)
                       ).astype(np.float32)
            states *= self.final_norm_gain
        ends = np.cumsum(inputs.query_lens)
        for i, (a, b) in enumerate(zip(ends - inputs.query_lens, ends)):
            if self.pooling == "mean":
                pooled[i] = states[a:b].sum(axis=0, dtype=np.float64)
            elif self.pooling == "last":
                pooled[i] = states[b - 1]
            elif inputs.positions[i, 0] == 0:            # cls: the input's first token is in this step
                pooled[i] = states[a]
        return pooled

    def _call_embed(self, step: StepInputs, flat: tuple, start: int, stop: int, tb: int) -> np.ndarray:
        """The Embedder graph of `tb` tokens on the step's real tokens start..stop-1 (inputs as `_call_packed`'s);
        (tb, H)."""
        T = self._ms.Tensor
        ids, pos, kv, context, lora = self._packed_inputs(step, flat, start, stop, tb)
        kv_slots, tables, kv_window_slots, kv_window_tables = self._kv_tensors(kv, (tb, 1))
        args = (T(ids.reshape(tb, 1)), T(pos.reshape(tb, 1)), kv_slots, tables, T(context),
                T(np.full(tb, -1, np.int32)), T(lora), kv_window_slots, kv_window_tables)
        return self._call("embed", (tb,), self.embedder, *args).asnumpy()

    _EXECUTE = {StepKind.PREFILL: _execute_step, StepKind.DECODE: _execute_step,
                StepKind.VERIFY: _execute_verify_step, StepKind.DECODE_RUN: _execute_decode_run,
                StepKind.EMBED: _execute_embed}

    def _no_outputs(self, n: int, return_logits: bool, wants_top: bool) -> list:
        """All-zero outputs for n rows, shaped as execute returns them."""
        out = [np.zeros(n, np.int32), np.zeros(n, np.float32)]
        if return_logits:
            out.append(np.zeros((n, self.config.vocab_size), np.float32))
        if wants_top:
            out += [np.zeros((n, self.top_k_logprobs), np.int32), np.zeros((n, self.top_k_logprobs), np.float32)]
        return out

    def _finish(self, outputs, n: int, rows: int, per_row: dict, return_logits: bool, live=None):
        """Greedy results of the model graph, or a sampling graph's when some row samples; first n rows. Rows with
        logit controls have them read from `live` (the step view) now, the master having written them meanwhile.
        A tensor-parallel rank other than 0 has no logits (its graph stops at the hidden state): zeros."""
        if not self.tp.writes_outputs:
            return tuple(self._no_outputs(n, return_logits, bool((per_row["top_n"] > 0).any())))
        token, logprob, logits = outputs
        T = self._ms.Tensor
        temperature, top_k, top_p = per_row["temperature"], per_row["top_k"], per_row["top_p"]
        sampling = temperature > 0
        penalized = "history" in per_row
        if penalized:        # penalties change the logits every row's choice comes from (greedy rows too)
            logits = self._call("penalizer", (rows,), self.penalizer, logits, T(_pad(per_row["history"], rows, 0)),
                                T(_pad(per_row["history_len"], rows, 0)), T(_pad(per_row["prompt_len"], rows, 0)),
                                T(_pad(per_row["repetition"], rows, 1.0)), T(_pad(per_row["presence"], rows, 0.0)),
                                T(_pad(per_row["frequency"], rows, 0.0)))
        if "controls_on" in per_row and per_row["controls_on"].any():
            per_row = {**per_row, **read_controls(live, per_row["row_index"], self.config.vocab_size, _step_error)}
        controlled = uses_controls(per_row)
        if controlled:       # bias, masks, min_p (logit_controls.py), on the host; the sampler then picks every row
            logits = T(apply_controls(logits.asnumpy(), per_row, _pad(temperature, rows, 0.0), owned=True))
        if sampling.any() or penalized or controlled:   # a sampling graph on the logits (which stay in MindSpore memory)
            filters = ((top_k[sampling] > 0) & (top_k[sampling] < self.config.vocab_size)).any() \
                or (top_p[sampling] < 1.0).any()
            kind, cell = ("sampler", self.sampler) if filters else ("plain_sampler", self.plain_sampler)
            token, logprob = self._call(kind, (rows,), cell, logits, T(_pad(temperature, rows, 0.0)),
                                        T(_pad(top_k, rows, 0)), T(_pad(top_p, rows, 1.0)),
                                        T(_pad(per_row["random_u"], rows, 0.0)))
        out = [token.asnumpy()[:n].astype(np.int32), logprob.asnumpy()[:n].astype(np.float32)]
        if return_logits:
            out.append(logits.asnumpy()[:n])
        if (per_row["top_n"] > 0).any():
            top_ids, top_lps = self._call("top_logprobs", (rows,), self.top_logprobs, logits)
            out += [top_ids.asnumpy()[:n], top_lps.asnumpy()[:n]]
        return tuple(out)

    def _execute_packed(self, step: StepInputs, return_logits: bool, scores: "Optional[PromptScores]" = None):
        """A prefill step as its real tokens side by side: token k of row i is a 'row' of a decode-shaped
        graph (S=1) with row i's block table and context (keys 0 .. its position), which the paged-attention
        kernel attends through; the K/V of all of a graph call's tokens are written before any layer attends,
        so a token sees the earlier tokens of its own row. The tokens run as one or more graph calls, in
        order (`_token_pieces`); each call samples the rows whose last token it holds (sample_index).
        Padding tokens write to the scratch block and attend to nothing. With `scores` (a step that scores prompt
        tokens) every call returns the logits of all its tokens, from which `scores` takes the prompt tokens'
        log-probabilities and the rows' samplers their last token's."""
        ql, per_row = step.query_lens, step.per_row
        n = step.n
        t = int(ql.sum())
        flat = self._flat_tokens(step)
        last = np.cumsum(ql) - 1                                                       # (n,) each row's last token
        rows = self.prefill_batch_sizes[-1]
        results = []
        failure = None
        start = 0
        for tb in self.buckets.token_pieces(t):
            stop = min(start + tb, t)
            mine = np.nonzero((last >= start) & (last < stop))[0]                      # rows sampled by this call
            sample_index = _pad((last[mine] - start).astype(np.int32), rows, 0)
            if scores is None:
                outputs = self._call_packed(step, flat, start, stop, tb, sample_index)
            else:                       # every token's logits: the prompt's scores, then the rows' last tokens'
                outputs = self._call_packed(step, flat, start, stop, tb, np.arange(tb, dtype=np.int32))
                outputs = self._scored(outputs, step, flat, start, stop, sample_index, scores)
            start = stop
            if failure is not None:
                continue
            sub = {key: arr[mine] for key, arr in per_row.items()}
            try:
                results.append((mine, self._finish(outputs, len(mine), rows, sub, return_logits, step.live)))
            except Exception as exc:      # noqa: BLE001 - re-raised below
                if self.all_reduce is None:
                    raise
                # rank 0's sampling failed (it has no all-reduce); the peers are already in the next piece's
                # all-reduces: run the remaining model pieces with them, then fail the step, in step
                failure = exc
        if failure is not None:
            raise failure
        out = self._no_outputs(n, return_logits, step.wants_top)   # (calls without a top_n row leave it zero)
        for mine, res in results:
            for arr, part in zip(out, res):
                arr[mine] = part
        return tuple(out)

    def _scored(self, outputs, step: StepInputs, flat: tuple, start: int, stop: int, sample_index, scores):
        """A packed call's outputs over all its tokens: the prompt tokens' scores recorded, and the outputs of the
        tokens in sample_index (the rows sampled by the call) returned as a sampling call's."""
        token, logprob, logits = outputs
        T = self._ms.Tensor
        logits = logits.asnumpy()
        valid, row_of = flat[:2]
        cols = np.nonzero(valid)[1][start:stop]
        scores.add(logits[:stop - start], row_of[start:stop], cols, step.prompt_target, step.prompt_top)
        return (T(token.asnumpy()[sample_index]), T(logprob.asnumpy()[sample_index]), T(logits[sample_index]))

    @staticmethod
    def _flat_tokens(step: StepInputs) -> tuple:
        """The step's real tokens in row-major order: valid (n, s) marks them; row_of, ids, positions, slots,
        context (keys each token sees) and window slots (None without a window pool), (t,) each."""
        valid = np.arange(step.s)[None, :] < step.query_lens[:, None]                  # (n, s)
        row_of = np.repeat(np.arange(step.n), step.query_lens)                          # (t,)
        context = ((step.context_lens - step.query_lens)[row_of] + np.nonzero(valid)[1] + 1).astype(np.int32)
        window_slots = None if step.window_slots is None else step.window_slots[valid]
        return (valid, row_of, step.input_ids[valid], step.positions[valid], step.slot_mapping[valid], context,
                window_slots)

    def _call_packed(self, step: StepInputs, flat: tuple, start: int, stop: int, tb: int, sample_index,
                     tree_bits: Optional[np.ndarray] = None):
        """The model graph of `tb` tokens on the step's real tokens start..stop-1 (`flat`: _flat_tokens(step)),
        padding after them; tree_bits: each real token's visible keys (a token tree's nodes; default all)."""
        ids, pos, kv, context, lora = self._packed_inputs(step, flat, start, stop, tb)
        bits = np.full(tb, -1, np.int32)
        if tree_bits is not None:
            bits[:stop - start] = tree_bits[start:stop]
        return self._run_packed(tb, ids, pos, kv, context, sample_index, bits, lora)

    def _packed_inputs(self, step: StepInputs, flat: tuple, start: int, stop: int, tb: int) -> tuple:
        """(ids, positions, KV inputs, context, LoRA slot) of the step's real tokens start..stop-1 padded to `tb`:
        each token its row's tables (padded as _call_padded's), context 0 for padding, each token its adapter."""
        row_of, ids, pos, slots, context = (a[start:stop] for a in flat[1:6])
        window_slots = None if flat[6] is None else flat[6][start:stop]
        window_tables = None if window_slots is None else step.window_tables[row_of]
        kv = self._kv_inputs(slots, step.block_tables[row_of], window_slots, window_tables, (tb,),
                             self.max_blocks_per_seq, self._layer_kernel_runs(tb))
        return _pad(ids, tb, 0), _pad(pos, tb, 0), kv, _pad(context, tb, 0), _pad(step.lora[row_of], tb, 0)

    def _run_packed(self, tb, ids, pos, kv, context, sample_index, tree_bits=None, lora=None,
                    compile_only: bool = False):
        """The model graph of tb packed tokens; kv: `_kv_inputs`' (tb,) slots and (tb, max_blocks_per_seq)
        tables."""
        T = self._ms.Tensor
        bits = np.full(tb, -1, np.int32) if tree_bits is None else tree_bits
        lora = np.zeros(tb, np.int32) if lora is None else lora
        slots, tables, window_slots, window_tables = self._kv_tensors(kv, (tb, 1))
        args = (T(ids.reshape(tb, 1)), T(pos.reshape(tb, 1)), slots, tables, T(context),
                T(np.ones(tb, np.int32)), T(sample_index), T(bits), T(lora), window_slots, window_tables)
        if compile_only:                 # warmup: compiled (or loaded from the compile cache), not run
            if self._plan is not None:
                self._plan.before_call(("packed", (tb, sample_index.shape[0])))
            return self.model.compile(*args)
        return self._call("packed", (tb, sample_index.shape[0]), self.model, *args)

    def _layer_kernel_runs(self, tokens: int) -> bool:
        """Whether a one-token-per-row step of `tokens` rows runs the layer kernel (LlamaForCausalLM's `fused`),
        whose padding rows sit out (slot -1) and cost nothing; MindSpore's ops need them in the scratch block."""
        return self.layer_kernel is not None and tokens <= self.layer_kernel_rows

    def _call(self, kind: str, shape: tuple, cell, *args):
        """Run a graph (kind and bucket shape name it in logs and errors).

        Under tensor parallelism the model graph all-reduces with the peers, so its failure on this rank, for
        whatever reason, leaves the group out of step (the peers wait in an all-reduce this rank never
        reaches, or the counts of calls no longer agree): it becomes a TensorParallelError, fatal for the
        group, saying why (the all-reduce's own reason when it was the cause; MindSpore only says that a
        kernel failed). The graph is waited for here (a device may run it asynchronously), so that a
        failure surfaces in this step, and every completed one is counted in `collective_calls`, which
        each step's reply carries: ranks that report the same count are in step."""
        if self._plan is not None:          # a staged warmup's entries left: this graph's may come first
            self._plan.before_call((kind, shape))
        if self.all_reduce is None or (cell is not self.model and cell is not self.embedder):
            return self._graphs(cell, *args)
        try:
            out = self._graphs(cell, *args)
            self._ms.runtime.synchronize()
        except Exception as exc:                  # noqa: BLE001 - any failure here is the group's
            why = self.all_reduce.error() or f"{type(exc).__name__}: {exc}"
            raise TensorParallelError(f"{kind} graph {shape}: {why}") from exc
        self.collective_calls += 1
        return out

    def _run_dummy(self, b: int, s: int, temperature: float, width: Optional[int] = None) -> None:
        """One step of bucket (b, s) [and decode width] that writes only to the scratch block."""
        pos = np.minimum(np.arange(s, dtype=np.int32), self.max_context - 1)
        context = pos[-1] + 1 if width is None else width * self.block_size
        kind = StepKind.DECODE if s == 1 else StepKind.PREFILL
        slots, tables = np.full((b, s), -1, np.int32), np.zeros((b, 1), np.int32)
        self.execute(StepView(kind, input_ids=np.zeros((b, s), np.int32), positions=np.tile(pos, (b, 1)),
                              slot_mapping=slots, block_tables=tables, window_slots=slots, window_tables=tables,
                              context_lens=np.full((b,), context, np.int32), query_lens=np.full((b,), s, np.int32),
                              temperature=np.full((b,), temperature, np.float32), top_k=np.zeros((b,), np.int32),
                              top_p=np.ones((b,), np.float32), random_u=np.full((b,), 0.5, np.float32)))

    def _run_dummy_packed(self, tokens: int, temperature: float, compile_only: bool = False) -> None:
        """One packed prefill step of `tokens` padding tokens (scratch block only, nothing attended); with
        compile_only its model graph is only compiled."""
        rows = self.prefill_batch_sizes[-1]
        none, no_tables = np.zeros(0, np.int32), np.zeros((0, 1), np.int32)    # every token padding
        kv = self._kv_inputs(none, no_tables, none if self.window_blocks else None, no_tables, (tokens,),
                             self.max_blocks_per_seq, self._layer_kernel_runs(tokens))
        zeros = np.zeros(tokens, np.int32)
        outputs = self._run_packed(tokens, zeros, zeros, kv, zeros, np.zeros(rows, np.int32),
                                   compile_only=compile_only)
        if compile_only:
            return
        per_row = {"temperature": np.full(rows, temperature, np.float32), "top_k": np.zeros(rows, np.int32),
                   "top_p": np.ones(rows, np.float32), "random_u": np.full(rows, 0.5, np.float32),
                   "top_n": np.zeros(rows, np.int32)}
        self._finish(outputs, rows, rows, per_row, False)

    def _run_dummy_embed(self, tokens: int, compile_only: bool = False) -> None:
        """The Embedder graph of `tokens` padding tokens (nothing written but the scratch block, nothing attended); with
        compile_only only compiled (the larger buckets: running them costs a deep model seconds)."""
        none, no_tables = np.zeros(0, np.int32), np.zeros((0, 1), np.int32)    # every token padding
        kv = self._kv_inputs(none, no_tables, none if self.window_blocks else None, no_tables, (tokens,),
                             self.max_blocks_per_seq, self._layer_kernel_runs(tokens))
        T = self._ms.Tensor
        zeros = np.zeros(tokens, np.int32)
        slots, tables, window_slots, window_tables = self._kv_tensors(kv, (tokens, 1))
        args = (T(zeros.reshape(tokens, 1)), T(zeros.reshape(tokens, 1)), slots, tables, T(zeros),
                T(np.full(tokens, -1, np.int32)), T(zeros), window_slots, window_tables)
        if compile_only:
            if self._plan is not None:
                self._plan.before_call(("embed", (tokens,)))
            self.embedder.compile(*args)
            return
        self._call("embed", (tokens,), self.embedder, *args)

    def _run_dummy_verify(self, size: int, temperature: float) -> None:
        """One verify step filling verify bucket `size` (its tokens packed, its rows unpacked) with padding
        tokens (scratch block only)."""
        s = self.buckets.verify_width
        n = size // s if self.buckets.packed else size
        pos = np.tile(np.arange(s, dtype=np.int32), (n, 1))
        slots, tables = np.full((n, s), -1, np.int32), np.zeros((n, 1), np.int32)
        self.execute(StepView(StepKind.VERIFY, input_ids=np.zeros((n, s), np.int32), positions=pos,
                              slot_mapping=slots, block_tables=tables, window_slots=slots, window_tables=tables,
                              context_lens=np.full((n,), s, np.int32), query_lens=np.full((n,), s, np.int32),
                              temperature=np.full((n,), temperature, np.float32), top_k=np.zeros((n,), np.int32),
                              top_p=np.ones((n,), np.float32), random_u=np.zeros((n,), np.float32),
                              verify_random_u=np.full((n, s), 0.5, np.float32)))

    def graph_buckets(self) -> list:
        """(kind, batch, seq, decode width) of every model graph warmup compiles, in order."""
        return self.buckets.graphs()

    def warmup(self, progress: Optional[Callable[[str], None]] = None, peer_timeout_s: Optional[float] = None,
               staged: bool = False) -> None:
        """Compile and run once every bucket (the KV cache is left as it was, apart from the scratch block), in the
        warmup plan's order (warmup.py). staged: only the graphs a first request needs, when the compile cache
        knows the rest; those follow by `warm_next` (when idle) or before a step that calls one (`_call`), and
        `warming` says whether any is left. Under tensor parallelism every rank warms up the same buckets in the
        same order, each graph's all-reduces meeting the peers' (which may still be loading or compiling: they
        wait up to peer_timeout_s, then the step timeout again): never staged."""
        if self.all_reduce is not None and peer_timeout_s is not None:
            self.all_reduce.set_timeout(peer_timeout_s)
        plan = WarmupPlan(self._warmup_entries(), self._cache_dir)
        self.warmup_plan = self._plan = plan
        try:
            plan.run(staged and self.tp.world == 1, progress)
        except BaseException:
            plan.abandon()
            raise
        finally:
            if self.all_reduce is not None:
                self.all_reduce.set_timeout(self.tp_timeout_s)
            if not plan.pending:
                self._plan = None

    @property
    def warming(self) -> bool:
        """Whether warmup entries are left (a staged warmup's, until `warm_next` or steps have run them all)."""
        return self._plan is not None

    def warm_next(self, progress: Optional[Callable[[str], None]] = None) -> bool:
        """Run the next pending warmup entry; whether any is left. An entry that fails ends the plan (its graphs
        and the rest's compile when a step needs them, outside the cache) and raises."""
        plan = self._plan
        if plan is None:
            return False
        try:
            plan.warm_next(progress)
        except BaseException:
            plan.abandon()
            raise
        finally:
            if not plan.pending:
                self._plan = None
        return self._plan is not None

    def _warmup_entries(self) -> list:
        """The warmup plan's entries in compile order: the graphs a first request needs (the smallest decode run,
        decode bucket and prefill bucket), then what a first request's longer prompt needs (the other prefill
        buckets, smallest first: a chat template's system prompt alone fills SmolLM2's smallest), then the smallest
        verify bucket (prompt lookup, on by default, verifies as soon as a reply repeats itself), then what
        concurrent requests need (the other decode runs and decode buckets, the other verify buckets). Read on
        demand, a first request's longer prompt or first verify step costs one entry or a few. A decode run's
        compile leaves ~80 MiB of freed heap behind (glibc keeps it, among live blocks), which the later graphs'
        compile state then fills instead of growing the heap: one comes first."""
        if not self.config.generates:           # an embedding model: its embed graphs, the smallest first
            return [Entry(f"embed bucket (T={tb} tokens)", lambda tb=tb: self._run_dummy_embed(tb, compile_only=i > 0),
                          first=i == 0) for i, tb in enumerate(self.prefill_token_sizes)]
        ranked = []         # (0: a first request's, 1: the other prefill buckets, 2: the first verify one, 3: the rest)
        for i, b in enumerate(self.decode_run_batch_sizes()):
            ranked.append((0 if i == 0 else 3, Entry(f"decode run ({self.decode_run_steps} steps, B={b})",
                                                     lambda b=b: self._run_decode_run(b, None, None), first=i == 0)))
        seen_kinds = set()
        for kind, b, s, w in self.graph_buckets():
            name = kind if kind in ("decode", "verify") else "prefill"
            shape = (f"T={b} tokens, {self.prefill_batch_sizes[-1]} rows" if kind == "packed"
                     else f"T={b} tokens" if kind == "verify" and s is None
                     else f"B={b}, S={s}" + (f", W={w}" if w is not None else ""))
            rank = (0 if kind not in seen_kinds and kind != "verify" else 1 if kind in ("packed", "prefill")
                    else 2 if kind not in seen_kinds else 3)
            seen_kinds.add(kind)
            ranked.append((rank, Entry(f"{name} bucket ({shape})", lambda k=(kind, b, s, w): self._warm_bucket(*k),
                                       first=rank == 0)))
        return [entry for _, entry in sorted(ranked, key=lambda r: r[0])]      # (stable: each part's order kept)

    def _warm_bucket(self, kind: str, b: int, s: Optional[int], w: Optional[int]) -> None:
        if kind == "packed" and b != self.prefill_token_sizes[0]:
            # a larger bucket's model graph is compiled (or loaded from the cache) but not run: running the
            # largest buckets of a deep model costs seconds each
            self._run_dummy_packed(b, 0.0, compile_only=True)
        elif kind == "packed":
            for temperature in (0.0, 1.0):          # greedy, then the temperature sampler for its rows
                self._run_dummy_packed(b, temperature)
        elif kind == "verify":
            for temperature in (0.0, 1.0):
                self._run_dummy_verify(b, temperature)
        else:
            self._run_dummy(b, s, 0.0, w)       # the model graph (greedy)
            if w is None or w == self.decode_block_widths[0]:   # the sampler depends on the batch size only
                self._run_dummy(b, s, 1.0, w)   # + the temperature-only sampler for this batch size

    def reset(self) -> None:
        """Zero the KV cache."""
        for p in self._caches:
            p.set_data(self._ms.ops.zeros(p.shape, p.dtype))
