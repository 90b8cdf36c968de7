"""The whole-layer CPU kernels (kernels/decoder_layer_cpu.cc), called through ctypes exactly as MindSpore's AOT
Custom op calls them, against a float64 numpy LLaMA layer and lm_head: outputs, the K/V written into the paged
cache (and nothing else), greedy token and log-probability, and the refusals. No MindSpore needed."""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import time

import numpy as np
import pytest

from llm_serving.models.kernels import build_kernel, cpu_flags
from llm_serving.models.kernels.aot_call import invoke
from tests.cache_types import Cache
from llm_serving.models.kernels.signatures import DECODER_LAYER, FINAL_LOGITS, check_library

from .test_cpu_kernels import reference as attention_reference

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and not os.environ.get("CXX"),
                                reason="no C++ compiler on this machine (the runner runs layers op by op)")


@pytest.fixture(scope="module")
def library_path():
    """The library the agents load (built once per machine into the cache directory, under the build lock)."""
    return build_kernel("decoder_layer_cpu", "DecoderLayer").rsplit(":", 1)[0]


@pytest.fixture(scope="module")
def library(library_path):
    return ctypes.CDLL(library_path)


@pytest.fixture(autouse=True)
def fastest_paths(library):
    """Each test here checks a path's values, so each batch takes its fastest path (KernelInvariant(0): the batched
    products from their row counts, AMX, the integer tiles) unless it asks for `invariant_mode`; the default,
    batch-invariant steps, are tests/unit/test_batch_invariance.py's."""
    library.KernelInvariant.argtypes = [ctypes.c_int]
    before = library.KernelInvariant(0)
    yield
    library.KernelInvariant(before)


@pytest.fixture(params=[0, 1], ids=["fastest", "invariant"])
def invariant_mode(library, fastest_paths, request):
    library.KernelInvariant(request.param)
    return request.param


def test_library_exports_the_declared_parameter_lists(library_path):
    """The .cc's parameter lists are signatures.py's (build_kernel checked them too: it raises otherwise)."""
    check_library(library_path, (DECODER_LAYER, FINAL_LOGITS))


# positions in Layer.arrays (the kernel's parameters: inputs, then the output)
Q_W, O_W, DOWN_W, ICFG = (DECODER_LAYER.index(n) for n in ("q_w", "o_w", "down_w", "iconfig"))
# the kernel's weight inputs in iconfig's order of their types (iconfig[4:]), and the fused float matrix (of the
# reference) each is a row range of
PARTS = ("q_w", "k_w", "v_w", "o_w", "gate_w", "up_w", "down_w")
FUSED = {"qkv_w": ("q_w", "k_w", "v_w"), "o_w": ("o_w",), "gate_up_w": ("gate_w", "up_w"), "down_w": ("down_w",)}


def iconfig_types(o=0, rest=0):
    """iconfig[4:] with the o_proj's type `o` and every other part's `rest`."""
    return [o if n == "o_w" else rest for n in PARTS]


def logits_args(x, lm_head, gain, slots, cfg, *outputs) -> list:
    """FinalLogits' parameters by name: its inputs (cfg: iconfig, fconfig), then the outputs."""
    return [*FINAL_LOGITS.args(x=x, lm_head=lm_head, gain=gain, slots=slots, iconfig=cfg[0], fconfig=cfg[1]),
            *outputs]


def random_k_blocks(rows: int, cols: int, qtype, rng, scale: float = 2e-4) -> np.ndarray:
    """(rows, row bytes) of random Q4_K/Q5_K/Q6_K super-blocks whose f16 super-block scales are `scale` (Q4_K/
    Q5_K: d and dmin, bytes 0-3; Q6_K: d, the last 2 bytes): every code and sub-block scale random, the values
    finite (Q6_K's int8 scales are 4x the others' 6-bit ones: its d is a quarter)."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    d = np.full((len(blocks), 1), scale / 4 if qtype == gguf.GGMLQuantizationType.Q6_K else scale, np.float16)
    for at in {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (size - 2,)}[qtype.name]:
        blocks[:, at:at + 2] = d.view(np.uint8)
    return blocks.reshape(rows, cols // block * size)


def quantized_rows(w: np.ndarray, qtype, rng) -> np.ndarray:
    """w's rows in GGUF type qtype: gguf's quantization of them, or random K-quant blocks (w's shape)."""
    from gguf.quants import quantize

    if qtype.name in ("Q4_K", "Q5_K", "Q6_K"):
        return random_k_blocks(*w.shape, qtype, rng)
    return quantize(w, qtype).view(np.uint8)


def assert_child_exits_0(pid: int, seconds: float) -> None:
    """The forked child `pid` exits with 0 within `seconds` (else it is killed and the test fails)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"the forked child's kernel call did not return within {seconds:g} s")


# The integer paths (KernelInt on; KernelInt(-1)'s bits say which the library has): a product whose parts all have
# integer codes takes its input rounded to 16 bits per block. AMX's int8 tiles (gemm_amx_int.h, bit 1) take it in
# steps that are not batch-invariant from this many computed rows (kIntGemmRows), per block of 32 of each row (256
# when every part is a K-quant); AVX2's (gemm_avx2_int.h, bit 2) every other such product, any rows, per block of
# 32. The references round the same way.
INT_ROWS = 3
INTEGER_CODES = {2, 3, 6, 7, 8, 12, 13, 14}
K_QUANT_CODES = {12, 13, 14}
AMX_INT, AVX2_INT = 1, 2


def integer_path(library, rows: int, codes) -> int:
    """The block the kernel rounds a product's input by (0: it does not): `rows` computed rows, parts' types, the
    process's batch-invariance setting (KernelInvariant)."""
    library.KernelInt.argtypes = [ctypes.c_int]
    library.KernelInvariant.argtypes = [ctypes.c_int]
    paths = library.KernelInt(-1)
    if not set(codes) <= INTEGER_CODES:
        return 0
    if paths & AMX_INT and rows >= INT_ROWS and library.KernelInvariant(-1) != 1:
        return 256 if set(codes) <= K_QUANT_CODES else 32
    return 32 if paths & AVX2_INT else 0


def rounded(x, block: int):
    """x (rows, k) as the integer path sees it: each row's blocks of `block` (float32) scaled to +-32512 and
    rounded to integers (0: x unchanged), in float64."""
    if not block:
        return x
    x32 = np.asarray(x, np.float32).reshape(len(x), -1, block)
    amax = np.abs(x32).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(32512) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    n = np.rint((x32 * inv).astype(np.float32))
    return (n.astype(np.float64) * (amax / np.float32(32512)).astype(np.float32)).reshape(np.shape(x))


def assert_layer_close(layer, got, want):
    """got within 1e-4 of the float64 want, plus 8 float32 epsilons of its row's largest output: an output that
    cancels to near zero keeps the rounding of float32 sums whose terms are of that size (K-quant weights at 12
    rows, the FMA kernel of gemm_cpu.h: an output of -0.03 summed from down_proj terms whose magnitudes add up to
    3,400, in a row whose largest output is 676, was 1.04e-4 off, 1.3 epsilons of 676; a CPU with AMX int8 tiles
    takes the integer path there and the bound below). Where the reference rounded a product's input
    (layer.rounded), within 1e-4 of the largest output: the kernel's float32 inputs can round a value to the
    other side of a boundary (an error of the block's scale times the weights, carried through the layer:
    measured up to 6e-5 of the largest output). A wrong scale, block or piece is off by a good part of the
    output itself."""
    row_scale = np.abs(want).max(-1, keepdims=True)
    atol = 1e-4 + 8 * np.finfo(np.float32).eps * row_scale + (1e-4 * np.abs(want).max() if layer.rounded else 0)
    bad = np.abs(got - want) > atol + 1e-4 * np.abs(want)
    assert not bad.any(), (f"{bad.sum()} of {bad.size} outputs differ; largest error "
                           f"{np.abs(got - want).max():.3g}, largest output {np.abs(want).max():.3g}")


def assert_cache_close(layer, got, want):
    """The K/V cache after the step within 1e-5 of the reference's (where the reference rounded q/k/v's input,
    within 1e-4 of its largest value, as assert_layer_close). A float16 or bfloat16 cache: within one step of
    its type (2^-10, 2^-7 of the value), as the kernel's float32 K/V can round to the neighbour of the float64
    reference's."""
    if layer.cache.int8:                     # one code of the largest scale (codes round against the row's maximum)
        np.testing.assert_allclose(layer.cache.values(got), want, atol=1.01 * np.abs(want).max() / 127)
        return
    np.testing.assert_allclose(layer.cache.values(got), want, rtol=layer.cache.step,
                               atol=1e-5 + (1e-4 * np.abs(want).max() if layer.rounded else 0))


def check_layer(library, layer, threads: int) -> list:
    """One DecoderLayer call on `layer`'s arrays against its float64 reference: the output, and the step's K/V in
    the cache at their slots with no other slot changed. Returns the call's arrays."""
    want, keys, values = layer.reference(library)
    arrays = layer.arrays(threads)
    assert invoke(library.DecoderLayer, arrays) == 0
    assert_layer_close(layer, arrays[-1], want)
    assert_cache_close(layer, layer.key_cache, keys)
    assert_cache_close(layer, layer.value_cache, values)
    return arrays


def rms(x):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5)


def gelu_tanh(g):
    """GELU's tanh approximation (transformers' gelu_pytorch_tanh, Gemma's MLP activation)."""
    return 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))


def gelu_erf(g):
    """GELU's exact form (BERT's "gelu")."""
    import math

    return 0.5 * g * (1 + np.vectorize(math.erf)(g / math.sqrt(2)))


def layer_norm(x, eps=1e-5):
    x = x.astype(np.float64)
    x = x - x.mean(-1, keepdims=True)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def tree_visible(context: int, bits: int) -> list:
    """The key indices a row of `context` keys sees under its tree bits (bit m: the key m places before the
    last; keys further back than 32 always)."""
    return [j for j in range(context) if context - 1 - j >= 32 or (bits >> (context - 1 - j)) & 1]


