"""Weights repacked, at load or after it, for the layer kernel's products: the stored rows of a type the library
repacks (Q4_K, Q6_K, Q8_0, Q4_0, Q4_1, into gemm_avx2_int.h's row-interleaved layout: 8 rows a panel, the same bytes
in another order) are replaced by their repacked copy, and their type code by the library's own (the GGML type +
100), which the kernel's iconfig then names. The library decides (`RepackRows`): where its products would not read
the layout (the integer paths off, AMX's integer tiles for a model whose steps are not batch-invariant, rows not a
multiple of 8), the rows stay as stored.

A model whose layers run as one stack call (kernels/layer_stack.py) repacks them after its load (`LaterRepacks`):
it serves from the stored rows at once, since their products are the repacked rows' to the bit
(tests/unit/test_kernel_repack.py), and each matrix is swapped for its repacked copy between steps as background
threads finish it. A first start on a file then waits for no repack (a 4B's 2.3 GB: 2-3.5 s on two cores); its
first steps run at the stored rows' speed (0.76-0.82x at one row of x, bench/repack.py)."""
from __future__ import annotations

import atexit
import ctypes
import dataclasses
import functools
import logging
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, NamedTuple, Optional

import numpy as np

__all__ = ["LATER_NICE", "LaterRepacks", "Repacker", "WeightType", "repack_rows", "repacked_type", "repacked_types",
           "weight_types"]

logger = logging.getLogger(__name__)

LATER_NICE = 10             # the nice value of LaterRepacks' threads: a step's kernel threads keep ~90% of the cores


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
    fn.argtypes = [ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int32]
    return fn


def repack_rows(library: str, rows: np.ndarray, qtype: int, store=None, invariant: bool = True) -> tuple:
    """(rows, qtype) as the library's products read them best: a repacked copy and its type, or `rows` and `qtype`
    themselves. `library`: the layer kernel's shared library (its path); rows: uint8 (n, bytes per row); invariant:
    whether the model's steps are batch-invariant (model_config.batch_invariant: where AMX's integer tiles are, they
    read the stored rows of steps that are not). With a PanelStore (kernels/panel_store.py), rows that are the model
    file's own bytes come from the panels an earlier start kept, or are kept by it once repacked."""
    to, at, kept = _kept(library, rows, qtype, store, invariant)
    if to == 0:
        return rows, qtype
    if kept is not None:
        return kept, to
    fn = _repack_function(library)
    src = np.ascontiguousarray(rows)
    out = np.empty_like(src)
    spans = _spans(src.shape[0], src.shape[1])
    if len(spans) == 1:
        fn(int(qtype), src.ctypes.data, src.shape[0], src.shape[1], out.ctypes.data, int(invariant))
    else:       # each panel is 8 rows' bytes in place: a span of whole panels repacks alone, on its own thread
        list(_pool().map(lambda span: fn(int(qtype), src[span[0]:span[1]].ctypes.data, span[1] - span[0],
                                         src.shape[1], out[span[0]:span[1]].ctypes.data, int(invariant)), spans))
    if at is not None:
        store.keep(at, out)
    return out, to


def _kept(library: str, rows: np.ndarray, qtype: int, store, invariant: bool) -> tuple:
    """(the type the library repacks these rows into, 0 where it reads them as stored; where they start in the model
    file, if a store keeps their panels; the panels an earlier start kept, or None)."""
    if qtype == 0 or rows.dtype != np.uint8 or rows.ndim != 2:
        return 0, None, None
    to = repacked_type(library, rows, qtype, invariant)
    at = store.offset(rows) if to and store is not None else None
    return to, at, store.panel(at, rows.shape) if at is not None else None


@dataclasses.dataclass(frozen=True)
class Repacker:
    """A model's repacking at load: the layer kernel's library (its path), the model file's PanelStore, if any, the
    LaterRepacks that repack the layer stack's matrices after the load (None: everything at load), and whether the
    model's steps are batch-invariant (repack_rows' `invariant`; a LaterRepacks holds its own, the same)."""
    library: str
    store: object = None
    later: Optional["LaterRepacks"] = None
    invariant: bool = True

    def rows(self, rows: np.ndarray, qtype: int) -> tuple:
        """repack_rows(library, rows, qtype, store, invariant)."""
        return repack_rows(self.library, rows, qtype, self.store, self.invariant)

    def kept_or_stored(self, rows: np.ndarray, qtype: int) -> tuple:
        """(rows, qtype, to) for a matrix repacked after the load: the panels an earlier start kept and their type
        (to 0), or, where the library repacks these rows, the rows themselves and the type `later` repacks them
        into (to), or the rows as stored (to 0)."""
        to, _, kept = _kept(self.library, rows, qtype, self.store, self.invariant)
        if to == 0:
            return rows, qtype, 0
        return (kept, to, 0) if kept is not None else (rows, qtype, to)


def repacked_type(library: str, rows: np.ndarray, qtype: int, invariant: bool = True) -> int:
    """The type code the library repacks these stored rows (uint8 (n, bytes per row)) of type `qtype` into, for a
    model whose steps are batch-invariant or not, or 0: it reads them as stored."""
    return int(_repack_function(library)(int(qtype), rows.ctypes.data, rows.shape[0], rows.shape[1], None,
                                         int(invariant)))


