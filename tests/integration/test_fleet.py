"""Several models in one server (issue 52), on real servers on loopback.

The models: stories260K's HF directory (served as "hf", the default: the first --model), its llama2.c twin
stories260K.bin ("stories260K", the same weights), a copy of the HF directory ("tales", listed in
serving_config.models with keep_alive -1) and "broken" (serving_config.models: a directory whose config.json is not
JSON). Two servers: the fleet (an API key, serving_config.keep_alive=2s), shared by the tests in file order, and one
with a memory budget for two models (test_lru_eviction_...). One-model references come from the session's
stories_server (tests/integration/conftest.py) and llama2.c's greedy_reference.json.

The server's settings are lean (few buckets, no speculation, 64 KV blocks) so that a load takes seconds: each test
that needs a model loaded or unloaded makes it so first, and every wait is bounded."""
from __future__ import annotations

import asyncio
import copy
import json
import os
import shutil
import signal
import socket
import time
import uuid
from pathlib import Path

import aiohttp
import psutil
import pytest
import sentencepiece as spm
import yaml

from llm_serving.agents.launch import ENV_CONFIG, ENV_SPARE
from tests.integration.server_harness import http, leftovers, project_shm_segments, serving, tagged_processes
from tests.integration.test_serving import STORY_PROMPTS

pytestmark = pytest.mark.usefixtures("needs_mindspore")

KEY = "fleet-test-" + uuid.uuid4().hex
AUTH = {"Authorization": f"Bearer {KEY}"}
MODELS = ("hf", "stories260K", "tales")            # the three that load (broken never does)
NUM_BLOCKS, BLOCK_SIZE = 64, 16
LEAN = {                                           # one graph per shape the tests need: a load takes seconds
    "model_config": {"max_generate_length": 256, "end_token": [1, 2], "seq_length": [16, 64],
                     "prefill_batch_size": [1, 4], "decode_batch_size": [1, 4]},
    "serving_config": {"agent_ports": [0], "max_num_seqs": 4, "max_num_batched_tokens": 64},
    "pa_config": {"num_blocks": NUM_BLOCKS, "block_size": BLOCK_SIZE},
    "spec_config": {"method": "off"},
}
MAX_GAP_S = 1.5          # the longest pause allowed between two tokens of a stream while another model loads (a load
                         # takes 3-15 s here; the tokens come in decode runs of 8, 0.1-0.5 s apart on a busy machine)
GAP_SHARE = 0.75         # ... or this share of the load's (or restart's) time, when more: a master that held the
                         # stream's steps behind the load would pause it for all of the load, while a 2-core CI machine
                         # running another test file beside this one paused it 1.56 s in a 3.1 s load, and a 2-core
                         # Zen 5 1.66 s in a 2.5 s one (alone: 0.2-0.3 s)


@pytest.fixture(scope="module")
def needs_mindspore():
    pytest.importorskip("mindspore")


