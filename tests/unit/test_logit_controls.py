"""Logit controls and grammars without a model: the agent's application of bias, masks and min_p (pure numpy), the
master's per-request state (bans that depend on the output, a grammar's masks), grammars compiled against real
vocabularies (the stories260K sentencepiece model, SmolLM2's byte-level BPE when installed) and the request
fields that give them."""
from __future__ import annotations

import json
import random
import threading
import time

import jsonschema
import numpy as np
import pytest

from llm_serving.master.grammar import GrammarError, GrammarSpec, Grammars
from llm_serving.master.logits import LogitsState, bits_of
from llm_serving.master.request import SamplingParams
from llm_serving.models.logit_controls import MASKED, apply_controls, logit_rows, read_controls
from llm_serving.server.api.base import validate
from llm_serving.server.api.openai import CompletionRequest
from llm_serving.server.api.tgi import GenerateRequest
from llm_serving.server.errors import ValidationError
from llm_serving.server.translate import prepare
from llm_serving.shm.layout import BAN_BIAS
from llm_serving.tokenization import SentencePieceTokenizer


def _fail(message):
    raise ValueError(message)


def test_bias_mask_and_min_p_change_only_their_rows_and_tokens():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 70)).astype(np.float32)      # row 3: padding the rows below do not describe
    per_row = {"bias_len": np.array([2, 0, 0], np.int32), "bias_ids": np.array([[5, 5], [0, 0], [0, 0]], np.int32),
               "bias_values": np.array([[1.5, 2.0], [0, 0], [0, 0]], np.float32),
               "mask_on": np.array([0, 1, 0], np.int32),
               "token_mask": np.stack([bits_of([], 70), bits_of([3, 64, 69], 70), bits_of([], 70)]),
               "min_p": np.array([0.0, 0.0, 0.5], np.float32)}
    temperature = np.array([0.0, 0.0, 2.0, 0.0], np.float32)
    out = apply_controls(logits, per_row, temperature)
    expected = logits.copy()
    expected[0, 5] += 3.5                                      # entries for one token add up
    keep = np.zeros(70, bool)
    keep[[3, 64, 69]] = True
    expected[1, ~keep] = MASKED
    p = np.exp(logits[2] / 2.0)
    expected[2, p < 0.5 * p.max()] = MASKED                    # min_p at the row's temperature
    np.testing.assert_array_equal(out, expected)
    assert (out[2] > MASKED).sum() >= 1
    np.testing.assert_array_equal(logits[3], out[3])


def test_min_p_leaves_greedy_rows_alone_and_controls_are_read_once_the_master_has_written_them():
    logits = np.arange(10, dtype=np.float32)[None, :]
    out = apply_controls(logits, {"min_p": np.array([0.9], np.float32)}, np.array([0.0], np.float32))
    np.testing.assert_array_equal(out, logits)

    class Step:
        controls_on = np.zeros(3, np.int32)
        controls_pending = np.ones(1, np.int32)
        mask_on = np.array([0, 1, 0], np.int32)
        token_mask = np.stack([bits_of([], 20), bits_of([3], 20), bits_of([], 20)])
        bias_len = np.array([0, 0, 1], np.int32)
        bias_ids = np.array([[0], [0], [7]], np.int32)
        bias_values = np.array([[0], [0], [2.5]], np.float32)
        min_p = np.zeros(3, np.float32)
    assert logit_rows(Step, 3) == {}
    Step.controls_on = np.array([0, 1, 1], np.int32)
    kept = logit_rows(Step, 3)
    assert kept["controls_on"].tolist() == [0, 1, 1] and kept["row_index"].tolist() == [0, 1, 2]
    # the master is still writing: the sampler waits, then fails the step instead of reading half-written rows
    with pytest.raises(ValueError, match="did not write"):
        read_controls(Step, np.array([1, 2]), 20, _fail, timeout_s=0.05)

    def master():                         # writes the flag down a moment later, from another thread
        time.sleep(0.05)
        Step.controls_pending[0] = 0
    threading.Thread(target=master).start()
    got = read_controls(Step, np.array([1, 2]), 20, _fail)
    assert got["mask_on"].tolist() == [1, 0] and got["bias_ids"].tolist() == [[0], [7]]
    assert got["bias_len"].tolist() == [0, 1]
    Step.bias_ids = np.array([[0], [0], [25]], np.int32)
    with pytest.raises(ValueError, match="bias_ids must be token ids"):
        read_controls(Step, np.array([2]), 20, _fail)


