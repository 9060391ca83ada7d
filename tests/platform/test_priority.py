"""Per-request priority (vLLM's `priority`, `--scheduling-policy priority`): waiting order, sitting out,
preemption for a seat, tenants' own priorities, batch lines yielding to everyone, fcfs refusing it, and an
all-zero workload scheduled exactly as before."""

from __future__ import annotations

import random

import pytest

from conftest import assert_all_blocks_free
from loraplex.platform import LLM
from loraplex.platform.config import EngineConfig
from loraplex.platform.core.fair_share import TenantShare, outranks
from loraplex.platform.core.kv_cache_manager import KVCacheManager
from loraplex.platform.core.scheduler import Scheduler
from loraplex.platform.engine.output_processor import accumulate
from loraplex.platform.request import BATCH_PRIORITY, Request, RequestStatus, SamplingParams

A, B = TenantShare("a"), TenantShare("b")


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_loras=1):
    return Scheduler(KVCacheManager(num_blocks, block_size, enable_caching=False), max_num_seqs, budget,
                     max_model_len=1024, max_loras=max_loras)


def req(rid, n_prompt, priority=0, max_tokens=8, tenant=None, adapter=None, first=1):
    return Request(rid, list(range(first, first + n_prompt)), SamplingParams(max_tokens=max_tokens, priority=priority),
                   tenant=tenant, adapter=adapter)


def advance(sched, out, token=7):
    """The engine's update after a step: computed tokens counted, `token` sampled where a chunk completes."""
    _, batch = sched.sampling_batch(out)
    return sched.update(batch, [token] * len(batch), [None] * len(batch))


def ids(requests):
    return [r.request_id for r in requests]


def scheduled(out):
    return [(r.request_id, n) for r, n in out.scheduled]


# ---- the values ---------------------------------------------------------------------------------

def test_priority_is_validated_by_name():
    for ok in (0, -2**31, 2**31 - 1, BATCH_PRIORITY, 5, -5):
        assert SamplingParams(priority=ok).priority == ok
    for bad in (2**31 + 1, -2**31 - 1, True, 1.0, "1", None):
        with pytest.raises(ValueError, match="^priority must be an integer"):
            SamplingParams(priority=bad)
    assert Request("r", [1], SamplingParams(priority=3)).priority == 3


def test_scheduling_policy_is_checked():
    assert EngineConfig(model="m").scheduling_policy == "fcfs"
    assert EngineConfig(model="m", scheduling_policy="priority").scheduling_policy == "priority"
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(model="m", scheduling_policy="lifo")


def test_outranks_is_within_a_tenant_or_over_batch_lines():
    a0, a5, b_urgent = req("a0", 1, 0, tenant=A), req("a5", 1, 5, tenant=A), req("b", 1, -9, tenant=B)
    a_batch = req("ab", 1, BATCH_PRIORITY, tenant=A)
    assert outranks(a0, a5) and not outranks(a5, a0) and not outranks(a0, a0)
    assert not outranks(b_urgent, a0) and not outranks(b_urgent, a5)  # another tenant's priorities: not a's order
    assert outranks(b_urgent, a_batch) and outranks(a5, a_batch)  # batch lines yield to everyone
    assert not outranks(a_batch, req("bb", 1, BATCH_PRIORITY, tenant=B))


# ---- waiting order ------------------------------------------------------------------------------

def test_waiting_is_in_priority_then_arrival_order():
    s = make(max_num_seqs=1)
    s.add(req("run", 4))
    s.schedule()  # the only seat taken: the rest wait
    for rid, p in [("p0", 0), ("p5", 5), ("m1", -1), ("p0b", 0), ("batch", BATCH_PRIORITY), ("p5b", 5)]:
        s.add(req(rid, 4, p))
    assert ids(s.waiting) == ["m1", "p0", "p0b", "p5", "p5b", "batch"]


def test_a_preempted_request_goes_back_to_the_front_of_its_class():
    """Blocks run short: the worst priority, newest among equals, is preempted, and waits first among its
    priority, behind the more urgent."""
    s = make(num_blocks=5, block_size=4, budget=64, max_loras=1)
    for rid, n, p, first in [("hi", 4, 0, 1), ("lo", 4, 5, 20), ("lo2", 3, 5, 40)]:
        s.add(req(rid, n, p, adapter="x", first=first))
    advance(s, s.schedule())  # one block each
    # another tenant's, waiting, not admissible while x holds the only adapter slot: its priorities outrank nobody
    # here, so nobody sits out or gives up the slot for them
    for rid, p in [("w0", -1), ("w5", 5), ("w6", 6)]:
        s.add(req(rid, 2, p, adapter="y", tenant=B))
    out = s.schedule()  # hi and lo take their 2nd blocks: all 5 held
    assert scheduled(out) == [("hi", 1), ("lo", 1), ("lo2", 1)] and not out.preempted
    advance(s, out)
    out = s.schedule()  # lo2 needs its 2nd block: none left
    assert scheduled(out) == [("hi", 1), ("lo", 1)] and ids(out.preempted) == ["lo2"]
    assert ids(s.waiting) == ["w0", "lo2", "w5", "w6"]


