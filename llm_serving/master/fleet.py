"""The models one server serves (issue 52): each an engine of its own (its agent group, scheduler, KV cache, prefix
cache and statistics), loaded on demand, unloaded when idle, found by name.

A model is listed from the start (`ModelSpec`: its name, its checkpoint, its settings over the server's, its
keep_alive) and is `unloaded`, `loading`, `loaded` or `failed` (its load's error kept, said to the requests that waited
and in /v1/models; a later request tries again). The default model (`llm-serving start --model`'s first, or the
configured one) is loaded at start, as a one-model server always was, and stays unless its keep_alive says otherwise.

- `acquire(name)`: the engine serving `name` (a model, or a LoRA adapter of a loaded one), loading it first when it is
  not loaded (bounded by `serving_config.load_timeout_s`; two requests for a model that is loading wait for the same
  load). The caller holds it until `release`: a model is never unloaded while a caller holds it or its engine has
  requests in flight.
- Unloading: a loaded model idle for its keep_alive (`serving_config.keep_alive`, or the model's; None never, 0 at
  once) is stopped by the fleet's sweep; `unload(name)` stops one now (refused while it serves). Before a load, when
  the loaded models' sizes and the new one's would pass `serving_config.memory_budget`, idle models are unloaded, least
  recently used first; if that cannot make room the load fails with `FleetFullError` (503) naming the models and sizes.
  A model's size is its checkpoint's bytes plus its KV cache's (its decided `pa_config.num_blocks`).
- Stopping an engine stops its agents and frees its shared memory and ports (Engine.stop).

The fleet knows nothing of HTTP: the server asks it for engines (server/app.py `engine_for`)."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

from llm_serving.agents import launch
from llm_serving.config import Config, ConfigError, config_from_dict, parse_bytes, parse_duration
from llm_serving.master import spare_agents

logger = logging.getLogger(__name__)

STATES = ("loaded", "loading", "unloaded", "failed")     # a model's, as /v1/models says it
SWEEP_S = 1.0               # how often idle models are checked against their keep_alive


class UnknownModelError(KeyError):
    """No model or LoRA adapter of that name is served here (404)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown model"


class FleetFullError(RuntimeError):
    """A model cannot be loaded: the memory budget is taken by models that serve requests (503)."""


class ModelLoadError(RuntimeError):
    """A model failed to load (its error, said to the requests that waited for it; 503)."""


class ModelBusyError(RuntimeError):
    """An unload asked for a model that is serving requests (409)."""


@dataclass(frozen=True)
class ModelSpec:
    """A model the server may serve: its name, checkpoint (a path as `--model` takes it), settings over the server's
    (`section.key=value`) and keep_alive in seconds (None: the server's; a negative number: never)."""
    name: str
    path: Optional[str]
    overrides: tuple = ()
    keep_alive: Optional[float] = None


@dataclass
class ModelEntry:
    spec: ModelSpec
    state: str = "unloaded"
    engine: object = None
    error: Optional[str] = None
    last_used: float = 0.0
    holders: int = 0
    size_bytes: int = 0
    load_s: Optional[float] = None
    loading: Optional[asyncio.Task] = None
    keep_alive: Optional[float] = None          # seconds idle before unloading; None: never
    loads: int = 0
    waits: int = 0                              # requests that waited for a load, and their seconds waited
    wait_s: float = 0.0

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def busy(self) -> bool:
        return self.holders > 0 or bool(self.engine is not None and self.engine.requests)

    def describe(self) -> dict:
        """The model as /v1/models and /api/ps say it."""
        return {"state": self.state, "error": self.error, "size_bytes": self.size_bytes or None,
                "load_s": self.load_s, "keep_alive_s": self.keep_alive, "last_used": self.last_used or None,
                "path": self.spec.path}


