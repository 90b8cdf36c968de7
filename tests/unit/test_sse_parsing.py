"""server_process.parse_sse, the tests' reader of an event stream: a line ends at CR LF, LF or CR only, as SSE
says, so a generated text that holds U+2028, NEL or a form feed raw inside a data line's JSON stays one line (the
HTTP fuzz test met a reply whose text split there)."""
from __future__ import annotations

import json

from llm_serving.server_process import parse_sse, sse_lines


def test_a_data_line_with_unicode_line_separators_is_one_event():
    texts = ["0\u2028a", "b\x85c", "d\u2029e", "\x0bf\x0c"]
    body = "".join(f"data: {json.dumps({'text': t}, ensure_ascii=False)}\n\n" for t in texts)
    assert [e["text"] for e in parse_sse(body)] == texts


def test_lines_end_at_cr_lf_lf_or_cr_and_done_is_left_out():
    body = 'event: x\r\ndata: {"a": 1}\r\n\rdata: {"a": 2}\n\ndata: [DONE]\n\n'
    assert parse_sse(body) == [{"a": 1}, {"a": 2}]
    assert sse_lines("a\r\nb\rc\nd") == ["a", "b", "c", "d"]
