#!/usr/bin/env python
"""Step roofline: the bare agent step (ModelRunner.execute, no HTTP, no scheduler, no shm) at decode batch
1..128, next to a numpy BLAS matmul of the same FLOPs measured in the same run.

The matmul is X (B, H) @ W (H, P/H), P = every weight the decode step multiplies by (layers + lm_head), so
it does the step's 2*B*P matmul FLOPs and reads the same weight bytes; attention over the context
(4*B*ctx*layers*heads*head_dim FLOPs) is added to the step's FLOP count but not to the matmul. The ratio
step / matmul says how far the MindSpore graph is from what the BLAS does with the same arithmetic, and
"% peak" compares the step's FLOP/s with one large numpy matmul (4096^3 by default, --peak-size), this
CPU's float32 ceiling, measured in the same run. --attention-kernel auto,off times the CPU paged-attention
kernel and the key-gather path side by side, --layer-kernel auto,off the whole-layer kernel
(kernels/decoder_layer_cpu.cc) against MindSpore's ops, layer by layer; --prefill times prefill steps
(rows x prompt tokens) the same way: with the kernel they run packed (real tokens only), without it padded to (batch, seq) buckets.

    python bench/step_roofline.py                                   # built-in model
    python bench/step_roofline.py --model ../shared/models/stories260K/hf --batches 1,8,32

Writes JSON (default bench_results/step_roofline.json).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (machine, memory_like_agents, table, time_decode_steps, time_prefill_step,  # noqa: E402
                          write_json)


def matmul_params(cfg) -> int:
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    per_layer = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h + 3 * h * i
    return cfg.num_layers * per_layer + cfg.vocab_size * h


def time_matmul(batch: int, hidden: int, params: int, iters: int) -> float:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, hidden), dtype=np.float32)
    w = rng.standard_normal((hidden, params // hidden), dtype=np.float32)
    x @ w
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        x @ w
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def time_peak(n: int, iters: int = 3) -> float:
    """GFLOP/s of one n x n x n float32 numpy matmul (best of `iters`)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(iters))
    return 2 * n ** 3 / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="model path (default: the built-in model)")
    p.add_argument("--batches", default="1,2,4,8,16,32,64,128", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--context", type=int, default=128, help="tokens already in each row's KV cache")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--threads", type=int, default=2, help="MindSpore CPU threads (numpy uses its BLAS default)")
    p.add_argument("--attention-kernel", default="auto", type=lambda s: s.split(","),
                   help="comma list of model_config.attention_kernel settings to time (auto, on, off)")
    p.add_argument("--layer-kernel", default="auto", type=lambda s: s.split(","),
                   help="comma list of model_config.layer_kernel settings to time (auto, on, off)")
    p.add_argument("--layer-kernel-max-tokens", type=int, default=None,
                   help="model_config.layer_kernel_max_tokens (steps up to it take the layer kernel; default: all)")
    p.add_argument("--prefill", default="", type=lambda s: [tuple(int(v) for v in x.split("x")) for x in s.split(",") if x],
                   help="comma list of ROWSxTOKENS prefill steps to time, e.g. 16x17,4x100")
    p.add_argument("--peak-size", type=int, default=4096, help="n of the n^3 numpy matmul that measures the peak")
    p.add_argument("--out", default="bench_results/step_roofline.json")
    args = p.parse_args(argv)

    from llm_serving.models.default_model import ensure_default_model
    from llm_serving.models.runner import ModelRunner
    from llm_serving.models.runner_spec import RunnerSpec

    model = args.model or str(ensure_default_model())
    block = 16
    decode_width = -(-(args.context + 1) // block)     # the gather path's decode graphs use this width
    peak = time_peak(args.peak_size)
    print(f"numpy peak: {peak:.1f} GFLOP/s ({args.peak_size}^3 float32 matmul)", flush=True)
    rows, prefill_rows = [], []
    prefill_batches = sorted({r for r, _ in args.prefill} | {1})
    prefill_lens = sorted({-(-t // block) * block for _, t in args.prefill} | {block})
    per_row = max([decode_width] + [-(-t // block) for _, t in args.prefill])
    # without the attention kernel there is no layer kernel either: that path is timed once
    runs = list(dict.fromkeys((a, "off" if a == "off" else lk)
                              for a in args.attention_kernel for lk in args.layer_kernel))
    for mode, layer_mode in runs:
        spec = RunnerSpec(num_blocks=max(max(args.batches), *prefill_batches) * per_row, block_size=block,
                          max_blocks_per_seq=per_row, decode_batch_sizes=args.batches,
                          prefill_batch_sizes=prefill_batches, prefill_seq_lens=prefill_lens,
                          decode_block_widths=[decode_width], num_threads=args.threads, attention_kernel=mode,
                          layer_kernel=layer_mode, layer_kernel_rows=args.layer_kernel_max_tokens)
        runner = ModelRunner(model, spec)
        attention = ("layer kernel" if runner.layer_kernel else "attn kernel" if runner.decode_kernel
                     else "gather")
        cfg = runner.config
        params = matmul_params(cfg)
        attn_flops = 4 * args.context * cfg.num_layers * cfg.num_heads * cfg.head_dim
        for b in args.batches:
            if runner.layer_kernel and b > runner.layer_kernel_rows:
                continue                                 # the same graph as without the layer kernel
            step = time_decode_steps(runner, b, args.context, args.iters)
            mm = time_matmul(b, cfg.hidden_size, params, args.iters)
            flops = b * (2 * params + attn_flops)
            rows.append({"attention": attention, "batch": b, "step_ms": step * 1e3, "matmul_ms": mm * 1e3,
                         "ratio": step / mm, "step_gflops": flops / step / 1e9, "matmul_gflops": 2 * b * params / mm / 1e9,
                         "peak_pct": 100 * flops / step / 1e9 / peak, "step_tok_s": b / step})
            print(f"{attention} batch {b}: step {step * 1e3:.3f} ms, matmul {mm * 1e3:.3f} ms", flush=True)
        layer_params = params - cfg.vocab_size * cfg.hidden_size
        for r, t in args.prefill:
            if runner.layer_kernel and r * t > runner.layer_kernel_rows:
                continue
            step = time_prefill_step(runner, r, t, args.iters)
            # useful FLOPs: the layers for every real token, causal attention, lm_head for each row's last token
            flops = r * (2 * layer_params * t + 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * t * (t + 1)
                         + 2 * cfg.vocab_size * cfg.hidden_size)
            prefill_rows.append({"prefill": ("layer kernel" if runner.layer_kernel else
                                             "packed" if runner.packed_prefill else "padded"), "rows": r, "tokens": t,
                                 "step_ms": step * 1e3, "ms_per_token": step * 1e3 / (r * t),
                                 "gflops": flops / step / 1e9, "peak_pct": 100 * flops / step / 1e9 / peak})
            print(f"{attention} prefill {r}x{t}: {step * 1e3:.3f} ms", flush=True)
        del runner
    print(f"\nstep roofline: {Path(model).name}, {params / 1e6:.2f} M matmul weights, context {args.context}, "
          f"numpy peak {peak:.1f} GFLOP/s")
    print(table(rows, [("attention", "path", "{}"), ("batch", "batch", "{}"), ("step_ms", "step ms", "{:.3f}"),
                       ("matmul_ms", "BLAS ms", "{:.3f}"), ("ratio", "step/BLAS", "{:.1f}x"),
                       ("step_gflops", "step GFLOP/s", "{:.2f}"), ("matmul_gflops", "BLAS GFLOP/s", "{:.2f}"),
                       ("peak_pct", "% peak", "{:.0f}%"), ("step_tok_s", "step tok/s", "{:.0f}")]))
    if prefill_rows:
        print("\nprefill steps (useful FLOPs: real tokens only)")
        print(table(prefill_rows, [("prefill", "prefill", "{}"), ("rows", "rows", "{}"), ("tokens", "tokens", "{}"),
                                   ("step_ms", "step ms", "{:.3f}"), ("ms_per_token", "ms/token", "{:.3f}"),
                                   ("gflops", "GFLOP/s", "{:.2f}"), ("peak_pct", "% peak", "{:.0f}%")]))
    write_json(args.out, {"scenario": "step_roofline", "machine": machine(), "model": model, "matmul_params": params,
                          "context": args.context, "threads": args.threads, "peak_gflops": peak,
                          "peak_size": args.peak_size, "rows": rows, "prefill_rows": prefill_rows})
    return 0


if __name__ == "__main__":
    memory_like_agents()
    sys.exit(main())
