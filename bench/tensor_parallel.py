#!/usr/bin/env python
"""Tensor parallelism: the same model and config served by 1 agent and by TP agents (shards of heads and
MLP units, all-reducing through shared memory on the CPU), compared in one run for

- correctness: greedy text of the same alpaca prompts, token for token against TP=1 (and the precision
  gate, tools/precision.py, on every server: logits against the float64 reference, 0.5%);
- cost: output tokens/s, TPOT and TTFT through the whole server at a fixed concurrency, the ratio to
  TP=1, and the time to start;
- memory: the weights each rank holds after loading its part of the checkpoint and how much its peak
  resident memory grew while loading (each rank in a fresh process), and each agent's peak resident memory
  once started, before any traffic (Linux VmHWM: weights, compiled graphs, what warmup touched of the KV
  cache, and the MindSpore runtime).

    python bench/tensor_parallel.py --model ../shared/models/stories260K/hf --config configs/stories260K.yaml \
        --tp 1,2,2:mindspore --out bench_results/tensor_parallel_stories260K.json
    python tools/make_random_llama.py --out /tmp/llama-8x512 --tokenizer ../shared/tokenizers/llama2/tokenizer.model
    python bench/tensor_parallel.py --model /tmp/llama-8x512 --out bench_results/tensor_parallel_8x512.json

On a 2-core CPU, TP=2 gives each rank one core (instead of both for one agent) and adds two all-reduces
per layer: expect it slower. The point here is that it is correct; its speed is for multi-device Ascend.
Writes JSON (default bench_results/tensor_parallel.json); exit 1 if any server failed a request, the
greedy text differed, or a precision gate failed.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (ALPACA, REPO, alpaca, info, log_dir, machine, replay, server_args, table,  # noqa: E402
                          write_json)
from llm_serving.server_process import ServerProcess, free_port, http  # noqa: E402


async def _greedy(url: str, model: str, prompts: list, max_new_tokens: int, concurrency: int) -> list:
    """Generated text of each prompt (greedy, exactly max_new_tokens tokens), `concurrency` at a time."""
    gate = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def one(prompt):
            async with gate:
                body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}
                async with session.post(f"{url}/models/{model}/generate", json=body) as resp:
                    out = await resp.json()
                    return out.get("generated_text") if resp.status == 200 else None
        return await asyncio.gather(*(one(p) for p in prompts))


def _precision(url: str, n: int, max_new_tokens: int, dataset: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "precision.json"
        proc = subprocess.run([sys.executable, str(REPO / "tools" / "precision.py"), "--url", url, "--out", str(out),
                               "-n", str(n), "--max-new-tokens", str(max_new_tokens), "--rate", "40",
                               "--prompts", str(dataset)], capture_output=True, text=True, timeout=1800)
        if not out.exists():
            return {"passed": False, "error": (proc.stdout + proc.stderr)[-2000:]}
        return json.loads(out.read_text())


def _agents_peak_rss_mb(url: str) -> list:
    """Each agent's peak resident memory so far (Linux VmHWM), in MB, rank order: weights, graphs, what
    warmup touched of the KV cache, and the MindSpore runtime."""
    agents = sorted(http("GET", url + "/health")[1]["agents"], key=lambda a: a["rank"])
    peaks = []
    for a in agents:
        with open(f"/proc/{a['pid']}/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
        peaks.append(kb / 1024)
    return peaks


_LOAD_PEAK = """
import json, resource, sys
from llm_serving.models.parallel import TensorParallel
from llm_serving.models.weights import load_llama_weights
rank, world = int(sys.argv[2]), int(sys.argv[3])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
_, weights = load_llama_weights(sys.argv[1], TensorParallel(rank, world) if world > 1 else None)
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
held = sum(v.nbytes for v in {id(v): v for v in weights.values()}.values())
print(json.dumps({"held_mb": held / 2**20, "peak_growth_mb": grown / 1024}))
"""


def _load_memory(model_path: str, world: int) -> list:
    """Per rank, in a fresh process each: the float32 weights the rank holds after loading its part of the
    checkpoint, and how much its peak resident memory grew while loading (MB)."""
    out = []
    for rank in range(world):
        proc = subprocess.run([sys.executable, "-c", _LOAD_PEAK, model_path, str(rank), str(world)], cwd=REPO,
                              capture_output=True, text=True, timeout=600, check=True)
        out.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return out


def _across_nodes_sets(sets: list, size: int) -> tuple:
    """(--set options of a group whose ranks 1..size-1 are "another node", the token) on loopback."""
    tmp = Path(tempfile.mkdtemp(prefix="tp-nodes-"))
    token = secrets.token_urlsafe(24)
    (tmp / "token").write_text(token)
    (tmp / "token").chmod(0o600)
    ports = [free_port() for _ in range(size)]
    hosts = ["null"] + ["127.0.0.1"] * (size - 1)
    return sets + [f"serving_config.agent_ports=[{','.join(map(str, ports))}]",
                   f"serving_config.agent_hosts=[{','.join(hosts)}]", f"serving_config.cluster_port={free_port()}",
                   f"serving_config.agent_token_file={tmp / 'token'}"], token


def _start_node(args: list, size: int, tp: str) -> subprocess.Popen:
    """`llm-serving agent` for ranks 1..size-1, as another node would run it."""
    log = open(log_dir() / f"tensor_parallel_tp{tp.replace(':', '_')}_node1.log", "wb")
    return subprocess.Popen([sys.executable, "-m", "llm_serving.cli", "agent", "--ranks", f"1-{size - 1}",
                             *args], cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


@contextlib.contextmanager
def _stopping(node: Optional[subprocess.Popen]):
    try:
        yield
    finally:
        if node is not None:
            node.send_signal(signal.SIGTERM)
            try:
                node.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()


def _broadcast_cost(url: str, token: str) -> dict:
    """Rank 0's step-input broadcasts so far (agent health over the control protocol) and its model time."""
    from llm_serving.agents.control import ControlClient
    from llm_serving.agents import protocol as proto

    agent = next(a for a in http("GET", url + "/health")[1]["agents"] if a["rank"] == 0)
    with ControlClient(agent["port"], token=token) as client:
        health = client.request(proto.Health())
    stats = http("GET", url + "/stats")[1]
    steps = health.input_broadcasts or 1
    model_ms = stats["step_profile_total_s"]["model"] * 1e3      # rank 0's step time, its broadcasts included
    return {"steps": health.input_broadcasts, "ms_total": health.input_broadcast_ms,
            "ms_per_step": health.input_broadcast_ms / steps, "model_ms_per_step": model_ms / max(1, stats["num_steps"]),
            "share_of_model_time": health.input_broadcast_ms / model_ms if model_ms else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="model path (default: the built-in model)")
    p.add_argument("--config", help="YAML config")
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--tp", default="1,2", type=lambda s: s.split(","),
                   help="groups to compare, the first is the baseline: N (default all-reduce) or N:BACKEND, "
                        "e.g. 1,2,2:mindspore; N:nodes = ranks 1..N-1 as another node's (`llm-serving agent` on "
                        "loopback, step inputs broadcast from rank 0)")
    p.add_argument("-n", "--num-prompts", type=int, default=64, help="alpaca prompts of the throughput run")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--greedy-prompts", type=int, default=32, help="prompts compared token for token")
    p.add_argument("--precision-prompts", type=int, default=12)
    p.add_argument("--dataset-path", default=str(ALPACA))
    p.add_argument("--out", default="bench_results/tensor_parallel.json")
    args = p.parse_args(argv)

    runs = {}
    for tp in args.tp:
        size, _, backend = tp.partition(":")
        sets = args.set + [f"serving_config.agent_ports={[0] * int(size)}".replace(" ", "")]
        node = None
        if backend == "nodes":
            sets, token = _across_nodes_sets(args.set, int(size))
            node = _start_node(server_args(args.model, args.config, sets), int(size), tp)
        elif backend:
            sets.append(f"model_config.all_reduce={backend}")
        t0 = time.monotonic()
        log = log_dir() / f"tensor_parallel_tp{tp.replace(':', '_')}.log"
        with ServerProcess(server_args(args.model, args.config, sets), log) as server, _stopping(node):
            start_s = time.monotonic() - t0
            facts = info(server)
            peak_mb = _agents_peak_rss_mb(server.url)      # after load and warmup, before any traffic
            room = facts["max_total_tokens"]
            samples = alpaca(max(args.num_prompts, args.greedy_prompts), facts["tokenizer_path"],
                             args.max_new_tokens, Path(args.dataset_path), room=room)
            prompts = [s.prompt for s in samples[:args.greedy_prompts]]
            greedy_len = min(args.max_new_tokens, min(s.max_new_tokens for s in samples[:args.greedy_prompts]))
            texts = asyncio.run(_greedy(server.url, facts["model_id"], prompts, greedy_len, args.concurrency))
            work = samples[:args.num_prompts]
            replay(server.url, facts["model_id"], work[:args.concurrency], [0.0] * args.concurrency,
                   max_concurrency=args.concurrency)                                               # warm
            summary, _ = replay(server.url, facts["model_id"], work, [0.0] * len(work),
                                max_concurrency=args.concurrency)
            broadcast = _broadcast_cost(server.url, token) if node is not None else None
            precision = _precision(server.url, args.precision_prompts, 16, Path(args.dataset_path))
        runs[tp] = {"input_broadcast": broadcast, "start_s": start_s, "summary": summary, "texts": texts, "precision": precision,
                    "agent_peak_rss_mb": peak_mb, "load": _load_memory(facts["model_path"], int(size)),
                    "tensor_parallel_size": facts["tensor_parallel_size"],
                    "all_reduce": facts.get("tensor_parallel_all_reduce")}
        print(f"TP={tp}: ready in {start_s:.1f} s, {summary['output_throughput']:.1f} output tok/s at concurrency "
              f"{args.concurrency}, precision max rel error {precision.get('max_rel_error', float('nan')):.2e}",
              flush=True)
        if broadcast:
            print(f"TP={tp}: step-input broadcast {broadcast['ms_per_step']:.3f} ms per step on rank 0 over "
                  f"{broadcast['steps']} steps, {100 * broadcast['share_of_model_time']:.1f}% of its step time "
                  f"({broadcast['model_ms_per_step']:.3f} ms per step)", flush=True)

    base = runs[args.tp[0]]
    rows = []
    for tp, r in runs.items():
        s = r["summary"]
        same = sum(a is not None and a == b for a, b in zip(r["texts"], base["texts"]))
        label = tp if r["all_reduce"] is None else f"{r['tensor_parallel_size']}:{r['all_reduce']}"
        rows.append({"tp": label + (" 2 nodes" if r["input_broadcast"] else ""),
                     "bcast_ms": (f"{r['input_broadcast']['ms_per_step']:.3f}" if r["input_broadcast"] else "-"),
                     "tok_s": s["output_throughput"], "ratio": s["output_throughput"]
                     / base["summary"]["output_throughput"], "tpot_p50": s["tpot_ms"]["median"],
                     "ttft_p50": s["ttft_ms"]["median"], "start_s": r["start_s"], "failed": s["failed"],
                     "greedy_same": same, "greedy_total": len(r["texts"]),
                     "precision_max": r["precision"].get("max_rel_error"),
                     "peak_rss_mb": max(r["agent_peak_rss_mb"]), "sum_rss_mb": sum(r["agent_peak_rss_mb"]),
                     "load_held_mb": max(x["held_mb"] for x in r["load"]),
                     "load_peak_mb": max(x["peak_growth_mb"] for x in r["load"]),
                     "precision_passed": bool(r["precision"].get("passed"))})
    print(f"\ntensor parallel: {facts['model_id']}, {args.num_prompts} alpaca prompts, <= {args.max_new_tokens} "
          f"output tokens, concurrency {args.concurrency}; greedy compared on {args.greedy_prompts} prompts")
    print(table(rows, [("tp", "TP:all-reduce", "{}"), ("tok_s", "output tok/s", "{:.1f}"), ("ratio", f"vs TP={args.tp[0]}",
                                                                                    "{:.2f}"),
                       ("tpot_p50", "TPOT p50 ms", "{:.2f}"), ("ttft_p50", "TTFT p50 ms", "{:.0f}"),
                       ("bcast_ms", "input bcast ms/step", "{}"),
                       ("start_s", "start s", "{:.1f}"), ("load_held_mb", "weights MB/rank", "{:.0f}"),
                       ("load_peak_mb", "load peak MB/rank", "{:.0f}"), ("peak_rss_mb", "agent peak MB/rank",
                                                                        "{:.0f}"),
                       ("sum_rss_mb", "agents MB", "{:.0f}"), ("greedy_same", "greedy same", "{}"),
                       ("precision_max", "max rel err", "{:.2e}"), ("failed", "failed", "{}")]))
    write_json(args.out, {"scenario": "tensor_parallel", "machine": machine(), "model": facts["model_id"],
                          "concurrency": args.concurrency, "max_new_tokens": args.max_new_tokens, "rows": rows,
                          "runs": {str(tp): {k: v for k, v in r.items() if k != "texts"} for tp, r in runs.items()}})
    ok = all(r["failed"] == 0 and r["greedy_same"] == r["greedy_total"] and r["precision_passed"] for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
