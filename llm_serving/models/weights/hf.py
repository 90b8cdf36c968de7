"""HuggingFace checkpoints: a directory with `config.json` (read by hf_config.py's `load_config`) and
`model.safetensors` or shards listed in `model.safetensors.index.json` (`stored_safetensors`: F16/F32/F64 read with
`safetensors`; BF16, which numpy lacks, widened to float32 by hand).

`load_hf` gives the tensors under the internal (LLaMA HF) names `expected_shapes` lists: Phi-3's fused matrices split
into row parts that read only their own rows, Gemma's norms renamed and read as 1 + the stored weight (its RMSNorm
computes x * (1 + w)), a multimodal checkpoint's text model (`language_model.model.*` or `model.language_model.*`)
under the text model's names. Embeddings tied (`tie_word_embeddings`, or no `lm_head.weight`) or not. A mixture's
experts, one tensor each (Qwen3-MoE's `mlp.experts.E.gate_proj`, Mixtral's `block_sparse_moe.experts.E.w1`), are
stacked by rows into one matrix per part and layer (`mlp.experts.gate_proj.weight`: E * I rows), its router renamed
`mlp.router.weight`.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Callable, Optional

import numpy as np

from .common import LlamaConfig, StoredTensor, WeightLoadError, expected_shapes, split_fused, stack_rows
from .hf_config import llama3_rope_factors, load_config

__all__ = ["llama3_rope_factors", "load_config", "load_hf", "stored_safetensors"]


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


def stored_safetensors(files: dict[str, str], wanted: set[str]) -> dict[str, StoredTensor]:
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


# Gemma's norms (after "model.layers.N.") -> the internal names; each gain is read as 1 + the stored weight
_GEMMA_NORMS = {"input_layernorm.weight": "input_layernorm.weight",
                "pre_feedforward_layernorm.weight": "post_attention_layernorm.weight",
                "post_attention_layernorm.weight": "attn_output_norm.weight",
                "post_feedforward_layernorm.weight": "mlp_output_norm.weight",
                "self_attn.q_norm.weight": "self_attn.q_norm.weight",
                "self_attn.k_norm.weight": "self_attn.k_norm.weight"}
# a multimodal checkpoint's text model as transformers names it (4.x and 5.x's save_pretrained: language_model.model.*;
# 5.x's modules: model.language_model.*) -> the text model's own names
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_FUSED = ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight")
# a mixture's tensors (after "model.layers.N."): the router, and each expert's matrices (after "...experts.E."), as
# Qwen3-MoE and Mixtral name them -> the internal router and the part its expert stack is of
_ROUTERS = {"mlp.gate.weight": "mlp.router.weight", "block_sparse_moe.gate.weight": "mlp.router.weight"}
_EXPERT_PARTS = {"gate_proj.weight": "gate_proj", "up_proj.weight": "up_proj", "down_proj.weight": "down_proj",
                 "w1.weight": "gate_proj", "w3.weight": "up_proj", "w2.weight": "down_proj"}
_EXPERT_PREFIXES = ("mlp.experts.", "block_sparse_moe.experts.")


def _internal_name(name: str, arch: str) -> str:
    """The internal name of checkpoint tensor `name` (a name the model does not use stays as it is)."""
    for prefix, text in _TEXT_PREFIXES:
        if name.startswith(prefix):
            name = text + name[len(prefix):]
            break
    if arch == "gemma3" and name.startswith("model.layers."):
        _, _, layer, rest = name.split(".", 3)
        if rest in _GEMMA_NORMS:
            return f"model.layers.{layer}.{_GEMMA_NORMS[rest]}"
    if name.startswith("model.layers.") and name.count(".") > 3:
        _, _, layer, rest = name.split(".", 3)
        if rest in _ROUTERS:
            return f"model.layers.{layer}.{_ROUTERS[rest]}"
    return name


def _expert_of(name: str) -> Optional[tuple]:
    """(layer, part, expert) of one expert's matrix (`model.layers.3.mlp.experts.7.up_proj.weight`: (3, "up_proj",
    7)), or None."""
    if not name.startswith("model.layers."):
        return None
    _, _, layer, rest = name.split(".", 3)
    for prefix in _EXPERT_PREFIXES:
        if rest.startswith(prefix):
            expert, _, tail = rest[len(prefix):].partition(".")
            if expert.isdigit() and tail in _EXPERT_PARTS:
                return int(layer), _EXPERT_PARTS[tail], int(expert)
    return None


# gpt-oss's experts, each part one 3-D tensor of every expert (after "model.layers.N.mlp.experts."): gate_up_proj
# (E, H, 2I), its units' gate and up interleaved (even columns gate, odd up), down_proj (E, I, H), and their biases
_FUSED_EXPERTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def _derived(tensor: StoredTensor, shape: tuple, fn) -> StoredTensor:
    """A tensor computed from the whole of another (`fn` of its float32 array), read whole then indexed."""
    def read(index: tuple) -> np.ndarray:
        return np.ascontiguousarray(fn(np.asarray(tensor.read((slice(None),) * len(tensor.shape)), np.float32)))[index]
    return StoredTensor(shape, read, stored_type=tensor.stored_type)


def _gpt_oss_experts(cfg: LlamaConfig, fused: dict, path: str) -> dict:
    """gpt-oss's fused expert tensors ({(layer, name): StoredTensor}) as the stacks and biases the model reads:
    gate (E*I, H) from gate_up's even columns, up from its odd ones, down (E*H, I), transposed per expert."""
    e, h, inter = cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate_size
    out = {}
    for i in range(cfg.num_layers):
        missing = [n for n in _FUSED_EXPERTS if (i, n) not in fused]
        if missing:
            raise WeightLoadError(f"{path}: layer {i} has no mlp.experts.{missing[0]} tensor")
        p = f"model.layers.{i}.mlp.experts."
        gate_up, gate_up_bias = fused[(i, "gate_up_proj")], fused[(i, "gate_up_proj_bias")]
        down, down_bias = fused[(i, "down_proj")], fused[(i, "down_proj_bias")]
        for name, t, shape in (("gate_up_proj", gate_up, (e, h, 2 * inter)),
                               ("gate_up_proj_bias", gate_up_bias, (e, 2 * inter)),
                               ("down_proj", down, (e, inter, h)), ("down_proj_bias", down_bias, (e, h))):
            if tuple(t.shape) != shape:
                raise WeightLoadError(f"{path}: tensor {p}{name} has shape {tuple(t.shape)}, expected {shape}")
        for part, offset in (("gate_proj", 0), ("up_proj", 1)):
            out[f"{p}{part}.weight"] = _derived(gate_up, (e * inter, h), lambda a, o=offset: a[:, :, o::2].transpose(
                0, 2, 1).reshape(e * inter, h))
            out[f"{p}{part}.bias"] = _derived(gate_up_bias, (e * inter,), lambda a, o=offset: a[:, o::2].reshape(-1))
        out[f"{p}down_proj.weight"] = _derived(down, (e * h, inter),
                                               lambda a: a.transpose(0, 2, 1).reshape(e * h, inter))
        out[f"{p}down_proj.bias"] = _derived(down_bias, (e * h,), lambda a: a.reshape(-1))
    return out


