"""The model's weights in the forms its graphs and CPU kernels run them, prepared in numpy (no MindSpore):
llama.py wraps what these functions return in Parameters and does nothing else to them.

Load-time rewrites of a decoder layer (`prepare_layer`):
- q/k/v fused into one [out, in] matrix (and their biases into one, where the model has them: Qwen2), gate/up
  into another: one MatMul each;
- the RMSNorm gains folded into the float32 matrix that follows the norm (input norm -> q/k/v, post-attention
  norm -> gate/up), so a norm is x * rsqrt(mean(x^2) + eps);
- a partial rotation's q and k rows (their biases, stored rows, q/k norm gains and LoRA rows too) reordered head by
  head (rope.rotary_permutation), so that every path rotates a whole head;
- the gains no product folds in (the q/k heads' norms, the sandwich norms, a BERT layer's post norms:
  `extra_gains`) kept beside them, and a LayerNorm's biases (`norm_biases`);
- an ungated MLP (BERT's down(f(up x))): its up rows are the `gate_up` product alone, and the layer kernel's gate_w a
  placeholder; MLP biases (gate's and up's, down's) beside the products;
- for the CPU layer kernel (`kernel`, kernels/decoder_layer_cpu.cc): each product's matrix as the checkpoint
  stores it where every part is block-quantized with one type (a GGUF's rows, untouched; the kernel multiplies
  the normalized activations by the norm's gain instead of having it folded in), else the float32 one; with
  the kernel's config, under the names of its inputs (kernels/signatures.DECODER_LAYER);
- LoRA adapters stacked by slot (`LoraStack`) in the layouts of the layer kernel and of MindSpore's ops.
`prepare_head` does the same for the final norm and the lm_head (the FinalLogits kernel's inputs);
`prepare_embedding_extras` what a BERT encoder adds to the embedding (its position rows with token type 0's row
folded in, its LayerNorm).

Under tensor parallelism `w` holds only this rank's part of each split tensor (weights.load_llama_weights(path,
tp)); the prepared matrices are then this rank's, and a LoRA stack cuts each adapter to match them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .kernels.signatures import DECODER_LAYER, FINAL_LOGITS, MOE_MLP
from .parallel import TensorParallel
from .rope import rotary_permutation
from .weights import LlamaConfig, QuantizedTensor

__all__ = ["EmbeddingExtras", "HeadWeights", "KERNEL_PARTS", "KernelInputs", "LORA_PRODUCTS", "LayerKernelConfig",
           "LayerWeights", "LoraStack", "MoeKernelInputs", "kernel_lora_arrays", "prepare_embedding_extras",
           "prepare_head", "prepare_layer"]

# a decoder layer's products that LoRA adapts: name -> (its parts, in the order of its output rows)
LORA_PRODUCTS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
                 "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}
# the layer kernel's weight inputs for each product's parts (kernels/signatures.DECODER_LAYER), in that order: each
# part in its own type (a Q4_K_M file stores some layers' v_proj as Q6_K beside Q4_K q/k), run as one product
KERNEL_PARTS = {"qkv": ("q_w", "k_w", "v_w"), "o": ("o_w",), "gate_up": ("gate_w", "up_w"), "down": ("down_w",)}
# the iconfig entries of the parts' type codes, in KERNEL_PARTS' order ("q_w" -> "q_type"); MoeMlp's, of its experts'
# gate, up and down stacks
_TYPE_ENTRIES = tuple(f"{name[:-len('_w')]}_type" for parts in KERNEL_PARTS.values() for name in parts)
_MOE_TYPE_ENTRIES = ("gate_type", "up_type", "down_type")
# the norm whose gain a product's input carries (folded into its float32 matrix), and the layer kernel's input
# for that gain
_NORMS = {"qkv": ("input_layernorm", "input_gain"), "gate_up": ("post_attention_layernorm", "post_gain")}
# the layer's other gains, by the layer kernel's input: the q/k heads' norms (LlamaConfig.qk_norm: (D,)) and the
# sandwich norms of the attention's and the MLP's outputs (sandwich_norms: (H,)); ones where the model has none
_EXTRA_GAINS = {"q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm", "attn_out_gain": "attn_output_norm",
                "mlp_out_gain": "mlp_output_norm"}
# the layer kernel's activation codes (iconfig): LlamaConfig.hidden_act
_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "gelu": 2}
# the layer kernel's norm codes (iconfig): LlamaConfig.norm
_NORM_CODES = {"rms": 0, "layer": 1}
# a LayerNorm's biases, by the row of the kernel's norm_bias input: the input, post-attention, attention-output and
# MLP-output norms' (a BERT layer's post norms are the last two)
_NORM_BIAS_ROWS = ("input_layernorm", "post_attention_layernorm", "attn_output_norm", "mlp_output_norm")


class LoraStack:
    """One product's LoRA adapters stacked by slot (slot 0: the base model, zeros), in the two forms the layer
    runs them in (`write` fills a slot; the layer's Parameters take the arrays again, with no recompile):
      the layer kernel's: A (S, P*R, K) and B transposed, (S, R, N), the scale folded into B;
      MindSpore's ops': A (S*P*R, K) and B (N, S*P*R), each output row's block of B nonzero only in its own
      part's columns, so that delta = ((x A^T) * one_hot(slot)) B^T for a whole batch of mixed slots.
    `gain`: the norm gain the product's float32 weight has folded in (q/k/v, gate/up), folded into the ops' A
    and into the kernel's A when `kernel_folded` (the kernel then normalizes without the gain).
    Under tensor parallelism (`tp`) a rank holds what matches its part of the base weight: B's rows of its heads
    or MLP units for the column-parallel q/k/v and gate/up (A whole: their input is whole on every rank), A's
    columns of its part of the input for the row-parallel o and down (B whole: the ranks' partial deltas are
    summed by the all-reduce that sums their products).
    `ops`: whether MindSpore's ops run the layer at all (not when the layer kernel runs every step): without them
    the ops' form is not kept (ops_a, ops_b, col_slot None)."""

    def __init__(self, slots: int, rank: int, parts: list, k: int, gain: Optional[np.ndarray], kernel_folded: bool,
                 tp: TensorParallel = TensorParallel(), row_parallel: bool = False, ops: bool = True,
                 row_orders: Optional[list] = None):
        self.slots, self.rank, self.parts, self.k = slots, rank, parts, k       # parts: [(out rows of part p)]
        # per part, the order its output rows are kept in (the base weight's: q/k under a partial rotation,
        # rope.rotary_permutation applied head by head), or None
        self.row_orders = row_orders or [None] * len(parts)
        self.gain, self.kernel_folded = gain, kernel_folded
        self.tp, self.row_parallel = tp, row_parallel
        n, width = sum(parts), len(parts) * rank
        self.kernel_a = np.zeros((slots, width, k), np.float32)
        self.kernel_b = np.zeros((slots, rank, n), np.float32)
        self.ops_a = np.zeros((slots * width, k), np.float32) if ops else None
        self.ops_b = np.zeros((n, slots * width), np.float32) if ops else None
        self.col_slot = np.repeat(np.arange(slots, dtype=np.int32), width) if ops else None  # (S*P*R,) column's slot

    def _forms(self, slot: int) -> list:
        """The arrays of slot `slot` in every form kept."""
        width = len(self.parts) * self.rank
        views = [self.kernel_a[slot], self.kernel_b[slot]]
        if self.ops_a is not None:
            views += [self.ops_a[slot * width:(slot + 1) * width], self.ops_b[:, slot * width:(slot + 1) * width]]
        return views

    @property
    def slot_nbytes(self) -> int:
        """Bytes one slot takes in the forms kept."""
        return sum(v.nbytes for v in self._forms(0))

    def write(self, slot: int, deltas: list, names: list) -> None:
        """Slot `slot` holds these per-part deltas (LoraDelta or None for a part the adapter leaves alone) of the
        base weights `names` (HF names, whole: this rank's part is cut here)."""
        r, width = self.rank, len(self.parts) * self.rank
        for arr in self._forms(slot):
            arr[...] = 0
        row = 0
        for p, (rows, d, name) in enumerate(zip(self.parts, deltas, names)):
            if d is not None:
                a, b = d.a, d.b                                                        # (r, K), (rows, r) whole
                if self.tp.world > 1 and self.row_parallel:
                    a = a[self.tp.part(name, a.shape)]                                 # this rank's input columns
                elif self.tp.world > 1:
                    b = b[self.tp.part(name, b.shape)]                                 # this rank's output rows
                if self.row_orders[p] is not None:
                    b = b[self.row_orders[p]]                                          # the base rows' order
                raw_a = a
                a = a * self.gain[None, :] if self.gain is not None else a
                b = b * np.float32(d.scale)
                self.kernel_a[slot, p * r:p * r + d.rank] = a if self.kernel_folded else raw_a
                self.kernel_b[slot, :d.rank, row:row + rows] = b.T
                if self.ops_a is not None:
                    self.ops_a[slot * width + p * r:slot * width + p * r + d.rank] = a
                    self.ops_b[row:row + rows, slot * width + p * r:slot * width + p * r + d.rank] = b
            row += rows


def kernel_lora_arrays(stacks: dict) -> dict:
    """The layer kernel's LoRA inputs ("lora_qkv_a", "lora_qkv_b", ...): the stacks' own kernel arrays."""
    return {f"lora_{key}_{ab}": arr for key, st in stacks.items() for ab, arr in (("a", st.kernel_a),
                                                                                   ("b", st.kernel_b))}


@dataclass(frozen=True)
class LayerKernelConfig:
    """What the layer kernel's iconfig carries besides the layer's shape and weight types."""

    block_size: int
    threads: int
    batch_invariant: bool = False        # every call batch-invariant (model_config.batch_invariant as resolved)


@dataclass
class KernelInputs:
    """The layer kernel's inputs a layer holds (the step's own come with each call), by the kernel's input names
    (kernels/signatures.DECODER_LAYER)."""

    matrices: dict          # "q_w", "k_w", "v_w", "o_w", "gate_w", "up_w", "down_w" (KERNEL_PARTS) -> float32 rows
                            # (of the LayerWeights' matrix: a view; or the checkpoint's, where the product has stored
                            # parts too), or the stored rows (uint8 (rows, bytes per row))
    types: tuple            # their GGML type codes, in that order (0: float32)
    qkv_bias: np.ndarray    # ((NH+2KVH)*D,) the LayerWeights' bias itself, or zeros for a model without one
    o_bias: np.ndarray      # (H,) o_proj's bias, or zeros
    sinks: np.ndarray       # (NH,) each query head's attention sink logit, or zeros (iconfig says whether)
    gate_up_bias: np.ndarray  # (2I,) gate's then up's biases, or zeros (iconfig says whether)
    down_bias: np.ndarray   # (H,) down's bias, or zeros
    norm_bias: np.ndarray   # (4, H) a LayerNorm's biases (_NORM_BIAS_ROWS), or zeros
    gains: dict             # "input_gain", "post_gain" -> (H,): 1 where folded into the float32 matrix; "q_norm",
                            # "k_norm" (D,) and "attn_out_gain", "mlp_out_gain" (H,): ones where the model has none
    lora: dict              # "lora_qkv_a", "lora_qkv_b", ... -> the stacks' kernel arrays themselves, or (without
                            # adapter slots) one all-zero slot of rank 1, which the kernel skips
    iconfig: np.ndarray     # (22,) int32, by DECODER_LAYER.iconfig's names (what each says: the C++ list)
    fconfig: np.ndarray     # (2,) float32 [rms_norm_eps, attention scale]

    def with_matrices(self, matrices: dict, types: tuple) -> "KernelInputs":
        """These inputs with other matrices and type codes (the iconfig's types too): the kernel library's
        repacked rows (kernels/repack.py)."""
        iconfig = self.iconfig.copy()
        for name, code in zip(_TYPE_ENTRIES, types):
            iconfig[DECODER_LAYER.iconfig_index(name)] = code
        return dataclasses.replace(self, matrices=matrices, types=tuple(int(t) for t in types), iconfig=iconfig)


@dataclass
class MoeKernelInputs:
    """A mixture-of-experts layer's MLP as the MoeMlp kernel takes it (kernels/signatures.MOE_MLP's held inputs),
    after the layer kernel that runs its attention without an MLP."""

    router: np.ndarray      # (E, H) float32
    router_bias: np.ndarray  # (E,) float32: zeros for a router without one
    biases: dict            # "gate_bias", "up_bias" (E*I,), "down_bias" (E*H,): the experts' biases, or zeros
    matrices: dict          # "gate_w", "up_w" (E*I, H), "down_w" (E*H, I): the experts stacked by rows, stored rows
                            # (uint8) where the checkpoint keeps them quantized, else float32
    types: tuple            # their GGML type codes, in that order (0: float32)
    post_gain: np.ndarray   # (H,) the post-attention norm's gain
    iconfig: np.ndarray     # (7,) int32, by MOE_MLP.iconfig's names
    fconfig: np.ndarray     # (3,) float32 [rms_norm_eps, swiglu alpha, swiglu limit]

    def with_matrices(self, matrices: dict, types: tuple) -> "MoeKernelInputs":
        """These inputs with other expert stacks and type codes (the iconfig's too): the library's repacked rows."""
        iconfig = self.iconfig.copy()
        for name, code in zip(_MOE_TYPE_ENTRIES, types):
            iconfig[MOE_MLP.iconfig_index(name)] = code
        return dataclasses.replace(self, matrices=matrices, types=tuple(int(t) for t in types), iconfig=iconfig)


@dataclass
class LayerWeights:
    """One decoder layer's weights as the model runs them (this rank's part under tensor parallelism)."""

    # the float32 products MindSpore's ops run; None for one the layer kernel reads as stored on every step (the
    # checkpoint's float32 copy was never made)
    qkv: Optional[np.ndarray]           # ((NH+2KVH)*D, H) float32, the input norm's gain folded in
    qkv_bias: Optional[np.ndarray]      # ((NH+2KVH)*D,) where the model has q/k/v biases (not touched by the fold)
    o: Optional[np.ndarray]             # (H, NH*D)
    gate_up: Optional[np.ndarray]       # (2I, H), the post-attention norm's gain folded in; an ungated MLP's: up (I, H)
    down: Optional[np.ndarray]          # (H, I)
    # the model's other gains where it has them (else None): q_norm, k_norm (D,) in the q/k rows' order;
    # attn_out_gain, mlp_out_gain (H,) (_EXTRA_GAINS: a sandwich's or a BERT layer's post norms)
    extra_gains: dict = field(default_factory=dict)
    # a LayerNorm's biases (H,) by its norm (_NORM_BIAS_ROWS), where the model has them
    norm_biases: dict = field(default_factory=dict)
    # the MLP's biases where it has them: gate_proj, up_proj (I,), down_proj (H,) (gate_up: an ungated MLP's is up's)
    mlp_biases: dict = field(default_factory=dict)
    lora_stacks: dict = field(default_factory=dict)     # product (LORA_PRODUCTS) -> LoraStack; {}: no adapter slots
    kernel: Optional[KernelInputs] = None               # None: no layer kernel
    moe: Optional[MoeKernelInputs] = None               # a mixture-of-experts layer's MLP (the kernel's only)


def _fused(w: dict, prefix: str, parts, suffix: str = "weight") -> np.ndarray:
    """The parts' tensors stacked by rows; a single part is the checkpoint's array itself (no copy)."""
    arrays = [w[f"{prefix}{part}.{suffix}"] for part in parts]
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=0)


