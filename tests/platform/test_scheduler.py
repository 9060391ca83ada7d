from loraplex.platform.core.kv_cache_manager import KVCacheManager
from loraplex.platform.request import Request, RequestStatus, SamplingParams
from loraplex.platform.core.scheduler import Scheduler


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, caching=False):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    return Scheduler(kv, max_num_seqs, budget, max_model_len=1024)


def req(rid, n_prompt, max_tokens=4, **params):
    return Request(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens, **params))


def advance(sched, out, token=7):
    """The engine's update after a step, through the real scheduler: count computed tokens,
    "sample" `token` where a chunk completes, finish at max_tokens."""
    rows, batch = sched.sampling_batch(out)
    return sched.update(batch, [token] * len(batch), [None] * len(batch))


def test_budget_chunks_a_long_prompt():
    s = make(budget=32)
    r = req("a", 100)
    s.add(r)
    sizes = []
    for _ in range(4):
        out = s.schedule()
        sizes.append(out.scheduled[0][1])
        advance(s, out)
    assert sizes == [32, 32, 32, 4]
    assert r.output_token_ids == [7]


def test_chunked_prefill_mixes_with_decodes():
    s = make(budget=16)
    a, b = req("a", 4, max_tokens=10), req("b", 40)
    s.add(a)
    advance(s, s.schedule())
    s.add(b)
    out = s.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 15)]


def test_max_num_seqs_caps_admission():
    s = make(max_num_seqs=2)
    for i in range(3):
        s.add(req(f"r{i}", 4))
    out = s.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2"]


def test_fcfs_head_of_queue_is_not_overtaken():
    s = make(num_blocks=6, block_size=4, budget=64)
    s.add(req("big0", 16))  # 4 blocks + 1 for decode later
    advance(s, s.schedule())
    s.add(req("big1", 12))  # 3 blocks: does not fit in the 2 left
    s.add(req("small", 2))  # would fit, but must wait its turn
    out = s.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["big0"]
    assert [r.request_id for r in s.waiting] == ["big1", "small"]


def test_preemption_takes_the_newest_and_requeues_it_first():
    s = make(num_blocks=4, block_size=4, budget=64)
    old, new = req("old", 4, max_tokens=8), req("new", 7, max_tokens=8)
    s.add(old)
    s.add(new)
    advance(s, s.schedule())  # old: 1 block (full), new: 2 blocks
    advance(s, s.schedule())  # old needs a 2nd block (pos 4); new writes pos 7
    out = s.schedule()  # pos 5 for old fits; pos 8 for new needs a block: none left
    assert [r.request_id for r in out.preempted] == ["new"]
    assert [r.request_id for r, _ in out.scheduled] == ["old"]
    assert s.waiting[0].request_id == "new" and new.status == RequestStatus.PREEMPTED
    assert new.num_computed_tokens == 0 and len(new.output_token_ids) == 2


def test_every_request_finishes_under_pressure_without_leaks():
    s = make(num_blocks=10, block_size=4, budget=24, max_num_seqs=4)
    reqs = [req(f"r{i}", 3 + 5 * (i % 4), max_tokens=6) for i in range(12)]
    for r in reqs:
        s.add(r)
    for _ in range(500):
        if not s.has_unfinished():
            break
        advance(s, s.schedule())
    assert not s.has_unfinished()
    assert all(len(r.output_token_ids) == 6 for r in reqs)
    assert s.num_preemptions > 0
    assert s.kv.num_free_blocks == 10 and s.kv.req_blocks == {}


