"""What every API's request models share: the strict body base, `validate` (a body into its model, or a
ValidationError naming the field in the API's words), the JSON body reader, and the field rules several APIs use.

The models are strict about the fields they name ("5" is not an integer, 1 is not true, NaN is not a number). A
validator that finds a rule broken raises errors.ValidationError with the request's field as `param`; `validate` passes
it on as it is, the field's path in the body (messages[2]) put before its message when the rule is a nested model's.
Fields they do not name are another matter: clients add fields every month (Codex's `client_metadata`, Claude Code's
`context_management`), and a server that refuses them breaks on the next release of every agent. `UnknownFields` (the
app's, from `serving_config.unknown_fields`) drops them and names each once in the log, as vLLM does; `reject` refuses
them with a 400 naming them, for a deployment that wants to know.
"""
from __future__ import annotations

import copy
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Optional

from pydantic import BaseModel, ConfigDict
from pydantic import ValidationError as PydanticError

from llm_serving.master.grammar import GrammarError
from llm_serving.server.errors import ValidationError
from llm_serving.server.keys import UNKNOWN_FIELDS

logger = logging.getLogger(__name__)

MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256
INT64 = dict(ge=-(1 << 63), le=(1 << 64) - 1)

# What only the served model knows (its names, its vocabulary, its context) marks a field's JSON schema; the OpenAPI
# document of the server at hand makes the mark an enum or a bound (api/document.py); the routes check them
SERVED_MODEL = {"x-served": "model"}            # the model's name or a LoRA adapter's
BASE_MODEL = {"x-served": "base-model"}         # the model's name alone (embeddings, rerank, score)
SERVED_ADAPTER = {"x-served": "adapter"}        # a LoRA adapter's name
OLLAMA_MODEL = {"x-served": "ollama-model"}     # either, or either with ":latest"
OLLAMA_BASE_MODEL = {"x-served": "ollama-base-model"}   # the model's name, with ":latest" or not
TOKEN_ID = {"type": "integer", "minimum": 0, "x-served": "token-id"}  # below the vocabulary's size
NEW_TOKENS = {"x-served": "new-tokens"}         # a reply's length: below the context's (the prompt takes one at least)
DIMENSIONS = {"x-served": "dimensions"}         # an embedding's width: those the model serves


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    def left_out(self) -> list:
        """What of the request is not served and is left out (named once in the log: `UnknownFields`); a body with
        parts it drops (hosted tools) says which."""
        return []


class Open(BaseModel):
    """A part of a body that may carry fields of its own beyond those named (a message, a tool's function)."""
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


async def read_body(request, model: type, unknown: str = "field"):
    """A request's JSON body as `model`, its unknown fields as the app's `UnknownFields` says (ignored unless the
    server was told to refuse them)."""
    fields = request.app.get(UNKNOWN_FIELDS) or UnknownFields()
    return fields.validate(model, read_json(await request.read()), f"{request.method} {request.path}", unknown)


def read_json(raw: bytes) -> dict:
    """A request body: a JSON object, or a ValidationError saying what it is instead."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValidationError(f"request body is not valid UTF-8 (byte {exc.start})") from None
    if not text.strip():
        raise ValidationError("request body is empty; expected a JSON object")
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValidationError(f"request body is not valid JSON: {exc.msg} at line {exc.lineno} "
                              f"column {exc.colno}") from None
    if not isinstance(body, dict):
        raise ValidationError(f"request body must be a JSON object, got {type(body).__name__}")
    return body


# --- rules several APIs' fields share -------------------------------------------------------------------------------

def stop_strings(value, field: str, param: str) -> tuple:
    """Stop strings: a string or a list of them (null = none), each 1..MAX_STOP_CHARS characters, at most
    MAX_STOP_STRINGS; as a tuple without repeats."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if len(items) > MAX_STOP_STRINGS:
        raise ValidationError(f"{field} must be a string or a list of at most {MAX_STOP_STRINGS} strings",
                              param=param)
    for v in items:
        if not 1 <= len(v) <= MAX_STOP_CHARS:
            raise ValidationError(f"{field}: every stop string must have 1 to {MAX_STOP_CHARS} characters, "
                                  f"got {v!r}", param=param)
    return tuple(dict.fromkeys(items))


def stop_token_ids(value, field: str, param: str) -> tuple:
    """More tokens that end the reply: at most MAX_STOP_STRINGS non-negative ids (the vocabulary's bound is the
    served model's: translate.prepare checks it)."""
    if value is None:
        return ()
    if len(value) > MAX_STOP_STRINGS or any(v < 0 for v in value):
        raise ValidationError(f"{field} must be a list of at most {MAX_STOP_STRINGS} token ids (>= 0)", param=param)
    return tuple(value)


# --- the validators' rules as JSON schema, for the OpenAPI document --------------------------------------------------
# (clients and fuzzers read them, validation does not): a field's rule is its json_schema_extra, rules between fields
# a model's (`rules`)

STOP_STRING = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS}
STOP = {"anyOf": [STOP_STRING, {"type": "array", "items": STOP_STRING, "maxItems": MAX_STOP_STRINGS}, {"type": "null"}]}
NOT_BLANK = {"pattern": r"\S"}
GIVEN = {"not": {"type": "null"}}


def when(field: str, schema: dict, then: dict) -> dict:
    """A rule between fields: when `field` is given and matches `schema`, the body matches `then`."""
    return {"if": {"required": [field], "properties": {field: schema}}, "then": then}


def needs(schemas: dict) -> dict:
    """A body that has each field of `schemas`, matching its schema."""
    return {"required": list(schemas), "properties": schemas}


TOOLS_GIVEN = needs({"tools": {"type": "array", "minItems": 1}})         # a body with a tool at least


