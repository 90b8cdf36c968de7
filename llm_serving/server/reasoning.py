"""Thinking models' replies split into reasoning and answer (vLLM's `reasoning_content`): a chat template that
marks reasoning with `<think>` ... `</think>` (Qwen3's, DeepSeek-R1's) has the text between the tags returned as
`reasoning_content` and the rest as `content`, whole (`split_reasoning`) or as a stream goes
(`ReasoningStream`). A template whose generation prompt opens the tag itself (the prompt ends with `<think>`) has
the reply start inside the reasoning."""
from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def split_reasoning(text: str, thinking: bool = False) -> tuple:
    """(reasoning or None, content) of a whole reply; `thinking`: the prompt opened the tag."""
    stream = ReasoningStream(thinking)
    reasoning, content = stream.push(text)
    more_reasoning, more_content = stream.flush()
    reasoning += more_reasoning
    return (reasoning.strip() or None) if stream.seen else None, content + more_content


class ReasoningStream:
    """A streamed reply split into (reasoning, content) deltas: before `<think>` content (a reply may answer
    without thinking), between the tags reasoning, after `</think>` content; a tag split over deltas is held until
    it is whole."""

    def __init__(self, thinking: bool = False):
        self.inside = thinking
        self.seen = thinking          # some reasoning was opened
        self.done = False             # the reasoning was closed: the rest is content
        self.buffer = ""
        self._strip = False           # newlines right after </think> are not content

    def push(self, text: str) -> tuple:
        self.buffer += text
        reasoning = content = ""
        while self.buffer:
            if self.done:
                if self._strip:
                    self.buffer = self.buffer.lstrip("\n")
                    self._strip = not self.buffer
                content += self.buffer
                self.buffer = ""
                break
            tag = CLOSE if self.inside else OPEN
            at = self.buffer.find(tag)
            if at < 0:
                keep = _partial(self.buffer, tag)
                part, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                if self.inside:
                    reasoning += part
                else:
                    content += part
                break
            if self.inside:
                reasoning += self.buffer[:at]
                self.inside, self.done, self._strip = False, True, True
            else:
                content += self.buffer[:at]
                self.inside = self.seen = True
            self.buffer = self.buffer[at + len(tag):]
        return reasoning, content

    def flush(self) -> tuple:
        text, self.buffer = self.buffer, ""
        return (text, "") if self.inside else ("", text)


def _partial(text: str, tag: str) -> int:
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0
