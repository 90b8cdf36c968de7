"""ModelRunner: numpy in, numpy out, over static-shape MindSpore graphs (one per (batch, seq) bucket).

The KV cache lives in the model's Parameters: per layer, key and value holding
[(num_blocks + 1) * block_size, num_kv_heads, head_dim] float32 (stored flat as
[slots * num_kv_heads, head_dim], same memory order; see attention.py). The last block is scratch:
padding tokens (slot -1) and padding rows write there, so real blocks are never touched by padding.

Process-wide MindSpore setup done here: GRAPH_MODE, the device, the CPU kernel thread count
(`num_threads`, settable once per process), and MindSpore's graph compile cache under
<cache>/ms_compile/<model+geometry+source hash>/<graph>_<shape>/, where <cache> is $LLM_SERVING_CACHE
or ~/.cache/llm-serving (set LLM_SERVING_COMPILE_CACHE=0 to disable). MindSpore names cached graphs by compile order, not by input
shape, so each graph shape gets its own directory: a graph cached for one shape is never loaded for
another (which otherwise happens when buckets are first used in a different order).

Graphs: the model, one per (batch, seq) bucket, returning greedy ids/logprobs and the logits Tensor;
the sampler, one per batch size (two variants: with and without top-k/top-p), run on those logits
only when some row has temperature > 0. With the CPU paged-attention kernel, prefill steps are *packed*:
the step's real tokens side by side, in token buckets (powers of two from the smallest prefill_seq_len
to max prefill batch x max seq len, or max_step_tokens if smaller), each token attending through its own
row's block table like a decode row, and max(prefill_batch_sizes) rows sampled; a prompt of 17 tokens costs 17
tokens, not a 32-token row, and a step that would pad a bucket badly runs as several calls (bench model,
16 prompts of 17 tokens: 647 -> 304 ms; serving 64 streams: TTFT p50 797 -> 397 ms). Without the kernel
(no compiler, or Ascend) prefill runs per (batch, seq) bucket.
"""
from __future__ import annotations

import bisect
import hashlib
import logging
import os
import time
from typing import Callable, Optional

import numpy as np

from llm_serving.shm.layout import TOP_LOGPROBS

from .parallel import TensorParallel, TensorParallelError, all_reduce_kernel, make_all_reduce
from .weights import LlamaConfig, load_llama_weights
from .default_model import default_cache_dir

logger = logging.getLogger(__name__)

__all__ = ["ModelRunner"]



