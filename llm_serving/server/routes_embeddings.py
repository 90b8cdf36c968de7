"""Embeddings, rerank and score: OpenAI's `POST /v1/embeddings`; `POST /v1/rerank`, `/rerank` (Jina's and Cohere's
shape, as vLLM serves them), `/v2/rerank` (Cohere's v2: no documents in its results unless asked) and vLLM's
`POST /score`, `/v1/score`. Errors are OpenAI's.

An embeddings request's inputs are embedded together (server/embedding.py: an engine request each, batched with the
generation traffic). Rerank and score score each (query, document) pair by the model's `score_method` (GET
/v1/models says which):
- similarity: the cosine of the query's and the document's embeddings (their dot product: both are normalized);
- yes_no (Qwen3-Reranker): the probability the model answers "yes" to its judgement prompt of the pair. The prompt
  goes through the ordinary generation path with one new token allowed to be only "yes" or "no", greedily; the
  log-probability the engine reports is that of this masked distribution, so P(yes) is exp(logprob) when it picked
  "yes" and 1 - exp(logprob) when "no": softmax([logit_no, logit_yes])[1], the model card's score."""
from __future__ import annotations

import base64
import math
import time
import uuid

import numpy as np
from aiohttp import web

from llm_serving.master.request import SamplingParams
from llm_serving.server import access_log, routes_openai
from llm_serving.server.api import base as api
from llm_serving.server.api.embeddings import (DEFAULT_INSTRUCTION, CohereRerankRequest, EmbeddingRequest,
                                              RerankRequest, ScoreRequest)
from llm_serving.server.embedding import (check_dimensions, embed, embedding_of, final_event, input_ids,
                                          shorten)
from llm_serving.server.errors import ValidationError
from llm_serving.server.served import engine_for
from llm_serving.server.translate import adapter_of

PATHS = frozenset({"/v1/embeddings", "/v1/rerank", "/rerank", "/v2/rerank", "/score", "/v1/score"})

# Qwen3-Reranker's judgement prompt (its model card's format), the answer opened after an empty thinking block
JUDGE_SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
                'Note that the answer can only be "yes" or "no".')
JUDGE_MARKERS = ("<|im_start|>", "<|im_end|>")      # ChatML's, which the model's vocabulary must have as specials


def judgement_prompt(query: str, document: str, instruction: str) -> str:
    return (f"<|im_start|>system\n{JUDGE_SYSTEM}<|im_end|>\n<|im_start|>user\n<Instruct>: {instruction}\n"
            f"<Query>: {query}\n<Document>: {document}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


def owns(path: str) -> bool:
    """OpenAI's error shape on every route here, those outside /v1/ too."""
    return path in PATHS


error_body = routes_openai.error_body


async def _read(request: web.Request, model_type: type):
    """(engine, the body validated as model_type), its model the served one (a LoRA adapter does not embed)."""
    r = await api.read_body(request, model_type)
    engine = await engine_for(request, r.model)
    if adapter_of(engine, r.model) is not None:
        raise ValidationError(f"{r.model!r} is a LoRA adapter; embeddings, rerank and score are the model's own "
                              f"({engine.model_name!r})", param="model")
    return engine, r


# --- embeddings -----------------------------------------------------------------------------------------------------

async def embeddings(request: web.Request) -> web.Response:
    engine, r = await _read(request, EmbeddingRequest)
    embedding_of(engine)
    check_dimensions(engine, r.dimensions)
    inputs = r.inputs()
    ids = [input_ids(engine, value, "input" if len(inputs) == 1 else f"input[{k}]", last=r.truncate_prompt_tokens)
           for k, value in enumerate(inputs)]
    vectors = [shorten(v, r.dimensions) for v in await embed(engine, ids)]
    encode = _base64 if r.encoding_format == "base64" else _floats
    num_tokens = sum(map(len, ids))
    return web.json_response({
        "id": "embd-" + uuid.uuid4().hex[:24], "object": "list", "created": int(time.time()), "model": r.model,
        "data": [{"object": "embedding", "index": k, "embedding": encode(v)} for k, v in enumerate(vectors)],
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})


def _floats(vector: np.ndarray) -> list:
    return np.asarray(vector, np.float32).tolist()          # (each float32 exactly: it round-trips through JSON)


def _base64(vector: np.ndarray) -> str:
    """The vector as the openai SDK decodes it: little-endian float32 bytes, base64."""
    return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")


# --- scoring --------------------------------------------------------------------------------------------------------

def check_ranks(engine) -> None:
    """A model that can rank: a reranker (score_method yes_no), an embedding model, or a model whose pooling is
    declared (its files' sentence-transformers config, or model_config.pooling). A chat model's hidden states'
    average is no ranking (it put "taxes" above "a cat" for "pets"): its rerank and score are a 400 saying what to
    load instead."""
    spec = engine.embedding
    if engine.score_method == "yes_no" or not engine.generates or (spec is not None and spec.source != "default"):
        return
    raise ValidationError(
        f"model {engine.model_name!r} is a chat model: its embeddings are its hidden states' average, which ranks "
        "poorly. Serve an embedding model (all-MiniLM-L6-v2, bge, Qwen3-Embedding) or a reranker (Qwen3-Reranker) "
        "beside it (--model again, or serving_config.models) and name it in 'model'; or start this one with "
        "--set model_config.pooling=mean to rank by its average anyway", param="model")


async def score_pairs(engine, pairs: list, instruction, fields: tuple) -> tuple:
    """([relevance of each (query, document) pair], tokens read) by the model's score_method; `fields`: the body's
    names of the queries and the documents (errors name them)."""
    check_ranks(engine)
    if engine.score_method == "yes_no":
        return await _judged(engine, pairs, instruction or DEFAULT_INSTRUCTION, fields[1])
    return await _similarity(engine, pairs, fields)


async def _similarity(engine, pairs: list, fields: tuple) -> tuple:
    """The cosine of each pair's embeddings; each distinct text embedded once."""
    embedding_of(engine)
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))
    one_query = len({query for query, _ in pairs}) == 1
    names: dict = {}                    # each text's place in the body, for errors
    for k, (query, document) in enumerate(pairs):
        names.setdefault(query, fields[0] if one_query else f"{fields[0]}[{k}]")
        names.setdefault(document, f"{fields[1]}[{k}]")
    ids = [input_ids(engine, t, names[t]) for t in texts]
    vectors = dict(zip(texts, await embed(engine, ids)))
    scores = [float(np.dot(vectors[q], vectors[d])) for q, d in pairs]
    return scores, sum(map(len, ids))