def prepare_layer(cfg: LlamaConfig, w: dict, i: int, *, tp: TensorParallel = TensorParallel(),
                  kernel: Optional[LayerKernelConfig] = None, quantized: Optional[dict] = None,
                  lora_slots: int = 0, lora_rank: int = 0, ops_graphs: bool = True) -> LayerWeights:
    """Layer i's weights from the checkpoint's tensors `w` (HF names, float32; this rank's part of each split
    one), for the layer kernel too when `kernel` is given (reading `quantized`'s stored matrices, weights.
    load_quantized's, where it has them), with `lora_slots` adapter slots of rank `lora_rank` (all empty)."""
    p = f"model.layers.{i}."
    quantized = quantized or {}
    moe = cfg.layer_moe(i)
    if moe and (kernel is None or ops_graphs or tp.world > 1):
        raise ValueError(f"layer {i} is a mixture of experts, which runs on the CPU layer kernel only, on every step "
                         "(no tensor parallelism, no op-by-op graphs: layer_kernel on, layer_kernel_rows unset)")
    if not cfg.causal and lora_slots:
        raise ValueError("LoRA adapters on a bidirectional encoder (an embedding model) are not supported")
    # the products the layer's own weights make (a mixture's MLP is MoeMlp's: its layer kernel runs no MLP; an
    # ungated MLP's first product is up alone)
    products = {key: parts for key, parts in LORA_PRODUCTS.items() if not (moe and key in ("gate_up", "down"))}
    if not cfg.gated_mlp and "gate_up" in products:
        products["gate_up"] = ("mlp.up_proj",)
    nh, kvh, d = cfg.num_heads // tp.world, cfg.num_kv_heads // tp.world, cfg.head_dim
    inter, h = cfg.intermediate_size // tp.world, cfg.hidden_size
    perm = rotary_permutation(cfg)
    orders = {"self_attn.q_proj": None, "self_attn.k_proj": None}
    if perm is not None:                 # a partial rotation: q/k rows (and what follows them) reordered per head
        orders = {"self_attn.q_proj": _head_order(perm, nh), "self_attn.k_proj": _head_order(perm, kvh)}
        w, quantized = _reordered(w, p, orders, perm), _reordered(quantized, p, orders, perm)
    # the pre norms' gains, folded into the float32 products (a post-norm layer's input is normalized already)
    gain = ({} if cfg.post_norm else {key: w[f"{p}{norm}.weight"] for key, (norm, _) in _NORMS.items()})   # (H,) each
    post_gain = gain.get("gate_up")
    if moe:
        gain.pop("gate_up", None)
    # the float32 form of the products whose parts `w` holds (a product the kernel runs as stored for every step
    # was not read as float32 at all: weights.load_llama_weights' `skip`)
    f32 = {key: _fused(w, p, parts) for key, parts in products.items()
           if all(f"{p}{part}.weight" in w for part in parts)}
    for key, g in gain.items():
        if key in f32:
            f32[key] = f32[key] * g[None, :]                      # (rows, H): the norm's gain folded in
    bias = _fused(w, p, LORA_PRODUCTS["qkv"], "bias") if cfg.attention_bias else None       # Qwen2
    layer = LayerWeights(qkv=f32.get("qkv"), qkv_bias=bias, o=f32.get("o"), gate_up=f32.get("gate_up"),
                         down=f32.get("down"),
                         extra_gains={key: w[f"{p}{norm}.weight"] for key, norm in _EXTRA_GAINS.items()
                                      if f"{p}{norm}.weight" in w},
                         norm_biases={norm: w[f"{p}{norm}.bias"] for norm in _NORM_BIAS_ROWS
                                      if f"{p}{norm}.bias" in w},
                         mlp_biases={part: w[f"{p}mlp.{part}.bias"] for part in ("gate_proj", "up_proj", "down_proj")
                                     if f"{p}mlp.{part}.bias" in w})
    # each part the kernel reads as stored (a product with any such part gets its norm's gain from the kernel,
    # not folded in: LoRA's A then leaves it to the kernel too)
    stored = {}
    if kernel is not None:
        for key, parts in products.items():
            kept = {part: quantized[f"{p}{part}.weight"] for part in parts if f"{p}{part}.weight" in quantized}
            if kept:
                stored[key] = kept
    missing = [f"{p}{part}.weight" for key, parts in products.items() for part in parts
               if key not in f32 and part not in stored.get(key, {}) and f"{p}{part}.weight" not in w]
    if missing:
        raise ValueError(f"{missing[0]} has neither float32 weights nor stored rows the layer kernel reads")
    if lora_slots > 0:
        shapes = {"qkv": ([nh * d, kvh * d, kvh * d], h), "o": ([h], nh * d), "gate_up": ([inter, inter], h),
                  "down": ([h], inter)}
        layer.lora_stacks = {key: LoraStack(lora_slots + 1, lora_rank, parts, k, gain.get(key),
                                            kernel_folded=key not in stored, tp=tp, row_parallel=key in ("o", "down"),
                                            ops=ops_graphs, row_orders=[orders.get(part) for part in LORA_PRODUCTS[key]])
                             for key, (parts, k) in shapes.items() if key in products}
    if kernel is not None:
        layer.kernel = _kernel_inputs(layer, w, p, stored, gain, nh, kvh, d, 1 if moe else inter, h, kernel, cfg, i,
                                      products, lora_slots, lora_rank)
    if moe:
        layer.moe = _moe_inputs(cfg, w, quantized, p, post_gain, kernel)
    return layer


