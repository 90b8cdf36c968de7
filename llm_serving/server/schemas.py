"""Validation of generate requests: every bad input becomes a ValidationError naming the field, before
anything reaches the engine."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Optional

from llm_serving.master.grammar import GrammarSpec
from llm_serving.master.request import SamplingParams
from llm_serving.shm.layout import TOP_LOGPROBS

DEFAULT_MAX_NEW_TOKENS = 64


class ValidationError(ValueError):
    """The request is malformed; answered with 400 and this message (`param`: the field, when known). A grammar
    that does not compile (master.grammar.GrammarError) is answered the same way."""

    def __init__(self, message: str, param=None):
        super().__init__(message)
        self.param = param


class ModelNotFoundError(LookupError):
    """The path names a model this server does not serve; answered with 404."""


@dataclass
class GenerateRequest:
    inputs: str
    sampling: SamplingParams
    stream: bool
    return_full_text: bool
    details: bool
    max_new_tokens_given: bool
    adapter_id: "str | None" = None       # TGI's parameters.adapter_id: a LoRA adapter served here


# Known TGI / llm-serving parameters that this version does not implement yet: accepted only when null
# or at their neutral value, so clients that always send them keep working.
NEUTRAL_PARAMETERS = {"truncate": None, "typical_p": None, "watermark": False, "best_of": 1}
KNOWN_PARAMETERS = {"max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "seed",
                    "return_full_text", "ignore_eos", "details", "stop", "stop_token_ids", "top_n_tokens",
                    "repetition_penalty", "frequency_penalty", "presence_penalty", "speculative",
                    "adapter_id", "grammar", "decoder_input_details"} | set(NEUTRAL_PARAMETERS)
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256


def parse_json_body(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValidationError(f"request body is not valid UTF-8 (byte {exc.start})") from None
    if not text.strip():
        raise ValidationError("request body is empty; expected a JSON object with 'inputs'")
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValidationError(f"request body is not valid JSON: {exc.msg} at line {exc.lineno} "
                              f"column {exc.colno}") from None
    if not isinstance(body, dict):
        raise ValidationError(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def bool_field(params: dict, key: str, default: bool, prefix: str = "parameters.") -> bool:
    value = params.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValidationError(f"{prefix}{key} must be true or false, got {value!r}", param=key)
    return value


def int_field(params: dict, key: str, default, lo: int, hi: int, prefix: str = "parameters."):
    value = params.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError(f"{prefix}{key} must be an integer, got {value!r}", param=key)
    if not lo <= value <= hi:
        raise ValidationError(f"{prefix}{key} must be between {lo} and {hi}, got {value}", param=key)
    return value


def float_field(params: dict, key: str, default, lo: float, hi: float, lo_open: bool = False,
           prefix: str = "parameters."):
    value = params.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValidationError(f"{prefix}{key} must be a number, got {value!r}", param=key)
    if value < lo or value > hi or (lo_open and value == lo):
        raise ValidationError(f"{prefix}{key} must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}",
                              param=key)
    return float(value)


def parse_penalties(params: dict, prefix: str = "parameters.") -> dict:
    """repetition_penalty in (0, 10] (1 = off), presence_penalty and frequency_penalty in [-2, 2] (0 = off)."""
    return {"repetition_penalty": float_field(params, "repetition_penalty", 1.0, 0.0, 10.0, lo_open=True, prefix=prefix),
            "presence_penalty": float_field(params, "presence_penalty", 0.0, -2.0, 2.0, prefix=prefix),
            "frequency_penalty": float_field(params, "frequency_penalty", 0.0, -2.0, 2.0, prefix=prefix)}


def parse_stop(value, field: str) -> tuple:
    """Stop strings: a string or a list of them (null = none), each 1..MAX_STOP_CHARS characters."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or len(items) > MAX_STOP_STRINGS or not all(isinstance(v, str) for v in items):
        raise ValidationError(f"{field} must be a string or a list of at most {MAX_STOP_STRINGS} strings, "
                              f"got {value!r}")
    for v in items:
        if not 1 <= len(v) <= MAX_STOP_CHARS:
            raise ValidationError(f"{field}: every stop string must have 1 to {MAX_STOP_CHARS} characters, "
                                  f"got {v!r}")
    return tuple(dict.fromkeys(items))


