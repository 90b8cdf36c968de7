"""A forced tool call ends when its call does, in every API that forces one: OpenAI chat's `tool_choice` required or
a named function, the Responses API's, Anthropic's `tool_choice` any or tool; streamed or not, parallel calls allowed
or not. Served: a tiny random model (transformers' qwen3 at test size, a ChatML template that does not take tools, so
they are described in a system message and calls are Hermes' `<tool_call>` blocks). What it writes is garbage: the
grammar alone makes its calls whole, and must let the reply end right after one.

- Sampled on seeds 0..19 (chat: the API with a seed and log-probabilities), each reply ends within two tokens of its
  last call's `</tool_call>` (a newline and EOS; none where one call is all the grammar takes), with finish_reason
  tool_calls and no content; streamed, the same calls and token count.
- Greedy on 20 prompts, the Responses API and Messages give the chat's calls and token count, streamed or not: a
  function_call item completed per call and no message (status completed), tool_use blocks and no text (stop_reason
  tool_use); the Responses items in the same order streamed and not.
- A budget (max_tokens) that cuts a reply inside a call: the call is dropped, never text; the calls before it are
  given; the reply says it was cut (length, max_tokens, incomplete)."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import jsonschema
import pytest

from tests.integration.server_harness import http, parse_sse, serving

MODEL = "qwen3"
CLOSE = "</tool_call>"
WEATHER = {"name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                          "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}}}}
ADD = {"name": "add", "description": "Add two integers",
       "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                      "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}
FUNCTIONS = {f["name"]: f for f in (WEATHER, ADD)}
ASK = "What is the weather in Paris, in celsius?"
MODES = ("parallel", "single", "named")      # required with parallel calls allowed, required with one call, add named
ENOUGH = 1000                                # tokens: a call is ~60 of them here
SEEDS = range(20)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("mindspore")
    from tests.families import make_hf_model, needs_transformers

    needs_transformers()
    folder = tmp_path_factory.mktemp("forced_tools")
    model = make_hf_model("qwen3", folder / MODEL, seed=5)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 2048     # the tools' system message is ~760 tokens of its 320-token vocabulary
    (model / "config.json").write_text(json.dumps(config))
    with serving(["--model", str(model)], folder / "server.log") as running:
        yield running


@dataclass
class Reply:
    """What an API said of a reply: its calls [(name, arguments)], all its text, how it ended ("calls": it called and
    stopped; "cut": max_tokens), its output tokens, and its items' or blocks' kinds in order."""
    calls: list
    text: str
    end: str
    tokens: int
    kinds: list


def _chat_tools(mode: str) -> dict:
    tools = [{"type": "function", "function": f} for f in (WEATHER, ADD)]
    if mode == "named":
        return {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "add"}}}
    return {"tools": tools, "tool_choice": "required", **({"parallel_tool_calls": False} if mode == "single" else {})}


def chat(url: str, mode: str, stream: bool, content: str = ASK, fields: dict | None = None) -> Reply:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": ENOUGH,
            "temperature": 0, **_chat_tools(mode), **(fields or {})}
    if stream:
        status, text = http("POST", url + "/v1/chat/completions",
                            {**body, "stream": True, "stream_options": {"include_usage": True}}, timeout=300)
        assert status == 200, text
        events = parse_sse(text.replace("data: [DONE]", ""))
        deltas = [c["delta"] for e in events for c in e["choices"]]
        ends = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
        calls = [d for delta in deltas for d in delta.get("tool_calls") or []]
        assert [d["index"] for d in calls] == list(range(len(calls)))
        assert len(ends) == 1, ends
        return Reply([(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls],
                     "".join(d.get("content") or "" for d in deltas), {"tool_calls": "calls", "length": "cut"}.get(
                         ends[0], ends[0]), events[-1]["usage"]["completion_tokens"], [])
    status, out = http("POST", url + "/v1/chat/completions", body, timeout=300)
    assert status == 200, out
    choice = out["choices"][0]
    calls = choice["message"].get("tool_calls") or []
    return Reply([(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls],
                 choice["message"]["content"] or "", {"tool_calls": "calls", "length": "cut"}.get(
                     choice["finish_reason"], choice["finish_reason"]), out["usage"]["completion_tokens"], [])


def responses(url: str, mode: str, stream: bool, content: str = ASK, max_tokens: int = ENOUGH) -> Reply:
    tools = [{"type": "function", **f} for f in (WEATHER, ADD)]
    choice = {"type": "function", "name": "add"} if mode == "named" else "required"
    body = {"model": MODEL, "input": content, "tools": tools, "tool_choice": choice, "temperature": 0,
            "max_output_tokens": max_tokens, "parallel_tool_calls": mode != "single", "stream": stream}
    status, out = http("POST", url + "/v1/responses", body, timeout=300)
    assert status == 200, out
    if stream:
        events = parse_sse(out)
        added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
        out = events[-1]["response"]
        assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
        assert added == [item["type"] for item in out["output"]]          # told in the order the output has
    items = out["output"]
    for item in items:
        assert item["type"] != "function_call" or item["status"] == "completed", item
    text = "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])
    return Reply([(i["name"], json.loads(i["arguments"])) for i in items if i["type"] == "function_call"], text,
                 {"completed": "calls", "incomplete": "cut"}[out["status"]], out["usage"]["output_tokens"],
                 [item["type"] for item in items])


def messages(url: str, mode: str, stream: bool, content: str = ASK, max_tokens: int = ENOUGH) -> Reply:
    tools = [{"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
             for f in (WEATHER, ADD)]
    choice = {"type": "tool", "name": "add"} if mode == "named" else \
        {"type": "any", **({"disable_parallel_tool_use": True} if mode == "single" else {})}
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "tools": tools,
            "tool_choice": choice, "temperature": 0, "max_tokens": max_tokens, "stream": stream}
    status, out = http("POST", url + "/v1/messages", body, timeout=300,
                       headers={"anthropic-version": "2023-06-01"})
    assert status == 200, out
    if stream:
        events = parse_sse(out)
        blocks = []
        for e in events:
            if e["type"] == "content_block_start":
                blocks.append({**e["content_block"], "json": ""})
            elif e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta":
                blocks[e["index"]]["text"] += e["delta"]["text"]
            elif e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta":
                blocks[e["index"]]["json"] += e["delta"]["partial_json"]
        for b in blocks:
            if b["type"] == "tool_use":
                b["input"] = json.loads(b["json"])
        (last,) = [e for e in events if e["type"] == "message_delta"]
        out = {"content": blocks, "stop_reason": last["delta"]["stop_reason"], "usage": last["usage"]}
    blocks = out["content"]
    return Reply([(b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"],
                 "".join(b.get("text") or "" for b in blocks if b["type"] == "text"),
                 {"tool_use": "calls", "max_tokens": "cut"}.get(out["stop_reason"], out["stop_reason"]),
                 out["usage"]["output_tokens"], [b["type"] for b in blocks])


def _valid(calls: list, mode: str) -> None:
    assert calls, "no call"
    for name, arguments in calls:
        assert name == "add" if mode == "named" else name in FUNCTIONS
        jsonschema.validate(arguments, FUNCTIONS[name]["parameters"])
    if mode != "parallel":
        assert len(calls) == 1, calls


def _tokens_after_last_call(logprobs: dict) -> list:
    """The tokens a reply wrote after its last call closed (EOS's text is empty)."""
    tokens = [e["token"] for e in logprobs["content"]]
    text = "".join(tokens)
    close, at = text.rindex(CLOSE) + len(CLOSE), 0
    for k, token in enumerate(tokens):
        at += len(token)
        if at >= close:
            return tokens[k + 1:]
    raise AssertionError("the reply's tokens do not reach its last call's end")


def _run(jobs: list) -> list:
    """Each job (function, args...) run, 6 at a time: the server batches them."""
    with ThreadPoolExecutor(6) as pool:
        return list(pool.map(lambda job: job[0](*job[1:]), jobs))


@pytest.mark.parametrize("mode", MODES)
def test_a_sampled_forced_call_ends_within_two_tokens_of_its_last_call_on_20_seeds(server, mode):
    """Seeds 0..19 at temperature 1: finish_reason tool_calls, no content, calls valid against their schemas, and at
    the reply ends on the token that closes its call (one call is all a forced reply's grammar takes); streamed, the same."""
    whole = _run([(_sampled_chat, server.url, mode, False, seed) for seed in SEEDS])
    streamed = _run([(_sampled_chat, server.url, mode, True, seed) for seed in SEEDS])
    for seed, (reply, after), (again, _) in zip(SEEDS, whole, streamed):
        assert reply.end == "calls" and reply.text == "", (seed, reply)
        _valid(reply.calls, mode)
        assert after == [], (seed, after, reply)
        assert again == reply, seed


def _sampled_chat(url: str, mode: str, stream: bool, seed: int) -> tuple:
    """(Reply, the tokens after its last call) of a chat sampled at temperature 1 with `seed`."""
    fields = {"temperature": 1.0, "seed": seed}
    if stream:
        return chat(url, mode, True, ASK, fields), None
    status, out = http("POST", url + "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": ASK}], "max_tokens": ENOUGH, "logprobs": True,
        **_chat_tools(mode), **fields}, timeout=300)
    assert status == 200, out
    choice = out["choices"][0]
    calls = choice["message"].get("tool_calls") or []
    assert len(choice["logprobs"]["content"]) == out["usage"]["completion_tokens"]
    reply = Reply([(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls],
                  choice["message"]["content"] or "", {"tool_calls": "calls", "length": "cut"}.get(
                      choice["finish_reason"], choice["finish_reason"]), out["usage"]["completion_tokens"], [])
    return reply, _tokens_after_last_call(choice["logprobs"]) if calls else None


PROMPTS = [f"{q} {city}?" for q in ("Weather in", "Add the numbers for") for city in
           ("Paris", "Oslo", "Lima", "Cairo", "Quito", "Hanoi", "Accra", "Riga", "Bern", "Kyiv")]


@pytest.mark.parametrize("mode", MODES)
def test_responses_and_messages_give_the_chats_forced_calls_streamed_or_not(server, mode):
    """Greedy on 20 prompts: every API and stream gives the chat's calls, token count and ending, and no text; the
    Responses API's items are function calls only (completed), Messages' blocks tool_use only."""
    ways = [(api, stream) for api in (responses, messages) for stream in (False, True)]
    jobs = []
    for prompt in PROMPTS:
        jobs += [(chat, server.url, mode, False, prompt)] + [(api, server.url, mode, s, prompt) for api, s in ways]
    replies = _run(jobs)
    for k, prompt in enumerate(PROMPTS):
        expected, *others = replies[5 * k:5 * k + 5]
        assert expected.end == "calls" and expected.text == "", (prompt, expected)
        _valid(expected.calls, mode)
        for reply, (api, stream) in zip(others, [(a.__name__, s) for a, s in ways]):
            assert (reply.calls, reply.text, reply.end, reply.tokens) == \
                (expected.calls, "", "calls", expected.tokens), (prompt, api, stream, reply, expected)
            assert set(reply.kinds) == {"function_call" if api == "responses" else "tool_use"}, reply


def test_a_budget_cut_inside_a_call_drops_it_in_every_api(server):
    """A forced reply cut by max_tokens inside its call: no call, no text, and the reply said cut (length,
    max_tokens, incomplete), in every API, streamed or not; the Responses API's items the same streamed and not."""
    url = server.url
    prompt = PROMPTS[0]
    tokens = _greedy_tokens(url, prompt)
    text, at, first_end = "".join(tokens), 0, None
    assert text.count(CLOSE) == 1 and text.endswith(CLOSE), text      # one call, and the reply ends with it
    for k, token in enumerate(tokens):
        at += len(token)
        if at >= len(text):
            first_end = k + 1
            break
    budget = first_end - 3
    replies = _run([(chat, url, "parallel", s, prompt, {"max_tokens": budget}) for s in (False, True)] +
                   [(api, url, "parallel", s, prompt, budget) for api in (responses, messages) for s in (False, True)])
    for reply in replies:
        assert (reply.calls, reply.text, reply.end, reply.tokens) == ([], "", "cut", budget), (budget, reply)
    assert replies[2].kinds == replies[3].kinds == []


def _greedy_tokens(url: str, prompt: str) -> list:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 400, "temperature": 0,
            "logprobs": True, **_chat_tools("parallel")}
    status, out = http("POST", url + "/v1/chat/completions", body, timeout=300)
    assert status == 200, out
    return [e["token"] for e in out["choices"][0]["logprobs"]["content"]]
