#!/usr/bin/env python
"""The whole-layer CPU kernel's batched products, before and after, in one run: DecoderLayer on a
Llama-3.2-1B-shaped layer (hidden 2048, 32 heads x 64, 8 KV heads, FFN 8192) and FinalLogits (vocab 49152 x
2048), called through ctypes as MindSpore calls them (kernels/aot_call.py's invoke), with the weights
float32 or GGUF-quantized (gguf.quants.quantize), at decode batches of 1..256 rows (each row its own sequence,
~64 keys of context) and one 512-token prefill (positions 0..511 of one sequence, causal context).

"before" is decoder_layer_cpu.cc (its other units and its headers) as git holds them at --baseline (default: main),
compiled with the same flags into a temporary directory; "after" is the working tree's. The two libraries are called
alternately, so that the machine's noise (2 shared cores) falls on both alike: compare them as ratios. Both take
the same parameters (q/k/v and gate/up as separate inputs: a baseline from before they were split cannot be
called with these arguments).
--invariant sets both libraries' batch invariance (KernelInvariant; the calls' iconfig does not say): 1 the serving
default (model_config.batch_invariant auto), 0 the fastest path per row count; unset, each library's own process
setting (off unless LLM_SERVING_KERNEL_INVARIANT=1).
--repack repacks the quantized weights as the runner does at load (where the library repacks the type), and each
row says whether the two libraries gave the same bits.
GFLOP/s counts the weight products only (2 * weights * rows per call); attention is in the time, not in the FLOPs.
"GF/s/core" divides the same FLOPs by the process's CPU time per call (every thread of the kernel): on a machine
other processes share, the wall time says how much of the cores the kernel got, the CPU time what its work cost.

    python bench/layer_kernel_gemm.py
    python bench/layer_kernel_gemm.py --batches 16,64 --types q8_0 --baseline HEAD~1
    python bench/layer_kernel_gemm.py --types q4_k,q6_k,q8_0 --batches 1,4,16,64,512 --invariant 1
    python bench/layer_kernel_gemm.py --baseline HEAD~3 --repack --types q4_k,q6_k,q8_0,q4_1,f32 --batches 1,16,512

Prints a table and writes JSON (default bench_results/layer_kernel_gemm.json).
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine, table, write_json  # noqa: E402
from llm_serving.models.kernels import (FLAGS, INT_TYPES, TYPED_UNITS, _compiler, _Unit, build_kernel,  # noqa: E402
                                        compile_libraries, sources)
from llm_serving.models.kernels.aot_call import invoke  # noqa: E402
from llm_serving.models.kernels.repack import repack_rows  # noqa: E402
from llm_serving.models.kernels.signatures import DECODER_LAYER, FINAL_LOGITS  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
KERNELS = "llm_serving/models/kernels"
H, NH, KVH, D, INTER, BS = 2048, 32, 8, 64, 8192, 16
TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 8, "q4_k": 12, "q5_k": 13, "q6_k": 14}


def build_baseline(ref: str, out_dir: Path) -> Path:
    """decoder_layer_cpu.cc and every header beside it as `ref` holds them, compiled like build_kernel does."""
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{ref}:{KERNELS}"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split()
    for name in names:
        if name.endswith((".cc", ".h")):
            text = subprocess.run(["git", "show", f"{ref}:{KERNELS}/{name}"], cwd=REPO, check=True,
                                  capture_output=True).stdout
            (out_dir / name).write_bytes(text)
    target = out_dir / "decoder_layer_cpu_baseline.so"
    units = [out_dir / unit for unit in sources("decoder_layer_cpu") if (out_dir / unit).exists()]   # (a ref
    typed = out_dir / TYPED_UNITS["decoder_layer_cpu"]                       # before the split: its one .cc)
    if typed.exists() and b"LLM_SERVING_INT_TYPE" in typed.read_bytes():   # (a ref of a unit per integer type)
        units += [_Unit(typed, name) for name in INT_TYPES]
    compile_libraries(_compiler(), FLAGS, [(units, target)])
    return target


def as_kernel_weight(w: np.ndarray, kind: str) -> np.ndarray:
    if kind == "f32":
        return w
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    qtype = GGMLQuantizationType[kind.upper()]
    if kind.endswith("_k"):             # gguf cannot quantize the K-quants: random super-blocks, f16 scales 1e-4
        block, size = GGML_QUANT_SIZES[qtype]
        rng = np.random.default_rng(int(qtype))
        blocks = rng.integers(0, 256, (w.size // block, size), dtype=np.uint8)
        scale = np.full((len(blocks), 1), 2.5e-5 if kind == "q6_k" else 1e-4, np.float16).view(np.uint8)
        for at in ((size - 2,) if kind == "q6_k" else (0, 2)):
            blocks[:, at:at + 2] = scale
        return blocks.reshape(w.shape[0], -1)
    return quantize(w, qtype).view(np.uint8)


def layer_weights(rng) -> dict:
    f32 = lambda *s: (rng.standard_normal(s, dtype=np.float32) * 0.02)          # noqa: E731
    return {"q_w": f32(NH * D, H), "k_w": f32(KVH * D, H), "v_w": f32(KVH * D, H), "o_w": f32(H, NH * D),
            "gate_w": f32(INTER, H), "up_w": f32(INTER, H), "down_w": f32(H, INTER)}


def step_arrays(rng, batch: int, prefill: bool, weights: dict, code: int, cache: tuple, threads: int) -> list:
    """DecoderLayer's parameters for one step: `batch` decode rows (own blocks, 64 keys each) or one prefill of
    `batch` tokens (positions 0..batch-1, causal); `code`: the weights' type code (TYPES, or a repacked one)."""
    if prefill:
        width = (batch + BS - 1) // BS
        tables = np.tile(np.arange(width, dtype=np.int32), (batch, 1))
        positions = np.arange(batch, dtype=np.int32)
    else:
        width = 4
        tables = (width * np.arange(batch, dtype=np.int32)[:, None] + np.arange(width, dtype=np.int32)
                  + 64).astype(np.int32)
        positions = np.full(batch, 63, np.int32)
    context = positions + 1
    slots = (tables[np.arange(batch), positions // BS] * BS + positions % BS).astype(np.int32)
    p = max(1024, batch)                                   # rope rows for every position
    angles = np.arange(p)[:, None] / 10000.0 ** (np.arange(0, D, 2) / D)[None, :]
    cos = np.concatenate([np.cos(angles)] * 2, -1).astype(np.float32)
    sin = np.concatenate([-np.sin(angles), np.sin(angles)], -1).astype(np.float32)
    nqkv = (NH + 2 * KVH) * D
    lora = {}
    for name, parts, k, n in (("qkv", 3, H, nqkv), ("o", 1, NH * D, H), ("gate_up", 2, H, 2 * INTER),
                              ("down", 1, INTER, H)):
        lora[f"lora_{name}_a"] = np.zeros((1, parts, k), np.float32)
        lora[f"lora_{name}_b"] = np.zeros((1, 1, n), np.float32)
    icfg = np.array([BS, NH, KVH, threads] + [code] * 7, np.int32)
    x = rng.standard_normal((batch, H), dtype=np.float32)
    return [*DECODER_LAYER.args(
        x=x, positions=positions, slots=slots, block_tables=tables, context_lens=context.astype(np.int32),
        tree_bits=np.full(batch, -1, np.int32), cos=cos, sin=sin, lora=np.zeros(batch, np.int32),
        qkv_bias=np.zeros(nqkv, np.float32), o_bias=np.zeros(H, np.float32), sinks=np.zeros(NH, np.float32),
        gate_up_bias=np.zeros(2 * INTER, np.float32), down_bias=np.zeros(H, np.float32),
        norm_bias=np.zeros((4, H), np.float32),
        input_gain=np.ones(H, np.float32), post_gain=np.ones(H, np.float32),
        q_norm=np.ones(D, np.float32), k_norm=np.ones(D, np.float32), attn_out_gain=np.ones(H, np.float32),
        mlp_out_gain=np.ones(H, np.float32), key_cache=cache[0], value_cache=cache[1], iconfig=icfg, fconfig=np.array([1e-5], np.float32),
        **weights, **lora), np.empty_like(x)]


def logits_arrays(rng, rows: int, lm_head: np.ndarray, kind: str, threads: int, vocab: int) -> list:
    x = rng.standard_normal((rows, H), dtype=np.float32)
    args = FINAL_LOGITS.args(x=x, lm_head=lm_head, gain=np.ones(H, np.float32), slots=np.arange(rows, dtype=np.int32),
                             iconfig=np.array([threads, TYPES[kind]], np.int32), fconfig=np.array([1e-5], np.float32))
    return [*args, np.empty((rows, vocab), np.float32), np.empty(rows, np.int32), np.empty(rows, np.float32)]


def time_pair(funcs: dict, arrays: list, min_calls: int, min_seconds: float) -> dict:
    """Per function, called alternately (one warm-up call each first): (median wall seconds per call, median
    process CPU seconds per call). On a shared machine the wall time mostly says how much of the cores the kernel
    got; the CPU time (all the kernel's threads, barrier spins included) says what its work cost."""
    times = {name: [] for name in funcs}
    for f in funcs.values():
        assert invoke(f, arrays) == 0
    start = time.perf_counter()
    while min(len(t) for t in times.values()) < min_calls or time.perf_counter() - start < min_seconds:
        for name, f in funcs.items():
            t, c = time.perf_counter(), time.process_time()
            invoke(f, arrays)
            times[name].append((time.perf_counter() - t, time.process_time() - c))
        if time.perf_counter() - start > 20 * min_seconds and min(len(t) for t in times.values()) >= 2:
            break
    return {name: (statistics.median(w for w, _ in t), statistics.median(c for _, c in t)) for name, t in times.items()}


def record(row: dict, secs: dict, flops: float) -> dict:
    for name, (wall, cpu) in secs.items():
        row[f"{name}_ms"] = wall * 1e3
        row[f"{name}_gflops"] = flops / wall / 1e9
        row[f"{name}_cpu_ms"] = cpu * 1e3
        row[f"{name}_gflops_per_core"] = flops / cpu / 1e9 if cpu > 0 else None
    if "before" in secs:
        row["speedup"] = secs["before"][0] / secs["after"][0]
        row["cpu_speedup"] = secs["before"][1] / secs["after"][1]
    print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default="main", help="git ref whose kernel is 'before' ('' to skip it)")
    ap.add_argument("--batches", default="1,4,16,64,256,512", help="rows per step; the largest is a prefill")
    ap.add_argument("--prefill", type=int, default=512, help="batches of this size run as one prefill")
    ap.add_argument("--types", default="f32,q8_0,q4_1")
    ap.add_argument("--logits-batches", default="16,64")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=1.0, help="least time per measurement and library")
    ap.add_argument("--invariant", type=int, choices=(0, 1), default=None,
                    help="both libraries' batch invariance (KernelInvariant): 1 on, 0 off (unset: their own setting)")
    ap.add_argument("--repack", action="store_true",
                    help="repack the quantized weights as the runner does at load (kernels/repack.py) where the type "
                         "is one the library repacks")
    ap.add_argument("--out", default="bench_results/layer_kernel_gemm.json")
    args = ap.parse_args()

    libs = {}
    tmp = tempfile.TemporaryDirectory()
    if args.baseline:
        libs["before"] = ctypes.CDLL(str(build_baseline(args.baseline, Path(tmp.name))))
    after = build_kernel("decoder_layer_cpu", "DecoderLayer", Path(tmp.name)).rsplit(":", 1)[0]
    libs["after"] = ctypes.CDLL(after)
    if args.invariant is not None:
        for lib in libs.values():
            lib.KernelInvariant.argtypes = [ctypes.c_int]
            lib.KernelInvariant(args.invariant)
    rng = np.random.default_rng(0)
    batches = [int(b) for b in args.batches.split(",")]
    weights = layer_weights(rng)
    n_weights = sum(w.size for w in weights.values())
    blocks = 64 + 4 * max(batches)
    cache = tuple(rng.standard_normal((blocks * BS * KVH, D), dtype=np.float32) for _ in range(2))
    rows = []
    for kind in args.types.split(","):
        kw = {n: as_kernel_weight(w, kind) for n, w in weights.items()}
        code = TYPES[kind]
        if args.repack and kind != "f32":          # (the same layout from both libraries: a test holds them to it)
            kw = {n: repack_rows(after, w, code) for n, w in kw.items()}
            code = next(iter(kw.values()))[1]
            kw = {n: w for n, (w, _) in kw.items()}
        for batch in batches:
            prefill = batch == args.prefill
            arrays = step_arrays(rng, batch, prefill, kw, code, cache, args.threads)
            outs = []
            for lib in libs.values():               # the same bits from both?
                assert invoke(lib.DecoderLayer, arrays) == 0
                outs.append(arrays[-1].copy())
            secs = time_pair({n: lib.DecoderLayer for n, lib in libs.items()}, arrays, 3, args.seconds)
            row = {"kernel": "layer", "weights": kind + (" repacked" if code >= 100 else ""), "rows": batch,
                   "step": "prefill" if prefill else "decode",
                   "same_bits": all(np.array_equal(outs[0], o) for o in outs[1:])}
            rows.append(record(row, secs, 2 * n_weights * batch))
    del weights
    head = rng.standard_normal((args.vocab, H), dtype=np.float32) * 0.02
    for kind in args.types.split(","):
        kw = as_kernel_weight(head, kind)
        for batch in (int(b) for b in args.logits_batches.split(",") if b):
            arrays = logits_arrays(rng, batch, kw, kind, args.threads, args.vocab)
            secs = time_pair({n: lib.FinalLogits for n, lib in libs.items()}, arrays, 3, args.seconds)
            row = {"kernel": "logits", "weights": kind, "rows": batch, "step": "decode"}
            rows.append(record(row, secs, 2 * head.size * batch))
    cols = [("kernel", "kernel", "{}"), ("weights", "weights", "{}"), ("rows", "rows", "{}"), ("step", "step", "{}")]
    if "before" in libs:
        cols.append(("same_bits", "same bits", "{}"))
    for name in libs:
        cols += [(f"{name}_ms", f"{name} ms", "{:.2f}"), (f"{name}_gflops", f"{name} GF/s", "{:.1f}"),
                 (f"{name}_gflops_per_core", f"{name} GF/s/core", "{:.1f}")]
    if "before" in libs:
        cols += [("speedup", "speedup", "{:.2f}x"), ("cpu_speedup", "cpu speedup", "{:.2f}x")]
    print(table(rows, cols))
    write_json(args.out, {"machine": machine(), "threads": args.threads, "baseline": args.baseline,
                          "invariant": args.invariant,
                          "layer": {"hidden": H, "heads": NH, "kv_heads": KVH, "head_dim": D, "inter": INTER,
                                    "weights": n_weights},
                          "vocab": args.vocab, "rows": rows})


if __name__ == "__main__":
    main()
