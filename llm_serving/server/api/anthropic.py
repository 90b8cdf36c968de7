"""Anthropic's Messages API bodies (POST /v1/messages, /v1/messages/count_tokens): every rule about their shape, and
their translation into the internal request (server/translate.py). Content blocks become OpenAI-shaped chat
messages — an assistant's tool_use blocks its `tool_calls` (arguments as JSON text), a user's tool_result blocks
`tool` messages — tools become OpenAI's functions, `thinking` the chat template's `enable_thinking` (Qwen3's switch).
What the server cannot serve (documents, Anthropic's server tools, images outside a user turn) is refused by name, never
dropped; an image block in a user turn is taken (a model without images refuses it in translate.py)."""
from __future__ import annotations

import json
from typing import Annotated, Any, Dict, List, Literal, Optional, Union

from pydantic import ConfigDict, Discriminator, Field, PrivateAttr, Tag, model_validator

from llm_serving.master.grammar import GrammarSpec
from llm_serving.master.request import SamplingParams
from llm_serving.server.api.base import (GIVEN, MAX_STOP_STRINGS, SERVED_MODEL, STOP_STRING, TOOLS_GIVEN, Body,
                                         Open, needs, rules, stop_strings, when)
from llm_serving.server.errors import ValidationError
from llm_serving.server.tools import join_contents
from llm_serving.server.translate import ApiRequest
from llm_serving.vision import ImageError, decode_data_url

MAX_TOOLS = 128
TOOL_NAME = r"^[A-Za-z0-9_-]{1,128}$"
# where a block that a message of the other role takes belongs
_BELONGS = {"tool_use": "assistant", "thinking": "assistant", "redacted_thinking": "assistant",
            "tool_result": "user"}
_MEDIA = ("image", "document", "search_result", "container_upload")     # (an image is taken in a user turn only)


class CacheControl(Body):
    """Accepted and ignored: the server's prefix cache reuses every shared prompt prefix by itself."""
    type: Literal["ephemeral"]
    ttl: Optional[Literal["5m", "1h"]] = None


class TextBlock(Body):
    type: Literal["text"]
    text: str
    cache_control: Optional[CacheControl] = None
    citations: Optional[List[Dict[str, Any]]] = Field(None, description="accepted and ignored")


class ToolUseBlock(Body):
    """A call the assistant made (in the history)."""
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: Dict[str, Any]
    cache_control: Optional[CacheControl] = None
    caller: Optional[Dict[str, Any]] = Field(None, description="accepted (the SDK sends its reply's blocks back)")
    toolset_name: Optional[str] = None


class ThinkingBlock(Body):
    """The assistant's earlier reasoning: accepted, not fed back (chat templates drop a past turn's reasoning)."""
    type: Literal["thinking"]
    thinking: str
    signature: Optional[str] = None


class RedactedThinkingBlock(Body):
    type: Literal["redacted_thinking"]
    data: str


class Unserved(Open):
    """A content block this server does not take: its validator says why, naming the block."""
    model_config = ConfigDict(json_schema_extra={"not": {}})      # (the document: no such block is taken)
    type: Any = None

    @model_validator(mode="after")
    def _refuse(self):
        kind = self.type
        if kind == "image":
            raise ValidationError("image blocks are taken in a user message's content, not here")
        if kind in _MEDIA:
            raise ValidationError(f"{kind} blocks are not supported: the served model reads text and images only")
        if isinstance(kind, str) and kind in _BELONGS:       # (an object or a list as the type: unknown)
            raise ValidationError(f"{kind} blocks belong in {_BELONGS[kind]} messages")
        raise ValidationError(f"unknown content block type {kind!r}")


def _blocks(**models) -> Any:
    """A content block union told apart by its `type` ({type: model}); any other type is `Unserved`'s, which refuses
    it. (Its tags have a space: api.base leaves them out of a field's path, messages[0].content[1].input.)"""
    def tag(value):
        kind = value.get("type") if isinstance(value, dict) else None
        return f"{kind} block" if isinstance(kind, str) and kind in models else "unserved block"
    return Annotated[Union[tuple(Annotated[m, Tag(f"{kind} block")] for kind, m in models.items())
                           + (Annotated[Unserved, Tag("unserved block")],)], Discriminator(tag)]


