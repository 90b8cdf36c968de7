"""What to send and when: datasets turned into `Sample`s, and arrival schedules.

Datasets
- alpaca json (a list of {instruction, input, output}): prompt = instruction + ":" + input when input is
  non-empty, else instruction; max_new_tokens = token count of the reference output (capped).
- ShareGPT json (a list of {"conversations": [{"from": "human"|"gpt", "value"}, ...]}): prompt = the first
  human turn, max_new_tokens = token count of the reply that follows it (capped).
- synthetic: input and output lengths drawn uniformly from [len*(1-r), len*(1+r)]; the prompt is random
  vocabulary pieces re-encoded to the drawn length, or plain words when no tokenizer is given.

Arrivals (offsets in seconds from the start, one per request)
- fixed: one request every 1/rate s (the contest's `-X qps -T seconds`: N = qps*T requests);
- poisson: exponential gaps of mean 1/rate;
- gamma: gamma gaps with shape = burstiness and mean 1/rate (burstiness 1 = Poisson, < 1 = burstier);
- rate = inf: everything at once. A concurrency cap (client.py) can be combined with any of them.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

__all__ = ["Sample", "WorkloadError", "TokenCounter", "load_alpaca", "load_sharegpt", "synthetic",
           "arrival_offsets"]


class WorkloadError(ValueError):
    """A dataset or schedule cannot be built; the message says why."""


@dataclass
class Sample:
    prompt: str
    prompt_len: int          # tokens, as the client's tokenizer counts them (no BOS)
    max_new_tokens: int
    model: Optional[str] = None   # the served model (or LoRA adapter) this request names; None: the run's model


class TokenCounter:
    """Counts tokens with the server's tokenizer (a sentencepiece .model, a tokenizer.json or a .gguf, read as the
    server reads it: llm_serving.tokenization.load_tokenizer); without one, words (an estimate, said so in results).
    Counts leave out BOS."""

    def __init__(self, model_file: Optional[str]):
        self.model_file = model_file
        self._tok = None
        if model_file:
            if not os.path.exists(model_file):
                raise WorkloadError(f"tokenizer {model_file!r} not found")
            from llm_serving.tokenization import load_tokenizer

            try:
                self._tok = load_tokenizer(model_file, model_file)
            except (OSError, ValueError) as exc:
                raise WorkloadError(f"tokenizer {model_file!r}: {exc}") from None

    @property
    def exact(self) -> bool:
        return self._tok is not None

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_bos=False)) if self._tok is not None else len(text.split())

    def encode(self, text: str) -> list:
        return self._tok.encode(text, add_bos=False)

    def decode(self, ids: list) -> str:
        return self._tok.decode(ids)

    @property
    def vocab_size(self) -> int:
        return self._tok.vocab_size

    def is_plain(self, i: int) -> bool:
        """A token that is ordinary text on its own: not special, and printable whole characters (not a
        sentencepiece byte or unused piece, not part of a UTF-8 character)."""
        if self._tok.is_special(i):
            return False
        text = self._tok.token_text(i)
        return bool(text.strip()) and text.isprintable() and "\ufffd" not in text and not text.startswith("<0x")


def _read_json(path: str):
    if not path:
        raise WorkloadError("no dataset path given (--dataset-path)")
    if not os.path.isfile(path):
        raise WorkloadError(f"dataset {path!r} not found")
    try:
        with open(path, "r", encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise WorkloadError(f"dataset {path!r} is not valid JSON: {e}") from None


def _cap(n_tokens: int, cap: Optional[int]) -> int:
    n = max(1, n_tokens)
    return min(n, cap) if cap else n


def load_alpaca(path: str, n: int, counter: TokenCounter, max_new_tokens: Optional[int]) -> list:
    data = _read_json(path)
    if not isinstance(data, list) or (data and not isinstance(data[0], dict)) or \
            (data and "instruction" not in data[0]):
        raise WorkloadError(f"dataset {path!r} is not alpaca json (a list of {{instruction, input, output}})")
    out = []
    for rec in data[:n]:
        instruction, extra = str(rec.get("instruction", "")), str(rec.get("input", "") or "")
        prompt = f"{instruction}:{extra}" if extra else instruction
        out.append(Sample(prompt, counter.count(prompt), _cap(counter.count(str(rec.get("output", ""))),
                                                              max_new_tokens)))
    return out


def load_sharegpt(path: str, n: int, counter: TokenCounter, max_new_tokens: Optional[int]) -> list:
    data = _read_json(path)
    if not isinstance(data, list):
        raise WorkloadError(f"dataset {path!r} is not ShareGPT json (a list of {{conversations: [...]}})")
    out = []
    for rec in data:
        turns = rec.get("conversations") if isinstance(rec, dict) else None
        if not isinstance(turns, list):
            continue
        for i in range(len(turns) - 1):
            if turns[i].get("from") in ("human", "user") and turns[i + 1].get("from") in ("gpt", "assistant"):
                prompt = str(turns[i].get("value", ""))
                if prompt.strip():
                    out.append(Sample(prompt, counter.count(prompt),
                                      _cap(counter.count(str(turns[i + 1].get("value", ""))), max_new_tokens)))
                break
        if len(out) == n:
            break
    if not out:
        raise WorkloadError(f"dataset {path!r} holds no conversation with a human turn followed by a reply")
    return out


_WORDS = ("time story house water little people world light music garden river morning paper family friend "
          "city school color dream window table green summer voice forest animal number simple mountain").split()


def synthetic(n: int, input_len: int, output_len: int, range_ratio: float, counter: TokenCounter,
              seed: int = 0) -> list:
    if input_len < 1 or output_len < 1:
        raise WorkloadError("--input-len and --output-len must be >= 1")
    if not 0 <= range_ratio < 1:
        raise WorkloadError("--range-ratio must be in [0, 1)")
    rng = np.random.default_rng(seed)
    lo_in, hi_in = max(1, int(input_len * (1 - range_ratio))), int(input_len * (1 + range_ratio))
    lo_out, hi_out = max(1, int(output_len * (1 - range_ratio))), int(output_len * (1 + range_ratio))
    plain = [i for i in range(counter.vocab_size) if counter.is_plain(i)] if counter.exact else None
    out = []
    for _ in range(n):
        want = int(rng.integers(lo_in, hi_in + 1))
        if plain:
            ids = list(rng.choice(plain, size=want))
            prompt = counter.decode(ids)
            ids = counter.encode(prompt)[:want]          # re-encoding may merge pieces: trim, then top up
            while len(ids) < want:
                ids += counter.encode(counter.decode([int(rng.choice(plain))]))
                ids = ids[:want]
            prompt = counter.decode(ids)
        else:
            prompt = " ".join(rng.choice(_WORDS, size=want))
        out.append(Sample(prompt, counter.count(prompt), int(rng.integers(lo_out, hi_out + 1))))
    return out


def arrival_offsets(n: int, rate: float, kind: str = "fixed", burstiness: float = 1.0, seed: int = 0) -> list:
    """Send time of each of n requests, in seconds from the start (all 0.0 when rate is inf)."""
    if not (rate > 0):
        raise WorkloadError(f"request rate must be > 0 (or inf), got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    if kind == "fixed":
        return [i / rate for i in range(n)]
    rng = np.random.default_rng(seed)
    if kind == "poisson":
        gaps = rng.exponential(1.0 / rate, size=n)
    elif kind == "gamma":
        if not burstiness > 0:
            raise WorkloadError(f"burstiness must be > 0, got {burstiness}")
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    else:
        raise WorkloadError(f"unknown arrival process {kind!r} (fixed, poisson, gamma)")
    gaps[0] = 0.0                      # the first request goes at once
    return np.cumsum(gaps).tolist()
