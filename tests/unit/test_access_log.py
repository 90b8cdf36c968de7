"""The access log without a model: its line (uvicorn's, the serving fields after it, an error's reason quoted on one
line), its level (polling quiet), the error messages of every API's shape, and the middleware over small apps:
what the routes note and track, a 400's reason and model, an unknown path, a stream logged when it ends, a client
that went away (499) and a handler's crash (500)."""
from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request

from llm_serving.config import ConfigError, config_from_dict
from llm_serving.server import access_log
from llm_serving.server.access_log import AccessEntry, Exchange, access_middleware, error_message
from llm_serving.server.app import error_middleware
from llm_serving.server.errors import ValidationError


def test_a_line_is_uvicorns_with_the_serving_fields_after_it():
    entry = AccessEntry("127.0.0.1:53422", "POST", "/v1/chat/completions", "1.1", 200, 390, model="smollm2",
                        prompt_tokens=12, completion_tokens=30, ttft_ms=41, finish="stop")
    assert entry.line() == ('127.0.0.1:53422 - "POST /v1/chat/completions HTTP/1.1" 200 OK model=smollm2 '
                            'prompt_tokens=12 completion_tokens=30 ttft_ms=41 total_ms=390 finish=stop')
    health = AccessEntry("127.0.0.1:1", "GET", "/health", "1.1", 200, 0)
    assert health.line() == '127.0.0.1:1 - "GET /health HTTP/1.1" 200 OK total_ms=0'


def test_an_errors_reason_ends_its_line_quoted_and_cut():
    entry = AccessEntry("::1:9", "POST", "/v1/completions?x=1", "1.0", 400, 3, model="my model",
                        error='temperature must be <= 2 (got "7")\nsee the docs')
    assert entry.line() == ('::1:9 - "POST /v1/completions?x=1 HTTP/1.0" 400 Bad Request model="my model" '
                            'total_ms=3 error="temperature must be <= 2 (got \\"7\\")\\nsee the docs"')
    long = AccessEntry("c:1", "POST", "/p", "1.1", 404, 1, error="x" * 2000).line()
    assert long.endswith('error="' + "x" * access_log.MAX_ERROR_CHARS + '..."') and "\n" not in long
    assert AccessEntry("c:1", "POST", "/p", "1.1", 499, 5).line().endswith("499 Client Closed Request total_ms=5")
    assert AccessEntry("c:1", "GET", "/p", "1.1", 599, 5).line() == 'c:1 - "GET /p HTTP/1.1" 599  total_ms=5'


def test_polling_answered_well_is_debug_and_everything_else_info():
    def level(method, path, status):
        return AccessEntry("c:1", method, path, "1.1", status, 1).level
    assert level("GET", "/health", 200) == level("GET", "/metrics?x=1", 200) == level("GET", "/stats", 200) \
        == logging.DEBUG
    assert level("GET", "/health", 503) == level("POST", "/health", 405) == logging.INFO
    assert level("GET", "/", 200) == level("GET", "/static/app.js", 200) == level("GET", "/v1/models", 200) \
        == logging.INFO


def test_error_messages_are_read_from_every_apis_shape():
    assert error_message(b'{"error": {"message": "bad", "type": "invalid_request_error"}}') == "bad"   # OpenAI
    assert error_message(b'{"type": "error", "error": {"type": "x", "message": "worse"}}') == "worse"  # Anthropic
    assert error_message(b'{"error": "model \'m\' not found"}') == "model 'm' not found"               # Ollama
    assert error_message(b'{"error": "queue full", "error_type": "overloaded"}') == "queue full"      # TGI
    assert error_message(b"not json") is None and error_message(b"[1]") is None
    assert error_message(b'{"error": {"code": 3}}') is None


def _req(prompt, output, first=None, finish="stop", pooling=None):
    return SimpleNamespace(prompt_ids=list(range(prompt)), output_ids=list(range(output)), first_token_time=first,
                           finish_reason=finish, pooling=pooling)


def test_usage_counts_a_prompt_of_n_choices_once_and_embeddings_as_prompts():
    exchange = Exchange(start=10.0)
    assert exchange.usage() == {}
    exchange.groups = [[_req(7, 3, first=10.25), _req(7, 5, first=10.05, finish="length")]]
    assert exchange.usage() == {"prompt_tokens": 7, "completion_tokens": 8, "ttft_ms": 50,
                                "finish": "stop,length"}
    embedded = Exchange(start=0.0, groups=[[_req(4, 0, pooling="mean")], [_req(6, 0, pooling="mean")]])
    assert embedded.usage() == {"prompt_tokens": 10, "completion_tokens": 0, "ttft_ms": None, "finish": None}


def test_the_setting_is_a_boolean():
    assert config_from_dict({}).serving_config.access_log is True
    assert config_from_dict({}, ["serving_config.access_log=false"]).serving_config.access_log is False
    with pytest.raises(ConfigError, match="serving_config.access_log"):
        config_from_dict({"serving_config": {"access_log": "sometimes"}})


