"""translate.prepare's rules about a request's length: the prompt against the context first (a long agent request's
error is the one its user must act on), a server's default reply length (serving_config.default_max_tokens) for
requests that give none, and Anthropic's max_tokens as a ceiling cut to what the context leaves."""
from __future__ import annotations

import pytest

from llm_serving.server.api.anthropic import MessagesRequest
from llm_serving.server.api.base import validate
from llm_serving.server.api.openai import CompletionRequest
from llm_serving.server.errors import ValidationError
from llm_serving.server.translate import prepare


class _Tok:
    def encode(self, text, add_bos=False):
        return [1] * add_bos + [ord(c) % 100 for c in text]


class _Template:
    harmony, takes_tools, tool_format = False, False, "hermes"

    def encode(self, messages, tools=None, variables=None, expand=None):
        return [ord(c) % 100 for m in messages for c in m["content"]]


class _Engine:
    model_name, vocab_size, max_model_len, tokenizer, chat_template = "m", 100, 64, _Tok(), _Template()
    image_facts = None                  # (a text model)

    def __init__(self, default_max_tokens=None):
        self.default_max_tokens = default_max_tokens

    def served_models(self):
        return ["m"]

    def check_generates(self):          # (a model that generates)
        return None


def test_a_prompt_past_the_context_is_the_error_whatever_else_is_wrong():
    body = {"model": "m", "prompt": "x" * 80, "max_tokens": 8, "logit_bias": {"100": 1}}
    with pytest.raises(ValidationError) as err:
        prepare(validate(CompletionRequest, body).to_request(), _Engine())
    assert err.value.param == "prompt"
    assert str(err.value).startswith("prompt has 81 tokens; this model accepts at most 63 prompt tokens (64 tokens "
                                     "per request, prompt + new tokens). Shorten the prompt")
    chat = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "y" * 70}]}
    with pytest.raises(ValidationError, match="prompt has 70 tokens") as err:
        prepare(validate(MessagesRequest, chat).to_request(), _Engine())
    assert err.value.param == "messages"
    # within the context, the vocabulary's bound is what is wrong
    with pytest.raises(ValidationError) as err:
        prepare(validate(CompletionRequest, {**body, "prompt": "x"}).to_request(), _Engine())
    assert err.value.param == "logit_bias"


def test_the_servers_default_length_applies_only_when_a_request_gives_none():
    body = {"model": "m", "prompt": "abc"}
    assert prepare(validate(CompletionRequest, body).to_request(), _Engine(10)).sampling.max_new_tokens == 10
    assert prepare(validate(CompletionRequest, body).to_request(), _Engine()).sampling.max_new_tokens == 16
    given = {**body, "max_tokens": 40}
    assert prepare(validate(CompletionRequest, given).to_request(), _Engine(10)).sampling.max_new_tokens == 40
    with pytest.raises(ValidationError, match="ask for at most 60 new tokens"):
        prepare(validate(CompletionRequest, {**body, "max_tokens": 61}).to_request(), _Engine())


def test_anthropics_max_tokens_is_a_ceiling_cut_to_what_the_context_leaves():
    chat = {"model": "m", "max_tokens": 32000, "messages": [{"role": "user", "content": "hello"}]}
    assert prepare(validate(MessagesRequest, chat).to_request(), _Engine(10)).sampling.max_new_tokens == 59
    chat["max_tokens"] = 7
    assert prepare(validate(MessagesRequest, chat).to_request(), _Engine(10)).sampling.max_new_tokens == 7


def test_system_messages_mid_conversation_are_folded_for_a_template_that_refuses_them():
    """Claude Code and Codex send instructions as system messages after the first turn; a template that takes the
    system prompt only first gets them before the user turn that follows (the opening ones joined)."""
    from llm_serving.server.translate import fold_system_messages
    conversation = [{"role": "system", "content": "A"}, {"role": "system", "content": "B"},
                    {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                    {"role": "system", "content": "C"}, {"role": "user", "content": [{"type": "text", "text": "go"}]},
                    {"role": "assistant", "content": "ok"}, {"role": "system", "content": "D"}]
    assert fold_system_messages(conversation) == [
        {"role": "system", "content": "A\n\nB"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"}, {"role": "user", "content": "C\n\ngo\n\nD"},
        {"role": "assistant", "content": "ok"}]
    plain = [{"role": "system", "content": "A"}, {"role": "user", "content": "hi"}]
    assert fold_system_messages(plain) == plain