def _model_source_digest() -> str:
    """Hash of the graph-defining sources and the MindSpore version (part of the compile-cache key)."""
    import mindspore as ms

    h = hashlib.sha1(ms.__version__.encode())
    here = os.path.dirname(os.path.abspath(__file__))
    for name in ("llama.py", "attention.py", "sampler.py"):
        with open(os.path.join(here, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def _token_buckets(smallest: int, largest: int) -> list[int]:
    """Powers of two from `smallest` up, then `largest`: padding a packed step wastes < half its tokens."""
    sizes = [smallest]
    while sizes[-1] * 2 < largest:
        sizes.append(sizes[-1] * 2)
    return sorted(set(sizes) | {largest})


def _pad(arr: np.ndarray, size: int, fill) -> np.ndarray:
    """arr (n, ...) padded with `fill` to (size, ...)."""
    out = np.full((size,) + arr.shape[1:], fill, arr.dtype)
    out[:len(arr)] = arr
    return out


_runners_in_process = 0   # MindSpore's compile cache is process-wide; see ModelRunner's compile_cache


def _setup_mindspore(device_target: str, device_id: int, num_threads: Optional[int], cache_key: Optional[str]):
    """Process-wide MindSpore setup; safe to call again with the same arguments.

    MindSpore 2.10 reads MS_COMPILER_CACHE_PATH once, at the process's first compile, and names cached
    graphs by their compile index in the process (compile_cache_N.mindir) with no shape check. A cache is
    only safe when the same sequence of graphs is compiled in the same order every time: one runner per
    process, warmed up bucket by bucket, with every input of that sequence in `cache_key`.
    """
    import mindspore as ms

    cache_dir = None
    if cache_key is not None and os.environ.get("LLM_SERVING_COMPILE_CACHE", "1") == "1":
        cache_dir = os.path.join(str(default_cache_dir()), "ms_compile", cache_key)
        try:
            os.makedirs(cache_dir, exist_ok=True)
        except OSError as e:
            logger.warning("compile cache disabled: cannot create %s (%s)", cache_dir, e)
            cache_dir = None
    if cache_dir is not None:
        os.environ["MS_COMPILER_CACHE_ENABLE"] = "1"
        os.environ["MS_COMPILER_CACHE_PATH"] = cache_dir
    else:
        os.environ["MS_COMPILER_CACHE_ENABLE"] = "0"
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        ms.set_device(device_target, device_id)
    except RuntimeError as e:  # already set by an earlier runner in this process
        logger.debug("ms.set_device: %s", e)
    if num_threads is not None:
        from mindspore._c_expression import RuntimeConf
        if RuntimeConf.get_instance().is_op_threads_num_configured():
            logger.info("MindSpore CPU thread count is set once per process; ignoring num_threads=%s", num_threads)
        else:
            ms.device_context.cpu.op_tuning.threads_num(int(num_threads))
    return cache_dir


def _close_compile_cache() -> None:
    """Graphs compiled from now on are neither loaded from nor written to the compile cache (MindSpore reads
    MS_COMPILER_CACHE_ENABLE at each compile): their order is not fixed, so their compile index names nothing."""
    os.environ["MS_COMPILER_CACHE_ENABLE"] = "0"


class ModelRunner:
    """Runs the LLaMA in `model_dir` over a paged KV cache; see `execute` for one step.

    Attributes: config (LlamaConfig), num_blocks, block_size, max_blocks_per_seq, the bucket lists (sorted),
    num_slots ((num_blocks + 1) * block_size), max_context (max_blocks_per_seq * block_size).

    compile_cache=True (the agent's runner) keeps compiled graphs under the project cache dir, keyed by
    everything that decides warmup's compile sequence; only the first runner of a process can use it.
    """

    def __init__(self, model_dir: str, *, num_blocks: int, block_size: int, max_blocks_per_seq: int,
                 decode_batch_sizes: list[int], prefill_batch_sizes: list[int], prefill_seq_lens: list[int],
                 decode_block_widths: Optional[list[int]] = None,
                 device_target: str = "CPU", device_id: int = 0, num_threads: Optional[int] = None,
                 compile_cache: bool = False, attention_kernel: str = "auto",
                 max_step_tokens: Optional[int] = None, tp: Optional["TensorParallel"] = None,
                 tp_timeout_s: float = 120.0):
        for key, val in (("num_blocks", num_blocks), ("block_size", block_size),
                         ("max_blocks_per_seq", max_blocks_per_seq)):
            if not isinstance(val, (int, np.integer)) or val < 1:
                raise ValueError(f"ModelRunner: {key} must be a positive integer, got {val!r}")
        for key, val in (("decode_batch_sizes", decode_batch_sizes), ("prefill_batch_sizes", prefill_batch_sizes),
                         ("prefill_seq_lens", prefill_seq_lens)):
            if not val or any((not isinstance(v, (int, np.integer))) or v < 1 for v in val):
                raise ValueError(f"ModelRunner: {key} must be a non-empty list of positive integers, got {val!r}")
        if not any(s >= 2 for s in prefill_seq_lens):
            raise ValueError(f"ModelRunner: prefill_seq_lens needs a length >= 2 (s=1 always uses the decode "
                             f"graph), got {prefill_seq_lens!r}")
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.max_blocks_per_seq = int(max_blocks_per_seq)
        self.decode_batch_sizes = sorted(set(int(b) for b in decode_batch_sizes))
        self.prefill_batch_sizes = sorted(set(int(b) for b in prefill_batch_sizes))
        self.prefill_seq_lens = sorted(set(int(s) for s in prefill_seq_lens if s >= 2))
        widths = decode_block_widths or [self.max_blocks_per_seq]
        if any((not isinstance(v, (int, np.integer))) or not 1 <= v <= self.max_blocks_per_seq for v in widths):
            raise ValueError(f"ModelRunner: decode_block_widths must be integers in [1, max_blocks_per_seq="
                             f"{self.max_blocks_per_seq}], got {widths!r}")
        if attention_kernel not in ("auto", "on", "off"):
            raise ValueError(f"ModelRunner: attention_kernel must be 'auto', 'on' or 'off', got {attention_kernel!r}")
        # CPU decode attends through the paged-attention kernel (kernels/) when it builds; 'auto' falls back
        # to gathering the keys (attention.py) when there is no C++ compiler, 'on' makes that an error
        self.decode_kernel = None
        if device_target == "CPU" and attention_kernel != "off":
            from .kernels import KernelBuildError, build_kernel
            try:
                self.decode_kernel = build_kernel("paged_attention_cpu", "PagedDecodeAttention")
            except KernelBuildError as e:
                if attention_kernel == "on":
                    raise
                logger.warning("CPU paged-attention kernel unavailable; decode steps gather keys instead: %s", e)
        # Decode graphs that gather keys exist per (batch, block-table width): a step gathers only the keys its
        # rows can have. Kernels that read the cache through the block table (CPU kernel, Ascend) need one width.
        if self.decode_kernel is not None or device_target == "Ascend":
            widths = [self.max_blocks_per_seq]
        self.decode_block_widths = sorted(set(int(v) for v in widths) | {self.max_blocks_per_seq})
        # With the CPU kernel a prefill step is packed: its real tokens side by side (no per-row padding to a
        # seq bucket), each attending through its own row's block table, padded to a token bucket; one graph
        # per token bucket, all sampling max(prefill_batch_sizes) rows.
        self.packed_prefill = self.decode_kernel is not None
        # (the scheduler never puts more than max_step_tokens = max_num_batched_tokens in a step)
        most = self.prefill_batch_sizes[-1] * self.prefill_seq_lens[-1]
        if max_step_tokens is not None:
            most = max(min(most, int(max_step_tokens)), self.prefill_seq_lens[-1])
        self.prefill_token_sizes = _token_buckets(self.prefill_seq_lens[0], most)
        self.device_target = device_target
        self.num_slots = (self.num_blocks + 1) * self.block_size
        self.scratch_slot = self.num_blocks * self.block_size     # first slot of the scratch block
        self.max_context = self.max_blocks_per_seq * self.block_size

        self.tp = tp if tp is not None else TensorParallel()
        self.config, weights = load_llama_weights(model_dir, self.tp)    # this rank's part only
        cfg: LlamaConfig = self.config
        cfg.check_context(self.max_context)       # e.g. a sliding window the longest request would outgrow
        global _runners_in_process
        _runners_in_process += 1
        reduce_kernel = all_reduce_kernel(self.tp, device_target)
        cache_key = None
        if compile_cache and _runners_in_process == 1:
            # everything that decides which graphs warmup() compiles, and in which order, and the kernel
            # libraries the graphs name
            key_src = repr((cfg, self.num_blocks, self.block_size, self.max_blocks_per_seq, self.decode_batch_sizes,
                            self.decode_block_widths, self.prefill_batch_sizes, self.prefill_seq_lens,
                            self.prefill_token_sizes, device_target,
                            (self.tp.rank, self.tp.world, self.tp.backend) if self.tp.world > 1 else None,
                            self.decode_kernel, reduce_kernel, _model_source_digest()))
            cache_key = hashlib.sha1(key_src.encode()).hexdigest()[:16]
        elif compile_cache:
            logger.warning("compile cache off: another ModelRunner already exists in this process")
        self._cache_dir = _setup_mindspore(device_target, device_id, num_threads, cache_key)

        import mindspore as ms
        from .llama import LlamaForCausalLM
        from .sampler import Penalizer, Sampler, TopLogprobs
        self._ms = ms
        # the group's all-reduce (None for one agent); its wait for peers is start-up-sized until warmup ends
        self.all_reduce = make_all_reduce(self.tp, device_target, timeout_s=tp_timeout_s, kernel=reduce_kernel)
        self.tp_timeout_s = tp_timeout_s
        self.collective_calls = 0        # model graph calls completed (all-reduces made with the peers)
        self.model = LlamaForCausalLM(cfg, weights, num_slots=self.num_slots, block_size=self.block_size,
                                      max_positions=self.max_context, device_target=device_target,
                                      decode_kernel=self.decode_kernel,
                                      kernel_threads=num_threads or len(os.sched_getaffinity(0)),
                                      tp=self.tp, all_reduce=self.all_reduce)
        self.model.set_train(False)
        self.sampler = Sampler(cfg.vocab_size, filters=True)          # some sampling row uses top-k/top-p
        self.plain_sampler = Sampler(cfg.vocab_size, filters=False)   # temperature only
        self.sampler.set_train(False)
        self.plain_sampler.set_train(False)
        self.top_k_logprobs = min(TOP_LOGPROBS, cfg.vocab_size)
        self.top_logprobs = TopLogprobs(self.top_k_logprobs)             # some row asks for top logprobs
        self.top_logprobs.set_train(False)
        self.penalizer = Penalizer()                                    # some row has a sampling penalty
        self.penalizer.set_train(False)
        self._caches = [p for layer in self.model.layers for p in (layer.attn.key_cache, layer.attn.value_cache)]

    # ------------------------------------------------------------------ buckets
    def _width(self, s: int, needed: int) -> int:
        """Block-table width of the graph for a step whose longest row has `needed` blocks."""
        if s > 1:
            return self.max_blocks_per_seq
        return self.decode_block_widths[bisect.bisect_left(self.decode_block_widths, needed)]

    def _bucket(self, n: int, s: int) -> tuple[int, int]:
        if s == 1:
            sizes, seq = self.decode_batch_sizes, 1
        else:
            i = bisect.bisect_left(self.prefill_seq_lens, s)
            if i == len(self.prefill_seq_lens):
                raise ValueError(f"ModelRunner.execute: query length {s} exceeds the largest prefill bucket "
                                 f"{self.prefill_seq_lens[-1]} (prefill_seq_lens={self.prefill_seq_lens})")
            sizes, seq = self.prefill_batch_sizes, self.prefill_seq_lens[i]
        j = bisect.bisect_left(sizes, n)
        if j == len(sizes):
            kind = "decode_batch_sizes" if s == 1 else "prefill_batch_sizes"
            raise ValueError(f"ModelRunner.execute: batch of {n} rows exceeds the largest {kind} bucket "
                             f"{sizes[-1]} ({kind}={sizes})")
        return sizes[j], seq

    # ------------------------------------------------------------------ execution
    def execute(self, input_ids, positions, slot_mapping, block_tables, context_lens, query_lens,
                temperature, top_k, top_p, random_u, return_logits: bool = False, top_n=None, penalties=None):
        """One step over n sequences; returns (next_token_ids int32 (n,), logprobs float32 (n,)), and with
        return_logits also the model's logits float32 (n, vocab) at each row's last new token (before
        temperature; copied to the host only when asked, for logits capture), and when some row of top_n
        (n,) is > 0 also (top_ids int32 (n, K), top_logprobs float32 (n, K)): each row's K = min(TOP_LOGPROBS,
        vocab) most likely tokens under log_softmax(logits), most likely first. penalties: None, or a dict of
        per-row arrays (see Penalizer): history int32 (n, <= max_context), history_len, prompt_len (n,),
        repetition, presence, frequency (n,); rows with a penalty then choose from (and report the logprobs
        and top logprobs of) the penalized logits.

        input_ids, positions, slot_mapping: int32 (n, s), new tokens left-aligned (padding: id 0, position 0,
        slot -1). block_tables int32 (n, w <= max_blocks_per_seq), padded with 0. context_lens (n,): tokens
        in the cache after this step's are written; query_lens (n,): valid new tokens (the sampled token
        follows token query_lens-1). temperature (0 = greedy), top_k (0 = off), top_p (1 = off),
        random_u (uniform [0, 1) per row). n is padded to the smallest batch bucket >= n, s to 1 (decode)
        or the smallest prefill_seq_len >= s, w to max_blocks_per_seq. ValueError if no bucket fits or an
        argument is malformed.
        """
        input_ids = np.asarray(input_ids, np.int32)
        if input_ids.ndim != 2 or input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
            raise ValueError(f"ModelRunner.execute: input_ids must be (n, s) with n, s >= 1, got {input_ids.shape}")
        n, s = input_ids.shape
        positions = np.asarray(positions, np.int32)
        slot_mapping = np.asarray(slot_mapping, np.int32)
        block_tables = np.asarray(block_tables, np.int32)
        if block_tables.ndim == 1:
            block_tables = block_tables.reshape(n, -1)
        per_row = {"context_lens": np.asarray(context_lens, np.int32), "query_lens": np.asarray(query_lens, np.int32),
                   "temperature": np.asarray(temperature, np.float32), "top_k": np.asarray(top_k, np.int32),
                   "top_p": np.asarray(top_p, np.float32), "random_u": np.asarray(random_u, np.float32),
                   "top_n": np.zeros(n, np.int32) if top_n is None else np.asarray(top_n, np.int32)}
        if penalties is not None:
            pen = {k: np.asarray(penalties[k], np.float32) for k in ("repetition", "presence", "frequency")}
            if ((pen["repetition"] != 1.0) | (pen["presence"] != 0.0) | (pen["frequency"] != 0.0)).any():
                history = np.asarray(penalties["history"], np.int32)
                if history.ndim != 2 or history.shape[0] != n or history.shape[1] > self.max_context:
                    raise ValueError(f"ModelRunner.execute: penalties history has shape {history.shape}, "
                                     f"expected ({n}, <= {self.max_context})")
                full = np.zeros((n, self.max_context), np.int32)
                full[:, :history.shape[1]] = np.clip(history, 0, self.config.vocab_size - 1)
                per_row.update(pen, history=full,
                               history_len=np.minimum(np.asarray(penalties["history_len"], np.int32), history.shape[1]),
                               prompt_len=np.asarray(penalties["prompt_len"], np.int32))
        for name, arr in (("positions", positions), ("slot_mapping", slot_mapping)):
            if arr.shape != (n, s):
                raise ValueError(f"ModelRunner.execute: {name} has shape {arr.shape}, expected {(n, s)}")
        if (block_tables.ndim != 2 or block_tables.shape[0] != n
                or not 1 <= block_tables.shape[1] <= self.max_blocks_per_seq):
            raise ValueError(f"ModelRunner.execute: block_tables has shape {block_tables.shape}, expected ({n}, w) "
                             f"with 1 <= w <= max_blocks_per_seq={self.max_blocks_per_seq}")
        for name, arr in per_row.items():
            if name != "history" and arr.shape != (n,):
                raise ValueError(f"ModelRunner.execute: {name} has shape {arr.shape}, expected ({n},)")
        ql, cl = per_row["query_lens"], per_row["context_lens"]
        if ql.min() < 1 or ql.max() > s:
            raise ValueError(f"ModelRunner.execute: query_lens must be in [1, {s}], got {ql.tolist()}")
        if cl.min() < 1 or cl.max() > self.max_context:
            raise ValueError(f"ModelRunner.execute: context_lens must be in [1, {self.max_context}], got {cl.tolist()}")
        if positions.min() < 0 or positions.max() >= self.max_context:
            raise ValueError(f"ModelRunner.execute: positions must be in [0, {self.max_context}), "
                             f"got range [{positions.min()}, {positions.max()}]")
        if slot_mapping.min() < -1 or slot_mapping.max() >= self.scratch_slot:
            raise ValueError(f"ModelRunner.execute: slot_mapping must be -1 or in [0, {self.scratch_slot}), "
                             f"got range [{slot_mapping.min()}, {slot_mapping.max()}]")
        if input_ids.min() < 0 or input_ids.max() >= self.config.vocab_size:
            raise ValueError(f"ModelRunner.execute: token ids must be in [0, {self.config.vocab_size}), "
                             f"got range [{input_ids.min()}, {input_ids.max()}]")
        if block_tables.min() < 0 or block_tables.max() >= self.num_blocks:
            raise ValueError(f"ModelRunner.execute: block ids must be in [0, {self.num_blocks}), "
                             f"got range [{block_tables.min()}, {block_tables.max()}]")

        nb, sb = self._bucket(n, s)
        if s > 1 and self.packed_prefill:
            return self._execute_packed(input_ids, positions, slot_mapping, block_tables, cl, ql, per_row,
                                        return_logits)
        w = self._width(sb, -(-int(cl.max()) // self.block_size))
        scratch = self.scratch_slot + (np.arange(nb * sb, dtype=np.int32) % self.block_size).reshape(nb, sb)
        ids_p = np.zeros((nb, sb), np.int32)
        pos_p = np.zeros((nb, sb), np.int32)
        slot_p = scratch.copy()
        bt_p = np.zeros((nb, w), np.int32)
        ids_p[:n, :s] = input_ids
        pos_p[:n, :s] = positions
        slot_p[:n, :s] = np.where(slot_mapping < 0, scratch[:n, :s], slot_mapping)
        used = min(block_tables.shape[1], w)          # entries past the longest row's blocks are padding
        bt_p[:n, :used] = block_tables[:, :used]
        T = self._ms.Tensor
        outputs = self._call("model", (nb, sb), self.model, T(ids_p), T(pos_p), T(slot_p), T(bt_p),
                             T(_pad(cl, nb, 1)), T(_pad(ql, nb, 1)), T(np.arange(nb, dtype=np.int32)))
        return self._finish(outputs, n, nb, per_row, return_logits)

    def _finish(self, outputs, n: int, rows: int, per_row: dict, return_logits: bool):
        """Greedy results of the model graph, or a sampling graph's when some row samples; first n rows.
        A tensor-parallel rank other than 0 has no logits (its graph stops at the hidden state): zeros."""
        if not self.tp.writes_outputs:
            out = [np.zeros(n, np.int32), np.zeros(n, np.float32)]
            if return_logits:
                out.append(np.zeros((n, self.config.vocab_size), np.float32))
            if (per_row["top_n"] > 0).any():
                out += [np.zeros((n, self.top_k_logprobs), np.int32), np.zeros((n, self.top_k_logprobs), np.float32)]
            return tuple(out)
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
        if sampling.any() or penalized:   # a sampling graph on the logits (which stay in MindSpore memory)
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

    def _execute_packed(self, input_ids, positions, slot_mapping, block_tables, cl, ql, per_row, return_logits):
        """A prefill step as its real tokens side by side: token k of row i is a 'row' of a decode-shaped
        graph (S=1) with row i's block table and context (keys 0 .. its position), which the paged-attention
        kernel attends through; the K/V of all of a graph call's tokens are written before any layer attends,
        so a token sees the earlier tokens of its own row. The tokens run as one or more graph calls, in
        order (`_token_pieces`); each call samples the rows whose last token it holds (sample_index).
        Padding tokens write to the scratch block and attend to nothing."""
        n = input_ids.shape[0]
        t = int(ql.sum())
        valid = np.arange(input_ids.shape[1])[None, :] < ql[:, None]                  # (n, s), row-major order
        row_of = np.repeat(np.arange(n), ql)                                           # (t,)
        ids, pos = input_ids[valid], positions[valid]
        slots = slot_mapping[valid]
        used = min(block_tables.shape[1], self.max_blocks_per_seq)
        context = ((cl - ql)[row_of] + np.nonzero(valid)[1] + 1).astype(np.int32)   # keys each token sees
        last = np.cumsum(ql) - 1                                                       # (n,) each row's last token
        rows = self.prefill_batch_sizes[-1]
        results = []
        failure = None
        start = 0
        for tb in self._token_pieces(t):
            stop = min(start + tb, t)
            mine = np.nonzero((last >= start) & (last < stop))[0]                      # rows sampled by this call
            k = stop - start
            scratch = self.scratch_slot + (np.arange(tb, dtype=np.int32) % self.block_size)
            piece_slots = scratch.copy()
            piece_slots[:k] = np.where(slots[start:stop] < 0, scratch[:k], slots[start:stop])
            piece_tables = np.zeros((tb, self.max_blocks_per_seq), np.int32)
            piece_tables[:k, :used] = block_tables[row_of[start:stop], :used]     # each token: its row's table
            sample_index = _pad((last[mine] - start).astype(np.int32), rows, 0)
            outputs = self._run_packed(tb, _pad(ids[start:stop], tb, 0), _pad(pos[start:stop], tb, 0), piece_slots,
                                       piece_tables, _pad(context[start:stop], tb, 0),   # context 0: padding
                                       sample_index)
            start = stop
            if failure is not None:
                continue
            sub = {key: arr[mine] for key, arr in per_row.items()}
            try:
                results.append((mine, self._finish(outputs, len(mine), rows, sub, return_logits)))
            except Exception as exc:      # noqa: BLE001 - re-raised below
                if self.all_reduce is None:
                    raise
                # rank 0's sampling failed (it has no all-reduce); the peers are already in the next piece's
                # all-reduces: run the remaining model pieces with them, then fail the step, in step
                failure = exc
        if failure is not None:
            raise failure
        out = [np.zeros(n, np.int32), np.zeros(n, np.float32)]
        if return_logits:
            out.append(np.zeros((n, self.config.vocab_size), np.float32))
        if (per_row["top_n"] > 0).any():    # calls without such a row return no top arrays: left zero
            k = self.top_k_logprobs
            out += [np.zeros((n, k), np.int32), np.zeros((n, k), np.float32)]
        for mine, res in results:
            for arr, part in zip(out, res):
                arr[mine] = part
        return tuple(out)

    def _token_pieces(self, t: int) -> list[int]:
        """Token buckets whose sum covers t tokens: the smallest bucket that holds them, unless that would
        pad more than the smallest bucket's worth of tokens — then the largest bucket that fits runs first
        and the rest is split the same way (272 tokens with buckets ..., 256, 512: 256 + 32, not 512);
        more tokens than the largest bucket fill it as often as needed."""
        sizes = self.prefill_token_sizes
        pieces = []
        while t > 0:
            i = bisect.bisect_left(sizes, t)
            if i == len(sizes):                  # more than the largest bucket (max_step_tokens): fill it
                pieces.append(sizes[-1])
                t -= sizes[-1]
                continue
            fit = sizes[i]
            below = sizes[bisect.bisect_right(sizes, t) - 1] if t >= sizes[0] else None
            if below is None or fit - t <= sizes[0]:
                pieces.append(fit)
                break
            pieces.append(below)
            t -= below
        return pieces

    def _run_packed(self, tb, ids, pos, slots, tables, context, sample_index, compile_only: bool = False):
        T = self._ms.Tensor
        args = (T(ids.reshape(tb, 1)), T(pos.reshape(tb, 1)), T(slots.reshape(tb, 1)), T(tables), T(context),
                T(np.ones(tb, np.int32)), T(sample_index))
        if compile_only:                 # warmup: compiled (or loaded from the compile cache), not run
            return self.model.compile(*args)
        return self._call("packed", (tb, sample_index.shape[0]), self.model, *args)

    def _call(self, kind: str, shape: tuple, cell, *args):
        """Run a graph (kind and bucket shape name it in logs and errors).

        Under tensor parallelism the model graph all-reduces with the peers, so its failure on this rank, for
        whatever reason, leaves the group out of step (the peers wait in an all-reduce this rank never
        reaches, or the counts of calls no longer agree): it becomes a TensorParallelError, fatal for the
        group, saying why (the all-reduce's own reason when it was the cause; MindSpore only says that a
        kernel failed). The graph is waited for here (a device may run it asynchronously), so that a
        failure surfaces in this step, and every completed one is counted in `collective_calls`, which
        each step's reply carries: ranks that report the same count are in step."""
        if self.all_reduce is None or cell is not self.model:
            return cell(*args)
        try:
            out = cell(*args)
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
        self.execute(np.zeros((b, s), np.int32), np.tile(pos, (b, 1)), np.full((b, s), -1, np.int32),
                     np.zeros((b, 1), np.int32), np.full((b,), context, np.int32), np.full((b,), s, np.int32),
                     np.full((b,), temperature, np.float32), np.zeros((b,), np.int32),
                     np.ones((b,), np.float32), np.full((b,), 0.5, np.float32))

    def _run_dummy_packed(self, tokens: int, temperature: float, compile_only: bool = False) -> None:
        """One packed prefill step of `tokens` padding tokens (scratch block only, nothing attended); with
        compile_only its model graph is only compiled."""
        rows = self.prefill_batch_sizes[-1]
        scratch = self.scratch_slot + (np.arange(tokens, dtype=np.int32) % self.block_size)
        zeros = np.zeros(tokens, np.int32)
        outputs = self._run_packed(tokens, zeros, zeros, scratch, np.zeros((tokens, self.max_blocks_per_seq),
                                   np.int32), zeros, np.zeros(rows, np.int32), compile_only=compile_only)
        if compile_only:
            return
        per_row = {"temperature": np.full(rows, temperature, np.float32), "top_k": np.zeros(rows, np.int32),
                   "top_p": np.ones(rows, np.float32), "random_u": np.full(rows, 0.5, np.float32),
                   "top_n": np.zeros(rows, np.int32)}
        self._finish(outputs, rows, rows, per_row, False)

    def graph_buckets(self) -> list[tuple]:
        """(kind, batch, seq, decode width) of every model graph warmup compiles, in order."""
        buckets = [("decode", b, 1, w) for b in self.decode_batch_sizes for w in self.decode_block_widths]
        if self.packed_prefill:
            return buckets + [("packed", t, None, None) for t in self.prefill_token_sizes]
        return buckets + [("prefill", b, s, None) for b in self.prefill_batch_sizes for s in self.prefill_seq_lens]

    def warmup(self, progress: Optional[Callable[[str], None]] = None, peer_timeout_s: Optional[float] = None) -> None:
        """Compile and run once every bucket (the KV cache is left as it was, apart from the scratch block).
        Under tensor parallelism every rank warms up the same buckets in the same order, each graph's
        all-reduces meeting the peers' (which may still be loading or compiling: they wait up to
        peer_timeout_s, then the step timeout again)."""
        if self.all_reduce is not None and peer_timeout_s is not None:
            self.all_reduce.set_timeout(peer_timeout_s)
        try:
            self._warmup(progress)
        finally:
            if self.all_reduce is not None:
                self.all_reduce.set_timeout(self.tp_timeout_s)

    def _warmup(self, progress: Optional[Callable[[str], None]]) -> None:
        """Every model graph, and the temperature sampler of every row count, compiled in a fixed order (the
        compile cache's condition, see _setup_mindspore); the graphs only some requests need (top-k/top-p
        sampler, top logprobs, penalties: four small graphs per row count, 5.5 s of a 20 s warm start of
        SmolLM2) compile on first use, outside the cache (their order depends on the traffic), ~0.5 s each."""
        try:
            self._warmup_buckets(progress)
        finally:
            _close_compile_cache()

    def _warmup_buckets(self, progress: Optional[Callable[[str], None]]) -> None:
        buckets = self.graph_buckets()
        for i, (kind, b, s, w) in enumerate(buckets):
            t0 = time.perf_counter()
            if kind == "packed" and b != self.prefill_token_sizes[0]:
                # a larger bucket's model graph is compiled (or loaded from the cache) but not run: running the
                # 2,048-token bucket of a 30-layer model took 4 s a time
                self._run_dummy_packed(b, 0.0, compile_only=True)
            elif kind == "packed":
                for temperature in (0.0, 1.0):          # greedy, then the temperature sampler for its rows
                    self._run_dummy_packed(b, temperature)
            else:
                self._run_dummy(b, s, 0.0, w)       # the model graph (greedy)
                if w is None or w == self.decode_block_widths[0]:   # the sampler depends on the batch size only
                    self._run_dummy(b, s, 1.0, w)   # + the temperature-only sampler for this batch size
            shape = (f"T={b} tokens, {self.prefill_batch_sizes[-1]} rows" if kind == "packed"
                     else f"B={b}, S={s}" + (f", W={w}" if w is not None else ""))
            msg = (f"warmup {i + 1}/{len(buckets)}: {'decode' if kind == 'decode' else 'prefill'} bucket ({shape}) "
                   f"ready in {time.perf_counter() - t0:.1f}s")
            logger.info(msg)
            if progress is not None:
                progress(msg)

    def reset(self) -> None:
        """Zero the KV cache."""
        for p in self._caches:
            p.set_data(self._ms.Tensor(np.zeros(p.shape, np.float32)).astype(p.dtype))
