"""A chat reply's text read into what every chat API returns: reasoning, content and tool calls, whole
(`read_reply`) or as it streams (`ReplyStream`), by the shape the prompt gave it (`reply_shape`): a thinking model's
`<think>` block (server/reasoning.py), gpt-oss's harmony channels (server/harmony.py), or tool calls in the
template's format (server/tools.py). OpenAI chat, Anthropic Messages, OpenAI Responses and Ollama's chat all read
replies here and differ only in how they write them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from llm_serving.server.harmony import HarmonyStream, split_harmony
from llm_serving.server.reasoning import AFTER, INSIDE, ReasoningStream, reply_start, split_reasoning
from llm_serving.server.tools import CallStream, parse_calls
from llm_serving.server.translate import Prepared


@dataclass(frozen=True)
class ReplyShape:
    """How a chat reply's text is read: `tool_format` the tools' call format (None: no tools, or harmony's own),
    `reasoning` a <think> block is split out (`thinking`: the reply starts inside it), `harmony` gpt-oss's format,
    `forced` a grammar forces calls (tool_choice required or named): its reply has no content; anything but whole
    calls in it is a call max_tokens cut, dropped."""
    tool_format: Optional[str] = None
    reasoning: bool = False
    thinking: bool = False
    harmony: bool = False
    forced: bool = False


def reply_shape(engine, prepared: Prepared) -> ReplyShape:
    """The shape of a prepared chat's reply. Where it starts: inside the reasoning (the prompt opened <think>), after
    it (the prompt closed an empty one: Qwen3's enable_thinking false), or before (the model may open it); a grammar
    constrains the reply from its first token, so its output is the answer unless it spells the reasoning out
    itself (its text has the closing tag)."""
    start = reply_start(engine.tokenizer.decode(prepared.prompt_ids[-32:], skip_special=False)) \
        if engine.chat_template.reasons else AFTER
    grammar = prepared.sampling.grammar
    reasons = start != AFTER and (grammar is None or "</think>" in str(grammar.value)) and not prepared.harmony
    tools = prepared.tools.format if prepared.tools is not None and not prepared.harmony else None
    return ReplyShape(tools, reasons, reasons and start == INSIDE, prepared.harmony,
                      tools is not None and prepared.tools.forced)


def read_reply(text: str, shape: ReplyShape) -> tuple:
    """(reasoning or None, content or None, [tool calls]) of a whole reply (calls in OpenAI's shape:
    {id, type: function, function: {name, arguments}})."""
    reasoning, calls = None, []
    if shape.harmony:
        reasoning, text, calls = split_harmony(text)
    elif shape.reasoning:
        reasoning, text = split_reasoning(text, shape.thinking)
    if shape.tool_format is not None:
        content, calls = parse_calls(text, shape.tool_format)
        if calls or shape.forced:
            return reasoning, None if shape.forced else content, calls
        text = content or ""    # (a call the reply ends inside dropped)
    return reasoning, text, calls


class ReplyStream:
    """A streamed reply's text as (reasoning, content, [calls completed]) pieces: reasoning first, then the answer;
    content until a tool call could start, each call once it is whole. `calls` holds every call so far."""

    def __init__(self, shape: ReplyShape):
        self.thinks = ReasoningStream(shape.thinking) if shape.reasoning else None
        self.harmony = HarmonyStream() if shape.harmony else None
        self.tools = CallStream(shape.tool_format) if shape.tool_format is not None else None
        self.forced = shape.forced

    @property
    def calls(self) -> list:
        source = self.harmony or self.tools
        return source.calls if source is not None else []

    def push(self, text: str) -> tuple:
        """(reasoning, content, [calls]) that `text` lets out now (the rest is held: a tag may be starting)."""
        thought, found = "", []
        if self.thinks is not None:
            thought, text = self.thinks.push(text)
        if self.harmony is not None:
            thought, text, found = self.harmony.push(text)
        if self.tools is not None:
            text, found = self.tools.push(text)
        return thought, "" if self.forced else text, found

    def flush(self) -> tuple:
        """At the end: (reasoning, content, [calls]) held back until now."""
        thought, text, found = "", "", []
        if self.thinks is not None:
            thought, text = self.thinks.flush()
        if self.harmony is not None:
            thought, text, found = self.harmony.flush()
        if self.tools is not None:
            text, found = self.tools.push(text)
            rest, more = self.tools.flush()
            text, found = text + rest, found + more
        return thought, "" if self.forced else text, found

    def finish_reason(self, reason: str) -> str:
        """The reply's finish reason: "tool_calls" where it stopped after calling a tool."""
        return "tool_calls" if reason == "stop" and self.calls else reason