# --- the middleware ---------------------------------------------------------------------------------------------------

async def _chat(request):
    """A route as the real ones go: the body read and checked, the model noted, two choices tracked."""
    body = await request.json()
    if body.get("temperature", 0) > 2:
        raise ValidationError("temperature must be <= 2", param="temperature")
    access_log.note_model(body["model"])
    now = asyncio.get_running_loop().time()         # (time.monotonic's clock on Linux)
    access_log.track([_req(5, 2, first=now), _req(5, 3, first=now, finish="length")])
    return web.json_response({"usage": {"prompt_tokens": 5, "completion_tokens": 5}})


async def _stream(request):
    access_log.note_model("m")
    req = _req(4, 0)
    access_log.track([req])
    response = web.StreamResponse()
    await response.prepare(request)
    for k in range(3):                                # the tokens come while the stream is open
        req.output_ids.append(k)
        await response.write(b"data: x\n\n")
    await response.write_eof()
    return response


async def _crash(request):
    raise RuntimeError("a bug")


def _serve(requests: list, middlewares=(access_middleware, error_middleware)) -> list:
    """(status of each (method, path, body) request) against an app of the routes above."""
    async def run():
        app = web.Application(middlewares=list(middlewares))
        app.router.add_post("/chat", _chat)
        app.router.add_get("/stream", _stream)
        app.router.add_get("/crash", _crash)
        async with TestClient(TestServer(app)) as client:
            statuses = []
            for method, path, body in requests:
                response = await client.request(method, path, json=body)
                await response.read()
                statuses.append(response.status)
            return statuses
    return asyncio.run(run())


def _fields(line: str) -> dict:
    head, _, rest = line.partition('" ')
    status = rest.split(" ", 1)[0]
    return {"request": head.split(' - "', 1)[1], "status": int(status),
            **dict(part.split("=", 1) for part in rest.split(" ") if "=" in part and not part.startswith('"'))}


def test_the_middleware_logs_each_request_with_what_its_route_noted(caplog):
    caplog.set_level(logging.DEBUG, logger="llm_serving.access")
    statuses = _serve([("POST", "/chat", {"model": "m", "temperature": 0}),
                       ("POST", "/chat?try=2", {"model": "other", "temperature": 5}),
                       ("GET", "/nowhere", None), ("GET", "/stream", None), ("GET", "/crash", None)])
    assert statuses == [200, 400, 404, 200, 500]
    records = [r for r in caplog.records if r.name == "llm_serving.access"]
    assert [r.levelno for r in records] == [logging.INFO] * 5
    lines = [r.getMessage() for r in records]
    assert all(line.startswith("127.0.0.1:") for line in lines), lines
    chat, bad, nowhere, stream, crash = map(_fields, lines)
    assert chat["request"] == "POST /chat HTTP/1.1" and chat["status"] == 200
    assert (chat["model"], chat["prompt_tokens"], chat["completion_tokens"], chat["finish"]) == \
        ("m", "5", "5", "stop,length")
    assert int(chat["ttft_ms"]) <= int(chat["total_ms"])
    # a 400 raised before the route noted its model: the body's, and the message the client got
    assert bad["request"] == "POST /chat?try=2 HTTP/1.1" and bad["model"] == "other" and "prompt_tokens" not in bad
    assert lines[1].endswith('400 Bad Request model=other total_ms=' + bad["total_ms"] +
                             ' error="temperature must be <= 2"')
    assert nowhere["status"] == 404 and lines[2].endswith('error="Not Found"') and "model" not in nowhere
    assert (stream["completion_tokens"], stream["finish"]) == ("3", "stop")      # counted when the stream ended
    assert crash["status"] == 500 and lines[4].endswith('error="RuntimeError: a bug"')


def test_without_the_middleware_nothing_is_logged_and_the_routes_still_serve(caplog):
    caplog.set_level(logging.DEBUG, logger="llm_serving.access")
    assert _serve([("POST", "/chat", {"model": "m"}), ("GET", "/stream", None)], middlewares=[error_middleware]) \
        == [200, 200]
    assert [r for r in caplog.records if r.name == "llm_serving.access"] == []


def test_a_client_that_went_away_is_499_with_what_it_had_so_far(caplog):
    caplog.set_level(logging.DEBUG, logger="llm_serving.access")

    async def run():
        async def handler(request):
            access_log.note_model("m")
            access_log.track([_req(3, 2, first=None, finish=None)])
            raise asyncio.CancelledError
        with pytest.raises(asyncio.CancelledError):
            await access_middleware(make_mocked_request("POST", "/v1/chat/completions"), handler)
    asyncio.run(run())
    (record,) = [r for r in caplog.records if r.name == "llm_serving.access"]
    fields = _fields(record.getMessage())
    assert (fields["status"], fields["model"], fields["prompt_tokens"], fields["completion_tokens"]) == \
        (499, "m", "3", "2")
    assert record.getMessage().endswith('error="the client closed the connection before the response was done"')