TextBlocks = List[_blocks(text=TextBlock)]


class ToolResultBlock(Body):
    """A tool's result (in a user message), answering the tool_use block with its id."""
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: Union[str, TextBlocks] = ""
    is_error: bool = False
    cache_control: Optional[CacheControl] = None
    toolset_name: Optional[str] = None

    def as_dict(self) -> dict:
        text = _text(self.content)
        return {"role": "tool", "tool_call_id": self.tool_use_id, "content": f"Error: {text}" if self.is_error
                else text}


class ImageSource(Body):
    type: Literal["base64", "url"]
    media_type: Optional[str] = Field(None, description="image/jpeg, image/png, image/gif or image/webp (base64)")
    data: Optional[str] = Field(None, description="the image file, base64 (type base64)")
    url: Optional[str] = Field(None, description="an http(s) URL of a host the server fetches from "
                                                 "(serving_config.image_url_hosts; type url)")


class ImageBlock(Body):
    """An image in a user message (a vision-language model's), its file as base64."""
    type: Literal["image"]
    source: ImageSource
    cache_control: Optional[CacheControl] = None
    _part: dict = PrivateAttr(None)

    @model_validator(mode="after")
    def _decoded(self):
        source = self.source
        if source.type == "url" and isinstance(source.url, str) and source.url.startswith(("http://", "https://")):
            self._part = {"type": "image", "url": source.url}       # (fetched from the allowed hosts only)
            return self
        if source.type == "url" or source.data is None:
            raise ValidationError("an image's source must be base64 (type base64, media_type, data) or an http(s) "
                                  "url", param="messages")
        try:
            self._part = {"type": "image", "image": decode_data_url(
                f"data:{source.media_type or 'image/png'};base64,{source.data}")}
        except ImageError as e:
            raise ValidationError(f"image block: {e}", param="messages") from None
        return self

    def part(self) -> dict:
        return self._part


def _text(content) -> str:
    """A content's text: a string, or its text blocks joined by newlines (as vLLM joins text parts)."""
    return content if isinstance(content, str) else "\n".join(b.text for b in content)


class UserMessage(Body):
    role: Literal["user"]
    content: Union[str, List[_blocks(text=TextBlock, tool_result=ToolResultBlock, image=ImageBlock)]] = Field(
        description="a string or blocks: text, tool_result, image")

    def images(self) -> list:
        return [b for b in self.content if b.type == "image"] if not isinstance(self.content, str) else []

    def as_dicts(self) -> list:
        """Its tool results as tool messages, then its text as one user message (with images: its text and images
        as parts, an image as {"type": "image", "image": its file}, in order)."""
        if isinstance(self.content, str):
            return [{"role": "user", "content": self.content}]
        out = [b.as_dict() for b in self.content if b.type == "tool_result"]
        if self.images():
            return out + [{"role": "user", "content": [b.part() if b.type == "image" else
                                                       {"type": "text", "text": b.text}
                                                       for b in self.content if b.type in ("image", "text")]}]
        texts = [b for b in self.content if b.type == "text"]
        return out + ([{"role": "user", "content": _text(texts)}] if texts or not out else [])


class AssistantMessage(Body):
    role: Literal["assistant"]
    content: Union[str, List[_blocks(text=TextBlock, tool_use=ToolUseBlock, thinking=ThinkingBlock,
                                     redacted_thinking=RedactedThinkingBlock)]] = Field(
        description="a string or blocks: text, tool_use, thinking, redacted_thinking (a last assistant message is a "
                    "prefix the reply continues)")

    def as_dicts(self) -> list:
        if isinstance(self.content, str):
            return [{"role": "assistant", "content": self.content}]
        message = {"role": "assistant", "content": _text([b for b in self.content if b.type == "text"])}
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(
            b.input, ensure_ascii=False)}} for b in self.content if b.type == "tool_use"]
        return [{**message, "tool_calls": calls} if calls else message]


