"""Ollama's request bodies (POST /api/chat, /api/generate, /api/show, /api/embed, /api/embeddings): every rule
about their shape, and `to_request()`, their translation into the internal request (server/translate.py). Ollama's
own defaults hold: stream true, temperature 0.8, top_k 40, top_p 0.9, a reply as long as the context allows. What
needs the served model (its name, its template's thinking, its embeddings) is the routes' (server/routes_ollama.py)
and translate.prepare's."""
from __future__ import annotations

import json
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import ConfigDict, Field, PrivateAttr, create_model, field_validator, model_validator

from llm_serving.master.grammar import GrammarSpec
from llm_serving.master.request import SamplingParams
from llm_serving.server.api.base import (DIMENSIONS, GIVEN, INT64, OLLAMA_BASE_MODEL, OLLAMA_MODEL, STOP, Body,
                                         Open, needs, rules, stop_strings, when)
from llm_serving.server.api.embeddings import MAX_INPUTS
from llm_serving.server.api.openai import MAX_TOOLS, Tool
from llm_serving.server.errors import ValidationError
from llm_serving.server.translate import ApiRequest
from llm_serving.shm.layout import TOP_LOGPROBS
from llm_serving.vision import ImageError, decode_data_url

DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P = 0.8, 40, 0.9      # Ollama's, when a request sets none
UNLIMITED = 1 << 20          # num_predict -1, -2 (or none): cut by translate.fit_length to what the context leaves

# Options Ollama's clients send that this server accepts and does not use, and why: the single list (each becomes a
# field of Options, any JSON scalar)
IGNORED_OPTIONS = {
    "num_ctx": "the context is the server's (model_config.max_generate_length); a longer prompt is a 400",
    "num_batch": "the server's scheduler sizes its steps (serving_config)",
    "num_gpu": "devices are the server's (model_config.device_target, its agents)",
    "main_gpu": "devices are the server's (model_config.device_target, its agents)",
    "low_vram": "memory is planned at start (pa_config)",
    "num_thread": "threads are the server's (model_config.num_threads)",
    "numa": "a llama.cpp load setting; the model is loaded once, at start",
    "use_mmap": "a llama.cpp load setting; the model is loaded once, at start",
    "use_mlock": "a llama.cpp load setting; the model is loaded once, at start",
    "vocab_only": "a llama.cpp load setting; the model is loaded once, at start",
    "f16_kv": "the KV cache's type is the server's (pa_config.kv_cache_dtype)",
    "logits_all": "a llama.cpp load setting; the model is loaded once, at start",
    "embedding_only": "a llama.cpp load setting; the model is loaded once, at start",
    "num_keep": "the context never shifts: a prompt that does not fit is refused, never cut",
    "repeat_last_n": "repeat_penalty counts every token of the prompt and the reply, not a window",
    "penalize_newline": "gone from Ollama; a newline is penalized as any token",
    "mirostat_tau": "mirostat is not served (only mirostat 0), so its target has nothing to tune",
    "mirostat_eta": "mirostat is not served (only mirostat 0), so its rate has nothing to tune",
}
# Samplers not served here: accepted at the value that turns them off
NEUTRAL_OPTIONS = {"typical_p": 1.0, "tfs_z": 1.0, "mirostat": 0}


