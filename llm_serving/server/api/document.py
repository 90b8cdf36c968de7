"""The server's OpenAPI 3.1 document (GET /openapi.json), its request bodies the models the routes validate with.

What only the served model knows (its names, its vocabulary, its context) is marked in the models' fields (api.base:
SERVED_MODEL, TOKEN_ID, ...): the document of a serving server makes each mark an enum or a bound, so that a client
or a fuzzer reading it sends what the server takes."""
from __future__ import annotations

import json
import re
from typing import Optional, Sequence

from aiohttp import web
from pydantic.json_schema import models_json_schema

from llm_serving.master.fleet import STATES as MODEL_STATES
from llm_serving.server.apis import APIS, ERROR_SHAPES, error_shape
from llm_serving.server.keys import UNKNOWN_FIELDS
from llm_serving.server.served import default_engine, fleet_of

# the server's own operations without a body (each API's are its module's in server/api/: apis.APIS)
GETS = [("/health", "200 when the engine serves"), ("/info", "the served model and limits (TGI's)"),
        ("/v1/models", "the served model and its LoRA adapters"), ("/metrics", "Prometheus metrics"),
        ("/stats", "the engine's counters"), ("/openapi.json", "this document")]
_TEXT, _TEXT_OR_NULL = {"type": "string"}, {"type": ["string", "null"]}

# the JSON replies of some routes (routes_openai.py writes them); a streamed one is text/event-stream
STREAMED = {"/v1/completions", "/v1/chat/completions"}
_COUNT = {"type": "integer", "minimum": 0}
_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
          "properties": {"prompt_tokens": _COUNT, "completion_tokens": _COUNT, "total_tokens": _COUNT}}


def _completion(kind: str, choice: dict) -> dict:
    """An OpenAI completion object whose choices have the fields of `choice` ({field: schema})."""
    choice = {"index": _COUNT, "finish_reason": {"enum": ["stop", "length", "tool_calls", "abort"]},
              "logprobs": {"type": ["object", "null"]}, **choice}
    return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"], "properties": {
        "id": _TEXT, "object": {"const": kind}, "created": _COUNT, "model": _TEXT, "usage": _USAGE,
        "choices": {"type": "array", "minItems": 1,
                    "items": {"type": "object", "required": list(choice), "properties": choice}}}}


_NUMBER = {"type": "number"}
_RERANK = {"type": "object", "required": ["id", "model", "usage", "results"], "properties": {
    "id": _TEXT, "model": _TEXT, "usage": {"type": "object", "required": ["total_tokens"],
                                           "properties": {"total_tokens": _COUNT}},
    "results": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["index", "relevance_score"],
        "properties": {"index": _COUNT, "relevance_score": _NUMBER,
                       "document": {"type": "object", "required": ["text"], "properties": {"text": _TEXT}}}}}}}
_SCORE = {"type": "object", "required": ["id", "object", "created", "model", "data", "usage"], "properties": {
    "id": _TEXT, "object": {"const": "list"}, "created": _COUNT, "model": _TEXT, "usage": _USAGE,
    "data": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["index", "object", "score"],
        "properties": {"index": _COUNT, "object": {"const": "score"}, "score": _NUMBER}}}}}