class SystemMessage(Body):
    role: Literal["system"]
    content: Union[str, TextBlocks]

    def as_dicts(self) -> list:
        return [{"role": "system", "content": _text(self.content)}]


def _role(value):
    if not isinstance(value, dict):         # (not an object: the user model says so)
        return "user message"
    role = value.get("role")
    return f"{role} message" if role in ("user", "assistant", "system") else None


Message = Annotated[Union[Annotated[UserMessage, Tag("user message")],
                          Annotated[AssistantMessage, Tag("assistant message")],
                          Annotated[SystemMessage, Tag("system message")]],
                    Discriminator(_role, custom_error_type="role",
                                  custom_error_message="role must be 'user' or 'assistant' (or 'system')")]


class CustomTool(Body):
    """A client tool (the client runs it)."""
    name: str = Field(pattern=TOOL_NAME, description="1-128 letters, digits, _ or -")
    description: Optional[str] = None
    input_schema: Dict[str, Any] = Field(description="a JSON schema of the input, of type object",
                                         json_schema_extra=needs({"type": {"const": "object"}}))
    type: Optional[Literal["custom"]] = None
    cache_control: Optional[CacheControl] = None
    strict: Optional[bool] = Field(None, description="accepted: a forced call always follows the schema")

    @model_validator(mode="after")
    def _object_schema(self):
        if self.input_schema.get("type") != "object":
            raise ValidationError("input_schema must be a JSON schema of type 'object'")
        return self

    def as_dict(self) -> dict:
        about = {"description": self.description} if self.description is not None else {}
        return {"type": "function", "function": {"name": self.name, **about, "parameters": self.input_schema}}


class ServerTool(Open):
    """One of Anthropic's server tools (web_search_20250305, code_execution_..., bash_..., text_editor_...: typed by
    version): this server runs none, so the request is answered without it (the model is not told of it) and the log
    names it once."""
    type: str = Field(json_schema_extra={"not": {"const": "custom"}})


def _tool_kind(value) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "type=custom" if kind in (None, "custom") else "type=server"


# a tool with no type (or "custom") is the client's; any other type is a server tool (left out)
Tool = Annotated[Union[Annotated[CustomTool, Tag("type=custom")], Annotated[ServerTool, Tag("type=server")]],
                 Discriminator(_tool_kind)]


class ContextManagement(Open):
    """Claude Code's context edits (clear_thinking, clear_tool_uses): accepted. Thinking blocks are never fed back
    here (what clear_thinking asks); tool uses are kept, the prompt is checked against the context as it is."""
    edits: Optional[List[Dict[str, Any]]] = None


