"""Ollama's API without a model: its request rules (a 400 naming the field), their translation into the internal
request, the lines a reply is written as, the served model's facts, and the routes themselves over a scripted
engine (NDJSON streams, thinking, tool calls, errors, load requests, the model's description)."""
from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import pytest
from aiohttp.test_utils import TestClient, TestServer

from llm_serving.master.grammar import GrammarSpec
from llm_serving.master.request import TokenEvent
from llm_serving.models.pooling import EmbeddingSpec
from llm_serving.server import routes_ollama
from llm_serving.server.api.base import validate
from llm_serving.server.api.document import openapi
from llm_serving.server.api.ollama import UNLIMITED, ChatRequest, GenerateRequest, ShowRequest
from llm_serving.server.errors import ModelNotFoundError, ValidationError
from llm_serving.server.model_facts import parameter_size, read_facts
from llm_serving.server.routes_ollama import Lines, metrics, served_name
from tests.apps import app_of_one

STORIES_HF = Path(__file__).resolve().parents[1] / "assets" / "stories260K" / "hf"
USER = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"}}}}}


def chat(**fields):
    return {"model": "m", "messages": USER, **fields}


def gen(**fields):
    return {"model": "m", "prompt": "Once", **fields}


@pytest.mark.parametrize("model, body, param, words", [
    (ChatRequest, chat(messages=[{"role": "assistant", "content": "x", "images": ["aGk="]}]), "messages",
     "images go in user messages"),
    (ChatRequest, chat(messages=[{"role": "user", "content": "x", "images": ["%%"]}]), "messages",
     "images[0]: "),
    (ChatRequest, chat(messages=[{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]),
     "messages", "only an assistant"),
    (ChatRequest, chat(messages=[{"role": "robot", "content": "x"}]), "messages", "messages[0].role must be"),
    (ChatRequest, chat(messages=[{"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "{}"}}]}]), "messages",
     "messages[0].tool_calls[0].function.arguments must be an object"),
    (ChatRequest, chat(format="xml"), "format", 'format must be "json" or a JSON schema'),
    (ChatRequest, chat(options={"foo": 1}), "options", "unknown field(s): options.foo"),
    (ChatRequest, chat(options={"mirostat": 2}), "options", "options.mirostat 2 is not served"),
    (ChatRequest, chat(options={"typical_p": 0.5}), "options", "options.typical_p 0.5 is not served"),
    (ChatRequest, chat(options={"temperature": -1}), "options", "options.temperature must be >= 0"),
    (ChatRequest, chat(options={"num_predict": -3}), "options", "options.num_predict must be >= -2"),
    (ChatRequest, chat(options={"stop": [""]}), "options", "1 to 256 characters"),
    (ChatRequest, chat(options={"top_k": "40"}), "options", "options.top_k must be an integer"),
    (ChatRequest, chat(top_logprobs=2), "top_logprobs", "needs logprobs"),
    (ChatRequest, chat(top_logprobs=21, logprobs=True), "top_logprobs", "<= 20"),
    (ChatRequest, chat(tools=[WEATHER, WEATHER]), "tools", "given twice"),
    (ChatRequest, chat(think="max"), "think", None),
    (ChatRequest, chat(n=2), "n", "unknown field(s): n"),
    (ChatRequest, chat(model=""), "model", None),
    (GenerateRequest, gen(suffix="end"), "suffix", "fill-in-the-middle"),
    (GenerateRequest, gen(template="{{ .Prompt }}"), "template", "chat template"),
    (GenerateRequest, gen(context=[1, 2]), "context", "/api/chat"),
    (GenerateRequest, gen(images=["aGk="], raw=True), "images", "images go with raw false"),
    (GenerateRequest, gen(images=["%%"]), "images", "images[0]: "),
    (GenerateRequest, gen(raw=True, system="be brief"), "system", "raw false"),
    (GenerateRequest, gen(raw=True, think=True), "think", "raw false"),
    (ShowRequest, {"verbose": True}, "model", "'model' is required"),
])
def test_a_rule_about_a_requests_shape_is_a_400_naming_its_field(model, body, param, words):
    with pytest.raises(ValidationError) as info:
        validate(model, body)
    assert info.value.param == param, str(info.value)
    assert words is None or words in str(info.value), str(info.value)


def test_what_ollamas_clients_send_by_default_is_accepted():
    # Go's client: empty strings for the fields it always sends, options null; every load-time option ignored
    go = {"model": "m", "prompt": "x", "system": "", "template": "", "suffix": "", "format": "", "options": None,
          "context": [], "raw": False, "keep_alive": "5m"}
    assert validate(GenerateRequest, go).to_request("m").sampling.temperature == 0.8
    ignored = {"num_ctx": 4096, "num_gpu": 99, "num_thread": 8, "use_mmap": True, "numa": False, "num_keep": 4,
               "repeat_last_n": 64, "mirostat_tau": 5.0, "penalize_newline": True, "mirostat": 0, "typical_p": 1.0,
               "tfs_z": 1.0}
    plain = validate(ChatRequest, chat()).to_request("m").sampling
    assert validate(ChatRequest, chat(options=ignored, keep_alive=-1)).to_request("m").sampling == plain
    # the Python client leaves an empty content out; a tool call's arguments are an object
    r = validate(ChatRequest, chat(messages=[*USER, {"role": "assistant", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}], tools=[], stream=False))
    assert r.to_request("m").messages[1]["content"] == "" and not r.streams


def test_options_become_sampling_with_ollamas_defaults():
    sp = validate(ChatRequest, chat()).to_request("m").sampling
    assert (sp.temperature, sp.top_k, sp.top_p, sp.seed, sp.repetition_penalty) == (0.8, 40, 0.9, None, 1.0)
    assert sp.max_new_tokens == UNLIMITED and sp.grammar is None
    options = {"temperature": 0, "top_k": 7, "top_p": 0.5, "seed": 42, "stop": ["\n\n", "END"], "num_predict": 12,
               "repeat_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": -0.5, "min_p": 0.05}
    req = validate(ChatRequest, chat(options=options, logprobs=True, top_logprobs=3)).to_request("m")
    sp = req.sampling
    assert (sp.temperature, sp.top_k, sp.top_p, sp.seed, sp.stop, sp.max_new_tokens) == \
        (0.0, 0, 1.0, 42, ("\n\n", "END"), 12)            # greedy: top_k and top_p off
    assert (sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty, sp.min_p, sp.top_logprobs) == \
        (1.2, 0.5, -0.5, 0.05, 3)
    # num_predict is a ceiling cut to the context (never a 400); -1, -2: as long as the context allows
    assert req.max_tokens_field == "num_predict" and not req.max_tokens_given
    for n in (-1, -2, 0):
        assert validate(ChatRequest, chat(options={"num_predict": n})).to_request("m").sampling.max_new_tokens == \
            UNLIMITED
    assert validate(ChatRequest, chat(options={"seed": -1, "top_k": -1})).to_request("m").sampling.seed is None


def test_format_becomes_a_grammar_and_think_the_templates_variables():
    assert validate(ChatRequest, chat(format="json")).to_request("m").sampling.grammar == \
        GrammarSpec("json_object", None, "format")
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}
    spec = validate(GenerateRequest, gen(format=schema)).to_request("m").sampling.grammar
    assert spec.kind == "json" and json.loads(spec.value) == schema and spec.field == "format"
    for think, variables in ((True, {"enable_thinking": True}), (False, {"enable_thinking": False}),
                             ("high", {"reasoning_effort": "high"}), (None, None)):
        assert validate(ChatRequest, chat(think=think)).to_request("m").variables == variables


def test_a_chat_becomes_the_internal_conversation_with_call_ids():
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather and time?"},
                {"role": "assistant", "content": "", "thinking": "two tools", "tool_calls": [
                    {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                    {"function": {"name": "get_time", "arguments": {}}}]},
                {"role": "tool", "tool_name": "get_time", "content": "noon"},
                {"role": "tool", "content": "sunny"}]
    req = validate(ChatRequest, chat(messages=messages, tools=[WEATHER])).to_request("adapter")
    first, second = (c["id"] for c in req.messages[2]["tool_calls"])
    assert req.messages[2] == {"role": "assistant", "content": "", "reasoning_content": "two tools", "tool_calls": [
        {"id": first, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": second, "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}
    # by its tool_name, then the first call still unanswered
    assert req.messages[3] == {"role": "tool", "content": "noon", "tool_call_id": second, "name": "get_time"}
    assert req.messages[4] == {"role": "tool", "content": "sunny", "tool_call_id": first}
    assert req.tools == [WEATHER] and req.tool_choice == "auto" and req.model == "adapter" and req.stream


def test_generate_is_a_raw_prompt_or_a_user_message_and_empty_is_a_load():
    raw = validate(GenerateRequest, gen(raw=True)).to_request("m")
    assert raw.prompt == "Once" and raw.messages is None
    templated = validate(GenerateRequest, gen(system="tell stories", think=False)).to_request("m")
    assert templated.messages == [{"role": "system", "content": "tell stories"}, {"role": "user", "content": "Once"}]
    assert templated.variables == {"enable_thinking": False} and templated.prompt is None
    assert validate(GenerateRequest, {"model": "m"}).loads_only and validate(ChatRequest, {"model": "m"}).loads_only
    assert not validate(GenerateRequest, gen()).loads_only and not validate(ChatRequest, chat()).loads_only


def test_names_resolve_with_or_without_latest_and_an_unknown_one_is_ollamas_404():
    engine = SimpleNamespace(served_models=lambda: ["m", "ad"])
    assert [served_name(engine, n) for n in ("m", "m:latest", "ad:latest")] == ["m", "m", "ad"]
    with pytest.raises(ModelNotFoundError, match="^model 'x:7b' not found$"):
        served_name(engine, "x:7b")
    with pytest.raises(ModelNotFoundError, match="^model 'x:latest' not found$"):
        served_name(engine, "x:latest")
    # a model listed with its tag keeps it; only a name known bare loses :latest
    assert [routes_ollama.untagged(n, ["m", "t:latest"]) for n in ("m:latest", "t:latest", "q:latest", "m")] == \
        ["m", "t:latest", "q:latest", "m"]
    assert routes_ollama.tagged("m") == "m:latest" and routes_ollama.tagged("m:q4") == "m:q4"
    assert routes_ollama.error_body(404, "model 'x' not found", "not_found", None) == {"error": "model 'x' not found"}
    assert routes_ollama.owns("/api/chat") and not routes_ollama.owns("/v1/chat/completions")


def test_lines_carry_message_or_response_and_the_last_one_the_counts():
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": [1, 2]}'}}
    line = Lines("m:latest", chat=True).piece("Hi", "hmm", [call], first_call=2, logprobs=[])
    assert line["message"] == {"role": "assistant", "content": "Hi", "thinking": "hmm", "tool_calls": [
        {"id": "call_1", "function": {"index": 2, "name": "f", "arguments": {"a": [1, 2]}}}]}
    assert line["model"] == "m:latest" and line["done"] is False and line["logprobs"] == []
    assert datetime.fromisoformat(line["created_at"]).utcoffset().total_seconds() == 0
    req = SimpleNamespace(prompt_ids=[1, 2, 3], output_ids=[4, 5], arrival_time=10.0, first_token_time=10.25,
                          finish_time=12.0)
    counts = metrics(req, started=9.5, now=12.5)
    assert counts == {"total_duration": 3_000_000_000, "load_duration": 0, "prompt_eval_count": 3,
                      "prompt_eval_duration": 250_000_000, "eval_count": 2, "eval_duration": 1_750_000_000}
    done = Lines("m", chat=False).done("length", counts, content="tail")
    assert (done["response"], done["done"], done["done_reason"], done["eval_count"]) == ("tail", True, "length", 2)
    assert "message" not in done and "thinking" not in done and "logprobs" not in done


def test_the_served_models_facts_come_from_its_files_headers():
    from safetensors.numpy import load_file

    facts = read_facts(str(STORIES_HF))
    weights = load_file(str(STORIES_HF / "model.safetensors"))
    assert facts.parameter_count == sum(a.size for a in weights.values())
    assert (facts.format, facts.family, facts.quantization) == ("safetensors", "llama", "F32")
    assert facts.size == (STORIES_HF / "model.safetensors").stat().st_size and len(facts.digest) == 64
    assert facts.info["llama.block_count"] == 5 and facts.info["general.architecture"] == "llama"
    assert read_facts("/nonexistent/model").size == 0
    assert [parameter_size(n) for n in (134_515_008, 8_000_000_000, 1_543_000_000, 260_032, 0)] == \
        ["134.52M", "8B", "1.5B", "260K", ""]


def test_the_document_lists_ollamas_routes():
    doc = openapi("1")
    paths = doc["paths"]
    ref = paths["/api/chat"]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    schema = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert {"messages", "tools", "think", "format", "options", "keep_alive"} <= set(schema["properties"])
    assert "get" in paths["/api/tags"] and "get" in paths["/api/version"] and "post" in paths["/api/embed"]


# --- the routes over a scripted engine ------------------------------------------------------------------------------

class _Tokenizer:
    vocab_size = 1 << 17

    def encode(self, text, add_bos=False):
        return ([1] if add_bos else []) + [ord(c) for c in text]

    def decode(self, ids, skip_special=True):
        return "".join(chr(i) for i in ids if i > 1)

    def token_text(self, token_id):
        return chr(token_id)


class _Template:
    """Renders a conversation as its contents joined; a reasoning one opens <think> unless enable_thinking false."""
    tool_format, harmony, text = "hermes", False, "{{ messages }}"

    def __init__(self, reasons=False, takes_tools=False):
        self.reasons, self.takes_tools, self.rendered = reasons, takes_tools, []

    def encode(self, messages, tools=None, variables=None, expand=None):
        self.rendered.append((messages, variables))
        think = self.reasons and (variables or {}).get("enable_thinking", True)
        return [ord(c) for c in "|".join(m["content"] for m in messages) + ("<think>" if think else "")]


class _Engine:
    """Answers every request with the scripted texts (token ids from 1000), the last one finishing with `reason`."""
    model_name, vocab_size, max_model_len, lora_paths, generates = "m", 1 << 17, 4096, {}, True
    default_max_tokens = None
    embedding = None                        # (models/pooling.py's EmbeddingSpec: how it embeds, when it does)
    image_facts = None                      # (a text model)

    def __init__(self, texts=("Hi", " there"), reason="stop", error=None, template=None):
        self.texts, self.reason, self.error = list(texts), reason, error
        self.tokenizer, self.chat_template = _Tokenizer(), template or _Template()
        self.model_path, self.start_time = str(STORIES_HF), time.time()
        self.submitted, self.released = [], []

    def served_models(self):
        return ["m"]

    def check_generates(self):          # (a model that generates)
        return None

    async def compile_grammar(self, spec):
        return spec

    def submit(self, prompt_ids, sampling, adapter=None, grammar=None, images=None):
        req = SimpleNamespace(prompt_ids=prompt_ids, output_ids=[], events=asyncio.Queue(), sampling=sampling,
                              arrival_time=time.monotonic(), first_token_time=None, finish_time=None)
        for k, text in enumerate(self.texts):
            last = k == len(self.texts) - 1
            req.output_ids.append(1000 + k)
            req.events.put_nowait(TokenEvent(1000 + k, text, -0.5 * k, False, self.reason if last else None,
                                             self.error if last else None, [(ord("a"), -0.1)] if sampling.top_logprobs
                                             else None))
        req.first_token_time = req.finish_time = time.monotonic()
        self.submitted.append(req)
        return req

    def release(self, req):
        self.released.append(req)


def call(engine, method, path, body=None):
    """(status, content type, body text) of one request to the Ollama routes on `engine`."""
    async def run():
        app = app_of_one(engine)
        async with TestClient(TestServer(app)) as client:
            response = await client.request(method, path, json=body)
            return response.status, response.content_type, await response.text()
    return asyncio.run(run())


def lines_of(text):
    return [json.loads(line) for line in text.splitlines()]


def test_a_streamed_chat_is_ndjson_whose_pieces_join_to_the_whole_reply():
    engine = _Engine(["Let me", " think.</think>", "Hi", " there"], template=_Template(reasons=True))
    status, kind, text = call(engine, "POST", "/api/chat", chat(model="m:latest"))
    assert status == 200 and kind == "application/x-ndjson"
    lines = lines_of(text)
    *pieces, last = lines
    assert all(not p["done"] and p["model"] == "m:latest" and p["message"]["role"] == "assistant" for p in pieces)
    assert "".join(p["message"].get("thinking", "") for p in pieces) == "Let me think."
    assert "".join(p["message"]["content"] for p in pieces) == "Hi there"
    assert last["done"] and last["done_reason"] == "stop" and last["message"] == {"role": "assistant", "content": ""}
    assert last["eval_count"] == 4 and last["prompt_eval_count"] == len("hi<think>")
    assert engine.released == engine.submitted          # the request was released when its reply was done
    status, kind, text = call(engine, "POST", "/api/chat", chat(stream=False))
    whole = json.loads(text)
    assert kind == "application/json" and whole["done"] and whole["done_reason"] == "stop"
    assert whole["message"] == {"role": "assistant", "content": "Hi there", "thinking": "Let me think."}
    # think false: the template's variable, and the reply is all answer
    call(engine, "POST", "/api/chat", chat(think=False, stream=False))
    assert engine.chat_template.rendered[-1][1] == {"enable_thinking": False}


def test_a_tool_call_comes_as_message_tool_calls_with_arguments_as_an_object():
    engine = _Engine(['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'])
    for stream in (True, False):
        status, _, text = call(engine, "POST", "/api/chat", chat(tools=[WEATHER], stream=stream))
        lines = lines_of(text)
        calls = [c for line in lines for c in line["message"].get("tool_calls", [])]
        assert status == 200 and [c["function"] for c in calls] == \
            [{"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}}]
        assert "<tool_call>" not in "".join(line["message"]["content"] for line in lines)
        assert lines[-1]["done_reason"] == "stop"
    # the tools were described to the model (its template takes none)
    assert "get_weather" in engine.chat_template.rendered[-1][0][0]["content"]


def test_generate_raw_and_templated_with_logprobs():
    engine = _Engine(["a", "b"], reason="length")
    status, _, text = call(engine, "POST", "/api/generate", gen(raw=True, logprobs=True, top_logprobs=1))
    *pieces, last = lines_of(text)
    assert status == 200 and engine.submitted[-1].prompt_ids == [1] + [ord(c) for c in "Once"]
    assert "".join(p["response"] for p in pieces) == "ab" and last["done_reason"] == "length"
    assert [lp["token"] for p in pieces for lp in p["logprobs"]] == ["a", "b"]
    assert pieces[1]["logprobs"][0] == {"token": "b", "logprob": -0.5, "bytes": [98],
                                        "top_logprobs": [{"token": "a", "logprob": -0.1, "bytes": [97]}]}
    status, _, text = call(engine, "POST", "/api/generate", gen(system="sys", stream=False))
    assert json.loads(text)["response"] == "ab" and engine.submitted[-1].prompt_ids == [ord(c) for c in "sys|Once"]


def test_errors_are_ollamas_shape_with_the_status_and_a_failed_stream_ends_with_an_error_line():
    engine = _Engine(["Hi", ""], reason="error", error="agent 0 died")
    status, _, text = call(engine, "POST", "/api/chat", chat(stream=False))
    assert (status, json.loads(text)) == (500, {"error": "agent 0 died"})
    status, _, text = call(engine, "POST", "/api/chat", chat())
    assert status == 200 and lines_of(text)[-1] == {"error": "agent 0 died"}
    for body, want in ((chat(model="llama3.2"), (404, "model 'llama3.2' not found")),
                       (chat(options={"temperature": "hot"}), (400, "options.temperature must be a number, got 'hot'")),
                       (chat(think=True), (400, "model 'm' does not support thinking"))):
        status, _, text = call(engine, "POST", "/api/chat", body)
        assert (status, json.loads(text)) == (want[0], {"error": want[1]}), body
    status, _, text = call(engine, "POST", "/api/pull", {"model": "m"})
    assert status == 404 and "error" in json.loads(text)


def test_a_request_with_nothing_to_generate_loads_the_model_at_once():
    engine = _Engine()
    for path in ("/api/generate", "/api/chat"):
        status, _, text = call(engine, "POST", path, {"model": "m", "keep_alive": 0})
        (line,) = lines_of(text)
        assert status == 200 and line["done"] and line["done_reason"] == "load"
    assert engine.submitted == []


def test_tags_show_ps_and_version_describe_the_served_model():
    engine = _Engine(template=_Template(reasons=True, takes_tools=True))
    engine.lora_paths = {"ad": str(STORIES_HF)}
    status, _, text = call(engine, "GET", "/api/tags")
    listed = json.loads(text)["models"]
    assert status == 200 and [m["name"] for m in listed] == ["m:latest", "ad:latest"]
    assert listed[0]["details"] == {"parent_model": "", "format": "safetensors", "family": "llama",
                                    "families": ["llama"], "parameter_size": "260K", "quantization_level": "F32"}
    assert listed[1]["details"]["parent_model"] == "m:latest" and listed[0]["size"] > 0
    datetime.fromisoformat(listed[0]["modified_at"])
    status, _, text = call(engine, "POST", "/api/show", {"model": "m:latest"})
    shown = json.loads(text)
    assert status == 200 and shown["capabilities"] == ["completion", "tools", "thinking"]
    engine.embedding = EmbeddingSpec("mean", "default", 64)            # (any model embeds: that is not a declaration)
    assert json.loads(call(engine, "POST", "/api/show", {"model": "m"})[2])["capabilities"] == \
        ["completion", "tools", "thinking"]
    engine.embedding = EmbeddingSpec("last", "1_Pooling/config.json", 64)     # an embedding model, as Ollama says it
    assert json.loads(call(engine, "POST", "/api/show", {"model": "m"})[2])["capabilities"] == ["embedding"]
    engine.embedding = None
    assert shown["model_info"]["llama.context_length"] == 4096 and shown["template"] == "{{ messages }}"
    assert "temperature 0.8" in shown["parameters"] and "FROM " + str(STORIES_HF) in shown["modelfile"]
    assert call(engine, "POST", "/api/show", {"model": "nope"})[0] == 404
    status, _, text = call(engine, "GET", "/api/ps")
    running = json.loads(text)["models"][0]
    assert (running["name"], running["size_vram"], running["context_length"]) == ("m:latest", 0, 4096)
    assert datetime.fromisoformat(running["expires_at"]).year > 2100
    assert json.loads(call(engine, "GET", "/api/version")[2])["version"].count(".") == 2
