#!/usr/bin/env python
"""The Qwen-VL towers (and Mistral 3's) served (issue 67): this server against llama.cpp's `llama-server --mmproj` on
the same files, a real-shaped vision tower with random weights as llama.cpp's mmproj GGUF (F16 matrices, as its
converter writes them with --outtype f16), beside a tiny text model of its family (tests/families.py's tiny models,
their GGUF twins: 2 or 3 layers of 64, so that an image question's time is the tower's):
- `--family qwen2.5` (the default): Qwen2.5-VL-3B's tower (32 blocks of 1,280, windows of 112 pixels, full attention
  in every 8th block, the merger; qwen2.5vl_merger), a `qwen2vl` text model; a 1,024 x 768 photo is 999 tokens
  (3,996 patches of 14 pixels);
- `--family qwen2`: Qwen2-VL-2B's and -7B's tower (32 blocks of 1,280, full attention in every block, LayerNorms,
  a quick-GELU MLP of 5,120; qwen2vl_merger), a `qwen2vl` text model; the photo is 999 tokens (3,996 patches);
- `--family qwen3`: Qwen3-VL-4B's and -8B's tower (24 blocks of 1,024, full attention, learned position rows,
  DeepStack mergers after blocks 5, 11 and 17; qwen3vl_merger), a `qwen3vl` text model; the photo is 768 tokens
  (3,072 patches of 16 pixels);
- `--family mistral3`: Mistral Small 3.1's Pixtral tower (24 blocks of 1,024, full attention, 2-D rotary positions,
  SwiGLU; the projector's RMS norm, patch merger and two products; pixtral), a `llama` text model (a tiny
  Mistral3ForConditionalGeneration's); the photo 896 x 672 (llama.cpp takes at most 1,024 tokens of this tower, and
  both servers leave this size as it is): 768 tokens and 24 row breaks (3,072 patches of 14 pixels);
- `--family pixtral`: Pixtral 12B's tower (the same blocks in 16-pixel patches, each patch a token; LLaVA's
  projector, two products with biases; pixtral without a patch merger), a `llama` text model (a tiny Pixtral 12B's);
  the photo 512 x 384 (llama.cpp takes at most 1,024 tokens of this tower): 768 tokens and 24 row breaks;
- `--family llava`: LLaVA 1.5's CLIP ViT-L/14-336 tower (24 layers of 1,024 of which LLaVA reads 23, a class token,
  quick GELU; LLaVA's projector; mlp, as llama.cpp's LLaVA converter writes it), a `llama` text model (a tiny LLaVA
  1.5's); any photo is 576 tokens (padded to a square, 336 pixels a side).
Measured, for each server in turn: the time to the first token of one image question (the photo, as both servers'
bounds leave it), for --rounds new pictures of that size; this server with its defaults and with `--set` settings
(--variant, repeatable).

    python bench/vision_qwen.py
    python bench/vision_qwen.py --family qwen2
    python bench/vision_qwen.py --family qwen3
    python bench/vision_qwen.py --rounds 3 --variant model_config.vision_int16=off

The files are made once under the peers directory's models/ (transformers makes the tiny text model: a bench's
cross-check, never the product). Writes JSON (default bench_results/vision_qwen.json).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import log_dir, machine, with_llama_server, write_json  # noqa: E402
from bench.make_models import peers_dir  # noqa: E402
from bench.peers import find_llama_server, start_ours  # noqa: E402
from bench.vision_serving import finish_gguf, image, mmproj_writer, random_weights  # noqa: E402

# Qwen2.5-VL-3B's and Qwen3-VL-4B's vision towers (their config.json's vision_config); the merger's output is the
# tiny text model's width
TOWERS = {"qwen2.5": dict(hidden=1280, intermediate=3420, layers=32, heads=16, patch=14, window=112, every=8,
                          text_hidden=64),
          "qwen2": dict(hidden=1280, intermediate=5120, layers=32, heads=16, patch=14, text_hidden=64),
          "qwen3": dict(hidden=1024, intermediate=4096, layers=24, heads=16, patch=16, positions=2304,
                        deepstack=(5, 11, 17), text_hidden=64),
          "mistral3": dict(hidden=1024, intermediate=4096, layers=24, heads=16, patch=14, image=1540, text_hidden=64,
                           picture=(896, 672)),
          "pixtral": dict(hidden=1024, intermediate=4096, layers=24, heads=16, patch=16, image=1024, text_hidden=64,
                          picture=(512, 384)),
          "llava": dict(hidden=1024, intermediate=4096, layers=23, heads=16, patch=14, image=336, text_hidden=64)}
QUESTION = "Describe this picture in detail."
NAME = "qwen25vl-bench"


def text_model(out: Path, family: str = "qwen2.5") -> Path:
    """The tiny Qwen2.5-VL's (or Qwen3-VL's) text model as a `qwen2vl` (`qwen3vl`) GGUF (F32) with its tokenizer and
    template, its context 4,096 tokens (made once)."""
    if out.is_file():
        return out
    from tests.families import (make_llava, make_mistral3, make_pixtral, make_qwen2_vl, make_qwen3_vl, make_qwen25_vl,
                                write_gguf)

    with tempfile.TemporaryDirectory() as tmp:
        if family == "mistral3":
            make_mistral3(Path(tmp), seed=0)
        elif family == "pixtral":
            make_pixtral(Path(tmp), seed=0)
        elif family == "llava":
            make_llava(Path(tmp), seed=0)
        elif family == "qwen2":
            make_qwen2_vl(Path(tmp), seed=0)
        elif family == "qwen3":           # (the real tower's three DeepStack layers; four text layers: llama.cpp
            make_qwen3_vl(Path(tmp), seed=0, text_layers=4, deepstack=(1, 2, 3))    # needs more than DeepStack's)
        else:
            make_qwen25_vl(Path(tmp), seed=0)
        config = json.loads((Path(tmp) / "config.json").read_text())
        config["text_config"]["max_position_embeddings"] = 4096       # (llama-server caps a slot at it)
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        write_gguf(None, Path(tmp), Path(str(out) + ".part"))
    Path(str(out) + ".part").rename(out)
    return out


def mmproj(out: Path, seed: int = 0, family: str = "qwen2.5") -> Path:
    """A random Qwen2.5-VL-3B (or, `family` "qwen2", Qwen2-VL-2B) tower and merger as llama.cpp's mmproj GGUF (the
    converter's names and keys: q, k, v apart, the patch kernel as two 2-D kernels; F16 matrices, F32 norms and
    biases), made once. Qwen2.5-VL's: qwen2.5vl_merger, RMS norms, a SwiGLU MLP (use_silu), windows (n_wa_pattern);
    Qwen2-VL's: qwen2vl_merger, LayerNorms with biases, fc1 and fc2 (neither use_gelu nor use_silu: quick GELU), its
    feed_forward_length the text model's width, as the converter writes it."""
    if out.is_file():
        return out
    qwen2 = family == "qwen2"
    t = TOWERS[family]
    d, m, p, c = t["hidden"], t["intermediate"], t["patch"], 4 * t["hidden"]
    keys = {"projection_dim": t["text_hidden"], "image_size": 560, "patch_size": p, "embedding_length": d,
            "feed_forward_length": t["text_hidden"] if qwen2 else m, "block_count": t["layers"],
            "attention.head_count": t["heads"], **({} if qwen2 else {"n_wa_pattern": t["every"]})}
    writer = mmproj_writer(out, "qwen2vl_merger" if qwen2 else "qwen2.5vl_merger", keys,
                           ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)))
    if not qwen2:
        writer.add_bool("clip.use_silu", True)
    matrix, vector = random_weights(seed)
    for k in ("", ".1"):
        writer.add_tensor("v.patch_embd.weight" + k, matrix((d, 3, p, p), 6 * p * p))
    for i in range(t["layers"]):
        at = f"v.blk.{i}."
        for norm in ("ln1", "ln2"):
            writer.add_tensor(at + norm + ".weight", vector(d, 1.0))
            if qwen2:
                writer.add_tensor(at + norm + ".bias", vector(d))
        for proj in ("attn_q", "attn_k", "attn_v", "attn_out"):
            writer.add_tensor(at + proj + ".weight", matrix((d, d), d))
            writer.add_tensor(at + proj + ".bias", vector(d))
        for proj in ("ffn_up",) if qwen2 else ("ffn_gate", "ffn_up"):
            writer.add_tensor(at + proj + ".weight", matrix((m, d), d))
            writer.add_tensor(at + proj + ".bias", vector(m))
        writer.add_tensor(at + "ffn_down.weight", matrix((d, m), m))
        writer.add_tensor(at + "ffn_down.bias", vector(d))
    writer.add_tensor("v.post_ln.weight", vector(d, 1.0))
    if qwen2:
        writer.add_tensor("v.post_ln.bias", vector(d))
    writer.add_tensor("mm.0.weight", matrix((c, c), c))
    writer.add_tensor("mm.0.bias", vector(c))
    writer.add_tensor("mm.2.weight", matrix((t["text_hidden"], c), c))
    writer.add_tensor("mm.2.bias", vector(t["text_hidden"]))
    return finish_gguf(writer, out)


