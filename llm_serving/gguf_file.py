"""Reading GGUF files (llama.cpp's format) by a scan of the header: metadata and tensors (`read_gguf`: the weight
loader's, and the tokenizer's with the vocabulary's strings) and the scalar metadata alone (`read_scalars`); and
opening them through the `gguf` package (`open_gguf`, for what wants its reader's objects: the model facts, the
bench scripts).

`gguf.GGUFReader` parses every metadata field when it opens a file, slicing its memory map once per string,
and for a vocabulary of tens of thousands of tokens and merges most of its time goes into creating
`np.memmap` objects for the slices. `open_gguf` gives the reader a plain ndarray view of the same map (no
copy; the view keeps the map open), whose slices are cheap ndarrays.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

import numpy as np

__all__ = ["GgufContents", "GgufTensor", "open_gguf", "read_gguf", "read_scalars"]

# GGUF's value types: their struct formats (little-endian); 8 is a string, 9 an array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# the element types of tensors the gguf package gives as typed arrays (the rest: their bytes, a row of blocks a row)
_TYPED = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


@dataclass(frozen=True)
class GgufTensor:
    """A tensor's entry in a GGUF, as `gguf.ReaderTensor` has it: `shape` its dimensions innermost first, `data`
    a read-only view of the file's memory map (a typed array for F32/F16/the integers, else its bytes, a row of
    blocks per row), `data_offset` where its bytes start in the file."""
    name: str
    tensor_type: object          # gguf.GGMLQuantizationType
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


@dataclass(frozen=True)
class GgufContents:
    """`read_gguf`'s: `fields` key -> value (a number, boolean or string; a list of them for an array; an array of
    strings, such as a vocabulary, left out unless asked for) and the tensors in file order."""
    fields: dict
    tensors: list


def open_gguf(path: str):
    """A `gguf.GGUFReader` of `path` (read-only memory map). Raises what the reader raises for a bad file."""
    import gguf

    class _PlainViewReader(gguf.GGUFReader):
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, value):
            self._plain = value.view(np.ndarray)

    return _PlainViewReader(path)


def read_scalars(path: str) -> dict:
    """A GGUF's metadata keys whose values are numbers, booleans or strings (arrays, such as a vocabulary, skipped
    unread), by a scan of the header: what a caller needing a few keys (`general.architecture`, `<arch>.pooling_type`)
    reads in milliseconds, where `open_gguf` parses every field (about 1.7 s for SmolLM2's 49,152-token vocabulary).
    ValueError for a file that is not a little-endian GGUF of version 2 or 3, or is cut short."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            return _scan(buf)
        except struct.error as e:
            raise ValueError(f"{path}: GGUF metadata cut short ({e})") from None


def read_gguf(path: str, strings: bool = False) -> GgufContents:
    """A GGUF's metadata (arrays of strings, such as a vocabulary, only with `strings`) and its tensors, the data of
    each a view of one read-only memory map of the file (which the views keep open): what the weight loader and the
    tokenizer read, in milliseconds (a vocabulary's strings: about 0.1 s) where the gguf package's reader takes a
    second or two. ValueError for a file that is not a little-endian GGUF of version 2 or 3, is cut short, holds a
    string that is not UTF-8, or names a tensor type the gguf package does not know."""
    import gguf

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            fields, at, n_tensors = _scan(buf, arrays=True, strings=strings)
            entries = []
            for _ in range(n_tensors):
                (size,) = struct.unpack_from("<Q", buf, at)
                name = bytes(buf[at + 8:at + 8 + size]).decode("utf-8")
                at += 8 + size
                (n_dims,) = struct.unpack_from("<I", buf, at)
                dims = np.frombuffer(buf, np.uint64, n_dims, at + 4).astype(np.int64)
                at += 4 + 8 * n_dims
                kind, offset = struct.unpack_from("<IQ", buf, at)
                at += 12
                entries.append((name, dims, kind, offset))
        except struct.error as e:
            raise ValueError(f"{path}: GGUF header cut short ({e})") from None
    alignment = int(fields.get("general.alignment", 32))
    start = (at + alignment - 1) // alignment * alignment
    whole = np.memmap(path, np.uint8, "r").view(np.ndarray)
    tensors, names = [], set()
    for name, dims, kind, offset in entries:
        if name in names:
            raise ValueError(f"{path}: tensor {name!r} twice")
        names.add(name)
        try:
            qtype = gguf.GGMLQuantizationType(kind)
        except ValueError:
            raise ValueError(f"{path}: tensor {name!r} has an unknown type {kind}") from None
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n = int(np.prod(dims))
        n_bytes = n * type_size // block
        at = start + int(offset)
        if at + n_bytes > len(whole):
            raise ValueError(f"{path}: tensor {name!r} runs past the end of the file")
        np_dims = tuple(int(d) for d in reversed(dims.tolist()))
        raw = whole[at:at + n_bytes]
        if kind in _TYPED:
            data = raw.view(_TYPED[kind]).reshape(np_dims)
        else:
            data = raw.reshape(gguf.quant_shape_to_byte_shape(np_dims, qtype))
        tensors.append(GgufTensor(name, qtype, dims, n, n_bytes, at, data))
    return GgufContents(fields, tensors)


def _scan(buf, arrays: bool = False, strings: bool = False):
    """The metadata (scalars and strings; with `arrays`, arrays of numbers too, as lists, and with `strings` arrays
    of strings as lists) -- and with `arrays`, also where the tensors' entries start and their count: (metadata,
    offset, count)."""
    magic, version, n_tensors, count = struct.unpack_from("<4sIQQ", buf, 0)
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"not a little-endian GGUF of version 2 or 3 (magic {magic!r}, version {version})")
    at, out = 24, {}

    def string(at: int) -> tuple:
        (size,) = struct.unpack_from("<Q", buf, at)
        return bytes(buf[at + 8:at + 8 + size]).decode("utf-8", errors="replace"), at + 8 + size

    for _ in range(count):
        key, at = string(at)
        (kind,) = struct.unpack_from("<I", buf, at)
        at += 4
        if kind in _SCALARS:
            (out[key],) = struct.unpack_from(_SCALARS[kind], buf, at)
            at += struct.calcsize(_SCALARS[kind])
        elif kind == _STRING:
            out[key], at = string(at)
        elif kind == _ARRAY:
            item, n = struct.unpack_from("<IQ", buf, at)
            at += 12
            if item in _SCALARS:
                if arrays:
                    out[key] = np.frombuffer(buf, np.dtype(_SCALARS[item]), n, at).tolist()
                at += n * struct.calcsize(_SCALARS[item])
            elif item == _STRING:
                items = [] if strings else None
                for _ in range(n):
                    (size,) = struct.unpack_from("<Q", buf, at)
                    if items is not None:
                        items.append(bytes(buf[at + 8:at + 8 + size]).decode("utf-8"))
                    at += 8 + size
                if items is not None:
                    out[key] = items
            else:
                raise ValueError(f"metadata {key!r}: an array of type {item} is not read here")
        else:
            raise ValueError(f"metadata {key!r}: unknown value type {kind}")
    return (out, at, n_tensors) if arrays else out
