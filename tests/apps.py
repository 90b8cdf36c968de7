"""The server's app for unit tests: `create_app` (server/app.py) around a fleet of one model already loaded, whose
engine is the test's stand-in, so that a route test goes through the middlewares and routes a server has."""
from __future__ import annotations

from llm_serving.config import config_from_dict
from llm_serving.master.fleet import Fleet, ModelSpec
from llm_serving.server.app import create_app


def fleet_of_one(engine, serving: dict = None) -> Fleet:
    """A fleet whose one model is `engine`, not yet marked loaded (`load`; it never loads or unloads by itself: no
    sweep runs); `serving`: serving_config settings over the defaults (an api_key, unknown_fields)."""
    base = config_from_dict({"serving_config": {"access_log": False, **(serving or {})}})

    def never(*_):
        raise AssertionError("a fleet of one never loads")
    return Fleet(base, [ModelSpec(getattr(engine, "model_name", "m"), None)], never, never)


def load(fleet: Fleet, engine) -> None:
    entry = fleet.entries[fleet.default]
    entry.state, entry.engine = "loaded", engine


def app_of_one(engine, serving: dict = None):
    """The server's app (every route, every middleware) around `engine` (a fleet of one). Built before the model is
    marked loaded: /metrics' collector, registered then, reads a loaded engine's scheduler, which a stand-in lacks."""
    fleet = fleet_of_one(engine, serving)
    app = create_app(fleet)
    load(fleet, engine)
    return app
