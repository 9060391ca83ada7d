"""Adapters combined per request (#41): a request's mix [(name, weight), ...] adds
sum_i w_i * (alpha_i / r_i) * B_i A_i x, what peft's `add_weighted_adapter(..., "cat")` builds, with
requests of different mixes, plain adapters and the base model in one batch."""

import pytest
import torch

from conftest import forced_kernels

from loraplex.kernels import cpu_kernels
from loraplex.kernels.lora_batch import LoRABatch
from loraplex.kernels.sgmv import LoRATable, StackedLoRA, sgmv_lora_stacked_reference, sgmv_lora_table_torch

needs_kernel = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler")


def _case(seed: int, num_tokens: int = 11, num_slots: int = 3, widths=(24, 8), in_features: int = 20):
    """Random adapters (ranks 2..4, two slices) as a table and stacked, token slots and weights."""
    g = torch.Generator().manual_seed(seed)
    offsets = [0, widths[0], sum(widths)]
    table = LoRATable.empty(num_slots, offsets)
    stacked = StackedLoRA.empty(num_slots, offsets, in_features, 4, torch.float32, torch.device("cpu"))
    for slot in range(num_slots):
        r = 2 + slot % 3
        a = torch.randn(2 * r, in_features, generator=g)
        b = torch.randn(r, sum(widths), generator=g)
        table.set(slot, a, b, 0.5 + slot)
        stacked.set(slot, a, b, 0.5 + slot)
    slots = torch.randint(-1, num_slots, (num_tokens,), generator=g).tolist()
    weights = (torch.rand(num_tokens, generator=g) * 8 - 4).tolist()
    x = torch.randn(num_tokens, in_features, generator=g)
    y0 = torch.randn(num_tokens, sum(widths), generator=g)
    return table, stacked, slots, weights, x, y0


def _dense(table: LoRATable, slots, weights, x, y0):
    """y0 + w_t * scale_s * x A_s^T Bt_s, token by token."""
    y = y0.clone()
    for t, (s, w) in enumerate(zip(slots, weights)):
        if s >= 0:
            r = table.ranks[s]
            h = x[t] @ table.a[s].T
            for i, (lo, hi) in enumerate(zip(table.offsets[:-1], table.offsets[1:])):
                y[t, lo:hi] += w * table.scales[s] * (h[i * r:(i + 1) * r] @ table.b[s][:, lo:hi])
    return y


@pytest.mark.parametrize("seed", [0, 1])
def test_token_weights_in_every_lora_path_match_a_dense_reference(seed):
    table, stacked, slots, weights, x, y0 = _case(seed)
    expected = _dense(table, slots, weights, x, y0)
    batch = LoRABatch.build(slots, token_weights=weights)
    tol = dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(sgmv_lora_table_torch(x, table, batch, y0.clone()), expected, **tol)
    torch.testing.assert_close(sgmv_lora_stacked_reference(x, stacked, batch, y0.clone()), expected, **tol)
    if cpu_kernels.library() is not None:
        got = cpu_kernels.sgmv_lora_table_c(x, table, batch.token_order, batch.order_slots, y0.clone(),
                                            batch.order_weights)
        torch.testing.assert_close(got, expected, **tol)


def test_contiguous_prefill_rows_take_their_weights():
    """A segment of contiguous rows (one request's prefill chunk) adds in place: weighted too."""
    table, _, _, _, x, y0 = _case(2)
    slots, weights = [1] * 6 + [2] * 5, [0.7] * 6 + [-0.3] * 5
    batch = LoRABatch.build(slots, token_weights=weights)
    assert all(rows is not None for rows in batch.host_ranges)
    torch.testing.assert_close(sgmv_lora_table_torch(x, table, batch, y0.clone()),
                               _dense(table, slots, weights, x, y0), atol=1e-4, rtol=1e-4)


@needs_kernel
def test_c_kernel_without_weights_is_bit_identical_to_unit_weights_and_unchanged():
    """NULL weights: the slot's scale alone (the path every plain-adapter step takes)."""
    table, _, slots, _, x, y0 = _case(3)
    plain = LoRABatch.build(slots)
    assert plain.order_weights is None
    got = cpu_kernels.sgmv_lora_table_c(x, table, plain.token_order, plain.order_slots, y0.clone())
    ones = LoRABatch.build(slots, token_weights=[1.0] * len(slots))
    unit = cpu_kernels.sgmv_lora_table_c(x, table, ones.token_order, ones.order_slots, y0.clone(),
                                         ones.order_weights)
    assert torch.equal(got, unit)
    torch.testing.assert_close(got, _dense(table, slots, [1.0] * len(slots), x, y0), atol=1e-4, rtol=1e-4)


