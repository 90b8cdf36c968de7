#!/usr/bin/env python
"""The inference contest's replay: the first N alpaca prompts at a fixed rate, greedy, against a
*baseline* server (one request at a time: prefill batch 1, decode batch 1, FCFS) and the *best* config,
in one run; prints both total times and their ratio, and the machine's batching ceiling for this model —
the bare decode step's per-token time at batch 1 over its per-token time at the best config's largest decode
batch (ModelRunner in this process, mean context of the replay) — with the ratio's share of it.

    python bench/contest_replay.py                      # built-in model, N=300 at 10 req/s
    python bench/contest_replay.py -n 1500 --rate 5 --model ../shared/models/stories260K/hf \
        --config configs/stories260K.yaml

Each request asks for the token count of its alpaca reference output (capped by --max-new-tokens) with
ignore_eos, so both servers do exactly the same work. "Total time" is the contest's figure: first send
to last response. Writes JSON (default bench_results/contest_replay.json).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (ALPACA, alpaca, info, log_dir, machine, memory_like_agents, replay,  # noqa: E402
                          server_args, table, time_decode_steps, write_json)
from llm_serving.bench.plots import write_plots  # noqa: E402
from llm_serving.bench.workload import arrival_offsets  # noqa: E402
from llm_serving.launch import ServerProcess  # noqa: E402

BASELINE = ["model_config.prefill_batch_size=[1]", "model_config.decode_batch_size=[1]",
            "scheduler_config.policy=fcfs", "scheduler_config.enable_prefix_caching=false",
            "serving_config.max_num_seqs=1"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="model path (default: the built-in model)")
    p.add_argument("--config", help="YAML config of the best setup (default: built-in defaults)")
    p.add_argument("--set", action="append", default=[], help="extra overrides for the best setup")
    p.add_argument("-n", "--num-prompts", type=int, default=300)
    p.add_argument("--rate", type=float, default=10.0, help="requests/s, fixed spacing (the contest's -X)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dataset-path", default=str(ALPACA))
    p.add_argument("--out", default="bench_results/contest_replay.json")
    args = p.parse_args(argv)

    setups = [("baseline", server_args(args.model, args.config, BASELINE)),
              ("best", server_args(args.model, args.config, args.set))]
    rows, runs = [], {}
    for name, cli in setups:
        print(f"--- {name}: llm-serving start {' '.join(cli)}", flush=True)
        with ServerProcess(cli, log_dir() / f"contest_{name}.log") as server:
            facts = info(server)
            samples = alpaca(args.num_prompts, facts["tokenizer_path"], args.max_new_tokens,
                             Path(args.dataset_path), room=facts["max_total_tokens"])
            offsets = arrival_offsets(len(samples), args.rate, "fixed")
            summary, results = replay(server.url, facts["model_id"], samples, offsets)
        plots = write_plots(results, summary["duration_s"], Path(args.out).parent / f"contest_{name}")
        runs[name] = {"server_args": cli, "summary": summary, "plots": plots}
        rows.append({"setup": name, "total_s": summary["duration_s"], "completed": summary["completed"],
                     "failed": summary["failed"], "tok_s": summary["output_throughput"],
                     "ttft_p50": summary["ttft_ms"]["median"], "ttft_p99": summary["ttft_ms"]["p99"],
                     "tpot_p50": summary["tpot_ms"]["median"], "e2el_p50": summary["e2el_ms"]["median"]})
        print(f"{name}: {summary['duration_s']:.1f} s total, {summary['completed']} completed, "
              f"{summary['failed']} failed", flush=True)
    ratio = rows[0]["total_s"] / rows[1]["total_s"]
    ceiling = batching_ceiling(facts["model_path"], args.config, args.set, samples)
    print(f"\ncontest replay: {len(samples)} alpaca prompts at {args.rate:g} req/s, "
          f"{sum(s.max_new_tokens for s in samples)} output tokens, model {facts['model_id']}")
    print(table(rows, [("setup", "setup", "{}"), ("total_s", "total s", "{:.1f}"), ("completed", "done", "{}"),
                       ("failed", "failed", "{}"), ("tok_s", "out tok/s", "{:.1f}"),
                       ("ttft_p50", "TTFT p50 ms", "{:.0f}"), ("ttft_p99", "TTFT p99 ms", "{:.0f}"),
                       ("tpot_p50", "TPOT p50 ms", "{:.1f}"), ("e2el_p50", "E2EL p50 ms", "{:.0f}")]))
    print(f"total time baseline / best: {ratio:.2f}x")
    print(f"batching ceiling (bare decode, context {ceiling['context']}): {ceiling['step_ms'][1]:.2f} ms/token at "
          f"batch 1 / {ceiling['step_ms'][ceiling['batch']] / ceiling['batch']:.3f} ms/token at batch "
          f"{ceiling['batch']} = {ceiling['ceiling']:.2f}x; the replay reached {ratio / ceiling['ceiling']:.0%} of it")
    write_json(args.out, {"scenario": "contest_replay", "machine": machine(), "model": facts["model_id"],
                          "num_prompts": len(samples), "rate": args.rate, "max_new_tokens": args.max_new_tokens,
                          "rows": rows, "ratio_total_time": ratio, "batching_ceiling": ceiling,
                          "share_of_ceiling": ratio / ceiling["ceiling"], "runs": runs})
    return 0 if all(r["failed"] == 0 for r in rows) else 1


def batching_ceiling(model_path: str, config: str, overrides: list, samples) -> dict:
    """Bare decode step (ModelRunner, this process) at batch 1 and at the best config's largest decode batch."""
    from llm_serving.config import load_config
    from llm_serving.models.runner import ModelRunner

    mc = load_config(config, tuple(overrides)).model_config
    batch = max(mc.decode_batch_size)
    context = int(np.mean([s.prompt_len + s.max_new_tokens / 2 for s in samples]))
    block = 16
    per_row = -(-(context + 1) // block)
    runner = ModelRunner(model_path, num_blocks=batch * per_row, block_size=block, max_blocks_per_seq=per_row,
                         decode_batch_sizes=[1, batch], prefill_batch_sizes=[1], prefill_seq_lens=[16],
                         num_threads=mc.num_threads, attention_kernel=mc.attention_kernel)
    step = {b: time_decode_steps(runner, b, context, 20) * 1e3 for b in (1, batch)}
    return {"batch": batch, "context": context, "step_ms": step, "ceiling": step[1] / (step[batch] / batch)}


if __name__ == "__main__":
    memory_like_agents()
    sys.exit(main())
