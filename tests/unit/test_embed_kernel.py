"""EmbedTokens (kernels/decoder_layer_cpu.cc): the embedding's rows read from the table as the GGUF stores it,
called through ctypes as MindSpore's AOT Custom op calls it, against gguf's own dequantization. No MindSpore."""
from __future__ import annotations

import ctypes
import os
import shutil

import numpy as np
import pytest

from llm_serving.models.kernels import build_kernel
from llm_serving.models.kernels.signatures import EMBED_TOKENS, check_library

from llm_serving.models.kernels.aot_call import invoke

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(shutil.which("g++") is None and not os.environ.get("CXX"),
                                reason="no C++ compiler on this machine (the embedding is a float32 gather)")


@pytest.fixture(scope="module")
def library():
    path = build_kernel("decoder_layer_cpu", "DecoderLayer").rsplit(":", 1)[0]       # the agents' (cached) build
    check_library(path, (EMBED_TOKENS,))
    return ctypes.CDLL(path)


def embed(library, ids, table, qtype, hidden):
    out = np.full((len(ids), hidden), np.nan, np.float32)
    args = [*EMBED_TOKENS.args(ids=np.asarray(ids, np.int32), table=table,
                               iconfig=np.array([int(qtype)], np.int32)), out]
    return invoke(library.EmbedTokens, args), out


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_rows_equal_gguf_dequantized_rows(library, qtype):
    rng = np.random.default_rng(int(qtype))
    vocab, hidden = 50, 96
    w = rng.standard_normal((vocab, hidden)).astype(np.float32)
    table = w if qtype == Q.F32 else gguf.quants.quantize(w, qtype).view(np.uint8)
    want = w if qtype == Q.F32 else gguf.quants.dequantize(table, qtype).reshape(vocab, hidden)
    ids = [0, 7, 49, 7, 3]                                  # repeats and both ends of the vocabulary
    code, out = embed(library, ids, table, qtype, hidden)
    assert code == 0
    np.testing.assert_array_equal(out, want[ids])


def test_refusals(library):
    rng = np.random.default_rng(1)
    table = gguf.quants.quantize(rng.standard_normal((10, 64)).astype(np.float32), Q.Q8_0).view(np.uint8)
    assert embed(library, [10], table, Q.Q8_0, 64)[0] == 3            # an id past the vocabulary
    assert embed(library, [-1], table, Q.Q8_0, 64)[0] == 3
    assert embed(library, [1], table, Q.Q4_0, 64)[0] == 2             # Q8_0's rows called Q4_0: wrong row bytes
    assert embed(library, [1], table, Q.Q8_0, 96)[0] == 2             # rows of 64 weights, 96 asked for
