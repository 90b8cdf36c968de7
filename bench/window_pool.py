#!/usr/bin/env python
"""The sliding layers' window pool (`pa_config.window_blocks`): what a long-context KV cache of a model with
sliding-window layers (Gemma 3: five of every six layers see the last 1,024 keys) costs on this server with the pool
(`auto`) and without it (`0`), and on llama.cpp's `llama-server` (its default flags: its own sliding-window cache),
at the same KV tokens, one after the other in one run, 2 threads each.

    python bench/window_pool.py --model gemma3-4b-q4km          # 16 streams' KV of 8,192 tokens each
    python bench/window_pool.py --model X.gguf --streams 4 --context 32768 --no-peer
    python bench/window_pool.py --model gemma3-4b-q4km --plan   # the start-up plans only, 1-16 streams of 8k-128k

Each server starts with a KV cache for --streams requests of --context tokens (this server: `pa_config.num_blocks`
= streams x context / block size, `model_config.max_generate_length` = context; llama-server: `-c` streams x context,
`-np` streams), serves one request of --prompt-len random tokens and --output-len out (streamed, `ignore_eos`; its
time to first token and time per output token are printed), then the memory of its process tree is read (PSS and
RSS: this server's master and agent; the KV cache is allocated, and touched, at start). For this server the cache's
bytes are also computed from /stats (each pool's blocks) and the model's shape: the main pool's blocks x the global
layers' K/V bytes + the window pool's blocks x the sliding layers'.

Writes JSON (default bench_results/window_pool.json).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import http, log_dir, machine, table, tree_memory, with_llama_server, write_json  # noqa: E402
from bench.make_models import resolve_short_name  # noqa: E402
from bench.peers import find_llama_server, start_ours  # noqa: E402
from llm_serving.startup.kv_memory import SlidingLayers, bytes_per_block  # noqa: E402


def one_request(url: str, name: str, prompt_len: int, output_len: int, vocab: int, peer: bool) -> dict:
    """TTFT and TPOT of one streamed request of random token ids. A token counts when its chunk comes, whatever its
    text (a random model's tokens may print nothing: llama-server then sends an empty text)."""
    rng = random.Random(7)
    body = {"model": name, "prompt": [rng.randrange(100, vocab - 100) for _ in range(prompt_len)],
            "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True}
    if peer:
        body["cache_prompt"] = False
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=3600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: {") and json.loads(line[6:]).get("choices") and first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    if first is None:
        raise RuntimeError(f"{url}: no token came back")
    return {"ttft_ms": (first - t0) * 1e3, "tpot_ms": (end - first) * 1e3 / max(output_len - 1, 1)}


def ours(model: str, args, pool: str) -> dict:
    block = 16
    sets = [f"pa_config.num_blocks={math.ceil(args.streams * args.context / block)}",
            f"model_config.max_generate_length={args.context}", f"pa_config.window_blocks={pool}",
            f"serving_config.max_num_seqs={args.streams}", *args.set]
    srv, started = start_ours(["--model", model] + sum((["--set", s] for s in sets), []),
                              log_dir() / f"window_pool_ours_{pool}.log")
    try:
        stats = http("GET", srv.url + "/stats")[1]
        name = http("GET", srv.url + "/info")[1]["model_id"]
        run = one_request(srv.url, name, args.prompt_len, args.output_len, args.vocab, peer=False)
        return {"start_s": started, **run, "memory": tree_memory(srv.proc.pid), "num_blocks": stats["num_blocks"],
                "window_pool": stats.get("window_pool")}
    finally:
        srv.stop()


def llama(binary: str, model: str, args) -> dict:
    log = log_dir() / "window_pool_llama_server.log"

    def work(peer):
        run = one_request(peer.url, "m", args.prompt_len, args.output_len, args.vocab, peer=True)
        return {**run, "memory": tree_memory(peer.proc.pid)}
    result, extra = with_llama_server([binary, "-m", model, "--alias", "m", "--host", "127.0.0.1", "-t", "2",
                                       "-np", str(args.streams), "-c", str(args.streams * args.context)], log, work)
    return {**result, "flags": extra}


def cache_bytes(model: str, run: dict) -> int:
    """This server's KV bytes from its pools' blocks and the model's shape (float16)."""
    from llm_serving.models.weights import model_shape

    shape = model_shape(model)
    sliding = SlidingLayers.of(shape, shape.num_layers)
    per = lambda layers: bytes_per_block(layers, shape.num_kv_heads, shape.head_dim, 16)  # noqa: E731
    pool = run["window_pool"]
    if not pool:
        return run["num_blocks"] * per(shape.num_layers)
    return run["num_blocks"] * per(shape.num_layers - sliding.count) + pool["num_blocks"] * per(sliding.count)


def plan(model: str, streams: list, contexts: list) -> list:
    """The cache start-up plans for each (streams, context), without a server: pa_config.num_blocks for streams x
    context tokens, the window pool as `auto` sizes it, and the bytes with and without it (float16)."""
    from llm_serving.config import config_from_dict
    from llm_serving.models.weights import model_shape
    from llm_serving.startup.kv_memory import size_for_model

    shape = model_shape(model)
    sliding = SlidingLayers.of(shape, shape.num_layers)
    per = lambda layers: bytes_per_block(layers, shape.num_kv_heads, shape.head_dim, 16)  # noqa: E731
    rows = []
    for s in streams:
        for c in contexts:
            blocks = math.ceil(s * c / 16)
            cfg = size_for_model(config_from_dict({}, (f"pa_config.num_blocks={blocks}", "spec_config.method=off",
                                                       f"model_config.max_generate_length={c}",
                                                       f"serving_config.max_num_seqs={s}")), model)
            full = blocks * per(shape.num_layers)
            pooled = blocks * per(shape.num_layers - sliding.count) + cfg.window_blocks * per(sliding.count) \
                if cfg.window_blocks else full
            rows.append({"streams": s, "context": c, "window_blocks": cfg.window_blocks, "full_mib": full / 2**20,
                         "pool_mib": pooled / 2**20, "ratio": pooled / full})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a GGUF or HF directory of a model with sliding-window layers, or "
                                                  "a bench/make_models.py short name (gemma3-4b-q4km)")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--context", type=int, default=8192, help="tokens a request may reach")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--vocab", type=int, default=49152, help="random prompt ids are drawn below this")
    p.add_argument("--no-peer", action="store_true", help="leave llama-server out")
    p.add_argument("--set", action="append", default=[], help="config overrides for this project's server")
    p.add_argument("--plan", action="store_true", help="only the start-up plans (no server): the cache's bytes with "
                                                        "and without the pool for 1/4/16 streams of 8k/32k/128k")
    p.add_argument("--out", default="bench_results/window_pool.json")
    args = p.parse_args(argv)
    model = str(resolve_short_name(args.model) or args.model)
    if args.plan:
        rows = plan(model, [1, 4, 16], [8192, 32768, 131072])
        print(table(rows, [("streams", "streams", "{}"), ("context", "context", "{}"),
                           ("window_blocks", "window blocks", "{}"), ("full_mib", "every layer MiB", "{:.0f}"),
                           ("pool_mib", "with the pool MiB", "{:.0f}"), ("ratio", "ratio", "{:.3f}")]))
        write_json(args.out.replace(".json", "_plan.json"), {"scenario": "window_pool_plan", "model": model,
                                                             "rows": rows})
        return 0

    runs = {}
    for pool in ("auto", "0"):
        label = f"llm-serving window_blocks={pool}"
        print(f"{label}: starting", flush=True)
        runs[label] = ours(model, args, pool)
        runs[label]["kv_bytes"] = cache_bytes(model, runs[label])
    binary, version = find_llama_server(None)
    if not args.no_peer and binary is not None and model.endswith(".gguf"):
        print("llama-server: starting", flush=True)
        runs["llama-server"] = llama(binary, model, args)
    elif not args.no_peer:
        print(f"llama-server left out: {version if binary is None else 'not a GGUF'}")
    on, off = runs["llm-serving window_blocks=auto"], runs["llm-serving window_blocks=0"]
    ratios = {"kv_bytes_pool_over_full": on["kv_bytes"] / off["kv_bytes"],
              "pss_pool_over_full": on["memory"]["pss"] / off["memory"]["pss"]}
    if "llama-server" in runs:
        ratios["pss_pool_over_llama_server"] = on["memory"]["pss"] / runs["llama-server"]["memory"]["pss"]
    write_json(args.out, {"scenario": "window_pool", "machine": machine(), "model": model, "streams": args.streams,
                          "context": args.context, "prompt_len": args.prompt_len, "output_len": args.output_len,
                          "runs": runs, "ratios": ratios, "at": time.strftime("%Y-%m-%d %H:%M")})
    rows = [{"server": label, "pss": r["memory"]["pss"] / 2**20, "rss": r["memory"]["rss"] / 2**20,
             "kv": r["kv_bytes"] / 2**20 if "kv_bytes" in r else None, "ttft": r["ttft_ms"], "tpot": r["tpot_ms"]}
            for label, r in runs.items()]
    print(f"\nKV cache for {args.streams} x {args.context} tokens; one request of {args.prompt_len} + "
          f"{args.output_len} tokens")
    print(table(rows, [("server", "server", "{}"), ("pss", "PSS MiB", "{:.0f}"), ("rss", "RSS MiB", "{:.0f}"),
                       ("kv", "KV MiB (computed)", "{:.0f}"), ("ttft", "TTFT ms", "{:.0f}"),
                       ("tpot", "TPOT ms", "{:.1f}")]))
    print("  " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
