from loraplex.platform.kv_cache_manager import KVCacheManager
from loraplex.platform.request import Request, SamplingParams


def req(rid, tokens, extra=()):
    return Request(rid, tokens, SamplingParams(max_tokens=8), extra_keys=extra)


def admit(kv, r):
    hits, n = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - n, hits) is not None
    kv.record_prefix_lookup(r.num_tokens, n)
    r.num_computed_tokens = r.num_tokens
    return n


def test_prefix_hit_is_capped_below_the_prompt_length():
    kv = KVCacheManager(16, block_size=4)
    a = req("a", list(range(8)))  # exactly 2 full blocks
    assert admit(kv, a) == 0
    b = req("b", list(range(8)))
    assert admit(kv, b) == 4  # 2 blocks cached, but the last token must be computed
    c = req("c", list(range(9)))
    assert admit(kv, c) == 8
    assert kv.block_ids(a)[:2] == kv.block_ids(c)[:2]
    assert [blk.ref_cnt for blk in kv.req_blocks["c#0"][:2]] == [3, 2]


def test_extra_keys_separate_otherwise_equal_prompts():
    kv = KVCacheManager(16, block_size=4)
    admit(kv, req("a", list(range(9)), ("adapter-1",)))
    assert admit(kv, req("b", list(range(9)), ("adapter-2",))) == 0
    assert admit(kv, req("c", list(range(9)), ("adapter-1",))) == 8


def test_allocation_failure_changes_nothing_and_free_returns_blocks():
    kv = KVCacheManager(4, block_size=4)
    a = req("a", list(range(12)))
    admit(kv, a)
    b = req("b", list(range(100, 108)))
    assert kv.allocate_slots(b, 8) is None
    assert kv.num_free_blocks == 1 and "b#0" not in kv.req_blocks
    kv.free(a)
    assert kv.num_free_blocks == 4


def test_cached_blocks_are_evicted_when_the_pool_runs_dry():
    kv = KVCacheManager(4, block_size=4)
    a = req("a", list(range(9)))
    admit(kv, a)
    kv.free(a)  # its two full blocks stay cached-free
    b = req("b", list(range(100, 116)))
    admit(kv, b)  # needs all 4 blocks: evicts the cache
    kv.free(b)
    assert admit(kv, req("c", list(range(9)))) == 0


def test_copy_on_write_for_a_shared_partial_block():
    kv = KVCacheManager(8, block_size=4)
    parent = req("p", list(range(6)))  # 1 full + 1 partial block
    admit(kv, parent)
    parent.output_token_ids.append(50)
    child = Request("p", parent.prompt_token_ids, parent.params, index=1)
    child.num_computed_tokens = 6
    child.output_token_ids.append(60)
    kv.fork(parent, child)
    assert kv.block_ids(parent) == kv.block_ids(child)
    kv.allocate_slots(child, 1)  # writes position 6, inside the shared partial block
    (src, dst), = kv.take_copies()
    assert src == kv.block_ids(parent)[1] and dst == kv.block_ids(child)[1] and src != dst
    assert kv.block_ids(parent)[0] == kv.block_ids(child)[0]  # full block still shared
    kv.allocate_slots(parent, 1)  # now the only owner: writes in place
    assert kv.take_copies() == []
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == 8


def test_hit_rate_counts_tokens():
    kv = KVCacheManager(16, block_size=4)
    admit(kv, req("a", list(range(9))))
    admit(kv, req("b", list(range(9))))
    assert kv.prefix_cache_hit_rate == 8 / 18


def test_token_slice_matches_the_full_list():
    r = req("a", [1, 2, 3, 4, 5])
    r.output_token_ids = [6, 7, 8]
    for begin in range(9):
        for end in range(begin, 9):
            assert r.token_slice(begin, end) == r.all_token_ids[begin:end]
