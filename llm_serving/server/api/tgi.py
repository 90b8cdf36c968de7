"""llm-serving's / TGI's generate body ({"inputs", "parameters", "stream"}): every rule about its shape, and
`to_request()`, its translation into the internal request (server/translate.py). For a model that takes images,
`inputs` carries them as TGI's do: markdown images, `![](data:image/png;base64,...)` or `![](https://...)` (fetched
from the allowed hosts only), each one where the model's chat template would mark an image (`markdown_images`)."""
from __future__ import annotations

import re
from typing import Any, List, Literal, Optional, Union

from pydantic import ConfigDict, Field, PrivateAttr, field_validator, model_validator

from llm_serving.master.grammar import GrammarSpec
from llm_serving.master.request import SamplingParams
from llm_serving.server.api.base import (NEW_TOKENS, NOT_BLANK, SERVED_ADAPTER, STOP, TOKEN_ID, Body, needs, rules,
                                         stop_strings, stop_token_ids, when)
from llm_serving.server.errors import ValidationError
from llm_serving.server.translate import ApiRequest
from llm_serving.shm.layout import TOP_LOGPROBS

DEFAULT_MAX_NEW_TOKENS = 64

# a markdown image whose target is a data: URL or an http(s) one (TGI's image syntax): ![alt](target)
_MARKDOWN_IMAGE = re.compile(r"!\[[^\]\n]*\]\(\s*((?:data:|https?://)[^)\s]*)\s*\)")


def markdown_images(text: str) -> Optional[list]:
    """`text` as a raw prompt's parts (translate.py's ApiRequest.prompt_parts): its text pieces and, for each markdown
    image, its part ({"type": "image", "image": bytes} for a data: URL, {"type": "image", "url"} for an http(s) one,
    fetched later), in order; None when it holds none. A data: URL that is not a base64 image is a ValidationError
    naming `inputs`."""
    from llm_serving.server.api.openai import image_part

    parts, at = [], 0
    for match in _MARKDOWN_IMAGE.finditer(text):
        parts.append(text[at:match.start()])
        parts.append(image_part(match.group(1), f"the markdown image at {match.start()} of inputs", "inputs"))
        at = match.end()
    if not parts:
        return None
    parts.append(text[at:])
    return [p for p in parts if p != ""]


class TGIGrammar(Body):
    model_config = ConfigDict(json_schema_extra=rules(
        when("type", {"const": "regex"}, needs({"value": {"type": "string", **NOT_BLANK}})),
        when("type", {"const": "json"}, needs({"value": {"type": ["object", "boolean", "string"]}}))))
    type: Literal["json", "regex", "json_object"]
    value: Any = Field(None, description="json: a JSON schema (an object or its text); regex: a pattern")

    def spec(self) -> GrammarSpec:
        field = "parameters.grammar"
        if self.type == "json_object":
            return GrammarSpec("json_object", None, field)
        if self.type == "json":
            return GrammarSpec.json_schema(self.value, f"{field}.value")
        if not isinstance(self.value, str) or not self.value.strip():
            raise ValidationError(f"{field}.value must be a non-empty string", param="grammar")
        return GrammarSpec("regex", self.value, f"{field}.value")


