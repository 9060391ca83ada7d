"""Property test (hypothesis): random sequences of admit (with prefix hits and evictions),
append, fork (copy-on-write), free and preempt keep ref counts, the free list and the prefix
cache consistent, and everything comes back when all requests end."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from loraplex.platform.core.kv_cache_manager import KVCacheManager, cdiv
from loraplex.platform.request import Request, SamplingParams

BLOCK = 4
PARAMS = SamplingParams(max_tokens=64)


class KVMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(24, block_size=BLOCK)
        self.live: list[Request] = []
        self.ids = 0

    def _new_id(self) -> str:
        self.ids += 1
        return f"r{self.ids}"

    # tokens from a tiny alphabet, so prompts share prefixes and the cache gets hits
    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=20), salt=st.sampled_from([(), ("lora", "x")]))
    def admit(self, prompt, salt):
        req = Request(self._new_id(), prompt, PARAMS, extra_keys=salt)
        free_before = self.kv.num_free_blocks
        hits, num_hit = self.kv.get_computed_blocks(req)
        assert num_hit < req.num_tokens
        if self.kv.allocate_slots(req, req.num_tokens - num_hit, hits) is None:
            assert self.kv.num_free_blocks == free_before and req.seq_id not in self.kv.req_blocks
            return
        req.num_computed_tokens = req.num_tokens
        self.live.append(req)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), count=st.integers(1, 6))
    def append(self, data, count):
        req = data.draw(st.sampled_from(self.live))
        before = (self.kv.num_free_blocks, list(self.kv.block_ids(req)))
        req.output_token_ids.extend(data.draw(st.lists(st.integers(0, 2), min_size=count, max_size=count)))
        if self.kv.allocate_slots(req, count) is None:
            assert (self.kv.num_free_blocks, self.kv.block_ids(req)) == before
            del req.output_token_ids[-count:]
            return
        req.num_computed_tokens += count

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.live))
        child = Request(parent.request_id, parent.prompt_token_ids, PARAMS, index=self.ids + 1000,
                        extra_keys=parent.extra_keys)
        self.ids += 1
        child.output_token_ids = list(parent.output_token_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        self.kv.fork(parent, child)
        assert self.kv.block_ids(child) == self.kv.block_ids(parent)
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), preempt=st.booleans())
    def end(self, data, preempt):
        req = data.draw(st.sampled_from(self.live))
        self.live.remove(req)
        if preempt:  # recompute later: blocks go back, hashes stay for a prefix hit on re-admission
            self.kv.free(req)
        else:
            self.kv.forget(req)
        assert req.seq_id not in self.kv.req_blocks

    @rule()
    def take_copies(self):
        for src, dst in self.kv.take_copies():
            assert src != dst

    @invariant()
    def ref_counts_match_block_tables(self):
        held = Counter(b.block_id for blocks in self.kv.req_blocks.values() for b in blocks)
        for block in self.kv.pool.blocks:
            assert block.ref_cnt == held[block.block_id], block
        free = {b.block_id for b in self.kv.pool.free_queue}
        assert free == {b.block_id for b in self.kv.pool.blocks if b.ref_cnt == 0}
        assert self.kv.num_free_blocks == len(free)

    @invariant()
    def live_requests_have_room_for_their_tokens(self):
        assert set(self.kv.req_blocks) == {r.seq_id for r in self.live}
        for req in self.live:
            assert len(self.kv.req_blocks[req.seq_id]) >= cdiv(req.num_computed_tokens, BLOCK)

    @invariant()
    def cache_maps_hashes_to_their_blocks(self):
        for block_hash, block in self.kv.pool.cached.items():
            assert block.block_hash == block_hash

    def teardown(self):
        for req in self.live:
            self.kv.forget(req)
        assert self.kv.num_free_blocks == self.kv.pool.num_blocks
        assert all(b.ref_cnt == 0 for b in self.kv.pool.blocks)


KVMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None, derandomize=True,
                                       database=None, suppress_health_check=[HealthCheck.too_slow])
test_kv_manager_state_machine = KVMachine.TestCase
