"""OpenAI's Responses API without a server: the request's validation (a ValidationError naming the field), its
translation into the chat request (items as chat messages, a stored response's history before them), the bounded
response store, and the output items and stream events `OutputBuilder` makes — checked against the openai SDK's own
models and its stream accumulator, so what the SDK's `responses.create` and `responses.stream` read is what we
send."""
from __future__ import annotations

import json

import openai
import pydantic
import pytest
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai._models import construct_type
from openai.types.responses import Response, ResponseStreamEvent

from llm_serving.server.api.base import validate
from llm_serving.server.api.responses import ResponsesRequest, check_call_ids
from llm_serving.server.errors import ValidationError
from llm_serving.server.routes_responses import OutputBuilder, ResponseStore, response_object, sse

WEATHER = {"type": "function", "name": "weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}, "strict": True}
CALL = {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": '{"city": "Paris"}'}
USAGE = {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
         "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 1}, "total_tokens": 10}
EVENT = pydantic.TypeAdapter(ResponseStreamEvent)


def body(**fields):
    return {"model": "m", "input": "hi", **fields}


def request(**fields) -> ResponsesRequest:
    return validate(ResponsesRequest, body(**fields))


@pytest.mark.parametrize("fields, param, words", [
    (dict(input=""), "input", "non-empty string"),
    (dict(input=[]), "input", "1 to 10000 items"),
    (dict(input=[{"role": "user"}]), "input", "'input[0].content' is required"),
    (dict(input=[{"role": "robot", "content": "x"}]), "input", "input[0].role must be"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), "input",
     "input_image: an image must be given as a base64 data: URL"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]), "input",
     "input_image needs image_url"),
    (dict(input=[{"role": "assistant", "content": [{"type": "input_image", "image_url": "data:image/png;base64,aGk="}]}]),
     "input", "input_image parts go in user messages"),
    (dict(input=[{"role": "user", "content": [{"type": "input_audio"}]}]), "input",
     "input[0].content[0].type must be 'input_text', 'output_text' or 'input_image'"),
    (dict(input=[{"type": "function_call", "name": "f", "arguments": "{}"}]), "input", "input[0].call_id"),
    (dict(input=[{"type": "web_search_call", "id": "ws_1"}]), "input", "item type 'web_search_call' is not served"),
    (dict(tools=[WEATHER, "web_search"]), "tools", "tools[1] must be an object with a string 'type'"),
    (dict(tools=[{"type": "namespace", "name": "mcp", "tools": []}]), "tools", "tools[0].tools"),
    (dict(tools=[{"type": "namespace", "name": "m", "tools": [{**WEATHER, "name": "a.b"}, WEATHER]},
                 {**WEATHER, "name": "m.weather"}]), "tools", "'m.weather' is given twice"),
    (dict(tools=[{"type": "web_search"}], tool_choice="required"), "tool_choice", "needs tools"),
    (dict(tools=[{**WEATHER, "name": "a b"}]), "tools", "must match"),
    (dict(tools=[WEATHER, WEATHER]), "tools", "given twice"),
    (dict(tools=[{**WEATHER, "function": {}}]), "tools", "unknown field"),
    (dict(tool_choice="required"), "tool_choice", "needs tools"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "name": "x"}), "tool_choice", "not one of the tools"),
    (dict(tools=[WEATHER], tool_choice={"type": "web_search_preview"}), "tool_choice", "is not served"),
    (dict(tools=[WEATHER], tool_choice="required", text={"format": {"type": "json_object"}}), "tool_choice",
     "cannot also follow text.format"),
    (dict(text={"format": {"type": "json_schema", "name": "x"}}), "text", "schema is required"),
    (dict(text={"format": {"type": "xml"}}), "text", "text.format.type must be"),
    (dict(text={"format": {"type": "json_schema", "name": "x", "schema": "{}"}}), "text",
     "text.format.schema must be true or false or an object"),
    (dict(truncation="auto"), "truncation", "must be 'disabled'"),
    (dict(max_output_tokens=0), "max_output_tokens", ">= 1"),
    (dict(temperature=2.5), "temperature", "<= 2.0"),
    (dict(reasoning={"effort": "extreme"}), "reasoning", "reasoning.effort must be"),
    (dict(metadata={"k": "v" * 513}), "metadata", "at most 512"),
    (dict(metadata={str(k): "v" for k in range(17)}), "metadata", None),
    (dict(background=True), "background", "unknown field"),
])
def test_a_bad_request_names_its_field(fields, param, words):
    with pytest.raises(ValidationError) as err:
        validate(ResponsesRequest, body(**fields))
    assert err.value.param == param
    if words is not None:
        assert words in str(err.value)


