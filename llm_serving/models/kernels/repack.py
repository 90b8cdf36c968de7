"""Weights repacked at load for the layer kernel's products: the stored rows of a type the library repacks (Q4_K,
Q6_K, Q8_0, Q4_0, Q4_1, into gemm_avx2_int.h's row-interleaved layout: 8 rows a panel, the same bytes in another
order) are replaced by their repacked copy, and their type code by the library's own (the GGML type + 100), which
the kernel's iconfig then names. The library decides (`RepackRows`): where its products would not read the layout
(the integer paths off, AMX's integer tiles, rows not a multiple of 8), the rows stay as stored."""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np

__all__ = ["Repacker", "WeightType", "repack_rows", "repacked_types", "weight_types"]


class WeightType(NamedTuple):
    """A row of the library's table of weight types (weight_types.h)."""
    code: int           # GGML's number
    block: int          # weights per block (1: F32/F16/BF16)
    bytes: int          # bytes per block
    repacked: int       # the code of its repacked form, or 0: never repacked


@functools.lru_cache(maxsize=None)
def weight_types(library: str) -> dict:
    """GGML type name -> WeightType, as the library at `library` (its path) describes them (WeightTypes())."""
    fn = ctypes.CDLL(library).WeightTypes
    fn.restype = ctypes.c_char_p
    fn.argtypes = []
    rows = (row.split(":") for row in fn().decode().split(","))
    return {name: WeightType(*map(int, numbers)) for name, *numbers in rows}


@functools.lru_cache(maxsize=None)
def _repack_function(library: str):
    fn = ctypes.CDLL(library).RepackRows
    fn.restype = ctypes.c_int32
    fn.argtypes = [ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return fn


def repack_rows(library: str, rows: np.ndarray, qtype: int, store=None) -> tuple:
    """(rows, qtype) as the library's products read them best: a repacked copy and its type, or `rows` and `qtype`
    themselves. `library`: the layer kernel's shared library (its path); rows: uint8 (n, bytes per row). With a
    PanelStore (kernels/panel_store.py), rows that are the model file's own bytes come from the panels an earlier
    start kept, or are kept by it once repacked."""
    if qtype == 0 or rows.dtype != np.uint8 or rows.ndim != 2:
        return rows, qtype
    fn = _repack_function(library)
    to = fn(int(qtype), rows.ctypes.data, rows.shape[0], rows.shape[1], None)   # (asks: reads nothing)
    if to == 0:
        return rows, qtype
    at = store.offset(rows) if store is not None else None
    if at is not None:
        kept = store.panel(at, rows.shape)
        if kept is not None:
            return kept, int(to)
    src = np.ascontiguousarray(rows)
    out = np.empty_like(src)
    spans = _spans(src.shape[0], src.shape[1])
    if len(spans) == 1:
        fn(int(qtype), src.ctypes.data, src.shape[0], src.shape[1], out.ctypes.data)
    else:       # each panel is 8 rows' bytes in place: a span of whole panels repacks alone, on its own thread
        list(_pool().map(lambda span: fn(int(qtype), src[span[0]:span[1]].ctypes.data, span[1] - span[0],
                                         src.shape[1], out[span[0]:span[1]].ctypes.data), spans))
    if at is not None:
        store.keep(at, out)
    return out, int(to)


@dataclasses.dataclass(frozen=True)
class Repacker:
    """A model's repacking at load: the layer kernel's library (its path) and the model file's PanelStore, if any."""
    library: str
    store: object = None

    def rows(self, rows: np.ndarray, qtype: int) -> tuple:
        """repack_rows(library, rows, qtype, store)."""
        return repack_rows(self.library, rows, qtype, self.store)


_SPAN_BYTES = 1 << 20           # a span at least this big: smaller matrices repack on the calling thread


@functools.lru_cache(maxsize=None)
def _pool() -> ThreadPoolExecutor:
    """The load's repack threads, one per CPU this process may run on (ctypes lets go of the GIL in the call)."""
    return ThreadPoolExecutor(max_workers=_workers(), thread_name_prefix="repack")


def _workers() -> int:
    return max(1, len(os.sched_getaffinity(0)))


def _spans(rows: int, row_bytes: int) -> list:
    """[start, end) row spans of whole panels (multiples of 8 rows), one per repack thread where each is at least
    _SPAN_BYTES, else one span."""
    panels = rows // 8
    n = max(1, min(_workers(), rows * row_bytes // _SPAN_BYTES, panels))
    bounds = [8 * (panels * i // n) for i in range(n)] + [rows]
    return [(a, b) for a, b in zip(bounds, bounds[1:])]


def repacked_types(library: str) -> tuple:
    """The names of the GGML types this library repacks in this process (its build and the integer paths' setting
    decide), for the log and the compile cache's key (a graph holds the kernel's iconfig, type codes included)."""
    fn = _repack_function(library)
    # a probe of 8 rows of 256 weights (one group of the panels) of each type the table says may be repacked
    repackable = {name: (t.code, 256 // t.block * t.bytes) for name, t in weight_types(library).items() if t.repacked}
    probe = np.zeros((8, max(b for _, b in repackable.values())), np.uint8)
    return tuple(name for name, (code, row_bytes) in repackable.items()
                 if fn(code, probe.ctypes.data, 8, row_bytes, None) != 0)
