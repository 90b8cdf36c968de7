#!/usr/bin/env python
"""Repacked weights (kernels/gemm_avx2_int.h's 8-row panels, made at load by the library's RepackRows) against the
stored rows they come from: the integer product (IntegerProduct: the layer kernel's product of a weight matrix by
m rows of x, on the calling thread) at several row counts m, alternately call by call on the same matrix (so the
machine's noise falls on both: compare the ratio), and the repack's own time per GB (it runs once at load).

The matrix (--rows x --k of each type, random valid blocks) is small enough to stay in the last-level cache
unless --stream (then --copies copies, round robin, several times the cache): in cache the figures are the
kernels' instructions; streamed, at one row of x, the memory's bytes too. One thread; the layer's own figures at
batch 1 on two threads are bench/quantized_matvec.py --paths int,repacked.

    python bench/repack.py                                  # every type it repacks, m = 1, 2, 4, 8, 16, 64
    LLM_SERVING_KERNEL_MARCH=x86-64-v3 python bench/repack.py    # the AVX2 build, on an AVX-512 machine

Writes JSON (default bench_results/repack.json).
"""
from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine, table, write_json  # noqa: E402
from llm_serving.models.kernels import build_kernel, flags  # noqa: E402

# code, weights and bytes per block, f16 scale offsets in a block
TYPES = {"Q4_K": (12, 256, 144, (0, 2)), "Q6_K": (14, 256, 210, (208,)), "Q8_0": (8, 32, 34, (0,)),
         "Q4_0": (2, 32, 18, (0,)), "Q4_1": (3, 32, 20, (0, 2))}


def random_rows(rng, name: str, rows: int, k: int) -> np.ndarray:
    """(rows, row bytes) of valid blocks: random codes (and sub-block scales), f16 scales ~1e-3."""
    code, weights, size, scale_at = TYPES[name]
    blocks = rng.integers(0, 256, (rows * k // weights, size), dtype=np.uint8)
    for at in scale_at:
        blocks[:, at:at + 2] = np.full((len(blocks), 1), 1e-3, np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="Q4_K,Q6_K,Q8_0,Q4_0,Q4_1")
    ap.add_argument("--rows", type=int, default=4096, help="weight rows (a multiple of 8)")
    ap.add_argument("--k", type=int, default=2048, help="weights per row (a multiple of 256)")
    ap.add_argument("--m", default="1,2,4,8,16,64", help="rows of x, comma separated")
    ap.add_argument("--stream", action="store_true", help="copies of the matrix beyond the cache, round robin")
    ap.add_argument("--copies", type=int, default=24)
    ap.add_argument("--calls", type=int, default=40, help="calls per path at one row of x (fewer for more rows)")
    ap.add_argument("--out", default="bench_results/repack.json")
    args = ap.parse_args()
    lib = ctypes.CDLL(build_kernel("decoder_layer_cpu", "DecoderLayer").rsplit(":", 1)[0])
    u8, f32 = np.ctypeslib.ndpointer(np.uint8, flags="C"), np.ctypeslib.ndpointer(np.float32, flags="C")
    lib.RepackRows.restype = ctypes.c_int32
    lib.RepackRows.argtypes = [ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                               ctypes.c_int32]
    lib.IntegerProduct.argtypes = [ctypes.c_int32, u8, ctypes.c_int64, ctypes.c_int64, f32, ctypes.c_int64, f32]
    rng = np.random.default_rng(0)
    n, k = args.rows, args.k
    results = []
    for name in args.types.split(","):
        code = TYPES[name][0]
        stored = [random_rows(rng, name, n, k) for _ in range(args.copies if args.stream else 1)]
        packed, repack_s = [], []
        for rows in stored:
            out = np.empty_like(rows)
            t = time.perf_counter()
            to = lib.RepackRows(code, rows.ctypes.data, n, rows.shape[1], out.ctypes.data, 1)
            repack_s.append(time.perf_counter() - t)
            if to == 0:
                sys.exit(f"{name}: this build keeps the stored rows (RepackRows: 0): AMX's integer tiles, the integer "
                         "paths off, or LLM_SERVING_KERNEL_REPACK=0")
            packed.append(out)
        nbytes = stored[0].nbytes
        for m in (int(v) for v in args.m.split(",")):
            x = rng.standard_normal((m, k), dtype=np.float32)
            y = np.zeros((m, n), np.float32)
            times = {"stored": [], "repacked": []}
            for it in range(max(6, args.calls // m)):
                for path, ws, c in (("stored", stored, code), ("repacked", packed, to)):
                    w = ws[it % len(ws)]
                    t = time.perf_counter()
                    lib.IntegerProduct(c, w, n, k, x, m, y)
                    times[path].append(time.perf_counter() - t)
            a, b = float(np.median(times["stored"])), float(np.median(times["repacked"]))
            results.append({"type": name, "m": m, "stored_ms": a * 1e3, "repacked_ms": b * 1e3,
                            "stored_gb_s": nbytes / a / 1e9, "repacked_gb_s": nbytes / b / 1e9, "speedup": a / b,
                            "repack_gb_s": nbytes / float(np.median(repack_s)) / 1e9})
            r = results[-1]
            print(f"{name} m={m}: stored {r['stored_ms']:.3f} ms, repacked {r['repacked_ms']:.3f} ms, "
                  f"{r['speedup']:.2f}x", flush=True)
    print(table(results, [("type", "type", "{}"), ("m", "rows of x", "{}"), ("stored_ms", "stored ms", "{:.3f}"),
                          ("repacked_ms", "repacked ms", "{:.3f}"), ("stored_gb_s", "stored GB/s", "{:.1f}"),
                          ("repacked_gb_s", "repacked GB/s", "{:.1f}"), ("speedup", "speedup", "{:.2f}x"),
                          ("repack_gb_s", "repack GB/s (at load)", "{:.2f}")]))
    write_json(args.out, {"bench": "repack", "machine": machine(), "flags": flags(), "rows": n, "k": k,
                          "stream": args.stream, "copies": args.copies if args.stream else 1, "results": results})


if __name__ == "__main__":
    main()
