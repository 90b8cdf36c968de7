"""The HTTP application: `create_app(fleet)` wires routes (each finds its model's engine through server/served.py)
and maps errors to status codes in one place."""
from __future__ import annotations

import hmac
import logging
from pathlib import Path

from aiohttp import web

from llm_serving.master.engine import (DuplicateRequestError, EngineStoppedError, LoraConflictError, LoraRefusedError,
                                       UnsupportedRequestError)
from llm_serving.master.fleet import FleetFullError, ModelBusyError, ModelLoadError, UnknownModelError
from llm_serving.master.grammar import GrammarError
from llm_serving.master.scheduler import QueueFullError
from llm_serving.server import access_log, metrics
from llm_serving.server.api import document
from llm_serving.server.api.base import UnknownFields
from llm_serving.server.apis import APIS, error_shape
from llm_serving.server.keys import FLEET, UNKNOWN_FIELDS
from llm_serving.server.served import default_engine, hold_middleware
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
    UnknownModelError: (404, "not_found"),
    ModelBusyError: (409, "conflict"),
    DuplicateRequestError: (409, "conflict"),
    LoraConflictError: (409, "conflict"),
    QueueFullError: (429, "overloaded"),
    EngineFailedError: (500, "server_error"),
    EngineStoppedError: (503, "unavailable"),
    FleetFullError: (503, "unavailable"),
    ModelLoadError: (503, "unavailable"),
}


def error_response(request: web.Request, status: int, message: str, kind: str, param=None) -> web.Response:
    """The error body of the API the path belongs to (apis.error_shape)."""
    body = error_shape(request.path).body(status, message, kind, param)
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
    """The default model's health (200 while it can serve: loaded and its agents up, or unloaded and loadable; 503
    when its agents are down or its last load failed), and every model's state."""
    engine = default_engine(request)
    fleet = request.app[FLEET]
    entry = fleet.entries[fleet.default]
    reason = (f"the default model failed to load: {entry.error}" if entry.state == "failed"
              else engine.unavailable_reason() if engine is not None else None)
    body = {"status": "ok" if reason is None else "unavailable", "model": fleet.default,
            "agents": engine.agent_info() if engine is not None else [],
            "agent_restarts": engine.num_agent_restarts if engine is not None else 0,
            "models": {name: fleet.entries[name].state for name in fleet.names}}
    draft = engine.draft_agent_info() if engine is not None else []
    if draft:          # a draft model's agent (speculative decoding); its failures cost speed, not health
        body["draft_agents"] = draft
    if reason is not None:
        body["reason"] = reason
    return web.json_response(body, status=200 if reason is None else 503)


async def model_info(request: web.Request) -> web.Response:
    """GET /info (the default model) and /models/{model}: a loaded model's shape and settings; an unloaded one's
    state (and its load's error, if it failed)."""
    fleet = request.app[FLEET]
    name = request.match_info.get("model")
    entry = fleet.entry_of(name)
    if entry.state != "loaded":
        return web.json_response({"model_id": entry.name, **entry.describe()})
    engine = entry.engine
    mc = engine.config.model_config
    tp = engine.tensor_parallel
    return web.json_response({"model_id": entry.name, "state": entry.state, "max_total_tokens": engine.max_model_len,
                              "max_num_seqs": engine.config.serving_config.max_num_seqs,
                              "device_target": mc.device_target, "vocab_size": engine.tokenizer.vocab_size,
                              "tensor_parallel_size": tp["size"], "tensor_parallel_all_reduce": tp["all_reduce"],
                              "kv_cache_dtype": engine.config.kv_cache_dtype,
                              "batch_invariant": engine.batch_invariant,
                              "kv_cache_blocks": engine.config.pa_config.num_blocks,
                              "kv_block_size": engine.config.pa_config.block_size,
                              "model_path": engine.model_path, "tokenizer_path": engine.tokenizer.model_file,
                              "mmproj": mc.mmproj,
                              "size_bytes": entry.size_bytes, "load_s": entry.load_s,
                              "keep_alive_s": entry.keep_alive, "agents": engine.agent_info()})


async def load_model(request: web.Request) -> web.Response:
    """POST /models/{model}/load: load it now (if it is not), as a request naming it would."""
    return web.json_response(await request.app[FLEET].load(request.match_info["model"]))


async def unload_model(request: web.Request) -> web.Response:
    """POST /models/{model}/unload: stop it now (409 while it serves requests); it stays listed."""
    return web.json_response(await request.app[FLEET].unload(request.match_info["model"]))


async def stats(request: web.Request) -> web.Response:
    """GET /stats: the default model's engine (?model=NAME: another loaded one's)."""
    name = request.query.get("model")
    engine = default_engine(request) if name is None else request.app[FLEET].entry_of(name).engine
    if engine is None:
        raise EngineStoppedError(f"model {name or request.app[FLEET].default!r} is not loaded")
    return web.json_response(engine.stats())


def create_app(fleet) -> web.Application:
    """The server's app over `fleet` (master/fleet.py), its default model loaded."""
    sc = fleet.base.serving_config
    # the access log outermost: it sees every answer as sent (error_middleware's bodies, the key's 401s)
    middlewares = ([access_log.access_middleware] if sc.access_log else []) + [error_middleware] + \
        ([api_key_middleware(sc.api_key)] if sc.api_key else []) + [hold_middleware]
    app = web.Application(middlewares=middlewares, client_max_size=sc.max_body_bytes)
    app[FLEET] = fleet
    app[UNKNOWN_FIELDS] = UnknownFields(sc.unknown_fields)
    app.router.add_get("/", playground)
    app.router.add_get("/dashboard", dashboard)
    app.router.add_static("/static/", STATIC, show_index=False)
    app.router.add_get("/health", health)
    app.router.add_get("/stats", stats)
    app.router.add_get("/info", model_info)
    app.router.add_get("/models/{model}", model_info)
    app.router.add_post("/models/{model}/load", load_model)
    app.router.add_post("/models/{model}/unload", unload_model)
    app.router.add_get("/openapi.json", document.serve)
    for api in APIS:                    # every API's routes (server/apis.py)
        api.routes.add_routes(app)
    metrics.add_routes(app, fleet)
    return app
