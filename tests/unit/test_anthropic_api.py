"""Anthropic's Messages API without a server: its bodies' validation (a 400 naming the field), their translation into
the internal chat request, and the reply's shapes (content blocks, stream events, stop_reason, errors)."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from llm_serving.master.request import SamplingParams
from llm_serving.master.stop import StopStrings
from llm_serving.server import routes_anthropic as routes
from llm_serving.server.api.anthropic import CountTokensRequest, MessagesRequest
from llm_serving.server.api.base import validate
from llm_serving.server.api.document import openapi
from llm_serving.server.errors import ValidationError
from llm_serving.server.reply import ReplyShape, ReplyStream, read_reply

USER = [{"role": "user", "content": "hi"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}


def body(**fields):
    return {"model": "m", "max_tokens": 16, "messages": USER, **fields}


def user(*blocks):
    return {"role": "user", "content": list(blocks)}


def assistant(*blocks):
    return {"role": "assistant", "content": list(blocks)}


@pytest.mark.parametrize("fields, param, words", [
    ({"max_tokens": None}, "max_tokens", "'max_tokens' is required"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens must be >= 1"),
    ({"messages": []}, "messages", "non-empty"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages", "messages[0]: role must be 'user' or 'assistant'"),
    ({"messages": ["hi"]}, "messages", "messages[0] must be an object"),
    ({"messages": [user({"type": "image", "source": {"type": "base64"}})]}, "messages",
     "an image's source must be base64"),
    ({"messages": [user({"type": "image", "source": {"type": "url", "url": "ftp://x/a.png"}})]}, "messages",
     "or an http(s) url"),
    ({"messages": [user({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "%%"}})]},
     "messages", "image block: "),
    ({"messages": [user({"type": "document", "source": {}})]}, "messages",
     "messages[0].content[0]: document blocks are not supported"),
    ({"messages": [user(CALL)]}, "messages", "messages[0].content[0]: tool_use blocks belong in assistant messages"),
    ({"messages": [assistant({"type": "tool_result", "tool_use_id": "x"})]}, "messages",
     "tool_result blocks belong in user messages"),
    ({"messages": [user({"type": "thinking", "thinking": "x"})]}, "messages", "belong in assistant messages"),
    ({"messages": [user({"type": "audio"})]}, "messages", "unknown content block type 'audio'"),
    ({"messages": [user({"text": "no type"})]}, "messages", "unknown content block type None"),
    ({"messages": [user({"type": "text", "text": "a", "colour": 1})]}, "messages",
     "unknown field(s): messages[0].content[0].colour"),
    ({"messages": [assistant({**CALL, "input": "city=Paris"})]}, "messages",
     "messages[0].content[0].input must be an object"),
    ({"messages": [user({"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"})]}, "messages",
     "messages[0].content[0].tool_use_id 'toolu_9' answers no tool_use block"),
    ({"messages": [assistant(CALL), user({"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [{"type": "image", "source": {}}]})]}, "messages",
     "messages[1].content[0].content[0]: image blocks are taken in a user message's content, not here"),
    ({"system": [{"type": "image"}]}, "system", "system[0]: image blocks are taken in a user message's content"),
    ({"system": 5}, "system", "system must be"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}], "tool_choice": {"type": "any"}},
     "tool_choice", "tool_choice 'any' needs tools"),
    ({"tools": [WEATHER, {"type": "bash_20250124", "name": "bash"}], "tool_choice": {"type": "tool", "name": "bash"}},
     "tool_choice", "names 'bash', which is not one of the tools"),
    ({"tools": [{"name": "a b", "input_schema": {"type": "object"}}]}, "tools", "tools[0].name must match"),
    ({"tools": [{"name": "a", "input_schema": {"type": "string"}}]}, "tools", "input_schema must be a JSON schema"),
    ({"tools": [{"name": "a"}]}, "tools", "'tools[0].input_schema' is required"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "'get_weather' is given twice"),
    ({"tools": [WEATHER] * 129}, "tools", "at most 128"),
    ({"tool_choice": {"type": "any"}}, "tool_choice", "tool_choice 'any' needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice", "tool_choice.name goes with type 'tool'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "add"}}, "tool_choice",
     "names 'add', which is not one of the tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "required"}}, "tool_choice", "tool_choice.type must be"),
    ({"tools": [WEATHER], "tool_choice": {"type": "any"}, "output_config": {"format": {
        "type": "json_schema", "schema": {"type": "object"}}}}, "tool_choice", "cannot also follow output_config"),
    ({"thinking": {"type": "enabled"}}, "thinking", "budget_tokens goes with type 'enabled'"),
    ({"thinking": {"type": "disabled", "budget_tokens": 2048}}, "thinking", "budget_tokens goes with type"),
    ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking", "thinking.budget_tokens must be >= 1024"),
    ({"thinking": {"type": "sometimes"}}, "thinking", "thinking.type must be"),
    ({"temperature": 1.5}, "temperature", "temperature must be <= 1.0"),
    ({"temperature": "0"}, "temperature", "temperature must be a number"),
    ({"top_p": 0}, "top_p", "top_p must be > 0"),
    ({"top_k": -1}, "top_k", "top_k must be >= 0"),
    ({"stop_sequences": ["x"] * 17}, "stop_sequences", "at most 16"),
    ({"stop_sequences": [""]}, "stop_sequences", "1 to 256 characters"),
    ({"stream": 1}, "stream", "stream must be true or false"),
    ({"service_tier": "priority"}, "service_tier", "service_tier must be"),
    ({"metadata": {"user_id": "u", "team": "t"}}, "metadata", "unknown field(s): metadata.team"),
    ({"container": "c1", "mcp_servers": []}, "container", "unknown field(s): container, mcp_servers"),
    ({"model": ""}, "model", None),
])
def test_a_body_that_cannot_be_served_names_its_field(fields, param, words):
    with pytest.raises(ValidationError) as err:
        validate(MessagesRequest, {k: v for k, v in body(**fields).items() if v is not None})
    assert err.value.param == param, str(err.value)
    if words is not None:
        assert words in str(err.value)


def test_fields_clients_send_that_change_nothing_are_accepted():
    r = validate(MessagesRequest, body(
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        messages=[user({"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}, "citations": None})],
        metadata={"user_id": "u-1"}, service_tier="auto", speed="standard", cache_control={"type": "ephemeral"},
        tools=[{**WEATHER, "type": "custom", "strict": True, "cache_control": {"type": "ephemeral"}}]))
    req = r.to_request()
    assert req.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert req.sampling == SamplingParams(max_new_tokens=16, temperature=1.0)
    assert req.variables is None and req.tool_choice == "auto" and req.parallel_tool_calls


def test_server_tools_are_left_out_and_claude_codes_fields_accepted():
    """Anthropic's server tools (typed by version) run on Anthropic's servers: left out (`left_out` names them for
    the log), the client's tools served. Claude Code's context_management and adaptive thinking are accepted."""
    r = validate(MessagesRequest, body(
        tools=[{"type": "web_search_20250305", "name": "web_search", "max_uses": 5}, WEATHER,
               {"type": "bash_20250124", "name": "bash"}],
        thinking={"type": "adaptive"}, output_config={"effort": "high"},
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}))
    req = r.to_request()
    assert [t["function"]["name"] for t in req.tools] == ["get_weather"]
    assert r.left_out() == ["tools of type 'web_search_20250305' (this server runs no server tools)",
                            "tools of type 'bash_20250124' (this server runs no server tools)"]
    assert req.variables == {"enable_thinking": True, "reasoning_effort": "high"}
    assert validate(MessagesRequest, body(tools=[{"type": "web_search_20250305", "name": "w"}])).to_request().tools \
        is None


def test_a_conversation_with_tool_calls_translates_into_openai_shaped_messages():
    r = validate(MessagesRequest, body(system="You help.", tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        assistant({"type": "thinking", "thinking": "I should call it.", "signature": "sig"},
                  {"type": "redacted_thinking", "data": "xyz"},
                  {"type": "text", "text": "Let me check."}, CALL,
                  {**CALL, "id": "toolu_2", "input": {"city": "Nice", "days": [1, 2]}}),
        user({"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "21C"},
                                                                          {"type": "text", "text": "sunny"}]},
             {"type": "tool_result", "tool_use_id": "toolu_2", "content": "no such city", "is_error": True},
             {"type": "text", "text": "Thanks."}),
        {"role": "user", "content": "And tomorrow?"}]))
    req = r.to_request()
    assert req.messages == [
        {"role": "system", "content": "You help."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": '{"city": "Paris"}'}},
            {"id": "toolu_2", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": '{"city": "Nice", "days": [1, 2]}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "21C\nsunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no such city"},
        {"role": "user", "content": "Thanks.\nAnd tomorrow?"}]          # a role's turns in a row are one turn
    assert req.tools == [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a "
                                                           "city", "parameters": WEATHER["input_schema"]}}]


def test_consecutive_assistant_turns_are_one_and_a_results_only_user_turn_adds_no_empty_message():
    r = validate(CountTokensRequest, {"model": "m", "system": [], "messages": [
        {"role": "user", "content": "Go"}, assistant({"type": "text", "text": "Sure. "}),
        assistant(CALL), user({"type": "tool_result", "tool_use_id": "toolu_1"}),
        {"role": "assistant", "content": "It is"}]})
    assert r.chat_messages() == [
        {"role": "user", "content": "Go"},
        {"role": "assistant", "content": "Sure. ", "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": ""},
        {"role": "assistant", "content": "It is"}]          # (a last assistant turn: the reply continues it)


@pytest.mark.parametrize("choice, internal, parallel", [
    (None, "auto", True), ({"type": "auto"}, "auto", True), ({"type": "any"}, "required", True),
    ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
    ({"type": "tool", "name": "get_weather"}, "get_weather", True), ({"type": "none"}, "none", True)])
def test_tool_choice_maps_to_the_internal_choice(choice, internal, parallel):
    fields = {"tools": [WEATHER]} if choice is None else {"tools": [WEATHER], "tool_choice": choice}
    req = validate(MessagesRequest, body(**fields)).to_request()
    assert (req.tool_choice, req.parallel_tool_calls) == (internal, parallel)


def test_tool_choice_none_needs_no_tools():
    assert validate(MessagesRequest, body(tool_choice={"type": "none"})).to_request().tools is None


@pytest.mark.parametrize("fields, variables", [
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, {"enable_thinking": True}),
    ({"thinking": {"type": "adaptive"}}, {"enable_thinking": True}),
    ({"thinking": {"type": "disabled"}}, {"enable_thinking": False}),
    ({"output_config": {"effort": "low"}}, {"reasoning_effort": "low"}),
    ({"output_config": {"effort": "max"}, "thinking": {"type": "disabled"}},
     {"enable_thinking": False, "reasoning_effort": "high"}),
    ({}, None)])
def test_thinking_and_effort_become_the_chat_templates_variables(fields, variables):
    assert validate(MessagesRequest, body(**fields)).to_request().variables == variables


def test_sampling_fields():
    greedy = validate(MessagesRequest, body(temperature=0, top_k=40, top_p=0.5, stop_sequences=["END", "END", "\n\n"],
                                            stream=True)).to_request()
    assert greedy.sampling == SamplingParams(max_new_tokens=16, temperature=0.0, stop=("END", "\n\n"))
    assert greedy.stream and greedy.max_tokens_given and greedy.model == "m"
    sampled = validate(MessagesRequest, body(temperature=0.7, top_k=40, top_p=0.5)).to_request().sampling
    assert (sampled.temperature, sampled.top_k, sampled.top_p) == (0.7, 40, 0.5)


def test_an_output_format_is_a_json_schema_grammar():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    spec = validate(MessagesRequest, body(output_config={"format": {"type": "json_schema", "schema": schema}})) \
        .to_request().sampling.grammar
    assert (spec.kind, json.loads(spec.value), spec.field) == ("json", schema, "output_config.format.schema")


def test_count_tokens_takes_no_generation_fields():
    with pytest.raises(ValidationError) as err:
        validate(CountTokensRequest, {"model": "m", "messages": USER, "max_tokens": 5})
    assert err.value.param == "max_tokens" and "unknown field" in str(err.value)


# --- the reply ------------------------------------------------------------------------------------------------------

def _call(name, arguments):
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}


def test_content_blocks_of_a_whole_reply():
    blocks = routes.content_blocks("Thinking.", "Hello", [_call("get_weather", '{"city": "Paris"}')])
    assert blocks[:2] == [{"type": "thinking", "thinking": "Thinking.", "signature": ""},
                          {"type": "text", "text": "Hello"}]
    assert blocks[2]["id"].startswith("toolu_") and len(blocks[2]["id"]) == 30
    assert {k: v for k, v in blocks[2].items() if k != "id"} == {"type": "tool_use", "name": "get_weather",
                                                                 "input": {"city": "Paris"}}
    # blank reasoning and text make no block; arguments that are not an object are an empty input
    blocks = routes.content_blocks(" \n", "\n", [_call("f", "[1, 2]"), _call("g", "not json")])
    assert [(b["type"], b["input"]) for b in blocks] == [("tool_use", {}), ("tool_use", {})]
    assert routes.content_blocks(None, "", []) == []


def _accumulate(events: bytes) -> list:
    """The content blocks a client builds from a stream's events: each event named by its type, each block started,
    given its deltas and stopped in turn, a tool_use block's input the JSON its deltas spell."""
    blocks, open_index = [], None
    for chunk in events.decode().split("\n\n")[:-1]:
        name, data = chunk.split("\n")
        event = json.loads(data[len("data: "):])
        assert name == f"event: {event['type']}"
        if event["type"] == "content_block_start":
            assert open_index is None and event["index"] == len(blocks)
            blocks.append({**event["content_block"], "partial_json": ""})
            open_index = event["index"]
        elif event["type"] == "content_block_delta":
            block, delta = blocks[event["index"]], event["delta"]
            kind = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}[
                delta["type"]]
            assert event["index"] == open_index and kind in block
            block[kind] += delta[kind]
        else:
            assert event["type"] == "content_block_stop" and event["index"] == open_index
            open_index = None
    assert open_index is None
    for block in blocks:
        partial = block.pop("partial_json")
        if block["type"] == "tool_use":
            assert block["input"] == {}
            block["input"] = json.loads(partial)
    return blocks


