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
    model_name, vocab_size, max_model_len, tokenizer, default_max_tokens = "m", 100, 64, _Tok(), None
    image_facts = None                  # (a text model)

    def served_models(self):
        return ["m"]

    def check_generates(self):          # (a model that generates)
        return None


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


# --- hostile grammars: refused when compiled, or cut short within bounded steps ---------------------------------------

def _stories_grammars(stories_dir):
    tok = SentencePieceTokenizer(str(stories_dir / "hf" / "tokenizer.model"))
    return tok, Grammars(tok, tok.vocab_size)


def _steps(grammars, spec, tok, max_steps, seed=0):
    """Random allowed tokens (EOS only when nothing else is), as _walk, until the grammar ends, fails or is cut short:
    (its LogitsState, the tokens taken, the slowest step's seconds: its mask and its token)."""
    state = LogitsState(SamplingParams(grammar=spec), set(tok.eos_ids), grammars.vocab_size,
                        grammars.compile_now(spec))
    row = np.zeros(grammars.mask_words, np.int32)
    rng, out, slowest = random.Random(seed), [], 0.0
    for _ in range(max_steps):
        t0 = time.perf_counter()
        state.write(row, out)
        if state.cut_short or state.error:
            break
        allowed = np.nonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))[0].tolist()
        token = rng.choice([t for t in allowed if t not in tok.eos_ids] or allowed)
        accepted = state.accept(token)
        slowest = max(slowest, time.perf_counter() - t0)
        if not accepted:
            break
        out.append(token)
        if state.complete:
            break
    return state, out, slowest


def test_grammars_that_would_hit_a_limit_at_once_are_refused_when_compiled_naming_their_field(stories_dir):
    """Each used to pass compilation and fail its request at the first token (a 500); now a 400 before it is queued,
    saying what is wrong. The cases already bounded stay refused the same way."""
    tok, grammars = _stories_grammars(stories_dir)
    alternatives = "start: " + " | ".join(f'"w{i:04d}"' for i in range(3000))
    nested = {"type": "integer"}
    for _ in range(300):
        nested = {"type": "array", "items": nested}
    cases = [(GrammarSpec("regex", "(a{1000}){1000}", "guided_regex"), "forces 497508 bytes before the model"),
             (GrammarSpec("grammar", alternatives, "guided_grammar"), "too complex for the grammar engine (Parser "
                                                                      "Error: Current row has 3001 items; max is 500"),
             (GrammarSpec.json_schema({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                       "$ref": "#/$defs/a"}, "response_format"), "no text the model can write"),
             (GrammarSpec.json_schema(nested, "guided_json"), "recursion limit"),
             (GrammarSpec.json_schema({"enum": [f"value number {i}" for i in range(10000)]}, "guided_json"),
              "is too large")]
    for spec, words in cases:
        with pytest.raises(GrammarError) as info:
            grammars.compile_now(spec)
        assert info.value.param == spec.field and str(info.value).startswith(spec.field)
        assert words in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_large_but_bounded_grammars_are_served(stories_dir):
    """A choice of 10,000 strings (one lexeme: as a rule it would hit the row limit at its first token), a JSON enum
    of 3,000, a left-recursive list, a long forced text: each walks with every step's mask quick."""
    tok, grammars = _stories_grammars(stories_dir)
    words = tuple(f"w{i:05d}" for i in range(10000))
    for seed in range(2):
        state, out, slowest = _steps(grammars, GrammarSpec("choice", words, "guided_choice"), tok, 20, seed)
        assert state.complete and tok.decode(out) in words and slowest < 0.5, tok.decode(out)
    enum = [f"value {i}" for i in range(3000)]
    state, out, _ = _steps(grammars, GrammarSpec.json_schema({"enum": enum}, "guided_json"), tok, 30)
    assert state.complete and json.loads(tok.decode(out)) in enum
    state, out, slowest = _steps(grammars, GrammarSpec("grammar", 'start: list\nlist: list "," item | item\n'
                                                                   'item: /[0-9]/', "g"), tok, 300)
    assert not (state.cut_short or state.error) and len(out) == 300 and slowest < 0.5
    state, out, slowest = _steps(grammars, GrammarSpec("regex", "a{60000}b", "guided_regex"), tok, 40)
    assert not (state.cut_short or state.error) and set(tok.decode(out)) == {"a"} and slowest < 0.5


