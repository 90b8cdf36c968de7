"""The access log of a real server (server/access_log.py): a line per request in its log, read back from the
server's output. Each request carries a query string of its own (routes ignore it; the line keeps it), so its line
is found among the other tests' on the shared stories260K server.

- a chat completion, whole and streamed (its usage from stream_options), and an embedding: their lines' status,
  path, model and token counts are the replies' usage;
- a 400 (a bad field value) and a 404 (an unknown model): their lines say the model and the message the client got;
- a /health poll answered 200 is left to DEBUG (the server logs at INFO);
- with `--set serving_config.access_log=false` nothing is logged by `llm_serving.access`."""
from __future__ import annotations

import json
import re
import time

import pytest

from tests.integration.server_harness import REPO, http, parse_sse, serving

ACCESS = "llm_serving.access: "
LINE = re.compile(r'(?P<client>\S+) - "(?P<method>\S+) (?P<path>\S+) HTTP/1\.1" (?P<status>\d+) [^=]*?'
                  r'(?= \w+=|$)(?P<fields>.*)$')


def access_line(server, marker: str, timeout_s: float = 10.0):
    """The fields of the access line whose path carries `marker` (a streamed reply's line comes once its stream
    ended, maybe just after the client read it: waited for, boundedly); None when there is none by then."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = [line.split(ACCESS, 1)[1] for line in server.log_path.read_text(errors="replace").splitlines()
                 if ACCESS in line and marker in line]
        if found or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if not found:
        return None
    assert len(found) == 1, found
    match = LINE.match(found[0])
    assert match, found[0]
    fields = dict(re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)', match["fields"]))
    return {**fields, "line": found[0], "method": match["method"], "path": match["path"],
            "status": int(match["status"]), "client": match["client"]}


def test_every_request_has_a_line_with_its_status_model_and_usage(stories_server):
    url = stories_server.url
    chat = {"model": "hf", "messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": 9,
            "temperature": 0}
    status, whole = http("POST", url + "/v1/chat/completions?case=access-whole", chat)
    assert status == 200, whole
    line = access_line(stories_server, "case=access-whole")
    assert (line["method"], line["path"], line["status"]) == ("POST", "/v1/chat/completions?case=access-whole", 200)
    assert line["line"].split('" ', 1)[1].startswith("200 OK model=hf ")
    assert re.fullmatch(r"127\.0\.0\.1:\d+", line["client"])
    assert int(line["prompt_tokens"]) == whole["usage"]["prompt_tokens"]
    assert int(line["completion_tokens"]) == whole["usage"]["completion_tokens"] == 9
    assert line["finish"] == whole["choices"][0]["finish_reason"] == "length"
    assert 0 <= int(line["ttft_ms"]) <= int(line["total_ms"])

    status, text = http("POST", url + "/v1/chat/completions?case=access-stream",
                        {**chat, "max_tokens": 7, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200
    assert text.rstrip().endswith("data: [DONE]"), text
    usage = [c for c in parse_sse(text.replace("data: [DONE]", "")) if c.get("usage")][-1]["usage"]
    line = access_line(stories_server, "case=access-stream")
    assert line["status"] == 200 and line["model"] == "hf"
    assert (int(line["prompt_tokens"]), int(line["completion_tokens"])) == \
        (usage["prompt_tokens"], usage["completion_tokens"]) == (whole["usage"]["prompt_tokens"], 7)
    assert 0 <= int(line["ttft_ms"]) <= int(line["total_ms"])

    status, embedded = http("POST", url + "/v1/embeddings?case=access-embed",
                            {"model": "hf", "input": ["a cat", "the dog ran"]})
    assert status == 200
    line = access_line(stories_server, "case=access-embed")
    assert (line["status"], line["model"]) == (200, "hf")
    assert (int(line["prompt_tokens"]), int(line["completion_tokens"])) == (embedded["usage"]["prompt_tokens"], 0)
    assert "ttft_ms" not in line


def test_a_400_and_a_404_say_the_model_and_the_message_the_client_got(stories_server):
    url = stories_server.url
    chat = {"model": "hf", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    status, body = http("POST", url + "/v1/chat/completions?case=access-400", {**chat, "temperature": 7})
    assert status == 400 and body["error"]["param"] == "temperature"
    line = access_line(stories_server, "case=access-400")
    assert line["status"] == 400 and line["line"].split('" ', 1)[1].startswith("400 Bad Request model=hf ")
    assert line["error"] == json.dumps(body["error"]["message"], ensure_ascii=False)
    assert "prompt_tokens" not in line and "completion_tokens" not in line

    status, body = http("POST", url + "/v1/chat/completions?case=access-404", {**chat, "model": "no-such-model"})
    assert status == 404
    line = access_line(stories_server, "case=access-404")
    assert (line["status"], line["model"]) == (404, "no-such-model")
    assert line["error"] == json.dumps(body["error"]["message"], ensure_ascii=False)

    status, _ = http("GET", url + "/health?case=access-poll")          # polling stays out of an INFO log
    assert status == 200 and access_line(stories_server, "case=access-poll", timeout_s=1.0) is None
    status, _ = http("GET", url + "/v1/models?case=access-models")       # a GET that is not polling is there
    assert status == 200 and access_line(stories_server, "case=access-models")["status"] == 200


def test_the_setting_off_logs_no_access_line(stories_dir, tmp_path):
    pytest.importorskip("mindspore")
    args = ["--config", str(REPO / "configs" / "stories260K.yaml"), "--model", str(stories_dir / "hf"),
            "--set", "serving_config.access_log=false"]
    with serving(args, tmp_path / "server.log") as server:
        status, _ = http("POST", server.url + "/v1/chat/completions", {
            "model": "hf", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert status == 200
        assert http("POST", server.url + "/v1/chat/completions", {
            "model": "nope", "messages": [{"role": "user", "content": "hi"}]})[0] == 404
        assert http("GET", server.url + "/v1/models")[0] == 200
    log = (tmp_path / "server.log").read_text(errors="replace")
    assert "serving model 'hf'" in log and "llm_serving.access" not in log
