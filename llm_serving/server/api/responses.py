"""OpenAI's Responses body (POST /v1/responses, what Codex CLI speaks): every rule about its shape, and its
translation into the internal chat request (server/translate.py). Input items become chat messages in OpenAI's
chat shape: messages as they are (developer as system), function calls as an assistant's tool_calls, their outputs
as tool messages; reasoning items are accepted and left out (the model's reasoning is not fed back). A stored
response the request continues (previous_response_id) gives the messages before them (routes_responses.py)."""
from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import ConfigDict, Discriminator, Field, PrivateAttr, Tag, field_validator, model_validator
from typing_extensions import Annotated

from llm_serving.master.grammar import GrammarSpec
from llm_serving.master.request import SamplingParams
from llm_serving.server.api.base import GIVEN, NEW_TOKENS, SERVED_MODEL, TOOLS_GIVEN, Body, Open, needs, rules, when
from llm_serving.server.api.openai import MAX_TOOLS, TOOL_NAME, image_part
from llm_serving.server.errors import ValidationError
from llm_serving.server.translate import ApiRequest

MAX_INPUT_ITEMS = 10_000
MAX_METADATA = 16                 # OpenAI's: 16 pairs, keys of at most 64 characters, values of at most 512
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class ItemText(Open):
    """A message's text: input_text (the user's, the system's) or output_text (an assistant's, as a response gave
    it, its annotations and logprobs along)."""
    type: Literal["input_text", "output_text"]
    text: str


class ItemImage(Open):
    """An image in a user message (a vision-language model's): its file as a base64 data: URL."""
    type: Literal["input_image"]
    image_url: Optional[str] = Field(None, description="a base64 data: URL (data:image/png;base64,...)")
    file_id: Optional[str] = Field(None, description="refused: no files are stored here")
    detail: Optional[Literal["auto", "low", "high"]] = Field(None, description="accepted; every image is read at "
                                                                               "the model's one resolution")
    _part: dict = PrivateAttr(None)

    @model_validator(mode="after")
    def _decoded(self):
        if self.image_url is None:
            raise ValidationError("input_image needs image_url, a base64 data: URL (file_id: no files are stored "
                                  "here)", param="input")
        self._part = image_part(self.image_url, "input_image")
        return self


class _OtherPart(Open):
    type: Literal["input_text", "output_text", "input_image"]


def _part_kind(part) -> str:
    kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
    return {"input_text": "text part", "output_text": "text part", "input_image": "image part"}.get(kind, "other part") \
        if isinstance(kind, str) else "other part"


# (tags with a space: they name no field in an error's path, api/base.py)
Part = Annotated[Union[Annotated[ItemText, Tag("text part")], Annotated[ItemImage, Tag("image part")],
                       Annotated[_OtherPart, Tag("other part")]], Discriminator(_part_kind)]


def _text(content) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content if isinstance(p, ItemText))


class MessageItem(Open):
    """A message, with or without "type": "message" (an output message given back carries its id and status)."""
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, List[Part]] = Field(description="a string, or text parts and (a user's) input_image parts")

    @model_validator(mode="after")
    def _images_in_user_turns(self):
        if self.role != "user" and self.images():
            raise ValidationError(f"input_image parts go in user messages, not in a {self.role} message",
                                  param="input")
        return self

    def images(self) -> list:
        return [p for p in self.content if isinstance(p, ItemImage)] if isinstance(self.content, list) else []

    def as_dict(self) -> dict:
        """As a chat message: its text, or (with images) its parts, an image as {"type": "image", "image": bytes}."""
        role = "system" if self.role == "developer" else self.role
        if self.images():
            return {"role": role, "content": [p._part if isinstance(p, ItemImage)
                                              else {"type": "text", "text": p.text} for p in self.content]}
        return {"role": role, "content": _text(self.content)}


class FunctionCallItem(Open):
    """A call the model made (a response's output item given back; a namespace's function with its namespace)."""
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    namespace: Optional[str] = None
    arguments: str = Field(description="the arguments as JSON text")


class FunctionCallOutputItem(Open):
    """What a call gave back, by its call_id."""
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: Union[str, List[ItemText]]


class ReasoningItem(Open):
    """A response's reasoning given back: accepted, not fed to the model."""
    type: Literal["reasoning"]