def mmproj_qwen3(out: Path, seed: int = 0) -> Path:
    """A random Qwen3-VL-4B tower, merger and DeepStack mergers as llama.cpp's qwen3vl_merger mmproj GGUF (the
    converter's names and keys: q|k|v one matrix, the patch kernel as two 2-D kernels and a bias, the position rows,
    `v.deepstack.L.*` by layer; F16 matrices, F32 norms, biases and position rows), made once."""
    if out.is_file():
        return out
    t = TOWERS["qwen3"]
    d, m, p, c = t["hidden"], t["intermediate"], t["patch"], 4 * t["hidden"]
    writer = mmproj_writer(out, "qwen3vl_merger", {
        "projection_dim": t["text_hidden"], "image_size": int(round(t["positions"] ** 0.5)) * p, "patch_size": p,
        "embedding_length": d, "feed_forward_length": m, "block_count": t["layers"],
        "attention.head_count": t["heads"], "spatial_merge_size": 2}, ((0.5,) * 3, (0.5,) * 3))
    writer.add_bool("clip.use_gelu", True)
    writer.add_array("clip.vision.is_deepstack_layers", [i in t["deepstack"] for i in range(t["layers"])])
    matrix, vector = random_weights(seed)
    for k in ("", ".1"):
        writer.add_tensor("v.patch_embd.weight" + k, matrix((d, 3, p, p), 6 * p * p))
    writer.add_tensor("v.patch_embd.bias", vector(d))
    writer.add_tensor("v.position_embd.weight", np.stack([vector(d) for _ in range(t["positions"])]))
    for i in range(t["layers"]):
        at = f"v.blk.{i}."
        for norm in ("ln1", "ln2"):
            writer.add_tensor(at + norm + ".weight", vector(d, 1.0))
            writer.add_tensor(at + norm + ".bias", vector(d))
        for proj, rows, cols in (("attn_qkv", 3 * d, d), ("attn_out", d, d), ("ffn_up", m, d), ("ffn_down", d, m)):
            writer.add_tensor(at + proj + ".weight", matrix((rows, cols), cols))
            writer.add_tensor(at + proj + ".bias", vector(rows))
    for at, width in [("v.post_ln", d), *((f"v.deepstack.{i}.norm", c) for i in t["deepstack"])]:
        writer.add_tensor(at + ".weight", vector(width, 1.0))
        writer.add_tensor(at + ".bias", vector(width))
    for first, second in [("mm.0", "mm.2"), *((f"v.deepstack.{i}.fc1", f"v.deepstack.{i}.fc2")
                                              for i in t["deepstack"])]:
        writer.add_tensor(first + ".weight", matrix((c, c), c))
        writer.add_tensor(first + ".bias", vector(c))
        writer.add_tensor(second + ".weight", matrix((t["text_hidden"], c), c))
        writer.add_tensor(second + ".bias", vector(t["text_hidden"]))
    return finish_gguf(writer, out)


