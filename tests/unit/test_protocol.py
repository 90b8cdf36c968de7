import socket
import threading

import pytest
from hypothesis import given, settings, strategies as st

from llm_serving.agents import protocol as proto
from llm_serving.agents.server import CommandQueue


def test_frame_round_trip_over_a_socket():
    a, b = socket.socketpair()
    with a, b:
        proto.send_frame(a, proto.DECODE, {"seq": 7, "step": 3, "n": 32})
        frame = proto.recv_frame(b)
    assert frame.command == proto.DECODE
    assert frame.payload == {"seq": 7, "step": 3, "n": 32}
    assert frame.seq == 7


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
    order = [(proto.DECODE, 1), (proto.PREFILL, 2), (proto.DECODE, 3), (proto.HEALTH, 4),
             (proto.PREFILL, 5), (proto.EXIT, 6), (proto.RESET, 7)]
    for cmd, seq in order:
        q.put(proto.Frame(cmd, {"seq": seq}))
    got = [q.get(timeout=1)[0].seq for _ in order]
    assert got == [4, 6, 7, 2, 5, 1, 3]
    assert len(q) == 0


def test_command_queue_get_blocks_until_put():
    q = CommandQueue()
    result = []
    t = threading.Thread(target=lambda: result.append(q.get(timeout=5)[0].command))
    t.start()
    q.put(proto.Frame(proto.DECODE, {"seq": 1}))
    t.join(5)
    assert result == [proto.DECODE]
