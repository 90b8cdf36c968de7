#!/usr/bin/env python
"""The vision tower's CPU kernels alone (kernels/vision_layer_cpu.cc), called through ctypes as MindSpore calls them,
at Gemma-3-4B's SigLIP shape (4,096 patches, width 1,152, 16 heads, MLP 4,304): VisionAttention's seconds and
GFLOP/s (float32, the values' product in int16, and the scores' too), and VisionLinear's four products of a layer
(q|k|v, out, fc1, fc2) on F16 panels (on FMAs, and on AMX tiles where the CPU has them) and on int16 panels
(model_config.vision_int16) against numpy's float32 matmul (OpenBLAS) on the same values, in turn, so that the
machine's noise falls on all of them; the best of --runs each, and each one's error (the products' against the
float64 product, the attention's against its float32 kernel).

    python bench/vision_kernels.py
    python bench/vision_kernels.py --threads 1 --runs 5

Writes JSON (default bench_results/vision_kernels.json).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine, write_json  # noqa: E402

PATCHES, WIDTH, HEADS, MLP = 4096, 1152, 16, 4304
PRODUCTS = {"qkv": (WIDTH, 3 * WIDTH), "out": (WIDTH, WIDTH), "fc1": (WIDTH, MLP), "fc2": (MLP, WIDTH)}   # (K, N)


def best(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default="bench_results/vision_kernels.json")
    args = ap.parse_args(argv)

    from llm_serving.models.kernels import build_kernel
    from llm_serving.models.kernels.aot_call import invoke
    from llm_serving.models.kernels.vision_panels import float_panels, int16_panels

    library = ctypes.CDLL(build_kernel("vision_layer_cpu", "VisionAttention").rsplit(":", 1)[0])
    rng = np.random.default_rng(0)
    result = {"machine": machine(), "threads": args.threads}

    qkv = (rng.standard_normal((PATCHES, 3 * WIDTH)) * 2).astype(np.float32)    # scores of a few units
    no_bias = np.zeros(3 * WIDTH, np.float32)
    amx = bool(library.VisionAmx(1))          # the float paths on AMX tiles too, where the CPU has them
    library.VisionAmx(0)
    # float32, int16 values, and scores (3: the float path on AMX tiles)
    outs = {level: np.zeros((PATCHES, WIDTH), np.float32) for level in range(4 if amx else 3)}

    def attention(level):
        library.VisionAmx(int(level == 3))
        try:
            return invoke(library.VisionAttention, [qkv, no_bias, np.array([PATCHES, HEADS, args.threads, level % 3],
                                                                           np.int32), outs[level]])
        finally:
            library.VisionAmx(0)
    calls = {level: (lambda level=level: attention(level)) for level in outs}
    times = {level: [] for level in outs}
    for _ in range(args.runs):                      # in turn
        for level, call in calls.items():
            times[level].append(best(call, 1))
    flops = 4.0 * PATCHES * PATCHES * WIDTH
    print(f"{machine().get('cpu', '')}, {args.threads} threads")
    names = {0: "float32", 1: "int16 values (vision_int16)", 2: "int16 scores too (vision_int16_scores)",
             **({3: "float32 on AMX tiles (bfloat16 pieces)"} if amx else {})}
    result["attention"] = {}
    for level, name in names.items():
        seconds = min(times[level])
        apart = float(np.abs(outs[level] - outs[0]).max() / np.abs(outs[0]).max())
        result["attention"][name] = {"seconds": seconds, "gflops": flops / seconds / 1e9, "apart_from_float32": apart}
        print(f"VisionAttention, {HEADS} heads x {PATCHES} patches, {name}: {seconds:.3f} s "
              f"({flops / seconds / 1e9:.0f} GFLOP/s; {seconds / min(times[0]):.2f}x float32's time), apart from "
              f"float32's output by {apart:.1e} of its largest")

    totals = {"kernel": 0.0, "int16": 0.0, "numpy": 0.0, **({"amx": 0.0} if amx else {})}
    for name, (k, n) in PRODUCTS.items():
        x = rng.standard_normal((PATCHES, k), dtype=np.float32)
        w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float16)
        wide, bias = w.astype(np.float32), np.zeros(n, np.float32)
        packed = float_panels(wide).astype(np.float16)
        codes, steps = int16_panels(wide)
        outs = {kind: np.zeros((PATCHES, n), np.float32) for kind in ("kernel", "int16", "amx") if kind in totals}
        config = np.array([args.threads, 0], np.int32)

        def on_amx():
            library.VisionAmx(1)
            try:
                return invoke(library.VisionLinear, [x, packed, bias, config, outs["amx"]])
            finally:
                library.VisionAmx(0)
        calls = {"kernel": lambda: invoke(library.VisionLinear, [x, packed, bias, config, outs["kernel"]]),
                 "int16": lambda: invoke(library.VisionLinear, [x, codes, np.stack([bias, steps]), config,
                                                                outs["int16"]]),
                 "numpy": lambda: x @ wide.T, **({"amx": on_amx} if amx else {})}
        times = {kind: [] for kind in calls}
        for _ in range(args.runs):                  # in turn
            for kind, call in calls.items():
                times[kind].append(best(call, 1))
        exact = x.astype(np.float64) @ wide.T.astype(np.float64)
        gaps = {kind: float(np.abs(out - exact).max() / np.abs(exact).max()) for kind, out in outs.items()}
        flops = 2.0 * PATCHES * k * n
        row = {kind: {"seconds": min(t), "gflops": flops / min(t) / 1e9} for kind, t in times.items()}
        result[name] = {**row, "max_relative_error": gaps}
        for kind in totals:
            totals[kind] += row[kind]["seconds"]
        print(f"{name} ({PATCHES} x {k} x {n}): VisionLinear on F16 panels {row['kernel']['seconds']:.3f} s "
              f"({row['kernel']['gflops']:.0f} GFLOP/s), on int16 panels {row['int16']['seconds']:.3f} s "
              f"({row['int16']['gflops']:.0f}), numpy float32 {row['numpy']['seconds']:.3f} s "
              f"({row['numpy']['gflops']:.0f}); off the float64 product by {gaps['kernel']:.1e} (F16 panels), "
              f"{gaps['int16']:.1e} (int16)")
        if amx:
            print(f"    on AMX tiles (F16 panels as bfloat16 pieces): {row['amx']['seconds']:.3f} s "
                  f"({row['amx']['gflops']:.0f} GFLOP/s), off the float64 product by {gaps['amx']:.1e}")
    library.VisionAmx(1)
    result["layer_products"] = totals
    print(f"a layer's four products: VisionLinear {totals['kernel']:.3f} s on F16 panels, {totals['int16']:.3f} s on "
          f"int16 ({totals['int16'] / totals['kernel']:.2f}x), numpy {totals['numpy']:.3f} s "
          f"(F16 panels {totals['kernel'] / totals['numpy']:.2f}x, int16 {totals['int16'] / totals['numpy']:.2f}x)"
          + (f"; on AMX tiles {totals['amx']:.3f} s ({totals['amx'] / totals['int16']:.2f}x int16's)" if amx else ""))
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
