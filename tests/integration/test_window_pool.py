"""The window pool (RunnerSpec.window_blocks): a sliding-window model's sliding layers keep their K/V in a cache of
their own, written at the step's window_slots and read through its window_tables. Here those map each row's blocks
elsewhere than its block_tables, a row holds only its window's blocks (freed as the window moves on, and taken at
once by other rows), and its table's entries below the window are left stale: blocks other rows hold and write.
Every kind of step (packed and padded prefill, a prompt longer than the window, chunked prefill, decode steps with a
padding row, a decode run whose rows end apart, a verify step of a token tree or of chains) gives the same tokens,
log-probabilities and logits as the same steps without the pool, to the bit, on the layer kernel, on MindSpore's ops
with the paged-attention kernel, and on MindSpore's key-gather path; and each layer's cache holds the same K/V of every
row's window (the sliding layers' in the pool)."""
from __future__ import annotations

import numpy as np
import pytest

from llm_serving.models.runner_spec import RunnerSpec
from llm_serving.shm.layout import StepView
from tests.families import make_hf_model, needs_transformers
from tests.integration.test_model_runner import MODEL_DIR, Seq, step_arrays, step_view

pytest.importorskip("mindspore")

WINDOW = 16                      # the tiny Gemma 3's sliding window (tests/families.py)
BS = 4                           # block size: a window spans four or five blocks
WINDOW_BLOCKS = 24
PROMPT_A = [1] + [(7 * i * i + 3 * i + 11) % 250 + 3 for i in range(39)]      # 40 tokens: past the window
PROMPT_B = [1, 17, 42, 5, 77, 23, 9, 61, 30]                                   # inside it
PROMPT_C = [1] + [(5 * i * i + 13 * i + 2) % 240 + 5 for i in range(36)]      # 37 tokens, in chunks of 16
CHUNK = 16
RUN_STEPS = 4
WIDTH = 5                        # verify: a row's last token and 4 proposals
SPEC = dict(num_blocks=48, block_size=BS, max_blocks_per_seq=16, decode_batch_sizes=[1, 2, 4],
            prefill_batch_sizes=[1, 2], prefill_seq_lens=[16, 48], num_threads=2, verify_width=WIDTH, verify_rows=2)
# the paths: the layer kernel on every step (and decode runs); MindSpore's ops above 2 tokens (prefill pieces, the
# 3-row decode steps' bucket of 4 with its padding row, the verify step), attending through the paged-attention
# kernel; MindSpore's ops gathering the keys (no attention kernel: padded prefill and verify steps, gathered decode)
PATHS = {"layer_kernel": dict(decode_run_steps=RUN_STEPS, decode_run_rows=4),
         "ops": dict(layer_kernel_rows=2),
         "gather": dict(attention_kernel="off")}


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    needs_transformers()
    return str(make_hf_model("gemma3", tmp_path_factory.mktemp("window_pool") / "gemma3", seed=3))


@pytest.fixture(scope="module", params=list(PATHS))
def runners(request, gemma3):
    """(path, the runner without the pool, the runner with it)."""
    from llm_serving.models.runner import ModelRunner
    spec = dict(SPEC, **PATHS[request.param])
    return (request.param, ModelRunner(gemma3, RunnerSpec(**spec)),
            ModelRunner(gemma3, RunnerSpec(**spec, window_blocks=WINDOW_BLOCKS)))


# ------------------------------------------------------------------------------------------- the master's part
class Row(Seq):
    """A sequence (its main blocks, its tokens in the cache) and its window-pool table, by block index: the blocks it
    holds (`held`), and below them stale entries."""

    def __init__(self, blocks):
        super().__init__(blocks)
        self.window_table, self.held = [], set()