def mmproj_mistral3(out: Path, seed: int = 0, family: str = "mistral3") -> Path:
    """A random Mistral Small 3.1 tower and projector as llama.cpp's pixtral mmproj GGUF (the converter's names and
    keys; F16 matrices, F32 norms; `v.token_embd.img_break`, the row break's embedding llama.cpp reads), made once;
    (`family` "pixtral") Pixtral 12B's: no merge size, norm or patch merger, the two products with biases."""
    if out.is_file():
        return out
    t, llava = TOWERS[family], family == "pixtral"
    d, m, p, out_hidden = t["hidden"], t["intermediate"], t["patch"], t["text_hidden"]
    writer = mmproj_writer(out, "pixtral", {
        "projection_dim": out_hidden, "image_size": t["image"], "patch_size": p, "embedding_length": d,
        "feed_forward_length": m, "block_count": t["layers"], "attention.head_count": t["heads"],
        **({} if llava else {"spatial_merge_size": 2})},
        ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)))
    writer.add_bool("clip.use_silu", True)
    matrix, vector = random_weights(seed)
    writer.add_tensor("v.patch_embd.weight", matrix((d, 3, p, p), 3 * p * p))
    writer.add_tensor("v.pre_ln.weight", vector(d, 1.0))
    for i in range(t["layers"]):
        at = f"v.blk.{i}."
        for norm in ("ln1", "ln2"):
            writer.add_tensor(at + norm + ".weight", vector(d, 1.0))
        for proj, rows, cols in (("attn_q", d, d), ("attn_k", d, d), ("attn_v", d, d), ("attn_out", d, d),
                                 ("ffn_gate", m, d), ("ffn_up", m, d), ("ffn_down", d, m)):
            writer.add_tensor(at + proj + ".weight", matrix((rows, cols), cols))
    if not llava:
        writer.add_tensor("mm.input_norm.weight", vector(d, 1.0))
        writer.add_tensor("mm.patch_merger.weight", matrix((d, 4 * d), 4 * d))
    writer.add_tensor("mm.1.weight", matrix((out_hidden, d), d))
    writer.add_tensor("mm.2.weight", matrix((out_hidden, out_hidden), out_hidden))
    if llava:
        writer.add_tensor("mm.1.bias", vector(out_hidden))
        writer.add_tensor("mm.2.bias", vector(out_hidden))
    writer.add_tensor("v.token_embd.img_break", vector(out_hidden))
    return finish_gguf(writer, out)