def at_most_one(schemas: dict) -> list:
    """Rules that at most one field of `schemas` ({field: the schema of its being given}) is given."""
    return [when(field, schema, {"not": {"anyOf": [needs({other: s}) for other, s in schemas.items()
                                                   if other != field]}}) for field, schema in schemas.items()]


def rules(*schemas: dict) -> dict:
    """A model's json_schema_extra: every rule of `schemas` holds."""
    return {"allOf": list(schemas)}


# --- validation -----------------------------------------------------------------------------------------------------

_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "literal"}
_PRUNE_ROUNDS = 4


def _without(body, locations) -> dict:
    """A copy of `body` without the fields at `locations` (pydantic's error locations: keys and list indexes, with a
    union's branch tags among them, which name nothing in the body and are passed over)."""
    out = copy.deepcopy(body)
    for loc in locations:
        parent, key = None, None
        node = out
        for part in loc:
            if isinstance(node, dict) and isinstance(part, str) and part in node:
                parent, key, node = node, part, node[part]
            elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
                parent, key, node = node, part, node[part]
        if isinstance(parent, dict):
            parent.pop(key, None)
    return out


def _path(loc) -> str:
    """A field's path as the API names it: messages[0].content[1].type; a union's branch tags left out."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", part) and part not in _TAGS:
            out += f".{part}" if out else part
    return out


_BOUNDS = {"greater_than_equal": (">=", "ge"), "less_than_equal": ("<=", "le"), "greater_than": (">", "gt"),
           "less_than": ("<", "lt")}
_KINDS = {"int_type": "an integer", "bool_type": "true or false", "float_type": "a number", "string_type": "a string",
          "list_type": "a list", "dict_type": "an object", "model_type": "an object", "model_attributes_type": "an object",
          "none_required": "null (not supported)", "too_short": "non-empty"}


def validate(model: type, body: dict, unknown: str = "field", ignored: Optional[list] = None):
    """`body` as `model`, or a ValidationError naming the first field that is wrong (unknown fields together):
    its path in the message (messages[0].role), the request's field as `param` (TGI's: the parameter).
    With a list as `ignored`, unknown fields are not wrong: they are left out of the body (a copy) and their paths
    appended to the list."""
    for _ in range(_PRUNE_ROUNDS):
        try:
            return model.model_validate(body)
        except PydanticError as exc:
            errors = exc.errors()
        extra = [e for e in errors if e["type"] == "extra_forbidden"]
        if ignored is None or not extra:
            break
        # an unknown field left out can uncover another one inside a part that failed before: a few rounds
        body = _without(body, [e["loc"] for e in extra])
        ignored.extend(sorted({_path(e["loc"]) for e in extra}))
    else:
        errors = [e for e in errors if e["type"] != "extra_forbidden"] or errors
    extra = [e for e in errors if e["type"] == "extra_forbidden"]
    if extra:
        names = sorted({_path(e["loc"]) for e in extra})
        if unknown == "parameter" and all(n.startswith("parameters.") for n in names):
            names = [n[len("parameters."):] for n in names]
        raise ValidationError(f"unknown {unknown}(s): {', '.join(names)}", param=re.split(r"[.\[]", names[0])[0])
    # the first field's error; of a union's branches (a string or a list of parts), the one that got furthest
    top = errors[0]["loc"][:1]
    first = max((e for e in errors if e["loc"][:1] == top), key=lambda e: len(e["loc"]))
    path = _path(first["loc"])
    field = re.split(r"[.\[]", path)[0] or None          # the request's field (TGI's: the parameter)
    if field == "parameters" and "." in path:
        field = re.split(r"[.\[]", path)[1]
    kind, value = first["type"], first.get("input")
    own = (first.get("ctx") or {}).get("error")
    if isinstance(own, GrammarError):                    # a JSON schema that is not one: named by its own field
        raise own
    if isinstance(own, ValidationError):                 # a validator's rule: its message, the path before it
        message = str(own) if not re.search(r"[.\[]", path) else f"{path}: {own}"   # (a nested model's: where)
        raise ValidationError(message, param=own.param if own.param is not None else field)
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
    elif kind == "too_long":
        message = f"{path} must have at most {first['ctx']['max_length']} items"
    elif kind == "string_pattern_mismatch":
        message = f"{path} must match {first['ctx']['pattern']}, got {value!r}"
    else:
        message = f"{path}: {first['msg']}"
    raise ValidationError(message, param=field)


@dataclass
class UnknownFields:
    """What a request's unknown fields get (`serving_config.unknown_fields`): `ignore` leaves them out and names each
    once in the log (by route and path: a client sends the same ones on every request); `reject` refuses the body
    with a 400 naming them."""
    policy: str = "ignore"
    _named: set = field(default_factory=set)

    def validate(self, model: type, body: dict, route: str, unknown: str = "field"):
        """`body` as `model` (`validate`), its unknown fields as the policy says."""
        if self.policy == "reject":
            return validate(model, body, unknown)
        ignored: list = []
        out = validate(model, body, unknown, ignored)
        self._name_once(route, f"ignored unknown {unknown}(s)", ignored,
                        "serving_config.unknown_fields=reject refuses them")
        # what a body's own model leaves out of a served request (hosted tools: `left_out()`), named the same way
        self._name_once(route, "left out", out.left_out(), "not served here")
        return out

    def _name_once(self, route: str, what: str, names: list, why: str) -> None:
        new = [name for name in dict.fromkeys(names) if (route, name) not in self._named]
        if new:
            self._named.update((route, name) for name in new)
            logger.warning("%s: %s %s (%s; named once)", route, what, ", ".join(new), why)
