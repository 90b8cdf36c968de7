"""Which CPU kernels a runner runs on (`choose_kernels`): the paged-attention kernel, the whole-layer kernel and the
steps it serves, batch invariance and decode runs, decided once from the spec and from what builds on this machine;
and what the layer kernel reads as stored (`describe_quantized`, `repacked_for`).

The settings themselves are checked where the config is read (config.py); what is refused here depends on what
built: an `auto` kernel that does not build leaves the steps to MindSpore's ops, which cannot serve a kernel-only KV
cache type or batch-invariant steps.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..kernels.repack import repacked_types
from ..parallel import TensorParallel
from ..runner_spec import KERNEL_ONLY_ROWS, RunnerSpec
from ..weights.gguf import KEPT_QUANTIZED

logger = logging.getLogger(__name__)

__all__ = ["GGML_TYPE_NAMES", "KernelChoice", "build_vision_kernels", "choose_kernels", "describe_quantized",
           "repacked_for", "vision_int16"]

GGML_TYPE_NAMES = {code: name for name, code in KEPT_QUANTIZED.items()}


@dataclass(frozen=True)
class KernelChoice:
    """The kernels a runner runs on.

    decode_kernel, layer_kernel: the libraries of the paged-attention and whole-layer kernels (None: not used).
    serves_all: the layer kernel serves every step (layer_kernel_rows unset), on the weights as stored.
    layer_kernel_rows: the most tokens of a step the layer kernel takes (KERNEL_ONLY_ROWS when it serves all, 0
    without it); MindSpore's ops (on float32 copies of the weights) take larger steps.
    batch_invariant: the layer kernel's steps give each row the same bits whatever the batch (its iconfig says so).
    decode_run_steps, decode_run_rows: decode runs, K greedy steps in one graph for batches of up to that many rows
    (1 and 0: none)."""

    decode_kernel: Optional[str]
    layer_kernel: Optional[str]
    serves_all: bool
    layer_kernel_rows: int
    batch_invariant: bool
    decode_run_steps: int
    decode_run_rows: int

    def without_decode_runs(self) -> "KernelChoice":
        """The same kernels without decode runs (an embedding model: it has no lm_head)."""
        return dataclasses.replace(self, decode_run_steps=1, decode_run_rows=0)


def choose_kernels(spec: RunnerSpec, tp: TensorParallel, types=None) -> KernelChoice:
    """The kernels `spec` asks for, built (or loaded from the kernel cache) on this machine, the layer kernel's
    integer products for the stored `types` only (weights.stored_types: the model's; None: every type); ValueError
    for a spec that needs the layer kernel on every step where it does not serve them, KernelBuildError for a
    kernel set to `on` that does not build."""
    decode_kernel = _build_decode_kernel(spec.device_target, spec.attention_kernel)
    layer_kernel = _build_layer_kernel(spec.device_target, spec.layer_kernel, tp, decode_kernel, types)
    serves_all = layer_kernel is not None and spec.layer_kernel_rows is None
    rows = 0 if layer_kernel is None else KERNEL_ONLY_ROWS if serves_all else int(spec.layer_kernel_rows)
    if spec.kv_cache.kernel_only and not serves_all:
        raise ValueError(f"pa_config.kv_cache_dtype {spec.kv_cache} is read by the CPU layer kernel only, which "
                         "does not serve every step here (layer_kernel off or unavailable, layer_kernel_max_tokens "
                         "set, tensor parallelism, or Ascend): MindSpore's CPU ScatterUpdate has no bfloat16, and its "
                         "ops do not read an int8 cache's scales; use float16 (the default) or float32")
    # batch invariance: 'auto' where the layer kernel serves every step (MindSpore's op-by-op graphs pick their
    # products by shape); the kernels' iconfig carries it into every call
    if spec.batch_invariant is True and not serves_all:
        raise ValueError("model_config.batch_invariant=true needs the CPU layer kernel on every step (a CPU agent "
                         "without tensor parallelism, layer_kernel not off and built, layer_kernel_max_tokens null): "
                         "MindSpore's op-by-op graphs pick their products by shape; leave it 'auto' to have it "
                         "wherever it can be")
    run_rows = rows if spec.decode_run_rows is None else spec.decode_run_rows
    runs = layer_kernel is not None and spec.decode_run_steps > 1 and run_rows >= 1
    return KernelChoice(decode_kernel=decode_kernel, layer_kernel=layer_kernel, serves_all=serves_all,
                        layer_kernel_rows=rows, batch_invariant=serves_all and spec.batch_invariant is not False,
                        decode_run_steps=int(spec.decode_run_steps) if runs else 1,
                        decode_run_rows=min(int(run_rows), rows) if runs else 0)


def _build_decode_kernel(device_target: str, attention_kernel: str) -> Optional[str]:
    """CPU decode attends through the paged-attention kernel (kernels/) when it builds; 'auto' falls back to
    gathering the keys (attention.py) when there is no C++ compiler, 'on' makes that an error."""
    if device_target != "CPU" or attention_kernel == "off":
        return None
    from ..kernels import KernelBuildError, build_kernel
    try:
        return build_kernel("paged_attention_cpu", "PagedDecodeAttention")
    except KernelBuildError as e:
        if attention_kernel == "on":
            raise
        logger.warning("CPU paged-attention kernel unavailable; decode steps gather keys instead: %s", e)
        return None


def build_vision_kernels(device_target: str, attention_kernel: str) -> Optional[str]:
    """The path of the CPU vision tower's kernel library (kernels/vision_layer_cpu.cc: its attention, fc1's bias
    and GELU) when it builds; the setting and the fallback are the decode kernel's (`attention_kernel`; MindSpore's
    ops, which write every head's scores)."""
    if device_target != "CPU" or attention_kernel == "off":
        return None
    from ..kernels import KernelBuildError, build_kernel
    try:
        return build_kernel("vision_layer_cpu", "VisionAttention").rsplit(":", 1)[0]
    except KernelBuildError as e:
        if attention_kernel == "on":
            raise
        logger.warning("CPU vision-tower kernels unavailable; the tower runs on MindSpore's ops: %s", e)
        return None


