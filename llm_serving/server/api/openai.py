"""OpenAI's request bodies (completions and chat, with vLLM's extra fields; vLLM's tokenize, detokenize and LoRA
routes): every rule about their shape, and `to_request()`, their translation into the internal request
(server/translate.py). What needs the served model (token ids below its vocabulary, the prompt's length, the chat
template, the model's name) is translate.prepare's."""
from __future__ import annotations

import re
from typing import Annotated, Any, Dict, List, Literal, Optional, Union

from pydantic import ConfigDict, Discriminator, Field, PrivateAttr, Tag, field_validator, model_validator

from llm_serving.master.grammar import GrammarSpec
from llm_serving.master.request import SamplingParams
from llm_serving.server.api.base import (GIVEN, INT64, MAX_STOP_CHARS, NEW_TOKENS, NOT_BLANK, SERVED_MODEL, STOP,
                                         TOKEN_ID, TOOLS_GIVEN, Body, Open, at_most_one, needs, rules, stop_strings,
                                         stop_token_ids, when)
from llm_serving.server.errors import ValidationError
from llm_serving.server.translate import ApiRequest
from llm_serving.shm.layout import TOP_LOGPROBS
from llm_serving.tokenization import ChatTemplateError, check_variables
from llm_serving.tokenization.chat_template import reserved_variables
from llm_serving.vision import ImageError, decode_data_url

MAX_N = 16
MAX_TOOLS = 128
MAX_LOGIT_BIAS_ENTRIES = 300        # OpenAI's limit
MAX_BAD_WORDS = 100
MAX_ALLOWED_TOKEN_IDS = 1 << 17
TOOL_NAME = r"^[A-Za-z0-9_.-]{1,64}$"
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# each field that says what the output must match, as the schema of its being given (a text response_format is not)
OUTPUT_GIVEN = {"response_format": {"type": "object", "properties": {"type": {"not": {"const": "text"}}}},
                "structured_outputs": GIVEN, **{k: GIVEN for k in GUIDED}}
# the rules between the fields the validators check, for the OpenAPI document
SAMPLING_RULES = [when("stream_options", GIVEN, needs({"stream": {"const": True}})), *at_most_one(OUTPUT_GIVEN)]
TOOL_CHOICE_RULE = when("tool_choice", {"not": {"enum": [None, "none"]}}, TOOLS_GIVEN)


class StreamOptions(Body):
    include_usage: bool = Field(False, description="a last chunk with the usage of the whole request")


class JsonSchemaFormat(Open):
    name: str = "response"
    schema_: Union[Dict[str, Any], bool] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: Optional[bool] = None
    description: Optional[str] = None


class ResponseFormat(Body):
    model_config = ConfigDict(json_schema_extra=when("type", {"const": "json_schema"}, needs({"json_schema": GIVEN})))
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValidationError("response_format.json_schema must be an object {name, schema, strict}",
                                  param="response_format")
        return self


