"""The engine end to end on a tiny random model: scheduling paths give the same tokens, bad
input is refused, and every block comes back."""

import time
from functools import reduce

import pytest
import torch

from conftest import assert_all_blocks_free
from loraplex.platform import LLM, SamplingParams
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.engine.output_processor import accumulate

PROMPTS = [{"prompt_token_ids": list(range(3 + i, 3 + i + n))} for i, n in enumerate([5, 17, 33, 2, 48, 16])]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """One prompt at a time, no chunking, no prefix cache, plenty of blocks."""
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=128, enable_prefix_caching=False)
    return [tokens(llm.generate([p], GREEDY))[0] for p in PROMPTS]


@pytest.mark.parametrize("args", [
    dict(num_kv_blocks=128),  # all at once
    dict(num_kv_blocks=128, max_num_batched_tokens=16),  # chunked prefill mixed with decodes
    dict(num_kv_blocks=9, max_num_batched_tokens=32),  # forces preemption
    dict(num_kv_blocks=128, max_num_seqs=2),
])
def test_batched_paths_match_one_at_a_time(tiny_model_dir, reference, args):
    llm = LLM(str(tiny_model_dir), dtype="float32", **args)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == reference
    second = llm.generate(PROMPTS, GREEDY)  # prefix-cache hits this time
    assert tokens(second) == reference
    if args["num_kv_blocks"] == 128:
        assert sum(o.num_cached_tokens for o in second) > 0
    else:
        assert llm.engine.core.scheduler.num_preemptions > 0
    assert_all_blocks_free(llm.engine)


def test_outputs_in_order_with_text_and_finish_reasons(tiny_llm):
    tok = tiny_llm.get_tokenizer()
    outs = tiny_llm.generate(["hello world", "the quick"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert [o.prompt for o in outs] == ["hello world", "the quick"]
    for o in outs:
        c = o.outputs[0]
        assert o.finished and c.finish_reason == "length" and len(c.token_ids) == 5
        # a random model may end on half a character: that tail is never emitted
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True).rstrip("\ufffd")
        assert o.prompt_token_ids == tok("hello world").input_ids or o.prompt == "the quick"


def test_stop_conditions(tiny_llm):
    base = tiny_llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    stop_tok = base.token_ids[3]
    first = base.token_ids.index(stop_tok)
    out = tiny_llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_tok]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok and out.token_ids == base.token_ids[:first + 1]
    eos = tiny_llm.engine.eos_token_ids[0]
    out = tiny_llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_tok],
                                                         min_tokens=first + 2, ignore_eos=True))[0].outputs[0]
    assert stop_tok not in out.token_ids[:first + 2] and eos not in out.token_ids[:first + 2]
    if len(base.text) > 4:
        stop = base.text[2:4]
        out = tiny_llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=10, stop=[stop], ignore_eos=True))[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == base.text[:base.text.index(stop)]
    assert_all_blocks_free(tiny_llm.engine)


def test_seeded_sampling_reproduces_whatever_the_batch(tiny_llm):
    p = SamplingParams(temperature=1.0, seed=42, max_tokens=10, ignore_eos=True)
    alone = tokens(tiny_llm.generate([PROMPTS[2]], p))[0]
    noise = SamplingParams(temperature=1.0, max_tokens=7, ignore_eos=True)
    mixed = tiny_llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[4]], [noise, p, noise])
    assert tokens(mixed)[1] == alone


def test_n_greater_than_one_shares_the_prompt_blocks(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64)
    greedy = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    out = llm.generate([PROMPTS[2]], SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.token_ids == greedy.outputs[0].token_ids for c in out.outputs)
    sampled = llm.generate([PROMPTS[2]], SamplingParams(n=4, temperature=1.5, seed=3, max_tokens=8, ignore_eos=True))[0]
    assert len({tuple(c.token_ids) for c in sampled.outputs}) > 1
    assert_all_blocks_free(llm.engine)


