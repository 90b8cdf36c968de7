"""LLaMA for static-shape graph-mode serving over a paged KV cache.

One call = one step over B rows of S new tokens each (T = B*S tokens); returns per row the greedy next
token and its log-probability, plus the logits for the sampling graph (sampler.py).

Load-time rewrites (each removes per-token kernels; on CPU a decode step is dominated by per-kernel
overhead, ~10-15 us each), the weights' done in numpy by layer_weights.py (this file only wraps them in Parameters):
- q/k/v fused into one [out, in] weight (and one bias where the model has them: Qwen2), gate/up into another
  (one MatMul each, transpose_b);
- RMSNorm gains folded into the weight of the MatMul that follows (input_norm -> qkv,
  post_norm -> gate_up, final norm -> lm_head), so a norm is x * rsqrt(mean(x^2) + eps);
- RoPE in HF rotate_half layout applied to the whole fused qkv tensor: per step, tables
  cos/sin of shape (T, NH+2KVH, D) are built once (v heads get cos=1, sin=0, and the attention
  scale 1/sqrt(D) is folded into the q heads), then per layer rope = qkv*cos + swap_halves(qkv)*sin.

On one CPU agent, every graph of S=1 (decode, packed prefill pieces, verify steps; or, with `layer_kernel_rows`
set, those of at most that many tokens) runs each layer as one C++ kernel on these same weights (kernels/decoder_layer_cpu.cc: it applies RoPE
from the raw tables and writes the same paged cache), and the final norm, lm_head and greedy pick as another;
the choice is made from the graph's static shape when it is compiled; the kernels' inputs are passed by name
(kernels/signatures.py). Where the checkpoint stores a matrix
block-quantized (a GGUF's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, K-quants Q4_K/Q5_K/Q6_K, F16/BF16: `quantized`, from
weights.load_quantized), the kernels read those
stored rows (a decode step of few rows streams every weight once, so its bytes are its time; with the kernel on
every step no float32 copy exists at all, and the embedding is gathered from its stored rows by EmbedTokens);
their norm gains are applied to the activations instead of folded in.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Zero, initializer

from llm_serving.config import KV_CACHE_TYPES, KvCacheType

from .attention import PagedAttention, paged_metadata
from .kernels.layer_stack import HIDDEN, LayerStack, cache_sources, step_sources
from .kernels.repack import Repacker
from .kernels.signatures import DECODER_LAYER, EMBED_TOKENS, FINAL_LOGITS, MOE_MLP
from .layer_weights import (LORA_PRODUCTS, KernelInputs, LayerKernelConfig, MoeKernelInputs, kernel_lora_arrays,
                            prepare_embedding_extras, prepare_head, prepare_layer)
from .parallel import TensorParallel
from .rope import ROPE_KINDS, rope_tables
from .runner_spec import KERNEL_ONLY_ROWS
from .sampler import greedy_pick
from .weights import LlamaConfig, QuantizedTensor

__all__ = ["LlamaForCausalLM"]


def _shared_param(tensor: Tensor, name: str) -> Parameter:
    """A Parameter over `tensor`'s memory (a Tensor.from_numpy of the weights: no second copy of them at start).
    Parameter(tensor) copies its input unless it judges, by the input's reference count, that nothing else holds
    it (a temporary passed positionally: keyword arguments already made it copy, a second copy of every weight at
    start); a lazy Parameter of the same shape (its initializer allocates nothing) given the tensor by set_data
    shares it whatever holds it (tests/integration/test_model_runner.py checks the sharing)."""
    param = Parameter(initializer(Zero(), tensor.shape, tensor.dtype), name=name, requires_grad=False)
    param.set_data(tensor)
    return param


def _param(array: np.ndarray, name: str) -> Parameter:
    return _shared_param(Tensor.from_numpy(np.ascontiguousarray(array, dtype=np.float32)), name)


def _stored_param(array: np.ndarray, name: str) -> Parameter:
    """A quantized matrix's stored bytes (uint8), as the layer kernel reads them."""
    return _shared_param(Tensor.from_numpy(np.ascontiguousarray(array, dtype=np.uint8)), name)


def _repack_all(repacker: Repacker, matrices: dict, types: tuple) -> tuple:
    """(matrices, types) with each stored matrix the library repacks (kernels/repack.py: 8 rows interleaved) in its
    repacked form and type; the stored rows are then no longer held."""
    out, codes = {}, []
    for (name, array), qtype in zip(matrices.items(), types):
        out[name], to = repacker.rows(array, qtype)
        codes.append(to)
    return out, tuple(codes)


def _repacked(repacker: Repacker, k: KernelInputs) -> KernelInputs:
    """The layer kernel's inputs with its stored matrices repacked where the library repacks them."""
    matrices, types = _repack_all(repacker, k.matrices, k.types)
    return k if types == tuple(k.types) else k.with_matrices(matrices, types)


def _kept_or_stored(repacker: Repacker, inputs):
    """(KernelInputs or MoeKernelInputs with each stored matrix as the load serves it until LaterRepacks repacks
    it: the panels an earlier start kept, else the stored rows; {name: the type it is repacked into} of the
    matrices left to LaterRepacks)."""
    matrices, types, later = {}, [], {}
    for (name, array), qtype in zip(inputs.matrices.items(), inputs.types):
        matrices[name], code, to = repacker.kept_or_stored(array, qtype)
        types.append(code)
        if to:
            later[name] = to
    return (inputs if tuple(types) == tuple(inputs.types) else inputs.with_matrices(matrices, tuple(types))), later


def _repacked_tied_table(repacker: Repacker, quantized: dict) -> QuantizedTensor:
    """A tied embedding's stored rows, which FinalLogits reads as the lm_head on every step: repacked where the
    library repacks them (EmbedTokens then reads each token's stored bytes back from the panels, the same floats),
    in place of the stored rows under both names, so that nothing holds a second copy."""
    table = quantized["model.embed_tokens.weight"]
    rows, qtype = repacker.rows(table.data, table.qtype)
    if qtype != table.qtype:
        table = dataclasses.replace(table, data=rows, qtype=qtype)
        quantized["model.embed_tokens.weight"] = quantized["lm_head.weight"] = table
    return table


def _repacked_experts(repacker: Repacker, m: MoeKernelInputs, cfg: LlamaConfig) -> MoeKernelInputs:
    """MoeMlp's inputs with each stored experts' stack the library repacks in its repacked form (kernels/repack.py),
    where every expert's rows are whole panels of 8 (an expert's rows start a panel: MoeMlp reads them by expert)."""
    if cfg.expert_intermediate_size % 8 or cfg.hidden_size % 8:
        return m
    return m.with_matrices(*_repack_all(repacker, m.matrices, m.types))


def _stack_arrays(signature, arrays: dict) -> dict:
    """A kernel's held inputs (but its caches) as the layer stack reads them: each array C-contiguous in its dtype
    (a stored matrix's bytes uint8, iconfig int32, the rest float32), by the signature's names."""
    out = {}
    for p in signature.held_inputs:
        if p.dtype == "cache":
            continue
        array = arrays[p.name]
        dtype = np.int32 if p.name == "iconfig" else np.uint8 if array.dtype == np.uint8 else np.float32
        out[p.name] = np.ascontiguousarray(array, dtype)
    return out


