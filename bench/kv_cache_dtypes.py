#!/usr/bin/env python
"""The KV cache's element type (`pa_config.kv_cache_dtype`): precision, memory and speed of each, one server
after the other in one run, on one model.

    python bench/kv_cache_dtypes.py                                  # SmolLM2-135M-Instruct Q4_1
    python bench/kv_cache_dtypes.py --model 1b-q4km --dtypes float16,int8

For each type: the precision gate (`llm-serving precision`: --prompts alpaca prompts, greedy, every captured step
against the float64 reference, which keeps K/V exact; max and mean relative error of the logits, greedy
agreement), the cache's bytes per token, and the TTFT and TPOT of one --context-token random prompt with
--output-len tokens out (bench/long_context.py's measurement), where the decode row reads the whole context each
step. Writes JSON (default bench_results/kv_cache_dtypes.json) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import ALPACA, http, log_dir, machine, table, write_json  # noqa: E402
from bench.long_context import default_model, long_prompts  # noqa: E402
from bench.make_models import resolve_short_name  # noqa: E402
from llm_serving.config import kv_vector_bytes  # noqa: E402
from llm_serving.server_process import ServerProcess  # noqa: E402
from llm_serving.models.weights import model_shape  # noqa: E402


def precision(url: str, prompts: int, new_tokens: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "precision.json"
        proc = subprocess.run([sys.executable, "-m", "llm_serving.cli", "precision", "--url", url, "-n", str(prompts),
                               "--max-new-tokens", str(new_tokens), "--rate", "8", "--prompts", str(ALPACA),
                               "--out", str(out)], capture_output=True, text=True, timeout=3600)
        if not out.is_file():
            raise RuntimeError(f"precision gate failed to run: {proc.stdout[-2000:]} {proc.stderr[-2000:]}")
        return json.loads(out.read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a GGUF path or a bench/make_models.py short name (default: SmolLM2 Q4_1)")
    p.add_argument("--dtypes", default="float32,float16,bfloat16,int8")
    p.add_argument("--prompts", type=int, default=16, help="precision gate prompts")
    p.add_argument("--new-tokens", type=int, default=16, help="precision gate tokens per prompt")
    p.add_argument("--context", type=int, default=4096, help="prompt tokens of the TTFT / TPOT probe")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--set", action="append", default=[], help="section.key=value for every server")
    p.add_argument("--out", default="bench_results/kv_cache_dtypes.json")
    args = p.parse_args(argv)
    model = str(resolve_short_name(args.model)) if args.model else default_model()
    shape = model_shape(model)
    results = {"machine": machine(), "model": model, "args": vars(args), "dtypes": {}}
    rows = []
    for dtype in [d for d in args.dtypes.split(",") if d]:
        sets = ["--set", f"pa_config.kv_cache_dtype={dtype}"]
        for s in args.set:
            sets += ["--set", s]
        srv = ServerProcess(["--model", model, *sets], log_dir() / f"kv_cache_dtypes_{dtype}.log")
        try:
            srv.wait_ready(timeout_s=3600)
            info = http("GET", srv.url + "/info")[1]
            print(f"{dtype}:", flush=True)
            speed = long_prompts(srv.url, info["model_id"], [args.context], args.output_len, 1, info["vocab_size"],
                                 False)[args.context]
            gate = precision(srv.url, args.prompts, args.new_tokens)
        finally:
            srv.stop()
        token_bytes = 2 * shape.num_layers * shape.num_kv_heads * kv_vector_bytes(dtype, shape.head_dim)
        row = {"dtype": dtype, "token_kib": token_bytes / 1024, "max_rel": gate["max_rel_error"],
               "mean_rel": gate["mean_rel_error"], "greedy": gate["greedy_agreement"], "passed": gate["passed"],
               **speed}
        print(f"  precision max {row['max_rel']:.2e} mean {row['mean_rel']:.2e} greedy {row['greedy']:.3f}",
              flush=True)
        results["dtypes"][dtype] = {"gate": gate, "speed": speed, "token_bytes": token_bytes}
        rows.append(row)
    print(f"\n{Path(model).name}: the cache's element type (precision: the gate against float64 K/V; "
          f"TTFT/TPOT: one {args.context}-token prompt, {args.output_len} tokens out)")
    print(table(rows, [("dtype", "kv_cache_dtype", "{}"), ("token_kib", "KiB/token", "{:.1f}"),
                       ("max_rel", "max rel err", "{:.2e}"), ("mean_rel", "mean rel err", "{:.2e}"),
                       ("greedy", "greedy agree", "{:.3f}"), ("passed", "gate 0.5%", "{}"),
                       ("ttft_ms", "TTFT ms", "{:.0f}"), ("tpot_ms", "TPOT ms", "{:.1f}")]))
    write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
