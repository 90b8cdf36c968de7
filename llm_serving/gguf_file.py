"""Opening GGUF files (llama.cpp's format) through the `gguf` package, for the weight loader and the tokenizer; and
reading a GGUF's scalar metadata alone, fast (`read_scalars`).

`gguf.GGUFReader` parses every metadata field when it opens a file, slicing its memory map once per string,
and for a vocabulary of tens of thousands of tokens and merges most of its time goes into creating
`np.memmap` objects for the slices. `open_gguf` gives the reader a plain ndarray view of the same map (no
copy; the view keeps the map open), whose slices are cheap ndarrays.
"""
from __future__ import annotations

import mmap
import struct

import numpy as np

__all__ = ["open_gguf", "read_scalars"]

# GGUF's value types: their struct formats (little-endian); 8 is a string, 9 an array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


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


def _scan(buf) -> dict:
    magic, version, _, count = struct.unpack_from("<4sIQQ", buf, 0)
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
                at += n * struct.calcsize(_SCALARS[item])
            elif item == _STRING:
                for _ in range(n):
                    (size,) = struct.unpack_from("<Q", buf, at)
                    at += 8 + size
            else:
                raise ValueError(f"metadata {key!r}: an array of type {item} is not read here")
        else:
            raise ValueError(f"metadata {key!r}: unknown value type {kind}")
    return out
