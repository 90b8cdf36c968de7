"""Thinking models' replies: <think> reasoning split from the answer, whole and streamed in any pieces."""
from __future__ import annotations

import pytest

from llm_serving.server.reasoning import ReasoningStream, split_reasoning
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
    assert (reasoning + r).strip() == "weigh </th and <think too" and content + c == "The answer: </think> stays."
    assert split_reasoning(text) == ("weigh </th and <think too", "The answer: </think> stays.")


def test_a_template_reasons_when_it_marks_thinking():
    assert ChatTemplate(_Tok(), PLAIN + "{% if add_generation_prompt %}<think>\n</think>{% endif %}").reasons
    assert not ChatTemplate(_Tok(), PLAIN).reasons and not ChatTemplate(_Tok()).reasons
