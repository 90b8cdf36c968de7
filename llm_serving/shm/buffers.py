"""Create, attach and unlink the POSIX shared-memory segments of a StepLayout.

The master creates one segment per array with a random name (mode 0600, Python's default for
shm_open) and passes the names to agents in the connect command; agents attach by name. Only the
creator unlinks, and only the creator is registered with Python's resource tracker, which is what cleans up
after a master killed with SIGKILL. Agents attach with `AttachedSegment`, not `SharedMemory`: in Python 3.11
SharedMemory registers an attaching process too (its tracker would unlink the master's segments when the agent
exits), and its first registration starts a tracker process (~7 MiB) that the agent does not need.

Segment names are `llmsrv_[<LLM_SERVING_SHM_TAG>_]p<pid>n<pid namespace>_<random>_<array>`: the optional tag
(letters and digits, at most 16) tells apart the segments of several deployments (or test runs) on one host, and
the pid is the creating master's (in its pid namespace, the inode of /proc/self/ns/pid: containers that share
/dev/shm may not see each other's processes), so that a later start can find the segments of a master that died
with its resource tracker (shm/sweep.py).
"""
from __future__ import annotations

import mmap
import os
import re
import secrets
from multiprocessing import shared_memory

import numpy as np

from llm_serving.shm.layout import ARRAYS, StepKind, StepLayout, StepView

def segment_tag() -> str:
    """This process's LLM_SERVING_SHM_TAG as its segment names carry it ("" for none)."""
    return re.sub(r"[^A-Za-z0-9]", "", os.environ.get("LLM_SERVING_SHM_TAG", ""))[:16]


def segment_prefix() -> str:
    """The prefix of this process's segment names (see the module docstring)."""
    tag = segment_tag()
    return f"llmsrv_{tag}_" if tag else "llmsrv_"


SEGMENT_PREFIX = segment_prefix()
# a name segment_stem made: its owner's pid and pid namespace, then 12 hex digits (a tag never ends the same way)
_OWNED_NAME = re.compile(r"llmsrv_(?:([A-Za-z0-9]{1,16})_)?p([0-9]+)n([0-9]+)_[0-9a-f]{12}_")


