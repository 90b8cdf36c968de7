#!/usr/bin/env python
"""Peer precision: how far each server's output is from the float64 reference, on the same GGUF and the same
prompt tokens: this server and llama.cpp's `llama-server`, greedy, at one stream and at several at once. The
speed rows of docs/BENCHMARKS.md get their precision column from here.

    python bench/peer_precision.py --model qwen3-4b-q4km                 # a made model's short name, or a GGUF
    python bench/peer_precision.py --model X.gguf --prompts 8 --output-len 16 --streams 1,8

Each server is started alone (the other stopped), with 2 threads, and sent --prompts alpaca prompts
(../shared/datasets, as in the precision gate), greedy, --output-len tokens each, with every chosen token's
log-probability: this server through its generate route (`details`; the prompt's token ids come back in
`decoder_input_details`), llama-server through `/completion` with those same token ids as its prompt, `n_probs` 1
(its probabilities are the softmax of the raw logits, before sampling) and `return_tokens`. At a level of S
streams the prompts go S at a time.

The reference (llm_serving/reference_llama.py) is the model in float64, from the same file's dequantized
weights; it scores each served continuation teacher-forced (prompt + served tokens, one pass over every layer for
all of them: a 4B is read a layer at a time). Per server and level (llm_serving.precision.served_token_errors):
greedy agreement (the share of served tokens that are the reference's argmax after the same prefix; a
disagreement where the reference's own top-two margin is below the server's error is counted as a near tie) and
the chosen token's log-probability error against the reference, mean / p99 / max, in nats. Output is text;
batch-invariant servers give the same tokens at every level.

A missing llama-server is left out (the output says why); this server is always measured. Writes JSON (default
bench_results/peer_precision.json).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import ALPACA, info, log_dir, machine, table, with_llama_server, write_json  # noqa: E402
from bench.peers import find_llama_server, resolve_model, start_ours  # noqa: E402
from llm_serving.precision import load_prompts, served_token_errors, summarize_token_errors  # noqa: E402
from llm_serving.reference_llama import ReferenceLlama  # noqa: E402


def post(url: str, body: dict, timeout: float = 1800) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def ours_one(url: str, model: str, prompt: str, output_len: int) -> dict:
    """{prompt_ids, tokens, logprobs} of one greedy request to this server."""
    body = post(f"{url}/models/{model}/generate",
                {"inputs": prompt, "parameters": {"max_new_tokens": output_len, "do_sample": False, "details": True,
                                                  "decoder_input_details": True}})
    d = body["details"]
    return {"prompt_ids": [t["id"] for t in d["prefill"]], "tokens": [t["id"] for t in d["tokens"]],
            "logprobs": [t["logprob"] for t in d["tokens"]]}


def llama_one(url: str, prompt_ids: list, output_len: int) -> dict:
    """{prompt_ids, tokens, logprobs} of one greedy request to llama-server, its prompt given as token ids."""
    body = post(f"{url}/completion", {"prompt": prompt_ids, "n_predict": output_len, "temperature": 0.0,
                                      "n_probs": 1, "return_tokens": True, "cache_prompt": False})
    probs = body["completion_probabilities"]
    return {"prompt_ids": list(prompt_ids), "tokens": [p["id"] for p in probs],
            "logprobs": [p["logprob"] for p in probs]}


def at_levels(streams: list, send, items: list) -> dict:
    """{S: [send(item) for every item]}, S requests in flight at a time."""
    out = {}
    for s in streams:
        with ThreadPoolExecutor(max_workers=s) as pool:
            out[s] = list(pool.map(send, items))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="a GGUF file or a made model's short name (bench/make_models.py)")
    p.add_argument("--llama-server", help="llama.cpp's llama-server binary (default: bench/setup_peers.sh's)")
    p.add_argument("--prompts", type=int, default=8, help="alpaca prompts")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--streams", default="1,8", help="levels: prompts in flight at a time, comma separated")
    p.add_argument("--dataset", default=str(ALPACA))
    p.add_argument("--threads", type=int, default=2, help="llama-server's threads (this server takes the cores)")
    p.add_argument("--set", action="append", default=[], help="config overrides for this project's server")
    p.add_argument("--out", default="bench_results/peer_precision.json")
    args = p.parse_args(argv)
    model = resolve_model(args.model)
    if not str(model).endswith(".gguf") or not Path(model).is_file():
        sys.exit(f"peer_precision: --model must be a GGUF file or a made model's short name, got {args.model!r}")
    streams = [int(s) for s in args.streams.split(",")]
    prompts = load_prompts(args.dataset, args.prompts)
    served = {}

    t0 = time.perf_counter()
    sets = sum((["--set", s] for s in args.set), [])
    srv, _ = start_ours(["--model", model, *sets], log_dir() / "peer_precision_ours.log")
    try:
        name = info(srv)["model_id"]
        served["llm-serving"] = at_levels(streams, lambda pr: ours_one(srv.url, name, pr, args.output_len), prompts)
    finally:
        srv.stop()
    prompt_ids = [r["prompt_ids"] for r in served["llm-serving"][streams[0]]]
    print(f"llm-serving: {len(prompts)} prompts x {len(streams)} levels in {time.perf_counter() - t0:.0f} s",
          flush=True)

    llama, llama_version = find_llama_server(args.llama_server)
    skipped = {}
    if llama is None:
        skipped["llama-server"] = llama_version
    else:
        ctx = max(map(len, prompt_ids)) + args.output_len + 16
        for s in streams:
            def level(peer, s=s):
                return at_levels([s], lambda ids: llama_one(peer.url, ids, args.output_len), prompt_ids)[s]
            flags = [llama, "-m", model, "--host", "127.0.0.1", "-t", str(args.threads), "-np", str(s),
                     "-c", str(ctx * s), "--threads-http", str(s + 4)]
            runs, _ = with_llama_server(flags, log_dir() / f"peer_precision_llama_{s}.log", level)
            served.setdefault("llama-server", {})[s] = runs

    # every distinct continuation once: prompt + served tokens but the last, teacher-forced
    sequences = {tuple(r["prompt_ids"] + r["tokens"][:-1]) for levels in served.values() for runs in levels.values()
                 for r in runs if r["tokens"]}
    t0 = time.perf_counter()
    reference = ReferenceLlama(model)
    logits = dict(zip(sequences, reference.forward_many([list(s) for s in sequences])))
    print(f"reference: {len(sequences)} sequences, {sum(map(len, sequences))} tokens in "
          f"{time.perf_counter() - t0:.0f} s ({'resident' if reference.resident else 'a layer at a time'})",
          flush=True)

    rows, result = [], {}
    for server, levels in served.items():
        for s, runs in levels.items():
            errors = [served_token_errors(logits[tuple(r["prompt_ids"] + r["tokens"][:-1])], len(r["prompt_ids"]),
                                          r["tokens"], r["logprobs"]) for r in runs if r["tokens"]]
            summary = summarize_token_errors(errors)
            result.setdefault(server, {})[s] = {**summary, "tokens_by_prompt": [r["tokens"] for r in runs]}
            rows.append({"server": server, "streams": s, **summary,
                         "ties": f"{summary['near_ties']}/{summary['disagreements']}"})
    print(table(rows, [("server", "server", "{}"), ("streams", "streams", "{}"), ("tokens", "tokens", "{}"),
                       ("greedy_agreement", "greedy agree", "{:.3f}"), ("ties", "near ties", "{}"),
                       ("lp_error_mean", "|dlogp| mean", "{:.4f}"), ("lp_error_p99", "p99", "{:.4f}"),
                       ("lp_error_max", "max", "{:.4f}")]))
    for server, levels in result.items():
        first = levels[streams[0]]["tokens_by_prompt"]
        same = all(levels[s]["tokens_by_prompt"] == first for s in streams)
        print(f"{server}: the same tokens at every level: {'yes' if same else 'no'}")
        result[server]["same_tokens_at_every_level"] = same
    write_json(args.out, {"scenario": "peer_precision", "machine": machine(), "model": model,
                          "prompts": len(prompts), "output_len": args.output_len, "streams": streams,
                          "llama_server": llama_version, "skipped": skipped, "results": result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
