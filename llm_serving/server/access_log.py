"""The access log: one line per HTTP request once its response is done (a streamed one: when its stream has ended,
or its client went away), uvicorn's line with what a serving engineer needs after it:

    127.0.0.1:53422 - "POST /v1/chat/completions HTTP/1.1" 200 OK model=smollm2 prompt_tokens=12 completion_tokens=30 ttft_ms=41 total_ms=390 finish=stop

through the logger `llm_serving.access` (so the process's log format puts its time and level before it). A 4xx or
5xx says why at the end of its line: `error="..."`, the message the client got (read from the error body every API
writes: `{"error": {"message"}}` or `{"error": "..."}`). A client that went away before its response was done is
nginx's 499. `serving_config.access_log: false` turns the log off (the middleware is then not installed).

Fields (each only where it applies): `model` the name the request asked for (a 400 before the route read its model:
the body's `model`); `prompt_tokens` and `completion_tokens` as the reply's usage counts them (a prompt of n choices
once; an embedding's inputs each; a score's judgement prompts each, their one answer token counted as completion,
as is the token a `max_tokens: 0` completion computes and drops, whose usage says 0);
`ttft_ms` from the request's arrival to its first generated token; `load_ms` the time it waited for its model to
load; `total_ms` to the response's end; `finish` the engine's finish reasons (stop, length, abort, error).

Where the numbers come from: `access_middleware` (the outermost of app.py's) gives each HTTP request an `Exchange`
and sets it as the current one (a context variable: the handler runs in the middleware's task, so the routes pass
nothing along); `served.engine_for` names the model (`note_model`) and every engine request made for the HTTP
request is tracked where it is submitted (`track`: generation.submit, embedding.embed, the TGI routes, the yes_no
judgements). The engine's `Request`s carry the rest (prompt and output ids, first token time, finish reason).

Polling: GET /health, /metrics and /stats answered below 400 are logged at DEBUG (LLM_SERVING_LOG_LEVEL=DEBUG shows them),
everything else at INFO. A Kubernetes probe, a Prometheus scrape and the dashboard (three requests a second) would
otherwise bury the requests a user is looking for; when they fail (a 503 /health) they are logged at INFO."""
from __future__ import annotations

import asyncio
import contextvars
import http
import json
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Optional

from aiohttp import web

from llm_serving.server.keys import LOAD_WAIT

logger = logging.getLogger("llm_serving.access")

CLIENT_CLOSED = 499                  # nginx's status for a client that closed its connection before the response
POLLED = frozenset({"/health", "/metrics", "/stats"})
MAX_ERROR_CHARS = 500                # an error message longer than this is cut (a 400 can quote a long value)
MAX_PEEKED_BODY = 1 << 20            # a 4xx body read again for its `model` only up to this size


@dataclass
class Exchange:
    """What one HTTP request did, filled while it is served: the model it named and its engine requests, each
    group one prompt (a group of n choices counts its prompt once)."""
    start: float = field(default_factory=time.monotonic)
    model: Optional[str] = None
    groups: list = field(default_factory=list)

    def usage(self) -> dict:
        """prompt_tokens, completion_tokens, ttft_ms and finish of the tracked engine requests ({} when none)."""
        if not self.groups:
            return {}
        generated = [r for group in self.groups for r in group if r.pooling is None]
        firsts = [r.first_token_time for r in generated if r.first_token_time is not None]
        finishes = list(dict.fromkeys(r.finish_reason for r in generated if r.finish_reason is not None))
        return {"prompt_tokens": sum(len(group[0].prompt_ids) for group in self.groups),
                "completion_tokens": sum(len(r.output_ids) for r in generated),
                "ttft_ms": _ms(min(firsts) - self.start) if firsts else None,
                "finish": ",".join(finishes) or None}


_CURRENT: contextvars.ContextVar = contextvars.ContextVar("llm_serving_access_exchange", default=None)


def note_model(name: Optional[str]) -> None:
    """The model the request being served names (the first one named stays)."""
    exchange = _CURRENT.get()
    if exchange is not None and exchange.model is None and name:
        exchange.model = name


def track(reqs: list) -> None:
    """Engine requests of one prompt (n choices of it, or one request) made for the request being served."""
    exchange = _CURRENT.get()
    if exchange is not None and reqs:
        exchange.groups.append(list(reqs))


