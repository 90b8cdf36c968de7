"""What every weight format shares: the model's config (`LlamaConfig`), a tensor not read yet (`StoredTensor`),
a matrix as the checkpoint stores it (`QuantizedTensor`), the error a bad checkpoint raises (`WeightLoadError`),
the tensors and shapes the model needs (`expected_shapes`), and the row order llama2.c and GGUF files need undone
(`rotate_half_rows`). The format modules import this one; it imports none of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

__all__ = ["HIDDEN_ACTS", "NORMS", "LlamaConfig", "QuantizedTensor", "StoredTensor", "WeightLoadError", "check_shape",
           "check_tensors", "expected_shapes", "first_id", "rotate_half_rows", "split_fused", "stack_rows"]


class WeightLoadError(ValueError):
    """A checkpoint file or tensor is missing, unreadable or has the wrong shape; the message names it."""


@dataclass(frozen=True)
class StoredTensor:
    """A checkpoint tensor that is not read yet: its full shape, and `read(index)`, which reads only the part
    `index` (a tuple of slices) selects, as float32. A tensor-parallel rank reads just its shard this way."""

    shape: tuple
    read: Callable[[tuple], np.ndarray]
    # a matrix the checkpoint stores block-quantized (GGUF): its GGML type code and read_blocks(rows slice) ->
    # uint8 (rows, bytes per row), the stored bytes of those rows (see load_quantized)
    qtype: Optional[int] = None
    read_blocks: Optional[Callable[[slice], np.ndarray]] = None
    # the type the checkpoint stores it in, where reading it as float32 converts it (a GGUF's "Q3_K", "F16", ...):
    # what load_llama_weights names when it makes a float32 copy of such a matrix
    stored_type: Optional[str] = None
    # where its stored bytes lie whole in the checkpoint file, rows in order: (byte offset, rows, bytes per row); None
    # when they do not (rows reordered, or no stored bytes). A cache may then keep the place instead of the bytes.
    region: Optional[tuple] = None

    @classmethod
    def of(cls, array: np.ndarray) -> "StoredTensor":
        """A tensor already in memory (a format whose reader loads everything)."""
        return cls(tuple(array.shape), lambda index: array[index])

    def rows(self, start: int, stop: int) -> "StoredTensor":
        """Rows start:stop as a tensor of their own (a part of a fused q/k/v or gate/up matrix): its read(index)
        and read_blocks(rows) read only the rows asked for, counted from `start`."""
        def shifted(rows: slice) -> slice:
            first, last, step = rows.indices(stop - start)
            return slice(start + first, start + last, step)

        blocks, region = self.read_blocks, self.region
        if region is not None:
            offset, _, row_bytes = region
            region = (offset + start * row_bytes, stop - start, row_bytes)
        return StoredTensor((stop - start,) + tuple(self.shape[1:]),
                            lambda index: self.read((shifted(index[0]),) + tuple(index[1:])), self.qtype,
                            None if blocks is None else (lambda rows: blocks(shifted(rows))), self.stored_type,
                            region)


@dataclass(frozen=True)
class QuantizedTensor:
    """A (rows, cols) weight matrix in a checkpoint's block-quantized form: `data` uint8 (rows, bytes per row),
    each row `cols` weights in blocks of GGML type `qtype` (2 Q4_0, 3 Q4_1, 8 Q8_0, 1 F16), rows in the order
    the float32 loader gives them (a GGUF llama's q/k rows permuted as theirs are)."""

    qtype: int
    shape: tuple
    data: np.ndarray


@dataclass(frozen=True)
class LlamaConfig:
    """A LLaMA-family model's shape and the things in which the family's members differ, as data (one model file
    serves them all). Each field's default is LLaMA's; a family sets what it changes:

    - `attention_bias`: q/k/v have biases (Qwen2).
    - `qk_norm`: each query and key head is RMS-normalized (gains `self_attn.q_norm.weight`, `k_norm`, (D,)) before
      RoPE (Qwen3, Gemma 3).
    - `sandwich_norms`: the attention's and the MLP's outputs are RMS-normalized (gains `attn_output_norm.weight`,
      `mlp_output_norm.weight`, (H,)) before the residual adds them (Gemma 3's post_attention_layernorm and
      post_feedforward_layernorm; its pre_feedforward_layernorm is the usual `post_attention_layernorm`).
      Every gain is stored as the multiplier itself: Gemma's (1 + w) is added by the reader.
    - `embed_scale`: the embedding's rows are multiplied by it (Gemma: sqrt(hidden)).
    - `hidden_act`: the gated MLP's activation, "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma).
    - `query_scale`: the attention's score scale (Gemma 3: query_pre_attn_scalar ** -0.5); None: head_dim ** -0.5.
    - `rotary_dim`: the leading dimensions of each head that RoPE rotates (Phi-4-mini: 3/4 of them), the rest
      pass through; None: all of them.
    - `rope_freq_factors`: a divisor per frequency (Llama-3.1's scaling, linear scaling, longrope's short factors);
      `rope_long_factors` with `rope_original_context`: longrope's factors for a served context longer than the
      original one (as llama.cpp chooses them, by the context served); `rope_scale`: cos and sin multiplied by it
      (longrope's attention factor).
    - `sliding_window` with `layer_types`: the layers ("sliding" or "full", one per layer) whose attention sees
      only the last `sliding_window` keys (the token's own included). `layer_types` None: every layer slides when
      `sliding_window` is set (Mistral v0.1, Qwen2 with use_sliding_window), none otherwise.
    - `local_rope_theta`: the sliding layers' own RoPE base, unscaled (Gemma 3's rope_local_base_freq).
    - `mrope_section`: multimodal RoPE (Qwen2.5-VL's M-RoPE): a head's rotary frequencies in three runs of these
      lengths (summing to rotary_dim / 2), each rotated by one of a token's three positions (time, row, column).
      A text token's three are one number, so that text alone is plain RoPE; an image's tokens take their place in
      the image's grid (the runner's rope rows, models/rope.py's `mrope_rows`), and the tokens after an image go on
      from its largest position, not from its token count. `mrope_interleaved` (Qwen3-VL's): the frequencies taken
      in turn t, h, w, t, h, w, ... (h's the first mrope_section[1] such, w's the first mrope_section[2], t's the
      rest) rather than in three runs.
    - `deepstack_layers` (Qwen3-VL's DeepStack): an image token's tower rows are 1 + deepstack_layers rows of
      hidden_size side by side; the first is its embedding, and row k + 1 is added to its hidden state after
      decoder layer k (k < deepstack_layers).
    - `nope_layers`: the layers without RoPE (SmolLM3's no_rope_layers).
    - `num_experts` > 0: a mixture of experts (Qwen3-MoE, Mixtral): each layer's MLP is `num_experts` gated MLPs of
      `expert_intermediate_size` units, of which a router (a linear layer over the experts) picks the
      `experts_per_token` with the largest logits for each token, their results weighted by the softmax of the
      logits over the chosen ones (`norm_topk_prob`: Mixtral, Qwen3-MoE's usual setting) or over all experts (not
      renormalized). `dense_layers`: those with the usual MLP of `intermediate_size` units instead (Qwen3-MoE's
      mlp_only_layers). `moe_bias`: the router and the experts' gate/up/down have biases (gpt-oss);
      `expert_act`: the experts' activation, "silu" (SwiGLU) or "swiglu_oai" (gpt-oss's: gate clamped to at most
      `swiglu_limit`, up to +-limit, gate * sigmoid(`swiglu_alpha` * gate) * (up + 1)).
    - `o_bias`: o_proj has a bias (gpt-oss). `attention_sinks`: each query head has a learned logit
      (`self_attn.sinks`, (NH,)) in its softmax's denominator (gpt-oss).

    A bidirectional encoder (BERT and its kin: all-MiniLM, bge) is the same layer with these switched:
    - `causal` False: every token of an input sees every token of it (the input is computed in one step); the model
      has no lm_head and does not generate: it embeds only.
    - `norm`: "rms" (RMSNorm, a gain) or "layer" (LayerNorm: the mean subtracted, a gain and a bias, `<norm>.bias`
      beside each `<norm>.weight`). `rms_norm_eps` is every norm's epsilon.
    - `post_norm`: the norms come after each residual add, x = norm(x + attention(x)), x = norm(x + mlp(x)) (gains
      and biases `attn_output_norm`, `mlp_output_norm`), instead of before each part; there is no final norm.
    - `gated_mlp` False: the MLP is down(f(up x)) (no gate_proj); `mlp_bias`: up (gate) and down have biases.
    - `hidden_act` "gelu": GELU's exact (erf) form.
    - `learned_positions`: the embedding adds a learned row per position (`model.embed_positions.weight`, (P, H))
      and token type 0's row (`model.embed_token_types.weight`, (T, H): a single text is type 0), and no layer
      rotates (RoPE); `embed_norm`: the sum is normalized (`model.embed_norm.weight` and `.bias`)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    bos_token_id: Optional[int] = 1
    eos_token_id: Optional[int] = 2
    tie_word_embeddings: bool = False
    architecture: str = "llama"
    attention_bias: bool = False
    rope_freq_factors: Optional[tuple] = None
    sliding_window: Optional[int] = None
    qk_norm: bool = False
    sandwich_norms: bool = False
    embed_scale: float = 1.0
    hidden_act: str = "silu"
    query_scale: Optional[float] = None
    rotary_dim: Optional[int] = None
    rope_long_factors: Optional[tuple] = None
    rope_original_context: Optional[int] = None
    rope_scale: float = 1.0
    layer_types: Optional[tuple] = None
    local_rope_theta: Optional[float] = None
    nope_layers: tuple = ()
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    dense_layers: tuple = ()
    moe_bias: bool = False
    expert_act: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    o_bias: bool = False
    attention_sinks: bool = False
    causal: bool = True
    norm: str = "rms"
    post_norm: bool = False
    gated_mlp: bool = True
    mlp_bias: bool = False
    learned_positions: bool = False
    type_vocab_size: int = 0
    embed_norm: bool = False
    mrope_section: Optional[tuple] = None
    mrope_interleaved: bool = False
    deepstack_layers: int = 0

    def __post_init__(self):
        if self.hidden_act not in HIDDEN_ACTS:
            raise WeightLoadError(f"{self.architecture}: hidden activation {self.hidden_act!r} is not supported "
                                  f"(supported: {', '.join(HIDDEN_ACTS)})")
        rot = self.rotary_dim if self.rotary_dim is not None else self.head_dim
        if not self.learned_positions and (rot % 2 or not 0 < rot <= self.head_dim):
            raise WeightLoadError(f"{self.architecture}: rotary dimension {rot} must be even and at most "
                                  f"head_dim={self.head_dim}")
        if self.mrope_section is not None and (len(self.mrope_section) != 3 or min(self.mrope_section) < 0
                                               or 2 * sum(self.mrope_section) != rot):
            raise WeightLoadError(f"{self.architecture}: mrope_section {self.mrope_section} must be three lengths "
                                  f"summing to half the rotary dimension ({rot // 2})")
        if not 0 <= self.deepstack_layers <= self.num_layers:
            raise WeightLoadError(f"{self.architecture}: {self.deepstack_layers} DeepStack layers, but the model has "
                                  f"{self.num_layers} decoder layers")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers or set(self.layer_types) - {"full", "sliding"}:
                raise WeightLoadError(f"{self.architecture}: layer_types must name 'full' or 'sliding' for each of "
                                      f"the {self.num_layers} layers, got {list(self.layer_types)}")
            if "sliding" in self.layer_types and not self.sliding_window:
                raise WeightLoadError(f"{self.architecture}: sliding layers without a sliding_window")
        if any(not 0 <= i < self.num_layers for i in self.nope_layers):
            raise WeightLoadError(f"{self.architecture}: nope_layers {list(self.nope_layers)} name layers past "
                                  f"the model's {self.num_layers}")
        if self.norm not in NORMS:
            raise WeightLoadError(f"{self.architecture}: norm {self.norm!r} is not supported (supported: "
                                  f"{', '.join(NORMS)})")
        if self.norm == "layer" and not self.post_norm:
            raise WeightLoadError(f"{self.architecture}: LayerNorm is supported as post norms only (BERT's); a "
                                  "pre-norm LayerNorm model is not")
        if self.post_norm and self.sandwich_norms:
            raise WeightLoadError(f"{self.architecture}: post norms and sandwich norms exclude each other")
        if not self.gated_mlp and self.num_experts:
            raise WeightLoadError(f"{self.architecture}: a mixture of experts has gated experts")
        if not self.causal and self.num_experts:
            raise WeightLoadError(f"{self.architecture}: a bidirectional encoder with a mixture of experts is not "
                                  "supported")
        if self.expert_act not in EXPERT_ACTS:
            raise WeightLoadError(f"{self.architecture}: expert activation {self.expert_act!r} is not supported "
                                  f"(supported: {', '.join(EXPERT_ACTS)})")
        if self.num_experts and not (0 < self.experts_per_token <= self.num_experts
                                     and self.expert_intermediate_size > 0):
            raise WeightLoadError(f"{self.architecture}: {self.num_experts} experts need 1 to {self.num_experts} "
                                  f"experts per token (got {self.experts_per_token}) and an expert size (got "
                                  f"{self.expert_intermediate_size})")

    def layer_moe(self, i: int) -> bool:
        """Whether layer i's MLP is a mixture of experts (else the dense gate/up/down)."""
        return self.num_experts > 0 and i not in self.dense_layers

    @property
    def attention_scale(self) -> float:
        """The attention's score scale (queries are multiplied by it)."""
        return self.query_scale if self.query_scale is not None else self.head_dim ** -0.5

    @property
    def rotary_dims(self) -> int:
        """How many leading dimensions of each head RoPE rotates."""
        return self.rotary_dim if self.rotary_dim is not None else self.head_dim

    def layer_window(self, i: int) -> Optional[int]:
        """Layer i's sliding window (the keys its attention sees: the last this many), or None (all of them)."""
        if not self.sliding_window:
            return None
        sliding = self.layer_types is None or self.layer_types[i] == "sliding"
        return int(self.sliding_window) if sliding else None

    @property
    def generates(self) -> bool:
        """Whether the model has an lm_head and generates text (a causal decoder); else it only embeds."""
        return self.causal

    def layer_rope(self, i: int) -> str:
        """Which RoPE layer i applies: "global" (rope_theta, scaled as configured), "local" (a sliding layer of
        a model with local_rope_theta) or "none" (also every layer of a model with learned positions)."""
        if i in self.nope_layers or self.learned_positions:
            return "none"
        if self.local_rope_theta is not None and self.layer_window(i) is not None:
            return "local"
        return "global"


# the gated MLP's activations the model computes (LlamaConfig.hidden_act), and a mixture's experts' (expert_act)
HIDDEN_ACTS = ("silu", "gelu_tanh", "gelu")
NORMS = ("rms", "layer")
EXPERT_ACTS = ("silu", "swiglu_oai")


def first_id(value) -> Optional[int]:
    """A config's token id that may be given as a list of ids (its first), or None."""
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)