def models_in(directory: str) -> list:
    """The checkpoints in a models directory, by name: each subdirectory with a config.json (or a .gguf / llama2.c
    .bin in it), each .gguf and .bin file; a name is the entry's name without its extension."""
    found = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if entry.name.startswith("."):
            continue
        if entry.is_dir():
            files = os.listdir(entry.path)
            if "config.json" in files or any(f.endswith((".gguf", ".bin")) for f in files):
                found.append(ModelSpec(entry.name, entry.path))
        elif entry.name.endswith((".gguf", ".bin")):
            found.append(ModelSpec(os.path.splitext(entry.name)[0], entry.path))
    return found


def specs_from_config(config: Config, default_name: str, default_path: str, extra_paths: tuple = ()) -> list:
    """Every model a config lists, the default first: `--model` paths given after the first (extra_paths),
    `serving_config.models`, then `serving_config.models_dir`'s checkpoints (a name listed twice: the first wins)."""
    from llm_serving.startup import resolve_model

    specs = [ModelSpec(default_name, default_path)]
    for path in extra_paths:
        raw = config.to_dict()
        raw["model_config"]["model_path"] = path
        raw["model_config"]["model_name"] = None
        _, name, _ = resolve_model(config_from_dict(raw))
        specs.append(ModelSpec(name, path))
    for item in config.serving_config.models:
        sets = tuple(f"{k}={json.dumps(v)}" for k, v in (item.get("set") or {}).items())   # (JSON is YAML)
        specs.append(ModelSpec(item["name"], item["path"], sets,
                               None if item.get("keep_alive") is None else parse_duration(item["keep_alive"], -1.0)))
    if config.serving_config.models_dir:
        specs += models_in(config.serving_config.models_dir)
    seen, unique = set(), []
    for spec in specs:
        if spec.name in seen:
            logger.warning("model %r is listed more than once; serving the first (%s)", spec.name,
                           next(s.path for s in unique if s.name == spec.name))
            continue
        seen.add(spec.name)
        unique.append(spec)
    return unique


