"""A model's files read into the page cache ahead of its load: the kernel asked (posix_fadvise WILLNEED, from a
thread) as soon as the agent knows what the load will read, so that a start on a file that is not in the page cache
(after a reboot, or when memory pressure took its pages) reads it from the disk at the disk's pace while the agent
sets up (its config, the GGUF cache, MindSpore's context: a second or two), instead of page by page as the layers
are built, each fault a wait. Where an earlier start kept the repacked panels (kernels/panel_store.py), those are
what the load reads, not the model file's matrices. Nothing is asked beyond half the memory available, where the
pages read ahead would push out one another. A file already cached costs nothing."""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import psutil

__all__ = ["read_ahead", "read_ahead_model", "weight_files"]

logger = logging.getLogger(__name__)

_SUFFIXES = (".gguf", ".safetensors", ".bin")


def weight_files(model_path: str, library=None, cache_dir=None) -> list:
    """What a load of `model_path` reads: the panels an earlier start kept for the layer kernel's `library` (its
    path; None: no layer kernel) in `cache_dir` when there are any, else the model file, or a directory's weight
    files (safetensors, GGUF, llama2.c)."""
    if library is not None:
        from ..kernels.panel_store import PanelStore

        kept = PanelStore.kept(model_path, str(library), Path(cache_dir))
        if kept:
            return kept
    path = Path(model_path)
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for p in path.iterdir() if p.is_file() and p.suffix in _SUFFIXES)
    return []


def read_ahead_model(model_path: str, layer_kernel: bool, keep_quantized: bool,
                     cache_dir: Path) -> threading.Thread:
    """`read_ahead` of what a load of `model_path` reads (`weight_files`, with this machine's layer kernel when
    `layer_kernel`: a CPU agent runs it, built for `kernel_types`), its library's path found on the thread too. The
    master asks as soon as a model is decided (startup.decide), before its agent imports MindSpore."""
    def find_and_read() -> None:
        from ..kernels import library_path
        from .loader import kernel_types

        library = (library_path("decoder_layer_cpu", types=kernel_types(model_path, keep_quantized))
                   if layer_kernel else None)
        _read(weight_files(model_path, library, cache_dir))
    thread = threading.Thread(target=find_and_read, name="read-ahead", daemon=True)
    thread.start()
    return thread


def read_ahead(files) -> threading.Thread:
    """Ask the kernel to read `files` into the page cache, on a thread (the call submits the reads itself, which
    for a large file takes a while)."""
    thread = threading.Thread(target=_read, args=(list(files),), name="read-ahead", daemon=True)
    thread.start()
    return thread


def _read(files) -> None:
    """posix_fadvise(WILLNEED) on each of `files`, unless together they are more than half the memory available."""
    files = [Path(f) for f in files]
    try:
        size = sum(f.stat().st_size for f in files)
    except OSError:
        return
    if size == 0 or size > psutil.virtual_memory().available // 2:
        return
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError as e:
            logger.debug("read-ahead of %s: %s", f, e)
        finally:
            os.close(fd)
