"""gpt-oss's chat format (OpenAI's harmony) read out of a reply: the reply is a run of messages, each a header and a
body,

    <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{...}<|call|>

and each body goes where its header says: the `analysis` channel is the reply's reasoning (`reasoning_content`), the
`final` channel (and a `commentary` message to nobody: a preamble the user sees) its content, and a message to
`functions.NAME` a tool call of NAME whose arguments are the body. The reply starts in a header: the generation prompt
ends with `<|start|>assistant`. A forced call (tool_choice required or named) follows `call_lark`'s grammar.
`HarmonyStream` splits a reply as it streams (its text decoded with the special tokens kept), `split_harmony` a whole
one; a chat template of this format says so (`ChatTemplate.harmony`), and its replies end at `<|return|>` or
`<|call|>` (`STOPS`).
"""
from __future__ import annotations

import json
import re
import uuid

from llm_serving.master.grammar import JSON_OPTIONS
from llm_serving.server.reasoning import partial_tag

START, END, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"
RETURN, CALL = "<|return|>", "<|call|>"
_BODY_ENDS = (END, RETURN, CALL, START)            # what ends a message's body
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


# the special tokens that end a reply: the final answer's, a tool call's
STOPS = (RETURN, CALL)


class HarmonyStream:
    """A streamed reply's text (special tokens kept) as (reasoning, content, calls) deltas: `push` each delta,
    `flush` at the end. A marker split over deltas is held until it is whole; a tool call is given once its message
    ends. Text outside any header the format knows (a model that answers without one) is content."""

    def __init__(self):
        self.buffer = ""
        self.in_header = True                          # the reply starts where the prompt's header left off
        self.header = ""
        self.channel, self.recipient = None, None
        self.arguments = ""
        self.calls: list = []                          # every call so far, as OpenAI's tool_calls entries

    def push(self, text: str) -> tuple:
        self.buffer += text
        reasoning, content, calls = [], [], []
        while self.buffer:
            if self.in_header:
                at = self.buffer.find(MESSAGE)
                if at < 0:
                    keep = partial_tag(self.buffer, MESSAGE)
                    self.header += self.buffer[:len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                self.header += self.buffer[:at]
                self.buffer = self.buffer[at + len(MESSAGE):]
                self._read_header()
                continue
            ends = [(self.buffer.find(m), m) for m in _BODY_ENDS if m in self.buffer]
            if not ends:
                keep = max(partial_tag(self.buffer, m) for m in _BODY_ENDS)
                self._body(self.buffer[:len(self.buffer) - keep], reasoning, content)
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            at, marker = min(ends)
            self._body(self.buffer[:at], reasoning, content)
            self.buffer = self.buffer[at + (0 if marker == START else len(marker)):]
            calls += self._end_message()
        return "".join(reasoning), "".join(content), calls

    def flush(self) -> tuple:
        """What is held at the reply's end: a body cut off, or a header that never reached its message (a model
        answering without the format: its text is content), and a call whose message was cut off."""
        reasoning, content = [], []
        if self.in_header:
            text = _strip_markers(self.header + self.buffer)
            content.append(text)
            self.header = ""
        else:
            self._body(self.buffer, reasoning, content)
        self.buffer = ""
        return "".join(reasoning), "".join(content), self._end_message() if not self.in_header else []

    def _read_header(self) -> None:
        header = self.header
        self.header, self.in_header, self.arguments = "", False, ""
        channel = header.split(CHANNEL, 1)[1] if CHANNEL in header else ""
        self.channel = re.split(r"[\s<]", channel.strip(), maxsplit=1)[0] if channel.strip() else None
        found = _RECIPIENT.search(header)
        self.recipient = found.group(1) if found else None

    def _body(self, text: str, reasoning: list, content: list) -> None:
        if not text:
            return
        if self.recipient is not None:
            self.arguments += text
        elif self.channel == "analysis":
            reasoning.append(text)
        else:                                          # final, a preamble, or a channel the format does not name
            content.append(text)

    def _end_message(self) -> list:
        found = []
        if self.recipient is not None and not self.in_header:
            name = self.recipient.split(".", 1)[1] if self.recipient.startswith("functions.") else self.recipient
            call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                    "function": {"name": name, "arguments": _arguments(self.arguments)}}
            self.calls.append(call)
            found.append(call)
        self.in_header, self.channel, self.recipient, self.arguments = True, None, None, ""
        return found


def call_lark(functions: list) -> str:
    """A Lark grammar (llguidance reads the special tokens by name) for one tool call in this format: a commentary
    message to functions.NAME whose body is a JSON object of that function's parameters, one alternative per function
    allowed (`functions`: OpenAI's function objects); the reply then ends at <|call|>."""
    rules = []
    for k, fn in enumerate(functions):
        params = json.dumps({**(fn.get("parameters") or {"type": "object"}), "x-guidance": JSON_OPTIONS})
        rules.append(f"call{k}: {json.dumps('commentary to=functions.' + fn['name'] + ' ')} {CONSTRAIN} \"json\" "
                     f"{MESSAGE} args{k} {CALL}\nargs{k}: %json {params}")
    start = " | ".join(f"call{k}" for k in range(len(functions)))
    return f"start: {CHANNEL} ({start})\n" + "\n".join(rules) + "\n"


def split_harmony(text: str) -> tuple:
    """(reasoning or None, content, calls) of a whole reply (its text with the special tokens kept)."""
    stream = HarmonyStream()
    reasoning, content, calls = stream.push(text)
    more_reasoning, more_content, more_calls = stream.flush()
    reasoning += more_reasoning
    return reasoning or None, content + more_content, calls + more_calls


def _arguments(text: str) -> str:
    """A call's arguments as OpenAI gives them: a JSON object's text (the body, stripped), as the model wrote it."""
    text = text.strip()
    try:
        return json.dumps(json.loads(text))
    except ValueError:
        return text


def _strip_markers(text: str) -> str:
    """Text with the format's markers (and a header's role and channel words) left out."""
    for marker in (START, END, MESSAGE, CONSTRAIN, RETURN, CALL):
        text = text.replace(marker, "")
    return re.sub(re.escape(CHANNEL) + r"\S*", "", text)