class Fleet:
    """The server's models by name (see the module docstring). `base`: the server's settings as given (not yet
    decided for a model: each model's are decided when it loads). `prepare(config)` makes a model's start-up
    decisions and reads its tokenizer (startup.decide, tokenization.load_tokenizer), in a thread: (decided config,
    model path, tokenizer); `make_engine(config, tokenizer, model_dir, name)` builds its engine (master/engine.Engine,
    or a test's)."""

    def __init__(self, base: Config, specs: list, make_engine: Callable, prepare: Callable,
                 clock: Callable[[], float] = time.monotonic, start_spare: Optional[Callable[[bool], None]] = None):
        if not specs:
            raise ValueError("Fleet: no models")
        self.base = base
        sc = base.serving_config
        self.default_keep_alive = parse_duration(sc.keep_alive, -1.0)
        self.load_timeout_s = sc.load_timeout_s
        self.budget = parse_bytes(sc.memory_budget) if sc.memory_budget != "auto" else _auto_budget()
        self.entries = {s.name: ModelEntry(s) for s in specs}
        self.default = specs[0].name
        self.make_engine = make_engine
        self.prepare = prepare
        self.clock = clock
        self.listeners: list = []            # callables(name, engine or None): a model loaded or unloaded
        self._stopping: set = set()          # engines' stops under way (each runs to its end)
        self._sweeper: Optional[asyncio.Task] = None
        self._draining: Optional[str] = None
        self._preloaded: Optional[tuple] = None     # the default model's decisions, made before the server started
        self.start_spare = start_spare       # start_spare(huge_pages): a spare agent for the next load, or None: none

    # --- the models ---------------------------------------------------------------------------------

    @property
    def names(self) -> list:
        return list(self.entries)

    def loaded(self) -> list:
        return [e for e in self.entries.values() if e.state == "loaded"]

    def entry_of(self, name: Optional[str]) -> ModelEntry:
        """The entry serving `name`: a model's name, or a LoRA adapter of a loaded model; None: the default model."""
        if name is None:
            return self.entries[self.default]
        entry = self.entries.get(name)
        if entry is not None:
            return entry
        for entry in self.loaded():
            if name in entry.engine.lora_paths:
                return entry
        served = [n for entry in self.entries.values()
                  for n in [entry.name, *(entry.engine.lora_paths if entry.state == "loaded" else ())]]
        raise UnknownModelError(f"the model {name!r} does not exist; this server serves "
                                f"{', '.join(map(repr, served))}")

    def default_engine(self):
        """The default model's engine (None while it is not loaded)."""
        return self.entries[self.default].engine

    def engines(self) -> list:
        return [(e.name, e.engine) for e in self.loaded()]

    # --- holding an engine --------------------------------------------------------------------------

    async def acquire(self, name: Optional[str]):
        """The engine serving `name`, loaded first if it is not (the model's `waits` and `wait_s` count the requests
        that waited and their seconds); held until `release(engine)`."""
        entry = self.entry_of(name)
        t0 = self.clock()
        waited = False
        while entry.state != "loaded":       # (a load that succeeded may be undone before this waiter runs: again)
            if self._draining:
                raise ModelLoadError(self._draining)
            await self._wait_loaded(entry)
            waited = True
        entry.holders += 1
        entry.last_used = self.clock()
        if waited:
            entry.waits += 1
            entry.wait_s += entry.last_used - t0
        return entry.engine

    def _entry_running(self, engine) -> Optional[ModelEntry]:
        return next((entry for entry in self.entries.values() if entry.engine is engine), None)

    def set_keep_alive(self, engine, seconds: float) -> None:
        """The model of `engine` stays loaded this long after its last request (a request's own keep_alive, as
        Ollama's; negative: for good, 0: unloaded once idle)."""
        entry = self._entry_running(engine)
        if entry is not None:
            entry.keep_alive = None if seconds < 0 else seconds

    def release(self, engine) -> None:
        entry = self._entry_running(engine)
        if entry is not None:
            entry.holders = max(entry.holders - 1, 0)
            entry.last_used = self.clock()

    async def _wait_loaded(self, entry: ModelEntry) -> None:
        if entry.loading is None:
            entry.loading = asyncio.ensure_future(self._load(entry))
        try:     # (the outcome of the load this waiter waited for: a later attempt may have begun since)
            error = await asyncio.wait_for(asyncio.shield(entry.loading), self.load_timeout_s)
        except asyncio.TimeoutError:
            raise ModelLoadError(f"model {entry.name!r} did not load within serving_config.load_timeout_s="
                                 f"{self.load_timeout_s:g} s; it is still loading") from None
        if error is not None:
            raise ModelLoadError(f"model {entry.name!r} failed to load: {error}")

    # --- loading and unloading ----------------------------------------------------------------------

    def _config_of(self, spec: ModelSpec) -> Config:
        """The model's settings: the server's, its checkpoint, its own overrides, its agents on free ports."""
        raw = self.base.to_dict()
        mc = raw["model_config"]
        mc["model_path"], mc["model_name"] = spec.path, spec.name
        raw["serving_config"]["agent_ports"] = [0] * len(raw["serving_config"]["agent_ports"])
        raw["serving_config"]["models"], raw["serving_config"]["models_dir"] = [], None
        return config_from_dict(raw, spec.overrides)

    async def _load(self, entry: ModelEntry) -> Optional[str]:
        """Load a model (its decisions in a thread, room made in the budget, its engine started); the entry says how
        it went, and so does the result: None, or the load's error. Never raises: a failure is the entry's state and
        error."""
        t0 = self.clock()
        entry.state, entry.error = "loading", None
        try:
            if entry.name == self.default and entry.loads == 0 and self._preloaded is not None:
                config, model_dir, tokenizer = self._preloaded
            else:
                config, model_dir, tokenizer = await asyncio.to_thread(self.prepare, self._config_of(entry.spec))
            size = _model_bytes(model_dir) + _kv_bytes(config, model_dir)
            await self._make_room(entry, size)
            engine = self.make_engine(config, tokenizer, model_dir, entry.name)
            try:
                await engine.start()
            except BaseException:
                await engine.stop()
                raise
        except asyncio.CancelledError:
            entry.state, entry.error = "failed", "the load was cancelled (the server is stopping)"
            raise
        except (Exception, ConfigError) as exc:          # noqa: BLE001 - the model's failure, said to its requests
            entry.state, entry.error = "failed", f"{type(exc).__name__}: {exc}" if not isinstance(
                exc, (ConfigError, FleetFullError)) else str(exc)
            logger.error("model %r failed to load: %s", entry.name, entry.error)
            return entry.error
        finally:
            entry.loading = None
            entry.loads += 1
        entry.engine, entry.size_bytes, entry.state = engine, size, "loaded"
        entry.load_s = self.clock() - t0
        entry.last_used = self.clock()
        keep = entry.spec.keep_alive
        if keep is None:
            keep = None if entry.name == self.default else self.default_keep_alive
        entry.keep_alive = None if keep is None or keep < 0 else keep
        logger.info("model %r loaded in %.1f s (%.0f MiB with its KV cache)", entry.name, entry.load_s, size / 2**20)
        for listener in self.listeners:
            listener(entry.name, engine)
        return None

    async def _make_room(self, entry: ModelEntry, size: int) -> None:
        """Unload idle models, least recently used first, until `size` more bytes fit the budget; FleetFullError if
        the models that serve requests leave no room."""
        def used() -> int:
            return sum(e.size_bytes for e in self.entries.values() if e.state == "loaded" and e is not entry)
        while used() + size > self.budget:
            idle = sorted((e for e in self.loaded() if e is not entry and not e.busy), key=lambda e: e.last_used)
            if not idle:
                held = ", ".join(f"{e.name} ({e.size_bytes / 2**20:.0f} MiB)" for e in self.loaded())
                raise FleetFullError(f"model {entry.name!r} needs {size / 2**20:.0f} MiB and the memory budget "
                                     f"(serving_config.memory_budget, {self.budget / 2**20:.0f} MiB) is taken by "
                                     f"models serving requests: {held}")
            logger.info("unloading model %r (least recently used) to make room for %r", idle[0].name, entry.name)
            await self._unload(idle[0])

    async def unload(self, name: str) -> dict:
        """Stop a loaded model now (ModelBusyError while it serves); its entry stays listed, unloaded."""
        entry = self.entry_of(name)
        if entry.name != name:
            raise UnknownModelError(f"{name!r} is a LoRA adapter of {entry.name!r}: unload the model, or the "
                                    f"adapter through /v1/unload_lora_adapter")
        if entry.state == "loading":
            raise ModelBusyError(f"model {name!r} is loading; unload it once it has")
        if entry.busy:
            raise ModelBusyError(f"model {name!r} is serving {len(entry.engine.requests)} request(s); it unloads "
                                 "when they are done and its keep_alive has passed")
        if entry.state == "loaded":
            await self._unload(entry)
        return self.describe(name)

    async def load(self, name: str) -> dict:
        entry = self.entry_of(name)
        if entry.state != "loaded":
            await self._wait_loaded(entry)
        entry.last_used = self.clock()
        return self.describe(entry.name)

    async def _unload(self, entry: ModelEntry) -> None:
        """Stop a model's engine; the stop runs to its end whoever waits for it (a client that went away, the sweep
        cancelled as the server stops: `stop` waits for it), so its agents and segments are always freed."""
        engine = entry.engine
        entry.engine, entry.state, entry.size_bytes = None, "unloaded", 0
        for listener in self.listeners:
            listener(entry.name, None)
        task = asyncio.ensure_future(self._stop_engine(entry.name, engine))
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)
        await asyncio.shield(task)

    @staticmethod
    async def _stop_engine(name: str, engine) -> None:
        await engine.stop()
        logger.info("model %r unloaded", name)

    def describe(self, name: str) -> dict:
        return {"id": name, **self.entries[name].describe()}

    # --- the fleet's life ---------------------------------------------------------------------------

    async def start(self, preloaded: tuple) -> None:
        """Load the default model (preloaded: its decided config, path and tokenizer, as `llm-serving start` decided
        them before anything started); raise its error if it fails, as a one-model server does."""
        self._preloaded = preloaded
        entry = self.entries[self.default]
        entry.loading = asyncio.ensure_future(self._load(entry))
        await asyncio.shield(entry.loading)
        if entry.state != "loaded":
            raise ModelLoadError(f"model {entry.name!r} failed to load: {entry.error}")
        self._sweeper = asyncio.ensure_future(self._sweep())

    async def _sweep(self) -> None:
        """Unload the models idle for their keep_alive; keep a spare agent for the next load."""
        while True:
            await asyncio.sleep(SWEEP_S)
            self._keep_spare()
            now = self.clock()
            for entry in self.loaded():
                if entry.keep_alive is not None and not entry.busy and now - entry.last_used >= entry.keep_alive:
                    logger.info("model %r idle for %.0f s (keep_alive %g s): unloading", entry.name,
                                now - entry.last_used, entry.keep_alive)
                    try:
                        await self._unload(entry)
                    except Exception:      # noqa: BLE001 - one model's stop must not end the sweep
                        logger.exception("unloading model %r failed", entry.name)

    def _keep_spare(self) -> None:
        """With several models (serving_config.spare_agent auto) or always (on): a spare agent waiting for the next
        load (`start_spare`: master/spare_agents.start), of the kind the first model not loaded needs, started while
        nothing is served or loading (its import takes a core for a second)."""
        sc = self.base.serving_config
        if self.start_spare is None or not spare_agents.wanted(sc, len(self.entries)) or self._draining is not None:
            return
        if self.requests or any(e.loading is not None for e in self.entries.values()):
            return
        waiting = [e for e in self.entries.values() if e.engine is None] or list(self.entries.values())
        self.start_spare(launch.agent_huge_pages(sc.agent_huge_pages, waiting[0].spec.path))

    def drain(self, reason: str) -> None:
        self._draining = reason
        for _, engine in self.engines():
            engine.drain(reason)

    @property
    def requests(self) -> int:
        return sum(len(engine.requests) for _, engine in self.engines())

    def abort_all(self, reason: str) -> int:
        return sum(engine.abort_all(reason) for _, engine in self.engines())

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._stopping:                   # (unloads under way finish first)
            await asyncio.gather(*self._stopping, return_exceptions=True)
        for entry in self.entries.values():
            if entry.loading is not None:
                entry.loading.cancel()
        for entry in list(self.entries.values()):
            if entry.engine is not None:
                engine, entry.engine, entry.state = entry.engine, None, "unloaded"
                await engine.stop()


def _model_bytes(model_dir: str) -> int:
    """A checkpoint's bytes on disk (what loading it maps or reads)."""
    if os.path.isfile(model_dir):
        return os.path.getsize(model_dir)
    total = 0
    for root, _, files in os.walk(model_dir):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files
                     if f.endswith((".safetensors", ".gguf", ".bin", ".ckpt")))
    return total


def _kv_bytes(config: Config, model_dir: str) -> int:
    from llm_serving.startup.kv_memory import bytes_per_block, model_shape

    try:
        shape = model_shape(model_dir)
    except Exception:      # noqa: BLE001 - a size estimate only
        return 0
    pa = config.pa_config
    layers = config.model_config.num_layers or shape.num_layers
    return int(pa.num_blocks) * bytes_per_block(layers, shape.num_kv_heads, shape.head_dim, pa.block_size,
                                                config.kv_cache_type)


def _auto_budget() -> int:
    import psutil
    return int(psutil.virtual_memory().total * 0.9)
