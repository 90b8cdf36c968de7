#!/usr/bin/env python
"""Embeddings beside generation (issue 51): S greedy generation streams run alone, then with embedding requests sent
at the same time, then the embeddings alone, in alternating rounds on one server. Embeddings share the step loop
(embed steps between the generation steps), so the streams should slow by no more than the embeddings' own compute:
the seconds the agent spent in embed steps during the mixed round (`/stats` step_time_s["embed"]). Goal: the
streams' extra wall time at most that (a ratio <= 1; noise allowing).

    python bench/embed_mix.py                                      # stories260K, 16 streams, 64 tokens
    python bench/embed_mix.py --model PATH --streams 16 --embeds 64 --batch 8 --rounds 5

Writes JSON (default bench_results/embed_mix.json).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.api_overhead import one_round as streamed_round  # noqa: E402
from bench.common import log_dir, machine, server_args, table, write_json  # noqa: E402
from llm_serving.server_process import ServerProcess, http  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared"
STORIES = SHARED / "models" / "stories260K"
ALPACA = SHARED / "datasets" / "alpaca_5000.json"
PROMPT = "Once upon a time, there was a little dog"


def texts(count: int) -> list:
    """Texts to embed: alpaca's instructions and inputs when ../shared has them, else numbered sentences."""
    if ALPACA.is_file():
        records = json.loads(ALPACA.read_text())
        return [(r["instruction"] + " " + r["input"]).strip() for r in records[:count]]
    return [f"Sentence number {i} is about a cat that sat on mat number {i % 7}." for i in range(count)]


async def generate(url: str, model: str, streams: int, tokens: int) -> float:
    """S concurrent streamed completions of `tokens` tokens each (api_overhead's round); the wall time until the last
    ends."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    t0 = time.perf_counter()
    await streamed_round(url, "/v1/completions", body, streams)
    return time.perf_counter() - t0


async def embed(session, url: str, model: str, inputs: list, batch: int, clients: int) -> float:
    """The inputs in requests of `batch` texts, `clients` requests in flight at a time; the wall time."""
    queue = [inputs[i:i + batch] for i in range(0, len(inputs), batch)]

    async def client():
        while queue:
            part = queue.pop()
            async with session.post(url + "/v1/embeddings", json={"model": model, "input": part}) as resp:
                data = await resp.json()
                if resp.status != 200 or len(data["data"]) != len(part):
                    raise RuntimeError(f"embeddings: {resp.status} {str(data)[:300]}")
    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return time.perf_counter() - t0


def embed_seconds(url: str) -> float:
    return http("GET", url + "/stats")[1]["step_time_s"].get("embed", 0.0)


async def one_round(url: str, model: str, what: str, args, inputs: list) -> dict:
    async with aiohttp.ClientSession() as session:
        e0 = embed_seconds(url)
        jobs = []
        if what in ("generation", "mixed"):
            jobs.append(generate(url, model, args.streams, args.tokens))
        if what in ("mixed", "embeddings"):
            jobs.append(embed(session, url, model, inputs, args.batch, args.clients))
        walls = await asyncio.gather(*jobs)
        return {"generation_s": walls[0] if what != "embeddings" else None,
                "embeddings_s": walls[-1] if what != "generation" else None,
                "embed_step_s": embed_seconds(url) - e0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(STORIES / "hf") if STORIES.is_dir() else None,
                   help="model path (default: stories260K from ../shared)")
    p.add_argument("--config", default="configs/stories260K.yaml" if STORIES.is_dir() else None)
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--embeds", type=int, default=64, help="texts embedded per round")
    p.add_argument("--batch", type=int, default=8, help="texts per embeddings request")
    p.add_argument("--clients", type=int, default=2, help="embeddings requests in flight")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default="bench_results/embed_mix.json")
    args = p.parse_args(argv)
    inputs = texts(args.embeds)
    server = ServerProcess(server_args(args.model, args.config, args.set), log_dir() / "embed_mix.log")
    kinds = ("generation", "mixed", "embeddings")
    runs: dict = {k: [] for k in kinds}
    try:
        server.wait_ready()
        model = http("GET", server.url + "/v1/models")[1]["data"][0]["id"]
        for what in kinds:                                   # warm-up: every graph compiled
            asyncio.run(one_round(server.url, model, what, args, inputs))
        for _ in range(args.rounds):                         # alternating: the machine's noise falls on each alike
            for what in kinds:
                runs[what].append(asyncio.run(one_round(server.url, model, what, args, inputs)))
    finally:
        server.stop()
    med = lambda what, key: statistics.median(r[key] for r in runs[what])      # noqa: E731
    alone, mixed = med("generation", "generation_s"), med("mixed", "generation_s")
    embed_compute = med("mixed", "embed_step_s")
    summary = {"generation_alone_s": alone, "generation_mixed_s": mixed, "slowdown_s": mixed - alone,
               "embed_step_s_mixed": embed_compute, "embed_step_s_alone": med("embeddings", "embed_step_s"),
               "embeddings_alone_s": med("embeddings", "embeddings_s"), "embeddings_mixed_s": med("mixed", "embeddings_s"),
               "slowdown_per_embed_compute": (mixed - alone) / embed_compute if embed_compute else None}
    print(f"\n{args.streams} streams x {args.tokens} tokens, {args.embeds} texts in requests of {args.batch} "
          f"({args.clients} in flight); median of {args.rounds} alternating rounds")
    print(table([{"figure": k, "value": v} for k, v in summary.items()],
                [("figure", "figure", "{}"), ("value", "seconds or ratio", "{:.3f}")]))
    write_json(args.out, {"machine": machine(), "args": vars(args), "summary": summary, "rounds": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
