"""Structured outputs and logit controls on the default model (SmolLM2-135M-Instruct), through real clients:
the openai SDK's `parse` with a pydantic model, huggingface_hub's `text_generation(grammar=...)`, plain HTTP for
vLLM's and TGI's fields; outputs checked with `json` and `jsonschema`, and the picks against the model's own
log-probabilities of the same position."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pydantic
import pytest

from tests.integration.server_harness import http, parse_sse

MODEL = "SmolLM2-135M-Instruct"
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "languages"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "languages": {"type": "array", "items": {"enum": ["English", "French", "German"]},
                                       "maxItems": 3}}}


@pytest.fixture(scope="module")
def client(smollm2_server):
    return openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="not-needed", max_retries=0, timeout=120)


def chat(url, content, **fields):
    return http("POST", url + "/v1/chat/completions", {"model": MODEL, "temperature": 0, "max_tokens": 80,
                                                        "messages": [{"role": "user", "content": content}], **fields})


def test_a_json_schema_reply_parses_and_validates_sampled_or_greedy_streamed_or_not(smollm2_server):
    url = smollm2_server.url
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    prompt = "Invent a person who speaks French: name, age and languages, as JSON."
    status, body = chat(url, prompt, response_format=fmt)
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"          # the grammar ended the reply: its last token closes the object
    reply = json.loads(choice["message"]["content"])
    jsonschema.validate(reply, PERSON)
    assert list(reply) == ["name", "age", "languages"]      # in the schema's order
    # sampled, three choices (each its own matcher), streamed
    status, text = chat(url, prompt, response_format=fmt, temperature=1.0, seed=7, n=3, stream=True)
    assert status == 200
    parts = {}
    for event in parse_sse(text):
        for c in event["choices"]:
            parts.setdefault(c["index"], []).append(c["delta"].get("content") or "")
            if c["finish_reason"] is not None:
                assert c["finish_reason"] == "stop", event
    assert sorted(parts) == [0, 1, 2]
    for index, pieces in parts.items():
        jsonschema.validate(json.loads("".join(pieces)), PERSON)


def test_the_openai_sdk_parses_a_pydantic_model(client):
    class City(pydantic.BaseModel):
        name: str
        country: str
        population_millions: float

    done = client.beta.chat.completions.parse(
        model=MODEL, temperature=0, max_tokens=80, response_format=City,
        messages=[{"role": "user", "content": "Describe Paris as JSON with name, country and population."}])
    city = done.choices[0].message.parsed
    assert isinstance(city, City) and city.name


def test_vllm_choice_regex_and_grammar_and_tgi_grammar(smollm2_server):
    url = smollm2_server.url
    status, body = chat(url, "Is water wet? Answer yes or no.", structured_outputs={"choice": ["yes", "no"]})
    assert status == 200 and body["choices"][0]["message"]["content"] in ("yes", "no"), body
    status, body = http("POST", url + "/v1/completions", {"model": MODEL, "prompt": "The year the war ended was",
                                                          "temperature": 0, "max_tokens": 12,
                                                          "guided_regex": r" [12][0-9]{3}\."})
    assert status == 200 and re.fullmatch(r" [12][0-9]{3}\.", body["choices"][0]["text"]), body
    gbnf = 'root ::= "The answer is " ("red" | "green" | "blue") "."'
    status, body = chat(url, "Pick a colour.", structured_outputs={"grammar": gbnf})
    assert status == 200 and re.fullmatch(r"The answer is (red|green|blue)\.",
                                          body["choices"][0]["message"]["content"]), body
    lark = 'start: "x=" /[0-9]{2}/'
    status, body = chat(url, "Pick a number.", guided_grammar=lark, temperature=1.0, seed=3)
    assert status == 200 and re.fullmatch(r"x=[0-9]{2}", body["choices"][0]["message"]["content"]), body
    # TGI's parameters.grammar, through huggingface_hub's client
    huggingface_hub = pytest.importorskip("huggingface_hub")
    tgi = huggingface_hub.InferenceClient(base_url=url)
    out = tgi.text_generation("Give the temperature as JSON:", max_new_tokens=40,
                              grammar={"type": "json", "value": {"type": "object", "required": ["celsius"],
                                                                 "properties": {"celsius": {"type": "number"}},
                                                                 "additionalProperties": False}})
    assert isinstance(json.loads(out)["celsius"], (int, float)), out


def test_a_grammar_that_does_not_compile_is_a_400_naming_the_field_and_nothing_else_is_affected(smollm2_server):
    url = smollm2_server.url
    cases = [({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
             ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
              "response_format.json_schema.schema", "foo"),
             ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar", ""),
             ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
             ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex", "at most one"),
             ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
             ({"logit_bias": {"abc": 1}}, "logit_bias", "token id"),
             ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
             ({"min_p": 2}, "min_p", "<= 1.0"),
             ({"min_tokens": 50, "max_tokens": 10}, "min_tokens", "more than"),
             ({"allowed_token_ids": [10 ** 6]}, "allowed_token_ids", "token ids"),
             ({"bad_words": ["", "x"]}, "bad_words", "non-blank")]
    for fields, param, words in cases:
        status, body = chat(url, "Hi", **fields)
        assert status == 400, (fields, body)
        assert body["error"]["param"] == param and words in body["error"]["message"], (fields, body)
    status, body = http("POST", url + "/generate", {"inputs": "Hi", "parameters": {"grammar": {"type": "regex",
                                                                                            "value": "(("}}})
    assert status == 400 and "parameters.grammar.value" in body["error"], body
    status, body = chat(url, "What is the capital of France?", max_tokens=8)
    assert status == 200 and "Paris" in body["choices"][0]["message"]["content"], body


def _top(url, prompt, k=5):
    """The model's k most likely first tokens of a completion: [(token text, logprob)]."""
    status, body = http("POST", url + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                                          "temperature": 0, "logprobs": k})
    assert status == 200, body
    return list(body["choices"][0]["logprobs"]["top_logprobs"][0].items())


