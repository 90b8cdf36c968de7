"""Hostile grammars on the default model (SmolLM2-135M-Instruct) through /v1/chat/completions, /v1/completions and
TGI's /generate: never a 5xx. A grammar that would hit one of llguidance's limits at once is a 400 naming its field;
one that hits a limit mid-output ends with finish reason "length" before max_tokens; a choice of 10,000 strings is
answered; and a normal greedy request, alone or alongside a hostile one, keeps its usual text."""
from __future__ import annotations

import re
import threading

import pytest

from tests.integration.server_harness import http, parse_sse

MODEL = "SmolLM2-135M-Instruct"
FORCES_A_MILLION = "(a{1000}){1000}"          # its first mask forces ~500,000 bytes, then the lexer's fuel runs out
CUT_AFTER_ONE = "[bc](a{1000}){1000}"         # the same, after one free token: fails mid-output
AMBIGUOUS = 'start: s\ns: s s | s s s | "a" | "b" | ""'     # Earley rows that grow with the output
NORMAL = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}


def post(url, path, body):
    return http("POST", url + path, body, timeout=300)


@pytest.fixture(scope="module")
def normal_text(smollm2_server):
    """The normal greedy request's text before any hostile grammar was sent."""
    status, body = post(smollm2_server.url, "/v1/completions", NORMAL)
    assert status == 200 and "Paris" in body["choices"][0]["text"], body
    return body["choices"][0]["text"]


def test_grammars_that_would_hit_a_limit_at_once_are_a_400_naming_the_field(smollm2_server, normal_text):
    url = smollm2_server.url
    chat = {"model": MODEL, "max_tokens": 20, "messages": [{"role": "user", "content": "Write a."}]}
    alternatives = "start: " + " | ".join(f'"w{i:04d}"' for i in range(3000))
    loop = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    cases = [("/v1/chat/completions", {**chat, "structured_outputs": {"regex": FORCES_A_MILLION}},
              "structured_outputs.regex", "forces 497508 bytes"),
             ("/v1/completions", {**NORMAL, "guided_grammar": alternatives}, "guided_grammar",
              "too complex for the grammar engine"),
             ("/v1/chat/completions", {**chat, "response_format": {"type": "json_schema", "json_schema": {
                 "name": "loop", "schema": loop}}}, "response_format.json_schema.schema", "no text the model")]
    for path, body, param, words in cases:
        status, reply = post(url, path, body)
        assert status == 400, (param, reply)
        assert reply["error"]["param"] == param and words in reply["error"]["message"], reply
    status, reply = post(url, "/generate", {"inputs": "Write a.", "parameters": {
        "max_new_tokens": 20, "grammar": {"type": "regex", "value": FORCES_A_MILLION}}})
    assert status == 400 and reply["error"].startswith("parameters.grammar.value: the grammar forces"), reply
    status, reply = post(url, "/v1/completions", NORMAL)
    assert status == 200 and reply["choices"][0]["text"] == normal_text, reply


def test_a_choice_of_10000_strings_is_answered_with_one_of_them(smollm2_server):
    words = [f"w{i:05d}" for i in range(10000)]
    status, reply = post(smollm2_server.url, "/v1/completions", {**NORMAL, "prompt": "Pick one:",
                                                                 "guided_choice": words})
    assert status == 200 and reply["choices"][0]["text"] in words, reply
    assert reply["choices"][0]["finish_reason"] == "stop"


def test_a_grammar_that_hits_a_limit_mid_output_ends_with_length_streamed_or_not(smollm2_server):
    url = smollm2_server.url
    status, reply = post(url, "/generate", {"inputs": "Write b.", "parameters": {
        "max_new_tokens": 20, "details": True, "grammar": {"type": "regex", "value": CUT_AFTER_ONE}}})
    assert status == 200, reply
    assert reply["details"]["finish_reason"] == "length" and reply["details"]["generated_tokens"] < 20, reply
    assert "could not go on" in reply["details"]["finish_message"], reply       # and why
    assert re.fullmatch("[bc]a*", reply["generated_text"]), reply
    status, text = post(url, "/v1/chat/completions", {"model": MODEL, "max_tokens": 20, "stream": True,
                                                      "messages": [{"role": "user", "content": "Write b."}],
                                                      "structured_outputs": {"regex": CUT_AFTER_ONE}})
    assert status == 200 and text.rstrip().endswith("data: [DONE]"), text
    events = parse_sse(text.replace("data: [DONE]", ""))
    assert not any("error" in e for e in events), events
    reasons = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"] is not None]
    assert any("could not go on" in c.get("finish_message", "") for e in events for c in e["choices"]), events
    content = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    assert reasons == ["length"] and re.fullmatch("[bc]a*", content), events


def test_an_ambiguous_grammar_is_cut_short_while_a_normal_request_keeps_its_text(smollm2_server, normal_text):
    """The hostile request runs its steps (each one's mask bounded) next to a normal one, which keeps its greedy
    text; the hostile one ends at the row limit with "length", well before its max_tokens."""
    url = smollm2_server.url
    hostile = {}

    def run_hostile():
        hostile["reply"] = post(url, "/v1/completions", {**NORMAL, "prompt": "Write a and b:", "max_tokens": 400,
                                                         "guided_grammar": AMBIGUOUS})
    thread = threading.Thread(target=run_hostile)
    thread.start()
    normal = [post(url, "/v1/completions", NORMAL) for _ in range(2)]
    overlapped = thread.is_alive()       # (its ~50 steps take several times the two normal requests)
    thread.join(timeout=300)
    assert overlapped and not thread.is_alive()
    for status, reply in normal:
        assert status == 200 and reply["choices"][0]["text"] == normal_text, reply
    status, reply = hostile["reply"]
    assert status == 200, reply
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "length" and reply["usage"]["completion_tokens"] < 400, reply
    assert "too complex" in choice["finish_message"], reply
    assert re.fullmatch("[ab]*", choice["text"]), reply


def test_allowed_token_ids_that_leave_a_grammar_no_token_end_the_reply_cleanly(smollm2_server):
    """allowed_token_ids and a grammar with no token in common (here the EOS alone, which `a+` does not allow first):
    nothing can be sampled, so the reply ends with "length" and says why, not a 500 (schemathesis found the 500)."""
    status, reply = post(smollm2_server.url, "/v1/completions", {"model": MODEL, "prompt": "Once", "max_tokens": 5,
                                                                 "guided_regex": "a+", "allowed_token_ids": [0]})
    assert status == 200, reply
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "length" and choice["text"] == "", reply
    assert "allowed_token_ids" in choice["finish_message"], reply