def test_a_long_forced_text_is_tokenized_canonically_at_its_head_and_spelled_whole(stories_dir):
    """llguidance tokenizes a grammar's forced text at every step: beyond its head, greedily (fast), but spelling
    exactly the same bytes."""
    tok, grammars = _stories_grammars(stories_dir)
    lltok = grammars.lltokenizer()
    text = "Once upon a time, a little bird sang. " * 2000
    t0 = time.perf_counter()
    ids = lltok.tokenize_str(text)
    assert time.perf_counter() - t0 < 0.5
    assert lltok.decode_str(ids) == text and ids[:50] == tok.encode_verbatim(text)[:50]


def test_a_grammar_that_hits_a_limit_mid_output_is_cut_short_within_bounded_steps(stories_dir):
    """A regex that forces a million bytes after its first token exhausts the lexer's fuel; an ambiguous grammar's
    Earley rows grow with its output until the row limit (with llguidance's defaults its steps pass half a second
    and it runs on). Both are cut short ("length", master/logits.py), not failed, and no step is slow."""
    tok, grammars = _stories_grammars(stories_dir)
    for spec, words, most in ((GrammarSpec("regex", "[bc](a{1000}){1000}", "r"), "too many expressions", 5),
                              (GrammarSpec("grammar", 'start: s\ns: s s | s s s | "a" | "b" | ""', "g"),
                               "Current row has 501 items; max is 500", 300)):
        state, out, slowest = _steps(grammars, spec, tok, most)
        assert state.error is None and state.cut_short is not None, (state.error, len(out))
        assert state.cut_short.startswith("the output stopped where its grammar could not go on: the grammar is too "
                                          "complex for the grammar engine") and words in state.cut_short
        assert slowest < 0.5 and len(out) < most


class _FailingMatcher:
    """An llguidance-like matcher that takes `tokens`, then fails with `message`: computing the next mask
    (`at_mask`) or taking the next token."""

    def __init__(self, tokens, message, at_mask):
        self.tokens, self.message, self.at_mask, self.failed = list(tokens), message, at_mask, False

    def is_error(self):
        self.failed = self.failed or (self.at_mask and not self.tokens)
        return self.failed

    def consume_token(self, token):
        if self.tokens and self.tokens[0] == token:
            self.tokens.pop(0)
            return True
        self.failed = True
        return False

    def get_error(self):
        return self.message + "\n<non-verbose/>" if self.failed else ""

    def is_stopped(self):
        return self.failed


@pytest.mark.parametrize("at_mask, message, reason, kept", [
    (True, "lexer error: too many expressions constructed", "length", [11]),
    (False, "Parser Error: Current row has 501 items; max is 500; consider ...", "length", [11, 12]),
    (True, "NoExtensionBias", "length", [11]),
    (False, "token 12 not allowed", "error", [11, 12])])
def test_a_request_whose_grammar_cannot_go_on_ends_with_length_and_says_why(at_mask, message, reason, kept):
    """A limit hit (or no token left) computing the mask: the token sampled under it is not kept; taking a token:
    it is (the mask allowed it). Either way "length" with the reason; any other failure stays an "error"."""
    from llm_serving.master.step_io import StepOutputs
    from tests.unit.test_output_processor import running
    from tests.unit.test_scheduler import make_scheduler

    sched = make_scheduler(num_blocks=16)
    (req,), outputs = running(sched, [5, 6], max_new_tokens=8)
    req.logits = LogitsState(req.sampling, [2], 128, _FailingMatcher([11], message, at_mask))
    for token in (11, 12):
        req.logits.write(np.zeros(4, np.int32), req.output_ids, filled=True)    # (as RowWriter, after fill_masks)
        (result,) = outputs.update_from_output(sched.schedule(), StepOutputs([token], [0.0]))
    assert result.finish_reason == reason and req.finished and req.output_ids == [10] + kept
    if reason == "length":
        assert result.error.startswith("the output stopped where its grammar could not go on: ")
        assert ("too complex" in result.error) == ("NoExtension" not in message) and "\n" not in result.error
    else:
        assert result.error == "the grammar does not allow token 12 here: token 12 not allowed"
