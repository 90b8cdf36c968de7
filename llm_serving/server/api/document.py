"""The server's OpenAPI 3.1 document (GET /openapi.json), its request bodies the models the routes validate with."""
from __future__ import annotations

import json
import re

from pydantic.json_schema import models_json_schema

from llm_serving.server.api import anthropic, ollama, openai, responses, tgi

# every API module's routes: ROUTES, POSTs with a body [(path, request model, summary)], and OPERATIONS without one
# [(method, path, summary)] if it has them; a new API adds its module here
API_MODULES = (openai, tgi, responses, anthropic, ollama)
API_NAMES = {"openai": "OpenAI", "tgi": "TGI", "responses": "Responses", "anthropic": "Anthropic", "ollama": "Ollama"}
# the server's own operations without a body
GETS = [("/health", "200 when the engine serves"), ("/info", "the served model and limits (TGI's)"),
        ("/v1/models", "the served model and its LoRA adapters"), ("/metrics", "Prometheus metrics"),
        ("/stats", "the engine's counters"), ("/openapi.json", "this document")]


def openapi(version: str) -> dict:
    """The OpenAPI 3.1 document of the HTTP API, its request bodies from the API models."""
    routes = [route for module in API_MODULES for route in module.ROUTES]
    refs, defs = models_json_schema([(m, "validation") for m in dict.fromkeys(m for _, m, _ in routes)],
                                    ref_template="#/components/schemas/{model}")
    error = {"description": "a bad request: the API's error shape, naming the field"}
    paths: dict = {}
    for path, model, summary in routes:
        op = {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {
            "schema": refs[(model, "validation")]}}},
              "responses": {"200": {"description": "the reply (text/event-stream when streamed)"}, "400": error}}
        if "{model}" in path:
            op["parameters"] = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]
        paths[path] = {"post": op}
    others = [("get", path, summary) for path, summary in GETS]
    others += [op for module in API_MODULES for op in getattr(module, "OPERATIONS", ())]
    for method, path, summary in others:
        op = {"summary": summary, "responses": {"200": {"description": summary}}}
        names = [part[1:-1] for part in path.split("/") if part.startswith("{")]
        if names:
            op["parameters"] = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
                                for n in names]
        paths.setdefault(path, {})[method] = op
    doc = {"openapi": "3.1.0", "info": {"title": "llm-serving", "version": version}, "paths": paths,
           "components": {"schemas": defs.get("$defs", {})}}
    # two APIs' models of one name (a ToolCall in OpenAI's and Ollama's) are told apart by their module, which
    # pydantic spells as a path: named by their API instead (OllamaToolCall)
    text = re.sub(r"llm_serving__server__api__([a-z]+)__(\w+)", lambda m: API_NAMES.get(m[1], m[1].title()) + m[2],
                  json.dumps(doc))
    return json.loads(text)
