"""--async-scheduling (`EngineCore._step_ahead`): a step of plain sequences leaves its sampled ids on the device,
the next step is launched with them gathered there, and they land after. The tokens equal the in-order engine's
(--deterministic on both, so a batch that holds one more sequence changes no sums), whatever ends a sequence
meanwhile (a stop token, max_tokens, an abort, a preemption), with steps that must sample in order between
(logprobs, a grammar), adapters, and decode graphs; no KV block is left held."""

from conftest import forced_kernels

from loraplex.platform import LLM, SamplingParams
from loraplex.platform.sample.sampler import Sampler
from loraplex.platform.worker.cuda_graphs import FakeCapture

PROMPTS = [list(range(3 + i, 9 + 2 * i)) for i in range(5)]


def engine(model_dir, ahead: bool, **settings) -> LLM:
    return LLM(str(model_dir), dtype="float32", num_kv_blocks=settings.pop("num_kv_blocks", 64), deterministic=True,
               async_scheduling=ahead, **settings)


def tokens(llm: LLM, params: list[SamplingParams], **kwargs) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:len(params)]], params, **kwargs)
    return [o.outputs[0].token_ids for o in outs]


def counted_on_device(monkeypatch) -> list[int]:
    """How many steps sampled on the device (and so ran ahead)."""
    calls = []
    original = Sampler.on_device

    def counting(self, logits, requests):
        calls.append(len(requests))
        return original(self, logits, requests)

    monkeypatch.setattr(Sampler, "on_device", counting)
    return calls


def free_blocks_back(llm: LLM) -> bool:
    kv = llm.engine.core.kv
    return kv.pool.num_free_blocks == llm.engine.core.num_blocks and not kv.req_blocks


def test_plain_sequences_run_ahead_and_give_the_in_order_tokens(tiny_model_dir, monkeypatch):
    """Greedy, seeded sampling, logit_bias and a stop token that ends one sequence early: equal tokens, finish
    reasons, every block back; most steps ran ahead."""
    alone = engine(tiny_model_dir, False).generate({"prompt_token_ids": PROMPTS[3]},
                                                   SamplingParams(temperature=0, max_tokens=6))
    stopper = alone[0].outputs[0].token_ids[2]  # ends the fourth sequence at its third token at the latest
    params = [SamplingParams(temperature=0, max_tokens=7), SamplingParams(temperature=0, max_tokens=12),
              SamplingParams(temperature=0.8, seed=5, top_k=20, max_tokens=9),
              SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stopper]),
              SamplingParams(temperature=0, max_tokens=8, logit_bias={7: 3.0})]
    in_order = engine(tiny_model_dir, False)
    expected = in_order.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    calls = counted_on_device(monkeypatch)
    ahead = engine(tiny_model_dir, True)
    got = ahead.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in expected]
    assert got[3].outputs[0].token_ids[-1] == stopper and len(got[3].outputs[0].token_ids) <= 3
    assert len(calls) >= 8 and free_blocks_back(ahead) and not ahead.engine.has_unfinished()


def test_steps_that_must_sample_in_order_fall_back(tiny_model_dir, monkeypatch):
    """A sequence asking for logprobs, one with a repetition penalty, n = 2: those steps sample in order (the
    others' pending ids landed first); the tokens and logprobs equal the in-order engine's."""
    params = [SamplingParams(temperature=0, max_tokens=6), SamplingParams(temperature=0, max_tokens=5, logprobs=2),
              SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.3),
              SamplingParams(temperature=0.7, seed=3, max_tokens=4, n=2)]
    expected = engine(tiny_model_dir, False).generate([{"prompt_token_ids": p} for p in PROMPTS[:4]], params)
    calls = counted_on_device(monkeypatch)
    got = engine(tiny_model_dir, True).generate([{"prompt_token_ids": p} for p in PROMPTS[:4]], params)
    for a, b in zip(got, expected):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert got[1].outputs[0].logprobs == expected[1].outputs[0].logprobs
    assert not calls  # a non-plain sequence ran in every step


