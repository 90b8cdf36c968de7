"""What a served model is, read from its files for the routes that describe it (Ollama's /api/tags, /api/show,
/api/ps): its size on disk, a digest, its format, family, parameter count, quantization and a GGUF-style
metadata table. Headers only are read (a GGUF's metadata, safetensors' JSON headers, config.json), never the
weights; anything a format does not say is left empty."""
from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin", ".ckpt")
# config.json's names for a GGUF's metadata keys ({family}.key)
HF_KEYS = {"block_count": "num_hidden_layers", "embedding_length": "hidden_size",
           "feed_forward_length": "intermediate_size", "attention.head_count": "num_attention_heads",
           "attention.head_count_kv": "num_key_value_heads", "context_length": "max_position_embeddings",
           "vocab_size": "vocab_size"}
MAX_LIST_ITEMS = 16             # a GGUF metadata list longer than this (a vocabulary) is left out


@dataclass(frozen=True)
class ModelFacts:
    size: int = 0                       # bytes of its weight files
    digest: str = ""                    # sha256 (hex) of the files' names, sizes and times: the weights' identity
                                        # without reading gigabytes
    modified_at: float = 0.0            # the newest file's time (unix seconds)
    format: str = ""                    # gguf, safetensors, llama2.c, mindformers
    family: str = ""                    # GGUF's general.architecture, config.json's model_type
    parameter_count: Optional[int] = None
    quantization: str = ""              # Q4_1, Q8_0, F16, BF16, F32, ...
    info: dict = field(default_factory=dict)    # GGUF-style metadata: general.architecture, {family}.block_count, ...


def read_facts(path: str) -> ModelFacts:
    """The facts of the model at `path` (a file or a directory); empty ones for a path that is neither."""
    files = _weight_files(path)
    if not files:
        return ModelFacts()
    stats = [(f, os.stat(f)) for f in files]
    digest = hashlib.sha256("\n".join(f"{os.path.basename(f)} {s.st_size} {s.st_mtime_ns}"
                                      for f, s in stats).encode()).hexdigest()
    base = dict(size=sum(s.st_size for _, s in stats), digest=digest, modified_at=max(s.st_mtime for _, s in stats))
    if files[0].endswith(".gguf"):
        return ModelFacts(**base, **_gguf_facts(files[0]))
    if files[0].endswith(".safetensors"):
        return ModelFacts(**base, **_hf_facts(os.path.dirname(files[0]), files))
    if files[0].endswith(".bin") and os.path.isfile(path):
        return ModelFacts(**base, format="llama2.c", family="llama", info={"general.architecture": "llama"})
    return ModelFacts(**base, format="mindformers" if files[0].endswith(".ckpt") else "")


def _weight_files(path: str) -> list:
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        return []
    names = sorted(n for n in os.listdir(path) if n.endswith(WEIGHT_SUFFIXES))
    safetensors = [n for n in names if n.endswith(".safetensors")]
    return [os.path.join(path, n) for n in (safetensors or names)]


def _gguf_facts(path: str) -> dict:
    """Format, family, parameter count, quantization and the metadata (scalars and short lists, no tokenizer) of
    a GGUF file."""
    import gguf

    from llm_serving.gguf_file import open_gguf

    reader = open_gguf(path)
    info = {}
    for key, f in reader.fields.items():
        if key.startswith(("GGUF.", "tokenizer.")):
            continue
        value = f.contents()
        if not isinstance(value, list) or len(value) <= MAX_LIST_ITEMS:
            info[key] = value
    count = sum(int(t.n_elements) for t in reader.tensors)
    info["general.parameter_count"] = count
    file_type = info.get("general.file_type")
    try:
        quantization = gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else ""
    except ValueError:
        quantization = ""
    if not quantization:        # the type most of the weights have
        kinds = Counter()
        for t in reader.tensors:
            kinds[t.tensor_type.name] += int(t.n_elements)
        quantization = kinds.most_common(1)[0][0] if kinds else ""
    return dict(format="gguf", family=str(info.get("general.architecture", "")), parameter_count=count,
                quantization=quantization, info=info)


def _hf_facts(directory: str, files: list) -> dict:
    """Format, family, parameter count (from the safetensors headers), the weights' most common dtype and
    config.json's shape under GGUF's metadata names."""
    kinds: Counter = Counter()
    for f in files:
        for name, tensor in _safetensors_header(f).items():
            if name != "__metadata__":
                kinds[tensor["dtype"]] += math.prod(tensor["shape"])
    count = sum(kinds.values())
    config_path = os.path.join(directory, "config.json")
    config = json.loads(open(config_path, encoding="utf-8").read()) if os.path.isfile(config_path) else {}
    family = str(config.get("model_type", ""))
    info = {"general.architecture": family, "general.parameter_count": count}
    info.update({f"{family}.{key}": config[hf] for key, hf in HF_KEYS.items() if hf in config})
    return dict(format="safetensors", family=family, parameter_count=count,
                quantization=kinds.most_common(1)[0][0] if kinds else "", info=info)


def _safetensors_header(path: str) -> dict:
    """A safetensors file's header: {tensor name: {dtype, shape, data_offsets}} (its first 8 bytes give the
    header's length, little-endian)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


def parameter_size(count: Optional[int]) -> str:
    """A parameter count as Ollama writes it: 135M as 134.52M, 8B as 8B, 1.54B as 1.5B ("" unknown)."""
    if not count:
        return ""
    for unit, scale, digits in (("B", 10 ** 9, 1), ("M", 10 ** 6, 2), ("K", 10 ** 3, 0)):
        if count >= scale:
            value = count / scale
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.{digits}f}{unit}"
    return str(count)
