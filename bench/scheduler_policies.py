#!/usr/bin/env python
"""Scheduling policies and prefix caching, measured with the load client in one run.

Part 1 (policies): the first N alpaca prompts at a fixed rate, greedy with ignore_eos, against one server
per setup — fcfs, prefill_first, longest_output_first, and prefill_first with chunked prefill — printing
output tokens/s, TTFT (p50/p99), TPOT and total time. Prefix caching is off here, so only the policy
differs.

Part 2 (prefix caching): the same kind of requests, each behind one shared ~200-token system prompt, with
prefix caching on and off; prints TTFT, throughput and the server's prefix-cache hit rate.

    python bench/scheduler_policies.py                   # built-in model, N=200 at 20 req/s
    python bench/scheduler_policies.py -n 300 --rate 30 --model ../shared/models/stories260K/hf \
        --config configs/stories260K.yaml

Writes JSON (default bench_results/scheduler_policies.json).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import ALPACA, alpaca, info, log_dir, machine, replay, server_args, table, write_json  # noqa: E402
from llm_serving.loadgen.workload import Sample, TokenCounter, arrival_offsets  # noqa: E402
from llm_serving.server_process import ServerProcess, http  # noqa: E402

NO_CACHE = "scheduler_config.enable_prefix_caching=false"
POLICY_SETUPS = [
    ("fcfs", ["scheduler_config.policy=fcfs", NO_CACHE]),
    ("prefill_first", ["scheduler_config.policy=prefill_first", NO_CACHE]),
    ("longest_output_first", ["scheduler_config.policy=longest_output_first", NO_CACHE]),
    ("prefill_first+chunked", ["scheduler_config.policy=prefill_first", "scheduler_config.chunked_prefill=true",
                               "scheduler_config.max_chunk_tokens=32", "serving_config.max_num_batched_tokens=64",
                               NO_CACHE]),
]
CACHE_SETUPS = [("prefix cache off", [NO_CACHE]), ("prefix cache on", ["scheduler_config.enable_prefix_caching=true"])]

COLUMNS = [("setup", "setup", "{}"), ("total_s", "total s", "{:.1f}"), ("failed", "failed", "{}"),
           ("tok_s", "out tok/s", "{:.1f}"), ("ttft_p50", "TTFT p50 ms", "{:.0f}"),
           ("ttft_p99", "TTFT p99 ms", "{:.0f}"), ("tpot_p50", "TPOT p50 ms", "{:.1f}"),
           ("e2el_p99", "E2EL p99 ms", "{:.0f}")]


def system_prompt(counter: TokenCounter, tokens: int, path: Path) -> str:
    """About `tokens` tokens of real text (alpaca reference outputs), cut at a token boundary."""
    import json

    text = " ".join(r["output"] for r in json.loads(Path(path).read_text())[:200])
    return counter.decode(counter.encode(text)[:tokens])


def run_setup(name, cli, make_samples, rate, out_rows, runs):
    print(f"--- {name}: llm-serving start {' '.join(cli)}", flush=True)
    with ServerProcess(cli, log_dir() / f"sched_{name.replace(' ', '_').replace('+', '_')}.log") as server:
        facts = info(server)
        samples = make_samples(facts)
        offsets = arrival_offsets(len(samples), rate, "fixed")
        summary, _ = replay(server.url, facts["model_id"], samples, offsets)
        stats = http("GET", server.url + "/stats")[1]
    row = {"setup": name, "total_s": summary["duration_s"], "completed": summary["completed"],
           "failed": summary["failed"], "tok_s": summary["output_throughput"],
           "ttft_p50": summary["ttft_ms"]["median"], "ttft_p99": summary["ttft_ms"]["p99"],
           "ttft_mean": summary["ttft_ms"]["mean"], "tpot_p50": summary["tpot_ms"]["median"],
           "e2el_p99": summary["e2el_ms"]["p99"], "preemptions": stats["num_preemptions"],
           "prefix_cache_hit_rate": stats.get("prefix_cache_hit_rate"), "steps": stats["num_steps"]}
    out_rows.append(row)
    runs[name] = {"server_args": cli, "summary": summary, "stats": stats}
    print(f"{name}: {row['total_s']:.1f} s, {row['tok_s']:.1f} out tok/s, TTFT p99 {row['ttft_p99']:.0f} ms, "
          f"{row['failed']} failed", flush=True)
    return samples


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="model path (default: the built-in model)")
    p.add_argument("--config", help="YAML config shared by every setup")
    p.add_argument("--set", action="append", default=[], help="extra overrides for every setup")
    p.add_argument("-n", "--num-prompts", type=int, default=200)
    p.add_argument("--rate", type=float, default=20.0, help="requests/s, fixed spacing")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--system-tokens", type=int, default=200, help="shared system prompt length (part 2)")
    p.add_argument("--cache-prompts", type=int, default=100, help="requests in part 2")
    p.add_argument("--cache-rate", type=float, default=5.0, help="requests/s in part 2")
    p.add_argument("--dataset-path", default=str(ALPACA))
    p.add_argument("--policies", default=",".join(n for n, _ in POLICY_SETUPS),
                   help="comma-separated setups of part 1 (fcfs is the reference and always runs)")
    p.add_argument("--skip-policies", action="store_true")
    p.add_argument("--skip-prefix", action="store_true")
    p.add_argument("--out", default="bench_results/scheduler_policies.json")
    args = p.parse_args(argv)
    dataset = Path(args.dataset_path)
    result = {"scenario": "scheduler_policies", "machine": machine(), "num_prompts": args.num_prompts,
              "rate": args.rate, "max_new_tokens": args.max_new_tokens}

    if not args.skip_policies:
        rows, runs = [], {}

        def policy_samples(facts):
            return alpaca(args.num_prompts, facts["tokenizer_path"], args.max_new_tokens, dataset,
                          room=facts["max_total_tokens"])

        chosen = {"fcfs", *args.policies.split(",")}
        unknown = chosen - {n for n, _ in POLICY_SETUPS}
        if unknown:
            p.error(f"unknown setup(s) {', '.join(sorted(unknown))}; known: {', '.join(n for n, _ in POLICY_SETUPS)}")
        for name, sets in [(n, s) for n, s in POLICY_SETUPS if n in chosen]:
            samples = run_setup(name, server_args(args.model, args.config, sets + args.set), policy_samples,
                                args.rate, rows, runs)
        print(f"\npolicies: {len(samples)} alpaca prompts at {args.rate:g} req/s, "
              f"{sum(s.max_new_tokens for s in samples)} output tokens")
        print(table(rows, COLUMNS + [("preemptions", "preempt", "{}")]))
        base = next(r for r in rows if r["setup"] == "fcfs")
        for r in rows:
            r["tok_s_vs_fcfs"] = r["tok_s"] / base["tok_s"]
            r["ttft_p99_vs_fcfs"] = r["ttft_p99"] / base["ttft_p99"]
        print("vs fcfs: " + ", ".join(f"{r['setup']} tok/s {r['tok_s_vs_fcfs']:.2f}x TTFT p99 "
                                      f"{r['ttft_p99_vs_fcfs']:.2f}x" for r in rows[1:]))
        result["policies"] = {"rows": rows, "runs": runs}

    if not args.skip_prefix:
        rows, runs = [], {}

        def cached_samples(facts):
            counter = TokenCounter(facts["tokenizer_path"])
            system = system_prompt(counter, args.system_tokens, dataset)
            base = alpaca(args.cache_prompts, facts["tokenizer_path"], args.max_new_tokens, dataset,
                          room=facts["max_total_tokens"] - args.system_tokens - 2)
            samples = []
            for s in base:
                prompt = f"{system}\n\n{s.prompt}"
                samples.append(Sample(prompt, counter.count(prompt), s.max_new_tokens))
            return samples

        for name, sets in CACHE_SETUPS:
            samples = run_setup(name, server_args(args.model, args.config, sets + args.set), cached_samples,
                                args.cache_rate, rows, runs)
        print(f"\nprefix caching: {len(samples)} alpaca prompts behind one {args.system_tokens}-token system "
              f"prompt at {args.cache_rate:g} req/s")
        print(table(rows, COLUMNS + [("ttft_mean", "TTFT mean ms", "{:.0f}"),
                                     ("prefix_cache_hit_rate", "hit rate", "{:.2f}")]))
        off, on = rows
        ratios = {"ttft_mean_off_over_on": off["ttft_mean"] / on["ttft_mean"],
                  "ttft_p50_off_over_on": off["ttft_p50"] / on["ttft_p50"],
                  "tok_s_on_over_off": on["tok_s"] / off["tok_s"]}
        print(f"prefix cache on vs off: TTFT mean {ratios['ttft_mean_off_over_on']:.2f}x lower, p50 "
              f"{ratios['ttft_p50_off_over_on']:.2f}x lower, output tok/s {ratios['tok_s_on_over_off']:.2f}x")
        result["prefix_caching"] = {"rows": rows, "runs": runs, "ratios": ratios,
                                    "system_tokens": args.system_tokens, "rate": args.cache_rate}

    write_json(args.out, result)
    failed = sum(r["failed"] for part in ("policies", "prefix_caching") for r in result.get(part, {}).get("rows", []))
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
