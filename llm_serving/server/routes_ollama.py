"""Ollama's API: `POST /api/chat` and `POST /api/generate` (NDJSON lines by default, one JSON object with
"stream": false), `GET /api/tags`, `POST /api/show`, `GET /api/ps`, `GET /api/version`, `POST /api/embed` and the
older `POST /api/embeddings` (server/embedding.py, as OpenAI's /v1/embeddings).

Requests go through translate.prepare and generation as every API's do; chat replies (and generate's through the
template) are read by server/reply.py: reasoning as `thinking`, tool calls as `message.tool_calls` with their
arguments as objects. Errors are Ollama's `{"error": message}` with the HTTP status (404 "model 'x' not found");
a stream that fails midway ends with an `{"error"}` line. The one model is loaded from start to stop, so
`keep_alive` changes nothing and a request with no prompt (Ollama's "load the model") is done at once."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Optional

from aiohttp import web

from llm_serving.server.api import base as api
from llm_serving.server.api.ollama import (DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P, ChatRequest,
                                           EmbeddingsRequest, EmbedRequest, GenerateRequest, ShowRequest)
from llm_serving.server.embedding import check_dimensions, embed, embedding_of, input_ids, shorten
from llm_serving.server.errors import ModelNotFoundError, ValidationError
from llm_serving.server.generation import events, submit
from llm_serving.config import ConfigError, parse_duration
from llm_serving.master.fleet import UnknownModelError
from llm_serving.server.served import LOAD_WAIT, engine_for, fleet_of
from llm_serving.server.model_facts import ModelFacts, parameter_size, read_facts
from llm_serving.server.reply import ReplyShape, ReplyStream, read_reply, reply_shape
from llm_serving.server.tools import serves_tools
from llm_serving.server.translate import prepare

# an Ollama release whose API this serves (think, tool_name): clients compare /api/version with Ollama's releases
# to decide what they may send (VS Code wants 0.6.4 or later), so it is that number, not llm-serving's
OLLAMA_VERSION = "0.12.0"
NEVER = "2318-01-01T00:00:00Z"          # /api/ps's expires_at: the model never unloads (Ollama's keep_alive -1 date)
FACTS = web.AppKey("ollama_model_facts", dict)      # the served model's path -> its ModelFacts, read once
NDJSON = "application/x-ndjson"


def owns(path: str) -> bool:
    """Ollama's error shape: every path under /api/."""
    return path.startswith("/api/")


def error_body(status: int, message: str, kind: str, param=None) -> dict:
    return {"error": message}


def untagged(name: str, known) -> str:
    """Ollama's X:latest as X, where `known` holds X (and not X:latest); any other name as it is."""
    bare = name[:-len(":latest")] if name.endswith(":latest") else None
    return bare if bare is not None and name not in known and bare in known else name


def served_name(engine, name: str) -> str:
    """The served model or LoRA adapter a request names (X or X:latest reach X), or a 404 in Ollama's words."""
    served = engine.served_models()
    name = untagged(name, served)
    if name in served:
        return name
    raise ModelNotFoundError(f"model '{name}' not found")


def tagged(name: str) -> str:
    """A name as Ollama lists it: with its tag, :latest when it has none."""
    return name if ":" in name else name + ":latest"


def created_at(when: Optional[float] = None) -> str:
    """RFC 3339 in UTC: now, or a unix time."""
    moment = datetime.now(timezone.utc) if when is None else datetime.fromtimestamp(when, timezone.utc)
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")


def ollama_calls(calls: list, first_index: int = 0) -> list:
    """Tool calls in OpenAI's shape (arguments as JSON text) in Ollama's: {id, function: {index, name, arguments
    (an object)}}; `first_index`: the reply's calls before these."""
    return [{"id": c["id"], "function": {"index": first_index + k, "name": c["function"]["name"],
                                         "arguments": json.loads(c["function"]["arguments"])}}
            for k, c in enumerate(calls)]


def metrics(req, started: float, now: float, load_s: float = 0.0) -> dict:
    """Ollama's counts and durations (ns) of a finished request, from time.monotonic() times: `started` when the
    route took it, `now` as it answers; `load_s`: what it waited for its model to load (load_duration)."""
    end = req.finish_time or now
    first = req.first_token_time or end

    def ns(seconds: float) -> int:
        return max(int(seconds * 1e9), 0)
    return {"total_duration": ns(now - started), "load_duration": ns(load_s), "prompt_eval_count": len(req.prompt_ids),
            "prompt_eval_duration": ns(first - req.arrival_time), "eval_count": len(req.output_ids),
            "eval_duration": ns(end - first)}