def test_hosted_tools_are_left_out_and_namespaces_served_as_qualified_functions():
    """Codex sends web_search (OpenAI's servers run it; this one has none: left out, and `left_out` names it for the
    log) and its MCP tools as a namespace (the client runs them: each a function the model calls by
    namespace.name, whose call item gives name and namespace apart, and whose history joins them again)."""
    close = {"type": "function", "name": "close_agent", "description": "close one",
             "parameters": {"type": "object", "properties": {"id": {"type": "string"}}}}
    r = request(tools=[WEATHER, {"type": "namespace", "name": "agents", "description": "sub-agents", "tools": [close]},
                       {"type": "web_search", "external_web_access": False}], tool_choice="required")
    assert [f["function"]["name"] for f in r.functions()] == ["weather", "agents.close_agent"]
    assert r.functions()[1]["function"]["parameters"] == close["parameters"]
    assert r.left_out() == ["tools of type 'web_search' (this server runs no hosted tools)"]
    assert r.call_name("agents.close_agent") == {"name": "close_agent", "namespace": "agents"}
    assert r.call_name("weather") == {"name": "weather"} and r.call_name("agents.x") == {"name": "agents.x"}
    assert [t["function"]["name"] for t in r.to_request(64).tools] == ["weather", "agents.close_agent"]
    # the call given back with its namespace is the qualified call in the chat history
    given = request(input=[{"type": "function_call", "call_id": "c1", "name": "close_agent", "namespace": "agents",
                            "arguments": "{}"}, {"type": "function_call_output", "call_id": "c1", "output": "ok"}])
    assert given.input_messages()[0]["tool_calls"][0]["function"]["name"] == "agents.close_agent"
    # the output item of such a call, and the message a continuation is given
    builder = OutputBuilder(response_object(r, "resp_1", 0), r.call_name)
    builder.push("", "", [{"id": "c2", "type": "function", "function": {"name": "agents.close_agent",
                                                                       "arguments": "{}"}}])
    [item] = builder.output
    assert (item["name"], item["namespace"]) == ("close_agent", "agents")
    assert builder.as_message()["tool_calls"][0]["function"]["name"] == "agents.close_agent"


def test_codex_fields_are_accepted():
    """What Codex CLI sends besides the input: include, prompt_cache_key, text.verbosity, store false, reasoning."""
    r = request(instructions="You are Codex.", tools=[WEATHER], tool_choice="auto", parallel_tool_calls=False,
                reasoning={"effort": "medium", "summary": "auto"}, store=False, stream=True,
                include=["reasoning.encrypted_content"], prompt_cache_key="thread-1", text={"verbosity": "low"},
                service_tier="auto", input=[{"type": "message", "role": "user",
                                             "content": [{"type": "input_text", "text": "hi"}]}])
    req = r.to_request(1024)
    assert req.messages == [{"role": "system", "content": "You are Codex."}, {"role": "user", "content": "hi"}]
    assert req.variables == {"reasoning_effort": "medium"} and req.stream and not req.parallel_tool_calls


