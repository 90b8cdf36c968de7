"""The OutputProcessor (master/output_processor.py), the one owner of a step's outcome: which tokens each row's
request gets, the token-level stops, the KV counted as computed, finished requests freed — for every step kind,
asserted on request and block state. (The fake-runner tests of test_scheduler, test_speculative and test_draft
run it under load too.)"""
import dataclasses

import numpy as np
import pytest

from llm_serving.master.logits import LogitsState
from llm_serving.master.output_processor import OutputProcessor
from llm_serving.master.request import PromptLogprob, Request, RequestStatus, SamplingParams
from llm_serving.master.speculative.stats import SpecStats
from llm_serving.master.step_io import StepOutputs
from tests.unit.test_scheduler import make_scheduler

EOS = 2


def running(sched, *prompts, max_new_tokens=8, **sampling):
    """Requests of `prompts` admitted and prefilled up to their last token (as after a prefill step whose token
    has been appended), so that the next step is a decode step."""
    reqs = [Request(list(p), SamplingParams(max_new_tokens=max_new_tokens, **sampling), frozenset({EOS}),
                    req_id=f"r{i}") for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add(r)
    batch = sched.schedule()
    outputs = OutputProcessor(sched)
    outputs.update_from_output(batch, StepOutputs([10] * len(reqs), [-0.5] * len(reqs)))
    return reqs, outputs


def test_a_plain_step_appends_each_rows_token_and_stops_at_a_stop_token():
    sched = make_scheduler(num_blocks=16)
    (a, b), outputs = running(sched, [5, 6, 7], [8, 9])
    assert a.output_ids == [10] and a.num_computed_tokens == 3 and a.first_token_time is not None
    batch = sched.schedule()
    results = outputs.update_from_output(batch, StepOutputs([11, EOS], [-0.1, -0.2]))
    assert [(r.request, r.token_ids, r.logprobs, r.finish_reason) for r in results] == \
        [(a, [11], [-0.1], None), (b, [EOS], [-0.2], "stop")]
    assert a.num_computed_tokens == 4 and a.status is RequestStatus.RUNNING
    assert b.finished and b.finish_reason == "stop" and "r1" not in sched.bm.block_tables   # freed at once
    assert outputs.num_generated_tokens == 4 and outputs.batch_sizes[("decode", 2)] == 1


def test_length_stops_at_max_new_tokens_and_at_the_model_length():
    sched = make_scheduler(num_blocks=16, max_model_len=6)
    (a, b), outputs = running(sched, [5, 6, 7, 8], [3], max_new_tokens=2)
    results = outputs.update_from_output(sched.schedule(), StepOutputs([11, 12], [0.0, 0.0]))
    assert [r.finish_reason for r in results] == ["length", "length"]        # a: 4 + 2 tokens = max_model_len
    assert a.output_ids == [10, 11] and b.output_ids == [10, 12]             # b: max_new_tokens 2


def test_a_request_that_ended_while_the_step_ran_gets_nothing():
    sched = make_scheduler(num_blocks=16)
    (a, b), outputs = running(sched, [5, 6], [7, 8])
    batch = sched.schedule()
    sched.finish(a, "abort")
    results = outputs.update_from_output(batch, StepOutputs([11, 12], [0.0, 0.0]))
    assert [r.request for r in results] == [b] and a.output_ids == [10] and a.num_computed_tokens == 2


def test_a_prompt_chunk_gets_no_token_and_counts_its_kv():
    sched = make_scheduler(num_blocks=16, chunked_prefill=True, max_chunk_tokens=4)
    req = Request(list(range(3, 13)), SamplingParams(max_new_tokens=4), frozenset(), req_id="long")
    sched.add(req)
    outputs = OutputProcessor(sched)
    assert outputs.update_from_output(sched.schedule(), StepOutputs([99], [0.0])) == []
    assert req.num_computed_tokens == 4 and req.output_ids == []


def test_a_decode_run_gets_a_token_per_step_it_took_and_stops_inside():
    sched = make_scheduler(num_blocks=32, decode_steps=4, decode_steps_max_rows=4)
    (a, b, c), outputs = running(sched, [5, 6, 7], [8, 9], [4], max_new_tokens=10)
    batch = sched.schedule()
    assert batch.steps == 4 and batch.run_lens == [4, 4, 4]
    results = outputs.update_from_output(batch, StepOutputs([[11, 12, 13, 14], [21, EOS, 23, 24], [31, 32, 33, 34]],
                                                            [[0.0] * 4] * 3))
    got = {r.request.req_id: (r.token_ids, r.finish_reason) for r in results}
    assert got == {"r0": ([11, 12, 13, 14], None), "r1": ([21, EOS], "stop"), "r2": ([31, 32, 33, 34], None)}
    # the agent fed the first 3 of a row's 4 tokens back: their KV is in; the last one is fed next step
    assert a.num_computed_tokens == 3 + 1 + 3 and a.num_tokens == 3 + 5
    assert b.finished and b.output_ids == [10, 21, EOS]


def test_run_lens_cut_a_rows_tokens():
    sched = make_scheduler(num_blocks=32, decode_steps=4, decode_steps_max_rows=4)
    (a, b), outputs = running(sched, [5, 6, 7], [8, 9], max_new_tokens=3)
    batch = sched.schedule()
    assert batch.run_lens == [2, 2]                      # 3 - 1 token each
    results = outputs.update_from_output(batch, StepOutputs([[11, 12, 13, 14], [21, 22, 23, 24]], [[0.0] * 4] * 2))
    assert [(r.token_ids, r.finish_reason) for r in results] == [([11, 12], "length"), ([21, 22], "length")]


def test_a_verify_step_keeps_the_agreeing_path_and_records_the_round():
    from llm_serving.master.speculative.planner import SpeculativePlanner, SpeculativeSpec
    from tests.unit.test_speculative import EmptyProposer

    sched = make_scheduler(num_blocks=32, spec_max_rows=4)
    (a, b), outputs = running(sched, [5, 6, 7], [8, 9], max_new_tokens=10)
    outputs = OutputProcessor(sched, SpecStats(3))
    planner = SpeculativePlanner(SpeculativeSpec(3, 2), EmptyProposer(False), sched)
    batch = sched.schedule()
    # a: a chain 20 21 22; b: a tree 30 -> (31 | 32)
    batch = planner.attach(dataclasses.replace(batch, spec_limits=[3, 2]),
                           [([20, 21, 22], [-1, 0, 1]), ([30, 31, 32], [-1, 0, 0])])
    assert batch.is_verify and batch.num_new_tokens == [4, 4]
    # targets after the last token, then after each node: a keeps 20 21 (40, not 22, after 21); b keeps 30, then
    # 32 (the target gives 32 after 30)
    results = outputs.update_from_output(batch, StepOutputs([[20, 21, 40, 0], [30, 32, 0, 50]], [[0.0] * 4] * 2))
    assert [r.token_ids for r in results] == [[20, 21, 40], [30, 32, 50]]
    assert a.num_computed_tokens == 3 + 1 + 2                # last token + the 2 kept proposals, in place
    assert b.num_computed_tokens == 2 + 1 + 1                # 30 in place; 32 sat in another slot: fed again
    d = outputs.spec_stats.as_dict()
    assert (d["verify_steps"], d["rounds"], d["proposed_tokens"], d["accepted_tokens"]) == (1, 2, 6, 4)
    assert d["other_branch_rounds"] == 1
    assert (a.num_new_tokens, b.num_new_tokens) == (1, 2)    # b's next step feeds 32 again, then 50


class ScriptedMatcher:
    """An llguidance-like matcher that accepts exactly `script`, then is stopped."""

    def __init__(self, script):
        self.script, self.at = list(script), 0

    def consume_token(self, token):
        if self.at < len(self.script) and self.script[self.at] == token:
            self.at += 1
            return True
        return False

    def is_stopped(self):
        return self.at == len(self.script)

    def get_error(self):
        return "not in the script"


@pytest.mark.parametrize("tokens, reason, error", [([11], None, None), ([11, 12], "stop", None),
                                                   ([11, 99], "error", "not in the script")])
def test_the_grammar_ends_a_request_when_matched_and_fails_it_on_a_refused_token(tokens, reason, error):
    """The grammar matched by the request's third token ends it as "stop", although that token also reached
    max_new_tokens; a token the grammar refuses ends it with the grammar's error."""
    sched = make_scheduler(num_blocks=16)
    (req,), outputs = running(sched, [5, 6], max_new_tokens=3)
    req.logits = LogitsState(req.sampling, [EOS], 128, ScriptedMatcher([11, 12]))
    for token in tokens:
        (result,) = outputs.update_from_output(sched.schedule(), StepOutputs([token], [0.0]))
    assert result.token_ids == [tokens[-1]] and result.finish_reason == reason
    assert result.error == (error and f"the grammar does not allow token 99 here: {error}")
    assert req.finished == (reason is not None)


def test_prompt_scores_are_kept_per_position_before_the_rows_advance():
    sched = make_scheduler(num_blocks=16, chunked_prefill=True, max_chunk_tokens=3)
    req = Request([5, 6, 7, 8, 9], SamplingParams(max_new_tokens=2, prompt_logprobs=1), frozenset(), req_id="s")
    sched.add(req)
    outputs = OutputProcessor(sched)
    for chunk in range(2):
        batch = sched.schedule()
        start = req.num_computed_tokens
        q = batch.num_new_tokens[0]
        # the score of the prompt token after new token j: logprob -(position), rank 1, itself on top
        lps = np.array([[-(start + j + 1.0) for j in range(3)]], np.float32)
        ranks = np.ones((1, 3), np.int32)
        top_ids = np.array([[[req.prompt_ids[min(start + j + 1, 4)]] for j in range(3)]], np.int32)
        out = StepOutputs([42], [0.0], prompt=(lps, ranks, top_ids, lps[..., None]))
        outputs.update_from_output(batch, out)
        assert req.num_computed_tokens == start + q
    assert req.prompt_scores[0] is None
    assert req.prompt_scores[1:] == [PromptLogprob(-float(p), 1, [(req.prompt_ids[p], -float(p))])
                                     for p in range(1, 5)]
    assert req.output_ids == [42]


def test_dropping_the_tokens_after_a_stop_string():
    sched = make_scheduler(num_blocks=32, decode_steps=4, decode_steps_max_rows=4)
    (req,), outputs = running(sched, [5, 6, 7], max_new_tokens=10)
    outputs.update_from_output(sched.schedule(), StepOutputs([[11, 12, 13, 14]], [[-1.0, -2.0, -3.0, -4.0]]))
    before = outputs.num_generated_tokens
    outputs.drop_last(req, 2)                            # the engine found a stop string in 12's text
    assert req.output_ids == [10, 11, 12] and req.output_logprobs == [-0.5, -1.0, -2.0]
    assert outputs.num_generated_tokens == before - 2
