"""Weights repacked at load (kernels/gemm_avx2_int.h's row-interleaved layout, through the library's RepackRows):
the same bytes in another order, and products of the repacked rows are the stored rows' products to the bit, at
every row count of x (one row, a few, the prefill tiles), so batch invariance holds whichever layout a matrix has.
The library built here is the agents' (-march=native, or $LLM_SERVING_KERNEL_MARCH)."""
from __future__ import annotations

import ctypes
import os
import shutil

import numpy as np
import pytest

from llm_serving.models.kernels import build_kernel
from tests.unit.test_layer_kernel import random_k_blocks

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and not os.environ.get("CXX"),
                                reason="no C++ compiler on this machine (the runner runs layers op by op)")

Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 8, 12, 13, 14
TYPES = {"Q4_K": Q4_K, "Q6_K": Q6_K, "Q8_0": Q8_0, "Q4_0": Q4_0, "Q4_1": Q4_1}


def stored_rows(qtype: int, n: int, k: int, rng) -> np.ndarray:
    """(n, row bytes) of valid stored rows: random K-quant super-blocks, or gguf's quantization of random rows."""
    from tests.unit.test_layer_kernel import quantized_rows
    if qtype in (Q4_K, Q6_K):
        return random_k_blocks(n, k, _gguf_type(qtype), rng)
    return np.ascontiguousarray(quantized_rows(rng.standard_normal((n, k)).astype(np.float32), _gguf_type(qtype), rng))