def parse_stop_token_ids(value, field: str, vocab_size: int) -> tuple:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_STOP_STRINGS or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v < vocab_size for v in value):
        raise ValidationError(f"{field} must be a list of at most {MAX_STOP_STRINGS} token ids in "
                              f"0..{vocab_size - 1}, got {value!r}")
    return tuple(value)


def parse_generate(body: dict, *, stream_default: bool = False, vocab_size: int = 1 << 31) -> GenerateRequest:
    """Check a llm-serving / TGI generate body: {"inputs": str, "parameters": {...}, "stream": bool}."""
    unknown = set(body) - {"inputs", "parameters", "stream"}
    if unknown:
        raise ValidationError(f"unknown field(s) in request body: {', '.join(sorted(unknown))} "
                              "(expected inputs, parameters, stream)")
    inputs = body.get("inputs")
    if inputs is None:
        raise ValidationError("missing field 'inputs' (the prompt text)")
    if not isinstance(inputs, str):
        raise ValidationError(f"'inputs' must be a string, got {type(inputs).__name__}")
    if not inputs.strip():
        raise ValidationError("'inputs' is empty; give a non-empty prompt")
    stream = body.get("stream", stream_default)
    if not isinstance(stream, bool):
        raise ValidationError(f"'stream' must be true or false, got {stream!r}")
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise ValidationError(f"'parameters' must be an object, got {type(params).__name__}")
    unknown = set(params) - KNOWN_PARAMETERS
    if unknown:
        raise ValidationError(f"unknown parameter(s): {', '.join(sorted(unknown))} "
                              f"(known: {', '.join(sorted(KNOWN_PARAMETERS))})")
    for key, neutral in NEUTRAL_PARAMETERS.items():
        if params.get(key) is not None and params[key] != neutral:
            raise ValidationError(f"parameters.{key} is not supported by this server yet "
                                  f"(send null or {json.dumps(neutral)})")

    max_new_tokens = int_field(params, "max_new_tokens", None, 1, 1 << 20)
    do_sample = bool_field(params, "do_sample", False)
    temperature = float_field(params, "temperature", None, 0.0, 100.0)
    top_k = int_field(params, "top_k", 0, 0, 1 << 20)
    top_p = float_field(params, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    seed = int_field(params, "seed", None, 0, (1 << 63) - 1)
    # TGI's rule: sampling is on when asked for, or when any sampling knob is set away from neutral.
    sample = do_sample or (temperature is not None and temperature not in (0.0, 1.0)) or top_k > 0 or top_p < 1.0
    if temperature == 0.0:
        sample = False
    sampling = SamplingParams(
        max_new_tokens=max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
        temperature=(temperature if temperature is not None else 1.0) if sample else 0.0,
        top_k=top_k if sample else 0, top_p=top_p if sample else 1.0, seed=seed,
        ignore_eos=bool_field(params, "ignore_eos", False), stop=parse_stop(params.get("stop"), "parameters.stop"),
        stop_token_ids=parse_stop_token_ids(params.get("stop_token_ids"), "parameters.stop_token_ids", vocab_size),
        top_logprobs=int_field(params, "top_n_tokens", 0, 0, TOP_LOGPROBS), **parse_penalties(params),
        speculative=bool_field(params, "speculative", True), grammar=parse_tgi_grammar(params.get("grammar")),
        prompt_logprobs=0 if bool_field(params, "decoder_input_details", False) else None)
    if sampling.prompt_logprobs is not None and stream:
        raise ValidationError("parameters.decoder_input_details is not supported when streaming (as TGI)",
                              param="decoder_input_details")
    return GenerateRequest(inputs=inputs, sampling=sampling, stream=stream,
                           return_full_text=bool_field(params, "return_full_text", False),
                           details=bool_field(params, "details", False),
                           max_new_tokens_given=max_new_tokens is not None,
                           adapter_id=_adapter_id(params.get("adapter_id")))


def _adapter_id(value) -> "str | None":
    if value is None or (isinstance(value, str) and value):
        return value
    raise ValidationError(f"parameters.adapter_id must be the name of a LoRA adapter served here (GET /v1/models), "
                          f"got {value!r}")


def parse_request_id(value):
    """A client-chosen request id (header X-Request-Id): 1-128 visible ASCII characters, or None."""
    if value is None:
        return None
    if not 1 <= len(value) <= 128 or not all(33 <= ord(c) <= 126 for c in value):
        raise ValidationError("header X-Request-Id must be 1 to 128 visible ASCII characters (no spaces)")
    return value


def check_lengths(req, num_prompt_tokens: int, max_model_len: int, field: str = "max_new_tokens") -> None:
    """Reject prompts the model cannot take; fit an unspecified max_new_tokens into what is left."""
    if num_prompt_tokens >= max_model_len:
        raise ValidationError(f"prompt has {num_prompt_tokens} tokens; this model accepts at most "
                              f"{max_model_len - 1} prompt tokens ({max_model_len} tokens per request, "
                              "prompt + new tokens)")
    room = max_model_len - num_prompt_tokens
    if not req.max_new_tokens_given:
        req.sampling.max_new_tokens = min(req.sampling.max_new_tokens, room)
    elif req.sampling.max_new_tokens > room:
        raise ValidationError(f"prompt ({num_prompt_tokens} tokens) + {field} "
                              f"({req.sampling.max_new_tokens}) exceeds the model's {max_model_len}-token "
                              f"limit; ask for at most {room} new tokens", param=field)


# --- logit controls and structured outputs (OpenAI's fields, vLLM's extras, TGI's grammar) ------------------------

MAX_LOGIT_BIAS_ENTRIES = 300        # OpenAI's limit
MAX_BAD_WORDS = 100
MAX_ALLOWED_TOKEN_IDS = 1 << 17
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _token_ids(value, field: str, vocab_size: int, most: int) -> tuple:
    if not isinstance(value, list) or not value or len(value) > most or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v < vocab_size for v in value):
        raise ValidationError(f"{field} must be a non-empty list of at most {most} token ids in 0..{vocab_size - 1}",
                              param=field)
    return tuple(dict.fromkeys(value))