def test_bans_follow_the_output_min_tokens_and_bad_words():
    sp = SamplingParams(min_tokens=2, bad_words=((7,), (1, 2, 3)), logit_bias=((9, -1.0), (9, -2.0)),
                        allowed_token_ids=(4, 5))
    state = LogitsState(sp, {0, 11}, vocab_size=40)
    row = np.zeros(2, np.int32)
    masked, ids, values = state.write(row, [])
    assert masked and np.nonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))[0].tolist() == [4, 5]
    assert dict(zip(ids, values)) == {9: -3.0, 7: BAN_BIAS, 0: BAN_BIAS, 11: BAN_BIAS}
    _, ids, values = state.write(row, [5, 1, 2])               # min_tokens reached; "1 2" was written: 3 is out
    assert dict(zip(ids, values)) == {9: -3.0, 7: BAN_BIAS, 3: BAN_BIAS}
    _, ids, _ = state.write(row, [5, 1, 2, 4])
    assert 3 not in ids
    assert state.accept(4) and not state.complete               # no grammar: every token is accepted


def _walk(grammars, spec, tokenizer, seed, steps=200) -> str:
    """Sample a random allowed token each step, as a model would inside the masks, until the grammar ends."""
    matcher = grammars.compile_now(spec)
    state = LogitsState(SamplingParams(grammar=spec), set(tokenizer.eos_ids), grammars.vocab_size, matcher)
    row = np.zeros(grammars.mask_words, np.int32)
    rng, out = random.Random(seed), []
    for _ in range(steps):
        assert state.write(row, out)[0]
        allowed = np.nonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))[0].tolist()
        allowed = [t for t in allowed if t not in tokenizer.eos_ids] or allowed
        token = rng.choice(allowed)
        assert state.accept(token), state.error
        out.append(token)
        if state.complete:
            return tokenizer.decode(out)
    raise AssertionError(f"the grammar did not end in {steps} tokens: {tokenizer.decode(out)!r}")


SCHEMA = {"type": "object", "required": ["id", "tags"], "additionalProperties": False,
          "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                         "tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "minItems": 1, "maxItems": 3}}}


def _vocabularies(stories_dir):
    yield "stories260K (sentencepiece)", SentencePieceTokenizer(str(stories_dir / "hf" / "tokenizer.model"))
    from llm_serving.models.default_model import smollm2_gguf
    from llm_serving.tokenization import load_tokenizer
    if smollm2_gguf() is not None:
        yield "SmolLM2 (byte-level BPE)", load_tokenizer(str(smollm2_gguf()), None)


def test_any_walk_inside_the_masks_matches_the_grammar_on_real_vocabularies(stories_dir):
    for name, tok in _vocabularies(stories_dir):
        grammars = Grammars(tok, tok.vocab_size + 3)             # a model's padding rows: never allowed
        schema = GrammarSpec.json_schema(SCHEMA, "response_format")
        for seed in range(3):
            jsonschema.validate(json.loads(_walk(grammars, schema, tok, seed)), SCHEMA)
        assert _walk(grammars, GrammarSpec("choice", ("alpha", "beta gamma"), "c"), tok, 0) in ("alpha", "beta gamma")
        import re
        assert re.fullmatch(r"[0-9]{3}-[a-z]+!", _walk(grammars, GrammarSpec("regex", r"[0-9]{3}-[a-z]{1,6}!", "r"),
                                                       tok, 1)), name
        gbnf = 'root ::= "n=" [0-9] [0-9]?'
        assert re.fullmatch(r"n=[0-9]{1,2}", _walk(grammars, GrammarSpec("grammar", gbnf, "g"), tok, 2)), name


def test_grammars_that_do_not_compile_name_their_field(stories_dir):
    tok = SentencePieceTokenizer(str(stories_dir / "hf" / "tokenizer.model"))
    grammars = Grammars(tok, tok.vocab_size)
    for spec, words in ((GrammarSpec("regex", "a(b", "guided_regex"), "unclosed group"),
                        (GrammarSpec.json_schema({"type": "nope"}, "structured_outputs.json"), "nope"),
                        (GrammarSpec("grammar", "start: missing", "structured_outputs.grammar"), "missing")):
        with pytest.raises(GrammarError, match=words) as info:
            grammars.compile_now(spec)
        assert info.value.param == spec.field and str(info.value).startswith(spec.field)
    with pytest.raises(GrammarError, match="not valid JSON"):
        GrammarSpec.json_schema("{oops", "guided_json")
    # compiled once, copied per request: two matchers of one spec advance on their own
    spec = GrammarSpec("choice", ("ab", "cd"), "c")
    first, second = grammars.compile_now(spec), grammars.compile_now(spec)
    assert first is not second and first.consume_tokens(tok.encode_verbatim("ab")) and not first.is_error()
    assert second.consume_tokens(tok.encode_verbatim("cd")) and not second.is_error()   # (it did not advance with it)


