#!/usr/bin/env python
"""The vision tower's time per image (issue 67): Gemma 3's SigLIP tower and projector (models/vision_tower.py) at a
real model's shape with random weights (default: Gemma-3-4B's, SigLIP-400M: 27 layers of 1,152, an 896-pixel image
in 4,096 patches, 256 tokens of 2,560), the first call (its graph compiled) and the next ones, with the rate of
float32 arithmetic they reach, the peak memory and what each tower's weights take. The tower runs a layer at a time
(one graph, each layer's weights its inputs). Its layer runs on the CPU kernels (kernels/vision_layer_cpu.cc: the
products on the matrices as the checkpoint stores them, the attention writing no scores), on the same kernels with
the products and the attention's values in int16 (model_config.vision_int16; with int16_scores its scores too), or
on MindSpore's ops (MatMul on float32 copies; one layer's (heads, patches, patches) scores, 1 GiB at 4,096 patches,
written and read back); by default int16, kernel and ops, in turn on the same weights and image, with their ratios
and how far apart their outputs are.

    python bench/vision_tower.py                      # Gemma-3-4B's tower, 3 runs of one image, int16/kernel/ops
    python bench/vision_tower.py --layers 4 --runs 2  # a shallower tower, for a quick look
    python bench/vision_tower.py --attention kernel   # one of them (its peak memory alone)
    python bench/vision_tower.py --attention int16,int16_scores,kernel

Writes JSON (default bench_results/vision_tower.json).
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine, write_json  # noqa: E402


def random_tower(cfg, seed: int = 0) -> dict:
    """{name: float32 array} of every tensor the tower reads, random at the scale a trained tower's have."""
    from llm_serving.models.weights.vision import vision_shapes

    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in vision_shapes(cfg).items():
        if len(shape) == 1:
            base = 1.0 if name.endswith(("norm1.weight", "norm2.weight", "post_layernorm.weight")) else 0.0
            out[name] = (base + 0.02 * rng.standard_normal(shape)).astype(np.float32)
        else:
            fan_in = int(np.prod(shape[1:])) if "projection" not in name else shape[0]
            out[name] = (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(fan_in)).astype(np.float32)
    return out


def stored_as(arrays: dict, kind: str) -> dict:
    """The tower's tensors as a checkpoint storing its matrices (2-D and up) in `kind` gives them: each rounded to
    that type, read as float32, its StoredTensor's stored_type saying which."""
    from llm_serving.models.weights.common import StoredTensor

    if kind == "F32":
        return arrays
    out = {}
    for name, a in arrays.items():
        if a.ndim < 2:
            out[name] = a
            continue
        if kind == "F16":
            a = a.astype(np.float16).astype(np.float32)
        else:
            a = ((a.view(np.uint32) + 0x7FFF + ((a.view(np.uint32) >> 16) & 1)) & 0xFFFF0000).view(np.float32)
        out[name] = StoredTensor(a.shape, lambda index, a=a: a[index], stored_type=kind)
    return out


