"""The paged KV cache's bookkeeping: which blocks are free, which blocks hold each request's tokens, and
(with prefix caching) which full blocks hold which token prefixes.

It never touches device memory: the agents own the cache; the master only hands out block ids, and the
step's block tables and slot mappings tell the agents where each token lives.

Every block of a pool (`BlockPool`) is in exactly one state:
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

The window pool (a model with sliding-window layers, `window` > 0 and `window_blocks` > 0): the sliding layers
keep their K/V in a second pool, and a request's `window_tables` entry holds, for each block index of its main
table, the window pool's block, or -1 once the window has left it: `release_window` frees the blocks whose every
token is older than what the request's next query sees (a query at position p sees keys p - window + 1 .. p), so
a long request holds a window's blocks there, not its length's. Every new token needs a window block too (its K/V
is written in the sliding layers before the window passes it), so allocation takes from both pools. With prefix
caching, a window block is cached under the identity of the main block at its index (that identity says the
whole prefix up to there), and a prefix matches only as far as the window pool still holds the blocks the
first query after it sees.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from typing import Callable, Optional


class Prefix(tuple):
    """match_prefix's answer: the main pool's cached blocks of a prefix, in order; `window`: the window pool's
    cached blocks of its last block indices (those the first query after it sees; () without a window pool)."""
    window: tuple = ()


class BlockPool:
    """One pool of blocks: the free list, reference counts, and the cached blocks (a key each, least recently used
    first in `evictable`)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free_block_ids: deque = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.evictable: OrderedDict = OrderedDict()   # cached blocks with no user, oldest first
        self.key_of: dict = {}                        # block id -> the key of its cached content
        self.block_of: dict = {}                      # key -> block id
        self.on_evict: Optional[Callable[[int], None]] = None   # told of a cached block handed out again

    @property
    def num_free(self) -> int:
        return len(self.free_block_ids) + len(self.evictable)

    def take(self) -> int:
        if self.free_block_ids:
            block = self.free_block_ids.popleft()
        else:   # evict the least recently used cached block
            block, _ = self.evictable.popitem(last=False)
            self.uncache(block)
        self.ref_counts[block] = 1
        return block

    def share(self, block: int) -> None:
        """One more user of a block in use or cached."""
        if self.ref_counts[block] == 0:
            del self.evictable[block]
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        """One user fewer; a block no one uses becomes cached (if it has a key) or free."""
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            if block in self.key_of:
                self.evictable[block] = None
            else:
                self.free_block_ids.append(block)

    def cache(self, block: int, key) -> None:
        self.block_of[key] = block
        self.key_of[block] = key

    def uncache(self, block: int) -> None:
        del self.block_of[self.key_of.pop(block)]
        if self.on_evict is not None:
            self.on_evict(block)

    def forget_cached(self) -> int:
        """Every cached block free, every cache entry gone; returns how many cached blocks were dropped."""
        dropped = len(self.evictable)
        self.free_block_ids.extend(self.evictable)
        self.evictable.clear()
        self.key_of.clear()
        self.block_of.clear()
        return dropped

    def check(self, tables) -> None:
        """Every block in exactly one state, reference counts equal to table membership (-1 entries: none)."""
        users = [0] * self.num_blocks
        for table in tables:
            for b in table:
                if b >= 0:
                    users[b] += 1
        assert users == self.ref_counts, "reference counts differ from the block tables"
        free, cached = set(self.free_block_ids), set(self.evictable)
        assert len(free) == len(self.free_block_ids), "a block is on the free list twice"
        assert not free & cached, "a block is both free and cached"
        in_use = {b for b in range(self.num_blocks) if users[b]}
        assert not in_use & (free | cached), "a block in use is also free or cached"
        assert len(free) + len(cached) + len(in_use) == self.num_blocks, "a block is lost"
        assert cached <= set(self.key_of), "an evictable block has no cache entry"
        assert all(self.block_of[k] == b for b, k in self.key_of.items())
        assert not free & set(self.key_of), "a free block still has a cache entry"


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 window: int = 0, window_blocks: int = 0):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.pool.on_evict = self._forget_identity
        self.block_tables: dict = {}   # req_id -> [block ids], in token order
        self._identity: dict = {}      # block id -> identity of its cached content
        self._identities = itertools.count(1)
        self._registered: dict = {}    # req_id -> (leading blocks of its table registered, identity of the last)
        # the window pool (None: off, the sliding layers read the main tables)
        self.window = window if window_blocks else 0
        self.window_pool = BlockPool(window_blocks) if self.window else None
        self.window_tables: dict = {}  # req_id -> [window block id, or -1 once released] per block index
        self._released: dict = {}      # req_id -> leading entries of its window table released

    # --- the main pool's state (tests read it) -------------------------------------------------------

    @property
    def ref_counts(self) -> list:
        return self.pool.ref_counts

    @property
    def evictable(self) -> OrderedDict:
        return self.pool.evictable

    @property
    def free_block_ids(self) -> deque:
        return self.pool.free_block_ids

    def is_cached(self, block: int) -> bool:
        """Whether a main-pool block holds a cached prefix block (then no request may write it)."""
        return block in self.pool.key_of

    # --- capacity ----------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_cached_blocks(self) -> int:
        """Blocks the prefix cache holds (in use or free to evict)."""
        return len(self.pool.key_of)

    @property
    def num_free_window_blocks(self) -> Optional[int]:
        return None if self.window_pool is None else self.window_pool.num_free

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_missing_blocks(self, req_id: str, num_tokens: int) -> int:
        """Blocks to add so that req_id's table covers num_tokens tokens."""
        have = len(self.block_tables.get(req_id, ()))
        return max(self.num_blocks_for(num_tokens) - have, 0)

    def can_allocate(self, req_id: str, num_tokens: int, prefix: tuple = (), reserve: int = 0) -> bool:
        """Whether req_id's table can grow to num_tokens tokens (adopting `prefix` blocks first) and
        leave `reserve` blocks free (of the main pool)."""
        missing = max(self.num_blocks_for(num_tokens) - len(self.block_tables.get(req_id, ())) - len(prefix), 0)
        if missing + self._adopted_cached(self.pool, prefix) + reserve > self.pool.num_free:
            return False
        if self.window_pool is None:
            return True
        window = getattr(prefix, "window", ())
        return missing + self._adopted_cached(self.window_pool, window) <= self.window_pool.num_free

    @staticmethod
    def _adopted_cached(pool: BlockPool, blocks) -> int:
        return sum(1 for b in blocks if pool.ref_counts[b] == 0)

    # --- allocation --------------------------------------------------------------------------------

    def allocate(self, req_id: str, num_tokens: int, prefix: tuple = ()) -> list:
        """Grow req_id's block table to cover num_tokens tokens; a new table first adopts the `prefix`
        blocks (from `match_prefix`). Returns the table; MemoryError if the blocks are not there."""
        if not self.can_allocate(req_id, num_tokens, prefix):
            raise MemoryError(f"{req_id} needs {self.num_missing_blocks(req_id, num_tokens)} more KV blocks, "
                              f"{self.num_free_blocks} free (window pool: {self.num_free_window_blocks})")
        table = self.block_tables.get(req_id)
        window_table = self.window_tables.get(req_id)
        if table is None:
            table = self.block_tables[req_id] = []
            for b in prefix:
                self.pool.share(b)
                table.append(b)
            if prefix:                   # (without one, cache_full_blocks starts the chain at the request's root)
                self._registered[req_id] = (len(prefix), self._identity[prefix[-1]])
            if self.window_pool is not None:
                window = getattr(prefix, "window", ())
                low = len(prefix) - len(window)
                window_table = self.window_tables[req_id] = [-1] * low
                for b in window:
                    self.window_pool.share(b)
                    window_table.append(b)
                self._released[req_id] = low
        elif prefix:
            raise ValueError(f"{req_id} already has blocks; a prefix can only start a table")
        for _ in range(self.num_missing_blocks(req_id, num_tokens)):
            table.append(self.pool.take())
            if window_table is not None:
                window_table.append(self.window_pool.take())
        return table

    def release_window(self, req_id: str, num_computed_tokens: int) -> int:
        """req_id's cache holds its first num_computed_tokens tokens: free its window-pool blocks whose every token
        is before the window of its next query (position num_computed_tokens); returns how many were freed."""
        table = self.window_tables.get(req_id)
        if table is None:
            return 0
        low = max(num_computed_tokens + 1 - self.window, 0) // self.block_size
        start = self._released[req_id]
        for i in range(start, min(low, len(table))):
            if table[i] >= 0:
                self.window_pool.release(table[i])
                table[i] = -1
        self._released[req_id] = max(start, min(low, len(table)))
        return max(self._released[req_id] - start, 0)

    def window_released(self, req_id: str) -> int:
        """How many leading entries of req_id's window table its window has left (released: -1)."""
        return self._released.get(req_id, 0)

    def free(self, req_id: str) -> int:
        """Drop req_id's references to its blocks; returns how many blocks it held. Cached blocks stay
        reusable (most recently used last) until their space is needed."""
        table = self.block_tables.pop(req_id, [])
        self._registered.pop(req_id, None)
        for b in reversed(table):     # a prefix's tail is evicted before its head
            self.pool.release(b)
        self._released.pop(req_id, None)
        for b in self.window_tables.pop(req_id, ()):   # (oldest first: a continuation needs the window's tail)
            if b >= 0:
                self.window_pool.release(b)
        return len(table)

    def forget_cached(self) -> int:
        """The cache's contents are gone (its agents restarted): every cached block becomes free and no prefix
        matches any more. Only blocks no request uses are cached, so tables in use are untouched. Returns how
        many cached blocks were dropped (of the main pool)."""
        dropped = self.pool.forget_cached()
        if self.window_pool is not None:
            self.window_pool.forget_cached()
        self._identity.clear()
        self._registered.clear()
        return dropped

    def slot(self, req_id: str, position: int) -> int:
        table = self.block_tables[req_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def window_slot(self, req_id: str, position: int) -> int:
        """The window pool's slot of req_id's token at `position` (its block must not have been released)."""
        return self.window_tables[req_id][position // self.block_size] * self.block_size + position % self.block_size

    # --- prefix caching ----------------------------------------------------------------------------

    def match_prefix(self, token_ids: list, root: int = 0) -> Prefix:
        """The cached blocks that hold the longest prefix of token_ids, stopping before the block that
        holds the last token (it must be computed to sample the next one). `root` starts the chain of block
        keys: requests whose KV differs for the same tokens (a LoRA adapter's) share blocks only among
        themselves (0: the base model; see cache_full_blocks). With a window pool, the prefix ends where the
        window blocks its next query sees are all still cached."""
        if not self.enable_prefix_caching:
            return Prefix()
        bs = self.block_size
        parent, blocks = -root if root else 0, []
        for i in range((len(token_ids) - 1) // bs):
            block = self.pool.block_of.get((parent, tuple(token_ids[i * bs:(i + 1) * bs])))
            if block is None:
                break
            blocks.append(block)
            parent = self._identity[block]
        if self.window_pool is None:
            return Prefix(blocks)
        # the longest m whose block indices low(m) .. m - 1 all have cached window blocks (a run of them ending at
        # m - 1 at least m - low(m) long)
        window = [self.window_pool.block_of.get(self._identity[b]) for b in blocks]
        run, best = 0, 0
        for i, b in enumerate(window):
            run = run + 1 if b is not None else 0
            m = i + 1
            if run >= m - max(m * bs + 1 - self.window, 0) // bs:
                best = m
        low = max(best * bs + 1 - self.window, 0) // bs
        prefix = Prefix(blocks[:best])
        prefix.window = tuple(window[low:best])
        return prefix

    def cache_full_blocks(self, req_id: str, tokens: Callable[[int, int], list], num_computed_tokens: int,
                          root: int = 0) -> None:
        """Register req_id's blocks that are now full of computed tokens, so later requests can share them;
        tokens(start, stop) gives the request's tokens (read only for blocks that just filled). `root` (>= 0):
        as match_prefix's; block identities are positive, so a root of -root never meets one. Its window blocks
        still held are registered under their index's identity."""
        if not self.enable_prefix_caching or req_id not in self.block_tables:
            return
        bs, table = self.block_size, self.block_tables[req_id]
        window_table = self.window_tables.get(req_id)
        done, parent = self._registered.get(req_id, (0, -root if root else 0))
        if num_computed_tokens // bs <= done:
            return
        pool = self.pool
        for i in range(done, num_computed_tokens // bs):
            block = table[i]
            key = (parent, tuple(tokens(i * bs, (i + 1) * bs)))
            existing = pool.block_of.get(key)
            if existing is None and block not in pool.key_of:
                pool.cache(block, key)
                self._identity[block] = next(self._identities)
                parent = self._identity[block]
            elif existing is not None:
                parent = self._identity[existing]   # same content computed twice: keep the first copy
            else:
                parent = self._identity[block]      # adopted from the cache (already registered)
            if window_table is not None:
                w = window_table[i]
                if w >= 0 and parent not in self.window_pool.block_of and w not in self.window_pool.key_of:
                    self.window_pool.cache(w, parent)
            done = i + 1
        self._registered[req_id] = (done, parent)

    def _forget_identity(self, block: int) -> None:
        del self._identity[block]

    # --- checks ------------------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Every block in exactly one state, reference counts equal to table membership (tests call this)."""
        self.pool.check(self.block_tables.values())
        if self.window_pool is not None:
            self.window_pool.check(self.window_tables.values())
            assert self.window_tables.keys() == self.block_tables.keys(), "a request holds one pool's blocks only"
            for req_id, table in self.window_tables.items():
                assert len(table) == len(self.block_tables[req_id]), "a window table's length differs from its table's"
                low = self._released[req_id]
                assert all(b < 0 for b in table[:low]) and all(b >= 0 for b in table[low:]), \
                    "a window table holds a block below its window or lacks one above"
