"""The repacked panels kept on disk: the only copy of a model's weights this server writes, in the layout the layer
kernel computes on (kernels/repack.py), so that the next start memory-maps them instead of repacking.

A GGUF's quantized matrices are memory-mapped where they lie in the file (weights/gguf.py's regions); repacking
them at load costs about a second per 1.5 GB on two cores. The first start on a file writes each matrix it
repacks into `<cache>/panels/<key>/<offset>.npy` (key: the file's path, size and modification time, and the
kernel library's build, whose layout the panels are; offset: where the matrix's stored bytes start in the file):

- repacked into memory as without a store (a file mapping's first writes cost twice the repack), then written by a
  thread after the load, each file flushed to disk before it is renamed into place (`finish`): a start never waits
  for the disk, and a file in place is whole;
- only rows that are the file's own bytes (a region: rows a reader reorders, such as a llama's q/k rows, are
  already a copy in the GGUF cache and are repacked at every start), so the start writes less than the file;
- only when the disk keeps at least max(5 GiB, 10% of it) free after the model's size: a user with a 17 GB model
  and 20 GB free serves it, repacking at every start.

`LLM_SERVING_PANEL_CACHE=0` turns the store off. Another build of the library, or a changed file, is another key;
opening a store removes the keys that no start reads again (of a file deleted, of an earlier version of the file,
of a library build no longer on disk) and the temporary files of processes that died writing them.
"""
from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np

__all__ = ["PANEL_CACHE_ENV", "PanelStore"]

logger = logging.getLogger(__name__)

