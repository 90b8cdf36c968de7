"""A master killed by SIGKILL (as the OOM killer would) while its agents still warm up leaves nothing: its agents
and cluster scheduler die with it, the compile cache's lock goes with them, and the next start removes the
shared-memory segments that its resource tracker, killed too, could not."""
import fcntl
import os
import re
import signal
import time
import urllib.error
import uuid

import psutil
import pytest

from tests.integration.server_harness import (REPO, ServerProcess, http, leftovers, private_cache,
                                              project_shm_segments, tagged_processes)
from tests.integration.test_tensor_parallel import MS_TP2

STORIES = ["--config", str(REPO / "configs" / "stories260K.yaml")]


def _command(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:                           # gone, or a zombie
        return ""


def _children(server: ServerProcess, command: str) -> list:
    return [p for p in server.refresh_children() if command in _command(p)]


def _held_cache_locks(processes: list) -> list:
    """The compile-cache lock files these processes have open (each holds its lock from set-up to warmup's end)."""
    paths = []
    for p in processes:
        try:
            paths += [f.path for f in p.open_files() if f.path.endswith("/.lock") and "/ms_compile/" in f.path]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return paths


def _locked(paths: list) -> list:
    """Those of these lock files that some process holds."""
    held = []
    for path in paths:
        with open(path, "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held.append(path)
    return held


def _wait_for_warmup(server: ServerProcess, num_agents: int, timeout_s: float = 300) -> list:
    """Wait until every agent has loaded its model and compiles its graphs (the server is not ready yet); returns
    the agent processes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.proc.poll() is None, server.log()
        compiling = len(re.findall(r"agent \d+: model loaded in .* compiling buckets", server.log()))
        agents = _children(server, "llm_serving.agents.server")
        if compiling == num_agents == len(agents) and (num_agents > 1 or _held_cache_locks(agents)):
            assert "warmup done" not in server.log(), "an agent finished warming up before it was caught"
            with pytest.raises(urllib.error.URLError):      # the HTTP port opens once the agents are ready
                http("GET", server.url + "/health", timeout=2)
            return agents
        time.sleep(0.1)
    raise AssertionError(f"the agents never got to warmup:\n{server.log()}")


def _kill_with_resource_tracker(server: ServerProcess) -> int:
    """SIGKILL the master and the resource tracker that would unlink its segments (as a `kill -9` of the process
    group would); returns the master's pid."""
    trackers = _children(server, "resource_tracker")
    assert trackers, "the master has no resource tracker"
    for p in trackers:
        p.kill()
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(30)
    return server.proc.pid


@pytest.mark.parametrize("sets", [[], MS_TP2], ids=["one agent", "tensor-parallel with a cluster scheduler"])
def test_master_killed_during_warmup_leaves_no_agent_lock_or_segment(stories_dir, tmp_path, sets):
    pytest.importorskip("mindspore")
    tag = uuid.uuid4().hex
    shm_before = set(project_shm_segments())
    # an empty compile cache of its own makes warmup compile every graph: long enough to be caught in
    cache = private_cache(tmp_path / "cache")
    env = {"LLM_SERVING_CACHE": str(cache), "LLM_SERVING_TEST_TAG": tag}
    args = STORIES + ["--model", str(stories_dir / "hf")]
    for s in sets:
        args += ["--set", s]
    num_agents = 2 if sets else 1

    first = ServerProcess(args, tmp_path / "first.log", env=env)
    try:
        agents = _wait_for_warmup(first, num_agents)
        locks = _held_cache_locks(agents)
        master = _kill_with_resource_tracker(first)
        # the agents (and the cluster's scheduler) die with the master, however busy compiling, and the compile
        # cache's lock goes with its holder (a process releases its files after its memory: wait for both)
        deadline = time.monotonic() + 10
        while (tagged_processes(tag) or leftovers(first) or _locked(locks)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tagged_processes(tag) == [], first.log()
        assert leftovers(first) == []
        assert _locked(locks) == [], "the compile cache is still locked: the next start would wait"
        left = [n for n in set(project_shm_segments()) - shm_before if f"_p{master}n" in n]
        assert left, "the killed master's segments are already gone: nothing for the next start to sweep"
    finally:
        first.stop(sig=signal.SIGKILL)

    second = ServerProcess(args, tmp_path / "second.log", env=env)
    try:
        second.wait_ready()
        log = second.log_path.read_text(errors="replace")     # (whole: the line lists every segment's name)
        assert f"removed {len(left)} shared-memory segment(s) left by master pid {master}, which is gone" in log, \
            second.log()
        assert not set(left) & set(project_shm_segments())
        if num_agents == 1:                        # no wait for a dead holder's compile cache
            assert "in use by another process" not in log, log
        status, body = http("POST", second.url + "/models/hf/generate",
                            {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 8}})
        assert status == 200 and body["details"]["generated_tokens"] == 8, body
    finally:
        second.stop()
    assert leftovers(second) == []
    deadline = time.monotonic() + 5                 # the master's resource tracker unlinks a moment after its exit
    while time.monotonic() < deadline and set(project_shm_segments()) - shm_before:
        time.sleep(0.1)
    assert set(project_shm_segments()) - shm_before == set()