REPLIES = {
    "/v1/completions": _completion("text_completion", {"text": _TEXT}),
    "/v1/chat/completions": _completion("chat.completion", {"message": {
        "type": "object", "required": ["role", "content"],
        "properties": {"role": {"const": "assistant"}, "content": _TEXT_OR_NULL, "reasoning_content": _TEXT,
                       "tool_calls": {"type": "array", "minItems": 1}}}}),
    "/tokenize": {"type": "object", "required": ["count", "max_model_len", "tokens", "token_strs"], "properties": {
        "count": _COUNT, "max_model_len": _COUNT, "tokens": {"type": "array", "items": _COUNT},
        "token_strs": {"type": ["array", "null"], "items": _TEXT}}},
    "/detokenize": {"type": "object", "required": ["prompt"], "properties": {"prompt": _TEXT}},
    "/v1/models": {"type": "object", "required": ["object", "data"], "properties": {
        "object": {"const": "list"}, "data": {"type": "array", "minItems": 1, "items": {
            # (a model not loaded says its state, and its load's error if it failed; a loaded one what it serves)
            "type": "object", "required": ["id", "object", "owned_by", "state"],
            "properties": {"id": _TEXT, "object": {"const": "model"}, "max_model_len": _COUNT,
                           "state": {"enum": list(MODEL_STATES)}, "error": _TEXT,
                           "created": {"type": ["integer", "null"]}, "size_bytes": _COUNT,
                           "embedding": {"anyOf": [{"type": "null"}, {
                               "type": "object", "required": ["pooling", "dimensions"],
                               "properties": {"pooling": {"enum": ["mean", "last", "cls"]}, "dimensions": _COUNT}}]},
                           "score_method": {"enum": ["yes_no", "similarity", None]}}}}}},
    "/v1/embeddings": {"type": "object", "required": ["object", "model", "data", "usage"], "properties": {
        "object": {"const": "list"}, "model": _TEXT,
        "data": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["object", "index", "embedding"],
            "properties": {"object": {"const": "embedding"}, "index": _COUNT,
                           "embedding": {"anyOf": [{"type": "array", "items": _NUMBER, "minItems": 1}, _TEXT]}}}},
        "usage": {"type": "object", "required": ["prompt_tokens", "total_tokens"],
                  "properties": {"prompt_tokens": _COUNT, "total_tokens": _COUNT}}}},
    "/score": _SCORE,
    "/v1/score": _SCORE,
    "/api/embed": {"type": "object", "required": ["model", "embeddings", "prompt_eval_count"], "properties": {
        "model": _TEXT, "embeddings": {"type": "array", "items": {"type": "array", "items": _NUMBER, "minItems": 1}},
        "total_duration": _COUNT, "load_duration": _COUNT, "prompt_eval_count": _COUNT}},
    "/api/embeddings": {"type": "object", "required": ["embedding"],
                        "properties": {"embedding": {"type": "array", "items": _NUMBER}}},
    **{path: _RERANK for path in ("/v1/rerank", "/rerank", "/v2/rerank")},
}


def openapi(version: str, models: Sequence[str] = (), vocab_size: Optional[int] = None,
            max_model_len: Optional[int] = None, dimensions: Optional[Sequence[int]] = None,
            closed: bool = False) -> dict:
    """The OpenAPI 3.1 document of the HTTP API, its request bodies from the API models. A serving server gives what
    it serves: `models` (the model's name, then its LoRA adapters'), the vocabulary's size, the context's length and
    the widths its embeddings may be asked for (`dimensions`, ascending: the model's own last); without them the
    fields that name or count them stay as open as their models. `closed` (serving_config.unknown_fields reject):
    the bodies take no field they do not name (additionalProperties false); else unknown fields are ignored, and
    the document says so by leaving them open."""
    routes = [(api, route) for api in APIS for route in api.bodies.ROUTES]
    refs, defs = models_json_schema([(m, "validation") for m in dict.fromkeys(m for _, (_, m, _) in routes)],
                                    ref_template="#/components/schemas/{model}")
    model_names = {"type": "string", **({"enum": list(models)} if models else {})}
    paths: dict = {}
    for api, (path, model, summary) in routes:
        op = {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {
            "schema": refs[(model, "validation")]}}},
              "responses": {"200": _reply(path, "the reply (text/event-stream when streamed)"),
                            **_errors(api.error.name)}}
        if "{model}" in path:
            op["parameters"] = [{"name": "model", "in": "path", "required": True, "schema": model_names}]
        paths[path] = {"post": op}
    others = [("get", path, summary, error_shape(path).name) for path, summary in GETS]
    others += [(*op, api.error.name) for api in APIS for op in getattr(api.bodies, "OPERATIONS", ())]
    for method, path, summary, error in others:
        op = {"summary": summary, "responses": {"200": _reply(path, summary), **_errors(error)}}
        names = [part[1:-1] for part in path.split("/") if part.startswith("{")]
        if names:
            op["parameters"] = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
                                for n in names]
        paths.setdefault(path, {})[method] = op
    doc = {"openapi": "3.1.0", "info": {"title": "llm-serving", "version": version}, "paths": paths,
           "components": {"schemas": {**defs.get("$defs", {}), **{e.name: e.schema for e in ERROR_SHAPES}}}}
    _resolve(doc, _served(models, vocab_size, max_model_len, dimensions))
    # two APIs' models of one name (a ToolCall in OpenAI's and Ollama's) are told apart by their module, which
    # pydantic spells as a path: named by their API instead (OllamaToolCall)
    names = {api.bodies.__name__.rsplit(".", 1)[1]: api.name for api in APIS}
    text = re.sub(r"llm_serving__server__api__([a-z]+)__(\w+)", lambda m: names.get(m[1], m[1].title()) + m[2],
                  json.dumps(doc))
    return json.loads(text) if closed else _open(json.loads(text))