PANEL_CACHE_ENV = "LLM_SERVING_PANEL_CACHE"
_FORMAT = 1
MIN_FREE_BYTES = 5 << 30          # the disk keeps at least this much free after a model's panels...
MIN_FREE_SHARE = 0.10             # ...and this share of its size


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class PanelStore:
    """One model file's panels on disk (see the module docstring). `panel(at, shape)`: the panels an earlier start
    kept of the rows at offset `at`; `keep(at, panels)`: keep these for the next (written by `finish`)."""

    def __init__(self, folder: Path, source: str, writes: bool):
        self.folder, self.source, self.writes = folder, source, writes
        self._pending: list = []            # (offset, panels) to write
        self.read = self.written = 0        # bytes of panels memory-mapped, and kept to be written

    @classmethod
    def open(cls, model_path: str, library: str, cache_dir: Path) -> Optional["PanelStore"]:
        """The store of the GGUF file `model_path` for the kernel library `library` (its path), or None: not a
        GGUF file, turned off, or no folder can be made in `cache_dir`."""
        if os.environ.get(PANEL_CACHE_ENV, "1") == "0" or not os.path.isfile(model_path):
            return None
        source = os.path.abspath(model_path)
        st = os.stat(source)
        folder = cls._folder(source, st, library, cache_dir)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            marker = folder / "source.json"
            if not marker.is_file():
                tmp = folder / f".source.{os.getpid()}.tmp"
                tmp.write_text(json.dumps({"source": source, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                                           "library": os.path.abspath(library)}))
                os.replace(tmp, marker)
        except OSError as e:
            logger.warning("repacked weights not kept on disk (%s): they are repacked at every start", e)
            return None
        _remove_stale(folder, source, st)
        free = shutil.disk_usage(folder)
        writes = free.free - st.st_size >= max(MIN_FREE_BYTES, MIN_FREE_SHARE * free.total)
        if not writes and not any(folder.glob("*.npy")):
            logger.info("repacked weights not kept on disk: %.1f GB free of %.1f GB, the model is %.1f GB (the disk "
                        "keeps max(%.0f GB, %.0f%%) free); they are repacked at every start", free.free / 1e9,
                        free.total / 1e9, st.st_size / 1e9, MIN_FREE_BYTES / 1e9, MIN_FREE_SHARE * 100)
        return cls(folder, source, writes)

    @staticmethod
    def _folder(source: str, st: os.stat_result, library: str, cache_dir: Path) -> Path:
        key = hashlib.sha1(repr((source, st.st_size, st.st_mtime_ns, os.path.basename(library),
                                 _FORMAT)).encode()).hexdigest()[:16]
        return cache_dir / "panels" / key

    @classmethod
    def kept(cls, model_path: str, library: str, cache_dir: Path) -> list:
        """The panel files an earlier start kept of `model_path` for `library` (what a load maps instead of
        repacking), without opening the store; [] if none."""
        if os.environ.get(PANEL_CACHE_ENV, "1") == "0" or not os.path.isfile(model_path):
            return []
        source = os.path.abspath(model_path)
        return sorted(cls._folder(source, os.stat(source), library, cache_dir).glob("*.npy"))

    def offset(self, rows: np.ndarray) -> Optional[int]:
        """Where `rows` start in the model file, when they are a whole memory map of its bytes (a region, or a
        reshaped view of the whole of one; not a part of one nor a copy); else None."""
        mapped = rows
        while isinstance(mapped, np.ndarray) and not isinstance(mapped.base, mmap.mmap):
            mapped = mapped.base                    # (a reshaped view: its memmap, whose offset is where it starts)
        if not isinstance(mapped, np.memmap) or mapped.filename is None or not rows.flags.c_contiguous:
            return None
        if mapped.ctypes.data != rows.ctypes.data or mapped.nbytes != rows.nbytes:
            return None                             # (a part of the map: its own offset is unknown)
        return int(mapped.offset) if os.path.abspath(mapped.filename) == self.source else None

    def panel(self, at: int, shape: tuple) -> Optional[np.ndarray]:
        """The panels kept for the rows at offset `at`, memory-mapped read-only, or None (none kept, or of another
        shape: a file that is not this store's would be another key)."""
        path = self.folder / f"{at}.npy"
        try:
            kept = np.load(path, mmap_mode="r")
        except (OSError, ValueError):
            return None
        if kept.shape != tuple(shape) or kept.dtype != np.uint8:
            return None
        self.read += kept.nbytes
        return kept

    def keep(self, at: int, panels: np.ndarray) -> None:
        """Keep `panels`, the repacked rows at offset `at`, for the next start: written by `finish` (a thread after
        the load: see `finish_later`), from the array itself, which the caller must not change. Nothing where this
        store does not write."""
        if self.writes:
            self._pending.append((at, panels))
            self.written += panels.nbytes

    def finish(self) -> None:
        """Write the panels kept this load, each to a temporary file that is flushed to disk and then renamed into
        place; a failure leaves temporary files the next start removes."""
        t0 = time.perf_counter()
        pending, self._pending = self._pending, []
        try:
            for at, panels in pending:
                tmp = self.folder / f".{at}.{os.getpid()}.{threading.get_ident()}.tmp"
                with open(tmp, "wb") as f:
                    np.save(f, panels)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.folder / f"{at}.npy")
        except OSError as e:
            logger.warning("repacked weights not kept on disk (%s)", e)
            return
        if pending:
            logger.info("repacked weights kept on disk for the next start: %.2f GB in %.1f s (%s)",
                        sum(panels.nbytes for _, panels in pending) / 1e9, time.perf_counter() - t0, self.folder)

    def finish_later(self) -> Optional[threading.Thread]:
        """`finish` on a daemon thread (None when nothing was written)."""
        if not self._pending:
            return None
        thread = threading.Thread(target=self.finish, name="panel-store", daemon=True)
        thread.start()
        return thread


def _remove_stale(folder: Path, source: str, st: os.stat_result) -> None:
    """Remove the keys that no start reads again: of a file no longer there, of an earlier version of `source`, of a
    library build no longer on disk (another build's, in use, stay); and the temporary files of processes no
    longer alive, in `folder`."""
    for other in folder.parent.iterdir():
        if other == folder or not (other / "source.json").is_file():
            continue
        try:
            said = json.loads((other / "source.json").read_text())
        except (OSError, ValueError):
            continue
        theirs = said.get("source", "")
        if theirs != source and os.path.exists(theirs):
            continue
        if theirs != source or (said.get("size"), said.get("mtime_ns")) != (st.st_size, st.st_mtime_ns) or \
                not os.path.exists(said.get("library", "")):
            shutil.rmtree(other, ignore_errors=True)
            logger.info("removed the repacked weights of an earlier file or library build: %s", other)
    for tmp in folder.glob(".*.tmp"):
        parts = tmp.name.split(".")
        pid = int(parts[2]) if len(parts) > 3 and parts[2].isdigit() else None
        if pid is not None and not _pid_alive(pid):
            tmp.unlink(missing_ok=True)
