"""Graph buckets (models/buckets.py) and step-input checks (models/step_inputs.py): pure numpy, no MindSpore."""
import dataclasses
import sys

import numpy as np
import pytest

from llm_serving.models.buckets import Buckets, token_buckets
from llm_serving.models.step_inputs import StepInputs, StepLimits
from llm_serving.shm.layout import StepView


def make(**kw) -> Buckets:
    args = dict(decode_batch_sizes=[1], prefill_batch_sizes=[1, 4], prefill_seq_lens=[16, 32], max_blocks_per_seq=4,
                packed=True, one_width=True)
    return Buckets.make(**{**args, **kw})


def test_packed_token_buckets_follow_the_prefill_buckets_and_the_step_budget():
    assert make().prefill_token_sizes == [16, 32, 64, 128]                     # up to 4 rows x 32 tokens
    capped = make(max_step_tokens=64)                                         # the scheduler's budget
    assert capped.prefill_token_sizes == [16, 32, 64]
    assert capped.token_pieces(200) == [64, 64, 64, 16]
    assert make(max_step_tokens=8).prefill_token_sizes == [16, 32]             # never below one row's bucket
    assert token_buckets(16, 100) == [16, 32, 64, 100]


def test_a_step_is_split_into_pieces_that_pad_less_than_the_smallest_bucket():
    b = make(prefill_batch_sizes=[1], prefill_seq_lens=[16, 64])
    assert b.prefill_token_sizes == [16, 32, 64]
    assert [b.token_pieces(t) for t in (1, 16, 17, 33, 40, 48, 64)] == [[16], [16], [32], [32, 16], [32, 16],
                                                                      [64], [64]]
    for t in range(1, 300):
        pieces = b.token_pieces(t)
        assert sum(pieces) >= t and sum(pieces) - t <= 16, t


def test_an_encoders_rows_stay_whole_within_one_graph_call():
    """row_pieces (a bidirectional encoder's embed step): rows side by side while they fit the largest bucket, each
    call in the smallest bucket holding it, a row longer than the largest alone in a doubled bucket; every row
    whole within one call and every token in exactly one."""
    b = make(prefill_batch_sizes=[1], prefill_seq_lens=[16, 64])              # buckets 16, 32, 64
    assert b.row_pieces([5, 7]) == [(0, 12, 16)]
    assert b.row_pieces([40, 30, 3]) == [(0, 40, 64), (40, 73, 64)]
    assert b.row_pieces([10, 100, 2]) == [(0, 10, 16), (10, 110, 128), (110, 112, 16)]
    assert b.row_pieces([300]) == [(0, 300, 512)]
    rng = np.random.default_rng(0)
    for _ in range(200):
        lengths = rng.integers(1, 150, rng.integers(1, 8))
        pieces = b.row_pieces(lengths)
        ends = np.cumsum(lengths)
        assert pieces[0][0] == 0 and pieces[-1][1] == ends[-1]
        for (start, stop, size), nxt in zip(pieces, pieces[1:] + [None]):
            assert stop - start <= size and (nxt is None or nxt[0] == stop)
            assert start in set(ends - lengths) and stop in set(ends)            # rows whole


def test_bucket_and_width_pick_the_smallest_that_fits_and_say_what_does_not_fit():
    b = make(decode_batch_sizes=[2, 8], decode_block_widths=[1, 2], one_width=False, packed=False,
             max_blocks_per_seq=6)
    assert b.decode_block_widths == [1, 2, 6]
    assert b.bucket(1, 1) == (2, 1) and b.bucket(3, 1) == (8, 1) and b.bucket(3, 20) == (4, 32)
    assert [b.width(1, k) for k in (1, 2, 3, 6)] == [1, 2, 6, 6] and b.width(16, 1) == 6
    with pytest.raises(ValueError, match="decode_batch_sizes"):
        b.bucket(9, 1)
    with pytest.raises(ValueError, match="prefill_seq_lens"):
        b.bucket(1, 33)
    assert [g[0] for g in b.graphs()] == ["decode"] * 6 + ["prefill"] * 4
    assert make().decode_block_widths == [4]                  # one width when the kernel reads the block table


@pytest.mark.parametrize("kw, message", [
    (dict(decode_batch_sizes=[]), "decode_batch_sizes"),
    (dict(prefill_seq_lens=[1]), "prefill_seq_lens needs a length >= 2"),
    (dict(prefill_batch_sizes=[0]), "prefill_batch_sizes"),
    (dict(decode_block_widths=[5]), "decode_block_widths"),
])
def test_bad_bucket_lists_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        make(**kw)


LIMITS = StepLimits(vocab_size=100, max_context=64, num_blocks=4, max_blocks_per_seq=4, scratch_slot=64)


def step_arrays() -> dict:
    n, s = 2, 3
    return dict(input_ids=np.ones((n, s)), positions=np.zeros((n, s)), slot_mapping=np.zeros((n, s)),
                block_tables=np.zeros((n, 2)), context_lens=[3, 3], query_lens=[3, 3], temperature=[0, 0],
                top_k=[0, 0], top_p=[1, 1], random_u=[0, 0])


def step(kind="prefill", **over):
    args = step_arrays()
    return StepInputs.make(LIMITS, StepView(kind, **{**args, **over}))