def token_logprob(event, tokenizer) -> dict:
    """A reply token's log-probability in Ollama's shape, with its likeliest alternatives when asked for."""
    entry = {"token": event.text, "logprob": event.logprob, "bytes": list(event.text.encode())}
    if event.top:
        texts = [(tokenizer.token_text(i), lp) for i, lp in event.top]
        entry["top_logprobs"] = [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in texts]
    return entry


@dataclass(frozen=True)
class Lines:
    """One reply's lines: chat's carry `message` {role, content, thinking?, tool_calls?}, generate's `response`
    (and `thinking`); `model` as the request named it."""
    model: str
    chat: bool

    def piece(self, content: str = "", thinking: str = "", calls: list = (), first_call: int = 0,
              logprobs: Optional[list] = None) -> dict:
        if self.chat:
            message = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = ollama_calls(calls, first_call)
            body = {"message": message}
        else:
            body = {"response": content, **({"thinking": thinking} if thinking else {})}
        line = {"model": self.model, "created_at": created_at(), **body, "done": False}
        if logprobs is not None:
            line["logprobs"] = logprobs
        return line

    def done(self, reason: str, counts: dict, **piece) -> dict:
        """The last line (or the whole reply): done, why ("stop", "length", "load"; "abort" when the server
        ended it) and the counts."""
        return {**self.piece(**piece), "done": True, "done_reason": reason, **counts}


def _ndjson(line: dict) -> bytes:
    return (json.dumps(line, ensure_ascii=False) + "\n").encode()


async def _loaded(request: web.Request, lines: Lines, stream: bool) -> web.StreamResponse:
    """Ollama's answer to a request with nothing to generate: the model is loaded (it always is)."""
    line = lines.done("load", {})
    if not stream:
        return web.json_response(line)
    return web.Response(body=_ndjson(line), content_type=NDJSON)


async def _answer(request: web.Request, engine, prepared, shape: ReplyShape, lines: Lines, r, started: float):
    """Run the prepared request and write its reply: NDJSON lines as the tokens come, or one object."""
    reqs = await submit(engine, prepared, 1)
    req, tokenizer = reqs[0], engine.tokenizer
    want_logprobs = bool(r.logprobs)
    try:
        if not r.streams:
            texts, logprobs, final = [], [], None
            async for _, event, _ in events(reqs):
                texts.append(event.text)
                if want_logprobs and event.token_id >= 0:
                    logprobs.append(token_logprob(event, tokenizer))
                final = event
            if final.finish_reason == "error":
                return web.json_response({"error": final.error or "generation failed"}, status=500)
            reasoning, content, calls = read_reply("".join(texts), shape)
            return web.json_response(lines.done(final.finish_reason, metrics(req, started, time.monotonic(),
                                                                             request.get(LOAD_WAIT, 0.0)),
                                                content=content or "", thinking=reasoning or "", calls=calls,
                                                logprobs=logprobs if want_logprobs else None))

        response = web.StreamResponse(headers={"Content-Type": NDJSON, "Cache-Control": "no-cache"})
        await response.prepare(request)
        reply, pending, logprobs = ReplyStream(shape), [], []
        async for _, event, more in events(reqs):
            if event.finish_reason == "error":
                pending.append(_ndjson({"error": event.error or "generation failed"}))
                break
            if want_logprobs and event.token_id >= 0:
                logprobs.append(token_logprob(event, tokenizer))
            thought, text, found = reply.push(event.text)        # (held back while a tag may be starting)
            if event.finish_reason is not None:
                more_thought, rest, more_calls = reply.flush()
                thought, text, found = thought + more_thought, text + rest, found + more_calls
            if text or thought or found:
                pending.append(_ndjson(lines.piece(text, thought, found, len(reply.calls) - len(found),
                                                   logprobs if want_logprobs else None)))
                logprobs = []
            if event.finish_reason is not None:
                pending.append(_ndjson(lines.done(event.finish_reason, metrics(req, started, time.monotonic(),
                                                                                      request.get(LOAD_WAIT, 0.0)),
                                                  logprobs=logprobs if want_logprobs else None)))
            if pending and not more:
                await response.write(b"".join(pending))
                pending.clear()
        if pending:
            await response.write(b"".join(pending))
        await response.write_eof()
        return response
    finally:
        engine.release(req)             # a client that went away frees its request


def _check_think(engine, r) -> None:
    """Ollama refuses `think` on a model that does not reason."""
    template = engine.chat_template
    if r.think and not (template.reasons or template.harmony):
        raise ValidationError(f"model '{r.model}' does not support thinking", param="think")


