"""The master <-> agent wire protocol: every TCP message, its framing, and command priorities.

Frame (both directions):   | length: uint32 big-endian | command: 1 byte ASCII | payload: JSON, UTF-8 |
`length` counts the command byte plus the payload and is at most MAX_FRAME_BYTES. Bulk step data never
travels here: it is in shared memory (see llm_serving/shm/layout.py); a step frame only says which step
and how many rows and tokens per row to read.

Commands (llm-serving's letters) and their messages, the dataclasses below (one per command and reply;
`encode` writes any of them, `Message.from_payload` reads and checks one):
  '#' Connect      token, shm: {array: segment name} | null      -> ConnectReply (geometry, cache_epoch)
  's' Step         kind, step, num_rows, max_query_len, steps,   -> StepReply (model_ms, agent_ms, ...)
                   images (a prefill step's: where its images' tokens are, their pixels' shm segment),
                   encode (an image whose vision tower runs about budget_ms ahead of its prefill step, before the
                   step's model: `EncodeSlice`; the reply's `encoded` says whether it is done)
                   kind (shm/layout.py's StepKind): prefill, decode (one new token per row), verify
                   (speculative decoding: a token is sampled after every new token of a row, not only its
                   last) or decode_run (`steps` greedy decode steps, each row's token fed to the next)
  'h' Health                                                     -> HealthReply (pid, rank, steps, attached)
  'r' Reset        zero the KV cache                             -> ResetReply (the new cache_epoch)
  'c' Capture      dir: path | null, max_steps                   -> CaptureReply (dir, steps)
                   logits capture (rank 0): every step's inputs and full logits go to dir/step_NNNNNNNN.npz
                   (see agents/worker.py) until max_steps or a capture with dir null, which stops it
  'l' LoadLora     slot, name, path | null                       -> LoraReply (slot, name, rank, slot_mb)
                   LoRA adapter slot `slot` now holds the PEFT adapter at `path` (checked against the model),
                   or nothing (path null); the master sends it only while no step in flight uses the slot
  'e' Exit         reply, then the agent exits                   -> Done
A step reads rows 0..num_rows-1 of the step buffers, max_query_len tokens per row at most. Every reply's
payload carries `seq` (the command's, so replies may come back out of order: the agent serves control
before prefill before decode: `priority`) and `ok`. A command that failed gets Failed: `error`, and `fatal` when the
agent can serve no more steps (its tensor-parallel group is out of step).

`cache_epoch` counts the agent's KV-cache resets: a reset (by `llm-serving agent-ctl reset`, say) zeroes
the blocks the master's prefix cache and running requests point at, and the next step reply tells the
master, which then recomputes what it had (master/engine.py).

Tensor parallelism adds one reply field: every agent of the group gets the same step frames (and reads the
same shared-memory inputs); rank 0 writes the outputs; the ranks exchange partial sums among themselves
(models/parallel.py), never through the master. Each rank's step reply, ok or failed, carries
`collective_calls`, the all-reducing graph calls it has completed: when a step fails on some ranks only,
equal counts tell the master the group is still in step (master/agent_group.py).
"""
from __future__ import annotations

import functools
import json
import socket
import struct
import typing
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, ClassVar, Optional

from llm_serving.shm.layout import STEP_PRIORITY, StepKind  # noqa: F401 - StepKind is the master's too

HEADER = struct.Struct(">I")          # uint32 frame length
MAX_FRAME_BYTES = 1 << 20             # 1 MiB: commands are small, bulk data is in shm

CONNECT, STEP, HEALTH, RESET, EXIT, CAPTURE, LOAD_LORA, REPLY = "#", "s", "h", "r", "e", "c", "l", "R"
COMMANDS = {CONNECT, STEP, HEALTH, RESET, EXIT, CAPTURE, LOAD_LORA}


def priority(frame: "Frame") -> int:
    """A command's place in the agent's queue, lower first: control commands 0, a step its kind's
    (layout.STEP_PRIORITY: prefill before decode, verify and decode runs)."""
    if frame.command != STEP:
        return 0
    try:
        return STEP_PRIORITY[StepKind(frame.payload.get("kind"))]
    except ValueError:
        return 0                  # a malformed step fails when it runs; it may as well fail soon


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


# --- messages --------------------------------------------------------------------------------------

