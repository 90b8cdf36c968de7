"""Unknown request fields (server/api/base.py): left out of the body and named once in the log (`ignore`, the
default), or refused with a 400 naming them (`reject`); fields that are served keep their checks either way. The
captured requests of Codex CLI and Claude Code (tests/assets/clients/) validate as they were sent, and with 20 more
unknown fields added at every depth."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from llm_serving.server.api.anthropic import MessagesRequest
from llm_serving.server.api.base import UnknownFields, validate
from llm_serving.server.api.openai import ChatCompletionRequest
from llm_serving.server.api.responses import ResponsesRequest
from llm_serving.server.errors import ValidationError

CLIENTS = Path(__file__).resolve().parents[1] / "assets" / "clients"
CODEX = json.loads((CLIENTS / "codex_0.171.0_responses.json").read_text())
CLAUDE = json.loads((CLIENTS / "claude_code_2.1.197_messages.json").read_text())
USER = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]


def with_unknown_fields(body: dict, count: int = 20) -> dict:
    """`body` with `count` fields no API knows, spread over its top level, its first message (or item) and its
    first tool."""
    out = json.loads(json.dumps(body))
    places = [out]
    for key in ("messages", "input", "tools"):
        if isinstance(out.get(key), list) and isinstance(out[key][0], dict):
            places.append(out[key][0])
    for k in range(count):
        places[k % len(places)][f"x_future_field_{k}"] = {"v": k} if k % 2 else k
    return out


def test_unknown_fields_are_left_out_at_every_depth_and_the_rest_kept():
    body = {"model": "m", "max_tokens": 8, "colour": "red", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi", "shade": 3}], "mood": "ok"}]}
    ignored: list = []
    r = validate(MessagesRequest, body, ignored=ignored)
    assert sorted(ignored) == ["colour", "messages[0].content[0].shade", "messages[0].mood"]
    assert r.to_request().messages == [{"role": "user", "content": "hi"}]
    assert body["colour"] == "red" and body["messages"][0]["mood"] == "ok"       # the caller's body is not changed
    with pytest.raises(ValidationError, match="unknown field"):                  # without the list: strict
        validate(MessagesRequest, body)


def test_a_bad_value_of_a_served_field_is_refused_whatever_unknown_fields_come_with_it():
    body = {"model": "m", "max_tokens": 0, "colour": "red", "messages": USER}
    with pytest.raises(ValidationError) as err:
        validate(MessagesRequest, body, ignored=[])
    assert err.value.param == "max_tokens" and "max_tokens must be >= 1" in str(err.value)
    with pytest.raises(ValidationError) as err:
        validate(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                         "temperature": "hot", "extra_thing": 1}, ignored=[])
    assert err.value.param == "temperature"


def test_the_policy_names_each_unknown_field_once_per_route_or_refuses_it(caplog):
    body = {"model": "m", "max_tokens": 8, "messages": USER, "colour": "red"}
    fields = UnknownFields("ignore")
    with caplog.at_level(logging.WARNING, logger="llm_serving.server.api.base"):
        for _ in range(3):
            fields.validate(MessagesRequest, body, "POST /v1/messages")
        fields.validate(MessagesRequest, {**body, "size": 2}, "POST /v1/messages")
        fields.validate(MessagesRequest, body, "POST /v1/messages/count_tokens")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert "POST /v1/messages: ignored unknown field(s) colour" in lines[0]
    assert "ignored unknown field(s) size" in lines[1] and "count_tokens" in lines[2]
    with pytest.raises(ValidationError, match=r"unknown field\(s\): colour"):
        UnknownFields("reject").validate(MessagesRequest, body, "POST /v1/messages")


def test_what_a_body_leaves_out_is_named_once_too(caplog):
    body = {"model": "m", "input": "hi", "tools": [{"type": "web_search", "external_web_access": False}]}
    fields = UnknownFields("ignore")
    with caplog.at_level(logging.WARNING, logger="llm_serving.server.api.base"):
        fields.validate(ResponsesRequest, body, "POST /v1/responses")
        fields.validate(ResponsesRequest, body, "POST /v1/responses")
    [line] = [r.getMessage() for r in caplog.records]
    assert "left out tools of type 'web_search'" in line


@pytest.mark.parametrize("captured, model", [(CODEX, ResponsesRequest), (CLAUDE, MessagesRequest)],
                         ids=["codex", "claude-code"])
def test_a_coding_agents_request_as_captured_and_with_20_unknown_fields_translates_the_same(captured, model):
    """Each CLI's request as its release sends it (its fields, its tools: Codex's namespace and web_search, Claude
    Code's context_management and adaptive thinking); 20 unknown fields added change nothing."""
    as_sent = UnknownFields("ignore").validate(model, captured["body"], captured["path"])
    more = UnknownFields("ignore").validate(model, with_unknown_fields(captured["body"]), captured["path"])
    if model is ResponsesRequest:
        want, got = as_sent.to_request(8192), more.to_request(8192)
        assert "multi_agent_v1.close_agent" in [t["function"]["name"] for t in want.tools]
        assert as_sent.left_out() == ["tools of type 'web_search' (this server runs no hosted tools)"]
    else:
        want, got = as_sent.to_request(), more.to_request()
        assert len(want.tools) == 24 and want.variables["enable_thinking"] is True
    assert (got.messages, got.tools, got.sampling) == (want.messages, want.tools, want.sampling)
    with pytest.raises(ValidationError, match="unknown field"):
        UnknownFields("reject").validate(model, with_unknown_fields(captured["body"]), captured["path"])


def test_the_openapi_document_says_whether_unknown_fields_are_taken():
    from llm_serving.server.api.document import openapi
    closed, open_ = json.dumps(openapi("1", closed=True)), json.dumps(openapi("1"))
    assert '"additionalProperties": false' in closed and '"additionalProperties": false' not in open_
