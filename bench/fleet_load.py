#!/usr/bin/env python
"""Several models in one server (issue 52): how long a model takes to load on demand, cold (an empty compile cache:
every kernel graph compiled) and warm (the cache filled, the weights read before), where that time goes (the
agent's log: process start and model load, graph warmup), and what serving two models at once costs against one.

    python bench/fleet_load.py                                # stories260K twice (its HF directory and its .bin)
    python bench/fleet_load.py --first PATH --second PATH --streams 16 --tokens 64
    python bench/fleet_load.py --first 1B.gguf --second SmolLM2.gguf --beside --tokens 256 --rounds 3

The second model loads on demand: cold in a server with an empty cache directory, then warm (unloaded through POST
/models/NAME/unload and asked again, and in two more servers on the filled cache: one whose agents compile every
graph before ready (serving_config.warmup=full), one staged, the default: ready once a first request's graphs are
read, models/warmup.py). Throughput: S streams on the
first model alone, then S/2 on each model at once, alternating rounds. --beside: S streams on the first model while
the second (loaded before, then unloaded) loads on demand, their tok/s in the load's window (from the request to its
first token) against a round without a load, alternating. Writes JSON (default bench_results/fleet_load.json).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import log_dir, machine, table, write_json  # noqa: E402
from llm_serving.server_process import ServerProcess, http  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
STORIES = REPO / "tests" / "assets" / "stories260K"
PROMPT = "Once upon a time, there was a little dog"


def names(url: str) -> list:
    return [m["id"] for m in http("GET", url + "/v1/models")[1]["data"] if not m.get("parent")]


def timed_request(url: str, model: str) -> float:
    t0 = time.perf_counter()
    status, body = http("POST", url + "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 4,
                                                          "temperature": 0}, timeout=1800)
    if status != 200:
        raise RuntimeError(f"{model}: {status} {body}")
    return time.perf_counter() - t0


def phases(log: Path, since: int) -> dict:
    """The last load's phases from the server log (its text after offset `since`): the agent's model load and
    warmup, and the engine's whole start."""
    text = log.read_text(errors="replace")[since:]
    found = {}
    for key, pattern in (("agent_model_load_s", r"model loaded in ([\d.]+) s"), ("warmup_s", r"warmup done in ([\d.]+) s"),
                         ("engine_ready_s", r"engine ready in ([\d.]+) s")):
        values = re.findall(pattern, text)
        if values:
            found[key] = float(values[-1])
    return found


def load_times(args, cache: str, label: str, warmup: str = "staged") -> list:
    """A server on `cache`: the second model asked twice (loaded, unloaded, loaded again); warmup: its agents'
    serving_config.warmup (staged: ready once a first request's graphs are read, on a cache that knows the rest)."""
    log = log_dir() / f"fleet_load_{label.replace(' ', '_').replace(',', '')}.log"
    env = {**os.environ, "LLM_SERVING_CACHE": cache}
    sets = args.set + [f"serving_config.warmup={warmup}"]
    server = ServerProcess(["--model", args.first, "--model", args.second] + sum((["--set", s] for s in sets), []),
                           log, env=env)
    rows = []
    try:
        server.wait_ready(timeout_s=1800)
        second = names(server.url)[1]
        for attempt in ("first load", "after an unload"):
            offset = len(log.read_text(errors="replace"))
            wall = timed_request(server.url, second)
            info = http("GET", server.url + f"/models/{second}")[1]
            rows.append({"server": label, "load": attempt, "first_answer_s": wall, "load_s": info["load_s"],
                         **phases(log, offset)})
            status, body = http("POST", server.url + f"/models/{second}/unload")
            if status != 200:
                raise RuntimeError(f"unload: {status} {body}")
    finally:
        server.stop()
    return rows


async def streams(url: str, plan: list, tokens: int) -> float:
    """Concurrent streamed completions ([(model, count)]); the wall time until the last ends and the tokens."""
    body = lambda model: {"model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0,  # noqa: E731
                          "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as session:
        async def one(model):
            async with session.post(url + "/v1/completions", json=body(model)) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"{model}: {resp.status}")
        t0 = time.perf_counter()
        await asyncio.gather(*(one(model) for model, count in plan for _ in range(count)))
        return time.perf_counter() - t0


