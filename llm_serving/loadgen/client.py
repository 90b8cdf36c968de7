"""`llm-serving bench` / `python tools/performance_serving.py`: replay a dataset against a running server.

    llm-serving bench --url http://127.0.0.1:8000 --dataset alpaca \
        --dataset-path ../shared/datasets/alpaca_5000.json --request-rate 10 --duration 30
    llm-serving bench --backend openai --url http://127.0.0.1:8001 --dataset synthetic \
        --input-len 128 --output-len 64 -n 200 --max-concurrency 16

Prints vLLM-style metrics, writes a JSON result (and PNG plots next to it). Exit status: 0 when every
request completed, 1 when some failed (the result file counts them), 2 when the run could not start
(bad arguments, missing dataset; a result file with the error is still written).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Optional

import aiohttp

from llm_serving.server_process import http

from .backends import BACKENDS, RequestResult, send
from .metrics import format_table, parse_slos, summarize
from .plots import timeline, write_plots
from .workload import (Sample, TokenCounter, WorkloadError, arrival_offsets, load_alpaca, load_sharegpt,
                       synthetic)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=BACKENDS, default="llm-serving")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--model", help="served model name (default: asked from the server)")
    p.add_argument("--tokenizer", help="tokenizer to count tokens: a sentencepiece .model, a tokenizer.json or a .gguf "
                                       "(default: the server's, from /info)")
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset", choices=("alpaca", "sharegpt", "synthetic"), default="alpaca")
    g.add_argument("--dataset-path", help="alpaca or ShareGPT json")
    g.add_argument("-n", "--num-prompts", type=int, default=100)
    g.add_argument("--max-new-tokens", type=int, default=256,
                   help="cap on a request's output length taken from the dataset (0 = no cap)")
    g.add_argument("--input-len", type=int, default=128, help="synthetic: mean prompt tokens")
    g.add_argument("--output-len", type=int, default=128, help="synthetic: mean output tokens")
    g.add_argument("--range-ratio", type=float, default=0.0, help="synthetic: lengths uniform in len*(1 +- r)")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("arrivals")
    g.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    g.add_argument("--arrival", choices=("fixed", "poisson", "gamma"), default="fixed")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson, < 1 burstier)")
    g.add_argument("--duration", type=float, help="seconds of arrivals: N = rate * duration (the contest's -T)")
    g.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    g = p.add_argument_group("requests")
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (default: ask for exactly max_new_tokens)")
    g.add_argument("--request-timeout", type=float, default=1800.0, help="seconds per request")
    g.add_argument("--goodput", nargs="*", metavar="KEY:MS", help="SLOs for goodput, e.g. ttft:500 tpot:50")
    g.add_argument("--percentiles", default="90,99", help="comma-separated percentiles to report")
    g = p.add_argument_group("output")
    g.add_argument("--result-file", help="JSON result (default bench_results/serving-<backend>-<time>.json)")
    g.add_argument("--profile", action="store_true",
                   help="llm-serving backend: print where each step's time went on the server during the run")
    g.add_argument("--no-plots", dest="plots", action="store_false")
    g.add_argument("--no-progress", dest="progress", action="store_false")


async def _get_json(url: str, timeout: float = 10.0):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s:
        async with s.get(url) as r:
            if r.status != 200:
                raise RuntimeError(f"GET {url}: HTTP {r.status}")
            return await r.json(content_type=None)


async def server_facts(backend: str, url: str) -> dict:
    """What the server says about itself: model name, tokenizer, context length; {"error"} if unreachable."""
    base = url.rstrip("/")
    try:
        if backend == "openai":
            model = (await _get_json(base + "/v1/models"))["data"][0]
            facts = {"model": model["id"], "max_total_tokens": model.get("max_model_len")}
            try:        # servers that also speak TGI's /info (this one) name their tokenizer there
                info = await _get_json(base + "/info")
                facts["tokenizer"] = info.get("tokenizer_path")
            except Exception:
                pass
            return facts
        info = await _get_json(base + "/info")
        return {"model": info.get("model_id"), "tokenizer": info.get("tokenizer_path"),
                "max_total_tokens": info.get("max_total_tokens")}
    except Exception as e:   # reported, and every request will then fail with its own reason
        return {"error": f"cannot query {base}: {type(e).__name__}: {e}"}


async def benchmark(url: str, backend: str, model: Optional[str], samples: list, offsets: list, *,
                    max_concurrency: Optional[int] = None, ignore_eos: bool = True, progress: bool = False,
                    request_timeout: float = 1800.0) -> tuple:
    """Send every sample at its offset (bounded by max_concurrency); returns (results, duration_s)."""
    bar = None
    if progress:
        try:
            from tqdm import tqdm
            bar = tqdm(total=len(samples), unit="req", file=sys.stderr, dynamic_ncols=True)
        except ImportError:
            bar = None
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    # a connection per request, as vLLM's benchmark client opens one: reusing kept-alive connections failed a
    # quarter of llama-server's requests at 64 streams (it closes them after a few requests: "Can not write
    # request body"), and a loopback connect costs well under a millisecond
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=request_timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()

        async def one(sample: Sample, offset: float) -> RequestResult:
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if limit is None:
                res = await send(session, backend, url, model, sample, ignore_eos=ignore_eos, t0=t0)
            else:
                async with limit:
                    res = await send(session, backend, url, model, sample, ignore_eos=ignore_eos, t0=t0)
            if bar is not None:
                bar.update(1)
            return res

        results = await asyncio.gather(*[one(s, o) for s, o in zip(samples, offsets)])
        ends = [r.send_time + r.latency for r in results if r.latency is not None]
        duration = max(ends) if ends else time.perf_counter() - t0
    if bar is not None:
        bar.close()
    return list(results), duration


def _samples(args, counter: TokenCounter, n: int) -> list:
    cap = args.max_new_tokens or None
    if args.dataset == "alpaca":
        return load_alpaca(args.dataset_path, n, counter, cap)
    if args.dataset == "sharegpt":
        return load_sharegpt(args.dataset_path, n, counter, cap)
    return synthetic(n, args.input_len, args.output_len, args.range_ratio, counter, seed=args.seed)


def _write(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, path)


def run(args) -> tuple:
    """Run the benchmark `args` describes; returns (result dict, exit status). Writes the result file."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path(args.result_file or f"bench_results/serving-{args.backend}-{stamp}.json")
    result = {"backend": args.backend, "url": args.url, "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "dataset": {"kind": args.dataset, "path": args.dataset_path},
              "arrival": {"request_rate": args.request_rate, "process": args.arrival, "burstiness": args.burstiness,
                          "max_concurrency": args.max_concurrency}, "ignore_eos": args.ignore_eos}
    try:
        percentiles = [float(x) for x in str(args.percentiles).split(",") if x.strip()]
        if any(not 0 < q < 100 for q in percentiles):
            raise ValueError("--percentiles must be in (0, 100)")
        slos = parse_slos(args.goodput)
        n = args.num_prompts
        if args.duration is not None:
            if math.isinf(args.request_rate) or args.duration <= 0:
                raise ValueError("--duration needs a finite --request-rate and a positive number of seconds")
            n = int(round(args.request_rate * args.duration))
        if n < 1:
            raise ValueError(f"nothing to send: {n} requests")
        if args.max_concurrency is not None and args.max_concurrency < 1:
            raise ValueError("--max-concurrency must be >= 1")
        facts = asyncio.run(server_facts(args.backend, args.url))
        if "error" in facts:
            print(f"warning: {facts['error']}", file=sys.stderr)
        tokenizer = args.tokenizer or (facts.get("tokenizer") if facts.get("tokenizer")
                                       and os.path.isfile(facts["tokenizer"]) else None)
        counter = TokenCounter(tokenizer)
        if not counter.exact:
            print("warning: no tokenizer (--tokenizer); token counts of the dataset are word-count estimates",
                  file=sys.stderr)
        samples = _samples(args, counter, n)
        skipped = 0
        room = facts.get("max_total_tokens")
        if room:   # fit outputs into the model's context, as the server would (BOS + prompt + output)
            fitted = []
            for s in samples:
                s.max_new_tokens = min(s.max_new_tokens, room - 1 - s.prompt_len)
                if s.max_new_tokens >= 1:
                    fitted.append(s)
            skipped, samples = len(samples) - len(fitted), fitted
        if not samples:
            raise WorkloadError("every prompt is longer than the server's context")
        offsets = arrival_offsets(len(samples), args.request_rate, args.arrival, args.burstiness, args.seed)
    except (WorkloadError, ValueError) as e:
        result.update(error=str(e), completed=0, failed=0)
        _write(path, result)
        print(f"error: {e}", file=sys.stderr)
        return result, 2

    model = args.model or facts.get("model") or "unknown"
    result.update(model=model, tokenizer=tokenizer, token_counts="exact" if counter.exact else "words (estimate)",
                  num_requests=len(samples), skipped_too_long=skipped)
    before = _server_stats(args.url) if args.profile else None
    results, duration = asyncio.run(benchmark(args.url, args.backend, model, samples, offsets,
                                              max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos,
                                              progress=args.progress, request_timeout=args.request_timeout))
    summary = summarize(results, duration, percentiles, slos)
    result["summary"] = summary
    if args.profile:
        result["step_profile"] = step_profile(before, _server_stats(args.url) if before is not None else None)
    result["timeline"] = timeline(results, duration)
    result["requests"] = [r.to_dict() for r in results]
    if args.plots:
        result["plots"] = write_plots(results, duration, path.with_suffix(""))
    _write(path, result)
    print(format_table(summary))
    if args.profile:
        print(format_profile(result["step_profile"]))
    if facts.get("error") and summary["completed"] == 0:
        print(f"every request failed; {facts['error']}")
    print(f"wrote {path}" + "".join(f", {p}" for p in result.get("plots", [])))
    return result, (0 if summary["failed"] == 0 else 1)


