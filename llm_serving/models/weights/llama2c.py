"""llama2.c checkpoints: a `.bin` file in the legacy (v0) export: seven int32 header fields (dim, hidden_dim,
n_layers, n_heads, n_kv_heads, vocab_size, seq_len; a negative vocab_size means the classifier is stored
separately), then float32 tensors in a fixed order, memory-mapped. llama2.c rotates interleaved pairs
(x[2i], x[2i+1]) while the model here rotates halves (x[i], x[i+D/2]), so wq/wk rows are permuted per head as
they are read (`rotate_half_rows`).
"""
from __future__ import annotations

import os
import struct

import numpy as np

from .common import LlamaConfig, StoredTensor, WeightLoadError, rotate_half_rows

__all__ = ["load_llama2c"]

_LLAMA2C_MAGIC = 0x616B3432   # "ak42": the header of llama2.c's version 1 and 2 exports


def load_llama2c(path: str) -> tuple[LlamaConfig, dict[str, StoredTensor]]:
    """The config and tensors (memory-mapped, not read yet) of a llama2.c v0 `.bin` file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        header = f.read(28)
    if len(header) < 28:
        raise WeightLoadError(f"{path}: {size} bytes is too short for a llama2.c checkpoint header")
    if struct.unpack("<I", header[:4])[0] == _LLAMA2C_MAGIC:
        version = struct.unpack("<i", header[4:8])[0]
        raise WeightLoadError(f"{path}: llama2.c export version {version} is not supported; export the legacy "
                              "format (export.py --version 0) or convert to a HuggingFace directory")
    dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len = struct.unpack("<7i", header)
    shared, vocab = vocab > 0, abs(vocab)
    fields = dict(dim=dim, hidden_dim=hidden, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                  vocab_size=vocab, seq_len=seq_len)
    if min(fields.values()) <= 0 or dim % n_heads or n_heads % n_kv_heads or (dim // n_heads) % 2:
        raise WeightLoadError(f"{path}: not a llama2.c v0 checkpoint (header {fields} is inconsistent)")
    d = dim // n_heads
    kv = n_kv_heads * d
    L = n_layers
    layout = [("tok", (vocab, dim)), ("rms_att", (L, dim)), ("wq", (L, dim, dim)), ("wk", (L, kv, dim)),
              ("wv", (L, kv, dim)), ("wo", (L, dim, dim)), ("rms_ffn", (L, dim)), ("w1", (L, hidden, dim)),
              ("w2", (L, dim, hidden)), ("w3", (L, hidden, dim)), ("rms_final", (dim,)),
              ("freq_cis_real", (seq_len, d // 2)), ("freq_cis_imag", (seq_len, d // 2))]
    if not shared:
        layout.append(("wcls", (vocab, dim)))
    expected = 28 + 4 * sum(int(np.prod(shape)) for _, shape in layout)
    if size != expected:
        raise WeightLoadError(f"{path}: {size} bytes, but a llama2.c v0 checkpoint with header {fields} "
                              f"({'shared' if shared else 'separate'} classifier) has {expected}; "
                              "the file is truncated or not this format")
    flat = np.memmap(path, dtype="<f4", mode="r", offset=28)     # read as tensors (or their parts) are used
    raw, at = {}, 0
    for name, shape in layout:
        n = int(np.prod(shape))
        raw[name] = flat[at: at + n].reshape(shape)
        at += n
    # The rotary tables must be the standard ones (theta 10000) that the model computes itself.
    angles = np.outer(np.arange(seq_len), 10000.0 ** (-np.arange(0, d, 2) / d))
    if not (np.allclose(raw["freq_cis_real"], np.cos(angles), atol=1e-4)
            and np.allclose(raw["freq_cis_imag"], np.sin(angles), atol=1e-4)):
        raise WeightLoadError(f"{path}: freq_cis tables are not standard RoPE with theta 10000; not supported")

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=hidden, num_layers=L,
                      num_heads=n_heads, num_kv_heads=n_kv_heads, head_dim=d, rms_norm_eps=1e-5,
                      rope_theta=10000.0, max_position_embeddings=seq_len, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=shared)
    out = {"model.embed_tokens.weight": raw["tok"], "model.norm.weight": raw["rms_final"],
           "lm_head.weight": raw["tok"] if shared else raw["wcls"]}
    for i in range(L):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = raw["rms_att"][i]
        out[p + "post_attention_layernorm.weight"] = raw["rms_ffn"][i]
        out[p + "self_attn.v_proj.weight"] = raw["wv"][i]
        out[p + "self_attn.o_proj.weight"] = raw["wo"][i]
        out[p + "mlp.gate_proj.weight"] = raw["w1"][i]
        out[p + "mlp.up_proj.weight"] = raw["w3"][i]
        out[p + "mlp.down_proj.weight"] = raw["w2"][i]
    # (copies: no array outlives the load as a view of the memory map)
    stored = {k: StoredTensor(v.shape, lambda index, v=v: np.array(v[index], dtype=np.float32))
              for k, v in out.items()}
    for i in range(L):
        p = f"model.layers.{i}."
        stored[p + "self_attn.q_proj.weight"] = _stored_rotated(raw["wq"][i], d)
        stored[p + "self_attn.k_proj.weight"] = _stored_rotated(raw["wk"][i], d)
    return cfg, stored


def _stored_rotated(w: np.ndarray, head_dim: int) -> StoredTensor:
    """A llama2.c wq/wk, its rows permuted to rotate-half when read; the permutation is within a head, so a
    part of whole heads (a tensor-parallel shard) is permuted on its own."""
    def read(index: tuple) -> np.ndarray:
        part = np.array(w[index], dtype=np.float32)
        first = index[0].indices(w.shape[0])[0] if index and isinstance(index[0], slice) else 0
        if part.shape[1] != w.shape[1] or part.shape[0] % head_dim or first % head_dim:
            raise ValueError(f"a llama2.c q/k tensor is read in whole heads of {head_dim} rows, not {index}")
        return rotate_half_rows(part, part.shape[0] // head_dim)
    return StoredTensor(w.shape, read)