def test_allowed_token_ids_and_logit_bias_pick_as_the_models_logprobs_say(smollm2_server):
    url = smollm2_server.url
    prompt = "The capital of France is"
    top = _top(url, prompt)
    _, tok = http("POST", url + "/tokenize", {"prompt": top[1][0] + top[2][0], "add_special_tokens": False})
    second, third = tok["tokens"]
    # only the 2nd and 3rd most likely allowed: greedy takes the 2nd
    status, body = http("POST", url + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                                          "temperature": 0, "allowed_token_ids": [third, second]})
    assert status == 200 and body["choices"][0]["text"] == top[1][0], (top, body)
    # a bias of more than the gap makes the 3rd the likeliest; one of less leaves the 1st
    gap = top[0][1] - top[2][1]
    for bias, expected in ((gap + 0.5, top[2][0]), (gap - 0.5, top[0][0])):
        status, body = http("POST", url + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                                              "temperature": 0, "logit_bias": {str(third): bias}})
        assert status == 200 and body["choices"][0]["text"] == expected, (bias, top, body)
    # -100 bans: the 1st never comes, whatever the seed
    _, tok = http("POST", url + "/tokenize", {"prompt": top[0][0], "add_special_tokens": False})
    for seed in range(3):
        status, body = http("POST", url + "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                                              "temperature": 1.0, "seed": seed,
                                                              "logit_bias": {str(tok["tokens"][0]): -100}})
        assert status == 200 and body["choices"][0]["text"] != top[0][0], body


def test_min_tokens_bad_words_and_min_p(smollm2_server):
    url = smollm2_server.url
    # the model answers in a few tokens and stops; min_tokens keeps its EOS away until then
    status, short = chat(url, "Say only the word: yes", max_tokens=30)
    assert status == 200 and short["choices"][0]["finish_reason"] == "stop"
    n = short["usage"]["completion_tokens"]
    status, body = chat(url, "Say only the word: yes", max_tokens=30, min_tokens=n + 5)
    assert status == 200 and body["usage"]["completion_tokens"] >= n + 5, body
    # a bad word never appears, though greedy would write it
    status, body = chat(url, "What is the capital of France?", max_tokens=20)
    assert "Paris" in body["choices"][0]["message"]["content"]
    status, body = chat(url, "What is the capital of France?", max_tokens=20, bad_words=["Paris"])
    assert status == 200 and "Paris" not in body["choices"][0]["message"]["content"], body
    # min_p 1: only the likeliest token survives, so sampling at any temperature is greedy
    status, greedy = chat(url, "Name three fruits.", max_tokens=16)
    for seed in (1, 2):
        status, body = chat(url, "Name three fruits.", max_tokens=16, temperature=1.5, seed=seed, min_p=1.0)
        assert status == 200 and body["choices"][0]["message"]["content"] == \
            greedy["choices"][0]["message"]["content"], body


