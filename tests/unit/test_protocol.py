import socket
import threading

import pytest
from hypothesis import given, settings, strategies as st

from llm_serving.agents import protocol as proto
from llm_serving.agents.server import CommandQueue


def test_frame_round_trip_over_a_socket():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(proto.encode(7, proto.Step(kind="decode", step=3, num_rows=32)))
        frame = proto.recv_frame(b)
    assert frame.command == proto.STEP
    assert frame.payload == {"seq": 7, "kind": "decode", "step": 3, "num_rows": 32, "max_query_len": 1, "steps": 1}
    assert frame.seq == 7
    assert proto.read_command(frame) == proto.Step(kind=proto.StepKind.DECODE, step=3, num_rows=32)
    # a step frame without "max_query_len" or "steps": one token per row, one step
    step = proto.read_command(proto.Frame(proto.STEP, {"seq": 1, "kind": "decode", "step": 3, "num_rows": 2}))
    assert (step.max_query_len, step.steps) == (1, 1)


def test_a_steps_queue_priority_comes_from_its_kind():
    def priority(message):
        return proto.priority(proto.decode_body(proto.encode(1, message)[proto.HEADER.size:]))
    assert priority(proto.Health()) == priority(proto.LoadLora(slot=1, name="a", path=None)) == 0
    assert priority(proto.Step(kind="prefill", step=1, num_rows=1, max_query_len=4)) == 1
    assert {priority(proto.Step(kind=k, step=1, num_rows=1)) for k in ("decode", "verify", "decode_run")} == {2}


@pytest.mark.parametrize("message", [
    proto.Connect(token="t", shm={"input_ids": "llmsrv_x"}), proto.Connect(token="t"),
    proto.Step(kind="prefill", step=1, num_rows=4, max_query_len=32), proto.Step(kind="decode", step=2, num_rows=1),
    proto.Step(kind="decode_run", step=2, num_rows=3, steps=8),
    proto.Step(kind="verify", step=2, num_rows=3, max_query_len=4), proto.Health(), proto.Reset(),
    proto.Capture(dir="/tmp/c", max_steps=3), proto.Capture(), proto.Exit()])
def test_every_command_round_trips_as_its_typed_message(message):
    frame = proto.decode_body(proto.encode(5, message)[proto.HEADER.size:])
    assert frame.command == message.COMMAND and frame.seq == 5
    assert proto.read_command(frame) == message


@pytest.mark.parametrize("command, payload, message", [
    (proto.STEP, {"step": 1, "num_rows": 2}, "needs 'kind'"),
    (proto.STEP, {"kind": "sideways", "step": 1, "num_rows": 2}, "kind must be one of"),
    (proto.STEP, {"kind": "decode", "step": 1, "num_rows": "2"}, "'num_rows' must be int"),
    (proto.STEP, {"kind": "decode", "step": 1, "num_rows": True}, "'num_rows' must be int"),
    (proto.CONNECT, {"token": 3}, "'token' must be str"),
    (proto.CONNECT, {"token": "t", "shm": [1]}, "'shm' must be dict or null"),
    (proto.CAPTURE, {"dir": 5}, "'dir' must be str or null"),
])
def test_a_payload_that_does_not_fit_its_command_names_the_key(command, payload, message):
    with pytest.raises(proto.ProtocolError, match=message):
        proto.read_command(proto.Frame(command, {"seq": 1, **payload}))


def test_replies_are_read_as_the_commands_reply_or_as_a_failure():
    step = proto.Step(kind="decode", step=1, num_rows=1)
    ok = proto.StepReply(step=1, model_ms=2.5, agent_ms=3, cache_epoch=0)
    frame = proto.decode_body(proto.encode(9, ok)[proto.HEADER.size:])
    assert frame.command == proto.REPLY and frame.payload["ok"] is True
    assert proto.read_reply(frame.payload, step) == ok
    failed = proto.decode_body(proto.encode(9, proto.Failed(error="boom", fatal=True))[proto.HEADER.size:])
    assert proto.read_reply(failed.payload, step) == proto.Failed(error="boom", fatal=True)
    with pytest.raises(proto.ProtocolError, match="cache_epoch"):       # a reply of an older agent
        proto.read_reply({"seq": 9, "ok": True, "step": 1, "model_ms": 1.0, "agent_ms": 1.0}, step)


def test_frame_layout_is_length_prefixed():
    data = proto.encode_frame(proto.HEALTH, {"seq": 1})
    (length,) = proto.HEADER.unpack(data[:4])
    assert length == len(data) - 4
    assert data[4:5] == b"h"


@pytest.mark.parametrize("body, message", [
    (b"", "empty frame"),
    (b"Z{}", "unknown command"),
    (b"h[1]", "JSON object"),
    (b"h{not json", "not JSON"),
    (b"h\xff\xfe", "not JSON"),
])
def test_bad_bodies_are_rejected(body, message):
    with pytest.raises(proto.ProtocolError, match=message):
        proto.decode_body(body)


def test_oversized_and_truncated_frames():
    with pytest.raises(proto.ProtocolError):
        proto.check_length(proto.MAX_FRAME_BYTES + 1)
    with pytest.raises(proto.ProtocolError):
        proto.encode_frame(proto.CONNECT, {"x": "y" * proto.MAX_FRAME_BYTES})
    a, b = socket.socketpair()
    with a, b:
        a.sendall(proto.encode_frame(proto.HEALTH, {"seq": 1})[:-2])
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(ConnectionError, match="mid-frame"):
            proto.recv_frame(b)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_decoder_never_raises_anything_but_protocol_error(body):
    try:
        frame = proto.decode_body(body)
    except proto.ProtocolError:
        return
    assert frame.command in proto.COMMANDS | {proto.REPLY}
    assert isinstance(frame.payload, dict)


def test_command_queue_serves_control_then_prefill_then_decode_fifo_within_class():
    q = CommandQueue()
    decode, prefill, verify = ((proto.STEP, {"kind": kind}) for kind in ("decode", "prefill", "verify"))
    order = [(decode, 1), (prefill, 2), (verify, 3), ((proto.HEALTH, {}), 4), (prefill, 5), ((proto.EXIT, {}), 6),
             ((proto.RESET, {}), 7)]
    for (cmd, payload), seq in order:
        q.put(proto.Frame(cmd, {"seq": seq, **payload}))
    got = [q.get(timeout=1)[0].seq for _ in order]
    assert got == [4, 6, 7, 2, 5, 1, 3]
    assert len(q) == 0


def test_command_queue_get_blocks_until_put():
    q = CommandQueue()
    result = []
    t = threading.Thread(target=lambda: result.append(q.get(timeout=5)[0].command))
    t.start()
    q.put(proto.Frame(proto.STEP, {"seq": 1, "kind": "decode"}))
    t.join(5)
    assert result == [proto.STEP]