class _ServedOptions(Body):
    temperature: Optional[float] = Field(None, ge=0.0, le=100.0, description="0 = greedy; default 0.8")
    top_k: Optional[int] = Field(None, ge=-1, le=1 << 20, description="0 or -1 = off; default 40")
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0, description="default 0.9")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    num_predict: Optional[int] = Field(None, ge=-2, le=UNLIMITED, description="the most tokens of the reply, cut to "
                                       "what the context leaves; -1, -2 or 0: as long as the context allows")
    seed: Optional[int] = Field(None, **INT64, description="negative: a random one")
    stop: Optional[Union[str, List[str]]] = Field(None, description="at most 16 stop strings of 1 to 256 characters",
                                                  json_schema_extra=STOP)
    repeat_penalty: float = Field(1.0, gt=0.0, le=10.0, description="HF's repetition_penalty over the prompt and "
                                                                    "the reply; 1 = off")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    typical_p: Optional[float] = Field(None, description="only 1 (off)", json_schema_extra={"enum": [1, None]})
    tfs_z: Optional[float] = Field(None, description="only 1 (off)", json_schema_extra={"enum": [1, None]})
    mirostat: Optional[int] = Field(None, description="only 0 (off)", json_schema_extra={"enum": [0, None]})

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        stop_strings(value, "options.stop", "options")
        return value

    @model_validator(mode="after")
    def _neutral(self):
        for name, off in NEUTRAL_OPTIONS.items():
            value = getattr(self, name)
            if value is not None and value != off:
                raise ValidationError(f"options.{name} {value!r} is not served here (only {off}: off)",
                                      param="options")
        return self


# every option Ollama's clients may send: those served, and the ignored ones (any scalar, described by why)
Options = create_model("Options", __base__=_ServedOptions, **{
    name: (Optional[Union[bool, int, float, str]], Field(None, description=f"accepted, ignored: {why}"))
    for name, why in IGNORED_OPTIONS.items()})


_LOGPROBS_RULE = when("top_logprobs", {"minimum": 1}, needs({"logprobs": {"const": True}}))


class _Generation(Body):
    """What chat and generate share: the model, the output's format, options, streaming, thinking, logprobs."""
    model_config = ConfigDict(json_schema_extra=rules(_LOGPROBS_RULE))
    model: str = Field(min_length=1, description="the served model's name (or a LoRA adapter's), :latest or not",
                       json_schema_extra=OLLAMA_MODEL)
    format: Any = Field(None, description='"json" (any JSON object) or a JSON schema the reply follows',
                        json_schema_extra={"anyOf": [{"enum": [None, "", "json"]}, {"type": "object"}]})
    options: Optional[Options] = Field(None, description="sampling and length (Ollama's names); null: defaults")
    stream: Optional[bool] = Field(None, description="default true: NDJSON, a line per piece of the reply")
    keep_alive: Optional[Union[str, int, float]] = Field(
        None, description="how long the model stays loaded after this request: seconds or 5m, 1h; -1 for good, 0 "
                          "unloaded once idle")
    think: Optional[Union[bool, Literal["low", "medium", "high"]]] = Field(
        None, description="true/false: the template's enable_thinking; low/medium/high: its reasoning_effort")
    logprobs: Optional[bool] = Field(None, description="each reply token's log-probability")
    top_logprobs: int = Field(0, ge=0, le=TOP_LOGPROBS, description="with logprobs: this many likeliest tokens too")

    _grammar: Optional[GrammarSpec] = PrivateAttr(None)

    @field_validator("format")
    @classmethod
    def _format(cls, value):
        if value in (None, "", "json") or isinstance(value, dict):
            return value
        raise ValidationError(f'format must be "json" or a JSON schema (an object), got {value!r}', param="format")

    @model_validator(mode="after")
    def _shared_rules(self):
        if self.top_logprobs and not self.logprobs:
            raise ValidationError("top_logprobs needs logprobs: true", param="top_logprobs")
        if self.format == "json":
            self._grammar = GrammarSpec("json_object", None, "format")
        elif isinstance(self.format, dict):
            self._grammar = GrammarSpec.json_schema(self.format, "format")
        return self

    @property
    def streams(self) -> bool:
        return self.stream is not False

    def variables(self) -> Optional[dict]:
        """The chat template's variables `think` sets."""
        if self.think is None:
            return None
        if isinstance(self.think, bool):
            return {"enable_thinking": self.think}
        return {"reasoning_effort": self.think}

    def sampling(self) -> SamplingParams:
        """The options as sampling: Ollama's defaults for those not set; greedy turns top_k and top_p off."""
        o = self.options or Options()
        temperature = DEFAULT_TEMPERATURE if o.temperature is None else o.temperature
        greedy = temperature == 0.0
        top_k = DEFAULT_TOP_K if o.top_k is None else max(o.top_k, 0)
        length = o.num_predict if o.num_predict is not None and o.num_predict > 0 else UNLIMITED
        return SamplingParams(
            max_new_tokens=length, temperature=temperature, top_k=0 if greedy else top_k,
            top_p=1.0 if greedy else (DEFAULT_TOP_P if o.top_p is None else o.top_p), min_p=o.min_p,
            seed=o.seed % (1 << 63) if o.seed is not None and o.seed >= 0 else None,
            stop=stop_strings(o.stop, "options.stop", "options"), repetition_penalty=o.repeat_penalty,
            presence_penalty=o.presence_penalty, frequency_penalty=o.frequency_penalty,
            top_logprobs=self.top_logprobs, grammar=self._grammar)

    def _request(self, model: str, **fields) -> ApiRequest:
        # num_predict is a ceiling as in Ollama: a reply stops where the context ends (done_reason "length")
        return ApiRequest(self.sampling(), model=model, max_tokens_field="num_predict", max_tokens_given=False,
                          stream=self.streams, **fields)