_EXPERT_PARTS = {"gate_w": "mlp.experts.gate_proj", "up_w": "mlp.experts.up_proj", "down_w": "mlp.experts.down_proj"}


def _moe_inputs(cfg: LlamaConfig, w: dict, quantized: dict, p: str, post_gain: np.ndarray,
                kernel: LayerKernelConfig) -> MoeKernelInputs:
    """MoeMlp's inputs for layer prefix p: the router, the experts' stacks (as stored where `quantized` has them),
    the post-attention norm's gain (never folded: the router reads the normalized x too)."""
    matrices, types = {}, []
    for name, part in _EXPERT_PARTS.items():
        stored = quantized.get(f"{p}{part}.weight")
        if stored is not None:
            matrices[name], qtype = stored.data, stored.qtype
        else:
            matrices[name], qtype = np.ascontiguousarray(w[f"{p}{part}.weight"], np.float32), 0
        types.append(int(qtype))
    e, inter, h = cfg.num_experts, cfg.expert_intermediate_size, cfg.hidden_size

    def bias(name: str, size: int) -> np.ndarray:
        return np.ascontiguousarray(w.get(f"{p}{name}", np.zeros(size, np.float32)), np.float32)

    return MoeKernelInputs(
        router=np.ascontiguousarray(w[f"{p}mlp.router.weight"], np.float32), router_bias=bias("mlp.router.bias", e),
        biases={"gate_bias": bias("mlp.experts.gate_proj.bias", e * inter),
                "up_bias": bias("mlp.experts.up_proj.bias", e * inter),
                "down_bias": bias("mlp.experts.down_proj.bias", e * h)},
        matrices=matrices, types=tuple(types), post_gain=np.ascontiguousarray(post_gain, np.float32),
        iconfig=MOE_MLP.iconfig_array(threads=kernel.threads, experts_per_token=cfg.experts_per_token,
                                      **dict(zip(_MOE_TYPE_ENTRIES, types)), renormalize=int(cfg.norm_topk_prob),
                                      activation=int(cfg.expert_act == "swiglu_oai")),
        fconfig=np.array([cfg.rms_norm_eps, cfg.swiglu_alpha, cfg.swiglu_limit], np.float32))


