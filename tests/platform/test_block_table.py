"""The runner's persistent int32 block table against the KV manager's block lists: after random joins (with
prefix hits), appends, forks (copy-on-write), preemptions, finishes and rejected drafts (blocks given back), with and without a sliding window
(which turns a prefix of each table into NULL_BLOCK entries), the committed table equals a rebuild from the
lists, and a step writes only the entries that changed."""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.platform.core.block_table import BlockTable
from loraplex.platform.core.kv_cache_manager import KVCacheManager
from loraplex.platform.request import Request, SamplingParams

BLOCK = 4
PARAMS = SamplingParams(max_tokens=64)


class Walk:
    """Requests driven through a real KVCacheManager; each step allocates a random batch's new tokens, syncs
    the table (before the computed counts move, as the runner does) and advances."""

    def __init__(self, seed: int, window: int | None) -> None:
        self.rng = random.Random(seed)
        self.kv = KVCacheManager(40, block_size=BLOCK, sliding_window=window)
        self.table = BlockTable(2, 2, BLOCK, torch.device("cpu"))  # small: rows and width grow
        self.live: list[Request] = []
        self.ids = 0
        self.known: dict[str, tuple[list, list[int]]] = {}  # seq_id -> (list object, ids at the last sync)

    def request(self, prompt: list[int]) -> Request:
        self.ids += 1
        return Request(f"r{self.ids}", prompt, PARAMS)

    def join(self) -> None:
        req = self.request([self.rng.randrange(3) for _ in range(self.rng.randrange(1, 14))])
        hits, num_hit = self.kv.get_computed_blocks(req)
        if self.kv.allocate_slots(req, req.num_tokens - num_hit, hits) is not None:
            req.num_computed_tokens = num_hit
            self.step([(req, req.num_tokens - num_hit)])
            self.live.append(req)

    def decode(self) -> None:
        batch = self.rng.sample(self.live, self.rng.randrange(1, len(self.live) + 1))
        scheduled = []
        for req in batch:
            count = self.rng.choice([1, 1, 1, 3])
            req.output_token_ids += [self.rng.randrange(3) for _ in range(count)]
            if self.kv.allocate_slots(req, count) is None:
                del req.output_token_ids[-count:]
            else:
                scheduled.append((req, count))
        if scheduled:
            self.step(scheduled)

    def draft(self) -> None:
        """A step verifying drafts, all rejected: their blocks given back; the next steps' new blocks may be
        others in the same places of the list."""
        req = self.rng.choice(self.live)
        drafts = self.rng.randrange(1, 2 * BLOCK)
        req.output_token_ids.append(self.rng.randrange(3))
        if self.kv.allocate_slots(req, 1 + drafts) is None:
            del req.output_token_ids[-1]
            return
        self.step([(req, 1 + drafts)])
        req.num_computed_tokens -= drafts
        self.kv.trim(req)

    def fork(self) -> None:
        parent = self.rng.choice(self.live)
        child = Request(parent.request_id, parent.prompt_token_ids, PARAMS, index=self.ids + 1000)
        self.ids += 1
        child.output_token_ids = list(parent.output_token_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        self.kv.fork(parent, child)
        self.live.append(child)

    def preempt(self) -> None:
        req = self.live.pop(self.rng.randrange(len(self.live)))
        self.kv.free(req)
        req.num_computed_tokens = 0
        hits, num_hit = self.kv.get_computed_blocks(req)
        if self.kv.allocate_slots(req, req.num_tokens - num_hit, hits) is not None:  # back at once, or later
            req.num_computed_tokens = num_hit
            self.step([(req, req.num_tokens - num_hit)])
            self.live.append(req)

    def finish(self) -> None:
        self.kv.forget(self.live.pop(self.rng.randrange(len(self.live))))

    def step(self, scheduled: list[tuple[Request, int]]) -> None:
        requests = [req for req, _ in scheduled]
        before = self.table.num_written
        rows = self.table.update(self.kv.req_blocks, requests)
        tables = self.table.commit(rows)
        assert tables.dtype == torch.int32 and tables.shape[0] == len(requests)
        for req, got in zip(requests, tables):
            ids = self.kv.block_ids(req)
            assert got[:len(ids)].tolist() == ids, req
        assert self.table.num_written - before <= self.changed(requests)
        for req, num_new in scheduled:
            req.num_computed_tokens += num_new

    def changed(self, requests: list[Request]) -> int:
        """Entries that differ from what the table was last told about each request (all of a new list)."""
        total = 0
        for req in requests:
            blocks = self.kv.req_blocks[req.seq_id]
            ids = [b.block_id for b in blocks]
            old_list, old = self.known.get(req.seq_id, (None, []))
            if old_list is not blocks:
                old = []
            total += sum(1 for i, b in enumerate(ids) if i >= len(old) or old[i] != b)
            self.known[req.seq_id] = (blocks, ids)
        return total


@pytest.mark.parametrize("window", [None, 6, 9])
@pytest.mark.parametrize("seed", range(6))
def test_table_equals_a_rebuild_after_random_steps(seed, window):
    walk = Walk(seed, window)
    moves = {"join": walk.join, "decode": walk.decode, "fork": walk.fork, "preempt": walk.preempt,
             "finish": walk.finish, "draft": walk.draft}
    for _ in range(300):
        move = walk.rng.choice(["join", "decode", "decode", "decode", "fork", "preempt", "finish", "draft"])
        if move == "join" or not walk.live:
            walk.join()
        else:
            moves[move]()
    assert walk.table.host.shape[0] >= 2 and walk.table.width >= 2


def test_steady_decode_writes_only_new_blocks():
    """32 long requests decoding one token a step: a step writes one entry per request that enters a new
    block, not B x width."""
    kv = KVCacheManager(32 * 40, block_size=BLOCK)
    table = BlockTable(32, 64, BLOCK, torch.device("cpu"))
    requests = [Request(f"r{i}", [i] * (100 + i), PARAMS) for i in range(32)]
    for req in requests:
        assert kv.allocate_slots(req, req.num_tokens) is not None
    table.update(kv.req_blocks, requests)
    for req in requests:
        req.num_computed_tokens = req.num_tokens
    for _ in range(2 * BLOCK):
        crossing = sum(1 for r in requests if r.num_tokens % BLOCK == 0)
        for req in requests:
            req.output_token_ids.append(1)
            assert kv.allocate_slots(req, 1) is not None
        before = table.num_written
        rows = table.update(kv.req_blocks, requests[::-1])  # order changes: rows stay, only gathered
        assert table.num_written - before == crossing
        assert table.commit(rows)[0, :30].tolist() == kv.block_ids(requests[-1])[:30]
        for req in requests:
            req.num_computed_tokens += 1


def test_rows_of_finished_requests_are_reused():
    kv = KVCacheManager(16, block_size=BLOCK)
    table = BlockTable(2, 4, BLOCK, torch.device("cpu"))
    a, b, c = (Request(name, [1, 2, 3], PARAMS) for name in "abc")
    for req in (a, b):
        kv.allocate_slots(req, 3)
    rows = table.update(kv.req_blocks, [a, b])
    kv.forget(a)
    kv.allocate_slots(c, 3)
    assert table.update(kv.req_blocks, [b, c]) == [rows[1], rows[0]] and table.host.shape[0] == 2


def test_engine_steps_never_rebuild_tables_from_the_lists(tiny_model_dir, monkeypatch):
    """Through the engine (chunked prefills, decode, forks sharing blocks): the runner keeps its
    int32 table up to date without ever turning a request's whole block list into ids again."""
    from loraplex.platform import LLM

    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=24, max_num_seqs=4, max_num_batched_tokens=32)
    calls = []
    real = KVCacheManager.block_ids
    monkeypatch.setattr(KVCacheManager, "block_ids", lambda self, req: calls.append(req) or real(self, req))
    prompts = [{"prompt_token_ids": list(range(3 + i, 40 + 3 * i))} for i in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=12, ignore_eos=True)]
    outs = llm.generate(prompts, [params[i % 2] for i in range(4)])
    assert all(len(c.token_ids) == 12 for o in outs for c in o.outputs)
    assert calls == [] and llm.engine.core.batch.block_table.host.dtype == torch.int32
