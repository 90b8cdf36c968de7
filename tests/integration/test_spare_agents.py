"""Spare agents (master/spare_agents.py): an agent process started before a model needs it, MindSpore imported,
given its model on its standard input. A two-model server: its default model's agent is the spare `llm-serving
start` began; once idle, another spare waits, and the second model's on-demand load takes it; a spare killed while
it waits is never taken (the load starts an agent of its own); a spare told nothing (its standard input closed)
exits; nothing is left when the server stops."""
from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
import time
import uuid

import psutil
import pytest
import yaml

from llm_serving.agents import launch
from tests.integration.server_harness import http, serving, tagged_processes
from tests.integration.test_fleet import LEAN

pytestmark = pytest.mark.usefixtures("needs_mindspore")


@pytest.fixture(scope="module")
def needs_mindspore():
    pytest.importorskip("mindspore")


def _waiting_spares(server) -> list:
    """pids of the server's spare agents that no model has taken (started as spares, serving no model)."""
    serving_pids = set()
    for name in ("hf", "stories260K"):
        status, info = http("GET", f"{server.url}/models/{name}")
        if status == 200 and info.get("state") == "loaded":
            serving_pids.update(a["pid"] for a in info["agents"])
    found = []
    for p in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get(launch.ENV_SPARE) == "1" \
                    and p.pid not in serving_pids:
                found.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _wait_for(predicate, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(0.1)
    return predicate()


def _unload(server, name: str) -> None:
    status, body = http("POST", f"{server.url}/models/{name}/unload")
    assert status == 200, body


def _complete(server, model: str) -> dict:
    status, body = http("POST", server.url + "/v1/completions", {"model": model, "prompt": "Once upon a time",
                                                                "max_tokens": 8, "temperature": 0}, timeout=300)
    assert status == 200, body
    return body


def test_loads_take_the_spare_agents_and_nothing_is_left(stories_dir, tmp_path):
    config = tmp_path / "lean.yaml"
    config.write_text(yaml.safe_dump(copy.deepcopy(LEAN)))
    tag = uuid.uuid4().hex
    args = ["--config", str(config), "--model", str(stories_dir / "hf"), "--model",
            str(stories_dir / "stories260K.bin")]
    with serving(args, tmp_path / "server.log", env={"LLM_SERVING_TEST_TAG": tag}) as server:
        # the default model's agent: the spare `llm-serving start` began before its own imports
        status, health = http("GET", server.url + "/health")
        assert status == 200
        [default_agent] = [a["pid"] for a in health["agents"]]
        taken = re.findall(r"agent 0: the spare agent \(pid (\d+)\)", server.log())
        assert taken == [str(default_agent)], server.log()[-3000:]
        # idle, with a second model to load: a spare waits for it, and its load takes that one
        [spare] = _wait_for(lambda: _waiting_spares(server), 20)
        want = _complete(server, "stories260K")["choices"][0]["text"]
        status, info = http("GET", server.url + "/models/stories260K")
        assert [a["pid"] for a in info["agents"]] == [spare]
        assert f"the spare agent (pid {spare})" in server.log()
        # the same answer from an agent started for it (its spare killed while it waited)
        _unload(server, "stories260K")
        [spare] = _wait_for(lambda: _waiting_spares(server), 20)
        os.kill(spare, 9)
        assert _wait_for(lambda: not psutil.pid_exists(spare) or
                         psutil.Process(spare).status() == psutil.STATUS_ZOMBIE, 10)
        assert _complete(server, "stories260K")["choices"][0]["text"] == want
        status, info = http("GET", server.url + "/models/stories260K")
        assert [a["pid"] for a in info["agents"]] != [spare]
        assert f"a spare agent (pid {spare}) exited" in server.log()
    assert _wait_for(lambda: not tagged_processes(tag), 10), tagged_processes(tag)


def test_a_spare_told_nothing_exits(tmp_path):
    """A spare whose standard input ends before a model comes (its master gone) exits by itself, with 0."""
    env, workdir = launch.child_env({launch.ENV_SPARE: "1"})
    proc = subprocess.Popen([sys.executable, "-m", "llm_serving.agents.server"], env=env, cwd=workdir,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = proc.communicate(b"", timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out.decode(errors="replace")[-2000:]


def test_a_start_that_cannot_decide_its_model_ends_the_spare_it_began(tmp_path):
    """`llm-serving start` begins its first agent before it decides the model (its MindSpore import beside the
    master's decisions); a model that cannot be decided is a config error (exit 2) and that spare ends with it."""
    tag = uuid.uuid4().hex
    env = {**os.environ, "LLM_SERVING_TEST_TAG": tag}       # (the machine's kernels: nothing is built)
    proc = subprocess.run([sys.executable, "-m", "llm_serving.cli", "start", "--model", str(tmp_path / "none.gguf"),
                           "--port", "0"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "config error" in proc.stderr, proc.stderr[-2000:]
    assert not tagged_processes(tag)     # ended with the master, not left importing MindSpore