def test_n_greater_than_one_copies_on_write(tiny_model_dir):
    """33-token prompt: its third block is partial and shared by the forks, so each write copies."""
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64)
    engine = llm.engine
    engine.add_request("r", PROMPTS[2], SamplingParams(n=3, temperature=0, max_tokens=4, ignore_eos=True))
    copies = []
    while engine.has_unfinished():
        sched = engine.core.scheduler.schedule
        def spy():
            out = sched()
            copies.extend(out.block_copies)
            return out
        engine.core.scheduler.schedule = spy
        engine.step()
        engine.core.scheduler.schedule = sched
    assert len(copies) == 2  # two of the three sequences copy; the last owner writes in place
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("prompt,params,field", [
    ({"prompt_token_ids": [5] * 600}, SamplingParams(max_tokens=1), "max_model_len"),
    ({"prompt_token_ids": [5] * 500}, SamplingParams(max_tokens=100), "max_tokens"),
    ("", SamplingParams(), "empty"),
    ({"prompt_token_ids": []}, SamplingParams(), "empty"),
    ({"prompt_token_ids": [3, 100000]}, SamplingParams(), "prompt_token_ids"),
    ({"prompt_token_ids": [3, -1]}, SamplingParams(), "prompt_token_ids"),
    ({"prompt_token_ids": [3]}, SamplingParams(stop_token_ids=[99999]), "stop_token_ids"),
])
def test_bad_input_is_refused_and_the_engine_keeps_serving(tiny_llm, prompt, params, field):
    with pytest.raises(ValueError, match=field):
        tiny_llm.generate([PROMPTS[0], prompt], [GREEDY, params])
    assert_all_blocks_free(tiny_llm.engine)
    assert len(tiny_llm.generate([PROMPTS[0]], GREEDY)[0].outputs[0].token_ids) == 12


def test_request_larger_than_the_cache_is_refused(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=4, block_size=16)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        llm.generate([{"prompt_token_ids": [3] * 60}], SamplingParams(max_tokens=10))


def test_abort_frees_blocks_at_once(tiny_llm):
    engine = tiny_llm.engine
    for i, p in enumerate(PROMPTS[:3]):
        engine.add_request(f"a{i}", p, SamplingParams(n=2, temperature=1.0, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.core.kv.num_free_blocks < engine.core.kv.pool.num_blocks
    outs = [engine.abort(f"a{i}") for i in range(3)]
    assert all(o.finished and all(c.finish_reason == "abort" for c in o.outputs) for o in outs)
    assert engine.abort("a0") is None
    assert_all_blocks_free(engine)


def test_async_engine_streams_and_aborts(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64)
    front = AsyncEngine(llm.engine)
    try:
        with pytest.raises(ValueError, match="empty"):
            front.submit({"prompt_token_ids": []}, GREEDY)
        rid = front.submit(PROMPTS[1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        outs = list(front.stream(rid, timeout=30))
        whole = reduce(accumulate, outs, None)
        assert outs[-1].finished and len(whole.outputs[0].token_ids) == 6
        assert all(len(o.outputs[0].token_ids) == 1 for o in outs)  # deltas: one new token per step
        long = front.submit(PROMPTS[2], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        stream = front.stream(long, timeout=30)
        next(stream)
        front.abort(long)
        rest = list(stream)
        assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
        assert len(reduce(accumulate, rest, None).outputs[0].token_ids) < 400
    finally:
        front.shutdown()
    assert_all_blocks_free(llm.engine)


def test_async_generate_leaving_early_aborts(tiny_model_dir):
    import asyncio

    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64)
    front = AsyncEngine(llm.engine)

    async def consume_two():
        n = 0
        async for _ in front.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)):
            n += 1
            if n == 2:
                break
        return n

    try:
        assert asyncio.run(consume_two()) == 2
        for _ in range(200):
            if not llm.engine.has_unfinished():
                break
            import time
            time.sleep(0.05)
    finally:
        front.shutdown()
    assert_all_blocks_free(llm.engine)


def test_float16_kv_cache_holds_twice_the_blocks_and_stays_close(tiny_model_dir):
    from loraplex.platform.config import EngineConfig
    from loraplex.platform.engine.llm_engine import Engine

    engines = {kv: Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_memory=1 << 22,
                                       kv_cache_dtype=kv)) for kv in ("auto", "float16")}
    assert engines["float16"].core.kv.pool.num_blocks == 2 * engines["auto"].core.kv.pool.num_blocks
    assert engines["float16"].core.executor.worker.runner.kv_cache.dtype == torch.float16
    logits = {kv: chunked_logits(engine, list(range(5, 45))) for kv, engine in engines.items()}
    torch.testing.assert_close(logits["float16"], logits["auto"], atol=2e-2, rtol=2e-2)


