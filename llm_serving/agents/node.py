"""`llm-serving agent`: the agents of one node of a tensor-parallel group that spans nodes.

The master runs on node 0 with rank 0 (and any other ranks whose `serving_config.agent_hosts` entry is
null). Every other node runs this launcher with the same YAML and `--set` options; it starts the node's ranks
(`--ranks`), each as a worker of the group's MindSpore cluster (the environment msrun sets: MS_ROLE=MS_WORKER,
MS_NODE_ID=rank, MS_WORKER_NUM=world, MS_SCHED_HOST/PORT = serving_config.cluster_host/cluster_port, where
the master starts the cluster's scheduler), listening on agent_ports[rank] for the master.

Such an agent has no shared memory: rank 0 broadcasts each step's inputs over the group's collectives
(models/parallel.StepInputBroadcast). It exits when the master's connection drops (its cluster went with the
master, or the master restarts the group); this launcher then starts it again, with a back-off, so it joins the
group's next start. The launcher runs until SIGTERM or SIGINT, then stops its agents; killed, it takes them
with it (agents/lifetime.py).
"""
from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import threading
import time

from llm_serving.agents import launch
from llm_serving.agents.lifetime import spawn
from llm_serving.agents.server import EXIT_PEERS_GONE
from llm_serving.hosts import is_loopback
from llm_serving.models.parallel import cluster_env

logger = logging.getLogger("llm_serving.node")

MAX_BACKOFF_S = 30.0
STABLE_S = 60.0            # an agent that ran this long restarts with the shortest back-off again


def check_ranks(config, ranks: list) -> None:
    """ValueError unless every rank is one the master expects on another node, and the agents listen where the
    master can reach them."""
    sc = config.serving_config
    remote = set(sc.remote_ranks)
    if not ranks:
        raise ValueError("--ranks: name at least one rank")
    bad = [r for r in ranks if r not in remote]
    if bad:
        raise ValueError(f"--ranks {bad}: serving_config.agent_hosts ({sc.agent_hosts}) does not put "
                         f"{'them' if len(bad) > 1 else 'it'} on another node than the master (ranks on other "
                         f"nodes: {sorted(remote) or 'none'})")
    if is_loopback(sc.agent_ip) and not all(is_loopback(sc.agent_hosts[r]) for r in ranks):
        raise ValueError(f"the agents would listen on {sc.agent_ip}, which the master on another machine cannot "
                         "reach: pass --host (this node's address, or 0.0.0.0)")


def agent_environment(config, model_dir: str, rank: int, token: str) -> tuple:
    """(environment, working directory) of rank's agent process: what msrun would set for it, and what the agent
    reads."""
    sc = config.serving_config
    raw = config.to_dict()
    raw["serving_config"]["api_key"] = None              # agents never see the HTTP API key
    device = sc.start_device_id + sc.local_rank(rank)[0]
    env, workdir = launch.child_env({
        **cluster_env(len(sc.agent_ports), sc.cluster_port, rank, host=sc.cluster_host),
        "RANK_ID": str(rank), "DEVICE_ID": str(device),     # (msrun exports these too)
        launch.ENV_CONFIG: json.dumps({"config": raw, "model_dir": model_dir, "rank": rank, "tp_comm": None,
                                      "remote": True}),
        launch.ENV_TOKEN: token}, huge_pages=launch.agent_huge_pages(sc.agent_huge_pages, model_dir))
    env.pop(launch.ENV_STATUS_FD, None)
    return env, workdir


class NodeLauncher:
    """Keeps one agent process per rank running until stopped."""

    def __init__(self, config, model_dir: str, ranks: list, token: str):
        check_ranks(config, ranks)
        self.config, self.model_dir, self.ranks, self.token = config, model_dir, ranks, token
        self.processes: dict = {}              # rank -> (process, when it started)
        self._stop = threading.Event()

    def _start(self, rank: int) -> None:
        env, workdir = agent_environment(self.config, self.model_dir, rank, self.token)
        process = spawn([sys.executable, "-m", "llm_serving.agents.server"], env, workdir)   # dies with this launcher
        self.processes[rank] = (process, time.monotonic())
        sc = self.config.serving_config
        logger.info("agent %d (pid %d) started: port %d, cluster scheduler %s:%d", rank, process.pid,
                    sc.agent_ports[rank], sc.cluster_host, sc.cluster_port)

    def run(self) -> int:
        for rank in self.ranks:
            self._start(rank)
        backoff = {r: 1.0 for r in self.ranks}
        due: dict = {}
        while not self._stop.wait(0.2):
            now = time.monotonic()
            for rank, (process, started) in list(self.processes.items()):
                if rank in due or process.poll() is None:
                    continue
                crashed = process.returncode not in (0, EXIT_PEERS_GONE)   # not asked to exit, nor left with
                if now - started >= STABLE_S or not crashed:                # its master
                    backoff[rank] = 1.0
                logger.log(logging.WARNING if crashed else logging.INFO,
                           "agent %d (pid %d) exited with code %d; starting it again in %.0f s", rank, process.pid,
                           process.returncode, backoff[rank])
                due[rank] = now + backoff[rank]
                backoff[rank] = min(MAX_BACKOFF_S, backoff[rank] * 2)
            for rank, when in list(due.items()):
                if now >= when:
                    del due[rank]
                    self._start(rank)
        self._stop_all()
        return 0

    def stop(self) -> None:
        self._stop.set()

    def _stop_all(self, grace_s: float = 5.0) -> None:
        for process, _ in self.processes.values():
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + grace_s
        for process, _ in self.processes.values():
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def run_node(config, model_dir: str, ranks: list, token: str) -> int:
    launcher = NodeLauncher(config, model_dir, ranks, token)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: launcher.stop())
    return launcher.run()
