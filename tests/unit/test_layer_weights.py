"""A decoder layer's weights prepared in numpy (models/layer_weights.py): fusion, norm folding, the layer
kernel's inputs (stored quantized rows untouched, its config), the LoRA stacks' two layouts and the tensor-parallel
parts. No MindSpore needed."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from llm_serving.models.kernels.signatures import DECODER_LAYER, FINAL_LOGITS
from llm_serving.models.layer_weights import (LORA_PRODUCTS, LayerKernelConfig, LoraStack, prepare_head,
                                              prepare_layer)
from llm_serving.models.lora import LoraDelta
from llm_serving.models.parallel import TensorParallel
from llm_serving.models.weights import LlamaConfig, QuantizedTensor

CFG = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=4, rms_norm_eps=1e-6, attention_bias=True)
P = "model.layers.1."


def checkpoint(cfg: LlamaConfig = CFG, seed: int = 0) -> dict:
    """Random HF-named float32 tensors of layer 1 and the head (norm gains away from 1)."""
    rng = np.random.default_rng(seed)
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes = {"self_attn.q_proj.weight": (cfg.num_heads * d, h), "self_attn.k_proj.weight": (cfg.num_kv_heads * d, h),
              "self_attn.v_proj.weight": (cfg.num_kv_heads * d, h), "self_attn.o_proj.weight": (h, cfg.num_heads * d),
              "self_attn.q_proj.bias": (cfg.num_heads * d,), "self_attn.k_proj.bias": (cfg.num_kv_heads * d,),
              "self_attn.v_proj.bias": (cfg.num_kv_heads * d,), "mlp.gate_proj.weight": (i, h),
              "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)}
    w = {P + n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    for norm in ("input_layernorm", "post_attention_layernorm"):
        w[f"{P}{norm}.weight"] = (1 + 0.5 * rng.standard_normal(h)).astype(np.float32)
    w["lm_head.weight"] = rng.standard_normal((cfg.vocab_size, h)).astype(np.float32)
    w["model.norm.weight"] = (1 + 0.5 * rng.standard_normal(h)).astype(np.float32)
    return w


def stored(rows: int, rng, qtype: int = 8) -> QuantizedTensor:
    """Stand-in stored rows (their bytes are only carried, never decoded, here)."""
    return QuantizedTensor(qtype=qtype, shape=(rows, CFG.hidden_size), data=rng.integers(0, 256, (rows, 34), np.uint8))


def test_qkv_and_gate_up_are_fused_with_their_norm_gains_folded_in():
    w = checkpoint()
    layer = prepare_layer(CFG, w, 1)
    g_in, g_post = w[P + "input_layernorm.weight"], w[P + "post_attention_layernorm.weight"]
    nq, nkv = CFG.num_heads * CFG.head_dim, CFG.num_kv_heads * CFG.head_dim
    assert layer.qkv.shape == (nq + 2 * nkv, CFG.hidden_size) and layer.qkv.dtype == np.float32
    assert layer.gate_up.shape == (2 * CFG.intermediate_size, CFG.hidden_size)
    np.testing.assert_array_equal(layer.qkv[:nq], w[P + "self_attn.q_proj.weight"] * g_in)
    np.testing.assert_array_equal(layer.qkv[nq + nkv:], w[P + "self_attn.v_proj.weight"] * g_in)
    np.testing.assert_array_equal(layer.gate_up[CFG.intermediate_size:], w[P + "mlp.up_proj.weight"] * g_post)
    np.testing.assert_array_equal(layer.qkv_bias, np.concatenate([w[P + f"self_attn.{m}_proj.bias"] for m in "qkv"]))
    # no norm before o and down: the checkpoint's arrays themselves (no copy of the largest matrices)
    assert layer.o is w[P + "self_attn.o_proj.weight"] and layer.down is w[P + "mlp.down_proj.weight"]
    # the folded product is the unfolded one: (x g) W^T = x (W g)^T
    x = np.random.default_rng(1).standard_normal((5, CFG.hidden_size))
    unfolded = np.concatenate([(x * g_post) @ w[P + f"mlp.{m}_proj.weight"].T.astype(np.float64)
                               for m in ("gate", "up")], axis=1)
    np.testing.assert_allclose(x @ layer.gate_up.T.astype(np.float64), unfolded, rtol=1e-5, atol=1e-5)
    assert layer.kernel is None and layer.lora_stacks == {}
    assert prepare_layer(dataclasses.replace(CFG, attention_bias=False), w, 1).qkv_bias is None


def test_the_kernel_reads_stored_rows_untouched_and_the_gain_beside_them():
    w, rng = checkpoint(), np.random.default_rng(2)
    nq, nkv, i = CFG.num_heads * CFG.head_dim, CFG.num_kv_heads * CFG.head_dim, CFG.intermediate_size
    quantized = {P + "self_attn.q_proj.weight": stored(nq, rng), P + "self_attn.k_proj.weight": stored(nkv, rng),
                 P + "self_attn.v_proj.weight": stored(nkv, rng),
                 P + "mlp.gate_proj.weight": stored(i, rng, 8), P + "mlp.up_proj.weight": stored(i, rng, 2)}
    layer = prepare_layer(CFG, w, 1, kernel=LayerKernelConfig(block_size=16, threads=3), quantized=quantized)
    k = layer.kernel
    # q/k/v all stored: each part its stored rows themselves (no copy, no concatenation), each with its own type;
    # the input norm's gain given separately
    for m in "qkv":
        assert k.matrices[f"{m}_w"] is quantized[P + f"self_attn.{m}_proj.weight"].data
    np.testing.assert_array_equal(k.gains["input_gain"], w[P + "input_layernorm.weight"])
    # gate/up of two types, each its own; o and down not stored: float32 rows of the folded matrices (views)
    assert k.matrices["gate_w"] is quantized[P + "mlp.gate_proj.weight"].data
    assert k.matrices["up_w"] is quantized[P + "mlp.up_proj.weight"].data
    np.testing.assert_array_equal(k.gains["post_gain"], w[P + "post_attention_layernorm.weight"])
    assert k.matrices["o_w"].base is layer.o or k.matrices["o_w"] is layer.o
    np.testing.assert_array_equal(k.matrices["o_w"], layer.o)
    assert k.types == (8, 8, 8, 0, 8, 2, 0)
    # not invariant; SiLU, no q/k norms, no sandwich norms, no window, the layer's own MLP, no sinks, RMSNorm, pre
    # norms, a gated MLP without biases
    assert k.iconfig.tolist() == [16, CFG.num_heads, CFG.num_kv_heads, 3, 8, 8, 8, 0, 8, 2, 0, 0, 0, 0, 0, 0, 1, 0,
                                  0, 0, 1, 0]
    assert k.iconfig.dtype == np.int32
    assert k.fconfig.tolist() == [np.float32(1e-6), np.float32(CFG.head_dim ** -0.5)] and k.qkv_bias is layer.qkv_bias
    # the float32 copy the graphs use is still folded
    np.testing.assert_array_equal(layer.qkv[:nq], w[P + "self_attn.q_proj.weight"] * w[P + "input_layernorm.weight"])


def test_a_product_with_stored_and_float32_parts_gives_the_kernel_unfolded_float32_rows():
    """A product whose parts are partly stored (a type the kernel reads) and partly float32: the kernel applies
    the norm's gain to the activations for the whole product, so its float32 parts are the checkpoint's own
    rows, not the folded ones."""
    w, rng = checkpoint(), np.random.default_rng(3)
    nkv = CFG.num_kv_heads * CFG.head_dim
    quantized = {P + "self_attn.v_proj.weight": stored(nkv, rng)}
    k = prepare_layer(CFG, w, 1, kernel=LayerKernelConfig(block_size=16, threads=1, batch_invariant=True),
                      quantized=quantized).kernel
    assert k.types[:3] == (0, 0, 8)
    assert k.iconfig[DECODER_LAYER.iconfig_index("batch_invariant")] == 1          # in every call
    assert k.matrices["q_w"] is w[P + "self_attn.q_proj.weight"] and k.matrices["k_w"] is w[P + "self_attn.k_proj.weight"]
    np.testing.assert_array_equal(k.gains["input_gain"], w[P + "input_layernorm.weight"])
    np.testing.assert_array_equal(k.gains["post_gain"], np.ones(CFG.hidden_size, np.float32))


def test_the_kernel_inputs_are_named_and_shaped_as_the_kernel_declares_them():
    """Every input the layer holds has a name of DECODER_LAYER's held inputs, with its rank; without adapter
    slots the LoRA inputs are one all-zero slot of rank 1."""
    layer = prepare_layer(CFG, checkpoint(), 1, kernel=LayerKernelConfig(block_size=4, threads=1))
    k = layer.kernel
    held = {**k.matrices, **k.gains, **k.lora, "qkv_bias": k.qkv_bias, "o_bias": k.o_bias, "sinks": k.sinks,
            "gate_up_bias": k.gate_up_bias, "down_bias": k.down_bias, "norm_bias": k.norm_bias,
            "iconfig": k.iconfig, "fconfig": k.fconfig}
    params = {p.name: p for p in DECODER_LAYER.inputs}
    for name, array in held.items():
        assert array.ndim == params[name].ndims, name
    caches = {"key_cache", "value_cache"}                             # the attention's, held by the layer too
    assert set(held) | caches == {p.name for p in DECODER_LAYER.held_inputs}
    assert all(not a.any() and a.shape[0] == 1 for a in k.lora.values())
    assert k.lora["lora_qkv_a"].shape == (1, 3, CFG.hidden_size) and k.lora["lora_down_b"].shape == (1, 1, 16)


def random_delta(rng, rows: int, k: int, rank: int) -> LoraDelta:
    return LoraDelta(a=rng.standard_normal((rank, k)).astype(np.float32),
                     b=rng.standard_normal((rows, rank)).astype(np.float32), scale=0.7)


def kernel_delta(stack: LoraStack, x: np.ndarray, token_slots) -> np.ndarray:
    """The kernel's reading: each token's u = A[slot] x, output row n (of part p) = B^T[slot][:, n] . u[p R:(p+1) R]."""
    r, out = stack.rank, np.zeros((len(x), sum(stack.parts)))
    for t, s in enumerate(token_slots):
        u = stack.kernel_a[s].astype(np.float64) @ x[t]
        row = 0
        for p, rows in enumerate(stack.parts):
            out[t, row:row + rows] = u[p * r:(p + 1) * r] @ stack.kernel_b[s, :, row:row + rows]
            row += rows
    return out


def ops_delta(stack: LoraStack, x: np.ndarray, token_slots) -> np.ndarray:
    """MindSpore's ops' reading: ((x A^T) * one_hot(slot)) B^T over the whole batch."""
    u = x @ stack.ops_a.T.astype(np.float64)
    u = u * (np.asarray(token_slots)[:, None] == stack.col_slot[None, :])
    return u @ stack.ops_b.T


def qkv_names(i: int = 1) -> list:
    return [f"model.layers.{i}.{n}.weight" for n in LORA_PRODUCTS["qkv"]]


@pytest.mark.parametrize("kernel_folded", [True, False])
def test_the_two_lora_layouts_give_the_same_delta(kernel_folded):
    """q/k/v's stack (the input norm's gain folded into A): the kernel's layout and the ops' give the same delta,
    scale * B (A (g x)), on a batch of tokens under mixed slots; a part the adapter leaves alone stays zero."""
    rng = np.random.default_rng(3)
    h, parts, gain = 16, [16, 8, 8], (1 + 0.5 * rng.standard_normal(16)).astype(np.float32)
    stack = LoraStack(slots=3, rank=4, parts=parts, k=h, gain=gain, kernel_folded=kernel_folded)
    deltas = {1: [random_delta(rng, 16, h, 4), None, random_delta(rng, 8, h, 2)],
              2: [random_delta(rng, 16, h, 3), random_delta(rng, 8, h, 3), random_delta(rng, 8, h, 3)]}
    for slot, ds in deltas.items():
        stack.write(slot, ds, qkv_names())
    x = rng.standard_normal((6, h))                              # normalized, without the gain
    token_slots = [0, 1, 2, 1, 0, 2]
    want = np.zeros((6, sum(parts)))
    for t, s in enumerate(token_slots):
        for p, d in enumerate(deltas.get(s, [None] * 3)):
            if d is not None:
                lo = sum(parts[:p])
                want[t, lo:lo + parts[p]] = d.scale * (d.b.astype(np.float64) @ (d.a @ (gain * x[t])))
    np.testing.assert_allclose(ops_delta(stack, x, token_slots), want, rtol=1e-5, atol=1e-5)
    # the kernel multiplies by the gain itself when its base rows are stored (kernel_folded False)
    kernel_x = x if kernel_folded else x * gain
    np.testing.assert_allclose(kernel_delta(stack, kernel_x, token_slots), want, rtol=1e-5, atol=1e-5)
    assert not want[[1, 3], 16:24].any() and not want[[0, 4]].any()
    stack.write(1, [None] * 3, qkv_names())                      # an emptied slot: zeros in both layouts
    assert not ops_delta(stack, x, [1] * 6).any() and not kernel_delta(stack, x, [1] * 6).any()


def test_without_mindspore_ops_a_stack_keeps_only_the_kernel_layout():
    """When the layer kernel runs every step, MindSpore's ops never run the layer: the stack keeps no ops' arrays,
    its slot costs only the kernel's layout, and the kernel's arrays are those of a stack that keeps both."""
    rng = np.random.default_rng(4)
    h, parts, gain = 16, [16, 8, 8], (1 + 0.5 * rng.standard_normal(16)).astype(np.float32)
    both = LoraStack(slots=2, rank=4, parts=parts, k=h, gain=gain, kernel_folded=True)
    kernel_only = LoraStack(slots=2, rank=4, parts=parts, k=h, gain=gain, kernel_folded=True, ops=False)
    assert kernel_only.ops_a is None and kernel_only.ops_b is None and kernel_only.col_slot is None
    assert kernel_only.slot_nbytes == (both.kernel_a.nbytes + both.kernel_b.nbytes) // 2 < both.slot_nbytes
    ds = [random_delta(rng, 16, h, 4), None, random_delta(rng, 8, h, 2)]
    for stack in (both, kernel_only):
        stack.write(1, ds, qkv_names())
    np.testing.assert_array_equal(kernel_only.kernel_a, both.kernel_a)
    np.testing.assert_array_equal(kernel_only.kernel_b, both.kernel_b)


def test_prepare_layer_stacks_lora_as_the_kernel_reads_the_base():
    """The stacks fold the gain into the kernel's A only where the kernel reads a float32 (folded) base."""
    rng = np.random.default_rng(4)
    nq, nkv = CFG.num_heads * CFG.head_dim, CFG.num_kv_heads * CFG.head_dim
    quantized = {P + f"self_attn.{m}_proj.weight": stored(n, rng) for m, n in (("q", nq), ("k", nkv), ("v", nkv))}
    layer = prepare_layer(CFG, checkpoint(), 1, kernel=LayerKernelConfig(4, 1), quantized=quantized, lora_slots=2,
                          lora_rank=3)
    st = layer.lora_stacks
    assert list(st) == list(LORA_PRODUCTS) and st["qkv"].slots == 3 and st["qkv"].rank == 3
    assert not st["qkv"].kernel_folded and st["gate_up"].kernel_folded
    assert st["o"].gain is None and st["o"].parts == [CFG.hidden_size]
    assert layer.kernel.lora["lora_gate_up_b"] is st["gate_up"].kernel_b          # written slots reach the kernel
    assert layer.kernel.lora["lora_qkv_a"].shape == (3, 3 * 3, CFG.hidden_size)


