"""RunnerSpec: everything a ModelRunner is built from but the model directory and the tensor-parallel group,
in one frozen object; `RunnerSpec.from_config` is the one place the config maps to it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

from llm_serving.config import ATTENTION_KERNELS, KV_CACHE_TYPES, KvCacheType, kv_cache_type

KERNEL_ONLY_ROWS = 1 << 30      # the layer kernel's row limit when it runs every step (layer_kernel_rows None)


@dataclass(frozen=True)
class RunnerSpec:
    """A runner's KV cache, graph buckets, kernels and step kinds (see ModelRunner for what each does).

    num_blocks, block_size, max_blocks_per_seq, kv_cache: the paged KV cache (plus the runner's scratch block) and
    its element type (config.KvCacheType; its name, "float16", "bfloat16", "float32" or "int8", is taken and
    checked by config.kv_cache_type). window_blocks: the window pool's blocks
    (0: none), the cache of the sliding-window layers (plus its own scratch block), read through the step's
    window_tables and window_slots (shm/layout.py); a model without sliding layers ignores it. window_tokens: the window
    the master frees those blocks by (pa_config.window_tokens), which must be the model's longest sliding window.
    decode_batch_sizes, prefill_batch_sizes, prefill_seq_lens, decode_block_widths, max_step_tokens: the graph
    buckets (buckets.py). verify_width, verify_rows: verify steps' buckets (speculative decoding; 0 rows: none).
    decode_run_steps, decode_run_rows: decode runs (None rows: every batch the layer kernel takes).
    attention_kernel, layer_kernel, layer_kernel_rows, keep_quantized: the CPU kernels (config.ATTENTION_KERNELS);
    layer_kernel_rows None: the layer kernel runs every step, on the weights as stored (no float32 copy).
    repack_after_load: the layer stack's matrices the kernel repacks, repacked after the load (kernels/repack.py's
    LaterRepacks; no earlier start kept their panels), the stored rows serving until then.
    batch_invariant: the layer kernel's steps batch-invariant: 'auto' (where the kernel serves every step), True or
    False; the runner resolves it (runner/kernels.py: KernelChoice.batch_invariant) and puts it in each kernel call's
    iconfig.
    num_layers: run only the checkpoint's first N layers (a draft model cut from it).
    lora_slots, lora_rank: LoRA adapter slots (0: none) and the largest rank they hold.
    device_target, device_id, num_threads, compile_cache, tp_timeout_s: the process's device and threads, the
    compile cache (only the first runner of a process may use it) and how long a collective waits for peers.
    """
    num_blocks: int
    block_size: int
    max_blocks_per_seq: int
    decode_batch_sizes: tuple
    prefill_batch_sizes: tuple
    prefill_seq_lens: tuple
    decode_block_widths: Optional[tuple] = None
    device_target: str = "CPU"
    device_id: int = 0
    num_threads: Optional[int] = None
    compile_cache: bool = False
    attention_kernel: str = "auto"
    max_step_tokens: Optional[int] = None
    tp_timeout_s: float = 120.0
    verify_width: int = 1
    verify_rows: int = 0
    num_layers: Optional[int] = None
    layer_kernel: str = "auto"
    layer_kernel_rows: Optional[int] = None    # None: the layer kernel serves every step
    decode_run_steps: int = 1
    decode_run_rows: Optional[int] = 0
    keep_quantized: bool = True
    repack_after_load: bool = True
    lora_slots: int = 0
    lora_rank: int = 16
    kv_cache: KvCacheType = KV_CACHE_TYPES["float16"]
    batch_invariant: Union[bool, str] = "auto"
    window_blocks: int = 0
    window_tokens: Optional[int] = None
    pooling: str = "auto"                      # embed steps' pooling (models/pooling.py; auto: as declared)
    mmproj: Optional[str] = None               # a GGUF model's vision tower (llama.cpp's mmproj GGUF); a HF
                                               # directory's is read from it (runner/images.py)
    image_cache_mb: int = 256                  # the encoded images kept (0: none)
    vision_int16: str = "auto"                 # the tower's products in int16 (runner/kernels.py's vision_int16)
    vision_int16_scores: bool = False          # ... and its attention's scores (with vision_int16)

    def __post_init__(self) -> None:
        """The spec's own checks, once: the runner and its rooms take its values as they are. (A spec from the config
        meets them already: config.py checks every setting; these name the spec's field for one built by hand.)"""
        object.__setattr__(self, "kv_cache", kv_cache_type(self.kv_cache))
        for name in ("num_blocks", "block_size", "max_blocks_per_seq", "lora_slots", "lora_rank", "window_blocks"):
            value, least = getattr(self, name), 0 if name in ("lora_slots", "window_blocks") else 1
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < least:
                raise ValueError(f"RunnerSpec.{name} must be an integer >= {least}, got {value!r}")
        for name in ("attention_kernel", "layer_kernel", "vision_int16"):
            if getattr(self, name) not in ATTENTION_KERNELS:
                raise ValueError(f"RunnerSpec.{name} must be one of {ATTENTION_KERNELS}, got {getattr(self, name)!r}")
        for name in ("decode_batch_sizes", "prefill_batch_sizes", "prefill_seq_lens", "decode_block_widths"):
            value = getattr(self, name)
            if isinstance(value, list):          # (frozen: a list would be shared with the caller)
                object.__setattr__(self, name, tuple(value))

    @classmethod
    def from_config(cls, config, *, device_id: int = 0, num_threads: Optional[int] = None,
                    compile_cache: bool = False) -> "RunnerSpec":
        """An agent's runner for `config`; the per-process values (its device, its threads: a tensor-parallel
        rank's share of the cores, and whether it keeps the compile cache) are the caller's."""
        mc, pa, sc = config.model_config, config.pa_config, config.serving_config
        lc, spec, sched = config.lora_config, config.spec_config, config.scheduler_config
        return cls(num_blocks=pa.num_blocks, window_blocks=config.window_blocks, window_tokens=pa.window_tokens,
                   block_size=pa.block_size,
                   max_blocks_per_seq=config.max_blocks_per_seq,
                   decode_batch_sizes=mc.decode_batch_size, prefill_batch_sizes=mc.prefill_batch_size,
                   prefill_seq_lens=mc.seq_length, decode_block_widths=config.decode_block_widths,
                   device_target=mc.device_target, device_id=device_id,
                   num_threads=mc.num_threads if num_threads is None else num_threads,
                   compile_cache=compile_cache, attention_kernel=mc.attention_kernel,
                   max_step_tokens=sc.max_num_batched_tokens, tp_timeout_s=sc.step_timeout_s,
                   verify_width=spec.tokens_per_row, verify_rows=spec.max_batch_size, num_layers=mc.num_layers,
                   layer_kernel=mc.layer_kernel, layer_kernel_rows=mc.layer_kernel_max_tokens,
                   decode_run_steps=sched.decode_steps, decode_run_rows=sched.decode_steps_max_rows,
                   keep_quantized=mc.keep_quantized, repack_after_load=mc.repack_after_load,
                   lora_slots=lc.max_loras if lc.enabled else 0,
                   lora_rank=lc.max_lora_rank, kv_cache=config.kv_cache_type,
                   batch_invariant=mc.batch_invariant, pooling=mc.pooling, mmproj=mc.mmproj,
                   image_cache_mb=sc.image_cache_mb, vision_int16=mc.vision_int16,
                   vision_int16_scores=mc.vision_int16_scores)
