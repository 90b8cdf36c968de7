"""Thinking models' replies: <think> reasoning split from the answer, whole and streamed in any pieces."""
from __future__ import annotations

import pytest

from llm_serving.server.reasoning import AFTER, BEFORE, INSIDE, ReasoningStream, reply_start, split_reasoning
from llm_serving.tokenization.chat_template import ChatTemplate

from tests.unit.test_tools import PLAIN, _Tok


def test_whole_replies_split_at_the_tags():
    assert split_reasoning("<think>\nThe user greets.\n</think>\n\nHello!") == ("The user greets.", "Hello!")
    assert split_reasoning("Just an answer <thin") == (None, "Just an answer <thin")
    # the prompt opened the tag: the reply starts inside the reasoning
    assert split_reasoning("2 + 2 is 4.\n</think>\n\n4", thinking=True) == ("2 + 2 is 4.", "4")
    assert split_reasoning("cut off while thinking", thinking=True) == ("cut off while thinking", "")
    assert split_reasoning("<think></think>\n\nno thoughts") == (None, "no thoughts")


@pytest.mark.parametrize("cut", [1, 2, 5, 9])
def test_a_stream_splits_the_same_way_in_any_pieces(cut):
    text = "<think>\nweigh </th and <think too\n</think>\n\nThe answer: </think> stays."
    stream, reasoning, content = ReasoningStream(), "", ""
    for k in range(0, len(text), cut):
        r, c = stream.push(text[k:k + cut])
        reasoning, content = reasoning + r, content + c
        assert "<think>" not in r + c and "</think" not in r
    r, c = stream.flush()
    assert reasoning + r == "weigh </th and <think too" and content + c == "The answer: </think> stays."
    assert split_reasoning(text) == ("weigh </th and <think too", "The answer: </think> stays.")


def test_a_template_reasons_when_it_marks_thinking():
    assert ChatTemplate(_Tok(), PLAIN + "{% if add_generation_prompt %}<think>\n</think>{% endif %}").reasons
    assert not ChatTemplate(_Tok(), PLAIN).reasons and not ChatTemplate(_Tok()).reasons


def _streamed(text, cut, thinking=False):
    stream, reasoning, content = ReasoningStream(thinking), "", ""
    for k in range(0, len(text), cut):
        r, c = stream.push(text[k:k + cut])
        reasoning, content = reasoning + r, content + c
    r, c = stream.flush()
    return reasoning + r, content + c


@pytest.mark.parametrize("cut", [1, 3, 7, 100])
def test_qwen3_shapes_stream_as_they_split_whole(cut):
    """Thinking on: Qwen3's prompt leaves the tag to the reply; a template that opens it in the prompt has the reply
    start inside. Either way the streamed pieces add up to the whole reply's split, the newlines around the
    reasoning (and inside it, between paragraphs) where they belong."""
    thought = "The user asks for 2+2.\n\nThat is 4."
    for reply, thinking in ((f"<think>\n{thought}\n</think>\n\nIt is 4.", False),
                            (f"{thought}\n</think>\n\nIt is 4.", True),
                            (f"\n{thought}\n\n</think>\n\nIt is 4.", True)):
        assert split_reasoning(reply, thinking) == (thought, "It is 4.")
        assert _streamed(reply, cut, thinking) == (thought, "It is 4.")
    # an empty reasoning block (the model chose not to think) is no reasoning
    assert split_reasoning("<think>\n\n</think>\n\nIt is 4.") == (None, "It is 4.")
    assert _streamed("<think>\n\n</think>\n\nIt is 4.", cut) == ("", "It is 4.")
    # cut off while thinking: what there is of the reasoning, no answer
    assert _streamed(f"<think>\n{thought}\n\n", cut) == (thought, "")


def test_where_a_reply_starts_is_read_from_its_prompt():
    chatml = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert reply_start(chatml) == BEFORE                                  # Qwen3, thinking on: the model opens it
    assert reply_start(chatml + "<think>\n") == INSIDE                    # the prompt opened it
    assert reply_start(chatml + "<think>\n\n</think>\n\n") == AFTER     # enable_thinking false: all answer
    # a reasoning block earlier in the conversation says nothing of this reply
    assert reply_start("<|im_start|>assistant\n<think>\nx\n</think>\n\n4<|im_end|>\n" + chatml) == BEFORE