# --- the models and the servers ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models(stories_dir, tmp_path_factory) -> dict:
    """name -> checkpoint path: hf, stories260K (.bin), tales (a copy of hf), broken (hf with a broken config.json)."""
    root = tmp_path_factory.mktemp("fleet_models")
    shutil.copytree(stories_dir / "hf", root / "tales")
    shutil.copytree(stories_dir / "hf", root / "broken")
    (root / "broken" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": \n')
    return {"hf": stories_dir / "hf", "stories260K": stories_dir / "stories260K.bin", "tales": root / "tales",
            "broken": root / "broken"}


def _write_config(path: Path, **serving_config) -> Path:
    raw = copy.deepcopy(LEAN)
    raw["serving_config"].update(serving_config)
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def fleet(models, stories_server, tmp_path_factory):
    """hf (default), stories260K (--model again), tales and broken (serving_config.models); keep_alive 2 s, an API
    key, every process marked with a tag of its own (test_nothing_is_left_after_the_server_stops). (The session's
    stories_server starts first: its segments are not this server's.)"""
    d = tmp_path_factory.mktemp("fleet")
    config = _write_config(d / "fleet.yaml", models=[
        {"name": "tales", "path": str(models["tales"]), "keep_alive": -1},
        {"name": "broken", "path": str(models["broken"])}])
    # (no spare agents: these tests tell an agent's model by its launch environment, which a spare, given its model
    # on its standard input, does not hold; tests/integration/test_spare_agents.py tests them)
    args = ["--config", str(config), "--model", str(models["hf"]), "--model", str(models["stories260K"]),
            "--set", "serving_config.keep_alive=2s", "--set", "serving_config.spare_agent=off"]
    tag = uuid.uuid4().hex
    shm_before = set(project_shm_segments())
    with serving(args, d / "server.log", env={"LLM_SERVING_API_KEY": KEY, "LLM_SERVING_TEST_TAG": tag}) as server:
        server.models, server.tag, server.shm_before = models, tag, shm_before
        server.agent_pids_seen = set()
        yield server


# --- helpers --------------------------------------------------------------------------------------------------------

def _get(server, path: str, timeout: float = 30):
    return http("GET", server.url + path, headers=AUTH, timeout=timeout)


def _post(server, path: str, body=None, timeout: float = 120, key: bool = True):
    return http("POST", server.url + path, body if body is not None else {}, headers=AUTH if key else None,
                timeout=timeout)


def _states(server) -> dict:
    status, body = _get(server, "/v1/models")
    assert status == 200, body
    return {m["id"]: m["state"] for m in body["data"] if "parent" not in m}


def _listed(server, name: str) -> dict:
    return next(m for m in _get(server, "/v1/models")[1]["data"] if m["id"] == name)


def _stats(server, name: str) -> dict:
    status, body = _get(server, f"/stats?model={name}")
    assert status == 200, (name, body)
    return body


def _generate(server, name: str, prompt: str = "Once upon a time", n: int = 8):
    return _post(server, f"/models/{name}/generate",
                 {"inputs": prompt, "parameters": {"max_new_tokens": n, "ignore_eos": True}})


def _agents(server) -> dict:
    """name -> [pid] of the live agent processes of each model (an agent's launch config says its model's path; a
    spare agent's, given on its standard input, is not in its environment: the server's /models/{name} names its
    agents)."""
    server.refresh_children()
    by_path = {os.path.realpath(p): name for name, p in server.models.items()}
    found: dict = {}
    spares = set()
    for p in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE or "llm_serving.agents.server" not in " ".join(p.cmdline()):
                continue
            env = p.environ()
            if ENV_CONFIG not in env:
                if env.get(ENV_SPARE) == "1":
                    spares.add(p.pid)
                continue
            model_dir = json.loads(env[ENV_CONFIG])["model_dir"]
        except (psutil.NoSuchProcess, psutil.AccessDenied, KeyError):
            continue
        found.setdefault(by_path.get(os.path.realpath(model_dir), model_dir), []).append(p.pid)
    for name in server.models if spares else ():
        status, info = http("GET", f"{server.url}/models/{name}", headers=AUTH)
        for agent in info.get("agents", []) if status == 200 else ():
            if agent["pid"] in spares:
                found.setdefault(name, []).append(agent["pid"])
    if hasattr(server, "agent_pids_seen"):
        server.agent_pids_seen.update(pid for pids in found.values() for pid in pids)
    return found


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait(predicate, timeout: float, interval: float = 0.1):
    """predicate()'s first true value within timeout (else its last value)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def _logged(server, text: str) -> int:
    """How many lines of the server's log say `text`, the access log's left out (a 503's line quotes its error)."""
    return sum(text in line for line in server.log_path.read_text(errors="replace").splitlines()
               if "llm_serving.access: " not in line)


def _loads(server, name: str) -> int:
    """How many times the server's log says model `name` loaded."""
    return _logged(server, f"model '{name}' loaded in ")


def _unloads(server, name: str) -> int:
    """How many times the server's log says model `name` was unloaded (its agents stopped)."""
    return _logged(server, f"model '{name}' unloaded")


def _listening_ports(pid: int) -> set:
    try:
        return {c.laddr.port for c in psutil.Process(pid).net_connections(kind="tcp")
                if c.status == psutil.CONN_LISTEN}
    except psutil.NoSuchProcess:
        return set()


def _accepting(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _ensure(server, name: str, state: str) -> None:
    """Make `name` loaded or unloaded through the explicit routes."""
    if _states(server)[name] != state:
        status, body = _post(server, f"/models/{name}/{'load' if state == 'loaded' else 'unload'}")
        assert status == 200 and body["state"] == state, body
    assert _states(server)[name] == state


def _expected_size(path: Path, hf_config: Path) -> int:
    """A model's bytes as the issue counts them, worked out here: its weights' file(s), plus its KV cache (K and V, in
    float16, of every layer's kv heads, for NUM_BLOCKS blocks of BLOCK_SIZE tokens)."""
    weights = path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.glob("*.safetensors"))
    cfg = json.loads(hf_config.read_text())
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    per_block = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * BLOCK_SIZE * 2
    return weights + NUM_BLOCKS * per_block


async def _stream(session, url: str, name: str, n: int, times: list, prompt: str = "Once upon a time") -> dict:
    """One streamed request (TGI's SSE) of n tokens; the arrival time of each token event is appended to `times`."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": n, "ignore_eos": True}, "stream": True}
    events = []
    async with session.post(f"{url}/models/{name}/generate", json=body, headers=AUTH) as resp:
        if resp.status != 200:
            return {"status": resp.status, "body": await resp.text()}
        async for line in resp.content:
            if line.startswith(b"data: "):
                times.append(time.monotonic())
                events.append(json.loads(line[6:]))
    return {"status": 200, **events[-1], "tokens": len(events)}


async def _keep_streaming(session, url: str, name: str, n: int, stop: asyncio.Event, times: list, finals: list,
                          stagger: float = 0.0) -> None:
    """Streams to `name`, one after another, until `stop` (the one running then finishes)."""
    await asyncio.sleep(stagger)
    i = 0
    while not stop.is_set():
        finals.append(await _stream(session, url, name, n, times, STORY_PROMPTS[i % len(STORY_PROMPTS)]))
        i += 1


async def _streaming(session, url: str, name: str, stop: asyncio.Event, times: list, finals: list) -> list:
    """Two streams of 64 tokens kept going to `name` (staggered), once 20 tokens have come: their tasks."""
    busy = [asyncio.create_task(_keep_streaming(session, url, name, 64, stop, times, finals, i * 0.2))
            for i in range(2)]
    await _wait_tokens(times, 20)
    return busy


async def _wait_tokens(times: list, count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while len(times) < count:
        assert time.monotonic() < deadline, f"only {len(times)} tokens streamed in {timeout} s"
        await asyncio.sleep(0.01)


def _gaps(times: list, start: float, end: float) -> float:
    """The longest time without a token between start and end (the edges count)."""
    inside = [start] + sorted(t for t in times if start <= t <= end) + [end]
    return max(b - a for a, b in zip(inside, inside[1:]))


def _assert_finished(finals: list, n: int) -> None:
    assert finals, "no stream ran"
    for final in finals:
        assert final["status"] == 200, final
        assert final["details"]["finish_reason"] == "length" and final["details"]["generated_tokens"] == n, final
        assert final["tokens"] == n, final


# --- the fleet as it starts ------------------------------------------------------------------------------------

def test_the_models_are_listed_with_their_states(fleet):
    assert _states(fleet) == {"hf": "loaded", "stories260K": "unloaded", "tales": "unloaded", "broken": "unloaded"}
    status, health = http("GET", fleet.url + "/health")
    assert status == 200 and health["model"] == "hf"
    assert health["models"] == {"hf": "loaded", "stories260K": "unloaded", "tales": "unloaded",
                                "broken": "unloaded"}
    assert list(_agents(fleet)) == ["hf"]
    status, info = _get(fleet, "/models/hf")
    assert status == 200 and info["state"] == "loaded" and info["keep_alive_s"] is None      # the default stays
    assert info["size_bytes"] == _expected_size(fleet.models["hf"], fleet.models["hf"] / "config.json")
    status, info = _get(fleet, "/models/stories260K")
    assert status == 200 and info["state"] == "unloaded" and info["size_bytes"] is None


# --- load on demand while another model streams; requests to each model, interleaved --------------------------------

def test_an_unloaded_model_loads_on_request_while_another_streams(fleet):
    _ensure(fleet, "tales", "unloaded")
    loads_before = _loads(fleet, "tales")
    [hf_agent] = _agents(fleet)["hf"]

    async def run():
        times, finals, seen = [], [], []
        stop = asyncio.Event()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session:
            busy = await _streaming(session, fleet.url, "hf", stop, times, finals)

            async def watch():          # tales's state in /v1/models, collapsed to its changes
                while True:             # the last poll starts after stop is set: it sees the state the answers left
                    last = stop.is_set()
                    async with session.get(f"{fleet.url}/v1/models", headers=AUTH) as r:
                        state = {m["id"]: m["state"] for m in (await r.json())["data"]}["tales"]
                    if not seen or seen[-1] != state:
                        seen.append(state)
                    if last:
                        return
                    await asyncio.sleep(0.05)
            watcher = asyncio.create_task(watch())

            async def ask():
                body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 12}}
                async with session.post(f"{fleet.url}/models/tales/generate", json=body, headers=AUTH) as r:
                    return r.status, await r.json(), time.monotonic()

            t0 = time.monotonic()
            answers = await asyncio.gather(ask(), ask())          # two at once: one load
            t1 = max(t for _, _, t in answers)
            tokens_during = sum(1 for t in times if t0 <= t <= t1)
            gap = _gaps(times, t0, t1)
            stop.set()
            await asyncio.gather(*busy)
            await watcher
        return answers, t1 - t0, tokens_during, gap, finals, seen

    answers, waited, tokens_during, gap, finals, seen = asyncio.run(run())
    status, info = _get(fleet, "/models/tales")
    assert status == 200 and info["state"] == "loaded", info
    # the requests waited for the load and were answered, with the text hf gives (the same weights)
    hf_text = _post(fleet, "/models/hf/generate", {"inputs": "Once upon a time",
                                                     "parameters": {"max_new_tokens": 12}})[1]["generated_text"]
    for status, body, _ in answers:
        assert status == 200 and body["generated_text"] == hf_text, body
    assert info["load_s"] > 0.5 and waited >= 0.8 * info["load_s"], (waited, info)
    # one load for both requests: one log line, one agent
    assert _loads(fleet, "tales") == loads_before + 1
    assert len(_agents(fleet)["tales"]) == 1
    # the other model's streams were not held up by the load: tokens kept coming, every one finished
    assert gap < max(MAX_GAP_S, GAP_SHARE * waited), f"hf's stream paused {gap:.2f} s in tales's {waited:.1f} s load"
    assert tokens_during >= 5 * waited, (tokens_during, waited)
    _assert_finished(finals, 64)
    assert _agents(fleet)["hf"] == [hf_agent]
    # the states seen while it loaded, in order (loading is seen when a poll falls in the load: not asserted)
    assert seen[-1] == "loaded" and seen == [s for s in ("unloaded", "loading", "loaded") if s in seen], seen


def test_requests_to_each_model_interleaved_match_one_model_servers(fleet, stories_server, stories_dir):
    """Each model's greedy text is the one-model server's (stories_server, hf) for the same request, and llama2.c's
    for greedy_reference.json's prompts; the replies name their model, and each model's steps are its own."""
    prompts = STORY_PROMPTS[:6]

    def completion(url, name, prompt, headers=None):
        return http("POST", url + "/v1/completions", {"model": name, "prompt": prompt, "max_tokens": 24,
                                                       "temperature": 0}, headers=headers, timeout=120)

    reference = {}
    for prompt in prompts:
        status, body = completion(stories_server.url, "hf", prompt)
        assert status == 200, body
        reference[prompt] = body["choices"][0]["text"]
    cases = json.loads((stories_dir / "greedy_reference.json").read_text())
    sp = spm.SentencePieceProcessor(model_file=str(stories_dir / "tok512.model"))

    async def run():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=240), headers=AUTH) as session:
            async def complete(name, prompt):
                body = {"model": name, "prompt": prompt, "max_tokens": 24, "temperature": 0}
                async with session.post(f"{fleet.url}/v1/completions", json=body) as r:
                    return name, prompt, r.status, await r.json()

            async def long_greedy(name, case):
                num_prompt = 1 + len(sp.encode(case["prompt"]))
                params = {"max_new_tokens": case["steps_total_incl_prompt_and_bos"] - (num_prompt - 1),
                          "return_full_text": True}
                async with session.post(f"{fleet.url}/models/{name}/generate",
                                        json={"inputs": case["prompt"], "parameters": params}) as r:
                    return name, case, r.status, await r.json()

            short = [complete(name, p) for p in prompts for name in MODELS]          # interleaved, all at once
            long = [long_greedy(name, case) for case in cases for name in MODELS]
            return await asyncio.gather(*short), await asyncio.gather(*long)

    short, long = asyncio.run(run())
    for name, prompt, status, body in short:
        assert status == 200, (name, body)
        assert body["model"] == name, body
        assert body["choices"][0]["text"] == reference[prompt], (name, prompt, body)
    for name, case, status, body in long:
        assert status == 200, (name, body)
        assert body["generated_text"] + "\n" == case["greedy_text"], (name, case["prompt"])

    # routing: 1, 2 and 3 requests of 8 tokens to hf, stories260K and tales (at once) add 8, 16 and 24 generated
    # tokens to each model's own /stats, and steps to each (stories260K, whose keep_alive is 2 s, used just before)
    assert _generate(fleet, "stories260K")[0] == 200
    assert {n: s for n, s in _states(fleet).items() if n in MODELS} == dict.fromkeys(MODELS, "loaded")
    before = {name: _stats(fleet, name) for name in MODELS}
    counts = {"hf": 1, "stories260K": 2, "tales": 3}

    async def routed():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120), headers=AUTH) as session:
            async def one(name):
                body = {"inputs": "The cat sat", "parameters": {"max_new_tokens": 8, "ignore_eos": True}}
                async with session.post(f"{fleet.url}/models/{name}/generate", json=body) as r:
                    return r.status
            return await asyncio.gather(*(one(n) for n in MODELS for _ in range(counts[n])))

    assert set(asyncio.run(routed())) == {200}
    after = {name: _stats(fleet, name) for name in MODELS}
    for name in MODELS:
        assert after[name]["num_generated_tokens"] - before[name]["num_generated_tokens"] == 8 * counts[name], name
        assert after[name]["num_steps"] > before[name]["num_steps"], name
        assert after[name]["num_running"] == 0 and after[name]["num_free_blocks"] == NUM_BLOCKS
    # /metrics says the same, each model's samples labelled with its name
    from prometheus_client.parser import text_string_to_metric_families

    status, text = _get(fleet, "/metrics")
    assert status == 200
    samples = {(sample.name, sample.labels.get("model")): sample.value
               for family in text_string_to_metric_families(text) for sample in family.samples}
    for name in MODELS:
        assert samples[("llm_serving_generation_tokens_total", name)] == after[name]["num_generated_tokens"], name
        assert samples[("llm_serving_model_loaded", name)] == 1
    assert samples[("llm_serving_model_loaded", "broken")] == 0


# --- keep_alive ---------------------------------------------------------------------------------------------------

def test_keep_alive_unloads_an_idle_model_and_a_request_loads_it_again(fleet):
    """serving_config.keep_alive=2s: stories260K (loaded on demand) is unloaded 2-3 s after its last request, its
    agent and segments gone; a request loads it again. hf (the default) and tales (keep_alive -1) stay."""
    [hf_agent] = _agents(fleet)["hf"]
    # a use by an earlier test expires first (its unload done: its agent stopped, its segments freed)
    assert _wait(lambda: _loads(fleet, "stories260K") == _unloads(fleet, "stories260K"), 15)
    assert "stories260K" not in _agents(fleet)
    segments = set(project_shm_segments())
    loads = _loads(fleet, "stories260K")

    status, body = _generate(fleet, "stories260K")
    last = time.monotonic()
    assert status == 200, body
    status, info = _get(fleet, "/models/stories260K")
    assert info["state"] == "loaded" and info["keep_alive_s"] == 2.0, info
    [agent] = _agents(fleet)["stories260K"]
    assert set(project_shm_segments()) - segments            # its step buffers
    assert _loads(fleet, "stories260K") == loads + 1

    assert _wait(lambda: _states(fleet)["stories260K"] == "unloaded", 6, interval=0.05)
    idle = time.monotonic() - last
    assert 1.9 <= idle <= 3.5, f"unloaded {idle:.2f} s after its last request (keep_alive 2 s, swept every 1 s)"
    assert _wait(lambda: _gone(agent), 15), f"the unloaded model's agent {agent} is still running"
    assert _wait(lambda: set(project_shm_segments()) == segments, 10), set(project_shm_segments()) ^ segments
    states = _states(fleet)
    assert states["hf"] == "loaded" and states["tales"] == "loaded", states
    assert _agents(fleet)["hf"] == [hf_agent] and http("GET", fleet.url + "/health")[0] == 200

    status, body = _generate(fleet, "stories260K")
    assert status == 200 and body["generated_text"] == _generate(fleet, "hf")[1]["generated_text"], body
    assert _loads(fleet, "stories260K") == loads + 2
    [again] = _agents(fleet)["stories260K"]
    assert again != agent


def test_ollama_keep_alive_0_unloads_the_model_once_idle(fleet):
    """tales stays loaded for good (its keep_alive -1) until an Ollama request says keep_alive 0."""
    _ensure(fleet, "tales", "loaded")
    assert _get(fleet, "/models/tales")[1]["keep_alive_s"] is None
    [agent] = _agents(fleet)["tales"]
    ports = _listening_ports(agent)
    status, body = _post(fleet, "/api/generate", {"model": "tales", "prompt": "Once upon a time", "stream": False,
                                                  "keep_alive": 0, "options": {"num_predict": 8, "temperature": 0}})
    answered = time.monotonic()
    assert status == 200 and body["model"] == "tales" and body["done"] and body["eval_count"] == 8, body
    assert _wait(lambda: _states(fleet)["tales"] == "unloaded", 5, interval=0.05), _states(fleet)
    assert time.monotonic() - answered < 2.5
    assert _wait(lambda: _gone(agent), 15)
    assert ports and not any(_accepting(p) for p in ports), ports       # its port is free
    assert _states(fleet)["hf"] == "loaded"


def test_ollama_load_duration_is_the_wait_for_the_load(fleet):
    """A request that waited for its model's load says so in Ollama's load_duration (the issue: "the wait is visible
    in the request's timing")."""
    _ensure(fleet, "tales", "unloaded")
    status, body = _post(fleet, "/api/generate", {"model": "tales", "prompt": "Once upon a time", "stream": False,
                                                  "options": {"num_predict": 8, "temperature": 0}})
    assert status == 200, body
    load_s = _get(fleet, "/models/tales")[1]["load_s"]
    assert load_s > 0.5 and body["total_duration"] >= 0.8 * load_s * 1e9, (load_s, body)
    assert body["load_duration"] >= 0.8 * load_s * 1e9, (
        f"load_duration {body['load_duration']} ns, though the request waited for a {load_s:.1f} s load")


# --- a load failure -------------------------------------------------------------------------------------------------

def test_a_model_that_fails_to_load_says_why_and_the_others_serve(fleet):
    """broken's config.json is not JSON: every request waiting for its load gets a 503 with the load's error, it is
    listed as failed with that error, and the others serve. The load fails in milliseconds, so of 80 requests sent 1
    ms apart (three times) later ones start attempts of their own as earlier ones wake: each must still be told its
    own attempt's error."""
    failures = _logged(fleet, "model 'broken' failed to load")
    routes = ("TGI", "OpenAI") * 40

    async def spread():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120), headers=AUTH) as session:
            async def ask(i, route):
                await asyncio.sleep(0.001 * i)
                path, body = (("/models/broken/generate", {"inputs": "Once", "parameters": {"max_new_tokens": 4}})
                              if route == "TGI" else
                              ("/v1/completions", {"model": "broken", "prompt": "Once", "max_tokens": 4}))
                async with session.post(fleet.url + path, json=body) as r:
                    status, answer = r.status, await r.json()
                return route, status, answer["error"] if route == "TGI" else answer["error"]["message"]
            return await asyncio.gather(*(ask(i, route) for i, route in enumerate(routes)))

    answers = [answer for _ in range(3) for answer in asyncio.run(spread())]
    listed = _listed(fleet, "broken")
    assert listed["state"] == "failed" and "config.json" in listed["error"] and "invalid JSON" in listed["error"]
    status, info = _get(fleet, "/models/broken")
    assert status == 200 and info["state"] == "failed" and info["error"] == listed["error"], info
    health = http("GET", fleet.url + "/health")
    assert health[0] == 200 and health[1]["models"]["broken"] == "failed", health
    assert "broken" not in _agents(fleet)
    attempts = _logged(fleet, "model 'broken' failed to load") - failures
    assert 1 <= attempts <= len(answers)
    # the other models serve meanwhile, and after
    for name in ("hf", "stories260K"):
        status, body = _generate(fleet, name)
        assert status == 200 and body["details"]["generated_tokens"] == 8, (name, body)
    # a later request tries again (and fails the same way)
    status, body = _generate(fleet, "broken")
    assert status == 503 and "invalid JSON" in body["error"], body
    assert {status for _, status, _ in answers} == {503}
    wrong = [(route, message) for route, _, message in answers
             if not ("'broken' failed to load" in message and "config.json" in message and "invalid JSON" in message)]
    assert not wrong, f"{len(wrong)} of {len(answers)} requests ({attempts} attempts) were told {wrong[:2]}"


# --- an agent killed in one model while another streams -------------------------------------------------------------

def test_an_agent_killed_in_one_model_is_restarted_while_another_streams(fleet):
    _ensure(fleet, "tales", "loaded")
    [victim] = _agents(fleet)["tales"]
    [hf_agent] = _agents(fleet)["hf"]
    restarts = _stats(fleet, "tales")["num_agent_restarts"]
    expected = _generate(fleet, "hf", "Tom had a red ball", 16)[1]["generated_text"]

    def restarted():
        stats = _stats(fleet, "tales")
        return stats["num_agent_restarts"] == restarts + 1 and stats["unavailable_reason"] is None

    async def run():
        times, finals, health = [], [], []
        stop = asyncio.Event()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session:
            busy = await _streaming(session, fleet.url, "hf", stop, times, finals)
            t0 = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            deadline = t0 + 120
            while time.monotonic() < deadline:
                async with session.get(f"{fleet.url}/health") as r:
                    health.append(r.status)
                async with session.get(f"{fleet.url}/stats?model=tales", headers=AUTH) as r:
                    stats = await r.json()
                if stats["num_agent_restarts"] == restarts + 1 and stats["unavailable_reason"] is None:
                    break
                await asyncio.sleep(0.1)
            t1 = time.monotonic()
            gap = _gaps(times, t0, t1)
            stop.set()
            await asyncio.gather(*busy)
        return finals, health, gap, t1 - t0

    finals, health, gap, took = asyncio.run(run())
    assert restarted(), _stats(fleet, "tales")
    _assert_finished(finals, 64)                   # hf's streams all finished, ...
    assert gap < max(MAX_GAP_S, GAP_SHARE * took), f"hf's stream paused {gap:.2f} s in tales's {took:.1f} s restart"
    assert set(health) == {200}, health            # ... /health (the default's) stayed 200
    assert _gone(victim) and _agents(fleet)["hf"] == [hf_agent]
    [new] = _agents(fleet)["tales"]
    assert new != victim
    status, body = _generate(fleet, "tales", "Tom had a red ball", 16)
    assert status == 200 and body["generated_text"] == expected, body
    assert _states(fleet)["tales"] == "loaded" and _stats(fleet, "hf")["num_agent_restarts"] == 0


# --- explicit load and unload, behind the API key -------------------------------------------------------------------

def test_explicit_load_and_unload_behind_the_api_key(fleet):
    _ensure(fleet, "tales", "loaded")
    for action in ("load", "unload"):
        status, body = _post(fleet, f"/models/tales/{action}", key=False)
        assert status == 401 and "API key" in body["error"], body
        wrong = {"Authorization": "Bearer nope-nope"}
        assert http("POST", f"{fleet.url}/models/tales/{action}", {}, headers=wrong)[0] == 401
        status, body = _post(fleet, f"/models/nope/{action}")
        assert status == 404 and "'nope'" in body["error"], body
    assert _states(fleet)["tales"] == "loaded"

    # busy: refused while it streams (409), its streams unharmed
    async def unload_while_streaming():
        times, finals = [], []
        stop = asyncio.Event()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            busy = await _streaming(session, fleet.url, "tales", stop, times, finals)
            async with session.post(f"{fleet.url}/models/tales/unload", headers=AUTH) as r:
                answer = r.status, await r.json()
            stop.set()
            await asyncio.gather(*busy)
        return answer, finals

    (status, body), finals = asyncio.run(unload_while_streaming())
    assert status == 409 and "serving" in body["error"], body
    _assert_finished(finals, 64)
    assert _states(fleet)["tales"] == "loaded"

    # idle: unloaded now, its agent, port and segments gone; listed still
    [agent] = _agents(fleet)["tales"]
    ports = _listening_ports(agent)
    with_tales = set(project_shm_segments())
    status, body = _post(fleet, "/models/tales/unload")
    assert status == 200 and body["id"] == "tales" and body["state"] == "unloaded", body
    assert _wait(lambda: _gone(agent), 15)
    assert ports and not any(_accepting(p) for p in ports)
    without = set(project_shm_segments())
    assert without < with_tales, "unloading freed no shared-memory segment"
    assert _states(fleet)["tales"] == "unloaded" and _generate(fleet, "hf")[0] == 200
    status, body = _post(fleet, "/models/tales/unload")                  # unloading an unloaded model: nothing to do
    assert status == 200 and body["state"] == "unloaded"

    # load: loaded when the answer comes, with its size; loading a loaded model again is no new load
    loads = _loads(fleet, "tales")
    status, body = _post(fleet, "/models/tales/load")
    assert status == 200 and body["state"] == "loaded" and body["load_s"] > 0, body
    assert body["size_bytes"] == _expected_size(fleet.models["tales"], fleet.models["hf"] / "config.json")
    assert _post(fleet, "/models/tales/load")[1]["state"] == "loaded" and _loads(fleet, "tales") == loads + 1
    [new] = _agents(fleet)["tales"]
    assert new != agent and set(project_shm_segments()) - without
    assert _generate(fleet, "tales")[0] == 200

    # and unloaded again: the segments are those before it loaded, exactly; then loaded for the next test
    assert _post(fleet, "/models/tales/unload")[0] == 200
    assert _wait(lambda: _gone(new), 15)
    assert _wait(lambda: set(project_shm_segments()) == without, 10), set(project_shm_segments()) ^ without


def _segment_groups(server) -> set:
    """The ids of the server's groups of segments (one per engine: llmsrv_<tag>_p<pid>n<ns>_<id>_<buffer>)."""
    return {name.split("_")[3] for name in set(project_shm_segments()) - server.shm_before}


def test_an_unload_whose_client_goes_away_still_frees_the_model(fleet):
    """POST /models/tales/unload from a client that gives up after 0.1 s (the agent group takes longer to stop): the
    unload still finishes: its agent gone, its segments freed, while the server runs on."""
    _ensure(fleet, "tales", "loaded")
    assert _wait(lambda: _loads(fleet, "stories260K") == _unloads(fleet, "stories260K"), 15)   # (only hf and tales)
    [agent] = _agents(fleet)["tales"]
    groups = _segment_groups(fleet)
    assert len(groups) == 2, groups                                       # hf's and tales's

    async def impatient():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.1)) as session:
            try:
                async with session.post(f"{fleet.url}/models/tales/unload", headers=AUTH) as r:
                    return r.status
            except asyncio.TimeoutError:
                return None

    asyncio.run(impatient())
    assert _wait(lambda: _states(fleet)["tales"] == "unloaded", 10)
    assert _wait(lambda: _gone(agent), 15)
    assert _generate(fleet, "hf")[0] == 200
    assert _wait(lambda: len(_segment_groups(fleet)) == 1, 10), (
        f"tales is unloaded and its agent gone, but its segments are still there: {_segment_groups(fleet)}; the log "
        f"says its unload finished {_unloads(fleet, 'tales')} of {_loads(fleet, 'tales')} times")


