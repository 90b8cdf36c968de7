"""The vision tower's CPU kernels (kernels/vision_layer_cpu.cc), called through ctypes exactly as MindSpore's AOT
Custom op calls them: the attention (float32, and its int16 paths) against a float64 numpy softmax attention, the
products (float32, float16, bfloat16 and int16 panels, fc1's GELU) against float64 ones, the LayerNorm against
numpy's. No MindSpore needed."""
from __future__ import annotations

import ctypes
import os
import shutil

import numpy as np
import pytest

from llm_serving.models.kernels import build_kernel, cpu_flags
from llm_serving.models.kernels.aot_call import invoke
from llm_serving.models.kernels.vision_panels import INT16_DEPTH, INT16_WEIGHT_MAX, float_panels
from llm_serving.models.kernels.vision_panels import int16_panels as pack_int16

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and not os.environ.get("CXX"),
                                reason="no C++ compiler on this machine (the tower then attends with MindSpore's ops)")


@pytest.fixture(scope="module")
def library():
    path, _ = build_kernel("vision_layer_cpu", "VisionAttention").rsplit(":", 1)
    return ctypes.CDLL(path)


@pytest.fixture(scope="module")
def kernel(library):
    return library.VisionAttention


@pytest.fixture(params=["fma", "amx"])
def float_path(request, library):
    """VisionLinear's float panels and VisionAttention's float path on AVX FMAs, or on AMX tiles (bfloat16 pieces)
    where the CPU has them; the process's setting put back after."""
    if request.param == "amx" and not library.VisionAmx(1):
        pytest.skip("this CPU has no AMX tiles (or Linux did not grant them): the float panels run on FMAs only")
    if request.param == "fma":
        library.VisionAmx(0)
    yield request.param
    library.VisionAmx(1)


# the float attention's error bound, of the largest output: float32 FMAs; AMX's (its scores to float32's precision,
# its values' product in two bfloat16 pieces: ~2^-16 of sum p |v|)
FLOAT_ATTENTION = {"fma": 1e-5, "amx": 5e-5}


