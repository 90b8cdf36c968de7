"""Tool calling on the chat route: a request's `tools` and `tool_choice` for the served model's template
(`ToolRequest.of`; their shape is checked by api/openai.py), the conversation rendered with them
(`ToolRequest.conversation`), the grammar that forces a call (`required`, a named function: any model then writes a
call whose arguments validate against the function's parameters, and the reply may end as soon as a call is whole:
`call_lark`), and the reply's calls parsed, whole (`parse_calls`) or as a stream goes (`CallStream`); a call the reply
ends inside (max_tokens cut it) is dropped, its markup never content (`cut_call`).

Formats. A chat template that takes `tools` (Qwen2.5's, Llama-3.1's) renders them itself, and the model writes
calls as its template taught it: Hermes/Qwen's `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, or
Llama-3's bare `{"name": ..., "parameters": {...}}` (`ChatTemplate.tool_format`). Any other template gets the
tools described in a system message that asks for the `<tool_call>` form (`DEFAULT_TOOL_PROMPT`). History is
passed as the template expects: assistant `tool_calls` (arguments as objects) and `tool` messages to a template
that takes tools; to another, calls as the `<tool_call>` text the model wrote and results as a user turn in
`<tool_response>` tags.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Optional

from llm_serving.master.grammar import JSON_OPTIONS, GrammarSpec
from llm_serving.server.reasoning import partial_tag
from llm_serving.tokenization import ChatTemplateError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
DEFAULT_TOOL_PROMPT = (
    "You can call functions to answer. Their definitions, one JSON object per line:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, write only a JSON object with its name and arguments between tags, one call per block:\n"
    "<tool_call>\n{{\"name\": \"function name\", \"arguments\": {{\"argument\": \"value\"}}}}\n</tool_call>\n"
    "A function's result comes back in <tool_response> tags.")


@dataclass
class ToolRequest:
    """A chat request's tools (OpenAI's shape), what it allows (`choice`: auto, required, none, or a function's
    name) and whether several calls may come at once; `format` is how the model writes a call."""
    tools: list
    choice: str = "auto"
    parallel: bool = True
    format: str = "hermes"
    takes_tools: bool = False
    names: list = field(default_factory=list)

    @classmethod
    def of(cls, tools: Optional[list], choice: str, parallel: bool, template) -> "Optional[ToolRequest]":
        """A chat's validated tools (api/openai.py checks their shape, names and tool_choice) for the served
        model's template; None when it has none, or tool_choice is none."""
        if not tools or choice == "none":
            return None
        return cls(tools, choice, parallel and choice in ("auto", "required"), template.tool_format,
                   template.takes_tools, [t["function"]["name"] for t in tools])

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    @property
    def allowed(self) -> list:
        """The tools a forced call may call: every one (required), or the named one."""
        return [t for t in self.tools if self.choice == "required" or t["function"]["name"] == self.choice]

    def grammar(self) -> Optional[GrammarSpec]:
        """The grammar a forced call follows (required: any tool, or a named one); None for auto."""
        if not self.forced:
            return None
        allowed = [t["function"] for t in self.allowed]
        args = "parameters" if self.format == "llama3_json" else "arguments"
        defs: dict = {}                  # every tool's $defs, at the root where their $refs can reach them
        schemas = [{"type": "object", "additionalProperties": False, "required": ["name", args],
                    "properties": {"name": {"const": fn["name"]},
                                   args: _hoisted(fn.get("parameters") or {"type": "object"}, f"{k}_", defs)}}
                   for k, fn in enumerate(allowed)]
        if defs:
            schemas = [{**schemas[0], "$defs": defs}] if len(schemas) == 1 else \
                [{"anyOf": schemas, "$defs": defs}]
        if self.format == "llama3_json":
            one = {"anyOf": schemas} if len(schemas) > 1 else schemas[0]
            return GrammarSpec("json", json.dumps({**one, "x-guidance": JSON_OPTIONS}), "tools")
        return GrammarSpec("grammar", call_lark(schemas), "tools")

    def conversation(self, messages: list) -> tuple:
        """(messages, tools) to render: as they are for a template that takes tools; else the tools described in
        a system message and the history's calls and results as text (see the module docstring)."""
        if self.takes_tools:
            return [_with_argument_objects(m) for m in messages], self.tools
        return describe_tools(self.tools, history_as_text(messages)), None