def flops(cfg) -> float:
    """Multiply-adds x 2 of one image through the tower and projector."""
    t, d, m = cfg.patches_per_side ** 2, cfg.hidden_size, cfg.intermediate_size
    per_layer = 2 * t * d * 4 * d + 2 * 2 * t * t * d + 2 * 2 * t * d * m
    return (2 * t * 3 * cfg.patch_size ** 2 * d + cfg.num_layers * per_layer
            + 2 * cfg.tokens_per_image * d * cfg.text_hidden_size)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--hidden", type=int, default=1152)
    ap.add_argument("--intermediate", type=int, default=4304)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--image", type=int, default=896)
    ap.add_argument("--patch", type=int, default=14)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--text-hidden", type=int, default=2560)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--attention", default="all",
                    help="the layers' arithmetic, comma-separated: kernel (the CPU kernels, kernels/"
                         "vision_layer_cpu.cc, float32 products), int16 (the same, the products and the attention's "
                         "values in int16: model_config.vision_int16), int16_scores (and the attention's scores: "
                         "vision_int16_scores), ops (MindSpore's); both = kernel,ops; all (default) = "
                         "int16,kernel,ops; in turn on the same weights and image (their ratios, and how far apart "
                         "they are)")
    ap.add_argument("--threads", type=int, default=None, help="the kernels' threads (default: the CPUs)")
    ap.add_argument("--stored", choices=("F16", "BF16", "F32"), default="F16",
                    help="the type the checkpoint stores the matrices in (default F16, as llama.cpp's mmproj GGUFs "
                         "do; BF16: HF's Gemma 3 safetensors): the kernels keep them so, MindSpore's ops widen them")
    ap.add_argument("--out", default="bench_results/vision_tower.json")
    args = ap.parse_args(argv)

    import os

    from llm_serving.models.runner.kernels import build_vision_kernels
    from llm_serving.models.mindspore_env import setup_mindspore
    from llm_serving.models.vision_tower import VisionTower
    from llm_serving.models.weights.vision import VisionConfig

    setup_mindspore("CPU", 0, None, None)
    cfg = VisionConfig(args.hidden, args.intermediate, args.layers, args.heads, args.image, args.patch, 3, 1e-6,
                       args.tokens, args.text_hidden)
    kinds = {"both": ("kernel", "ops"), "all": ("int16", "kernel", "ops")}.get(
        args.attention, tuple(args.attention.split(",")))
    if not kinds or any(kind not in ("int16", "int16_scores", "kernel", "ops") for kind in kinds):
        ap.error(f"--attention: kernel, int16, int16_scores, ops (comma-separated), both or all, not "
                 f"{args.attention!r}")
    threads = args.threads or len(os.sched_getaffinity(0))
    weights = stored_as(random_tower(cfg), args.stored)
    towers, built = {}, {}
    for kind in kinds:
        t0 = time.perf_counter()
        kernels = build_vision_kernels("CPU", "on") if kind != "ops" else None
        towers[kind] = VisionTower(cfg, weights, kernels=kernels, threads=threads, int16=kind.startswith("int16"),
                                   int16_scores=kind == "int16_scores")
        built[kind] = time.perf_counter() - t0
    pixels = np.random.default_rng(1).uniform(-1, 1, (1, 3, args.image, args.image)).astype(np.float32)
    times, outs = {kind: [] for kind in kinds}, {}
    for _ in range(args.runs):
        for kind in kinds:                       # in turn: both see the machine's same moments
            t0 = time.perf_counter()
            outs[kind] = towers[kind].encode(pixels)
            times[kind].append(time.perf_counter() - t0)
    work = flops(cfg)
    print(f"tower: {cfg.num_layers} layers of {cfg.hidden_size}, {cfg.patches_per_side ** 2} patches an image, "
          f"{work / 1e12:.2f} TFLOP; {machine().get('cpu', '')}")
    result = {"machine": machine(), "config": cfg.__dict__, "flops": work, "threads": threads}
    for kind in kinds:
        out = outs[kind]
        assert out.shape == (1, cfg.tokens_per_image, cfg.text_hidden_size) and np.isfinite(out).all()
        best = min(times[kind][1:]) if len(times[kind]) > 1 else times[kind][0]
        print(f"{kind:>12}: first image (graph compiled) {times[kind][0]:.1f} s; then "
              f"{', '.join(f'{t:.1f}' for t in times[kind][1:])} s; best {best:.1f} s = {work / best / 1e9:.0f} "
              f"GFLOP/s ({best / cfg.num_layers:.2f} s a layer)")
        result[kind] = {"build_s": built[kind], "seconds": times[kind], "best_s": best, "gflops": work / best / 1e9}
    reference = "kernel" if "kernel" in kinds else "ops"
    for kind in kinds if reference in kinds else ():        # (neither kernel nor ops run: nothing to compare with)
        if kind == reference:
            continue
        ratio = result[kind]["best_s"] / result[reference]["best_s"]
        apart = float(np.abs(outs[kind] - outs[reference]).max() / np.abs(outs[reference]).max())
        result[f"{kind}_over_{reference}"], result[f"{kind}_{reference}_max_relative_difference"] = ratio, apart
        print(f"{kind} / {reference} time: {ratio:.2f}x; outputs apart by {apart:.1e} of their largest")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6            # (kB on Linux)
    result.update(peak_rss_gb=peak, stored=args.stored,
                  weights_gb={kind: towers[kind].nbytes / 1e9 for kind in kinds})
    print(f"peak resident memory {peak:.1f} GB; the weights ({args.stored} in the checkpoint) "
          + ", ".join(f"{kind} {towers[kind].nbytes / 1e9:.2f} GB" for kind in kinds))
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