def chunked_logits(engine, ids: list[int]) -> torch.Tensor:
    """The last position's logits after a prefill chunk, a short chunk (C kernel) and a decode-sized one."""
    from loraplex.platform.core.scheduler import SchedulerOutput

    req = engine.inputs.process("r", {"prompt_token_ids": ids}, SamplingParams(max_tokens=1))
    for chunk in (30, 9, 1):
        assert engine.core.kv.allocate_slots(req, chunk) is not None
        out, _ = engine.core.executor.execute(engine.core.batch.build(SchedulerOutput([(req, chunk)]), {}).inputs)
        req.num_computed_tokens += chunk
    return out.float()


@pytest.mark.parametrize("model_dtype", ["float32", "bfloat16"])
def test_fp8_kv_cache_holds_a_byte_a_value_and_stays_close(tiny_model_dir, model_dtype):
    """`--kv-cache-dtype fp8` (vLLM's name; float8 e4m3): one byte a value, written and read by the C
    kernels (prefill chunks through the reference, which reads the same bytes)."""
    from loraplex.platform.config import EngineConfig
    from loraplex.platform.engine.llm_engine import Engine

    engines = {kv: Engine(EngineConfig(model=str(tiny_model_dir), dtype=model_dtype, kv_cache_memory=1 << 22,
                                       kv_cache_dtype=kv)) for kv in ("auto", "fp8")}
    ratio = 4 if model_dtype == "float32" else 2
    assert engines["fp8"].core.kv.pool.num_blocks == ratio * engines["auto"].core.kv.pool.num_blocks
    assert engines["fp8"].core.executor.worker.runner.kv_cache.dtype == torch.float8_e4m3fn
    logits = {kv: chunked_logits(engine, list(range(5, 45))) for kv, engine in engines.items()}
    # e4m3 keeps 3 mantissa bits (up to ~6% per value): measured max |diff| 0.048 (float32) / 0.046 (bf16)
    # on logits up to 2.2
    assert (logits["fp8"] - logits["auto"]).abs().max() < 0.1
    assert torch.equal(logits["fp8"].argmax(-1), logits["auto"].argmax(-1))


def test_bad_kv_cache_dtype_is_refused(tiny_model_dir, monkeypatch):
    from loraplex.platform.config import EngineConfig
    from loraplex.platform.engine.llm_engine import Engine

    for bad in ("fp8_e5m2", "int4"):
        with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
            EngineConfig(model="x", kv_cache_dtype=bad)
    monkeypatch.setenv("LORAPLEX_KERNELS", "triton")  # read once, as the engine resolves its config
    with pytest.raises(ValueError, match="kv_cache_dtype fp8 runs the CPU kernels"):
        Engine(EngineConfig(model=str(tiny_model_dir), kv_cache_dtype="fp8", num_kv_blocks=8))


def unread_after_a_stall(model_dir, prompts: int, blocked: bool, limit_message: str) -> list:
    """One call of `prompts` 300-token requests on an AsyncEngine that lets 8 outputs a sequence
    wait: its first output read, then none while the engine goes on; the outputs read after (its
    error raised). `blocked`: the reader's loop runs nothing meanwhile (a busy event loop), so what
    the engine publishes waits on its way to the queue, where it counts as unread too."""
    import asyncio

    from loraplex.platform.engine.async_engine import ClientTooSlowError

    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64)
    front = AsyncEngine(llm.engine, max_unread_outputs=8)
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)

    async def read_one_then_stall():
        outputs = front.generate_many(PROMPTS[:prompts], [params] * prompts, [None] * prompts)
        await anext(outputs)
        for _ in range(300):  # the client stops reading; the engine goes on generating
            if not llm.engine.has_unfinished():
                break
            time.sleep(0.02) if blocked else await asyncio.sleep(0.02)
        items = []
        with pytest.raises(ClientTooSlowError, match=limit_message):
            async for _, out in outputs:
                items.append(out)
        return items

    try:
        unread = asyncio.run(read_one_then_stall())
    finally:
        front.shutdown()
    assert_all_blocks_free(llm.engine)
    return unread


# blocked: the engine generated all 300 while the queue's size, which the bound read, stayed 0
@pytest.mark.parametrize("blocked", [False, True])
def test_a_reader_that_stops_reading_is_aborted_not_buffered_forever(tiny_model_dir, blocked):
    unread = unread_after_a_stall(tiny_model_dir, 1, blocked, "more than 8 outputs were left unread")
    assert len(unread) <= 8  # what was buffered before the abort
    assert sum(len(o.outputs[0].token_ids) for o in unread) < 299