def _item_type(value) -> Optional[str]:
    if isinstance(value, dict):
        return f"type={value.get('type', 'message')}"
    return f"type={getattr(value, 'type', None)}"


# the item's "type" picks its model (a message may leave it out); the tags are left out of an error's path
InputItem = Annotated[Union[Annotated[MessageItem, Tag("type=message")],
                            Annotated[FunctionCallItem, Tag("type=function_call")],
                            Annotated[FunctionCallOutputItem, Tag("type=function_call_output")],
                            Annotated[ReasoningItem, Tag("type=reasoning")]], Discriminator(_item_type)]


class FunctionTool(Body):
    """A function the model may call (Responses' flat shape: no nested "function")."""
    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME, description="1-64 letters, digits, _ . or -")
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = Field(None, description="a JSON schema of the arguments")
    strict: Optional[bool] = None

    def as_chat_tool(self, namespace: Optional[str] = None) -> dict:
        """The tool in OpenAI chat's shape, as translate.prepare takes tools; a namespace's function by its
        qualified name (namespace.name), the name the model sees and calls."""
        function = {"name": qualified(namespace, self.name), "description": self.description,
                    "parameters": self.parameters}
        return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


class NamespaceTool(Body):
    """Functions grouped under a name (Codex's MCP servers: the client runs them): each served as a function the
    model calls by `namespace.name`; a call comes back with `name` and `namespace` apart, as OpenAI gives it."""
    type: Literal["namespace"]
    name: str = Field(pattern=TOOL_NAME)
    description: Optional[str] = None
    tools: List[FunctionTool] = Field(min_length=1, max_length=MAX_TOOLS)


class HostedTool(Open):
    """A tool OpenAI's servers run (web_search, file_search, code_interpreter, image_generation, mcp, ...) or a
    free-form custom tool: this server runs none of them, so the request is answered without it (the model is not
    told of it) and the log names it once."""
    type: str = Field(description="a hosted tool's type: left out", json_schema_extra={"not": {"enum": [
        "function", "namespace"]}})


def _tool_kind(value) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"type={kind}" if kind in ("function", "namespace") else "type=hosted"


# a tool's "type" picks its model: a function, a namespace of functions, or anything else (hosted: left out)
Tool = Annotated[Union[Annotated[FunctionTool, Tag("type=function")], Annotated[NamespaceTool, Tag("type=namespace")],
                       Annotated[HostedTool, Tag("type=hosted")]], Discriminator(_tool_kind)]


def qualified(namespace: Optional[str], name: str) -> str:
    return f"{namespace}.{name}" if namespace else name


class FunctionChoice(Body):
    type: Literal["function"]
    name: str


class ResponseTextFormat(Body):
    """text.format: plain text, any JSON object, or JSON that follows `schema`."""
    model_config = ConfigDict(json_schema_extra=when("type", {"const": "json_schema"}, needs({"schema": GIVEN})))
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = Field(None, max_length=64)
    schema_: Optional[Union[Dict[str, Any], bool]] = Field(None, alias="schema")
    strict: Optional[bool] = None
    description: Optional[str] = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.schema_ is None:
            raise ValidationError("schema is required with type json_schema", param="text")
        return self


class ResponseText(Body):
    format: Optional[ResponseTextFormat] = None
    verbosity: Optional[Literal["low", "medium", "high"]] = Field(None, description="accepted (Codex sends it)")


class ReasoningConfig(Body):
    effort: Optional[Literal["minimal", "low", "medium", "high"]] = Field(
        None, description="the chat template's `reasoning_effort` variable (gpt-oss's template reads it; minimal is "
                          "given as low, its least)")
    summary: Optional[Literal["auto", "concise", "detailed"]] = Field(None, description="accepted: the reasoning "
                                                                                        "comes whole, not summarized")


