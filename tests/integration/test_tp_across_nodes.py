"""Tensor parallel across nodes, rehearsed on one machine: a TP=2 group of stories260K whose rank 1 is node 1
of a two-node MindSpore cluster. `llm-serving agent --ranks 1` starts it (not the master; msrun's environment),
the master connects to it over TCP and never gives it the shared memory: rank 0 broadcasts each step's inputs
over the group's collectives. It must serve the reference greedy text (what TP=1 serves), token for token like
one agent under concurrency, survive losing rank 1 (its launcher starts it again and the group restarts), and
refuse to start with a rank whose config differs."""
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from llm_serving.shm.buffers import segment_prefix
from tests.integration.server_harness import REPO, ServerProcess, free_port, http, leftovers, project_shm_segments
from tests.integration.test_faults import _kill_agent_under_load
from tests.integration.test_serving import STORY_PROMPTS, assert_greedy_reference
from tests.integration.test_tensor_parallel import _greedy_texts, assert_rank_1_loss

MODEL_ARGS = ["--config", str(REPO / "configs" / "stories260K.yaml")]
# the smallest bucket set (MindSpore's CPU collectives are ~1 ms a call): this group only has to be right
SMALL = ["model_config.decode_batch_size=[1,8]", "model_config.prefill_batch_size=[1]", "serving_config.max_num_seqs=8",
         "serving_config.agent_restart_backoff_s=0.2"]


class NodeLauncher:
    """`llm-serving agent --ranks 1` as an operator runs it on node 1 (its own session, killed with it)."""

    def __init__(self, args: list, log_path: Path):
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "llm_serving.cli", "agent", "--ranks", "1", *args],
                                     cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def agents(self) -> list:
        """Its live agent processes."""
        try:
            return [p for p in psutil.Process(self.proc.pid).children()
                    if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        except psutil.NoSuchProcess:
            return []

    def stop(self) -> list:
        """SIGTERM (the launcher stops its agents), SIGKILL after 20 s; returns processes left alive."""
        procs = [psutil.Process(self.proc.pid)] + self.agents() if self.proc.poll() is None else []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        gone, alive = psutil.wait_procs(procs, timeout=10)
        return alive

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def _group_sets(tmp_path) -> list:
    token = tmp_path / "token"
    token.write_text("rehearsal-token-" + os.urandom(8).hex())
    token.chmod(0o600)
    return SMALL + [f"serving_config.agent_ports=[{free_port()},{free_port()}]",
                    "serving_config.agent_hosts=[null,127.0.0.1]", f"serving_config.cluster_port={free_port()}",
                    f"serving_config.agent_token_file={token}"]


def _args(stories_dir, sets) -> list:
    args = MODEL_ARGS + ["--model", str(stories_dir / "hf")]
    for s in sets:
        args += ["--set", s]
    return args


def _maps_shared_memory(pid: int) -> bool:
    """Whether the process maps any of this test run's step-buffer segments."""
    prefix = "/dev/shm/" + segment_prefix()
    with open(f"/proc/{pid}/maps") as f:
        return any(prefix in line for line in f)


def test_rank_1_on_node_1_serves_the_reference_without_the_shared_memory(stories_dir, tmp_path, stories_server):
    pytest.importorskip("mindspore")
    shm_before = set(project_shm_segments())
    sets = _group_sets(tmp_path)
    node1 = NodeLauncher(_args(stories_dir, sets), tmp_path / "node1.log")
    server = ServerProcess(_args(stories_dir, sets), tmp_path / "server.log")
    try:
        server.wait_ready()
        info = http("GET", server.url + "/info")[1]
        assert info["tensor_parallel_size"] == 2 and info["tensor_parallel_all_reduce"] == "mindspore"
        agents = http("GET", server.url + "/health")[1]["agents"]
        rank1 = next(a for a in agents if a["rank"] == 1)
        assert rank1["host"] == "127.0.0.1" and "host" not in agents[0]
        # rank 1 is the launcher's process, not the master's, and maps none of the master's shared memory
        assert [p.pid for p in node1.agents()] == [rank1["pid"]]
        assert rank1["pid"] not in {p.pid for p in server.refresh_children()}
        assert project_shm_segments() and not _maps_shared_memory(rank1["pid"])
        assert _maps_shared_memory(agents[0]["pid"])
        log = server.log()
        assert "step-input broadcast from rank 0" in log and "on 127.0.0.1) connected" in log

        assert_greedy_reference(server.url, "hf", stories_dir)
        prompts = STORY_PROMPTS[:8]
        assert _greedy_texts(server.url, prompts, 32) == _greedy_texts(stories_server.url, prompts, 32)

        # losing rank 1 under load: its requests fail naming it, its launcher starts it again, the group
        # restarts (rank 0 and the cluster's scheduler too) and serves the same text
        n, max_new = 16, 24
        results, states, killed = asyncio.run(_kill_agent_under_load(server, n, max_new, agent_pid=rank1["pid"],
                                                                     after_done=4))
        assert killed == rank1["pid"]
        assert_rank_1_loss(results, states, n, max_new, max_running=8)
        new = http("GET", server.url + "/health")[1]["agents"]
        assert {a["pid"] for a in new}.isdisjoint({a["pid"] for a in agents})
        assert [p.pid for p in node1.agents()] == [new[1]["pid"]]
        assert "agent 1 (pid %d) exited with code -9; starting it again" % rank1["pid"] in node1.log()
        assert not _maps_shared_memory(new[1]["pid"])
        assert_greedy_reference(server.url, "hf", stories_dir)
    finally:
        server.stop()
        alive = node1.stop()
    assert leftovers(server) == [] and alive == [], server.log()[-3000:]
    assert set(project_shm_segments()) - shm_before == set()


def test_a_rank_started_with_another_config_is_refused_before_serving(stories_dir, tmp_path):
    """Ranks compiled from different configs would hang in their first all-reduce: they compare first."""
    pytest.importorskip("mindspore")
    sets = _group_sets(tmp_path)
    node1 = NodeLauncher(_args(stories_dir, sets + ["model_config.decode_batch_size=[1,4,8]"]), tmp_path / "node1.log")
    server = ServerProcess(_args(stories_dir, sets), tmp_path / "server.log")
    try:
        assert server.proc.wait(300) == 1
    finally:
        server.stop()
        alive = node1.stop()
    log = server.log()
    assert "rank 1's graphs, model_config differ from rank 0's" in log, log[-3000:]
    assert leftovers(server) == [] and alive == []


def test_a_missing_node_fails_the_start_in_time_and_leaves_nothing(stories_dir, tmp_path):
    """No `llm-serving agent` on node 1: the start fails after agent_start_timeout_s, saying which agent and how
    to start it, and the master's own rank and the cluster's scheduler are gone with it."""
    pytest.importorskip("mindspore")
    shm_before = set(project_shm_segments())
    server = ServerProcess(_args(stories_dir, _group_sets(tmp_path) + ["serving_config.agent_start_timeout_s=20"]),
                           tmp_path / "server.log")
    try:
        assert server.proc.wait(120) == 1
    finally:
        server.stop()
    log = server.log()
    assert "never answered: agent 1 (127.0.0.1:" in log and "start them there with `llm-serving agent --ranks 1`" \
        in log, log[-3000:]
    assert leftovers(server) == []
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and set(project_shm_segments()) - shm_before:
        time.sleep(0.1)
    assert set(project_shm_segments()) - shm_before == set()
