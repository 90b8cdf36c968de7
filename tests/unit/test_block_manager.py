import pytest

from llm_serving.master.block_manager import BlockManager


def test_allocate_grows_tables_and_free_returns_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate("a", 5) == [0, 1]
    assert bm.num_free_blocks == 6
    assert bm.allocate("a", 8) == [0, 1]          # still covered
    assert bm.allocate("a", 9) == [0, 1, 2]
    assert bm.allocate("b", 1) == [3]
    assert bm.free("a") == 3
    assert bm.num_free_blocks == 7
    assert bm.free("a") == 0


def test_slot_follows_the_block_table():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("x", 1)
    bm.allocate("y", 1)
    bm.allocate("x", 6)                            # x = [0, 2]
    assert bm.block_tables["x"] == [0, 2]
    assert [bm.slot("x", p) for p in range(6)] == [0, 1, 2, 3, 8, 9]


def test_never_over_commits():
    bm = BlockManager(num_blocks=3, block_size=2)
    assert bm.can_allocate("a", 6)
    assert not bm.can_allocate("a", 7)
    with pytest.raises(MemoryError, match="needs 4 more"):
        bm.allocate("a", 7)
    assert bm.num_free_blocks == 3 and "a" not in bm.block_tables


def tokens_of(seq):
    return lambda start, stop: seq[start:stop]


def test_prefix_match_is_exact_chained_and_block_aligned():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    seq = [5, 6, 7, 8, 9]
    bm.allocate("a", 5)
    bm.cache_full_blocks("a", tokens_of(seq), 5)       # blocks [5,6] and [7,8] are full
    a = bm.block_tables["a"]
    assert bm.match_prefix([5, 6, 7, 8, 1]) == (a[0], a[1])
    assert bm.match_prefix([5, 6, 7, 8]) == (a[0],)    # the last token's block is never matched
    assert bm.match_prefix([5, 6, 0, 8, 1]) == (a[0],)
    assert bm.match_prefix([7, 8, 5, 6, 1]) == ()      # same block content after another parent: no hit
    bm.check_invariants()


def test_adopting_a_prefix_counts_references_and_cached_blocks_count_as_free():
    bm = BlockManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    seq = [1, 2, 3, 4, 5]
    bm.allocate("a", 5)
    bm.cache_full_blocks("a", tokens_of(seq), 5)
    prefix = bm.match_prefix(seq)
    assert bm.can_allocate("b", 5, prefix) and not bm.can_allocate("b", 5, prefix, reserve=3)
    bm.allocate("b", 5, prefix)
    assert [bm.ref_counts[b] for b in prefix] == [2, 2]
    assert bm.block_tables["b"][:2] == list(prefix) and bm.num_free_blocks == 2
    bm.free("a")
    bm.free("b")
    bm.check_invariants()
    assert bm.num_free_blocks == 6 and set(prefix) <= set(bm.evictable)
    # adopting evictable blocks takes them out of the free count
    assert bm.can_allocate("c", 12, bm.match_prefix(seq)) and not bm.can_allocate("c", 13, bm.match_prefix(seq))


def test_forgetting_the_cache_frees_cached_blocks_and_keeps_tables_in_use():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    old, live = [1, 2, 3, 4, 5], [7, 7, 8, 8, 9]
    for req, seq in (("old", old), ("live", live)):
        bm.allocate(req, 5)
        bm.cache_full_blocks(req, tokens_of(seq), 5)
    bm.free("old")
    live_table = list(bm.block_tables["live"])
    assert len(bm.evictable) == 2 and bm.match_prefix(old) and bm.match_prefix(live)
    assert bm.forget_cached() == 2                  # the agents restarted: no KV content survives
    bm.check_invariants()
    assert not bm.evictable and bm.match_prefix(old) == () and bm.match_prefix(live) == ()
    assert bm.block_tables["live"] == live_table and len(bm.free_block_ids) == 5
    # the live request registers its blocks again as it goes on, and freeing it caches nothing stale
    bm.cache_full_blocks("live", tokens_of(live), 5)
    assert bm.match_prefix(live) == tuple(live_table[:2])
    bm.free("live")
    bm.check_invariants()
    assert bm.num_free_blocks == 8


def test_without_prefix_caching_nothing_is_cached():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 4)
    bm.cache_full_blocks("a", tokens_of([1, 2, 3, 4]), 4)
    bm.free("a")
    assert bm.match_prefix([1, 2, 3, 4, 5]) == () and not bm.evictable and bm.num_free_blocks == 4


def test_invariant_check_catches_a_lost_block_and_a_wrong_reference_count():
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 3)
    bm.check_invariants()
    bm.ref_counts[bm.block_tables["a"][0]] = 2
    with pytest.raises(AssertionError, match="reference counts"):
        bm.check_invariants()
    bm.ref_counts[bm.block_tables["a"][0]] = 1
    bm.free_block_ids.pop()
    with pytest.raises(AssertionError, match="lost"):
        bm.check_invariants()