class ResponsesRequest(Body):
    """POST /v1/responses."""
    model_config = ConfigDict(json_schema_extra=when(      # a forced call needs tools, and follows no text.format
        "tool_choice", {"not": {"enum": ["auto", "none"]}}, rules(TOOLS_GIVEN, {
            "not": needs({"text": needs({"format": needs({"type": {"enum": ["json_object", "json_schema"]}})})})})))
    model: str = Field(min_length=1, description="the served model's id, or a LoRA adapter's (GET /v1/models)",
                       json_schema_extra=SERVED_MODEL)
    input: Union[str, List[InputItem]] = Field(description="a user message's text, or items: messages, "
                                                           "function_call, function_call_output, reasoning",
                                               json_schema_extra={"minLength": 1, "minItems": 1,
                                                                  "maxItems": MAX_INPUT_ITEMS})
    instructions: Optional[str] = Field(None, description="a system message before the input (a continued "
                                                          "response's own are not carried over)")
    tools: Optional[List[Tool]] = Field(None, max_length=MAX_TOOLS, description="function tools, namespaces of "
                                        "them (served as namespace.name); hosted tools (web_search, ...) are left out")
    tool_choice: Union[Literal["auto", "none", "required"], FunctionChoice] = "auto"
    parallel_tool_calls: bool = True
    text: Optional[ResponseText] = None
    max_output_tokens: Optional[int] = Field(None, ge=1, le=1 << 20, json_schema_extra=NEW_TOKENS)
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    reasoning: Optional[ReasoningConfig] = None
    stream: bool = False
    store: bool = Field(True, description="kept in memory for GET, DELETE and previous_response_id (the newest "
                                          "1,000, for a day)")
    previous_response_id: Optional[str] = Field(None, min_length=1, description="continue a stored response: its "
                                                                                "input and output come first")
    metadata: Optional[Dict[str, str]] = Field(None, max_length=MAX_METADATA, json_schema_extra={
        "propertyNames": {"maxLength": 64}, "additionalProperties": {"maxLength": 512}})
    user: Optional[str] = None
    truncation: Optional[Literal["disabled"]] = Field(None, description="only disabled: a prompt too long is refused")
    include: Optional[List[str]] = Field(None, description="accepted (Codex sends it): every item comes whole")
    prompt_cache_key: Optional[str] = Field(None, description="accepted: the prefix cache needs no key")
    service_tier: Optional[str] = Field(None, description="accepted: one tier")
    client_metadata: Optional[Dict[str, Any]] = Field(None, description="accepted (Codex sends it): the client's "
                                                                        "own labels, not used")

    _grammar: Optional[GrammarSpec] = PrivateAttr(None)

    @field_validator("tools", mode="before")
    @classmethod
    def _tool_objects(cls, value):
        if isinstance(value, list):
            for k, tool in enumerate(value):
                if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
                    raise ValidationError(f"tools[{k}] must be an object with a string 'type'", param="tools")
        return value

    @field_validator("input", mode="before")
    @classmethod
    def _item_types(cls, value):
        if isinstance(value, list):
            if not value or len(value) > MAX_INPUT_ITEMS:
                raise ValidationError(f"input must be a string or a list of 1 to {MAX_INPUT_ITEMS} items",
                                      param="input")
            for k, item in enumerate(value):
                kind = item.get("type", "message") if isinstance(item, dict) else None
                if kind not in ITEM_TYPES:
                    raise ValidationError(f"input[{k}]: item type {kind!r} is not served; one of "
                                          f"{', '.join(ITEM_TYPES)}", param="input")
        elif isinstance(value, str) and not value:
            raise ValidationError("input must be a non-empty string or a list of items", param="input")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice_type(cls, value):
        if isinstance(value, dict) and value.get("type") != "function":
            raise ValidationError(f"tool_choice type {value.get('type')!r} is not served; auto, none, required or "
                                  "{\"type\": \"function\", \"name\": ...}", param="tool_choice")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value):
        if value is not None and any(len(k) > 64 or len(v) > 512 for k, v in value.items()):
            raise ValidationError("metadata: keys of at most 64 characters, values of at most 512",
                                  param="metadata")
        return value

    @model_validator(mode="after")
    def _rules(self):
        names = [f["function"]["name"] for f in self.functions()]
        twice = next((n for k, n in enumerate(names) if n in names[:k]), None)
        if twice is not None:
            raise ValidationError(f"tools: the function name {twice!r} is given twice", param="tools")
        if self.choice not in ("auto", "none"):
            if not names:
                raise ValidationError(f"tool_choice {self.choice!r} needs tools", param="tool_choice")
            if self.choice != "required" and self.choice not in names:
                raise ValidationError(f"tool_choice names {self.choice!r}, which is not one of the tools",
                                      param="tool_choice")
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            self._grammar = GrammarSpec.json_schema(fmt.schema_, "text.format.schema")
        elif fmt is not None and fmt.type == "json_object":
            self._grammar = GrammarSpec("json_object", None, "text.format")
        if self._grammar is not None and names and self.choice not in ("auto", "none"):
            raise ValidationError(f"tool_choice {self.choice!r} forces a function call; it cannot also follow "
                                  "text.format", param="tool_choice")
        return self

    def functions(self) -> list:
        """The functions the model may call, in OpenAI chat's shape: the function tools and the namespaces'
        (by their qualified names); hosted tools left out."""
        out = []
        for tool in self.tools or ():
            if isinstance(tool, FunctionTool):
                out.append(tool.as_chat_tool())
            elif isinstance(tool, NamespaceTool):
                out += [f.as_chat_tool(tool.name) for f in tool.tools]
        return out

    def left_out(self) -> list:
        """What of the request is not served and left out (the log names it once): hosted tools by type."""
        return [f"tools of type {t.type!r} (this server runs no hosted tools)" for t in self.tools or ()
                if isinstance(t, HostedTool)]

    def call_name(self, name: str) -> dict:
        """A call's name as a function_call item gives it: a namespace's function as its name and namespace."""
        for tool in self.tools or ():
            if isinstance(tool, NamespaceTool) and name.startswith(tool.name + "."):
                inner = name[len(tool.name) + 1:]
                if any(f.name == inner for f in tool.tools):
                    return {"name": inner, "namespace": tool.name}
        return {"name": name}

    @property
    def choice(self) -> str:
        """auto, required, none, or the named function's name."""
        c = self.tool_choice
        return c.name if isinstance(c, FunctionChoice) else c

    def input_messages(self) -> list:
        """The input as chat messages, the instructions left out (a continuation does not carry them over)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return as_messages(self.input)

    def to_request(self, max_model_len: int, history: tuple = ()) -> ApiRequest:
        """The chat request: the instructions, then `history` (a stored response's messages), then the input. A
        function_call_output must answer a call made before it."""
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions is not None else [])
        messages += [*history, *self.input_messages()]
        if not any(m["role"] in ("user", "assistant", "tool") for m in messages):
            raise ValidationError("input has no message to answer (only reasoning or instructions)", param="input")
        check_call_ids(messages)
        greedy = self.temperature == 0.0
        sampling = SamplingParams(max_new_tokens=self.max_output_tokens or max_model_len,
                                  temperature=self.temperature, top_p=1.0 if greedy else self.top_p,
                                  grammar=self._grammar)
        effort = self.reasoning.effort if self.reasoning is not None else None
        variables = {"reasoning_effort": "low" if effort == "minimal" else effort} if effort else None
        return ApiRequest(sampling, messages=messages, variables=variables,
                          tools=self.functions() or None,
                          tool_choice=self.choice, parallel_tool_calls=self.parallel_tool_calls, model=self.model,
                          max_tokens_field="max_output_tokens",
                          max_tokens_given=self.max_output_tokens is not None, stream=self.stream)


def as_messages(items) -> list:
    """Input items as chat messages: a function call joins the assistant message before it (one turn: its text
    and its calls), its output is a tool message; reasoning is left out. New dicts: history's are shared."""
    out: list = []
    for item in items:
        if isinstance(item, MessageItem):
            out.append(item.as_dict())
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": qualified(item.namespace, item.name), "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant":
                last = out[-1]
                out[-1] = {**last, "tool_calls": [*last.get("tool_calls", ()), call]}
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    return out


def check_call_ids(messages: list) -> None:
    """Every tool message answers a call an assistant message made before it (OpenAI refuses one that does not)."""
    called: set = set()
    for m in messages:
        called.update(c["id"] for c in m.get("tool_calls") or ())
        if m["role"] == "tool" and m["tool_call_id"] not in called:
            raise ValidationError(f"no function_call with call_id {m['tool_call_id']!r} comes before its "
                                  "function_call_output", param="input")


ROUTES = [("/v1/responses", ResponsesRequest, "OpenAI Responses: messages and function calls in, typed items out; "
                                              "stored for previous_response_id")]
OPERATIONS = [("get", "/v1/responses/{response_id}", "a stored response"),
              ("delete", "/v1/responses/{response_id}", "forget a stored response")]
