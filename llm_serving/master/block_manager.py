"""The paged KV cache's bookkeeping: which blocks are free and which blocks hold each request's tokens.

It never touches device memory: the agents own the cache; the master only hands out block ids, and the
step's block tables and slot mappings tell the agents where each token lives.
"""
from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_block_ids: deque = deque(range(num_blocks))
        self.block_tables: dict = {}   # req_id -> [block ids], in token order

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_missing_blocks(self, req_id: str, num_tokens: int) -> int:
        """Blocks to add so that req_id's table covers num_tokens tokens."""
        have = len(self.block_tables.get(req_id, ()))
        return max(self.num_blocks_for(num_tokens) - have, 0)

    def can_allocate(self, req_id: str, num_tokens: int) -> bool:
        return self.num_missing_blocks(req_id, num_tokens) <= self.num_free_blocks

    def allocate(self, req_id: str, num_tokens: int) -> list:
        """Grow req_id's block table to cover num_tokens tokens; returns the table."""
        missing = self.num_missing_blocks(req_id, num_tokens)
        if missing > self.num_free_blocks:
            raise MemoryError(f"{req_id} needs {missing} more KV blocks, {self.num_free_blocks} free")
        table = self.block_tables.setdefault(req_id, [])
        for _ in range(missing):
            table.append(self.free_block_ids.popleft())
        return table

    def free(self, req_id: str) -> int:
        """Return all of req_id's blocks to the free list; returns how many."""
        table = self.block_tables.pop(req_id, [])
        self.free_block_ids.extend(table)
        return len(table)

    def slot(self, req_id: str, position: int) -> int:
        table = self.block_tables[req_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size