# --- nothing left after the server stops ----------------------------------------------------------------------------

def test_nothing_is_left_after_the_server_stops(fleet):
    """The server stops (SIGTERM) with hf loaded while stories260K is being unloaded by its keep_alive: every agent it
    ever started is gone, and every segment and port; and stories260K's unload was let finish (its engine stopped,
    not cut short)."""
    assert _generate(fleet, "stories260K")[0] == 200                   # unloaded by the sweep 2-3 s from now
    agents = _agents(fleet)
    assert set(agents) >= {"hf", "stories260K"}
    ports = {port for pids in agents.values() for pid in pids for port in _listening_ports(pid)}
    assert len(ports) >= 2
    assert _wait(lambda: _states(fleet)["stories260K"] == "unloaded", 6, interval=0.02)     # its unload began
    assert fleet.stop() == 0
    assert leftovers(fleet) == [], fleet.log()
    assert set(project_shm_segments()) - fleet.shm_before == set()
    assert _wait(lambda: not tagged_processes(fleet.tag), 10), tagged_processes(fleet.tag)
    assert len(fleet.agent_pids_seen) >= 6 and all(_gone(pid) for pid in fleet.agent_pids_seen)
    assert not any(_accepting(port) for port in ports)
    log = fleet.log_path.read_text(errors="replace")
    assert _loads(fleet, "stories260K") == _unloads(fleet, "stories260K"), (
        "stopping the server cancelled stories260K's unload half-way (its engine's stop never finished; the master's "
        "resource tracker freed its segments as it exited)\n" + log[-1200:])