def with_product_calls(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` with the argument types of the calls these tests make (RepackRows, IntegerProduct, KernelInt)."""
    u8, f32 = np.ctypeslib.ndpointer(np.uint8, flags="C"), np.ctypeslib.ndpointer(np.float32, flags="C")
    lib.RepackRows.argtypes = [ctypes.c_int32, u8, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int32]
    lib.RepackRows.restype = ctypes.c_int32
    lib.IntegerProduct.argtypes = [ctypes.c_int32, u8, ctypes.c_int64, ctypes.c_int64, f32, ctypes.c_int64, f32]
    lib.KernelInt.argtypes = [ctypes.c_int]
    return lib


@pytest.fixture(scope="module")
def library():
    return with_product_calls(ctypes.CDLL(build_kernel("decoder_layer_cpu", "DecoderLayer").rsplit(":", 1)[0]))


@pytest.fixture
def repacks(library):
    """Skips where this build keeps Q4_K as stored (no AVX2 integer products, or AMX's integer tiles read it)."""
    probe = np.zeros((8, 144), np.uint8)
    if library.RepackRows(Q4_K, probe, 8, 144, None, 1) == 0:
        pytest.skip("this CPU's build reads Q4_K as stored (no AVX2 integer path, or AMX's integer tiles)")


def repack(library, rows: np.ndarray, qtype: int = Q4_K) -> tuple:
    out = np.empty_like(rows)
    code = library.RepackRows(qtype, rows, rows.shape[0], rows.shape[1], out.ctypes.data, 1)
    return code, out


def product(library, code: int, rows: np.ndarray, k: int, x: np.ndarray) -> np.ndarray:
    out = np.zeros((x.shape[0], rows.shape[0]), np.float32)
    assert library.IntegerProduct(code, rows, rows.shape[0], k, np.ascontiguousarray(x), x.shape[0], out) == 0
    return out


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 17, 64])
@pytest.mark.parametrize("n,k", [(16, 256), (40, 512), (56, 256), (8, 2048)])
@pytest.mark.parametrize("qtype", list(TYPES.values()), ids=list(TYPES))
def test_repacked_products_equal_the_stored_rows_products_to_the_bit(library, repacks, qtype, m, n, k):
    rng = np.random.default_rng(1000 * m + n)
    rows = stored_rows(qtype, n, k, rng)
    code, packed = repack(library, rows, qtype)
    assert code == qtype + 100
    assert packed.nbytes == rows.nbytes and not np.array_equal(packed, rows)
    x = rng.standard_normal((m, k), dtype=np.float32)
    want = product(library, qtype, rows, k, x)
    got = product(library, code, packed, k, x)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), np.abs(got - want).max()


@pytest.mark.parametrize("m", [1, 2, 7])
@pytest.mark.parametrize("qtype", [Q4_K, Q4_0, Q4_1], ids=["Q4_K", "Q4_0", "Q4_1"])
def test_the_largest_sums_are_exact(library, repacks, qtype, m):
    """Every code 15 and every x the same: each block's integer sums at their largest. One row of x takes the
    4-bit codes in place, pair 2's times 256, a block's sums kept in int32 before they are shifted back: they must
    not overflow there. w is 15 d (Q4_K: sub-block scales 63, minimums 0), 7 d (Q4_0) or 15 d + m (Q4_1)."""
    n, k = 16, 2048
    half = lambda v: np.frombuffer(np.float16(v).tobytes(), np.uint8)        # noqa: E731
    if qtype == Q4_K:
        block = np.concatenate([half(1.0), half(0.0), np.full(12, 0xFF, np.uint8), np.full(128, 0xFF, np.uint8)])
        weight = 63 * 15 * 1.0
    elif qtype == Q4_0:
        block, weight = np.concatenate([half(0.5), np.full(16, 0xFF, np.uint8)]), 7 * 0.5
    else:
        block, weight = np.concatenate([half(0.5), half(0.25), np.full(16, 0xFF, np.uint8)]), 15 * 0.5 + 0.25
    rows = np.ascontiguousarray(np.tile(block, (n, k * block.size // (256 if qtype == Q4_K else 32) // block.size)))
    code, packed = repack(library, rows, qtype)
    x = np.full((m, k), 3.0, np.float32)
    want = product(library, qtype, rows, k, x)
    got = product(library, code, packed, k, x)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    np.testing.assert_allclose(got, np.full((m, n), weight * 3.0 * k), rtol=1e-6)


def test_repacking_keeps_every_byte(library, repacks):
    """A permutation of the stored bytes' information: the same multiset of code nibbles, each row's f16 scales
    as stored."""
    rng = np.random.default_rng(7)
    k, n = 512, 16
    rows = random_k_blocks(n, k, _gguf_type(Q4_K), rng)
    rows[:, 4:16] = rng.integers(0, 256, (n, 12))            # every 6-bit scale and min pattern, not a few
    _, packed = repack(library, rows)
    stored = rows.reshape(n // 8, 8, k // 256, 144)
    panels = packed.reshape(n // 8, k // 256, 1152)
    d = stored[..., 0:2].transpose(0, 2, 1, 3).reshape(n // 8, k // 256, 16)
    assert np.array_equal(panels[..., 0:16], d)
    nibbles = lambda b: np.sort(np.concatenate([b & 15, b >> 4], axis=-1), axis=-1)     # noqa: E731
    codes_stored = stored[..., 16:].transpose(0, 2, 1, 3).reshape(n // 8, k // 256, 1024)
    assert np.array_equal(nibbles(panels[..., 128:]), nibbles(codes_stored))


def test_what_is_not_repacked(library, repacks):
    rng = np.random.default_rng(3)
    rows = random_k_blocks(12, 256, _gguf_type(Q4_K), rng)
    assert library.RepackRows(Q4_K, rows, 12, 144, None, 1) == 0          # rows not a multiple of 8
    assert library.RepackRows(Q4_K, rows[:8], 8, 100, None, 1) == 0       # not whole super-blocks
    assert library.RepackRows(Q5_K, np.zeros((8, 176), np.uint8), 8, 176, None, 1) == 0    # Q5_K: stored
    assert library.RepackRows(Q6_K, np.zeros((8, 210), np.uint8), 8, 210, None, 1) == Q6_K + 100
    assert library.RepackRows(Q4_1, np.zeros((8, 180), np.uint8), 8, 180, None, 1) == 0   # 9 blocks: a short group
    assert library.RepackRows(Q4_1, np.zeros((8, 320), np.uint8), 8, 320, None, 1) == Q4_1 + 100
    before = library.KernelInt(-1)
    try:
        library.KernelInt(0)                                              # the float paths would read it
        assert library.RepackRows(Q4_K, rows[:8], 8, 144, None, 1) == 0
    finally:
        library.KernelInt(1 if before else 0)


def test_the_weight_types_table_agrees_with_gguf_the_loader_and_the_repacker(library, repacks):
    """The library's table of weight types (weight_types.h, exported by WeightTypes()) has gguf's block sizes, names
    by their codes the types the loader keeps as stored (every one but F32: gguf.KEPT_QUANTIZED), and as repackable
    exactly the types RepackRows repacks, into the codes it gives."""
    import gguf
    from llm_serving.models.kernels.repack import weight_types
    from llm_serving.models.weights.gguf import KEPT_QUANTIZED
    table = weight_types(library._name)
    assert {name: t.code for name, t in table.items() if name != "F32"} == KEPT_QUANTIZED
    for name, t in table.items():
        assert t.code == gguf.GGMLQuantizationType[name].value, name
        assert (t.block, t.bytes) == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]], name
        row_bytes = 256 // t.block * t.bytes                       # one group of the panels
        probe = np.zeros((8, row_bytes), np.uint8)
        assert library.RepackRows(t.code, probe, 8, row_bytes, None, 1) == t.repacked, name


def test_a_model_whose_steps_are_not_invariant_keeps_its_rows_where_amx_integer_tiles_read_them(library, repacks):
    """RepackRows' last argument, whether the model's steps are batch-invariant: AMX's integer tiles (where this
    process has them: KernelInt's bit 1) read the stored rows of steps that are not, and take no invariant step,
    so a build with them keeps the rows of a model whose steps are not invariant and repacks those of one whose
    steps are; elsewhere the panels serve both."""
    probe = np.zeros((8, 144), np.uint8)
    amx_tiles = library.KernelInt(-1) & 1
    assert library.RepackRows(Q4_K, probe, 8, 144, None, 1) == Q4_K + 100
    assert library.RepackRows(Q4_K, probe, 8, 144, None, 0) == (0 if amx_tiles else Q4_K + 100)
    from llm_serving.models.kernels.repack import repacked_types
    assert "Q4_K" in repacked_types(library._name, invariant=True)
    assert ("Q4_K" in repacked_types(library._name, invariant=False)) != bool(amx_tiles)


def _gguf_type(code: int):
    import gguf
    return gguf.GGMLQuantizationType(code)


def test_a_layer_on_repacked_rows_gives_the_stored_rows_bits_in_any_step(library, repacks):
    """llama.cpp's Q4_K_M mix in a whole DecoderLayer (q/k/o/gate/up Q4_K, v and down Q6_K: q/k/v mix types in one
    product), batch-invariant steps: with the matrices repacked (types 112 and 114 in the iconfig), a sequence's
    rows and K/V are the stored rows' bits, whole prompt, chunked, decoded alone or among
    others, on 2 threads and 1."""
    from tests.unit.test_batch_invariance import MORE_WEIGHTS, Steps, prompt_in_steps, PROMPT

    library.KernelInvariant.argtypes = [ctypes.c_int]
    before = library.KernelInvariant(1)
    try:
        for threads in (2, 1):
            steps = Steps(np.random.default_rng(23), "float16", MORE_WEIGHTS["q4_k_m"], threads=threads, inter=512)
            steps.library = library
            want, want_kv = prompt_in_steps(steps, [PROMPT])
            for name, (rows, qtype) in list(steps.layer.kernel_weights.items()):
                if qtype in (Q4_K, Q6_K):
                    code, packed = repack(library, rows, qtype)
                    steps.layer.kernel_weights[name] = (packed, code)
            assert sorted(t for _, t in steps.layer.kernel_weights.values()) == [112] * 5 + [114] * 2
            for chunks, batch, beside in [([PROMPT], 1, 0), ([16, 30, 24], 1, 0), ([5, 17], 64, 0), ([], 3, 0),
                                          ([40], 2, 0), ([PROMPT], 40, 25)]:
                steps.reset()
                got, got_kv = prompt_in_steps(steps, chunks, batch, beside)
                np.testing.assert_array_equal(got, want, err_msg=f"{threads} threads, chunks {chunks}, {batch} rows")
                for g, w in zip(got_kv, want_kv):
                    np.testing.assert_array_equal(g, w, err_msg=f"K/V, chunks {chunks}, {batch} rows")
    finally:
        library.KernelInvariant(before)


@pytest.mark.parametrize("qtype", [Q4_K, Q6_K], ids=["Q4_K", "Q6_K"])
def test_repacked_experts_give_the_stored_experts_bits(library, repacks, qtype):
    """MoeMlp on experts' stacks repacked whole (each expert's rows whole panels: MoeMlp reads an expert from its
    first row): the stored stacks' bits, for 1, 3 and 9 rows."""
    from tests.unit.test_moe_kernel import Block

    rng = np.random.default_rng(qtype)
    block = Block(rng, hidden=256, inter=256, experts=6, used=2, qtype=_gguf_type(qtype))
    x = rng.standard_normal((9, block.h)).astype(np.float32)
    want = [block.call(library, x[:m]) for m in (1, 3, 9)]
    for name, rows in list(block.stored.items()):
        code, block.stored[name] = repack(library, rows, qtype)
        assert code == qtype + 100
    block.qtype = qtype + 100
    for m, w in zip((1, 3, 9), want):
        assert np.array_equal(block.call(library, x[:m]), w), m


def test_a_repacked_lm_head_gives_the_stored_rows_logits_token_and_logprob(library, repacks):
    """FinalLogits on a Q6_K lm_head (a Q4_K_M file's) of 696 rows (87 panels: the last tile of 16 rows half one)
    repacked: the stored rows' logits, tokens and log-probabilities to the bit, for 1, 2, 5 and 40 rows."""
    from llm_serving.models.kernels.aot_call import invoke
    from tests.unit.test_layer_kernel import logits_args

    rng = np.random.default_rng(9)
    h, vocab = 512, 696
    raw = random_k_blocks(vocab, h, _gguf_type(Q6_K), rng)
    code, packed = repack(library, raw, Q6_K)
    gain = (1 + 0.3 * rng.standard_normal(h)).astype(np.float32)
    x = rng.standard_normal((40, h)).astype(np.float32)

    def call(rows, qtype, m):
        out = np.empty((m, vocab), np.float32), np.empty(m, np.int32), np.empty(m, np.float32)
        cfg = [np.array([2, qtype], np.int32), np.array([1e-5], np.float32)]
        assert invoke(library.FinalLogits, logits_args(np.ascontiguousarray(x[:m]), rows, gain,
                                                       np.arange(m, dtype=np.int32), cfg, *out)) == 0
        return out

    for m in (1, 2, 5, 40):
        for got, want in zip(call(packed, code, m), call(raw, Q6_K, m)):
            np.testing.assert_array_equal(got, want, err_msg=f"{m} rows")


@pytest.mark.parametrize("qtype", list(TYPES.values()), ids=list(TYPES))
def test_a_tied_tables_repacked_rows_embed_as_the_stored_rows(library, repacks, qtype):
    """A tied embedding whose table is the lm_head's repacked panels (llama.py repacks it once for both):
    EmbedTokens reads each token's stored bytes back from the panels, so the embedding is the stored rows' to the
    bit, for tokens in every lane of a panel, repeated and out of order."""
    from llm_serving.models.kernels.aot_call import invoke

    rng = np.random.default_rng(qtype + 40)
    vocab, h = 48, 512
    raw = stored_rows(qtype, vocab, h, rng)
    code, packed = repack(library, raw, qtype)
    assert code == qtype + 100
    ids = np.array([0, 7, 8, 47, 13, 13, 40, 1, 46, 25], np.int32)

    def embed(table, table_type):
        out = np.empty((len(ids), h), np.float32)
        args = [ids, np.ascontiguousarray(table), np.array([table_type], np.int32), out]
        assert invoke(library.EmbedTokens, args) == 0
        return out

    want = embed(raw, qtype)
    assert np.isfinite(want).all() and np.abs(want).max() > 0
    np.testing.assert_array_equal(embed(packed, code).view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qtype", [Q4_K, Q6_K, Q4_1], ids=["Q4_K", "Q6_K", "Q4_1"])
def test_repack_rows_on_threads_gives_one_calls_bytes(library, repacks, qtype, monkeypatch):
    """kernels/repack.repack_rows splits a matrix into spans of whole panels, one per thread: the bytes of one call
    on the whole matrix, whatever the spans' count and their bounds (a span's rows not a multiple of the threads')."""
    from llm_serving.models.kernels import repack as repack_module

    rng = np.random.default_rng(11)
    rows = stored_rows(qtype, 8 * 37, 512, rng)                 # 37 panels: spans of unequal size
    path = build_kernel("decoder_layer_cpu", "DecoderLayer").rsplit(":", 1)[0]
    code, whole = repack(library, rows, qtype)
    monkeypatch.setattr(repack_module, "_SPAN_BYTES", 1)       # every matrix split, as a model's are
    for workers in (2, 3, 5):
        monkeypatch.setattr(repack_module, "_workers", lambda n=workers: n)
        assert len(repack_module._spans(rows.shape[0], rows.shape[1])) == workers
        got, got_code = repack_module.repack_rows(path, rows, qtype)
        assert got_code == code and np.array_equal(got, whole)


def test_a_library_of_the_models_types_reads_those_alone_to_the_same_bits(library, repacks):
    """The layer kernel built for a model's stored types (ModelRunner: weights.stored_types) links their integer
    products only: Q4_1's products (stored and repacked) and repacking are the full library's to the bit, and a
    type it was not built for is refused (IntegerProduct's 2, RepackRows' 0: the kernel routes it elsewhere)."""
    path = build_kernel("decoder_layer_cpu", "DecoderLayer", types={"Q4_1", "F32"}).rsplit(":", 1)[0]
    assert path.endswith("-q4_1.so") and path != library._name
    lean = with_product_calls(ctypes.CDLL(path))
    rng = np.random.default_rng(5)
    n, k = 16, 512
    rows = stored_rows(Q4_1, n, k, rng)
    x = rng.standard_normal((3, k), dtype=np.float32)
    (code, packed), (full_code, full_packed) = repack(lean, rows, Q4_1), repack(library, rows, Q4_1)
    assert code == full_code == Q4_1 + 100 and np.array_equal(packed, full_packed)
    for c, r in ((Q4_1, rows), (code, packed)):
        assert np.array_equal(product(lean, c, r, k, x).view(np.uint32), product(library, c, r, k, x).view(np.uint32))
    q4k = stored_rows(Q4_K, n, k, rng)
    assert repack(lean, q4k, Q4_K)[0] == 0
    out = np.zeros((3, n), np.float32)
    assert lean.IntegerProduct(Q4_K, q4k, n, k, x, 3, out) == 2


def test_matrices_repacked_after_the_load_reach_their_use_with_one_calls_bytes_and_are_kept(library, repacks,
                                                                                           tmp_path):
    """kernels/repack.py's LaterRepacks: the rows a load serves as stored (Repacker.kept_or_stored: no panels kept)
    are repacked by its threads, each copy handed to its use by `apply` only (the thread that runs the steps), the
    library's bytes and type; the copies of the file's own rows are written to the PanelStore, so that the next
    load's kept_or_stored serves those panels at once and leaves nothing for later."""
    from llm_serving.models.kernels.panel_store import PanelStore
    from llm_serving.models.kernels.repack import LaterRepacks, Repacker

    rng = np.random.default_rng(17)
    parts = [(stored_rows(Q4_K, 64, 512, rng), Q4_K), (stored_rows(Q6_K, 32, 256, rng), Q6_K),
             (stored_rows(Q4_1, 24, 256, rng), Q4_1)]
    model = tmp_path / "model.gguf"
    model.write_bytes(b"".join(rows.tobytes() for rows, _ in parts))
    offsets = np.cumsum([0] + [rows.nbytes for rows, _ in parts])
    mapped = [(np.memmap(model, np.uint8, "r", int(at), rows.shape), qtype)
              for at, (rows, qtype) in zip(offsets, parts)]
    path = build_kernel("decoder_layer_cpu", "DecoderLayer").rsplit(":", 1)[0]
    store = PanelStore.open(str(model), path, tmp_path / "cache")
    later = LaterRepacks(path, store)
    repacker = Repacker(path, store, later)
    got = {}
    for i, (rows, qtype) in enumerate(mapped):
        served, code, to = repacker.kept_or_stored(rows, qtype)
        assert served is rows and code == qtype and to == repack(library, np.array(rows), qtype)[0] != 0
        later.add(rows, qtype, to, lambda panels, code, i=i: got.__setitem__(i, (panels, code)))
    assert later.pending and later.bytes == sum(rows.nbytes for rows, _ in parts)
    later.start()
    assert later.wait(60) and later.error is None and later.ready == len(parts)
    assert got == {}                            # (handed over by apply only)
    assert later.apply() == len(parts) and not later.pending and later.apply() == 0
    for i, (rows, qtype) in enumerate(mapped):
        code, want = repack(library, np.array(rows), qtype)
        assert got[i][1] == code and np.array_equal(got[i][0], want)
    assert len(list(store.folder.glob("*.npy"))) == len(parts)

    again = Repacker(path, PanelStore.open(str(model), path, tmp_path / "cache"), LaterRepacks(path))
    for i, (rows, qtype) in enumerate(mapped):
        served, code, to = again.kept_or_stored(rows, qtype)
        assert to == 0 and code == got[i][1] and isinstance(served, np.memmap) and np.array_equal(served, got[i][0])


def test_matrices_left_for_later_are_dropped_when_closed(library, repacks):
    """LaterRepacks.close: the threads stop after the matrix each is on, nothing is handed over and nothing is
    pending any more (the stored rows serve on)."""
    from llm_serving.models.kernels.repack import LaterRepacks

    path = build_kernel("decoder_layer_cpu", "DecoderLayer").rsplit(":", 1)[0]
    rows = stored_rows(Q4_K, 64, 512, np.random.default_rng(2))
    later = LaterRepacks(path)
    used = []
    for _ in range(50):
        later.add(rows, Q4_K, Q4_K + 100, lambda panels, code: used.append(code))
    later.close()
    later.start()
    assert later.wait(30) and not later.pending
    assert later.apply() == 0 and used == []
