"""Speculative decoding, the master's part (master/speculative/): n-gram prompt lookup, token trees, the acceptance
rule, and verify steps planned and applied as the engine does (the planner, then the OutputProcessor) — checked
with test_scheduler's fake KV cache, so a proposal's KV that is kept when it should not be (or lost when it
should be kept) changes the outputs."""
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llm_serving.master.output_processor import OutputProcessor
from llm_serving.master.request import Request, SamplingParams
from llm_serving.master.speculative.ngram import LookupProposer, NgramProposer
from llm_serving.master.speculative.planner import SpeculativePlanner, SpeculativeSpec, can_speculate
from llm_serving.master.speculative.stats import SpecStats
from llm_serving.master.speculative.tree import (accept, accepted_prefix, node_depths, tree_from_paths, tree_walk,
                                                 trim_tree)
from tests.unit.test_scheduler import FakeRunner, make_requests, make_scheduler, next_token, reference_output


# --- the proposer ------------------------------------------------------------------------------------

def test_ngram_lookup_proposes_what_followed_the_latest_match_of_the_longest_suffix():
    p = NgramProposer(num_tokens=3, ngram_max=3, ngram_min=1)
    #                 0  1  2  3  4  5  6  7  8  9
    assert p.lookup([5, 6, 7, 8, 9, 5, 6, 7, 1, 5, 6, 7]) == [1, 5, 6]      # "5 6 7": the latest match wins
    assert p.lookup([5, 6, 7, 8, 9, 6, 7]) == [8, 9, 6]                      # "6 7" (no earlier "9 6 7")
    assert p.lookup([5, 6, 7, 8, 9, 7]) == [8, 9, 7]                         # one token, at its last match
    assert p.lookup([1, 2, 3, 4]) == []                                      # nothing recurs
    assert p.lookup([4, 4]) == [4]                                           # what follows stops at the end
    assert p.lookup([5, 6, 7, 8, 9, 5, 6], k=1) == [7]
    assert p.lookup([7], k=2) == [] and p.lookup([], k=2) == []
    assert NgramProposer(num_tokens=2, ngram_max=3, ngram_min=2).lookup([5, 6, 7, 8, 9, 7]) == []


def test_ngram_lookup_is_refused_with_impossible_settings():
    with pytest.raises(ValueError):
        NgramProposer(num_tokens=3, ngram_max=1, ngram_min=2)
    with pytest.raises(ValueError):
        NgramProposer(num_tokens=0, ngram_max=2)


def test_acceptance_stops_at_the_first_disagreement_and_stats_count_positions():
    assert accepted_prefix([4, 5, 6], [4, 5, 6, 7]) == 3
    assert accepted_prefix([4, 5, 6], [4, 9, 6, 7]) == 1
    assert accepted_prefix([4, 5, 6], [1, 5, 6, 7]) == 0
    assert accepted_prefix([], [3]) == 0
    stats = SpecStats(3)
    stats.record(3, 3)
    stats.record(3, 1)
    d = stats.as_dict()
    assert (d["proposed_tokens"], d["accepted_tokens"], d["rounds"]) == (6, 4, 2)
    assert d["acceptance_rate"] == round(4 / 6, 4) and d["mean_tokens_per_round"] == 3.0
    assert d["acceptance_by_position"] == {"1": 1.0, "2": 0.5, "3": 0.5}


def test_requests_needing_last_token_logits_do_not_speculate():
    base = dict(max_new_tokens=8)
    assert can_speculate(Request([1], SamplingParams(**base), frozenset()))
    for extra in ({"speculative": False}, {"top_logprobs": 2}, {"repetition_penalty": 1.2}):
        assert not can_speculate(Request([1], SamplingParams(**base, **extra), frozenset()))


# --- verify steps through the scheduler and the fake KV cache ----------------------------------------

class OracleProposer(LookupProposer):
    """Proposes a request's true next tokens (reference_output), with each one wrong with probability
    `wrong` — so rows accept anything from none to all of their proposals."""

    def __init__(self, num_tokens: int, wrong: float, seed: int = 0, tree_width: int = 0):
        super().__init__(num_tokens, tree_width)
        self.wrong, self.rng = wrong, random.Random(seed)

    def lookup(self, tokens, k=None):
        k = self.num_tokens if k is None else min(k, self.num_tokens)
        seq = list(tokens)
        out = []
        for _ in range(max(k, 0)):
            t = next_token(seq)
            if self.rng.random() < self.wrong:
                t = (t + 1) % 97 + 3
            out.append(t)
            seq.append(t)
        return out


