"""Tool calling's pure parts: checking tools and tool_choice, rendering them through templates that take tools and
templates that do not, the grammar that forces a call (walked token by token as a random model would: where it may
end), and parsing calls whole and streamed in both formats (a call max_tokens cut dropped; a forced reply's text)."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest

from llm_serving.server.api.base import validate
from llm_serving.server.api.openai import ChatCompletionRequest
from llm_serving.server.errors import ValidationError
from llm_serving.server.reply import ReplyShape, ReplyStream, read_reply
from llm_serving.server.tools import CallStream, ToolRequest, history_as_text, parse_calls, serves_tools
from llm_serving.tokenization.chat_template import ChatTemplate

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"}}}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}

# a template that renders tools itself, as Qwen2.5's does (Hermes <tool_call> format)
QWEN_LIKE = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
             "{% for m in messages %}{{ m.role }}: {% if m.tool_calls %}{% for c in m.tool_calls %}"
             "<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}\n"
             "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
LLAMA3_LIKE = ('{% if tools %}Respond with {"name": function name, "parameters": dictionary of argument name and '
               'its value}.{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}')
PLAIN = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


class _Tok:
    vocab_size, bos_id, eos_id, eos_ids, chat_template, model_file = 300, None, 0, [0], None, "t"

    def special_text(self, i):
        return ""

    def encode(self, text, add_bos=False):
        return [ord(c) % 300 for c in text]


def _tools(body, template=PLAIN):
    """A chat request's tools, validated (api/openai.py) and made a ToolRequest for the template."""
    r = validate(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body})
    return ToolRequest.of(r.tool_dicts(), r.choice, r.parallel_tool_calls is not False,
                          template if isinstance(template, ChatTemplate) else ChatTemplate(_Tok(), template))


def test_tools_and_tool_choice_are_checked_and_name_their_field():
    assert _tools({}) is None and _tools({"tools": [WEATHER], "tool_choice": "none"}) is None
    req = _tools({"tools": [WEATHER, ADD], "tool_choice": {"type": "function", "function": {"name": "add"}}})
    assert req.choice == "add" and req.forced and not req.parallel
    assert _tools({"tools": [WEATHER]}).choice == "auto"
    for body, param in (({"tool_choice": "auto"}, "tool_choice"),
                        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
                        ({"tools": [WEATHER, WEATHER]}, "tools"),
                        ({"tools": [{"type": "retrieval"}]}, "tools"),
                        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
                         "tool_choice"),
                        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls")):
        with pytest.raises(ValidationError) as info:
            _tools(body)
        assert info.value.param == param, body


def test_a_template_without_tools_gets_them_in_a_system_message_and_the_history_as_text():
    req = _tools({"tools": [WEATHER]})
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "-3 C"},
               {"role": "tool", "tool_call_id": "c2", "content": "snow"}]
    messages, rendered = req.conversation(history)
    assert rendered is None and messages[0]["role"] == "system"
    assert json.dumps(WEATHER) in messages[0]["content"] and "<tool_call>" in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                                                           '{"city": "Oslo"}}\n</tool_call>'}
    assert messages[3] == {"role": "user", "content": "<tool_response>\n-3 C\n</tool_response>\n"
                                                      "<tool_response>\nsnow\n</tool_response>"}
    assert history_as_text([{"role": "system", "content": "s"}]) == [{"role": "system", "content": "s"}]


def test_a_template_that_takes_tools_renders_them_with_argument_objects():
    template = ChatTemplate(_Tok(), QWEN_LIKE)
    assert template.takes_tools and template.tool_format == "hermes"
    req = _tools({"tools": [WEATHER, ADD]}, template)
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]}]
    messages, rendered = req.conversation(history)
    text = template.render(messages, rendered)
    assert text.startswith("TOOLS:get_weather;add;user: hi")
    assert '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>' in text
    assert ChatTemplate(_Tok(), LLAMA3_LIKE).tool_format == "llama3_json"
    assert not ChatTemplate(_Tok(), PLAIN).takes_tools


# Gemma's way: no system role, no tools
NO_SYSTEM = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role not supported') }}"
             "{% endif %}<{{ m.role }}>{{ m.content }}{% endfor %}")


def test_tools_are_served_by_a_template_that_takes_them_or_a_system_message_when_they_fit():
    assert serves_tools(ChatTemplate(_Tok(), QWEN_LIKE), 4096)
    assert serves_tools(ChatTemplate(_Tok(), LLAMA3_LIKE), 4096)
    plain = ChatTemplate(_Tok(), PLAIN)
    assert serves_tools(plain, 4096)                              # (described in a system message)
    described = len(plain.encode(*ToolRequest.of([WEATHER], "auto", True, plain).conversation(
        [{"role": "user", "content": "What time is it?"}])))
    assert 400 < described and not serves_tools(plain, 256)      # the description alone fills a small context
    assert not serves_tools(ChatTemplate(_Tok(), NO_SYSTEM), 4096)
    takes_them = NO_SYSTEM.replace("{% for m", "{% if tools %}TOOLS{% endif %}{% for m", 1)
    assert serves_tools(ChatTemplate(_Tok(), takes_them), 4096)   # (rendered by the template, no system message)


