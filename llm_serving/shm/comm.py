"""The shared-memory segment a CPU tensor-parallel group all-reduces through.

One segment per group, created by the master before it spawns the agents (its name travels in each agent's
start-up spec, since the agents all-reduce during warmup, before they connect) and unlinked by the master
when the group stops; a restarted group gets a fresh one, so its counters start at zero. In each agent the
all-reduce kernel maps it by name and checks the header (models/kernels/shm_allreduce_cpu.cc, which
documents the protocol). Layout, in 64-byte lines:

    line 0        magic "LLMSTP01" (uint64), world (uint64), slot bytes (uint64)
    line 1 + r    the last call rank r has published (uint64)
    data          2 parities x world slots of `slot_bytes` each

Node-local by nature: on Ascend the group all-reduces through HCCL instead, and no segment exists.
"""
from __future__ import annotations

import struct
from multiprocessing import shared_memory

from llm_serving.shm.buffers import segment_stem

MAGIC = 0x31305054534d4c4c          # b"LLMSTP01" read as a little-endian uint64
LINE = 64
DEFAULT_SLOT_BYTES = 1 << 20        # a bigger tensor is reduced in 1 MiB pieces


def segment_bytes(world: int, slot_bytes: int = DEFAULT_SLOT_BYTES) -> int:
    return LINE * (1 + world) + 2 * world * slot_bytes


class CommSegment:
    """A tensor-parallel group's all-reduce segment, created and unlinked by the master."""

    def __init__(self, shm: shared_memory.SharedMemory, world: int, owner: bool):
        self.shm = shm
        self.world = world
        self.owner = owner

    @property
    def name(self) -> str:
        return self.shm.name

    @classmethod
    def create(cls, world: int, slot_bytes: int = DEFAULT_SLOT_BYTES) -> "CommSegment":
        if world < 2:
            raise ValueError(f"a tensor-parallel segment needs at least 2 ranks, got {world}")
        if slot_bytes < LINE or slot_bytes % LINE:
            raise ValueError(f"slot_bytes must be a positive multiple of {LINE}, got {slot_bytes}")
        shm = shared_memory.SharedMemory(name=f"{segment_stem()}_tp", create=True,
                                         size=segment_bytes(world, slot_bytes))
        shm.buf[:LINE * (1 + world)] = bytes(LINE * (1 + world))     # counters start at zero
        struct.pack_into("<QQQ", shm.buf, 0, MAGIC, world, slot_bytes)
        return cls(shm, world, owner=True)

    def close(self) -> None:
        """Unmap and, in the creating process, unlink."""
        try:
            self.shm.close()
        except BufferError:
            pass
        if self.owner:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass
