"""Many adapters in one batch give, token for token, what peft gives for each adapter alone."""

import pytest
import torch

from conftest import assert_all_blocks_free, make_peft_adapter, peft_greedy
from loraplex.platform import LLM, SamplingParams

NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)


def prompts_for(n, shared_prefix=0):
    prefix = list(range(100, 100 + shared_prefix))
    return [prefix + list(range(3 + i, 3 + i + 5 + 3 * i)) for i in range(n)]


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def names(tiny_adapters):
    return [f"ad{i}" for i in range(len(tiny_adapters))]


@pytest.mark.parametrize("max_loras,shared_prefix", [(8, 0), (2, 0), (8, 40)])
def test_eight_adapters_in_one_call_match_peft(tiny_model_dir, tiny_adapters, names, max_loras, shared_prefix):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=128, max_loras=max_loras,
              lora_modules=dict(zip(names, map(str, tiny_adapters))))
    prompts = prompts_for(8, shared_prefix) + prompts_for(1, shared_prefix)
    adapters = names + [None]
    got = tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, adapter=adapters))
    want = peft_greedy(tiny_model_dir, list(tiny_adapters) + [None], prompts, NEW)
    assert got == want
    assert len({tuple(t) for t in got}) > 4  # the adapters really change the outputs
    if max_loras == 2:
        assert llm.engine.adapters.num_slot_loads > 2  # slots were swapped between steps
    if shared_prefix:  # same prefix, different adapters: no block is shared across adapters
        again = llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, adapter=names[0])
        assert again[0].num_cached_tokens > 0 and tokens(again)[0] == want[0]
    assert_all_blocks_free(llm.engine)
    assert llm.engine.adapters.num_pins() == 0


def test_same_prompt_under_two_adapters_never_shares_kv(tiny_model_dir, tiny_adapters, names):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64,
              lora_modules={"x": str(tiny_adapters[0]), "y": str(tiny_adapters[1])})
    prompt = {"prompt_token_ids": list(range(3, 60))}
    first = llm.generate([prompt], GREEDY, adapter="x")[0]
    second = llm.generate([prompt], GREEDY, adapter="y")[0]
    base = llm.generate([prompt], GREEDY)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 0 and base.num_cached_tokens == 0
    assert llm.generate([prompt], GREEDY, adapter="x")[0].num_cached_tokens == 48


def test_reloaded_name_never_reuses_the_old_adapters_kv(tiny_model_dir, tiny_adapters):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, lora_modules={"tuned": str(tiny_adapters[0])})
    prompt = [{"prompt_token_ids": list(range(3, 60))}]
    old = tokens(llm.generate(prompt, GREEDY, adapter="tuned"))[0]
    llm.unload_adapter("tuned")
    llm.load_adapter("tuned", str(tiny_adapters[2]))
    new = llm.generate(prompt, GREEDY, adapter="tuned")[0]
    assert new.num_cached_tokens == 0  # the old adapter's cached blocks are not hit
    assert new.outputs[0].token_ids == peft_greedy(tiny_model_dir, [tiny_adapters[2]], [prompt[0]["prompt_token_ids"]], NEW)[0]
    assert new.outputs[0].token_ids != old


def test_unknown_adapter_and_in_use_unload(tiny_model_dir, tiny_adapters):
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, lora_modules={"a": str(tiny_adapters[0])})
    with pytest.raises(ValueError, match="unknown adapter 'nope'"):
        llm.generate(["hello"], GREEDY, adapter=["a", "nope"][1:])
    engine = llm.engine
    engine.add_request("r", {"prompt_token_ids": [3, 4, 5]}, GREEDY, adapter="a")
    engine.step()
    with pytest.raises(ValueError, match="in use"):
        llm.unload_adapter("a")
    engine.abort("r")
    assert engine.adapters.num_pins() == 0
    llm.unload_adapter("a")
    assert_all_blocks_free(engine)


