#!/usr/bin/env python
"""Quantized weights at decode batch 1: one DecoderLayer call (kernels/decoder_layer_cpu.cc, through ctypes as
MindSpore calls it) on a Llama-3.2-1B-shaped layer (hidden 2048, 32 heads x 64, 8 KV heads, FFN 8192), with
all four matrices (q/k/v, o, gate/up, down) in one GGML type each, on 2 threads.

At batch 1 the step reads every weight once, so the layer's time is its weight bytes over the memory bandwidth
it reaches: the table gives ms per layer (median and best call) and the stored weight bytes streamed per
second (GB/s, from the median and from the best). On a machine shared with other work the wall times include
the time a thread waits for its core: "cpu ms/thread" (the process's CPU time over the call / threads, spinning
at barriers included) and the GB/s from it are what the kernel takes when it has its cores. The layer is
copied enough times (a different copy per call, round robin) that the copies together are several times the
last-level cache, so every call streams its weights from memory. The weights are random but valid blocks
(finite scales); their values do not change the kernel's work.

--paths times each type on the kernel's paths for integer codes, alternately call by call (so that the machine's
noise falls on both; compare the ratio, "speedup"): "int", the integer products (KernelInt(1): gemm_avx2_int.h, or
AMX's tiles where they take the step), and "float", the float paths of before (KernelInt(0): the weights decoded to
float32). --invariant sets the process's batch invariance (KernelInvariant; the calls' iconfig does not say): 1,
the serving default (model_config.batch_invariant auto), or 0.

    python bench/quantized_matvec.py                         # every type, 2 threads, int and float paths
    python bench/quantized_matvec.py --types Q4_K,Q4_0 --threads 1 --iters 50 --paths int

Writes JSON (default bench_results/quantized_matvec.json).
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
from llm_serving.models.kernels import build_kernel  # noqa: E402
from llm_serving.models.kernels.aot_call import aot_args  # noqa: E402
from llm_serving.models.kernels.signatures import DECODER_LAYER  # noqa: E402

# GGML type: (code, bytes per block, weights per block, offsets of the f16 scale fields in a block)
TYPES = {
    "F16": (1, 2, 1, ()), "Q8_0": (8, 34, 32, (0,)), "Q4_0": (2, 18, 32, (0,)), "Q4_1": (3, 20, 32, (0,)),
    "Q4_K": (12, 144, 256, (0, 2)), "Q5_K": (13, 176, 256, (0, 2)), "Q6_K": (14, 210, 256, (208,)),
    "Q5_0": (6, 22, 32, (0,)), "Q5_1": (7, 24, 32, (0,)), "BF16": (30, 2, 1, ()),
}
DEFAULT_TYPES = "F16,Q8_0,Q4_0,Q4_1,Q4_K,Q5_K,Q6_K,Q5_0"


def random_rows(rng, name: str, rows: int, k: int) -> np.ndarray:
    """(rows, row bytes) uint8 of valid blocks: random codes, f16 scales about 0.01 (F16/BF16: small values)."""
    code, block_bytes, block_weights, scale_at = TYPES[name]
    if name == "F16":
        return (rng.standard_normal((rows, k), dtype=np.float32) * 0.02).astype(np.float16).view(np.uint8)
    if name == "BF16":
        f = (rng.standard_normal((rows, k), dtype=np.float32) * 0.02).view(np.uint32)
        return (f >> 16).astype(np.uint16).view(np.uint8)
    blocks = rng.integers(0, 256, (rows * k // block_weights, block_bytes), dtype=np.uint8)
    scale = np.full((len(blocks), 1), 0.01, np.float16).view(np.uint8)
    for at in scale_at:
        blocks[:, at:at + 2] = scale
    return blocks.reshape(rows, -1)


class Step:
    """One decode row's inputs for a layer of the given shape; `arrays(weights, threads)` the kernel's params."""

    def __init__(self, hidden=2048, heads=32, kv_heads=8, head_dim=64, inter=8192, context=128, block_size=16):
        rng = np.random.default_rng(0)
        self.h, self.nh, self.kvh, self.d, self.i = hidden, heads, kv_heads, head_dim, inter
        blocks = context // block_size + 1
        self.x = rng.standard_normal((1, hidden), dtype=np.float32)
        self.positions = np.array([context - 1], np.int32)
        self.tables = np.arange(blocks, dtype=np.int32)[None]
        self.context = np.array([context], np.int32)
        self.slots = self.positions.copy()
        self.tree = np.full(1, -1, np.int32)
        p = context + 1
        angles = np.arange(p)[:, None] / 10000.0 ** (np.arange(0, head_dim, 2) / head_dim)[None, :]
        self.cos = np.concatenate([np.cos(angles)] * 2, -1).astype(np.float32)
        self.sin = np.concatenate([-np.sin(angles), np.sin(angles)], -1).astype(np.float32)
        self.keys = rng.standard_normal((blocks * block_size * kv_heads, head_dim), dtype=np.float32)
        self.values = rng.standard_normal((blocks * block_size * kv_heads, head_dim), dtype=np.float32)
        nq = (heads + 2 * kv_heads) * head_dim
        self.bias = np.zeros(nq, np.float32)
        self.gain = np.ones(hidden, np.float32)
        self.lora = np.zeros(1, np.int32)
        self.lora_args = {}
        for name, parts, k, n in (("qkv", 3, hidden, nq), ("o", 1, heads * head_dim, hidden),
                                  ("gate_up", 2, hidden, 2 * inter), ("down", 1, inter, hidden)):
            self.lora_args[f"lora_{name}_a"] = np.zeros((1, parts, k), np.float32)
            self.lora_args[f"lora_{name}_b"] = np.zeros((1, 1, n), np.float32)
        self.block_size = block_size
        self.out = np.empty_like(self.x)

    def shapes(self):
        """(name, rows, k) of the four matrices."""
        nq, nkv = self.nh * self.d, self.kvh * self.d
        return (("q_w", nq, self.h), ("k_w", nkv, self.h), ("v_w", nkv, self.h), ("o_w", self.h, self.nh * self.d),
                ("gate_w", self.i, self.h), ("up_w", self.i, self.h), ("down_w", self.h, self.i))

    def arrays(self, weights: dict, code: int, threads: int) -> list:
        icfg = np.array([self.block_size, self.nh, self.kvh, threads] + [code] * 7, np.int32)
        return [*DECODER_LAYER.args(
            x=self.x, positions=self.positions, slots=self.slots, block_tables=self.tables,
            context_lens=self.context, tree_bits=self.tree, cos=self.cos, sin=self.sin, lora=self.lora,
            qkv_bias=self.bias, o_bias=np.zeros(len(self.gain), np.float32), sinks=np.zeros(self.nh, np.float32),
            gate_up_bias=np.zeros(2 * self.i, np.float32), down_bias=np.zeros(len(self.gain), np.float32),
            norm_bias=np.zeros((4, len(self.gain)), np.float32),
            **weights, input_gain=self.gain, post_gain=self.gain, key_cache=self.keys,
            q_norm=np.ones(self.d, np.float32), k_norm=np.ones(self.d, np.float32), attn_out_gain=self.gain,
            mlp_out_gain=self.gain,
            value_cache=self.values, iconfig=icfg, fconfig=np.array([1e-5], np.float32), **self.lora_args),
            self.out]


PATHS = {"int": 1, "repacked": 1, "float": 0}          # KernelInt's setting for each


def repacked_layers(lib, layers: list, code: int, shapes) -> tuple:
    """The layers' matrices repacked by the library (RepackRows: the row-interleaved layout its integer products
    read), and the repacked type's code; None where this build keeps the type as stored."""
    lib.RepackRows.restype = ctypes.c_int32
    lib.RepackRows.argtypes = [ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                               ctypes.c_int32]
    out, to = [], 0
    for layer in layers:
        packed = {}
        for n, rows, k in shapes:
            w = layer[n]
            dst = np.empty_like(w)
            to = lib.RepackRows(code, w.ctypes.data, rows, w.shape[1], dst.ctypes.data, 1)
            if to == 0:
                return None, 0
            packed[n] = dst
        out.append(packed)
    return out, to


