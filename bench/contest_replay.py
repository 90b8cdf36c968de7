#!/usr/bin/env python
"""The inference contest's replay: the first N alpaca prompts at a fixed rate, greedy, against a
*baseline* server (one request at a time: prefill batch 1, decode batch 1, FCFS) and the *best* config,
in one run; prints both total times and their ratio, and the machine's batching ceiling for this model —
the bare decode step's per-token time at batch 1 over its per-token time at the best config's largest decode
batch (ModelRunner in this process, mean context of the replay) — with the ratio's share of it.

It also prints the best config's total time over the replay's lower bound (issue 23; goal <= 1.15):
max(arrival span, sum of prompt tokens / best bare packed-prefill tokens/s + sum of output tokens / best
bare decode tokens/s at the largest decode batch, single steps or decode runs), rates measured in this process.

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
                          server_args, table, time_decode_run, time_decode_steps, time_prefill_step, write_json)
from llm_serving.loadgen.plots import write_plots  # noqa: E402
from llm_serving.loadgen.workload import arrival_offsets  # noqa: E402
from llm_serving.server_process import ServerProcess  # noqa: E402

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
    p.add_argument("--best-only", action="store_true", help="skip the baseline server (no ratio)")
    p.add_argument("--out", default="bench_results/contest_replay.json")
    args = p.parse_args(argv)

    setups = [("baseline", server_args(args.model, args.config, BASELINE))] if not args.best_only else []
    setups.append(("best", server_args(args.model, args.config, args.set)))
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
    ratio = rows[0]["total_s"] / rows[-1]["total_s"] if not args.best_only else None
    ceiling = batching_ceiling(facts["model_path"], args.config, args.set, samples)
    bound = replay_bound(ceiling, samples, offsets)
    print(f"\ncontest replay: {len(samples)} alpaca prompts at {args.rate:g} req/s, "
          f"{sum(s.max_new_tokens for s in samples)} output tokens, model {facts['model_id']}")
    print(table(rows, [("setup", "setup", "{}"), ("total_s", "total s", "{:.1f}"), ("completed", "done", "{}"),
                       ("failed", "failed", "{}"), ("tok_s", "out tok/s", "{:.1f}"),
                       ("ttft_p50", "TTFT p50 ms", "{:.0f}"), ("ttft_p99", "TTFT p99 ms", "{:.0f}"),
                       ("tpot_p50", "TPOT p50 ms", "{:.1f}"), ("e2el_p50", "E2EL p50 ms", "{:.0f}")]))
    if ratio is not None:
        print(f"total time baseline / best: {ratio:.2f}x")
    print(f"batching ceiling (bare decode, context {ceiling['context']}): {ceiling['step_ms'][1]:.2f} ms/token at "
          f"batch 1 / {ceiling['step_ms'][ceiling['batch']] / ceiling['batch']:.3f} ms/token at batch "
          f"{ceiling['batch']} = {ceiling['ceiling']:.2f}x"
          + (f"; the replay reached {ratio / ceiling['ceiling']:.0%} of it" if ratio is not None else ""))
    best_over_bound = rows[-1]["total_s"] / bound["bound_s"]
    print(f"replay bound: max(arrivals {bound['arrival_span_s']:.1f} s, {bound['prompt_tokens']} prompt tokens at "
          f"{bound['prefill_tok_s']:.0f} tok/s + {bound['output_tokens']} output tokens at {bound['decode_tok_s']:.0f} "
          f"tok/s = {bound['compute_s']:.1f} s) = {bound['bound_s']:.1f} s; best / bound = {best_over_bound:.2f}x "
          f"(goal <= 1.15)")
    write_json(args.out, {"scenario": "contest_replay", "machine": machine(), "model": facts["model_id"],
                          "num_prompts": len(samples), "rate": args.rate, "max_new_tokens": args.max_new_tokens,
                          "rows": rows, "ratio_total_time": ratio, "batching_ceiling": ceiling,
                          "share_of_ceiling": ratio / ceiling["ceiling"] if ratio is not None else None,
                          "bound": bound, "best_over_bound": best_over_bound, "runs": runs})
    return 0 if all(r["failed"] == 0 for r in rows) else 1


def batching_ceiling(model_path: str, config: str, overrides: list, samples) -> dict:
    """Bare steps (ModelRunner, this process, the best config's model settings): decode at batch 1 and at the
    largest decode batch (single steps, and decode runs when the config has them), and packed prefill of the
    largest prefill batch of prompts of the replay's mean length and of 128 and 256 tokens."""
    from llm_serving.config import load_config
    from llm_serving.models.runner import ModelRunner
    from llm_serving.models.runner_spec import RunnerSpec

    cfg = load_config(config, tuple(overrides))
    mc, sched = cfg.model_config, cfg.scheduler_config
    batch = max(mc.decode_batch_size)
    context = int(np.mean([s.prompt_len + s.max_new_tokens / 2 for s in samples]))
    rows = max(mc.prefill_batch_size)
    lengths = sorted({int(np.mean([s.prompt_len for s in samples])), 128, 256})
    lengths = [t for t in lengths if rows * t <= cfg.serving_config.max_num_batched_tokens] or lengths[:1]
    block = 16
    per_row = -(-(max(context + sched.decode_steps, *lengths) + 1) // block)
    spec = RunnerSpec(num_blocks=max(batch, rows) * per_row, block_size=block, max_blocks_per_seq=per_row,
                      decode_batch_sizes=[1, batch], prefill_batch_sizes=[rows],
                      prefill_seq_lens=sorted({-(-t // block) * block for t in lengths}),
                      max_step_tokens=cfg.serving_config.max_num_batched_tokens, num_threads=mc.num_threads,
                      attention_kernel=mc.attention_kernel, layer_kernel=mc.layer_kernel,
                      layer_kernel_rows=mc.layer_kernel_max_tokens, decode_run_steps=sched.decode_steps,
                      decode_run_rows=sched.decode_steps_max_rows)
    runner = ModelRunner(model_path, spec)
    step = {b: time_decode_steps(runner, b, context, 20) * 1e3 for b in (1, batch)}
    decode_tok_s = batch / step[batch] * 1e3
    run_ms = None
    if runner.decode_run_max_rows() >= batch:
        run_ms = time_decode_run(runner, batch, context, 5) * 1e3
        decode_tok_s = max(decode_tok_s, batch / run_ms * 1e3)
    prefill = {t: rows * t / time_prefill_step(runner, rows, t, 5) for t in lengths}
    return {"batch": batch, "context": context, "step_ms": step, "run_step_ms": run_ms,
            "ceiling": step[1] / (step[batch] / batch), "decode_tok_s": decode_tok_s,
            "prefill_rows": rows, "prefill_tok_s_by_length": prefill, "prefill_tok_s": max(prefill.values())}


def replay_bound(ceiling: dict, samples: list, offsets: list) -> dict:
    """Issue 23's lower bound of a replay's total time (see the module docstring)."""
    prompt = sum(s.prompt_len + 1 for s in samples)                  # + BOS
    output = sum(s.max_new_tokens for s in samples)
    compute = prompt / ceiling["prefill_tok_s"] + output / ceiling["decode_tok_s"]
    span = float(offsets[-1]) if len(offsets) else 0.0
    return {"arrival_span_s": span, "prompt_tokens": prompt, "output_tokens": output,
            "prefill_tok_s": ceiling["prefill_tok_s"], "decode_tok_s": ceiling["decode_tok_s"],
            "compute_s": compute, "bound_s": max(span, compute)}


if __name__ == "__main__":
    memory_like_agents()
    sys.exit(main())
