"""What is decided from the model when a server starts: the tokens a request may reach when
`model_config.max_generate_length` is `auto` (`model_context`), and how many KV-cache blocks to allocate when
`pa_config.num_blocks` is `auto` (both the defaults), and the model's vocabulary size (`model_config.vocab_size`,
the width of the step buffers' token masks) when not given, and its task (`model_config.task`: `decide_task`):
`size_for_model` decides them all.

A bidirectional encoder (BERT) embeds only (task embed), and runs where the CPU kernel's packed steps run (one CPU
agent with the attention kernel: `_check_encoder`). An embedding model (task embed) computes each input whole in one
step: its context is at most the largest of `model_config.seq_length` (a step's row) and an encoder's learned
positions.

Every agent allocates the same number of blocks (the master's block tables index them all); a block holds
`block_size` tokens of keys and values for every layer and KV head, in pa_config.kv_cache_dtype (float16 and
bfloat16: 2 bytes a value, float16 the default; float32: 4; int8: 1, plus a 4-byte scale per head vector):

    bytes per block = 2 (K, V) x layers x kv_heads x (head_dim x bytes per value [+ 4]) x block_size

summed over the models that keep a cache with the target's block tables (the target, and a draft model when
spec_config uses one). Tensor parallelism splits the KV heads over the agents, so the sum is the same.

The number is the smaller of
  - what `max_num_seqs` requests of up to SHARE_TOKENS tokens need, or one request of the whole context if that
    is more: requests are admitted by the blocks they use, not by their longest length (a few long
    conversations and many short questions share the blocks; past them the scheduler queues or preempts), and
    memory beyond that would serve only the prefix cache, better left to the machine;
  - `pa_config.kv_memory_fraction` of the memory available when the server starts less the model's weights
    (`memory_after_weights`: a GGUF's file size, float32 for the other formats; like vLLM's KV-cache space setting),
    so a small machine gets a smaller cache rather than an out-of-memory kill; a model whose weights alone do not
    fit is refused there, naming both sizes.
It must hold one longest request; if even that does not fit the server does not start, and says what to lower.

The window pool (`pa_config.window_blocks`, models with sliding-window layers: Gemma 3's five of six, Mistral's
all): the sliding layers keep their K/V in a cache of their own, whose blocks a request holds only while its window
needs them (master/block_manager.py), so a long request costs the global layers' bytes per token and the sliding
layers' a window. `auto` sizes it for what is in flight at once (`window_need`): max_num_seqs requests' windows
and the tokens a step may take ahead, plus one step's new tokens (every new token's K/V is written in the sliding
layers too, before the window passes it), and turns it off (0) where that is no fewer blocks than the main pool's.
With it, the main pool's blocks cost only the global layers' bytes (and a draft's), and the longest request
`max_generate_length: auto` allows is bounded by those. A number is checked against what one request needs
(`window_minimum`); beyond that the scheduler preempts, as for the main pool.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Optional, Union

import psutil

from llm_serving.config import Config, ConfigError, KvCacheType, kv_vector_bytes
from llm_serving.models.weights import WeightLoadError, expected_shapes, model_shape

logger = logging.getLogger(__name__)

SHARE_TOKENS = 512      # tokens per running request that num_blocks auto provides (besides one whole context)


@dataclass(frozen=True)
class KVPlan:
    num_blocks: int
    bytes_per_block: int
    wanted_blocks: int          # max_num_seqs requests of SHARE_TOKENS, or one of the whole context
    budget_bytes: int           # kv_memory_fraction of the available memory
    window_blocks: int = 0      # the window pool's (0: none)
    window_block_bytes: int = 0

    def describe(self) -> str:
        limit = "the blocks wanted" if self.num_blocks == self.wanted_blocks else "the memory budget"
        text = (f"{self.num_blocks} KV blocks ({self.num_blocks * self.bytes_per_block / 2**20:.0f} MiB, "
                f"{self.bytes_per_block / 2**10:.0f} KiB each; bound by {limit}: "
                f"{self.wanted_blocks} blocks wanted, budget {self.budget_bytes / 2**20:.0f} MiB)")
        if self.window_blocks:
            text += (f", and {self.window_blocks} blocks in the sliding layers' window pool "
                     f"({self.window_blocks * self.window_block_bytes / 2**20:.0f} MiB, "
                     f"{self.window_block_bytes / 2**10:.0f} KiB each)")
        return text


@dataclass(frozen=True)
class SlidingLayers:
    """The target model's sliding-window layers: how many, and their longest window (tokens)."""
    count: int
    window: int

    @classmethod
    def of(cls, shape, num_layers: int) -> "SlidingLayers":
        windows = [w for w in (shape.layer_window(i) for i in range(num_layers)) if w]
        return cls(len(windows), max(windows, default=0))