class TGIParameters(Body):
    max_new_tokens: Optional[int] = Field(None, ge=1, le=1 << 20, json_schema_extra=NEW_TOKENS)
    do_sample: bool = False
    temperature: Optional[float] = Field(None, ge=0.0, le=100.0)
    top_k: int = Field(0, ge=0, le=1 << 20)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: Optional[int] = Field(None, ge=0, le=(1 << 63) - 1)
    return_full_text: bool = False
    ignore_eos: bool = False
    details: bool = False
    decoder_input_details: bool = Field(False, description="details.prefill: the prompt tokens' log-probabilities "
                                                           "(not with a stream)")
    stop: Optional[Union[str, List[str]]] = Field(None, description="at most 16 stop strings of 1 to 256 characters",
                                                  json_schema_extra=STOP)
    stop_token_ids: Optional[List[int]] = Field(None, max_length=16, json_schema_extra={"items": TOKEN_ID})
    top_n_tokens: int = Field(0, ge=0, le=TOP_LOGPROBS)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    speculative: bool = True
    adapter_id: Optional[str] = Field(None, min_length=1, description="a LoRA adapter served here (GET /v1/models)",
                                      json_schema_extra=SERVED_ADAPTER)
    grammar: Optional[TGIGrammar] = None
    truncate: None = None
    typical_p: None = None
    watermark: Literal[False] = False
    best_of: Optional[Literal[1]] = None

    _grammar: Optional[GrammarSpec] = PrivateAttr(None)

    @field_validator("stop")
    @classmethod
    def _stop(cls, value):
        stop_strings(value, "parameters.stop", "stop")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, value):
        stop_token_ids(value, "parameters.stop_token_ids", "stop_token_ids")
        return value

    @model_validator(mode="after")
    def _compile_spec(self):
        self._grammar = self.grammar.spec() if self.grammar is not None else None
        return self

    def sampling(self) -> SamplingParams:
        # TGI's rule: sampling is on when asked for, or when any sampling knob is set away from neutral
        t = self.temperature
        sample = (self.do_sample or (t is not None and t not in (0.0, 1.0)) or self.top_k > 0 or self.top_p < 1.0) \
            and t != 0.0
        return SamplingParams(
            max_new_tokens=self.max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
            temperature=(t if t is not None else 1.0) if sample else 0.0,
            top_k=self.top_k if sample else 0, top_p=self.top_p if sample else 1.0, seed=self.seed,
            ignore_eos=self.ignore_eos, stop=stop_strings(self.stop, "parameters.stop", "stop"),
            stop_token_ids=stop_token_ids(self.stop_token_ids, "parameters.stop_token_ids", "stop_token_ids"),
            top_logprobs=self.top_n_tokens, repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            speculative=self.speculative, grammar=self._grammar,
            prompt_logprobs=0 if self.decoder_input_details else None)


class GenerateRequest(Body):
    """POST /generate, /generate_stream, /models/{model}/generate[_stream], and TGI's POST /."""
    inputs: str = Field(description="the prompt (not blank)", json_schema_extra=NOT_BLANK)
    parameters: Optional[TGIParameters] = Field(default_factory=TGIParameters)
    stream: Optional[bool] = Field(None, description="default: false on generate routes, true on _stream ones")

    @field_validator("inputs")
    @classmethod
    def _not_blank(cls, value):
        if not value.strip():
            raise ValidationError("'inputs' is empty; give a non-empty prompt", param="inputs")
        return value

    @field_validator("parameters")
    @classmethod
    def _defaults(cls, value):       # "parameters": null is every default
        return value if value is not None else TGIParameters()

    def to_request(self, stream_default: bool, model: Optional[str], takes_images: bool = False) -> ApiRequest:
        """The internal request on `model` (the path's model or adapter, or parameters.adapter_id: the route
        decides); `stream_default` the route's. `takes_images`: the served model takes images, so that `inputs`'
        markdown images are its images (a text model's prompt keeps them as text)."""
        stream = stream_default if self.stream is None else self.stream
        p = self.parameters
        if p.decoder_input_details and stream:
            raise ValidationError("parameters.decoder_input_details is not supported when streaming (as TGI)",
                                  param="decoder_input_details")
        parts = markdown_images(self.inputs) if takes_images else None
        return ApiRequest(p.sampling(), prompt=self.inputs if parts is None else None, prompt_parts=parts, model=model,
                          max_tokens_field="max_new_tokens", max_tokens_given=p.max_new_tokens is not None,
                          stream=stream)


ROUTES = [("/generate", GenerateRequest, "llm-serving / TGI generate"),
          ("/generate_stream", GenerateRequest, "llm-serving / TGI token stream"),
          ("/models/{model}/generate", GenerateRequest, "generate on a model (or adapter) by name"),
          ("/models/{model}/generate_stream", GenerateRequest, "token stream on a model (or adapter) by name"),
          ("/", GenerateRequest, "TGI's POST /: generate, or a token stream with stream: true")]
