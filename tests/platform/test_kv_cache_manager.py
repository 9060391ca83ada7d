from collections import Counter

from hypothesis.stateful import invariant

from loraplex.platform.core.block_pool import NULL_BLOCK, live
from loraplex.platform.core.kv_cache_manager import KVCacheManager, reclaim_window
from loraplex.platform.request import Request, SamplingParams
from test_kv_properties import BLOCK, KVMachine


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


def decode(kv, r, steps, token=7):
    """`steps` decode steps: each appends a token and allocates its slot, as the scheduler does."""
    held = []
    for _ in range(steps):
        r.output_token_ids.append(token)
        assert kv.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
        held.append(kv.pool.num_blocks - kv.num_free_blocks)
    return held


def test_sliding_window_frees_blocks_no_query_can_read():
    """Window 6, blocks of 4: a query at q reads q - 5 .. q, so before computing from position p a
    request holds only the blocks from the one holding p - 5; the others are back in the pool and their
    table entries hold the padding id (the table keeps one entry per block of positions)."""
    kv = KVCacheManager(16, block_size=4, sliding_window=6)
    r = req("a", list(range(10)))
    admit(kv, r)  # positions 0..9: 3 blocks, all readable by the first decode query (at 10: 5..10)
    assert kv.num_free_blocks == 13
    held = decode(kv, r, 30)  # computing position p: blocks up to p's, from (p - 5)'s
    assert held == [-(-(p + 1) // 4) - max(0, p - 5) // 4 for p in range(10, 40)] and max(held) == 3
    table, blocks = kv.block_ids(r), kv.req_blocks[r.seq_id]
    assert len(table) == 10 and table[:8] == [0] * 8 and all(b.ref_cnt == 1 for b in blocks[8:])
    assert kv.num_free_blocks == 14
    kv.free(r)
    assert kv.num_free_blocks == 16 and all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_freed_window_blocks_stay_cached_and_hits_before_the_window_are_not_taken():
    kv = KVCacheManager(16, block_size=4, sliding_window=6)
    a = req("a", list(range(20)))
    admit(kv, a)  # the first allocation computes all 20 positions: nothing is unreadable yet
    decode(kv, a, 4)  # the last query, at 23, read from 18: blocks 0..3 freed (still cached), 4 and 5 held
    assert kv.block_ids(a)[:4] == [0] * 4 and kv.num_free_blocks == 16 - 2
    b = req("b", list(range(20)))
    hits, n = kv.get_computed_blocks(b)
    assert n == 16 and len(hits) == 4  # the whole cached prefix is found (capped below the prompt)
    assert kv.allocate_slots(b, 4, hits) is not None
    # b computes from 16: it reads from 11, so blocks 0 and 1 are not taken, 2 and 3 are revived
    assert [blk.ref_cnt for blk in hits] == [0, 0, 1, 1] and kv.block_ids(b)[:2] == [0, 0]
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 16 and all(blk.ref_cnt == 0 for blk in kv.pool.blocks)


def test_forks_share_the_window_and_each_frees_its_own_references():
    kv = KVCacheManager(16, block_size=4, sliding_window=5)
    parent = req("p", list(range(14)))
    admit(kv, parent)
    decode(kv, parent, 3)
    child = Request("p", parent.prompt_token_ids, parent.params, index=1)
    child.output_token_ids = list(parent.output_token_ids)
    child.num_computed_tokens = parent.num_computed_tokens
    kv.fork(parent, child)
    assert kv.block_ids(child) == kv.block_ids(parent) and kv.block_ids(child)[0] == 0
    decode(kv, parent, 6, token=1)
    decode(kv, child, 6, token=2)
    assert all(b.ref_cnt == 1 for b in kv.req_blocks["p#0"] + kv.req_blocks["p#1"] if b.block_id)
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == 16


def test_a_global_layer_keeps_every_block():
    assert reclaim_window((8, 8, 8)) == 8 and reclaim_window((4, 8)) == 8
    assert reclaim_window((8, None, 8)) is None and reclaim_window(()) is None
    kv = KVCacheManager(16, block_size=4, sliding_window=reclaim_window((4, None)))
    r = req("a", list(range(10)))
    admit(kv, r)
    assert decode(kv, r, 12)[-1] == 6 and all(b.ref_cnt == 1 for b in kv.req_blocks[r.seq_id])


class RecordingKV(KVCacheManager):
    """Records where each request's last allocation started computing (what its release went by)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.computed_from: dict[str, int] = {}

    def allocate_slots(self, request, num_new_tokens, computed_blocks=None):
        start = request.num_computed_tokens + len(computed_blocks or []) * self.block_size
        new = super().allocate_slots(request, num_new_tokens, computed_blocks)
        if new is not None:
            self.computed_from[request.seq_id] = start
        return new


class WindowedKVMachine(KVMachine):
    """The KV property machine (admit with prefix hits, append, fork, free, preempt) on a manager that gives
    back blocks before a window of 5 positions: ref counts count live table entries only, and each request
    has given back exactly the blocks before its last allocation's window, and holds the rest."""

    WINDOW = 5

    def __init__(self) -> None:
        super().__init__()
        self.kv = RecordingKV(24, block_size=BLOCK, sliding_window=self.WINDOW)

    @invariant()
    def ref_counts_match_block_tables(self):
        held = Counter(b.block_id for blocks in self.kv.req_blocks.values() for b in live(blocks))
        for block in self.kv.pool.blocks:
            assert block.ref_cnt == held[block.block_id], block
        assert self.kv.num_free_blocks == sum(1 for b in self.kv.pool.blocks if b.ref_cnt == 0)

    @invariant()
    def blocks_before_the_window_are_given_back_and_the_rest_held(self):
        for req in self.live:
            blocks, start = self.kv.req_blocks[req.seq_id], self.kv.computed_from.get(req.seq_id)
            if start is None:  # a fork that has not allocated yet: its parent's table
                continue
            given_back = next((i for i, b in enumerate(blocks) if b is not NULL_BLOCK), len(blocks))
            assert given_back == max(0, start - self.WINDOW + 1) // BLOCK and NULL_BLOCK not in blocks[given_back:]


WindowedKVMachine.TestCase.settings = KVMachine.TestCase.settings
test_windowed_kv_manager_state_machine = WindowedKVMachine.TestCase