def _server_stats(url: str) -> Optional[dict]:
    try:
        status, body = http("GET", url.rstrip("/") + "/stats", timeout=10)
    except OSError:
        return None
    return body if status == 200 and isinstance(body, dict) and "step_profile_total_s" in body else None


PROFILE_PHASES = [("schedule", "scheduler"), ("shm_write", "shm write (master)"),
                  ("round_trip", "frames + master loop latency"), ("agent_other", "agent queue + shm in/out"),
                  ("model", "model (ModelRunner.execute)"),
                  ("output", "output read, requests, events"), ("detokenize", "  of which detokenize"),
                  ("stream", "HTTP SSE writes (overlaps the model)"), ("loop", "step loop wall time")]


def step_profile(before: Optional[dict], after: Optional[dict]) -> dict:
    """Mean ms per step of each phase over the run, from two /stats snapshots of an llm-serving server."""
    if before is None or after is None:
        return {"error": "the server does not report a step profile (not llm-serving, or unreachable)"}
    steps = after["num_steps"] - before["num_steps"]
    t0, t1 = before["step_profile_total_s"], after["step_profile_total_s"]
    per_step = {k: (t1.get(k, 0.0) - t0.get(k, 0.0)) * 1e3 / max(steps, 1) for k, _ in PROFILE_PHASES}
    return {"steps": steps, "ms_per_step": per_step}


def format_profile(profile: dict) -> str:
    if "error" in profile:
        return f"step profile: {profile['error']}"
    ms = profile["ms_per_step"]
    loop = ms.get("loop") or 1e-9
    lines = [f"{' Step profile (' + str(profile['steps']) + ' steps, mean ms per step) ':=^60}"]
    for key, label in PROFILE_PHASES:
        share = "" if key in ("loop", "stream", "detokenize") else f"{ms[key] / loop:>7.1%}"
        lines.append(f"{label:<42}{ms[key]:>9.3f}{share}")
    other = loop - sum(ms[k] for k in ("schedule", "shm_write", "round_trip", "agent_other", "model", "output"))
    lines.append(f"{'other (HTTP handlers between steps)':<42}{other:>9.3f}{other / loop:>7.1%}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="llm-serving bench", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))[1]


if __name__ == "__main__":
    sys.exit(main())
