"""The official `ollama` client against the server: chat and generate (streamed and not, against the OpenAI
routes' greedy replies of the same prompts), list, show, ps (and /api/version over plain HTTP), format with a JSON
schema, a tool call's history, `think` on a thinking template, and errors as ResponseError with their status.

SmolLM2-135M does not call a tool on its own (asked for Paris's weather with a tool at hand, it answers in words,
and a few-shot history makes it imitate the tool's response rather than the call), and Ollama has no tool_choice to
force one. So the reply's calls parsed into message.tool_calls are tested over a scripted engine
(tests/unit/test_ollama_api.py), and here the parsing path a call would take is checked with `format`: a schema
of a get_weather call, whose reply parses and validates."""
from __future__ import annotations

import json

import jsonschema
import ollama
import pytest

from tests.integration.server_harness import REPO, http, serving

SMOLLM2 = "SmolLM2-135M-Instruct"
GREEDY = {"temperature": 0, "num_predict": 12}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                            "parameters": {"type": "object", "required": ["city"], "properties": {
                                                "city": {"type": "string", "description": "the city"}}}}}


@pytest.fixture(scope="module")
def client(stories_server):
    return ollama.Client(host=stories_server.url, timeout=120)


@pytest.fixture(scope="module")
def smollm2(smollm2_server):
    return ollama.Client(host=smollm2_server.url, timeout=120)


def openai_chat(url, messages, max_tokens, **fields):
    status, body = http("POST", url + "/v1/chat/completions", {"model": fields.pop("model", "hf"), "messages": messages,
                                                               "max_tokens": max_tokens, "temperature": 0, **fields})
    assert status == 200, body
    return body


def test_chat_streamed_and_not_is_the_greedy_reply_of_the_openai_route(client, stories_server):
    messages = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "A cat"}]
    expected = openai_chat(stories_server.url, messages, 12)
    whole = client.chat(model="hf", messages=messages, options=GREEDY, stream=False)
    assert whole.message.role == "assistant" and whole.message.content == expected["choices"][0]["message"]["content"]
    assert whole.done and whole.done_reason == expected["choices"][0]["finish_reason"]
    assert whole.prompt_eval_count == expected["usage"]["prompt_tokens"]
    assert whole.eval_count == expected["usage"]["completion_tokens"]
    assert whole.total_duration >= whole.eval_duration > 0 and whole.load_duration == 0
    parts = list(client.chat(model="hf:latest", messages=messages, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True] and parts[-1].message.content == ""
    assert parts[-1].done_reason == whole.done_reason and parts[-1].eval_count == whole.eval_count
    assert all(p.model == "hf:latest" and p.created_at for p in parts)
    # seeded sampling is reproducible; logprobs come per token
    sampled = [client.chat(model="hf", messages=messages, options={"temperature": 1.0, "seed": 7, "num_predict": 16})
               .message.content for _ in range(2)]
    assert sampled[0] == sampled[1]
    scored = client.chat(model="hf", messages=messages, options=GREEDY, logprobs=True, top_logprobs=2)
    assert "".join(lp.token for lp in scored.logprobs) == whole.message.content
    assert all(lp.top_logprobs[0].logprob == pytest.approx(lp.logprob, abs=1e-4) for lp in scored.logprobs)


def test_generate_raw_is_a_completion_and_templated_is_a_chat(client, stories_server):
    prompt = "Once upon a time"
    status, completion = http("POST", stories_server.url + "/v1/completions", {
        "model": "hf", "prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert status == 200
    raw = client.generate(model="hf", prompt=prompt, raw=True, options=GREEDY)
    assert raw.response == completion["choices"][0]["text"] and raw.done_reason == "length"
    assert raw.eval_count == 12 and raw.prompt_eval_count == completion["usage"]["prompt_tokens"]
    streamed = list(client.generate(model="hf", prompt=prompt, raw=True, options=GREEDY, stream=True))
    assert "".join(p.response for p in streamed) == raw.response and streamed[-1].done
    templated = client.generate(model="hf", prompt="A cat", system="You tell stories.", options=GREEDY)
    chat = openai_chat(stories_server.url, [{"role": "system", "content": "You tell stories."},
                                            {"role": "user", "content": "A cat"}], 12)
    assert templated.response == chat["choices"][0]["message"]["content"]
    loaded = client.generate(model="hf", prompt="")            # Ollama's "load the model"
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""


def test_list_show_ps_and_version_describe_the_served_model(client, stories_server):
    status, info = http("GET", stories_server.url + "/info")
    (listed,) = client.list().models
    assert listed.model == "hf:latest" and listed.size > 0 and len(listed.digest) == 64
    assert (listed.details.format, listed.details.family, listed.details.quantization_level) == \
        ("safetensors", "llama", "F32")
    shown = client.show("hf")
    assert shown.template == ""                                    # the built-in LLaMA-2 format
    # no tools: its format takes none, and the system message that would describe them does not fit its context
    assert shown.capabilities == ["completion"]
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="hf", messages=[{"role": "user", "content": "A cat"}], tools=[WEATHER], options=GREEDY)
    assert err.value.status_code == 400 and "this model accepts at most 255 prompt tokens" in err.value.error
    assert shown.modelinfo["llama.context_length"] == info["max_total_tokens"]
    assert shown.modelinfo["general.parameter_count"] > 0 and "temperature 0.8" in shown.parameters
    (running,) = client.ps().models
    assert running.model == "hf:latest" and running.size_vram == 0 and running.digest == listed.digest
    assert running.context_length == info["max_total_tokens"]
    status, version = http("GET", stories_server.url + "/api/version")     # (the Python client has no call for it)
    assert status == 200 and version["version"].count(".") == 2


def test_errors_are_response_errors_with_ollamas_message_and_status(client):
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="llama3.2", messages=[{"role": "user", "content": "hi"}])
    assert err.value.status_code == 404 and err.value.error == "model 'llama3.2' not found"
    with pytest.raises(ollama.ResponseError) as err:
        client.show("llama3.2:8b")
    assert err.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as err:
        client.generate(model="hf", prompt="x", options={"mirostat": 2})
    assert err.value.status_code == 400 and "options.mirostat" in err.value.error
    with pytest.raises(ollama.ResponseError) as err:        # more than the context holds
        client.generate(model="hf", prompt="x " * 5000, raw=True)
    assert err.value.status_code == 400 and "tokens" in err.value.error


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "languages"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "languages": {"type": "array", "items": {"enum": ["English", "French", "German"]},
                                       "maxItems": 3}}}


