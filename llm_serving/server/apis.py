"""The one registry of the server's HTTP APIs (`APIS`): for each, the module that adds its routes, the module of its
request bodies (the source of its OpenAPI operations) and its error shape (the body its errors get and the schema
the document gives that body). app.py sets the routes up and shapes errors from it, api/document.py writes the
document from it; a new API is a row here."""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Callable

from llm_serving.server import (routes_anthropic, routes_embeddings, routes_llm_serving, routes_ollama, routes_openai,
                                routes_responses)
from llm_serving.server.api import anthropic, embeddings, ollama, openai, responses, tgi


@dataclass(frozen=True)
class ErrorShape:
    """An API's error body: `body(status, message, kind, param)` writes it; `schema`, named `name` among the
    document's components, describes it (tests/unit/test_api_models.py holds the two to each other)."""
    name: str
    body: Callable[..., dict]
    schema: dict


_TEXT, _TEXT_OR_NULL = {"type": "string"}, {"type": ["string", "null"]}
OPENAI_ERROR = ErrorShape("OpenAIError", routes_openai.error_body, {
    "type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": _TEXT, "type": _TEXT, "param": _TEXT_OR_NULL, "code": _TEXT_OR_NULL}}}})
TGI_ERROR = ErrorShape("TGIError", routes_llm_serving.error_body, {
    "type": "object", "required": ["error", "error_type"], "properties": {"error": _TEXT, "error_type": _TEXT}})
ANTHROPIC_ERROR = ErrorShape("AnthropicError", routes_anthropic.error_body, {
    "type": "object", "required": ["type", "error"], "properties": {
        "type": {"const": "error"},
        "error": {"type": "object", "required": ["type", "message"], "properties": {"type": _TEXT, "message": _TEXT}}}})
OLLAMA_ERROR = ErrorShape("OllamaError", routes_ollama.error_body, {
    "type": "object", "required": ["error"], "properties": {"error": _TEXT}})
ERROR_SHAPES = (OPENAI_ERROR, TGI_ERROR, ANTHROPIC_ERROR, OLLAMA_ERROR)
DEFAULT_ERROR = TGI_ERROR       # the server's own routes' (/health, /info, ...) and those of an API without `owns`


@dataclass(frozen=True)
class Api:
    """One HTTP API. `routes`: its routes module, with `add_routes(app)`, and `owns(path)` when its paths get `error`
    (without it, its paths get the shape of the API that owns them, or the default). `bodies`: its module in
    server/api/, with `ROUTES` (POSTs with a body: [(path, request model, summary)]) and, if it has them,
    `OPERATIONS` (without one: [(method, path, summary)]). `name`: the prefix the document gives its models where
    two APIs have one of the same name (OllamaToolCall)."""
    name: str
    routes: ModuleType
    bodies: ModuleType
    error: ErrorShape

    def owns(self, path: str) -> bool:
        return hasattr(self.routes, "owns") and self.routes.owns(path)


# The first API that owns a path shapes its errors: an API whose paths are under /v1/ too comes before OpenAI's.
APIS = (
    Api("TGI", routes_llm_serving, tgi, TGI_ERROR),
    Api("Anthropic", routes_anthropic, anthropic, ANTHROPIC_ERROR),
    Api("Responses", routes_responses, responses, OPENAI_ERROR),        # (its paths are OpenAI's /v1/)
    Api("Ollama", routes_ollama, ollama, OLLAMA_ERROR),
    Api("Embeddings", routes_embeddings, embeddings, OPENAI_ERROR),     # (outside /v1/ too)
    Api("OpenAI", routes_openai, openai, OPENAI_ERROR),
)


def error_shape(path: str) -> ErrorShape:
    """The error shape of `path`'s answers: its owner's (the first API in APIS that owns it), or the default."""
    return next((api.error for api in APIS if api.owns(path)), DEFAULT_ERROR)
