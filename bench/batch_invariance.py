#!/usr/bin/env python
"""What batch invariance (model_config.batch_invariant; here the layer kernel's KernelInvariant switch) costs the CPU
kernels, in one run: DecoderLayer and FinalLogits on bench/layer_kernel_gemm.py's Llama-3.2-1B-shaped layer and
lm_head, float32 or GGUF-quantized, at decode batches of 1..64 rows and one 512-token prefill, called through
ctypes as MindSpore calls them, with the same library switched between its fastest paths (KernelInvariant(0),
the default) and batch-invariant steps, alternately, so that the machine's noise falls on both: compare them as
ratios ("invariant / fastest" > 1 is the time invariance adds).

    python bench/batch_invariance.py
    python bench/batch_invariance.py --batches 1,16,64 --types q8_0,q4_k

Prints a table and writes JSON (default bench_results/batch_invariance.json).
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine, table, write_json  # noqa: E402
from bench.layer_kernel_gemm import (BS, D, H, INTER, KVH, NH, as_kernel_weight, layer_weights,  # noqa: E402
                                     logits_arrays, step_arrays)
from llm_serving.models.kernels import build_kernel  # noqa: E402
from llm_serving.models.kernels.aot_call import invoke  # noqa: E402


def time_modes(lib, func, arrays, min_calls: int, min_seconds: float) -> dict:
    """Median wall and CPU seconds per call in each mode, the modes alternating call by call."""
    times = {0: [], 1: []}
    for mode in times:
        lib.KernelInvariant(mode)
        assert invoke(func, arrays) == 0
    start = time.perf_counter()
    while min(len(t) for t in times.values()) < min_calls or time.perf_counter() - start < min_seconds:
        for mode in times:
            lib.KernelInvariant(mode)
            t, c = time.perf_counter(), time.process_time()
            invoke(func, arrays)
            times[mode].append((time.perf_counter() - t, time.process_time() - c))
        if time.perf_counter() - start > 20 * min_seconds and min(len(t) for t in times.values()) >= 2:
            break
    lib.KernelInvariant(0)
    return {mode: (statistics.median(w for w, _ in t), statistics.median(c for _, c in t)) for mode, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,4,16,64,512", help="rows per step; the largest is a prefill")
    ap.add_argument("--prefill", type=int, default=512, help="batches of this size run as one prefill")
    ap.add_argument("--types", default="f32,q8_0,q4_k")
    ap.add_argument("--logits-batches", default="1,16,64")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=1.0, help="least time per measurement and mode")
    ap.add_argument("--out", default="bench_results/batch_invariance.json")
    args = ap.parse_args()
    lib = ctypes.CDLL(build_kernel("decoder_layer_cpu", "DecoderLayer").rsplit(":", 1)[0])
    lib.KernelInvariant.argtypes = [ctypes.c_int]
    rng = np.random.default_rng(0)
    rows = []
    nb = 4096
    for kind in args.types.split(","):
        weights = {k: as_kernel_weight(v, kind) for k, v in layer_weights(rng).items()}
        for batch in [int(b) for b in args.batches.split(",")]:
            prefill = batch >= args.prefill
            cache = tuple(np.zeros((nb * BS * KVH, D), np.float16) for _ in range(2))
            arrays = step_arrays(rng, batch, prefill, weights, kind, cache, args.threads)
            secs = time_modes(lib, lib.DecoderLayer, arrays, 3, args.seconds)
            rows.append(row("layer", kind, batch, "prefill" if prefill else "decode", secs))
        lm_head = as_kernel_weight(rng.standard_normal((args.vocab, H), dtype=np.float32) * 0.02, kind)
        for batch in [int(b) for b in args.logits_batches.split(",") if b]:
            arrays = logits_arrays(rng, batch, lm_head, kind, args.threads, args.vocab)
            secs = time_modes(lib, lib.FinalLogits, arrays, 3, args.seconds)
            rows.append(row("logits", kind, batch, "decode", secs))
    print(table(rows, [("kernel", "kernel", "{}"), ("weights", "weights", "{}"), ("rows", "rows", "{}"),
                       ("step", "step", "{}"), ("fastest_ms", "fastest ms", "{:.2f}"),
                       ("invariant_ms", "invariant ms", "{:.2f}"), ("wall_ratio", "invariant/fastest", "{:.2f}"),
                       ("cpu_ratio", "cpu ratio", "{:.2f}")]))
    write_json(args.out, {"machine": machine(), "shape": {"hidden": H, "heads": NH, "kv_heads": KVH, "head_dim": D,
                                                          "inter": INTER, "vocab": args.vocab},
                          "threads": args.threads, "rows": rows})


def row(kernel: str, kind: str, batch: int, step: str, secs: dict) -> dict:
    (fw, fc), (iw, ic) = secs[0], secs[1]
    r = {"kernel": kernel, "weights": kind, "rows": batch, "step": step, "fastest_ms": round(fw * 1e3, 2),
         "invariant_ms": round(iw * 1e3, 2), "wall_ratio": round(iw / fw, 3), "cpu_ratio": round(ic / fc, 3)}
    print(r, flush=True)
    return r


if __name__ == "__main__":
    main()
