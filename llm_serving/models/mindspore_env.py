"""Process-wide MindSpore set-up: graph mode, the device, the CPU kernel thread count, and the graph
compile cache.

The compile cache lives under <cache>/ms_compile/<key>/, where <cache> is $LLM_SERVING_CACHE or
~/.cache/llm-serving (LLM_SERVING_COMPILE_CACHE=0 turns it off) and <key> hashes everything that decides
which graphs warmup compiles and in which order. MindSpore 2.10 reads MS_COMPILER_CACHE_PATH once, at the
process's first compile, and names cached graphs by their compile index in the process
(compile_cache_N.mindir) with no shape check. A cache is therefore only safe when the same sequence of
graphs is compiled in the same order every time: one runner per process (the first one claims the cache,
`claim_compile_cache`), warmed up bucket by bucket, with every input of that sequence in the key; graphs
compiled outside warmup's entries (whose order depends on the traffic) bypass it (`set_compile_cache`,
`close_compile_cache`; warmup.py may run some entries after the agent is ready, still in order). Processes
that share a cache directory (servers of the same model and configuration starting together) never use it
at the same time: each holds an exclusive lock on it from set-up to the end of its warmup. A single agent
waits for the lock (then reads what the other wrote); a tensor-parallel rank does not wait (its warmup
meets its peers' in every all-reduce, and a peer may be waiting on another group's lock): it compiles
without the cache instead.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import sys
import time
from typing import Optional

from llm_serving.cache_dir import default_cache_dir

logger = logging.getLogger(__name__)

_GRAPH_SOURCES = ("llama.py", "attention.py", "sampler.py", "layer_weights.py", "kernels/signatures.py")
_runners_made = 0               # in this process: only the first can use the compile cache
_cache_lock = None              # the open lock file of the cache directory in use, until warmup ends


def model_source_digest() -> str:
    """Hash of the graph-defining sources, the MindSpore version and the process's entry script (part of the
    compile-cache key). MindSpore checks a cache against a hash of the entry script (and what it imports from
    outside sys.path) and, when that differs, compiles every graph again and rewrites the cache: keyed by it, a
    changed agent script (or a test's own script) gets a cache of its own instead, and a staged warmup
    (warmup.py) never meets a cache whose graphs all compile cold."""
    import mindspore as ms

    h = hashlib.sha1(ms.__version__.encode())
    here = os.path.dirname(os.path.abspath(__file__))
    for path in [os.path.join(here, name) for name in _GRAPH_SOURCES] + [os.path.realpath(sys.argv[0] or "-")]:
        try:
            with open(path, "rb") as f:
                h.update(f.read())
        except OSError:
            if os.path.dirname(path) == here:
                raise
            h.update(path.encode())        # (an interactive interpreter or `python -c`: no script)
    return h.hexdigest()


def claim_compile_cache(key_parts: Optional[tuple]) -> Optional[str]:
    """Every runner calls this once, with the description of its warmup sequence when it wants the compile
    cache (None when not). Returns the cache key, or None: not wanted, or another runner of this process
    came first (its graphs took the first compile indices)."""
    global _runners_made
    _runners_made += 1
    if key_parts is None:
        return None
    if _runners_made > 1:
        logger.warning("compile cache off: another ModelRunner already exists in this process")
        return None
    return hashlib.sha1(repr(key_parts + (model_source_digest(),)).encode()).hexdigest()[:16]


def setup_mindspore(device_target: str, device_id: int, num_threads: Optional[int],
                    cache_key: Optional[str], wait_for_cache: bool = True) -> Optional[str]:
    """Set MindSpore up for this process (safe to call again with the same arguments); returns the compile
    cache directory in use, if any (wait_for_cache: see the module docstring)."""
    import mindspore as ms

    cache_dir = None
    if cache_key is not None and os.environ.get("LLM_SERVING_COMPILE_CACHE", "1") == "1":
        cache_dir = os.path.join(str(default_cache_dir()), "ms_compile", cache_key)
        try:
            os.makedirs(cache_dir, exist_ok=True)
        except OSError as e:
            logger.warning("compile cache disabled: cannot create %s (%s)", cache_dir, e)
            cache_dir = None
    if cache_dir is not None and not _lock_cache(cache_dir, wait_for_cache):
        cache_dir = None
    if cache_dir is not None:
        os.environ["MS_COMPILER_CACHE_ENABLE"] = "1"
        os.environ["MS_COMPILER_CACHE_PATH"] = cache_dir
    else:
        os.environ["MS_COMPILER_CACHE_ENABLE"] = "0"
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        ms.set_device(device_target, device_id)
    except RuntimeError as e:  # already set by an earlier runner in this process
        logger.debug("ms.set_device: %s", e)
    if num_threads is not None:
        from mindspore._c_expression import RuntimeConf
        if RuntimeConf.get_instance().is_op_threads_num_configured():
            logger.info("MindSpore CPU thread count is set once per process; ignoring num_threads=%s", num_threads)
        else:
            ms.device_context.cpu.op_tuning.threads_num(int(num_threads))
    return cache_dir


def _lock_cache(cache_dir: str, wait: bool) -> bool:
    """Take (and hold) the cache directory's lock, waiting for it or not; whether this process has it. An flock,
    not a file naming its holder: the kernel drops it when the holder dies, however it dies, so the .lock file a
    killed agent leaves makes no start wait."""
    global _cache_lock
    lock = open(os.path.join(cache_dir, ".lock"), "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        if not wait:
            lock.close()
            logger.warning("compile cache %s is in use by another process; compiling without it", cache_dir)
            return False
        logger.info("compile cache %s is in use by another process; waiting for it", cache_dir)
        t0 = time.perf_counter()
        fcntl.flock(lock, fcntl.LOCK_EX)
        logger.info("compile cache free after %.1f s", time.perf_counter() - t0)
    _cache_lock = lock
    return True


def set_compile_cache(on: bool) -> None:
    """Whether the graphs compiled from now on go through the compile cache (read from it, written to it), when
    this process holds one: on only while a warmup entry runs (warmup.py), so that a graph a step compiles between
    entries takes no compile index (MindSpore counts only the compiles made with the cache on)."""
    os.environ["MS_COMPILER_CACHE_ENABLE"] = "1" if on and _cache_lock is not None else "0"


_dep_files = None       # MindSpore's own function, while quicken_compiles holds its answer


def quicken_compiles(on: bool) -> None:
    """Make each graph compile of a warmup cheaper, or (off) undo it. MindSpore's compile starts with a full
    gc.collect() and, with the cache on, re-parses the entry script and its imports to list the files the cache
    depends on: read from the cache, a SmolLM2 graph took 0.23 s, 0.055 s of it collecting and 0.024 s listing.
    On: the objects alive now (the model, MindSpore's modules) move out of the collector's reach (gc.freeze) and
    the list is made once. Off: both undone, the frozen objects collectable again."""
    import gc

    global _dep_files
    ms_api = sys.modules.get("mindspore.graph.api")     # (None: another MindSpore, or none yet: the collector's part)
    if on:
        gc.freeze()
        if ms_api is not None and _dep_files is None and hasattr(ms_api, "_get_compile_cache_dep_files"):
            _dep_files = ms_api._get_compile_cache_dep_files
            listed = functools.cache(_dep_files)    # (made at MindSpore's first call: it calls only with the cache on)
            ms_api._get_compile_cache_dep_files = lambda: list(listed())
    else:
        gc.unfreeze()
        if ms_api is not None and _dep_files is not None:
            ms_api._get_compile_cache_dep_files = _dep_files
            _dep_files = None


def close_compile_cache() -> None:
    """Graphs compiled from now on are neither loaded from nor written to the compile cache (MindSpore reads
    MS_COMPILER_CACHE_ENABLE at each compile): their order is not fixed, so their compile index names nothing.
    The cache directory's lock is released for the next process."""
    global _cache_lock
    os.environ["MS_COMPILER_CACHE_ENABLE"] = "0"
    if _cache_lock is not None:
        _cache_lock.close()         # (closing the file releases the lock)
        _cache_lock = None


class GraphCalls:
    """Calls a Cell's compiled graph directly once a call of the same input shapes has compiled it.

    `cell(*tensors)` runs a few hundred microseconds of Python per call before the graph starts (signature
    binding, argument checks, the argument key of the compile cache lookup); at a one-row decode step of a
    small model that is ~5% of the step (docs/benchmarks/JOURNAL.md). The first call of each (cell, input shapes
    and dtypes) goes through `cell(...)`, which compiles and records the graph's phase; later calls hand
    the tensors to MindSpore's graph executor under that phase, which is what `cell(...)` ends in. Only
    for cells whose inputs are all Tensors and whose graph depends on nothing but their shapes and dtypes
    (the runner's). MindSpore's executor is a private API (pinned to 2.10 in setup.py): if it is not
    there, every call goes through `cell(...)`."""

    def __init__(self):
        try:
            from mindspore.common.api import _cell_graph_executor
            self._executor = _cell_graph_executor._graph_executor
        except (ImportError, AttributeError) as e:      # another MindSpore: the public path only
            logger.info("direct graph calls unavailable (%s); graphs run through Cell.__call__", e)
            self._executor = None
        self._phases: dict = {}

    def __call__(self, cell, *tensors):
        if self._executor is None:
            return cell(*tensors)
        key = (id(cell),) + tuple((t.shape, t.dtype) for t in tensors)
        phase = self._phases.get(key)
        if phase is not None:
            return self._executor(tensors, phase)
        out = cell(*tensors)
        phase = getattr(cell, "current_phase", None)
        if isinstance(phase, str) and self._executor.has_compiled(phase):
            self._phases[key] = phase
        return out
