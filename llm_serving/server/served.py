"""Which engine serves a request: the model it names, through the server's fleet (master/fleet.py: loaded first when
it is not), held until the response is done (`hold_middleware`), so that a model is never unloaded under a request."""
from __future__ import annotations

import time
from typing import Optional

from aiohttp import web

from llm_serving.server import access_log
from llm_serving.server.keys import FLEET, LOAD_WAIT

HELD = web.RequestKey("held_engines", list)


async def engine_for(request: web.Request, name: Optional[str]):
    """The engine serving model `name` (None: the default model), held until this request's response is done."""
    fleet = request.app[FLEET]
    access_log.note_model(name or fleet.default)
    loaded, t0 = fleet.entry_of(name).state == "loaded", time.monotonic()
    engine = await fleet.acquire(name)
    if not loaded:                          # (the request waited for its model's load)
        request[LOAD_WAIT] = request.get(LOAD_WAIT, 0.0) + time.monotonic() - t0
    held = request.get(HELD)
    if held is None:                      # (no middleware: released at once, as a request outside a response)
        fleet.release(engine)
    else:
        held.append(engine)
    return engine


def default_engine(request: web.Request):
    """The default model's engine, loaded or not (None then): what model-less routes (/health, /stats) describe."""
    return request.app[FLEET].default_engine()


def fleet_of(request: web.Request):
    return request.app[FLEET]


@web.middleware
async def hold_middleware(request: web.Request, handler):
    """The engines a request acquired are released when its response is done (streamed to its end, or failed)."""
    request[HELD] = []
    try:
        return await handler(request)
    finally:
        fleet = request.app[FLEET]
        for engine in request[HELD]:
            fleet.release(engine)
