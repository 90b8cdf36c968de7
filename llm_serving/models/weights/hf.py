"""HuggingFace checkpoints: a directory with `config.json` (read by hf_config.py's `load_config`) and
`model.safetensors` or shards listed in `model.safetensors.index.json` (`stored_safetensors`: F16/F32/F64 read with
`safetensors`; BF16, which numpy lacks, widened to float32 by hand).

`load_hf` gives the tensors under the internal (LLaMA HF) names `expected_shapes` lists: Phi-3's fused matrices split
into row parts that read only their own rows, a multimodal checkpoint's text model (`language_model.model.*` or
`model.language_model.*`) under the text model's names, and where a family names a tensor otherwise, under the name
its family maps it to (`models/families/`: Gemma's norms, read as 1 + the stored weight since its RMSNorm computes
x * (1 + w); a BERT encoder's parts; a mixture's router). Embeddings tied (`tie_word_embeddings`, or no
`lm_head.weight`) or not. A mixture's experts, one tensor each (as its family names them: Qwen3-MoE's
`mlp.experts.E.gate_proj`, Mixtral's `block_sparse_moe.experts.E.w1`), are
stacked by rows into one matrix per part and layer (`mlp.experts.gate_proj.weight`: E * I rows), its router renamed
`mlp.router.weight`. gpt-oss's experts, one 3-D tensor per part and layer, are cut into those stacks too: float
(`gate_up_proj`, gate and up interleaved) or, as openai's checkpoints ship them (`quantization_config` mxfp4), MXFP4
blocks and scales (uint8, `gate_up_proj_blocks`/`_scales`, `down_proj_...`), which stay MXFP4: each stack offers its
rows as GGML's MXFP4 blocks (`read_blocks`, type 39, a nibble re-layout of the same codes and scales, read from the
memory-mapped file), which the CPU kernels read as stored, and float32 values (`read`) for every other path.
"""
from __future__ import annotations

import functools
import json
import os
import struct
from typing import Callable, Optional

import numpy as np

from .. import families
from .common import LlamaConfig, StoredTensor, WeightLoadError, expected_shapes, split_fused, stack_rows
from .hf_config import llama3_rope_factors, load_config

__all__ = ["llama3_rope_factors", "load_config", "load_hf", "mxfp4_to_ggml", "mxfp4_values", "stored_safetensors"]


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


def _u8_array(fpath: str, header_len: int, info: dict, shape: tuple) -> np.ndarray:
    """A uint8 tensor of a safetensors file as a read-only memory map, viewed as `shape` (its own, regrouped)."""
    return np.memmap(fpath, dtype=np.uint8, mode="r", offset=8 + header_len + info["data_offsets"][0], shape=shape)


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


# a multimodal checkpoint's text model as transformers names it (4.x and 5.x's save_pretrained: language_model.model.*;
# 5.x's modules: model.language_model.*; SmolVLM's and Idefics3's: model.text_model.*) -> the text model's own names
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."), ("model.text_model.", "model."))
_FUSED = ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight")
def _internal_name(name: str, family: families.Family) -> str:
    """The internal name of checkpoint tensor `name` (a name the model does not use stays as it is): the family's
    renaming of its names, else a text model's names with the family's own after "model.layers.N."."""
    if family.hf_tensor_name is not None:
        return family.hf_tensor_name(name)
    for prefix, text in _TEXT_PREFIXES:
        if name.startswith(prefix):
            name = text + name[len(prefix):]
            break
    if name.startswith("model.layers.") and name.count(".") >= 3:
        _, _, layer, rest = name.split(".", 3)
        if rest in family.hf_layer_names:
            return f"model.layers.{layer}.{family.hf_layer_names[rest]}"
    return name


def _expert_of(name: str, family: families.Family) -> Optional[tuple]:
    """(layer, part, expert) of one expert's matrix, as the family names them
    (`model.layers.3.mlp.experts.7.up_proj.weight`: (3, "up_proj", 7)), or None."""
    prefix = family.hf_expert_prefix
    if prefix is None or not name.startswith("model.layers."):
        return None
    _, _, layer, rest = name.split(".", 3)
    if rest.startswith(prefix):
        expert, _, tail = rest[len(prefix):].partition(".")
        if expert.isdigit() and tail in family.hf_expert_parts:
            return int(layer), family.hf_expert_parts[tail], int(expert)
    return None


# gpt-oss's experts, each part one 3-D tensor of every expert (after "model.layers.N.mlp.experts."): gate_up_proj
# (E, H, 2I), its units' gate and up interleaved (even columns gate, odd up), down_proj (E, I, H), and their biases
_FUSED_EXPERTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


