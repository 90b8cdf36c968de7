"""Embedding requests on the scheduler and the output processor (no MindSpore): embed steps hold only embeddings,
the queue's order holds across embeddings and generation, an embedding's chunks are fixed by its input alone, its
blocks are never cached nor adopted, and its pooled parts combine into the normalized embedding."""
import dataclasses

import numpy as np
import pytest

from llm_serving.master.block_manager import BlockManager
from llm_serving.master.output_processor import OutputProcessor
from llm_serving.master.request import Request, RequestStatus, SamplingParams
from llm_serving.master.scheduler import Scheduler, SchedulerSpec
from llm_serving.master.step_io import StepOutputs
from llm_serving.shm.layout import StepKind

SPEC = SchedulerSpec(max_num_seqs=8, max_num_batched_tokens=24, max_prefill_rows=2, max_waiting_requests=100,
                     max_decode_rows=8, chunked_prefill=True, max_chunk_tokens=8, max_embed_rows=6)


def scheduler(num_blocks=64, prefix_caching=False, **overrides) -> Scheduler:
    return Scheduler(dataclasses.replace(SPEC, **overrides),
                     BlockManager(num_blocks, 4, enable_prefix_caching=prefix_caching))


def embedding(tokens, pooling="mean", name=None) -> Request:
    return Request(list(tokens), SamplingParams(max_new_tokens=1), frozenset(), req_id=name, pooling=pooling)


def generation(tokens, n=3, name=None) -> Request:
    return Request(list(tokens), SamplingParams(max_new_tokens=n), frozenset(), req_id=name)


def pooled_part(req: Request, fed: int) -> np.ndarray:
    """What an agent would pool for `fed` new tokens of req: a 'hidden state' of (token, 1.0) per token; mean: their
    sum, last: the last token's, cls: the first token's when the chunk starts the input (else zeros)."""
    start = req.num_computed_tokens
    states = np.array([[t, 1.0] for t in req.tokens(start, start + fed)], np.float32)
    if req.pooling == "mean":
        return states.sum(axis=0)
    if req.pooling == "last":
        return states[-1]
    return states[0] if start == 0 else np.zeros(2, np.float32)


def run(sched: Scheduler, limit: int = 200) -> list:
    """Drive the scheduler to the end, as the agents would answer; returns the batches in order (each with the
    computed tokens of its rows before the step)."""
    outputs = OutputProcessor(sched)
    steps = []
    while sched.has_work and len(steps) < limit:
        batch = sched.schedule()
        starts = [r.num_computed_tokens for r in batch.requests]
        steps.append((batch, starts))
        if batch.kind is StepKind.EMBED:
            out = StepOutputs([], [], pooled=np.stack([pooled_part(r, q) for r, q in
                                                       zip(batch.requests, batch.num_new_tokens)]))
        else:
            out = StepOutputs([7] * batch.num_rows, [0.0] * batch.num_rows)
        outputs.update_from_output(batch, out)
    assert not sched.has_work
    return steps


def expected(tokens, pooling) -> np.ndarray:
    states = np.array([[t, 1.0] for t in tokens], np.float64)
    v = states.mean(axis=0) if pooling == "mean" else states[-1] if pooling == "last" else states[0]
    return (v / np.linalg.norm(v)).astype(np.float32)


@pytest.mark.parametrize("policy", ["prefill_first", "fcfs", "longest_output_first"])
def test_embed_steps_hold_only_embeddings_and_every_request_ends(policy):
    sched = scheduler(policy=policy)
    reqs = []
    for i in range(6):
        reqs.append(generation(range(10 * i, 10 * i + 5), name=f"g{i}"))
        reqs.append(embedding(range(100 + 30 * i, 100 + 30 * i + 3 + 5 * i), name=f"e{i}"))
    for req in reqs:
        sched.add(req)
    steps = run(sched)
    for batch, _ in steps:
        embeds = {r.pooling is not None for r in batch.requests}
        assert len(embeds) == 1
        assert (batch.kind is StepKind.EMBED) == embeds.pop()
    assert all(b.num_rows <= (SPEC.max_embed_rows if b.kind is StepKind.EMBED else SPEC.max_prefill_rows
                              if b.kind is StepKind.PREFILL else SPEC.max_decode_rows) for b, _ in steps)
    for req in reqs:
        assert req.status is RequestStatus.FINISHED
        if req.pooling is not None:
            assert req.finish_reason == "stop" and req.output_ids == []
            np.testing.assert_allclose(req.embedding, expected(req.prompt_ids, "mean"), rtol=1e-6)
        else:
            assert req.finish_reason == "length" and req.output_ids == [7, 7, 7] and req.embedding is None
    assert sched.bm.num_free_blocks == sched.bm.num_blocks


