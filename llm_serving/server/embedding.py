"""Inputs embedded on the engine, what every API that embeds runs (OpenAI's /v1/embeddings, rerank and score by
similarity, Ollama's /api/embed): `input_ids` (a text or token ids as the model takes them, checked against the
vocabulary and the context), `embed` (one engine request per input, submitted together and batched with the
generation traffic on the step loop; their vectors in input order, L2-normalized), `shorten` (a Matryoshka width)."""
from __future__ import annotations

import re
from typing import Optional

import numpy as np

from llm_serving.master.engine import EngineStoppedError
from llm_serving.server import access_log
from llm_serving.server.errors import EngineFailedError, ValidationError


def embedding_of(engine):
    """What the served model's embeddings are (engine.embedding: pooling, dimensions), or a 400 when this server
    cannot embed."""
    if engine.embedding is None:
        raise ValidationError(f"the model {engine.model_name!r} is served without embeddings: the server was started "
                              "without the model's hidden size (model_config.hidden_size)", param="model")
    return engine.embedding


def check_dimensions(engine, dimensions: Optional[int]) -> None:
    """A request's `dimensions`: None, or a width the model serves (a 400 naming the field saying why not)."""
    if dimensions is None:
        return
    reason = embedding_of(engine).check_dimensions(dimensions)
    if reason is not None:
        raise ValidationError(reason, param="dimensions")


def input_ids(engine, value, field: str, last: Optional[int] = None, fit: bool = False) -> list:
    """The token ids of one input (`field`: where it is in the body, input[2]): a text's as a prompt's (the BOS when
    the model starts prompts with one) and what the model's tokenizer appends to a whole text (`input_suffix`:
    Qwen3-Embedding's last token, whose state it pools), or its ids, each below the vocabulary. `last`: keep only the last this many
    (vLLM's truncate_prompt_tokens; -1: the context's length); `fit`: keep the first tokens the context takes
    (Ollama's truncate). An input with no tokens, or longer than the context, is a 400 naming the field."""
    param = re.split(r"[.\[]", field)[0]
    if isinstance(value, str):        # (with what the tokenizer appends to a whole text: Qwen3-Embedding's last token)
        ids = engine.tokenizer.encode(value, add_bos=True) + list(getattr(engine.tokenizer, "input_suffix", ()))
    else:
        vocab = engine.vocab_size
        bad = [t for t in value if not 0 <= t < vocab]
        if bad:
            raise ValidationError(f"{field}: {bad[0]} is not a token id in 0..{vocab - 1}", param=param)
        ids = list(value)
    limit = engine.max_model_len
    if last is not None:
        ids = ids[-(limit if last == -1 else last):]
    if fit:
        ids = ids[:limit]
    if not ids:
        raise ValidationError(f"{field} has no tokens to embed", param=param)
    if len(ids) > limit:
        raise ValidationError(f"{field} has {len(ids)} tokens; this model embeds at most {limit} tokens an input",
                              param=param)
    return ids


async def final_event(req):
    """The last event of a request the engine runs (its finish_reason set); EngineFailedError (500) when the engine
    failed it, EngineStoppedError (503) when it was aborted (the server stopping)."""
    while True:
        event = await req.events.get()
        if event.finish_reason is not None:
            break
    if event.finish_reason == "error":
        raise EngineFailedError(event.error or "the engine failed the request")
    if event.finish_reason == "abort":
        raise EngineStoppedError(event.error or "the request was aborted")
    return event


async def embed(engine, inputs: list) -> list:
    """Each input's ids (`input_ids`) embedded: one engine request each, submitted together, awaited; their vectors
    (float32, L2-normalized) in input order. One that fails fails them all; the rest are released."""
    reqs = []
    try:
        for ids in inputs:
            reqs.append(engine.submit_embedding(ids))
            access_log.track(reqs[-1:])
        for req in reqs:
            await final_event(req)
        return [req.embedding for req in reqs]
    finally:
        for req in reqs:                # (no-op for those that finished)
            engine.release(req)


def shorten(vector: np.ndarray, dimensions: Optional[int]) -> np.ndarray:
    """A Matryoshka model's vector at `dimensions`: its first values, L2-normalized again (None: as it is)."""
    if dimensions is None or dimensions >= len(vector):
        return vector
    head = np.asarray(vector[:dimensions], np.float32)
    norm = float(np.linalg.norm(head))
    return head / np.float32(norm) if norm > 0 else head