def _stream_events(text: str, shape: ReplyShape, step: int) -> tuple:
    reply, stream, events = ReplyStream(shape), routes.BlockStream(), []
    for i in range(0, len(text), step):
        events += stream.push(*reply.push(text[i:i + step]))
    return b"".join(events + stream.push(*reply.flush()) + stream.close())


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_streamed_reply_has_the_whole_replys_blocks(step):
    shape = ReplyShape(tool_format="hermes", reasoning=True, thinking=True)
    text = ("Paris, then.\n</think>\n\nI will look it up.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
            "{\"city\": \"Paris\", \"unit\": \"é\"}}\n</tool_call>")
    streamed = _accumulate(_stream_events(text, shape, step))
    whole = routes.content_blocks(*read_reply(text, shape))
    assert [b["type"] for b in streamed] == [b["type"] for b in whole] == ["thinking", "text", "tool_use"]
    assert streamed[0] == whole[0] == {"type": "thinking", "thinking": "Paris, then.", "signature": ""}
    # (a whole reply's text before a call is stripped; a stream sent its newline before the call was seen)
    assert streamed[1]["text"].strip() == whole[1]["text"] == "I will look it up."
    assert streamed[2]["input"] == whole[2]["input"] == {"city": "Paris", "unit": "é"}
    assert streamed[2]["name"] == whole[2]["name"] == "get_weather" and streamed[2]["id"].startswith("toolu_")