class WindowPool:
    """The test's stand-in for the master's window pool: blocks from a shuffled free list, the last freed taken first
    (by another row, or by the same row for another block index)."""

    def __init__(self, seed: int = 0):
        self.free = [int(b) for b in np.random.default_rng(seed).permutation(WINDOW_BLOCKS)]
        self.owner = {}                   # block -> the row holding it
        self.stale_elsewhere = 0          # stale entries of a step's rows pointing at blocks other rows hold

    def hold(self, rows, spans) -> None:
        """Before a step: each row, feeding the keys first..last (its slot order), holds the blocks of the window of
        its first new token up to that of its last, and frees those below."""
        for row, (first, last) in zip(rows, spans):
            low = max(0, first + 1 - WINDOW) // BS
            for j in sorted(row.held):
                if j < low:
                    row.held.discard(j)
                    del self.owner[row.window_table[j]]
                    self.free.append(row.window_table[j])
        for row, (first, last) in zip(rows, spans):
            for j in range(max(0, first + 1 - WINDOW) // BS, last // BS + 1):
                if j in row.held:
                    continue
                block = self.free.pop()
                if j < len(row.window_table):
                    row.window_table[j] = block
                else:
                    row.window_table.append(block)
                row.held.add(j)
                self.owner[block] = row
        self.stale_elsewhere += sum(self.owner.get(row.window_table[j], row) is not row
                                    for row in rows for j in range(len(row.window_table)) if j not in row.held)

    @staticmethod
    def arrays(rows, counts, width: int, steps: int = 0) -> dict:
        """window_slots (n, max count) of each row's next `count` keys (-1 after them) and window_tables (n, width)
        (0 past a row's entries); steps: a decode run's (n, steps)."""
        slots = np.full((len(rows), max(max(counts), steps)), -1, np.int32)
        tables = np.zeros((len(rows), width), np.int32)
        for i, (row, count) in enumerate(zip(rows, counts)):
            keys = np.arange(row.cached, row.cached + count)
            slots[i, :count] = np.asarray(row.window_table)[keys // BS] * BS + keys % BS
            tables[i, :len(row.window_table)] = row.window_table
        return dict(window_slots=slots, window_tables=tables)


# ------------------------------------------------------------------------------------------------ one step, twice
def both(off, on, view: StepView) -> tuple:
    """The step on both runners (`off` ignores the window arrays); their outputs, equal to the bit."""
    out_off, out_on = off.execute(view), on.execute(view)
    assert len(out_off) == len(out_on)
    for a, b in zip(out_off, out_on):
        np.testing.assert_array_equal(a, b)
    return out_on


def feed(off, on, pool, rows, new_tokens, *, positions=None, **arrays) -> tuple:
    """One prefill, decode or verify step of `rows` feeding `new_tokens` (positions: a token tree's, by depth) on both
    runners; logits too, but for verify steps."""
    counts = [len(t) for t in new_tokens]
    pool.hold(rows, [(row.cached, row.cached + c - 1) for row, c in zip(rows, counts)])
    window = pool.arrays(rows, counts, width=on.max_blocks_per_seq)
    verify = "verify_random_u" in arrays
    args = step_arrays(on, rows, new_tokens)
    if positions is not None:
        args["positions"] = np.asarray(positions, np.int32)
    kind = "verify" if verify else "prefill" if args["input_ids"].shape[1] > 1 else "decode"
    return both(off, on, StepView(kind, return_logits=not verify, **args, **window, **arrays))


def decode_run(off, on, pool, rows, tokens, steps) -> tuple:
    """A decode run of `rows` from their last `tokens`, row i taking steps[i] of its RUN_STEPS."""
    pool.hold(rows, [(row.cached, row.cached + k - 1) for row, k in zip(rows, steps)])
    window = pool.arrays(rows, steps, width=on.max_blocks_per_seq, steps=RUN_STEPS)
    slots = np.full((len(rows), RUN_STEPS), -1, np.int32)
    tables = np.zeros((len(rows), on.max_blocks_per_seq), np.int32)
    for i, (row, k) in enumerate(zip(rows, steps)):
        keys = np.arange(row.cached, row.cached + k)
        slots[i, :k] = np.asarray(row.blocks)[keys // BS] * BS + keys % BS
        tables[i, :len(row.blocks)] = row.blocks
    pos = np.array([row.cached for row in rows], np.int32)
    view = StepView("decode_run", input_ids=np.asarray(tokens, np.int32).reshape(-1, 1), positions=pos.reshape(-1, 1),
                    slot_mapping=slots, block_tables=tables, context_lens=pos + 1, **window)
    out = both(off, on, view)
    for row, k in zip(rows, steps):
        row.cached += k
    return out


def check_caches(off, on, rows) -> None:
    """Every layer's K/V of each row's last WINDOW keys: the same numbers, at the row's window slots in a sliding
    layer's pool, at its main slots elsewhere."""
    for lay_off, lay_on in zip(off.model.layers, on.model.layers):
        kvh = lay_on.kvh
        if lay_on.in_window_pool:
            assert lay_on.attn.key_cache.shape[0] == (WINDOW_BLOCKS + 1) * BS * kvh
        else:
            assert lay_on.attn.key_cache.shape == lay_off.attn.key_cache.shape
        for name in ("key_cache", "value_cache"):
            cache_off = getattr(lay_off.attn, name).asnumpy().reshape(-1, kvh, lay_on.d)     # (slots, KVH, D)
            cache_on = getattr(lay_on.attn, name).asnumpy().reshape(-1, kvh, lay_on.d)
            for row in rows:
                keys = np.arange(max(0, row.cached - WINDOW), row.cached)
                main = np.asarray(row.blocks)[keys // BS] * BS + keys % BS
                table = row.window_table if lay_on.in_window_pool else row.blocks
                mine = np.asarray(table)[keys // BS] * BS + keys % BS
                np.testing.assert_array_equal(cache_off[main], cache_on[mine])


# ------------------------------------------------------------------------------------------------------ the tests
def test_every_step_kind_gives_what_it_gives_without_the_pool(runners):
    path, off, on = runners
    assert off.window_blocks == 0 and on.window_blocks == WINDOW_BLOCKS
    assert [layer.in_window_pool for layer in on.model.layers] == [True, False, True, False]   # Gemma 3's sliding
    for r in (off, on):
        r.reset()
    main = np.random.default_rng(1).permutation(off.num_blocks)
    rows = [Row(list(main[16 * i:16 * (i + 1)])) for i in range(3)]              # A, B, C: 16 blocks each
    a, b, c = rows
    pool = WindowPool()
    ids, lps, logits = feed(off, on, pool, [a, b], [PROMPT_A, PROMPT_B])         # one step, A past the window
    assert np.isfinite(logits).all() and (lps < 0).all()
    last = {id(a): int(ids[0]), id(b): int(ids[1])}
    for start in range(0, len(PROMPT_C), CHUNK):                                 # chunked: a window across chunks
        ids, _, _ = feed(off, on, pool, [c], [PROMPT_C[start:start + CHUNK]])
    last[id(c)] = int(ids[0])
    for _ in range(3):                                                           # 3 rows: a padding row in bucket 4
        ids, _, _ = feed(off, on, pool, rows, [[last[id(r)]] for r in rows])
        last = {id(r): int(t) for r, t in zip(rows, ids)}
    if on.graphs.decode_run is not None:                                                # B ends after 2 of the run's steps
        tokens, logprobs = decode_run(off, on, pool, rows, [last[id(r)] for r in rows], [RUN_STEPS, 2, RUN_STEPS])
        assert (tokens[1, 2:] == -1).all() and (tokens >= 0).sum() == 2 * RUN_STEPS + 2
        last = {id(r): int(t[t >= 0][-1]) for r, t in zip(rows, tokens)}
        ids, _, _ = feed(off, on, pool, rows, [[last[id(r)]] for r in rows])    # and on from where the run left
        last = {id(r): int(t) for r, t in zip(rows, ids)}
    check_caches(off, on, rows)
    # verify: A feeds a token tree (its last token, then two branches of two: parents -1, 0, 1, 0, 3), C a chain;
    # the padded path (no attention kernel) takes chains only
    x = last[id(a)]
    tree, parents, depths = [x, 7, 8, 9, 10], [-1, 0, 1, 0, 3], [0, 1, 2, 1, 2]
    chain = [last[id(c)], 11, 12]
    tree_step = on.buckets.packed
    positions = np.zeros((2, WIDTH), np.int32)
    positions[0] = a.cached + np.asarray(depths if tree_step else range(WIDTH))
    positions[1, :3] = c.cached + np.arange(3)
    verify = dict(verify_random_u=np.zeros((2, WIDTH), np.float32))
    if tree_step:
        verify["verify_parent"] = np.array([parents, [-1, 0, 1, 2, 3]], np.int32)
    ids, lps = feed(off, on, pool, [a, c], [tree, chain], positions=positions, **verify)
    assert ids.shape == (2, WIDTH) and (lps[:, 0] < 0).all()
    check_caches(off, on, [a, c])
    assert pool.stale_elsewhere > 0                   # (the stale entries did point at other rows' blocks)
    if path == "gather":
        assert not on.buckets.packed and on.decode_kernel is None
    else:
        assert on.buckets.packed and (on.layer_kernel_rows == 2) == (path == "ops")


def test_the_pool_needs_the_window_arrays_and_checks_them(runners):
    _, off, on = runners
    row = Row(list(range(8)))
    args = step_arrays(on, [row], [[1, 5, 9]])
    with pytest.raises(ValueError, match="window pool is on .*needs window_slots and window_tables"):
        on.execute(StepView("prefill", **args))
    off.execute(StepView("prefill", **args))                      # without a pool: not read
    slots = np.array([[0, 1, -1]], np.int32)
    with pytest.raises(ValueError, match="window_slots must be -1 exactly where slot_mapping is"):
        on.execute(StepView("prefill", **args, window_slots=slots, window_tables=np.zeros((1, 2), np.int32)))
    with pytest.raises(ValueError, match=r"window block ids must be in \[0, 25\)"):   # (24: the scratch block)
        on.execute(StepView("prefill", **args, window_slots=np.array([[0, 1, 2]], np.int32),
                            window_tables=np.array([[0, WINDOW_BLOCKS + 1]], np.int32)))
    with pytest.raises(ValueError, match=r"window_slots must be in \[-1, 96\)"):       # (the scratch block's)
        on.execute(StepView("prefill", **args, window_slots=np.array([[0, 1, 96]], np.int32),
                            window_tables=np.zeros((1, 2), np.int32)))
    run = dict(input_ids=[[3]], positions=[[3]], slot_mapping=np.array([[3, 4, -1, -1]], np.int32),
               block_tables=np.zeros((1, 4), np.int32), context_lens=[4], window_tables=np.zeros((1, 4), np.int32))
    if on.graphs.decode_run is not None:
        with pytest.raises(ValueError, match=r"window_slots must be \(1, 4\), >= 0 exactly where"):
            on.execute(StepView("decode_run", **run, window_slots=np.array([[3, 4, 5, -1]], np.int32)))


def test_a_model_without_sliding_layers_has_no_pool():
    """window_blocks is ignored for a model whose layers all see every key: its steps need no window arrays."""
    from llm_serving.models.runner import ModelRunner
    runner = ModelRunner(str(MODEL_DIR), RunnerSpec(num_blocks=16, block_size=16, max_blocks_per_seq=4,
                                                    decode_batch_sizes=[1], prefill_batch_sizes=[1],
                                                    prefill_seq_lens=[16], num_threads=2, window_blocks=8))
    assert runner.window_blocks == 0 and not runner.model.window_pool
    ids, _ = runner.execute(step_view(runner, [Seq([0])], [[1, 403, 407]]))
    assert ids.shape == (1,)
