"""gpt-oss's chat format (server/harmony.py): a reply's analysis channel as reasoning, its final channel (and
preambles) as content, messages to functions.NAME as tool calls; streamed in any pieces as whole."""
from __future__ import annotations

import json

import pytest

from llm_serving.server.harmony import HarmonyStream, split_harmony

THINK_ANSWER = ("<|channel|>analysis<|message|>The user greets; answer briefly.<|end|>"
                "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?<|return|>")
CALL = ("<|channel|>analysis<|message|>Need the weather tool.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"location": "Paris", "unit": "c"}<|call|>')


def test_reasoning_and_answer_come_apart():
    reasoning, content, calls = split_harmony(THINK_ANSWER)
    assert (reasoning, content, calls) == ("The user greets; answer briefly.", "Hello! How can I help?", [])


def test_a_message_to_a_function_is_a_tool_call_with_its_arguments():
    reasoning, content, calls = split_harmony(CALL)
    assert reasoning == "Need the weather tool." and content == ""
    assert len(calls) == 1 and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"location": "Paris", "unit": "c"}


def test_the_recipient_may_follow_the_role_and_a_preamble_is_content():
    text = ("<|channel|>commentary<|message|>Let me look that up.<|end|>"
            "<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{\"q\": 1}<|call|>")
    reasoning, content, calls = split_harmony(text)
    assert reasoning is None and content == "Let me look that up."
    assert [c["function"]["name"] for c in calls] == ["lookup"] and calls[0]["function"]["arguments"] == '{"q": 1}'


@pytest.mark.parametrize("text", [THINK_ANSWER, CALL])
@pytest.mark.parametrize("size", [1, 3, 7])
def test_streamed_in_any_pieces_it_is_the_same(text, size):
    stream, reasoning, content, names = HarmonyStream(), "", "", []
    for i in range(0, len(text), size):
        r, c, found = stream.push(text[i:i + size])
        reasoning, content, names = reasoning + r, content + c, names + [f["function"]["name"] for f in found]
    r, c, found = stream.flush()
    reasoning, content, names = reasoning + r, content + c, names + [f["function"]["name"] for f in found]
    want_reasoning, want_content, want_calls = split_harmony(text)
    assert (reasoning, content) == (want_reasoning or "", want_content)
    assert names == [f["function"]["name"] for f in want_calls]
    assert "<|" not in reasoning + content


def test_a_reply_cut_off_or_without_the_format():
    reasoning, content, calls = split_harmony("<|channel|>analysis<|message|>Thinking about it")
    assert (reasoning, content, calls) == ("Thinking about it", "", [])
    assert split_harmony("Just an answer.") == (None, "Just an answer.", [])
    cut = split_harmony("<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\": ")
    assert [c["function"]["arguments"] for c in cut[2]] == ['{"a":']          # as written: not JSON yet


def test_a_harmony_template_is_told_by_its_markers(tmp_path):
    from llm_serving.tokenization import load_chat_template, load_tokenizer
    from tests.families import write_tokenizer

    tok = load_tokenizer(str(write_tokenizer(tmp_path, 320)))
    harmony = "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
    (tmp_path / "harmony.jinja").write_text(harmony)
    assert load_chat_template(str(tmp_path / "harmony.jinja"), str(tmp_path), tok).harmony
    assert not load_chat_template(None, str(tmp_path), tok).harmony          # the directory's own (ChatML)


def test_a_forced_calls_grammar_takes_a_message_to_an_allowed_function_only(tmp_path):
    """call_lark: llguidance reads the format's special tokens by name; a call to an allowed function with arguments
    of its schema is accepted whole, another function's name or arguments off the schema are not."""
    from llm_serving.master.grammar import Grammars, GrammarSpec
    from llm_serving.server.harmony import call_lark
    from llm_serving.tokenization import load_tokenizer
    from tests.families import write_tokenizer

    tok = load_tokenizer(str(write_tokenizer(tmp_path, 320, harmony=True) / "tokenizer.json"))
    grammar = call_lark([{"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}}])
    grammars = Grammars(tok, 320)

    def accepts(text: str) -> bool:
        matcher = grammars.compile_now(GrammarSpec("grammar", grammar, "tools"))
        return all(matcher.consume_token(i) for i in tok.encode(text, add_bos=False)) and matcher.is_accepting()

    head = "<|channel|>commentary to=functions."
    assert accepts(head + 'get_weather <|constrain|>json<|message|>{"city": "paris"}<|call|>')
    assert not accepts(head + 'get_time <|constrain|>json<|message|>{"city": "paris"}<|call|>')
    assert not accepts(head + 'get_weather <|constrain|>json<|message|>{"town": "paris"}<|call|>')