def _answer_ids(engine) -> tuple:
    """(no, yes): the single tokens a yes_no reranker answers with, or a 400 when the vocabulary lacks them (or the
    ChatML markers of its prompt as special tokens)."""
    tok = engine.tokenizer
    for marker in JUDGE_MARKERS:
        ids = tok.encode(marker, add_bos=False)
        if len(ids) != 1 or not tok.is_special(ids[0]):
            raise ValidationError(f"score_method yes_no needs the model's vocabulary to have {marker} as a special "
                                  "token (Qwen3-Reranker's ChatML judgement prompt); this one does not",
                                  param="model")
    answers = []
    for word in ("no", "yes"):
        ids = tok.encode(word, add_bos=False)
        if len(ids) != 1:
            raise ValidationError(f"score_method yes_no needs {word!r} to be a single token of the model's "
                                  f"vocabulary; it is {len(ids)} tokens here", param="model")
        answers.append(ids[0])
    return tuple(answers)


async def _judged(engine, pairs: list, instruction: str, field: str) -> tuple:
    """P("yes") of each pair's judgement prompt: one token, greedy among "no" and "yes", all submitted together."""
    no_id, yes_id = _answer_ids(engine)
    prompts = []
    for k, (query, document) in enumerate(pairs):
        ids = engine.tokenizer.encode(judgement_prompt(query, document, instruction), add_bos=True)
        if len(ids) >= engine.max_model_len:
            raise ValidationError(f"{field}[{k}]: its judgement prompt has {len(ids)} tokens; this model takes at "
                                  f"most {engine.max_model_len - 1} (one token answers)", param=field)
        prompts.append(ids)
    reqs = []
    try:
        for ids in prompts:
            reqs.append(engine.submit(ids, SamplingParams(max_new_tokens=1, temperature=0.0,
                                                          allowed_token_ids=(no_id, yes_id))))
            access_log.track(reqs[-1:])
        scores = []
        for req in reqs:
            event = await final_event(req)
            p = math.exp(event.logprob)
            scores.append(p if event.token_id == yes_id else 1.0 - p)
        return scores, sum(map(len, prompts))
    finally:
        for req in reqs:
            engine.release(req)


async def rerank(request: web.Request) -> web.Response:
    """Jina's /v1/rerank and /rerank (each result's document unless return_documents is false); Cohere's /v2/rerank
    (its document only when return_documents is true)."""
    engine, r = await _read(request, CohereRerankRequest if request.path == "/v2/rerank" else RerankRequest)
    documents = r.texts()
    scores, num_tokens = await score_pairs(engine, [(r.query, d) for d in documents], r.instruction,
                                           ("query", "documents"))
    order = sorted(range(len(documents)), key=lambda k: -scores[k])[:r.top_n or None]
    results = [{"index": k, "relevance_score": scores[k],
                **({"document": {"text": documents[k]}} if r.return_documents else {})} for k in order]
    return web.json_response({"id": "rerank-" + uuid.uuid4().hex[:24], "model": r.model or engine.model_name,
                              "usage": {"total_tokens": num_tokens}, "results": results})


async def score(request: web.Request) -> web.Response:
    engine, r = await _read(request, ScoreRequest)
    scores, num_tokens = await score_pairs(engine, r.pairs(), r.instruction, ("text_1", "text_2"))
    return web.json_response({
        "id": "score-" + uuid.uuid4().hex[:24], "object": "list", "created": int(time.time()),
        "model": r.model or engine.model_name,
        "data": [{"index": k, "object": "score", "score": s} for k, s in enumerate(scores)],
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0}})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/embeddings", embeddings)
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.router.add_post(path, rerank)
    for path in ("/score", "/v1/score"):
        app.router.add_post(path, score)