def attend(kernel, qkv: np.ndarray, patches: int, heads: int, threads: int = 2, bias=None, level=None) -> np.ndarray:
    """The kernel's output; `level`: its config's 4th value (0 float, 1 the values' product in int16, 2 the scores'
    too), None: a 3-value config."""
    out = np.full((qkv.shape[0], qkv.shape[1] // 3), np.nan, np.float32)
    bias = np.zeros(qkv.shape[1], np.float32) if bias is None else bias
    config = [patches, heads, threads] + ([] if level is None else [level])
    assert invoke(kernel, [qkv, bias, np.array(config, np.int32), out]) == 0
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
def test_it_matches_softmax_attention_per_image_and_head(kernel, float_path, images, patches, heads, head_dim):
    rng = np.random.default_rng(patches)
    qkv = (rng.standard_normal((images * patches, 3 * heads * head_dim)) * 2).astype(np.float32)
    bias = rng.standard_normal(3 * heads * head_dim).astype(np.float32)
    got = attend(kernel, qkv, patches, heads, bias=bias)
    want = reference(qkv, patches, heads, bias)
    assert np.abs(got - want).max() <= FLOAT_ATTENTION[float_path] * np.abs(want).max()


def test_large_scores_stay_finite_and_exact(kernel, float_path):
    """Scores in the hundreds (a trained tower's outliers): the online softmax rescales, never overflows; on AMX
    the scores keep float32's precision (their error would be exponentiated)."""
    rng = np.random.default_rng(1)
    qkv = (rng.standard_normal((300, 3 * 2 * 72)) * 12).astype(np.float32)
    got = attend(kernel, qkv, 300, 2)
    want = reference(qkv, 300, 2)
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_an_images_rows_do_not_depend_on_the_threads_or_the_other_images(kernel, float_path):
    rng = np.random.default_rng(2)
    a, b = (rng.standard_normal((2, 150, 3 * 4 * 72)) * 2).astype(np.float32)
    alone = attend(kernel, a, 150, 4, threads=1)
    together = attend(kernel, np.concatenate([a, b]), 150, 4, threads=3)
    np.testing.assert_array_equal(together[:150], alone)
    assert not np.array_equal(together[150:], alone)


@pytest.mark.parametrize("images,patches,heads,head_dim", [
    (1, 64, 2, 72),      # SigLIP's head size: 72 dims, 36 pairs
    (2, 200, 3, 72),     # patches not a multiple of the key block or the query block
    (1, 131, 4, 64),     # 64 dims padded to 66 (a multiple of the 6-row tiles)
    (1, 300, 1, 40),
])
@pytest.mark.parametrize("level", [1, 2])
def test_int16_attention_is_near_softmax_attention(kernel, images, patches, heads, head_dim, level):
    """Level 1 (vision_int16): P V in int16, ~3e-4 of the output; level 2 (vision_int16_scores): q k too, ~1e-3 at
    these scores (a few units)."""
    rng = np.random.default_rng(patches + level)
    qkv = (rng.standard_normal((images * patches, 3 * heads * head_dim)) * 2).astype(np.float32)
    bias = rng.standard_normal(3 * heads * head_dim).astype(np.float32)
    got = attend(kernel, qkv, patches, heads, bias=bias, level=level)
    want = reference(qkv, patches, heads, bias)
    error = np.abs(got - want).max() / np.abs(want).max()
    assert error <= (1e-3 if level == 1 else 3e-3)
    assert error > 1e-5                                            # (not the float path)


def test_int16_values_stay_near_at_large_scores_where_int16_scores_do_not(kernel):
    """Scores in the hundreds: the values' int16 error does not grow with them (it is the probabilities' and values'
    rounding), the scores' does (a score's error is a fraction of q.k, which the softmax exponentiates). This is why
    vision_int16_scores is opt-in."""
    rng = np.random.default_rng(11)
    qkv = (rng.standard_normal((300, 3 * 2 * 72)) * 12).astype(np.float32)
    want = reference(qkv, 300, 2)
    values = np.abs(attend(kernel, qkv, 300, 2, level=1) - want).max() / np.abs(want).max()
    scores = np.abs(attend(kernel, qkv, 300, 2, level=2) - want).max() / np.abs(want).max()
    assert values <= 1e-3 < scores


@pytest.mark.parametrize("level", [1, 2])
def test_int16_attention_rows_do_not_depend_on_the_threads_or_the_other_images(kernel, level):
    rng = np.random.default_rng(12)
    a, b = (rng.standard_normal((2, 150, 3 * 4 * 72)) * 2).astype(np.float32)
    alone = attend(kernel, a, 150, 4, threads=1, level=level)
    together = attend(kernel, np.concatenate([a, b]), 150, 4, threads=3, level=level)
    np.testing.assert_array_equal(together[:150], alone)


def test_int16_attention_past_128_head_dims_is_the_float_path(kernel):
    """hd x 4,095^2 must fit int32: past 128 dims (padded) the kernel attends in float32, to the bit."""
    rng = np.random.default_rng(13)
    qkv = rng.standard_normal((40, 3 * 136)).astype(np.float32)
    np.testing.assert_array_equal(attend(kernel, qkv, 40, 1, level=2), attend(kernel, qkv, 40, 1))
    np.testing.assert_array_equal(attend(kernel, qkv, 40, 1, level=0), attend(kernel, qkv, 40, 1))


def _rotated(qkv: np.ndarray, bias: np.ndarray, rope: np.ndarray, heads: int) -> np.ndarray:
    """q and k of every head, their bias added, rotated by each patch's cos and sin rows as a Qwen-VL tower does
    (x cos + rotate_half(x) sin, in float64); v with its bias; (rows, 3 D)."""
    rows, width = qkv.shape
    hd, half = width // 3 // heads, width // 6 // heads
    x = (qkv.astype(np.float64) + bias).reshape(rows, 3, heads, hd)
    cos, sin = rope[:, None, :hd].astype(np.float64), rope[:, None, hd:].astype(np.float64)
    for part in (0, 1):
        y = x[:, part]
        x[:, part] = y * cos + np.concatenate([-y[..., half:], y[..., :half]], -1) * sin
    return x.reshape(rows, width)


@pytest.mark.parametrize("level", [None, 1, 2])
def test_rotary_tables_rotate_q_and_k_as_they_are_read(kernel, float_path, level):
    """A fifth input, each patch's cos and sin rows (N, 2 hd): the kernel's output is softmax attention over q and k
    rotated by them after their bias (a Qwen-VL tower's 2-D rotary positions), v untouched; to float32's precision,
    and within the int16 levels' own error; without the tables it is another output (the test can tell)."""
    rng = np.random.default_rng(21)
    images, patches, heads, hd = 2, 150, 2, 64
    qkv = (rng.standard_normal((images * patches, 3 * heads * hd)) * 2).astype(np.float32)
    bias = rng.standard_normal(3 * heads * hd).astype(np.float32)
    angles = rng.uniform(0, 40, (images * patches, hd // 2))
    angles = np.concatenate([angles, angles], 1)
    rope = np.concatenate([np.cos(angles), np.sin(angles)], 1).astype(np.float32)
    out = np.full((qkv.shape[0], heads * hd), np.nan, np.float32)
    config = [patches, heads, 2] + ([] if level is None else [level])
    assert invoke(kernel, [qkv, bias, np.array(config, np.int32), rope, out]) == 0
    want = reference(_rotated(qkv, bias, rope, heads), patches, heads)
    error = np.abs(out - want).max() / np.abs(want).max()
    assert error <= {None: FLOAT_ATTENTION[float_path], 1: 1e-3, 2: 3e-3}[level], error
    assert np.abs(attend(kernel, qkv, patches, heads, bias=bias) - want).max() > 1e-2 * np.abs(want).max()
    wrong = np.zeros((qkv.shape[0], hd), np.float32)                          # (tables of hd, not 2 hd)
    assert invoke(kernel, [qkv, bias, np.array(config, np.int32), wrong, out]) == 2


@pytest.mark.parametrize("level", [None, 1, 2])
def test_each_images_key_count_leaves_its_padding_out(kernel, float_path, level):
    """A sixth input, each image's key count (N,): image n's first keys[n] patches attend among themselves exactly as
    an image of that many patches alone (a Qwen2.5-VL window at the grid's edge, padded to the window's size), its
    padding rows (anything, even inf) never reaching them; a count of 0 or past T is refused."""
    rng = np.random.default_rng(22)
    patches, heads, hd, keys = 64, 2, 64, [64, 23, 1, 40]
    qkv = (rng.standard_normal((len(keys) * patches, 3 * heads * hd)) * 2).astype(np.float32)
    for n, count in enumerate(keys):
        qkv[n * patches + count:(n + 1) * patches] = np.inf                   # (padding: must not be read as keys)
    angles = rng.uniform(0, 40, (qkv.shape[0], hd // 2))
    rope = np.concatenate([np.cos(angles), np.cos(angles), np.sin(angles), np.sin(angles)], 1).astype(np.float32)
    bias = rng.standard_normal(3 * heads * hd).astype(np.float32)
    out = np.full((qkv.shape[0], heads * hd), np.nan, np.float32)
    config = np.array([patches, heads, 2] + ([] if level is None else [level]), np.int32)
    assert invoke(kernel, [qkv, bias, config, rope, np.array(keys, np.int32), out]) == 0
    for n, count in enumerate(keys):
        rows = slice(n * patches, n * patches + count)
        want = reference(_rotated(qkv[rows], bias, rope[rows], heads), count, heads)
        error = np.abs(out[rows] - want).max() / np.abs(want).max()
        assert error <= {None: FLOAT_ATTENTION[float_path], 1: 1e-3, 2: 3e-3}[level], (n, error)
    for bad in ([64, 0, 1, 40], [64, 65, 1, 40]):
        assert invoke(kernel, [qkv, bias, config, rope, np.array(bad, np.int32), out]) == 2


def test_an_unknown_attention_level_is_refused(kernel):
    qkv = np.zeros((30, 3 * 96), np.float32)
    out = np.zeros((30, 96), np.float32)
    assert invoke(kernel, [qkv, np.zeros(3 * 96, np.float32), np.array([30, 4, 2, 3], np.int32), out]) == 2


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
    """(N, K) -> (ceil(N / 16), K, 16) float32, as the tower packs a matrix (zeros past N)."""
    return float_panels(w.astype(np.float32))


def as_bfloat16(a: np.ndarray) -> np.ndarray:
    """float32 values as the bfloat16 bits nearest them (ties to even), and those bits."""
    bits = a.astype(np.float32).view(np.uint32)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return bits


# VisionLinear's activation codes (layer_parts_cpu.h's kGeluTanh, kQuickGelu) -> the activation in float64
ACTIVATIONS = {1: lambda y: 0.5 * y * (1 + np.tanh(np.sqrt(2 / np.pi) * (y + 0.044715 * y ** 3))),
               3: lambda y: y / (1 + np.exp(-1.702 * y))}


def within_path(got, x, w, bias, path, gelu=0):
    """Asserts `got` is x w^T + bias (gelu: that activation of it, an ACTIVATIONS code) in float64 within the path's
    bound: float32 FMAs' 2e-6
    sqrt(k) of the largest value; AMX's pieces (x to 16 bits, w0 + w1 exact for a 16-bit type and within 2^-18 for
    float32, x1 w1 dropped: each product within 2^-16 of |x| |w|, plus float32 sums' k 2^-24) of sum |x| |w|, per
    value."""
    y = x.astype(np.float64) @ w.astype(np.float64).T + bias
    if gelu:
        y = ACTIVATIONS[gelu](y)
    k = x.shape[1]
    if path == "fma":
        assert np.abs(got - y).max() <= 2e-6 * np.sqrt(k) * np.abs(y).max()
    else:
        scale = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T
        bound = (2.0 ** -16 + k * 2.0 ** -24) * scale + 2e-7 * np.abs(y) + 1e-30
        if gelu:                    # (a GELU's slope is at most ~1.13; its own float32 error as the FMA test allows)
            bound = 1.2 * bound + 1e-5 * np.abs(y) + 1e-4
        assert np.all(np.abs(got - y) <= bound), np.max(np.abs(got - y) / bound)


def linear(library, x, w_panels, bias, gelu=0, threads=2):
    """VisionLinear's x w^T + bias, then (gelu) the activation of that code (1 the tanh GELU, 3 quick GELU)."""
    out = np.full((x.shape[0], bias.shape[-1]), np.nan, np.float32)
    rc = invoke(library.VisionLinear, [x, w_panels, bias, np.array([threads, int(gelu)], np.int32), out])
    return rc, out


@pytest.mark.parametrize("rows,k,n", [
    (1, 8, 16),           # one row, one panel
    (7, 40, 37),          # a last tile of 1 row, a last panel of 5 columns
    (300, 300, 100),      # several row blocks' tiles and depth blocks (256) with a remainder
    (601, 520, 48),       # more rows than a task's block (288): three tasks
    (40, 1200, 33),       # AMX: two depth slices (1,152 k), the last k block 16 long; a last panel alone
])
@pytest.mark.parametrize("kind", ["float32", "float16", "bfloat16"])
def test_linear_is_x_times_w_transposed_plus_bias(library, float_path, rows, k, n, kind):
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
    within_path(got, x, w, bias, float_path)


@pytest.mark.parametrize("activation", [1, 3], ids=["tanh GELU", "quick GELU"])
def test_linear_with_an_activation_is_that_activation_of_the_product(library, float_path, activation):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((37, 64)) * 2).astype(np.float32)
    w = rng.standard_normal((301, 64)).astype(np.float32)     # products far out on both sides: the sigmoid's 0 and 1
    bias = rng.standard_normal(301).astype(np.float32)
    bias[:3] = [0.0, -300.0, 300.0]
    rc, got = linear(library, x, panels(w), bias, gelu=activation, threads=3)
    assert rc == 0
    if float_path == "fma":
        want = ACTIVATIONS[activation](x.astype(np.float64) @ w.astype(np.float64).T + bias)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    else:
        within_path(got, x, w, bias, float_path, gelu=activation)
    rc, plain = linear(library, x, panels(w), bias, threads=3)
    assert rc == 0 and np.abs(got - plain).max() > 1.0        # (the activation was applied)


@pytest.mark.parametrize("activation", [-1, 4])
def test_linear_refuses_an_unknown_activation(library, activation):
    x = np.ones((2, 8), np.float32)
    rc, _ = linear(library, x, panels(np.ones((16, 8), np.float32)), np.zeros(16, np.float32), gelu=activation)
    assert rc != 0


@pytest.mark.parametrize("kind", ["float32", "float16"])
def test_a_rows_product_does_not_depend_on_the_threads_or_the_other_rows(library, float_path, kind):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((700, 1300)).astype(np.float32)
    w = panels(rng.standard_normal((40, 1300)).astype(np.float32)).astype(kind)
    bias = rng.standard_normal(40).astype(np.float32)
    _, alone = linear(library, x[:5], w, bias, threads=1)
    _, together = linear(library, x, w, bias, threads=3)
    _, shifted = linear(library, x[3:300], w, bias, threads=2)
    np.testing.assert_array_equal(together[:5], alone)
    np.testing.assert_array_equal(together[3:300], shifted)


def test_amx_runs_where_the_cpu_has_its_bfloat16_tiles(library):
    """VisionAmx says whether the float panels and the float attention run on AMX tiles: where the CPU has AMX's
    tiles and their bfloat16 products (and Linux grants the tile state, which it does on the machines these tests
    meet); it can be turned off and on (whatever LLM_SERVING_KERNEL_AMX said), and the runner's vision_int16 'auto'
    then keeps the float panels (runner/kernels.py)."""
    has = {"amx_tile", "amx_bf16", "avx512_bf16"} <= cpu_flags()
    assert library.VisionAmx(1) == int(has)
    assert library.VisionAmx(-1) == int(has)
    assert library.VisionAmx(0) == 0
    assert library.VisionAmx(-1) == 0
    assert library.VisionAmx(1) == int(has)


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


# ---- int16 panels (kernels/vision_panels.py; the kernel's kActivationMax, 2 kChunkPairs) ----
X_MAX, CHUNK = 8191, INT16_DEPTH


def int16_panels(w: np.ndarray) -> tuple:
    """(the tower's int16 panels of w, its columns' steps, w's codes: each column in its steps)."""
    packed, steps = pack_int16(w)
    assert packed.shape == (-(-w.shape[0] // 16), -(-w.shape[1] // CHUNK) * CHUNK, 16) and packed.dtype == np.int16
    codes = np.rint(w / steps.astype(np.float64)[:, None]).astype(np.int16)
    assert np.abs(codes).max() == INT16_WEIGHT_MAX
    return packed, steps, codes


def int16_reference(x: np.ndarray, codes: np.ndarray, w_steps: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """What the int16 product computes, in float64: each row's 64-value chunks quantized (float32, to nearest
    even) in steps of the chunk's largest / 8,191, the exact integer sums times the steps, plus the bias."""
    rows, k = x.shape
    out = np.zeros((rows, codes.shape[0]))
    for c0 in range(0, k, CHUNK):
        chunk = x[:, c0:c0 + CHUNK]
        top = np.abs(chunk).max(axis=1)
        inverse = np.where(top > 0, np.float32(X_MAX) / np.where(top > 0, top, 1), 0).astype(np.float32)
        q = np.rint(chunk * inverse[:, None]).astype(np.int64)
        step = np.where(top > 0, top / np.float32(X_MAX), 1).astype(np.float32)
        out += (q @ codes[:, c0:c0 + CHUNK].T.astype(np.int64)) * step.astype(np.float64)[:, None]
    return out * w_steps + bias


@pytest.mark.parametrize("rows,k,n", [
    (1, 8, 16),           # one row, one panel, a chunk mostly zeros
    (7, 40, 37),          # a last tile of 1 row, a last panel of 5 columns
    (300, 300, 100),      # several tiles and depth blocks (256 pairs) with a remainder, K not whole chunks
    (601, 520, 48),       # more rows than a task's block (288): three tasks
])
def test_int16_linear_is_its_quantized_product_and_near_the_float_one(library, rows, k, n):
    rng = np.random.default_rng(rows + k + 1)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    packed, steps, codes = int16_panels(w)
    rc, got = linear(library, x, packed, np.stack([bias, steps]))
    assert rc == 0
    scale = np.abs(got).max()
    assert np.abs(got - int16_reference(x, codes, steps, bias)).max() <= 1e-6 * scale
    exact = x.astype(np.float64) @ w.astype(np.float64).T + bias      # the quantization's cost: about 3e-4
    assert np.abs(got - exact).max() <= 2e-3 * scale
    assert np.sqrt(((got - exact) ** 2).mean()) <= 5e-4 * np.sqrt((exact ** 2).mean())


def test_int16_x_is_stepped_per_chunk_so_an_outlier_channel_costs_only_its_chunk(library):
    """A channel 1,000x the others in every row (as ViTs have), its weights zero: stepped per row, every value of
    x would lose ~7 bits; stepped per 64, only the outlier's chunk's do (here one chunk of ten: about 1/3 the
    error, which grows with K)."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((50, 640)).astype(np.float32)
    x[:, 3] = 1000.0
    w = rng.standard_normal((32, 640)).astype(np.float32)
    w[:, 3] = 0.0
    packed, steps, codes = int16_panels(w)
    rc, got = linear(library, x, packed, np.stack([np.zeros(32, np.float32), steps]))
    assert rc == 0
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    row_step = np.abs(x).max(axis=1, keepdims=True) / X_MAX
    per_row = (np.rint(x / row_step) @ codes.T.astype(np.float64)) * row_step * steps
    assert np.abs(got - exact).max() <= 0.5 * np.abs(per_row - exact).max()


@pytest.mark.parametrize("activation", [1, 3], ids=["tanh GELU", "quick GELU"])
def test_int16_linear_with_an_activation_and_its_rows_alone_or_together(library, activation):
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((700, 200)) * 2).astype(np.float32)
    w = rng.standard_normal((45, 200)).astype(np.float32)
    bias = rng.standard_normal(45).astype(np.float32)
    packed, steps, codes = int16_panels(w)
    both = np.stack([bias, steps])
    rc, together = linear(library, x, packed, both, gelu=activation, threads=3)
    assert rc == 0
    want = ACTIVATIONS[activation](int16_reference(x, codes, steps, bias))
    np.testing.assert_allclose(together, want, rtol=1e-5, atol=1e-4)
    _, alone = linear(library, x[:5], packed, both, gelu=activation, threads=1)
    np.testing.assert_array_equal(together[:5], alone)       # a row's bits whatever the threads and other rows


@pytest.mark.parametrize("w_shape,bias_shape", [
    ((3, 128, 16), (40,)),             # int16 panels without the steps
    ((3, 96, 16), (2, 40)),            # depth not rounded up to 64 (x's K is 96: 128)
    ((3, 128, 16), (3, 40)),           # three rows of bias
])
def test_int16_linear_refuses_what_does_not_fit(library, w_shape, bias_shape):
    x = np.zeros((4, 96), np.float32)
    out = np.zeros((4, 40), np.float32)
    rc = invoke(library.VisionLinear, [x, np.zeros(w_shape, np.int16), np.zeros(bias_shape, np.float32),
                                       np.array([2, 0], np.int32), out])
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


@pytest.mark.skipif(not cpu_flags() or bool(os.environ.get("LLM_SERVING_KERNEL_MARCH")),
                    reason="reads the CPU's flags from /proc/cpuinfo and the library built for them (-march=native)")
def test_rms_norm_is_each_rows_rms_norm(library):
    """VisionRmsNorm (Qwen2.5-VL's tower's norms): x / sqrt(mean(x^2) + eps) * gain, each row on its own, whatever
    the threads."""
    rng = np.random.default_rng(31)
    x = (rng.standard_normal((37, 80)) * 3).astype(np.float32)
    gain = rng.standard_normal(80).astype(np.float32)
    want = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * gain
    outs = []
    for threads in (1, 3):
        out = np.full_like(x, np.nan)
        assert invoke(library.VisionRmsNorm, [x, gain, np.array([1e-6], np.float32),
                                              np.array([threads], np.int32), out]) == 0
        outs.append(out)
    np.testing.assert_allclose(outs[0], want, rtol=2e-6, atol=2e-6 * np.abs(want).max())
    np.testing.assert_array_equal(outs[0], outs[1])
    assert invoke(library.VisionRmsNorm, [x, gain[:79], np.array([1e-6], np.float32), np.array([2], np.int32),
                                          np.zeros_like(x)]) == 2


@pytest.mark.parametrize("activation", [0, 1, 2])
def test_gated_is_the_activation_of_the_gate_times_the_up(library, activation):
    """VisionGated (Qwen2.5-VL's SwiGLU): a gate|up product's rows (R, 2 I) to act(gate) * up (R, I): SiLU, GELU-tanh
    or GELU-erf, as the text kernels' activations."""
    from math import erf

    rng = np.random.default_rng(32 + activation)
    gu = (rng.standard_normal((21, 2 * 75)) * 3).astype(np.float32)
    g, u = gu[:, :75].astype(np.float64), gu[:, 75:].astype(np.float64)
    act = {0: lambda v: v / (1 + np.exp(-v)),
           1: lambda v: 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v ** 3))),
           2: lambda v: 0.5 * v * (1 + np.vectorize(erf)(v / np.sqrt(2)))}[activation]
    out = np.full((21, 75), np.nan, np.float32)
    assert invoke(library.VisionGated, [gu, np.array([2, activation], np.int32), out]) == 0
    want = act(g) * u
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert invoke(library.VisionGated, [gu, np.array([2, 3], np.int32), out]) == 2


def test_the_int16_loop_is_native_where_avx2_without_avx512_or_avx512_vnni_is(library):
    """model_config.vision_int16 'auto' asks VisionLinearInt16Native: AVX2's vpmaddwd assembly where there is no
    AVX-512, vpdpwssd where AVX-512 has VNNI; elsewhere the int16 loop is plain C++, slower than the float panels."""
    flags = cpu_flags()
    native = "avx2" in flags and "fma" in flags and ("avx512f" not in flags or "avx512_vnni" in flags)
    assert library.VisionLinearInt16Native() == int(native)