def _lora_param(array: np.ndarray, name: str) -> Parameter:
    """A Parameter initialized from `array` (float32, contiguous), which refresh_lora gives it again after a write."""
    assert array.dtype == np.float32 and array.flags["C_CONTIGUOUS"]
    return Parameter(Tensor(array.copy()), name=name, requires_grad=False)


def _final_logits_shapes(*shapes):
    # FinalLogits' output shapes from its inputs': logits (R, V), token (R,), logprob (R,)
    rows, vocab = shapes[FINAL_LOGITS.index("x")][0], shapes[FINAL_LOGITS.index("lm_head")][0]
    return (rows, vocab), (rows,), (rows,)


def _rms_normalize(x, eps: float):
    # x (..., N) -> x / sqrt(mean(x^2) + eps) over the last axis; the gain is folded into the next MatMul's weight,
    # or multiplied after (the q/k heads' norms, the sandwich norms)
    return x * ops.rsqrt(ops.mean(x * x, -1, keep_dims=True) + eps)    # (..., N)


def _layer_normalize(x, eps: float):
    # x (..., N) -> (x - mean) / sqrt(mean((x - mean)^2) + eps) over the last axis (LayerNorm; BERT), before its gain
    # and bias
    centred = x - ops.mean(x, -1, keep_dims=True)                                    # (..., N)
    return centred * ops.rsqrt(ops.mean(centred * centred, -1, keep_dims=True) + eps)


def _gelu_tanh(x):
    # GELU with the tanh approximation (Gemma's gelu_pytorch_tanh) as the kernel writes it (layer_parts_cpu.h's
    # gelu_times): 0.5 (1 + tanh(u)) = sigmoid(2 u), no cancellation for negative x. On MindSpore's CPU tanh the tanh
    # form was up to 1.9e-4 off the float64 GELU over [-12, 12], this one 5e-7 (tests/integration/test_activations.py)
    return x * ops.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))


def _gelu_erf(x):
    # GELU's exact form (BERT's gelu), written out: the kernel's formula
    return 0.5 * x * (1.0 + ops.erf(x * 0.7071067811865476))


def _quick_gelu(x):
    # transformers' quick_gelu (Qwen2-VL's vision MLP), as the kernel writes it (layer_parts_cpu.h's quick_gelu_times)
    return x * ops.sigmoid(1.702 * x)


