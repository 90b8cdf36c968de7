"""Opening GGUF files (llama.cpp's format) through the `gguf` package, for the weight loader and the tokenizer.

`gguf.GGUFReader` parses every metadata field when it opens a file, slicing its memory map once per string,
and for a vocabulary of tens of thousands of tokens and merges most of its time goes into creating
`np.memmap` objects for the slices. `open_gguf` gives the reader a plain ndarray view of the same map (no
copy; the view keeps the map open), whose slices are cheap ndarrays.
"""
from __future__ import annotations

import numpy as np

__all__ = ["open_gguf"]


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
