"""llm-serving / TGI generate routes: `/models/{model}/generate[_stream]`, `/generate[_stream]`, and TGI's `POST /`."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from aiohttp import web

from llm_serving.server import access_log, streaming
from llm_serving.server.api import base as api
from llm_serving.server.api.tgi import GenerateRequest
from llm_serving.server.errors import ModelNotFoundError, ValidationError
from llm_serving.server.image_urls import fetch_images
from llm_serving.server.served import engine_for, fleet_of
from llm_serving.server.translate import prepare, request_id

# Clients may name their request (to abort it by id); the server echoes the id it used in responses.
REQUEST_ID_HEADER = "X-Request-Id"

logger = logging.getLogger(__name__)


@dataclass
class _Generate:
    """A generate request as its route answers it."""
    inputs: str
    sampling: object               # SamplingParams
    stream: bool
    return_full_text: bool
    details: bool
    compiled: object = None        # its grammar's matcher (Engine.compile_grammar), once compiled


async def _read_request(request: web.Request, stream_default: bool):
    """(engine, the request, what `prepare` made of it (its prompt ids, images, LoRA adapter or None), its request
    id): the path's model (the base model or an adapter's name) or TGI's parameters.adapter_id picks the
    adapter."""
    model = request.match_info.get("model")
    engine = await engine_for(request, model)       # (the path's model, or the default: TGI's /generate names none)
    if model is not None and model not in engine.served_models():
        raise ModelNotFoundError(f"model {model!r} is not served here; this server serves "
                                 f"{', '.join(map(repr, engine.served_models()))}")
    r = await api.read_body(request, GenerateRequest, unknown="parameter")
    adapter_id = r.parameters.adapter_id
    if adapter_id is not None:
        if adapter_id not in engine.lora_paths:
            raise ModelNotFoundError(f"LoRA adapter {adapter_id!r} (parameters.adapter_id) is not served here; "
                                     f"adapters: {', '.join(map(repr, engine.lora_paths)) or 'none'}")
        if model is not None and model != engine.model_name and model != adapter_id:
            raise ValidationError(f"parameters.adapter_id {adapter_id!r} differs from the path's model {model!r}")
        model = adapter_id
    api_request = r.to_request(stream_default, model, takes_images=engine.image_facts is not None)
    await fetch_images(api_request, engine.config)
    prepared = prepare(api_request, engine)
    req_id = request_id(request.headers.get(REQUEST_ID_HEADER))
    gen = _Generate(r.inputs, prepared.sampling, api_request.stream, r.parameters.return_full_text,
                    r.parameters.details)
    if gen.sampling.grammar is not None:        # compiled off the event loop, then copied into the request
        gen.compiled = await engine.compile_grammar(gen.sampling.grammar)
    return engine, gen, prepared, req_id


async def generate(request: web.Request) -> web.StreamResponse:
    engine, gen, prepared, req_id = await _read_request(request, stream_default=False)
    req = engine.submit(prepared.prompt_ids, gen.sampling, req_id=req_id, adapter=prepared.adapter,
                        grammar=gen.compiled, images=prepared.images)
    access_log.track([req])
    try:
        if gen.stream:
            return await _stream(request, engine, req, gen)
        text, tops, tokens = [], [], []
        while True:
            event = await req.events.get()
            text.append(event.text)
            if event.token_id >= 0 and gen.details:
                tokens.append(streaming.token_details(event, engine.tokenizer))
            if event.token_id >= 0 and gen.sampling.top_logprobs:
                tops.append(streaming.top_tokens(event, engine.tokenizer))
            if event.finish_reason is not None:
                break
        if event.finish_reason == "error":
            return web.json_response(streaming.failed_body(req, event.error or "generation failed"), status=500,
                                     headers={REQUEST_ID_HEADER: req.req_id})
        generated = "".join(text)
        if gen.return_full_text:
            generated = gen.inputs + generated
        details = streaming.details(req, event.finish_reason, event.error)
        if gen.details:
            details["tokens"] = tokens            # per generated token, as TGI
        if gen.sampling.prompt_logprobs is not None:
            details["prefill"] = streaming.prefill_details(req, engine.tokenizer)
        if gen.sampling.top_logprobs:
            details["top_tokens"] = tops          # per generated token, as TGI
        return web.json_response({"generated_text": generated, "details": details},
                                 headers={REQUEST_ID_HEADER: req.req_id})
    finally:
        engine.release(req)  # no-op when finished; frees the blocks of a client that went away


async def generate_stream(request: web.Request) -> web.StreamResponse:
    engine, gen, prepared, req_id = await _read_request(request, stream_default=True)
    gen.stream = True
    req = engine.submit(prepared.prompt_ids, gen.sampling, req_id=req_id, adapter=prepared.adapter,
                        grammar=gen.compiled, images=prepared.images)
    access_log.track([req])
    try:
        return await _stream(request, engine, req, gen)
    finally:
        engine.release(req)


async def abort(request: web.Request) -> web.Response:
    """POST /abort/{request_id}: end a request in flight (its client gets finish_reason "abort")."""
    req_id = request.match_info["request_id"]
    engines = [engine for _, engine in fleet_of(request).engines()]
    if not any(engine.abort(req_id, reason="aborted through /abort") for engine in engines):
        return web.json_response(streaming.error_body(f"no request {req_id!r} in flight", "not_found"), status=404)
    return web.json_response({"request_id": req_id, "aborted": True})


async def _stream(request: web.Request, engine, req, gen) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           REQUEST_ID_HEADER: req.req_id})
    await response.prepare(request)
    text = [gen.inputs] if gen.return_full_text else []
    profile = engine.profile
    pending = []                  # events that came together (a decode run, a verify step): one write
    final = False
    while not final:
        event = await req.events.get()
        t0 = time.perf_counter()
        text.append(event.text)
        final = event.finish_reason is not None
        if event.finish_reason == "error":
            body = streaming.failed_body(req, event.error or "generation failed")
        else:
            body = streaming.token_event(event, "".join(text) if final else None, req, engine.tokenizer)
        pending.append(streaming.sse(body))
        if final or req.events.empty():
            await response.write(b"".join(pending))
            pending.clear()
        profile["stream"] += time.perf_counter() - t0
    await response.write_eof()
    return response


def error_body(status: int, message: str, kind: str, param=None) -> dict:
    """llm-serving's / TGI's error shape: the message and its kind."""
    return streaming.error_body(message, kind)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/", generate)         # TGI's compatibility route: generate, or a stream with "stream": true
    app.router.add_post("/models/{model}/generate", generate)
    app.router.add_post("/models/{model}/generate_stream", generate_stream)
    app.router.add_post("/generate", generate)
    app.router.add_post("/generate_stream", generate_stream)
    app.router.add_post("/abort/{request_id}", abort)