def throughput(args) -> dict:
    server = ServerProcess(["--model", args.first, "--model", args.second, "--set", "serving_config.keep_alive=-1"]
                           + sum((["--set", s] for s in args.set), []), log_dir() / "fleet_load_throughput.log")
    half = args.streams // 2
    walls: dict = {"one model": [], "two models": []}
    try:
        server.wait_ready(timeout_s=1800)
        first, second = names(server.url)[:2]
        plans = {"one model": [(first, args.streams)], "two models": [(first, half), (second, args.streams - half)]}
        for plan in plans.values():                      # warm-up: both loaded, every graph used
            asyncio.run(streams(server.url, plan, args.tokens))
        for _ in range(args.rounds):
            for label, plan in plans.items():
                walls[label].append(asyncio.run(streams(server.url, plan, args.tokens)))
    finally:
        server.stop()
    tokens = args.streams * args.tokens
    return {label: {"wall_s": statistics.median(w), "tok_s": tokens / statistics.median(w)} for label, w in walls.items()}


async def _timed_streams(url: str, model: str, count: int, tokens: int, arrivals: list) -> None:
    """`count` streamed completions of `tokens` tokens on `model`; each event's arrival time into `arrivals`."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    async with aiohttp.ClientSession() as session:
        async def one():
            async with session.post(url + "/v1/completions", json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"{model}: {resp.status} {await resp.text()}")
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        arrivals.append(time.perf_counter())
        await asyncio.gather(*(one() for _ in range(count)))


async def _round_beside(url: str, first: str, second: Optional[str], args) -> dict:
    """One round: args.streams streams on `first`; `args.lead_s` in, `second` is asked for a first token (loading
    it on demand), or, with second None, nothing is (the same round alone). The first model's events per second
    in the window [lead, lead + the load's time to its first token] (alone: the window of --window-s)."""
    arrivals: list = []
    started = time.perf_counter()
    task = asyncio.create_task(_timed_streams(url, first, args.streams, args.tokens, arrivals))
    await asyncio.sleep(args.lead_s)
    t0 = time.perf_counter()
    ttft = None
    if second is not None:
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/v1/completions", json={
                    "model": second, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}) as resp:
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        ttft = time.perf_counter() - t0
                        break
                await resp.read()
        if ttft is None:
            raise RuntimeError(f"{second}: no token")
    else:
        await asyncio.sleep(args.window_s)
    t1 = time.perf_counter()
    await task
    if t1 > max(arrivals):
        raise RuntimeError("the streams ended before the window did: raise --tokens")
    inside = sum(t0 <= t < t1 for t in arrivals)
    return {"window_s": t1 - t0, "tok_s": inside / (t1 - t0), "second_first_token_s": ttft,
            "round_s": max(arrivals) - started}