def _stack_experts(cfg: LlamaConfig, experts: dict, path: str) -> dict:
    """Each mixture layer's experts' matrices ({(layer, part, expert): StoredTensor}) as the stacks the model reads
    (`model.layers.N.mlp.experts.<part>.weight`, expert e's rows the e-th block); an expert missing fails naming
    it."""
    out = {}
    for i in range(cfg.num_layers):
        if not cfg.layer_moe(i):
            continue
        for part in ("gate_proj", "up_proj", "down_proj"):
            missing = [e for e in range(cfg.num_experts) if (i, part, e) not in experts]
            if missing:
                raise WeightLoadError(f"{path}: layer {i}'s expert {missing[0]} has no {part} tensor (the config "
                                      f"names {cfg.num_experts} experts)")
            out[f"model.layers.{i}.mlp.experts.{part}.weight"] = stack_rows(
                [experts[(i, part, e)] for e in range(cfg.num_experts)])
    return out


def _plus_one(tensor: StoredTensor) -> StoredTensor:
    """A Gemma norm weight w read as its gain 1 + w (float32, as Gemma's RMSNorm computes it)."""
    return StoredTensor(tensor.shape, lambda index: np.asarray(tensor.read(index), np.float32) + np.float32(1.0),
                        stored_type=tensor.stored_type)


def _checkpoint_names(files: dict[str, str]) -> list[str]:
    """Every tensor name in the checkpoint (the index's, or the single file's header)."""
    if "" not in files:
        return list(files)
    try:
        return [n for n in _safetensors_header(files[""])[1] if n != "__metadata__"]
    except (OSError, ValueError, struct.error) as e:
        raise WeightLoadError(f"{files['']}: cannot read safetensors file: {e}") from e


def load_hf(model_dir: str) -> tuple[LlamaConfig, dict[str, StoredTensor]]:
    """The config and tensors (not read yet) of a HuggingFace directory, under the internal names."""
    cfg = load_config(model_dir)
    files = _shard_files(model_dir)
    needed = set(expected_shapes(cfg))
    fused = {f"model.layers.{i}.{name}" for i in range(cfg.num_layers) for name in _FUSED}
    names = {n: _internal_name(n, cfg.architecture) for n in _checkpoint_names(files)}
    expert_parts = {n: _expert_of(internal) for n, internal in names.items()} if cfg.num_experts else {}
    oss = cfg.architecture == "gptoss"
    if oss and any(n.endswith(("_blocks", "_scales")) for n in names):
        raise WeightLoadError(f"{model_dir}: the experts are stored as MXFP4 blocks and scales, which this reader "
                              "does not read from safetensors; serve the model's GGUF (llama.cpp's converter keeps "
                              "them MXFP4, which the CPU kernels read as stored)")
    fused_experts = {n: (int(n.split(".")[2]), n.rsplit(".", 1)[1]) for n in names
                     if oss and n.startswith("model.layers.") and n.rsplit(".", 1)[1] in _FUSED_EXPERTS
                     and ".mlp.experts." in n}
    wanted = {n for n, internal in names.items()
              if internal in needed or internal in fused or expert_parts.get(n) or n in fused_experts}
    stored, experts, by_layer = {}, {}, {}
    for name, tensor in stored_safetensors(files, wanted).items():
        internal = names[name]
        gemma_norm = cfg.architecture == "gemma3" and internal.endswith("norm.weight")
        if expert_parts.get(name):
            experts[expert_parts[name]] = tensor
        elif name in fused_experts:
            by_layer[fused_experts[name]] = tensor
        else:
            stored[internal] = _plus_one(tensor) if gemma_norm else tensor
    split_fused(cfg, stored)
    if oss:
        stored.update(_gpt_oss_experts(cfg, by_layer, model_dir))
    elif cfg.num_experts:
        stored.update(_stack_experts(cfg, experts, model_dir))
    return cfg, stored