class LlamaDecoderLayer(nn.Cell):
    def __init__(self, cfg: LlamaConfig, w: dict, i: int, num_slots: int, device_target: str, block_size: int,
                 decode_kernel: Optional[str], kernel_threads: int, tp: TensorParallel, all_reduce,
                 layer_kernel: Optional[str] = None, quantized: Optional[dict] = None, lora_slots: int = 0,
                 lora_rank: int = 0, ops_graphs: bool = True, kv_cache: KvCacheType = KV_CACHE_TYPES["float16"],
                 batch_invariant: bool = False, window_pool_slots: int = 0, repacker: Optional[Repacker] = None):
        super().__init__()
        world = tp.world
        if repacker is None and layer_kernel is not None:
            repacker = Repacker(layer_kernel, invariant=batch_invariant)
        # the layer's RoPE (rope.ROPE_KINDS) and window (None: every key); the model gives it the index of its
        # table and of its attention metadata (rope_index, window_index). A sliding layer keeps its K/V in the
        # window pool when there is one (window_pool_slots > 0: its cache's slots, scratch block included), read
        # through the step's window_slots and window_tables
        self.rope_kind = cfg.layer_rope(i)
        self.window = cfg.layer_window(i)
        self.in_window_pool = self.window is not None and window_pool_slots > 0
        self.act = cfg.hidden_act                   # the MLP's activation: silu, gelu_tanh or gelu (erf)
        # a BERT layer: its norms after the residual adds (LayerNorm, gain and bias), an ungated MLP, biases
        self.sandwich, self.post_norm, self.gated = cfg.sandwich_norms, cfg.post_norm, cfg.gated_mlp
        self.layer_norm = cfg.norm == "layer"      # (LlamaConfig: only as post norms)
        # this rank's heads and MLP units (all of them when world == 1): `w` holds only this rank's part of
        # each split tensor (weights.load_llama_weights(path, tp); the split is parallel.SPLIT_AXIS)
        self.nh, self.kvh, self.d = cfg.num_heads // world, cfg.num_kv_heads // world, cfg.head_dim
        self.inter = cfg.intermediate_size // world
        self.eps = cfg.rms_norm_eps
        kernel = (LayerKernelConfig(block_size, kernel_threads, batch_invariant) if layer_kernel is not None
                  else None)
        prepared = prepare_layer(cfg, w, i, tp=tp, kernel=kernel, quantized=quantized, lora_slots=lora_slots,
                                 lora_rank=lora_rank, ops_graphs=ops_graphs)
        # the float32 products of MindSpore's ops (construct), only where some step runs them (ops_graphs: no layer
        # kernel, or one that serves only steps of up to layer_kernel_rows tokens); with the kernel on every step
        # construct is never compiled and they are None
        f32 = {"qkv_w": prepared.qkv, "o_w": prepared.o, "gate_up_w": prepared.gate_up, "down_w": prepared.down}
        for name, array in f32.items():    # qkv ((NH+2KVH)*D, H), o (H, NH*D), gate_up (2I, H), down (H, I)
            setattr(self, name, _param(array, f"layers.{i}.{name.removesuffix('_w')}")
                    if ops_graphs and array is not None else None)
        self.qkv_bias = None
        if prepared.qkv_bias is not None:
            self.qkv_bias = _param(prepared.qkv_bias, f"layers.{i}.qkv_bias")       # ((NH+2KVH)*D,)
        # MindSpore's ops' other biases, where the model has them: o_proj's (H,), the MLP's first product's ((2)I,:
        # gate's then up's, or an ungated MLP's up's) and down's (H,), and the post norms' LayerNorm biases (H,)
        ops_biases = {"o_bias": w.get(f"model.layers.{i}.self_attn.o_proj.bias"),
                      "gate_up_bias": (np.concatenate([prepared.mlp_biases[n] for n in ("gate_proj", "up_proj")
                                                       if n in prepared.mlp_biases])
                                       if prepared.mlp_biases else None),
                      "down_bias": prepared.mlp_biases.get("down_proj"),
                      "attn_out_bias": prepared.norm_biases.get("attn_output_norm"),
                      "mlp_out_bias": prepared.norm_biases.get("mlp_output_norm")}
        for name, array in ops_biases.items():
            setattr(self, name, _param(array, f"layers.{i}.{name}") if ops_graphs and array is not None else None)
        # the q/k heads' norms (D,) and the sandwich norms (H,), where the model has them (Qwen3, Gemma 3)
        for name in ("q_norm", "k_norm", "attn_out_gain", "mlp_out_gain"):
            gain = prepared.extra_gains.get(name)
            setattr(self, name, None if gain is None else _param(gain, f"layers.{i}.{name}"))
        # LoRA adapters (lora_slots > 0): S = lora_slots + 1 slots of rank lora_rank per product
        self.lora_stacks = prepared.lora_stacks
        self.has_lora = lora_slots > 0
        self.ops_lora = self.has_lora and ops_graphs          # MindSpore's ops' form of the adapters, where they run
        if self.ops_lora:
            self.lora_ops_a = ms.ParameterTuple([_lora_param(st.ops_a, f"layers.{i}.lora_ops_a_{key}")
                                                 for key, st in self.lora_stacks.items()])      # (S*P*R, K) each
            self.lora_ops_b = ms.ParameterTuple([_lora_param(st.ops_b, f"layers.{i}.lora_ops_b_{key}")
                                                 for key, st in self.lora_stacks.items()])      # (N, S*P*R) each
            self.lora_cols = tuple(Tensor(st.col_slot.reshape(1, -1)) for st in self.lora_stacks.values())   # (1, S*P*R)
        self.attn = PagedAttention(self.nh, self.kvh, cfg.head_dim,
                                   window_pool_slots if self.in_window_pool else num_slots,
                                   layer_id=i, device_target=device_target, block_size=block_size,
                                   decode_kernel=decode_kernel, kernel_threads=kernel_threads,
                                   cache=kv_cache, window=self.window)
        self.matmul_t = ops.MatMul(transpose_b=True)
        self.parallel = all_reduce is not None            # o_proj and down_proj outputs are partial sums
        self.all_reduce = all_reduce.op if self.parallel else None
        self.layer_kernel = None
        # the layer kernel on every step: the model runs its layers as one call (kernels/layer_stack.py), which reads
        # the arrays this layer keeps (`stack_held`, `moe_stack_held`); no Parameter holds them
        self.stacked = layer_kernel is not None and not ops_graphs
        # (stacked, with a LaterRepacks: the matrices no earlier start kept are served as stored and repacked after
        # the load, `stack_later` {name: its repacked type}; the model queues them once its stack holds them)
        later = self.stacked and repacker.later is not None
        self.stack_later, self.moe_stack_later = {}, {}
        if self.stacked:
            k, self.stack_later = (_kept_or_stored(repacker, prepared.kernel) if later
                                   else (_repacked(repacker, prepared.kernel), {}))
            self.stack_held = _stack_arrays(DECODER_LAYER, {
                **k.matrices, **k.gains, **k.lora, "qkv_bias": k.qkv_bias, "o_bias": k.o_bias, "sinks": k.sinks,
                "gate_up_bias": k.gate_up_bias, "down_bias": k.down_bias, "norm_bias": k.norm_bias,
                "iconfig": k.iconfig, "fconfig": k.fconfig})
        elif layer_kernel is not None:
            # the whole layer as one CPU kernel (kernels/decoder_layer_cpu.cc) for small decode-shaped steps
            self.layer_kernel = ops.Custom(f"{layer_kernel}:DecoderLayer", out_shape=lambda x, *_: x,
                                           out_dtype=lambda x, *_: x, func_type="aot")
            self._hold_kernel_inputs(_repacked(repacker, prepared.kernel), i)
            DECODER_LAYER.check_call(self.fused)
        # a mixture-of-experts layer: its MLP as the MoeMlp kernel after the layer kernel (which then runs none)
        self.moe = prepared.moe is not None
        if self.moe and self.stacked:
            repacks = cfg.expert_intermediate_size % 8 == 0 and cfg.hidden_size % 8 == 0     # (_repacked_experts)
            m, self.moe_stack_later = (_kept_or_stored(repacker, prepared.moe) if later and repacks
                                       else (_repacked_experts(repacker, prepared.moe, cfg), {}))
            self.moe_stack_held = _stack_arrays(MOE_MLP, {
                **m.matrices, **m.biases, "router": m.router,
                "router_bias": m.router_bias, "post_gain": m.post_gain, "iconfig": m.iconfig, "fconfig": m.fconfig})
        elif self.moe:
            m = _repacked_experts(repacker, prepared.moe, cfg)
            self.moe_kernel = ops.Custom(f"{layer_kernel}:MoeMlp", out_shape=lambda x, *_: x,
                                         out_dtype=lambda x, *_: x, func_type="aot")
            weights = {name: (_stored_param(array, f"layers.{i}.experts_{name.removesuffix('_w')}_stored") if qtype
                              else _param(array, f"layers.{i}.experts_{name.removesuffix('_w')}"))
                       for (name, array), qtype in zip(m.matrices.items(), m.types)}
            weights.update({name: _param(array, f"layers.{i}.experts_{name}") for name, array in m.biases.items()})
            weights.update(router=_param(m.router, f"layers.{i}.router"),
                           router_bias=_param(m.router_bias, f"layers.{i}.router_bias"),
                           post_gain=_param(m.post_gain, f"layers.{i}.moe_post_gain"))
            self.moe_params = ms.ParameterTuple(list(weights.values()))
            self.moe_held = MOE_MLP.held(**dict(zip(weights, self.moe_params)), iconfig=Tensor(m.iconfig),
                                         fconfig=Tensor(m.fconfig))

    def _hold_kernel_inputs(self, k: KernelInputs, i: int) -> None:
        """The layer kernel's inputs the layer holds (layer_weights.KernelInputs), as `kernel_<input name>`: stored
        rows, or float32 ones (o and down: the graphs' own Parameter where there is one; q/k/v and gate/up are
        separate inputs, rows of the graphs' fused matrices)."""
        graphs = {"o_w": self.o_w, "down_w": self.down_w}
        for (name, array), qtype in zip(k.matrices.items(), k.types):
            if qtype != 0:
                param = _stored_param(array, f"layers.{i}.{name.removesuffix('_w')}_stored")
            elif graphs.get(name) is not None:
                param = graphs[name]
            else:
                param = _param(array, f"layers.{i}.kernel_{name.removesuffix('_w')}")
            setattr(self, f"kernel_{name}", param)
        self.kernel_qkv_bias = self.qkv_bias if self.qkv_bias is not None else _param(k.qkv_bias,
                                                                                      f"layers.{i}.qkv_bias0")
        self.kernel_o_bias = _param(k.o_bias, f"layers.{i}.kernel_o_bias")                          # (H,)
        self.kernel_sinks = _param(k.sinks, f"layers.{i}.kernel_sinks")                             # (NH,)
        self.kernel_gate_up_bias = _param(k.gate_up_bias, f"layers.{i}.kernel_gate_up_bias")       # (2I,)
        self.kernel_down_bias = _param(k.down_bias, f"layers.{i}.kernel_down_bias")                 # (H,)
        self.kernel_norm_bias = _param(k.norm_bias, f"layers.{i}.kernel_norm_bias")                 # (4, H)
        self.kernel_input_gain = _param(k.gains["input_gain"], f"layers.{i}.kernel_input_gain")       # (H,)
        self.kernel_post_gain = _param(k.gains["post_gain"], f"layers.{i}.kernel_post_gain")         # (H,)
        # q_norm, k_norm (D,), attn_out_gain, mlp_out_gain (H,): the ops' Parameter where there is one, else ones
        # (the kernel's iconfig says whether it applies them)
        for name in ("q_norm", "k_norm", "attn_out_gain", "mlp_out_gain"):
            own = getattr(self, name)
            setattr(self, f"kernel_{name}", own if own is not None else _param(k.gains[name], f"layers.{i}.kernel_{name}"))
        # LoRA adapters stacked by slot, as the kernel takes them (A (S, parts*R, K), B (S, R, N)); slot 0 is the
        # base model. Without adapter slots: one all-zero slot of rank 1, which the kernel skips
        for name, array in k.lora.items():
            setattr(self, f"kernel_{name}", _lora_param(array, f"layers.{i}.kernel_{name}"))
        self.kernel_types = k.types           # GGML type codes of q, k, v, o, gate, up, down (0: float32)
        self.kernel_iconfig = Tensor(k.iconfig)                                       # (16,) int32
        self.kernel_fconfig = Tensor(k.fconfig)                                       # (2,) float32 [eps, scale]
        # the same objects in the kernel's order, which `fused` passes after the step's inputs
        self.kernel_held = DECODER_LAYER.held(
            qkv_bias=self.kernel_qkv_bias, o_bias=self.kernel_o_bias, sinks=self.kernel_sinks,
            gate_up_bias=self.kernel_gate_up_bias, down_bias=self.kernel_down_bias, norm_bias=self.kernel_norm_bias,
            input_gain=self.kernel_input_gain, post_gain=self.kernel_post_gain,
            q_norm=self.kernel_q_norm, k_norm=self.kernel_k_norm, attn_out_gain=self.kernel_attn_out_gain,
            mlp_out_gain=self.kernel_mlp_out_gain,
            key_cache=self.attn.key_cache, value_cache=self.attn.value_cache, iconfig=self.kernel_iconfig,
            fconfig=self.kernel_fconfig, **{name: getattr(self, f"kernel_{name}") for name in k.matrices},
            **{name: getattr(self, f"kernel_{name}") for name in k.lora})

    def refresh_lora(self) -> None:
        """The LoRA Parameters take their stacks' arrays again (after LoraStack.write): a compiled graph reads
        the new values at its next run."""
        if not self.has_lora:
            return
        stacks = list(self.lora_stacks.values())      # (a stacked layer's kernel reads their arrays as written)
        pairs = []
        if self.ops_lora:
            pairs += [(p, a) for p, a in zip(self.lora_ops_a, (st.ops_a for st in stacks))]
            pairs += [(p, b) for p, b in zip(self.lora_ops_b, (st.ops_b for st in stacks))]
        if self.layer_kernel is not None and not self.stacked:
            pairs += [(getattr(self, f"kernel_{name}"), array)
                      for name, array in kernel_lora_arrays(self.lora_stacks).items()]
        for param, array in pairs:
            param.set_data(Tensor(array.copy()))

    def fused(self, x, positions, slots, block_tables, context_lens, tree_bits, cos, sin, lora):
        """The layer as its kernel (kernels/decoder_layer_cpu.cc): the step's inputs (DECODER_LAYER's call inputs,
        by name and in order: checked when the layer is built), then what the layer holds. x (T, H); positions,
        slots, context_lens, tree_bits, lora (T,); block_tables (T, W); cos/sin tables (P, D) -> (T, H). slots and
        block_tables are those of the layer's cache (the window pool's for a layer in it)."""
        out = self.layer_kernel(x, positions, slots, block_tables, context_lens, tree_bits, cos, sin, lora,
                                *self.kernel_held)                                                     # (T, H)
        if self.moe:
            out = self.moe_kernel(out, slots, *self.moe_held)                                          # (T, H)
        return out

    def lora_delta(self, j: int, x, lora):
        """Product j's LoRA deltas for a batch of mixed adapters: x (T, K), lora (T, 1) each token's slot ->
        (T, N): only each token's own slot's columns of x A^T survive the mask."""
        u = self.matmul_t(x, self.lora_ops_a[j])                                         # (T, S*P*R)
        u = u * ops.equal(lora, self.lora_cols[j]).astype(u.dtype)                       # (T, S*P*R)
        return self.matmul_t(u, self.lora_ops_b[j])                                      # (T, N)

    def construct(self, x, cos, sin, meta, lora):
        # x (T, H); cos, sin (T, NH+2KVH, D); meta: paged_metadata's tuple; lora (T, 1) each token's adapter slot
        t = x.shape[0]
        nh, kvh, d = self.nh, self.kvh, self.d
        xn = x if self.post_norm else _rms_normalize(x, self.eps)     # (T, H) (post norms: normalized already)
        qkv = self.matmul_t(xn, self.qkv_w)                                               # (T, (NH+2KVH)*D)
        if self.has_lora:
            qkv = qkv + self.lora_delta(0, xn, lora)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias                                                     # (T, (NH+2KVH)*D)
        qkv = qkv.reshape(t, nh + 2 * kvh, d)                                             # (T, NH+2KVH, D)
        if self.q_norm is not None:                    # each q and k head RMS-normalized (Qwen3, Gemma 3)
            q, k, v = ops.split(qkv, (nh, kvh, kvh), 1)                                   # (T, NH|KVH|KVH, D)
            q = _rms_normalize(q, self.eps) * self.q_norm
            k = _rms_normalize(k, self.eps) * self.k_norm
            qkv = ops.cat((q, k, v), 1)                                                   # (T, NH+2KVH, D)
        first, second = ops.split(qkv, d // 2, 2)                                         # (T, NH+2KVH, D/2) each
        swapped = ops.cat((second, first), 2)         # (T, NH+2KVH, D); flip/ReverseV2: 4.5 ms/layer at B=128 on CPU
        qkv = qkv * cos + swapped * sin                                                   # (T, NH+2KVH, D)
        q, k, v = ops.split(qkv, (nh, kvh, kvh), 1)                                       # (T, NH|KVH|KVH, D)
        attn = self.attn(q, k, v, meta)                                                   # (T, NH*D)
        o = self.matmul_t(attn, self.o_w)                                                 # (T, H)
        if self.has_lora:
            o = o + self.lora_delta(1, attn, lora)
        if self.parallel:
            o = self.all_reduce(o)                                                        # (T, H) summed over ranks
        if self.o_bias is not None:
            o = o + self.o_bias                                                           # (T, H)
        if self.sandwich:                              # sandwich norms (Gemma 3): the output normalized first
            o = _rms_normalize(o, self.eps) * self.attn_out_gain
        x = x + o
        if self.post_norm:                             # BERT: x = LayerNorm(x + o), the MLP's input as it is
            x = self._post_normalize(x, self.attn_out_gain, self.attn_out_bias)           # (T, H)
            xn = x
        else:
            xn = _rms_normalize(x, self.eps)                                              # (T, H)
        gate_up = self.matmul_t(xn, self.gate_up_w)                                       # (T, 2I); ungated: (T, I)
        if self.has_lora:
            gate_up = gate_up + self.lora_delta(2, xn, lora)
        if self.gate_up_bias is not None:
            gate_up = gate_up + self.gate_up_bias
        if self.gated:
            gate, up = ops.split(gate_up, self.inter, 1)                                  # (T, I) each
            act = self._activation(gate) * up                                             # (T, I)
        else:
            act = self._activation(gate_up)                                               # (T, I): f(up)
        down = self.matmul_t(act, self.down_w)                                            # (T, H)
        if self.has_lora:
            down = down + self.lora_delta(3, act, lora)
        if self.parallel:
            down = self.all_reduce(down)                                                  # (T, H) summed over ranks
        if self.down_bias is not None:
            down = down + self.down_bias
        if self.sandwich:
            down = _rms_normalize(down, self.eps) * self.mlp_out_gain
        if self.post_norm:
            return self._post_normalize(x + down, self.mlp_out_gain, self.mlp_out_bias)   # (T, H)
        return x + down                                                                   # (T, H)

    def _post_normalize(self, x, gain, bias):
        """A post norm of x (T, H): LayerNorm with its gain and bias, or RMSNorm with its gain."""
        if self.layer_norm:
            return _layer_normalize(x, self.eps) * gain + bias
        return _rms_normalize(x, self.eps) * gain

    def _activation(self, g):
        """The MLP's activation of g (its gate's sums, or an ungated MLP's up's)."""
        if self.act == "gelu_tanh":
            return _gelu_tanh(g)
        if self.act == "gelu":
            return _gelu_erf(g)
        return ops.silu(g)


class LlamaForCausalLM(nn.Cell):
    """construct(input_ids, positions, slot_mapping, block_tables, context_lens, query_lens, sample_index, tree_bits,
    lora, window_slots, window_tables) -> (greedy_token (R,) int32, its logprob (R,) float32, logits (R, V) float32),
    R = B unless packed or verifying (R = B*S).
    Argument meanings are those of ModelRunner.execute (after the runner's padding). With a window pool
    (window_pool_slots > 0: its cache's slots, scratch block included) the sliding-window layers keep their K/V
    there, written at window_slots and read through window_tables (shaped as slot_mapping and block_tables); without
    one (or without sliding layers) every layer reads slot_mapping and block_tables, and the window pair is not
    read (the runner passes the main pair again). The logits are
    only for `Sampler` (a second graph, run when some row samples); they are not copied to the host.
    Under tensor parallelism (`tp`, `all_reduce`: see parallel.py) this is rank tp.rank's shard, built from
    `weights` that hold only that rank's part (load_llama_weights(path, tp)); ranks other than 0 have no
    lm_head and return only the final hidden state (R, H). `quantized` (weights.load_quantized's, one agent): the
    matrices the CPU kernels read as the checkpoint stores them; `panels` (kernels/panel_store.py's PanelStore of the
    model file, or None): where the layer kernel's repacked matrices are kept between starts; `later`
    (kernels/repack.py's LaterRepacks, or None): repacks the layer stack's matrices after the load (queued here,
    started by the caller), the stored rows serving until then."""

    def __init__(self, cfg: LlamaConfig, weights: dict, *, num_slots: int, block_size: int,
                 max_positions: int, device_target: str = "CPU", decode_kernel: Optional[str] = None,
                 kernel_threads: int = 1, tp: TensorParallel = TensorParallel(), all_reduce=None,
                 layer_kernel: Optional[str] = None, layer_kernel_rows: Optional[int] = 0,
                 quantized: Optional[dict] = None, lora_slots: int = 0, lora_rank: int = 0,
                 kv_cache: KvCacheType = KV_CACHE_TYPES["float16"], batch_invariant: bool = False,
                 window_pool_slots: int = 0, panels=None, later=None, image_rows: int = 0):
        super().__init__()
        tp.check(cfg)
        repacker = (Repacker(layer_kernel, panels, later, invariant=batch_invariant) if layer_kernel is not None
                    else None)
        if batch_invariant and (layer_kernel is None or layer_kernel_rows is not None):
            raise ValueError("LlamaForCausalLM: batch-invariant steps need the layer kernel on every step")
        if layer_kernel is not None and (tp.world > 1 or device_target != "CPU"):
            raise ValueError("LlamaForCausalLM: the CPU layer kernel serves one CPU agent (no tensor parallelism)")
        if (tp.world > 1) != (all_reduce is not None):
            raise ValueError("LlamaForCausalLM: an all-reduce is needed exactly when tp.world > 1")
        q_name = "model.layers.0.self_attn.q_proj.weight"
        q_rows = (weights[q_name] if q_name in weights else quantized[q_name]).shape[0]
        if q_rows != cfg.num_heads // tp.world * cfg.head_dim:
            raise ValueError(f"LlamaForCausalLM: weights hold {q_rows} q_proj rows, rank {tp.rank} of {tp.world} "
                             f"needs its {cfg.num_heads // tp.world * cfg.head_dim}: load them with "
                             "load_llama_weights(path, tp)")
        self.block_size = block_size
        self.kvh = cfg.num_kv_heads // tp.world
        self.eps = cfg.rms_norm_eps
        self.writes_outputs = tp.writes_outputs
        # the embedding: a gather from float32 rows, or (read as stored on every step: not in `weights`) the
        # EmbedTokens kernel on the stored rows
        self.embed_stored = "model.embed_tokens.weight" not in weights
        if self.embed_stored:
            table = (quantized or {}).get("model.embed_tokens.weight")
            if table is None or layer_kernel is None:
                raise ValueError("LlamaForCausalLM: the embedding has no float32 weights and no stored rows the "
                                 "CPU kernels read")
            if cfg.generates and self.writes_outputs and quantized.get("lm_head.weight") is table:
                table = _repacked_tied_table(repacker, quantized)
            hidden = cfg.hidden_size
            self.embed_kernel = ops.Custom(f"{layer_kernel}:EmbedTokens", func_type="aot",
                                           out_shape=lambda ids, *_: (ids[0], hidden),
                                           out_dtype=lambda *_: ms.float32)
            self.embed_table = _stored_param(table.data, "embed_stored")                  # (V, row bytes)
            self.embed_held = EMBED_TOKENS.held(table=self.embed_table,
                                                iconfig=Tensor(EMBED_TOKENS.iconfig_array(table_type=table.qtype)))
        else:
            self.embed = _param(weights["model.embed_tokens.weight"], "embed")        # (V, H)
        # images (a vision-language model: image_rows > 0): a token id V + j (V the vocabulary) takes row j of
        # image_buffer, which the runner fills with the tower's rows before a graph call (runner/images.py), in place
        # of its embedding (Gemma's scale not applied: the projector's rows are the text model's inputs as they are).
        # DeepStack (Qwen3-VL: cfg.deepstack_layers = n): a row is n + 1 rows of H side by side, the first the
        # embedding, row k + 1 added to the token's hidden state after decoder layer k (`_deepstack`)
        self.vocab = cfg.vocab_size
        self.deepstack = cfg.deepstack_layers if image_rows else 0
        self.image_buffer = (np.zeros((image_rows, cfg.hidden_size * (1 + self.deepstack)), np.float32)
                             if image_rows else None)
        self.image_rows = (None if not image_rows
                           else _shared_param(Tensor.from_numpy(self.image_buffer), "image_rows"))  # (M, (1+n) H)
        self.hidden = cfg.hidden_size
        # a BERT encoder's embedding extras: a row per position (token type 0's folded in), then a LayerNorm
        extras = prepare_embedding_extras(cfg, weights)
        self.embed_positions = (None if extras.positions is None
                                else _param(extras.positions, "embed_positions"))                    # (P, H)
        self.embed_norm_gain = None if extras.norm_gain is None else _param(extras.norm_gain, "embed_norm_gain")
        self.embed_norm_bias = None if extras.norm_bias is None else _param(extras.norm_bias, "embed_norm_bias")
        # a causal model attends to the keys up to each token's own; an encoder's tokens to their whole input
        self.causal = cfg.causal
        self.generates = cfg.generates             # (an embedding model has no lm_head: it runs Embedder only)
        # layer_kernel_rows None: the layer kernel runs every step, and MindSpore's op-by-op layers never do
        kernel_only = layer_kernel is not None and layer_kernel_rows is None
        self.layers = nn.CellList([LlamaDecoderLayer(cfg, weights, i, num_slots, device_target, block_size,
                                                     decode_kernel, kernel_threads, tp, all_reduce,
                                                     layer_kernel, quantized, lora_slots, lora_rank,
                                                     ops_graphs=not kernel_only, kv_cache=kv_cache,
                                                     batch_invariant=batch_invariant,
                                                     window_pool_slots=window_pool_slots, repacker=repacker)
                                   for i in range(cfg.num_layers)])
        self.window_pool = any(layer.in_window_pool for layer in self.layers)
        self.layer_kernel_rows = (0 if layer_kernel is None else KERNEL_ONLY_ROWS if kernel_only
                                  else layer_kernel_rows)
        if self.writes_outputs and self.generates:      # (the logits' tensors are loaded on rank 0 only)
            head = prepare_head(cfg, weights, kernel_threads=kernel_threads if layer_kernel is not None else None,
                                quantized=quantized, batch_invariant=batch_invariant)
            self.lm_head = None if head.lm_head is None else _param(head.lm_head, "lm_head")   # (V, H)
            if layer_kernel is not None:
                self.final_logits = ops.Custom(f"{layer_kernel}:FinalLogits",
                                               out_shape=_final_logits_shapes,
                                               out_dtype=lambda x, *_: (x, ms.int32, x), func_type="aot")
                if head.kernel_type == 0:
                    self.kernel_lm_head = self.lm_head
                elif self.embed_stored and head.kernel_lm_head is quantized["model.embed_tokens.weight"].data:
                    self.kernel_lm_head = self.embed_table           # tied: the embedding's rows (repacked above)
                else:                                                # its own rows: repacked where the library does
                    rows, lm_type = repacker.rows(head.kernel_lm_head, head.kernel_type)
                    head.iconfig[FINAL_LOGITS.iconfig_index("lm_head_type")] = lm_type
                    head.kernel_type = lm_type
                    self.kernel_lm_head = _stored_param(rows, "lm_head_stored")
                self.kernel_norm_gain = _param(head.kernel_gain, "kernel_final_norm_gain")         # (H,)
                self.kernel_lm_type = head.kernel_type
                self.logits_icfg = Tensor(head.iconfig)                                      # (3,) int32
                self.logits_fcfg = Tensor(head.fconfig)                                      # (1,) float32
                self.logits_held = FINAL_LOGITS.held(lm_head=self.kernel_lm_head, gain=self.kernel_norm_gain,
                                                     iconfig=self.logits_icfg, fconfig=self.logits_fcfg)
                FINAL_LOGITS.check_call(self.fused_logits)
        # a RoPE table pair per kind some layer uses, and the layers' windows (0: every key), each one attention
        # metadata tuple per step; every layer takes its own by index
        kinds = [kind for kind in ROPE_KINDS if kind in {layer.rope_kind for layer in self.layers}]
        tables = [rope_tables(cfg, max_positions, kind) for kind in kinds]
        # multimodal RoPE with images (kernel_only): an image token's (t, h, w) rows are written before a graph
        # call into the image_rows rows after the positions' (the runner's `mrope`), and the token is given the
        # position max_positions + j (its row among the call's image tokens, as its image_buffer row)
        self.mrope = None
        if cfg.mrope_section is not None and image_rows and kernel_only:
            if kinds != ["global"] or cfg.sliding_window:
                raise ValueError("LlamaForCausalLM: multimodal RoPE with sliding or NoPE layers is not supported")
            tables = [tuple(np.ascontiguousarray(np.concatenate([t, np.repeat(t[:1], image_rows, 0)]), np.float32)
                            for t in tables[0])]
            self.mrope = (cfg, max_positions, tables[0])     # (the arrays the stack reads: contiguous float32)
        self.cos_tables = ms.ParameterTuple([_param(cos, f"rope_cos_{kind}")                            # (P, D)
                                             for (cos, _), kind in zip(tables, kinds)])
        self.sin_tables = ms.ParameterTuple([_param(sin, f"rope_sin_{kind}") for (_, sin), kind in zip(tables, kinds)])
        self.windows = tuple(sorted({layer.window or 0 for layer in self.layers}))
        for layer in self.layers:
            layer.rope_index = kinds.index(layer.rope_kind)
            layer.window_index = self.windows.index(layer.window or 0)
        self.stacks, self.stacked = [], kernel_only        # (a bool for construct: the stacks are no graph value)
        if kernel_only:
            self._stack_layers(layer_kernel, [(np.ascontiguousarray(cos, np.float32),
                                               np.ascontiguousarray(sin, np.float32)) for cos, sin in tables],
                               repacker.later)
        self.embed_scale = float(cfg.embed_scale)
        # Per-head multipliers for the fused qkv: q heads carry the attention scale, v heads no rotation.
        nh, kvh = cfg.num_heads // tp.world, cfg.num_kv_heads // tp.world
        scale = cfg.attention_scale
        rot = np.array([scale] * nh + [1.0] * kvh + [0.0] * kvh, np.float32).reshape(1, -1, 1)
        keep = np.array([0.0] * (nh + kvh) + [1.0] * kvh, np.float32).reshape(1, -1, 1)
        self.head_rot = _param(rot, "rope_head_rot")                                    # (1, NH+2KVH, 1)
        self.head_keep = _param(keep, "rope_head_keep")                                 # (1, NH+2KVH, 1)
        self.matmul_t = ops.MatMul(transpose_b=True)

    def _stack_layers(self, layer_kernel: str, tables: list, later) -> None:
        """The layers as one DecoderStack call (kernels/layer_stack.py): each layer's DecoderLayer (and MoeMlp) with
        the arrays it keeps and its RoPE tables, its caches the call's inputs; the KV caches stay Parameters. The
        matrices a layer left to `later` (LaterRepacks) are queued with the call that reads them. With DeepStack
        (n layers), a stack per layer of the first n and one of the rest (`stack_bounds`), the image rows added
        between them."""
        n, layers = self.deepstack, len(self.layers)
        self.stack_bounds = tuple(range(n + 1)) + ((layers,) if n < layers else ())    # (0, N), or (0, 1, .., n, N)
        for first, stop in zip(self.stack_bounds, self.stack_bounds[1:]):
            stack = LayerStack(layer_kernel)
            for i in range(first, stop):
                layer = self.layers[i]
                cos, sin = tables[layer.rope_index]
                sources = {**step_sources(layer.in_window_pool), **cache_sources(i - first)}
                stack.add(DECODER_LAYER, sources, {**layer.stack_held, "cos": cos, "sin": sin})
                self._queue_later(later, stack, DECODER_LAYER, layer.stack_held, layer.stack_later)
                if layer.moe:
                    stack.add(MOE_MLP, {"x": HIDDEN, "slots": sources["slots"]}, layer.moe_stack_held)
                    self._queue_later(later, stack, MOE_MLP, layer.moe_stack_held, layer.moe_stack_later)
            self.stacks.append(stack)
        self.stack_kernel = ops.Custom(f"{layer_kernel}:DecoderStack", out_shape=lambda x, *_: x,
                                       out_dtype=lambda x, *_: x, func_type="aot")
        self.stack_caches = tuple(p for layer in self.layers for p in (layer.attn.key_cache, layer.attn.value_cache))
        self.stack_handles = ms.ParameterTuple([
            Parameter(Tensor(np.array([stack.handle], np.int32)), name="layer_stack" if k == 0 else f"layer_stack_{k}",
                      requires_grad=False) for k, stack in enumerate(self.stacks)])

    @staticmethod
    def _queue_later(later, stack: LayerStack, signature, held: dict, to_later: dict) -> None:
        """Queue with `later` the matrices of `stack`'s last call left to it ({name: repacked type}): each copy
        replaces the stored rows in the stack, and its type code theirs in the call's iconfig (`held`'s, which the
        library reads at every call)."""
        call = stack.calls - 1
        for name, to in to_later.items():
            index = signature.iconfig_index(f"{name.removesuffix('_w')}_type")

            def use(panels, code, name=name, index=index):
                stack.replace(call, name, panels)
                held[name] = panels
                held["iconfig"][index] = code
            later.add(held[name], held["iconfig"][index], to, use)

    def construct(self, input_ids, positions, slot_mapping, block_tables, context_lens, query_lens, sample_index,
                  tree_bits, lora, window_slots, window_tables):
        # input_ids, positions, slot_mapping (B, S) int32; block_tables (B, W) int32; context/query_lens (B,);
        # sample_index (R,) int32: the tokens to sample from when S == 1 and R < B (packed prefill: B is then
        # the step's tokens, each with its own block-table row and context; see ModelRunner); R = B*S: every
        # token (a verify step, speculative decoding); tree_bits (B,) int32: the keys a token of a speculative
        # token tree sees (the CPU decode kernel's, see attention.paged_metadata; -1 = all, as for every other token);
        # lora (B,) int32: each row's LoRA adapter slot (0: none); window_slots (B, S), window_tables (B, W) int32: the
        # window pool's slot_mapping and block_tables (the sliding layers', when the pool is on)
        b, s = input_ids.shape
        fused = s == 1 and b <= self.layer_kernel_rows          # small decode-shaped steps: one kernel per layer
        flat_slots = slot_mapping.reshape(-1)                                            # (T,)
        x = self.hidden_states(input_ids, positions, slot_mapping, block_tables, context_lens, tree_bits, lora,
                               window_slots, window_tables)                              # (T, H)
        if s > 1 and sample_index.shape[0] == b:       # each row's last new token (else every token: verify)
            last = ops.arange(0, b, dtype=ms.int32) * s + query_lens - 1                 # (B,)
            x = ops.gather(x, last, 0)                                                   # (B, H)
        elif s == 1 and sample_index.shape[0] != b:
            x = ops.gather(x, sample_index, 0)                                           # (R, H)
            flat_slots = ops.gather(flat_slots, sample_index, 0)                         # (R,)
        if not self.writes_outputs:
            return x                                                                     # (R, H)
        if fused:
            logits, token, logprob = self.fused_logits(x, flat_slots)                    # (R, V), (R,), (R,)
            return token, logprob, logits
        logits = self.matmul_t(_rms_normalize(x, self.eps), self.lm_head)                # (R, V)
        token, logprob = greedy_pick(logits)                                             # (R,), (R,)
        return token, logprob, logits

    def hidden_states(self, input_ids, positions, slot_mapping, block_tables, context_lens, tree_bits, lora,
                      window_slots, window_tables):
        """The last decoder layer's output for every token (T, H), before the final norm: what construct takes its
        rows' logits from and an embed step pools (Embedder). Arguments as construct's."""
        b, s = input_ids.shape
        flat_pos = positions.reshape(-1)                                                 # (T,)
        flat_ids = input_ids.reshape(-1)
        x = self.embed_tokens(flat_ids, flat_pos)                                        # (T, H)
        fused = s == 1 and b <= self.layer_kernel_rows
        if fused:
            x = self.fused_layers(x, flat_pos, slot_mapping.reshape(-1), block_tables, context_lens, tree_bits, lora,
                                  window_slots.reshape(-1), window_tables, flat_ids)            # (T, H)
        else:
            ropes = ()                                                                   # per kept kind
            for cos_table, sin_table in zip(self.cos_tables, self.sin_tables):
                d = cos_table.shape[1]
                cos = ops.gather(cos_table, flat_pos, 0).reshape(b * s, 1, d)            # (T, 1, D)
                sin = ops.gather(sin_table, flat_pos, 0).reshape(b * s, 1, d)            # (T, 1, D)
                ropes += ((cos * self.head_rot + self.head_keep, sin * self.head_rot),)   # (T, NH+2KVH, D) each
            metas = ()                                      # per window, over the cache its layers keep K/V in
            for window in self.windows:
                pool = window > 0 and self.window_pool
                metas += (paged_metadata(window_tables if pool else block_tables, positions,
                                         window_slots if pool else slot_mapping, context_lens, self.block_size,
                                         self.kvh, tree_bits, window, self.causal),)
            lora_tok = ops.broadcast_to(lora.reshape(b, 1), (b, s)).reshape(b * s, 1)     # (T, 1)
            for i, layer in enumerate(self.layers):
                cos, sin = ropes[layer.rope_index]
                x = layer(x, cos, sin, metas[layer.window_index], lora_tok)              # (T, H)
                if i < self.deepstack:
                    x = self._deepstack(x, flat_ids, i)
        return x

    def _deepstack(self, x, ids, k):
        """x (T, H) after decoder layer k < deepstack: each image token's (id V + j) row j's part k + 1 added."""
        image = (ids >= self.vocab).reshape(-1, 1)                                       # (T, 1)
        rows = ops.clip_by_value(ids - self.vocab, 0, self.image_rows.shape[0] - 1)
        h = self.hidden
        part = ops.gather(self.image_rows, rows, 0)[:, (k + 1) * h:(k + 2) * h]         # (T, H)
        return x + ops.select(ops.broadcast_to(image, x.shape), part, ops.zeros_like(x))

    def embed_tokens(self, ids, positions):
        """ids, positions (T,) -> the tokens' embeddings (T, H): the EmbedTokens kernel on the stored rows, or a
        float32 gather; a BERT encoder's position rows added and the sum LayerNorm-ed; an image's token (id V + j)
        row j of the image rows."""
        if self.image_rows is not None:
            image = ids >= self.vocab                                                    # (T,)
            text_ids = ops.select(image, ops.zeros_like(ids), ids)
        else:
            text_ids = ids
        x = (self.embed_kernel(text_ids, *self.embed_held) if self.embed_stored
             else ops.gather(self.embed, text_ids, 0))
        if self.embed_scale != 1.0:                    # Gemma: the rows times sqrt(hidden)
            x = x * self.embed_scale
        if self.image_rows is not None:
            rows = ops.clip_by_value(ids - self.vocab, 0, self.image_rows.shape[0] - 1)
            picked = ops.gather(self.image_rows, rows, 0)[:, :self.hidden]               # (T, H)
            x = ops.select(ops.broadcast_to(image.reshape(-1, 1), x.shape), picked, x)
        if self.embed_positions is not None:
            x = x + ops.gather(self.embed_positions, positions, 0)                       # (T, H)
        if self.embed_norm_gain is not None:
            x = _layer_normalize(x, self.eps) * self.embed_norm_gain + self.embed_norm_bias
        return x

    def fused_layers(self, x, positions, slots, block_tables, context_lens, tree_bits, lora, window_slots,
                     window_tables, ids=None):
        """Every decoder layer as the layer kernel, on T decode-shaped tokens (x (T, H); the rest (T,), tables
        (T, W)), each over its cache's slots and tables (the window pool's for a layer in it); (T, H). With the
        kernel on every step, all of them as one call (DecoderStack; with DeepStack, a call per stack of
        `stack_bounds`). `ids` (T,): the tokens' ids, which DeepStack's image rows are added by (None: no image)."""
        if self.stacked:
            bounds = self.stack_bounds
            for k in range(len(bounds) - 1):
                x = self.stack_kernel(x, positions, slots, block_tables, context_lens, tree_bits, lora, window_slots,
                                      window_tables, *self.stack_caches[2 * bounds[k]:2 * bounds[k + 1]],
                                      self.stack_handles[k])
                if ids is not None and k < self.deepstack:
                    x = self._deepstack(x, ids, k)
            return x
        for i, layer in enumerate(self.layers):
            pool = layer.in_window_pool
            x = layer.fused(x, positions, window_slots if pool else slots, window_tables if pool else block_tables,
                            context_lens, tree_bits, self.cos_tables[layer.rope_index],
                            self.sin_tables[layer.rope_index], lora)
            if ids is not None and i < self.deepstack:
                x = self._deepstack(x, ids, i)
        return x

    def write_lora(self, slot: int, adapter) -> None:
        """Adapter slot `slot` (1..lora_slots) now holds `adapter` (models/lora.py's LoraAdapter), or nothing (None):
        written into the stacks' memory in place, so the next step computes with it (no recompile). Its rank
        must be at most the model's lora_rank."""
        for i, layer in enumerate(self.layers):
            for key, stack in layer.lora_stacks.items():
                names = [f"model.layers.{i}.{n}.weight" for n in LORA_PRODUCTS[key]]
                stack.write(slot, [None if adapter is None else adapter.deltas.get(n) for n in names], names)
            layer.refresh_lora()

    def fused_logits(self, x, slots):
        """Final norm, lm_head and the greedy pick as one kernel: (logits (R, V), token (R,), logprob (R,)); slots
        (R,) the rows' K/V slots (all < 0: nothing to compute, tokens 0)."""
        return self.final_logits(x, slots, *self.logits_held)


class DecodeRun(nn.Cell):
    """construct(input_ids (B,), positions (K, B), slot_mapping (K, B), block_tables (B, W), context_lens (K, B),
    tree_bits (B,), lora (B,), window_slots (K, B), window_tables (B, W)) -> (tokens (K, B) int32, logprobs (K, B)
    float32): K greedy decode steps of `model` in one graph, each step's tokens fed to the next (step i feeds
    positions[i], writes its K/V at slot_mapping[i], a sliding layer in the window pool at window_slots[i], and sees
    context_lens[i] keys). A row whose slot is < 0 sits the step out (its outputs there mean nothing), and a
    step all of whose rows sit out costs almost nothing: a run can end early for every row (the kernels skip
    it). It runs the layer kernel and FinalLogits (model must have them), so B is at most
    the model's layer_kernel_rows. The master's round trip and the graph launch are paid once per K tokens
    instead of once per token: at one row of a small model they are ~20% of a step (docs/benchmarks/JOURNAL.md)."""

    def __init__(self, model: LlamaForCausalLM, steps: int):
        super().__init__(auto_prefix=False)       # model's parameters keep their names (they are shared)
        if model.layer_kernel_rows < 1 or not model.writes_outputs:
            raise ValueError("DecodeRun needs a model with the CPU layer kernel and the lm_head")
        self.model = model
        self.steps = steps

    def construct(self, input_ids, positions, slot_mapping, block_tables, context_lens, tree_bits, lora, window_slots,
                  window_tables):
        m = self.model
        ids = input_ids
        tokens, logprobs = (), ()
        for i in range(self.steps):
            x = m.fused_layers(m.embed_tokens(ids, positions[i]), positions[i], slot_mapping[i], block_tables,
                               context_lens[i], tree_bits, lora, window_slots[i], window_tables)   # (B, H)
            _, ids, logprob = m.fused_logits(x, slot_mapping[i])                         # (B,) each
            tokens += (ids,)
            logprobs += (logprob,)
        return ops.stack(tokens), ops.stack(logprobs)                                    # (K, B) each


class Embedder(nn.Cell):
    """construct(input_ids, positions, slot_mapping (T, 1), block_tables (T, W), context_lens (T,), tree_bits (T,),
    lora (T,), window_slots (T, 1), window_tables (T, W)) -> the last decoder layer's output (T, H) float32 for
    every token of a packed step (as the model's packed prefill feeds them: a token a row with its own table and
    context), before the final norm: an embed step's hidden states, which the runner normalizes and pools on the
    host (models/pooling.py). No logits are computed. The model's parameters and KV cache are shared."""

    def __init__(self, model: LlamaForCausalLM):
        super().__init__(auto_prefix=False)       # model's parameters keep their names (they are shared)
        self.model = model

    def construct(self, input_ids, positions, slot_mapping, block_tables, context_lens, tree_bits, lora, window_slots,
                  window_tables):
        return self.model.hidden_states(input_ids, positions, slot_mapping, block_tables, context_lens, tree_bits,
                                        lora, window_slots, window_tables)
