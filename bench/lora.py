#!/usr/bin/env python
"""Multi-LoRA serving (issue 24): output tokens/s at several concurrencies with the base model only, with every
request on one adapter, and with the requests spread over eight adapters, in one run on one machine; the ratios
to the base model and the memory each loaded adapter takes.

    python bench/lora.py                                   # the bench model (peers.py's), 16 and 64 streams
    python bench/lora.py --model DIR --rank 16 --streams 16,64 --adapters 1,8

The adapters are random PEFT adapters of every projection (rank --rank, written under --work), served from
`lora_config.adapters`; the same synthetic workload as bench/peers.py (32-token prompts, 128 greedy tokens with
ignore_eos, streaming OpenAI completions), the `model` field of each request naming its adapter (round robin).
Writes JSON (default bench_results/lora.json).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import info, log_dir, machine, synthetic_samples, table, write_json  # noqa: E402
from bench.peers import bench_model, measure  # noqa: E402
from llm_serving.server_process import ServerProcess  # noqa: E402
from llm_serving.models.lora import TARGET_MODULES, random_lora_tensors, write_peft_adapter  # noqa: E402
from llm_serving.models.weights import checkpoint_config  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="HF directory or GGUF file (default: the bench model of bench/peers.py)")
    p.add_argument("--streams", default="16,64", help="concurrencies, comma separated")
    p.add_argument("--adapters", default="1,8", help="adapter counts to serve besides the base model")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2, help="requests per concurrency = rounds * streams")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--set", action="append", default=[], help="config overrides for every server")
    p.add_argument("--work", help="directory for the adapters (default: a temporary one)")
    p.add_argument("--out", default="bench_results/lora.json")
    args = p.parse_args(argv)

    model = args.model or bench_model()
    cfg = checkpoint_config(model)
    streams = [int(s) for s in args.streams.split(",")]
    counts = [int(c) for c in args.adapters.split(",")]
    work = Path(args.work or tempfile.mkdtemp(prefix="lora-bench-"))
    paths = {f"lora{i}": write_peft_adapter(work / f"lora{i}", random_lora_tensors(cfg, args.rank, tuple(TARGET_MODULES),
                                                                                     seed=i), r=args.rank,
                                            lora_alpha=args.rank)
             for i in range(max(counts))}
    per_adapter_mb = (Path(paths["lora0"]) / "adapter_model.safetensors").stat().st_size / 1e6

    setups = [("base", 0)] + [(f"{c} adapter{'s' if c > 1 else ''}", c) for c in counts]
    runs, facts = {}, None
    for label, count in setups:
        served = {name: paths[name] for name in list(paths)[:max(count, 0)]}
        sets = list(args.set) + [f"lora_config.max_loras={max(count, 1)}",
                                 f"lora_config.max_lora_rank={args.rank}"]
        if served:
            sets.append(f"lora_config.adapters={json.dumps(served)}")
        cli = ["--model", model] + sum((["--set", s] for s in sets), [])
        with ServerProcess(cli, log_dir() / f"lora_{count}.log") as srv:
            facts = info(srv)
            base = facts["model_id"]
            names = list(served) or [base]
            samples = {}
            for s in streams:
                batch = synthetic_samples(max(args.rounds * s, 4), facts["tokenizer_path"], args.input_len,
                                          args.output_len)
                for i, sample in enumerate(batch):
                    sample.model = names[i % len(names)]
                samples[s] = batch
            runs[label] = measure(srv.url, None, samples)     # (each sample names its adapter)
            print(f"{label}: " + ", ".join(f"{s} streams {runs[label][s]['output_throughput']:.1f} tok/s"
                                           for s in streams), flush=True)

    rows = []
    for s in streams:
        row = {"streams": s}
        for label, _ in setups:
            row[label] = runs[label][s]["output_throughput"]
            row[f"{label} failed"] = runs[label][s]["failed"]
            if label != "base":
                row[f"{label} / base"] = row[label] / row["base"]
        rows.append(row)
    cols = [("streams", "streams", "{}")] + [(label, f"{label} tok/s", "{:.1f}") for label, _ in setups]
    cols += [(f"{label} / base", f"{label} / base", "{:.2f}") for label, _ in setups[1:]]
    print(f"\nmulti-LoRA: {Path(model).name}, adapters of rank {args.rank} on every projection "
          f"({per_adapter_mb:.1f} MB each as float32), {args.input_len} -> {args.output_len} tokens")
    print(table(rows, cols))
    failed = sum(r[f"{label} failed"] for r in rows for label, _ in setups)
    write_json(args.out, {"scenario": "lora", "machine": machine(), "model": model, "rank": args.rank,
                          "adapter_mb": per_adapter_mb, "sets": args.set, "rows": rows,
                          "runs": {k: {str(s): r for s, r in v.items()} for k, v in runs.items()}})
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