def time_type(lib, step: Step, name: str, threads: int, iters: int, stream_bytes: float, paths: list) -> list:
    """One row per path: the layer's ms and GB/s on `name` weights, the paths' calls alternating."""
    rng = np.random.default_rng(1)
    code = TYPES[name][0]
    one = {n: random_rows(rng, name, rows, k) for n, rows, k in step.shapes()}
    layer_bytes = sum(w.nbytes for w in one.values())
    copies = max(2, int(np.ceil(stream_bytes / layer_bytes)))
    layers = [one] + [{n: w.copy() for n, w in one.items()} for _ in range(copies - 1)]
    calls = {path: [aot_args(step.arrays(w, code, threads)) for w in layers] for path in paths if path != "repacked"}
    if "repacked" in paths:
        lib.KernelInt(1)
        packed, to = repacked_layers(lib, layers, code, step.shapes())
        if packed is None:
            print(f"{name}: not repacked by this build (RepackRows): the repacked path left out", flush=True)
            paths = [p for p in paths if p != "repacked"]
        else:
            calls["repacked"] = [aot_args(step.arrays(w, to, threads)) for w in packed]
    for path in paths:                                            # warm up: the pool, the code
        lib.KernelInt(PATHS[path])
        for args, _ in calls[path][:2]:
            assert lib.DecoderLayer(*args) == 0, name
    times = {path: [] for path in paths}
    cpu = {path: [] for path in paths}
    for it in range(iters):
        for path in paths:
            args, _ = calls[path][it % copies]
            lib.KernelInt(PATHS[path])
            c, t = time.process_time(), time.perf_counter()
            rc = lib.DecoderLayer(*args)
            times[path].append(time.perf_counter() - t)
            cpu[path].append((time.process_time() - c) / threads)
            assert rc == 0, name
    lib.KernelInt(1)
    rows = []
    for path in paths:
        ms = float(np.median(times[path])) * 1e3
        cpu_ms = float(np.median(cpu[path])) * 1e3
        rows.append({"type": name, "code": code, "path": path, "layer_mb": layer_bytes / 1e6,
                     "bits_per_weight": 8 * layer_bytes / sum(r * k for _, r, k in step.shapes()),
                     "ms": ms, "best_ms": float(np.min(times[path])) * 1e3, "gb_s": layer_bytes / (ms * 1e-3) / 1e9,
                     "best_gb_s": layer_bytes / np.min(times[path]) / 1e9, "cpu_ms": cpu_ms,
                     "cpu_gb_s": layer_bytes / (cpu_ms * 1e-3) / 1e9, "copies": copies})
    for row in rows:                                              # against the last path (float, by default)
        row["speedup"] = rows[-1]["ms"] / row["ms"]
        row["cpu_speedup"] = rows[-1]["cpu_ms"] / row["cpu_ms"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default=DEFAULT_TYPES, help=f"comma-separated GGML types ({', '.join(TYPES)})")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--stream-gb", type=float, default=1.5,
                    help="the layer's copies together at least this many GB (beyond the last-level cache)")
    ap.add_argument("--paths", default="int,float",
                    help="comma-separated: int, repacked (the int path on weights repacked at load, where the build "
                         "repacks the type), float (timed alternately)")
    ap.add_argument("--invariant", type=int, default=1, choices=(0, 1),
                    help="batch invariance (KernelInvariant): 1 the serving default, 0 off")
    ap.add_argument("--out", default="bench_results/quantized_matvec.json")
    args = ap.parse_args()
    lib = ctypes.CDLL(build_kernel("decoder_layer_cpu", "DecoderLayer").rsplit(":", 1)[0])
    lib.KernelInt.argtypes = [ctypes.c_int]
    lib.KernelInvariant.argtypes = [ctypes.c_int]
    lib.KernelInvariant(args.invariant)
    paths = args.paths.split(",")
    step = Step()
    rows = []
    for name in args.types.split(","):
        rows += time_type(lib, step, name, args.threads, args.iters, args.stream_gb * 1e9, paths)
        done = [r for r in rows if r["type"] == name]
        print("  ".join(f"{name} {r['path']}: {r['ms']:.3f} ms, {r['gb_s']:.1f} GB/s" for r in done),
              flush=True)
    print(table(rows, [("type", "type", "{}"), ("path", "path", "{}"), ("bits_per_weight", "bits/weight", "{:.2f}"),
                       ("layer_mb", "layer MB", "{:.1f}"), ("ms", "ms/layer", "{:.3f}"),
                       ("best_ms", "best ms", "{:.3f}"), ("gb_s", "GB/s", "{:.1f}"),
                       ("best_gb_s", "best GB/s", "{:.1f}"), ("cpu_ms", "cpu ms/thread", "{:.3f}"),
                       ("cpu_gb_s", "GB/s by cpu", "{:.1f}"), ("speedup", "speedup", "{:.2f}x"),
                       ("cpu_speedup", "cpu speedup", "{:.2f}x")]))
    write_json(args.out, {"bench": "quantized_matvec", "machine": machine(),
                          "shape": {"hidden": step.h, "heads": step.nh, "kv_heads": step.kvh, "head_dim": step.d,
                                    "inter": step.i, "batch": 1, "context": int(step.context[0])},
                          "threads": args.threads, "iters": args.iters, "paths": paths,
                          "invariant": args.invariant, "results": rows})


if __name__ == "__main__":
    main()