def test_prefixes_are_shared_only_under_the_same_root():
    """A LoRA adapter's KV differs from the base model's for the same tokens: a request's root (its adapter
    slot) starts its chain of block keys, so blocks are shared among requests of one root only."""
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    tokens = list(range(1, 14))                                  # 3 full blocks + 1 token
    for req, root in (("base", 0), ("lora2", 2)):
        bm.allocate(req, len(tokens), bm.match_prefix(tokens, root))
        bm.cache_full_blocks(req, lambda a, b: tokens[a:b], len(tokens), root)
    assert len(bm.match_prefix(tokens, 0)) == 3 and len(bm.match_prefix(tokens, 2)) == 3
    assert set(bm.match_prefix(tokens, 0)).isdisjoint(bm.match_prefix(tokens, 2))
    assert bm.match_prefix(tokens, 0) == tuple(bm.block_tables["base"][:3])
    assert bm.match_prefix(tokens, 2) == tuple(bm.block_tables["lora2"][:3])
    assert bm.match_prefix(tokens, 1) == ()                       # another adapter: nothing cached yet
    assert bm.num_cached_blocks == 6
    bm.check_invariants()


# --- the window pool (sliding-window layers) ------------------------------------------------------------

def test_a_window_pool_holds_only_the_blocks_the_next_query_sees():
    bm = BlockManager(num_blocks=16, block_size=4, window=6, window_blocks=8)
    assert bm.allocate("a", 10) == [0, 1, 2] and bm.window_tables["a"] == [0, 1, 2]
    assert bm.num_free_window_blocks == 5
    # 10 tokens computed: the query at position 10 sees keys 5..10, so block 0 (keys 0-3) goes, block 1 stays
    assert bm.release_window("a", 10) == 1
    assert bm.window_tables["a"] == [-1, 1, 2] and bm.num_free_window_blocks == 6
    assert bm.release_window("a", 10) == 0                     # nothing more until the window moves on
    bm.allocate("a", 14)                                       # a new block in both pools, at the same index
    assert bm.block_tables["a"] == [0, 1, 2, 3] and bm.window_tables["a"][3] >= 0
    assert bm.window_slot("a", 13) == bm.window_tables["a"][3] * 4 + 1 and bm.slot("a", 13) == 3 * 4 + 1
    assert bm.release_window("a", 13) == 1                     # query 13 sees 8..13: block 1 goes
    assert bm.window_tables["a"][:2] == [-1, -1]
    bm.check_invariants()
    assert bm.free("a") == 4
    assert bm.num_free_blocks == 16 and bm.num_free_window_blocks == 8
    bm.check_invariants()


def test_every_new_token_needs_a_window_block_so_the_smaller_pool_bounds_a_step():
    bm = BlockManager(num_blocks=16, block_size=4, window=4, window_blocks=3)
    assert bm.can_allocate("a", 12) and not bm.can_allocate("a", 13)       # 4 main blocks free but 3 window
    with pytest.raises(MemoryError, match="window pool: 3"):
        bm.allocate("a", 13)
    bm.allocate("a", 12)
    bm.release_window("a", 12)                 # the query at 12 sees 9..12: blocks 0 and 1 go
    assert bm.can_allocate("a", 20) and bm.num_free_window_blocks == 2
    bm.check_invariants()


def test_a_prefix_matches_only_as_far_as_its_window_blocks_are_still_cached():
    bm = BlockManager(num_blocks=16, block_size=2, enable_prefix_caching=True, window=3, window_blocks=16)
    seq = list(range(10, 20))                                  # 10 tokens, 5 blocks
    bm.allocate("a", 10)
    bm.cache_full_blocks("a", tokens_of(seq), 10)              # main and window blocks registered
    window_a = list(bm.window_tables["a"])
    assert bm.release_window("a", 10) == 4                     # the query at 10 sees 8..10: blocks 0-3 go
    bm.free("a")                                               # (released blocks stay cached)
    seq_b = seq[:8] + [1, 2, 3]                                # shares 4 blocks with seq
    # 4 blocks match, and the first query after them (position 8, keys 6..8) sees index 3's window block only
    prefix = bm.match_prefix(seq_b)
    assert len(prefix) == 4 and prefix.window == (window_a[3],)
    bm.allocate("b", len(seq_b), prefix)
    assert bm.window_tables["b"][:4] == [-1, -1, -1, window_a[3]]
    assert bm.window_pool.ref_counts[window_a[3]] == 1
    bm.check_invariants()
    bm.free("b")
    # index 3's window block evicted (made the least recently used, then every free block and one cached taken):
    # the prefix ends where the window blocks its query sees are still there, 3 blocks (query 6 sees 4..6: index 2)
    bm.window_pool.evictable.move_to_end(window_a[3], last=False)
    bm.allocate("c", 2 * 12)
    assert window_a[3] in bm.window_tables["c"]
    prefix = bm.match_prefix(seq_b)
    assert len(prefix) == 3 and prefix.window == (window_a[2],)
    bm.check_invariants()
