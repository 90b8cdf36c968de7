"""Supervision of the agent group: what happens when an agent is lost, and when to stop restarting.

A step an agent answers with a failure ends exactly the requests in it (the engine's business). An agent
that dies (its connection drops) or does not answer a step within `step_timeout_s` is lost, and so is
its KV cache: every running request ends at once with finish_reason "error" and the reason, waiting
requests stay queued, and the agent group is killed and started again (fresh KV cache, every block free,
prefix cache forgotten) after a back-off that doubles per failure. More than `max_agent_restarts` failures
within `agent_restart_window_s` and the supervisor gives up: the engine fails what is queued, refuses new
requests and says why on /health. While agents are down /health answers 503 with the reason; new
requests queue (up to the usual bounds) and run once they are back.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Callable, Optional

from llm_serving.master.agent_group import AgentError, AgentGroup

logger = logging.getLogger(__name__)


class Supervisor:
    def __init__(self, serving_config, agents: AgentGroup, what: str = "agents"):
        self.config = serving_config
        self.agents = agents
        self.what = what                            # for the log: "agents", "draft agent"
        self.failure: Optional[str] = None          # an agent was lost and why; the step loop recovers
        self.down_reason: Optional[str] = None      # agents down (restarting) and why
        self.failed_reason: Optional[str] = None    # gave up restarting: the engine serves nothing more
        self.recent_failures: deque = deque()       # monotonic times of failures within the window
        self.num_restarts = 0

    def agent_lost(self, reason: str) -> None:
        """An agent was lost (connection dropped, a fatal step failure): the step loop will recover."""
        if self.failure is None:
            logger.error("%s", reason)
            self.failure = reason

    async def recover(self, lose_running: Callable[[str], Optional[int]], fail_all: Callable[[str], None]) -> bool:
        """Restart the agent group after a loss, with back-off. lose_running(reason) ends the running
        requests (their KV is gone) and returns how many (None: no request fails, as for a draft model); fail_all(reason) ends every request when giving up.
        Returns True when the agents serve again, False when the supervisor gave up."""
        sc = self.config
        reason = self.down_reason = self.failure
        while True:
            lost = lose_running(f"agent failure: {reason}")
            now = time.monotonic()
            self.recent_failures.append(now)
            while self.recent_failures and now - self.recent_failures[0] > sc.agent_restart_window_s:
                self.recent_failures.popleft()
            failures = len(self.recent_failures)
            logger.error("%s failure (%s)%s", self.what, reason,
                         "" if lost is None else f": {lost} running request(s) failed")
            await self.agents.stop(grace_s=5.0, kill=True)
            if failures > sc.max_agent_restarts:
                self.failed_reason = (f"{self.what} failed {failures} times within {sc.agent_restart_window_s:g} s "
                                      f"(serving_config.max_agent_restarts={sc.max_agent_restarts}); not "
                                      f"restarting. Last failure: {reason}")
                logger.error("%s", self.failed_reason)
                fail_all(self.failed_reason)
                self.down_reason = None
                return False
            delay = sc.agent_restart_backoff_s * 2 ** (failures - 1)
            logger.warning("restarting the %s in %.1f s (failure %d of at most %d within %g s)", self.what, delay,
                           failures, sc.max_agent_restarts, sc.agent_restart_window_s)
            await asyncio.sleep(delay)
            self.failure = None
            t0 = time.perf_counter()
            try:
                await self.agents.start()
            except (AgentError, OSError) as exc:
                reason = self.down_reason = f"restart failed: {exc}"
                logger.error("%s", reason)
                continue
            if self.failure is not None:            # died again while starting
                reason = self.down_reason = self.failure
                continue
            self.num_restarts += 1
            self.down_reason = None
            logger.info("%s restarted in %.1f s; serving again", self.what, time.perf_counter() - t0)
            return True