def test_a_block_opens_on_its_first_text_that_is_not_blank():
    stream = routes.BlockStream()
    assert stream.push("", "\n", []) == [] and stream.push("", " ", []) == []
    events = b"".join(stream.push("", "Hi", []) + stream.close()).decode()
    assert '"text_delta", "text": "\\n Hi"' in events and events.count("event: content_block_start") == 1
    assert routes.BlockStream().push("", "\n\n", []) == []      # a reply of blanks: no block, as a whole one


def _finished(pieces, stops=()) -> SimpleNamespace:
    """A request that produced `pieces` (a token as its text) with these stop strings."""
    sampling = SamplingParams(stop=tuple(stops))
    req = SimpleNamespace(sampling=sampling, output_ids=list(pieces),
                          stop_strings=StopStrings(stops) if stops else None)
    for piece in pieces:
        if req.stop_strings is not None:
            req.stop_strings.push(piece)
    return req


def test_stop_reason_tells_a_stop_sequence_from_eos_and_names_it():
    stopped = _finished(["The", " end", " is", " HERE", "!"], stops=("is HE", "end", "HERE!"))
    assert routes.stop_reason(stopped, "stop", False) == ("stop_sequence", "end")
    late = _finished(["a", "b", "c", "STO", "P"], stops=("STOP", "xyz"))
    assert routes.stop_reason(late, "stop", False) == ("stop_sequence", "STOP")
    eos = _finished(["a", "b"], stops=("STOP",))
    assert routes.stop_reason(eos, "stop", False) == ("end_turn", None)
    assert routes.stop_reason(_finished(["a"]), "stop", False) == ("end_turn", None)
    assert routes.stop_reason(_finished(["a"]), "stop", True) == ("tool_use", None)
    assert routes.stop_reason(_finished(["a"]), "length", True) == ("max_tokens", None)


