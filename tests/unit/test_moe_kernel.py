"""The mixture-of-experts MLP kernel (kernels/decoder_layer_cpu.cc's MoeMlp), called through ctypes as MindSpore's
AOT Custom op calls it, against a float64 numpy MoE block: the router's top-k and weights (renormalized or not,
ties to the lower expert), each chosen expert's gated MLP, float32 and block-quantized experts; a row's output the
same bits alone and among other rows; the experts no row chose never read; padding rows; the refusals. No
MindSpore needed."""
from __future__ import annotations

import ctypes
import os
import shutil

import numpy as np
import pytest

from llm_serving.models.kernels import build_kernel
from llm_serving.models.kernels.aot_call import invoke
from llm_serving.models.kernels.signatures import MOE_MLP, check_library

from .test_layer_kernel import quantized_rows, rounded

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and not os.environ.get("CXX"),
                                reason="no C++ compiler on this machine (the runner runs layers op by op)")

EPS = 1e-6


@pytest.fixture(scope="module")
def library_path():
    return build_kernel("decoder_layer_cpu", "MoeMlp").rsplit(":", 1)[0]


@pytest.fixture(scope="module")
def library(library_path):
    return ctypes.CDLL(library_path)


def test_library_exports_the_declared_parameter_list(library_path):
    check_library(library_path, (MOE_MLP,))


class Block:
    """A random MoE block: E experts of I units on H, K used per row; weights float32 or a GGUF type's rows."""

    def __init__(self, rng, *, hidden=64, inter=32, experts=8, used=2, renormalize=True, qtype=None, oai=False):
        self.h, self.i, self.e, self.k, self.renormalize = hidden, inter, experts, used, renormalize
        # gpt-oss's experts: biases, and the clamped SwiGLU (alpha, limit)
        self.oai, self.alpha, self.limit = oai, 1.702, 1.5
        scale = 0.3 if oai else 0.0
        self.gate_bias = (rng.standard_normal(experts * inter) * scale).astype(np.float32)
        self.up_bias = (rng.standard_normal(experts * inter) * scale).astype(np.float32)
        self.down_bias = (rng.standard_normal(experts * hidden) * scale).astype(np.float32)
        self.router = (rng.standard_normal((experts, hidden)) * 0.5).astype(np.float32)
        self.router_bias = np.zeros(experts, np.float32)
        self.gate = (rng.standard_normal((experts * inter, hidden)) * 0.2).astype(np.float32)
        self.up = (rng.standard_normal((experts * inter, hidden)) * 0.2).astype(np.float32)
        self.down = (rng.standard_normal((experts * hidden, inter)) * 0.2).astype(np.float32)
        self.gain = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
        self.qtype = qtype
        self.stored = {}
        if qtype is not None:
            from gguf.quants import dequantize

            for name in ("gate", "up", "down"):
                rows = quantized_rows(getattr(self, name), qtype, rng)
                self.stored[name] = rows
                setattr(self, name, np.asarray(dequantize(rows, qtype), np.float32).reshape(getattr(self, name).shape))

    def weight(self, name):
        return self.stored.get(name, getattr(self, name))

    def call(self, library, x, slots=None, threads=2):
        x = np.ascontiguousarray(x, np.float32)
        slots = np.arange(len(x), dtype=np.int32) if slots is None else np.asarray(slots, np.int32)
        code = 0 if self.qtype is None else int(self.qtype)
        icfg = np.array([threads, self.k, code, code, code, int(self.renormalize), int(self.oai)], np.int32)
        out = np.full_like(x, np.nan)
        args = MOE_MLP.args(x=x, slots=slots, router=self.router, router_bias=self.router_bias,
                            gate_w=self.weight("gate"), up_w=self.weight("up"), down_w=self.weight("down"),
                            gate_bias=self.gate_bias, up_bias=self.up_bias, down_bias=self.down_bias,
                            post_gain=self.gain, iconfig=icfg,
                            fconfig=np.array([EPS, self.alpha, self.limit], np.float32))
        assert invoke(library.MoeMlp, [*args, out]) == 0
        return out

    def route(self, xn):
        """(chosen experts, weights) of one normalized row: the K largest logits, ties to the lower index."""
        # (an expert at a time: equal router rows give equal logits, which a matrix product's blocking may not)
        logits = np.array([self.router[e].astype(np.float64) @ xn for e in range(self.e)]) + self.router_bias
        chosen = sorted(range(self.e), key=lambda e: (-logits[e], e))[:self.k]
        p = np.exp(logits - logits.max())
        w = p[chosen] / (p[chosen].sum() if self.renormalize else p.sum())
        return chosen, w

    def reference(self, x, block: int = 0):
        """float64 out = x + sum_k w_k down_k(silu(gate_k(xn)) up_k(xn)); the products' inputs rounded as the
        integer path rounds them (block 32) for quantized experts."""
        out = []
        for row in np.asarray(x, np.float64):
            xn = row / np.sqrt(np.mean(row * row) + EPS) * self.gain
            y = row.copy()
            for e, w in zip(*self.route(xn)):
                units, outs = slice(e * self.i, (e + 1) * self.i), slice(e * self.h, (e + 1) * self.h)
                g = self.gate[units].astype(np.float64) @ rounded(xn[None], block)[0] + self.gate_bias[units]
                u = self.up[units].astype(np.float64) @ rounded(xn[None], block)[0] + self.up_bias[units]
                if self.oai:
                    g, u = np.minimum(g, self.limit), np.clip(u, -self.limit, self.limit)
                    a = g / (1 + np.exp(-self.alpha * g)) * (u + 1)
                else:
                    a = g / (1 + np.exp(-g)) * u
                y += w * (self.down[outs].astype(np.float64) @ rounded(a[None], block)[0] + self.down_bias[outs])
            out.append(y)
        return np.array(out)