class CalledFunction(Open):
    name: str = Field(min_length=1)
    arguments: Dict[str, Any] = Field(default_factory=dict, description="an object, as Ollama's")
    index: Optional[int] = None


class ToolCall(Open):
    function: CalledFunction
    id: Optional[str] = None


class Message(Open):
    """A message: role system, user, assistant (content, thinking, tool_calls) or tool (its tool_name)."""
    model_config = ConfigDict(json_schema_extra=when("tool_calls", {"type": "array", "minItems": 1},
                                                     needs({"role": {"const": "assistant"}})))
    role: Literal["system", "user", "assistant", "tool"]
    content: Optional[str] = Field("", description="missing or null: empty")
    thinking: Optional[str] = Field(None, description="an assistant's reasoning, given to the template as "
                                                      "reasoning_content")
    images: Optional[List[str]] = Field(None, description="a user message's images, each its file as base64 (a "
                                                          "vision-language model's), put before its text")
    tool_calls: Optional[List[ToolCall]] = None
    tool_name: Optional[str] = Field(None, description="a tool message's tool")
    tool_call_id: Optional[str] = None

    _data: tuple = PrivateAttr(())

    @model_validator(mode="after")
    def _role_rules(self):
        if self.images and self.role != "user":
            raise ValidationError(f"images go in user messages, not in a {self.role} message", param="messages")
        self._data = image_files(self.images, "messages")
        if self.tool_calls and self.role != "assistant":
            raise ValidationError("only an assistant message has tool_calls", param="messages")
        return self


def image_files(images: Optional[list], field: str) -> tuple:
    """Ollama's images (each a file as base64, or a data: URL) as their files' bytes; a ValidationError naming the
    image that is not base64."""
    out = []
    for k, image in enumerate(images or ()):
        url = image if image.startswith("data:") else f"data:image/png;base64,{image}"
        try:
            out.append(decode_data_url(url))
        except ImageError as e:
            raise ValidationError(f"images[{k}]: {e}", param=field) from None
    return tuple(out)


def _conversation(messages: List[Message]) -> list:
    """The messages in the internal (OpenAI's) shape: calls get ids (Ollama's have none) and each tool message
    answers the latest assistant's first unanswered call of its tool_name (else its first unanswered one)."""
    out, open_calls = [], []
    for m in messages:
        message = {"role": m.role, "content": m.content or ""}
        if m.images:              # (as Ollama's templates place them: before the message's text)
            message["content"] = [*({"type": "image", "image": d} for d in m._data),
                                  {"type": "text", "text": m.content or ""}]
        if m.tool_calls:
            message["tool_calls"] = [
                {"id": c.id or f"call_{len(out)}_{k}", "type": "function",
                 "function": {"name": c.function.name,
                              "arguments": json.dumps(c.function.arguments, ensure_ascii=False)}}
                for k, c in enumerate(m.tool_calls)]
            open_calls = [(c["id"], c["function"]["name"]) for c in message["tool_calls"]]
        if m.role == "tool":
            answered = m.tool_call_id or next((i for i, n in open_calls if n == m.tool_name),
                                              open_calls[0][0] if open_calls else m.tool_name or "call")
            open_calls = [(i, n) for i, n in open_calls if i != answered]
            message["tool_call_id"] = answered
            if m.tool_name:
                message["name"] = m.tool_name
        if m.thinking and m.role == "assistant":
            message["reasoning_content"] = m.thinking
        out.append(message)
    return out


