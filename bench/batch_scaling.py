#!/usr/bin/env python
"""Decode speed at fixed concurrency, through the real server: step time and tokens/s per batch size.

Starts `llm-serving start` (the built-in model unless --model is given) on loopback, then for each
concurrency B sends B streaming requests at once (same length, ignore_eos, so the decode batch stays
at B) and reports, from the client and from the engine's /stats counters measured around the phase:

  decode_ms_per_step   mean agent step time of decode steps with exactly B rows (master round trip
                       included: shm write, TCP frame, model, shm read)
  decode_tok_s         B / decode step time: the engine's decode throughput at that batch
  client_tok_s         generated tokens / wall time of the phase, as clients saw it (prefill included)
  ttft_ms_p50          time to first streamed token

    python bench/batch_scaling.py                                   # default model, B = 1 and 32
    python bench/batch_scaling.py --model ../shared/models/stories260K/hf \
        --config configs/stories260K.yaml --batch-sizes 1,8,32 --new-tokens 128

Prints a table and writes JSON (default bench_results/batch_scaling.json).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import replay  # noqa: E402
from llm_serving.loadgen.workload import Sample  # noqa: E402
from llm_serving.server_process import ServerProcess, http  # noqa: E402

PROMPTS = ["Once upon a time", "The little dog", "In a small town", "She opened the door",
           "The weather today", "He said hello", "A long road", "The red ball"]


def _phase(url, model, batch, new_tokens):
    """B requests at once through the load client (ignore_eos, exact lengths); (wall s, summary)."""
    samples = [Sample(PROMPTS[i % len(PROMPTS)], 4, new_tokens) for i in range(batch)]
    summary, _ = replay(url, model, samples, [0.0] * batch)
    if summary["failed"]:
        raise RuntimeError(f"{summary['failed']} requests failed: {summary['errors']}")
    return summary["duration_s"], summary


def run(args) -> dict:
    cli = []
    if args.config:
        cli += ["--config", args.config]
    if args.model:
        cli += ["--model", args.model]
    for item in args.set:
        cli += ["--set", item]
    with tempfile.TemporaryDirectory() as tmp, \
            ServerProcess(cli, Path(tmp) / "server.log") as server:
        _, info = http("GET", server.url + "/info")
        model = info["model_id"]
        # one untimed request so lazily initialised paths are warm
        _phase(server.url, model, 1, 4)
        rows = []
        for batch in args.batch_sizes:
            _, before = http("GET", server.url + "/stats")
            wall, summary = _phase(server.url, model, batch, args.new_tokens)
            _, after = http("GET", server.url + "/stats")
            key = str(batch)
            steps = (after["batch_sizes"]["decode"].get(key, 0) - before["batch_sizes"]["decode"].get(key, 0))
            secs = (after["step_time_s_by_batch"]["decode"].get(key, 0.0)
                    - before["step_time_s_by_batch"]["decode"].get(key, 0.0))
            tokens = summary["total_output_tokens"]
            ms = 1000 * secs / steps if steps else float("nan")
            rows.append({
                "batch": batch, "new_tokens": args.new_tokens, "decode_steps_at_batch": steps,
                "decode_ms_per_step": round(ms, 3),
                "decode_tok_s": round(batch * 1000 / ms, 1) if steps else None,
                "client_tok_s": round(tokens / wall, 1), "wall_s": round(wall, 3), "generated_tokens": tokens,
                "ttft_ms_p50": round(summary["ttft_ms"]["median"], 1),
            })
        _, final = http("GET", server.url + "/stats")
    return {"model": model, "info": info, "rows": rows, "num_preemptions": final["num_preemptions"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="HuggingFace LLaMA directory (default: the built-in model)")
    parser.add_argument("--config", help="YAML config")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--batch-sizes", default="1,32", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", default="bench_results/batch_scaling.json")
    args = parser.parse_args(argv)

    result = run(args)
    print(f"model {result['model']}  ({args.new_tokens} new tokens per request)")
    print(f"{'batch':>5} {'decode ms/step':>15} {'decode tok/s':>13} {'client tok/s':>13} {'ttft p50 ms':>12}")
    for r in result["rows"]:
        print(f"{r['batch']:>5} {r['decode_ms_per_step']:>15.2f} {r['decode_tok_s'] or float('nan'):>13.1f} "
              f"{r['client_tok_s']:>13.1f} {r['ttft_ms_p50']:>12.1f}")
    base = result["rows"][0]
    for r in result["rows"][1:]:
        if base["decode_tok_s"] and r["decode_tok_s"]:
            print(f"decode throughput, batch {r['batch']} / batch {base['batch']}: "
                  f"{r['decode_tok_s'] / base['decode_tok_s']:.1f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
