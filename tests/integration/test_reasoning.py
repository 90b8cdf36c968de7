"""A thinking model's reply (vLLM's reasoning_content): the stories260K model served with a chat template whose
generation prompt opens <think>, its reply forced by a regular expression to reason, close the tag and answer;
the reasoning and the answer come apart, whole and streamed. A grammar that does not spell the reasoning out (a
JSON schema) constrains the answer: the whole reply is content. Qwen3's thinking switch (`chat_template_kwargs`
{"enable_thinking": false}) reaches the template, and the split follows the prompt it renders; so does OpenAI's
reasoning_effort. gpt-oss's format (harmony): a reply's analysis channel is its reasoning, its final channel its content,
a message to a function a tool call."""
from __future__ import annotations

import json
import re

import pytest

from tests.integration.server_harness import REPO, http, parse_sse, serving

THINKING = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: <think>\n{% endif %}")
REGEX = r"[a-z]{2,8}( [a-z]{2,8}){1,3}\n</think>\n\n[a-z]{2,8}( [a-z]{2,8}){0,2}\."


def test_reasoning_and_answer_come_apart_whole_and_streamed(stories_dir, tmp_path):
    template = tmp_path / "thinking.jinja"
    template.write_text(THINKING)
    args = ["--config", str(REPO / "configs" / "stories260K.yaml"), "--model", str(stories_dir / "hf"),
            "--set", f"tokenizer.chat_template={template}"]
    with serving(args, tmp_path / "server.log") as server:
        body = {"model": "hf", "temperature": 0, "max_tokens": 60, "guided_regex": REGEX,
                "messages": [{"role": "user", "content": "Once upon a time"}]}
        status, whole = http("POST", server.url + "/v1/chat/completions", body)
        assert status == 200, whole
        message = whole["choices"][0]["message"]
        thought, answer = message["reasoning_content"], message["content"]
        assert thought and "</think>" not in thought and "\n" not in thought.strip()
        assert answer.endswith(".") and "think" not in answer and not answer.startswith("\n"), message
        status, text = http("POST", server.url + "/v1/chat/completions", {**body, "stream": True})
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in text.splitlines()
                  if line.startswith("data: {") and json.loads(line[6:])["choices"]]
        streamed_thought = "".join(d.get("reasoning_content") or "" for d in deltas)
        streamed_answer = "".join(d.get("content") or "" for d in deltas)
        assert streamed_thought.strip() == thought and streamed_answer == answer
        # the reasoning comes first: no content delta before the last reasoning delta
        kinds = ["r" if d.get("reasoning_content") else "c" for d in deltas if d.get("reasoning_content") or d.get("content")]
        assert kinds == sorted(kinds, reverse=True), kinds
        status, body = http("POST", server.url + "/v1/chat/completions", {
            **body, "guided_regex": None, "max_tokens": 20, "structured_outputs": {"choice": ["yes", "no"]}})
        assert status == 200 and body["choices"][0]["message"]["content"] in ("yes", "no"), body
        assert "reasoning_content" not in body["choices"][0]["message"]


# Qwen3's thinking switch (`chat_template_kwargs`), in a template of our own: thinking on leaves the generation
# prompt open and the reply opens <think> itself (Qwen3's); `open_think`, a variable of this test's, opens it in the
# prompt (DeepSeek-R1's way: the reply starts inside); enable_thinking false closes an empty block there
SWITCH = ("{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}\n{% endif %}"
          "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
          "{% if add_generation_prompt %}assistant:"
          "{% if enable_thinking is defined and enable_thinking is false %} <think>\n\n</think>\n\n"
          "{% elif open_think %} <think>\n{% endif %}{% endif %}")
THOUGHT, ANSWER = r"[a-z]{2,8}( [a-z]{2,8}){1,3}\n</think>\n\n", r"[a-z]{2,8}( [a-z]{2,8}){0,2}\."
ON, OPEN, OFF = {"enable_thinking": True}, {"enable_thinking": True, "open_think": True}, {"enable_thinking": False}
CHAT = {"model": "hf", "temperature": 0, "max_tokens": 60,
        "messages": [{"role": "user", "content": "Once upon a time"}]}


