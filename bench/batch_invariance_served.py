#!/usr/bin/env python
"""What batch-invariant steps cost a served model: two servers on one model, `model_config.batch_invariant`
auto (the default: on, where the layer kernel serves every step) and false (each batch size's fastest products),
both started first and then driven in turn by the load client (synthetic prompts, greedy, ignore_eos) at each
number of concurrent streams, the two alternating run by run so that the machine's noise falls on both. Output
tokens per second per run, the median of each mode's runs, and their ratio (invariant / fastest: below 1 is
what invariance costs).

    python bench/batch_invariance_served.py                                   # the default model (SmolLM2)
    python bench/batch_invariance_served.py --model DIR --streams 1,16,64 --reps 3

Prints a table and writes JSON (default bench_results/batch_invariance_served.json).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import info, log_dir, machine, replay, server_args, synthetic_samples, table, write_json  # noqa: E402
from llm_serving.loadgen.workload import arrival_offsets  # noqa: E402
from llm_serving.server_process import ServerProcess  # noqa: E402

MODES = ("auto", "false")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory or file (default: the server's default model)")
    ap.add_argument("--config", default=None)
    ap.add_argument("--set", action="append", default=[], help="config overrides for both servers")
    ap.add_argument("--streams", default="1,16,64")
    ap.add_argument("--reps", type=int, default=2, help="runs per mode and stream count (alternating)")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--out", default="bench_results/batch_invariance_served.json")
    args = ap.parse_args()
    rows, runs = [], []
    with ExitStack() as stack:
        servers = {}
        for mode in MODES:
            cli = server_args(args.model, args.config, args.set + [f"model_config.batch_invariant={mode}"])
            servers[mode] = stack.enter_context(ServerProcess(cli, log_dir() / f"batch_invariance_{mode}.log"))
        for mode, server in servers.items():
            server.wait_ready()
            resolved = info(server)["batch_invariant"]
            print(f"{mode}: {server.url}, batch_invariant {resolved}", flush=True)
            if resolved != (mode == "auto"):
                sys.exit(f"batch_invariant={mode} resolved to {resolved}: nothing to compare on this setup")
        first = info(servers["auto"])
        model, tokenizer = first["model_id"], first["tokenizer_path"]
        for streams in [int(s) for s in args.streams.split(",")]:
            n = max(8, 2 * streams)
            samples = synthetic_samples(n, tokenizer, args.input_len, args.output_len)
            tok_s = {mode: [] for mode in MODES}
            for rep in range(args.reps):
                for mode in MODES:
                    summary, _ = replay(servers[mode].url, model, samples, arrival_offsets(n, float("inf")),
                                        max_concurrency=streams)
                    tok_s[mode].append(summary["output_throughput"])
                    runs.append({"streams": streams, "mode": mode, "rep": rep,
                                 "output_tok_s": round(summary["output_throughput"], 2)})
                    print(runs[-1], flush=True)
            inv, fast = statistics.median(tok_s["auto"]), statistics.median(tok_s["false"])
            rows.append({"streams": streams, "requests": n, "invariant_tok_s": round(inv, 1),
                         "fastest_tok_s": round(fast, 1), "ratio": round(inv / fast, 3)})
    print(table(rows, [("streams", "streams", "{}"), ("requests", "requests", "{}"),
                       ("invariant_tok_s", "invariant tok/s", "{:.1f}"), ("fastest_tok_s", "fastest tok/s", "{:.1f}"),
                       ("ratio", "invariant/fastest", "{:.3f}")]))
    write_json(args.out, {"machine": machine(), "model": model, "input_len": args.input_len,
                          "output_len": args.output_len, "reps": args.reps, "rows": rows, "runs": runs})


if __name__ == "__main__":
    main()
