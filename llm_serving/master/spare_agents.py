"""Spare agents: agent processes started before a model needs them, so that a start does not wait for Python and
MindSpore's import (about 1.2 s of CPU), and a model loaded on demand beside others being served takes that
second from nobody.

A spare (launch.ENV_SPARE) imports MindSpore and the runner, then waits on its standard input for the rest of its
environment: its config and launch token (`launch`). `AgentGroup` takes one for a rank where one of the same kind
waits (the same huge-pages setting, which glibc reads at exec; not for tensor parallelism, whose ranks need the
cluster's environment at exec) and starts a process of its own otherwise. `llm-serving start` starts one as soon as
its model is decided, before the master's own imports and the tokenizer; with several models
(`serving_config.spare_agent: auto`; `wanted`) the fleet's sweep starts another while nothing is served or loading,
for the next load. A spare that dies is never taken; the master's exit ends them (their standard input closes).

The pool is the master process's: one per process, module state like the logging configuration.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional

from llm_serving.agents import launch
from llm_serving.agents.lifetime import spawn

__all__ = ["Spare", "close", "start", "take", "wanted"]

logger = logging.getLogger(__name__)


@dataclass
class Spare:
    process: subprocess.Popen
    status_fd: int              # the read end of its status pipe
    huge_pages: bool
    started: float              # time.perf_counter() at its start

    def alive(self) -> bool:
        return self.process.poll() is None

    def launch(self, env: dict) -> None:
        """Give it its environment (ENV_CONFIG, ENV_TOKEN): it goes on as a fresh agent would."""
        self.process.stdin.write((json.dumps({"env": env}) + "\n").encode())
        self.process.stdin.close()

    def discard(self) -> None:
        try:
            self.process.stdin.close()          # (EOF: it exits by itself)
        except OSError:
            pass
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        try:
            os.close(self.status_fd)
        except OSError:
            pass


_spares: list = []


def wanted(sc, models: int, at_start: bool = False) -> bool:
    """Whether a server of `models` models with these serving settings (`serving_config`) keeps a spare waiting: not
    with spare_agent off, nor for agents a spare cannot be (several ranks, or ranks on other nodes); at start always,
    afterwards with several models (auto) or always (on)."""
    if sc.spare_agent == "off" or sc.remote_ranks or len(sc.agent_ports) != 1:
        return False
    return at_start or sc.spare_agent == "on" or models > 1


def start(huge_pages: bool) -> None:
    """Start a spare of this kind unless one waits already."""
    if any(s.huge_pages == huge_pages and s.alive() for s in _spares):
        return
    read_fd, write_fd = os.pipe()
    env, workdir = launch.child_env({launch.ENV_SPARE: "1", launch.ENV_STATUS_FD: str(write_fd)},
                                    huge_pages=huge_pages)
    try:
        process = spawn([sys.executable, "-m", "llm_serving.agents.server"], env, workdir, pass_fds=(write_fd,),
                        stdin=subprocess.PIPE)
    except OSError as e:
        os.close(read_fd)
        logger.warning("no spare agent: %s", e)
        return
    finally:
        os.close(write_fd)
    _spares.append(Spare(process, read_fd, huge_pages, time.perf_counter()))


def take(huge_pages: bool) -> Optional[Spare]:
    """A waiting spare of this kind, now the caller's (to `launch`), or None."""
    for spare in list(_spares):
        if spare.huge_pages != huge_pages:
            continue
        _spares.remove(spare)
        if spare.alive():
            return spare
        logger.warning("a spare agent (pid %d) exited with %s before it was needed", spare.process.pid,
                       spare.process.returncode)
        spare.discard()
    return None


def close() -> None:
    """End every waiting spare (the server's shutdown)."""
    while _spares:
        _spares.pop().discard()