# --- LRU eviction under a memory budget (a server of its own) -------------------------------------------------------

def test_lru_eviction_under_a_memory_budget(models, tmp_path):
    """A budget for two models: loading a third unloads the least recently used idle one; with both loaded models
    streaming, a request for the third gets a 503 naming them and their sizes, and the streams finish."""
    hf_config = models["hf"] / "config.json"
    sizes = {name: _expected_size(models[name], hf_config) for name in MODELS}
    budget = sizes["hf"] + sizes["stories260K"] + min(sizes.values()) // 2
    assert max(a + b for a in sizes.values() for b in sizes.values()) <= budget < sum(sizes.values())
    config = _write_config(tmp_path / "budget.yaml", memory_budget=budget, keep_alive=-1)
    args = ["--config", str(config), "--model", str(models["hf"]), "--model", str(models["stories260K"]),
            "--model", str(models["tales"])]
    with serving(args, tmp_path / "server.log") as server:
        server.models = models
        get = lambda path: http("GET", server.url + path)            # noqa: E731 - no API key here
        states = lambda: {m["id"]: m["state"] for m in get("/v1/models")[1]["data"]}   # noqa: E731
        generate = lambda name: http("POST", f"{server.url}/models/{name}/generate",   # noqa: E731
                                     {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 8}}, timeout=120)
        assert states() == {"hf": "loaded", "stories260K": "unloaded", "tales": "unloaded"}

        # two fit
        assert generate("stories260K")[0] == 200
        assert states() == {"hf": "loaded", "stories260K": "loaded", "tales": "unloaded"}
        for name in ("hf", "stories260K"):
            assert get(f"/models/{name}")[1]["size_bytes"] == sizes[name]
        [stories_agent] = _agents(server)["stories260K"]

        # the third: stories260K, used before hf, is the least recently used and goes
        assert generate("hf")[0] == 200
        assert generate("tales")[0] == 200
        assert states() == {"hf": "loaded", "stories260K": "unloaded", "tales": "loaded"}
        assert ("unloading model 'stories260K' (least recently used) to make room for 'tales'"
                in server.log_path.read_text())
        assert _wait(lambda: _gone(stories_agent), 15)
        assert set(_agents(server)) == {"hf", "tales"}

        # no room: hf and tales both stream, so neither can go; stories260K's request gets a 503 naming them
        async def full():
            times = {"hf": [], "tales": []}
            finals = []
            stop = asyncio.Event()
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
                busy = [asyncio.create_task(_keep_streaming(session, server.url, name, 64, stop, times[name], finals,
                                                            i * 0.15))
                        for name in ("hf", "tales") for i in range(2)]
                await _wait_tokens(times["hf"], 10)
                await _wait_tokens(times["tales"], 10)
                body = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 8}}
                async with session.post(f"{server.url}/models/stories260K/generate", json=body) as r:
                    answer = r.status, await r.json()
                stop.set()
                await asyncio.gather(*busy)
            return answer, finals

        (status, body), finals = asyncio.run(full())
        assert status == 503 and body["error_type"] == "unavailable", body
        message = body["error"]
        assert "'stories260K'" in message and "memory_budget" in message, message
        mib = lambda n: f"{n / 2**20:.0f} MiB"                         # noqa: E731
        assert f"hf ({mib(sizes['hf'])})" in message and f"tales ({mib(sizes['tales'])})" in message, message
        _assert_finished(finals, 64)
        listed = {m["id"]: m for m in get("/v1/models")[1]["data"]}
        assert listed["hf"]["state"] == "loaded" and listed["tales"]["state"] == "loaded"
        assert listed["stories260K"]["state"] == "failed" and "memory_budget" in listed["stories260K"]["error"]

        # once they are idle there is room again: hf, the default, used more recently than tales, stays
        assert generate("tales")[0] == 200
        assert generate("hf")[0] == 200
        status, body = generate("stories260K")
        assert status == 200, body
        assert states() == {"hf": "loaded", "stories260K": "loaded", "tales": "unloaded"}
        assert http("GET", server.url + "/health")[0] == 200
        # the default is no exception once it is the least recently used: it goes, and /health stays 200 (an
        # unloaded default loads on the next request that names it)
        [hf_agent] = _agents(server)["hf"]
        assert generate("tales")[0] == 200
        assert states() == {"hf": "unloaded", "stories260K": "loaded", "tales": "loaded"}
        assert _wait(lambda: _gone(hf_agent), 15)
        status, health = http("GET", server.url + "/health")
        assert status == 200 and health["models"]["hf"] == "unloaded", health
    assert "leaked shared_memory" not in (tmp_path / "server.log").read_text()