def test_blocks_running_short_preempt_the_worst_priority_not_the_newest():
    s = make(num_blocks=4, block_size=4, budget=64)
    low, high = req("low", 4, 5), req("high", 7, 0)  # high arrives second but is more urgent
    s.add(low)
    advance(s, s.schedule())
    s.add(high)
    advance(s, s.schedule())  # high prefills (low sits out), 2 blocks; low: 1 (full)
    advance(s, s.schedule())  # low needs a 2nd block (pos 4); high writes pos 7
    out = s.schedule()  # high needs a block at pos 8: none left; low, not the newest, goes
    assert ids(out.preempted) == ["low"] and scheduled(out) == [("high", 1)]
    assert ids(s.waiting) == ["low"] and low.num_computed_tokens == 0


# ---- sitting out ----------------------------------------------------------------------------------

def test_a_batch_decode_sits_out_while_an_interactive_prompt_prefills():
    s = make(budget=16)
    batch = req("batch", 4, BATCH_PRIORITY, max_tokens=20)
    s.add(batch)
    for _ in range(3):
        advance(s, s.schedule())
    blocks, computed, made = list(s.kv.block_ids(batch)), batch.num_computed_tokens, len(batch.output_token_ids)
    s.add(req("chat", 40, 0, first=50))
    steps = []
    for _ in range(4):
        out = s.schedule()
        steps.append(scheduled(out))
        assert not out.preempted
        advance(s, out)
    # the prompt has every step's whole budget until it is in; then the batch line runs again after it
    assert steps == [[("chat", 16)], [("chat", 16)], [("chat", 8)], [("chat", 1), ("batch", 1)]]
    assert s.kv.block_ids(batch)[:len(blocks)] == blocks and batch.status == RequestStatus.RUNNING
    assert batch.num_computed_tokens == computed + 1 and len(batch.output_token_ids) == made + 1


def test_equal_priorities_share_the_step_as_before():
    s = make(budget=16)
    a = req("a", 4, 3, max_tokens=20)
    s.add(a)
    advance(s, s.schedule())
    s.add(req("b", 40, 3, first=50))
    assert scheduled(s.schedule()) == [("a", 1), ("b", 15)]


def test_an_urgent_request_takes_a_seat_from_batch_lines():
    """Every seat held by batch lines: an interactive request preempts the newest for its seat, the other sits
    out while it prefills, and the preempted line waits first among batch lines."""
    s = make(max_num_seqs=2, budget=32)
    b0, b1, b2 = (req(f"b{i}", 4, BATCH_PRIORITY, max_tokens=20, first=10 * i + 1) for i in range(3))
    for r in (b0, b1, b2):
        s.add(r)
    advance(s, s.schedule())
    assert ids(s.running) == ["b0", "b1"]
    s.add(req("chat", 6, 0, first=100))
    out = s.schedule()
    assert ids(out.preempted) == ["b1"] and scheduled(out) == [("chat", 6)]
    assert ids(s.waiting) == ["b1", "b2"] and b0.status == RequestStatus.RUNNING
    advance(s, out)
    assert scheduled(s.schedule()) == [("chat", 1), ("b0", 1)]


def test_a_tenants_priority_orders_only_its_own_work():
    """Tenant b's urgent request neither sits out nor preempts tenant a's priority-0 work, but it does both
    to a's batch line; b's own less urgent work sits out."""
    s = make(max_num_seqs=3, budget=32)
    a0 = req("a0", 4, 0, tenant=A, max_tokens=20)
    a_batch = req("a_batch", 4, BATCH_PRIORITY, tenant=A, max_tokens=20, first=10)
    b0 = req("b0", 4, 0, tenant=B, max_tokens=20, first=20)
    for r in (a0, a_batch, b0):
        s.add(r)
    advance(s, s.schedule())
    s.add(req("b_urgent", 6, -5, tenant=B, first=30))
    out = s.schedule()
    assert ids(out.preempted) == ["a_batch"]  # the seat: from the batch line, never from a0
    assert scheduled(out) == [("a0", 1), ("b_urgent", 6)]  # b0 sits out, a0 runs
    assert b0.status == RequestStatus.RUNNING and a0.status == RequestStatus.RUNNING