def test_the_forcing_grammar_allows_only_the_chosen_tools_in_the_models_format():
    hermes = _tools({"tools": [WEATHER, ADD], "tool_choice": "required", "parallel_tool_calls": False}).grammar()
    assert hermes.kind == "grammar" and '"<tool_call>\\n" obj' in hermes.value and "call (" not in hermes.value
    assert '"const": "get_weather"' in hermes.value and '"const": "add"' in hermes.value
    named = _tools({"tools": [WEATHER, ADD], "tool_choice": {"type": "function", "function": {"name": "add"}}},
                   LLAMA3_LIKE).grammar()
    schema = json.loads(named.value)
    assert named.kind == "json" and schema["properties"]["name"] == {"const": "add"}
    assert schema["properties"]["parameters"] == ADD["function"]["parameters"]
    assert _tools({"tools": [WEATHER]}).grammar() is None                          # auto: the model decides


def test_calls_are_parsed_from_whole_replies_in_both_formats():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    content, calls = parse_calls(text, "hermes")
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Oslo"}), ("add", {"a": 1})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert parse_calls("<tool_call>{not json}</tool_call>", "hermes") == ("<tool_call>{not json}</tool_call>", [])
    content, calls = parse_calls('<|python_tag|>{"name": "add", "parameters": {"a": 2}}; {"name": "x", '
                                 '"parameters": {}}', "llama3_json")
    assert content is None and [c["function"]["name"] for c in calls] == ["add", "x"]
    assert parse_calls("The answer is {1}", "llama3_json") == ("The answer is {1}", [])


@pytest.mark.parametrize("cut", [1, 3, 7])
def test_a_stream_passes_content_on_and_each_call_once_it_closes(cut):
    text = ('Sure <tool<x> <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>\n')
    stream, content, calls = CallStream("hermes"), "", []
    for k in range(0, len(text), cut):
        c, found = stream.push(text[k:k + cut])
        content, calls = content + c, calls + found
        assert "<tool_call" not in c
    c, found = stream.flush()
    assert content + c == "Sure <tool<x> " and found == []
    assert [c["function"]["name"] for c in calls] == ["add", "get_weather"] == \
        [c["function"]["name"] for c in stream.calls]
    llama = CallStream("llama3_json")
    assert llama.push('{"name": "add", ') == ("", []) and llama.push('"parameters": {}}') == ("", [])
    content, calls = llama.flush()
    assert content == "" and calls[0]["function"]["name"] == "add"
    plain = CallStream("llama3_json")
    assert plain.push("Hello {x}") == ("Hello {x}", []) and plain.flush() == ("", [])


def test_a_forced_call_compiles_tools_whose_parameters_refer_to_their_own_defs(stories_dir):
    """pydantic writes nested types as $defs and $refs; nested under a call's arguments they must still resolve,
    each tool's apart from another's of the same name."""
    from llm_serving.master.grammar import Grammars
    from llm_serving.master.logits import LogitsState
    from llm_serving.master.request import SamplingParams
    from llm_serving.tokenization import SentencePieceTokenizer

    def tool(name, inner):
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "required": ["where"], "additionalProperties": False,
            "properties": {"where": {"$ref": "#/$defs/Place"}}, "$defs": {"Place": inner}}}}
    tools = [tool("go", {"type": "object", "required": ["x"], "additionalProperties": False,
                         "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}}),
             tool("see", {"enum": ["north", "south"]})]
    tok = SentencePieceTokenizer(str(stories_dir / "hf" / "tokenizer.model"))
    grammars = Grammars(tok, tok.vocab_size)
    for choice in ("required", {"type": "function", "function": {"name": "see"}}):
        spec = _tools({"tools": tools, "tool_choice": choice, "parallel_tool_calls": False}).grammar()
        state = LogitsState(SamplingParams(grammar=spec), set(tok.eos_ids), tok.vocab_size, grammars.compile_now(spec))
        row, out, rng = np.zeros(grammars.mask_words, np.int32), [], random.Random(0)
        while not state.complete:
            state.write(row, out)
            allowed = [t for t in np.nonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))[0].tolist()
                       if t not in tok.eos_ids]
            token = rng.choice(allowed)
            assert state.accept(token), state.error
            out.append(token)
        _, calls = parse_calls(tok.decode(out), "hermes")
        args = json.loads(calls[0]["function"]["arguments"])
        if calls[0]["function"]["name"] == "go":
            assert choice == "required" and 0 <= args["where"]["x"] <= 9
        else:
            assert args["where"] in ("north", "south")


def test_llama3_calls_keep_semicolons_inside_their_strings():
    content, calls = parse_calls('{"name": "sql", "parameters": {"q": "SELECT 1; SELECT 2"}};{"name": "x", '
                                 '"parameters": {}}', "llama3_json")
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"q": "SELECT 1; SELECT 2"}
    assert [c["function"]["name"] for c in calls] == ["sql", "x"]