class StructuredOutputs(Body):
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar (Lark or GBNF), json_object."""
    json_: Optional[Union[Dict[str, Any], bool, str]] = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[List[str]] = None
    grammar: Optional[str] = Field(None, description="Lark or GBNF")
    json_object: Optional[bool] = None
    disable_any_whitespace: Optional[bool] = Field(None, description="accepted: JSON never has free whitespace here")
    backend: Optional[Literal["auto", "guidance", "llguidance"]] = Field(None, description="llguidance, the one here")

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [k for k in STRUCTURED_KINDS if getattr(self, "json_" if k == "json" else k) not in (None, False)]
        if len(given) != 1:
            raise ValidationError(f"structured_outputs must have exactly one of {', '.join(STRUCTURED_KINDS)}",
                                  param="structured_outputs")
        return self

    def spec(self) -> GrammarSpec:
        kind = next(k for k in STRUCTURED_KINDS if getattr(self, "json_" if k == "json" else k) not in (None, False))
        return _grammar(kind, getattr(self, "json_" if kind == "json" else kind), f"structured_outputs.{kind}")


def _grammar(kind: str, value, field: str) -> GrammarSpec:
    """A GrammarSpec of one structured-output kind (GrammarError for a JSON schema that is not one)."""
    if kind == "json":
        return GrammarSpec.json_schema(value, field)
    if kind == "json_object":
        return GrammarSpec("json_object", None, field)
    if kind == "choice":              # (named as a grammar that does not compile is: the field's whole path)
        if not value or not all(value):
            raise ValidationError(f"{field} must be a non-empty list of non-empty strings", param=field)
        return GrammarSpec("choice", tuple(dict.fromkeys(value)), field)
    if not value.strip():
        raise ValidationError(f"{field} must be a non-empty string", param=field)
    return GrammarSpec(kind, value, field)


class _Sampling(Body):
    """What completions and chat share: sampling, stops, logit controls, structured outputs."""
    model_config = ConfigDict(json_schema_extra=rules(*SAMPLING_RULES))
    model: str = Field(description="the served model's id, or a LoRA adapter's (GET /v1/models)", min_length=1,
                       json_schema_extra=SERVED_MODEL)
    stream: bool = Field(False, description="server-sent events, a chunk per token")
    stream_options: Optional[StreamOptions] = Field(None, description="only with stream: true")
    n: int = Field(1, ge=1, le=MAX_N, description="choices, each its own request (with a seed: choice i uses seed + i)")
    stop: Optional[Union[str, List[str]]] = Field(None, description="stop strings (not in the text): at most 16, "
                                                  "each of 1 to 256 characters", json_schema_extra=STOP)
    stop_token_ids: Optional[List[int]] = Field(None, max_length=16, description="more tokens that end the reply "
                                                "(vLLM)", json_schema_extra={"items": TOKEN_ID})
    seed: Optional[int] = Field(None, **INT64)
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=1 << 20, description="0 or -1 = off (vLLM)")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="tokens below min_p x the likeliest's probability are out (vLLM)")
    ignore_eos: bool = Field(False, description="EOS does not end the reply (vLLM)")
    skip_special_tokens: bool = Field(True, description="the reply's text leaves special tokens out; false keeps "
                                                        "them (vLLM; a gpt-oss chat keeps them to read its format)")
    user: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=0, le=1 << 20, json_schema_extra=NEW_TOKENS,
                                      description="0 only with echo or prompt_logprobs: the prompt is scored")
    min_tokens: int = Field(0, ge=0, le=1 << 20, description="stop tokens are banned until this many (vLLM)")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description="HF/vLLM, 1 = off")
    logit_bias: Optional[Dict[str, Union[int, float]]] = Field(
        None, max_length=MAX_LOGIT_BIAS_ENTRIES, description="{token id: bias in [-100, 100]}", json_schema_extra={
            "propertyNames": {"pattern": r"^\s*(-0{1,9}|[0-9]{1,9})\s*$"},
            "additionalProperties": {"minimum": -100, "maximum": 100}})
    bad_words: Optional[List[str]] = Field(None, max_length=MAX_BAD_WORDS,
                                           description="words the reply never contains (vLLM)",
                                           json_schema_extra={"items": {**NOT_BLANK, "maxLength": MAX_STOP_CHARS}})
    allowed_token_ids: Optional[List[int]] = Field(None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS,
                                                   description="the only tokens the reply may use (vLLM)",
                                                   json_schema_extra={"items": TOKEN_ID})
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputs] = None
    guided_json: Optional[Union[Dict[str, Any], bool, str]] = None
    guided_regex: Optional[str] = Field(None, json_schema_extra=NOT_BLANK)
    guided_choice: Optional[List[str]] = Field(None, json_schema_extra={"minItems": 1, "items": {"minLength": 1}})
    guided_grammar: Optional[str] = Field(None, json_schema_extra=NOT_BLANK)
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=TOP_LOGPROBS,
                                           description="each prompt token's log-probability, with this many top ones (vLLM)")
    speculative: bool = Field(True, description="false keeps the request out of speculative decoding")
    best_of: Optional[Literal[1]] = Field(None, description="only 1")

    _grammar: Optional[GrammarSpec] = PrivateAttr(None)
    _logit_bias: tuple = PrivateAttr(())

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        stop_strings(value, "stop", "stop")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, value):
        stop_token_ids(value, "stop_token_ids", "stop_token_ids")
        return value

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, value):
        if value is not None and not all(w.strip() and len(w) <= MAX_STOP_CHARS for w in value):
            raise ValidationError(f"bad_words must be a list of at most {MAX_BAD_WORDS} non-blank strings of at most "
                                  f"{MAX_STOP_CHARS} characters", param="bad_words")
        return value

    @model_validator(mode="after")
    def _rules(self):
        """The rules between fields, and the structured output's and logit bias's own."""
        if self.stream_options is not None and not self.stream:
            raise ValidationError("stream_options is only allowed with stream: true", param="stream_options")
        entries = []
        for key, value in (self.logit_bias or {}).items():
            if not re.fullmatch(r"\s*-?[0-9]{1,9}\s*", key) or int(key) < 0:
                raise ValidationError(f"logit_bias: {key!r} is not a token id", param="logit_bias")
            if not -100 <= value <= 100:
                raise ValidationError(f"logit_bias[{key}] must be a number in [-100, 100], got {value!r}",
                                      param="logit_bias")
            entries.append((int(key), float(value)))
        self._logit_bias = tuple(entries)
        if self.allowed_token_ids is not None and any(t < 0 for t in self.allowed_token_ids):
            raise ValidationError("allowed_token_ids must be token ids (>= 0)", param="allowed_token_ids")
        given = [k for k in ("response_format", "structured_outputs", *GUIDED) if getattr(self, k) is not None]
        if self.response_format is not None and self.response_format.type == "text":
            given.remove("response_format")
        if len(given) > 1:
            raise ValidationError(f"give at most one of {', '.join(given)}: each says what the output must match",
                                  param=given[1])
        self._grammar = self._structured(given[0]) if given else None
        limit = self._max_tokens()
        if limit is not None and self.min_tokens > limit:
            raise ValidationError(f"min_tokens ({self.min_tokens}) is more than the most tokens asked for ({limit})",
                                  param="min_tokens")
        if limit == 0:
            key = self._max_tokens_field()
            if self.prompt_logprobs is None and not getattr(self, "echo", False):
                raise ValidationError(f"{key} must be at least 1 (0: only with echo or prompt_logprobs, to score "
                                      "the prompt)", param=key)
            if self._grammar is not None or self.stream:
                raise ValidationError(f"{key} 0 (scoring the prompt) goes with neither a grammar nor stream",
                                      param=key)
        return self

    def _structured(self, key: str) -> GrammarSpec:
        if key in GUIDED:
            return _grammar(GUIDED[key], getattr(self, key), key)
        if key == "structured_outputs":
            return self.structured_outputs.spec()
        rf = self.response_format
        if rf.type == "json_object":
            return GrammarSpec("json_object", None, key)
        return GrammarSpec.json_schema(rf.json_schema.schema_, "response_format.json_schema.schema")

    def _max_tokens(self) -> Optional[int]:
        return self.max_tokens

    def _max_tokens_field(self) -> str:
        return "max_tokens"

    def _request(self, default_max: int, **fields) -> ApiRequest:
        limit = self._max_tokens()
        greedy = self.temperature == 0.0
        sampling = SamplingParams(
            max_new_tokens=(limit if limit is not None else default_max) or 1, temperature=self.temperature,
            top_k=0 if greedy or self.top_k == -1 else self.top_k, top_p=1.0 if greedy else self.top_p,
            seed=None if self.seed is None else self.seed % (1 << 63), ignore_eos=self.ignore_eos,
            stop=stop_strings(self.stop, "stop", "stop"),
            stop_token_ids=stop_token_ids(self.stop_token_ids, "stop_token_ids", "stop_token_ids"),
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, speculative=self.speculative,
            skip_special_tokens=self.skip_special_tokens, min_p=self.min_p, min_tokens=self.min_tokens,
            logit_bias=self._logit_bias, allowed_token_ids=tuple(dict.fromkeys(self.allowed_token_ids or ())),
            grammar=self._grammar, prompt_logprobs=self.prompt_logprobs)
        return ApiRequest(sampling, model=self.model, bad_words=tuple(self.bad_words or ()),
                          max_tokens_field=self._max_tokens_field(), max_tokens_given=limit is not None, n=self.n,
                          stream=self.stream, **fields)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def score_only(self) -> bool:
        """max_tokens 0: the prompt is only scored (the token the step samples is dropped)."""
        return self._max_tokens() == 0


class CompletionRequest(_Sampling):
    """POST /v1/completions."""
    prompt: Union[str, List[str], List[int]] = Field(
        description="a non-empty string, a list of one string, or token ids (one prompt per request)",
        json_schema_extra={"anyOf": [{"type": "string", "minLength": 1},
                                     {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1,
                                      "maxItems": 1},
                                     {"type": "array", "items": TOKEN_ID, "minItems": 1}]})
    echo: bool = Field(False, description="the reply starts with the prompt (its tokens' logprobs too)")
    logprobs: Optional[int] = Field(None, ge=0, le=5, description="top log-probabilities per token, besides the chosen")
    suffix: None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
            value = value[0]
        if isinstance(value, str) and value:
            return value
        if isinstance(value, list) and value and all(isinstance(t, int) and t >= 0 for t in value):
            return value
        raise ValidationError("'prompt' must be a non-empty string, a list of one string, or a list of token ids "
                              "(one prompt per request)", param="prompt")

    def to_request(self) -> ApiRequest:
        req = self._request(16, prompt=self.prompt)
        req.sampling.top_logprobs = self.logprobs or 0
        if self.echo and self.logprobs is not None:   # the echoed prompt's tokens carry their log-probabilities too
            req.sampling.prompt_logprobs = max(self.logprobs, self.prompt_logprobs or 0)
        return req


class ToolFunction(Open):
    name: str = Field(pattern=TOOL_NAME, description="1-64 letters, digits, _ . or -")
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = Field(None, description="a JSON schema of the arguments")
    strict: Optional[bool] = None


class Tool(Body):
    type: Literal["function"]
    function: ToolFunction


class NamedFunction(Body):
    name: str


class NamedTool(Body):
    type: Literal["function"]
    function: NamedFunction


class TextPart(Open):
    type: Literal["text"]
    text: str


class ImageUrl(Open):
    url: str = Field(description="the image as a base64 data: URL (data:image/png;base64,...), or an http(s) URL "
                                 "of a host the server fetches from (serving_config.image_url_hosts)")
    detail: Optional[Literal["auto", "low", "high"]] = Field(None, description="accepted; every image is read at "
                                                                               "the model's one resolution")


class ImagePart(Open):
    """An image in a user message (a vision-language model's): its bytes as a base64 data: URL."""
    type: Literal["image_url"]
    image_url: Union[ImageUrl, str]
    _part: dict = PrivateAttr(None)

    @model_validator(mode="after")
    def _decoded(self):
        url = self.image_url if isinstance(self.image_url, str) else self.image_url.url
        self._part = image_part(url, "image_url")
        return self

    def part(self) -> dict:
        """The image as a chat message's part: its file's bytes, or the URL the server fetches (image_urls.py)."""
        return self._part


def image_part(url: str, where: str, param: Optional[str] = None) -> dict:
    """An image URL as a chat message's part: a data: URL's bytes, an http(s) URL as it is (fetched before the
    request is prepared, from the allowed hosts only); a ValidationError for another one, naming `param` (default:
    the chat's messages for an image_url, the Responses API's input otherwise)."""
    if isinstance(url, str) and url.startswith(("http://", "https://")):
        return {"type": "image", "url": url}
    try:
        return {"type": "image", "image": decode_data_url(url)}
    except ImageError as e:
        raise ValidationError(f"{where}: {e}", param=param or ("messages" if where == "image_url" else "input")) \
            from None


class _OtherPart(Open):
    """A part of a type no other part model takes: refused by its type."""
    type: Literal["text", "image_url"]


_PART_TAGS = {"text": "text part", "image_url": "image part"}


def _part_kind(part) -> str:
    kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
    return _PART_TAGS.get(kind, "other part") if isinstance(kind, str) else "other part"


# (tags with a space: they name no field, so an error's path leaves them out: api/base.py)
Part = Annotated[Union[Annotated[TextPart, Tag("text part")], Annotated[ImagePart, Tag("image part")],
                       Annotated[_OtherPart, Tag("other part")]], Discriminator(_part_kind)]


class CalledFunction(Open):
    name: str
    arguments: Union[str, Dict[str, Any]] = "{}"


class ToolCall(Open):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(Open):
    """A message: role system, developer, user, assistant (content, or tool_calls) or tool (its tool_call_id)."""
    model_config = ConfigDict(json_schema_extra=rules(
        {"anyOf": [needs({"content": GIVEN}), needs({"role": {"const": "assistant"}, "tool_calls": GIVEN})]},
        when("role", {"const": "tool"}, needs({"tool_call_id": GIVEN}))))
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, List[Part]]] = Field(None, description="a string, or text parts and (in a user "
                                                                        "message) image parts")
    tool_calls: Optional[List[ToolCall]] = Field(None, min_length=1)
    tool_call_id: Optional[str] = None
    name: Optional[str] = None

    @model_validator(mode="after")
    def _role_rules(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValidationError("content must be a string or text parts (null only for an assistant's tool calls)",
                                  param="messages")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValidationError("a tool message needs the tool_call_id it answers", param="messages")
        if self.role != "user" and self.images():
            raise ValidationError(f"image parts go in user messages, not in a {self.role} message", param="messages")
        return self

    def images(self) -> list:
        """The message's image parts, in order."""
        return [p for p in self.content if isinstance(p, ImagePart)] if isinstance(self.content, list) else []

    def as_dict(self) -> dict:
        """The message as the chat template takes it: its text (with images: its parts, an image as {"type":
        "image", "image": its file} or {"type": "image", "url"}), developer as system, tool calls and ids."""
        if self.images():
            return {"role": self.role, "content": [p.part() if isinstance(p, ImagePart)
                                                   else {"type": "text", "text": p.text} for p in self.content]}
        content = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        role = "system" if self.role == "developer" else self.role
        if role == "assistant" and self.tool_calls:
            return {"role": role, "content": content or "", "tool_calls": [
                {"id": c.id or f"call_{k}", "type": "function",
                 "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for k, c in enumerate(self.tool_calls)]}
        message = {"role": role, "content": content}
        if role == "tool":
            message["tool_call_id"] = self.tool_call_id
        return message


_TEMPLATE_KWARGS = ("extra variables for the chat template's render (vLLM, SGLang), e.g. {\"enable_thinking\": false} "
                    "for Qwen3; not the render's own: messages, tools, add_generation_prompt, bos_token, eos_token, "
                    "raise_exception, ...")


class _Tools(Body):
    """What chat and tokenize share: the tools, which to call, and the template's variables."""
    tools: Optional[List[Tool]] = Field(None, max_length=MAX_TOOLS)
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedTool]] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = Field(None, description=_TEMPLATE_KWARGS, json_schema_extra={
        "propertyNames": {"not": {"enum": sorted(reserved_variables())}}})

    @field_validator("chat_template_kwargs")
    @classmethod
    def _variables(cls, value):
        try:
            check_variables(value)
        except ChatTemplateError as exc:
            raise ValidationError(str(exc), param="chat_template_kwargs") from None
        return value

    def _check_tools(self, parallel: Optional[bool]) -> None:
        if not self.tools:
            if self.tool_choice not in (None, "none"):
                raise ValidationError("tool_choice needs tools", param="tool_choice")
            if parallel is not None:
                raise ValidationError("parallel_tool_calls needs tools", param="parallel_tool_calls")
            return
        names = [t.function.name for t in self.tools]
        twice = next((n for k, n in enumerate(names) if n in names[:k]), None)
        if twice is not None:
            raise ValidationError(f"tools: the function name {twice!r} is given twice", param="tools")
        if isinstance(self.tool_choice, NamedTool) and self.tool_choice.function.name not in names:
            raise ValidationError(f"tool_choice names {self.tool_choice.function.name!r}, which is not one of the "
                                  "tools", param="tool_choice")

    @property
    def choice(self) -> str:
        """auto, required, none, or the named tool's name."""
        c = self.tool_choice
        return c.function.name if isinstance(c, NamedTool) else (c or "auto")

    def tool_dicts(self) -> Optional[list]:
        return None if not self.tools else [t.model_dump(exclude_none=True) for t in self.tools]


class ChatCompletionRequest(_Tools, _Sampling):
    """POST /v1/chat/completions."""
    # (without the tool rules, tool_choice and parallel_tool_calls need tools: with them too, the rules outgrow what
    # schemathesis's JSON schema generator combines, and the route could not be fuzzed)
    model_config = ConfigDict(json_schema_extra=rules(
        *SAMPLING_RULES, when("top_logprobs", {"minimum": 1}, needs({"logprobs": {"const": True}}))))
    messages: List[ChatMessage] = Field(min_length=1)
    logprobs: Optional[bool] = None
    top_logprobs: int = Field(0, ge=0, le=TOP_LOGPROBS, description="only with logprobs: true")
    max_completion_tokens: Optional[int] = Field(None, ge=0, le=1 << 20, json_schema_extra=NEW_TOKENS)
    parallel_tool_calls: Optional[bool] = Field(None, description="only with tools")
    reasoning_effort: Optional[Literal["low", "medium", "high"]] = Field(
        None, description="OpenAI's: how much a reasoning model thinks, given to the chat template as its "
                          "`reasoning_effort` variable (gpt-oss's template reads it); chat_template_kwargs' own wins")
    functions: None = None
    function_call: None = None

    @model_validator(mode="after")
    def _chat_rules(self):
        if self.top_logprobs and not self.logprobs:
            raise ValidationError("top_logprobs needs logprobs: true", param="top_logprobs")
        self._check_tools(self.parallel_tool_calls)
        if self.tools and self.choice not in ("auto", "none"):      # a call is forced by its grammar
            if self._grammar is not None:
                raise ValidationError(f"tool_choice {self.choice!r} forces a tool call; it cannot also follow "
                                      f"{self._grammar.field}", param="tool_choice")
            if self.score_only:
                key = self._max_tokens_field()
                raise ValidationError(f"{key} 0 (scoring the prompt) cannot force a tool call", param=key)
        return self

    def _max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def to_request(self, max_model_len: int) -> ApiRequest:
        variables = self.chat_template_kwargs
        if self.reasoning_effort is not None:      # (the template's variable; chat_template_kwargs may set it too)
            variables = {"reasoning_effort": self.reasoning_effort, **(variables or {})}
        req = self._request(max_model_len, messages=[m.as_dict() for m in self.messages], variables=variables,
                            tools=self.tool_dicts(), tool_choice=self.choice,
                            parallel_tool_calls=self.parallel_tool_calls is not False)
        req.sampling.top_logprobs = self.top_logprobs
        return req


_CHAT_ONLY = ("add_generation_prompt", "chat_template_kwargs", "tools", "tool_choice")     # not with a prompt


class TokenizeRequest(_Tools):
    """vLLM's POST /tokenize: a prompt or a chat."""
    model_config = ConfigDict(json_schema_extra=rules(
        TOOL_CHOICE_RULE, {"oneOf": [needs({"prompt": GIVEN}), needs({"messages": GIVEN})]},
        when("prompt", GIVEN, {"not": {"anyOf": [needs({k: GIVEN}) for k in _CHAT_ONLY]}}),
        when("messages", GIVEN, {"not": needs({"add_special_tokens": {"const": True}})})))
    model: Optional[str] = Field(None, json_schema_extra=SERVED_MODEL)
    prompt: Optional[str] = None
    messages: Optional[List[ChatMessage]] = Field(None, min_length=1)
    add_special_tokens: Optional[bool] = Field(None, description="with prompt: add the BOS (default true)")
    add_generation_prompt: Optional[bool] = Field(None, description="with messages; false only after a last "
                                                                    "assistant message")
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_chat(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValidationError("give exactly one of 'prompt' (a string) or 'messages' (a chat)", param="prompt")
        if self.prompt is not None:
            for field in _CHAT_ONLY:
                if getattr(self, field) is not None:
                    raise ValidationError(f"{field} goes with 'messages'", param=field)
            return self
        if self.add_special_tokens:
            raise ValidationError("add_special_tokens goes with 'prompt': a chat's special tokens are its "
                                  "template's", param="add_special_tokens")
        if self.add_generation_prompt is False and self.messages[-1].role != "assistant":
            raise ValidationError("add_generation_prompt false is not supported: the chat template opens the "
                                  "assistant's turn after a last user or system message (and continues a last "
                                  "assistant message)", param="add_generation_prompt")
        self._check_tools(None)
        return self


class DetokenizeRequest(Body):
    model: Optional[str] = Field(None, json_schema_extra=SERVED_MODEL)
    tokens: List[int] = Field(description="token ids, each below the vocabulary's size",
                              json_schema_extra={"items": TOKEN_ID})


class LoadLoraRequest(Body):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: Optional[bool] = None


class UnloadLoraRequest(Body):
    lora_name: str = Field(min_length=1)
    lora_int_id: Optional[int] = None


ROUTES = [("/v1/completions", CompletionRequest, "OpenAI completions (vLLM's extra fields)"),
          ("/v1/chat/completions", ChatCompletionRequest, "OpenAI chat completions: tools, structured outputs"),
          ("/tokenize", TokenizeRequest, "vLLM: a prompt's or a chat's token ids"),
          ("/detokenize", DetokenizeRequest, "vLLM: token ids' text"),
          ("/v1/load_lora_adapter", LoadLoraRequest, "vLLM: serve a LoRA adapter"),
          ("/v1/unload_lora_adapter", UnloadLoraRequest, "vLLM: stop serving a LoRA adapter")]
