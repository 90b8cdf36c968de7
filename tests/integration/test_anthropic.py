"""Anthropic's Messages API through the official `anthropic` SDK: text, usage and stop reasons, the stream against the
whole greedy reply, count_tokens, errors in Anthropic's shape, a tool round trip on SmolLM2 (tool_choice any forces
the call through its grammar), and `thinking` reaching a template that reads Qwen3's switch. Greedy text is checked
against the OpenAI chat route's on the same chat."""
from __future__ import annotations

import json

import jsonschema
import pytest

from tests.integration.server_harness import REPO, http, serving

anthropic = pytest.importorskip("anthropic")

STORY = [{"role": "user", "content": "A cat"}]
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "input_schema": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                            "properties": {"city": {"type": "string", "maxLength": 40},
                                           "unit": {"enum": ["celsius", "fahrenheit"]}}}}


# the SDK's create() has no temperature (Anthropic's newer models take none); the server takes it, as older clients
# send it: greedy here, where replies are compared
GREEDY = {"extra_body": {"temperature": 0}}


def _client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="not-needed", max_retries=0, timeout=120)


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_create_stream_and_count_tokens_agree_with_the_chat_route(stories_server):
    client = _client(stories_server)
    status, chat = http("POST", stories_server.url + "/v1/chat/completions", {
        "model": "hf", "messages": STORY, "max_tokens": 12, "temperature": 0})
    assert status == 200
    out = client.messages.create(model="hf", max_tokens=12, **GREEDY, messages=STORY)
    assert out.type == "message" and out.role == "assistant" and out.id.startswith("msg_") and out.model == "hf"
    assert [b.type for b in out.content] == ["text"] and out.content[0].text == chat["choices"][0]["message"]["content"]
    assert out.stop_reason == "max_tokens" and out.stop_sequence is None
    assert (out.usage.input_tokens, out.usage.output_tokens) == (chat["usage"]["prompt_tokens"], 12)
    counted = client.messages.count_tokens(model="hf", messages=STORY)
    assert counted.input_tokens == out.usage.input_tokens
    # streamed: the text deltas join to the same text; the final message carries the stop reason and usage
    with client.messages.stream(model="hf", max_tokens=12, **GREEDY, messages=STORY) as stream:
        deltas = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(deltas) > 1 and "".join(deltas) == out.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 12
    assert final.usage.input_tokens == out.usage.input_tokens and final.content[0].text == out.content[0].text
    # a stop sequence from the greedy text: the reply ends before it and names it
    word = out.content[0].text.split()[2]
    stopped = client.messages.create(model="hf", max_tokens=12, **GREEDY, messages=STORY,
                                     stop_sequences=["never in a story", word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == out.content[0].text[:out.content[0].text.index(word)]


def test_the_raw_stream_is_anthropics_event_sequence(stories_server):
    status, body = http("POST", stories_server.url + "/v1/messages", {
        "model": "hf", "max_tokens": 4, "temperature": 0, "stream": True, "messages": STORY},
        headers={"anthropic-version": "2023-06-01", "anthropic-beta": "fine-grained-tool-streaming-2025-05-14"})
    assert status == 200
    events = [(chunk.split("\n")[0], json.loads(chunk.split("\n")[1][len("data: "):]))
              for chunk in body.strip().split("\n\n")]
    assert all(name == f"event: {e['type']}" for name, e in events)
    kinds = [e["type"] for _, e in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    assert events[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2][1]["usage"] == {"output_tokens": 4}


def test_errors_are_anthropics_shape_through_the_sdk(stories_server):
    client = _client(stories_server)
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="hf", max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    assert err.value.status_code == 400 and err.value.body["type"] == "error"
    assert err.value.body["error"]["type"] == "invalid_request_error"
    assert "model 'hf' does not take images" in err.value.body["error"]["message"]    # (a text model)
    with pytest.raises(anthropic.BadRequestError) as err:       # a served field's bad value, whatever comes with it
        client.messages.create(model="hf", max_tokens=8, messages=STORY, extra_body={"best_of": 2, "top_k": -1})
    assert err.value.body["error"]["message"].startswith("top_k must be >= 0")
    # an unknown field is ignored; max_tokens is a ceiling, cut to what the context leaves
    reply = client.messages.create(model="hf", max_tokens=100000, messages=STORY,
                                   extra_body={"best_of": 2, "temperature": 0})
    assert reply.stop_reason in ("max_tokens", "end_turn") and reply.usage.output_tokens >= 1
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model="claude-sonnet-4-5", max_tokens=8, messages=STORY)
    assert err.value.body["error"]["type"] == "not_found_error" and "'hf'" in err.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.count_tokens(model="claude-sonnet-4-5", messages=STORY)
    status, body = http("POST", stories_server.url + "/v1/messages", raw=b"{nope")
    assert status == 400 and body["type"] == "error" and "not valid JSON" in body["error"]["message"]


def test_a_forced_tool_call_and_its_result_round_trip_on_smollm2(smollm2_server):
    client = _client(smollm2_server)
    model = "SmolLM2-135M-Instruct"
    ask = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
    call = client.messages.create(model=model, max_tokens=60, **GREEDY, messages=ask, tools=[WEATHER],
                                  tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert call.stop_reason == "tool_use" and call.content[-1].type == "tool_use"
    (use,) = [b for b in call.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_") and use.input["city"] == "Paris"
    jsonschema.validate(use.input, WEATHER["input_schema"])
    assert client.messages.count_tokens(model=model, messages=ask, tools=[WEATHER],
                                        tool_choice={"type": "any"}).input_tokens == call.usage.input_tokens
    # streamed: the same call, its input from input_json_delta
    with client.messages.stream(model=model, max_tokens=60, **GREEDY, messages=ask, tools=[WEATHER],
                                tool_choice={"type": "any", "disable_parallel_tool_use": True}) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(use.name, use.input)]
    # the call and its result in the history: the model answers from the result
    reply = client.messages.create(model=model, max_tokens=40, **GREEDY, tools=[WEATHER], messages=[
        *ask, {"role": "assistant", "content": [b.model_dump() for b in call.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "It is 41 degrees celsius and sunny."}]}])
    assert reply.stop_reason == "end_turn" and [b.type for b in reply.content] == ["text"]
    assert "41" in reply.content[0].text


# Qwen3's switch in a template of the test's own: thinking opens <think> in the prompt (the reply starts inside it),
# enable_thinking false closes an empty block there
SWITCH = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:"
          "{% if enable_thinking is defined and enable_thinking is false %} <think>\n\n</think>\n\n"
          "{% else %} <think>\n{% endif %}{% endif %}")


def test_thinking_reaches_the_chat_template_and_the_reasoning_is_a_thinking_block(stories_dir, tmp_path):
    template = tmp_path / "switch.jinja"
    template.write_text(SWITCH)
    args = ["--config", str(REPO / "configs" / "stories260K.yaml"), "--model", str(stories_dir / "hf"),
            "--set", f"tokenizer.chat_template={template}"]
    with serving(args, tmp_path / "server.log") as server:
        client = _client(server)
        ask = dict(model="hf", max_tokens=10, messages=[{"role": "user", "content": "Once upon a time"}], **GREEDY)
        on = client.messages.create(**ask, thinking={"type": "enabled", "budget_tokens": 1024})
        assert [b.type for b in on.content] == ["thinking"] and on.content[0].thinking.strip()
        assert on.content[0].signature == "" and on.stop_reason == "max_tokens"
        with client.messages.stream(**ask, thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
            thought = "".join(e.thinking for e in stream if e.type == "thinking")
        assert thought == on.content[0].thinking
        off = client.messages.create(**ask, thinking={"type": "disabled"})
        assert [b.type for b in off.content] == ["text"] and off.content[0].text.strip()
        # the closed block is in the prompt: more tokens, as count_tokens says too
        assert off.usage.input_tokens > on.usage.input_tokens == client.messages.count_tokens(
            model="hf", messages=ask["messages"], thinking={"type": "enabled", "budget_tokens": 1024}).input_tokens
        assert client.messages.count_tokens(model="hf", messages=ask["messages"], thinking={
            "type": "disabled"}).input_tokens == off.usage.input_tokens
