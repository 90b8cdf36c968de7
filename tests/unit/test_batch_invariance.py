"""Batch invariance of the CPU kernels (decoder_layer_cpu.cc, invariant_enabled): one sequence's rows give the same
layer outputs and the same K/V to the bit whatever step they run in — one prompt chunk, chunks of other sizes,
one decode row at a time among 63 other rows, a chunk packed beside another prompt, a token tree's verify rows —
and the lm_head gives a row the same logits, token and log-probability alone or among 63 others. Float32 and
quantized weights (blocks of 32 and K-quants), every KV-cache type, the model families' parts (GELU, q/k norms,
sandwich norms, sliding windows). KernelInvariant(0), the faster paths that each batch size picks, does not
promise this (and on these shapes does not give it: the test says so)."""
from __future__ import annotations

import numpy as np
import pytest

from llm_serving.models.kernels.aot_call import invoke

from .test_layer_kernel import (GGUF_TYPES, Layer, integer_path, library, library_path, logits_args,  # noqa: F401
                                quantized_rows)

PROMPT = 70            # the sequence's tokens
NOISE_CONTEXT = 90     # other rows' keys at most


@pytest.fixture
def invariant(library):
    import ctypes

    library.KernelInvariant.argtypes = [ctypes.c_int]
    before = library.KernelInvariant(-1)
    yield library
    library.KernelInvariant(before)