def test_an_abort_and_preemptions_while_a_step_is_in_flight(tiny_model_dir):
    """A KV cache of 9 blocks for five growing sequences (preemptions), and one request aborted while its step
    is in flight: the others' tokens equal the in-order engine's and every block comes back."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    results = []
    for ahead in (False, True):
        llm = engine(tiny_model_dir, ahead, num_kv_blocks=9, block_size=4, max_num_seqs=5)
        core = llm.engine
        for i, prompt in enumerate(PROMPTS):
            core.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
        out: dict[str, list[int]] = {}
        steps = 0
        while core.has_unfinished():
            for o in core.step():
                out.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
            steps += 1
            if steps == 4:
                assert (core.core._in_flight is not None) == ahead  # r2's step launched, its id not read yet
                core.abort("r2")
        assert free_blocks_back(llm) and core.core.scheduler.num_preemptions > 0
        results.append({k: v for k, v in out.items() if k != "r2"})
    assert results[0] == results[1] and len(results[1]) == 4


def test_adapters_and_decode_graphs_ahead(tiny_model_dir, tiny_adapters, monkeypatch):
    """Adapters (stacked slots, Triton in the interpreter) and decode graphs replayed with the pending ids
    gathered into their input buffer: the in-order engine's tokens."""
    names = ["a0", None, "a1"]
    params = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)] * 3
    results, captures = [], []
    with forced_kernels("triton"):
        for ahead in (False, True):
            llm = engine(tiny_model_dir, ahead, max_num_seqs=4, max_loras=2,
                         lora_modules={"a0": str(tiny_adapters[0]), "a1": str(tiny_adapters[1])})
            captures.append(FakeCapture())
            llm.engine.core.enable_graphs(captures[-1])
            calls = counted_on_device(monkeypatch)
            results.append(tokens(llm, params, adapter=names))
    assert results[0] == results[1]
    assert captures[1].replays >= 3 and len(calls) >= 3


def test_a_stop_string_landing_in_a_step_sampled_in_order(tiny_model_dir):
    """A plain sequence's landed id completes its stop string in a step that samples in order (a logprobs
    request joined): one output per sequence and step, the sequence delivered finished, nothing after the stop,
    no group left in the front end. Joining at each of several steps."""
    prompt = list(range(3, 12))
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    reference = engine(tiny_model_dir, False).generate({"prompt_token_ids": prompt}, plain)[0].outputs[0]
    stop = reference.text[1:3]  # completed by an early token
    expected = engine(tiny_model_dir, False).generate(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]))
    for join in range(2, 6):
        llm = engine(tiny_model_dir, True)
        front = llm.engine
        front.add_request("A", {"prompt_token_ids": prompt},
                          SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]))
        outputs = []
        for step in range(1, 60):
            if step == join:
                front.add_request("B", {"prompt_token_ids": list(range(20, 27))},
                                  SamplingParams(temperature=0, max_tokens=3, logprobs=1))
            outputs += [o for o in front.step() if o.request_id == "A"]
            if not front.has_unfinished():
                break
        assert all(len(o.outputs) == 1 for o in outputs), join
        assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
        assert [t for o in outputs for t in o.outputs[0].token_ids] == expected[0].outputs[0].token_ids
        assert "".join(o.outputs[0].text for o in outputs) == expected[0].outputs[0].text
        assert not front.outputs.groups and free_blocks_back(llm)


def test_a_step_that_raises_leaves_no_pending_id_behind(tiny_model_dir):
    """A step fails after its schedule preempted a sequence whose id was still in flight: `abort_running` clears
    the pending ids (the preempted one computes its token again), and the engine goes on to the end."""
    llm = engine(tiny_model_dir, True, num_kv_blocks=9, block_size=4, max_num_seqs=5)
    front, core = llm.engine, llm.engine.core
    for i, prompt in enumerate(PROMPTS):
        front.add_request(f"r{i}", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=24,
                                                                                ignore_eos=True))
    schedule, execute, armed = core.scheduler.schedule, core.executor.execute, []

    def preempting_schedule():
        out = schedule()
        armed.extend(r for r in out.preempted if r.num_pending)
        return out

    def failing_execute(inputs):
        if armed and not failing_execute.failed:
            failing_execute.failed = True
            raise RuntimeError("injected")
        return execute(inputs)

    failing_execute.failed = False
    core.scheduler.schedule, core.executor.execute = preempting_schedule, failing_execute
    for _ in range(200):
        if not front.has_unfinished():
            break
        try:
            front.step()
        except RuntimeError:
            front.abort_running()
            assert all(r.num_pending == 0 for r in core.scheduler.waiting)
    assert failing_execute.failed and not front.has_unfinished() and free_blocks_back(llm)
