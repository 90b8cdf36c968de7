"""The request bodies as pydantic models, the ecosystem's convention: every route's fields, their types, ranges,
defaults and meanings in one place. `validate` turns a body into its model or a ValidationError that names the
field in the API's words (the app answers it with the API's own 400 shape); `openapi` builds the server's OpenAPI
document (GET /openapi.json) from the same models.

What needs the served model is checked after validation, by the routes and server/schemas.py: token ids below
the vocabulary, a prompt's length against the context, stop strings' sizes, a grammar that compiles, the tools'
shapes, fields that exclude each other. The request models are strict ("5" is not an integer, 1 is not true, NaN is
not a number); what they carry through to those checks (a message's parts, a tool's function, a JSON schema) is
typed loosely and checked there.
"""
from __future__ import annotations

import re
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic import ValidationError as PydanticError
from pydantic.json_schema import models_json_schema

from llm_serving.server.schemas import ValidationError
from llm_serving.shm.layout import TOP_LOGPROBS

MAX_N = 16
_INT64 = dict(ge=-(1 << 63), le=(1 << 64) - 1)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


# --- OpenAI (with vLLM's extra fields) ---------------------------------------------------------------------------

class StreamOptions(_Body):
    include_usage: bool = Field(False, description="a last chunk with the usage of the whole request")


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = "response"
    schema_: Dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: Optional[bool] = None
    description: Optional[str] = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputs(_Body):
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar (Lark or GBNF), json_object."""
    json_: Optional[Union[Dict[str, Any], str]] = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[List[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: Optional[bool] = Field(None, description="accepted: JSON never has free whitespace here")
    backend: Optional[Literal["auto", "guidance", "llguidance"]] = Field(None, description="llguidance, the one here")


class _Sampling(_Body):
    """What completions and chat share: sampling, stops, logit controls, structured outputs."""
    model: str = Field(description="the served model's id, or a LoRA adapter's (GET /v1/models)")
    stream: bool = Field(False, description="server-sent events, a chunk per token")
    stream_options: Optional[StreamOptions] = None
    n: int = Field(1, ge=1, le=MAX_N, description="choices, each its own request (with a seed: choice i uses seed + i)")
    stop: Optional[Union[str, List[str]]] = Field(None, description="stop strings (not in the text)")
    stop_token_ids: Optional[List[int]] = Field(None, description="more tokens that end the reply (vLLM)")
    seed: Optional[int] = Field(None, **_INT64)
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=1 << 20, description="0 or -1 = off (vLLM)")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="tokens below min_p x the likeliest's probability are out (vLLM)")
    ignore_eos: bool = Field(False, description="EOS does not end the reply (vLLM)")
    skip_special_tokens: bool = Field(True, description="the reply's text leaves special tokens out; false keeps "
                                                        "them (vLLM; a gpt-oss chat keeps them to read its format)")
    user: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=0, le=1 << 20,
                                      description="0 only with echo or prompt_logprobs: the prompt is scored")
    min_tokens: int = Field(0, ge=0, le=1 << 20, description="stop tokens are banned until this many (vLLM)")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description="HF/vLLM, 1 = off")
    logit_bias: Optional[Dict[str, Union[int, float]]] = Field(None, description="{token id: bias in [-100, 100]}")
    bad_words: Optional[List[str]] = Field(None, description="words the reply never contains (vLLM)")
    allowed_token_ids: Optional[List[int]] = Field(None, description="the only tokens the reply may use (vLLM)")
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputs] = None
    guided_json: Optional[Union[Dict[str, Any], str]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[List[str]] = None
    guided_grammar: Optional[str] = None
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=TOP_LOGPROBS,
                                           description="each prompt token's log-probability, with this many top ones (vLLM)")
    speculative: bool = Field(True, description="false keeps the request out of speculative decoding")
    best_of: Optional[Literal[1]] = Field(None, description="only 1")


class CompletionRequest(_Sampling):
    """POST /v1/completions."""
    prompt: Union[str, List[str], List[int]] = Field(description="a string, a list of one string, or token ids")
    echo: bool = Field(False, description="the reply starts with the prompt (its tokens' logprobs too)")
    logprobs: Optional[int] = Field(None, ge=0, le=5, description="top log-probabilities per token, besides the chosen")
    suffix: None = None


class ToolFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(_Body):
    type: Literal["function"]
    function: ToolFunction


class NamedTool(_Body):
    type: Literal["function"]
    function: Dict[str, str]


class ChatMessage(BaseModel):
    """A message: role system, developer, user, assistant (content, or tool_calls) or tool (its tool_call_id)."""
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, List[Dict[str, Any]]]] = None
    tool_calls: Optional[List[Dict[str, Any]]] = None
    tool_call_id: Optional[str] = None
    name: Optional[str] = None


_TEMPLATE_KWARGS = ("extra variables for the chat template's render (vLLM, SGLang), e.g. {\"enable_thinking\": false} "
                    "for Qwen3; not the render's own: messages, tools, add_generation_prompt, bos_token, eos_token, "
                    "raise_exception, ...")


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""
    messages: List[ChatMessage] = Field(min_length=1)
    logprobs: Optional[bool] = None
    top_logprobs: int = Field(0, ge=0, le=TOP_LOGPROBS)
    max_completion_tokens: Optional[int] = Field(None, ge=0, le=1 << 20)
    tools: Optional[List[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedTool]] = None
    parallel_tool_calls: Optional[bool] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = Field(None, description=_TEMPLATE_KWARGS)
    reasoning_effort: Optional[Literal["low", "medium", "high"]] = Field(
        None, description="OpenAI's: how much a reasoning model thinks, given to the chat template as its "
                          "`reasoning_effort` variable (gpt-oss's template reads it); chat_template_kwargs' own wins")
    functions: None = None
    function_call: None = None


class TokenizeRequest(_Body):
    """vLLM's POST /tokenize: a prompt or a chat."""
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[List[ChatMessage]] = None
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: Optional[bool] = None
    return_token_strs: bool = False
    tools: Optional[List[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedTool]] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = Field(None, description=_TEMPLATE_KWARGS)