GO = {"type": "function", "function": {"name": "go", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["to"],
    "properties": {"to": {"enum": ["north", "south"]}}}}}
HALT = {"type": "function", "function": {"name": "halt", "parameters": {
    "type": "object", "additionalProperties": False, "properties": {}}}}
def _walk(tok, grammars, spec, seed: int) -> list:
    """A reply a random model writes under the grammar (each token drawn from those its mask allows, EOS among
    them): [(the text so far, whether EOS is allowed there)] up to its end (EOS, or the grammar complete)."""
    from llm_serving.master.logits import LogitsState
    from llm_serving.master.request import SamplingParams

    state = LogitsState(SamplingParams(grammar=spec), set(tok.eos_ids), tok.vocab_size, grammars.compile_now(spec))
    row, out, rng, seen = np.zeros(grammars.mask_words, np.int32), [], random.Random(seed), []
    for _ in range(400):
        state.write(row, out)
        allowed = np.nonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))[0].tolist()
        seen.append((tok.decode(out), tok.eos_id in allowed))
        if state.complete:
            return seen
        token = rng.choice(allowed)
        if token in tok.eos_ids:
            return seen
        assert state.accept(token), state.error
        out.append(token)
    raise AssertionError(f"no end after 400 tokens: {tok.decode(out)!r}")


def test_a_forced_call_is_one_call_and_the_reply_ends_on_the_token_that_closes_it(stories_dir):
    """required (parallel calls allowed or not) and a named function alike: the grammar is complete, and the reply
    ends, on the token that closes the call; EOS is never allowed before it, nor any text after it."""
    from llm_serving.master.grammar import Grammars
    from llm_serving.tokenization import SentencePieceTokenizer

    tok = SentencePieceTokenizer(str(stories_dir / "hf" / "tokenizer.model"))
    grammars = Grammars(tok, tok.vocab_size)
    for choice, parallel in (("required", True), ("required", False),
                             ({"type": "function", "function": {"name": "go"}}, True)):
        one = _tools({"tools": [GO, HALT], "tool_choice": choice, "parallel_tool_calls": parallel}).grammar()
        assert one.value.startswith("start: call\n")
        for seed in range(10):
            seen = _walk(tok, grammars, one, seed)
            assert not any(eos for _, eos in seen[:-1])
            text = seen[-1][0]
            assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>") and \
                len(parse_calls(text, "hermes")[1]) == 1, text
            assert choice == "required" or json.loads(text.split("\n")[1])["name"] == "go"


CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


@pytest.mark.parametrize("cut", ["\n<tool_call>", '\n<tool_call>\n{"name": "ad', "\n<tool_call>\n{}\n</tool_c"])
def test_a_call_the_reply_ends_inside_is_dropped_whole_or_streamed(cut):
    """max_tokens cut a second call: the first alone, and nothing of the second as content."""
    text = CALL_TEXT + cut
    content, calls = parse_calls(text, "hermes")
    assert content is None and [c["function"]["name"] for c in calls] == ["add"]
    for step in (1, 4, 1000):
        stream, streamed, found = CallStream("hermes"), "", []
        for k in range(0, len(text), step):
            c, more = stream.push(text[k:k + step])
            streamed, found = streamed + c, found + more
        c, more = stream.flush()
        assert streamed + c == "" and [f["function"]["arguments"] for f in found + more] == ['{"a": 1, "b": 2}']
    # a call cut after text (tool_choice auto): the text stays, the call's markup goes
    assert parse_calls("Let me add.\n" + cut.lstrip("\n"), "hermes") == ("Let me add.\n", [])
    stream = CallStream("hermes")
    assert stream.push("Let me add.\n" + cut.lstrip("\n"))[0] + stream.flush()[0] == "Let me add.\n"


@pytest.mark.parametrize("fmt, text, names", [
    ("hermes", CALL_TEXT + "\n<tool_", ["add"]),          # cut inside the next call's tag
    ("hermes", "<tool_ca", []),                           # inside the first
    ("hermes", CALL_TEXT + "\n", ["add"]),                # the newline the grammar allows before the end
    ("llama3_json", '{"name": "add", "parameters": {"a": 1', []),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1}}', ["add"])])
def test_a_forced_reply_has_no_content_whole_or_streamed(fmt, text, names):
    """A grammar forced the reply to be calls: whatever is not a whole call in it is a call cut short, never text."""
    shape = ReplyShape(tool_format=fmt, forced=True)
    reasoning, content, calls = read_reply(text, shape)
    assert reasoning is None and content is None and [c["function"]["name"] for c in calls] == names
    for step in (1, 3, 1000):
        reply, streamed, found = ReplyStream(shape), "", []
        for k in range(0, len(text), step):
            _, piece, more = reply.push(text[k:k + step])
            streamed, found = streamed + piece, found + more
        _, piece, more = reply.flush()
        assert streamed + piece == "" and [c["function"]["name"] for c in found + more] == names
    # not forced (tool_choice auto), the same text of a cut Llama-3 call is the model's text
    if fmt == "llama3_json" and not names:
        assert read_reply(text, ReplyShape(tool_format=fmt))[1] == text