def test_the_unread_bound_of_a_call_counts_each_of_its_sequences(tiny_model_dir):
    """Three prompts in one call: 3 x 8 outputs may wait unread (one step gives three), not 8."""
    assert 8 < len(unread_after_a_stall(tiny_model_dir, 3, True, "more than 24 outputs")) <= 24


@pytest.mark.parametrize("args", [dict(num_kv_blocks=128, max_num_batched_tokens=16),  # chunked, cache warm
                                  dict(num_kv_blocks=9, max_num_batched_tokens=32)])  # preempted, recomputed
def test_prompt_logprobs_match_a_whole_forward_pass(tiny_model_dir, args):
    from transformers import AutoModelForCausalLM

    llm = LLM(str(tiny_model_dir), dtype="float32", **args)
    llm.generate(PROMPTS, GREEDY)  # the prompts are in the prefix cache: these must still compute every position
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=3, n=2)
    outs = llm.generate(PROMPTS, params)
    assert args["num_kv_blocks"] == 128 or llm.engine.core.scheduler.num_preemptions > 0
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for prompt, out in zip(PROMPTS, outs):
        ids = prompt["prompt_token_ids"]
        with torch.no_grad():
            expected = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), -1)
        got = out.prompt_logprobs
        assert len(got) == len(ids) and got[0] is None
        for i in range(1, len(ids)):
            assert got[i][ids[i]].logprob == pytest.approx(float(expected[i - 1, ids[i]]), abs=1e-4)
            assert got[i][ids[i]].decoded_token is not None
            top = sorted((lp.rank, t) for t, lp in got[i].items() if lp.rank <= 3)
            assert [t for _, t in top] == expected[i - 1].topk(3).indices.tolist()
    assert all(o.prompt_logprobs is None for o in llm.generate(PROMPTS[:1], GREEDY))
    assert_all_blocks_free(llm.engine)


def test_chat_renders_tools_and_constrained_calls_come_back(tiny_llm, monkeypatch):
    """vLLM's LLM.chat: tools into the template, OpenAI-style string arguments taken, and with a
    tools spec in the params every output is a valid call."""
    import json

    from loraplex.grammar.backend import StructuredOutputs
    from loraplex.grammar.tooling.tools import Function, ToolCalls, parse_tool_calls

    tokenizer = tiny_llm.get_tokenizer()
    monkeypatch.setattr(tokenizer, "chat_template", "{% for t in tools or [] %}{{ t.function.name }}{% endfor %}"
                        "{% for m in messages %}{{ m.content or '' }}{% for c in m.tool_calls or [] %}"
                        "{{ c.function.arguments.n }}{% endfor %}{% endfor %}")
    tools = [{"type": "function", "function": {"name": "count", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["n"],
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}}}]
    turn = [{"role": "user", "content": "hello"},
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                  "function": {"name": "count", "arguments": '{"n": 7}'}}]}]
    rendered = tiny_llm.engine.inputs.chat_token_ids([turn[0]], True, None, tools)
    assert tokenizer.decode(rendered).startswith("count")
    spec = StructuredOutputs(tools=ToolCalls((Function("count", tools[0]["function"]["parameters"]),), required=True))
    outs = tiny_llm.chat([turn, turn[:1]], SamplingParams(max_tokens=80, seed=1, structured=spec), tools=tools)
    assert tokenizer.decode(outs[0].prompt_token_ids).endswith("hello7")  # the string arguments, as an object
    for out in outs:
        content, calls = parse_tool_calls(out.outputs[0].text)
        assert content is None and [c.name for c in calls] == ["count"] and 0 <= json.loads(calls[0].arguments)["n"] <= 9


def test_prompt_logprobs_with_unpacked_weights(tiny_model_dir):
    """Bug: weights that are not prepacked (bfloat16 without native bf16 here, every weight on
    CUDA) required grad, so prompt logprobs (computed outside inference_mode) raised in the step
    and aborted every running request."""
    llm = LLM(str(tiny_model_dir), dtype="bfloat16", num_kv_blocks=32)
    assert not any(p.requires_grad for p in llm.engine.core.executor.worker.model.parameters())
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=1)
    out = llm.generate([PROMPTS[0], PROMPTS[1]], [params, GREEDY])
    assert len(out[0].prompt_logprobs) == len(PROMPTS[0]["prompt_token_ids"]) and len(out[1].outputs[0].token_ids) > 0
