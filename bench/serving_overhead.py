#!/usr/bin/env python
"""Serving overhead: end-to-end output tokens/s through the whole server (HTTP, tokenizer, scheduler,
shm, TCP, agent, streaming) at a fixed concurrency C, divided by the bare model step's tokens/s at batch C
(ModelRunner.execute in this process, same model, mean context of the run), both measured in one run.

    python bench/serving_overhead.py                                # built-in model, C = 1, 8, 32
    python bench/serving_overhead.py --model ../shared/models/stories260K/hf \
        --config configs/stories260K.yaml --concurrency 32

1.0 would be a server that costs nothing beyond the model step; prefill steps count against the
server here (they produce no decode tokens), so short prompts and long outputs are used by default.

It also reports issue 23's definition of the serving overhead, which the client's cores do not blur: the
master process's CPU seconds (user + system, from the OS) over the agents' model seconds (the engine's
`step_profile_total_s["model"]` in /stats), both taken around the measured run (goal: <= 5% at 64 streams); and
the master's CPU milliseconds per output token, which does not depend on the model's speed (compare two builds
of the master with it: `--skip-bare` leaves out the bare step).

Writes JSON (default bench_results/serving_overhead.json).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (info, log_dir, machine, memory_like_agents, replay, server_args,  # noqa: E402
                          synthetic_samples, table, time_decode_steps, write_json)
from llm_serving.server_process import ServerProcess, http  # noqa: E402


def master_cpu_and_model_s(server: ServerProcess) -> tuple:
    """(the master's CPU seconds so far, the agents' model seconds so far)."""
    t = psutil.Process(server.proc.pid).cpu_times()
    model_s = http("GET", server.url + "/stats")[1]["step_profile_total_s"].get("model", 0.0)
    return t.user + t.system, model_s


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="model path (default: the built-in model)")
    p.add_argument("--config", help="YAML config")
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--concurrency", default="1,8,32", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="requests per run = rounds * concurrency")
    p.add_argument("--threads", type=int, default=None, help="MindSpore threads of the bare step "
                                                               "(default: the server config's num_threads)")
    p.add_argument("--skip-bare", action="store_true", help="measure the server only (no bare model step)")
    p.add_argument("--out", default="bench_results/serving_overhead.json")
    args = p.parse_args(argv)

    cli = server_args(args.model, args.config, args.set)
    e2e, master, master_ms = {}, {}, {}
    with ServerProcess(cli, log_dir() / "serving_overhead.log") as server:
        facts = info(server)
        for c in args.concurrency:
            samples = synthetic_samples(args.rounds * c, facts["tokenizer_path"], args.input_len, args.output_len)
            replay(server.url, facts["model_id"], samples[:c], [0.0] * c, max_concurrency=c)   # warm
            cpu0, model0 = master_cpu_and_model_s(server)
            summary, _ = replay(server.url, facts["model_id"], samples, [0.0] * len(samples), max_concurrency=c)
            cpu1, model1 = master_cpu_and_model_s(server)
            e2e[c] = summary
            master[c] = (cpu1 - cpu0) / (model1 - model0) if model1 > model0 else None
            master_ms[c] = (cpu1 - cpu0) * 1e3 / max(summary["total_output_tokens"], 1)
            print(f"C={c}: {summary['output_throughput']:.1f} output tok/s end to end "
                  f"({summary['failed']} failed)", flush=True)
        model_path = facts["model_path"]

    runner = None if args.skip_bare else bare_runner(args, model_path)
    rows = []
    for c in args.concurrency:
        step = time_decode_steps(runner, c, args.input_len + args.output_len // 2, 30) if runner else None
        s = e2e[c]
        rows.append({"concurrency": c, "e2e_tok_s": s["output_throughput"], "bare_tok_s": c / step if step else None,
                     "ratio": s["output_throughput"] / (c / step) if step else None,
                     "bare_step_ms": step * 1e3 if step else None,
                     "tpot_p50": s["tpot_ms"]["median"], "ttft_p50": s["ttft_ms"]["median"], "failed": s["failed"],
                     "master_cpu_over_model": master[c], "master_cpu_ms_per_token": master_ms[c]})
    print(f"\nserving overhead: {facts['model_id']}, prompts ~{args.input_len} tokens, {args.output_len} output "
          f"tokens, {args.rounds} rounds per concurrency")
    print(table(rows, [("concurrency", "C", "{}"), ("e2e_tok_s", "e2e tok/s", "{:.1f}"),
                       ("bare_tok_s", "bare step tok/s", "{:.1f}"), ("ratio", "e2e/bare", "{:.2f}"),
                       ("bare_step_ms", "bare step ms", "{:.2f}"), ("tpot_p50", "TPOT p50 ms", "{:.2f}"),
                       ("ttft_p50", "TTFT p50 ms", "{:.0f}"),
                       ("master_cpu_over_model", "master CPU/model", "{:.1%}"),
                       ("master_cpu_ms_per_token", "master CPU ms/token", "{:.3f}")]))
    write_json(args.out, {"scenario": "serving_overhead", "machine": machine(), "model": facts["model_id"],
                          "input_len": args.input_len, "output_len": args.output_len, "rows": rows,
                          "runs": {str(c): s for c, s in e2e.items()}})
    return 0 if all(r["failed"] == 0 for r in rows) else 1


def bare_runner(args, model_path: str):
    """A ModelRunner in this process on the served model, with decode buckets of the run's concurrencies."""
    from llm_serving.config import load_config
    from llm_serving.models.runner import ModelRunner
    from llm_serving.models.runner_spec import RunnerSpec

    config = load_config(args.config, tuple(args.set))
    block = 16
    per_row = -(-(args.input_len + args.output_len + 1) // block)
    spec = RunnerSpec(num_blocks=max(args.concurrency) * per_row, block_size=block, max_blocks_per_seq=per_row,
                      decode_batch_sizes=args.concurrency, prefill_batch_sizes=[1], prefill_seq_lens=[16],
                      num_threads=args.threads or config.model_config.num_threads)
    return ModelRunner(model_path, spec)


if __name__ == "__main__":
    memory_like_agents()
    sys.exit(main())