@dataclass(frozen=True)
class AccessEntry:
    """One line of the access log."""
    client: str
    method: str
    path: str                           # as the client sent it, query string included
    version: str                        # "1.1"
    status: int
    total_ms: int
    model: Optional[str] = None
    prompt_tokens: Optional[int] = None
    completion_tokens: Optional[int] = None
    ttft_ms: Optional[int] = None
    load_ms: Optional[int] = None
    finish: Optional[str] = None
    error: Optional[str] = None

    def line(self) -> str:
        head = f'{self.client} - "{self.method} {self.path} HTTP/{self.version}" {self.status} {_phrase(self.status)}'
        fields = [("model", self.model), ("prompt_tokens", self.prompt_tokens),
                  ("completion_tokens", self.completion_tokens), ("ttft_ms", self.ttft_ms), ("load_ms", self.load_ms),
                  ("total_ms", self.total_ms), ("finish", self.finish)]
        parts = [head] + [f"{key}={_value(value)}" for key, value in fields if value is not None]
        if self.error is not None:
            error = self.error if len(self.error) <= MAX_ERROR_CHARS else self.error[:MAX_ERROR_CHARS] + "..."
            parts.append("error=" + json.dumps(error, ensure_ascii=False))
        return " ".join(parts)

    @property
    def level(self) -> int:
        polled = self.method == "GET" and self.path.split("?", 1)[0] in POLLED
        return logging.DEBUG if polled and self.status < 400 else logging.INFO


def _phrase(status: int) -> str:
    if status == CLIENT_CLOSED:
        return "Client Closed Request"
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return ""


_PLAIN = re.compile(r'[^\s"=]+')


def _value(value) -> str:
    """A field's value as it is, or JSON-quoted when it has spaces, quotes or '=' (a model's name could)."""
    text = str(value)
    return text if _PLAIN.fullmatch(text) else json.dumps(text, ensure_ascii=False)


def _ms(seconds: float) -> int:
    return max(int(round(seconds * 1000)), 0)


def error_message(body: bytes) -> Optional[str]:
    """The message of an error body in any of the APIs' shapes (OpenAI's and Anthropic's `{"error": {"message"}}`,
    TGI's and Ollama's `{"error": "..."}`), or None."""
    try:
        payload = json.loads(body)
    except ValueError:
        return None
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict):
        error = error.get("message")
    return error if isinstance(error, str) else None


def client_of(request: web.Request) -> str:
    """host:port of the peer, as uvicorn writes it."""
    peer = request.transport.get_extra_info("peername") if request.transport is not None else None
    if isinstance(peer, (tuple, list)) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return request.remote or "-"


async def _model_in_body(request: web.Request) -> Optional[str]:
    """The `model` of a JSON body the handler already read (a 400 that came before the route read its model)."""
    if request.can_read_body or not request.body_exists or (request.content_length or 0) > MAX_PEEKED_BODY:
        return None                     # (never read a body the handler left unread: a 401's, say)
    try:
        payload = json.loads(await request.read())
    except ValueError:
        return None
    model = payload.get("model") if isinstance(payload, dict) else None
    return model if isinstance(model, str) and model else None


@web.middleware
async def access_middleware(request: web.Request, handler):
    """One access-log line per request, written when its response is done (see the module docstring)."""
    exchange = Exchange()
    token = _CURRENT.set(exchange)
    status, error = 500, None
    try:
        response = await handler(request)
        status = response.status
        if status >= 400 and isinstance(response, web.Response) and isinstance(response.body, bytes):
            error = error_message(response.body)
        return response
    except web.HTTPException as exc:        # (error_middleware answers those >= 400; the rest pass through)
        status = exc.status
        raise
    except asyncio.CancelledError:
        status, error = CLIENT_CLOSED, "the client closed the connection before the response was done"
        raise
    except Exception as exc:                 # (aiohttp answers it with a 500)
        error = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        _CURRENT.reset(token)
        if status >= 400 and exchange.model is None and status != CLIENT_CLOSED:
            exchange.model = await _model_in_body(request)
        load = request.get(LOAD_WAIT)
        entry = AccessEntry(client_of(request), request.method, request.raw_path,
                            f"{request.version.major}.{request.version.minor}", status,
                            _ms(time.monotonic() - exchange.start), model=exchange.model,
                            load_ms=_ms(load) if load else None, error=error, **exchange.usage())
        logger.log(entry.level, "%s", entry.line())