def _head_order(perm: np.ndarray, heads: int) -> np.ndarray:
    """The row order of a (heads * D, ...) matrix whose every head's D rows are taken in `perm`'s order."""
    d = len(perm)
    return (np.arange(heads)[:, None] * d + perm[None, :]).reshape(-1)


def _reordered(tensors: dict, p: str, orders: dict, perm: np.ndarray) -> dict:
    """`tensors` with layer p's q and k rows (weights, stored rows, biases) and q/k norm gains in the model's order
    (rope.rotary_permutation); the others as they are (a shallow copy: nothing else is copied)."""
    out = dict(tensors)
    for part, order in orders.items():
        for suffix in ("weight", "bias"):
            name = f"{p}{part}.{suffix}"
            if name in out:
                t = out[name]
                out[name] = (dataclasses.replace(t, data=np.ascontiguousarray(t.data[order]))
                             if isinstance(t, QuantizedTensor) else np.ascontiguousarray(t[order]))
    for norm in ("self_attn.q_norm", "self_attn.k_norm"):
        if f"{p}{norm}.weight" in out:
            out[f"{p}{norm}.weight"] = np.ascontiguousarray(out[f"{p}{norm}.weight"][perm])
    return out


def _kernel_inputs(layer: LayerWeights, w: dict, p: str, stored: dict, gain: dict, nh: int, kvh: int, d: int,
                   inter: int, h: int, config: LayerKernelConfig, cfg: LlamaConfig, i: int, products: dict,
                   lora_slots: int = 0, lora_rank: int = 0) -> KernelInputs:
    """The layer kernel's view of `layer`, part by part (KERNEL_PARTS): a part's stored rows where `stored` has
    them; else float32: its rows of the product's float32 matrix (the norm's gain folded in), or, in a product
    with stored parts too, the checkpoint's own rows (the kernel applies that product's gain to the activations).
    A mixture-of-experts layer (layer.moe; `inter` 1) runs no MLP here: its gate/up/down are (1, H), (1, H) and
    (H, 1) placeholders the kernel does not read (iconfig's MLP entry 0), their LoRA inputs zeros of their shape;
    an ungated MLP's gate_w a (1, H) placeholder (iconfig's gated entry 0)."""
    one = np.ones(h, np.float32)
    moe = cfg.layer_moe(i)
    matrices, types, gains = {}, [], {}
    for key, parts in LORA_PRODUCTS.items():
        if moe and key in ("gate_up", "down"):
            for name in KERNEL_PARTS[key]:
                matrices[name] = np.zeros((h, 1) if name == "down_w" else (1, h), np.float32)
                types.append(0)
            if key == "gate_up":
                gains["post_gain"] = one
            continue
        kept = stored.get(key, {})
        row = 0
        if key == "gate_up" and not cfg.gated_mlp:          # an ungated MLP: no gate rows (a placeholder)
            matrices["gate_w"] = np.zeros((1, h), np.float32)
            types.append(0)
        for part, name in zip(products[key], KERNEL_PARTS[key][-len(products[key]):]):
            rows = {"self_attn.q_proj": nh * d, "self_attn.k_proj": kvh * d, "self_attn.v_proj": kvh * d,
                    "mlp.gate_proj": inter, "mlp.up_proj": inter}.get(part, h)           # o_proj, down_proj: H
            if part in kept:
                matrices[name], qtype = kept[part].data, kept[part].qtype
            elif kept:
                matrices[name], qtype = w[f"{p}{part}.weight"], 0
            else:
                matrices[name], qtype = getattr(layer, key)[row:row + rows], 0
            types.append(int(qtype))
            row += rows
        if key in _NORMS:
            gains[_NORMS[key][1]] = gain[key] if kept and key in gain else one
    for name in _EXTRA_GAINS:
        gains[name] = layer.extra_gains.get(name, np.ones(d if name in ("q_norm", "k_norm") else h, np.float32))
    nqkv = (nh + 2 * kvh) * d
    # (without adapter slots: one all-zero slot of rank 1, which the kernel skips; a product no stack adapts: zeros
    # of the slots' count and rank)
    slots, rank = (lora_slots + 1, lora_rank) if layer.lora_stacks else (1, 1)
    parts = {"qkv": (3, h, nqkv), "o": (1, nh * d, h), "gate_up": (2, h, 2 * inter), "down": (1, inter, h)}
    lora = {f"lora_{key}_{ab}": np.zeros((slots, n * rank, k) if ab == "a" else (slots, rank, out), np.float32)
            for key, (n, k, out) in parts.items() for ab in ("a", "b")}
    lora.update(kernel_lora_arrays(layer.lora_stacks))
    qkv_bias = layer.qkv_bias if layer.qkv_bias is not None else np.zeros(nqkv, np.float32)
    o_bias = np.ascontiguousarray(w.get(f"{p}self_attn.o_proj.bias", np.zeros(h, np.float32)), np.float32)
    sinks = np.ascontiguousarray(w.get(f"{p}self_attn.sinks", np.zeros(nh, np.float32)), np.float32)
    biases = layer.mlp_biases
    zeros = np.zeros(inter, np.float32)
    gate_up_bias = np.concatenate([biases.get("gate_proj", zeros), biases.get("up_proj", zeros)]).astype(np.float32)
    down_bias = np.ascontiguousarray(biases.get("down_proj", np.zeros(h, np.float32)), np.float32)
    norm_bias = np.stack([layer.norm_biases.get(norm, np.zeros(h, np.float32)) for norm in _NORM_BIAS_ROWS]
                         ).astype(np.float32)
    iconfig = DECODER_LAYER.iconfig_array(
        block_size=config.block_size, num_heads=nh, num_kv_heads=kvh, threads=config.threads,
        **dict(zip(_TYPE_ENTRIES, types)), batch_invariant=int(config.batch_invariant),
        activation=_ACTIVATIONS[cfg.hidden_act], qk_norm=int(cfg.qk_norm), sandwich_norms=int(cfg.sandwich_norms),
        window=cfg.layer_window(i) or 0, mlp=0 if moe else 1, attention_sinks=int(cfg.attention_sinks),
        norm=_NORM_CODES[cfg.norm], post_norms=int(cfg.post_norm), gated_mlp=int(cfg.gated_mlp),
        mlp_biases=int(cfg.mlp_bias and not moe))
    return KernelInputs(matrices=matrices, types=tuple(types), qkv_bias=qkv_bias, o_bias=o_bias, sinks=sinks,
                        gate_up_bias=gate_up_bias, down_bias=down_bias, norm_bias=norm_bias, gains=gains, lora=lora,
                        iconfig=iconfig, fconfig=np.array([cfg.rms_norm_eps, cfg.attention_scale], np.float32))


