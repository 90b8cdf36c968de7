"""Typed keys for state shared through the aiohttp application."""
from aiohttp import web

FLEET = web.AppKey("fleet", object)             # master/fleet.Fleet: the server's models by name (server/served.py)
METRICS = web.AppKey("metrics", object)
RESPONSES = web.AppKey("responses", object)      # routes_responses.ResponseStore: stored Responses
UNKNOWN_FIELDS = web.AppKey("unknown_fields", object)   # api/base.UnknownFields: what unknown body fields get
LOAD_WAIT = web.RequestKey("load_wait_s", float)   # seconds a request waited for its model to load (served.py)