def parse_logit_controls(params: dict, tokenizer, prefix: str = "", max_tokens: Optional[int] = None) -> dict:
    """logit_bias ({token id: bias in [-100, 100]}, ids as JSON keys), min_p [0, 1], min_tokens (<= max_tokens),
    bad_words (strings the output never contains), allowed_token_ids: SamplingParams fields, each checked."""
    vocab = tokenizer.vocab_size
    out: dict = {}
    bias = params.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValidationError(f"{prefix}logit_bias must be an object {{token id: bias}} of at most "
                                  f"{MAX_LOGIT_BIAS_ENTRIES} entries", param="logit_bias")
        entries = []
        for key, value in bias.items():
            token = int(key) if isinstance(key, str) and key.strip().lstrip("-").isdigit() else None
            if token is None or not 0 <= token < vocab:
                raise ValidationError(f"{prefix}logit_bias: {key!r} is not a token id in 0..{vocab - 1}",
                                      param="logit_bias")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise ValidationError(f"{prefix}logit_bias[{key}] must be a number in [-100, 100], got {value!r}",
                                      param="logit_bias")
            entries.append((token, float(value)))
        out["logit_bias"] = tuple(entries)
    out["min_p"] = float_field(params, "min_p", 0.0, 0.0, 1.0, prefix=prefix)
    min_tokens = int_field(params, "min_tokens", 0, 0, 1 << 20, prefix=prefix)
    if max_tokens is not None and min_tokens > max_tokens:
        raise ValidationError(f"{prefix}min_tokens ({min_tokens}) is more than the most tokens asked for "
                              f"({max_tokens})", param="min_tokens")
    out["min_tokens"] = min_tokens
    words = params.get("bad_words")
    if words is not None:
        if not isinstance(words, list) or len(words) > MAX_BAD_WORDS or not all(
                isinstance(w, str) and w.strip() and len(w) <= MAX_STOP_CHARS for w in words):
            raise ValidationError(f"{prefix}bad_words must be a list of at most {MAX_BAD_WORDS} non-blank strings of "
                                  f"at most {MAX_STOP_CHARS} characters", param="bad_words")
        sequences: dict = {}
        for word in words:      # as it starts the text and as it follows a space
            for text in (word, word if word.startswith(" ") else " " + word):
                ids = tuple(tokenizer.encode(text, add_bos=False))
                if ids:
                    sequences[ids] = None
        out["bad_words"] = tuple(sequences)
    if params.get("allowed_token_ids") is not None:
        out["allowed_token_ids"] = _token_ids(params["allowed_token_ids"], f"{prefix}allowed_token_ids", vocab,
                                              MAX_ALLOWED_TOKEN_IDS)
    return out