def test_tensor_parallel_ranks_hold_their_parts():
    """Two ranks, each preparing from its own part of the checkpoint: q/k/v rows are the rank's heads of each
    part (folded as the whole), and each rank's LoRA deltas are its part of the whole one: its rows of q/k/v's,
    a partial sum of o's (the ranks' sum is the whole)."""
    w, rng = checkpoint(seed=5), np.random.default_rng(5)
    whole = prepare_layer(CFG, w, 1, lora_slots=1, lora_rank=2)
    h, nq, nkv = CFG.hidden_size, CFG.num_heads * CFG.head_dim, CFG.num_kv_heads * CFG.head_dim
    qkv_deltas = [random_delta(rng, nq, h, 2), random_delta(rng, nkv, h, 2), random_delta(rng, nkv, h, 2)]
    o_name = [P + "self_attn.o_proj.weight"]
    o_delta = [random_delta(rng, h, nq, 2)]
    whole.lora_stacks["qkv"].write(1, qkv_deltas, qkv_names())
    whole.lora_stacks["o"].write(1, o_delta, o_name)
    x, attn = rng.standard_normal((3, h)), rng.standard_normal((3, nq))
    want_qkv, want_o = ops_delta(whole.lora_stacks["qkv"], x, [1, 0, 1]), ops_delta(whole.lora_stacks["o"], attn,
                                                                                       [1, 0, 1])
    o_sum = np.zeros_like(want_o)
    for rank in range(2):
        tp = TensorParallel(rank=rank, world=2)
        part = {n: t[tp.part(n, t.shape)] for n, t in w.items()}
        layer = prepare_layer(CFG, part, 1, tp=tp, lora_slots=1, lora_rank=2)
        q_rows = slice(rank * nq // 2, (rank + 1) * nq // 2)
        kv_rows = [slice(nq + rank * nkv // 2, nq + (rank + 1) * nkv // 2),
                   slice(nq + nkv + rank * nkv // 2, nq + nkv + (rank + 1) * nkv // 2)]
        rows = np.r_[q_rows, kv_rows[0], kv_rows[1]]
        np.testing.assert_array_equal(layer.qkv, whole.qkv[rows])
        layer.lora_stacks["qkv"].write(1, qkv_deltas, qkv_names())
        layer.lora_stacks["o"].write(1, o_delta, o_name)
        np.testing.assert_allclose(ops_delta(layer.lora_stacks["qkv"], x, [1, 0, 1]), want_qkv[:, rows],
                                   rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(kernel_delta(layer.lora_stacks["qkv"], x, [1, 0, 1]), want_qkv[:, rows],
                                   rtol=1e-5, atol=1e-5)
        cols = slice(rank * nq // 2, (rank + 1) * nq // 2)                 # the rank's part of o's input
        o_sum += ops_delta(layer.lora_stacks["o"], attn[:, cols], [1, 0, 1])
    np.testing.assert_allclose(o_sum, want_o, rtol=1e-5, atol=1e-5)


def test_the_head_folds_the_final_norm_or_keeps_stored_rows():
    w, rng = checkpoint(seed=6), np.random.default_rng(6)
    head = prepare_head(CFG, w)
    np.testing.assert_array_equal(head.lm_head, w["lm_head.weight"] * w["model.norm.weight"])
    assert head.kernel_lm_head is None
    head = prepare_head(CFG, w, kernel_threads=2)
    assert head.kernel_lm_head is head.lm_head and head.kernel_type == 0 and not (head.kernel_gain - 1).any()
    q = stored(CFG.vocab_size, rng, 3)
    head = prepare_head(CFG, w, kernel_threads=2, quantized={"lm_head.weight": q})
    np.testing.assert_array_equal(head.kernel_lm_head, q.data)
    np.testing.assert_array_equal(head.kernel_gain, w["model.norm.weight"])
    assert head.iconfig.tolist() == [2, 3, 0] and head.fconfig.dtype == np.float32
    assert prepare_head(CFG, w, kernel_threads=2, batch_invariant=True).iconfig.tolist() == [2, 0, 1]
    assert {"lm_head", "gain", "iconfig", "fconfig"} <= set(FINAL_LOGITS.input_names)


def test_no_mindspore_in_weight_preparation():
    code = ("import sys, llm_serving.models.layer_weights, llm_serving.models.kernels.signatures; "
            "sys.exit('mindspore' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_a_partial_rotation_reorders_q_and_k_rows_their_norms_and_their_lora_rows_alike():
    """rope.rotary_permutation's order, head by head, on everything that yields a q or k row: the float32 rows
    (bias included), the stored rows (bytes moved whole), the q/k norms' gains and LoRA's B; v and o untouched.
    The kernel's iconfig carries the family's switches and fconfig its attention scale."""
    from llm_serving.models.rope import rotary_permutation
    cfg = dataclasses.replace(CFG, head_dim=8, rotary_dim=4, qk_norm=True, sandwich_norms=True,
                              hidden_act="gelu_tanh", query_scale=0.125, sliding_window=6,
                              layer_types=("full", "sliding"))
    w = checkpoint(cfg)
    rng = np.random.default_rng(5)
    for norm in ("self_attn.q_norm", "self_attn.k_norm"):
        w[f"{P}{norm}.weight"] = rng.standard_normal(8).astype(np.float32)
    for norm in ("attn_output_norm", "mlp_output_norm"):
        w[f"{P}{norm}.weight"] = rng.standard_normal(cfg.hidden_size).astype(np.float32)
    perm = rotary_permutation(cfg)
    assert perm.tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    q_rows = (np.arange(cfg.num_heads)[:, None] * 8 + perm).reshape(-1)
    k_rows = (np.arange(cfg.num_kv_heads)[:, None] * 8 + perm).reshape(-1)
    nq, nkv = cfg.num_heads * 8, cfg.num_kv_heads * 8
    quantized = {P + "self_attn.k_proj.weight": stored(nkv, rng)}
    layer = prepare_layer(cfg, w, 1, kernel=LayerKernelConfig(4, 1), quantized=quantized, lora_slots=1, lora_rank=2)
    g_in = w[P + "input_layernorm.weight"]
    np.testing.assert_array_equal(layer.qkv[:nq], w[P + "self_attn.q_proj.weight"][q_rows] * g_in)
    np.testing.assert_array_equal(layer.qkv[nq:nq + nkv], w[P + "self_attn.k_proj.weight"][k_rows] * g_in)
    np.testing.assert_array_equal(layer.qkv[nq + nkv:], w[P + "self_attn.v_proj.weight"] * g_in)
    np.testing.assert_array_equal(layer.qkv_bias[:nq], w[P + "self_attn.q_proj.bias"][q_rows])
    k = layer.kernel
    np.testing.assert_array_equal(k.matrices["k_w"], quantized[P + "self_attn.k_proj.weight"].data[k_rows])
    np.testing.assert_array_equal(k.gains["q_norm"], w[P + "self_attn.q_norm.weight"][perm])
    np.testing.assert_array_equal(k.gains["k_norm"], w[P + "self_attn.k_norm.weight"][perm])
    np.testing.assert_array_equal(k.gains["attn_out_gain"], w[P + "attn_output_norm.weight"])
    np.testing.assert_array_equal(layer.extra_gains["q_norm"], k.gains["q_norm"])
    assert k.iconfig.tolist()[12:] == [1, 1, 1, 6, 1, 0, 0, 0, 1, 0] and k.fconfig.tolist() == [np.float32(1e-6), 0.125]
    # LoRA: a q/k delta's B rows follow the base rows; the kernel's A is the raw one where k is stored
    a, b = rng.standard_normal((2, cfg.hidden_size)).astype(np.float32), rng.standard_normal((nq, 2)).astype(np.float32)
    names = [f"{P}{n}.weight" for n in LORA_PRODUCTS["qkv"]]
    layer.lora_stacks["qkv"].write(1, [LoraDelta(a=a, b=b, scale=1.0), None, None], names)
    np.testing.assert_array_equal(layer.lora_stacks["qkv"].kernel_b[1, :, :nq], b[q_rows].T)
    # the model without the switches: ones in their place, and layer 0 (full attention) has no window
    plain_cfg = dataclasses.replace(cfg, qk_norm=False, sandwich_norms=False, rotary_dim=None)
    plain = prepare_layer(plain_cfg, checkpoint(plain_cfg), 1, kernel=LayerKernelConfig(4, 1))
    np.testing.assert_array_equal(plain.kernel.gains["q_norm"], np.ones(8, np.float32))
    full = prepare_layer(cfg, {k.replace(P, "model.layers.0."): v for k, v in w.items()}, 0,
                         kernel=LayerKernelConfig(4, 1))
    assert full.kernel.iconfig[DECODER_LAYER.iconfig_index("window")] == 0