def test_an_embeddings_chunks_start_at_multiples_of_the_chunk_size_whatever_else_runs():
    """A long generation prompt takes part of each step's budget; the embedding behind it is still fed in chunks of
    max_chunk_tokens from its first token (a chunk waits for room, or runs alone)."""
    sched = scheduler(max_num_batched_tokens=12)
    long_prompt = generation(range(500, 530), name="long")
    emb = embedding(range(1000, 1029), name="emb")
    sched.add(long_prompt)
    sched.add(emb)
    steps = run(sched)
    chunks = [(start, q) for batch, starts in steps for r, start, q in zip(batch.requests, starts,
                                                                          batch.num_new_tokens) if r is emb]
    assert chunks == [(0, 8), (8, 8), (16, 8), (24, 5)]
    np.testing.assert_allclose(emb.embedding, expected(emb.prompt_ids, "mean"), rtol=1e-6)


def test_an_embedding_models_inputs_are_fed_whole_in_one_step():
    """whole_embeddings (model_config.task embed: a bidirectional encoder, whose chunk could not attend to its later
    tokens): each input in one step, several side by side while the budget holds them, one longer than the budget (or
    than max_chunk_tokens) alone; none ever split."""
    sched = scheduler(max_num_batched_tokens=12, whole_embeddings=True)
    reqs = [embedding(range(100 * i, 100 * i + n), name=f"e{i}") for i, n in enumerate((5, 6, 29, 3, 9, 4))]
    for req in reqs:
        sched.add(req)
    steps = run(sched)
    fed = [[(r.req_id, start, q) for r, start, q in zip(batch.requests, starts, batch.num_new_tokens)]
           for batch, starts in steps]
    assert fed == [[("e0", 0, 5), ("e1", 0, 6)], [("e2", 0, 29)], [("e3", 0, 3), ("e4", 0, 9)], [("e5", 0, 4)]]
    for req in reqs:
        np.testing.assert_allclose(req.embedding, expected(req.prompt_ids, "mean"), rtol=1e-6)


@pytest.mark.parametrize("pooling", ["last", "cls"])
def test_last_and_cls_pooling_take_one_tokens_state_across_chunks(pooling):
    sched = scheduler()
    emb = embedding(range(40, 61), pooling=pooling)
    sched.add(emb)
    run(sched)
    np.testing.assert_allclose(emb.embedding, expected(emb.prompt_ids, pooling), rtol=1e-6)


def test_an_embedding_neither_adopts_nor_leaves_cached_blocks():
    sched = scheduler(prefix_caching=True)
    first = generation(range(16), name="first")
    sched.add(first)
    run(sched)
    cached = sched.bm.num_cached_blocks
    emb = embedding(range(16), name="emb")           # the same prompt: its blocks are in the prefix cache
    sched.add(emb)
    steps = run(sched)
    assert steps[0][1] == [0] and emb.num_cached_tokens == 0
    np.testing.assert_allclose(emb.embedding, expected(emb.prompt_ids, "mean"), rtol=1e-6)
    assert sched.bm.num_cached_blocks == cached
    again = embedding(range(100, 116), name="again")
    sched.add(again)
    run(sched)
    probe = generation(range(100, 116), name="probe")
    sched.add(probe)
    steps = run(sched)
    assert steps[0][1] == [0]           # nothing of the embedding's input was cached


def test_a_preempted_embedding_pools_again_from_its_first_token():
    """Two embeddings whose chunks need more blocks than there are: the later one is preempted, computed again from
    its first token, and its embedding is the whole input's, counted once."""
    sched = scheduler(num_blocks=9, max_num_batched_tokens=16)
    a, b = embedding(range(200, 224), name="a"), embedding(range(300, 324), name="b")
    sched.add(a)
    sched.add(b)
    run(sched)
    assert sched.num_preemptions >= 1
    for req in (a, b):
        np.testing.assert_allclose(req.embedding, expected(req.prompt_ids, "mean"), rtol=1e-6)


def test_fcfs_serves_an_embedding_while_requests_decode():
    sched = scheduler(policy="fcfs")
    gens = [generation(range(10 * i, 10 * i + 4), n=40, name=f"g{i}") for i in range(3)]
    for g in gens:
        sched.add(g)
    sched.schedule()                   # (admitted; now they decode)
    emb = embedding(range(900, 905), name="emb")
    sched.add(emb)
    outputs = OutputProcessor(sched)
    for _ in range(6):
        batch = sched.schedule()
        if batch.kind is StepKind.EMBED:
            outputs.update_from_output(batch, StepOutputs([], [], pooled=np.stack(
                [pooled_part(r, q) for r, q in zip(batch.requests, batch.num_new_tokens)])))
        else:
            outputs.update_from_output(batch, StepOutputs([7] * batch.num_rows, [0.0] * batch.num_rows))
    assert emb.status is RequestStatus.FINISHED
    assert all(len(g.output_ids) >= 3 for g in gens)