def call_lark(schemas: list) -> str:
    """A Lark grammar of one Hermes call: a `<tool_call>` block holding a JSON object {"name", "arguments"} that one of
    `schemas` (one per tool allowed) validates. The grammar ends with the call, and so does the reply, on the token
    that closes it (finish_reason tool_calls). A forced reply is one call even where parallel calls are allowed:
    neither OpenAI's nor Anthropic's API says how many a client wants, and a grammar that lets a model open another
    call after its first lets a small model repeat it until max_tokens (SmolLM2 gives the next "<" 0.99); several
    calls come with tool_choice auto. A call cut by max_tokens is dropped when the reply is read (`cut_call`)."""
    one = {"anyOf": schemas} if len(schemas) > 1 else schemas[0]
    return (f"start: call\n"
            f"call: {json.dumps(OPEN + chr(10))} obj {json.dumps(chr(10) + CLOSE)}\n"
            f"obj: %json {json.dumps({**one, 'x-guidance': JSON_OPTIONS})}\n")


def _hoisted(schema: dict, prefix: str, defs: dict) -> dict:
    """A tool's parameters schema with its $defs (or definitions) moved into `defs` under `prefix` and its
    "#/$defs/X" references pointed there: nested under a call's "arguments", its own root is no longer the root."""
    own = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    if not own:
        return schema
    for name, value in own.items():
        defs[prefix + name] = value

    def point(node):
        if isinstance(node, dict):
            out = {k: point(v) for k, v in node.items() if k not in ("$defs", "definitions")}
            ref = node.get("$ref")
            if isinstance(ref, str):
                for root in ("#/$defs/", "#/definitions/"):
                    if ref.startswith(root):
                        out["$ref"] = "#/$defs/" + prefix + ref[len(root):]
            return out
        if isinstance(node, list):
            return [point(v) for v in node]
        return node
    for name in own:
        defs[prefix + name] = point(defs[prefix + name])
    return point(schema)


