#!/usr/bin/env python
"""Image questions served (issue 67): this server against llama.cpp's `llama-server --mmproj` on the same files, a
real-shaped Gemma-3-4B: its text body as bench/make_models.py makes it (random weights, Q4_K_M, SmolLM2's vocabulary)
and a random SigLIP-400M tower and projector as llama.cpp's mmproj GGUF (F16 matrices, as its converter writes them
with --outtype f16). Measured, for each server in turn:
  - the time to the first token of one image question alone (an 896-pixel image: 4,096 patches through 27 layers, its
    256 tokens and the question's), the first request after the server is ready;
  - N concurrent image questions, each its own image (--streams), the replies' tokens per second over the wall time;
  - the same image asked again in a new conversation: its time to the first token (this server's encoded-image cache
    and prefix cache; llama-server's slot cache, where it has one).

    python bench/vision_serving.py                          # made files, 1 + 4 questions, 32 tokens each
    python bench/vision_serving.py --streams 16 --tokens 32
    python bench/vision_serving.py --beside 2               # a text stream's waits while 2 image questions come

Both servers run at once for `--paired N` rounds of alone questions sent to each in turn (a new picture each round,
the order swapped each round; the idle server waits on its socket), so that each ratio compares the same minutes of a
VM whose speed drifts; then each server's own measures below, one after the other.

The files (made once, under the peers directory's models/, beside the text model):
  - `bench-llama-gemma3-4b-vl-Q4_K_M.gguf`: the text model with three of SmolLM2's unused special tokens (ids 4-6)
    renamed Gemma 3's `<start_of_image>`, `<end_of_image>`, `<image_soft_token>` and a ChatML template that places
    `<start_of_image>` where a message's image part is (this server needs the tokens in the vocabulary; llama-server
    reads them as control tokens, which its Gemma 3 image chunks use);
  - `bench-gemma3-4b-mmproj-f16.gguf`: the tower, seeded normal weights at the scale a trained tower's have.
Writes JSON (default bench_results/vision_serving.json).
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import log_dir, machine, with_llama_server, write_json  # noqa: E402
from bench.make_models import model_path, peers_dir  # noqa: E402
from bench.peers import find_llama_server, start_ours  # noqa: E402

# Gemma-3-4B's SigLIP-400M tower and projector
TOWER = dict(hidden=1152, intermediate=4304, layers=27, heads=16, image=896, patch=14, text_hidden=2560)
IMAGE_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
TEMPLATE = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n'}}{% if m['content'] is string %}"
            "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
            "{{ '<start_of_image>' }}{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
            "{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\\n'}}"
            "{% endif %}")
QUESTION = "Describe this picture in detail."


def vl_text_model(src: Path, out: Path) -> Path:
    """`src` with tokens 4-6 renamed Gemma 3's image tokens and TEMPLATE as its chat template (made once)."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

    if out.is_file():
        return out
    reader = gguf.GGUFReader(str(src))
    field = reader.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(field.parts[i]).decode() for i in field.data]
    tokens[4:7] = IMAGE_TOKENS
    arch = reader.fields["general.architecture"]
    writer = gguf.GGUFWriter(str(out) + ".part", bytes(arch.parts[arch.data[0]]).decode(),
                             endianess=reader.endianess)
    copy_with_new_metadata(reader, writer, {
        "tokenizer.ggml.tokens": MetadataDetails(gguf.GGUFValueType.ARRAY, tokens, sub_type=gguf.GGUFValueType.STRING),
        gguf.Keys.Tokenizer.CHAT_TEMPLATE: MetadataDetails(gguf.GGUFValueType.STRING, TEMPLATE)}, [])
    Path(str(out) + ".part").rename(out)
    return out


def mmproj_writer(out: Path, projector: str, keys: dict, normalize: tuple):
    """A GGUF writer of an mmproj (to `out`.part) with its converter's header: the projector type, `keys`
    (clip.vision.<key>: uint32), the image mean and std."""
    import gguf

    writer = gguf.GGUFWriter(str(out) + ".part", "clip")
    writer.add_string("general.type", "mmproj")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string("clip.projector_type", projector)
    for key, value in keys.items():
        writer.add_uint32(f"clip.vision.{key}", value)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    writer.add_array("clip.vision.image_mean", list(normalize[0]))
    writer.add_array("clip.vision.image_std", list(normalize[1]))
    return writer