def test_abort_frees_blocks_of_running_and_waiting_requests():
    s = make(num_blocks=8, block_size=4, budget=64, max_num_seqs=1)
    a, b = req("a", 9), req("b", 5)
    s.add(a)
    s.add(b)
    advance(s, s.schedule())
    assert s.kv.num_free_blocks == 5 and list(s.waiting) == [b]
    s.finish(a, RequestStatus.FINISHED_ABORTED)
    s.finish(b, RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished() and s.kv.num_free_blocks == 8 and s.kv.req_blocks == {}
    assert a.finish_reason == "abort"


def test_prefix_hits_are_counted_once_per_admission():
    s = make(num_blocks=16, block_size=4, caching=True)
    first = req("a", 9)
    s.add(first)
    advance(s, s.schedule())
    s.finish(first, RequestStatus.FINISHED_STOPPED)
    second = req("b", 9)
    s.add(second)
    out = s.schedule()
    assert out.scheduled == [(second, 1)] and second.num_cached_tokens == 8
    assert s.kv.prefix_cache_hit_rate == 8 / 18


def lora_req(rid, adapter, n_prompt=4, max_tokens=4):
    r = req(rid, n_prompt, max_tokens)
    r.adapter = adapter
    return r


def make_lora(max_loras, cycle_steps=4, max_num_seqs=8):
    kv = KVCacheManager(256, 4, enable_caching=False)
    return Scheduler(kv, max_num_seqs, 64, max_model_len=1024, max_loras=max_loras, lora_cycle_steps=cycle_steps)


def test_base_and_resident_adapter_requests_overtake_one_waiting_for_a_slot():
    s = make_lora(max_loras=1)
    s.add(lora_req("x0", "x", max_tokens=20))
    advance(s, s.schedule())  # x holds the only slot
    s.add(lora_req("y0", "y"))  # needs a slot: none is free
    s.add(req("base", 4))
    s.add(lora_req("x1", "x"))
    out = s.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["x0", "base", "x1"]
    assert [r.request_id for r in s.waiting] == ["y0"]


def test_no_adapter_waits_forever_while_others_are_served():
    """Two slots, four adapters and a steady stream of new requests for the first two: the
    resident ones yield after lora_cycle_steps, so every adapter is served within a bound."""
    s = make_lora(max_loras=2, cycle_steps=4, max_num_seqs=6)
    first_step: dict[str, int] = {}
    for a in "abcd":
        s.add(lora_req(f"{a}-0", a, max_tokens=3))
    for step in range(1, 80):
        for a in "ab":  # a and b never run out of new requests
            s.add(lora_req(f"{a}-{step}", a, max_tokens=3))
        out = s.schedule()
        assert len({r.adapter for r in s.running if r.adapter}) <= 2
        for r, _ in out.scheduled:
            first_step.setdefault(r.adapter, step)
        advance(s, out)
    assert set(first_step) == set("abcd")
    assert max(first_step.values()) <= 4 + 2 * 3 + 2  # a cycle, then the residents' running requests drain


def test_cycling_waits_until_adapters_are_waiting():
    s = make_lora(max_loras=2, cycle_steps=1)
    for step in range(10):
        s.add(lora_req(f"a{step}", "a", max_tokens=2))
        out = s.schedule()
        assert any(r.request_id == f"a{step}" for r, _ in out.scheduled)  # nobody waits: a never yields
        advance(s, out)


def test_update_appends_finishes_and_reports_only_the_new_tokens():
    kv = KVCacheManager(64, 4, enable_caching=False)
    s = Scheduler(kv, 8, 64, max_model_len=1024, eos_token_ids=(2,))
    a, b, c = req("a", 4, max_tokens=3), req("b", 4, max_tokens=9, stop_token_ids=[5]), req("c", 4, max_tokens=9)
    for r in (a, b, c):
        s.add(r)
    deltas = advance(s, s.schedule(), token=7)
    assert [(d.request_id, d.new_token_ids, d.finish_reason) for d in deltas] == [("a", [7], None), ("b", [7], None),
                                                                                ("c", [7], None)]
    out = s.schedule()
    _, batch = s.sampling_batch(out)
    deltas = s.update(batch, [7, 5, 2], [None] * 3)  # a: a token, b: its stop token, c: EOS
    assert [(d.new_token_ids, d.finish_reason, d.stop_reason) for d in deltas] == [
        ([7], None, None), ([5], "stop", 5), ([2], "stop", None)]
    assert [r.request_id for r in s.running] == ["a"] and kv.block_ids(b) == [] and kv.block_ids(c) == []
    assert [g[0].request_id for g in s.pop_finished_groups()] == ["b", "c"]
    assert advance(s, s.schedule())[0].finish_reason == "length" and not s.has_unfinished()
    assert [g[0].request_id for g in s.pop_finished_groups()] == ["a"]


def test_forks_sample_from_their_parents_row_and_the_group_ends_with_its_last_sequence():
    kv = KVCacheManager(64, 4, enable_caching=False)
    s = Scheduler(kv, 8, 64, max_model_len=1024)
    s.add(req("p", 6, max_tokens=2, n=3))
    s.add(req("q", 3, max_tokens=2))
    rows, batch = s.sampling_batch(s.schedule())
    assert rows == [0, 0, 0, 1] and [(r.request_id, r.index) for r in batch] == [("p", 0), ("p", 1), ("p", 2),
                                                                              ("q", 0)]
    assert kv.block_ids(batch[1]) == kv.block_ids(batch[0])  # the prompt's blocks are shared
    s.update(batch, [7, 8, 9, 7], [None] * 4)
    assert [r.output_token_ids for r in batch] == [[7], [8], [9], [7]]
    s.abort("p")
    assert [g[0].request_id for g in s.pop_finished_groups()] == ["p"] and len(s.groups) == 1
    assert not s.abort("p") and s.abort("q") and not s.has_unfinished()


def make_resident(ready: set[str], max_loras=4, wait_steps=64, max_num_seqs=8):
    kv = KVCacheManager(256, 4, enable_caching=False)
    return Scheduler(kv, max_num_seqs, 64, max_model_len=1024, max_loras=max_loras,
                     ready=lambda names: set(names) <= ready, lora_max_wait_steps=wait_steps)


def test_base_requests_never_wait_behind_an_adapter_coming_in():
    """Counted in steps: while `y` comes in (not ready), the base request and a ready adapter's request that
    arrived with it run in the very next step; `y` runs in the step after it is ready, never earlier."""
    ready = {"x"}
    s = make_resident(ready)
    s.add(lora_req("x0", "x", max_tokens=20))
    advance(s, s.schedule())  # something running: a new adapter now waits for its slot to be filled
    for r in (lora_req("y0", "y"), req("base", 4), lora_req("x1", "x")):
        s.add(r)
    out = s.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["x0", "base", "x1"]
    advance(s, out)
    assert [r.request_id for r, _ in s.schedule().scheduled] == ["x0", "base", "x1"]  # y still coming in
    ready.add("y")
    assert "y0" in [r.request_id for r, _ in s.schedule().scheduled]


def test_a_request_whose_adapter_never_comes_in_runs_at_the_age_limit():
    """The prefetcher never delivers `y`: its request is admitted (its step fills the slot itself) exactly
    lora_max_wait_steps steps after it was queued, while base requests keep running before it."""
    s = make_resident({"x"}, wait_steps=5)
    s.add(lora_req("x0", "x", max_tokens=40))
    advance(s, s.schedule())
    s.add(lora_req("y0", "y", max_tokens=40))
    queued_at, admitted_at = s._step, None
    for step in range(12):
        s.add(req(f"base{step}", 4, max_tokens=2))
        out = s.schedule()
        assert any(r.request_id == f"base{step}" for r, _ in out.scheduled)
        if admitted_at is None and any(r.request_id == "y0" for r, _ in out.scheduled):
            admitted_at = s._step
        advance(s, out)
    assert admitted_at == queued_at + 5


def test_a_burst_into_an_idle_engine_runs_at_once():
    """Nothing running: no request would wait on a slot being filled, so adapters not yet in slots run in the
    first step (a burst's first step is not lost)."""
    s = make_resident(set())
    for r in (lora_req("y0", "y"), lora_req("z0", "z"), req("base", 4)):
        s.add(r)
    assert [r.request_id for r, _ in s.schedule().scheduled] == ["y0", "z0", "base"]


def test_a_tenant_waiting_on_an_adapter_coming_in_does_not_stall_the_fair_share():
    """Two tenants: the fair share's pick skipped only requests without a slot, so it kept picking the one whose
    adapter was still coming in, forever (schedule never returned)."""
    from loraplex.platform.core.fair_share import TenantShare

    s = make_resident({"x"})
    a0 = lora_req("a0", "x", max_tokens=20)
    a0.tenant = TenantShare("A")
    s.add(a0)
    advance(s, s.schedule())
    b0, a1 = lora_req("b0", "y"), req("a1", 4)
    b0.tenant, a1.tenant = TenantShare("B"), TenantShare("A")
    s.add(b0)
    s.add(a1)
    assert [r.request_id for r, _ in s.schedule().scheduled] == ["a0", "a1"]


def test_an_urgent_request_whose_adapter_is_coming_in_preempts_nobody():
    """Priority: a more urgent request still waiting for its adapter neither takes a seat nor frees one (it
    preempted a running request every step until the age limit)."""
    s = make_resident({"x"}, max_num_seqs=2)
    for rid in ("x0", "x1"):
        r = req(rid, 4, max_tokens=20, priority=1)
        r.adapter = "x"
        s.add(r)
    advance(s, s.schedule())
    u = lora_req("u", "y")
    s.add(u)
    for _ in range(3):
        out = s.schedule()
        assert not out.preempted and [r.request_id for r, _ in out.scheduled] == ["x0", "x1"]
        advance(s, out)
    assert s.num_preemptions == 0
