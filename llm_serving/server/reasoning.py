"""Thinking models' replies split into reasoning and answer (vLLM's `reasoning_content`): a chat template that
marks reasoning with `<think>` ... `</think>` (Qwen3's, DeepSeek-R1's) has the text between the tags returned as
`reasoning_content` and the rest as `content`, whole (`split_reasoning`) or as a stream goes
(`ReasoningStream`); newlines around the reasoning (`<think>\\n...\\n</think>\\n\\n`) belong to neither.

Where a reply starts depends on its prompt's end (`reply_start`): a generation prompt that opens the tag itself
(DeepSeek-R1's: the prompt ends with `<think>`) has the reply start inside the reasoning; one that closes an empty
block (Qwen3's with `enable_thinking` false: `<think>\\n\\n</think>\\n\\n`) has it be the answer, whatever it says;
any other (Qwen3's with thinking on) lets the model open the tag itself, or answer at once."""
from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
INSIDE, BEFORE, AFTER = "inside", "before", "after"     # where a reply starts: `reply_start`


def reply_start(prompt_tail: str) -> str:
    """Where a reply starts, from the text its prompt ends with: INSIDE the reasoning (the prompt opened the tag),
    AFTER it (the prompt closed one: the reply is all answer), or BEFORE (the reply may open one)."""
    tail = prompt_tail.rstrip()
    if tail.endswith(OPEN):
        return INSIDE
    return AFTER if tail.endswith(CLOSE) else BEFORE


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
    it is whole, and so are newlines that may turn out to precede `</think>`."""

    def __init__(self, thinking: bool = False):
        self.inside = thinking
        self.seen = thinking          # some reasoning was opened
        self.done = False             # the reasoning was closed: the rest is content
        self.buffer = ""
        self._strip = thinking        # newlines right after a tag are neither reasoning nor content

    def push(self, text: str) -> tuple:
        self.buffer += text
        reasoning = content = ""
        while self.buffer:
            if self._strip:
                self.buffer = self.buffer.lstrip("\n")
                self._strip = not self.buffer
                if not self.buffer:
                    break
            if self.done:
                content += self.buffer
                self.buffer = ""
                break
            tag = CLOSE if self.inside else OPEN
            at = self.buffer.find(tag)
            if at < 0:
                keep = partial_tag(self.buffer, tag)
                if self.inside:               # newlines before a closing tag are not reasoning
                    keep = len(self.buffer) - len(self.buffer[:len(self.buffer) - keep].rstrip("\n"))
                part, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                if self.inside:
                    reasoning += part
                else:
                    content += part
                break
            if self.inside:
                reasoning += self.buffer[:at].rstrip("\n")
                self.inside, self.done = False, True
            else:
                content += self.buffer[:at]
                self.inside = self.seen = True
            self._strip = True
            self.buffer = self.buffer[at + len(tag):]
        return reasoning, content

    def flush(self) -> tuple:
        """What is held back at the reply's end: reasoning cut off (its trailing newlines dropped) or content."""
        text, self.buffer = self.buffer, ""
        return (text.rstrip("\n"), "") if self.inside else ("", text)


def partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag` (held back until the next delta says)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0