def _with_argument_objects(message: dict) -> dict:
    """An assistant message's tool calls with their arguments as objects (templates write them with tojson)."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        fn = dict(call["function"])
        try:
            fn["arguments"] = json.loads(fn["arguments"]) if isinstance(fn.get("arguments"), str) else fn["arguments"]
        except json.JSONDecodeError:
            pass
        calls.append({**call, "function": fn})
    return {**message, "tool_calls": calls}


PROBE_TOOL = {"type": "function", "function": {"name": "get_time", "description": "the current time",
                                               "parameters": {"type": "object", "properties": {}}}}


def serves_tools(template, max_model_len: int) -> bool:
    """Whether a chat with one small tool is served with this template, its prompt made as a request's would be
    (`ToolRequest.conversation`) and left room for a reply in the context: true for a template that takes tools and
    for any other that takes a system message (the tools are described there) when that fits; false for one that
    refuses a system message (Gemma's raise "System role not supported") and takes no tools, or a context the
    prompt does not fit (stories260K's 256 tokens)."""
    tools = ToolRequest.of([PROBE_TOOL], "auto", True, template)
    messages, rendered = tools.conversation([{"role": "user", "content": "What time is it?"}])
    try:
        return len(template.encode(messages, rendered)) < max_model_len
    except ChatTemplateError:
        return False


def describe_tools(tools: list, messages: list) -> list:
    """The conversation with the tools described at the end of its system message (one made if it has none)."""
    text = DEFAULT_TOOL_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def join_contents(a, b, sep: str = "\n"):
    """Two turns' contents as one: strings joined by `sep`; with parts (a user turn's images), the parts in order,
    `sep` a text part between them."""
    if isinstance(a, str) and isinstance(b, str):
        return a + sep + b
    parts = [{"type": "text", "text": a}] if isinstance(a, str) else list(a)
    return parts + [{"type": "text", "text": sep}] + ([{"type": "text", "text": b}] if isinstance(b, str) else list(b))


def history_as_text(messages: list) -> list:
    """Assistant tool calls as the `<tool_call>` blocks the model wrote, tool results as user turns (consecutive
    user turns joined), for a template that knows neither."""
    out: list = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            blocks = [f"{OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                                "arguments": _arguments(c["function"].get("arguments"))},
                                               ensure_ascii=False) + f"\n{CLOSE}" for c in m["tool_calls"]]
            content = "\n".join(([content] if content else []) + blocks)
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        if out and role == "user" and out[-1]["role"] == "user":
            out[-1] = {"role": "user", "content": join_contents(out[-1]["content"], content)}
        else:
            out.append({"role": role, "content": content})
    return out


def _arguments(value):
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def _call(obj, args_key: str) -> Optional[dict]:
    """An OpenAI tool call of a parsed {"name", args_key} object; None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)


def parse_calls(text: str, fmt: str) -> tuple:
    """(content left, [tool calls]) of a whole reply: `<tool_call>` blocks (hermes), or a reply that is a JSON
    object or several separated by ';' (llama3_json). Text that does not parse stays content."""
    if fmt == "llama3_json":
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):]
        calls, at, decoder = [], 0, json.JSONDecoder()
        while True:                      # objects one after another, ';' (or whitespace) between them
            while at < len(body) and body[at] in " \t\r\n;":
                at += 1
            if at == len(body):
                break
            try:
                obj, at = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return text, []
            call = _call(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
        return (None, calls) if calls else (text, [])
    calls, rest, last = [], [], 0
    for match in _BLOCK.finditer(text):
        try:
            call = _call(json.loads(match.group(1)), "arguments")
        except json.JSONDecodeError:
            call = None
        if call is None:
            continue
        calls.append(call)
        rest.append(text[last:match.start()])
        last = match.end()
    rest.append(cut_call(text[last:]))
    content = "".join(rest).strip() if calls else "".join(rest)
    return (content or None), calls


def cut_call(text: str) -> str:
    """`text` without a `<tool_call>` block that it ends inside (one max_tokens cut): a call cut short is no call,
    and its markup is no content."""
    start = text.rfind(OPEN)
    return text[:start] if start >= 0 and CLOSE not in text[start:] else text


class CallStream:
    """A streamed reply's text split into content deltas and tool calls as they complete (hermes: content is
    passed on until a `<tool_call>` tag could be starting; each call goes out when its block closes). llama3_json
    replies are held whole when they start with '{' (they are either a call or content) and parsed at the end."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self.buffer = ""
        self.calls: list = []
        self.started = False          # llama3_json: the reply starts like a call

    def push(self, text: str) -> tuple:
        """(content to send now, [calls completed now])."""
        self.buffer += text
        if self.fmt == "llama3_json":
            if not self.started and self.buffer.lstrip():
                self.started = self.buffer.lstrip()[0] in "{<"
            if self.started:
                return "", []
            out, self.buffer = self.buffer, ""
            return out, []
        content, calls = "", []
        while True:
            start = self.buffer.find(OPEN)
            if start < 0:
                keep = partial_tag(self.buffer, OPEN)
                if self.calls and not self.buffer[:len(self.buffer) - keep].strip():
                    return content, calls       # whitespace between calls: held, sent only if text follows
                content += self.buffer[:len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return content, calls
            if not (self.calls and not self.buffer[:start].strip()):
                content += self.buffer[:start]
            end = self.buffer.find(CLOSE, start)
            if end < 0:
                self.buffer = self.buffer[start:]
                return content, calls
            block = self.buffer[start:end + len(CLOSE)]
            self.buffer = self.buffer[end + len(CLOSE):]
            _, found = parse_calls(block, "hermes")
            if found:
                calls += found
                self.calls += found
            else:
                content += block

    def flush(self) -> tuple:
        """At the end: (content left, [calls left]); a call the reply ends inside is dropped (`cut_call`)."""
        text, self.buffer = self.buffer, ""
        if self.fmt == "llama3_json" and self.started:
            content, calls = parse_calls(text, "llama3_json")
            self.calls += calls
            return content or "", calls
        text = cut_call(text)
        return ("" if self.calls and not text.strip() else text), []