class Layer:
    """Random weights, cache and a step of `batch` decode rows for one layer of the given shape."""

    def __init__(self, rng, *, hidden, heads, kv_heads, head_dim, inter, batch, block_size=4, num_blocks=60,
                 width=6, bias=True, cache_dtype="float32"):
        f32 = lambda *s: (rng.standard_normal(s) * 0.2).astype(np.float32)          # noqa: E731
        self.h, self.nh, self.kvh, self.d, self.i, self.b, self.bs = hidden, heads, kv_heads, head_dim, inter, \
            batch, block_size
        nq = (heads + 2 * kv_heads) * head_dim
        self.x = f32(batch, hidden)
        self.qkv_w, self.o_w = f32(nq, hidden), f32(hidden, heads * head_dim)
        self.qkv_b = f32(nq) if bias else np.zeros(nq, np.float32)
        self.gate_up_w, self.down_w = f32(2 * inter, hidden), f32(hidden, inter)
        self.in_gain, self.post_gain = np.ones(hidden, np.float32), np.ones(hidden, np.float32)
        # LoRA: no adapter (one all-zero slot of rank 1) unless with_lora() ran
        self.lora = np.zeros(batch, np.int32)
        self.lora_a = {n: np.zeros((1, p, k), np.float32) for n, p, k in self._lora_shapes(1)}
        self.lora_b = {n: np.zeros((1, o, 1), np.float32) for n, o in self._lora_outs()}    # (S, N, R); the
        # kernel takes them transposed, (S, R, N)
        # the weights as the kernel gets them: part name (PARTS) -> (array, GGML type code); float32 unless
        # quantize() ran; q/k/v and gate/up are row ranges of the reference's fused matrices
        self.kernel_weights = {n: (getattr(self, fused)[self._rows(n)], 0)
                               for fused, parts in FUSED.items() for n in parts}
        self.cache = Cache(str(np.dtype(cache_dtype)) if cache_dtype != "bfloat16" else cache_dtype)
        self.key_cache = self.cache.store(f32(num_blocks * block_size * kv_heads, head_dim))
        self.value_cache = self.cache.store(f32(num_blocks * block_size * kv_heads, head_dim))
        # every row its own blocks (scattered), a context of 1 .. width*block_size keys, the new token last
        blocks = rng.permutation(num_blocks)[:batch * width].reshape(batch, width)
        self.tables = blocks.astype(np.int32)
        self.context = rng.integers(1, width * block_size + 1, batch).astype(np.int32)
        self.positions = (self.context - 1).astype(np.int32)
        self.slots = (self.tables[np.arange(batch), self.positions // block_size] * block_size
                      + self.positions % block_size).astype(np.int32)
        self.tree = np.full(batch, -1, np.int32)
        self.rounded = False             # whether reference() rounded a product's input as the integer path does
        # the model family's parts (iconfig[12..15], fconfig[1]): LLaMA's unless with_features() ran; iconfig_len:
        # the iconfig's entries (None: 11 or 12, or 16 when a part is on)
        self.q_norm, self.k_norm = np.ones(head_dim, np.float32), np.ones(head_dim, np.float32)
        self.attn_out_gain, self.mlp_out_gain = np.ones(hidden, np.float32), np.ones(hidden, np.float32)
        self.activation, self.qk_norm, self.sandwich, self.window = 0, False, False, 0
        self.attention_scale = None
        # gpt-oss's parts: o_proj's bias (zeros: none) and each query head's attention sink (None: none)
        self.o_b, self.sinks = np.zeros(hidden, np.float32), None
        # a BERT encoder's parts (iconfig[18..21]): LayerNorm (its biases: norm_b's rows), post norms, an ungated MLP,
        # MLP biases; LLaMA's unless with_encoder() ran
        self.norm, self.post, self.gated, self.mlp_bias = 0, False, True, False
        self.gate_up_b, self.down_b = np.zeros(2 * inter, np.float32), np.zeros(hidden, np.float32)
        self.norm_b = np.zeros((4, hidden), np.float32)
        self.iconfig_len = None
        p = max(64, width * block_size)
        angles = np.arange(p)[:, None] / 10000.0 ** (np.arange(0, head_dim, 2) / head_dim)[None, :]
        self.cos = np.concatenate([np.cos(angles)] * 2, -1).astype(np.float32)
        self.sin = np.concatenate([-np.sin(angles), np.sin(angles)], -1).astype(np.float32)

    def as_prompts(self, rng, runs):
        """The step's rows as runs of consecutive tokens, a packed prefill's: runs = [(first position, rows)],
        each a sequence with its own scattered blocks (a run of one row: a decode row)."""
        assert sum(n for _, n in runs) == self.b
        width = self.tables.shape[1]
        blocks = rng.permutation(self.key_cache.shape[0] // (self.kvh * self.bs))
        row = 0
        for i, (start, n) in enumerate(runs):
            assert start + n <= width * self.bs
            for r in range(n):
                self.tables[row] = blocks[i * width:(i + 1) * width]
                self.context[row] = start + r + 1
                row += 1
        self.positions = (self.context - 1).astype(np.int32)
        self.slots = (self.tables[np.arange(self.b), self.positions // self.bs] * self.bs
                      + self.positions % self.bs).astype(np.int32)

    def with_features(self, rng, *, activation=0, qk_norm=False, sandwich=False, window=0, attention_scale=None):
        """Qwen3's, Gemma 3's, Mistral's parts: the MLP's activation (0 SiLU, 1 GELU-tanh), RMSNorm of each q and
        k head (random gains), sandwich norms after o and down (random gains), a sliding window of `window` keys,
        the queries' scale (None: 1/sqrt(D))."""
        self.activation, self.qk_norm, self.sandwich, self.window = activation, qk_norm, sandwich, window
        self.attention_scale = attention_scale
        gains = lambda n: (1 + 0.3 * rng.standard_normal(n)).astype(np.float32)      # noqa: E731
        if qk_norm:
            self.q_norm, self.k_norm = gains(self.d), gains(self.d)
        if sandwich:
            self.attn_out_gain, self.mlp_out_gain = gains(self.h), gains(self.h)
        return self

    def with_encoder(self, rng, *, norm=1, post=True, gated=False, mlp_bias=True, activation=2):
        """A BERT layer's parts (by default all of them): LayerNorm with random biases, post norms (random gains),
        an ungated MLP (gate_w a (1, H) placeholder; up's rows are gate_up_w's second half), random biases on
        gate/up and down, GELU (erf); RoPE off (cos 1, sin 0: learned positions are the embedding's)."""
        self.norm, self.post, self.gated, self.mlp_bias, self.activation = norm, post, gated, mlp_bias, activation
        gains = lambda n: (1 + 0.3 * rng.standard_normal(n)).astype(np.float32)      # noqa: E731
        small = lambda *n: (0.3 * rng.standard_normal(n)).astype(np.float32)          # noqa: E731
        self.norm_b = small(4, self.h) if norm else self.norm_b
        self.attn_out_gain, self.mlp_out_gain = gains(self.h), gains(self.h)
        self.in_gain, self.post_gain = gains(self.h), gains(self.h)
        if mlp_bias:
            self.gate_up_b, self.down_b = small(2 * self.i), small(self.h)
        if not gated:
            self.kernel_weights["gate_w"] = (np.full((1, self.h), np.nan, np.float32), 0)      # (not read)
        self.cos, self.sin = np.ones_like(self.cos), np.zeros_like(self.sin)
        return self

    def as_inputs(self, rng, lengths):
        """The step's rows as whole inputs of a bidirectional encoder, side by side: input i of lengths[i] tokens
        at positions 0.., each with its own scattered blocks, every token seeing all of its input's keys (context
        = its length)."""
        self.as_prompts(rng, [(0, n) for n in lengths])
        row = 0
        for n in lengths:
            self.context[row:row + n] = n
            row += n

    def _rows(self, part: str) -> slice:
        """The rows of its fused matrix that kernel weight `part` is."""
        nq, nk, i = self.nh * self.d, self.kvh * self.d, self.i
        return {"q_w": slice(0, nq), "k_w": slice(nq, nq + nk), "v_w": slice(nq + nk, nq + 2 * nk),
                "gate_w": slice(0, i), "up_w": slice(i, 2 * i)}.get(part, slice(None))

    def _lora_shapes(self, r):
        return (("qkv", 3 * r, self.h), ("o", r, self.nh * self.d), ("gate_up", 2 * r, self.h), ("down", r, self.i))

    def _lora_outs(self):
        return (("qkv", (self.nh + 2 * self.kvh) * self.d), ("o", self.h), ("gate_up", 2 * self.i), ("down", self.h))

    def with_lora(self, slots: int, rank: int, row_slots, rng):
        """`slots` adapter slots of rank `rank` (slot 0 all zeros: the base model), random in the others; each
        row of the step uses row_slots[row]."""
        self.lora = np.asarray(row_slots, np.int32)
        self.lora_a = {n: (rng.standard_normal((slots, p, k)) * 0.3).astype(np.float32)
                       for n, p, k in self._lora_shapes(rank)}
        self.lora_b = {n: (rng.standard_normal((slots, o, rank)) * 0.3).astype(np.float32)
                       for n, o in self._lora_outs()}
        for arrays in (self.lora_a, self.lora_b):
            for arr in arrays.values():
                arr[0] = 0

    def _lora_delta(self, name, x, parts_bounds):
        """(B, N) float64: each row's B[slot] . (A[slot] x) per output row, each reading its part's slice."""
        a, b = self.lora_a[name].astype(np.float64), self.lora_b[name].astype(np.float64)
        r = b.shape[2]
        out = np.zeros((len(x), b.shape[1]))
        for row, slot in enumerate(self.lora):
            u = a[slot] @ x[row]
            for p, (lo, hi) in enumerate(parts_bounds):
                out[row, lo:hi] = b[slot, lo:hi] @ u[p * r:(p + 1) * r]
        return out

    def quantize(self, types: dict, rng):
        """Give the kernel the named matrices in GGUF's quantized forms (name -> gguf type), and the norms random
        gains (not folded into quantized rows); the reference then uses the dequantized weights. K-quants (which
        gguf cannot make) are random blocks of about the float weights' scale instead."""
        from gguf.quants import dequantize

        self.in_gain = (1 + 0.3 * rng.standard_normal(self.h)).astype(np.float32)
        self.post_gain = (1 + 0.3 * rng.standard_normal(self.h)).astype(np.float32)
        for name, qtype in types.items():              # a fused name: each of its parts; or one part alone
            for part in FUSED.get(name, (name,)):
                fused = next(f for f, parts in FUSED.items() if part in parts)
                rows = getattr(self, fused)[self._rows(part)]
                raw = quantized_rows(np.ascontiguousarray(rows), qtype, rng)
                rows[...] = dequantize(raw, qtype).astype(np.float32).reshape(rows.shape)   # (a view: in place)
                self.kernel_weights[part] = (raw.view(np.uint8), int(qtype))

    def arrays(self, threads, out=None, invariant=None):
        """The kernel's parameters; invariant (1 or 0): the call's batch-invariance entry (iconfig[11]), None: none
        (the process's setting, KernelInvariant)."""
        w = self.kernel_weights
        features = [self.activation, int(self.qk_norm), int(self.sandwich), self.window]
        encoder = [self.norm, int(self.post), int(self.gated), int(self.mlp_bias)]
        length = self.iconfig_len or (22 if encoder != [0, 0, 1, 0] else 18 if self.sinks is not None
                                      else 16 if any(features) else 11 if invariant is None else 12)
        icfg = np.array(([self.bs, self.nh, self.kvh, threads] + [w[n][1] for n in PARTS]
                         + [-1 if invariant is None else invariant] + features
                         + [1, int(self.sinks is not None)] + encoder)[:length], np.int32)
        fcfg = [1e-5] + ([] if self.attention_scale is None else [self.attention_scale])
        out = np.full_like(self.x, np.nan) if out is None else out
        lora = {f"lora_{n}_{ab}": arr for n in ("qkv", "o", "gate_up", "down")
                for ab, arr in (("a", self.lora_a[n]), ("b", np.ascontiguousarray(self.lora_b[n].transpose(0, 2, 1))))}
        return [*DECODER_LAYER.args(
            x=self.x, positions=self.positions, slots=self.slots, block_tables=self.tables, context_lens=self.context,
            tree_bits=self.tree, cos=self.cos, sin=self.sin, qkv_bias=self.qkv_b, input_gain=self.in_gain,
            o_bias=self.o_b, sinks=np.zeros(self.nh, np.float32) if self.sinks is None else self.sinks,
            **{n: np.ascontiguousarray(w[n][0]) for n in PARTS},
            post_gain=self.post_gain, q_norm=self.q_norm, k_norm=self.k_norm, attn_out_gain=self.attn_out_gain,
            mlp_out_gain=self.mlp_out_gain, gate_up_bias=self.gate_up_b, down_bias=self.down_b, norm_bias=self.norm_b,
            key_cache=self.cache.arg(self.key_cache),
            value_cache=self.cache.arg(self.value_cache), lora=self.lora,
            iconfig=icfg, fconfig=np.array(fcfg, np.float32), **lora), out]

    def reference(self, library, stored_kv: bool = False):
        """(output, key cache, value cache) in float64, from the caches as they are now; each product's input
        rounded as `library` rounds it (integer_path). stored_kv: the step's K/V are read from the caches (as the
        kernel stored them: a float16 cache's rounding of a float32 value can go to the other neighbour of the
        float64 one's), not computed."""
        b, nh, kvh, d = self.b, self.nh, self.kvh, self.d
        computed = b
        while computed > 0 and self.slots[computed - 1] < 0:
            computed -= 1
        paths = {parts: integer_path(library, computed, [self.kernel_weights[n][1] for n in parts])
                 for parts in (("q_w", "k_w", "v_w"), ("o_w",), ("gate_w", "up_w"), ("up_w",), ("down_w",))}
        path = lambda *parts: paths[parts]                                       # noqa: E731
        self.rounded = any(paths.values())
        nb = self.norm_b.astype(np.float64)

        def norm(x, gain, row):             # the layer's norm: RMSNorm, or LayerNorm with norm_b[row]
            return layer_norm(x) * gain + nb[row] if self.norm else rms(x) * gain

        xn = self.x.astype(np.float64) if self.post else norm(self.x, self.in_gain, 0)
        nq, nk = nh * d, (nh + kvh) * d
        qkv = rounded(xn, path("q_w", "k_w", "v_w")) @ self.qkv_w.T.astype(np.float64) + self.qkv_b
        qkv = (qkv + self._lora_delta("qkv", xn, ((0, nq), (nq, nk), (nk, nk + kvh * d)))).reshape(b, nh + 2 * kvh, d)
        if self.qk_norm:                                   # each q and k head RMS-normalized, before RoPE
            qkv = np.concatenate([rms(qkv[:, :nh]) * self.q_norm, rms(qkv[:, nh:nh + kvh]) * self.k_norm,
                                  qkv[:, nh + kvh:]], 1)
        swapped = np.concatenate([qkv[..., d // 2:], qkv[..., :d // 2]], -1)
        roped = qkv * self.cos[self.positions][:, None] + swapped * self.sin[self.positions][:, None]
        q = roped[:, :nh] * (1 / np.sqrt(d) if self.attention_scale is None else np.float32(self.attention_scale))
        k, v = roped[:, nh:nh + kvh], qkv[:, nh + kvh:]
        keys, values = self.cache.values(self.key_cache), self.cache.values(self.value_cache)
        stored = lambda a: self.cache.values(self.cache.store(a.astype(np.float32)))  # noqa: E731  (as the cache keeps it)
        if not stored_kv:
            keys.reshape(-1, kvh, d)[self.slots] = stored(k)
            values.reshape(-1, kvh, d)[self.slots] = stored(v)
        visible = None if (self.tree == -1).all() else [tree_visible(c, t) for c, t in zip(self.context, self.tree)]
        sinks = None if self.sinks is None else self.sinks.reshape(kvh, nh // kvh)
        attn = attention_reference(q.reshape(b, kvh, nh // kvh, d), keys, values, self.tables, self.context,
                                   self.bs, visible, self.window, sinks).reshape(b, -1)
        o = rounded(attn, path("o_w")) @ self.o_w.T + self.o_b + self._lora_delta("o", attn, ((0, self.h),))
        x1 = self.x + (norm(o, self.attn_out_gain, 2) if self.sandwich else o)
        if self.post:                           # BERT: the norm after the residual add, the MLP's input as it is
            x1 = norm(x1, self.attn_out_gain, 2)
        xn1 = x1 if self.post else norm(x1, self.post_gain, 1)
        gate_up = rounded(xn1, path("gate_w", "up_w") if self.gated else path("up_w")) @ self.gate_up_w.T \
            + self._lora_delta("gate_up", xn1, ((0, self.i), (self.i, 2 * self.i)))
        gate_up = gate_up + (self.gate_up_b if self.mlp_bias else 0)
        gate, up = gate_up[:, :self.i], gate_up[:, self.i:]
        if not self.gated:                      # f(up)
            gate, up = up, 1.0
        f = {0: lambda g: g / (1 + np.exp(-g)), 1: gelu_tanh, 2: gelu_erf}[self.activation]
        act = f(gate) * up
        down = rounded(act, path("down_w")) @ self.down_w.T + self._lora_delta("down", act, ((0, self.h),))
        down = down + (self.down_b if self.mlp_bias else 0)
        out = x1 + (norm(down, self.mlp_out_gain, 3) if self.sandwich else down)
        return (norm(out, self.mlp_out_gain, 3) if self.post else out), keys, values


# hidden sizes and MLP widths that are not multiples of the 16-float vectors, batches not multiples of the
# 4-row tiles, grouped and plain attention, with and without a q/k/v bias, 1-3 threads
@pytest.mark.parametrize("hidden,heads,kv_heads,head_dim,inter,batch,bias,threads,cache", [
    (64, 8, 4, 8, 172, 1, False, 1, "float32"),
    (64, 8, 4, 8, 172, 3, True, 2, "float32"),
    (72, 6, 2, 12, 100, 9, True, 3, "float32"),
    (128, 4, 4, 32, 256, 6, False, 2, "float32"),
    (48, 3, 1, 16, 40, 1, True, 2, "float32"),
    (64, 8, 4, 8, 172, 1, False, 1, "float16"),
    (72, 6, 2, 12, 100, 9, True, 3, "float16"),
    (128, 4, 4, 32, 256, 6, False, 2, "float16"),
    (72, 6, 2, 12, 100, 9, True, 3, "bfloat16"),
    (128, 4, 4, 32, 256, 6, False, 2, "bfloat16"),
    (72, 6, 2, 12, 100, 9, True, 3, "int8"),
    (128, 4, 4, 32, 256, 6, False, 2, "int8"),
])
def test_layer_matches_numpy(library, invariant_mode, hidden, heads, kv_heads, head_dim, inter, batch, bias, threads, cache):
    """A float16 or bfloat16 cache (pa_config.kv_cache_dtype): the reference attends over the same values, the
    step's K/V rounded to the cache's type as the kernel stores them."""
    rng = np.random.default_rng(hidden + batch + threads)
    layer = Layer(rng, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim, inter=inter, batch=batch,
                  bias=bias, cache_dtype=cache)
    check_layer(library, layer, threads)


@pytest.mark.parametrize("head_dim,threads,cache", [(64, 1, "float32"), (64, 2, "float16"), (128, 2, "float32"),
                                                    (128, 3, "float16"), (64, 2, "bfloat16"), (64, 2, "int8"),
                                                    (128, 3, "int8")])
def test_a_prompts_rows_attend_together_as_tiles(library, invariant_mode, head_dim, threads, cache):
    """Consecutive rows of one sequence (a prompt's chunk) attend as tiles of rows per KV head: a chunk of 45 rows
    (two tiles, the first over keys past two key tiles) after 100 cached tokens, a decode row of a short context
    (attend_row), one of 301 keys (a one-row tile), and a prompt's first 7 tokens; the result is the row-by-row
    reference's."""
    rng = np.random.default_rng(head_dim + threads)
    layer = Layer(rng, hidden=128, heads=8, kv_heads=2, head_dim=head_dim, inter=96, batch=54, block_size=16,
                  num_blocks=54 * 20, width=20, cache_dtype=cache)
    layer.as_prompts(rng, [(100, 45), (37, 1), (300, 1), (0, 7)])
    _, keys, values = layer.reference(library)
    arrays = layer.arrays(threads)
    assert invoke(library.DecoderLayer, arrays) == 0
    assert_cache_close(layer, layer.key_cache, keys)
    assert_cache_close(layer, layer.value_cache, values)
    # each row attends over the K/V the rows before it stored (a float16 cache: as the kernel rounded them)
    assert_layer_close(layer, arrays[-1], layer.reference(library, stored_kv=True)[0])


@pytest.mark.parametrize("threads", [1, 2])
def test_rows_with_slot_minus_one_sit_the_step_out(library, threads):
    """A row whose slot is -1 writes no K/V and leaves the other rows' outputs as a step without it gives
    them; a step every row sits out returns its input and touches nothing."""
    layer = Layer(np.random.default_rng(5), hidden=64, heads=8, kv_heads=4, head_dim=8, inter=96, batch=3)
    keys0, values0 = layer.key_cache.copy(), layer.value_cache.copy()
    want, keys, values = layer.reference(library)
    gone, position = layer.slots[1], layer.positions[1]
    layer.slots[1] = -1
    layer.positions[1] = 10_000                  # out of range: not looked at for a row sitting out
    arrays = layer.arrays(threads)
    assert invoke(library.DecoderLayer, arrays) == 0
    np.testing.assert_allclose(arrays[-1][[0, 2]], want[[0, 2]], rtol=1e-4, atol=1e-4)
    # rows 0 and 2 wrote their K/V; row 1's slot (in the reference's caches) did not change
    skipped = np.zeros(len(keys0) // layer.kvh, bool)
    skipped[gone] = True
    kept = np.repeat(~skipped, layer.kvh)
    np.testing.assert_allclose(layer.key_cache[kept], keys.reshape(-1, 8)[kept], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(layer.key_cache[~kept], keys0[~kept])
    np.testing.assert_array_equal(layer.value_cache[~kept], values0[~kept])
    # rows sitting out at the end of the batch (padding) are not computed: their output is their input
    layer.slots[1], layer.positions[1], layer.slots[2] = gone, position, -1
    arrays = layer.arrays(threads)
    assert invoke(library.DecoderLayer, arrays) == 0
    np.testing.assert_allclose(arrays[-1][:2], want[:2], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(arrays[-1][2], layer.x[2])
    layer.slots[:] = -1
    before = layer.key_cache.copy()
    arrays = layer.arrays(threads)
    assert invoke(library.DecoderLayer, arrays) == 0
    np.testing.assert_array_equal(arrays[-1], layer.x)
    np.testing.assert_array_equal(layer.key_cache, before)


def test_thread_counts_agree(library):
    """The same step split over 1, 2 and 4 threads (each count its own pool) gives the same output."""
    outs = []
    for threads in (1, 2, 4):
        layer = Layer(np.random.default_rng(3), hidden=64, heads=8, kv_heads=4, head_dim=8, inter=172, batch=5)
        arrays = layer.arrays(threads)
        assert invoke(library.DecoderLayer, arrays) == 0
        outs.append(arrays[-1])
    np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(outs[2], outs[0], rtol=1e-5, atol=1e-6)


def test_a_forked_child_gets_its_own_workers(library):
    """A process forked after the kernel made its thread pool (whose workers the child does not have) still runs
    the kernel on two threads instead of waiting forever for the parent's workers."""
    layer = Layer(np.random.default_rng(4), hidden=64, heads=8, kv_heads=4, head_dim=8, inter=64, batch=3)
    assert invoke(library.DecoderLayer, layer.arrays(2)) == 0
    pid = os.fork()
    if pid == 0:                                                  # the child: exit code = the kernel's
        os._exit(invoke(library.DecoderLayer, layer.arrays(2)))
    assert_child_exits_0(pid, 30)


def test_token_tree_bits_reach_the_attention(library):
    """A row whose tree bits hide its previous key attends differently from the same row with all keys."""
    layer = Layer(np.random.default_rng(8), hidden=64, heads=8, kv_heads=4, head_dim=8, inter=64, batch=2)
    layer.context[:] = 10
    layer.positions[:] = 9
    layer.slots = (layer.tables[:, 2] * layer.bs + 1).astype(np.int32)
    base = layer.arrays(2)
    k0, v0 = layer.key_cache.copy(), layer.value_cache.copy()
    assert invoke(library.DecoderLayer, base) == 0
    layer.key_cache[:], layer.value_cache[:] = k0, v0
    layer.tree[:] = [-1, ~0b10]                                     # row 1 does not see the key before its own
    tree = layer.arrays(2)
    assert invoke(library.DecoderLayer, tree) == 0
    np.testing.assert_array_equal(tree[-1][0], base[-1][0])
    assert not np.allclose(tree[-1][1], base[-1][1])


def test_refusals(library):
    layer = Layer(np.random.default_rng(1), hidden=64, heads=8, kv_heads=4, head_dim=8, inter=64, batch=2)
    arrays = layer.arrays(1)
    assert invoke(library.DecoderLayer, arrays[:-1]) == 1                        # an input missing
    wrong_rank = list(arrays)
    wrong_rank[0] = layer.x.reshape(-1)
    assert invoke(library.DecoderLayer, wrong_rank) == 1
    wrong_shape = list(arrays)
    wrong_shape[O_W] = layer.o_w[:, :-8].copy()                                   # o_proj for fewer heads
    assert invoke(library.DecoderLayer, wrong_shape) == 2
    for name, bad in (("positions", 64), ("slots", len(layer.key_cache) // layer.kvh), ("tables", 60)):
        step = Layer(np.random.default_rng(1), hidden=64, heads=8, kv_heads=4, head_dim=8, inter=64, batch=2)
        getattr(step, name)[0] = bad                                              # one past the end
        if name == "tables":
            step.tables[0, :] = bad
        before = step.key_cache.copy()
        assert invoke(library.DecoderLayer, step.arrays(1)) == 3, name
        np.testing.assert_array_equal(step.key_cache, before)                     # refused before any write


@pytest.mark.parametrize("vocab,rows,threads", [(512, 1, 1), (500, 3, 2), (1000, 5, 3), (1000, 17, 3), (700, 70, 2)])
def test_final_logits_token_and_logprob(library, invariant_mode, vocab, rows, threads):
    rng = np.random.default_rng(vocab + rows)
    x = rng.standard_normal((rows, 48)).astype(np.float32)
    w = rng.standard_normal((vocab, 48)).astype(np.float32)
    w[7] = w[3]                  # tokens 3 and 7 always tie: the greedy token is never 7 (first index wins)
    logits, token = np.empty((rows, vocab), np.float32), np.empty(rows, np.int32)
    logprob = np.empty(rows, np.float32)
    slots = np.arange(rows, dtype=np.int32)
    slots[0] = -1 if rows > 1 else 0       # a row sitting out is computed as any other while some row is in
    gain = np.ones(48, np.float32)
    cfg = [np.array([threads, 0], np.int32), np.array([1e-5], np.float32)]
    assert invoke(library.FinalLogits, logits_args(x, w, gain, slots, cfg, logits, token, logprob)) == 0
    want = rms(x) @ w.T.astype(np.float64)
    np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4)
    assert token.tolist() == np.argmax(logits, -1).tolist() and 7 not in token.tolist()
    log_softmax = want - want.max(-1, keepdims=True)
    log_softmax -= np.log(np.exp(log_softmax).sum(-1, keepdims=True))
    np.testing.assert_allclose(logprob, log_softmax[np.arange(rows), token], rtol=1e-5, atol=1e-6)
    # a tie at the top, across the threads' shares of the vocabulary: the first index is the greedy token
    x[0] = 0
    x[0, 0] = 1
    w[:, 0] = 0
    w[[vocab - 2, 4], 0] = 5.0
    assert invoke(library.FinalLogits, logits_args(x, w, gain, slots, cfg, logits, token, logprob)) == 0
    assert token[0] == 4 and logits[0, 4] == logits[0, vocab - 2]
    # a row sitting out at the end (padding) is not computed: token 0, log-probability 0
    if rows > 1:
        tail = slots.copy()
        tail[-1] = -1
        first_tokens, first_logprobs = token.copy(), logprob.copy()
        assert invoke(library.FinalLogits, logits_args(x, w, gain, tail, cfg, logits, token, logprob)) == 0
        assert token[:-1].tolist() == first_tokens[:-1].tolist() and token[-1] == 0 and logprob[-1] == 0
        if invariant_mode:      # the same bits whatever the rows; the fastest products pick their route by the
            np.testing.assert_array_equal(logprob[:-1], first_logprobs[:-1])     # rows (AVX2: 1 ulp apart)
        else:
            np.testing.assert_allclose(logprob[:-1], first_logprobs[:-1], rtol=1e-6, atol=1e-6)
    # every row sitting out (a decode run's step after all its rows ended): nothing computed, tokens 0
    logits[:] = np.nan
    none = np.full(rows, -1, np.int32)
    assert invoke(library.FinalLogits, logits_args(x, w, gain, none, cfg, logits, token, logprob)) == 0
    assert np.isnan(logits).all() and token.tolist() == [0] * rows and logprob.tolist() == [0.0] * rows
    assert invoke(library.FinalLogits, logits_args(x, w, gain, slots[:-1].copy(), cfg, logits, token, logprob)) == 2


GGUF_TYPES = pytest.importorskip("gguf").GGMLQuantizationType


K_QUANTS = (GGUF_TYPES.Q4_K, GGUF_TYPES.Q5_K, GGUF_TYPES.Q6_K)
NEW_TYPES = (*K_QUANTS, GGUF_TYPES.Q5_0, GGUF_TYPES.Q5_1, GGUF_TYPES.BF16)


@pytest.mark.parametrize("qtype,threads,batch", [
    (GGUF_TYPES.Q4_1, 2, 1), (GGUF_TYPES.Q4_1, 1, 6), (GGUF_TYPES.Q4_0, 2, 3), (GGUF_TYPES.Q4_0, 1, 2),
    (GGUF_TYPES.Q8_0, 3, 5), (GGUF_TYPES.Q8_0, 2, 1), (GGUF_TYPES.F16, 2, 2), (GGUF_TYPES.F16, 1, 7),
    *[(qtype, 1 + (batch + i) % 3, batch) for i, qtype in enumerate(NEW_TYPES) for batch in (1, 2, 3 + i % 4)]])
@pytest.mark.parametrize("integer", [1, 0], ids=["integer", "tiles"])
def test_layer_reads_quantized_weights(library, invariant_mode, qtype, threads, batch, integer):
    """GGUF's own blocks in (as the file holds them): the layer equals the float64 layer on the dequantized
    weights, with the norms' gains applied to the activations instead of folded into the rows. One or two rows
    decode the blocks in registers, more share a dequantized tile (KernelInt(0), as on CPUs without AMX) or run
    on the integer tiles where they are: every way for every type. K-quants' rows are super-blocks of 256
    weights: their layer's widths are multiples of 256."""
    library.KernelInt.argtypes = [ctypes.c_int]
    library.KernelInt(integer)
    try:
        layer_reads(library, qtype, threads, batch)
    finally:
        library.KernelInt(1)


def layer_reads(library, qtype, threads, batch):
    rng = np.random.default_rng(int(qtype) + batch)
    if qtype in K_QUANTS:
        layer = Layer(rng, hidden=256, heads=4, kv_heads=2, head_dim=64, inter=512, batch=batch)
    else:
        layer = Layer(rng, hidden=64, heads=4, kv_heads=2, head_dim=16, inter=96, batch=batch)
    layer.quantize({n: qtype for n in ("qkv_w", "o_w", "gate_up_w", "down_w")}, rng)
    want, keys, values = layer.reference(library)
    arrays = layer.arrays(threads)
    assert arrays[Q_W].dtype == np.uint8 and arrays[ICFG].tolist()[4:] == [int(qtype)] * 7
    assert invoke(library.DecoderLayer, arrays) == 0
    assert_layer_close(layer, arrays[-1], want)
    assert_cache_close(layer, layer.key_cache, keys)


def test_layer_mixes_weight_types(library):
    """Each matrix has its own type (a GGUF may keep some in higher precision), float32 ones among them."""
    rng = np.random.default_rng(11)
    layer = Layer(rng, hidden=64, heads=4, kv_heads=2, head_dim=16, inter=96, batch=4)
    layer.quantize({"qkv_w": GGUF_TYPES.Q8_0, "gate_up_w": GGUF_TYPES.Q4_1}, rng)
    want, _, _ = layer.reference(library)
    arrays = layer.arrays(2)
    assert arrays[ICFG].tolist()[4:] == [8, 8, 8, 0, 3, 3, 0]
    assert invoke(library.DecoderLayer, arrays) == 0
    assert_layer_close(layer, arrays[-1], want)


@pytest.mark.parametrize("batch", [4, 20])
def test_a_product_mixing_block_types_and_k_quants(library, batch):
    """q/k/v of Q8_0, Q4_0 and Q6_K run a block of 32 at a time on the integer path, Q6_K's second pieces in the
    same row blocks as the others' zeros; gate/up of Q6_K and Q4_K a super-block at a time (per-row factors)."""
    rng = np.random.default_rng(90 + batch)
    layer = Layer(rng, hidden=256, heads=4, kv_heads=2, head_dim=64, inter=512, batch=batch, num_blocks=6 * batch + 6)
    layer.quantize({"q_w": GGUF_TYPES.Q8_0, "k_w": GGUF_TYPES.Q4_0, "v_w": GGUF_TYPES.Q6_K, "o_w": GGUF_TYPES.Q5_1,
                    "gate_w": GGUF_TYPES.Q6_K, "up_w": GGUF_TYPES.Q4_K, "down_w": GGUF_TYPES.Q5_0}, rng)
    want, keys, values = layer.reference(library)
    arrays = layer.arrays(2)
    assert invoke(library.DecoderLayer, arrays) == 0
    assert_layer_close(layer, arrays[-1], want)
    assert_cache_close(layer, layer.value_cache, values)


@pytest.mark.parametrize("batch,threads", [(1, 2), (3, 1), (12, 2)])
def test_each_part_of_a_fused_product_has_its_own_type(library, batch, threads):
    """q, k and v (and gate and up) are separate inputs, each in the type the file stores it: a Q4_K_M file keeps
    some layers' v and down as Q6_K beside Q4_K q/k/gate/up. In registers (1 row), from tiles (3) and through the
    batched product (12)."""
    rng = np.random.default_rng(40 + batch)
    layer = Layer(rng, hidden=256, heads=4, kv_heads=2, head_dim=64, inter=512, batch=batch, num_blocks=6 * batch + 6)
    layer.quantize({"q_w": GGUF_TYPES.Q4_K, "k_w": GGUF_TYPES.Q4_K, "v_w": GGUF_TYPES.Q6_K, "o_w": GGUF_TYPES.Q4_K,
                    "gate_w": GGUF_TYPES.Q4_K, "up_w": GGUF_TYPES.Q5_K, "down_w": GGUF_TYPES.Q6_K}, rng)
    want, keys, values = layer.reference(library)
    arrays = layer.arrays(threads)
    assert arrays[ICFG].tolist()[4:] == [12, 12, 14, 12, 12, 13, 14]
    assert invoke(library.DecoderLayer, arrays) == 0
    assert_layer_close(layer, arrays[-1], want)
    assert_cache_close(layer, layer.value_cache, values)


def test_quantized_weights_refusals(library):
    rng = np.random.default_rng(12)
    layer = Layer(rng, hidden=64, heads=4, kv_heads=2, head_dim=16, inter=96, batch=2)
    layer.quantize({"o_w": GGUF_TYPES.Q4_1}, rng)
    good = layer.arrays(1)
    raw = good[O_W]
    for bad_w, types in ((raw[:, :-1].copy(), None),                     # rows a byte short of 2 blocks
                         (raw, iconfig_types(o=0)),                      # uint8 rows called float32
                         (raw, iconfig_types(o=2)),                      # Q4_0's row length is not Q4_1's
                         (raw, iconfig_types(o=5)),                      # a type the kernel does not read
                         (layer.o_w, iconfig_types(o=3))):               # float32 rows called Q4_1
        arrays = list(good)
        arrays[O_W] = bad_w
        if types is not None:
            arrays[ICFG] = np.array(list(good[ICFG][:4]) + types, np.int32)
        assert invoke(library.DecoderLayer, arrays) == 2
    arrays = list(good)
    arrays[ICFG] = good[ICFG][:4].copy()                                     # the types missing from iconfig
    assert invoke(library.DecoderLayer, arrays) == 2
    # a width that is not whole 32-weight blocks cannot be quantized rows
    odd = Layer(rng, hidden=48, heads=3, kv_heads=1, head_dim=16, inter=40, batch=1)
    arrays = odd.arrays(1)
    arrays[DOWN_W] = np.zeros((48, 40 // 32 * 20 + 20), np.uint8)
    arrays[ICFG] = np.array(list(arrays[ICFG][:10]) + [3], np.int32)
    assert invoke(library.DecoderLayer, arrays) == 2
    # K-quant rows are whole super-blocks of 256 weights: o_proj's 64 (or 320) are not, whatever the bytes
    for code, size in ((12, 144), (13, 176), (14, 210)):
        for width in (64, 320):
            wide = Layer(rng, hidden=width, heads=4, kv_heads=2, head_dim=width // 4, inter=256, batch=1)
            arrays = wide.arrays(1)
            arrays[O_W] = np.zeros((width, -(-width // 256) * size), np.uint8)
            arrays[ICFG] = np.array(list(arrays[ICFG][:4]) + iconfig_types(o=code), np.int32)
            assert invoke(library.DecoderLayer, arrays) == 2, (code, width)


@pytest.mark.parametrize("qtype,rows", [(GGUF_TYPES.Q8_0, 3), (GGUF_TYPES.Q8_0, 1), (GGUF_TYPES.Q4_1, 2),
                                        (GGUF_TYPES.Q4_1, 20), (GGUF_TYPES.Q8_0, 40),
                                        *[(qtype, rows) for qtype in NEW_TYPES for rows in (1, 2, 4)]])
def test_final_logits_reads_a_quantized_lm_head(library, qtype, rows):
    from gguf.quants import dequantize

    rng = np.random.default_rng(int(qtype) + rows)
    vocab, h = 301 if qtype in NEW_TYPES else 300, 256 if qtype in K_QUANTS else 64    # 301: a 1-row tile too
    x = rng.standard_normal((rows, h)).astype(np.float32)
    raw = quantized_rows(rng.standard_normal((vocab, h)).astype(np.float32), qtype, rng)
    w = dequantize(raw, qtype).reshape(vocab, h)
    gain = (1 + 0.3 * rng.standard_normal(h)).astype(np.float32)
    logits, token, logprob = np.empty((rows, vocab), np.float32), np.empty(rows, np.int32), np.empty(rows, np.float32)
    cfg = [np.array([2, int(qtype)], np.int32), np.array([1e-5], np.float32)]
    slots = np.arange(rows, dtype=np.int32)
    assert invoke(library.FinalLogits, logits_args(x, raw, gain, slots, cfg, logits, token, logprob)) == 0
    want = rounded(rms(x) * gain, integer_path(library, rows, [int(qtype)])) @ w.T.astype(np.float64)
    np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4)
    assert token.tolist() == np.argmax(want, -1).tolist()
    cfg[0] = np.array([2, 0], np.int32)                                     # the same bytes called float32
    assert invoke(library.FinalLogits, logits_args(x, raw, gain, slots, cfg, logits, token, logprob)) == 2


@pytest.mark.parametrize("threads,row_slots,qtype", [
    (1, [2], None), (2, [0, 3], None), (2, [1, 0, 2, 3, 1, 0, 2], None), (3, [3, 3, 1, 0, 2], None),
    (2, [1, 2], GGUF_TYPES.Q4_1), (2, [0, 1, 2, 1, 3], GGUF_TYPES.Q8_0)])
def test_each_row_gets_its_own_lora_adapter(library, threads, row_slots, qtype):
    """Rows of one step under different adapters (slot 0: none): each row's q/k/v, o, gate/up and down products
    get B[slot] (A[slot] x), the fused products each part from its own slice of A x; with float32 and quantized
    base weights, in register-decoded (1-2 rows) and tiled batches."""
    rng = np.random.default_rng(len(row_slots) * 7 + threads)
    layer = Layer(rng, hidden=64, heads=4, kv_heads=2, head_dim=16, inter=96, batch=len(row_slots))
    if qtype is not None:
        layer.quantize({n: qtype for n in ("qkv_w", "o_w", "gate_up_w", "down_w")}, rng)
    layer.with_lora(slots=4, rank=3, row_slots=row_slots, rng=rng)
    want, keys, _ = layer.reference(library)
    arrays = layer.arrays(threads)
    assert invoke(library.DecoderLayer, arrays) == 0
    assert_layer_close(layer, arrays[-1], want)
    assert_cache_close(layer, layer.key_cache, keys)
    # and the adapters matter: the same step without them differs on every adapted row, not on the others
    plain = Layer(np.random.default_rng(len(row_slots) * 7 + threads), hidden=64, heads=4, kv_heads=2, head_dim=16,
                  inter=96, batch=len(row_slots))
    if qtype is not None:
        plain.quantize({n: qtype for n in ("qkv_w", "o_w", "gate_up_w", "down_w")},
                       np.random.default_rng(0))
    base_rows = np.array(row_slots) == 0
    if qtype is None:
        base_out = plain.arrays(threads)
        assert invoke(library.DecoderLayer, base_out) == 0
        np.testing.assert_array_equal(base_out[-1][base_rows], arrays[-1][base_rows])
        assert not np.isclose(base_out[-1][~base_rows], arrays[-1][~base_rows], rtol=1e-3).all(axis=1).any()


def test_lora_refusals(library):
    rng = np.random.default_rng(3)
    layer = Layer(rng, hidden=64, heads=4, kv_heads=2, head_dim=16, inter=96, batch=2)
    layer.with_lora(slots=3, rank=2, row_slots=[1, 3], rng=rng)
    assert invoke(library.DecoderLayer, layer.arrays(1)) == 3                  # slot 3 of 3 slots
    layer.lora[:] = [1, -1]
    assert invoke(library.DecoderLayer, layer.arrays(1)) == 3
    layer.lora[:] = [1, 2]
    layer.lora_b["o"] = layer.lora_b["o"][:, :, :1].copy()                      # B's rank differs from A's
    assert invoke(library.DecoderLayer, layer.arrays(1)) == 2
    layer.with_lora(slots=3, rank=2, row_slots=[1, 2], rng=rng)
    layer.lora_a["down"] = layer.lora_a["down"][:2].copy()                      # fewer slots than the others
    assert invoke(library.DecoderLayer, layer.arrays(1)) == 2


# The batched path (kGemmRows = 10 rows and more: x packed into panels of 32 rows, a last one of 16 when 16 or
# fewer remain; weights a group of 48 rows at a time, 24 past k = 4096; micro-kernels of 12 weight rows; depth
# blocks of 128 columns): row counts at and around the panel edges, widths that end mid depth block, row counts
# that end mid kernel and mid group, float32 and quantized, LoRA on and off, 1-3 threads.
@pytest.mark.parametrize("hidden,heads,kv_heads,head_dim,inter,batch,threads,qtype,adapters", [
    (200, 5, 1, 40, 300, 17, 2, None, False),             # k = 128 + 72; q/k/v 280 rows, 300 gate/up units
    (72, 6, 2, 12, 100, 70, 3, None, True),               # panels 32, 32 and a 16 with 6 rows
    (160, 4, 2, 40, 288, 130, 2, "Q8_0", True),           # 4 panels of 32 and a 16 with 2 rows
    (96, 4, 4, 24, 160, 10, 1, "Q4_1", False),            # the smallest batched step, one 16-row panel
    (64, 4, 2, 16, 96, 33, 3, "F16", False),              # a panel of 32 and one of a single row
    (64, 4, 2, 16, 4128, 17, 2, "Q4_0", True),            # down's k = 4128: groups of 24 rows
    (64, 4, 2, 16, 4128, 20, 1, None, False),
])
def test_batched_products_match_numpy(library, invariant_mode, hidden, heads, kv_heads, head_dim, inter, batch, threads, qtype,
                                      adapters):
    rng = np.random.default_rng(hidden + inter + batch)
    layer_matches_numpy(library, rng, dict(hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                           inter=inter, batch=batch), threads, qtype, adapters)


def layer_matches_numpy(library, rng, shape: dict, threads: int, qtype, adapters: bool) -> None:
    """A random layer of `shape` (every matrix in GGUF type `qtype`, or float32; LoRA adapters on its rows) against
    the float64 reference: output, K and V written."""
    batch = shape["batch"]
    layer = Layer(rng, **shape, num_blocks=batch * 6, width=6)
    if qtype is not None:
        layer.quantize({n: GGUF_TYPES[qtype] for n in ("qkv_w", "o_w", "gate_up_w", "down_w")}, rng)
    if adapters:
        layer.with_lora(slots=4, rank=3, row_slots=rng.integers(0, 4, batch), rng=rng)
    check_layer(library, layer, threads)


def test_batched_products_do_not_depend_on_the_thread_count(library):
    """Each output of a batched product is summed in the same order whichever thread (and chunk) computes it: the
    layer's output and the logits are the same to the bit on 1, 2 and 3 threads."""
    outs = []
    for threads in (1, 2, 3):
        rng = np.random.default_rng(21)
        layer = Layer(rng, hidden=160, heads=4, kv_heads=2, head_dim=40, inter=288, batch=40, num_blocks=240)
        layer.quantize({"gate_up_w": GGUF_TYPES.Q8_0, "down_w": GGUF_TYPES.Q4_1}, rng)
        arrays = layer.arrays(threads)
        assert invoke(library.DecoderLayer, arrays) == 0
        outs.append(arrays[-1])
    np.testing.assert_array_equal(outs[1], outs[0])
    np.testing.assert_array_equal(outs[2], outs[0])
    rng = np.random.default_rng(22)
    x = rng.standard_normal((24, 64)).astype(np.float32)
    w = rng.standard_normal((1000, 64)).astype(np.float32)
    gain, slots = np.ones(64, np.float32), np.arange(24, dtype=np.int32)
    results = []
    for threads in (1, 2, 3):
        logits, token, logprob = np.empty((24, 1000), np.float32), np.empty(24, np.int32), np.empty(24, np.float32)
        cfg = [np.array([threads, 0], np.int32), np.array([1e-5], np.float32)]
        assert invoke(library.FinalLogits, logits_args(x, w, gain, slots, cfg, logits, token, logprob)) == 0
        results.append((logits, token))
    for logits, token in results[1:]:
        np.testing.assert_array_equal(logits, results[0][0])
        np.testing.assert_array_equal(token, results[0][1])


ALL_READ = (GGUF_TYPES.F16, GGUF_TYPES.BF16, GGUF_TYPES.Q4_0, GGUF_TYPES.Q4_1, GGUF_TYPES.Q5_0, GGUF_TYPES.Q5_1,
            GGUF_TYPES.Q8_0, *K_QUANTS, GGUF_TYPES.MXFP4)


def dequantize_rows(library, code: int, raw: np.ndarray, rows: int, k: int):
    """(DequantizeRows' return code, its (rows, k) output)."""
    out = np.full((rows, k), np.nan, np.float32)
    fn = library.DequantizeRows
    fn.argtypes = [ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return fn(code, raw.ctypes.data, rows, k, out.ctypes.data), out


@pytest.mark.parametrize("qtype", ALL_READ, ids=[t.name for t in ALL_READ])
def test_dequantized_rows_are_gguf_s(library, qtype):
    """The kernel's decoding of every type it reads equals gguf's numpy dequantization (to float rounding: the
    kernel forms some weights with one fused multiply-add where numpy rounds twice), on valid random blocks:
    gguf's quantization of random rows, or random K-quant super-blocks (every code, scale and minimum)."""
    from gguf.quants import dequantize

    rng = np.random.default_rng(int(qtype))
    rows, k = 5, 768
    raw = np.ascontiguousarray(quantized_rows((rng.standard_normal((rows, k)) * 2).astype(np.float32), qtype, rng))
    if qtype in K_QUANTS:
        raw = random_k_blocks(rows, k, qtype, rng, scale=0.01)          # large values: more rounding to compare
    want = dequantize(raw, qtype).reshape(rows, k)
    code, got = dequantize_rows(library, int(qtype), raw, rows, k)
    assert code == 0
    assert np.isfinite(want).all() and np.abs(want).max() > 0
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def test_dequantize_rows_refusals(library):
    raw = np.zeros((2, 1024), np.uint8)
    for code, k in ((12, 128), (13, 320), (14, 32), (2, 48), (5, 64), (99, 256)):   # not whole (super-)blocks;
        assert dequantize_rows(library, code, raw, 2, k)[0] == 2, (code, k)        # types the kernel does not read
    assert dequantize_rows(library, 12, raw, 2, 512)[0] == 0


def test_a_layer_refuses_mxfp4_matrices(library):
    """MXFP4 (gpt-oss's experts) is read by MoeMlp and the dequantizing readers only: a DecoderLayer given one is
    refused (2), not run on another type's decoder."""
    from gguf.quants import quantize

    layer = Layer(np.random.default_rng(5), hidden=64, heads=4, kv_heads=2, head_dim=16, inter=96, batch=2)
    arrays = layer.arrays(1)
    at, icfg = DECODER_LAYER.index("o_w"), DECODER_LAYER.index("iconfig")
    arrays[at] = quantize(layer.o_w, GGUF_TYPES.MXFP4).view(np.uint8)
    arrays[icfg] = arrays[icfg].copy()
    arrays[icfg][4 + PARTS.index("o_w")] = int(GGUF_TYPES.MXFP4)
    assert invoke(library.DecoderLayer, arrays) == 2


# Both batched paths on this machine: with AMX (gemm_amx.h, where the CPU and Linux allow it; from kAmxGemmRows =
# 12 rows) and the float32 FMA kernel (gemm_cpu.h) that KernelAmx(0) forces (LLM_SERVING_KERNEL_AMX=0 at load does
# the same for a process).
@pytest.fixture
def fma_or_amx(library, request):
    """Sets the batched path for one test (request.param: 1 AMX when available, 0 FMA) and restores AMX after."""
    library.KernelAmx.argtypes = [ctypes.c_int]
    library.KernelAmx(request.param)
    yield request.param
    library.KernelAmx(1)


def amx_available(library) -> bool:
    library.KernelAmx.argtypes = [ctypes.c_int]
    return library.KernelAmx(-1) == 1


@pytest.mark.parametrize("fma_or_amx", [1, 0], ids=["amx", "fma"], indirect=True)
@pytest.mark.parametrize("hidden,heads,kv_heads,head_dim,inter,batch,threads,qtype,adapters", [
    (200, 5, 1, 40, 300, 33, 2, None, True),              # k = 200 (6 blocks of 32 and 8), rows 2 x 16 + 1
    (72, 6, 2, 12, 100, 37, 3, None, False),              # k = 72 and 100, 37 rows: tiles of 16, 16 and 5
    (96, 4, 2, 24, 160, 45, 2, "Q8_0", False),            # k = 96 and 160 (3 and 5 blocks), 45 rows
    (64, 4, 2, 16, 4128, 23, 2, "Q4_1", True),            # down's k = 4128: three AMX depth blocks (64 x 32)
])
def test_batched_products_on_either_path_match_numpy(library, fma_or_amx, hidden, heads, kv_heads, head_dim, inter,
                                                     batch, threads, qtype, adapters):
    """The AMX path (three bfloat16 pieces per float, six piece products) is as close to float64 as the float32
    FMA path, at widths that are not whole blocks of 32 and row counts that are not whole tiles of 16."""
    if fma_or_amx == 0:
        assert library.KernelAmx(-1) == 0
    rng = np.random.default_rng(hidden + inter + batch)
    layer_matches_numpy(library, rng, dict(hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                           inter=inter, batch=batch), threads, qtype, adapters)
    x = rng.standard_normal((batch, hidden)).astype(np.float32)
    w = rng.standard_normal((333, hidden)).astype(np.float32)
    logits, token, logprob = np.empty((batch, 333), np.float32), np.empty(batch, np.int32), np.empty(batch, np.float32)
    cfg = [np.array([threads, 0], np.int32), np.array([1e-5], np.float32)]
    gain, slots = np.ones(hidden, np.float32), np.arange(batch, dtype=np.int32)
    assert invoke(library.FinalLogits, logits_args(x, w, gain, slots, cfg, logits, token, logprob)) == 0
    np.testing.assert_allclose(logits, rms(x) @ w.T.astype(np.float64), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fma_or_amx", [1, 0], ids=["amx", "fma"], indirect=True)
def test_either_path_does_not_depend_on_the_thread_count(library, fma_or_amx):
    test_batched_products_do_not_depend_on_the_thread_count(library)


def test_the_environment_turns_amx_off(library_path):
    """LLM_SERVING_KERNEL_AMX=0 (read once, at the first kernel call) keeps a process on the FMA path."""
    import subprocess
    import sys

    code = (f"import ctypes; lib = ctypes.CDLL({library_path!r}); lib.KernelAmx.argtypes = [ctypes.c_int]; "
            "print(lib.KernelAmx(-1))")
    for env, want in (("0", "0"), ("1", None)):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "LLM_SERVING_KERNEL_AMX": env}).stdout.strip()
        assert out == (want if want is not None else out) and out in ("0", "1")


def test_a_forked_child_runs_the_batched_products(library):
    """The tile permission is asked for again by a forked child (and its pool is its own): a batched step there
    gives the parent's output to the bit."""
    layer = Layer(np.random.default_rng(5), hidden=96, heads=4, kv_heads=2, head_dim=24, inter=160, batch=20,
                  num_blocks=120)
    arrays = layer.arrays(2)
    assert invoke(library.DecoderLayer, arrays) == 0
    parent = arrays[-1].copy()
    pid = os.fork()
    if pid == 0:                                                  # the child: 0 when its output is the parent's
        again = Layer(np.random.default_rng(5), hidden=96, heads=4, kv_heads=2, head_dim=24, inter=160, batch=20,
                      num_blocks=120).arrays(2)
        code = invoke(library.DecoderLayer, again)
        os._exit(code if code != 0 else 0 if np.array_equal(again[-1], parent) else 9)
    assert_child_exits_0(pid, 60)


# The integer path (gemm_amx_int.h): quantized weights' codes on AMX's int8 tiles with 16-bit activations.
INTEGER_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def has_amx_int8() -> bool:
    """Whether this CPU has AMX's int8 tiles (the amx_int8 flag of /proc/cpuinfo)."""
    return "amx_int8" in cpu_flags()


@pytest.fixture
def integer_path_on(library):
    library.KernelInt.argtypes = [ctypes.c_int]
    if library.KernelInt(-1) == 0:
        pytest.skip("needs an integer path: AVX2's (a CPU with AVX2, FMA and F16C) or AMX's int8 tiles "
                    + ("(Linux did not grant this process the tile state: arch_prctl ARCH_REQ_XCOMP_PERM)"
                       if has_amx_int8() else "(no amx_int8 in /proc/cpuinfo: Intel Sapphire Rapids or later)"))
    yield
    library.KernelInt(1)


def integer_lm_head(name):
    """A batched lm_head of GGUF type `name` (37 rows of x whose blocks of 32 differ in scale, 160 x 512):
    (its normalized x and its dequantized weights in float64, logits(library): FinalLogits' logits on it)."""
    from gguf.quants import dequantize

    qtype = GGUF_TYPES[name]
    rng = np.random.default_rng(7 + int(qtype))
    rows, vocab, h = 37, 160, 512
    x = rng.standard_normal((rows, h)).astype(np.float32) * np.repeat(rng.uniform(0.1, 10, h // 32), 32).astype(np.float32)
    raw = quantized_rows(rng.standard_normal((vocab, h)).astype(np.float32), qtype, rng)
    w = dequantize(raw, qtype).reshape(vocab, h).astype(np.float64)
    gain = (1 + 0.3 * rng.standard_normal(h)).astype(np.float32)
    xn = rms(x) * gain
    cfg = [np.array([2, int(qtype)], np.int32), np.array([1e-5], np.float32)]
    slots = np.arange(rows, dtype=np.int32)

    def logits(library):
        out = [np.empty((rows, vocab), np.float32), np.empty(rows, np.int32), np.empty(rows, np.float32)]
        assert invoke(library.FinalLogits, logits_args(x, raw, gain, slots, cfg, *out)) == 0
        return out[0]

    return xn, w, logits


@pytest.mark.parametrize("name", INTEGER_TYPES)
def test_the_integer_path_rounds_activations_to_16_bits(library, integer_path_on, name):
    """A batched lm_head of every type with integer codes: the logits are the float64 product of the
    dequantized weights and x rounded to 16 bits per block (32, or on AMX's tiles the K-quants' 256), closer to
    that than to the unrounded product (so the path ran), and within 1e-4 of the largest logit of either."""
    xn, w, logits = integer_lm_head(name)
    exact = xn @ w.T
    block = integer_path(library, len(xn), [int(GGUF_TYPES[name])])
    amx_tiles = library.KernelInt(-1) & AMX_INT
    assert block == (256 if name.endswith("_K") and amx_tiles else 32)
    want = rounded(xn, block) @ w.T
    got, scale = logits(library), np.abs(exact).max()
    assert np.abs(got - want).max() < 1e-4 * scale
    assert np.abs(got - want).max() < 0.5 * np.abs(got - exact).max()


@pytest.mark.parametrize("name", INTEGER_TYPES)
def test_without_the_integer_path_a_batched_lm_head_is_float32_exact(library, name):
    """The same lm_head off the integer path (KernelInt(0), or a CPU without AMX's int8 tiles): the batched
    product of the dequantized weights (bfloat16 pieces on AMX, else the FMA kernel), float32's precision: within
    1e-4 of the largest logit of the unrounded product."""
    xn, w, logits = integer_lm_head(name)
    exact = xn @ w.T
    library.KernelInt.argtypes = [ctypes.c_int]
    library.KernelInt(0)
    try:
        assert integer_path(library, len(xn), [int(GGUF_TYPES[name])]) == 0
        np.testing.assert_allclose(logits(library), exact, rtol=1e-4, atol=1e-4 * np.abs(exact).max())
    finally:
        library.KernelInt(1)


def test_the_environment_turns_the_integer_path_off(library_path, library, integer_path_on):
    """LLM_SERVING_KERNEL_INT=0 (read once) keeps a process's quantized products on the float paths (dequantized
    weights); 1 gives it this process's integer paths."""
    import subprocess
    import sys

    code = (f"import ctypes; lib = ctypes.CDLL({library_path!r}); lib.KernelInt.argtypes = [ctypes.c_int]; "
            "print(lib.KernelInt(-1))")
    for env, want in (("0", "0"), ("1", str(library.KernelInt(-1)))):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "LLM_SERVING_KERNEL_INT": env}).stdout.strip()
        assert out == want, (env, out)



# The integer path of gemm_avx2_int.h: the codes as int16 times x rounded to 16 bits per block of 32
# (_mm256_madd_epi16, each block's sum exact in int32, then scaled in float32 in one order for every output), at
# every row count. IntegerProduct is its product alone (x rounded there, no norm in front).
BLOCK_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,)}   # f16 d (and m) offsets


def random_blocks(rows: int, cols: int, qtype, rng, scale: float = 1e-3) -> np.ndarray:
    """(rows, row bytes) of blocks of random bytes (every code, every fifth bit, Q8_0's -128 too) whose f16 scales
    (and minimums) are about `scale`; K-quants: random_k_blocks."""
    import gguf

    if qtype.name.endswith("_K"):
        return random_k_blocks(rows, cols, qtype, rng, scale)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for at in BLOCK_FIELDS[qtype.name]:
        field = (scale * rng.uniform(0.5, 2, (len(blocks), 1)) * rng.choice([-1, 1], (len(blocks), 1)))
        blocks[:, at:at + 2] = field.astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, cols // block * size)


def integer_product(library, code: int, raw: np.ndarray, k: int, x: np.ndarray):
    """(IntegerProduct's return code, its (len(x), rows) output) for weight rows `raw` of GGML type `code`."""
    fn = library.IntegerProduct
    fn.argtypes = [ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_void_p]
    raw, x = np.ascontiguousarray(raw), np.ascontiguousarray(x, np.float32)
    out = np.full((len(x), len(raw)), np.nan, np.float32)
    return fn(code, raw.ctypes.data, len(raw), k, x.ctypes.data, len(x), out.ctypes.data), out


@pytest.fixture
def avx2_integer(library):
    library.KernelInt.argtypes = [ctypes.c_int]
    library.KernelInt(1)
    if not library.KernelInt(-1) & AVX2_INT:
        pytest.skip("gemm_avx2_int.h's integer path needs a CPU with AVX2, FMA and F16C")


def scaled_rows(rng, m: int, k: int) -> np.ndarray:
    """(m, k) float32 rows whose blocks of 32 differ in scale by up to 1e4 (each block rounds against its own)."""
    return (rng.standard_normal((m, k)) * np.repeat(rng.uniform(0.01, 100, (m, k // 32)), 32, axis=1)).astype(np.float32)


@pytest.mark.parametrize("name", INTEGER_TYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 17])
def test_the_avx2_integer_product_is_the_float64_product_of_x_rounded_per_block(library, avx2_integer, name, m):
    """Every type on both of its ways (1-2 rows of x: weights decoded in registers; more: unpacked once per tile),
    widths that end mid group (3 and 9 blocks of 32) and whole ones, random blocks (every code: Q8_0's -128, Q5's
    fifth bits, K-quant scales and minimums) and gguf's quantization: within 5e-7 of the sum of |w x| of the
    float64 product of the dequantized weights and x rounded to 16 bits per block of 32 (float32's rounding of a
    few scaled sums), closer to it than to the unrounded product (so x was rounded, per block of 32)."""
    from gguf.quants import dequantize

    qtype = GGUF_TYPES[name]
    rng = np.random.default_rng(int(qtype) * 100 + m)
    widths = (256, 768) if name.endswith("_K") else (32, 96, 288, 512)
    for k in widths:
        for source in ("random", "gguf"):
            if source == "random":
                raw = random_blocks(37, k, qtype, rng)
            else:
                raw = quantized_rows((rng.standard_normal((37, k)) * 0.05).astype(np.float32), qtype, rng)
            w = dequantize(raw, qtype).reshape(37, k).astype(np.float64)
            x = scaled_rows(rng, m, k)
            code, got = integer_product(library, int(qtype), raw, k, x)
            assert code == 0
            want, exact = rounded(x, 32) @ w.T, x.astype(np.float64) @ w.T
            bound = np.abs(rounded(x, 32)) @ np.abs(w).T
            err = np.abs(got - want)
            assert (err <= 5e-7 * bound).all(), (k, source, float((err / bound).max()))
            assert err.max() < 0.5 * np.abs(got - exact).max(), (k, source)


def test_integer_product_refusals(library, avx2_integer):
    raw = np.zeros((2, 1024), np.uint8)
    x = np.zeros((1, 256), np.float32)
    for code, k in ((12, 128), (2, 48), (0, 256), (1, 256), (30, 256)):   # not whole blocks; float types
        assert integer_product(library, code, raw, k, x)[0] == 2, (code, k)


@pytest.mark.parametrize("name", INTEGER_TYPES)
def test_an_avx2_integer_products_rows_are_the_same_bits_among_any_rows(library, avx2_integer, name):
    """A row of x gets the same bits alone, beside one or two others, among 15, 16, 17 or 64 (the tiles of 4 rows
    of x and of 2 weight rows fall elsewhere each time), whichever rows are beside it and in which order."""
    qtype = GGUF_TYPES[name]
    rng = np.random.default_rng(int(qtype))
    k = 512 if name.endswith("_K") else 288
    raw = random_blocks(37, k, qtype, rng)
    x = scaled_rows(rng, 64, k)
    code, together = integer_product(library, int(qtype), raw, k, x)
    assert code == 0
    for n in (1, 2, 3, 15, 16, 17, 64):
        pick = rng.permutation(64)[:n]
        np.testing.assert_array_equal(integer_product(library, int(qtype), raw, k, x[pick])[1], together[pick],
                                      err_msg=f"{n} rows")
    for first in (0, 5, 20, 36):                  # and a weight row the same whichever weight rows are beside it
        np.testing.assert_array_equal(integer_product(library, int(qtype), raw[first:], k, x)[1], together[:, first:])

def test_sample_logits_follows_the_sampling_rule(library):
    """SampleLogits (the temperature-only sampler as a kernel): a row of temperature t > 0 takes the first token
    whose cumulative softmax(logits / t), in id order, exceeds u times the total; temperature 0 is greedy (the
    first index of the largest logit); the log-probability is log_softmax(logits) at the token (temperature 1)."""
    from llm_serving.models.kernels.signatures import SAMPLE_LOGITS

    rng = np.random.default_rng(3)
    rows, vocab = 9, 1000
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    logits[0, [17, 400]] = logits[0].max() + 1                # a tie: greedy takes the first
    temperature = np.array([0, 0, 0.5, 0.7, 1, 1, 2, 1.3, 0], np.float32)
    want = np.empty(rows, np.int64)
    u = np.empty(rows, np.float32)
    for b in range(rows):
        if temperature[b] == 0:
            want[b], u[b] = int(np.argmax(logits[b])), rng.random()
            continue
        z = logits[b].astype(np.float64) / temperature[b]
        p = np.exp(z - z.max())
        cdf = np.cumsum(p / p.sum())
        pick = int(rng.integers(0, 50)) if b % 2 else int(np.argmax(p))   # some tokens, the likeliest among them
        lo = cdf[pick - 1] if pick else 0.0
        want[b], u[b] = pick, (lo + cdf[pick]) / 2               # u in the middle of the token's interval
    token, logprob = np.empty(rows, np.int32), np.empty(rows, np.float32)
    args = [*SAMPLE_LOGITS.args(logits=logits, temperature=temperature, random_u=u,
                                iconfig=np.array([2], np.int32)), token, logprob]
    assert invoke(library.SampleLogits, args) == 0
    assert token.tolist() == want.tolist()
    l64 = logits.astype(np.float64)
    log_softmax = l64 - l64.max(-1, keepdims=True) - np.log(np.exp(l64 - l64.max(-1, keepdims=True)).sum(-1, keepdims=True))
    np.testing.assert_allclose(logprob, log_softmax[np.arange(rows), want], rtol=1e-5, atol=1e-5)
    assert invoke(library.SampleLogits, [*args[:2], u[:3], *args[3:]]) == 2          # rows that do not agree


# The model families' parts (iconfig[12..15], fconfig[1]): Qwen3's q/k head norms, Gemma 3's sandwich norms, GELU
# (tanh) and query scale, Mistral's and Gemma 3's sliding window; each against the float64 layer with the part.
FEATURES = {
    "qk_norm": dict(qk_norm=True),
    "attention_scale": dict(attention_scale=0.0625),
    "sandwich": dict(sandwich=True),
    "gelu": dict(activation=1),
    "silu_16": dict(activation=0),                         # an iconfig of 16 entries, every part off
    "gemma3": dict(qk_norm=True, sandwich=True, activation=1, attention_scale=0.2, window=9),
}


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("batch,threads,adapters", [(1, 1, False), (3, 2, True), (20, 2, False), (20, 3, True)])
def test_model_family_parts_match_numpy(library, invariant_mode, feature, batch, threads, adapters):
    """Each part alone and all of Gemma 3's together, in every MLP and product path: 1 row (registers), 3 rows
    (tiles; invariant: dot_gemm), 20 rows (the batched products; invariant: lane_units), LoRA on some rows (its
    deltas are in the products' results the sandwich norms normalize)."""
    rng = np.random.default_rng(batch * 10 + threads)
    layer = Layer(rng, hidden=64, heads=4, kv_heads=2, head_dim=16, inter=96, batch=batch, num_blocks=batch * 6 + 6)
    layer.with_features(rng, **FEATURES[feature])
    layer.iconfig_len = 16
    if adapters:
        layer.with_lora(slots=3, rank=2, row_slots=rng.integers(0, 3, batch), rng=rng)
    assert check_layer(library, layer, threads)[ICFG].shape == (16,)


def test_each_part_changes_the_output(library):
    """The parts are not vacuous: each changes every row's output from LLaMA's (same weights, same step)."""
    def output(**features):
        rng = np.random.default_rng(31)
        layer = Layer(rng, hidden=64, heads=4, kv_heads=2, head_dim=16, inter=96, batch=4)
        layer.context[:], layer.positions[:] = 20, 19
        layer.slots = (layer.tables[:, 4] * layer.bs + 3).astype(np.int32)
        arrays = layer.with_features(rng, **features).arrays(2)
        assert invoke(library.DecoderLayer, arrays) == 0
        return arrays[-1]

    base = output()
    for features in FEATURES.values():
        if any(features.values()):
            assert not np.isclose(output(**features), base, rtol=1e-4, atol=1e-5).all(axis=1).any(), features


# a BERT encoder's parts, alone and together (the encoder's layer: every one of them)
ENCODER_PARTS = {
    "layer_norm": dict(norm=1, post=False, gated=True, mlp_bias=False, activation=0),
    "post_norms": dict(norm=0, post=True, gated=True, mlp_bias=False, activation=0),
    "ungated": dict(norm=0, post=False, gated=False, mlp_bias=False, activation=1),
    "mlp_bias": dict(norm=0, post=False, gated=True, mlp_bias=True, activation=0),
    "gelu_erf": dict(norm=0, post=False, gated=True, mlp_bias=False, activation=2),
    "bert": {},
}


@pytest.mark.parametrize("part", list(ENCODER_PARTS))
@pytest.mark.parametrize("lengths,threads,qtype", [((3,), 1, None), ((5, 1, 7), 2, None), ((11, 9), 3, None),
                                                   ((2, 4), 2, "Q8_0"), ((13, 8), 2, "Q4_0")])
def test_encoder_parts_match_numpy(library, invariant_mode, part, lengths, threads, qtype):
    """Each of a BERT layer's parts alone and all together, on whole inputs side by side whose every token sees its
    whole input (context = its length: bidirectional attention), in the few-row, tile and batched paths (3, 13, 20
    rows) and on quantized weights (the integer paths' rounding in the reference too)."""
    import gguf

    rng = np.random.default_rng(sum(lengths) * 7 + threads)
    layer = Layer(rng, hidden=64, heads=4, kv_heads=4, head_dim=16, inter=96, batch=sum(lengths),
                  num_blocks=sum(lengths) * 6 + 6)
    layer.as_inputs(rng, lengths)
    layer.with_encoder(rng, **ENCODER_PARTS[part])
    if qtype is not None:
        layer.quantize({n: getattr(gguf.GGMLQuantizationType, qtype) for n in ("qkv_w", "o_w", "up_w", "down_w")},
                       rng)
    layer.iconfig_len = 22
    assert check_layer(library, layer, threads)[ICFG].shape == (22,)


def test_an_encoders_tokens_see_their_whole_input_and_only_it(library):
    """Bidirectional attention is each token's context: the first token of an input changes when its last one does,
    and an input beside another is computed as it is alone (to the bit, batch-invariant)."""
    library.KernelInvariant(1)

    rng = np.random.default_rng(5)
    layer = Layer(rng, hidden=64, heads=4, kv_heads=4, head_dim=16, inter=96, batch=15, num_blocks=96)
    layer.as_inputs(rng, (6, 9))
    layer.with_encoder(rng)
    arrays = layer.arrays(2)
    assert invoke(library.DecoderLayer, arrays) == 0
    beside = arrays[-1][:6].copy()
    for name in ("x", "positions", "slots", "tables", "context", "tree", "lora"):     # the first input alone
        setattr(layer, name, np.ascontiguousarray(getattr(layer, name)[:6]))
    layer.b = 6
    arrays = layer.arrays(2)
    assert invoke(library.DecoderLayer, arrays) == 0
    np.testing.assert_array_equal(arrays[-1], beside)
    alone = arrays[-1].copy()
    layer.x[5] *= 3.0                                # its last token changed: its first token's output changes
    arrays = layer.arrays(2)
    assert invoke(library.DecoderLayer, arrays) == 0
    assert np.abs(arrays[-1][0] - alone[0]).max() > 1e-3


def test_encoder_iconfig_refusals(library):
    """Post norms with sandwich norms, an unknown norm or activation, and a non-flag entry are refused (2)."""
    rng = np.random.default_rng(3)
    layer = Layer(rng, hidden=64, heads=4, kv_heads=4, head_dim=16, inter=96, batch=4)
    layer.with_encoder(rng)
    for at, value in ((14, 1), (18, 2), (12, 3), (19, 2), (20, 5), (21, -1)):
        arrays = layer.arrays(1)
        arrays[ICFG][at] = value
        assert invoke(library.DecoderLayer, arrays) == 2, (at, value)
    arrays = layer.arrays(1)
    arrays[DECODER_LAYER.index("norm_bias")] = np.zeros((3, 64), np.float32)
    assert invoke(library.DecoderLayer, arrays) == 2


@pytest.mark.parametrize("length", [11, 12])
def test_llama_iconfigs_of_11_and_12_entries_are_an_iconfig_of_16_with_every_part_off(library, invariant_mode, length):
    """An iconfig without the parts' entries (today's callers) and an fconfig of one entry give the same bits as
    16 entries of zeros and the attention scale 1/sqrt(D) given, in every path."""
    for batch in (1, 3, 20):
        outs = []
        for icfg_len, scale in ((length, None), (16, None), (16, float(np.float32(1) / np.sqrt(np.float32(16))))):
            rng = np.random.default_rng(batch)
            layer = Layer(rng, hidden=64, heads=4, kv_heads=2, head_dim=16, inter=96, batch=batch,
                          num_blocks=batch * 6 + 6)
            layer.iconfig_len, layer.attention_scale = icfg_len, scale
            want, _, _ = layer.reference(library)
            arrays = layer.arrays(2, invariant=invariant_mode)
            assert len(arrays[ICFG]) == icfg_len
            assert invoke(library.DecoderLayer, arrays) == 0
            assert_layer_close(layer, arrays[-1], want)
            outs.append(arrays[-1])
        np.testing.assert_array_equal(outs[1], outs[0])
        np.testing.assert_array_equal(outs[2], outs[0])


# windows smaller than, equal to and larger than the rows' contexts: as_prompts' chunk of 45 rows after 100 keys
# (contexts 101..145), decode rows of 38 and 301 keys, a prompt's first 7 tokens
WINDOWS = (1, 7, 38, 64, 100, 130, 301, 1000)


@pytest.mark.parametrize("head_dim,cache,windows", [
    (64, "float32", WINDOWS), (64, "float16", (7, 38, 130)), (64, "int8", (7, 100)), (64, "bfloat16", (38,)),
    (32, "float32", WINDOWS), (32, "float16", (38, 130)), (32, "int8", (7, 100)), (16, "float32", (5, 40))])
def test_a_sliding_window_matches_numpy(library, invariant_mode, head_dim, cache, windows):
    """Sliding-window attention (Mistral, Gemma 3's local layers): a row with context c sees keys c - W .. c - 1.
    Head dim 64 attends as tiles (a chunk's rows each with its own lower bound, key tiles below a chunk's
    lowest skipped), 32 and 16 row by row (attend_row, from the window's first key). A window at least the
    context is no window: the same bits as none."""
    rng = np.random.default_rng(head_dim + len(windows))
    layer = Layer(rng, hidden=128, heads=8, kv_heads=2, head_dim=head_dim, inter=96, batch=54, block_size=16,
                  num_blocks=54 * 20, width=20, cache_dtype=cache)
    layer.as_prompts(rng, [(100, 45), (37, 1), (300, 1), (0, 7)])
    fresh = layer.key_cache.copy(), layer.value_cache.copy()

    def run(window):
        layer.key_cache[...], layer.value_cache[...] = fresh
        layer.window = window
        arrays = layer.arrays(2)
        assert invoke(library.DecoderLayer, arrays) == 0
        return arrays[-1]

    none = run(0)
    for window in windows:
        got = run(window)
        assert_layer_close(layer, got, layer.reference(library, stored_kv=True)[0])
        wide = layer.context <= window
        np.testing.assert_array_equal(got[wide], none[wide], err_msg=f"window {window}")
        if window < 100:
            assert not np.allclose(got[~wide], none[~wide], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 32])
def test_keys_before_a_window_are_not_read(library, invariant_mode, head_dim):
    """A long context under a small window costs the window: the keys before it (before its first key tile, as
    tiles) are never read. NaN there leaves decode rows of 2,000 and 1,500 keys (a one-row tile each, invariant)
    and a chunk of 10 rows after 1,690 keys as they are with those keys intact."""
    rng = np.random.default_rng(77)
    window, bs = 100, 64
    layer = Layer(rng, hidden=64, heads=4, kv_heads=2, head_dim=head_dim, inter=64, batch=12, block_size=bs,
                  num_blocks=12 * 32, width=32)
    layer.as_prompts(rng, [(1999, 1), (1499, 1), (1690, 10)])
    layer.window = window
    fresh = layer.key_cache.copy(), layer.value_cache.copy()
    arrays = layer.arrays(2)
    assert invoke(library.DecoderLayer, arrays) == 0
    want = arrays[-1].copy()
    assert_layer_close(layer, want, layer.reference(library, stored_kv=True)[0])
    layer.key_cache[...], layer.value_cache[...] = fresh
    for row in (0, 1, 2):                               # each sequence's first row: its lowest bound
        first = layer.context[row] - window
        unread = first // 64 * 64 if llm_serving_tiles(head_dim) else first
        keys = np.arange(unread)
        slots = layer.tables[row][keys // bs] * bs + keys % bs
        rows = (slots[:, None] * layer.kvh + np.arange(layer.kvh)).reshape(-1)
        layer.key_cache[rows], layer.value_cache[rows] = np.nan, np.nan
    arrays = layer.arrays(2)
    assert invoke(library.DecoderLayer, arrays) == 0
    np.testing.assert_array_equal(arrays[-1], want)


def llm_serving_tiles(head_dim: int) -> bool:
    """Whether the kernels attend as key tiles at this head size (cpu_kernel_common.h's tile_head_dim)."""
    return head_dim % 64 == 0


@pytest.mark.parametrize("head_dim", [64, 16])
@pytest.mark.parametrize("cache", ["float32", "float16"])
def test_a_token_trees_rows_see_the_last_keys_of_their_window_they_can_see(library, invariant_mode, head_dim, cache):
    """A verify step's tree rows (tree bits hide some of the last keys): a window counts only the visible keys,
    taken in order as if consecutive (the last W of them), in attend_tile (64, invariant) and attend_row."""
    rng = np.random.default_rng(head_dim)
    layer = Layer(rng, hidden=64, heads=4, kv_heads=2, head_dim=head_dim, inter=96, batch=5, block_size=16,
                  num_blocks=60, width=6, cache_dtype=cache)
    layer.context[:] = [50, 51, 52, 53, 90]
    layer.positions[:] = layer.context - 1
    layer.slots = (layer.tables[np.arange(5), layer.positions // 16] * 16 + layer.positions % 16).astype(np.int32)
    layer.tree[:] = [-1, ~0b10, ~0b110, ~0b1101010, ~0b10101010]
    fresh = layer.key_cache.copy(), layer.value_cache.copy()
    for window in (1, 2, 3, 4, 10, 40, 100):
        layer.key_cache[...], layer.value_cache[...] = fresh
        layer.window = window
        arrays = layer.arrays(2)
        assert invoke(library.DecoderLayer, arrays) == 0
        assert_layer_close(layer, arrays[-1], layer.reference(library, stored_kv=True)[0])


@pytest.mark.parametrize("qtype,batch,threads", [("Q8_0", 1, 2), ("Q8_0", 3, 1), ("Q8_0", 12, 2), ("Q4_K", 1, 2),
                                                 ("Q4_K", 4, 2), ("Q4_K", 12, 3), ("Q4_1", 2, 2)])
@pytest.mark.parametrize("integer", [1, 0], ids=["integer", "tiles"])
def test_model_family_parts_on_quantized_weights(library, invariant_mode, qtype, batch, threads, integer):
    """Gemma 3's parts together on GGUF blocks (the gains on the activations, not folded into the rows): every
    product path, the integer tiles' rounded inputs where the CPU has them."""
    library.KernelInt.argtypes = [ctypes.c_int]
    library.KernelInt(integer)
    try:
        rng = np.random.default_rng(batch + len(qtype))
        k_quant = qtype.endswith("_K")
        layer = Layer(rng, hidden=256 if k_quant else 64, heads=4, kv_heads=2, head_dim=64 if k_quant else 16,
                      inter=512 if k_quant else 96, batch=batch, block_size=8, num_blocks=batch * 6 + 6)
        layer.quantize({n: GGUF_TYPES[qtype] for n in ("qkv_w", "o_w", "gate_up_w", "down_w")}, rng)
        layer.with_features(rng, qk_norm=True, sandwich=True, activation=1, attention_scale=0.1, window=13)
        check_layer(library, layer, threads)
    finally:
        library.KernelInt(1)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("runs", [[(0, 1), (5, 1), (20, 1)], [(0, 9), (3, 1)]], ids=["decode", "prompt"])
def test_gpt_oss_attention_sinks_and_o_bias_match_numpy(library, invariant_mode, runs, threads):
    """gpt-oss: each query head's sink logit in its softmax's denominator (attend_row's and attend_tile's: decode
    rows and a prompt's rows as tiles, with a sliding window), o_proj's bias added to its product."""
    rng = np.random.default_rng(31 + threads)
    batch = sum(n for _, n in runs)
    layer = Layer(rng, hidden=64, heads=4, kv_heads=2, head_dim=64, inter=96, batch=batch, block_size=8)
    layer.as_prompts(rng, runs)
    layer.with_features(rng, window=6)
    layer.sinks = (rng.standard_normal(4) * 2).astype(np.float32)
    layer.o_b = (rng.standard_normal(64) * 0.5).astype(np.float32)
    check_layer(library, layer, threads)
    with_them = layer.reference(library)[0]
    layer.sinks, layer.o_b = None, np.zeros(64, np.float32)
    assert np.abs(with_them - layer.reference(library)[0]).max() > 0.05         # they matter here


def test_a_layer_without_its_mlp_is_its_attention_and_residual(library):
    """iconfig[16] 0 (a mixture-of-experts layer, whose MLP MoeMlp runs next): out = x + attention, as the whole
    layer's with a down_proj of zeros (whose MLP then adds exactly 0), gate/up/down given as placeholders of one
    unit; the K/V written the same."""
    rng = np.random.default_rng(12)
    layer = Layer(rng, hidden=64, heads=4, kv_heads=2, head_dim=16, inter=96, batch=3)
    keys, values = layer.key_cache.copy(), layer.value_cache.copy()
    layer.iconfig_len = 16
    whole = layer.arrays(2)
    whole[DECODER_LAYER.index("down_w")] = np.zeros_like(whole[DECODER_LAYER.index("down_w")])
    assert invoke(library.DecoderLayer, whole) == 0
    want, want_keys = whole[-1].copy(), layer.key_cache.copy()
    layer.key_cache[...], layer.value_cache[...] = keys, values
    bare = layer.arrays(2)
    bare[DECODER_LAYER.index("iconfig")] = np.append(bare[DECODER_LAYER.index("iconfig")], 0).astype(np.int32)
    for name, shape in (("gate_w", (1, 64)), ("up_w", (1, 64)), ("down_w", (64, 1)), ("gate_up_bias", (2,))):
        bare[DECODER_LAYER.index(name)] = np.full(shape, np.nan, np.float32)             # never read
    for name in ("lora_gate_up_b", "lora_down_a"):
        at = DECODER_LAYER.index(name)
        bare[at] = np.zeros(bare[at].shape[:2] + ((2 if name == "lora_gate_up_b" else 1),), np.float32)
    assert invoke(library.DecoderLayer, bare) == 0
    np.testing.assert_array_equal(bare[-1], want)
    np.testing.assert_array_equal(layer.key_cache, want_keys)


def test_model_family_parts_refusals(library):
    """iconfig of another length (13, 23), an unknown activation, a flag not 0 or 1, a negative window, an fconfig
    of three, gains of the wrong size: refused (2) before any write."""
    layer = Layer(np.random.default_rng(2), hidden=64, heads=4, kv_heads=2, head_dim=16, inter=96, batch=2)
    layer.iconfig_len = 16
    good = layer.arrays(1)
    assert invoke(library.DecoderLayer, good) == 0
    icfg, fcfg = DECODER_LAYER.index("iconfig"), DECODER_LAYER.index("fconfig")
    bad = [(icfg, good[icfg][:13].copy()), (icfg, np.append(good[icfg], [1, 0, 0, 0, 1, 0, 0]).astype(np.int32)),
           (icfg, np.append(good[icfg], 2).astype(np.int32)), (icfg, np.append(good[icfg], [1, 2]).astype(np.int32)),
           (fcfg, np.array([1e-5, 0.1, 0.2], np.float32))]
    for at, value in ((12, 3), (12, -1), (13, 2), (14, -1), (15, -1)):
        changed = good[icfg].copy()
        changed[at] = value
        bad.append((icfg, changed))
    for name, size in (("q_norm", 15), ("k_norm", 17), ("attn_out_gain", 63), ("mlp_out_gain", 16), ("o_bias", 63),
                       ("sinks", 5)):
        bad.append((DECODER_LAYER.index(name), np.ones(size, np.float32)))
    for at, value in bad:
        arrays = list(good)
        arrays[at] = value
        before = layer.key_cache.copy()
        assert invoke(library.DecoderLayer, arrays) == 2, (DECODER_LAYER.params[at].name, value)
        np.testing.assert_array_equal(layer.key_cache, before)


def test_the_families_layer_bench_runs_and_writes_its_ratios(tmp_path):
    """bench/families_layer.py on its tiny shape: every step timed in the three forms (each call's return code
    checked by the script), the ratios written as the times give them."""
    import json

    from bench.families_layer import main

    out = tmp_path / "fl.json"
    assert main(["--shape", "tiny", "--steps", "decode:2:300,prefill:32:1100", "--seconds", "0.2",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["shape"] == "tiny" and result["window"] == 1024 and len(result["rows"]) == 2
    for row in result["rows"]:
        assert min(row["llama_ms"], row["global_ms"], row["sliding_ms"]) > 0 and row["calls"] >= 3
        assert row["sliding_vs_global"] == pytest.approx(row["sliding_ms"] / row["global_ms"])
        assert row["model_vs_llama"] == pytest.approx((5 * row["sliding_ms"] + row["global_ms"]) / 6 / row["llama_ms"])
