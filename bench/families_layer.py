#!/usr/bin/env python
"""What a family's differences cost the CPU layer kernel, in one run: DecoderLayer on a Gemma-3-4B-shaped layer
(hidden 2560, 8 heads x 256, 4 KV heads, FFN 10240, Q4_K weights, a float16 cache), called through ctypes as
MindSpore calls it (kernels/aot_call.py), in three forms called alternately, so that the machine's noise falls on
all alike (compare them as ratios):
  llama    every switch off: LLaMA's layer of the same shape;
  global   Gemma 3's global layer: q/k head norms, sandwich norms, GELU-tanh, query_pre_attn_scalar;
  sliding  Gemma 3's sliding layer: the same with a 1,024-key window (5 of every 6 of its layers).
Steps: decode rows of long contexts (each row its own sequence) and the last 512-token chunk of an 8k prompt.
A Gemma 3 model's attention at 8k costs about (5 x sliding + global) / 6 a layer: the window's saving shows in
the "model" column. The weights are random K-quant super-blocks (their bytes, not their values, make the time).

    python bench/families_layer.py
    python bench/families_layer.py --steps decode:1:8192 --threads 2
Prints a table and writes JSON (default bench_results/families_layer.json).
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
from llm_serving.models.kernels.aot_call import invoke  # noqa: E402
from llm_serving.models.kernels.signatures import DECODER_LAYER  # noqa: E402

SHAPES = {"gemma3-4b": dict(h=2560, nh=8, kvh=4, d=256, inter=10240, scalar=256),
          "tiny": dict(h=256, nh=4, kvh=2, d=64, inter=512, scalar=64)}          # (for the test of this script)
BS, Q4_K, WINDOW = 16, 12, 1024
FORMS = {"llama": (0, 0, 0, 0), "global": (1, 1, 1, 0), "sliding": (1, 1, 1, WINDOW)}   # act, qk, sandwich, window
DEFAULT_STEPS = ("decode:1:8192", "decode:16:8192", "decode:64:2048", "prefill:512:8192")


def q4k_rows(rng, rows: int, cols: int) -> np.ndarray:
    """Random Q4_K rows (144 bytes per 256 weights), with small float16 scales so that sums stay finite."""
    blocks = rng.integers(0, 256, (rows * cols // 256, 144), dtype=np.uint8)
    blocks[:, 0:4] = np.full((len(blocks), 2), 1e-4, np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def step_arrays(rng, shape: dict, kind: str, n: int, context: int, form: tuple, weights: dict, cache: tuple,
                threads: int, invariant: bool = True) -> list:
    """DecoderLayer's parameters: `n` decode rows, each of its own sequence with `context` keys, or (prefill) the
    chunk of `n` tokens ending a prompt of `context` tokens."""
    h, nh, kvh, d = shape["h"], shape["nh"], shape["kvh"], shape["d"]
    if kind == "decode":
        width = (context + BS - 1) // BS
        tables = (np.arange(n, dtype=np.int32)[:, None] * width + np.arange(width, dtype=np.int32)).astype(np.int32)
        positions = np.full(n, context - 1, np.int32)
    else:
        width = (context + BS - 1) // BS
        tables = np.tile(np.arange(width, dtype=np.int32), (n, 1))
        positions = np.arange(context - n, context, dtype=np.int32)
    slots = (tables[np.arange(n), positions // BS] * BS + positions % BS).astype(np.int32)
    angles = np.arange(context)[:, None] / 10000.0 ** (np.arange(0, d, 2) / d)[None, :]
    cos = np.concatenate([np.cos(angles)] * 2, -1).astype(np.float32)
    sin = np.concatenate([-np.sin(angles), np.sin(angles)], -1).astype(np.float32)
    nqkv = (nh + 2 * kvh) * d
    lora = {}
    for name, parts, k, out in (("qkv", 3, h, nqkv), ("o", 1, nh * d, h), ("gate_up", 2, h, 2 * shape["inter"]),
                                ("down", 1, shape["inter"], h)):
        lora[f"lora_{name}_a"] = np.zeros((1, parts, k), np.float32)
        lora[f"lora_{name}_b"] = np.zeros((1, 1, out), np.float32)
    icfg = np.array([BS, nh, kvh, threads] + [Q4_K] * 7 + [int(invariant), *form], np.int32)
    fcfg = np.array([1e-6, shape["scalar"] ** -0.5], np.float32)
    x = rng.standard_normal((n, h), dtype=np.float32)
    gain = lambda size: (1 + 0.1 * rng.standard_normal(size)).astype(np.float32)    # noqa: E731
    return [*DECODER_LAYER.args(
        x=x, positions=positions, slots=slots, block_tables=tables, context_lens=positions + 1,
        tree_bits=np.full(n, -1, np.int32), cos=cos, sin=sin, lora=np.zeros(n, np.int32),
        qkv_bias=np.zeros(nqkv, np.float32), o_bias=np.zeros(h, np.float32), sinks=np.zeros(nh, np.float32),
        gate_up_bias=np.zeros(2 * shape["inter"], np.float32), down_bias=np.zeros(h, np.float32),
        norm_bias=np.zeros((4, h), np.float32),
        input_gain=gain(h), post_gain=gain(h), q_norm=gain(d), k_norm=gain(d),
        attn_out_gain=gain(h), mlp_out_gain=gain(h), key_cache=cache[0], value_cache=cache[1], iconfig=icfg,
        fconfig=fcfg, **weights, **lora), np.empty_like(x)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="gemma3-4b")
    ap.add_argument("--steps", default=",".join(DEFAULT_STEPS),
                    help="kind:rows:context, comma-separated (kind decode or prefill)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=6.0, help="least time per step, all forms together")
    ap.add_argument("--batch-invariant", type=int, choices=(0, 1), default=1,
                    help="the steps batch-invariant (1, the server's default) or each batch size's fastest (0)")
    ap.add_argument("--out", default="bench_results/families_layer.json")
    args = ap.parse_args(argv)
    shape = SHAPES[args.shape]
    h, nh, kvh, d, inter = shape["h"], shape["nh"], shape["kvh"], shape["d"], shape["inter"]
    func = ctypes.CDLL(build_kernel("decoder_layer_cpu", "DecoderLayer").rsplit(":", 1)[0]).DecoderLayer
    rng = np.random.default_rng(0)
    weights = {"q_w": q4k_rows(rng, nh * d, h), "k_w": q4k_rows(rng, kvh * d, h), "v_w": q4k_rows(rng, kvh * d, h),
               "o_w": q4k_rows(rng, h, nh * d), "gate_w": q4k_rows(rng, inter, h), "up_w": q4k_rows(rng, inter, h),
               "down_w": q4k_rows(rng, h, inter)}
    rows = []
    for spec in args.steps.split(","):
        kind, n, context = spec.split(":")
        n, context = int(n), int(context)
        sequences = n if kind == "decode" else 1
        slots = sequences * ((context + BS - 1) // BS) * BS
        cache = tuple((rng.standard_normal((slots * kvh, d)) * 0.5).astype(np.float16) for _ in range(2))
        arrays = {form: step_arrays(rng, shape, kind, n, context, code, weights, cache, args.threads,
                                    bool(args.batch_invariant))
                  for form, code in FORMS.items()}
        times = {form: [] for form in FORMS}
        for form in FORMS:                                              # a warm-up call each
            assert invoke(func, arrays[form]) == 0, form
        start = time.perf_counter()
        while time.perf_counter() - start < args.seconds or min(len(t) for t in times.values()) < 3:
            for form in FORMS:
                t = time.perf_counter()
                invoke(func, arrays[form])
                times[form].append(time.perf_counter() - t)
        ms = {form: 1e3 * float(np.median(t)) for form, t in times.items()}
        model = (5 * ms["sliding"] + ms["global"]) / 6
        rows.append({"step": f"{kind} {n} x {context}", "llama_ms": ms["llama"], "global_ms": ms["global"],
                     "sliding_ms": ms["sliding"], "global_vs_llama": ms["global"] / ms["llama"],
                     "sliding_vs_global": ms["sliding"] / ms["global"], "model_vs_llama": model / ms["llama"],
                     "calls": min(len(t) for t in times.values())})
    print(table(rows, [("step", "step", "{}"), ("llama_ms", "llama ms", "{:.2f}"), ("global_ms", "global ms", "{:.2f}"),
                       ("sliding_ms", "sliding ms", "{:.2f}"), ("global_vs_llama", "global/llama", "{:.3f}"),
                       ("sliding_vs_global", "sliding/global", "{:.3f}"),
                       ("model_vs_llama", "model/llama", "{:.3f}")]))
    write_json(args.out, {"bench": "families_layer", "machine": machine(), "shape": args.shape, **shape,
                          "window": WINDOW, "threads": args.threads, "batch_invariant": bool(args.batch_invariant), "weights": "Q4_K", "cache": "float16",
                          "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