async def _serve(request: web.Request, body_type: type) -> web.StreamResponse:
    """/api/chat or /api/generate: the body validated, an empty one answered as Ollama's "load", the rest prepared
    and answered line by line. A raw prompt's reply (generate's raw) is read as it is."""
    started = time.monotonic()
    r = await api.read_body(request, body_type)
    engine = await _engine(request, r.model, r.keep_alive)
    model, lines = served_name(engine, r.model), Lines(r.model, chat=body_type is ChatRequest)
    if r.loads_only:
        return await _loaded(request, lines, r.streams)
    _check_think(engine, r)
    prepared = prepare(r.to_request(model), engine)
    shape = ReplyShape() if getattr(r, "raw", False) else reply_shape(engine, prepared)
    return await _answer(request, engine, prepared, shape, lines, r, started)


async def chat(request: web.Request) -> web.StreamResponse:
    return await _serve(request, ChatRequest)


async def generate(request: web.Request) -> web.StreamResponse:
    return await _serve(request, GenerateRequest)


# --- the served model, described ------------------------------------------------------------------------------------

def details(facts: ModelFacts, parent: str = "") -> dict:
    return {"parent_model": parent, "format": facts.format, "family": facts.family,
            "families": [facts.family] if facts.family else [], "parameter_size": parameter_size(facts.parameter_count),
            "quantization_level": facts.quantization}


async def _engine(request: web.Request, name: str, keep_alive=None):
    """The engine serving Ollama's model name (X or X:latest), loaded first if it is not; a request's keep_alive
    (Ollama's: how long the model stays loaded after it; 0 unloads it once idle) given to the fleet."""
    fleet = fleet_of(request)
    name = untagged(name, fleet.names)
    try:
        engine = await engine_for(request, name)
    except UnknownModelError:
        raise ModelNotFoundError(f"model '{name}' not found") from None
    if keep_alive is not None:
        try:
            fleet.set_keep_alive(engine, parse_duration(keep_alive, -1.0, key="keep_alive"))
        except ConfigError as exc:
            raise ValidationError(str(exc), param="keep_alive") from None
    return engine


async def _facts(app: web.Application, path: str) -> ModelFacts:
    """A checkpoint's facts, its files read once, off the loop."""
    cache = app[FACTS]
    if path not in cache:
        cache[path] = await asyncio.to_thread(read_facts, path)
    return cache[path]


async def _served(app: web.Application, engine) -> list:
    """[(name, its facts, its details)]: the model (its files read once, off the loop), then each LoRA adapter
    (its own files' size and digest, the model's details, the model as its parent)."""
    base = await _facts(app, engine.model_path)
    served = [(engine.model_name, base, details(base))]
    for name, path in engine.lora_paths.items():
        served.append((name, await asyncio.to_thread(read_facts, path), details(base, tagged(engine.model_name))))
    return served


def _listed(name: str, facts: ModelFacts, described: dict) -> dict:
    return {"name": tagged(name), "model": tagged(name), "size": facts.size, "digest": facts.digest,
            "details": described}


async def tags(request: web.Request) -> web.Response:
    """GET /api/tags: every model the server serves, loaded or not, and the loaded ones' LoRA adapters, named as
    Ollama lists models."""
    listed = []
    for name, entry in fleet_of(request).entries.items():
        if entry.state == "loaded":
            listed += await _served(request.app, entry.engine)
        else:
            facts = await _facts(request.app, entry.spec.path)
            listed.append((name, facts, details(facts)))
    return web.json_response({"models": [
        {**_listed(name, facts, described), "modified_at": created_at(facts.modified_at or time.time())}
        for name, facts, described in listed]})


async def ps(request: web.Request) -> web.Response:
    """GET /api/ps: the loaded models (and their adapters), each until when it stays loaded (its keep_alive after
    its last request; Ollama's far date when it stays for good), in the server's memory (size_vram 0)."""
    models = []
    for entry in fleet_of(request).loaded():
        engine, expires = entry.engine, NEVER
        if entry.keep_alive is not None:
            left = entry.last_used + entry.keep_alive - time.monotonic()
            expires = datetime.fromtimestamp(time.time() + max(left, 0), timezone.utc).isoformat()
        models += [{**_listed(name, facts, described), "expires_at": expires, "size_vram": 0,
                    "context_length": engine.max_model_len}
                   for name, facts, described in await _served(request.app, engine)]
    return web.json_response({"models": models})


def capabilities(engine) -> list:
    """What Ollama's clients may ask of the model, in Ollama's sense and order: `embedding` for an embedding model
    (one that does not generate: model_config.task embed, a BERT encoder's; or one whose pooling its files declare,
    sentence-transformers' 1_Pooling, or model_config.pooling sets: Ollama's GGUF pooling_type), which Ollama's clients
    then embed with instead of chatting; else `completion`, `vision` when it takes images (its vision tower
    served), `tools` when a chat with a tool is served
    (`tools.serves_tools`: a template that takes them, or any that takes a system message, where they are described,
    and the prompt fits the context; the calls are parsed either way), `thinking` when it reasons (`<think>`,
    harmony)."""
    spec = engine.embedding
    if not engine.generates or (spec is not None and spec.source != "default"):
        return ["embedding"]
    template = engine.chat_template
    return ["completion"] + (["vision"] if getattr(engine, "image_facts", None) is not None else []) + \
        (["tools"] if serves_tools(template, engine.max_model_len) else []) + \
        (["thinking"] if template.reasons or template.harmony else [])


