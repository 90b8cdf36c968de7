"""Load a LLaMA checkpoint into numpy float32 arrays under HuggingFace tensor names, all of it or one
tensor-parallel rank's part (`load_llama_weights(path, tp)`).

Four formats, told apart by `detect_format` (GGUF's reader lives in weights_gguf.py):

- **hf**: a HuggingFace directory, `config.json` plus `model.safetensors` or shards listed in
  `model.safetensors.index.json`; embeddings tied (`tie_word_embeddings`, or no `lm_head.weight`)
  or not. F16/F32/F64 read with `safetensors`; BF16 (no numpy dtype) widened to float32 by hand.
  `LlamaForCausalLM`, `Qwen2ForCausalLM` (q/k/v biases) and `MistralForCausalLM`, their differences kept
  as data in `LlamaConfig` (`load_config`).
- **gguf**: a llama.cpp `.gguf` file (weights_gguf.py): `llama` and `qwen2`, dequantized per tensor.
- **llama2c**: a llama2.c `.bin` file, legacy (v0) export: seven int32 header fields (dim, hidden_dim,
  n_layers, n_heads, n_kv_heads, vocab_size, seq_len; a negative vocab_size means the classifier is
  stored separately), then float32 tensors in a fixed order. llama2.c rotates interleaved pairs
  (x[2i], x[2i+1]) while the model here rotates halves (x[i], x[i+D/2]), so wq/wk rows are permuted
  per head at load (llama.cpp's GGUF converter interleaves them the same way, undone the same way).
- **mindformers**: a directory with one MindFormers `*.ckpt` (read with `mindspore.load_checkpoint`;
  names like `model.layers.0.attention.wq.weight`, optionally fused `attention.w_qkv` and
  `feed_forward.w_gate_hidden`) and either a `config.json` or a MindFormers `*.yaml`
  (`model.model_config`). MindFormers keeps HF's rotate-half layout, so no permutation.

Every loader returns HF names (`model.layers.0.self_attn.q_proj.weight`, ...; `lm_head.weight` always
present), each a `StoredTensor` not read yet (safetensors slices and memory-mapped llama2.c files read only
the part asked for; a MindSpore checkpoint is read whole by MindSpore), checked once against
`expected_shapes` before anything is read: a missing tensor, a wrong shape or a non-float dtype fails with
a `WeightLoadError` naming the tensor. The model concatenates Q/K/V and
gate/up itself when it builds its parameters (`llama.py`).

A GGUF's block-quantized matrices are also available as the file stores them (`load_quantized`): the CPU layer
kernel reads those rows directly, 4.5-8.5 bits per weight instead of float32's 32 (docs/BENCHMARKS.md).
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import struct
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from .parallel import TensorParallel

__all__ = ["LlamaConfig", "QuantizedTensor", "StoredTensor", "WeightLoadError", "checkpoint_config", "detect_format",
           "load_config", "load_llama_weights", "load_quantized", "expected_shapes"]


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


def _first_id(value) -> Optional[int]:
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


# config.json "architectures" entry -> the family member's name; each is this one model with data differences
_HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}


def llama3_rope_factors(head_dim: int, theta: float, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_max_position_embeddings: int) -> tuple:
    """Llama-3.1's RoPE scaling as a divisor per frequency: long wavelengths are slowed by `factor`, short ones
    kept, the band between blended smoothly (transformers' `rope_type: llama3`, llama.cpp's rope_freqs)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)      # (D/2,)
    wavelen = 2 * np.pi / inv_freq
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    divisor = 1.0 / ((1.0 - smooth) / factor + smooth)                                     # blended band
    divisor = np.where(wavelen > low_wavelen, factor, divisor)                               # slowed
    divisor = np.where(wavelen < high_wavelen, 1.0, divisor)                                 # kept
    return tuple(float(v) for v in divisor)