def expected_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs (HF names) and its shape."""
    h, d = cfg.hidden_size, cfg.head_dim
    layer_norm = cfg.norm == "layer"

    def norm(shapes: dict, name: str) -> None:             # a norm's gain, and its bias for a LayerNorm
        shapes[name + ".weight"] = (h,)
        if layer_norm:
            shapes[name + ".bias"] = (h,)

    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    if cfg.learned_positions:
        shapes["model.embed_positions.weight"] = (cfg.max_position_embeddings, h)
        if cfg.type_vocab_size:
            shapes["model.embed_token_types.weight"] = (cfg.type_vocab_size, h)
    if cfg.embed_norm:
        norm(shapes, "model.embed_norm")
    if not cfg.post_norm:                                  # (post norms: the last layer's output is normalized)
        norm(shapes, "model.norm")
    if cfg.generates:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        if cfg.post_norm:
            norm(shapes, p + "attn_output_norm")
            norm(shapes, p + "mlp_output_norm")
        else:
            norm(shapes, p + "input_layernorm")
            norm(shapes, p + "post_attention_layernorm")
        shapes[p + "self_attn.q_proj.weight"] = (cfg.num_heads * d, h)
        shapes[p + "self_attn.k_proj.weight"] = (cfg.num_kv_heads * d, h)
        shapes[p + "self_attn.v_proj.weight"] = (cfg.num_kv_heads * d, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, cfg.num_heads * d)
        if cfg.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if cfg.attention_sinks:
            shapes[p + "self_attn.sinks"] = (cfg.num_heads,)
        if cfg.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (cfg.num_heads * d,)
            shapes[p + "self_attn.k_proj.bias"] = (cfg.num_kv_heads * d,)
            shapes[p + "self_attn.v_proj.bias"] = (cfg.num_kv_heads * d,)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        if cfg.sandwich_norms:
            norm(shapes, p + "attn_output_norm")
            norm(shapes, p + "mlp_output_norm")
        if cfg.layer_moe(i):                # the experts stacked by rows: expert e's are e * rows .. (e + 1) * rows - 1
            e, inter = cfg.num_experts, cfg.expert_intermediate_size
            shapes[p + "mlp.router.weight"] = (e, h)
            shapes[p + "mlp.experts.gate_proj.weight"] = (e * inter, h)
            shapes[p + "mlp.experts.up_proj.weight"] = (e * inter, h)
            shapes[p + "mlp.experts.down_proj.weight"] = (e * h, inter)
            if cfg.moe_bias:
                shapes[p + "mlp.router.bias"] = (e,)
                shapes[p + "mlp.experts.gate_proj.bias"] = (e * inter,)
                shapes[p + "mlp.experts.up_proj.bias"] = (e * inter,)
                shapes[p + "mlp.experts.down_proj.bias"] = (e * h,)
            continue
        inter = cfg.intermediate_size
        for part in (("gate_proj", "up_proj") if cfg.gated_mlp else ("up_proj",)):
            shapes[p + f"mlp.{part}.weight"] = (inter, h)
            if cfg.mlp_bias:
                shapes[p + f"mlp.{part}.bias"] = (inter,)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
        if cfg.mlp_bias:
            shapes[p + "mlp.down_proj.bias"] = (h,)
    return shapes


def stack_rows(parts: list) -> StoredTensor:
    """StoredTensors of the same width stacked by rows as one (a mixture's experts, stored one tensor each, as the
    layer kernel reads them: one matrix of E * rows); read(index) reads only the parts the rows asked for touch."""
    sizes = [p.shape[0] for p in parts]
    starts = np.cumsum([0] + sizes)
    cols = tuple(parts[0].shape[1:])
    if any(tuple(p.shape[1:]) != cols for p in parts):
        raise WeightLoadError(f"experts of different shapes cannot be stacked: {[p.shape for p in parts]}")

    def read(index: tuple) -> np.ndarray:
        rows = np.arange(starts[-1])[index[0] if index else slice(None)]
        rest = tuple(index[1:])
        out = []
        for part, start, size in zip(parts, starts, sizes):
            mine = rows[(rows >= start) & (rows < start + size)] - start
            if len(mine):
                out.append(np.asarray(part.read((slice(int(mine[0]), int(mine[-1]) + 1),) + rest))[mine - mine[0]])
        return np.concatenate(out, axis=0) if out else np.zeros((0,) + cols, np.float32)
    return StoredTensor((int(starts[-1]),) + cols, read, stored_type=parts[0].stored_type)



def split_fused(cfg: LlamaConfig, stored: dict) -> None:
    """Replace, in `stored` ({HF name: StoredTensor}), each layer's fused matrices by their parts, as Phi-3 stores
    them (and llama.cpp's converter, fusing on request): `self_attn.qkv_proj` (weight and bias) into q/k/v (rows
    NH*D, KVH*D, KVH*D) and `mlp.gate_up_proj` into gate/up (I rows each, gate first). Each part reads only its
    own rows (a tensor-parallel rank's shard of q_proj reads just those rows). A fused tensor of the wrong shape
    fails naming it."""
    q, kv, h = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size
    inter = cfg.intermediate_size
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for fused, parts, cols in (("self_attn.qkv_proj.weight", (("q", q), ("k", kv), ("v", kv)), (h,)),
                                   ("self_attn.qkv_proj.bias", (("q", q), ("k", kv), ("v", kv)), ()),
                                   ("mlp.gate_up_proj.weight", (("gate", inter), ("up", inter)), (h,))):
            tensor = stored.pop(p + fused, None)
            if tensor is None:
                continue
            check_shape(p + fused, tensor, (sum(n for _, n in parts),) + cols)
            start = 0
            for part, n in parts:
                stored[p + fused.replace("qkv", part).replace("gate_up", part)] = tensor.rows(start, start + n)
                start += n


def rotate_half_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder each head's rows from interleaved pairs (0,1),(2,3),... to halves (0..D/2-1 | D/2..D-1)."""
    rows, cols = w.shape
    d = rows // n_heads
    return np.ascontiguousarray(w.reshape(n_heads, d // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols))



def check_tensors(stored: dict, shapes: dict, where: str) -> None:
    """WeightLoadError naming the first tensor of `shapes` ({name: shape}) that `stored` lacks or holds in another
    shape; `where`: what was read ("the checkpoint in PATH")."""
    for name, shape in shapes.items():
        if name not in stored:
            raise WeightLoadError(f"tensor {name!r} is missing from {where} (expected shape {tuple(shape)})")
        check_shape(name, stored[name], shape)


def check_shape(name: str, arr, shape: tuple) -> None:
    """WeightLoadError naming the tensor unless `arr` (an array or StoredTensor) has `shape`."""
    if tuple(arr.shape) != tuple(shape):
        raise WeightLoadError(f"tensor {name!r} has shape {tuple(arr.shape)}, expected {tuple(shape)}")