# the MXFP4 form of those (after "model.layers.N.mlp.experts."): uint8 blocks (E, rows, K/32, 16), each byte two
# consecutive E2M1 codes (low nibble first), and scales (E, rows, K/32), E8M0 exponents (2 ** (scale - 127))
_MXFP4_EXPERTS = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")
_MXFP4 = 39                     # GGML's type code of MXFP4 (gguf.KEPT_QUANTIZED's): 17 bytes per 32 weights
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
_MXFP4_CHUNK = 4096             # rows converted at a time (bounds the temporary arrays of a whole stack's read)


def _e2m1_codes(blocks: np.ndarray) -> np.ndarray:
    """The 4-bit codes of HF MXFP4 blocks (..., 16) in weight order (..., 32): byte k holds weights 2k (its low
    nibble) and 2k + 1 (its high one)."""
    return np.stack([blocks & 0xF, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)


def mxfp4_to_ggml(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """HF MXFP4 rows, blocks (rows, K/32, 16) and scales (rows, K/32), as GGML's MXFP4 rows (rows, K/32 * 17), the
    same codes and scales: each block its E8M0 byte, then 16 bytes whose low nibbles are weights 0..15 and high
    nibbles 16..31. (GGML's table is the E2M1 values doubled and its scale 2 ** (e - 128): the same weights.)"""
    codes = _e2m1_codes(blocks)
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    return np.concatenate([scales[..., None], packed], axis=-1).reshape(blocks.shape[0], -1)


def mxfp4_values(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """HF MXFP4 rows as float32 (rows, K): E2M1 value times 2 ** (scale - 127), exactly."""
    exponents = scales.astype(np.int32)[..., None] - 127
    return np.ldexp(_E2M1[_e2m1_codes(blocks)], exponents).reshape(blocks.shape[0], -1)


def _mxfp4_stack(blocks: Callable[[], np.ndarray], scales: Callable[[], np.ndarray], shape: tuple, first: int,
                 step: int) -> StoredTensor:
    """A (rows, K) expert stack whose row r is row first + r * step of the (E * R, K/32, 16) blocks and (E * R, K/32)
    scales that `blocks()` and `scales()` map (gate: even rows of gate_up, up: odd ones, down: every row): read(index)
    its float32 values, read_blocks(rows) its GGML MXFP4 bytes."""
    def packed_rows(rows) -> np.ndarray:
        return np.arange(shape[0])[rows] * step + first

    def read_blocks(rows: slice) -> np.ndarray:
        at, b, s = packed_rows(rows), blocks(), scales()
        out = np.empty((len(at), shape[1] // 32 * 17), np.uint8)
        for start in range(0, len(at), _MXFP4_CHUNK):
            part = at[start:start + _MXFP4_CHUNK]
            out[start:start + len(part)] = mxfp4_to_ggml(b[part], s[part])
        return out

    def read(index: tuple) -> np.ndarray:
        at = packed_rows(index[0] if index else slice(None))
        return mxfp4_values(blocks()[at], scales()[at])[(slice(None),) + tuple(index[1:])]
    return StoredTensor(shape, read, _MXFP4, read_blocks, "MXFP4")


def _mxfp4_experts(cfg: LlamaConfig, packed: dict, path: str) -> dict:
    """gpt-oss's MXFP4 experts ({(layer, name): (file, header length, header entry)}) as the gate, up and down stacks,
    read from the memory-mapped files (as `_gpt_oss_experts` cuts the float ones: gate_up's rows are its outputs,
    gate and up interleaved)."""
    e, h, inter = cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate_size
    out = {}
    # each packed tensor: its rows (outputs) and K (inputs), and the stacks cut from it (part, first row, step)
    cuts = {"gate_up_proj": (2 * inter, h, (("gate_proj", 0, 2), ("up_proj", 1, 2))),
            "down_proj": (h, inter, (("down_proj", 0, 1),))}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}.mlp.experts."
        for name, (rows, k, parts) in cuts.items():
            arrays = {}
            for kind, shape in (("blocks", (e, rows, k // 32, 16)), ("scales", (e, rows, k // 32))):
                fpath, header_len, info = packed[(i, f"{name}_{kind}")]
                if info["dtype"] != "U8" or tuple(info["shape"]) != shape:
                    raise WeightLoadError(f"{path}: tensor {p}{name}_{kind} is {info['dtype']} {tuple(info['shape'])}"
                                          f", expected U8 {shape} (MXFP4 {kind})")
                arrays[kind] = functools.partial(_u8_array, fpath, header_len, info, (e * rows,) + shape[2:])
            for part, first, step in parts:
                out[f"{p}{part}.weight"] = _mxfp4_stack(arrays["blocks"], arrays["scales"], (e * rows // step, k),
                                                        first, step)
    return out


def _derived(tensor: StoredTensor, shape: tuple, fn) -> StoredTensor:
    """A tensor computed from the whole of another (`fn` of its float32 array), read whole then indexed."""
    def read(index: tuple) -> np.ndarray:
        return np.ascontiguousarray(fn(np.asarray(tensor.read((slice(None),) * len(tensor.shape)), np.float32)))[index]
    return StoredTensor(shape, read, stored_type=tensor.stored_type)


def _gpt_oss_experts(cfg: LlamaConfig, fused: dict, path: str, packed: Optional[dict] = None) -> dict:
    """gpt-oss's fused expert tensors ({(layer, name): StoredTensor}) as the stacks and biases the model reads:
    gate (E*I, H) from gate_up's even columns, up from its odd ones, down (E*H, I), transposed per expert. `packed`:
    an MXFP4 checkpoint's blocks and scales (`_packed_tensors`), its matrices (`_mxfp4_experts`); the biases are
    float in either."""
    e, h, inter = cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate_size
    shapes = {"gate_up_proj": (e, h, 2 * inter), "gate_up_proj_bias": (e, 2 * inter), "down_proj": (e, inter, h),
              "down_proj_bias": (e, h)}
    if packed is not None:
        shapes = {name: shape for name, shape in shapes.items() if name.endswith("_bias")}
    out = {}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}.mlp.experts."
        missing = [n for n in _MXFP4_EXPERTS if packed is not None and (i, n) not in packed]
        missing += [n for n in shapes if (i, n) not in fused]
        if missing:
            raise WeightLoadError(f"{path}: tensor {p}{missing[0]} is missing" + (
                " (an MXFP4 checkpoint: each layer's experts are blocks and scales, with float biases)"
                if packed is not None else ""))
        t = {name: fused[(i, name)] for name in shapes}
        for name, shape in shapes.items():
            if tuple(t[name].shape) != shape:
                raise WeightLoadError(f"{path}: tensor {p}{name} has shape {tuple(t[name].shape)}, expected {shape}")
        for part, offset in (("gate_proj", 0), ("up_proj", 1)):
            if packed is None:
                out[f"{p}{part}.weight"] = _derived(t["gate_up_proj"], (e * inter, h), lambda a, o=offset: a[
                    :, :, o::2].transpose(0, 2, 1).reshape(e * inter, h))
            out[f"{p}{part}.bias"] = _derived(t["gate_up_proj_bias"], (e * inter,),
                                              lambda a, o=offset: a[:, o::2].reshape(-1))
        if packed is None:
            out[f"{p}down_proj.weight"] = _derived(t["down_proj"], (e * h, inter),
                                                   lambda a: a.transpose(0, 2, 1).reshape(e * h, inter))
        out[f"{p}down_proj.bias"] = _derived(t["down_proj_bias"], (e * h,), lambda a: a.reshape(-1))
    if packed is not None:
        out.update(_mxfp4_experts(cfg, packed, path))
    return out


def _halves_experts(cfg: LlamaConfig, fused: dict, path: str) -> dict:
    """Qwen3-VL-MoE's fused expert tensors ({(layer, name): StoredTensor}) of each mixture layer as the stacks the
    model reads: gate (E*I, H) the first half of each expert's gate_up units, up the second, down (E*H, I). Either
    orientation transformers stores: the Hub's (gate_up (E, H, 2I), down (E, I, H): each expert's x @ W) or 5.x's
    save_pretrained's ((E, 2I, H), (E, H, I): nn.Linear's rows); where the shape cannot tell (H = 2I, or H = I),
    config.json's transformers_version does (5 and later: rows)."""
    e, h, inter = cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate_size
    rows_first = _saved_by_transformers_5(path)
    out = {}
    for i in range(cfg.num_layers):
        if not cfg.layer_moe(i):
            continue
        p = f"model.layers.{i}.mlp.experts."
        missing = [n for n in ("gate_up_proj", "down_proj") if (i, n) not in fused]
        if missing:
            raise WeightLoadError(f"{path}: tensor {p}{missing[0]} is missing (the config names {e} experts)")
        gate_up, down = fused[(i, "gate_up_proj")], fused[(i, "down_proj")]
        shapes = {"gate_up_proj": ((e, h, 2 * inter), (e, 2 * inter, h)), "down_proj": ((e, inter, h), (e, h, inter))}
        laid = {}
        for name, tensor in (("gate_up_proj", gate_up), ("down_proj", down)):
            columns, rows = shapes[name]
            shape = tuple(tensor.shape)
            if shape not in (columns, rows):
                raise WeightLoadError(f"{path}: tensor {p}{name} has shape {shape}, expected {columns} or {rows}")
            laid[name] = shape == rows and (shape != columns or rows_first)
        for part, half in (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, 2 * inter))):
            if laid["gate_up_proj"]:
                fn = lambda a, s=half: a[:, s, :].reshape(e * inter, h)                   # noqa: E731
            else:
                fn = lambda a, s=half: a[:, :, s].transpose(0, 2, 1).reshape(e * inter, h)  # noqa: E731
            out[f"{p}{part}.weight"] = _derived(gate_up, (e * inter, h), fn)
        out[f"{p}down_proj.weight"] = _derived(down, (e * h, inter), (lambda a: a.reshape(e * h, inter)) if laid[
            "down_proj"] else (lambda a: a.transpose(0, 2, 1).reshape(e * h, inter)))
    return out


def _saved_by_transformers_5(model_dir: str) -> bool:
    """Whether config.json says transformers 5 or later wrote the checkpoint (`transformers_version`)."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            version = str(json.load(f).get("transformers_version", "0"))
        return int(version.split(".")[0]) >= 5
    except (OSError, ValueError, json.JSONDecodeError):
        return False


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


def _quant_method(model_dir: str) -> Optional[str]:
    """config.json's `quantization_config.quant_method` (gpt-oss's checkpoints: "mxfp4"), or None. (load_config has
    read the file already: it is there and JSON.)"""
    with open(os.path.join(model_dir, "config.json"), "r", encoding="utf-8") as f:
        quant = json.load(f).get("quantization_config")
    return quant.get("quant_method") if isinstance(quant, dict) else None


def _packed_tensors(files: dict[str, str], names: dict[str, tuple]) -> dict[tuple, tuple]:
    """{key: (file, header length, header entry)} of the tensors `names` ({name: key}) maps, not read: where each
    one's bytes are."""
    headers, out = {}, {}
    for name, key in names.items():
        fpath = files.get(name) or files[""]
        if fpath not in headers:
            try:
                headers[fpath] = _safetensors_header(fpath)
            except (OSError, ValueError, struct.error) as e:
                raise WeightLoadError(f"{fpath}: cannot read safetensors file: {e}") from e
        header_len, header = headers[fpath]
        out[key] = (fpath, header_len, header[name])
    return out


def load_hf(model_dir: str) -> tuple[LlamaConfig, dict[str, StoredTensor]]:
    """The config and tensors (not read yet) of a HuggingFace directory, under the internal names."""
    cfg = load_config(model_dir)
    files = _shard_files(model_dir)
    needed = set(expected_shapes(cfg))
    fused = {f"model.layers.{i}.{name}" for i in range(cfg.num_layers) for name in _FUSED}
    family = families.FAMILIES[cfg.architecture]
    names = {n: _internal_name(n, family) for n in _checkpoint_names(files)}
    expert_parts = {n: _expert_of(internal, family) for n, internal in names.items()} if cfg.num_experts else {}
    experts_3d = family.fused_experts is not None       # (gpt-oss's, Qwen3-VL-MoE's: one 3-D tensor per part)
    # gpt-oss's experts: (layer, name) of each 3-D tensor, float or MXFP4 (its blocks and scales are not float: they
    # are read from the memory-mapped file, not through stored_safetensors)
    oss_experts = {n: (int(internal.split(".")[2]), internal.rsplit(".", 1)[1]) for n, internal in names.items()
                   if experts_3d and internal.startswith("model.layers.") and ".mlp.experts." in internal}
    fused_experts = {n: key for n, key in oss_experts.items() if key[1] in _FUSED_EXPERTS}
    mxfp4 = {n: key for n, key in oss_experts.items() if key[1] in _MXFP4_EXPERTS}
    packed = _packed_tensors(files, mxfp4) if experts_3d and (mxfp4 or _quant_method(model_dir) == "mxfp4") else None
    wanted = {n for n, internal in names.items()
              if internal in needed or internal in fused or expert_parts.get(n) or n in fused_experts}
    stored, experts, by_layer = {}, {}, {}
    for name, tensor in stored_safetensors(files, wanted).items():
        internal = names[name]
        plus_one = family.norm_gain_plus_one and internal.endswith("norm.weight")
        if expert_parts.get(name):
            experts[expert_parts[name]] = tensor
        elif name in fused_experts:
            by_layer[fused_experts[name]] = tensor
        else:
            stored[internal] = _plus_one(tensor) if plus_one else tensor
    split_fused(cfg, stored)
    if family.fused_experts == "halves":
        stored.update(_halves_experts(cfg, by_layer, model_dir))
    elif experts_3d:
        stored.update(_gpt_oss_experts(cfg, by_layer, model_dir, packed))
    elif cfg.num_experts:
        stored.update(_stack_experts(cfg, experts, model_dir))
    return cfg, stored