async def serve(request: web.Request) -> web.Response:
    """GET /openapi.json: the document of what this server serves (its default model's vocabulary and context)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        served = version("llm-serving")
    except PackageNotFoundError:
        served = "0"
    engine, fleet = default_engine(request), fleet_of(request)
    spec = engine.embedding             # the widths a request may ask its embeddings for
    widths = None if spec is None else [d for d in range(1, spec.dimensions + 1) if spec.check_dimensions(d) is None]
    names = engine.served_models() + [n for n in fleet.names if n != engine.model_name]
    closed = getattr(request.app.get(UNKNOWN_FIELDS), "policy", "ignore") == "reject"
    return web.json_response(openapi(served, names, engine.vocab_size, engine.max_model_len, widths, closed))


def _open(node):
    """The document with every `"additionalProperties": false` (a strict body's) left out: unknown fields ignored."""
    if isinstance(node, dict):
        return {k: _open(v) for k, v in node.items() if not (k == "additionalProperties" and v is False)}
    if isinstance(node, list):
        return [_open(v) for v in node]
    return node


def _reply(path: str, description: str) -> dict:
    """A 200 answer: its JSON's schema when REPLIES has it (and a stream's media type, without one)."""
    if path not in REPLIES:
        return {"description": description}
    content = {"application/json": {"schema": REPLIES[path]}}
    if path in STREAMED:
        content["text/event-stream"] = {}
    return {"description": description, "content": content}


def _errors(name: str) -> dict:
    """An operation's error answers (a bad request, a name not served, too many requests), in its API's shape."""
    return {"4XX": {"description": "a request the server refuses: the API's error shape, naming the field",
                    "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}}}


def _served(models: Sequence[str], vocab_size: Optional[int], max_model_len: Optional[int],
            dimensions: Optional[Sequence[int]]) -> dict:
    """Each mark of api.base (its x-served) as the JSON schema keywords it becomes on this server."""
    served: dict = {}
    if dimensions:                  # every width up to the model's (a Matryoshka model without a list): a bound
        widths = list(dimensions)
        served["dimensions"] = {"maximum": widths[-1]} if widths == list(range(1, widths[-1] + 1)) else \
            {"enum": widths}
    if models:
        served.update({"model": {"enum": list(models)}, "adapter": {"enum": list(models[1:])},
                       "ollama-model": {"enum": [*models, *(m + ":latest" for m in models)]},
                       "base-model": {"enum": [models[0]]}, "ollama-base-model": {"enum": [models[0],
                                                                                            models[0] + ":latest"]}})
    if vocab_size:
        served["token-id"] = {"maximum": vocab_size - 1}
    if max_model_len:
        served["new-tokens"] = {"maximum": max_model_len - 1}
    return served


def _resolve(node, served: dict) -> None:
    """Every mark in `node` made its keywords (an enum keeps null for a field that may be null), or dropped."""
    if isinstance(node, list):
        for item in node:
            _resolve(item, served)
    elif isinstance(node, dict):
        keywords = dict(served.get(node.pop("x-served", None), {}))
        if "enum" in keywords and any(branch.get("type") == "null" for branch in node.get("anyOf", ())):
            keywords["enum"] = [*keywords["enum"], None]
        node.update(keywords)
        for value in node.values():
            _resolve(value, served)