def test_format_a_json_schema_and_json_on_smollm2(smollm2):
    ask = [{"role": "user", "content": "Invent a person who speaks French: name, age and languages, as JSON."}]
    whole = smollm2.chat(model=SMOLLM2, messages=ask, format=PERSON, options={"temperature": 0, "num_predict": 80})
    person = json.loads(whole.message.content)
    jsonschema.validate(person, PERSON)
    assert whole.done_reason == "stop"            # the grammar ended the reply with the object
    parts = list(smollm2.chat(model=SMOLLM2, messages=ask, format=PERSON, stream=True,
                              options={"temperature": 0, "num_predict": 80}))
    assert "".join(p.message.content for p in parts) == whole.message.content
    # the shape of a call to get_weather, as content (the reply's JSON, not a tool call: no tools were given)
    call = {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": "get_weather"}, "arguments": WEATHER["function"]["parameters"]}}
    out = smollm2.generate(model=SMOLLM2, prompt="Call get_weather for Paris, as JSON.", format=call,
                           options={"temperature": 0, "num_predict": 60})
    jsonschema.validate(json.loads(out.response), call)
    anything = smollm2.generate(model=SMOLLM2, prompt="Give the capital of France as JSON.", format="json",
                                options={"temperature": 0, "num_predict": 200})
    assert anything.done_reason == "stop" and isinstance(json.loads(anything.response), dict), anything.response


def test_tools_and_a_calls_history_reach_smollm2s_template(smollm2):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = smollm2.chat(model=SMOLLM2, messages=ask, tools=[WEATHER], options={"temperature": 0, "num_predict": 60})
    assert "<tool_call>" not in (reply.message.content or "")          # a call would be message.tool_calls
    for call in reply.message.tool_calls or []:
        assert call.function.name == "get_weather" and isinstance(call.function.arguments["city"], str)
    history = [*ask, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_name": "get_weather", "content": "It is 41 degrees celsius and sunny."}]
    answer = smollm2.chat(model=SMOLLM2, messages=history, tools=[WEATHER],
                          options={"temperature": 0, "num_predict": 40})
    assert "41" in answer.message.content and answer.done_reason == "stop"
    shown = smollm2.show(SMOLLM2)
    assert shown.capabilities == ["completion", "tools"]       # (its template renders no tools: a system message does)
    assert shown.details.format == "gguf" and shown.details.quantization_level == "Q4_1"
    assert shown.details.parameter_size == "134.52M" and "{%" in shown.template
    with pytest.raises(ollama.ResponseError) as err:       # its template does not reason
        smollm2.chat(model=SMOLLM2, messages=ask, think=True)
    assert err.value.status_code == 400 and "does not support thinking" in err.value.error


# a thinking template of the test's own (Qwen3's switch): enable_thinking false closes an empty <think> block
SWITCH = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
          "{% if add_generation_prompt %}assistant:"
          "{% if enable_thinking is defined and enable_thinking is false %} <think>\n\n</think>\n\n{% endif %}"
          "{% endif %}")


def test_think_reaches_a_thinking_template_and_show_says_it_thinks(stories_dir, tmp_path):
    template = tmp_path / "switch.jinja"
    template.write_text(SWITCH)
    args = ["--config", str(REPO / "configs" / "stories260K.yaml"), "--model", str(stories_dir / "hf"),
            "--set", f"tokenizer.chat_template={template}"]
    with serving(args, tmp_path / "server.log") as server:
        client = ollama.Client(host=server.url, timeout=120)
        assert client.show("hf").capabilities == ["completion", "thinking"]      # (tools: as test_list_show_...)
        assert client.show("hf").template == SWITCH
        ask = dict(model="hf", messages=[{"role": "user", "content": "Once upon a time"}], options=GREEDY)
        on, off = client.chat(**ask, think=True), client.chat(**ask, think=False)
        # the closed block is in the prompt, and the reply after it is all answer
        assert off.prompt_eval_count > on.prompt_eval_count and off.message.thinking is None
        assert off.message.content and "</think>" not in off.message.content
        streamed = list(client.chat(**ask, think=False, stream=True))
        assert "".join(p.message.content for p in streamed) == off.message.content