class Message:
    """A command or reply: a dataclass whose fields are its payload's keys (besides `seq`)."""
    COMMAND: ClassVar[str]

    def payload(self) -> dict:
        return asdict(self)

    @classmethod
    def from_payload(cls, payload: dict):
        """The message a payload holds; ProtocolError naming the key that is missing or of the wrong type
        (unknown keys are ignored: a newer peer may send more)."""
        hints, values = _field_hints(cls), {}
        for f in fields(cls):
            if f.name not in payload:
                if f.default is MISSING and f.default_factory is MISSING:
                    raise ProtocolError(f"{cls.__name__} ({cls.COMMAND!r}) needs {f.name!r}")
                continue
            value = payload[f.name]
            if not _has_type(value, hints[f.name]):
                raise ProtocolError(f"{cls.__name__} ({cls.COMMAND!r}): {f.name!r} must be "
                                    f"{_type_name(hints[f.name])}, got {value!r}")
            values[f.name] = value
        return cls(**values)


@functools.lru_cache(maxsize=None)
def _field_hints(cls) -> dict:
    """A message class's resolved field types (typing.get_type_hints: ~50 us a call, and every step's reply
    needs them)."""
    return typing.get_type_hints(cls)


def _has_type(value, hint) -> bool:
    if typing.get_origin(hint) is typing.Union:
        return any(_has_type(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, typing.get_origin(hint) or hint)


def _type_name(hint) -> str:
    if typing.get_origin(hint) is typing.Union:
        return " or ".join(_type_name(h) for h in typing.get_args(hint))
    return "null" if hint is type(None) else getattr(typing.get_origin(hint) or hint, "__name__", str(hint))


def encode(seq: Any, message: Message) -> bytes:
    """The frame of a command or reply message."""
    return encode_frame(message.COMMAND, {"seq": seq, **message.payload()})


@dataclass(frozen=True)
class Connect(Message):
    COMMAND: ClassVar[str] = CONNECT
    token: str
    shm: Optional[dict] = None      # array name -> segment name; null for a control connection (agent-ctl), or
                                    # for a rank on another node than the master (its inputs come from rank 0)
    master: bool = False            # the group's master (not agent-ctl): an agent on another node exits when
                                    # this connection drops, as its group's collectives are gone with the master


@dataclass(frozen=True)
class Step(Message):
    """One step of the model over rows 0..num_rows-1 of the step buffers (see the module docstring)."""
    COMMAND: ClassVar[str] = STEP
    kind: str                       # a StepKind (a str: it travels as its value)
    step: int
    num_rows: int
    max_query_len: int = 1
    steps: int = 1                  # a decode run's steps
    images: Optional[list] = None   # a prefill step's images: StepImage's fields, a dict each
    encode: Optional[dict] = None   # an image to encode ahead, before the step: EncodeSlice's fields

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", StepKind(self.kind))
        except ValueError:
            raise ProtocolError(f"Step: kind must be one of {', '.join(k.value for k in StepKind)}, "
                                f"got {self.kind!r}") from None

    def payload(self) -> dict:
        out = asdict(self)
        for key in ("images", "encode"):
            if out[key] is None:           # (most steps: nothing said)
                del out[key]
        return out

    def encode_slice(self) -> Optional["EncodeSlice"]:
        """The image this step encodes ahead, if any (ProtocolError for one that is malformed)."""
        if self.encode is None:
            return None
        if not isinstance(self.encode, dict):
            raise ProtocolError(f"Step: encode must be an object, got {self.encode!r}")
        return EncodeSlice.from_payload(self.encode)

    def step_images(self) -> tuple:
        """The step's images as StepImage's (ProtocolError for one that is malformed)."""
        return tuple(StepImage.from_payload(entry) if isinstance(entry, dict) else _not_an_image(entry)
                     for entry in self.images or ())


def _not_an_image(entry):
    raise ProtocolError(f"Step: each of images must be an object, got {entry!r}")


@dataclass(frozen=True)
class StepImage(Message):
    """An image whose tokens a prefill step feeds (models/runner/images.py): row `row`'s new tokens offset..offset +
    count - 1 are the image's tokens first..first + count - 1 of `length`; `key` names its content (the encoded-image
    cache's key), `segment` the shared memory holding its float32 pixels of `shape` (shm/images.py)."""
    COMMAND: ClassVar[str] = STEP
    row: int
    offset: int
    first: int
    count: int
    length: int
    key: str
    segment: str
    shape: list


@dataclass(frozen=True)
class EncodeSlice(Message):
    """Run about `budget_ms` (at least one layer) more of the vision tower's layers on the image `key` (its float32
    pixels of `shape` in shared memory `segment`), ahead of the prefill step that feeds it (models/runner/images.py's
    `advance`): while other requests decode, an image's tens of seconds of tower are spread over their steps."""
    COMMAND: ClassVar[str] = STEP
    key: str
    segment: str
    shape: list
    budget_ms: float




@dataclass(frozen=True)
class Health(Message):
    COMMAND: ClassVar[str] = HEALTH


@dataclass(frozen=True)
class Reset(Message):
    COMMAND: ClassVar[str] = RESET


@dataclass(frozen=True)
class Capture(Message):
    COMMAND: ClassVar[str] = CAPTURE
    dir: Optional[str] = None       # start capturing into this directory; null stops
    max_steps: int = 100_000


@dataclass(frozen=True)
class LoadLora(Message):
    COMMAND: ClassVar[str] = LOAD_LORA
    slot: int
    name: Optional[str] = None      # the adapter's served name (logs)
    path: Optional[str] = None      # its PEFT directory; null empties the slot


@dataclass(frozen=True)
class Exit(Message):
    COMMAND: ClassVar[str] = EXIT


COMMAND_MESSAGES = {m.COMMAND: m for m in (Connect, Step, Health, Reset, Capture, LoadLora, Exit)}


def read_command(frame: Frame) -> Message:
    """The typed command a frame carries; ProtocolError if its payload does not fit."""
    return COMMAND_MESSAGES[frame.command].from_payload(frame.payload)


@dataclass(frozen=True)
class Reply(Message):
    COMMAND: ClassVar[str] = REPLY
    ok: ClassVar[bool] = True

    def payload(self) -> dict:
        return {"ok": self.ok, **asdict(self)}


@dataclass(frozen=True)
class Done(Reply):
    """Success with nothing to say (exit)."""


@dataclass(frozen=True)
class ConnectReply(Reply):
    rank: int
    pid: int
    device_id: int
    num_blocks: int
    block_size: int
    vocab_size: int
    max_position_embeddings: int
    cache_epoch: int
    token_trees: bool = True        # verify steps may be token trees (packed verify steps: the CPU kernel path)
    scores_prompts: bool = True     # prefill steps may score prompt tokens (packed prefill: the CPU kernel path)
    decode_steps: int = 1           # steps a decode run may have (1: the agent runs no decode runs)
    decode_run_rows: int = 0        # the most rows a decode run may have
    batch_invariant: bool = False   # its steps are batch-invariant (model_config.batch_invariant, as it resolved)
    image_tokens: int = 0           # the tokens an image becomes in its prefill steps (0: it takes no images; -1:
                                    # as many as its size makes, Qwen2.5-VL's)
    max_image_tokens: int = 0       # the most tokens an image may have (its tokens go in one graph call)


@dataclass(frozen=True)
class StepReply(Reply):
    step: int
    model_ms: float                 # in ModelRunner.execute
    agent_ms: float                 # from reading the frame to the reply (queueing, shm reads and writes)
    cache_epoch: int
    collective_calls: Optional[int] = None     # tensor parallelism only
    encoded: Optional[bool] = None  # a step with `encode`: the image's tower is done (or its rows were cached)
    encode_error: Optional[str] = None         # ... or why it could not run (the image's request ends with it)


@dataclass(frozen=True)
class HealthReply(Reply):
    pid: int
    rank: int
    device_id: int
    steps: int
    attached: bool                  # the master's step buffers are attached (or, on another node, its own)
    cache_epoch: int
    input_broadcasts: Optional[int] = None     # a group across nodes: step-input broadcasts so far
    input_broadcast_ms: Optional[float] = None  # and the milliseconds they took on this rank


@dataclass(frozen=True)
class ResetReply(Reply):
    cache_epoch: int


@dataclass(frozen=True)
class CaptureReply(Reply):
    dir: Optional[str]
    steps: int


@dataclass(frozen=True)
class LoraReply(Reply):
    slot: int
    name: Optional[str]
    rank: int                       # 0: the slot is empty
    slot_mb: float                  # memory one slot takes on this agent


@dataclass(frozen=True)
class Failed(Reply):
    ok: ClassVar[bool] = False
    error: str
    fatal: bool = False
    collective_calls: Optional[int] = None


# each command's reply on success
REPLY_OF = {Connect: ConnectReply, Step: StepReply, Health: HealthReply, Reset: ResetReply, Capture: CaptureReply,
            LoadLora: LoraReply, Exit: Done}


def read_reply(payload: dict, command: Message) -> Reply:
    """The typed reply to `command` a payload holds (Failed when not ok); ProtocolError if it does not fit."""
    return (REPLY_OF[type(command)] if payload.get("ok") else Failed).from_payload(payload)


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