class DetokenizeRequest(_Body):
    model: Optional[str] = None
    tokens: List[int]


class LoadLoraRequest(_Body):
    lora_name: str
    lora_path: str
    load_inplace: Optional[bool] = None


class UnloadLoraRequest(_Body):
    lora_name: str
    lora_int_id: Optional[int] = None


# --- llm-serving / TGI --------------------------------------------------------------------------------------------

class TGIGrammar(_Body):
    type: Literal["json", "regex", "json_object"]
    value: Any = None


class TGIParameters(_Body):
    max_new_tokens: Optional[int] = Field(None, ge=1, le=1 << 20)
    do_sample: bool = False
    temperature: Optional[float] = Field(None, ge=0.0, le=100.0)
    top_k: int = Field(0, ge=0, le=1 << 20)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: Optional[int] = Field(None, ge=0, le=(1 << 63) - 1)
    return_full_text: bool = False
    ignore_eos: bool = False
    details: bool = False
    decoder_input_details: bool = Field(False, description="details.prefill: the prompt tokens' log-probabilities")
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    top_n_tokens: int = Field(0, ge=0, le=TOP_LOGPROBS)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    speculative: bool = True
    adapter_id: Optional[str] = None
    grammar: Optional[TGIGrammar] = None
    truncate: None = None
    typical_p: None = None
    watermark: Literal[False] = False
    best_of: Optional[Literal[1]] = None


class GenerateRequest(_Body):
    """POST /generate, /generate_stream, /models/{model}/generate[_stream], and TGI's POST /."""
    inputs: str
    parameters: Optional[TGIParameters] = Field(default_factory=TGIParameters)
    stream: Optional[bool] = None

    @field_validator("parameters")
    @classmethod
    def _defaults(cls, value):       # "parameters": null is every default
        return value if value is not None else TGIParameters()


# --- validation --------------------------------------------------------------------------------------------------

_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "literal"}