def test_another_tenants_urgent_prefill_does_not_sit_out_priority_zero_work():
    s = make(budget=16)
    a0 = req("a0", 4, 0, tenant=A, max_tokens=20)
    s.add(a0)
    advance(s, s.schedule())
    s.add(req("b_urgent", 40, -100, tenant=B, first=50))
    assert scheduled(s.schedule()) == [("a0", 1), ("b_urgent", 15)]


def test_batch_lines_waiting_take_no_seat_from_interactive_work():
    """Fair share: tenant b's batch lines waiting below b's share preempt nothing of a's interactive
    work (they would only be sat out and preempted back), and are admitted once seats free."""
    s = make(max_num_seqs=2, budget=32)
    for i in range(2):
        s.add(req(f"a{i}", 4, 0, tenant=A, max_tokens=3, first=10 * i + 1))
    advance(s, s.schedule())
    s.add(req("b_batch", 4, BATCH_PRIORITY, tenant=B, first=50))
    out = s.schedule()
    assert not out.preempted and scheduled(out) == [("a0", 1), ("a1", 1)]
    while s.has_unfinished():
        advance(s, s.schedule())
    assert s.num_preemptions == 0


def test_a_sitting_request_is_preempted_rather_than_stuck_behind_a_blocked_admission():
    """An urgent waiting request behind one that cannot come in (no adapter slot, the batch full) still gets
    a seat: the request it outranks does not sit out for ever."""
    s = make(max_num_seqs=2, budget=32, max_loras=1)
    s.add(req("low0", 4, 5, adapter="x", max_tokens=30))
    s.add(req("low1", 4, 5, adapter="x", max_tokens=30, first=10))
    advance(s, s.schedule())
    s.add(req("other", 4, -9, adapter="y", first=20))  # first in line, no slot for y
    s.add(req("urgent", 4, 0, adapter="x", first=30))
    out = s.schedule()
    assert ids(out.preempted) == ["low1"] and scheduled(out) == [("urgent", 4)]


def test_nobody_sits_out_a_step_in_which_nothing_more_urgent_can_run():
    """Tenant b's urgent request waits behind tenant a's, which the blocks cannot take yet and which outranks
    nothing of b's: b's running request runs rather than sit out for nothing, and all finish."""
    s = make(num_blocks=8, block_size=4, budget=64)
    low = req("b_low", 4, 5, tenant=B, max_tokens=6)
    s.add(low)
    advance(s, s.schedule())
    advance(s, s.schedule())  # 2 blocks held, 6 free
    s.add(req("a_big", 28, 0, tenant=A, max_tokens=1, first=10))  # needs 7 blocks; a has the fewer seats
    s.add(req("b_urgent", 2, 0, tenant=B, max_tokens=1, first=50))
    out = s.schedule()
    assert scheduled(out) == [("b_low", 1)] and not out.preempted
    advance(s, out)
    while s.has_unfinished():
        advance(s, s.schedule())
    assert s.kv.num_free_blocks == 8


# ---- unchanged with all priorities equal ---------------------------------------------------------

def _workload_trace(monkeypatch=None, tenants=True, priority=0):
    """A seeded workload (arrivals over time, chunked prompts, blocks short enough to preempt, adapters
    waiting for slots, two tenants), every request at `priority`: every step's scheduled and preempted
    sequences."""
    rng = random.Random(7)
    s = make(num_blocks=24, block_size=4, max_num_seqs=5, budget=24, max_loras=2)
    if monkeypatch is not None:  # the sitting-out pass made to run in full every step
        monkeypatch.setattr(s, "_outranked_priority", lambda: BATCH_PRIORITY + 1 if s.running else None)
    arrivals = sorted((rng.randrange(60), i) for i in range(30))
    trace = []
    for step in range(400):
        for t, i in arrivals:
            if t == step:
                s.add(req(f"r{i}", rng.randrange(2, 30), priority, max_tokens=rng.randrange(1, 12),
                          tenant=(A, B)[i % 2] if tenants else None, adapter=(None, "x", "y", "z")[i % 4],
                          first=i + 1))
        out = s.schedule()
        trace.append((scheduled(out), ids(out.preempted)))
        advance(s, out)
        if step > 60 and not s.has_unfinished():
            break
    assert not s.has_unfinished() and s.num_preemptions > 0
    return trace


