"""The HTTP application: `create_app(engine)` wires routes and maps errors to status codes in one place."""
from __future__ import annotations

import hmac
import logging
from pathlib import Path

from aiohttp import web

from llm_serving.master.engine import (DuplicateRequestError, EngineStoppedError, LoraConflictError, LoraRefusedError,
                                       UnsupportedRequestError)
from llm_serving.master.grammar import GrammarError
from llm_serving.master.scheduler import QueueFullError
from llm_serving.server import (metrics, routes_anthropic, routes_embeddings, routes_llm_serving, routes_ollama,
                                routes_openai, routes_responses, streaming)
from llm_serving.server.keys import ENGINE
from llm_serving.server.errors import EngineFailedError, ModelNotFoundError, ValidationError

logger = logging.getLogger(__name__)

class UnauthorizedError(PermissionError):
    """Missing or wrong API key; answered with 401."""


# exception type -> (HTTP status, error_type); the only place errors become status codes
ERROR_STATUS = {
    ValidationError: (400, "validation"),
    GrammarError: (400, "validation"),
    UnsupportedRequestError: (400, "validation"),
    LoraRefusedError: (400, "validation"),
    UnauthorizedError: (401, "unauthorized"),
    ModelNotFoundError: (404, "not_found"),
    DuplicateRequestError: (409, "conflict"),
    LoraConflictError: (409, "conflict"),
    QueueFullError: (429, "overloaded"),
    EngineFailedError: (500, "server_error"),
    EngineStoppedError: (503, "unavailable"),
}
# the route modules, each with add_routes(app); one whose API has an error shape of its own says which paths are its
# (`owns(path)`) and writes its errors (`error_body(status, message, kind, param)`): the first that owns a path
# shapes its errors, llm-serving's / TGI's shape the rest. A new API adds its module here (before OpenAI's if its
# paths are under /v1/ too).
ROUTE_MODULES = (routes_llm_serving, routes_anthropic, routes_responses, routes_ollama, routes_embeddings,
                 routes_openai)


def error_response(request: web.Request, status: int, message: str, kind: str, param=None) -> web.Response:
    """The error body of the API the path belongs to (`ROUTE_MODULES`)."""
    owner = next((m for m in ROUTE_MODULES if hasattr(m, "owns") and m.owns(request.path)), None)
    body = owner.error_body(status, message, kind, param) if owner is not None else streaming.error_body(message, kind)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return web.json_response(body, status=status, headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(request, exc.status, exc.reason, "http")
    except tuple(ERROR_STATUS) as exc:
        status, kind = next(v for t, v in ERROR_STATUS.items() if isinstance(exc, t))
        return error_response(request, status, str(exc), kind, getattr(exc, "param", None))


# Routes anyone may call even when an API key is set: load balancers probe /health without credentials.
OPEN_PATHS = frozenset({"/health", "/dashboard"})
OPEN_PREFIXES = ("/static/",)          # the pages' files (they ask for the key themselves; GET / is below)


def api_key_middleware(key: str):
    """Requests must carry `Authorization: Bearer KEY` or `X-API-Key: KEY` (compared in constant time)."""
    expected = key.encode()

    @web.middleware
    async def check_key(request: web.Request, handler):
        page = request.method == "GET" and (request.path == "/" or request.path in OPEN_PATHS
                                            or request.path.startswith(OPEN_PREFIXES))
        if request.path not in OPEN_PATHS and not page:
            auth = request.headers.get("Authorization", "")
            given = auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("X-API-Key", "")
            if not hmac.compare_digest(given.encode("utf-8", "replace"), expected):
                raise UnauthorizedError("missing or wrong API key: send 'Authorization: Bearer <key>' or "
                                        "'X-API-Key: <key>'")
        return await handler(request)
    return check_key


STATIC = Path(__file__).resolve().parent / "static"     # the web pages: plain files, nothing fetched from outside


async def playground(request: web.Request) -> web.FileResponse:
    """GET /: a chat page over the OpenAI routes (static/playground.js)."""
    return web.FileResponse(STATIC / "index.html")


async def dashboard(request: web.Request) -> web.FileResponse:
    """GET /dashboard: live charts of /stats, /health and /metrics (static/dashboard.js)."""
    return web.FileResponse(STATIC / "dashboard.html")


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    reason = engine.unavailable_reason()
    body = {"status": "ok" if reason is None else "unavailable", "model": engine.model_name,
            "agents": engine.agent_info(),
            "agent_restarts": engine.num_agent_restarts}
    draft = engine.draft_agent_info()
    if draft:          # a draft model's agent (speculative decoding); its failures cost speed, not health
        body["draft_agents"] = draft
    if reason is not None:
        body["reason"] = reason
    return web.json_response(body, status=200 if reason is None else 503)


async def model_info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    model = request.match_info.get("model", engine.model_name)
    if model != engine.model_name:
        raise ModelNotFoundError(f"model {model!r} is not served here; this server serves {engine.model_name!r}")
    mc = engine.config.model_config
    tp = engine.tensor_parallel
    return web.json_response({"model_id": engine.model_name, "max_total_tokens": engine.max_model_len,
                              "max_num_seqs": engine.config.serving_config.max_num_seqs,
                              "device_target": mc.device_target, "vocab_size": engine.tokenizer.vocab_size,
                              "tensor_parallel_size": tp["size"], "tensor_parallel_all_reduce": tp["all_reduce"],
                              "kv_cache_dtype": engine.config.kv_cache_dtype,
                              "batch_invariant": engine.batch_invariant,
                              "kv_cache_blocks": engine.config.pa_config.num_blocks,
                              "kv_block_size": engine.config.pa_config.block_size,
                              "model_path": engine.model_path, "tokenizer_path": engine.tokenizer.model_file})


async def stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[ENGINE].stats())


def create_app(engine) -> web.Application:
    sc = engine.config.serving_config
    middlewares = [error_middleware] + ([api_key_middleware(sc.api_key)] if sc.api_key else [])
    app = web.Application(middlewares=middlewares, client_max_size=sc.max_body_bytes)
    app[ENGINE] = engine
    app.router.add_get("/", playground)
    app.router.add_get("/dashboard", dashboard)
    app.router.add_static("/static/", STATIC, show_index=False)
    app.router.add_get("/health", health)
    app.router.add_get("/stats", stats)
    app.router.add_get("/info", model_info)
    app.router.add_get("/models/{model}", model_info)
    for module in ROUTE_MODULES:
        module.add_routes(app)
    metrics.add_routes(app, engine)
    return app