class Steps:
    """One layer (weights, caches) and a way to run a step of any rows: a row is (x, position, key index, context,
    tree bits, block table); its slot is its table's entry for the key index."""

    def __init__(self, rng, cache, weights, threads=2, inter=256, features=None, head_dim=64):
        hidden = 256
        self.layer = Layer(rng, hidden=hidden, heads=8, kv_heads=2, head_dim=head_dim, inter=inter, batch=1,
                           block_size=16, num_blocks=120, width=8, cache_dtype=cache)
        if weights is not None:
            self.layer.quantize(weights, rng)
        if features is not None:                 # Layer.with_features' parts (tests/unit/test_layer_kernel.py)
            self.layer.with_features(rng, **features)
        self.fresh = (self.layer.key_cache.copy(), self.layer.value_cache.copy())
        blocks = rng.permutation(120)
        self.table = blocks[:8].astype(np.int32)                 # the sequence's blocks
        self.noise_tables = blocks[8:].reshape(-1, 8)[:13]       # 13 other sequences' (random keys: the cache)
        self.xs = (rng.standard_normal((PROMPT + 8, hidden)) * 0.5).astype(np.float32)
        self.rng, self.threads = rng, threads
        self.call_invariant = None          # the calls' own iconfig entry (None: the process's setting)

    def reset(self):
        self.layer.key_cache[...] = self.fresh[0]
        self.layer.value_cache[...] = self.fresh[1]

    def row(self, i, position=None, key=None, tree=-1):
        """Token i of the sequence at key index `key` (default i), position `position` (default key)."""
        key = i if key is None else key
        return (self.xs[i], key if position is None else position, key, key + 1, tree, self.table)

    def noise(self, n):
        rng = self.rng
        return [((rng.standard_normal(self.xs.shape[1]) * 0.5).astype(np.float32), c - 1, c - 1, c, -1,
                 self.noise_tables[rng.integers(0, len(self.noise_tables))])
                for c in rng.integers(1, NOISE_CONTEXT, n)]

    def run(self, rows):
        layer, bs = self.layer, self.layer.bs
        layer.b = len(rows)
        layer.x = np.ascontiguousarray(np.stack([r[0] for r in rows]))
        layer.positions = np.array([r[1] for r in rows], np.int32)
        keys = np.array([r[2] for r in rows], np.int32)
        layer.context = np.array([r[3] for r in rows], np.int32)
        layer.tree = np.array([r[4] for r in rows], np.int32)
        layer.tables = np.ascontiguousarray(np.stack([r[5] for r in rows]).astype(np.int32))
        layer.slots = (layer.tables[np.arange(len(rows)), keys // bs] * bs + keys % bs).astype(np.int32)
        layer.lora = np.zeros(len(rows), np.int32)
        arrays = layer.arrays(self.threads, invariant=self.call_invariant)
        assert invoke(self.library.DecoderLayer, arrays) == 0
        return arrays[-1]

    def slots_of(self, n):
        bs = self.layer.bs
        return [self.table[k // bs] * bs + k % bs for k in range(n)]

    def kv(self, n):
        """The sequence's first n keys and values as the cache holds them (raw bytes)."""
        kvh = self.layer.kvh
        rows = [s * kvh + h for s in self.slots_of(n) for h in range(kvh)]
        return self.layer.key_cache[rows].copy(), self.layer.value_cache[rows].copy()


def prompt_in_steps(steps, chunks, decode_batch=1, beside=0):
    """The sequence's PROMPT tokens run as prompt chunks of the given sizes, then one decode row per step for the
    rest, each step also holding `decode_batch - 1` other rows (decode rows of other sequences) and `beside` rows
    of another prompt's chunk before it. Returns (each token's output row, the sequence's K/V)."""
    steps.reset()
    out = np.empty((PROMPT, steps.xs.shape[1]), np.float32)
    at = 0
    for n in chunks:
        other = steps.noise(decode_batch - 1) if decode_batch > 1 else []
        chunk = [steps.row(i) for i in range(at, at + n)]
        got = steps.run(other[:beside] + chunk + other[beside:])
        out[at:at + n] = got[min(beside, len(other)):][:n]
        at += n
    while at < PROMPT:
        other = steps.noise(decode_batch - 1)
        place = int(steps.rng.integers(0, len(other) + 1))
        got = steps.run(other[:place] + [steps.row(at)] + other[place:])
        out[at] = got[place]
        at += 1
    return out, steps.kv(PROMPT)


WEIGHTS = {
    "float32": None,
    "q8_0": {name: GGUF_TYPES.Q8_0 for name in ("qkv_w", "o_w", "gate_up_w", "down_w")},
    "q4_k/q6_k": {"qkv_w": GGUF_TYPES.Q4_K, "o_w": GGUF_TYPES.Q4_1, "gate_up_w": GGUF_TYPES.Q4_K,
                  "down_w": GGUF_TYPES.Q6_K},
}
# llama.cpp's Q4_K_M mix (q/k/o/gate/up Q4_K, v and down Q6_K: q/k/v mix types in one product), and the blocks of
# 32 with a width that ends mid group of 256 (inter 288 = 9 blocks)
MORE_WEIGHTS = {
    "q4_k_m": {"q_w": GGUF_TYPES.Q4_K, "k_w": GGUF_TYPES.Q4_K, "v_w": GGUF_TYPES.Q6_K, "o_w": GGUF_TYPES.Q4_K,
               "gate_up_w": GGUF_TYPES.Q4_K, "down_w": GGUF_TYPES.Q6_K},
    "q5/q4_0": {"q_w": GGUF_TYPES.Q5_0, "k_w": GGUF_TYPES.Q5_1, "v_w": GGUF_TYPES.Q8_0, "o_w": GGUF_TYPES.Q4_0,
                "gate_w": GGUF_TYPES.Q5_K, "up_w": GGUF_TYPES.Q4_1, "down_w": GGUF_TYPES.Q8_0},
}


@pytest.mark.parametrize("cache", ["float16", "float32", "bfloat16", "int8"])
@pytest.mark.parametrize("weights", list(WEIGHTS))
def test_a_sequence_gives_the_same_bits_in_any_step(invariant, cache, weights):
    steps = Steps(np.random.default_rng(7), cache, WEIGHTS[weights])
    steps.library = invariant
    assert invariant.KernelInvariant(1) == 1
    want, want_kv = prompt_in_steps(steps, [PROMPT])                           # the whole prompt, one chunk
    for chunks, batch, beside in [([16, 30, 24], 1, 0),                      # chunks of other sizes, alone
                                  ([5, 17], 64, 0),                           # short chunks, then decode among 63
                                  ([], 3, 0),                                  # every token decoded, among 2
                                  ([40], 1, 0),                               # decoded alone, one row a step
                                  ([20], 2, 0),                               # decoded beside one other row
                                  ([PROMPT], 40, 25)]:                         # packed after 25 rows of others
        got, got_kv = prompt_in_steps(steps, chunks, batch, beside)
        np.testing.assert_array_equal(got, want, err_msg=f"chunks {chunks}, {batch} rows a step")
        for g, w in zip(got_kv, want_kv):
            np.testing.assert_array_equal(g, w, err_msg=f"K/V, chunks {chunks}, {batch} rows a step")


# Gemma 3's parts together, GELU alone, windows alone: a window of 5 keys puts the last rows' first key tile past
# the first (a row alone starts there, in a chunk the tiles before it are no-ops for it), one of 40 keeps the
# bounds inside the first tiles, one of 66 spans two tiles (which fall at multiples of 64 alone or in a chunk)
GEMMA3 = dict(qk_norm=True, sandwich=True, activation=1, attention_scale=0.125, window=5)
PARTS = {"gemma3": GEMMA3, "gelu": dict(activation=1), "window_40": dict(window=40), "window_66": dict(window=66),
         "qk_norm_window_5": dict(qk_norm=True, window=5)}


@pytest.mark.parametrize("parts,weights,cache,head_dim", [
    ("gemma3", "float32", "float16", 64), ("gemma3", "q8_0", "int8", 64), ("gemma3", "q4_k/q6_k", "float32", 64),
    ("gelu", "float32", "float32", 64), ("window_40", "q8_0", "float16", 64), ("gemma3", "float32", "float16", 32),
    ("window_40", "float32", "bfloat16", 32), ("qk_norm_window_5", "q8_0", "float32", 64),
    ("window_66", "float32", "float16", 64)])
def test_the_model_family_parts_give_the_same_bits_in_any_step(invariant, parts, weights, cache, head_dim):
    """As test_a_sequence_gives_the_same_bits_in_any_step with the parts on: the activation through its one
    compiled copy in every MLP path, the q/k and sandwich norms by row, a window's bounds in attend_tile (head dim
    64) and attend_row (32)."""
    steps = Steps(np.random.default_rng(17), cache, WEIGHTS[weights], features=PARTS[parts], head_dim=head_dim)
    steps.library = invariant
    assert invariant.KernelInvariant(1) == 1
    want, want_kv = prompt_in_steps(steps, [PROMPT])
    for chunks, batch, beside in [([16, 30, 24], 1, 0), ([5, 17], 64, 0), ([], 3, 0), ([40], 1, 0),
                                  ([PROMPT], 40, 25)]:
        got, got_kv = prompt_in_steps(steps, chunks, batch, beside)
        np.testing.assert_array_equal(got, want, err_msg=f"chunks {chunks}, {batch} rows a step")
        for g, w in zip(got_kv, want_kv):
            np.testing.assert_array_equal(g, w, err_msg=f"K/V, chunks {chunks}, {batch} rows a step")


def test_a_width_not_a_multiple_of_16_gives_the_same_bits(invariant):
    """Float32 weights with 200 MLP units: the down product's rows are 200 wide, 12 whole vectors of 16 and 8
    columns after them, which the many-row products (lane_gemm) and the few-row ones (dot_gemm) both sum last."""
    steps = Steps(np.random.default_rng(5), "float16", None, inter=200)
    steps.library = invariant
    invariant.KernelInvariant(1)
    want, want_kv = prompt_in_steps(steps, [PROMPT])
    for chunks, batch in [([], 1), ([16, 54], 20)]:
        got, got_kv = prompt_in_steps(steps, chunks, batch)
        np.testing.assert_array_equal(got, want, err_msg=f"chunks {chunks}, {batch} rows a step")
        for g, w in zip(got_kv, want_kv):
            np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("cache,parts", [("float16", None), ("int8", None), ("float16", GEMMA3),
                                         ("int8", dict(window=3, activation=1))])
def test_a_token_trees_rows_are_the_decode_of_their_branch(invariant, cache, parts):
    """A verify step of a tree over the sequence's first 40 tokens: a (key 40), its sibling b (key 41, a hidden)
    and b's child c (key 42): b's and c's outputs are those of b and c decoded right after the prefix (keys 40,
    41); a's is the first token's of either. With a window, a tree row's are the last of the keys it sees (c's
    window of 3: keys 39, 41 and 42, as the decoded c's 39, 40, 41)."""
    steps = Steps(np.random.default_rng(11), cache, WEIGHTS["q8_0"], features=parts)
    steps.library = invariant
    invariant.KernelInvariant(1)
    a, b, c = 40, 41, 42                     # token indices (their x rows)
    steps.reset()
    steps.run([steps.row(i) for i in range(40)])
    tree = steps.run(steps.noise(5) + [steps.row(a, position=40, key=40),
                                       steps.row(b, position=40, key=41, tree=~(1 << 1)),
                                       steps.row(c, position=41, key=42, tree=~(1 << 2))])[5:]
    steps.reset()
    steps.run([steps.row(i) for i in range(40)])
    plain = steps.run([steps.row(b, position=40, key=40), steps.row(c, position=41, key=41)])
    np.testing.assert_array_equal(tree[1:], plain)
    steps.reset()
    steps.run([steps.row(i) for i in range(40)])
    np.testing.assert_array_equal(tree[0], steps.run(steps.noise(3) + [steps.row(a, position=40, key=40)])[3])


@pytest.mark.parametrize("qtype,h", [(None, 256), (GGUF_TYPES.Q8_0, 256), (GGUF_TYPES.Q4_K, 256), (None, 200)])
def test_the_lm_head_gives_a_row_the_same_bits_alone_or_among_others(invariant, qtype, h):
    rng = np.random.default_rng(3)
    vocab = 1000
    x = rng.standard_normal((64, h)).astype(np.float32)
    w = rng.standard_normal((vocab, h)).astype(np.float32)
    raw = w if qtype is None else quantized_rows(w, qtype, rng)
    gain = (1 + 0.3 * rng.standard_normal(h)).astype(np.float32)
    cfg = [np.array([2, 0 if qtype is None else int(qtype)], np.int32), np.array([1e-5], np.float32)]
    invariant.KernelInvariant(1)

    def call(rows):
        n = len(rows)
        logits, token, logprob = np.empty((n, vocab), np.float32), np.empty(n, np.int32), np.empty(n, np.float32)
        slots = np.arange(n, dtype=np.int32)
        assert invoke(invariant.FinalLogits, logits_args(np.ascontiguousarray(x[rows]), raw, gain, slots, cfg,
                                                         logits, token, logprob)) == 0
        return logits, token, logprob

    together = call(list(range(64)))
    for rows in ([5], [5, 9], list(range(3, 20)), [63, 5]):
        alone = call(rows)
        for got, want in zip(alone, together):
            np.testing.assert_array_equal(got, want[rows], err_msg=f"rows {rows}")


@pytest.mark.parametrize("weights", list(MORE_WEIGHTS))
def test_integer_weights_give_a_sequence_the_same_bits_in_any_step_on_any_threads(invariant, weights):
    """Layers whose products all run on the integer path (every weight of integer codes, mixed types within q/k/v
    and gate/up; the blocks of 32 at a width of 9 blocks): the sequence's rows are the same bits in every step
    shape as on test_a_sequence_gives_the_same_bits_in_any_step, on 1 thread as on 2 (each output summed whole by
    one thread, in its one order)."""
    inter = 512 if weights == "q4_k_m" else 288          # (down's K: Q6_K's whole super-blocks, Q8_0's 9 blocks)
    want = None
    for threads in (2, 1):
        steps = Steps(np.random.default_rng(23), "float16", MORE_WEIGHTS[weights], threads=threads, inter=inter)
        steps.library = invariant
        assert invariant.KernelInvariant(1) == 1
        if want is None:
            want, want_kv = prompt_in_steps(steps, [PROMPT])
        for chunks, batch, beside in [([PROMPT], 1, 0), ([16, 30, 24], 1, 0), ([5, 17], 64, 0), ([], 3, 0),
                                      ([40], 2, 0), ([PROMPT], 40, 25)]:
            got, got_kv = prompt_in_steps(steps, chunks, batch, beside)
            np.testing.assert_array_equal(got, want, err_msg=f"{threads} threads, chunks {chunks}, {batch} rows")
            for g, w in zip(got_kv, want_kv):
                np.testing.assert_array_equal(g, w, err_msg=f"K/V, {threads} threads, chunks {chunks}, {batch} rows")


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_an_integer_lm_head_gives_a_row_the_same_bits_in_any_call(invariant, name):
    """Every type of integer codes (the integer path of gemm_avx2_int.h at every row count): a row's logits, token
    and log-probability are the same bits alone, beside 1 or 2 rows, among 15, 16, 17 or 64, on 1 thread or 2
    (its logits the same on both; the log-probability sums the vocabulary's chunks, whose size is the thread
    count's); where that path takes the steps that are not batch-invariant too (no AMX integer tiles), in those as
    well."""
    import ctypes

    qtype = GGUF_TYPES[name]
    rng = np.random.default_rng(int(qtype))
    h, vocab = (256 if name.endswith("_K") else 288), 700
    x = (rng.standard_normal((64, h)) * np.repeat(rng.uniform(0.1, 10, (64, h // 32)), 32, axis=1)).astype(np.float32)
    raw = quantized_rows(rng.standard_normal((vocab, h)).astype(np.float32), qtype, rng)
    gain = (1 + 0.3 * rng.standard_normal(h)).astype(np.float32)
    invariant.KernelInt.argtypes = [ctypes.c_int]
    paths = invariant.KernelInt(-1)
    if not paths & 2:
        pytest.skip("needs gemm_avx2_int.h's integer path (AVX2, FMA, F16C)")

    def call(rows, threads):
        n = len(rows)
        out = np.empty((n, vocab), np.float32), np.empty(n, np.int32), np.empty(n, np.float32)
        cfg = [np.array([threads, int(qtype)], np.int32), np.array([1e-5], np.float32)]
        assert invoke(invariant.FinalLogits, logits_args(np.ascontiguousarray(x[rows]), raw, gain,
                                                         np.arange(n, dtype=np.int32), cfg, *out)) == 0
        return out

    for mode in (1, 0) if not paths & 1 else (1,):
        invariant.KernelInvariant(mode)
        logits = None
        for threads in (1, 2):
            together = call(list(range(64)), threads)
            if logits is not None:
                np.testing.assert_array_equal(together[0], logits, err_msg=f"mode {mode}: logits on 1 and 2 threads")
            logits = together[0]
            for n in (1, 2, 3, 15, 16, 17, 64):
                rows = list(rng.permutation(64)[:n])
                for got, want in zip(call(rows, threads), together):
                    np.testing.assert_array_equal(got, want[rows], err_msg=f"mode {mode}, {threads} threads, {n} rows")


def test_without_invariance_the_paths_differ(invariant):
    """The test above is not vacuous: with KernelInvariant(0) a prompt's chunk of 70 rows (the batched products, or
    on the integer path the attention's tiles) and its decode one row at a time give other bits. (On the integer
    path a last-bit difference in a product's input can round it to the neighbouring 16-bit value: up to ~1e-4 of
    the layer's largest output, as test_layer_kernel.assert_layer_close allows.)"""
    steps = Steps(np.random.default_rng(7), "float32", WEIGHTS["q8_0"])
    steps.library = invariant
    invariant.KernelInvariant(0)
    chunk, _ = prompt_in_steps(steps, [PROMPT])
    decoded, _ = prompt_in_steps(steps, [], 1)
    assert not np.array_equal(chunk, decoded)
    rounded = integer_path(invariant, 1, [int(GGUF_TYPES.Q8_0)]) != 0
    np.testing.assert_allclose(chunk, decoded, rtol=1e-3, atol=1e-3 + (1e-4 * np.abs(chunk).max() if rounded else 0))


def test_a_calls_own_setting_decides_over_the_process_setting(invariant):
    """The runner says in every call's iconfig whether it is batch-invariant (runners in one process keep their
    own): with the entry 1 the kernel is invariant under KernelInvariant(0), with 0 it is not under
    KernelInvariant(1); FinalLogits likewise."""
    steps = Steps(np.random.default_rng(7), "float16", WEIGHTS["q8_0"])
    steps.library = invariant
    invariant.KernelInvariant(1)
    want, _ = prompt_in_steps(steps, [PROMPT])
    invariant.KernelInvariant(0)
    steps.call_invariant = 1
    for chunks in ([PROMPT], []):
        np.testing.assert_array_equal(prompt_in_steps(steps, chunks)[0], want)
    invariant.KernelInvariant(1)
    steps.call_invariant = 0
    assert not np.array_equal(prompt_in_steps(steps, [PROMPT])[0], prompt_in_steps(steps, [])[0])

    rng = np.random.default_rng(3)
    vocab, h = 1000, 256
    x = rng.standard_normal((64, h)).astype(np.float32)
    w = rng.standard_normal((vocab, h)).astype(np.float32)
    gain = np.ones(h, np.float32)

    def logits(rows, entry):
        n = len(rows)
        out = np.empty((n, vocab), np.float32), np.empty(n, np.int32), np.empty(n, np.float32)
        cfg = [np.array([2, 0] + entry, np.int32), np.array([1e-5], np.float32)]
        assert invoke(invariant.FinalLogits, logits_args(np.ascontiguousarray(x[rows]), w, gain,
                                                         np.arange(n, dtype=np.int32), cfg, *out)) == 0
        return out[0]

    invariant.KernelInvariant(1)
    together = logits(list(range(64)), [])
    invariant.KernelInvariant(0)
    np.testing.assert_array_equal(logits([5], [1]), together[[5]])
    # without the entry the process setting rules: 64 rows take the fast path's order of sums (a lone row's may
    # happen to be the invariant one's on some CPUs: Zen 4's AVX-512 without AMX)
    assert not np.array_equal(logits(list(range(64)), []), together)