def assert_close(got, want, rel=1e-4):
    scale = np.abs(want).max(axis=1, keepdims=True)
    assert np.abs(got - want).max() <= rel * scale.max(), np.abs(got - want).max() / scale.max()


@pytest.mark.parametrize("rows", [1, 3, 17, 40])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
def test_float_experts_match_numpy(library, rows, renormalize, threads):
    rng = np.random.default_rng(rows * 10 + threads)
    block = Block(rng, renormalize=renormalize)
    x = rng.standard_normal((rows, block.h)).astype(np.float32)
    assert_close(block.call(library, x, threads=threads), block.reference(x))


@pytest.mark.parametrize("rows", [1, 5, 23])
def test_gpt_oss_experts_biases_and_clamped_swiglu_match_numpy(library, rows):
    """Biases on the router and on every expert product, top-k then a softmax over the chosen logits, and the clamped
    SwiGLU (a limit of 1.5, so that gate and up values are clamped on both sides)."""
    rng = np.random.default_rng(40 + rows)
    block = Block(rng, experts=8, used=4, oai=True)
    block.router_bias[:] = rng.standard_normal(block.e).astype(np.float32)
    x = (rng.standard_normal((rows, block.h)) * 2).astype(np.float32)
    got = block.call(library, x)
    assert_close(got, block.reference(x))
    g = block.gate[:block.i] @ x[0]
    assert (g > block.limit).any() and (g < -block.limit).any()            # clamping matters here


@pytest.mark.parametrize("qtype_name", ["Q8_0", "Q4_0", "Q4_K", "Q6_K", "MXFP4"])
@pytest.mark.parametrize("rows", [1, 2, 9])
def test_quantized_experts_match_numpy(library, qtype_name, rows):
    """The experts as a GGUF stores them (K-quants: a row of 256); the products' inputs rounded to 16 bits per block
    of 32 where the integer path runs them."""
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]
    rng = np.random.default_rng(rows)
    super_blocks = qtype_name.endswith("_K")
    block = Block(rng, hidden=256 if super_blocks else 64, inter=256 if super_blocks else 32, qtype=qtype)
    x = rng.standard_normal((rows, block.h)).astype(np.float32)
    library.KernelInt.argtypes = [ctypes.c_int]
    rounding = 32 if library.KernelInt(-1) & 2 else 0            # gemm_avx2_int.h in this library
    assert_close(block.call(library, x), block.reference(x, rounding), rel=2e-4)


