"""master/fleet.py with fake engines (no agents, no MindSpore): one load for concurrent requests, keep_alive, the
memory budget's least-recently-used unloading, a load's failure kept and said, names and adapters resolved."""
import asyncio
import json

import pytest

from llm_serving.config import config_from_dict
from llm_serving.config import ConfigError, parse_bytes, parse_duration
from llm_serving.master.fleet import (Fleet, ModelBusyError, ModelLoadError, ModelSpec, UnknownModelError, models_in,
                                      specs_from_config)

MiB = 1 << 20


class FakeEngine:
    def __init__(self, config, tokenizer, model_dir, name, log):
        self.config, self.model_dir, self.model_name, self.log = config, model_dir, name, log
        self.requests, self.lora_paths = {}, {}
        self.stopped = False

    async def start(self):
        self.log.append(("start", self.model_name))
        await asyncio.sleep(0.05)
        if "broken" in self.model_dir:
            raise RuntimeError("agent 0 failed to start: the checkpoint is broken")

    async def stop(self):
        self.stopped = True
        self.log.append(("stop", self.model_name))


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def make_fleet(tmp_path, names=("a", "b", "c"), sizes=None, budget=None, keep_alive="5m", clock=None):
    """A fleet of models whose checkpoints are files of `sizes` MiB (default 1 each)."""
    sizes = sizes or {}
    specs = []
    for name in names:
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(b"\0" * int(sizes.get(name, 1) * MiB))
        specs.append(ModelSpec(name, str(path)))
    sets = [f"serving_config.keep_alive={keep_alive}", "pa_config.num_blocks=4"]
    if budget is not None:
        sets.append(f"serving_config.memory_budget={budget}")
    base = config_from_dict({}, tuple(sets))
    log = []

    def prepare(config):
        return config, config.model_config.model_path, None

    fleet = Fleet(base, specs, lambda c, t, d, n: FakeEngine(c, t, d, n, log), prepare,
                  **({"clock": clock} if clock else {}))
    return fleet, log


def run(coro):
    return asyncio.run(coro)


def test_the_default_loads_at_start_and_two_requests_for_another_load_it_once(tmp_path):
    async def main():
        fleet, log = make_fleet(tmp_path)
        await fleet.start((fleet.base, str(tmp_path / "a.gguf"), None))
        assert [e.state for e in fleet.entries.values()] == ["loaded", "unloaded", "unloaded"]
        first, second = await asyncio.gather(fleet.acquire("b"), fleet.acquire("b"))
        assert first is second and log.count(("start", "b")) == 1
        assert fleet.entries["b"].holders == 2 and fleet.entries["b"].load_s is not None
        assert fleet.entry_of(None).name == "a" and fleet.default_engine().model_name == "a"
        await fleet.stop()
        assert ("stop", "a") in log and ("stop", "b") in log
    run(main())


def test_an_idle_model_unloads_after_its_keep_alive_but_not_while_held_or_serving(tmp_path):
    async def main():
        clock = Clock()
        fleet, log = make_fleet(tmp_path, keep_alive="10s", clock=clock)
        await fleet.start((fleet.base, str(tmp_path / "a.gguf"), None))
        engine = await fleet.acquire("b")
        assert fleet.entries["b"].keep_alive == 10.0 and fleet.entries["a"].keep_alive is None   # the default stays
        clock.now += 60
        await asyncio.sleep(1.3)                         # a sweep: b is held
        assert fleet.entries["b"].state == "loaded"
        fleet.release(engine)
        engine.requests["r1"] = object()                 # a request in flight
        clock.now += 60
        await asyncio.sleep(1.1)
        assert fleet.entries["b"].state == "loaded"
        engine.requests.clear()
        clock.now += 60
        await asyncio.sleep(1.1)
        assert fleet.entries["b"].state == "unloaded" and engine.stopped
        assert fleet.entries["a"].state == "loaded"
        again = await fleet.acquire("b")                  # loaded again by the next request
        assert again is not engine and log.count(("start", "b")) == 2
        fleet.set_keep_alive(again, 0)                    # Ollama's keep_alive 0: unloaded once idle
        fleet.release(again)
        await asyncio.sleep(1.1)
        assert fleet.entries["b"].state == "unloaded"
        await fleet.stop()
    run(main())


def test_the_budget_unloads_the_least_recently_used_idle_model_or_refuses_naming_them(tmp_path):
    async def main():
        clock = Clock()
        sizes = {"a": 4, "b": 4, "c": 4}
        fleet, log = make_fleet(tmp_path, sizes=sizes, budget=f"{9 * MiB}", clock=clock)
        await fleet.start((fleet.base, str(tmp_path / "a.gguf"), None))
        b = await fleet.acquire("b")
        fleet.release(b)
        clock.now += 1
        a = await fleet.acquire("a")                     # a used after b: b is the least recently used
        fleet.release(a)
        clock.now += 1
        await fleet.acquire("c")                         # 4 + 4 + 4 > 9: b goes
        assert [fleet.entries[n].state for n in "abc"] == ["loaded", "unloaded", "loaded"]
        assert log.index(("stop", "b")) < log.index(("start", "c"))
        a = await fleet.acquire("a")                     # now a and c are both held
        with pytest.raises(ModelLoadError, match=r"needs 4 MiB .* a \(4 MiB\), c \(4 MiB\)"):
            await fleet.acquire("b")
        assert fleet.entries["b"].state == "failed" and "memory budget" in fleet.entries["b"].error
        await fleet.stop()
    run(main())