def test_triton_expand_takes_token_weights():
    pytest.importorskip("triton")
    from loraplex.kernels.sgmv import sgmv_lora_stacked_triton

    table, stacked, slots, weights, x, y0 = _case(4, num_tokens=19)
    weighted = sgmv_lora_stacked_triton(x, stacked, LoRABatch.build(slots, token_weights=weights), y0.clone())
    plain = sgmv_lora_stacked_triton(x, stacked, LoRABatch.build(slots), y0.clone())
    torch.testing.assert_close(weighted, _dense(table, slots, weights, x, y0), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(plain, _dense(table, slots, [1.0] * len(slots), x, y0), atol=2e-3, rtol=2e-3)


# ---- the engine: mixes, plain adapters and the base model in one batch ---------------------------

from loraplex.platform import LLM, SamplingParams  # noqa: E402
from loraplex.platform.adapter_mix import AdapterMix  # noqa: E402
from loraplex.platform.engine.output_processor import accumulate  # noqa: E402
from tests.conftest import assert_all_blocks_free  # noqa: E402

MIXES = [
    [("a0", 0.7), ("a1", 0.3)],
    [("a1", 1.0), ("a2", -0.5)],  # a negative weight
    [("a0", 0.5)],  # one adapter at weight 0.5
    {"a2": 0.4, "a0": 0.6, "a1": -0.2},  # three adapters: three passes
]
PROMPTS = [list(range(3, 3 + n)) for n in (5, 9, 14, 7, 11, 6)]
REQUEST_ADAPTERS = [*MIXES, "a1", None]  # four mixes, a plain adapter and the base model
NEW_TOKENS = 5


def _peft_mix_greedy(base_dir, adapter_dirs: dict, specs, prompts) -> list[list[int]]:
    """peft's greedy tokens, each mix built with `add_weighted_adapter(..., combination_type="cat")`."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    base.generation_config.eos_token_id = None
    (first, first_dir), *rest = adapter_dirs.items()
    model = PeftModel.from_pretrained(base, first_dir, adapter_name=first).eval()
    for name, folder in rest:
        model.load_adapter(folder, adapter_name=name)
    out = []
    for i, (ids, spec) in enumerate(zip(prompts, specs)):
        pairs = list(spec.items()) if isinstance(spec, dict) else spec
        if isinstance(pairs, list):
            model.add_weighted_adapter([n for n, _ in pairs], [w for _, w in pairs], f"mix{i}",
                                       combination_type="cat")
        with torch.no_grad():
            if spec is None:
                with model.disable_adapter():
                    g = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
            else:
                model.set_adapter(f"mix{i}" if isinstance(pairs, list) else spec)
                g = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        out.append(g[0, len(ids):].tolist())
    return out


@pytest.fixture(scope="module")
def mix_adapters(tiny_adapters) -> dict:
    return {"a0": str(tiny_adapters[0]), "a1": str(tiny_adapters[1]), "a2": str(tiny_adapters[2])}


@pytest.fixture(scope="module")
def peft_mix_tokens(tiny_model_dir, mix_adapters) -> list[list[int]]:
    return _peft_mix_greedy(tiny_model_dir, mix_adapters, REQUEST_ADAPTERS, PROMPTS)


def _run_one_batch(llm: LLM, prompts, adapters) -> list[list[int]]:
    """Every request admitted in the first step (one batch); their greedy tokens."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    requests = [engine.inputs.process(f"m{i}", {"prompt_token_ids": p}, params, a)
                for i, (p, a) in enumerate(zip(prompts, adapters))]
    for req in requests:
        engine.add(req)
    totals = {}
    first = True
    while engine.has_unfinished():
        for out in engine.step():
            totals[out.request_id] = accumulate(totals.get(out.request_id), out)
        if first:  # slots by distinct adapters: the mixes' a0 / a1 / a2 fit max_loras=3 together
            assert len(engine.core.scheduler.running) == len(prompts)
            assert engine.core.scheduler.running_adapters() == {"a0", "a1", "a2"}
            first = False
    assert engine.adapters.num_pins() == 0
    assert_all_blocks_free(engine)
    return [totals[r.request_id].outputs[0].token_ids for r in requests]


def test_the_mixes_change_the_tokens(peft_mix_tokens):
    """What the comparisons below rest on: every mix, the plain adapter and the base model differ."""
    assert len({tuple(tokens) for tokens in peft_mix_tokens}) == len(peft_mix_tokens)


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_mixes_in_one_batch_match_peft_weighted_adapters(tiny_model_dir, mix_adapters, peft_mix_tokens, backend,
                                                         monkeypatch):
    """CPU tables (the C kernel for decode steps, per-segment GEMMs for prefill) and the stacked Triton
    path under the interpreter: each mix gives the tokens of peft's combined adapter."""
    if backend == "triton":
        pytest.importorskip("triton")
    weighted_c_calls = []
    kernel = cpu_kernels.sgmv_lora_table_c
    monkeypatch.setattr(cpu_kernels, "sgmv_lora_table_c",
                        lambda *args: weighted_c_calls.append(args[5] is not None) or kernel(*args))
    with forced_kernels(backend):
        llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_loras=3, lora_modules=mix_adapters)
        assert llm.engine.adapters.slots.stacked == (backend == "triton")
        assert _run_one_batch(llm, PROMPTS, REQUEST_ADAPTERS) == peft_mix_tokens
    if backend == "auto" and cpu_kernels.library() is not None:
        assert any(weighted_c_calls)  # the decode steps' mixes went through the C kernel's weights


