"""The master <-> agent wire protocol: every TCP message, its framing, and command priorities.

Frame (both directions):   | length: uint32 big-endian | command: 1 byte ASCII | payload: JSON, UTF-8 |
`length` counts the command byte plus the payload and is at most MAX_FRAME_BYTES. Bulk step data never
travels here: it is in shared memory (see llm_serving/shm/layout.py); a step frame only says which step
and how many rows and tokens per row to read.

Commands (llm-serving's letters), payload keys, and the reply payload on success:
  '#' connect   {seq, token, shm: {array: segment name} | null}  -> {num_blocks, block_size, vocab_size, ...}
  '*' prefill   {seq, step, n, s}   rows 0..n-1, s tokens per row -> {step, model_ms, agent_ms}
  'a' decode    {seq, step, n}      rows 0..n-1, one token per row -> {step, model_ms, agent_ms}
  'h' health    {seq}                                              -> {pid, device_id, steps, connected}
  'r' reset     {seq}               drop all KV state              -> {}
  'c' capture   {seq, dir: path | null, max_steps: int}            -> {dir, steps}
                logits capture (rank 0): every step's inputs and full logits go to dir/step_NNNNNNNN.npz
                (see agents/worker.py) until max_steps or a capture with dir null, which stops it
  'e' exit      {seq}               reply, then the agent exits    -> {}
Reply: command 'R', payload {seq, ok: bool, error: str (when not ok), fatal: true (when not ok because the
agent can serve no more steps: its tensor-parallel group is out of step), ...}. `seq` echoes the
request's, so replies may come back out of order (the agent serves control before prefill before decode).

Tensor parallelism adds one reply field: every agent of the group gets the same step frames (and reads the
same shared-memory inputs); rank 0 writes the outputs; the ranks exchange partial sums among themselves
(models/parallel.py), never through the master. Each rank's step reply, ok or failed, carries
`collective_calls`, the all-reducing graph calls it has completed: when a step fails on some ranks only,
equal counts tell the master the group is still in step (master/agent_group.py).
"""
from __future__ import annotations

import json
import socket
import struct
from dataclasses import dataclass
from typing import Any

HEADER = struct.Struct(">I")          # uint32 frame length
MAX_FRAME_BYTES = 1 << 20             # 1 MiB: commands are small, bulk data is in shm

CONNECT, PREFILL, DECODE, HEALTH, RESET, EXIT, CAPTURE, REPLY = "#", "*", "a", "h", "r", "e", "c", "R"
COMMANDS = {CONNECT, PREFILL, DECODE, HEALTH, RESET, EXIT, CAPTURE}

# Lower runs first. Control before prefill (new requests' first token) before decode.
PRIORITY = {EXIT: 0, RESET: 0, HEALTH: 0, CONNECT: 0, CAPTURE: 0, PREFILL: 1, DECODE: 2}


class ProtocolError(ValueError):
    """A frame that cannot be accepted: truncated, oversized, unknown command, or bad payload."""


@dataclass
class Frame:
    command: str
    payload: dict
    received: float = 0.0     # time.perf_counter() when the agent read it (for the step profile)

    @property
    def seq(self) -> Any:
        return self.payload.get("seq")


def encode_frame(command: str, payload: dict) -> bytes:
    if len(command) != 1:
        raise ProtocolError(f"command must be one character, got {command!r}")
    body = command.encode("ascii") + json.dumps(payload, separators=(",", ":")).encode("utf-8")
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(body)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    return HEADER.pack(len(body)) + body


def decode_body(body: bytes) -> Frame:
    """Parse one frame body (command byte + JSON payload), validating the command and payload."""
    if not body:
        raise ProtocolError("empty frame")
    command = chr(body[0])
    if command not in COMMANDS and command != REPLY:
        raise ProtocolError(f"unknown command {command!r}")
    try:
        payload = json.loads(body[1:].decode("utf-8")) if len(body) > 1 else {}
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"payload of {command!r} is not JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise ProtocolError(f"payload of {command!r} must be a JSON object")
    return Frame(command, payload)


def check_length(length: int) -> None:
    if length == 0 or length > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame length {length} outside 1..{MAX_FRAME_BYTES}")


def reply(seq: Any, ok: bool = True, error: str = "", **fields: Any) -> bytes:
    payload = {"seq": seq, "ok": ok, **fields}
    if not ok:
        payload["error"] = error
    return encode_frame(REPLY, payload)


# --- blocking socket helpers (agent side and agent-ctl) ---------------------------------------------

def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(n)
        if not chunk:
            raise ConnectionError("connection closed" + (" mid-frame" if chunks else ""))
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket) -> Frame:
    (length,) = HEADER.unpack(_recv_exact(sock, HEADER.size))
    check_length(length)
    return decode_body(_recv_exact(sock, length))


def send_frame(sock: socket.socket, command: str, payload: dict) -> None:
    sock.sendall(encode_frame(command, payload))


# --- asyncio helpers (master side) -------------------------------------------------------------------

async def read_frame_async(reader) -> Frame:
    header = await reader.readexactly(HEADER.size)
    (length,) = HEADER.unpack(header)
    check_length(length)
    return decode_body(await reader.readexactly(length))