def test_equal_priorities_schedule_exactly_as_without_the_priority_pass(monkeypatch):
    for tenants in (True, False):
        plain = _workload_trace(tenants=tenants)
        assert _workload_trace(monkeypatch, tenants=tenants) == plain
        assert _workload_trace(tenants=tenants, priority=BATCH_PRIORITY) == plain
        assert _workload_trace(tenants=tenants, priority=-7) == plain


def test_all_zero_priorities_admit_in_arrival_order():
    s = make(num_blocks=12, block_size=4, max_num_seqs=3, budget=24)
    rng = random.Random(3)
    order = []
    for step in range(300):
        if step < 20:
            s.add(req(f"r{step}", rng.randrange(2, 20), 0, max_tokens=rng.randrange(1, 20), first=step + 1))
        out = s.schedule()
        order += [r.request_id for r, _ in out.scheduled if r.request_id not in order]
        if s.running or s.waiting:
            assert not out.preempted or out.preempted[-1] is s.waiting[0]  # the newest, back first
        advance(s, out)
    assert order == [f"r{i}" for i in range(20)] and s.num_preemptions > 0


# ---- the engine --------------------------------------------------------------------------------

def test_fcfs_refuses_a_priority_but_takes_batch_lines(tiny_llm):
    assert tiny_llm.engine.config.scheduling_policy == "fcfs"
    with pytest.raises(ValueError, match="priority=5 needs a server started with --scheduling-policy priority"):
        tiny_llm.engine.inputs.process("p", [1, 2, 3], SamplingParams(priority=5))
    assert tiny_llm.engine.inputs.process("b", [1, 2, 3], SamplingParams(priority=BATCH_PRIORITY)).priority \
        == BATCH_PRIORITY
    assert not tiny_llm.engine.has_unfinished()


PROMPTS = [list(range(3 + i, 3 + i + n)) for i, n in enumerate([5, 17, 33, 2, 48, 16, 9])]
PRIORITIES = [BATCH_PRIORITY, BATCH_PRIORITY, 0, 3, -2, BATCH_PRIORITY, 1]


def test_priorities_do_not_change_what_is_generated(tiny_model_dir):
    """Batch lines first, interactive requests arriving while they run (sit-outs, preemptions for seats and
    blocks, chunked prompts): each output as generated alone."""
    def params(priority=0):
        return SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, priority=priority)

    alone = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=128, enable_prefix_caching=False)
    expected = [alone.generate({"prompt_token_ids": p}, params())[0].outputs[0].token_ids for p in PROMPTS]
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=10, max_num_seqs=3, max_num_batched_tokens=16,
              scheduling_policy="priority")
    engine, totals = llm.engine, {}
    for step in range(1000):
        for i, priority in enumerate(PRIORITIES):
            if step == (0 if priority == BATCH_PRIORITY else 2 + i):
                engine.add_request(f"r{i}", {"prompt_token_ids": PROMPTS[i]}, params(priority))
        for out in engine.step():
            totals[out.request_id] = accumulate(totals.get(out.request_id), out)
        if step > 10 and not engine.has_unfinished():
            break
    assert [totals[f"r{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == expected
    assert engine.core.scheduler.num_preemptions > 0
    assert_all_blocks_free(engine)


def test_an_adapter_slot_held_by_batch_lines_frees_for_an_interactive_request():
    """max_loras 1: batch lines on adapter x hold the only slot; an interactive request on adapter y would wait
    for them all to finish. They give the slot up (preempted, recomputed later); equal priorities do not."""
    sched = make(max_loras=1)
    for i in range(2):
        sched.add(req(f"batch{i}", 4, BATCH_PRIORITY, adapter="x", first=10 * i + 1))
    advance(sched, sched.schedule())
    sched.add(req("chat", 4, 0, adapter="y", first=50))
    out = sched.schedule()
    assert ids(out.preempted) == ["batch1", "batch0"] or ids(out.preempted) == ["batch0", "batch1"]
    assert scheduled(out) == [("chat", 4)] and sched.running_adapters() == {"y"}
    assert [r.status for r in sched.waiting] == [RequestStatus.PREEMPTED] * 2

    same = make(max_loras=1)
    same.add(req("first", 4, 0, adapter="x"))
    advance(same, same.schedule())
    same.add(req("second", 4, 0, adapter="y", first=50))
    out = same.schedule()
    assert not out.preempted and scheduled(out) == [("first", 1)]  # FCFS for slots among equals
