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