@dataclass
class EmbeddingExtras:
    """What the embedding adds to a token's row besides its scale (a BERT encoder's; None where the model has none):
    a learned row per position, token type 0's row folded in (a single text is type 0), then a LayerNorm."""

    positions: Optional[np.ndarray] = None      # (P, H) float32: position p's row + token type 0's
    norm_gain: Optional[np.ndarray] = None      # (H,) the embedding LayerNorm's gain
    norm_bias: Optional[np.ndarray] = None      # (H,) and bias


def prepare_embedding_extras(cfg: LlamaConfig, weights: dict) -> EmbeddingExtras:
    """The embedding's extras of `cfg` (`learned_positions`, `embed_norm`) from the checkpoint's float32 tensors."""
    extras = EmbeddingExtras()
    if cfg.learned_positions:
        rows = np.asarray(weights["model.embed_positions.weight"], np.float32)
        if cfg.type_vocab_size:
            rows = rows + np.asarray(weights["model.embed_token_types.weight"][0], np.float32)[None, :]
        extras.positions = np.ascontiguousarray(rows, np.float32)
    if cfg.embed_norm:
        extras.norm_gain = np.ascontiguousarray(weights["model.embed_norm.weight"], np.float32)
        extras.norm_bias = np.ascontiguousarray(weights.get("model.embed_norm.bias", np.zeros(cfg.hidden_size)),
                                                np.float32)
    return extras


