"""Draft-model speculation, the master's part (master/speculative/draft.py): the rounds a DraftProposer runs and the draft
KV bookkeeping, with a fake draft agent that keeps its KV by slot and refuses to read a position whose KV is
stale — so a `num_draft_computed` that claims more than the draft's cache holds fails the test, and one that
claims less shows as the draft re-feeding tokens (counted)."""
import asyncio
import dataclasses
import random
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llm_serving.agents import protocol as proto
from llm_serving.config import ConfigError, config_from_dict
from llm_serving.master.speculative.draft import DraftProposer
from llm_serving.master.speculative.planner import SpeculativePlanner, SpeculativeSpec
from tests.unit.test_scheduler import make_requests, make_scheduler, next_token, reference_output
from tests.unit.test_speculative import (SpecFakeRunner, TreeFakeRunner, add_random_requests,
                                        assert_outputs_are_plain_decodings)


class FakeDraftAgents:
    """What a draft agent does with a step, on the step buffers' arrays: write each fed token's KV at its
    slot, read the row's context back through its block table, and 'sample' the true next token of what it
    read (wrong with probability `wrong`)."""

    def __init__(self, requests, bm, rows=8, tokens=64, width=64, wrong=0.0, seed=0, top_n=0):
        z = lambda *shape, dtype=np.int32: np.zeros(shape, dtype)      # noqa: E731
        self.buffers = SimpleNamespace(
            input_ids=z(rows, tokens), positions=z(rows, tokens), slot_mapping=z(rows, tokens),
            block_tables=z(rows, width), context_lens=z(rows), query_lens=z(rows),
            temperature=z(rows, dtype=np.float32) + 1, top_k=z(rows), top_p=z(rows, dtype=np.float32),
            random_u=z(rows, dtype=np.float32), top_n=z(rows), repetition_penalty=z(rows, dtype=np.float32),
            presence_penalty=z(rows, dtype=np.float32), frequency_penalty=z(rows, dtype=np.float32),
            history_len=z(rows), prompt_len=z(rows), lora=z(rows), rope_delta=z(rows),
            request_ids=z(rows, dtype=np.int64),
            min_p=z(rows, dtype=np.float32), mask_on=z(rows), bias_len=z(rows), prompt_top=z(rows),
            controls_on=z(rows), controls_pending=z(1),
            out_token_ids=z(rows), out_logprobs=z(rows, dtype=np.float32),
            out_top_ids=z(rows, 20), out_top_logprobs=z(rows, 20, dtype=np.float32))
        self.requests = {r.number: r for r in requests}
        self.bm, self.bs, self.wrong, self.rng = bm, bm.block_size, wrong, random.Random(seed)
        self.kv: dict = {}
        self.top_n = top_n                 # what a catch-up row may ask for (the drafter's width; 0 = nothing)
        self.agents = [object()]
        self.fed_tokens = 0
        self.commands: list = []
        self.reset_next = False

    def dead_agents(self):
        return []

    async def step(self, command):
        b, bs = self.buffers, self.bs
        self.commands.append(command)
        # a block no request holds may have been written by anyone since: forget what it held
        held = {blk for table in self.bm.block_tables.values() for blk in table}
        self.kv = {slot: t for slot, t in self.kv.items() if slot // bs in held}
        s = command.max_query_len if command.kind is proto.StepKind.PREFILL else 1
        assert command.kind in (proto.StepKind.PREFILL, proto.StepKind.DECODE)
        for r in range(command.num_rows):
            req = self.requests[int(b.request_ids[r])]
            q, ctx = int(b.query_lens[r]), int(b.context_lens[r])
            assert 1 <= q <= s and b.temperature[r] == 0 and b.top_n[r] in (0, self.top_n)
            assert list(b.positions[r, :q]) == list(range(ctx - q, ctx))
            for j in range(q):
                self.kv[int(b.slot_mapping[r, j])] = int(b.input_ids[r, j])
            self.fed_tokens += q
            seen = [self.kv.get(int(b.block_tables[r, p // bs]) * bs + p % bs) for p in range(ctx)]
            for p in range(min(ctx, req.num_tokens)):
                assert seen[p] == req.token_at(p), f"{req.req_id}: the draft reads stale KV at position {p}"
            t = next_token(seen)
            b.out_token_ids[r] = out = (t + 1) % 97 + 3 if self.rng.random() < self.wrong else t
            if b.top_n[r]:        # the runners-up: the true token among them when the most likely is wrong
                alts = [a for a in (t, (t + 11) % 97 + 3, (t + 23) % 97 + 3, (t + 37) % 97 + 3) if a != out]
                b.out_top_ids[r, :b.top_n[r]] = [out] + alts[:b.top_n[r] - 1]
        reset, self.reset_next = self.reset_next, False
        return [SimpleNamespace(model_ms=0.5)], reset


def make_drafter(sched, requests, spec_tokens, wrong=0.0, seed=0, width=1):
    """A DraftProposer on fake draft agents, its forget_all calls, and a speculative planner of it for sched
    (proposing spec_tokens per row; trees when width > 1)."""
    config = config_from_dict({"spec_config": {"method": "draft"}, "model_config": {"max_generate_length": 512}})
    forgotten = []

    def forget_all():
        forgotten.append(1)
        for r in sched.running:
            r.num_draft_computed = 0
    drafter = DraftProposer(config.draft_config("/nonexistent"), "/nonexistent", sched.bm, forget_all, width=width)
    drafter.agents = FakeDraftAgents(requests, sched.bm, wrong=wrong, seed=seed, top_n=width if width > 1 else 0)
    drafter.max_step_tokens, drafter.max_chunk = sched.spec.max_num_batched_tokens, 8
    planner = SpeculativePlanner(SpeculativeSpec(spec_tokens, width if width > 1 else 0), drafter, sched)
    return drafter, forgotten, planner


async def serve(sched, runner, planner, max_steps=2000):
    """The engine's loop: schedule, let the planner plan a speculating step (the draft proposes), run the step."""
    drafter = planner.proposer
    propose_branches = drafter.propose_branches

    async def checked(requests, limits):
        branches = await propose_branches(requests, limits)
        assert all(len(p) <= k for paths, k in zip(branches, limits) for p in paths)
        assert all(len(paths) <= drafter.width for paths in branches)
        return branches
    drafter.propose_branches = checked
    for _ in range(max_steps):
        batch = sched.schedule()
        if batch is None:
            return
        if batch.may_speculate:
            batch = await planner.speculate(batch)
        runner.step(batch)


def test_a_perfect_draft_is_accepted_whole_and_feeds_each_token_once():
    sched = make_scheduler(spec_max_rows=4, max_num_batched_tokens=64)
    reqs = make_requests(2, prompt_len=[6, 9], max_new_tokens=21)
    for r in reqs:
        sched.add(r)
    drafter, _, planner = make_drafter(sched, reqs, spec_tokens=4)
    drafter.max_chunk = 64                                # each prompt caught up in one step
    runner = SpecFakeRunner(sched)
    asyncio.run(serve(sched, runner, planner))
    assert [r.output_ids for r in reqs] == [reference_output(r) for r in reqs]
    # prefill gives token 1; each round then proposes 4 and the target adds its own: 20 tokens in 4 rounds
    assert runner.outputs.batch_sizes[("verify", 2)] == 4 and runner.outputs.batch_sizes[("decode", 2)] == 0
    # every round: one catch-up step (the prompt on the first, then the target's bonus token and the last
    # proposal, whose KV the draft never wrote) and 3 decode steps
    kinds = [c.kind.value for c in drafter.agents.commands]
    assert kinds == ["prefill", "decode", "decode", "decode"] * 4
    # per row: its prompt and first token, 3 proposals, then 3 rounds of 2 catch-up tokens and 3 proposals
    assert drafter.agents.fed_tokens == sum(len(r.prompt_ids) + 1 + 3 + 3 * (2 + 3) for r in reqs)


def test_rows_propose_within_their_limits_and_a_cache_reset_proposes_nothing():
    sched = make_scheduler(spec_max_rows=4)
    reqs = make_requests(2, prompt_len=5, max_new_tokens=[3, 30])
    for r in reqs:
        sched.add(r)
    drafter, forgotten, planner = make_drafter(sched, reqs, spec_tokens=4)
    runner = SpecFakeRunner(sched)
    runner.step(sched.schedule())                         # prefill
    batch = sched.schedule()
    limits = planner.plan(batch)
    assert limits == [1, 4]                               # 3 - 1 output - 1 for the target's own token
    proposals = [paths[0] for paths in asyncio.run(drafter.propose_branches(batch.requests, limits))]
    assert [len(p) for p in proposals] == [1, 4]
    assert [p[0] for p in proposals] == [next_token(r.tokens(0, r.num_tokens)) for r in reqs]
    drafter.agents.reset_next = True
    assert asyncio.run(drafter.propose_branches(batch.requests, limits)) == [[], []]
    assert forgotten and drafter.num_cache_resets == 1
    assert all(r.num_draft_computed == 0 for r in reqs)


def test_a_request_that_ended_during_the_draft_leaves_the_step():
    sched = make_scheduler(spec_max_rows=4)
    reqs = make_requests(3, prompt_len=5, max_new_tokens=20)
    for r in reqs:
        sched.add(r)
    drafter, _, planner = make_drafter(sched, reqs, spec_tokens=3)
    runner = SpecFakeRunner(sched)
    runner.step(sched.schedule())
    draft_propose = drafter.propose

    async def propose_then_abort(requests, limits):
        trees = await draft_propose(requests, limits)
        sched.finish(reqs[1], "abort")                    # the client left while the draft ran
        return trees
    drafter.propose = propose_then_abort
    batch = asyncio.run(planner.speculate(sched.schedule()))
    assert batch.requests == [reqs[0], reqs[2]] and batch.num_new_tokens == [4, 4]
    runner.step(batch)
    assert [len(r.output_ids) for r in (reqs[0], reqs[2])] == [5, 5]


def test_a_request_aborted_during_the_drafts_round_leaves_the_round():
    """The client leaves after the round's catch-up step: its blocks are free at once, so the draft's decode steps
    go on without it (its row would name blocks it no longer has), and the others get their whole proposals."""
    sched = make_scheduler(spec_max_rows=4)
    reqs = make_requests(2, prompt_len=5, max_new_tokens=20)
    for r in reqs:
        sched.add(r)
    drafter, _, planner = make_drafter(sched, reqs, spec_tokens=4)
    SpecFakeRunner(sched).step(sched.schedule())
    agents, fake_step = drafter.agents, drafter.agents.step

    async def abort_after_the_catch_up(command):
        result = await fake_step(command)
        if len(agents.commands) == 1:
            sched.finish(reqs[1], "abort")
        return result
    agents.step = abort_after_the_catch_up
    batch = sched.schedule()
    branches = asyncio.run(drafter.propose_branches(batch.requests, planner.plan(batch)))
    assert [len(paths[0]) for paths in branches] == [4, 1]     # r1 keeps only the catch-up's token
    assert [c.num_rows for c in agents.commands] == [2, 1, 1, 1]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 6), wrong=st.sampled_from([0.0, 0.3, 1.0]), k=st.integers(1, 5),
       num_blocks=st.integers(12, 40), prefix_caching=st.booleans(), budget=st.integers(8, 40),
       policy=st.sampled_from(["prefill_first", "fcfs", "longest_output_first"]), width=st.integers(1, 3),
       seed=st.integers(0, 1000))
def test_draft_kv_stays_valid_and_outputs_equal_plain_decoding(n, wrong, k, num_blocks, prefix_caching, budget,
                                                               policy, width, seed):
    """Requests sharing a prefix, under block pressure (preemption, recompute) and chunking, with a draft
    that is right or wrong at random, proposing chains or (width > 1) trees whose kept path is often off the
    first branch: the draft never reads stale KV (FakeDraftAgents checks), and every output is exactly plain
    decoding's."""
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=num_blocks, block_size=4, prefix_caching=prefix_caching,
                           max_num_batched_tokens=budget, policy=policy, chunked_prefill=True, max_chunk_tokens=8,
                           spec_max_rows=rng.randint(1, 6))
    reqs = add_random_requests(sched, rng, n, 12)
    _, _, planner = make_drafter(sched, reqs, spec_tokens=k, wrong=wrong, seed=seed, width=width)
    asyncio.run(serve(sched, TreeFakeRunner(sched), planner))
    assert_outputs_are_plain_decodings(sched, reqs)


def test_draft_config_is_the_targets_with_the_drafts_model_and_one_agent():
    config = config_from_dict({"model_config": {"decode_batch_size": [1, 2, 8, 16], "prefill_batch_size": [1, 2],
                                                "max_generate_length": 512},
                               "serving_config": {"agent_ports": [16002, 16003], "max_num_seqs": 16},
                               "spec_config": {"method": "draft", "draft_num_layers": 2, "max_batch_size": 4,
                                               "draft_agent_port": 16010}})
    draft = config.draft_config("/models/draft")
    assert draft.model_config.model_path == "/models/draft" and draft.model_config.num_layers == 2
    assert draft.serving_config.agent_ports == [16010]
    assert draft.model_config.decode_batch_size == [1, 2, 8] and draft.serving_config.max_num_seqs == 8
    assert draft.model_config.prefill_batch_size == [1, 2, 4]          # every speculating row catches up at once
    assert draft.model_config.seq_length == [2] + config.model_config.seq_length   # catch-ups are 1-2 tokens
    assert not draft.spec_config.enabled
    # the target's blocks, but never the window pool: the draft catches up on the main tables from behind
    assert dataclasses.replace(draft.pa_config, window_blocks="auto") == config.pa_config
    assert draft.max_blocks_per_seq == config.max_blocks_per_seq
    assert draft.pa_config.window_blocks == 0 and draft.pa_config.window_tokens is None
    with pytest.raises(ConfigError, match="draft_agent_port"):
        config_from_dict({"serving_config": {"agent_ports": [16002]},
                          "spec_config": {"method": "draft", "draft_agent_port": 16002}})
    assert config_from_dict({"spec_config": {"method": "tree", "tree_width": 3}}).spec_config.tokens_per_row == 13
    with pytest.raises(ConfigError, match="<= 32"):
        config_from_dict({"spec_config": {"method": "tree", "tree_width": 4, "num_speculative_tokens": 8}})
    for bad in ({"draft_num_layers": 0}, {"draft_agent_port": 70000}, {"draft_model": ""}, {"method": "medusa"},
                {"tree_width": 0}, {"tree_width": 5}):
        with pytest.raises(ConfigError):
            config_from_dict({"spec_config": bad})


@pytest.mark.parametrize("width", [1, 2])
def test_a_draft_tree_keeps_the_runner_up_when_the_drafts_first_choice_is_wrong(width):
    """A draft whose most likely token is always wrong but whose runner-up is right: as a chain it gains
    nothing (one token a round, the target's); as a 2-branch tree each round keeps the runner-up too, whose
    KV the draft overwrote with its first branch's — and it still never reads stale KV."""
    sched = make_scheduler(spec_max_rows=4, max_num_batched_tokens=64)
    reqs = make_requests(2, prompt_len=[6, 9], max_new_tokens=21)
    for r in reqs:
        sched.add(r)
    drafter, _, planner = make_drafter(sched, reqs, spec_tokens=3, wrong=1.0, width=width)
    runner = TreeFakeRunner(sched)
    asyncio.run(serve(sched, runner, planner))
    assert [r.output_ids for r in reqs] == [reference_output(r) for r in reqs]
    # 20 tokens after the prefill. A chain gains one a round; a tree keeps the runner-up and the target's token
    # after it, which (off the in-place first branch) are fed again with the next step, sampling a third
    verify = runner.outputs.batch_sizes[("verify", 2)]
    assert verify == 19 if width == 1 else verify <= 8
    # each round: a catch-up step, then 2 decode steps per branch (the runner-up's first, the first's last)
    kinds = [c.kind.value for c in drafter.agents.commands]
    assert kinds[:1 + 2 * width] == ["prefill"] + ["decode"] * 2 * width
