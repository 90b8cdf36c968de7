"""A blocking client for an agent's control commands (health, reset, capture, exit), for people and tools.

It connects without shared memory (`shm: null`), so it can talk to an agent while the master drives it:
control commands go ahead of queued steps. The token is the master's per-launch token, read from the
runtime dir (`launch.token_file`, written by the master when it connects the agent) unless given.
"""
from __future__ import annotations

import itertools
import socket
from typing import Optional

from llm_serving.agents import protocol as proto
from llm_serving.agents.launch import token_file


class ControlError(RuntimeError):
    """The agent refused the command (the message is its error text) or could not be reached."""


class ControlClient:
    def __init__(self, port: int, host: str = "127.0.0.1", token: Optional[str] = None, timeout_s: float = 30.0):
        if token is None:
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
            self.info = self.request(proto.Connect(token=token, shm=None))
        except ControlError:
            self.close()
            raise

    def request(self, command: proto.Message) -> proto.Reply:
        """Send one command and return the agent's typed reply; ControlError if it says failed."""
        try:
            self._sock.sendall(proto.encode(next(self._seq), command))
            answer = proto.read_reply(proto.recv_frame(self._sock).payload, command)
        except (OSError, ConnectionError, proto.ProtocolError) as exc:
            raise ControlError(f"agent connection failed during {command.COMMAND!r}: {exc}") from exc
        if isinstance(answer, proto.Failed):
            raise ControlError(answer.error)
        return answer

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> "ControlClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