@pytest.mark.parametrize("status, kind", [(400, "invalid_request_error"), (401, "authentication_error"),
                                          (404, "not_found_error"), (405, "invalid_request_error"),
                                          (413, "request_too_large"), (429, "rate_limit_error"),
                                          (500, "api_error"), (503, "overloaded_error"), (529, "overloaded_error")])
def test_errors_are_anthropics_shape(status, kind):
    assert routes.error_body(status, "no", "x") == {"type": "error", "error": {"type": kind, "message": "no"}}


def test_an_errors_message_names_its_field():
    assert routes.error_body(400, "must be positive", "validation", "max_tokens")["error"]["message"] == \
        "max_tokens: must be positive"
    named = "messages[0].content[0]: image blocks are not supported"
    assert routes.error_body(400, named, "validation", "messages")["error"]["message"] == named
    assert routes.owns("/v1/messages") and routes.owns("/v1/messages/count_tokens")
    assert not routes.owns("/v1/messagesx") and not routes.owns("/v1/chat/completions")


def test_the_openapi_document_has_the_routes():
    doc = openapi("0")
    assert doc["paths"]["/v1/messages"]["post"]["requestBody"]["content"]["application/json"]["schema"] == \
        {"$ref": "#/components/schemas/MessagesRequest"}
    assert "/v1/messages/count_tokens" in doc["paths"] and "max_tokens" in \
        doc["components"]["schemas"]["MessagesRequest"]["required"]