def _path(loc) -> str:
    """A field's path as the API names it: messages[0].role; a union's branch tags left out."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", part) and part not in _TAGS:
            out += f".{part}" if out else part
        else:
            break
    return out


_BOUNDS = {"greater_than_equal": (">=", "ge"), "less_than_equal": ("<=", "le"), "greater_than": (">", "gt"),
           "less_than": ("<", "lt")}
_KINDS = {"int_type": "an integer", "bool_type": "true or false", "float_type": "a number", "string_type": "a string",
          "list_type": "a list", "dict_type": "an object", "model_type": "an object", "model_attributes_type": "an object",
          "none_required": "null (not supported)", "too_short": "non-empty"}


def validate(model: type, body: dict, unknown: str = "field"):
    """`body` as `model`, or a ValidationError naming the first field that is wrong (unknown fields together):
    its path in the message (messages[0].role), the request's field as `param` (TGI's: the parameter)."""
    try:
        return model.model_validate(body)
    except PydanticError as exc:
        errors = exc.errors()
    extra = [e for e in errors if e["type"] == "extra_forbidden"]
    if extra:
        names = sorted({_path(e["loc"]) for e in extra})
        if unknown == "parameter" and all(n.startswith("parameters.") for n in names):
            names = [n[len("parameters."):] for n in names]
        raise ValidationError(f"unknown {unknown}(s): {', '.join(names)}", param=re.split(r"[.\[]", names[0])[0])
    first = errors[0]
    path = _path(first["loc"])
    field = re.split(r"[.\[]", path)[0] or None          # the request's field (TGI's: the parameter)
    if field == "parameters" and "." in path:
        field = re.split(r"[.\[]", path)[1]
    kind, value = first["type"], first.get("input")
    if kind == "missing":
        message = f"'{path}' is required"
    elif kind in _BOUNDS:
        op, key = _BOUNDS[kind]
        message = f"{path} must be {op} {first['ctx'][key]}, got {value!r}"
    elif kind in _KINDS:
        types = {e["type"] for e in errors if _path(e["loc"]) == path}
        wanted = " or ".join(_KINDS.get(t, t) for t in sorted(types)) if len(types) > 1 else _KINDS[kind]
        message = f"{path} must be {wanted}, got {value!r}"
    elif kind == "literal_error":
        message = f"{path} must be {first['ctx']['expected']}, got {value!r}"
    else:
        message = f"{path}: {first['msg']}"
    raise ValidationError(message, param=field)


# --- the OpenAPI document ----------------------------------------------------------------------------------------

ROUTES = [("/v1/completions", CompletionRequest, "OpenAI completions (vLLM's extra fields)"),
          ("/v1/chat/completions", ChatCompletionRequest, "OpenAI chat completions: tools, structured outputs"),
          ("/tokenize", TokenizeRequest, "vLLM: a prompt's or a chat's token ids"),
          ("/detokenize", DetokenizeRequest, "vLLM: token ids' text"),
          ("/v1/load_lora_adapter", LoadLoraRequest, "vLLM: serve a LoRA adapter"),
          ("/v1/unload_lora_adapter", UnloadLoraRequest, "vLLM: stop serving a LoRA adapter"),
          ("/generate", GenerateRequest, "llm-serving / TGI generate"),
          ("/generate_stream", GenerateRequest, "llm-serving / TGI token stream"),
          ("/models/{model}/generate", GenerateRequest, "generate on a model (or adapter) by name"),
          ("/models/{model}/generate_stream", GenerateRequest, "token stream on a model (or adapter) by name"),
          ("/", GenerateRequest, "TGI's POST /: generate, or a token stream with stream: true")]
GETS = [("/health", "200 when the engine serves"), ("/info", "the served model and limits (TGI's)"),
        ("/v1/models", "the served model and its LoRA adapters"), ("/metrics", "Prometheus metrics"),
        ("/stats", "the engine's counters"), ("/openapi.json", "this document")]


def openapi(version: str) -> dict:
    """The OpenAPI 3.1 document of the HTTP API, its request bodies from the models above."""
    _, defs = models_json_schema([(m, "validation") for m in dict.fromkeys(m for _, m, _ in ROUTES)],
                                 ref_template="#/components/schemas/{model}")
    error = {"description": "a bad request: the API's error shape, naming the field"}
    paths: dict = {}
    for path, model, summary in ROUTES:
        op = {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}},
              "responses": {"200": {"description": "the reply (text/event-stream when streamed)"}, "400": error}}
        if "{model}" in path:
            op["parameters"] = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]
        paths[path] = {"post": op}
    for path, summary in GETS:
        paths.setdefault(path, {})["get"] = {"summary": summary, "responses": {"200": {"description": summary}}}
    return {"openapi": "3.1.0", "info": {"title": "llm-serving", "version": version}, "paths": paths,
            "components": {"schemas": defs.get("$defs", {})}}
