"""ModelRunner: numpy in, numpy out, over static-shape MindSpore graphs; it composes the runner's rooms (the package's
docstring maps them) and owns nothing they do."""
from __future__ import annotations

import logging
import os
from typing import Callable, Optional

from llm_serving.cache_dir import default_cache_dir
from llm_serving.shm.layout import StepKind, StepView

from ..buckets import Buckets
from ..mindspore_env import claim_compile_cache, setup_mindspore
from ..parallel import TensorParallel, all_reduce_kernel
from ..runner_spec import RunnerSpec
from ..step_inputs import StepLimits
from ..weights import LlamaConfig, kernel_types, load_llama_weights, load_quantized, read_ahead, weight_files
from .decode_runs import DecodeRuns
from .embed_steps import EmbedSteps
from .graphs import RunnerGraphs
from .images import ImageEncoder, vision_checkpoint_of
from .kernels import build_vision_kernels, choose_kernels, describe_quantized, repacked_for, vision_int16
from .kv_inputs import KvLayout
from .lora_slots import LoraSlots
from .outputs import StepOutputs
from .token_steps import TokenSteps
from .warm import WARMUP_ORDER, RunnerWarmup

logger = logging.getLogger(__name__)

__all__ = ["ModelRunner"]


class ModelRunner:
    """Runs the LLaMA in `model_dir` over a paged KV cache; see `execute` for one step.

    Attributes: config (LlamaConfig), spec, buckets (Buckets), kernels (KernelChoice), layout (KvLayout: the caches'
    scratch blocks), limits (StepLimits), graphs (RunnerGraphs), lora (LoraSlots), num_blocks, block_size,
    max_blocks_per_seq, max_context (max_blocks_per_seq * block_size), window_blocks (the window pool's blocks:
    spec.window_blocks for a model with sliding-window layers, else 0, the pool off), quantized_matrices and
    repacked (what the layer kernel reads as stored, and which of those types it repacks: at load, or after it,
    runner/graphs.py).

    spec (RunnerSpec, runner_spec.py; an agent's from `RunnerSpec.from_config`): the cache, buckets, kernels
    and step kinds. Its num_layers runs only the checkpoint's first N layers with its final norm and head (a
    draft model cut from it; see weights.load_llama_weights). Its compile_cache=True (the agent's runner)
    keeps compiled graphs under the project cache dir, keyed by everything that decides warmup's compile
    sequence; only the first runner of a process can use it. tp: this rank of a tensor-parallel group.
    """

    def __init__(self, model_dir: str, spec: RunnerSpec, tp: Optional[TensorParallel] = None):
        self.spec, self.model_dir = spec, model_dir
        self.device_target = spec.device_target
        self.num_blocks, self.block_size = int(spec.num_blocks), int(spec.block_size)
        self.max_blocks_per_seq = int(spec.max_blocks_per_seq)
        self.max_context = self.max_blocks_per_seq * self.block_size
        self.tp = tp if tp is not None else TensorParallel()
        # (the layer kernel built for the types the checkpoint stores: a model's first start on a machine compiles
        # its own types' products only, and its next finds them kept)
        self.kernels = choose_kernels(spec, self.tp, kernel_types(model_dir, spec.keep_quantized))
        read_ahead(weight_files(model_dir, self.kernels.layer_kernel, default_cache_dir()))   # (the master's decide
        # asked too; this one is for what it has not read yet, and for runners no master started)
        self.buckets = Buckets.make(
            decode_batch_sizes=list(spec.decode_batch_sizes), prefill_batch_sizes=list(spec.prefill_batch_sizes),
            prefill_seq_lens=list(spec.prefill_seq_lens),
            decode_block_widths=None if spec.decode_block_widths is None else list(spec.decode_block_widths),
            max_blocks_per_seq=self.max_blocks_per_seq, max_step_tokens=spec.max_step_tokens,
            verify_width=spec.verify_width, verify_rows=spec.verify_rows, packed=self.kernels.decode_kernel is not None,
            one_width=self.kernels.decode_kernel is not None or spec.device_target == "Ascend")
        self.lora = LoraSlots(spec.lora_slots, spec.lora_rank)
        quantized, weights = self._load_weights()
        self.layout = KvLayout(self.num_blocks, self.block_size, self._window_blocks())
        self.limits = StepLimits(vocab_size=self.config.vocab_size, max_context=self.max_context,
                                 num_blocks=self.num_blocks, max_blocks_per_seq=self.max_blocks_per_seq,
                                 scratch_slot=self.layout.scratch_slot, lora_slots=self.lora.slots,
                                 window_blocks=self.layout.window_blocks,
                                 window_scratch_slot=self.layout.window_scratch_slot)
        self.quantized_matrices = describe_quantized(quantized, float32_copy=not self.kernels.serves_all)
        self.repacked = repacked_for(self.kernels, quantized, spec.device_target)
        if self.quantized_matrices:
            logger.info("the layer kernel reads the checkpoint's quantized matrices as stored (%s)%s",
                        self.quantized_matrices, f"; {', '.join(self.repacked)} rows repacked into panels of 8 rows "
                        "interleaved, for its integer products" if self.repacked else "")
        reduce_kernel = all_reduce_kernel(self.tp, spec.device_target)
        vision = self._vision_checkpoint()
        kernel_threads = spec.num_threads or len(os.sched_getaffinity(0))      # the CPU kernels' pool
        self._cache_dir = setup_mindspore(spec.device_target, spec.device_id, spec.num_threads,
                                          self._compile_cache_key(reduce_kernel, kernel_threads,
                                                                  vision[0] if vision else None),
                                          wait_for_cache=self.tp.world == 1)
        vision_kernels = None if vision is None else build_vision_kernels(spec.device_target, spec.attention_kernel)
        self.images = (None if vision is None      # (MindSpore's tensors: after its set-up)
                       else ImageEncoder.build(vision, spec.image_cache_mb, kernel_threads, vision_kernels,
                                               vision_int16(vision_kernels, spec.vision_int16),
                                               spec.vision_int16_scores))
        self.graphs = RunnerGraphs.build(self.config, weights, quantized, spec=spec, model_dir=model_dir, tp=self.tp,
                                         kernels=self.kernels, layout=self.layout, max_context=self.max_context,
                                         kernel_threads=kernel_threads, reduce_kernel=reduce_kernel,
                                         image_rows=self.buckets.prefill_token_sizes[-1] if self.images else 0)
        self._compose()

    def _load_weights(self) -> tuple:
        """(the matrices the CPU kernels read as stored, this rank's weights as the graphs take them); sets
        `config`. The CPU kernels read a GGUF's quantized matrices as stored (llama.py); MindSpore's graphs a
        float32 copy, made only when some step runs them. A bidirectional encoder only embeds: no lm_head, so no
        decode runs; its whole input in one graph call, which tensor parallelism's step pieces do not keep to."""
        spec, kernels = self.spec, self.kernels
        quantized = (load_quantized(self.model_dir, spec.num_layers)
                     if kernels.layer_kernel is not None and spec.keep_quantized else {})
        skip = frozenset(quantized) if kernels.serves_all else frozenset()
        self.config, weights = load_llama_weights(self.model_dir, self.tp, spec.num_layers, skip=skip)
        cfg: LlamaConfig = self.config
        if not cfg.generates:
            if self.tp.world > 1:
                raise ValueError(f"ModelRunner: {cfg.architecture} is an embedding model (a bidirectional encoder); "
                                 "tensor parallelism does not serve it (serve it on one agent)")
            if not self.buckets.packed:
                raise ValueError(f"ModelRunner: {cfg.architecture} is an embedding model, and embeddings need the "
                                 "CPU kernel's packed steps (attention_kernel on, a CPU agent)")
            self.kernels = kernels.without_decode_runs()
        return quantized, weights

    def _vision_checkpoint(self) -> Optional[tuple]:
        """The model's vision tower as stored (VisionConfig, tensors: runner/images.py), or None: a text model, or one
        whose images these steps cannot take (said in the log): they need one agent's packed prefill (the CPU
        kernel) and a packed call that holds an image's tokens. Its graphs read the image rows (llama.py), so the
        config is part of the compile cache's key."""
        checkpoint = vision_checkpoint_of(self.model_dir, self.spec.mmproj)
        if checkpoint is None:
            return None
        # (a Qwen2.5-VL image's tokens vary with its size: the master keeps them within the largest call)
        tokens, largest = getattr(checkpoint[0], "tokens_per_image", 0), self.buckets.prefill_token_sizes[-1]
        why = None
        if self.tp.world > 1 or not self.buckets.packed:
            why = "images need one agent's packed prefill (attention_kernel on, a CPU agent, no tensor parallelism)"
        elif self.config.mrope_section is not None and not self.kernels.serves_all:
            why = ("multimodal RoPE's image positions need every step on the layer kernel (model_config.layer_kernel "
                   "on, layer_kernel_rows unset)")
        elif largest < tokens:
            why = (f"an image's {tokens} tokens need a packed graph call of as many (the largest holds {largest}: "
                   "serving_config.max_num_batched_tokens)")
        if why is not None:
            logger.warning("the model's vision tower is not used: %s; image requests are refused", why)
            return None
        width, cfg = getattr(checkpoint[0], "row_width", None), self.config
        if width is not None and width != cfg.hidden_size * (1 + cfg.deepstack_layers):
            deep = f" x {1 + cfg.deepstack_layers} (DeepStack)" if cfg.deepstack_layers else ""
            raise ValueError(f"ModelRunner: the vision tower gives rows of {width} values a token; the text model "
                             f"takes {cfg.hidden_size} (hidden_size){deep}: is the mmproj this model's?")
        return checkpoint

    def _window_blocks(self) -> int:
        """The window pool's blocks: the sliding layers' own cache (0: the model has none, or the pool is off)."""
        spec, cfg = self.spec, self.config
        windows = [w for w in (cfg.layer_window(i) for i in range(cfg.num_layers)) if w is not None]
        blocks = int(spec.window_blocks) if windows else 0
        if blocks and spec.window_tokens is not None and spec.window_tokens != max(windows):
            # the master frees a row's window blocks by pa_config.window_tokens: a smaller one would free keys the
            # sliding layers still read
            raise ValueError(f"ModelRunner: pa_config.window_tokens={spec.window_tokens} is not the model's sliding "
                             f"window ({max(windows)} tokens); leave it unset: it is read from the model at start")
        return blocks

    def _compile_cache_key(self, reduce_kernel, kernel_threads: int, vision) -> Optional[str]:
        """The compile cache's key (None: not wanted, or another runner of this process came first): everything
        that decides which graphs warmup compiles, and in which order, the kernel libraries the graphs name, and the
        kernels' config tensors, which a compiled graph holds as constants (the thread count and batch invariance:
        a cache compiled with batch-invariant steps served a server started without them)."""
        spec, k, tp = self.spec, self.kernels, self.tp
        if not spec.compile_cache:
            return claim_compile_cache(None)
        return claim_compile_cache(
            (self.config, self.num_blocks, self.layout.window_blocks, self.block_size, self.buckets,
             spec.device_target, (tp.rank, tp.world, tp.backend, tp.across_nodes) if tp.world > 1 else None,
             k.decode_kernel, reduce_kernel, k.layer_kernel, k.layer_kernel_rows, k.decode_run_steps,
             k.decode_run_rows, self.quantized_matrices, self.repacked, self.lora.slots, self.lora.rank,
             spec.kv_cache.name, kernel_threads, k.batch_invariant, vision, WARMUP_ORDER))

    def _compose(self) -> None:
        """The rooms that run steps, over the graphs."""
        writes = self.tp.writes_outputs
        self.lora.attach(self.graphs.model, self.config.num_layers)
        outputs = StepOutputs(self.graphs, writes)
        self.tokens = TokenSteps(self.buckets, self.limits, self.layout, self.kernels, self.graphs, outputs, writes,
                                 self.images)
        self.runs = DecodeRuns(self.buckets, self.limits, self.layout, self.kernels, self.graphs)
        self.embeds = EmbedSteps(self.config, self.buckets, self.layout, self.graphs, self.tokens, writes)
        self.warm = RunnerWarmup(self.execute, self.config.generates, self.layout, self.max_context, self.graphs,
                                 self.tokens, self.runs, self.embeds)
        self._execute = {StepKind.PREFILL: self.tokens.execute, StepKind.DECODE: self.tokens.execute,
                         StepKind.VERIFY: self.tokens.verify, StepKind.DECODE_RUN: self.runs.execute,
                         StepKind.EMBED: self.embeds.execute}

    # what the agent and tools read
    decode_kernel = property(lambda self: self.kernels.decode_kernel)
    layer_kernel = property(lambda self: self.kernels.layer_kernel)
    kernel_serves_all = property(lambda self: self.kernels.serves_all)
    layer_kernel_rows = property(lambda self: self.kernels.layer_kernel_rows)
    batch_invariant = property(lambda self: self.kernels.batch_invariant)
    decode_run_steps = property(lambda self: self.kernels.decode_run_steps)
    window_blocks = property(lambda self: self.layout.window_blocks)
    scratch_slot = property(lambda self: self.layout.scratch_slot)
    lora_slots = property(lambda self: self.lora.slots)
    lora_rank = property(lambda self: self.lora.rank)
    lora_slot_bytes = property(lambda self: self.lora.slot_bytes)
    image_tokens = property(lambda self: self.images.tokens_per_image if self.images is not None else 0)
    max_image_tokens = property(lambda self: self.buckets.prefill_token_sizes[-1] if self.images is not None else 0)
    model = property(lambda self: self.graphs.model)
    collective_calls = property(lambda self: self.graphs.collective_calls)
    pooling = property(lambda self: self.graphs.pooling)
    warmup_plan = property(lambda self: self.warm.plan)
    # (warming: warmup entries left, or the vision tower's graphs not compiled yet: both run when the agent is idle)
    warming = property(lambda self: self.warm.warming or (self.images is not None and not self.images.compiled))
    # the bucket lists, as the runner's own (tests and tools read them)
    decode_batch_sizes = property(lambda self: self.buckets.decode_batch_sizes)
    decode_block_widths = property(lambda self: self.buckets.decode_block_widths)
    prefill_batch_sizes = property(lambda self: self.buckets.prefill_batch_sizes)
    prefill_seq_lens = property(lambda self: self.buckets.prefill_seq_lens)
    prefill_token_sizes = property(lambda self: self.buckets.prefill_token_sizes)
    packed_prefill = property(lambda self: self.buckets.packed)

    def execute(self, step: StepView):
        """One step over n sequences: `step` (shm/layout.py's StepView) names its kind and its input arrays
        (described in step_inputs.py), as the worker reads them from the step buffers; each kind has its room
        (token_steps.py: prefill, decode, verify; decode_runs.py; embed_steps.py).

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

        A decode run: see `DecodeRuns.execute`. An embed step: see `EmbedSteps.execute`.

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
        return self._execute[step.kind](step)

    def set_lora(self, slot: int, adapter) -> None:
        """LoRA adapter slot `slot` (1..lora_slots) now holds `adapter`, or nothing (None): `LoraSlots.set`."""
        self.lora.set(slot, adapter)

    def decode_run_batch_sizes(self) -> list:
        """The decode batch buckets decode runs have graphs for (empty: no decode runs)."""
        return self.runs.batch_sizes()

    def decode_run_max_rows(self) -> int:
        """The most rows a decode run takes (0: no decode runs)."""
        return self.runs.max_rows()

    def graph_buckets(self) -> list:
        """(kind, batch, seq, decode width) of every model graph warmup compiles, in order."""
        return self.buckets.graphs()

    def warmup(self, progress: Optional[Callable[[str], None]] = None, peer_timeout_s: Optional[float] = None,
               staged: bool = False) -> None:
        """Compile and run once every bucket (the KV cache is left as it was, apart from the scratch block), in the
        warmup plan's order (warmup.py). staged: only the graphs a first request needs, when the compile cache
        knows the rest; those follow by `warm_next` (when idle) or before a step that calls one
        (`RunnerGraphs.call`), and `warming` says whether any is left. Under tensor parallelism every rank warms up
        the same buckets in the same order, each graph's all-reduces meeting the peers' (which may still be loading
        or compiling: they wait up to peer_timeout_s, then the step timeout again): never staged."""
        self.warm.warmup(self._cache_dir, staged and self.tp.world == 1, progress, peer_timeout_s,
                         self.spec.tp_timeout_s)

    def warm_next(self, progress: Optional[Callable[[str], None]] = None) -> bool:
        """Run the next pending warmup entry (`RunnerWarmup.warm_next`), then the vision tower's compile; whether
        any is left."""
        if self.warm.warming:
            return self.warm.warm_next(progress) or self.warming
        if self.images is not None and not self.images.compiled:
            self.images.compile()
        return False

    def reset(self) -> None:
        """Zero the KV cache."""
        self.graphs.reset()
