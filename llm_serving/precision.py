"""Precision gate (`llm-serving precision`): replay prompts through a running server with logits capture
on, and compare every captured step with a float64 numpy reference (reference_llama.py). Passes at 0.5%,
like the inference contest's check.

    llm-serving start --model DIR &                       # any server; agent 0 does the capture
    llm-serving precision --url http://127.0.0.1:8000 -n 200 --max-new-tokens 32

What happens: the tool reads the agent ports from GET /health, tells agent 0 over its control socket
(`c` command, with the launch token from the runtime dir) to write each step's inputs and full logits
to a temporary directory, sends the prompts over HTTP (greedy, `--rate` requests per second), and
meanwhile replays each captured row through the reference: per request (rows carry the request
number) the reference keeps its own float64 K/V, so a decode row costs one token and a recomputed
prefill (preemption) restarts from its first position. Per row:

    relative error = max_v |logits[v] - ref[v]| / max_v |ref[v]|

and the run passes when the largest over all rows is <= --threshold (default 0.005).

Images (`--images N`, a model that takes them): N of the prompts carry a picture each (`gate_image`: seeded color
fields and noise, `--image-seed`), sent through the chat API. The agent's capture then holds each step's images (where
their tokens are, and each picture's pixels once); the reference runs the tower and projector on those pixels in
float64 (reference_vision.py), puts the rows at the image's tokens and gives them the family's mask (Gemma 3's
image tokens see their whole image): the tower is inside the gate's bound, not beside it. Prints
max / mean / p99 relative error and the greedy-token agreement (of the rows whose token is served: a chunk
inside a prompt is compared but samples nothing); writes JSON (--out); exit 0 on pass,
1 on fail. The weights the reference loads are the server's (/info model_path) unless --model is given.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import aiohttp
import numpy as np

from llm_serving.agents import protocol as proto
from llm_serving.agents.control import ControlClient
from llm_serving.server_process import http
from llm_serving.reference_llama import ReferenceLlama
from llm_serving.reference_vision import ReferenceVision
from llm_serving.tokenization import load_tokenizer

DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "datasets" / "alpaca_5000.json"


def load_prompts(path: str, n: int) -> list:
    """Alpaca records (instruction + input), a JSONL of {"prompt"|"text"|"turns"}, or plain text lines."""
    text = Path(path).read_text(encoding="utf-8")
    if path.endswith(".json"):
        records = json.loads(text)
        prompts = [r["instruction"] + ("\n\n" + r["input"] if r.get("input") else "") for r in records]
    elif path.endswith(".jsonl"):
        prompts = []
        for line in text.splitlines():
            if line.strip():
                r = json.loads(line)
                prompts.append(r.get("prompt") or r.get("text") or r["turns"][0])
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    if len(prompts) < n:
        raise SystemExit(f"precision: {path} has {len(prompts)} prompts, {n} asked for")
    return prompts[:n]


class Comparator:
    """Consumes capture files in step order, keeping one reference sequence per request number. `vision`: the
    float64 tower (reference_vision.py) that makes a captured image's rows from its captured pixels."""

    def __init__(self, reference: ReferenceLlama, directory: str, prompt_ids: list = (),
                 vision: ReferenceVision | None = None):
        self.ref = reference
        self.vision = vision
        self.image_rows: dict = {}      # an image's key -> the reference tower's (tokens, H) rows of it
        self.image_grids: dict = {}     # ... -> its (rows, cols) of tokens (multimodal RoPE's), or None
        self.images = 0                 # images the reference tower encoded
        self.dir = directory
        self.prompt_ids = [list(p) for p in prompt_ids]   # the replayed prompts, tokenized as the server does
        self.sequences: dict = {}
        self.errors: list = []          # relative error per captured row
        self.agree = 0                  # sampled rows whose served greedy token is the reference's argmax
        self.sampled = 0                # rows that reach the end of their prompt (a chunk inside it samples nothing)
        self.files = 0
        self.failure: BaseException | None = None

    def consume_ready(self) -> int:
        done = 0
        for name in sorted(f for f in os.listdir(self.dir) if f.endswith(".npz")):
            path = os.path.join(self.dir, name)
            with np.load(path) as step:
                self._compare(step)
            os.unlink(path)
            done += 1
        self.files += done
        return done

    def _compare(self, step) -> None:
        images = self._step_images(step)
        for i, rid in enumerate(step["request_ids"].tolist()):
            q = int(step["query_lens"][i])
            positions = step["positions"][i, :q]
            seq = self.sequences.setdefault(rid, self.ref.new_sequence())
            served_ids = step["input_ids"][i, :q].tolist()
            tokens, mine = list(served_ids), images.get(i, [])
            for offset, rows, *_ in mine:           # (ids the embedding never reads: their rows are the image's;
                for k in np.nonzero(~np.isnan(rows[:, 0]))[0]:       # a NaN row's token, Pixtral's break, its own)
                    tokens[offset + k] = 0
            if int(positions[0]) > seq.length:      # the server took the prefix from its prefix cache
                self.ref.forward(seq, self._prefix_of(served_ids, int(positions[0])), 0)
            ref = self.ref.forward(seq, tokens, int(positions[0]), mine)[-1]
            served = step["logits"][i].astype(np.float64)
            self.errors.append(float(np.max(np.abs(served - ref)) / np.max(np.abs(ref))))
            if int(positions[-1]) + 1 >= int(step["prompt_lens"][i]):   # the row's token is served
                self.sampled += 1
                self.agree += int(int(step["token_ids"][i]) == int(np.argmax(ref)))

    def _step_images(self, step) -> dict:
        """{row: [(offset, rows, bidirectional, grid), ...]} of a captured step's images (worker.py's image_places,
        image_keys, image_pixels_<j>), each one's rows the reference tower's of its pixels, its grid of tokens
        (rows, cols) where its pixels are Qwen2.5-VL's patches (rows, cols, merge^2, features), else None."""
        if "image_places" not in step.files:
            return {}
        if self.vision is None:
            raise ValueError("precision: the server fed images, and the reference has no vision tower")
        out: dict = {}
        for j, ((row, offset, first, count, length), key) in enumerate(zip(step["image_places"].tolist(),
                                                                          step["image_keys"].tolist())):
            if key not in self.image_rows:
                if f"image_pixels_{j}" not in step.files:
                    raise ValueError(f"precision: image {key} was captured without its pixels")
                pixels = step[f"image_pixels_{j}"]
                self.image_rows[key] = self.vision.encode(pixels)
                self.image_grids[key] = tuple(pixels.shape[:2]) if pixels.ndim == 4 else None
                self.images += 1
            if self.vision.bidirectional and (first, count) != (0, length):
                raise ValueError(f"precision: a step feeds tokens {first}..{first + count - 1} of a {length}-token "
                                 "image whose tokens see each other; the reference needs it whole")
            if self.image_grids[key] is not None and (first, count) != (0, length):
                raise ValueError(f"precision: a step feeds tokens {first}..{first + count - 1} of a {length}-token "
                                 "image placed by its grid; the reference needs it whole")
            out.setdefault(row, []).append((offset, self.image_rows[key][first:first + count],
                                            self.vision.bidirectional, self.image_grids[key]))
        return out

    def _prefix_of(self, tokens: list, start: int) -> list:
        """The first `start` tokens of the replayed prompt that has `tokens` at positions start... (a
        prompt whose first row starts past 0 shares its head with a prompt served earlier)."""
        for ids in self.prompt_ids:
            if ids[start:start + len(tokens)] == tokens:
                if self.vision is not None and self.vision.config.image_token_id in ids[:start]:
                    raise ValueError(f"precision: a row at position {start} took an image's tokens from the "
                                     "prefix cache (this server saw these pictures before: rerun with another "
                                     "--image-seed)")
                return ids[:start]
        raise ValueError(f"precision: a row starts at position {start} and matches no replayed prompt")

    def run_until(self, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                if not self.consume_ready():
                    time.sleep(0.05)
            self.consume_ready()
        except BaseException as exc:   # reported by the main thread
            self.failure = exc


def served_token_errors(ref_logits: np.ndarray, prompt_len: int, tokens, logprobs) -> dict:
    """A served greedy continuation against the reference, teacher-forced: `ref_logits` are the reference's logits
    (prompt_len + len(tokens) - 1, vocab) of the prompt and the served tokens but the last, so row prompt_len - 1 + j
    is its distribution for served token j, given the served tokens before it. Per served token: whether it is the
    reference's greedy choice there (`agrees`), the error of the log-probability the server gave it (`lp_error`,
    nats, served - reference), and the reference's own margin between its top two tokens (`margin`, nats: where it
    is below the server's error a disagreement is a near tie, not a wrong turn). Any server that reports its chosen
    tokens' log-probabilities can be measured so (llama-server's n_probs, this server's details)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    rows = ref_logits[prompt_len - 1:prompt_len - 1 + len(tokens)]
    if len(rows) != len(tokens):
        raise ValueError(f"precision: {len(tokens)} served tokens after a {prompt_len}-token prompt need "
                         f"{prompt_len + len(tokens) - 1} reference rows, got {len(ref_logits)}")
    shifted = rows - rows.max(axis=-1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    top2 = np.sort(log_softmax, axis=-1)[:, -2:]
    return {"agrees": rows.argmax(axis=-1) == tokens,
            "lp_error": np.asarray(logprobs, dtype=np.float64) - log_softmax[np.arange(len(tokens)), tokens],
            "margin": top2[:, 1] - top2[:, 0]}


def summarize_token_errors(per_request: list) -> dict:
    """served_token_errors of many requests as one row: greedy agreement (its share of the tokens, and the share
    of disagreements that were near ties), the log-probability error's mean, 99th percentile and largest
    magnitude (nats), and the tokens counted."""
    agrees = np.concatenate([e["agrees"] for e in per_request])
    err = np.abs(np.concatenate([e["lp_error"] for e in per_request]))
    margin = np.concatenate([e["margin"] for e in per_request])
    wrong = ~agrees
    return {"tokens": int(agrees.size), "greedy_agreement": float(agrees.mean()),
            "disagreements": int(wrong.sum()), "near_ties": int((wrong & (margin <= err)).sum()),
            "lp_error_mean": float(err.mean()), "lp_error_p99": float(np.percentile(err, 99)),
            "lp_error_max": float(err.max())}


def gate_image(index: int, seed: int = 0) -> bytes:
    """The picture of image prompt `index`: a PNG of 300 x 220 pixels, smooth color fields plus noise, seeded by
    the index and `seed` (each prompt its own picture: the prefix cache never hands one prompt's image to another)."""
    import io

    from PIL import Image

    rng = np.random.default_rng([seed, 1000 + index])
    y, x = np.mgrid[0:220, 0:300] / 100.0
    fields = [np.sin(x * rng.uniform(1, 4) + y * rng.uniform(1, 4) + rng.uniform(0, 6)) for _ in range(3)]
    rgb = (np.stack(fields, -1) * 90 + 128 + rng.normal(0, 20, (220, 300, 3))).clip(0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(rgb).save(buffer, "PNG")
    return buffer.getvalue()


def image_messages(prompt: str, image: bytes) -> list:
    """A one-turn chat: the picture (a data: URL), then the prompt."""
    import base64

    url = "data:image/png;base64," + base64.b64encode(image).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": prompt}]}]


async def replay(url: str, model: str, prompts: list, max_new_tokens: int, rate: float) -> list:
    """Each prompt (text, or a chat's messages: image prompts) sent greedy; the tokens each reply generated."""
    async def one(session, i, prompt):
        if rate > 0:
            await asyncio.sleep(i / rate)
        # no speculative decoding: a verify step is not captured (agents/worker.py), and the gate follows each
        # request step by step; past an end-of-sequence token too, so every request is compared over
        # max_new_tokens steps whatever the model writes
        if isinstance(prompt, list):        # an image prompt: through the chat API, which carries images
            body = {"model": model, "messages": prompt, "max_tokens": max_new_tokens, "temperature": 0,
                    "ignore_eos": True, "speculative": False}
            async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
                answer = await resp.json()
                if resp.status != 200:
                    raise RuntimeError(f"request {i} failed with HTTP {resp.status}: {answer}")
                return answer["usage"]["completion_tokens"]
        body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens, "speculative": False,
                                                 "ignore_eos": True}}
        async with session.post(f"{url}/models/{model}/generate", json=body) as resp:
            answer = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"request {i} failed with HTTP {resp.status}: {answer}")
            return answer["details"]["generated_tokens"]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        return await asyncio.gather(*[one(session, i, p) for i, p in enumerate(prompts)])


