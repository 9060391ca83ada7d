import pytest

from loraplex.platform.core.block_pool import BlockPool, FreeBlockQueue, Block, hash_block


def test_free_queue_removes_from_the_middle_and_keeps_order():
    blocks = [Block(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4]
    assert q.popleft().block_id == 0
    q.append(blocks[2])
    assert [b.block_id for b in q] == [1, 3, 4, 2] and len(q) == 4
    with pytest.raises(RuntimeError):
        q.remove(Block(9))


def test_ref_counts_and_double_free():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    assert (a.ref_cnt, b.ref_cnt, pool.num_free_blocks, pool.usage) == (1, 1, 2, 0.5)
    pool.touch([a])
    pool.free_blocks([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.free_blocks([a, b])
    assert pool.num_free_blocks == 4
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([a])
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(5)


def test_cached_free_block_is_revived_then_evicted_lru_first():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    hashes = [hash_block(None, (i,)) for i in range(3)]
    for blk, h in zip(blocks, hashes):
        pool.cache_block(blk, h)
    pool.free_blocks(blocks)  # free order 0, 1, 2: 0 is evicted first
    assert pool.num_free_blocks == 3 and pool.get_cached_block(hashes[0]) is blocks[0]
    pool.touch([blocks[1]])  # a hit revives block 1 out of the free list
    assert pool.num_free_blocks == 2 and blocks[1].ref_cnt == 1
    (fresh,) = pool.get_new_blocks(1)
    assert fresh is blocks[0] and pool.get_cached_block(hashes[0]) is None and fresh.block_hash is None
    assert pool.get_cached_block(hashes[2]) is blocks[2]


def test_hash_depends_on_parent_tokens_and_extra_keys():
    h = hash_block(None, (1, 2))
    assert h == hash_block(None, (1, 2))
    assert h != hash_block(None, (1, 3))
    assert h != hash_block(None, (1, 2), ("adapter-hash",))
    assert hash_block(h, (5,)) != hash_block(hash_block(None, (9, 9)), (5,))


def test_caching_disabled_never_hits():
    pool = BlockPool(2, enable_caching=False)
    (blk,) = pool.get_new_blocks(1)
    pool.cache_block(blk, b"x")
    assert pool.get_cached_block(b"x") is None
