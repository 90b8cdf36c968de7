#!/usr/bin/env python
"""What a translated API costs (issue 51): the same chat, greedy, through OpenAI chat completions, OpenAI Responses,
Anthropic Messages and Ollama's chat, each streamed by S concurrent clients, in alternating rounds on one server.
Every API gives the same greedy tokens (one translation, one engine), so a round's wall time compares them directly;
the master's CPU seconds per round say what each API's shaping costs the process that also schedules. Goal: no API
more than 5% over chat completions at 16 streams.

    python bench/api_overhead.py                                   # stories260K, 16 streams, 64 tokens
    python bench/api_overhead.py --model PATH --config CFG --streams 16 --rounds 5

Writes JSON (default bench_results/api_overhead.json).
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import log_dir, machine, server_args, table, write_json  # noqa: E402
from llm_serving.server_process import ServerProcess, http  # noqa: E402

STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"
PROMPT = "Tell me a story about a cat."


def bodies(model: str, tokens: int) -> dict:
    """Each API's streamed, greedy request for the same one-message chat and reply length."""
    message = [{"role": "user", "content": PROMPT}]
    return {
        "chat": ("/v1/chat/completions", {"model": model, "messages": message, "max_tokens": tokens,
                                          "temperature": 0, "stream": True}),
        "responses": ("/v1/responses", {"model": model, "input": PROMPT, "max_output_tokens": tokens,
                                        "temperature": 0, "stream": True, "store": False}),
        "messages": ("/v1/messages", {"model": model, "messages": message, "max_tokens": tokens, "temperature": 0,
                                      "stream": True}),
        "ollama": ("/api/chat", {"model": model, "messages": message, "stream": True,
                                 "options": {"temperature": 0, "num_predict": tokens}}),
    }


async def one_round(url: str, path: str, body: dict, streams: int) -> int:
    """S concurrent streamed requests, each read to its end; returns the bytes read (a check they all ran)."""
    async with aiohttp.ClientSession() as session:
        async def call() -> int:
            async with session.post(url + path, json=body) as resp:
                data = await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"{path}: {resp.status} {data[:300]!r}")
                return len(data)
        return sum(await asyncio.gather(*(call() for _ in range(streams))))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(STORIES / "hf") if STORIES.is_dir() else None,
                   help="model path (default: stories260K from ../shared)")
    p.add_argument("--config", default="configs/stories260K.yaml" if STORIES.is_dir() else None)
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default="bench_results/api_overhead.json")
    args = p.parse_args(argv)
    server = ServerProcess(server_args(args.model, args.config, args.set), log_dir() / "api_overhead.log")
    try:
        server.wait_ready()
        model = http("GET", server.url + "/v1/models")[1]["data"][0]["id"]
        master = psutil.Process(server.proc.pid)
        apis = bodies(model, args.tokens)
        wall: dict = {name: [] for name in apis}
        cpu: dict = {name: [] for name in apis}
        for name, (path, body) in apis.items():           # warm-up: every path compiled, every route touched
            asyncio.run(one_round(server.url, path, body, args.streams))
        for _ in range(args.rounds):                        # alternating: the machine's noise falls on each alike
            for name, (path, body) in apis.items():
                c0, t0 = master.cpu_times(), time.perf_counter()
                asyncio.run(one_round(server.url, path, body, args.streams))
                wall[name].append(time.perf_counter() - t0)
                c1 = master.cpu_times()
                cpu[name].append(c1.user + c1.system - c0.user - c0.system)
    finally:
        server.stop()
    base_wall, base_cpu = statistics.median(wall["chat"]), statistics.median(cpu["chat"])
    rows = [{"api": name, "wall_s": statistics.median(wall[name]), "vs_chat": statistics.median(wall[name]) / base_wall,
             "master_cpu_s": statistics.median(cpu[name]), "cpu_vs_chat": statistics.median(cpu[name]) / base_cpu}
            for name in apis]
    print(f"\n{args.streams} streams x {args.tokens} tokens, greedy, median of {args.rounds} alternating rounds")
    print(table(rows, [("api", "api", "{}"), ("wall_s", "round s", "{:.2f}"), ("vs_chat", "/ chat", "{:.3f}"),
                       ("master_cpu_s", "master CPU s", "{:.2f}"), ("cpu_vs_chat", "/ chat", "{:.3f}")]))
    write_json(args.out, {"machine": machine(), "streams": args.streams, "tokens": args.tokens,
                          "rounds": args.rounds, "model": args.model, "rows": rows,
                          "wall_s": wall, "master_cpu_s": cpu})
    return 0


if __name__ == "__main__":
    sys.exit(main())
