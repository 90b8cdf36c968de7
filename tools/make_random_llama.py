#!/usr/bin/env python
"""Write a randomly initialised LLaMA (HuggingFace layout) for benchmarks and the precision gate.

    python tools/make_random_llama.py --out /tmp/llama-8x512 \
        --tokenizer ../shared/tokenizers/llama2/tokenizer.model       # 8 layers, 512 wide, 32k vocab

The vocabulary size is the tokenizer's; weights are N(0, 0.02) from --seed, RMSNorm gains 1.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import sentencepiece as spm

from llm_serving.models.default_model import write_hf_llama


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer", required=True, help="sentencepiece .model; copied as tokenizer.model")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1376)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--max-positions", type=int, default=2048)
    p.add_argument("--tied", action="store_true", help="tie lm_head to the embedding")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    tok_bytes = Path(args.tokenizer).read_bytes()
    vocab = spm.SentencePieceProcessor(model_proto=tok_bytes).vocab_size()
    out = write_hf_llama(args.out, vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
                         max_position_embeddings=args.max_positions, seed=args.seed,
                         tokenizer_model_bytes=tok_bytes, tie_word_embeddings=args.tied)
    print(f"wrote {out}: {args.layers} layers, hidden {args.hidden}, vocab {vocab}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