@pytest.mark.parametrize("qtype_name", [None, "Q4_K"])
def test_a_rows_output_is_the_same_bits_alone_and_among_other_rows(library, qtype_name):
    """Batch invariance: the row's experts see 1 row or many, the units split differently over the threads."""
    import gguf

    qtype = None if qtype_name is None else gguf.GGMLQuantizationType[qtype_name]
    rng = np.random.default_rng(5)
    block = Block(rng, hidden=256, inter=256, experts=6, used=2, qtype=qtype)
    x = rng.standard_normal((37, block.h)).astype(np.float32)
    together = block.call(library, x)
    for row in (0, 11, 36):
        alone = block.call(library, x[row:row + 1])
        assert np.array_equal(alone[0], together[row]), row
    assert np.array_equal(block.call(library, x[::-1].copy(), threads=1)[::-1], together)


def test_experts_no_row_chose_are_never_read(library):
    """Experts 4..7's router rows lose to every other expert's (a bias of -1e4): their weights are NaN, which any
    product that touched them (even weighted by 0) would carry into the output."""
    rng = np.random.default_rng(3)
    block = Block(rng, experts=8, used=3)
    x = rng.standard_normal((12, block.h)).astype(np.float32)
    block.router_bias[4:] = -1e4
    want = block.reference(x)
    for name, per in (("gate", block.i), ("up", block.i), ("down", block.h)):
        getattr(block, name)[4 * per:] = np.nan
    got = block.call(library, x)
    assert np.isfinite(got).all()
    assert_close(got, want)


def test_a_router_tie_goes_to_the_lower_expert(library):
    """Experts 2 and 5 have the same router row (the same logit for every row) and different MLPs: with K=1 every row
    that picks one of them picks expert 2."""
    rng = np.random.default_rng(9)
    block = Block(rng, experts=6, used=1)
    block.router[:] = -1.0 * np.abs(block.router)
    block.router[5] = block.router[2] = np.abs(block.router[2])
    x = np.abs(rng.standard_normal((4, block.h))).astype(np.float32)
    rows = np.asarray(x, np.float64)
    chosen = [block.route(r / np.sqrt(np.mean(r * r) + EPS) * block.gain)[0] for r in rows]
    assert all(c == [2] for c in chosen)
    got = block.call(library, x)
    assert_close(got, block.reference(x))
    block.gate[5 * block.i:6 * block.i] = np.nan                    # expert 5 is never used
    assert np.array_equal(block.call(library, x), got)


def test_padding_rows_are_copied_and_sitting_out_rows_computed(library):
    rng = np.random.default_rng(4)
    block = Block(rng)
    x = rng.standard_normal((5, block.h)).astype(np.float32)
    got = block.call(library, x, slots=[0, -1, 2, -1, -1])
    assert np.array_equal(got[3:], x[3:])                           # padding: out = x
    assert_close(got[:3], block.reference(x[:3]))


def test_refusals(library):
    rng = np.random.default_rng(1)
    block = Block(rng)
    x = rng.standard_normal((2, block.h)).astype(np.float32)

    def code(**changes):
        values = dict(x=x, slots=np.arange(2, dtype=np.int32), router=block.router, router_bias=block.router_bias,
                      gate_w=block.gate, up_w=block.up, down_w=block.down, gate_bias=block.gate_bias,
                      up_bias=block.up_bias, down_bias=block.down_bias, post_gain=block.gain,
                      iconfig=np.array([2, block.k, 0, 0, 0, 1, 0], np.int32),
                      fconfig=np.array([EPS, 1.0, 7.0], np.float32))
        values.update(changes)
        return invoke(library.MoeMlp, [*MOE_MLP.args(**values), np.zeros_like(x)])

    assert code() == 0
    assert code(iconfig=np.array([2, 9, 0, 0, 0, 1, 0], np.int32)) == 2       # more experts per row than experts
    assert code(iconfig=np.array([2, 0, 0, 0, 0, 1, 0], np.int32)) == 2
    assert code(iconfig=np.array([2, 2, 0, 0, 0, 3, 0], np.int32)) == 2       # renormalize neither 0 nor 1
    assert code(iconfig=np.array([2, 2, 0, 0, 0, 1, 2], np.int32)) == 2       # no activation 2
    assert code(iconfig=np.array([2, 2, 0, 0, 0, 1], np.int32)) == 2          # iconfig too short
    assert code(down_bias=np.zeros(block.e * block.h - 1, np.float32)) == 2
    assert code(router_bias=np.zeros(7, np.float32)) == 2
    assert code(down_w=block.down[:-1]) == 2                                  # not E * H rows
    assert code(gate_w=block.gate[:, :-1].copy()) == 2
    assert code(x=x.astype(np.float64)) == 1
