"""A blocking client for an agent's control commands (health, reset, capture, exit), for people and tools.

It connects without shared memory (`shm: null`), so it can talk to an agent while the master drives it:
control commands go ahead of queued steps. The token is the master's per-launch token, read from the
runtime dir (see master/agent_group.token_file) unless given.
"""
from __future__ import annotations

import itertools
import socket
from typing import Optional

from llm_serving.agents import protocol as proto


class ControlError(RuntimeError):
    """The agent refused the command (the message is its error text) or could not be reached."""


class ControlClient:
    def __init__(self, port: int, host: str = "127.0.0.1", token: Optional[str] = None, timeout_s: float = 30.0):
        if token is None:
            from llm_serving.master.agent_group import token_file

            path = token_file(port)
            if not path.is_file():
                raise ControlError(f"no token for agent port {port} at {path}; pass the token explicitly")
            token = path.read_text().strip()
        self._seq = itertools.count(1)
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as exc:
            raise ControlError(f"cannot reach agent on {host}:{port}: {exc}") from exc
        try:
            self.info = self.request(proto.CONNECT, token=token, shm=None)
        except ControlError:
            self.close()
            raise

    def request(self, command: str, **payload) -> dict:
        """Send one command and return the agent's reply payload; ControlError if it says failed."""
        seq = next(self._seq)
        try:
            proto.send_frame(self._sock, command, {"seq": seq, **payload})
            answer = proto.recv_frame(self._sock).payload
        except (OSError, ConnectionError, proto.ProtocolError) as exc:
            raise ControlError(f"agent connection failed during {command!r}: {exc}") from exc
        if not answer.get("ok"):
            raise ControlError(answer.get("error") or f"command {command!r} failed")
        return answer

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> "ControlClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