def mmproj_llava(out: Path, seed: int = 0) -> Path:
    """A random LLaVA 1.5 CLIP tower (the layers LLaVA reads) and projector as llama.cpp's mlp mmproj GGUF (its
    LLaVA converter's names and keys: fc1 as ffn_down, fc2 as ffn_up; F16 matrices, F32 vectors), made once."""
    if out.is_file():
        return out
    t = TOWERS["llava"]
    d, m, p, out_hidden, side = t["hidden"], t["intermediate"], t["patch"], t["text_hidden"], t["image"] // t["patch"]
    writer = mmproj_writer(out, "mlp", {
        "projection_dim": 768, "image_size": t["image"], "patch_size": p, "embedding_length": d,
        "feed_forward_length": m, "block_count": t["layers"], "attention.head_count": t["heads"]},
        ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)))
    writer.add_bool("clip.has_llava_projector", True)
    writer.add_bool("clip.use_gelu", False)
    matrix, vector = random_weights(seed)
    writer.add_tensor("v.class_embd", vector(d))
    writer.add_tensor("v.patch_embd.weight", matrix((d, 3, p, p), 3 * p * p))
    writer.add_tensor("v.position_embd.weight", matrix((side * side + 1, d), d))
    writer.add_tensor("v.pre_ln.weight", vector(d, 1.0))
    writer.add_tensor("v.pre_ln.bias", vector(d))
    for i in range(t["layers"]):
        at = f"v.blk.{i}."
        for norm in ("ln1", "ln2"):
            writer.add_tensor(at + norm + ".weight", vector(d, 1.0))
            writer.add_tensor(at + norm + ".bias", vector(d))
        for proj, rows, cols in (("attn_q", d, d), ("attn_k", d, d), ("attn_v", d, d), ("attn_out", d, d),
                                 ("ffn_down", m, d), ("ffn_up", d, m)):
            writer.add_tensor(at + proj + ".weight", matrix((rows, cols), cols))
            writer.add_tensor(at + proj + ".bias", vector(rows))
    writer.add_tensor("mm.0.weight", matrix((out_hidden, d), d))
    writer.add_tensor("mm.0.bias", vector(out_hidden))
    writer.add_tensor("mm.2.weight", matrix((out_hidden, out_hidden), out_hidden))
    writer.add_tensor("mm.2.bias", vector(out_hidden))
    return finish_gguf(writer, out)


def ask(url: str, picture: str) -> dict:
    """One image question, 2 tokens: seconds to the reply (its first token is the second's step), its prompt's
    tokens."""
    import urllib.request

    body = {"model": NAME, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": picture}},
                                                      {"type": "text", "text": QUESTION}]}]}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=3600) as r:
        reply = json.loads(r.read())
    return {"seconds": time.perf_counter() - t0, "prompt_tokens": (reply.get("usage") or {}).get("prompt_tokens")}