def _structured_value(kind: str, value, field: str):
    """A GrammarSpec of one structured-output kind."""
    if kind == "json":
        return GrammarSpec.json_schema(value, field)
    if kind == "json_object":
        if value is not True:
            raise ValidationError(f"{field} must be true", param=field)
        return GrammarSpec("json_object", None, field)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ValidationError(f"{field} must be a non-empty list of non-empty strings", param=field)
        return GrammarSpec("choice", tuple(dict.fromkeys(value)), field)
    if not isinstance(value, str) or not value.strip():
        raise ValidationError(f"{field} must be a non-empty string", param=field)
    return GrammarSpec(kind, value, field)


def parse_structured(body: dict) -> "Optional[GrammarSpec]":
    """What the output must match, from the one of OpenAI's `response_format`, vLLM's `structured_outputs`
    (json, regex, choice, grammar: Lark or GBNF, json_object) or its older `guided_*` fields that is given."""
    given = [k for k in ("response_format", "structured_outputs", *GUIDED) if body.get(k) is not None]
    if body.get("response_format") is not None and body["response_format"] == {"type": "text"}:
        given.remove("response_format")
    if len(given) > 1:
        raise ValidationError(f"give at most one of {', '.join(given)}: each says what the output must match",
                              param=given[1])
    if not given:
        return None
    key = given[0]
    value = body[key]
    if key in GUIDED:
        return _structured_value(GUIDED[key], value, key)
    if key == "structured_outputs":
        if not isinstance(value, dict):
            raise ValidationError("structured_outputs must be an object with one of "
                                  f"{', '.join(STRUCTURED_KINDS)}", param=key)
        kinds = [k for k in STRUCTURED_KINDS if value.get(k) not in (None, False)]
        unknown = set(value) - set(STRUCTURED_KINDS) - {"disable_any_whitespace", "disable_additional_properties",
                                                         "whitespace_pattern", "backend"}
        if unknown or len(kinds) != 1:
            raise ValidationError(f"structured_outputs must have exactly one of {', '.join(STRUCTURED_KINDS)}"
                                  + (f" (unknown: {', '.join(sorted(unknown))})" if unknown else ""), param=key)
        return _structured_value(kinds[0], value[kinds[0]], f"structured_outputs.{kinds[0]}")
    # OpenAI's response_format
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        return GrammarSpec("json_object", None, key)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
            raise ValidationError("response_format.json_schema must be an object {name, schema, strict}",
                                  param="response_format")
        schema = spec.get("schema", {"type": "object"})
        return GrammarSpec.json_schema(schema, "response_format.json_schema.schema")
    raise ValidationError("response_format.type must be text, json_object or json_schema", param="response_format")


def parse_tgi_grammar(value) -> "Optional[GrammarSpec]":
    """TGI's parameters.grammar: {"type": "json", "value": a JSON schema} or {"type": "regex", "value": str}."""
    if value is None:
        return None
    field = "parameters.grammar"
    if not isinstance(value, dict) or value.get("type") not in ("json", "regex", "json_object") \
            or set(value) - {"type", "value"}:
        raise ValidationError(f"{field} must be {{\"type\": \"json\" or \"regex\", \"value\": ...}}", param="grammar")
    if value["type"] == "json_object":
        return GrammarSpec("json_object", None, field)
    if value["type"] == "json":
        return GrammarSpec.json_schema(value.get("value"), f"{field}.value")
    return _structured_value("regex", value.get("value"), f"{field}.value")
