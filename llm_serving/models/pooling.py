"""How a model's embeddings are made (pure Python, read from the checkpoint's files): the pooling of the final
hidden states, and the widths a request may ask for.

- pooling: `mean` over the input's tokens, the `last` token's (decoder embedding models such as Qwen3-Embedding)
  or the first token's (`cls`), each L2-normalized. `model_config.pooling: auto` takes what the model declares in
  sentence-transformers' files (`modules.json` naming a Pooling module, whose `config.json` says
  `pooling_mode_lasttoken`, `pooling_mode_mean_tokens` or `pooling_mode_cls_token`; a GGUF's `<arch>.pooling_type`,
  as llama.cpp's converter writes it from those files), else mean.
- dimensions: the hidden size; a Matryoshka model (config.json's `matryoshka_dimensions`, or `is_matryoshka`)
  may be asked for fewer (the first d of the pooled vector, normalized again); any other model only for its own.

The master and the agents both read this (the agent pools a step's hidden states by it; the master combines and
reports it), from the same files, so they agree.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

POOLINGS = ("mean", "last", "cls")
POOLING_CODES = {"mean": 0, "last": 1, "cls": 2}         # as the agent's pooled output reads them
_DECLARED = (("pooling_mode_lasttoken", "last"), ("pooling_mode_mean_tokens", "mean"),
             ("pooling_mode_cls_token", "cls"))
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}         # llama.cpp's pooling_type (0: none, 4: rank)


def _gguf_pooling(path: str) -> Optional[tuple]:
    """(pooling, key) a GGUF's `<arch>.pooling_type` declares, or None."""
    from llm_serving.gguf_file import read_scalars

    try:
        meta = read_scalars(path)
        arch = meta["general.architecture"]
        kind = meta.get(f"{arch}.pooling_type")
    except Exception:               # not readable here: the weight loader says why
        return None
    return (_GGUF_POOLING[kind], f"{arch}.pooling_type") if kind in _GGUF_POOLING else None


@dataclass(frozen=True)
class EmbeddingSpec:
    """What /v1/embeddings serves: the pooling, where it came from, the width, and the widths a request may name
    (None: any from 1 to `dimensions`, a Matryoshka model without a list; () : only `dimensions`)."""
    pooling: str
    source: str                    # "model_config.pooling", "<file>" or "default"
    dimensions: int
    matryoshka: Optional[tuple] = ()

    def check_dimensions(self, dims: int) -> Optional[str]:
        """Why a request's `dimensions` cannot be served (None: it can)."""
        if dims == self.dimensions:
            return None
        if self.matryoshka == ():
            return (f"this model's embeddings have {self.dimensions} dimensions and it is not a Matryoshka model "
                    "(its config.json declares no matryoshka_dimensions): leave `dimensions` out")
        if self.matryoshka is None:
            if 1 <= dims <= self.dimensions:
                return None
            return f"`dimensions` must be between 1 and {self.dimensions}"
        if dims in self.matryoshka:
            return None
        return f"`dimensions` must be one of {', '.join(map(str, sorted(set(self.matryoshka) | {self.dimensions})))}"


def declared_pooling(model_dir: Optional[str]) -> Optional[tuple]:
    """(pooling, file) a sentence-transformers model declares (a GGUF: its pooling_type), or None."""
    if model_dir and os.path.isfile(model_dir) and model_dir.endswith(".gguf"):
        return _gguf_pooling(model_dir)
    if not model_dir or not os.path.isdir(model_dir):
        return None
    modules_file = os.path.join(model_dir, "modules.json")
    try:
        with open(modules_file, encoding="utf-8") as f:
            modules = json.load(f)
    except (OSError, ValueError):
        return None
    for module in modules if isinstance(modules, list) else []:
        if not isinstance(module, dict) or not str(module.get("type", "")).endswith("Pooling"):
            continue
        path = os.path.join(model_dir, str(module.get("path", "")), "config.json")
        try:
            with open(path, encoding="utf-8") as f:
                declared = json.load(f)
        except (OSError, ValueError):
            return None
        for key, pooling in _DECLARED:
            if declared.get(key):
                return pooling, os.path.relpath(path, model_dir)
        return None
    return None


def _matryoshka(model_dir: Optional[str]) -> Optional[tuple]:
    if not model_dir or not os.path.isdir(model_dir):
        return ()
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return ()
    dims = cfg.get("matryoshka_dimensions")
    if isinstance(dims, list) and dims and all(isinstance(d, int) and d > 0 for d in dims):
        return tuple(dims)
    return None if cfg.get("is_matryoshka") is True else ()


def embedding_spec(pooling_setting: str, model_dir: Optional[str], hidden_size: int) -> EmbeddingSpec:
    """The embeddings of the model at `model_dir` (`model_config.pooling`: auto, or a pooling that overrides the
    declared one)."""
    if pooling_setting != "auto":
        pooling, source = pooling_setting, "model_config.pooling"
    else:
        pooling, source = declared_pooling(model_dir) or ("mean", "default")
    return EmbeddingSpec(pooling, source, hidden_size, _matryoshka(model_dir))


def score_method(setting: str, model_dir: Optional[str], model_name: Optional[str]) -> str:
    """How /rerank and /score score (`model_config.score_method`): auto = 'yes_no' when the served name or the
    checkpoint's directory says the model is a reranker (Qwen3-Reranker-0.6B), else 'similarity'."""
    if setting != "auto":
        return setting
    names = (model_name or "", os.path.basename(os.path.normpath(model_dir or "")))
    return "yes_no" if any("rerank" in name.lower() for name in names) else "similarity"
