"""The vision tower's CPU kernels (kernels/vision_layer_cpu.cc), called through ctypes exactly as MindSpore's AOT
Custom op calls them: the attention against a float64 numpy softmax attention, the products (float32, float16 and
bfloat16 panels, fc1's GELU) against float64 ones, the LayerNorm against numpy's. No MindSpore needed."""
from __future__ import annotations

import ctypes
import os
import shutil

import numpy as np
import pytest

from llm_serving.models.kernels import build_kernel
from llm_serving.models.kernels.aot_call import invoke

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and not os.environ.get("CXX"),
                                reason="no C++ compiler on this machine (the tower then attends with MindSpore's ops)")


@pytest.fixture(scope="module")
def library():
    path, _ = build_kernel("vision_layer_cpu", "VisionAttention").rsplit(":", 1)
    return ctypes.CDLL(path)


@pytest.fixture(scope="module")
def kernel(library):
    return library.VisionAttention


def attend(kernel, qkv: np.ndarray, patches: int, heads: int, threads: int = 2, bias=None) -> np.ndarray:
    out = np.full((qkv.shape[0], qkv.shape[1] // 3), np.nan, np.float32)
    bias = np.zeros(qkv.shape[1], np.float32) if bias is None else bias
    assert invoke(kernel, [qkv, bias, np.array([patches, heads, threads], np.int32), out]) == 0
    return out


def reference(qkv: np.ndarray, patches: int, heads: int, bias=0.0) -> np.ndarray:
    rows, width = qkv.shape
    d = width // 3
    x = (qkv.astype(np.float64) + bias).reshape(rows // patches, patches, 3, heads, d // heads).transpose(2, 0, 3, 1, 4)
    s = x[0] @ x[1].transpose(0, 1, 3, 2) / np.sqrt(d // heads)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return (p @ x[2]).transpose(0, 2, 1, 3).reshape(rows, d)


@pytest.mark.parametrize("images,patches,heads,head_dim", [
    (1, 64, 2, 72),      # SigLIP's head size
    (2, 200, 3, 72),     # patches not a multiple of the key block (128) or the query block (48)
    (1, 131, 4, 64),
    (2, 50, 2, 16),
    (1, 300, 1, 40),     # a head size that is not a whole number of vectors
])
def test_it_matches_softmax_attention_per_image_and_head(kernel, images, patches, heads, head_dim):
    rng = np.random.default_rng(patches)
    qkv = (rng.standard_normal((images * patches, 3 * heads * head_dim)) * 2).astype(np.float32)
    bias = rng.standard_normal(3 * heads * head_dim).astype(np.float32)
    got = attend(kernel, qkv, patches, heads, bias=bias)
    want = reference(qkv, patches, heads, bias)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_large_scores_stay_finite_and_exact(kernel):
    """Scores in the hundreds (a trained tower's outliers): the online softmax rescales, never overflows."""
    rng = np.random.default_rng(1)
    qkv = (rng.standard_normal((300, 3 * 2 * 72)) * 12).astype(np.float32)
    got = attend(kernel, qkv, 300, 2)
    want = reference(qkv, 300, 2)
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_an_images_rows_do_not_depend_on_the_threads_or_the_other_images(kernel):
    rng = np.random.default_rng(2)
    a, b = (rng.standard_normal((2, 150, 3 * 4 * 72)) * 2).astype(np.float32)
    alone = attend(kernel, a, 150, 4, threads=1)
    together = attend(kernel, np.concatenate([a, b]), 150, 4, threads=3)
    np.testing.assert_array_equal(together[:150], alone)
    assert not np.array_equal(together[150:], alone)


@pytest.mark.parametrize("rows,width,patches,heads", [
    (100, 3 * 96, 30, 4),     # 100 rows are not whole images of 30 patches
    (60, 3 * 96, 30, 5),      # 96 is not 5 heads
    (60, 3 * 96, 0, 4),
])
def test_a_call_of_the_wrong_shape_is_refused(kernel, rows, width, patches, heads):
    qkv = np.zeros((rows, width), np.float32)
    out = np.zeros((rows, width // 3), np.float32)
    assert invoke(kernel, [qkv, np.zeros(width, np.float32), np.array([patches, heads, 2], np.int32), out]) == 2


def panels(w: np.ndarray) -> np.ndarray:
    """(N, K) -> (ceil(N / 16), K, 16) float32, as vision_tower._panels packs a matrix (zeros past N)."""
    n, k = w.shape
    padded = np.zeros((-(-n // 16) * 16, k), np.float32)
    padded[:n] = w
    return np.ascontiguousarray(padded.reshape(-1, 16, k).transpose(0, 2, 1))


def as_bfloat16(a: np.ndarray) -> np.ndarray:
    """float32 values as the bfloat16 bits nearest them (ties to even), and those bits."""
    bits = a.astype(np.float32).view(np.uint32)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return bits


def linear(library, x, w_panels, bias, gelu=False, threads=2):
    out = np.full((x.shape[0], bias.shape[0]), np.nan, np.float32)
    rc = invoke(library.VisionLinear, [x, w_panels, bias, np.array([threads, int(gelu)], np.int32), out])
    return rc, out


@pytest.mark.parametrize("rows,k,n", [
    (1, 8, 16),           # one row, one panel
    (7, 40, 37),          # a last tile of 1 row, a last panel of 5 columns
    (300, 300, 100),      # several row blocks' tiles and depth blocks (256) with a remainder
    (601, 520, 48),       # more rows than a task's block (288): three tasks
])
@pytest.mark.parametrize("kind", ["float32", "float16", "bfloat16"])
def test_linear_is_x_times_w_transposed_plus_bias(library, rows, k, n, kind):
    rng = np.random.default_rng(rows + k)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    if kind == "float16":
        w = w.astype(np.float16).astype(np.float32)
        packed = panels(w).astype(np.float16)
    elif kind == "bfloat16":
        bits = as_bfloat16(w)
        w = (bits.astype(np.uint32) << 16).view(np.float32)
        packed = (as_bfloat16(panels(w)), "bfloat16")
    else:
        packed = panels(w)
    rc, got = linear(library, x, packed, bias)
    assert rc == 0
    want = x.astype(np.float64) @ w.astype(np.float64).T + bias
    assert np.abs(got - want).max() <= 2e-6 * np.sqrt(k) * np.abs(want).max()


def test_linear_with_gelu_is_the_tanh_gelu_of_the_product(library):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((37, 64)) * 2).astype(np.float32)
    w = rng.standard_normal((301, 64)).astype(np.float32)     # products far out on both sides: tanh's -1 and 1
    bias = rng.standard_normal(301).astype(np.float32)
    bias[:3] = [0.0, -300.0, 300.0]
    rc, got = linear(library, x, panels(w), bias, gelu=True, threads=3)
    assert rc == 0
    y = x.astype(np.float64) @ w.astype(np.float64).T + bias
    want = 0.5 * y * (1 + np.tanh(np.sqrt(2 / np.pi) * (y + 0.044715 * y ** 3)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_a_rows_product_does_not_depend_on_the_threads_or_the_other_rows(library):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((700, 96)).astype(np.float32)
    w = panels(rng.standard_normal((40, 96)).astype(np.float32))
    bias = rng.standard_normal(40).astype(np.float32)
    _, alone = linear(library, x[:5], w, bias, threads=1)
    _, together = linear(library, x, w, bias, threads=3)
    np.testing.assert_array_equal(together[:5], alone)


@pytest.mark.parametrize("w_shape,bias_len,dtype", [
    ((2, 96, 16), 40, np.float32),     # 40 columns need 3 panels
    ((3, 95, 16), 40, np.float32),     # the panels' depth is not x's
    ((3, 96, 8), 40, np.float32),      # panels of 8 columns
    ((3, 96, 16), 40, np.int32),       # not a float type
])
def test_linear_refuses_panels_that_do_not_fit(library, w_shape, bias_len, dtype):
    x = np.zeros((4, 96), np.float32)
    rc, _ = linear(library, x, np.zeros(w_shape, dtype), np.zeros(bias_len, np.float32))
    assert rc in (1, 2)


def test_layer_norm_is_each_rows_layer_norm(library):
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((45, 200)) * 3 + 5).astype(np.float32)      # an offset: the mean matters
    gain, bias = rng.standard_normal((2, 200)).astype(np.float32)
    out = np.full_like(x, np.nan)
    eps = np.array([1e-6], np.float32)
    assert invoke(library.VisionLayerNorm, [x, gain, bias, eps, np.array([2], np.int32), out]) == 0
    y = x.astype(np.float64)
    want = (y - y.mean(-1, keepdims=True)) / np.sqrt(y.var(-1, keepdims=True) + 1e-6) * gain + bias
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    wrong = np.zeros(199, np.float32)
    assert invoke(library.VisionLayerNorm, [x, wrong, bias, eps, np.array([2], np.int32), out]) == 2