def test_the_api_key_comes_in_x_api_key_and_a_refusal_is_anthropics_shape():
    """The server's own middlewares in front of these routes (no engine: a body the route refuses shows the key
    was taken)."""
    from aiohttp.test_utils import TestClient, TestServer

    from tests.apps import app_of_one

    async def run():
        app = app_of_one(None, {"api_key": "key-0001"})
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            out = []
            for headers in ({}, {"x-api-key": "wrong"}, {"x-api-key": "key-0001"},
                            {"Authorization": "Bearer key-0001"}):
                resp = await client.post("/v1/messages/count_tokens", json={"model": "m"}, headers={
                    "anthropic-version": "2023-06-01", **headers})
                out.append((resp.status, await resp.json()))
            return out
    (none, wrong, key, bearer) = asyncio.run(run())
    assert none[0] == wrong[0] == 401 and none[1]["error"]["type"] == "authentication_error"
    assert none[1]["type"] == "error" and "X-API-Key" in none[1]["error"]["message"]
    assert key == bearer == (400, {"type": "error", "error": {"type": "invalid_request_error",
                                                              "message": "'messages' is required"}})


def _stream_of(token_events) -> list:
    """The events `routes._stream` writes for a request whose engine gives `token_events` (over loopback HTTP)."""
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from llm_serving.master.request import TokenEvent

    async def run():
        req = SimpleNamespace(events=asyncio.Queue(), prompt_ids=[1, 2, 3], output_ids=[], stop_strings=None,
                              sampling=SamplingParams())
        for k, (text, finish, error) in enumerate(token_events):
            req.output_ids.append(k)
            req.events.put_nowait(TokenEvent(k, text, 0.0, False, finish_reason=finish, error=error))
        engine = SimpleNamespace()

        async def handler(request):
            return await routes._stream(request, engine, req, ReplyShape(), {"type": "message", "content": []})
        app = web.Application()
        app.router.add_post("/", handler)
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            resp = await client.post("/")
            assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
            return await resp.text()
    return [(chunk.split("\n")[0], json.loads(chunk.split("\n")[1][len("data: "):]))
            for chunk in asyncio.run(run()).split("\n\n")[:-1]]


def test_a_stream_ends_with_the_stop_reason_and_usage():
    events = _stream_of([("Hello", None, None), (" there", "stop", None)])
    assert [e["type"] for _, e in events] == ["message_start", "content_block_start", "content_block_delta",
                                              "content_block_delta", "content_block_stop", "message_delta",
                                              "message_stop"]
    assert events[-2][1] == {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                             "usage": {"output_tokens": 2}}


def test_an_engine_error_mid_stream_is_an_error_event():
    events = _stream_of([("Hello", None, None), ("", "error", "agent 0 died")])
    assert events[-1] == ("event: error", {"type": "error", "error": {"type": "api_error", "message":
                                                                      "generation failed: agent 0 died"}})
    assert "message_stop" not in [e["type"] for _, e in events]
    aborted = _stream_of([("", "abort", "server shutting down")])
    assert [e["type"] for _, e in aborted] == ["message_start", "error"]
    assert aborted[-1][1]["error"]["message"] == "the request was aborted: server shutting down"