TOOLS = [{"type": "function", "function": {
             "name": "get_weather", "description": "The current weather in a city",
             "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                            "properties": {"city": {"type": "string", "maxLength": 30},
                                           "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
         {"type": "function", "function": {
             "name": "add", "description": "Add two integers",
             "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


def _validate_call(call):
    fn = next(t["function"] for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), fn["parameters"])
    assert call.id.startswith("call_") and call.type == "function"


def test_a_forced_tool_call_validates_whole_and_streamed_and_its_result_goes_back_into_the_chat(client):
    ask = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
    done = client.chat.completions.create(model=MODEL, messages=ask, tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=False, temperature=0, max_tokens=60)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    _validate_call(call)
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Paris"
    # a named function: that one, whatever the question
    named = client.chat.completions.create(model=MODEL, messages=ask, tools=TOOLS, temperature=0.8, seed=1,
                                           tool_choice={"type": "function", "function": {"name": "add"}},
                                           max_tokens=60)
    (other,) = named.choices[0].message.tool_calls
    assert other.function.name == "add"
    _validate_call(other)
    # streamed: the same call as one delta.tool_calls, then finish_reason tool_calls, no tag as content
    stream = client.chat.completions.create(model=MODEL, messages=ask, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, temperature=0, max_tokens=60, stream=True)
    deltas, reasons, content = [], [], ""
    for chunk in stream:
        for c in chunk.choices:
            deltas += c.delta.tool_calls or []
            content += c.delta.content or ""
            reasons.append(c.finish_reason)
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == \
        [(0, call.function.name, call.function.arguments)]
    assert reasons[-1] == "tool_calls" and "<tool_call>" not in content
    # the call and its result in the history: the model answers from the result
    reply = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=40, tools=TOOLS, messages=[
        *ask, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "It is 41 degrees celsius and sunny."}])
    assert reply.choices[0].finish_reason == "stop" and "41" in reply.choices[0].message.content


def test_tool_requests_that_cannot_be_served_are_400s_naming_the_field(smollm2_server):
    url = smollm2_server.url
    bad_params = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]
    for fields, param in (({"tools": bad_params, "tool_choice": "required"}, "tools"),
                          ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
                          ({"tool_choice": "required"}, "tool_choice"),
                          ({"tools": [{"type": "function"}]}, "tools")):
        status, body = chat(url, "Hi", **fields)
        assert status == 400 and body["error"]["param"] == param, (fields, body)
    status, body = chat(url, "Hi", messages=[{"role": "tool", "content": "x"}])
    assert status == 400 and "tool_call_id" in body["error"]["message"], body


def test_a_forced_call_with_parallel_calls_allowed_ends_with_its_call(smollm2_server):
    """tool_choice required with parallel calls allowed (the default), sampled: SmolLM2, which repeated its call
    until max_tokens under a grammar that let it open another, writes one call and the reply ends on the token that
    closes it: finish_reason tool_calls, never content, whole or streamed (n=4: seeds 0..3)."""
    url = smollm2_server.url
    body = {"model": MODEL, "tools": TOOLS, "tool_choice": "required", "temperature": 1.0, "seed": 0, "n": 4,
            "max_tokens": 60, "logprobs": True,
            "messages": [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]}
    status, whole = http("POST", url + "/v1/chat/completions", body)
    assert status == 200, whole
    ends = []
    for choice in whole["choices"]:
        message, tokens = choice["message"], [e["token"] for e in choice["logprobs"]["content"]]
        assert message["content"] is None and message["tool_calls"], choice
        for call in message["tool_calls"]:
            fn = next(t["function"] for t in TOOLS if t["function"]["name"] == call["function"]["name"])
            jsonschema.validate(json.loads(call["function"]["arguments"]), fn["parameters"])
        text = "".join(tokens)
        closed = text.rindex("</tool_call>") + len("</tool_call>")
        after = len(tokens) - next(k for k in range(len(tokens)) if len("".join(tokens[:k + 1])) >= closed) - 1
        assert choice["finish_reason"] == "tool_calls" and after == 0 and len(message["tool_calls"]) == 1, text
        ends.append((choice["finish_reason"], [c["function"]["arguments"] for c in message["tool_calls"]]))
    status, text = http("POST", url + "/v1/chat/completions", {**body, "stream": True, "logprobs": False})
    streamed = {}
    for event in parse_sse(text):
        for c in event["choices"]:
            assert not c["delta"].get("content"), c
            got = streamed.setdefault(c["index"], [None, []])
            got[1] += [d["function"]["arguments"] for d in c["delta"].get("tool_calls") or []]
            got[0] = c["finish_reason"] or got[0]
    assert [tuple(streamed[i]) for i in range(4)] == [(reason, calls) for reason, calls in ends]