def run(args) -> dict:
    status, health = http("GET", args.url + "/health")
    if status != 200:
        raise SystemExit(f"precision: server at {args.url} is not healthy: {health}")
    _, info = http("GET", args.url + "/info")
    port = next(a["port"] for a in health["agents"] if a["rank"] == 0)
    # the served context picks a longrope model's factors, on the server and in the reference alike
    reference = ReferenceLlama(args.model or info["model_path"], max_context=info.get("max_total_tokens"))
    prompts = load_prompts(args.prompts, args.num_prompts)
    tokenizer = load_tokenizer(info["model_path"], info["tokenizer_path"])
    prompt_ids = [tokenizer.encode(p, add_bos=True) for p in prompts]
    vision = None
    if args.images:
        # the tower as the server reads it: the HF directory's, or the GGUF's mmproj (/info)
        vision = ReferenceVision(args.model or info["model_path"], mmproj=None if args.model else info.get("mmproj"))
        every = max(1, len(prompts) // args.images)
        for j, i in enumerate(range(0, len(prompts), every)[:args.images]):
            prompts[i] = image_messages(prompts[i], gate_image(j, args.image_seed))
            status, body = http("POST", args.url + "/tokenize", {"model": info["model_id"], "messages": prompts[i],
                                                                 "add_generation_prompt": True})
            if status != 200:
                raise SystemExit(f"precision: /tokenize refused image prompt {i}: {body}")
            prompt_ids[i] = body["tokens"]

    with tempfile.TemporaryDirectory(prefix="llm-serving-capture-") as capture_dir, \
            ControlClient(port) as agent:
        comparator = Comparator(reference, capture_dir, prompt_ids, vision)
        stop = threading.Event()
        worker = threading.Thread(target=comparator.run_until, args=(stop,), daemon=True)
        agent.request(proto.Capture(dir=capture_dir, max_steps=args.max_steps))
        t0 = time.perf_counter()
        try:
            worker.start()
            generated = asyncio.run(replay(args.url, info["model_id"], prompts, args.max_new_tokens, args.rate))
        finally:
            captured = agent.request(proto.Capture(dir=None)).steps
            stop.set()
            worker.join()
        wall = time.perf_counter() - t0
    if comparator.failure is not None:
        raise comparator.failure
    errors = np.array(comparator.errors)
    if comparator.files != captured or errors.size == 0:
        raise SystemExit(f"precision: agent captured {captured} steps, {comparator.files} compared")
    return {
        "model": info["model_id"], "model_path": args.model or info["model_path"],
        "kv_cache_dtype": info.get("kv_cache_dtype"),     # (the reference keeps K/V in float64: a float16 cache's
                                                          # rounding is part of the error measured)
        "prompts": len(prompts), "image_prompts": sum(isinstance(p, list) for p in prompts),
        "images_encoded": comparator.images, "generated_tokens": int(sum(generated)), "steps": captured,
        "rows": int(errors.size), "sampled_rows": comparator.sampled, "max_rel_error": float(errors.max()), "mean_rel_error": float(errors.mean()),
        "p99_rel_error": float(np.percentile(errors, 99)),
        "greedy_agreement": comparator.agree / max(comparator.sampled, 1), "threshold": args.threshold,
        "passed": bool(errors.max() <= args.threshold), "wall_s": round(wall, 1),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", help="weights for the reference (default: the server's, from /info)")
    parser.add_argument("--prompts", default=str(DEFAULT_PROMPTS),
                        help="alpaca .json, .jsonl, or text lines (default: ../shared alpaca_5000.json)")
    parser.add_argument("-n", "--num-prompts", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rate", type=float, default=0.0, help="requests per second (0: all at once)")
    parser.add_argument("--images", type=int, default=0,
                        help="this many of the prompts carry a picture each (a model that takes images: sent through "
                             "the chat API, the reference running the tower in float64 on the captured pixels)")
    parser.add_argument("--image-seed", type=int, default=0, help="the pictures' seed (a server that saw them "
                        "already serves their tokens from its prefix cache, which the gate cannot replay)")
    parser.add_argument("--threshold", type=float, default=0.005)
    parser.add_argument("--max-steps", type=int, default=100_000, help="capture stops by itself after this")
    parser.add_argument("--out", default="bench_results/precision.json")


def run_cli(args) -> int:
    """Run the gate, print the figures, write the JSON; exit code 0 on pass, 1 on fail."""
    result = run(args)
    print(f"model {result['model']} (KV cache {result['kv_cache_dtype']}): {result['prompts']} prompts "
          f"({result['image_prompts']} with an image, {result['images_encoded']} images through the reference tower), "
          f"{result['generated_tokens']} tokens, "
          f"{result['steps']} steps, {result['rows']} rows compared ({result['sampled_rows']} sampled) in {result['wall_s']} s")
    print(f"relative error  max {result['max_rel_error']:.3e}  mean {result['mean_rel_error']:.3e}  "
          f"p99 {result['p99_rel_error']:.3e}  (threshold {args.threshold})")
    print(f"greedy token agreement {100 * result['greedy_agreement']:.2f}%")
    print("PASS" if result["passed"] else "FAIL")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return 0 if result["passed"] else 1