def beside_load(args) -> dict:
    """16 streams on the first model while the second, loaded here before and unloaded, loads on demand: the first
    model's tok/s in the load's window against rounds without a load (alternating), and the load's first token."""
    server = ServerProcess(["--model", args.first, "--model", args.second]
                           + sum((["--set", s] for s in args.set), []), log_dir() / "fleet_load_beside.log")
    rows = []
    try:
        server.wait_ready(timeout_s=1800)
        first, second = names(server.url)[:2]

        def unload():
            status, body = http("POST", server.url + f"/models/{second}/unload")
            if status != 200:
                raise RuntimeError(f"unload: {status} {body}")

        timed_request(server.url, second)            # started here before (its caches and panels written)
        time.sleep(args.settle_s)
        unload()
        asyncio.run(streams(server.url, [(first, args.streams)], args.tokens))       # the first model's graphs
        for _ in range(args.rounds):
            time.sleep(args.gap_s)       # idle: the server may start a spare agent (master/spare_agents.py)
            alone = asyncio.run(_round_beside(server.url, first, None, args))
            loading = asyncio.run(_round_beside(server.url, first, second, args))
            unload()
            # the streams' share of their tok/s kept in the load's window: the round's extra time beside the load
            # (the same tokens) is what the window lost (decode runs send tokens in bursts of 8 a stream, which a
            # count of those inside a window of seconds would quantize)
            lost = (loading["round_s"] - alone["round_s"]) / loading["window_s"]
            rows.append({"alone_tok_s": alone["tok_s"], "beside_tok_s": loading["tok_s"],
                         "alone_round_s": alone["round_s"], "beside_round_s": loading["round_s"],
                         "window_s": loading["window_s"], "kept": 1.0 - lost,
                         "second_first_token_s": loading["second_first_token_s"]})
    finally:
        server.stop()
    return {"rounds": rows, "kept": statistics.median(r["kept"] for r in rows),
            "alone_round_s": statistics.median(r["alone_round_s"] for r in rows),
            "window_s": statistics.median(r["window_s"] for r in rows),
            "second_first_token_s": statistics.median(r["second_first_token_s"] for r in rows)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--first", default=str(STORIES / "hf"))
    p.add_argument("--second", default=str(STORIES / "stories260K.bin"))
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default="bench_results/fleet_load.json")
    p.add_argument("--beside", action="store_true", help="only the load beside streams: --streams on the first "
                   "model while the second (started before, unloaded) loads on demand, against rounds without")
    p.add_argument("--lead-s", type=float, default=2.0, help="--beside: the streams' time before the load is asked")
    p.add_argument("--window-s", type=float, default=2.0, help="--beside: the window of a round without a load")
    p.add_argument("--gap-s", type=float, default=4.0, help="--beside: idle seconds before each pair of rounds")
    p.add_argument("--settle-s", type=float, default=15.0,
                   help="--beside: after the second model's first load, before its unload (its panels written)")
    args = p.parse_args(argv)
    if args.beside:
        got = beside_load(args)
        print(table(got["rounds"], [("alone_round_s", "round alone s", "{:.2f}"),
                                    ("beside_round_s", "round beside a load s", "{:.2f}"),
                                    ("window_s", "load window s", "{:.2f}"), ("kept", "tok/s kept in it", "{:.2f}"),
                                    ("second_first_token_s", "load: first token s", "{:.2f}")]))
        print(f"\n{args.streams} streams on the first model kept {got['kept']:.2f}x their tok/s during the "
              f"second's load; the load's first token in {got['second_first_token_s']:.2f} s (medians of "
              f"{args.rounds})")
        write_json(args.out, {"machine": machine(), "args": vars(args), "beside": got})
        return 0
    with tempfile.TemporaryDirectory(prefix="fleet-cold-") as cold:
        (Path(cold) / "kernels").symlink_to(Path(os.environ.get("LLM_SERVING_CACHE", Path.home() / ".cache" /
                                                                  "llm-serving")) / "kernels")
        rows = (load_times(args, cold, "cold cache") + load_times(args, cold, "warm cache, full warmup", "full")
                + load_times(args, cold, "warm cache"))
    print(table(rows, [("server", "server", "{}"), ("load", "load", "{}"), ("first_answer_s", "first answer s", "{:.2f}"),
                       ("load_s", "load s", "{:.2f}"), ("agent_model_load_s", "agent: model s", "{}"),
                       ("warmup_s", "agent: warmup s", "{}")]))
    both = throughput(args)
    ratio = both["two models"]["tok_s"] / both["one model"]["tok_s"]
    print(f"\n{args.streams} streams x {args.tokens} tokens: one model {both['one model']['tok_s']:.0f} tok/s, the "
          f"same streams split over two models {both['two models']['tok_s']:.0f} tok/s ({ratio:.2f}x)")
    write_json(args.out, {"machine": machine(), "args": vars(args), "loads": rows, "throughput": both,
                          "two_over_one": ratio})
    return 0


if __name__ == "__main__":
    sys.exit(main())