class LaterRepacks:
    """A model's matrices repacked after its load, on background threads (one per CPU, at nice LATER_NICE: a
    step's kernel threads keep most of the cores, and the repack runs in the gaps and when idle).

    `add` (at load) queues stored rows (Repacker.kept_or_stored's) with what uses their repacked copy; `start`
    starts the threads; `apply`, called by the thread that runs the model's steps between them, hands each finished
    copy to its `use` (which points the layer stack at it: the stored rows give the same bits, so no step's tokens
    depend on when); `pending` says whether any is left to apply; `wait` (tests, benchmarks) waits for the threads;
    `close` stops them after the matrix each is on. With a PanelStore, each copy of the file's own rows is kept for
    the next start, and the last thread writes them (PanelStore.finish: the load's other kept panels too) once all
    are repacked."""

    def __init__(self, library: str, store=None, nice: int = LATER_NICE, invariant: bool = True):
        self.library, self.store, self.nice, self.invariant = library, store, nice, invariant
        self._jobs: list = []               # (rows, qtype, to, offset in the file or None, use)
        self._next = 0                      # the next job a thread takes
        self._done: list = []               # (use, panels, to) repacked, not yet applied
        self._lock = threading.Lock()
        self._threads: list = []
        self._closed = threading.Event()
        self._running = 0                   # threads not yet finished
        self.bytes = 0                      # of the rows queued
        self.applied = 0                    # jobs applied
        self.error: Optional[BaseException] = None
        self.writing = False                # the last thread writes the panels kept (PanelStore.finish)
        _LIVE.add(self)

    def add(self, rows: np.ndarray, qtype: int, to: int, use: Callable[[np.ndarray, int], None]) -> None:
        """Queue `rows` of type `qtype`, which the library repacks into type `to`: `use(panels, to)` gets the copy."""
        at = self.store.offset(rows) if self.store is not None else None
        self._jobs.append((rows, int(qtype), int(to), at, use))
        self.bytes += rows.nbytes

    @property
    def ready(self) -> int:
        """How many repacked copies wait for `apply`."""
        return len(self._done)

    @property
    def pending(self) -> bool:
        """Whether some queued matrix is not applied yet (and still may be: not closed, no failure)."""
        return self.applied < len(self._jobs) and not self._closed.is_set()

    def start(self) -> None:
        """Start the threads (none when nothing is queued)."""
        if not self._jobs or self._threads:
            return
        self._t0 = time.perf_counter()
        n = max(1, min(_workers(), len(self._jobs)))
        self._running = n
        for i in range(n):
            thread = threading.Thread(target=self._work, name=f"repack-later-{i}", daemon=True)
            self._threads.append(thread)
            thread.start()

    def _work(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
        except (OSError, AttributeError):
            pass                            # (this thread's priority stays the process's)
        fn = _repack_function(self.library)
        try:
            while not self._closed.is_set():
                with self._lock:
                    if self._next >= len(self._jobs):
                        break
                    rows, qtype, to, at, use = self._jobs[self._next]
                    self._next += 1
                src = np.ascontiguousarray(rows)
                out = np.empty_like(src)
                got = fn(qtype, src.ctypes.data, src.shape[0], src.shape[1], out.ctypes.data, int(self.invariant))
                if got != to:
                    raise RuntimeError(f"LaterRepacks: RepackRows gave type {got} for rows of type {qtype}; it said "
                                       f"{to}")
                if at is not None and self.store is not None:
                    self.store.keep(at, out)
                with self._lock:
                    self._done.append((use, out, to))
        except BaseException as exc:       # noqa: BLE001 - the model goes on reading the stored rows
            self.error = exc
            logger.error("repacking after the load failed (the stored rows serve on): %s", exc)
            self._closed.set()
        with self._lock:
            self._running -= 1
            last = self._running == 0
        if last and not self._closed.is_set():
            seconds = time.perf_counter() - self._t0
            if self.store is not None:          # (the load's panels kept, these and any repacked at load)
                self.writing = True
                self.store.finish()
            logger.info("repacked after the load: %.2f GB in %.1f s", self.bytes / 1e9, seconds)

    def apply(self) -> int:
        """Hand each repacked copy finished since the last call to its `use` (on the thread that runs the steps,
        between them); the number handed."""
        if not self._done:
            return 0
        with self._lock:
            done, self._done = self._done, []
        for use, panels, to in done:
            use(panels, to)
        self.applied += len(done)
        return len(done)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Wait for the threads to finish (repacked, and the panels written); whether they did."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self._threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    def close(self) -> None:
        """Stop the threads after the matrix each is on; nothing more is applied."""
        self._closed.set()
        with self._lock:
            self._done = []


_LIVE: "weakref.WeakSet[LaterRepacks]" = weakref.WeakSet()


@atexit.register
def _stop_at_exit() -> None:
    """At exit, each LaterRepacks' threads stop after their matrix (a daemon thread still in RepackRows would write
    into arrays the interpreter frees as it ends); one writing the panels is left to end with the process (a file
    half written stays a temporary file, which the next start removes)."""
    for later in list(_LIVE):
        later.close()
    for later in list(_LIVE):
        if not later.writing:
            later.wait(timeout=5.0)


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


def repacked_types(library: str, invariant: bool = True) -> tuple:
    """The names of the GGML types this library repacks in this process for a model whose steps are batch-invariant
    or not (its build, the integer paths' setting and AMX's integer tiles decide), for the log and the compile cache's
    key (a graph holds the kernel's iconfig, type codes included)."""
    fn = _repack_function(library)
    # a probe of 8 rows of 256 weights (one group of the panels) of each type the table says may be repacked
    repackable = {name: (t.code, 256 // t.block * t.bytes) for name, t in weight_types(library).items() if t.repacked}
    probe = np.zeros((8, max(b for _, b in repackable.values())), np.uint8)
    return tuple(name for name, (code, row_bytes) in repackable.items()
                 if fn(code, probe.ctypes.data, 8, row_bytes, None, int(invariant)) != 0)
