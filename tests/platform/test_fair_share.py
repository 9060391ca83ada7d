"""Tenants' fair share of the batch (#42): admission by seats per weight, preemption of the tenant
furthest above its share while another waits below its own, outputs unchanged by the preemptions."""

from __future__ import annotations

import pytest

from conftest import assert_all_blocks_free
from loraplex.platform import LLM, SamplingParams
from loraplex.platform.core.fair_share import TenantShare, fair_seats, next_to_admit, preemption_victims, seats
from loraplex.platform.engine.output_processor import accumulate
from loraplex.platform.request import Request

A, B = TenantShare("a"), TenantShare("b")


def _req(rid: str, tenant: TenantShare | None) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=4), tenant=tenant)


def test_weights_must_be_positive():
    for weight in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="weight"):
            TenantShare("x", weight)


def test_the_tenant_with_fewest_seats_per_weight_goes_first():
    heavy = TenantShare("h", 3.0)
    waiting = [_req("a1", A), _req("a2", A), _req("h1", heavy), _req("b1", B)]
    running = [_req("ra", A), _req("rh1", heavy), _req("rh2", heavy)]
    held = seats(running)
    assert next_to_admit(waiting, held, lambda r: True) == 3  # b: 0 seats
    held["b"] = 1  # a: 1/1, h: 2/3, b: 1/1 -> h
    assert next_to_admit(waiting, held, lambda r: True) == 2
    assert next_to_admit(waiting, held, lambda r: r.request_id != "h1") == 0  # h's only request has no slot
    assert next_to_admit(waiting, held, lambda r: False) is None


def test_victims_come_from_the_tenant_furthest_above_its_share():
    running = [_req(f"a{i}", A) for i in range(6)] + [_req("c0", TenantShare("c", 2.0))]
    waiting = [_req("b0", B), _req("b1", B), _req("a9", A)]
    assert fair_seats([*waiting, *running], 8) == {"b": 2.0, "a": 2.0, "c": 4.0}
    victims = preemption_victims(waiting, running, 8, lambda r: True)
    assert [v.request_id for v in victims] == ["a5"]  # b can take 2 seats, one is free; a is over, newest first
    assert preemption_victims(waiting[2:], running, 8, lambda r: True) == []  # nobody waits below its share
    assert preemption_victims(waiting, running, 8, lambda r: r.tenant is not B) == []  # b cannot run now


def test_interactive_work_below_its_share_takes_batch_lines_seats_first():
    """a waits with interactive work; b runs 5 interactive requests (furthest above its share), c 3 batch lines
    (within its share): the batch lines give up the seat, not b's interactive work."""
    from loraplex.platform.request import BATCH_PRIORITY

    c = TenantShare("c")
    running = [_req(f"b{i}", B) for i in range(5)] + [_req(f"c{i}", c) for i in range(3)]
    for r in running[5:]:
        r.priority = BATCH_PRIORITY
    victims = preemption_victims([_req("a0", A)], running, 8, lambda r: True)
    assert [v.request_id for v in victims] == ["c2"]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=256)


def _run(llm, flood: int, short: int, tenants: bool, short_after: int = 3):
    """`flood` long requests of tenant a, then after `short_after` steps `short` short ones of tenant b;
    steps until the short ones finish, and every request's tokens."""
    engine = llm.engine
    long_params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    short_params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i in range(flood):
        engine.add(engine.inputs.process(f"a{i}", [3 + i % 7, 4, 5, 6, 7, 8], long_params, tenant=A if tenants else None))
    totals, steps, added, done_at = {}, 0, False, None
    while (engine.has_unfinished() or not added) and steps < 2000:
        if steps == short_after and not added:
            for i in range(short):
                engine.add(engine.inputs.process(f"b{i}", [9, 10 + i, 11], short_params, tenant=B if tenants else None))
            added, first = True, steps
        for out in engine.step():
            totals[out.request_id] = accumulate(totals.get(out.request_id), out)
        steps += 1
        if added and done_at is None and all(totals.get(f"b{i}") is not None and totals[f"b{i}"].finished
                                             for i in range(short)):
            done_at = steps - first
    assert not engine.has_unfinished()
    assert_all_blocks_free(engine)
    return done_at, {rid: out.outputs[0].token_ids for rid, out in totals.items()}


def test_a_flood_cannot_hold_the_batch_from_another_tenant(llm):
    """48 long requests of one tenant fill the batch (8 seats); another tenant's 4 short requests take
    about as many steps as alone, where without tenants they wait for the flood's seats. The preempted
    long requests still give their greedy tokens."""
    alone, _ = _run(llm, 0, 4, tenants=True, short_after=0)
    fair, fair_tokens = _run(llm, 48, 4, tenants=True)
    fifo, fifo_tokens = _run(llm, 48, 4, tenants=False)
    assert fair <= 2 * alone + 2, (alone, fair)
    assert fifo > 5 * alone, (alone, fifo)  # what the share prevents
    assert fair_tokens == fifo_tokens
    assert llm.engine.core.scheduler.num_preemptions > 0
