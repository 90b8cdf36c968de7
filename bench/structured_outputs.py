#!/usr/bin/env python
"""What a grammar costs: output tokens per second of --streams concurrent chat streams on one server, each
request free or constrained by a JSON schema (response_format), greedy and sampled.

    python bench/structured_outputs.py                       # SmolLM2-135M-Instruct, 16 streams
    python bench/structured_outputs.py --streams 4 --rounds 2
    python bench/structured_outputs.py --temperatures 0 --set scheduler_config.decode_steps=1   # no decode runs

Every stream sends its requests back to back; a round runs each mode for --seconds and modes alternate within a
round (free, constrained, free, ...), so the machine's drift falls on both. A constrained row is masked on the
host (the master's llguidance matcher writes its bitmask into shm before each step, the agent applies it before
the pick), and takes no part in decode runs (greedy) or speculation.

Two workloads:
  - equal length (the cost of the constraint itself): every request makes exactly --max-tokens tokens, free ones
    with ignore_eos, constrained ones under a schema no reply finishes in that many (a long array of strings:
    the masks inside JSON strings are the costliest to compute), so both modes pay the same prefill and decode
    steps per token and differ only by the masks;
  - people (the parse check): a person as JSON, the grammar ending the reply; every reply that ended by `stop`
    is parsed and validated with jsonschema. Its replies are shorter than free ones, so their tokens carry more
    prefill each: its tok/s is reported, not compared.
Tokens per second count the tokens streamed (usage.completion_tokens). Also from /stats: the master's shm_write ms
per step (where the masks are computed) in each mode. Writes JSON (default bench_results/structured_outputs.json)
and prints a table.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp  # noqa: E402
import jsonschema  # noqa: E402

from bench.common import http, log_dir, machine, table, write_json  # noqa: E402
from llm_serving.server_process import ServerProcess  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "hobbies"],
          "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
                         "city": {"type": "string", "maxLength": 40},
                         "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4}}}
LONG = {"type": "object", "additionalProperties": False, "required": ["notes"],
        "properties": {"notes": {"type": "array", "minItems": 200, "items": {"type": "string", "maxLength": 24}}}}
PEOPLE = ["a chef from Lyon", "a retired pilot", "a young violinist", "a marine biologist", "a farmer in Kenya",
          "a software engineer", "a librarian in Oslo", "a street musician", "a mountain guide", "a nurse",
          "a potter from Kyoto", "a taxi driver", "a chess champion", "a beekeeper", "a painter", "a firefighter"]


async def stream_one(session, url: str, model: str, k: int, mode: str, temperature: float, max_tokens: int) -> tuple:
    body = {"model": model, "max_tokens": max_tokens, "temperature": temperature, "seed": k, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"Describe {PEOPLE[k % len(PEOPLE)]} as JSON with name, age, "
                                                     "city and hobbies."}]}
    if mode == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    elif mode == "long_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "notes", "schema": LONG}}
    elif mode == "free_exact":
        body["ignore_eos"] = True
    text, tokens, reason = [], 0, None
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for c in chunk["choices"]:
                text.append(c["delta"].get("content") or "")
                reason = c["finish_reason"] or reason
    return tokens, "".join(text), reason


async def run_mode(url: str, model: str, mode: str, streams: int, seconds: float, temperature: float,
                   max_tokens: int) -> dict:
    deadline = time.perf_counter() + seconds
    done = {"tokens": 0, "requests": 0, "parsed": 0, "stopped": 0}

    async def worker(w: int):
        k = w
        while time.perf_counter() < deadline:
            tokens, text, reason = await stream_one(session, url, model, k, mode, temperature, max_tokens)
            k += streams
            done["tokens"] += tokens
            done["requests"] += 1
            if mode == "json_schema" and reason == "stop":
                done["stopped"] += 1
                jsonschema.validate(json.loads(text), SCHEMA)        # a reply the grammar ended always parses
                done["parsed"] += 1
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        await asyncio.gather(*(worker(w) for w in range(streams)))
    done["seconds"] = time.perf_counter() - t0
    return done


def _mean(values: list) -> float:
    return sum(values) / len(values)


def profile(url: str) -> dict:
    return http("GET", url + "/stats")[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="model path (default: the server's default, SmolLM2-135M-Instruct)")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=40.0, help="per mode and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE",
                    help="a server setting (repeatable), e.g. scheduler_config.decode_steps=1")
    ap.add_argument("--out", default="bench_results/structured_outputs.json")
    args = ap.parse_args()
    server_args = (["--model", args.model] if args.model else []) + [
        "--set", f"serving_config.max_num_seqs={max(args.streams, 16)}"] + [a for s in args.sets for a in ("--set", s)]
    srv = ServerProcess(server_args, log_dir() / "structured_outputs.log")
    results = {"machine": machine(), "sets": args.sets, "streams": args.streams, "seconds": args.seconds, "rounds": args.rounds,
               "max_tokens": args.max_tokens, "modes": {}}
    try:
        srv.wait_ready(timeout_s=3600)
        model = http("GET", srv.url + "/v1/models")[1]["data"][0]["id"]
        # warm: compile what each mode's steps use, and the grammar
        for mode in ("free", "json_schema", "long_schema"):
            asyncio.run(run_mode(srv.url, model, mode, args.streams, 1.0, 0.7, 8))
        pairs = [("free_exact", "long_schema"), ("free", "json_schema")]
        for temperature in map(float, args.temperatures.split(",")):
            for rnd in range(args.rounds):
                for mode in [m for pair in pairs for m in (pair if rnd % 2 == 0 else pair[::-1])]:
                    before = profile(srv.url)
                    got = asyncio.run(run_mode(srv.url, model, mode, args.streams, args.seconds, temperature,
                                               args.max_tokens))
                    after = profile(srv.url)
                    steps = after["num_steps"] - before["num_steps"]
                    write_ms = 1e3 * (after["step_profile_total_s"].get("shm_write", 0.0) -
                                      before["step_profile_total_s"].get("shm_write", 0.0)) / max(steps, 1)
                    key = f"{mode}@T={temperature:g}"
                    agg = results["modes"].setdefault(key, {"tokens": 0, "seconds": 0.0, "requests": 0, "parsed": 0,
                                                            "stopped": 0, "steps": 0, "shm_write_ms": []})
                    for k in ("tokens", "seconds", "requests", "parsed", "stopped"):
                        agg[k] += got[k]
                    agg["steps"] += steps
                    agg["shm_write_ms"].append(write_ms)
                    print(f"  round {rnd} {key}: {got['tokens'] / got['seconds']:.1f} tok/s "
                          f"({got['requests']} requests)", flush=True)
        rows = []
        for temperature in map(float, args.temperatures.split(",")):
            for free_mode, json_mode in pairs:
                free = results["modes"][f"{free_mode}@T={temperature:g}"]
                json_ = results["modes"][f"{json_mode}@T={temperature:g}"]
                free_tps, json_tps = free["tokens"] / free["seconds"], json_["tokens"] / json_["seconds"]
                results[f"ratio_{json_mode}@T={temperature:g}"] = json_tps / free_tps
                rows.append({"t": temperature, "work": "equal length" if free_mode == "free_exact" else "people",
                             "free": free_tps, "json": json_tps, "ratio": json_tps / free_tps,
                             "tokens": f"{free['tokens'] / free['requests']:.0f}/{json_['tokens'] / json_['requests']:.0f}",
                             "parsed": f"{json_['parsed']}/{json_['stopped']}" if json_mode == "json_schema" else "-",
                             "free_write": _mean(free["shm_write_ms"]), "json_write": _mean(json_["shm_write_ms"])})
        write_json(args.out, results)
        print(table(rows, [("work", "workload", "{}"), ("t", "temperature", "{:g}"), ("free", "free tok/s", "{:.1f}"),
                           ("json", "schema tok/s", "{:.1f}"), ("ratio", "ratio", "{:.3f}"),
                           ("tokens", "tokens/reply", "{}"), ("parsed", "parsed/stopped", "{}"),
                           ("free_write", "free write ms", "{:.2f}"), ("json_write", "schema write ms", "{:.2f}")]))
    finally:
        srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