def _rope_settings(raw: dict, path: str, head_dim: int) -> tuple[float, Optional[tuple]]:
    """(rope_theta, rope_freq_factors) from a config.json as transformers 4.x writes it (`rope_theta`,
    `rope_scaling`) or 5.x (`rope_parameters` with `rope_type` and `rope_theta`)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:    # 5.x per-layer-type form
        params = params["full_attention"]
    scaling = params if isinstance(params, dict) else raw.get("rope_scaling")
    theta = float((params or {}).get("rope_theta") or raw.get("rope_theta") or 10000.0)
    if not scaling:
        return theta, None
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, (float(scaling["factor"]),) * (head_dim // 2)
    if kind == "llama3":
        try:
            return theta, llama3_rope_factors(head_dim, theta, float(scaling["factor"]),
                                              float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"]),
                                              int(scaling["original_max_position_embeddings"]))
        except KeyError as e:
            raise WeightLoadError(f"{path}: llama3 RoPE scaling needs {e.args[0]!r}") from None
    raise WeightLoadError(f"{path}: RoPE scaling type {kind!r} is not supported (supported: llama3, linear)")


def load_config(model_dir: str) -> LlamaConfig:
    """The LlamaConfig of a HuggingFace directory's config.json: LlamaForCausalLM (Llama-1/2/3, SmolLM2, ...),
    Qwen2ForCausalLM (q/k/v biases), MistralForCausalLM. Anything else fails naming the architecture."""
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, "r", encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise WeightLoadError(f"{path}: config.json not found (expected a HuggingFace LLaMA directory)") from None
    except json.JSONDecodeError as e:
        raise WeightLoadError(f"{path}: invalid JSON: {e}") from None

    def need(key):
        if key not in raw:
            raise WeightLoadError(f"{path}: missing key {key!r}")
        return raw[key]

    names = raw.get("architectures") or ["LlamaForCausalLM"]
    arch = _HF_ARCHITECTURES.get(names[0])
    if arch is None:
        raise WeightLoadError(f"{path}: architecture {names[0]!r} is not supported (supported: "
                              f"{', '.join(_HF_ARCHITECTURES)})")
    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    head_dim = int(raw.get("head_dim") or hidden // heads)
    if heads % kv_heads != 0:
        raise WeightLoadError(f"{path}: num_attention_heads={heads} not divisible by num_key_value_heads={kv_heads}")
    if head_dim % 2 != 0:
        raise WeightLoadError(f"{path}: head_dim={head_dim} must be even for rotary embeddings")
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise WeightLoadError(f"{path}: hidden_act={act!r} is not supported (only silu)")
    if arch == "llama" and (raw.get("attention_bias") or raw.get("mlp_bias")):
        raise WeightLoadError(f"{path}: a LLaMA with attention_bias/mlp_bias (o_proj or MLP biases) is not "
                              "supported; only Qwen2's q/k/v biases are")
    theta, factors = _rope_settings(raw, path, head_dim)
    window = raw.get("sliding_window")
    if arch == "qwen2" and not raw.get("use_sliding_window", False):
        window = None                       # Qwen2 configs name a window they do not use
    return LlamaConfig(
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        bos_token_id=_first_id(raw.get("bos_token_id", 1)),
        eos_token_id=_first_id(raw.get("eos_token_id", 2)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        architecture=arch,
        attention_bias=arch == "qwen2",
        rope_freq_factors=factors,
        sliding_window=int(window) if window else None,
    )


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


def _shard_files(model_dir: str) -> dict[str, str]:
    """Map tensor name -> safetensors file path (for index-less single files: name -> that file, filled lazily)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(index):
        try:
            with open(index, "r", encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise WeightLoadError(f"{index}: not a valid safetensors index ({e})") from None
        out = {}
        for name, fname in weight_map.items():
            fpath = os.path.join(model_dir, fname)
            if not os.path.exists(fpath):
                raise WeightLoadError(f"{fpath}: shard listed in the index (for tensor {name!r}) is missing")
            out[name] = fpath
        return out
    if os.path.exists(single):
        return {"": single}
    raise WeightLoadError(f"{model_dir}: neither model.safetensors nor model.safetensors.index.json found")


def _safetensors_header(fpath: str) -> tuple[int, dict]:
    """(header length, header) of a safetensors file: each tensor's dtype, shape and data offsets."""
    with open(fpath, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        return header_len, json.loads(f.read(header_len))


def _bf16_reader(fpath: str, header_len: int, info: dict) -> Callable[[tuple], np.ndarray]:
    """read(index) of one BF16 tensor (numpy has no bfloat16): the file is memory-mapped as uint16 for the
    read only, and just the selected part is widened to float32 (a bfloat16 is the top half of a float32)."""
    def read(index: tuple) -> np.ndarray:
        offset = 8 + header_len + info["data_offsets"][0]
        raw = np.memmap(fpath, dtype="<u2", mode="r", offset=offset, shape=tuple(info["shape"]))
        return (np.asarray(raw[index]).astype(np.uint32) << 16).view(np.float32)
    return read


_FLOAT_SAFETENSORS = ("F16", "BF16", "F32", "F64")


def _stored_safetensors(files: dict[str, str], wanted: set[str]) -> dict[str, StoredTensor]:
    """Every wanted tensor of the files, unread: `safetensors` slices (reading only the part asked for),
    BF16 through a memory map. A non-float dtype fails here, before anything is read."""
    from safetensors import safe_open

    by_file: dict[str, Optional[list[str]]] = {}
    if "" in files:  # single file: take whatever it holds
        by_file[files[""]] = None
    else:
        for name, fpath in files.items():
            if name in wanted:
                by_file.setdefault(fpath, []).append(name)  # type: ignore[union-attr]
    out: dict[str, StoredTensor] = {}
    for fpath, names in by_file.items():
        try:
            f = safe_open(fpath, framework="np")      # the slices keep the file open until they are dropped
            header = None
            for name in (f.keys() if names is None else names):
                if name not in wanted:
                    continue
                part = f.get_slice(name)
                dtype = part.get_dtype()
                if dtype not in _FLOAT_SAFETENSORS:
                    raise WeightLoadError(f"tensor {name!r} in {fpath} has dtype {dtype}; expected a float "
                                          f"type ({', '.join(_FLOAT_SAFETENSORS)})")
                if dtype == "BF16":
                    header = header or _safetensors_header(fpath)
                    read = _bf16_reader(fpath, header[0], header[1][name])
                else:
                    read = lambda index, part=part: part[index]         # noqa: E731
                out[name] = StoredTensor(tuple(part.get_shape()), read)
        except WeightLoadError:
            raise
        except Exception as e:  # corrupt / unreadable file
            raise WeightLoadError(f"{fpath}: cannot read safetensors file: {e}") from e
    return out


def _load_hf(model_dir: str) -> tuple[LlamaConfig, dict[str, StoredTensor]]:
    cfg = load_config(model_dir)
    return cfg, _stored_safetensors(_shard_files(model_dir), set(expected_shapes(cfg)))


# ------------------------------------------------------------------------------------------ llama2.c
_LLAMA2C_MAGIC = 0x616B3432   # "ak42": the header of llama2.c's version 1 and 2 exports


def _rotate_half_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder each head's rows from interleaved pairs (0,1),(2,3),... to halves (0..D/2-1 | D/2..D-1)."""
    rows, cols = w.shape
    d = rows // n_heads
    return np.ascontiguousarray(w.reshape(n_heads, d // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols))


def _load_llama2c(path: str) -> tuple[LlamaConfig, dict[str, StoredTensor]]:
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
        return _rotate_half_rows(part, part.shape[0] // head_dim)
    return StoredTensor(w.shape, read)


# ---------------------------------------------------------------------------------------- MindFormers
_MF_RENAMES = (  # MindFormers name fragment -> HF fragment, applied in order
    ("model.tok_embeddings.embedding_weight", "model.embed_tokens.weight"),
    ("model.norm_out.", "model.norm."),
    (".attention.wq.", ".self_attn.q_proj."), (".attention.wk.", ".self_attn.k_proj."),
    (".attention.wv.", ".self_attn.v_proj."), (".attention.wo.", ".self_attn.o_proj."),
    (".attention_norm.", ".input_layernorm."), (".ffn_norm.", ".post_attention_layernorm."),
    (".feed_forward.w1.", ".mlp.gate_proj."), (".feed_forward.w3.", ".mlp.up_proj."),
    (".feed_forward.w2.", ".mlp.down_proj."),
)


def _mindformers_config(path: str) -> LlamaConfig:
    """LlamaConfig from a MindFormers yaml's `model.model_config` section."""
    import yaml

    try:
        with open(path, "r", encoding="utf-8") as f:
            raw = (yaml.safe_load(f) or {}).get("model", {}).get("model_config")
    except (yaml.YAMLError, AttributeError) as e:
        raise WeightLoadError(f"{path}: not a MindFormers model yaml ({e})") from None
    if not isinstance(raw, dict):
        raise WeightLoadError(f"{path}: no model.model_config section")

    def need(key):
        if raw.get(key) is None:
            raise WeightLoadError(f"{path}: model.model_config.{key} is missing")
        return int(raw[key])

    hidden, heads = need("hidden_size"), need("num_heads")
    kv_heads = int(raw.get("n_kv_heads") or heads)
    inter = raw.get("intermediate_size")
    if inter is None:   # LLaMA's rule: 2/3 of 4*hidden, times ffn_dim_multiplier, rounded up to multiple_of
        multiple_of = int(raw.get("multiple_of", 256))
        inter = int(2 * 4 * hidden / 3)
        if raw.get("ffn_dim_multiplier") is not None:
            inter = int(float(raw["ffn_dim_multiplier"]) * inter)
        inter = multiple_of * ((inter + multiple_of - 1) // multiple_of)
    if heads % kv_heads or (hidden // heads) % 2:
        raise WeightLoadError(f"{path}: num_heads={heads}, n_kv_heads={kv_heads}, hidden_size={hidden} "
                              "are inconsistent")
    return LlamaConfig(vocab_size=need("vocab_size"), hidden_size=hidden, intermediate_size=int(inter),
                       num_layers=need("num_layers"), num_heads=heads, num_kv_heads=kv_heads,
                       head_dim=hidden // heads, rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
                       rope_theta=float(raw.get("theta", 10000.0)),
                       max_position_embeddings=int(raw.get("max_position_embedding") or raw.get("seq_length")
                                                   or 2048),
                       bos_token_id=_first_id(raw.get("bos_token_id", 1)),
                       eos_token_id=_first_id(raw.get("eos_token_id", 2)),
                       tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)))


def _one(pattern: str, what: str) -> Optional[str]:
    found = sorted(glob.glob(pattern))
    if len(found) > 1:
        raise WeightLoadError(f"{os.path.dirname(pattern)}: {len(found)} {what} files ({', '.join(map(os.path.basename, found))}); "
                              "expected one")
    return found[0] if found else None


def _mindformers_dir_config(model_dir: str) -> LlamaConfig:
    if os.path.exists(os.path.join(model_dir, "config.json")):
        return load_config(model_dir)
    yaml_path = _one(os.path.join(model_dir, "*.yaml"), "yaml") or _one(os.path.join(model_dir, "*.yml"), "yaml")
    if yaml_path is None:
        raise WeightLoadError(f"{model_dir}: a MindFormers checkpoint needs a config.json or a MindFormers "
                              "*.yaml next to it")
    return _mindformers_config(yaml_path)


def _load_mindformers(path: str) -> tuple[LlamaConfig, dict[str, StoredTensor]]:
    """(MindSpore's load_checkpoint reads the whole file: a tensor-parallel rank cuts its part afterwards.)"""
    model_dir = path if os.path.isdir(path) else os.path.dirname(path)
    ckpt = path if os.path.isfile(path) else _one(os.path.join(model_dir, "*.ckpt"), "checkpoint (*.ckpt)")
    cfg = _mindformers_dir_config(model_dir)
    import mindspore as ms

    try:
        params = ms.load_checkpoint(ckpt)
    except Exception as e:
        raise WeightLoadError(f"{ckpt}: cannot read MindSpore checkpoint: {e}") from e
    floats = (ms.float16, ms.float32, ms.float64, ms.bfloat16)
    out: dict[str, np.ndarray] = {}
    for name, param in params.items():
        if not (name.startswith("model.") or name.startswith("lm_head.")):
            continue   # optimizer state, step counters, ...
        if param.dtype not in floats:
            raise WeightLoadError(f"tensor {name!r} in {ckpt} has dtype {param.dtype}; expected a float type")
        arr = (ms.ops.cast(param, ms.float32) if param.dtype == ms.bfloat16 else param).asnumpy()
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        hf = name
        for old, new in _MF_RENAMES:
            hf = hf.replace(old, new)
        out[hf] = arr
    d, nh, kvh, inter = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    for i in range(cfg.num_layers):   # fused projections (qkv_concat) are split back into HF tensors
        p = f"model.layers.{i}."
        fused = out.pop(p + "attention.w_qkv.weight", None)
        if fused is not None:
            _check_shape(p + "attention.w_qkv.weight", fused,
                         ((nh + 2 * kvh) * d, cfg.hidden_size))
            q, k, v = np.split(fused, [nh * d, (nh + kvh) * d])
            out.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                        p + "self_attn.v_proj.weight": v})
        fused = out.pop(p + "feed_forward.w_gate_hidden.weight", None)
        if fused is not None:
            _check_shape(p + "feed_forward.w_gate_hidden.weight", fused, (2 * inter, cfg.hidden_size))
            out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = np.split(fused, [inter])
    return cfg, {k: StoredTensor.of(v) for k, v in out.items()}


# ------------------------------------------------------------------------------------------- entry
def detect_format(path: str) -> str:
    """'hf', 'gguf', 'llama2c' or 'mindformers' for a checkpoint path; WeightLoadError if it is none of them."""
    if os.path.isfile(path):
        if path.endswith(".bin"):
            return "llama2c"
        if path.endswith(".ckpt"):
            return "mindformers"
        if path.endswith(".gguf"):
            return "gguf"
        raise WeightLoadError(f"{path}: a model file must be a GGUF .gguf, a llama2.c .bin or a MindFormers .ckpt")
    if not os.path.isdir(path):
        raise WeightLoadError(f"{path}: no such file or directory")
    if (os.path.exists(os.path.join(path, "model.safetensors"))
            or os.path.exists(os.path.join(path, "model.safetensors.index.json"))):
        return "hf"
    if glob.glob(os.path.join(path, "*.ckpt")):
        return "mindformers"
    raise WeightLoadError(f"{path}: not a model directory: expected config.json with model.safetensors (or "
                          "a safetensors index), or a MindFormers *.ckpt; or pass a llama2.c .bin file")


def model_shape(path: str) -> LlamaConfig:
    """The LlamaConfig of any supported checkpoint without reading its tensors (sizing the KV cache before the
    agents load it). A GGUF goes through `load_gguf`'s cache, which this fills on a first start."""
    path = os.fspath(path)
    fmt = detect_format(path)
    if fmt == "gguf":
        from .weights_gguf import load_gguf
        return load_gguf(path)[0]
    if fmt == "mindformers":
        return _mindformers_dir_config(path if os.path.isdir(path) else os.path.dirname(path))
    return {"hf": _load_hf, "llama2c": _load_llama2c}[fmt](path)[0]


def _check_shape(name: str, arr, shape: tuple) -> None:
    if tuple(arr.shape) != tuple(shape):
        raise WeightLoadError(f"tensor {name!r} has shape {tuple(arr.shape)}, expected {tuple(shape)}")


def _checked_stored(path: str, num_layers: Optional[int]) -> tuple[LlamaConfig, dict[str, StoredTensor]]:
    """The checkpoint's config and tensors (not read yet), `lm_head.weight` present, every shape checked."""
    fmt = detect_format(path)
    if fmt == "gguf":
        from .weights_gguf import load_gguf
        cfg, stored = load_gguf(path)
    else:
        cfg, stored = {"hf": _load_hf, "llama2c": _load_llama2c, "mindformers": _load_mindformers}[fmt](path)
    if num_layers is not None:
        if not 1 <= num_layers <= cfg.num_layers:
            raise WeightLoadError(f"cannot keep the first {num_layers} layers of {path}: it has {cfg.num_layers}")
        cfg = dataclasses.replace(cfg, num_layers=num_layers)
    if "lm_head.weight" not in stored or cfg.tie_word_embeddings:
        if "model.embed_tokens.weight" in stored:
            stored["lm_head.weight"] = stored["model.embed_tokens.weight"]
    for name, shape in expected_shapes(cfg).items():
        if name not in stored:
            raise WeightLoadError(f"tensor {name!r} is missing from the checkpoint in {path} "
                                  f"(expected shape {shape})")
        _check_shape(name, stored[name], shape)
    return cfg, stored


def checkpoint_config(path: str) -> LlamaConfig:
    """The LlamaConfig of any supported checkpoint (its tensors checked but not read)."""
    return _checked_stored(os.fspath(path), None)[0]


def load_llama_weights(path: str, tp: Optional[TensorParallel] = None,
                       num_layers: Optional[int] = None) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """Return (config, {hf_name: float32 array}) for any supported checkpoint, with every tensor checked.

    num_layers: keep only the first N decoder layers (with the final norm and head): a draft model cut from
    the checkpoint (speculative decoding); the other layers are not read.

    tp: read only what that tensor-parallel rank holds (default: one agent, which holds everything): each
    tensor's shard (`TensorParallel.part`), and no logits tensors on ranks other than 0. A model whose heads
    or MLP units do not split over tp.world fails before anything is read (ValueError naming them)."""
    path = os.fspath(path)
    cfg, stored = _checked_stored(path, num_layers)
    shapes = expected_shapes(cfg)
    tp = tp if tp is not None else TensorParallel()        # one agent: every tensor, whole
    tp.check(cfg)
    out, done = {}, {}
    for name, shape in shapes.items():
        if not tp.needs(name):
            continue
        index = tp.part(name, shape)
        key = (id(stored[name]), repr(index))       # tied embeddings: one tensor under two names, read once
        if key not in done:
            try:
                done[key] = np.ascontiguousarray(stored[name].read(index), dtype=np.float32)
            except (OSError, ValueError) as e:      # data its header promised but the file does not hold
                raise WeightLoadError(f"tensor {name!r} in {path}: cannot read it: {e}") from e
        out[name] = done[key]
    return cfg, out


def load_quantized(path: str, num_layers: Optional[int] = None) -> dict[str, QuantizedTensor]:
    """{hf_name: QuantizedTensor} of the model's 2-D weight matrices that the checkpoint stores block-quantized
    (a GGUF's Q4_0, Q4_1, Q8_0 and F16 tensors; see weights_gguf.KEPT_QUANTIZED), whole (one agent); {} for a
    checkpoint that has none. Not the embedding (a row gather, served from float32); a tied lm_head is the
    embedding's stored tensor."""
    path = os.fspath(path)
    cfg, stored = _checked_stored(path, num_layers)
    out, done = {}, {}
    for name, shape in expected_shapes(cfg).items():
        tensor = stored[name]
        if tensor.read_blocks is None or len(shape) != 2 or name == "model.embed_tokens.weight":
            continue
        if id(tensor) not in done:
            try:
                data = np.ascontiguousarray(tensor.read_blocks(slice(None)), dtype=np.uint8)
            except (OSError, ValueError) as e:
                raise WeightLoadError(f"tensor {name!r} in {path}: cannot read its blocks: {e}") from e
            if data.ndim != 2 or data.shape[0] != shape[0]:
                raise WeightLoadError(f"tensor {name!r} in {path}: its blocks are {data.shape}, not {shape[0]} rows")
            done[id(tensor)] = QuantizedTensor(tensor.qtype, tuple(shape), data)
        out[name] = done[id(tensor)]
    return out