def _step_tokens(config: Config) -> int:
    """The most tokens one step feeds: the token budget, or a lone whole prompt without chunked prefill."""
    sc = config.serving_config
    if config.scheduler_config.chunked_prefill:
        return sc.max_num_batched_tokens
    return max(sc.max_num_batched_tokens, config.model_config.seq_length[-1])


def _window_row_blocks(config: Config, window: int) -> int:
    """Window-pool blocks one running request holds at most when a step is scheduled: its window's keys (the
    blocks below it were freed) and the tokens a step feeds it ahead (a decode run's, a verify step's)."""
    ahead = max(config.scheduler_config.decode_steps, config.spec_config.tokens_per_row, 1)
    return -(-(window + ahead) // config.pa_config.block_size) + 2


def window_minimum(config: Config, window: int) -> int:
    """The fewest window-pool blocks with which a lone request always goes on: its window and one step's tokens."""
    return _window_row_blocks(config, window) + -(-_step_tokens(config) // config.pa_config.block_size)


def window_need(config: Config, window: int) -> int:
    """Window-pool blocks for what is in flight at once: max_num_seqs requests' windows, one step's new tokens
    (a block more per prefill row, for its chunk's rounding)."""
    return (config.serving_config.max_num_seqs * _window_row_blocks(config, window)
            + -(-_step_tokens(config) // config.pa_config.block_size) + config.model_config.prefill_batch_size[-1])


def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                    dtype: Union[str, KvCacheType] = "float16") -> int:
    return 2 * num_layers * num_kv_heads * kv_vector_bytes(dtype, head_dim) * block_size


def plan_blocks(config: Config, token_bytes: int, available_bytes: int, window_token_bytes: int = 0,
                window_blocks: int = 0, optional: bool = True) -> KVPlan:
    """The block count for a cache of `token_bytes` per token (K and V of every layer of every model),
    given `available_bytes` of free memory; with a window pool of `window_blocks` (`window_token_bytes` per token:
    the sliding layers', which token_bytes then leaves out), the main pool gets what the window pool leaves, or,
    where that is no more blocks than the window pool's and the pool is `optional`, the pool is off (window_blocks 0
    in the plan) and every layer's bytes count per block. ConfigError if one longest request does not fit."""
    pa, sc = config.pa_config, config.serving_config
    per_block = token_bytes * pa.block_size
    share = -(-min(config.max_model_len, SHARE_TOKENS) // pa.block_size)
    wanted = max(sc.max_num_seqs * share, config.max_blocks_per_seq)
    budget = int(available_bytes * pa.kv_memory_fraction)
    if window_blocks:
        window_block = window_token_bytes * pa.block_size
        left = budget - window_blocks * window_block
        num = wanted if per_block == 0 else min(wanted, max(left, 0) // per_block)
        if num > window_blocks or not optional:
            if num < config.max_blocks_per_seq:
                _too_small(config, per_block, available_bytes)
            return KVPlan(num_blocks=num, bytes_per_block=per_block, wanted_blocks=wanted, budget_bytes=budget,
                          window_blocks=window_blocks, window_block_bytes=window_block)
        per_block += window_block                  # the pool saves nothing: off
    num = min(wanted, budget // per_block)
    if num < config.max_blocks_per_seq:
        _too_small(config, per_block, available_bytes)
    return KVPlan(num_blocks=num, bytes_per_block=per_block, wanted_blocks=wanted, budget_bytes=budget)


def _too_small(config: Config, per_block: int, available_bytes: int) -> None:
    pa = config.pa_config
    need = config.max_blocks_per_seq * per_block
    raise ConfigError(
        f"pa_config.num_blocks=auto: one request of {config.max_model_len} tokens needs "
        f"{config.max_blocks_per_seq} KV blocks ({need / 2**20:.0f} MiB), more than pa_config.kv_memory_fraction="
        f"{pa.kv_memory_fraction:g} of the {available_bytes / 2**20:.0f} MiB available; lower "
        "model_config.max_generate_length, raise the fraction, or set pa_config.num_blocks")


def model_context(shape, config: Config, per_token: int, available_bytes: int,
                  window_pool: Optional[tuple] = None) -> tuple[int, str, bool]:
    """(tokens per request, why, whether the cache cut it) for model_config.max_generate_length auto: the model's
    trained context
    (`max_position_embeddings`: a GGUF's `<arch>.context_length`, HF's, a MindFormers `seq_length`), lowered to
    what the KV cache holds for one request (pa_config.num_blocks, or kv_memory_fraction of `available_bytes`).
    window_pool (main bytes per token, the window pool's bytes): with a window pool, a token costs only the main
    pool's bytes once the pool's are set aside, when that holds more."""
    pa = config.pa_config
    n, why, cut = shape.max_position_embeddings, "the model's trained context", False
    if pa.num_blocks != "auto":
        fits = pa.num_blocks * pa.block_size
        where = f"pa_config.num_blocks={pa.num_blocks} blocks of {pa.block_size} tokens"
    else:
        budget = int(available_bytes * pa.kv_memory_fraction)
        fits = budget // (per_token * pa.block_size) * pa.block_size
        where = (f"pa_config.kv_memory_fraction={pa.kv_memory_fraction:g} of the {available_bytes / 2**20:.0f} MiB "
                 f"available ({per_token / 2**10:.1f} KiB a token)")
        if window_pool is not None:
            main_token, pool_bytes = window_pool
            left = max(budget - pool_bytes, 0)
            pooled = n if main_token == 0 else left // (main_token * pa.block_size) * pa.block_size
            if pooled > fits:
                fits = pooled
                where += (f", {main_token / 2**10:.1f} KiB a token beside the sliding layers' window pool "
                          f"({pool_bytes / 2**20:.0f} MiB)")
    if fits < n:
        n, cut, why = fits, True, (f"what the KV cache holds for one request, {where}; the model was trained for "
                        f"{shape.max_position_embeddings} tokens: raise the fraction, set pa_config.num_blocks or "
                        "pa_config.kv_cache_dtype, or set model_config.max_generate_length")
    if n < 2:
        raise ConfigError(f"model_config.max_generate_length=auto: the KV cache holds {n} tokens ({where}), "
                          "too few for one request")
    return n, why, cut


def _check_mixture(config: Config, shape) -> None:
    """ConfigError before any agent starts when the model is a mixture of experts and the settings would run it on
    MindSpore's ops, where mixtures are not built (only the CPU layer kernel runs them, on every step)."""
    if not shape.num_experts:
        return
    mc = config.model_config
    ops = [f"{name}={value}" for name, value, wrong in (
        ("model_config.device_target", mc.device_target, mc.device_target != "CPU"),
        ("model_config.layer_kernel", mc.layer_kernel, mc.layer_kernel == "off"),
        ("model_config.layer_kernel_max_tokens", mc.layer_kernel_max_tokens, mc.layer_kernel_max_tokens is not None),
        ("serving_config.agent_ports (tensor parallelism)", config.serving_config.agent_ports,
         len(config.serving_config.agent_ports) > 1)) if wrong]
    if ops:
        raise ConfigError(f"the model is a mixture of experts ({shape.architecture}, {shape.num_experts} experts), "
                          f"which runs on the CPU layer kernel on every step only; {', '.join(ops)} would run it on "
                          "MindSpore's ops, which have no mixture layer")


def decide_task(config: Config, shape) -> str:
    """model_config.task as the model decides it: `embed` for a bidirectional encoder (which has no lm_head: asking it
    to generate is a ConfigError), else the setting (auto: `generate`)."""
    task = config.model_config.task
    if shape.causal:
        task = "generate" if task == "auto" else task
    elif task == "generate":
        raise ConfigError(f"model_config.task=generate: the model is a bidirectional encoder ({shape.architecture}), "
                          "which has no lm_head and only embeds; leave model_config.task auto or set it to embed")
    else:
        _check_encoder(config, shape)
        task = "embed"
    if task == "embed" and config.model_config.score_method == "yes_no":
        raise ConfigError("model_config.score_method=yes_no: an embedding model (task embed) does not generate the "
                          "judgement's token; it scores by similarity (leave score_method auto)")
    return task


def _check_encoder(config: Config, shape) -> None:
    """ConfigError before any agent starts when the settings cannot serve a bidirectional encoder: its embeddings
    need the CPU kernel's packed steps on one agent (an input's keys all written before any of its tokens attends,
    within one graph call)."""
    mc = config.model_config
    wrong = [f"{name}={value}" for name, value, bad in (
        ("model_config.device_target", mc.device_target, mc.device_target != "CPU"),
        ("model_config.attention_kernel", mc.attention_kernel, mc.attention_kernel == "off"),
        ("serving_config.agent_ports (tensor parallelism)", config.serving_config.agent_ports,
         len(config.serving_config.agent_ports) > 1),
        ("lora_config (LoRA adapters: they do not embed)", "enabled", config.lora_config.enabled)) if bad]
    if wrong:
        raise ConfigError(f"the model is a bidirectional encoder ({shape.architecture}), served for embeddings on one "
                          f"CPU agent with the attention kernel's packed steps only; {', '.join(wrong)} would not "
                          "serve it")


def _whole_input_context(config: Config, shape, n: int) -> int:
    """The context an embedding model (task embed: its inputs computed whole, one step each) is served with: `n` (the
    trained context, or the cache's) at most a step's row (model_config.seq_length's largest)."""
    row = config.model_config.seq_length[-1]
    if n > row:
        logger.warning("model_config.max_generate_length=auto: %d tokens per input (model_config.seq_length's "
                       "largest: an embedding model's input is computed whole, in one step's row; the model has "
                       "%d positions)", row, shape.max_position_embeddings)
    return min(n, row)


def _check_whole_input_context(config: Config, shape) -> None:
    """ConfigError when a given context exceeds what an embedding model computes whole (a step's row; an encoder's
    learned positions)."""
    n, row = config.max_model_len, config.model_config.seq_length[-1]
    positions = shape.max_position_embeddings if shape.learned_positions else n
    if n > row or n > positions:
        raise ConfigError(f"model_config.max_generate_length={n}: an embedding model (task embed) computes an input "
                          f"whole, in one step's row of at most model_config.seq_length's largest ({row}) tokens"
                          + (f", at the model's {positions} learned positions" if shape.learned_positions else "")
                          + "; lower it or leave it auto")


def weight_bytes(model_path: str, shape) -> int:
    """The memory the agents' weights take: a GGUF's file size (its matrices are kept as stored), else every tensor
    of the model as float32 (how the other formats are read)."""
    if os.path.isfile(model_path) and model_path.endswith(".gguf"):
        return os.path.getsize(model_path)
    return 4 * sum(math.prod(s) for s in expected_shapes(shape).values())


def memory_after_weights(model_path: str, shape, available_bytes: int) -> int:
    """The memory left for the KV cache once the weights are loaded (`available_bytes`: what the machine has
    now); ConfigError naming both sizes when the weights alone would not fit, before any agent starts (a model
    loaded into too little memory swaps or is killed mid-request)."""
    need = weight_bytes(model_path, shape)
    if need >= available_bytes:
        raise ConfigError(f"the model's weights take {need / 2**30:.1f} GiB in memory, but only "
                          f"{available_bytes / 2**30:.1f} GiB is available: free memory (stop other processes) or "
                          "serve a smaller quantization of the model")
    return available_bytes - need


def size_for_model(config: Config, model_path: str, available_bytes: Optional[int] = None) -> Config:
    """`config` with what depends on the model decided: `model_config.vocab_size` and `hidden_size` when not given,
    `model_config.max_generate_length` when it is `auto` (`model_context`), then `pa_config.num_blocks` and
    `pa_config.window_blocks` when they are `auto` (the model's shape read from its checkpoint, the draft's too);
    `config` itself when all are set. `available_bytes`: the memory the KV cache is sized from; None: what the
    machine has now less the model's weights (`memory_after_weights`, which refuses a model that does not fit)."""
    pa = config.pa_config
    if (pa.num_blocks != "auto" and (pa.window_blocks == 0 or pa.window_tokens is not None)
            and config.context_decided and config.model_config.vocab_size and config.model_config.hidden_size
            and config.model_config.task != "auto"):
        return config
    spec = config.spec_config
    try:
        shape = model_shape(model_path)
        draft = model_shape(spec.draft_model) if spec.uses_draft and spec.draft_model is not None else shape
    except WeightLoadError as e:
        raise ConfigError(f"cannot read the model's shape, vocabulary and context (to decide model_config.vocab_size, "
                          f"max_generate_length and pa_config.num_blocks auto): {e}") from None
    _check_mixture(config, shape)
    task = decide_task(config, shape)
    if task != config.model_config.task:
        config = config.with_decided(task=task)
    if config.model_config.vocab_size is None:        # the token masks' width in the step buffers (shm/layout.py)
        config = config.with_decided(vocab_size=shape.vocab_size)
    if config.model_config.hidden_size is None:       # the pooled hidden states' width (embeddings: shm/layout.py)
        config = config.with_decided(hidden_size=shape.hidden_size)
    layers = config.model_config.num_layers or shape.num_layers       # a served cut keeps only its layers
    dtype = config.kv_cache_type
    per_token = bytes_per_block(layers, shape.num_kv_heads, shape.head_dim, 1, dtype)
    if spec.uses_draft:
        per_token += bytes_per_block(spec.draft_num_layers or draft.num_layers, draft.num_kv_heads, draft.head_dim, 1,
                                     dtype)
    # the window pool: its blocks (0: none), and the sliding layers' bytes per token, which the main pool's then
    # leave out (a draft's layers all read the main pool)
    sliding = SlidingLayers.of(shape, layers)
    window_token = bytes_per_block(sliding.count, shape.num_kv_heads, shape.head_dim, 1, dtype)
    window_blocks = 0
    if sliding.count and pa.window_blocks != 0:
        window_blocks = window_need(config, sliding.window) if pa.window_blocks == "auto" else pa.window_blocks
        least = window_minimum(config, sliding.window)
        if window_blocks < least:
            raise ConfigError(f"pa_config.window_blocks={pa.window_blocks}: one request needs {least} blocks of the "
                              f"window pool ({sliding.window}-token windows and a step's "
                              f"{least * pa.block_size - sliding.window} tokens ahead); set at least that, auto or 0")
    elif pa.window_blocks not in ("auto", 0):
        logger.info("pa_config.window_blocks=%s: the model has no sliding-window layers; no window pool",
                    pa.window_blocks)
    if available_bytes is None:
        available_bytes = memory_after_weights(model_path, shape, psutil.virtual_memory().available)
    if not config.context_decided:
        pool = (per_token - window_token, window_blocks * window_token * pa.block_size) if window_blocks else None
        n, why, cut = model_context(shape, config, per_token, available_bytes, pool)
        (logger.warning if cut else logger.info)("model_config.max_generate_length=auto: %d tokens per request, %s",
                                                 n, why)
        if task == "embed":
            n = _whole_input_context(config, shape, n)
        config = config.with_decided(max_generate_length=n)
    elif task == "embed":
        _check_whole_input_context(config, shape)
    if pa.num_blocks != "auto":
        if pa.window_blocks == "auto" and window_blocks >= pa.num_blocks:
            window_blocks = 0                         # it would save nothing
        if window_blocks:
            logger.info("pa_config.window_blocks: %d blocks in the sliding layers' window pool", window_blocks)
        return config.with_decided(window_blocks=window_blocks, window_tokens=sliding.window if window_blocks else None)
    plan = plan_blocks(config, per_token - window_token if window_blocks else per_token, available_bytes,
                       window_token, window_blocks, optional=pa.window_blocks == "auto")
    logger.info("pa_config.num_blocks=auto: %s", plan.describe())
    return config.with_decided(num_blocks=plan.num_blocks, window_blocks=plan.window_blocks,
                               window_tokens=sliding.window if plan.window_blocks else None)