def pid_namespace() -> int:
    """The inode of this process's pid namespace (0 where /proc does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def segment_stem() -> str:
    """The start of a new set of segments' names: the prefix, this process's pid and a random part."""
    return f"{SEGMENT_PREFIX}p{os.getpid()}n{pid_namespace()}_{secrets.token_hex(6)}"


def segment_owner(name: str, tag: str | None = None) -> tuple | None:
    """(pid, pid namespace) of the process that created the segment `name` (segment_stem's), or None for
    another naming; with `tag`, None too for a name of another tag ("": untagged)."""
    match = _OWNED_NAME.match(name)
    if match is None or (tag is not None and (match.group(1) or "") != tag):
        return None
    return int(match.group(2)), int(match.group(3))


class AttachedSegment:
    """A segment another process created (and unlinks), mapped read-write: the attaching side of
    `shared_memory.SharedMemory`, without its resource-tracker registration (see the module docstring)."""

    def __init__(self, name: str):
        from _posixshmem import shm_open       # (what SharedMemory opens segments with on POSIX)

        fd = shm_open("/" + name.lstrip("/"), os.O_RDWR, mode=0o600)
        try:
            self.size = os.fstat(fd).st_size
            self._mmap = mmap.mmap(fd, self.size)
        finally:
            os.close(fd)
        self.name = name
        self.buf = memoryview(self._mmap)

    def close(self) -> None:
        """Unmap (BufferError while a view of it is alive, as SharedMemory.close)."""
        if self.buf is not None:
            self.buf.release()
            self.buf = None
        self._mmap.close()


class StepBuffers:
    """numpy views (attribute per array name) over the shared segments of one layout."""

    def __init__(self, layout: StepLayout, segments: dict, owner: bool):
        self.layout = layout
        self.owner = owner
        self._segments = segments
        self.arrays = {}
        self._plans: dict = {}          # view's, per step kind
        for spec in layout.arrays():
            seg = segments.get(spec.name)
            self.arrays[spec.name] = (np.ndarray(spec.shape, dtype=spec.dtype, buffer=seg.buf) if seg is not None
                                      else np.zeros(spec.shape, spec.dtype))
        self.__dict__.update(self.arrays)

    @property
    def names(self) -> dict:
        """{array name: segment name}, sent to agents in the connect command."""
        return {name: seg.name for name, seg in self._segments.items()}

    @classmethod
    def create(cls, layout: StepLayout) -> "StepBuffers":
        stem = segment_stem()
        segments = {}
        try:
            for spec in layout.arrays():
                segments[spec.name] = shared_memory.SharedMemory(
                    name=f"{stem}_{spec.name}", create=True, size=max(spec.nbytes, 1))
        except BaseException:
            for seg in segments.values():
                seg.close()
                seg.unlink()
            raise
        buffers = cls(layout, segments, owner=True)
        for arr in buffers.arrays.values():
            arr.fill(0)
        return buffers

    @classmethod
    def private(cls, layout: StepLayout) -> "StepBuffers":
        """The same arrays in this process's own memory (no segment): a tensor-parallel rank on another node
        than the master fills them from rank 0's broadcast (pack_inputs / unpack_inputs)."""
        return cls(layout, {}, owner=False)

    @property
    def shared(self) -> bool:
        return bool(self._segments)

    def view(self, kind: StepKind, n: int, s: int, steps: int = 1, return_logits: bool = False) -> StepView:
        """A step's arrays by name, as views of its part of the buffers (layout.py's shape classes: `part`,
        `in_step`): what the worker hands ModelRunner.execute and writes the outputs into."""
        kind = StepKind(kind)
        plan = self._plans.get(kind)
        if plan is None:                # per kind: (name, array, whether its part has a token width)
            plan = self._plans[kind] = [(a.name, self.arrays[a.name], len(self.layout.part(a, 1, 1)) == 2)
                                        for a in ARRAYS if self.layout.in_step(a, kind)]
        width = max(s, steps)
        return StepView(kind, return_logits=return_logits,
                        **{name: arr[:n, :width] if wide else arr[:n] for name, arr, wide in plan})

    def pack_inputs(self, kind: StepKind, n: int, s: int, steps: int = 1) -> np.ndarray:
        """The step's inputs (layout.step_inputs) as one int32 array of layout.step_inputs_size words."""
        parts = [self.arrays[name][index].view(np.int32).reshape(-1)
                 for name, index in self.layout.step_inputs(kind, n, s, steps)]
        return np.concatenate(parts)

    def unpack_inputs(self, words: np.ndarray, kind: StepKind, n: int, s: int, steps: int = 1) -> None:
        """Write pack_inputs's words (at least step_inputs_size of them) back into the same places."""
        at = 0
        for name, index in self.layout.step_inputs(kind, n, s, steps):
            target = self.arrays[name][index]
            size = target.size
            target[...] = words[at:at + size].view(target.dtype).reshape(target.shape)
            at += size

    @classmethod
    def attach(cls, layout: StepLayout, names: dict) -> "StepBuffers":
        missing = [spec.name for spec in layout.arrays() if spec.name not in names]
        if missing:
            raise ValueError(f"connect is missing shared-memory names for: {', '.join(missing)}")
        segments = {}
        try:
            for spec in layout.arrays():
                seg = AttachedSegment(names[spec.name])
                segments[spec.name] = seg
                if seg.size < spec.nbytes:
                    raise ValueError(f"segment for {spec.name} has {seg.size} bytes, layout needs {spec.nbytes}")
        except BaseException:
            for seg in segments.values():
                seg.close()
            raise
        return cls(layout, segments, owner=False)

    def close(self) -> None:
        """Drop the views, close the mappings and, in the creating process, unlink the segments."""
        self.arrays.clear()
        self._plans.clear()
        for spec in self.layout.arrays():
            self.__dict__.pop(spec.name, None)
        for seg in self._segments.values():
            try:
                seg.close()
            except BufferError:
                pass  # a view is still alive somewhere; the mapping goes with the process
            if self.owner:
                try:
                    seg.unlink()
                except FileNotFoundError:
                    pass
        self._segments = {}
