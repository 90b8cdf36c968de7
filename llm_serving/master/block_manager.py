"""The paged KV cache's bookkeeping: which blocks are free, which blocks hold each request's tokens, and
(with prefix caching) which full blocks hold which token prefixes.

It never touches device memory: the agents own the cache; the master only hands out block ids, and the
step's block tables and slot mappings tell the agents where each token lives.

Every block is in exactly one state:
- free: on `free_block_ids`, holds nothing useful;
- in use: in one or more requests' block tables, `ref_counts[b]` = how many;
- cached: no request uses it but it holds a full block of a known prefix (prefix caching); it sits in
  `evictable` in least-recently-used order and is handed out again (its cache entry dropped) only when
  no free block is left. `num_free_blocks` counts free + cached blocks: both can be allocated.

Prefix caching: a full block is identified by (identity of the block before it, its tokens), so a hit
means the whole prefix up to and including that block is the same; identities are integers handed out
when a block is first cached, so keys stay small and lookups are exact (no hash collisions possible).
A request adopting cached blocks shares them by reference count and only computes what follows; the
block that holds a request's last prompt token is never taken from the cache, so shared blocks are
never written.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from typing import Callable


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.free_block_ids: deque = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.block_tables: dict = {}   # req_id -> [block ids], in token order
        self.evictable: OrderedDict = OrderedDict()   # cached blocks with no user, oldest first
        self._key_of: dict = {}        # block id -> (parent identity, tokens) of a cached block
        self._block_of: dict = {}      # (parent identity, tokens) -> block id
        self._identity: dict = {}      # block id -> identity of its cached content
        self._identities = itertools.count(1)
        self._registered: dict = {}    # req_id -> (leading blocks of its table registered, identity of the last)

    # --- capacity ----------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids) + len(self.evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks the prefix cache holds (in use or free to evict)."""
        return len(self._key_of)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_missing_blocks(self, req_id: str, num_tokens: int) -> int:
        """Blocks to add so that req_id's table covers num_tokens tokens."""
        have = len(self.block_tables.get(req_id, ()))
        return max(self.num_blocks_for(num_tokens) - have, 0)

    def can_allocate(self, req_id: str, num_tokens: int, prefix: tuple = (), reserve: int = 0) -> bool:
        """Whether req_id's table can grow to num_tokens tokens (adopting `prefix` blocks first) and
        leave `reserve` blocks free."""
        adopted_cached = sum(1 for b in prefix if self.ref_counts[b] == 0)
        missing = max(self.num_blocks_for(num_tokens) - len(self.block_tables.get(req_id, ())) - len(prefix), 0)
        return missing + adopted_cached + reserve <= self.num_free_blocks

    # --- allocation --------------------------------------------------------------------------------

    def _take(self) -> int:
        if self.free_block_ids:
            block = self.free_block_ids.popleft()
        else:   # evict the least recently used cached block
            block, _ = self.evictable.popitem(last=False)
            self._uncache(block)
        self.ref_counts[block] = 1
        return block

    def allocate(self, req_id: str, num_tokens: int, prefix: tuple = ()) -> list:
        """Grow req_id's block table to cover num_tokens tokens; a new table first adopts the `prefix`
        blocks (from `match_prefix`). Returns the table; MemoryError if the blocks are not there."""
        if not self.can_allocate(req_id, num_tokens, prefix):
            raise MemoryError(f"{req_id} needs {self.num_missing_blocks(req_id, num_tokens)} more KV blocks, "
                              f"{self.num_free_blocks} free")
        table = self.block_tables.get(req_id)
        if table is None:
            table = self.block_tables[req_id] = []
            for b in prefix:
                if self.ref_counts[b] == 0:
                    del self.evictable[b]
                self.ref_counts[b] += 1
                table.append(b)
            if prefix:                   # (without one, cache_full_blocks starts the chain at the request's root)
                self._registered[req_id] = (len(prefix), self._identity[prefix[-1]])
        elif prefix:
            raise ValueError(f"{req_id} already has blocks; a prefix can only start a table")
        for _ in range(self.num_missing_blocks(req_id, num_tokens)):
            table.append(self._take())
        return table

    def free(self, req_id: str) -> int:
        """Drop req_id's references to its blocks; returns how many blocks it held. Cached blocks stay
        reusable (most recently used last) until their space is needed."""
        table = self.block_tables.pop(req_id, [])
        self._registered.pop(req_id, None)
        for b in reversed(table):     # a prefix's tail is evicted before its head
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if b in self._key_of:
                    self.evictable[b] = None
                else:
                    self.free_block_ids.append(b)
        return len(table)

    def forget_cached(self) -> int:
        """The cache's contents are gone (its agents restarted): every cached block becomes free and no prefix
        matches any more. Only blocks no request uses are cached, so tables in use are untouched. Returns how
        many cached blocks were dropped."""
        dropped = len(self.evictable)
        for b in self.evictable:
            self.free_block_ids.append(b)
        self.evictable.clear()
        self._key_of.clear()
        self._block_of.clear()
        self._identity.clear()
        self._registered.clear()
        return dropped

    def slot(self, req_id: str, position: int) -> int:
        table = self.block_tables[req_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size

    # --- prefix caching ----------------------------------------------------------------------------

    def match_prefix(self, token_ids: list, root: int = 0) -> tuple:
        """The cached blocks that hold the longest prefix of token_ids, stopping before the block that
        holds the last token (it must be computed to sample the next one). `root` starts the chain of block
        keys: requests whose KV differs for the same tokens (a LoRA adapter's) share blocks only among
        themselves (0: the base model; see cache_full_blocks)."""
        if not self.enable_prefix_caching:
            return ()
        bs = self.block_size
        parent, blocks = -root if root else 0, []
        for i in range((len(token_ids) - 1) // bs):
            block = self._block_of.get((parent, tuple(token_ids[i * bs:(i + 1) * bs])))
            if block is None:
                break
            blocks.append(block)
            parent = self._identity[block]
        return tuple(blocks)

    def cache_full_blocks(self, req_id: str, tokens: Callable[[int, int], list], num_computed_tokens: int,
                          root: int = 0) -> None:
        """Register req_id's blocks that are now full of computed tokens, so later requests can share them;
        tokens(start, stop) gives the request's tokens (read only for blocks that just filled). `root` (>= 0):
        as match_prefix's; block identities are positive, so a root of -root never meets one."""
        if not self.enable_prefix_caching or req_id not in self.block_tables:
            return
        bs, table = self.block_size, self.block_tables[req_id]
        done, parent = self._registered.get(req_id, (0, -root if root else 0))
        if num_computed_tokens // bs <= done:
            return
        for i in range(done, num_computed_tokens // bs):
            block = table[i]
            key = (parent, tuple(tokens(i * bs, (i + 1) * bs)))
            existing = self._block_of.get(key)
            if existing is None and block not in self._key_of:
                self._block_of[key] = block
                self._key_of[block] = key
                self._identity[block] = next(self._identities)
                parent = self._identity[block]
            elif existing is not None:
                parent = self._identity[existing]   # same content computed twice: keep the first copy
            else:
                parent = self._identity[block]      # adopted from the cache (already registered)
            done = i + 1
        self._registered[req_id] = (done, parent)

    def _uncache(self, block: int) -> None:
        key = self._key_of.pop(block)
        del self._block_of[key]
        del self._identity[block]

    # --- checks ------------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Every block in exactly one state, reference counts equal to table membership (tests call this)."""
        users = [0] * self.num_blocks
        for table in self.block_tables.values():
            for b in table:
                users[b] += 1
        assert users == self.ref_counts, "reference counts differ from the block tables"
        free, cached = set(self.free_block_ids), set(self.evictable)
        assert len(free) == len(self.free_block_ids), "a block is on the free list twice"
        assert not free & cached, "a block is both free and cached"
        in_use = {b for b in range(self.num_blocks) if users[b]}
        assert not in_use & (free | cached), "a block in use is also free or cached"
        assert len(free) + len(cached) + len(in_use) == self.num_blocks, "a block is lost"
        assert cached <= set(self._key_of), "an evictable block has no cache entry"
        assert all(self._block_of[k] == b for b, k in self._key_of.items())
        assert not free & set(self._key_of), "a free block still has a cache entry"

