"""OpenAI's Responses API through the openai SDK (`client.responses`): the greedy reply is the chat route's for the
same messages, streamed or not (every event parsed by the SDK's models and its stream helper); stored responses
are read, continued and deleted by id; on SmolLM2, a forced function call, its output sent back through
previous_response_id, and a JSON schema's reply."""
from __future__ import annotations

import json

import jsonschema
import openai
import pydantic
import pytest

from tests.integration.server_harness import http

SYSTEM, ASK = "You tell stories.", "A cat"
SMOL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city", "strict": True,
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                          "properties": {"city": {"type": "string", "maxLength": 30},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}}}}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0}}}


def sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="not-needed", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def stories(stories_server):
    return sdk(stories_server)


@pytest.fixture(scope="module")
def smol(smollm2_server):
    return sdk(smollm2_server)


def test_a_greedy_response_is_the_chat_reply_streamed_or_not(stories):
    chat = stories.chat.completions.create(model="hf", max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}])
    expected = chat.choices[0].message.content
    assert expected.strip()
    status = {"stop": "completed", "length": "incomplete"}[chat.choices[0].finish_reason]
    out = stories.responses.create(model="hf", instructions=SYSTEM, input=ASK, max_output_tokens=12, temperature=0)
    assert out.output_text == expected and out.status == status and out.id.startswith("resp_")
    (message,) = out.output
    assert message.type == "message" and message.id.startswith("msg_") and message.role == "assistant"
    assert out.usage.input_tokens == chat.usage.prompt_tokens and out.usage.output_tokens == \
        chat.usage.completion_tokens and out.usage.total_tokens == chat.usage.total_tokens
    assert out.max_output_tokens == 12 and out.temperature == 0 and out.instructions == SYSTEM
    if status == "incomplete":
        assert out.incomplete_details.reason == "max_output_tokens"

    events = list(stories.responses.create(model="hf", instructions=SYSTEM, input=ASK, max_output_tokens=12,
                                           temperature=0, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{status}"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected
    last = events[-1].response
    assert last.output_text == expected and last.usage.output_tokens == chat.usage.completion_tokens

    # the SDK's stream helper (it checks each event against what it has accumulated)
    with stories.responses.stream(model="hf", instructions=SYSTEM, input=ASK, max_output_tokens=12,
                                  temperature=0) as stream:
        seen = list(stream)
    done = next(e for e in seen if e.type == "response.output_text.done")
    assert done.text == expected and seen[-1].type == f"response.{status}"
    assert [e.snapshot for e in seen if e.type == "response.output_text.delta"][-1] == expected


def test_a_stored_response_is_read_continued_and_deleted_by_id(stories, stories_server):
    first = stories.responses.create(model="hf", instructions=SYSTEM, input=ASK, max_output_tokens=8,
                                     temperature=0, metadata={"run": "1"})
    got = stories.responses.retrieve(first.id)
    assert got.model_dump() == first.model_dump() and got.metadata == {"run": "1"}
    # continued: its input and output come first, its instructions do not (OpenAI's rule)
    more = stories.responses.create(model="hf", input="And then?", previous_response_id=first.id,
                                    max_output_tokens=8, temperature=0)
    chat = stories.chat.completions.create(model="hf", max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": ASK}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"}])
    assert more.output_text == chat.choices[0].message.content and more.previous_response_id == first.id
    assert more.usage.input_tokens == chat.usage.prompt_tokens

    url = stories_server.url + f"/v1/responses/{first.id}"
    assert http("DELETE", url) == (200, {"id": first.id, "object": "response", "deleted": True})
    with pytest.raises(openai.NotFoundError):
        stories.responses.retrieve(first.id)
    status, body = http("DELETE", url)
    assert status == 404 and body["error"]["type"] == "invalid_request_error" and first.id in body["error"]["message"]
    with pytest.raises(openai.BadRequestError) as err:           # OpenAI's answer to an unknown one: 400
        stories.responses.create(model="hf", input="x", previous_response_id=first.id)
    assert err.value.code == "previous_response_not_found" and err.value.param == "previous_response_id"
    unstored = stories.responses.create(model="hf", input=ASK, max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        stories.responses.retrieve(unstored.id)


def test_what_cannot_be_served_is_a_400_naming_the_field(stories):
    for fields, param in (({"tools": [{"type": "web_search"}], "tool_choice": "required"}, "tool_choice"),
                          ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
                          ({"tool_choice": "required"}, "tool_choice"),
                          ({"model": "nope"}, None)):
        with pytest.raises((openai.BadRequestError, openai.NotFoundError)) as err:
            stories.responses.create(**{"model": "hf", "input": ASK, **fields})
        assert err.value.param == param, fields
    assert err.value.status_code == 404 and err.value.code == "model_not_found"


def test_a_forced_call_its_output_and_the_answer_through_previous_response_id(smol):
    ask = "What is the weather in Paris, in celsius?"
    first = smol.responses.create(model=SMOL, input=ask, tools=[WEATHER], tool_choice="required",
                                  parallel_tool_calls=False, temperature=0, max_output_tokens=60)
    assert first.status == "completed" and first.output_text == ""
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, WEATHER["parameters"])
    assert arguments["city"] == "Paris"
    # streamed: the same call, parsed by the SDK's helper (strict: it parses the arguments too)
    with smol.responses.stream(model=SMOL, input=ask, tools=[WEATHER], tool_choice="required",
                               parallel_tool_calls=False, temperature=0, max_output_tokens=60) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    (streamed,) = final.output
    assert (streamed.name, streamed.arguments, streamed.parsed_arguments) == (call.name, call.arguments, arguments)

    answer = smol.responses.create(model=SMOL, previous_response_id=first.id, tools=[WEATHER], temperature=0,
                                   max_output_tokens=60, input=[{"type": "function_call_output",
                                                                 "call_id": call.call_id,
                                                                 "output": "It is 41 degrees celsius and sunny."}])
    assert answer.status == "completed" and "41" in answer.output_text
    assert [i.type for i in answer.output] == ["message"]


def test_a_json_schema_reply_parses_and_validates(smol):
    ask = "Invent a person: name and age, as JSON."
    out = smol.responses.create(model=SMOL, input=ask, temperature=0, max_output_tokens=60, text={
        "format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}})
    assert out.status == "completed" and out.text.format.type == "json_schema"
    jsonschema.validate(json.loads(out.output_text), PERSON)

    class City(pydantic.BaseModel):
        name: str
        country: str

    parsed = smol.responses.parse(model=SMOL, input="Describe Paris as JSON with name and country.",
                                  temperature=0, max_output_tokens=60, text_format=City)
    assert isinstance(parsed.output_parsed, City) and parsed.output_parsed.name