@dataclass
class HeadWeights:
    """The final norm and the lm_head as the model runs them (rank 0's only: the logits are computed there)."""

    lm_head: Optional[np.ndarray]               # (V, H) float32, the final norm's gain folded in (None: stored only)
    kernel_lm_head: Optional[np.ndarray] = None  # FinalLogits': the same array, or the stored rows (uint8)
    kernel_gain: Optional[np.ndarray] = None     # (H,): 1 where folded
    kernel_type: int = 0                         # the GGML type code FinalLogits reads (0: float32)
    iconfig: Optional[np.ndarray] = None         # (3,) int32, by FINAL_LOGITS.iconfig's names
    fconfig: Optional[np.ndarray] = None         # (1,) float32 [rms_norm_eps]


def prepare_head(cfg: LlamaConfig, weights: dict, *, kernel_threads: Optional[int] = None,
                 quantized: Optional[dict] = None, batch_invariant: bool = False) -> HeadWeights:
    """The lm_head with the final norm's gain folded in (None when `weights` has no float32 lm_head: the kernel
    reads it as stored on every step), and FinalLogits' inputs when `kernel_threads` is given (the stored rows
    where `quantized` has the lm_head, the gain then beside them; batch_invariant: every call's)."""
    lm_head = (weights["lm_head.weight"] * weights["model.norm.weight"][None, :]                # (V, H)
               if "lm_head.weight" in weights else None)
    head = HeadWeights(lm_head=lm_head)
    if kernel_threads is not None:
        stored = (quantized or {}).get("lm_head.weight")
        kept = None if stored is None else (stored.data, stored.qtype)
        if kept is None and lm_head is None:
            raise ValueError("the lm_head has neither float32 weights nor stored rows FinalLogits reads")
        if kept is None:
            head.kernel_lm_head, head.kernel_gain = lm_head, np.ones(cfg.hidden_size, np.float32)
        else:
            (head.kernel_lm_head, head.kernel_type), head.kernel_gain = kept, weights["model.norm.weight"]
        head.iconfig = FINAL_LOGITS.iconfig_array(threads=kernel_threads, lm_head_type=head.kernel_type,
                                                  batch_invariant=int(batch_invariant))
        head.fconfig = np.array([cfg.rms_norm_eps], np.float32)
    return head