def test_a_failed_load_is_said_to_its_requests_kept_in_the_list_and_tried_again(tmp_path):
    async def main():
        fleet, log = make_fleet(tmp_path, names=("a", "broken"))
        await fleet.start((fleet.base, str(tmp_path / "a.gguf"), None))
        for _ in range(2):
            with pytest.raises(ModelLoadError, match="the checkpoint is broken"):
                await fleet.acquire("broken")
            assert fleet.describe("broken")["state"] == "failed"
            assert "the checkpoint is broken" in fleet.describe("broken")["error"]
        assert log.count(("start", "broken")) == 2 and log.count(("stop", "broken")) == 2   # stopped after failing
        assert (await fleet.acquire("a")).model_name == "a"
        await fleet.stop()
    run(main())


def test_names_adapters_and_explicit_unloads(tmp_path):
    async def main():
        fleet, _ = make_fleet(tmp_path)
        await fleet.start((fleet.base, str(tmp_path / "a.gguf"), None))
        fleet.default_engine().lora_paths["a-tales"] = "/adapters/tales"
        assert (await fleet.acquire("a-tales")).model_name == "a"          # a loaded model's adapter
        with pytest.raises(UnknownModelError, match=r"'nope' does not exist; .*'a', 'a-tales', 'b', 'c'"):
            await fleet.acquire("nope")
        b = await fleet.acquire("b")
        with pytest.raises(ModelBusyError):
            await fleet.unload("b")
        fleet.release(b)
        assert (await fleet.unload("b"))["state"] == "unloaded"
        assert (await fleet.load("c"))["state"] == "loaded"
        await fleet.stop()
    run(main())


def test_models_are_listed_from_the_config_the_command_line_and_a_directory(tmp_path):
    models = tmp_path / "models"
    (models / "tales").mkdir(parents=True)
    (models / "tales" / "config.json").write_text(json.dumps({}))
    (models / "small.gguf").write_bytes(b"GGUF")
    (models / "notes").mkdir()
    assert [(s.name, s.path) for s in models_in(str(models))] == [("small", str(models / "small.gguf")),
                                                                  ("tales", str(models / "tales"))]
    config = config_from_dict({"serving_config": {"models_dir": str(models), "models": [
        {"name": "chat", "path": "/m/chat", "keep_alive": "30s", "set": {"pa_config.num_blocks": 64}},
        {"name": "tales", "path": "/m/other"}]}})
    specs = specs_from_config(config, "default", "/m/default")
    assert [(s.name, s.path) for s in specs] == [("default", "/m/default"), ("chat", "/m/chat"),
                                                 ("tales", "/m/other"), ("small", str(models / "small.gguf"))]
    assert specs[1].keep_alive == 30.0 and specs[1].overrides == ("pa_config.num_blocks=64",)


def test_keep_alive_and_budget_settings_read_as_ollama_writes_them_and_bad_ones_are_named():
    assert [parse_duration(v) for v in ("5m", "30s", "1h30m", 300, "0", -1, "-1")] == \
        [300.0, 30.0, 5400.0, 300.0, 0.0, -1.0, -1.0]
    assert parse_bytes("12GiB") == 12 << 30 and parse_bytes("500MB") == 500_000_000 and parse_bytes(4096) == 4096
    for key, value, why in (("keep_alive", "soon", "duration"), ("memory_budget", "lots", "size"),
                            ("models", [{"name": "x"}], "name and a path"),
                            ("models", [{"name": "x", "path": "/p", "extra": 1}], "keys are"),
                            ("models", [{"name": "x", "path": "/p"}, {"name": "x", "path": "/q"}], "distinct")):
        with pytest.raises(ConfigError, match=why):
            config_from_dict({"serving_config": {key: value}})


@pytest.mark.parametrize("setting,names,want", [("auto", ("a", "b"), True), ("auto", ("a",), False),
                                                ("on", ("a",), True), ("off", ("a", "b"), False)])
def test_a_spare_agent_is_kept_for_the_next_load_only_when_idle(tmp_path, setting, names, want):
    """master/fleet.py's sweep keeps a spare agent waiting (master/spare_agents.py) where the setting asks for one
    (auto: with several models), of the huge-pages kind the first model not loaded needs, and starts it only while
    nothing is served or loading."""
    async def main():
        fleet, _ = make_fleet(tmp_path, names=names)
        fleet.base = config_from_dict({}, (f"serving_config.spare_agent={setting}", "pa_config.num_blocks=4"))
        started = []
        fleet.start_spare = started.append
        await fleet.start((fleet.base, str(tmp_path / "a.gguf"), None))
        fleet._keep_spare()
        assert started == ([True] if want else [])          # (a 1 MiB checkpoint: huge pages, auto)
        if want:
            engine = fleet.entries["a"].engine
            engine.requests["r"] = object()                   # serving: no spare now
            fleet._keep_spare()
            assert started == [True]
        await fleet.stop()
    run(main())


def test_the_spare_agent_setting_is_checked():
    assert config_from_dict({}, ("serving_config.spare_agent=off",)).serving_config.spare_agent == "off"
    with pytest.raises(ConfigError, match="spare_agent"):
        config_from_dict({}, ("serving_config.spare_agent=sometimes",))