class _Tok:
    vocab_size = 100

    def encode(self, text, add_bos=False):
        return [ord(c) % 100 for c in text]


class _Engine:
    """What translate.prepare reads of the engine for a completion."""
    model_name, vocab_size, max_model_len, tokenizer = "m", 100, 64, _Tok()

    def served_models(self):
        return ["m"]


def _structured(body):
    return validate(CompletionRequest, {"model": "m", "prompt": "p", **body})._grammar


def test_request_fields_become_sampling_fields_or_a_400_naming_them():
    body = {"model": "m", "prompt": "p", "logit_bias": {"5": 10, "7": -100.0}, "min_p": 0.1, "min_tokens": 3,
            "bad_words": ["ab"], "allowed_token_ids": [1, 2, 2], "max_tokens": 8}
    sp = prepare(validate(CompletionRequest, body).to_request(), _Engine()).sampling
    assert (sp.logit_bias, sp.min_p, sp.min_tokens, sp.bad_words, sp.allowed_token_ids) == (
        ((5, 10.0), (7, -100.0)), 0.1, 3, ((97 % 100, 98 % 100), (32, 97 % 100, 98 % 100)), (1, 2))
    for bad, param in (({"logit_bias": {"100": 1}}, "logit_bias"), ({"allowed_token_ids": [3, 100]},
                                                                    "allowed_token_ids"),
                       ({"stop_token_ids": [100]}, "stop_token_ids"), ({"prompt": [5, 100]}, "prompt")):
        with pytest.raises(ValidationError) as info:       # the vocabulary's bound: the served model's
            prepare(validate(CompletionRequest, {**body, **bad}).to_request(), _Engine())
        assert info.value.param == param, bad
    assert _structured({"response_format": {"type": "text"}}) is None
    assert _structured({"guided_choice": ["x", "y", "x"]}) == GrammarSpec("choice", ("x", "y"), "guided_choice")
    assert _structured({"structured_outputs": {"json_object": True}}).kind == "json_object"
    spec = _structured({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}})
    assert spec.kind == "json" and json.loads(spec.value) == SCHEMA
    tgi = validate(GenerateRequest, {"inputs": "x", "parameters": {"grammar": {"type": "regex", "value": "[ab]+"}}})
    assert tgi.to_request(False, None).sampling.grammar == GrammarSpec("regex", "[ab]+", "parameters.grammar.value")
    for body, param in (({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
                        ({"structured_outputs": {"xml": "a"}}, "structured_outputs"),
                        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
                        ({"response_format": {"type": "json_schema", "json_schema": []}}, "response_format"),
                        ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
                        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"), ({"bad_words": [" "]}, "bad_words")):
        with pytest.raises(ValidationError) as info:
            _structured(body)
        assert info.value.param == param, body
    with pytest.raises(ValidationError, match="parameters.grammar"):
        validate(GenerateRequest, {"inputs": "x", "parameters": {"grammar": {"type": "lark", "value": "x"}}})


def test_a_row_whose_controls_fail_is_left_without_them_and_the_others_are_written():
    from llm_serving.master.step_io import RowWriter

    class Broken(LogitsState):
        def write(self, mask_row, output_ids, filled=False):
            raise RuntimeError("boom")
    z = np.zeros
    buffers = type("B", (), {"token_mask": z((3, 2), np.int32), "mask_on": z(3, np.int32) + 7,
                             "bias_ids": z((3, 4), np.int32), "bias_values": z((3, 4), np.float32),
                             "bias_len": z(3, np.int32) + 7})()
    good = LogitsState(SamplingParams(allowed_token_ids=(3,), logit_bias=((5, 1.0),)), set(), vocab_size=40)
    bad = Broken(SamplingParams(min_tokens=1), {0}, vocab_size=40)
    RowWriter(buffers, 16).controls([(0, good, []), (2, bad, [])])
    assert buffers.mask_on.tolist() == [1, 7, 0] and buffers.bias_len.tolist() == [1, 7, 0]
    assert buffers.token_mask[0].tolist() == bits_of([3], 40).tolist() and buffers.bias_ids[0, 0] == 5
    assert bad.error.startswith("its logit controls could not be written: boom") and good.error is None