def random_weights(seed: int) -> tuple:
    """matrix(shape, fan_in): F16 normal weights at a trained tower's scale; vector(n, base): F32 near `base`."""
    rng = np.random.default_rng(seed)

    def matrix(shape, fan_in):
        return (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(fan_in)).astype(np.float16)

    def vector(n, base=0.0):
        return (base + 0.02 * rng.standard_normal(n)).astype(np.float32)
    return matrix, vector


def finish_gguf(writer, out: Path) -> Path:
    """Write the GGUF and move it to `out` (it is whole or absent)."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    Path(str(out) + ".part").rename(out)
    return out


def mmproj(out: Path, seed: int = 0) -> Path:
    """A random SigLIP-400M tower and Gemma 3 projector as llama.cpp's mmproj GGUF (F16 matrices; the position
    table, norms, biases and the projection's norm gain, stored 1 + w, F32), made once."""
    if out.is_file():
        return out
    t = TOWER
    d, m, p = t["hidden"], t["intermediate"], t["patch"]
    writer = mmproj_writer(out, "gemma3", {
        "projection_dim": t["text_hidden"], "image_size": t["image"], "patch_size": p, "embedding_length": d,
        "feed_forward_length": m, "block_count": t["layers"], "attention.head_count": t["heads"]},
        ((0.5,) * 3, (0.5,) * 3))
    matrix, vector = random_weights(seed)

    grid = t["image"] // p
    writer.add_tensor("v.patch_embd.weight", matrix((d, 3, p, p), 3 * p * p))
    writer.add_tensor("v.patch_embd.bias", vector(d))
    writer.add_tensor("v.position_embd.weight", matrix((grid * grid, d), d).astype(np.float32))   # (added: F32)
    for i in range(t["layers"]):
        at = f"v.blk.{i}."
        for norm in ("ln1", "ln2"):
            writer.add_tensor(at + norm + ".weight", vector(d, 1.0))
            writer.add_tensor(at + norm + ".bias", vector(d))
        for proj in ("attn_q", "attn_k", "attn_v", "attn_out"):
            writer.add_tensor(at + proj + ".weight", matrix((d, d), d))
            writer.add_tensor(at + proj + ".bias", vector(d))
        writer.add_tensor(at + "ffn_up.weight", matrix((m, d), d))
        writer.add_tensor(at + "ffn_up.bias", vector(m))
        writer.add_tensor(at + "ffn_down.weight", matrix((d, m), m))
        writer.add_tensor(at + "ffn_down.bias", vector(d))
    writer.add_tensor("v.post_ln.weight", vector(d, 1.0))
    writer.add_tensor("v.post_ln.bias", vector(d))
    writer.add_tensor("mm.input_projection.weight", matrix((d, t["text_hidden"]), d))
    writer.add_tensor("mm.soft_emb_norm.weight", vector(d, 1.0))
    return finish_gguf(writer, out)


