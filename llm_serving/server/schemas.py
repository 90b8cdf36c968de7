"""Checks of a request past its fields' types and ranges (those are the request models', server/api_models.py):
what needs the served model or several fields at once — token ids below the vocabulary, stop strings, a prompt's
length, logit controls, which structured-output field is given and its value — each a ValidationError naming the
field, before anything reaches the engine; and the GenerateRequest a llm-serving / TGI body becomes."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional

from llm_serving.master.grammar import GrammarSpec
from llm_serving.master.request import SamplingParams

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
    compiled: object = None               # its grammar's matcher (Engine.compile_grammar), once compiled


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


def parse_generate(r, *, stream_default: bool = False, vocab_size: int = 1 << 31) -> GenerateRequest:
    """A llm-serving / TGI generate body validated as api_models.GenerateRequest, {"inputs": str, "parameters":
    {...}, "stream": bool}, made a GenerateRequest (what the types and ranges cannot say checked here)."""
    if not r.inputs.strip():
        raise ValidationError("'inputs' is empty; give a non-empty prompt", param="inputs")
    stream = stream_default if r.stream is None else r.stream
    p = r.parameters
    temperature = p.temperature
    # TGI's rule: sampling is on when asked for, or when any sampling knob is set away from neutral.
    sample = p.do_sample or (temperature is not None and temperature not in (0.0, 1.0)) or p.top_k > 0 or p.top_p < 1.0
    if temperature == 0.0:
        sample = False
    sampling = SamplingParams(
        max_new_tokens=p.max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
        temperature=(temperature if temperature is not None else 1.0) if sample else 0.0,
        top_k=p.top_k if sample else 0, top_p=p.top_p if sample else 1.0, seed=p.seed,
        ignore_eos=p.ignore_eos, stop=parse_stop(p.stop, "parameters.stop"),
        stop_token_ids=parse_stop_token_ids(p.stop_token_ids, "parameters.stop_token_ids", vocab_size),
        top_logprobs=p.top_n_tokens, repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty, speculative=p.speculative,
        grammar=parse_tgi_grammar(p.grammar.model_dump() if p.grammar is not None else None),
        prompt_logprobs=0 if p.decoder_input_details else None)
    if sampling.prompt_logprobs is not None and stream:
        raise ValidationError("parameters.decoder_input_details is not supported when streaming (as TGI)",
                              param="decoder_input_details")
    return GenerateRequest(inputs=r.inputs, sampling=sampling, stream=stream, return_full_text=p.return_full_text,
                           details=p.details, max_new_tokens_given=p.max_new_tokens is not None,
                           adapter_id=_adapter_id(p.adapter_id))


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


def parse_logit_controls(r, tokenizer, vocab: int, max_tokens: Optional[int] = None) -> dict:
    """A validated request's logit controls as SamplingParams fields (what needs the vocabulary checked here):
    logit_bias ({token id: bias in [-100, 100]}, ids as JSON keys), min_p, min_tokens (<= max_tokens), bad_words
    (strings the output never contains, as token sequences), allowed_token_ids; `vocab`: the ids a request may
    name (the tokenizer's that the model has too)."""
    out: dict = {"min_p": r.min_p, "min_tokens": r.min_tokens}
    if r.logit_bias is not None:
        if len(r.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValidationError(f"logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} entries", param="logit_bias")
        entries = []
        for key, value in r.logit_bias.items():
            token = int(key) if re.fullmatch(r"\s*-?[0-9]{1,9}\s*", key) else None
            if token is None or not 0 <= token < vocab:
                raise ValidationError(f"logit_bias: {key!r} is not a token id in 0..{vocab - 1}", param="logit_bias")
            if not -100 <= value <= 100:
                raise ValidationError(f"logit_bias[{key}] must be a number in [-100, 100], got {value!r}",
                                      param="logit_bias")
            entries.append((token, float(value)))
        out["logit_bias"] = tuple(entries)
    if max_tokens is not None and r.min_tokens > max_tokens:
        raise ValidationError(f"min_tokens ({r.min_tokens}) is more than the most tokens asked for ({max_tokens})",
                              param="min_tokens")
    if r.bad_words is not None:
        if len(r.bad_words) > MAX_BAD_WORDS or not all(w.strip() and len(w) <= MAX_STOP_CHARS for w in r.bad_words):
            raise ValidationError(f"bad_words must be a list of at most {MAX_BAD_WORDS} non-blank strings of at most "
                                  f"{MAX_STOP_CHARS} characters", param="bad_words")
        sequences: dict = {}
        for word in r.bad_words:      # as it starts the text and as it follows a space
            for text in (word, word if word.startswith(" ") else " " + word):
                ids = tuple(tokenizer.encode(text, add_bos=False))
                if ids:
                    sequences[ids] = None
        out["bad_words"] = tuple(sequences)
    if r.allowed_token_ids is not None:
        out["allowed_token_ids"] = _token_ids(r.allowed_token_ids, "allowed_token_ids", vocab, MAX_ALLOWED_TOKEN_IDS)
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
    if isinstance(body.get("response_format"), dict) and body["response_format"].get("type") == "text":
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
        # JSON comes out without free whitespace either way; llguidance is the one backend
        unknown = {k for k in set(value) - set(STRUCTURED_KINDS) - {"disable_any_whitespace"}
                   if not (k == "backend" and value[k] in (None, "auto", "guidance", "llguidance"))}
        if unknown or len(kinds) != 1:
            raise ValidationError(f"structured_outputs must have exactly one of {', '.join(STRUCTURED_KINDS)}"
                                  + (f" (not supported here: {', '.join(sorted(unknown))})" if unknown else ""),
                                  param=key)
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