class ChatRequest(_Generation):
    """POST /api/chat; no messages: Ollama's "load the model" (answered done at once)."""
    messages: List[Message] = Field(default_factory=list)
    tools: Optional[List[Tool]] = Field(None, max_length=MAX_TOOLS, description="OpenAI's function shape; Ollama "
                                        "has no tool_choice: the model calls one or answers")

    @field_validator("messages", mode="before")
    @classmethod
    def _null_messages(cls, value):
        return [] if value is None else value

    @model_validator(mode="after")
    def _tool_names(self):
        names = [t.function.name for t in self.tools or ()]
        twice = next((n for k, n in enumerate(names) if n in names[:k]), None)
        if twice is not None:
            raise ValidationError(f"tools: the function name {twice!r} is given twice", param="tools")
        return self

    @property
    def loads_only(self) -> bool:
        return not self.messages

    def to_request(self, model: str) -> ApiRequest:
        """The internal request on `model`, the served name the route resolved."""
        tools = [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None
        return self._request(model, messages=_conversation(self.messages), variables=self.variables(), tools=tools)


class GenerateRequest(_Generation):
    """POST /api/generate; an empty prompt: Ollama's "load the model" (answered done at once)."""
    model_config = ConfigDict(json_schema_extra=rules(_LOGPROBS_RULE, when("raw", {"const": True}, {"not": {"anyOf": [
        needs({"system": {"type": "string", "minLength": 1}}), needs({"think": {"not": {"enum": [None, False]}}})]}})))
    prompt: Optional[str] = Field("", description="raw: the text as it is; else a user message through the chat "
                                                  "template")
    raw: Optional[bool] = Field(None, description="true: no template")
    system: Optional[str] = Field(None, description="the system message (not with raw)")
    suffix: Optional[str] = Field(None, description="only empty: fill-in-the-middle is not served",
                                  json_schema_extra={"maxLength": 0})
    template: Optional[str] = Field(None, description="only empty: the model's chat template is used",
                                    json_schema_extra={"maxLength": 0})
    context: Optional[List[int]] = Field(None, description="only empty: a conversation goes through /api/chat "
                                                           "(its messages)", json_schema_extra={"maxItems": 0})
    images: Optional[List[str]] = Field(None, description="images, each its file as base64 (a vision-language "
                                                          "model's), put before the prompt (not with raw)")
    _data: tuple = PrivateAttr(())

    @model_validator(mode="after")
    def _generate_rules(self):
        refused = {"suffix": "fill-in-the-middle is not served", "template": "the model's own chat template is "
                   "used (raw: true sends a prompt as it is)", "context": "send the conversation to /api/chat as "
                   "messages"}
        if self.raw and self.images:
            raise ValidationError("images go with raw false: the chat template places them", param="images")
        self._data = image_files(self.images, "images")
        for field, why in refused.items():
            if getattr(self, field):
                raise ValidationError(f"{field} is not supported: {why}", param=field)
        if self.raw:
            for field in ("system", "think"):
                if getattr(self, field):
                    raise ValidationError(f"{field} goes with raw false: a raw prompt is sent as it is",
                                          param=field)
        return self

    @property
    def loads_only(self) -> bool:
        return not self.prompt

    def to_request(self, model: str) -> ApiRequest:
        if self.raw:
            return self._request(model, prompt=self.prompt)
        messages = [{"role": "system", "content": self.system}] if self.system else []
        content = self.prompt if not self.images else [*({"type": "image", "image": d} for d in self._data),
                                                       {"type": "text", "text": self.prompt}]
        return self._request(model, messages=[*messages, {"role": "user", "content": content}],
                             variables=self.variables())


class ShowRequest(Body):
    """POST /api/show: {model} (Ollama's older `name` too)."""
    model_config = ConfigDict(json_schema_extra={"anyOf": [      # a served name: the model's, else the name's
        needs({"model": {**GIVEN, **OLLAMA_MODEL}}),
        {"not": needs({"model": GIVEN}), **needs({"name": {**GIVEN, **OLLAMA_MODEL}})}]})
    model: Optional[str] = Field(None, min_length=1)
    name: Optional[str] = Field(None, min_length=1, description="Ollama's older name of `model`")
    verbose: Optional[bool] = Field(None, description="accepted: model_info is the same either way")

    @model_validator(mode="after")
    def _named(self):
        if (self.model or self.name) is None:
            raise ValidationError("'model' is required", param="model")
        return self

    @property
    def named(self) -> str:
        return self.model or self.name


class _Embedding(Body):
    """What /api/embed and /api/embeddings share: the model (its embeddings are the served model's own), options and
    keep_alive accepted (neither changes an embedding)."""
    model: str = Field(min_length=1, description="the served model's name, :latest or not (LoRA adapters do not "
                                                 "embed)", json_schema_extra=OLLAMA_BASE_MODEL)
    options: Optional[Options] = Field(None, description="accepted: no option changes an embedding")
    keep_alive: Optional[Union[str, int, float]] = Field(
        None, description="how long the model stays loaded after this request: seconds or 5m, 1h; -1 for good, 0 "
                          "unloaded once idle")


class EmbedRequest(_Embedding):
    """POST /api/embed: each input's embedding, L2-normalized; no input: Ollama's "load the model" (no embeddings)."""
    input: Optional[Union[str, List[str]]] = Field(None, description="a string or a list of strings; empty: none",
                                                   json_schema_extra={"anyOf": [
                                                       {"type": "string"}, {"type": "null"},
                                                       {"type": "array", "items": {"type": "string", "minLength": 1},
                                                        "maxItems": MAX_INPUTS}]})
    truncate: Optional[bool] = Field(None, description="default true: an input longer than the context is cut to "
                                                       "its first tokens; false: it is a 400")
    dimensions: Optional[int] = Field(None, ge=1, le=1 << 20, description="a Matryoshka model's width to cut the "
                                      "vectors to (normalized again); any other model only its own",
                                      json_schema_extra=DIMENSIONS)

    @field_validator("input")
    @classmethod
    def _inputs(cls, value):
        if isinstance(value, list) and (len(value) > MAX_INPUTS or not all(value)):
            raise ValidationError(f"input must be a string or a list of at most {MAX_INPUTS} non-empty strings",
                                  param="input")
        return value

    def inputs(self) -> list:
        """The texts to embed ([] for none)."""
        if not self.input:
            return []
        return [self.input] if isinstance(self.input, str) else list(self.input)


class EmbeddingsRequest(_Embedding):
    """POST /api/embeddings (Ollama's older route): one prompt's embedding; no prompt: none."""
    prompt: Optional[str] = Field(None, description="the text; empty: an empty embedding")


ROUTES = [("/api/chat", ChatRequest, "Ollama chat: NDJSON stream by default, tools, format, think"),
          ("/api/generate", GenerateRequest, "Ollama generate: a prompt (raw or through the chat template)"),
          ("/api/show", ShowRequest, "Ollama: the served model's template, parameters, details and capabilities"),
          ("/api/embed", EmbedRequest, "Ollama: embeddings of a string or strings, normalized"),
          ("/api/embeddings", EmbeddingsRequest, "Ollama's older embeddings route: one prompt's embedding")]
OPERATIONS = [("get", "/api/tags", "Ollama: the served model and its LoRA adapters"),
              ("get", "/api/ps", "Ollama: the models loaded (always the served one)"),
              ("get", "/api/version", "Ollama: the Ollama API version this server speaks")]