@pytest.fixture(scope="module")
def mix_llm(tiny_model_dir, mix_adapters) -> LLM:
    return LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_loras=3, block_size=4,
               max_adapters_per_request=3, lora_modules=mix_adapters)


@pytest.mark.parametrize("spec,field", [
    ([], "at least one adapter"),
    ([("a0", float("nan"))], "adapter[0].weight"),
    ([("a0", float("inf"))], "adapter[0].weight"),
    ([("a0", 4.5)], "adapter[0].weight"),
    ([("a0", "0.5")], "adapter[0].weight"),
    ([("a0", 0.5), ("a0", 0.2)], "'a0' appears more than once"),
    ({"a0": 0.1, "a1": 0.1, "a2": 0.1, "a3": 0.1}, "max_adapters_per_request"),
    ([("", 0.5)], "adapter[0]"),
    ([("a0",)], "(adapter name, weight) pairs"),
])
def test_invalid_mixes_are_refused_naming_the_field(mix_llm, spec, field):
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                       .replace(")", r"\)")):
        mix_llm.generate([[3, 4, 5]], params, adapter=[spec])
    assert mix_llm.engine.adapters.num_pins() == 0 and not mix_llm.engine.has_unfinished()


def test_an_unknown_adapter_in_a_mix_pins_none(mix_llm):
    with pytest.raises(ValueError, match="unknown adapter 'zz'"):
        mix_llm.generate([[3, 4, 5]], SamplingParams(max_tokens=2), adapter=[[("a0", 0.5), ("zz", 0.5)]])
    assert mix_llm.engine.adapters.num_pins() == 0


def test_a_mix_of_one_at_weight_one_is_the_plain_adapter(mix_llm):
    process = mix_llm.engine.inputs.process
    req = process("p", [3, 4, 5], SamplingParams(max_tokens=2), AdapterMix((("a1", 1.0),)))
    assert (req.adapter, req.mix, req.adapter_names) == ("a1", None, ("a1",))
    req = process("q", [3, 4, 5], SamplingParams(max_tokens=2), {"a1": 0.5, "a0": 0.5})
    assert req.adapter is None and req.mix.entries == (("a1", 0.5), ("a0", 0.5))


def test_prefix_cache_keys_by_the_mix(mix_llm):
    """The same prompt under the same mix reuses its KV; under another mix, another weight, the plain
    adapter or the base model it does not."""
    engine, prompt = mix_llm.engine, {"prompt_token_ids": list(range(3, 3 + 21))}
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    def hits(adapter) -> int:
        before = engine.core.kv.num_hits
        mix_llm.generate([prompt], params, adapter=[adapter])
        assert engine.adapters.num_pins() == 0
        assert_all_blocks_free(engine)
        return engine.core.kv.num_hits - before

    assert hits([("a0", 0.7), ("a1", 0.3)]) == 0
    assert hits([("a0", 0.7), ("a1", 0.3)]) > 0  # the same mix
    for other in ([("a0", 0.6), ("a1", 0.4)], [("a0", 0.7), ("a2", 0.3)], [("a0", 0.7)], "a0", None):
        assert hits(other) == 0


def test_a_mix_waits_for_its_slots_and_shares_the_ones_it_has(tiny_model_dir, mix_adapters):
    """max_loras=2: a mix of a0 + a1 runs beside plain a0 (two slots); the mix of a1 + a2 would make three
    and waits until a0 leaves, then runs; every step's adapters fit the slots, and nothing stays pinned."""
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_loras=2, lora_modules=mix_adapters)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for i, adapter in enumerate([[("a0", 0.5), ("a1", 0.5)], [("a1", 0.5), ("a2", 0.5)], "a0"]):
        engine.add(engine.inputs.process(f"w{i}", [3, 4, 5, 6], params, adapter))
    running = []
    while engine.has_unfinished():
        engine.step()
        names = engine.core.scheduler.running_adapters()
        assert len(names) <= 2
        running.append({r.request_id for r in engine.core.scheduler.running})
    assert running[0] == {"w0", "w2"}
    assert any("w1" in ids for ids in running)
    assert engine.adapters.num_pins() == 0
    assert_all_blocks_free(engine)


def test_an_adapter_on_the_embedding_is_refused_in_a_mix(tiny_model_dir, mix_adapters, tmp_path):
    """The embedding and the head take one adapter per token: a mix with such an adapter is a ValueError,
    while the adapter alone still serves."""
    from tests.conftest import make_peft_adapter

    emb = make_peft_adapter(tiny_model_dir, tmp_path / "emb", rank=4, targets=["q_proj", "embed_tokens"])
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=32, max_loras=2,
              lora_modules={"a0": mix_adapters["a0"], "emb": str(emb)})
    with pytest.raises(ValueError, match="'emb' adapts embed_tokens"):
        llm.generate([[3, 4, 5]], SamplingParams(max_tokens=2), adapter=[[("a0", 0.5), ("emb", 0.5)]])
    assert llm.engine.adapters.num_pins() == 0
    assert len(llm.generate([[3, 4, 5]], SamplingParams(max_tokens=2), adapter="emb")[0].outputs[0].token_ids) == 2
