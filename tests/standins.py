"""Generated stand-ins for the licence-restricted files the tests once read from ../shared: the alpaca sample
(Stanford Alpaca, CC BY-NC 4.0) and the LLaMA-2 tokenizer (Meta's licence). Neither is ever committed; a test that
needs the real file (not just one of its shape) skips naming it. Both are deterministic: the same bytes on every
run and machine."""
from __future__ import annotations

import json
import random
from pathlib import Path

from llm_serving.models.default_model import builtin_tokenizer_bytes, generate_story_lines

_TASKS = ["Summarize the story", "Give the story a title", "Name the animal in the story",
          "Continue the story", "Rewrite the story for a small child", "What happens at the end of the story?",
          "Tell a short story about a friend", "Write one sentence about the weather",
          "Explain why the child was happy", "List three things in the garden"]


def alpaca_records(n: int, seed: int = 0) -> list:
    """`n` alpaca records ({instruction, input, output}): short instructions, an input on about half of them,
    outputs from a few words to ~120, built from the default model's generated story lines."""
    rng = random.Random(seed)     # random() alone: its sequence for a seed is promised never to change

    def between(low: int, high: int) -> int:
        return low + int(rng.random() * (high - low + 1))

    stories = iter(generate_story_lines(2 * n, seed))
    records = []
    for _ in range(n):
        story, answer = next(stories).split(), next(stories).split()
        extra = " ".join(story[:between(4, 40)]) if rng.random() < 0.5 else ""
        records.append({"instruction": _TASKS[between(0, len(_TASKS) - 1)], "input": extra,
                        "output": " ".join((answer * 3)[:between(3, 120)])})
    return records


def write_alpaca_standin(path: Path, n: int = 500) -> Path:
    path.write_text(json.dumps(alpaca_records(n), indent=0))
    return path


def write_llama_tokenizer_standin(path: Path) -> Path:
    """The built-in model's sentencepiece tokenizer: LLaMA's kind (BPE with byte fallback, <unk> <s> </s> = 0 1 2),
    1,024 pieces trained on generated stories."""
    path.write_bytes(builtin_tokenizer_bytes())
    return path