async def show(request: web.Request) -> web.Response:
    """POST /api/show: the model's template (its Jinja source: "" for the built-in LLaMA-2 format), the defaults
    requests start from, details, GGUF-style model_info (its context_length the served one) and capabilities."""
    r = await api.read_body(request, ShowRequest)
    engine = await _engine(request, r.named)
    name = served_name(engine, r.named)
    facts, described = next((f, d) for n, f, d in await _served(request.app, engine) if n == name)
    base_facts = request.app[FACTS][engine.model_path]
    info = dict(base_facts.info)
    if base_facts.family:
        info[f"{base_facts.family}.context_length"] = engine.max_model_len
    template = engine.chat_template.text or ""
    parameters = (f"temperature {DEFAULT_TEMPERATURE}\ntop_k {DEFAULT_TOP_K}\ntop_p {DEFAULT_TOP_P}\n"
                  f"num_ctx {engine.max_model_len}")
    modelfile = [f"# the Modelfile of {tagged(name)} as llm-serving serves it", f"FROM {engine.model_path}"]
    if name != engine.model_name:
        modelfile.append(f"ADAPTER {engine.lora_paths[name]}")
    if template:
        modelfile.append(f'TEMPLATE """{template}"""')
    modelfile += [f"PARAMETER {line}" for line in parameters.splitlines()]
    return web.json_response({"modelfile": "\n".join(modelfile) + "\n", "parameters": parameters,
                              "template": template, "details": described, "model_info": info,
                              "capabilities": capabilities(engine),
                              "modified_at": created_at(facts.modified_at or engine.start_time)})


# --- embeddings -----------------------------------------------------------------------------------------------------

def _embedding_model(engine, name: str) -> str:
    """The served model a request to embed names (a LoRA adapter does not embed)."""
    served = served_name(engine, name)
    if served != engine.model_name:
        raise ValidationError(f"model '{name}' is a LoRA adapter; embeddings are the model's own "
                              f"('{engine.model_name}')", param="model")
    return served


async def embed_route(request: web.Request) -> web.Response:
    """POST /api/embed: {model, embeddings: [[...]], total_duration, load_duration, prompt_eval_count}; `truncate`
    (default true) cuts an input to the context's first tokens, false refuses a longer one."""
    started = time.monotonic()
    r = await api.read_body(request, EmbedRequest)
    engine = await _engine(request, r.model, r.keep_alive)
    _embedding_model(engine, r.model)
    texts = r.inputs()
    vectors, num_tokens = [], 0
    if texts:                           # (none: Ollama's "load the model")
        embedding_of(engine)
        check_dimensions(engine, r.dimensions)
        ids = [input_ids(engine, t, "input" if isinstance(r.input, str) else f"input[{k}]",
                         fit=r.truncate is not False) for k, t in enumerate(texts)]
        vectors = [shorten(v, r.dimensions).tolist() for v in await embed(engine, ids)]
        num_tokens = sum(map(len, ids))
    return web.json_response({"model": r.model, "embeddings": vectors,
                              "total_duration": max(int((time.monotonic() - started) * 1e9), 0),
                              "load_duration": max(int(request.get(LOAD_WAIT, 0.0) * 1e9), 0),
                              "prompt_eval_count": num_tokens})


async def embeddings_route(request: web.Request) -> web.Response:
    """POST /api/embeddings (Ollama's older route): {embedding: [...]} of `prompt` (normalized here, as /api/embed's;
    an empty prompt: []), a prompt longer than the context a 400."""
    r = await api.read_body(request, EmbeddingsRequest)
    engine = await _engine(request, r.model, getattr(r, "keep_alive", None))
    _embedding_model(engine, r.model)
    if not r.prompt:
        return web.json_response({"embedding": []})
    embedding_of(engine)
    [vector] = await embed(engine, [input_ids(engine, r.prompt, "prompt")])
    return web.json_response({"embedding": vector.tolist()})


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": OLLAMA_VERSION})


def add_routes(app: web.Application) -> None:
    app[FACTS] = {}
    app.router.add_post("/api/chat", chat)
    app.router.add_post("/api/generate", generate)
    app.router.add_get("/api/tags", tags)
    app.router.add_post("/api/show", show)
    app.router.add_get("/api/ps", ps)
    app.router.add_get("/api/version", version)
    app.router.add_post("/api/embed", embed_route)
    app.router.add_post("/api/embeddings", embeddings_route)