def add_random_requests(sched, rng, n, max_prompt_len):
    """n requests sharing a 5-token prefix, random prompt (1..max_prompt_len) and output (1..14) lengths, added."""
    reqs = make_requests(n, prompt_len=[rng.randint(1, max_prompt_len) for _ in range(n)],
                         max_new_tokens=[rng.randint(1, 14) for _ in range(n)], prefix=(7, 8, 9, 10, 11))
    for r in reqs:
        sched.add(r)
    return reqs


def assert_outputs_are_plain_decodings(sched, reqs):
    assert not sched.has_work
    for r in reqs:
        assert r.output_ids == reference_output(r), r.req_id


def make_speculating(proposer, *, spec_tokens=None, tree_width=0, **overrides):
    """A scheduler (make_scheduler with `overrides`, spec_max_rows among them) and a speculative planner of
    `proposer` for it."""
    sched = make_scheduler(**overrides)
    spec = SpeculativeSpec(spec_tokens or proposer.num_tokens, tree_width)
    return sched, SpeculativePlanner(spec, proposer, sched)


def run_now(coroutine):
    """The result of a coroutine that never waits (a lookup proposer's round)."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    raise AssertionError("the coroutine waited")


class SpecFakeRunner(FakeRunner):
    """FakeRunner that also runs verify steps of chains: the proposals' K/V are written like any token's, a token
    is 'sampled' after each of them, and the OutputProcessor keeps the agreeing run (its statistics in
    `spec_stats`). With a planner, steps are planned as the engine's loop does: schedule, then the planner (a
    lookup: no waiting)."""

    def __init__(self, sched, planner=None):
        super().__init__(sched)
        self.planner = planner
        self.spec_stats = SpecStats(8)
        self.outputs = OutputProcessor(sched, self.spec_stats)

    def schedule(self):
        batch = self.sched.schedule()
        if batch is not None and batch.may_speculate and self.planner is not None:
            batch = run_now(self.planner.speculate(batch))
        return batch

    def step(self, batch):
        if not batch.is_verify:
            return super().step(batch)
        bm, bs = self.sched.bm, self.sched.bm.block_size
        targets = []
        for req, q, proposal in zip(batch.requests, batch.num_new_tokens, batch.proposals):
            c, table = req.num_computed_tokens, bm.block_tables[req.req_id]
            assert len(table) * bs >= c + q, f"{req.req_id}: blocks do not cover the verify step"
            fed = req.tokens(c, c + q - len(proposal)) + list(proposal)
            row = []
            for j, p in enumerate(range(c, c + q)):
                block = table[p // bs]
                assert bm.ref_counts[block] == 1 and not bm.is_cached(block), f"{req.req_id} writes a shared block"
                self.kv[block * bs + p % bs] = fed[j]
                row.append(next_token([self.kv.get(table[i // bs] * bs + i % bs) for i in range(p + 1)]))
            targets.append(row)
        self.complete(batch, targets)


def test_a_small_decode_step_becomes_a_verify_step_within_every_limit():
    sched, planner = make_speculating(OracleProposer(4, wrong=0.0), spec_max_rows=2, max_model_len=14)
    reqs = make_requests(3, prompt_len=5, max_new_tokens=[3, 20, 20])
    for r in reqs:
        sched.add(r)
    runner = SpecFakeRunner(sched, planner)
    runner.step(runner.schedule())                              # prefill: one token each
    batch = runner.schedule()
    assert not batch.is_verify and batch.num_rows == 3         # 3 rows > spec_max_rows: plain decode
    runner.step(batch)
    assert reqs[0].finished is False
    runner.step(runner.schedule())                              # r0 ends (3 tokens)
    batch = runner.schedule()
    assert batch.is_verify and batch.kind == "verify" and not batch.is_prefill
    # r1, r2 hold 5 + 3 tokens: max_model_len 14 leaves room for 14 - 8 - 1 = 5 > 4 proposals
    assert batch.num_new_tokens == [5, 5] and [len(p) for p in batch.proposals] == [4, 4]
    runner.step(batch)
    assert [len(r.output_ids) for r in reqs[1:]] == [8, 8]     # all 4 kept + the target's own token
    batch = runner.schedule()
    # 13 tokens now: no room for a proposal under max_model_len 14 (the target's own token fills it)
    assert not batch.is_verify


def test_proposals_never_preempt_and_never_exceed_max_new_tokens():
    sched, planner = make_speculating(OracleProposer(8, wrong=0.0), num_blocks=4, block_size=4, spec_max_rows=4)
    (req,) = make_requests(1, prompt_len=6, max_new_tokens=5)
    sched.add(req)
    runner = SpecFakeRunner(sched, planner)
    runner.step(runner.schedule())
    batch = runner.schedule()
    assert batch.proposals == [batch.proposals[0]] and len(batch.proposals[0]) == 3   # 5 - 1 output - 1
    runner.run()
    assert req.output_ids == reference_output(req) and sched.num_preemptions == 0

    sched, planner = make_speculating(OracleProposer(4, wrong=0.0), num_blocks=2, block_size=4, spec_max_rows=4)
    (req,) = make_requests(1, prompt_len=7, max_new_tokens=1 + 4)
    sched.add(req)
    runner = SpecFakeRunner(sched, planner)
    runner.step(runner.schedule())                              # 8 tokens fill both blocks
    batch = runner.schedule()
    assert not batch.is_verify and sched.num_preemptions == 0  # no free block for proposals: plain decode


def test_rows_with_top_logprobs_keep_the_step_plain():
    sched, planner = make_speculating(OracleProposer(4, wrong=0.0), spec_max_rows=4)
    plain, special = make_requests(2, prompt_len=5, max_new_tokens=10)
    special.sampling = SamplingParams(max_new_tokens=10, top_logprobs=3)
    for r in (plain, special):
        sched.add(r)
    runner = SpecFakeRunner(sched, planner)
    runner.step(runner.schedule())
    assert not runner.schedule().is_verify


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 6), wrong=st.sampled_from([0.0, 0.3, 0.7, 1.0]), k=st.integers(1, 5),
       num_blocks=st.integers(12, 40), prefix_caching=st.booleans(), budget=st.integers(8, 40),
       policy=st.sampled_from(["prefill_first", "fcfs", "longest_output_first"]), seed=st.integers(0, 1000))
def test_outputs_equal_plain_decoding_whatever_is_accepted(n, wrong, k, num_blocks, prefix_caching, budget, policy,
                                                            seed):
    """Requests sharing a prefix, under block pressure (preemption, recompute), with proposals that are
    right or wrong at random: every request's output is exactly plain decoding's."""
    rng = random.Random(seed)
    sched, planner = make_speculating(OracleProposer(k, wrong, seed), num_blocks=num_blocks, block_size=4,
                                      prefix_caching=prefix_caching, max_num_batched_tokens=budget, policy=policy,
                                      chunked_prefill=True, max_chunk_tokens=8, spec_max_rows=rng.randint(1, 6))
    reqs = add_random_requests(sched, rng, n, 12)
    runner = SpecFakeRunner(sched, planner)
    runner.run(max_steps=2000)
    assert_outputs_are_plain_decodings(sched, reqs)
    stats = runner.spec_stats
    assert stats.rounds <= sum(v for (kind, _), v in runner.outputs.batch_sizes.items() if kind == "verify") * n
    if wrong == 0.0:                  # every proposal is the true next token: each one is kept
        assert stats.accepted == stats.proposed
    elif wrong == 1.0:                # every first proposal is wrong: none is kept
        assert stats.accepted == 0


# --- token trees (method tree) -------------------------------------------------------------------------

def test_prompt_lookup_trees_merge_distinct_continuations_depth_first():
    p = NgramProposer(num_tokens=3, ngram_max=3, ngram_min=1)
    #          "5 6 7" follows 0 (-> 8 9 5) and 5 (-> 8 2 5): the latest first, sharing the 8
    assert p.lookup_tree([5, 6, 7, 8, 9, 5, 6, 7, 8, 2, 5, 6, 7], width=2) == ([8, 2, 5, 9, 5], [-1, 0, 1, 0, 3])
    assert p.lookup_tree([5, 6, 7, 8, 9, 5, 6, 7, 8, 2, 5, 6, 7], width=1) == ([8, 2, 5], [-1, 0, 1])
    assert p.lookup_tree([1, 2, 3], width=2) == ([], [])
    assert tree_from_paths([(1, 2), (3,), (1, 4)]) == ([1, 2, 4, 3], [-1, 0, 0, -1])
    assert node_depths([-1, 0, 0, -1, 3]) == [1, 2, 2, 1, 2]
    nodes, parents = [1, 2, 4, 3], [-1, 0, 0, -1]
    assert tree_walk(nodes, parents, [1, 4, 0, 0, 0]) == [0, 2]       # 1, then 4 (the second child)
    assert tree_walk(nodes, parents, [3, 0, 0, 0, 9]) == [3]
    assert tree_walk(nodes, parents, [7, 0, 0, 0, 0]) == []


def test_acceptance_keeps_the_agreeing_path_and_counts_only_the_first_branch_in_place():
    nodes, parents = [1, 2, 4, 3], [-1, 0, 0, -1]                    # 1 -> (2 | 4), and 3
    on_chain = accept(nodes, parents, [1, 2, 9, 0, 0])               # 1 then 2: nodes 0, 1 (both in place)
    assert (on_chain.kept, on_chain.emit, on_chain.in_place) == ([0, 1], [0, 1, 2], 2)
    assert not on_chain.off_first_branch
    second = accept(nodes, parents, [1, 4, 0, 0, 0])                 # 1 then 4 (node 2, in slot 2 not 1)
    assert (second.kept, second.emit, second.in_place) == ([0, 2], [0, 1, 3], 1) and second.off_first_branch
    other = accept(nodes, parents, [3, 0, 0, 0, 8])                  # the second root: nothing in place
    assert (other.kept, other.emit, other.in_place) == ([3], [0, 4], 0)
    none = accept([5, 6], [-1, 0], [7, 0, 0])
    assert (none.kept, none.emit, none.in_place) == ([], [0], 0)


class TreeFakeRunner(SpecFakeRunner):
    """Runs token-tree verify steps as the agents do: node j's K/V goes to the row's slot start + j, and the
    token after it is the one after its own path (committed tokens, then its ancestors); the OutputProcessor's
    rule (the agreeing path kept, only its in-place first-child chain counted as computed) does the rest."""

    def step(self, batch):
        if not (batch.is_verify and batch.parents):
            return super().step(batch)
        bm, bs = self.sched.bm, self.sched.bm.block_size
        targets = []
        for req, q, nodes, parents in zip(batch.requests, batch.num_new_tokens, batch.proposals, batch.parents):
            c, table = req.num_computed_tokens, bm.block_tables[req.req_id]
            assert len(table) * bs >= c + q
            own = q - len(nodes)
            fed = req.tokens(c, c + own) + list(nodes)
            for j, slot_pos in enumerate(range(c, c + q)):
                block = table[slot_pos // bs]
                assert bm.ref_counts[block] == 1 and not bm.is_cached(block)
                self.kv[block * bs + slot_pos % bs] = fed[j]
            committed = [self.kv.get(table[i // bs] * bs + i % bs) for i in range(c + own)]
            row = [next_token(committed)]
            for j in range(len(nodes)):
                path, a = [], j
                while a >= 0:
                    path.append(nodes[a])
                    a = parents[a]
                row.append(next_token(committed + path[::-1]))
            targets.append(row)
        self.complete(batch, targets)


class TreeOracleProposer(OracleProposer):
    """Two continuations: the oracle's (wrong at random) and a wrong-first one, in random order — so the
    kept path is sometimes the second branch (off the in-place chain)."""

    def lookup_tree(self, tokens, k=None, width=2):
        a = self.lookup(tokens, k)
        if not a:
            return [], []
        b = [(a[0] + 5) % 97 + 3] + self.lookup(list(tokens) + [(a[0] + 5) % 97 + 3], len(a) - 1) if len(a) > 1 \
            else [(a[0] + 5) % 97 + 3]
        paths = [a, b] if self.rng.random() < 0.5 else [b, a]
        return tree_from_paths(paths[:width])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 5), wrong=st.sampled_from([0.0, 0.3, 1.0]), k=st.integers(1, 4),
       num_blocks=st.integers(14, 40), prefix_caching=st.booleans(), policy=st.sampled_from(["prefill_first", "fcfs"]),
       seed=st.integers(0, 1000))
def test_tree_outputs_equal_plain_decoding_whatever_branch_is_kept(n, wrong, k, num_blocks, prefix_caching, policy,
                                                                   seed):
    rng = random.Random(seed)
    sched, planner = make_speculating(TreeOracleProposer(k, wrong, seed, tree_width=2), tree_width=2,
                                      num_blocks=num_blocks, block_size=4, prefix_caching=prefix_caching,
                                      max_num_batched_tokens=40, policy=policy, chunked_prefill=True,
                                      max_chunk_tokens=8, spec_max_rows=rng.randint(1, 5), max_model_len=40)
    reqs = add_random_requests(sched, rng, n, 10)
    TreeFakeRunner(sched, planner).run(max_steps=2000)
    assert_outputs_are_plain_decodings(sched, reqs)


# --- the planner (speculative/planner.py) ---------------------------------------------------------------

def test_trimming_a_tree_keeps_nodes_within_depth_and_room_with_their_parents():
    nodes, parents = [1, 2, 3, 4, 5], [-1, 0, 1, -1, 3]          # two branches: 1 2 3 and 4 5
    assert trim_tree(nodes, parents, depth=3, room=5) == (nodes, parents)
    assert trim_tree(nodes, parents, depth=2, room=5) == ([1, 2, 4, 5], [-1, 0, -1, 2])
    assert trim_tree(nodes, parents, depth=3, room=2) == ([1, 2], [-1, 0])
    assert trim_tree(nodes, parents, depth=1, room=5) == ([1, 4], [-1, -1])
    assert trim_tree([], [], depth=3, room=3) == ([], [])


class EmptyProposer:
    """Proposes nothing; reserves blocks first or not, as a draft model or a lookup does."""

    def __init__(self, reserves_blocks):
        self.reserves_blocks, self.agent_step_kind, self.calls = reserves_blocks, None, []

    async def propose(self, requests, limits):
        self.calls.append(list(limits))
        return [([], []) for _ in requests]


@pytest.mark.parametrize("reserves_blocks", [False, True])
def test_a_step_left_without_proposals_is_a_decode_run_only_when_no_blocks_were_reserved(reserves_blocks):
    """A lookup that finds nothing leaves a plain decode step, which may be a decode run; a draft model that
    proposed nothing leaves its step as it is (its blocks reserved: requests may have arrived meanwhile)."""
    proposer = EmptyProposer(reserves_blocks)
    sched, planner = make_speculating(proposer, spec_tokens=3, spec_max_rows=4, decode_steps=4,
                                      decode_steps_max_rows=4)
    reqs = make_requests(2, prompt_len=5, max_new_tokens=10)
    for r in reqs:
        sched.add(r)
    runner = SpecFakeRunner(sched, planner)
    runner.step(runner.schedule())                               # prefill: 6 tokens each, 2 blocks of 4
    batch = sched.schedule()
    assert batch.may_speculate and batch.steps == 1              # the scheduler leaves the run to the planner
    batch = run_now(planner.speculate(batch))
    assert proposer.calls == [[3, 3]] and not batch.is_verify
    if reserves_blocks:                                          # 6 + 3 tokens' blocks, held for the draft's KV
        assert batch.steps == 1 and batch.spec_limits == [3, 3]
        assert [len(sched.bm.block_tables[r.req_id]) for r in reqs] == [3, 3]
    else:                                                        # a run of 4: K/V of 6 + 3 tokens
        assert batch.steps == 4 and batch.run_lens == [4, 4] and sched.num_decode_runs == 1
    runner.step(batch)
    runner.run()
    assert_outputs_are_plain_decodings(sched, reqs)


def test_a_lookup_proposes_chains_or_trees_per_row_within_its_limit():
    p = NgramProposer(num_tokens=3, ngram_max=3, ngram_min=1)
    reqs = [Request([5, 6, 7, 8, 9, 5, 6, 7, 8, 2, 5, 6, 7], SamplingParams(max_new_tokens=4), frozenset()),
            Request([1, 2, 3], SamplingParams(max_new_tokens=4), frozenset())]
    assert run_now(p.propose(reqs, [2, 3])) == [([8, 2], [-1, 0]), ([], [])]
    assert run_now(p.propose(reqs, [0, 3])) == [([], []), ([], [])]
    tree = NgramProposer(num_tokens=3, ngram_max=3, ngram_min=1, tree_width=2)
    assert run_now(tree.propose(reqs, [3, 3])) == [([8, 2, 5, 9, 5], [-1, 0, 1, 0, 3]), ([], [])]