def test_256_registered_64_in_flight(tiny_model_dir, tmp_path):
    sources = [make_peft_adapter(tiny_model_dir, tmp_path / f"s{i}", rank=r, seed=50 + i, scale=0.5)
               for i, r in enumerate((1, 2, 4, 8))]
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=256, max_loras=64, max_lora_rank=8,
              max_cpu_loras=256, max_num_seqs=64)
    for i in range(256):
        llm.load_adapter(f"lora-{i}", str(sources[i % 4]))
    chosen = [f"lora-{i * 4 + (i % 4)}" for i in range(64)]  # 64 distinct names, all four ranks
    prompts = prompts_for(64)
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=NEW, ignore_eos=True)
    batched = tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], params, adapter=chosen))
    adapters = llm.engine.adapters
    assert len(llm.engine.core.scheduler.running) == 0 and adapters.num_slot_loads + adapters.num_preloads >= 64
    alone = [tokens(llm.generate([{"prompt_token_ids": p}], params, adapter=a))[0]
             for p, a in list(zip(prompts, chosen))[:12]]
    assert batched[:12] == alone
    greedy = tokens(llm.generate([{"prompt_token_ids": p} for p in prompts[:8]], GREEDY, adapter=chosen[:8]))
    assert greedy == peft_greedy(tiny_model_dir, [sources[int(a.split("-")[1]) % 4] for a in chosen[:8]], prompts[:8], NEW)
    assert_all_blocks_free(llm.engine)


def test_layers_to_transform_matches_peft(tiny_model_dir, tmp_path):
    """An adapter on the top layer only (peft's layers_to_transform) is served exactly as peft."""
    folder = make_peft_adapter(tiny_model_dir, tmp_path / "top", rank=8, seed=3, layers_to_transform=[1])
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, lora_modules={"top": str(folder)})
    prompts = prompts_for(3)
    got = tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, adapter="top"))
    assert got == peft_greedy(tiny_model_dir, [folder] * 3, prompts, NEW)
    assert got != tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY))


def test_more_adapters_than_memory_holds_match_peft_and_the_engine_thread_never_reads_disk(
        tiny_model_dir, tiny_adapters, names, monkeypatch):
    """lora_memory holds two adapters of the eight: every other one is evicted and re-read from
    disk (its prepared file), never in the engine thread; mixed ranks (8 and 16), two slots, peft's tokens."""
    import threading
    from functools import reduce

    from loraplex.adapters import registry as registry_module
    from loraplex.adapters.peft_format import adapter_bytes
    from loraplex.platform.engine.async_engine import AsyncEngine
    from loraplex.platform.config import EngineConfig
    from loraplex.platform.models.registry import read_model_config
    from loraplex.platform.engine.llm_engine import Engine
    from loraplex.platform.engine.output_processor import accumulate

    two = 2 * adapter_bytes(read_model_config(tiny_model_dir), 16, torch.float32)
    engine = Engine(EngineConfig(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=128, lora_memory=two,
                                 max_num_seqs=2))
    assert engine.max_loras == 2  # derived from lora_memory
    for name, path in zip(names, tiny_adapters):
        engine.adapters.load(name, str(path))
    assert engine.adapters.memory()[0] < 8 and engine.adapters.memory()[1] <= two
    reads: list[str] = []
    real, spilled = registry_module.read_peft_adapter, engine.adapters.spill.read
    monkeypatch.setattr(registry_module, "read_peft_adapter",
                        lambda *a, **k: reads.append(threading.current_thread().name) or real(*a, **k))
    monkeypatch.setattr(engine.adapters.spill, "read",
                        lambda *a, **k: reads.append(threading.current_thread().name) or spilled(*a, **k))
    front = AsyncEngine(engine)
    prompts = prompts_for(8)
    order = [0, 5, 2, 7, 1, 4, 3, 6]
    try:
        ids = [front.submit({"prompt_token_ids": prompts[i]}, GREEDY, adapter=names[i]) for i in order]
        got = {i: reduce(accumulate, front.stream(rid, timeout=60), None).outputs[0].token_ids
               for i, rid in zip(order, ids)}
    finally:
        front.shutdown()
    assert [got[i] for i in range(8)] == peft_greedy(tiny_model_dir, list(tiny_adapters), prompts, NEW)
    assert reads and "loraplex-engine" not in reads  # evicted adapters came back, never on the engine thread
    assert engine.adapters.num_pins() == 0 and engine.adapters.memory()[1] <= two