class ToolChoice(Body):
    model_config = ConfigDict(json_schema_extra=rules(
        when("type", {"const": "tool"}, needs({"name": GIVEN})),
        when("type", {"not": {"const": "tool"}}, {"not": needs({"name": GIVEN})})))
    type: Literal["auto", "any", "tool", "none"] = Field(description="any: some tool must be called (its input "
                                                                     "follows its schema); tool: the named one")
    name: Optional[str] = Field(None, description="with type tool")
    disable_parallel_tool_use: Optional[bool] = None

    @model_validator(mode="after")
    def _name(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValidationError("tool_choice.name goes with type 'tool' (and it needs one)", param="tool_choice")
        return self


class Thinking(Body):
    model_config = ConfigDict(json_schema_extra=rules(
        when("type", {"const": "enabled"}, needs({"budget_tokens": GIVEN})),
        when("type", {"not": {"const": "enabled"}}, {"not": needs({"budget_tokens": GIVEN})})))
    type: Literal["enabled", "disabled", "adaptive"] = Field(
        description="the chat template's enable_thinking: true (enabled, adaptive) or false")
    budget_tokens: Optional[int] = Field(None, ge=1024, description="with enabled; accepted, not enforced: the "
                                                                    "reasoning ends when the model ends it")
    display: Optional[Literal["summarized", "omitted"]] = None

    @model_validator(mode="after")
    def _budget(self):
        if (self.type == "enabled") != (self.budget_tokens is not None):
            raise ValidationError("thinking.budget_tokens goes with type 'enabled' (and it needs one)",
                                  param="thinking")
        return self


class OutputFormat(Body):
    type: Literal["json_schema"]
    schema_: Dict[str, Any] = Field(alias="schema", description="the reply is JSON that validates against it")


class OutputConfig(Body):
    effort: Optional[Literal["low", "medium", "high", "xhigh", "max"]] = Field(
        None, description="the chat template's reasoning_effort (gpt-oss's; xhigh and max as high)")
    format: Optional[OutputFormat] = None


class _Chat(Body):
    """What messages and count_tokens share: the conversation, the tools, and what the template is given."""
    model_config = ConfigDict(json_schema_extra=rules(     # a tool_choice but none needs tools; a forced one, no format
        when("tool_choice", needs({"type": {"not": {"const": "none"}}}), TOOLS_GIVEN),
        when("tool_choice", needs({"type": {"enum": ["any", "tool"]}}),
             {"not": needs({"output_config": needs({"format": GIVEN})})})))
    model: str = Field(min_length=1, description="the served model's id, or a LoRA adapter's (GET /v1/models)",
                       json_schema_extra=SERVED_MODEL)
    messages: List[Message] = Field(min_length=1)
    system: Optional[Union[str, TextBlocks]] = Field(None, description="a string or text blocks")
    tools: Optional[List[Tool]] = Field(None, max_length=MAX_TOOLS, description="client tools; server tools "
                                        "(web search, code execution, ...) are left out")
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None
    output_config: Optional[OutputConfig] = None
    cache_control: Optional[CacheControl] = None
    speed: Optional[Literal["standard", "fast"]] = Field(None, description="accepted and ignored")
    context_management: Optional[ContextManagement] = Field(None, description="accepted (Claude Code sends it)")

    _grammar: Optional[GrammarSpec] = PrivateAttr(None)

    @model_validator(mode="after")
    def _chat_rules(self):
        self._check_tools()
        self._check_tool_results()
        fmt = self.output_config.format if self.output_config is not None else None
        if fmt is not None:
            if self.choice not in ("auto", "none") and self.client_tools():
                raise ValidationError(f"tool_choice {self.tool_choice.type!r} forces a tool call; it cannot also "
                                      "follow output_config.format", param="tool_choice")
            self._grammar = GrammarSpec.json_schema(fmt.schema_, "output_config.format.schema")
        return self

    def client_tools(self) -> list:
        return [t for t in self.tools or () if isinstance(t, CustomTool)]

    def left_out(self) -> list:
        """What of the request is not served and left out (the log names it once): server tools by type."""
        return [f"tools of type {t.type!r} (this server runs no server tools)" for t in self.tools or ()
                if isinstance(t, ServerTool)]

    def _check_tools(self) -> None:
        names = [t.name for t in self.client_tools()]
        twice = next((n for k, n in enumerate(names) if n in names[:k]), None)
        if twice is not None:
            raise ValidationError(f"tools: the tool name {twice!r} is given twice", param="tools")
        choice = self.tool_choice
        if choice is not None and choice.type != "none" and not names:
            raise ValidationError(f"tool_choice {choice.type!r} needs tools", param="tool_choice")
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise ValidationError(f"tool_choice names {choice.name!r}, which is not one of the tools",
                                  param="tool_choice")

    def _check_tool_results(self) -> None:
        """Every tool_result answers a tool_use block the conversation made before it."""
        called: set = set()
        for i, m in enumerate(self.messages):
            for k, b in enumerate(m.content if isinstance(m.content, list) else ()):
                if b.type == "tool_use":
                    called.add(b.id)
                elif b.type == "tool_result" and b.tool_use_id not in called:
                    raise ValidationError(f"messages[{i}].content[{k}].tool_use_id {b.tool_use_id!r} answers no "
                                          "tool_use block before it", param="messages")

    @property
    def choice(self) -> str:
        """tool_choice as the internal request says it: auto, required, none, or the named tool."""
        c = self.tool_choice
        return "auto" if c is None else {"auto": "auto", "any": "required", "none": "none"}.get(c.type, c.name)

    @property
    def parallel(self) -> bool:
        return not (self.tool_choice is not None and self.tool_choice.disable_parallel_tool_use)

    def chat_messages(self) -> list:
        """The conversation as OpenAI-shaped messages, the system prompt first; a role's turns that follow each other
        are one turn (as Anthropic combines them)."""
        system = _text(self.system) if self.system is not None else ""
        out = [{"role": "system", "content": system}] if system else []
        for m in self.messages:
            for message in m.as_dicts():
                last = out[-1] if out else None
                if last is not None and last["role"] == message["role"] == "user":
                    last["content"] = join_contents(last["content"], message["content"])
                elif last is not None and last["role"] == message["role"] == "assistant":
                    calls = last.get("tool_calls", []) + message.get("tool_calls", [])
                    out[-1] = {**last, "content": last["content"] + message["content"],
                               **({"tool_calls": calls} if calls else {})}
                else:
                    out.append(message)
        return out

    def tool_dicts(self) -> Optional[list]:
        return [t.as_dict() for t in self.client_tools()] or None


    def variables(self) -> Optional[dict]:
        """The chat template's variables: enable_thinking (Qwen3's), reasoning_effort (gpt-oss's)."""
        out = {}
        if self.thinking is not None:
            out["enable_thinking"] = self.thinking.type != "disabled"
        effort = self.output_config.effort if self.output_config is not None else None
        if effort is not None:
            out["reasoning_effort"] = effort if effort in ("low", "medium", "high") else "high"
        return out or None


class Metadata(Body):
    user_id: Optional[str] = None


class MessagesRequest(_Chat):
    """POST /v1/messages."""
    max_tokens: int = Field(ge=1, le=1 << 20, description="the most tokens the reply may have")
    stop_sequences: Optional[List[str]] = Field(None, description="at most 16 strings of 1 to 256 characters; the "
                                                "reply ends before the first one it writes",
                                                json_schema_extra={"items": STOP_STRING, "maxItems": MAX_STOP_STRINGS})
    temperature: float = Field(1.0, ge=0.0, le=1.0, description="0 = greedy")
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=0, le=1 << 20, description="0 = off")
    stream: bool = Field(False, description="server-sent events: message_start, content blocks, message_stop")
    metadata: Optional[Metadata] = None
    service_tier: Optional[Literal["auto", "standard_only"]] = Field(None, description="accepted and ignored")

    @model_validator(mode="after")
    def _stops(self):
        stop_strings(self.stop_sequences, "stop_sequences", "stop_sequences")
        return self

    def to_request(self) -> ApiRequest:
        greedy = self.temperature == 0.0
        sampling = SamplingParams(
            max_new_tokens=self.max_tokens, temperature=self.temperature,
            top_k=0 if greedy else self.top_k or 0, top_p=1.0 if greedy or self.top_p is None else self.top_p,
            stop=stop_strings(self.stop_sequences, "stop_sequences", "stop_sequences"), grammar=self._grammar)
        return ApiRequest(sampling, messages=self.chat_messages(), variables=self.variables(),
                          tools=self.tool_dicts(), tool_choice=self.choice, parallel_tool_calls=self.parallel,
                          model=self.model, stream=self.stream,
                          max_tokens_ceiling=True)    # (Claude Code asks 32,000): cut to what the context leaves


class CountTokensRequest(_Chat):
    """POST /v1/messages/count_tokens: the prompt's tokens, as /v1/messages would feed it."""


ROUTES = [("/v1/messages", MessagesRequest, "Anthropic Messages: text, tools, thinking, streamed or not"),
          ("/v1/messages/count_tokens", CountTokensRequest, "Anthropic: the tokens a Messages request's prompt has")]