def test_items_become_chat_messages():
    items = [{"role": "developer", "content": "Be brief."},
             {"role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                          {"type": "input_text", "text": "in Paris?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": None},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
             {**CALL, "id": "fc_1", "status": "completed"},
             {**CALL, "call_id": "call_2", "arguments": '{"city": "Lyon"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
             {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]}]
    req = request(input=items, instructions="Answer in English.").to_request(1024)
    calls = [{"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
             {"id": "call_2", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Lyon"}'}}]
    assert req.messages == [
        {"role": "system", "content": "Answer in English."}, {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": calls},     # its text and calls: one turn
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"}]


def test_the_request_translates_into_sampling_tools_and_a_grammar():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    r = request(tools=[WEATHER], tool_choice={"type": "function", "name": "weather"}, temperature=0, top_p=0.5,
                max_output_tokens=40, reasoning={"effort": "minimal"}, model="adapter")
    req = r.to_request(1024)
    assert req.tools == [{"type": "function", "function": {"name": "weather", "description": "the weather in a city",
                                                           "parameters": WEATHER["parameters"]}}]
    assert req.tool_choice == "weather" and req.model == "adapter"
    assert (req.sampling.temperature, req.sampling.top_p, req.sampling.max_new_tokens) == (0.0, 1.0, 40)
    assert req.max_tokens_given and req.max_tokens_field == "max_output_tokens"
    assert req.variables == {"reasoning_effort": "low"}               # minimal: gpt-oss's least
    sampled = request().to_request(1024)
    assert (sampled.sampling.temperature, sampled.sampling.max_new_tokens, sampled.max_tokens_given) == \
        (1.0, 1024, False)
    assert sampled.tools is None and sampled.sampling.grammar is None and sampled.variables is None
    fmt = request(text={"format": {"type": "json_schema", "name": "a", "schema": schema, "strict": True}})
    grammar = fmt.to_request(1024).sampling.grammar
    assert grammar.kind == "json" and json.loads(grammar.value) == schema
    assert request(text={"format": {"type": "json_object"}}).to_request(1024).sampling.grammar.kind == "json_object"
    assert request(text={"format": {"type": "text"}}).to_request(1024).sampling.grammar is None


def test_a_continuation_puts_the_history_first_and_calls_must_come_before_their_outputs():
    history = ({"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
                                                                    "function": {"name": "weather",
                                                                                 "arguments": "{}"}}]})
    snapshot = json.dumps(history)
    out = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}
    req = request(input=[out], instructions="New rules.").to_request(1024, history)
    assert req.messages == [{"role": "system", "content": "New rules."}, *history,
                            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    # a function call joining history's last assistant message is a new dict: the stored history is unchanged
    request(input=[{**CALL, "call_id": "call_9"}]).to_request(1024, history)
    assert json.dumps(history) == snapshot
    with pytest.raises(ValidationError) as err:
        request(input=[out]).to_request(1024)
    assert err.value.param == "input" and "call_1" in str(err.value)
    with pytest.raises(ValidationError):
        check_call_ids([{"role": "tool", "tool_call_id": "x", "content": ""}, {"role": "assistant", "content": "",
                        "tool_calls": [{"id": "x", "type": "function", "function": {}}]}])
    with pytest.raises(ValidationError) as err:
        request(input=[{"type": "reasoning", "id": "rs_1", "summary": []}]).to_request(1024)
    assert "no message" in str(err.value)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def stored(store: ResponseStore, name: str) -> None:
    store.put({"id": name, "object": "response"}, ({"role": "user", "content": name},))


def test_the_store_keeps_the_newest_within_its_count_and_age():
    clock = Clock()
    store = ResponseStore(max_count=3, max_age_s=100.0, clock=clock)
    for k in range(5):
        clock.now = k
        stored(store, f"r{k}")
    assert len(store) == 3 and store.get("r0") is None and store.get("r1") is None      # oldest created first
    assert store.get("r4").history == ({"role": "user", "content": "r4"},)
    clock.now = 102.5                  # r2 (created at 2) is 100.5 s old: gone; r3 and r4 are not
    assert store.get("r2") is None and store.get("r3") is not None and len(store) == 2
    assert store.delete("r3") and not store.delete("r3") and store.get("r3") is None
    clock.now = 104.5
    assert store.get("r4") is None and len(store) == 0


def replay(events: list) -> Response:
    """The events through the SDK: each validates as its event model, and its stream accumulator (what
    `client.responses.stream` runs) gives the response its last event carries."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for e in events:
        EVENT.validate_python(e)
        text = sse(e).decode()
        assert text.startswith(f"event: {e['type']}\ndata: ") and json.loads(text.split("data: ", 1)[1]) == e
    state = ResponseStreamState(input_tools=[WEATHER], text_format=openai.omit)
    for e in events:
        last = state.handle_event(construct_type(type_=ResponseStreamEvent, value=e))
    return last[-1].response


def builder(**fields) -> OutputBuilder:
    return OutputBuilder(response_object(request(tools=[WEATHER], **fields), "resp_1", 1700000000))


def test_the_stream_tells_reasoning_text_and_calls_in_order_and_the_sdk_reads_it():
    b = builder(max_output_tokens=50, metadata={"k": "v"})
    events = b.start() + b.push("Think", "", []) + b.push("ing.", "\n", []) + b.push("", "It is ", [])
    events += b.push("", "sunny.", [{"id": "call_7", "type": "function",
                                      "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}])
    events += b.finish("stop", USAGE)
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
                     "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
                     "response.output_item.done",
                     "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                     "response.output_text.delta", "response.output_text.done", "response.content_part.done",
                     "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == ["\nIt is ", "sunny."]
    response = replay(events)
    assert response.status == "completed" and response.output_text == "\nIt is sunny."
    reasoning, message, call = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Thinking." and reasoning.summary == []
    assert message.id.startswith("msg_") and message.status == "completed"
    assert (call.call_id, call.name, call.arguments, call.status) == \
        ("call_7", "weather", '{"city": "Paris"}', "completed") and call.id.startswith("fc_")
    assert response.usage.output_tokens_details.reasoning_tokens == 1 and response.max_output_tokens == 50
    assert response.metadata == {"k": "v"} and response.tools[0].name == "weather"
    assert Response.model_validate(b.response).output_text == "\nIt is sunny."     # the non-streamed body
    assert b.as_message() == {"role": "assistant", "content": "\nIt is sunny.", "tool_calls": [
        {"id": "call_7", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]}


def test_whole_or_in_pieces_the_output_is_the_same():
    pieces = [("a", "", []), ("b", "", []), ("", " \n", []), ("", "x", []), ("", "y", [])]
    streamed, whole = builder(), builder()
    for piece in pieces:
        streamed.push(*piece)
    whole.push("ab", " \nxy", [])
    for b in (streamed, whole):
        b.finish("stop", USAGE)
    strip = [{k: v for k, v in item.items() if k != "id"} for item in streamed.response["output"]]
    assert strip == [{k: v for k, v in item.items() if k != "id"} for item in whole.response["output"]]
    assert strip[1]["content"][0]["text"] == " \nxy"


def test_blank_text_before_a_call_is_no_message():
    b = builder(tool_choice="required")
    events = b.start() + b.push("", "\n", []) + b.push("", "\n", [{"id": "call_1", "type": "function",
                                                                    "function": {"name": "weather",
                                                                                 "arguments": "{}"}}])
    events += b.push("", "  ", []) + b.finish("stop", USAGE)
    response = replay(events)
    assert [i.type for i in response.output] == ["function_call"] and response.output_text == ""
    assert response.tool_choice == "required"
    assert b.as_message() == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]}


def test_a_reply_cut_by_max_output_tokens_is_incomplete():
    b = builder(max_output_tokens=2)
    events = b.start() + b.push("", "Once upon", []) + b.finish("length", USAGE)
    assert events[-1]["type"] == "response.incomplete"
    response = replay(events)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete" and response.output_text == "Once upon"
    assert "completed_at" not in b.response


def test_an_engine_failure_is_response_failed():
    b = builder()
    events = b.start() + b.push("", "Once", []) + b.fail("agent 0 died")
    assert events[-1]["type"] == "response.failed" and "error" not in events[-1]   # (a top-level error: the SDK
    failed = EVENT.validate_python(events[-1])                                    # would raise, not yield it)
    assert failed.response.status == "failed" and failed.response.error.code == "server_error"
    assert failed.response.error.message == "agent 0 died"


def test_the_response_echoes_the_request():
    r = request(instructions="Be brief.", previous_response_id="resp_0", temperature=0.5, top_p=0.9, user="u",
                tools=[WEATHER], tool_choice="none", parallel_tool_calls=False, reasoning={"effort": "high"},
                store=False,
                text={"format": {"type": "json_schema", "name": "p", "schema": {"type": "object"}, "strict": True}})
    obj = response_object(r, "resp_9", 1700000000)
    response = Response.model_validate(obj)
    assert (response.id, response.instructions, response.previous_response_id, response.temperature,
            response.top_p, response.parallel_tool_calls, response.store) == \
        ("resp_9", "Be brief.", "resp_0", 0.5, 0.9, False, False)
    assert obj["tool_choice"] == "none"
    named = request(tools=[WEATHER], tool_choice={"type": "function", "name": "weather"})
    assert response_object(named, "resp_2", 0)["tool_choice"] == {"type": "function", "name": "weather"}
    assert obj["text"] == {"format": {"type": "json_schema", "name": "p", "schema": {"type": "object"},
                                      "strict": True}}
    assert obj["reasoning"] == {"effort": "high", "summary": None} and obj["tools"][0] == WEATHER
    assert response_object(request(), "resp_1", 0)["text"] == {"format": {"type": "text"}}


def _read_as_the_route_does(text: str, shape, reason: str) -> Response:
    """A reply's text token by token (3 characters here) through ReplyStream into a builder, as POST /v1/responses
    reads it, streamed or not: the events replayed through the SDK."""
    from llm_serving.server.reply import ReplyStream

    b, reply = builder(), ReplyStream(shape)
    events = b.start()
    for k in range(0, len(text), 3):
        events += b.push(*reply.push(text[k:k + 3]))
    events += b.push(*reply.flush()) + b.finish(reason, USAGE)
    response = replay(events)
    whole = Response.model_validate(b.response)                                # (the non-streamed body)
    assert [(i.type, i.id) for i in whole.output] == [(i.type, i.id) for i in response.output]
    return response


def test_items_come_in_the_replys_order_and_a_cut_call_is_no_item():
    from llm_serving.server.reply import ReplyShape

    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    response = _read_as_the_route_does(f"Let me look.\n{call}\nIt is sunny.", ReplyShape(tool_format="hermes"),
                                       "stop")
    assert [i.type for i in response.output] == ["message", "function_call", "message"]
    assert [i.content[0].text for i in response.output if i.type == "message"] == ["Let me look.\n", "\nIt is sunny."]
    # tool_choice required, max_output_tokens cut a second call: the first, completed, and nothing else
    forced = ReplyShape(tool_format="hermes", forced=True)
    response = _read_as_the_route_does(f'{call}\n<tool_call>\n{{"name": "wea', forced, "length")
    assert [(i.type, i.status) for i in response.output] == [("function_call", "completed")]
    assert response.status == "incomplete" and response.output_text == ""