@pytest.fixture(scope="module")
def switch_server(stories_dir, tmp_path_factory):
    pytest.importorskip("mindspore")
    folder = tmp_path_factory.mktemp("thinking_switch")
    (folder / "switch.jinja").write_text(SWITCH)
    args = ["--config", str(REPO / "configs" / "stories260K.yaml"), "--model", str(stories_dir / "hf"),
            "--set", f"tokenizer.chat_template={folder / 'switch.jinja'}"]
    with serving(args, folder / "server.log") as server:
        yield server


def _chat(server, body):
    """(message, streamed (reasoning, content), usage) of a chat request, whole and streamed."""
    status, whole = http("POST", server.url + "/v1/chat/completions", body)
    assert status == 200, whole
    status, text = http("POST", server.url + "/v1/chat/completions", {**body, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in parse_sse(text.replace("data: [DONE]", "")) if e["choices"]]
    streamed = tuple("".join(d.get(k) or "" for d in deltas) for k in ("reasoning_content", "content"))
    return whole["choices"][0]["message"], streamed, whole["usage"]


def _prompt(server, kwargs):
    """(ids, text) of the chat's prompt as /tokenize renders it with these template variables."""
    status, out = http("POST", server.url + "/tokenize", {"messages": CHAT["messages"], "chat_template_kwargs": kwargs})
    assert status == 200, out
    status, text = http("POST", server.url + "/detokenize", {"tokens": out["tokens"]})
    return out["tokens"], text["prompt"]


def test_the_thinking_switch_reaches_the_template_and_the_split_follows(switch_server):
    server = switch_server
    (on_ids, on_text), (open_ids, open_text), (off_ids, off_text) = (_prompt(server, k) for k in (ON, OPEN, OFF))
    assert on_text.endswith("assistant:") and open_text.endswith("assistant: <think>\n"), (on_text, open_text)
    assert off_text.endswith("assistant: <think>\n\n</think>\n\n"), off_text
    assert _prompt(server, None)[0] == on_ids and open_ids[:len(on_ids)] == off_ids[:len(on_ids)] == on_ids
    # thinking on: the reply opens the reasoning itself (Qwen3) or starts inside it (the prompt opened it)
    for kwargs, regex, ids in ((ON, "<think>\n" + THOUGHT + ANSWER, on_ids), (OPEN, THOUGHT + ANSWER, open_ids)):
        message, streamed, usage = _chat(server, {**CHAT, "guided_regex": regex, "chat_template_kwargs": kwargs})
        assert usage["prompt_tokens"] == len(ids)                       # the prompt /tokenize showed
        thought, answer = message["reasoning_content"], message["content"]
        assert re.fullmatch(r"[a-z]{2,8}( [a-z]{2,8}){1,3}", thought), message
        assert re.fullmatch(ANSWER, answer), message
        assert streamed == (thought, answer)
    # thinking off: the prompt closed an empty block, so the reply is all answer, even one that "thinks" anyway
    # (vLLM's streaming rule too); no reasoning_content, and no reasoning delta streamed
    for regex in (ANSWER, "<think>\n" + THOUGHT + ANSWER):
        message, streamed, usage = _chat(server, {**CHAT, "guided_regex": regex, "chat_template_kwargs": OFF})
        assert usage["prompt_tokens"] == len(off_ids) and "reasoning_content" not in message, message
        assert re.fullmatch(regex, message["content"]) and streamed == ("", message["content"]), (message, streamed)
    # free text, thinking off: the same greedy reply as a completion of the prompt /tokenize gave
    message, streamed, _ = _chat(server, {**CHAT, "max_tokens": 12, "chat_template_kwargs": OFF})
    status, completion = http("POST", server.url + "/v1/completions", {"model": "hf", "prompt": off_ids,
                                                                       "max_tokens": 12, "temperature": 0})
    assert status == 200 and message["content"] == completion["choices"][0]["text"], (message, completion)
    assert "reasoning_content" not in message and streamed == ("", message["content"])


def test_reasoning_effort_reaches_the_template_as_gpt_oss_reads_it(switch_server):
    """OpenAI's `reasoning_effort` is the template's `reasoning_effort` variable (gpt-oss's template writes it into
    its system message): the prompt is the one chat_template_kwargs renders with it, which wins when both say; a
    value outside low/medium/high is a 400 naming the field."""
    server = switch_server
    body = {**CHAT, "max_tokens": 2}
    plain = http("POST", server.url + "/v1/chat/completions", body)[1]["usage"]["prompt_tokens"]
    low = http("POST", server.url + "/v1/chat/completions", {**body, "reasoning_effort": "low"})[1]["usage"]
    ids, text = _prompt(server, {"reasoning_effort": "low"})
    assert text.startswith("Reasoning: low\n") and low["prompt_tokens"] == len(ids) > plain
    both = http("POST", server.url + "/v1/chat/completions",
                {**body, "reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}})[1]
    assert both["usage"]["prompt_tokens"] == len(_prompt(server, {"reasoning_effort": "high"})[0])
    status, out = http("POST", server.url + "/v1/chat/completions", {**body, "reasoning_effort": "extreme"})
    assert status == 400 and out["error"]["param"] == "reasoning_effort", out


def test_a_bad_chat_template_kwargs_is_a_400_naming_it(switch_server):
    url = switch_server.url
    for kwargs, says in (("yes", "chat_template_kwargs must be an object"), ([OFF], "must be an object"),
                         ({"enable_thinking": False, "add_generation_prompt": False},
                          "chat_template_kwargs.add_generation_prompt: the chat template's render sets 'add_generation_"
                          "prompt' itself"),
                         ({"messages": []}, "chat_template_kwargs.messages"),
                         ({"namespace": 1}, "chat_template_kwargs.namespace")):
        for route, body in (("/v1/chat/completions", CHAT), ("/tokenize", {"messages": CHAT["messages"]})):
            status, out = http("POST", url + route, {**body, "chat_template_kwargs": kwargs})
            assert status == 400 and out["error"]["param"] == "chat_template_kwargs", (route, out)
            assert says in out["error"]["message"], out
    raw = json.dumps({**CHAT, "chat_template_kwargs": {"budget": float("nan")}}).encode()   # NaN: not JSON
    status, out = http("POST", url + "/v1/chat/completions", raw=raw)
    assert status == 400 and "chat_template_kwargs.budget must be a JSON value" in out["error"]["message"], out
    status, out = http("POST", url + "/tokenize", {"prompt": "Once", "chat_template_kwargs": OFF})
    assert status == 400 and out["error"]["param"] == "chat_template_kwargs", out


# gpt-oss's format (harmony): a tiny gpt-oss model whose tokenizer has the format's special tokens and whose chat
# template renders it; a grammar (llguidance reads the special tokens by name) makes the random model write a reply
# of two messages, or a tool call, as gpt-oss does
HARMONY_REPLY = ('start: <|channel|> "analysis" <|message|> /[a-z]{2,6}( [a-z]{2,6}){1,3}/ <|end|> <|start|> '
                 '"assistant" <|channel|> "final" <|message|> /[a-z]{2,6}( [a-z]{2,6}){0,2}/ <|return|>')
HARMONY_CALL = ('start: <|channel|> "commentary to=functions.get_weather " <|constrain|> "json" <|message|> '
                '"{\\"city\\": \\"" /[a-z]{2,8}/ "\\"}" <|call|>')
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def harmony_server(tmp_path_factory):
    pytest.importorskip("mindspore")
    from tests.families import make_hf_model, needs_transformers, write_tokenizer

    needs_transformers()
    folder = tmp_path_factory.mktemp("harmony")
    model = make_hf_model("gptoss", folder / "gptoss", seed=1)
    write_tokenizer(model, 320, harmony=True)
    with serving(["--model", str(model), "--set", "model_config.max_generate_length=256"],
                 folder / "server.log") as server:
        yield server


def test_a_gpt_oss_reply_comes_apart_by_its_channels_whole_and_streamed(harmony_server):
    """The analysis channel is reasoning_content, the final one content, no marker in either; streamed alike; the
    reply ends at <|return|> (a stop token of the format) with finish_reason stop."""
    body = {"model": "gptoss", "temperature": 0, "max_tokens": 60, "guided_grammar": HARMONY_REPLY,
            "messages": [{"role": "user", "content": "Once upon a time"}]}
    message, streamed, usage = _chat(harmony_server, body)
    assert re.fullmatch(r"[a-z]{2,6}( [a-z]{2,6}){1,3}", message["reasoning_content"]), message
    assert re.fullmatch(r"[a-z]{2,6}( [a-z]{2,6}){0,2}", message["content"]), message
    assert streamed == (message["reasoning_content"], message["content"])
    status, whole = http("POST", harmony_server.url + "/v1/chat/completions", body)
    assert whole["choices"][0]["finish_reason"] == "stop" and usage["completion_tokens"] < 60


def test_a_gpt_oss_message_to_a_function_is_a_tool_call(harmony_server):
    """A commentary message to functions.get_weather is a tool call (its body the arguments), whole and streamed,
    finish_reason tool_calls; a forced call (tool_choice required, then named) follows this format's grammar: a
    message to the function whose body its parameters' schema shapes."""
    body = {"model": "gptoss", "temperature": 0, "max_tokens": 120, "guided_grammar": HARMONY_CALL, "tools": WEATHER,
            "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    status, whole = http("POST", harmony_server.url + "/v1/chat/completions", body)
    assert status == 200, whole
    choice = whole["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert re.fullmatch(r"[a-z]{2,8}", json.loads(calls[0]["function"]["arguments"])["city"])
    status, text = http("POST", harmony_server.url + "/v1/chat/completions", {**body, "stream": True})
    events = [e for e in parse_sse(text.replace("data: [DONE]", "")) if e["choices"]]
    streamed = [c for e in events for c in e["choices"][0]["delta"].get("tool_calls") or []]
    assert [c["function"] for c in streamed] == [c["function"] for c in calls]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    two = WEATHER + [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"]}}}]
    for choice, names in (("required", {"get_weather", "get_time"}),
                          ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})):
        forced = {**body, "guided_grammar": None, "tools": two, "tool_choice": choice}
        status, out = http("POST", harmony_server.url + "/v1/chat/completions", forced)
        assert status == 200, out
        calls = out["choices"][0]["message"]["tool_calls"]
        assert len(calls) == 1 and calls[0]["function"]["name"] in names, calls
        arguments = json.loads(calls[0]["function"]["arguments"])
        assert set(arguments) == ({"city"} if calls[0]["function"]["name"] == "get_weather" else {"zone"})


def test_skip_special_tokens_false_keeps_them_in_a_completions_text(harmony_server):
    """vLLM's skip_special_tokens: the text of a reply that writes special tokens has them only when it is false."""
    body = {"model": "gptoss", "temperature": 0, "max_tokens": 60, "guided_grammar": HARMONY_REPLY,
            "prompt": "<|start|>user<|message|>Once<|end|><|start|>assistant"}
    status, plain = http("POST", harmony_server.url + "/v1/completions", body)
    status2, kept = http("POST", harmony_server.url + "/v1/completions", {**body, "skip_special_tokens": False})
    assert status == status2 == 200, (plain, kept)
    text, full = plain["choices"][0]["text"], kept["choices"][0]["text"]
    assert "<|" not in text and full.startswith("<|channel|>analysis<|message|>") and "<|end|>" in full
    for marker in ("<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|return|>"):
        full = full.replace(marker, "")
    assert full == text