def test_step_inputs_are_converted_to_their_dtypes():
    st = step()
    assert (st.n, st.s) == (2, 3) and st.input_ids.dtype == np.int32 and st.per_row["top_p"].dtype == np.float32
    assert not st.penalized and not st.wants_top
    pen = dict(history=[[1, 2]] * 2, history_len=[2, 2], prompt_len=[1, 1], repetition_penalty=[1.0, 1.2],
               presence_penalty=[0, 0], frequency_penalty=[0, 0])
    st = step(**pen, top_n=[0, 2])
    assert st.penalized and st.wants_top and st.per_row["history"].shape == (2, 64)
    assert not step(**{**pen, "repetition_penalty": [1.0, 1.0]}).penalized    # no row has a penalty
    assert not StepInputs.make(LIMITS, StepView("prefill", **step_arrays(), **pen), sampler=False).penalized
    verify = StepView("verify", **step_arrays(), verify_random_u=np.zeros((2, 3)), **pen)
    assert not StepInputs.make(LIMITS, verify).penalized        # (a verify step's rows have none)


@pytest.mark.parametrize("over, message", [
    (dict(input_ids=np.ones(3)), "input_ids must be"),
    (dict(positions=np.zeros((2, 2))), "positions has shape"),
    (dict(block_tables=np.zeros((2, 5))), "max_blocks_per_seq=4"),
    (dict(top_k=[0]), "top_k has shape"),
    (dict(query_lens=[0, 3]), "query_lens must be in"),
    (dict(context_lens=[3, 65]), "context_lens must be in"),
    (dict(positions=np.full((2, 3), 64)), "positions must be in"),
    (dict(slot_mapping=np.full((2, 3), 64)), "slot_mapping must be in"),
    (dict(input_ids=np.full((2, 3), 100)), "token ids must be in"),
    (dict(block_tables=np.full((2, 2), 4)), "block ids must be in"),
    (dict(history=np.zeros((2, 65)), history_len=[0, 0], prompt_len=[0, 0], repetition_penalty=[1.1, 1],
          presence_penalty=[0, 0], frequency_penalty=[0, 0]), "history has shape"),
])
def test_malformed_step_inputs_are_refused_naming_the_array(over, message):
    with pytest.raises(ValueError, match=message):
        step(**over)


WINDOW_LIMITS = dataclasses.replace(LIMITS, window_blocks=2, window_scratch_slot=32)     # a pool of 2 blocks of 16
WINDOW_PAIR = dict(window_slots=np.arange(6).reshape(2, 3), window_tables=[[1, 0], [0, 1]])


def test_the_window_pair_is_read_with_a_pool_only():
    st = StepInputs.make(WINDOW_LIMITS, StepView("prefill", **step_arrays(), **WINDOW_PAIR))
    assert st.window_slots.dtype == st.window_tables.dtype == np.int32 and st.window_tables.tolist() == [[1, 0], [0, 1]]
    st = StepInputs.make(LIMITS, StepView("prefill", **step_arrays(), **WINDOW_PAIR))
    assert st.window_slots is None and st.window_tables is None          # no pool: the step's arrays are not read
    padding = dict(step_arrays(), slot_mapping=[[0, 1, -1], [2, -1, -1]], query_lens=[2, 1])
    st = StepInputs.make(WINDOW_LIMITS, StepView("prefill", **padding, window_slots=[[3, 4, -1], [5, -1, -1]],
                                                 window_tables=[1, 0, 0, 1]))               # (a flat table reshaped)
    assert st.window_tables.shape == (2, 2)


@pytest.mark.parametrize("pair, message", [
    (dict(), "window pool is on .*needs window_slots and window_tables"),
    (dict(window_slots=np.zeros((2, 3))), "needs window_tables"),
    (dict(WINDOW_PAIR, window_slots=np.zeros((2, 2))), "window_slots has shape"),
    (dict(WINDOW_PAIR, window_tables=np.zeros((2, 5))), "window_tables has shape"),
    (dict(WINDOW_PAIR, window_slots=np.full((2, 3), 32)), r"window_slots must be in \[-1, 32\)"),
    (dict(WINDOW_PAIR, window_tables=[[0, 3], [0, 0]]), r"window block ids must be in \[0, 3\)"),   # (2: scratch)
    (dict(WINDOW_PAIR, window_slots=[[0, 1, -1], [2, 3, 4]]), "window_slots must be -1 exactly where slot_mapping is"),
])
def test_a_malformed_window_pair_is_refused_naming_it(pair, message):
    with pytest.raises(ValueError, match=message):
        StepInputs.make(WINDOW_LIMITS, StepView("prefill", **step_arrays(), **pair))


def test_shape_logic_needs_no_mindspore():
    import subprocess
    out = subprocess.run([sys.executable, "-c", "import sys, llm_serving.models.buckets, "
                          "llm_serving.models.step_inputs; print('mindspore' in sys.modules)"],
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_verify_parents_make_tree_bits_and_chains_need_none():
    vu = np.zeros((2, 3), np.float32)
    assert step("verify", verify_random_u=vu, verify_parent=[[-1, 0, 1], [-1, 0, 0]]).verify_parent is not None
    chains = step("verify", verify_random_u=vu, verify_parent=[[-1, 0, 1], [-1, 0, 1]])
    assert chains.verify_parent is None                     # all chains: plain causal attention
    # row 1 is a root with two children: its third token must not see the second (bit 1: one key back)
    tree = step("verify", verify_random_u=vu, verify_parent=[[-1, 0, 1], [-1, 0, 0]], query_lens=[2, 3])
    assert tree.tree_bits().tolist() == [-1, -1, -1, -1, -1 & ~(1 << 1)]
    for parents in ([[0, 0, 1], [-1, 0, 1]], [[-1, 1, 1], [-1, 0, 1]], [[-1, 0, 2], [-1, 0, 1]]):
        with pytest.raises(ValueError, match="verify_parent must be"):
            step("verify", verify_random_u=vu, verify_parent=parents)
    with pytest.raises(ValueError, match="not a verify step"):
        step(verify_parent=[[-1, 0, 1], [-1, 0, 1]])