def vision_int16(kernels: Optional[str], setting: str) -> bool:
    """Whether the vision tower's products run in int16 (vision_layer_cpu.cc's int16 panels) on the kernel library
    `kernels`: 'on' wherever the library runs (plain C++ elsewhere: slower than its float panels), 'off' never,
    'auto' where its int16 loop is native (VisionLinearInt16Native: AVX2's vpmaddwd assembly where there is no
    AVX-512, vpdpwssd where AVX-512 has VNNI) and its float panels do not run on AMX tiles (VisionAmx: there
    the float panels are faster and far more precise)."""
    if kernels is None or setting == "off":
        return False
    if setting == "on":
        return True
    import ctypes
    library = ctypes.CDLL(kernels)
    return bool(library.VisionLinearInt16Native()) and not library.VisionAmx(-1)


def _build_layer_kernel(device_target: str, layer_kernel: str, tp: TensorParallel,
                        decode_kernel: Optional[str], types=None) -> Optional[str]:
    """The library of the whole-layer CPU kernel (kernels/decoder_layer_cpu.cc) that serves every step (or those of
    up to layer_kernel_rows tokens), or None: 'off', not a CPU, tensor parallel (its all-reduces sit inside the
    layer), no paged-attention kernel (the padded path), or it does not build ('auto')."""
    if layer_kernel == "off" or device_target != "CPU" or tp.world > 1 or decode_kernel is None:
        if layer_kernel == "on":
            raise ValueError("ModelRunner: layer_kernel 'on' needs a CPU agent without tensor parallelism and the "
                             "paged-attention kernel")
        return None
    from ..kernels import KernelBuildError, build_kernel
    try:
        return build_kernel("decoder_layer_cpu", "DecoderLayer", types=types).rsplit(":", 1)[0]
    except KernelBuildError as e:
        if layer_kernel == "on":
            raise
        logger.warning("CPU layer kernel unavailable; small decode steps run layer by layer: %s", e)
        return None


def repacked_for(kernels: KernelChoice, quantized: dict, device_target: str) -> tuple:
    """The stored types of `quantized` that the layer kernel's library repacks at load (kernels/repack.py)."""
    if kernels.layer_kernel is None or device_target != "CPU":
        return ()
    stored = {GGML_TYPE_NAMES.get(t.qtype) for t in quantized.values()}
    return tuple(t for t in repacked_types(kernels.layer_kernel, kernels.batch_invariant) if t in stored)


def describe_quantized(quantized: dict, float32_copy: bool) -> Optional[str]:
    """'Q4_1 x211: 96.3 MB instead of 537.2 MB of float32' for the matrices the CPU kernels read as stored
    (float32_copy: MindSpore's graphs keep a float32 copy beside them), logged once; None when there are none."""
    if not quantized:
        return None
    counts, stored, f32, seen = {}, 0, 0, set()
    for name, t in sorted(quantized.items()):
        if id(t) in seen:                   # a tied lm_head: the embedding's tensor
            continue
        seen.add(id(t))
        label = GGML_TYPE_NAMES.get(t.qtype, str(t.qtype))
        counts[label] = counts.get(label, 0) + 1
        stored += t.data.nbytes
        f32 += 4 * int(np.prod(t.shape))
    summary = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
    if float32_copy:
        return f"{summary}: {stored / 1e6:.1f} MB, and a float32 copy of {f32 / 1e6:.1f} MB for MindSpore's graphs"
    return f"{summary}: {stored / 1e6:.1f} MB instead of {f32 / 1e6:.1f} MB of float32"