def rounds(url: str, count: int, size: tuple = (1024, 768)) -> list:
    return [ask(url, image(500 + k, size)) for k in range(count)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=tuple(TOWERS), default="qwen2.5")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variant", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="this server again with this setting (repeatable: one run each)")
    ap.add_argument("--only", choices=("ours", "llama"), default=None)
    ap.add_argument("--out", default=None, help="default bench_results/vision_qwen.json (vision_qwen2.json, "
                                                "vision_qwen3.json, vision_mistral3.json, vision_pixtral.json, "
                                                "vision_llava.json)")
    args = ap.parse_args(argv)

    models = peers_dir() / "models"
    models.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if args.family == "mistral3":
        text = text_model(models / "bench-mistral3-tiny-text.gguf", "mistral3")
        proj = mmproj_mistral3(models / "bench-mistral-small-3.1-mmproj-f16.gguf")
    elif args.family == "llava":
        text = text_model(models / "bench-llava-tiny-text.gguf", "llava")
        proj = mmproj_llava(models / "bench-llava-1.5-mmproj-f16.gguf")
    elif args.family == "pixtral":
        text = text_model(models / "bench-pixtral-tiny-text.gguf", "pixtral")
        proj = mmproj_mistral3(models / "bench-pixtral-12b-mmproj-f16.gguf", family="pixtral")
    elif args.family == "qwen2":
        text = text_model(models / "bench-qwen2vl-tiny-text.gguf", "qwen2")
        proj = mmproj(models / "bench-qwen2vl-2b-mmproj-f16.gguf", family="qwen2")
    elif args.family == "qwen3":
        text = text_model(models / "bench-qwen3vl-tiny-text.gguf", "qwen3")
        proj = mmproj_qwen3(models / "bench-qwen3vl-4b-mmproj-f16.gguf")
    else:
        text = text_model(models / "bench-qwen25vl-tiny-text.gguf")
        proj = mmproj(models / "bench-qwen25vl-3b-mmproj-f16.gguf")
    print(f"files ready in {time.perf_counter() - t0:.0f} s: {text.name}, {proj.name}", flush=True)
    result = {"machine": machine(), "family": args.family, "tower": TOWERS[args.family], "rounds": args.rounds}
    base = ["--model", str(text), "--set", f"model_config.mmproj={proj}", "--set", f"model_config.model_name={NAME}",
            "--set", "model_config.max_generate_length=2048", "--set", "model_config.seq_length=[32,128,512,1024]",
            "--set", "serving_config.max_num_batched_tokens=1024"]
    size = TOWERS[args.family].get("picture", (1024, 768))
    if args.family in ("mistral3", "pixtral"):  # (a square image of the longest edge must fit one call, else the
        # processor's longest edge is lowered until one does: 33 x 34 tokens for Mistral 3, 44 x 45 for Pixtral 12B)
        base += ["--set", "model_config.seq_length=[32,128,512,1024,2048]",
                 "--set", "serving_config.max_num_batched_tokens=2048"]
    if args.only != "llama":
        for variant in [None, *args.variant]:
            extra = [] if variant is None else ["--set", variant]
            srv, started = start_ours(base + extra, log_dir() / "vision_qwen_ours.log")
            try:
                runs = rounds(srv.url, args.rounds, size)
            finally:
                srv.stop()
            result.setdefault("ours", {})[variant or "defaults"] = {"start_s": started, "runs": runs}
            print(f"ours ({variant or 'defaults'}):", json.dumps(runs), flush=True)
    binary, version = find_llama_server(None) if args.only != "ours" else (None, "not asked for")
    if binary is not None:
        cmd = [binary, "-m", str(text), "--mmproj", str(proj), "--alias", NAME, "--host", "127.0.0.1",
               "-t", str(args.threads), "-c", "4096", "--jinja"]
        runs, _ = with_llama_server(cmd, log_dir() / "vision_qwen_llama.log",
                                    lambda peer: rounds(peer.url, args.rounds, size))
        result["llama"] = {"runs": runs, "version": version}
        print("llama-server:", json.dumps(runs), flush=True)
    if "ours" in result and "llama" in result:
        best = lambda runs: min(r["seconds"] for r in runs[1:] or runs)          # noqa: E731 (the first compiles)
        theirs = best(result["llama"]["runs"])
        result["ratios"] = {k: best(v["runs"]) / theirs for k, v in result["ours"].items()}
        print("image question, ours / llama-server (best after the first):", json.dumps(result["ratios"]))
    names = {"qwen2.5": "vision_qwen", "qwen2": "vision_qwen2", "qwen3": "vision_qwen3", "mistral3": "vision_mistral3",
             "pixtral": "vision_pixtral", "llava": "vision_llava"}
    write_json(args.out or f"bench_results/{names[args.family]}.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
