"""Scheduler tests with factories and a fake runner: no MindSpore, no processes."""
import random

from llm_serving.master.block_manager import BlockManager
from llm_serving.master.request import Request, RequestStatus, SamplingParams
from llm_serving.master.scheduler import QueueFullError, Scheduler

import pytest


def make_scheduler(*, num_blocks=64, block_size=4, **overrides):
    kwargs = dict(max_num_seqs=8, max_num_batched_tokens=64, max_prefill_rows=4, max_waiting_requests=100)
    kwargs.update(overrides)
    return Scheduler(block_manager=BlockManager(num_blocks, block_size), **kwargs)


def make_requests(n, prompt_len=5, max_new_tokens=4):
    return [Request(list(range(1, prompt_len + 1)), SamplingParams(max_new_tokens=max_new_tokens), frozenset(),
                    req_id=f"r{i}") for i in range(n)]


def fake_step(sched, batch, token=7):
    """What the engine does after a step: every row gets one new token; finished rows leave."""
    for req in batch.requests:
        req.num_computed_tokens = req.num_tokens
        req.output_ids.append(token)
        if len(req.output_ids) >= req.sampling.max_new_tokens:
            sched.finish(req, "length")


def test_new_requests_prefill_together_then_decode_together():
    sched = make_scheduler()
    for r in make_requests(3):
        sched.add(r)
    batch = sched.schedule()
    assert batch.is_prefill and [r.req_id for r in batch.requests] == ["r0", "r1", "r2"]
    assert batch.max_query_len == 5
    fake_step(sched, batch)
    batch = sched.schedule()
    assert not batch.is_prefill and batch.num_rows == 3
    assert all(r.num_new_tokens == 1 for r in batch.requests)


def test_a_new_request_joins_the_running_batch_at_the_next_step():
    sched = make_scheduler()
    first = make_requests(2)
    for r in first:
        sched.add(r)
    fake_step(sched, sched.schedule())
    fake_step(sched, sched.schedule())                 # one decode
    late = Request([9, 9], SamplingParams(max_new_tokens=4), frozenset(), req_id="late")
    sched.add(late)
    batch = sched.schedule()
    assert batch.is_prefill and batch.requests == [late]
    fake_step(sched, batch)
    batch = sched.schedule()
    assert [r.req_id for r in batch.requests] == ["r0", "r1", "late"]


def test_prefill_respects_token_budget_rows_and_max_num_seqs():
    sched = make_scheduler(max_num_batched_tokens=12, max_prefill_rows=4, max_num_seqs=3)
    for r in make_requests(5, prompt_len=5):
        sched.add(r)
    b1 = sched.schedule()
    assert b1.num_rows == 2                            # 5 + 5 <= 12 < 15
    fake_step(sched, b1)
    b2 = sched.schedule()
    assert b2.is_prefill and b2.num_rows == 1          # max_num_seqs = 3
    fake_step(sched, b2)
    assert sched.schedule().is_prefill is False


def test_finished_requests_free_their_blocks_at_once():
    sched = make_scheduler(num_blocks=16)
    reqs = make_requests(2, prompt_len=4, max_new_tokens=1)
    for r in reqs:
        sched.add(r)
    fake_step(sched, sched.schedule())
    assert all(r.status is RequestStatus.FINISHED for r in reqs)
    assert sched.bm.num_free_blocks == 16 and not sched.has_work


def test_queue_bound():
    sched = make_scheduler(max_waiting_requests=2)
    a, b, c = make_requests(3)
    sched.add(a)
    sched.add(b)
    with pytest.raises(QueueFullError, match="max_waiting_requests=2"):
        sched.add(c)


def test_preemption_frees_the_newest_and_recomputes_it_later():
    # 6 blocks of 4 tokens; three prompts of 7 tokens take 2 blocks each, the next token needs a third
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=100)
    reqs = make_requests(3, prompt_len=7, max_new_tokens=6)
    for r in reqs:
        sched.add(r)
    fake_step(sched, sched.schedule())                 # prefill all three; 8 tokens each now
    batch = sched.schedule()                           # decode needs positions 0..7: still 2 blocks each
    assert batch.num_rows == 3
    fake_step(sched, batch)                            # 9 tokens each: a third block each, only 0 free
    batch = sched.schedule()                           # preempting r2 frees 2 blocks: r0 and r1 go on
    assert [r.req_id for r in batch.requests] == ["r0", "r1"]
    assert sched.num_preemptions == 1
    assert [r.req_id for r in sched.waiting] == ["r2"]
    victim = reqs[2]
    assert victim.num_computed_tokens == 0 and victim.status is RequestStatus.WAITING
    assert victim.output_ids == [7, 7]                 # outputs are kept ...
    assert victim.num_new_tokens == 9                  # ... and recomputed with the prompt in one prefill
    assert sched.bm.num_free_blocks == 0
    fake_step(sched, batch)
    for _ in range(4):                                 # r0, r1 finish; r2 comes back as a prefill
        batch = sched.schedule()
        fake_step(sched, batch)
        if batch.is_prefill:
            break
    assert batch.is_prefill and batch.requests == [victim]


def test_randomized_load_conserves_blocks_and_finishes_everything():
    rng = random.Random(0)
    sched = make_scheduler(num_blocks=20, block_size=4, max_num_batched_tokens=32, max_num_seqs=6)
    pending = [Request(list(range(rng.randint(1, 14))) or [1], SamplingParams(max_new_tokens=rng.randint(1, 12)),
                       frozenset(), req_id=f"q{i}") for i in range(60)]
    finished = []
    for _ in range(2000):
        if pending and rng.random() < 0.3:
            sched.add(pending.pop())
        batch = sched.schedule()
        used = sum(len(t) for t in sched.bm.block_tables.values())
        assert used + sched.bm.num_free_blocks == 20
        if batch is None:
            if not pending and not sched.has_work:
                break
            continue
        if batch.is_prefill:
            assert sum(r.num_new_tokens for r in batch.requests) <= 32 or batch.num_rows == 1
        assert len(sched.running) <= 6
        for r in batch.requests:
            assert sched.bm.num_blocks_for(r.num_tokens) <= len(sched.bm.block_tables[r.req_id])
        done_before = {r.req_id for r in batch.requests if r.finished}
        fake_step(sched, batch)
        finished += [r for r in batch.requests if r.finished and r.req_id not in done_before]
    assert not pending and not sched.has_work
    assert len(finished) == 60
    assert all(len(r.output_ids) == r.sampling.max_new_tokens for r in finished)
    assert sched.bm.num_free_blocks == 20