def image(seed: int, size: tuple = (1024, 768)) -> str:
    """A photo-sized random picture (`size`: 1,024 x 768, JPEG) as a data: URL."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)            # smooth-ish blocks, as photos compress
    picture = Image.fromarray(small).resize(size, Image.BILINEAR)
    buffer = io.BytesIO()
    picture.save(buffer, "JPEG", quality=90)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def ask(url: str, model: str, picture: str, tokens: int) -> dict:
    """One streamed image question: seconds to the first content token, to the end, and the tokens."""
    body = {"model": model, "max_tokens": tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": picture}},
                                                      {"type": "text", "text": QUESTION}]}]}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first, count = None, 0
    with urllib.request.urlopen(req, timeout=3600) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            delta = (chunk.get("choices") or [{}])[0].get("delta", {})
            if delta.get("content"):
                count += 1
                if first is None:
                    first = time.perf_counter() - t0
    return {"ttft_s": first, "total_s": time.perf_counter() - t0, "chunks": count}


def measure(url: str, model: str, streams: int, tokens: int) -> dict:
    alone = ask(url, model, image(0), tokens)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        runs = list(pool.map(lambda k: ask(url, model, image(100 + k), tokens), range(streams)))
    wall = time.perf_counter() - t0
    again = ask(url, model, image(0), tokens)
    done = sum(r["chunks"] for r in runs)
    return {"alone": alone, "concurrent": {"streams": streams, "wall_s": wall, "chunks": done,
                                           "tok_s": done / wall, "ttft_s": sorted(r["ttft_s"] for r in runs)},
            "again": again}


def beside(url: str, model: str, images: int, tokens: int, lead_s: float = 5.0) -> dict:
    """A text stream decoding while `images` image questions come at once (`--beside`): how long the stream waits
    between its tokens while the images are served (a server that runs an image's tower inside one step stalls every
    stream for it), the images' time to first token, and the stream's tokens meanwhile."""
    import threading

    body = {"model": model, "max_tokens": tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Write a very long story about a lighthouse keeper."}]}
    times, started, stop = [], threading.Event(), threading.Event()

    def stream() -> None:
        req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=3600) as r:
            for line in r:
                if line.startswith(b"data:") and b'"content"' in line and not stop.is_set():
                    times.append(time.perf_counter())
                    started.set()
                if stop.is_set():
                    return                  # (closing the connection aborts the request)
    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    started.wait(600)
    time.sleep(lead_s)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(images) as pool:
        runs = list(pool.map(lambda k: ask(url, model, image(200 + k), 8), range(images)))
    t1 = time.perf_counter()
    stop.set()
    during = [t for t in times if t0 <= t <= t1]
    gaps = np.diff([t0, *during, t1])
    return {"images": images, "image_ttft_s": sorted(r["ttft_s"] for r in runs), "images_wall_s": t1 - t0,
            "stream_tokens_during": len(during), "stream_lasted": bool(times) and times[-1] >= t1 - 1.0,
            "max_gap_s": float(gaps.max()), "median_gap_s": float(np.median(gaps)),
            "gaps_over_10s": int((gaps > 10).sum())}


def paired(ours: str, theirs: str, model: str, rounds: int, tokens: int) -> dict:
    """Alone questions to the two servers in turn, both running (the idle one waits on its socket), each round a new
    picture to both and the order swapped every round: on a VM whose speed drifts by 10% over minutes, each ratio
    compares the same minutes."""
    ttft = {"ours": [], "llama": []}
    for k in range(rounds):
        picture = image(1000 + k)
        for name in (("ours", "llama") if k % 2 == 0 else ("llama", "ours")):
            ttft[name].append(ask(ours if name == "ours" else theirs, model, picture, tokens)["ttft_s"])
    ratios = [o / t for o, t in zip(ttft["ours"], ttft["llama"])]
    return {**ttft, "ratios": ratios, "ratio_median": float(np.median(ratios))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--text", default=None, help="the text model (default: bench/make_models.py's gemma3-4b Q4_K_M)")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", choices=("ours", "llama"), default=None)
    ap.add_argument("--paired", type=int, default=2,
                    help="rounds of alone questions to both servers in turn, both running (0: none)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="a setting of this server's (llm-serving start --set), e.g. model_config.vision_int16=off")
    ap.add_argument("--beside", type=int, default=0, metavar="N",
                    help="instead: a text stream decoding while N image questions come at once, on each server in turn "
                         "(the stream's longest wait between tokens)")
    ap.add_argument("--out", default="bench_results/vision_serving.json")
    args = ap.parse_args(argv)
    if args.beside:
        args.streams = max(args.streams, args.beside + 1)

    models = peers_dir() / "models"
    text = Path(args.text) if args.text else model_path("gemma3-4b")
    if not text.is_file():
        print(f"no text model at {text}: python bench/make_models.py --sizes gemma3-4b")
        return 2
    t0 = time.perf_counter()
    vl = vl_text_model(text, models / text.name.replace("gemma3-4b", "gemma3-4b-vl"))
    proj = mmproj(models / "bench-gemma3-4b-mmproj-f16.gguf")
    print(f"files ready in {time.perf_counter() - t0:.0f} s: {vl.name}, {proj.name}", flush=True)
    result = {"machine": machine(), "text": str(vl), "mmproj": str(proj), "streams": args.streams,
              "tokens": args.tokens, "settings": args.set}
    name = "gemma3-4b-vl"
    ours_args = ["--model", str(vl), "--set", f"model_config.mmproj={proj}", "--set", f"model_config.model_name={name}",
                 "--set", "model_config.max_generate_length=1024",
                 "--set", f"serving_config.max_num_seqs={max(16, args.streams)}",
                 *(arg for setting in args.set for arg in ("--set", setting))]
    llama_cmd = ["-m", str(vl), "--mmproj", str(proj), "--alias", name, "--host", "127.0.0.1", "-t", str(args.threads),
                 "-np", str(args.streams), "-c", str(1024 * args.streams), "--jinja"]
    binary, version = find_llama_server(None) if args.only != "ours" else (None, "not asked for")
    if args.beside:
        run = lambda url: beside(url, name, args.beside, 900)           # noqa: E731
        if args.only != "llama":
            srv, started = start_ours(ours_args, log_dir() / "vision_serving_ours.log")
            try:
                result["ours"] = {"start_s": started, "beside": run(srv.url)}
            finally:
                srv.stop()
            print("ours:", json.dumps(result["ours"]), flush=True)
        if args.only != "ours" and binary is not None:
            result["llama"], _ = with_llama_server([binary, *llama_cmd], log_dir() / "vision_serving_llama.log",
                                                   lambda peer: {"beside": run(peer.url), "version": version})
            print("llama-server:", json.dumps(result["llama"]), flush=True)
        write_json(args.out, result)
        return 0
    if args.only is None and binary is not None:
        # both servers up: the paired alone questions, then each server's own measures with the other idle
        srv, started = start_ours(ours_args, log_dir() / "vision_serving_ours.log")
        try:
            def both(peer) -> dict:
                out = {"paired": paired(srv.url, peer.url, name, args.paired, args.tokens)}
                print("paired alone questions:", json.dumps(out["paired"]), flush=True)
                out["ours"] = {"start_s": started, **measure(srv.url, name, args.streams, args.tokens)}
                print("ours:", json.dumps(out["ours"]), flush=True)
                out["llama"] = {**measure(peer.url, name, args.streams, args.tokens), "version": version}
                print("llama-server:", json.dumps(out["llama"]), flush=True)
                return out
            measured, _ = with_llama_server([binary, *llama_cmd], log_dir() / "vision_serving_llama.log", both)
            result.update(measured)
        finally:
            srv.stop()
    if args.only == "ours" or (args.only is None and binary is None):
        srv, started = start_ours(ours_args, log_dir() / "vision_serving_ours.log")
        try:
            result["ours"] = {"start_s": started, **measure(srv.url, name, args.streams, args.tokens)}
        finally:
            srv.stop()
        print("ours:", json.dumps(result["ours"]), flush=True)
    if args.only == "llama":
        if binary is None:
            print(f"llama-server: {version}")
        else:
            result["llama"], _ = with_llama_server(
                [binary, *llama_cmd], log_dir() / "vision_serving_llama.log",
                lambda peer: measure(peer.url, name, args.streams, args.tokens))
            result["llama"]["version"] = version
            print("llama-server:", json.dumps(result["llama"]), flush=True)
    if "ours" in result and "llama" in result:
        o, ll = result["ours"], result["llama"]
        result["ratios"] = {"ttft_alone": o["alone"]["ttft_s"] / ll["alone"]["ttft_s"],
                            **({"ttft_paired_median": result["paired"]["ratio_median"]} if "paired" in result else {}),
                            "tok_s": o["concurrent"]["tok_s"] / ll["concurrent"]["tok_s"],
                            "ttft_again": o["again"]["ttft_s"] / ll["again"]["ttft_s"]}
        print("ratios (ours / llama-server):", json.dumps(result["ratios"]))
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
