"""What every weight format shares: the model's config (`LlamaConfig`), a tensor not read yet (`StoredTensor`),
a matrix as the checkpoint stores it (`QuantizedTensor`), the error a bad checkpoint raises (`WeightLoadError`),
the tensors and shapes the model needs (`expected_shapes`), and the row order llama2.c and GGUF files need undone
(`rotate_half_rows`). The format modules import this one; it imports none of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

__all__ = ["LlamaConfig", "QuantizedTensor", "StoredTensor", "WeightLoadError", "check_shape", "expected_shapes",
           "first_id", "rotate_half_rows"]


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

    @classmethod
    def of(cls, array: np.ndarray) -> "StoredTensor":
        """A tensor already in memory (a format whose reader loads everything)."""
        return cls(tuple(array.shape), lambda index: array[index])


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
    """A LLaMA-family model's shape and the few things in which the family's members differ, as data (one model
    file serves them all): `attention_bias` (Qwen2: q/k/v have biases), `rope_freq_factors` (Llama-3.1's RoPE
    scaling, or any per-frequency divisors: inv_freq[i] / factor[i]), `sliding_window` (Mistral v0.1: a
    request must not outgrow it, see `check_context`)."""

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

    def check_context(self, max_context: int) -> None:
        """WeightLoadError when a sequence of `max_context` tokens would need attention this server does not
        compute (sliding-window attention reaching past its window): refused rather than served wrong."""
        if self.sliding_window is not None and max_context > self.sliding_window:
            raise WeightLoadError(
                f"this {self.architecture} model uses sliding-window attention (sliding_window={self.sliding_window}),"
                f" which this server does not implement; sequences of up to {max_context} tokens would attend past "
                f"the window. Serve it with model_config.max_generate_length <= {self.sliding_window} (and "
                f"pa_config.decode_seq_length unset or <= {self.sliding_window}).")


def first_id(value) -> Optional[int]:
    """A config's token id that may be given as a list of ids (its first), or None."""
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)




def expected_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs (HF names) and its shape."""
    h, d = cfg.hidden_size, cfg.head_dim
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,),
              "lm_head.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (cfg.num_heads * d, h)
        shapes[p + "self_attn.k_proj.weight"] = (cfg.num_kv_heads * d, h)
        shapes[p + "self_attn.v_proj.weight"] = (cfg.num_kv_heads * d, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, cfg.num_heads * d)
        if cfg.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (cfg.num_heads * d,)
            shapes[p + "self_attn.k_proj.bias"] = (cfg.num_kv_heads * d,)
            shapes[p + "self_attn.v_proj.bias"] = (cfg.num_kv_heads * d,)
        shapes[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, cfg.intermediate_size)
    return shapes



def rotate_half_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder each head's rows from interleaved pairs (0,1),(2,3),... to halves (0..D/2-1 | D/2..D-1)."""
    rows, cols = w.shape
    d = rows // n_heads
    return np.ascontiguousarray(w.reshape(n_heads, d // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols))



def check_shape(name: str, arr, shape: tuple) -> None:
    """WeightLoadError naming the tensor unless `arr` (an array or StoredTensor) has `shape`."""
    if tuple(arr.shape) != tuple(shape):
        raise WeightLoadError(f"tensor {name!r} has shape {tuple(arr.shape)}, expected {tuple(shape)}")

