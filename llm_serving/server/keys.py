"""Typed keys for state shared through the aiohttp application."""
from aiohttp import web

ENGINE = web.AppKey("engine", object)
METRICS = web.AppKey("metrics", object)
RESPONSES = web.AppKey("responses", object)      # routes_responses.ResponseStore: stored Responses
