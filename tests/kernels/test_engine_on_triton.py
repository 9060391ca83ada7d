"""The whole engine with its attention forced through the Triton kernels (the interpreter on
CPU) gives the same greedy tokens as the PyTorch path."""

import pytest

from conftest import forced_kernels
from loraplex.platform import LLM, SamplingParams

pytest.importorskip("triton")


@pytest.mark.parametrize("block_size", [16, 4])
def test_engine_tokens_match_across_kernel_backends(tiny_model_dir, block_size):
    """Block size 4 too: the Triton kernel tiles KV across blocks (tl.dot needs tiles of >= 16 positions)."""
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 21, 40)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        with forced_kernels(backend):  # read as the engine is built: its kernels are chosen then
            llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=32 * 16 // block_size,
                      block_size=block_size, max_num_batched_tokens=24, enable_prefix_caching=False)
        assert llm.engine.resolved.kernels.backend == ("native" if backend == "torch" else "triton")
        results[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert results["triton"] == results["torch"]


def test_stacked_adapter_slots_on_triton_match_peft(tiny_model_dir, tiny_adapters):
    """An engine built with the Triton kernels keeps adapters stacked in slots (the CUDA layout,
    persistent ranks and scales) and runs the SGMV kernels in the real step: mixed adapters and
    base in one batch give peft's greedy tokens, and the same as the in-place CPU tables."""
    from tests.conftest import peft_greedy

    prompts = [list(range(3, 3 + n)) for n in (5, 9, 14, 7)]
    adapters = [tiny_adapters[0], tiny_adapters[1], None, tiny_adapters[0]]
    names = ["a0", "a1", None, "a0"]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        with forced_kernels(backend):
            llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_loras=2,
                      lora_modules={"a0": str(tiny_adapters[0]), "a1": str(tiny_adapters[1])})
            assert llm.engine.adapters.slots.stacked == (backend == "triton")
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, adapter=names)
            results[backend] = [o.outputs[0].token_ids for o in outs]
    assert results["triton"] == results["torch"] == peft_greedy(tiny_model_dir, adapters, prompts, 5)


def test_verified_drafts_on_triton_give_the_tokens_of_plain_decoding(tiny_model_dir, tiny_adapters):
    """Speculative decoding's verify pass on the Triton kernels (paged attention and SGMV over several new tokens
    per sequence, after its context): the tokens of decoding without drafts on the PyTorch path."""
    import json

    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]}, {"prompt_token_ids": list(range(3, 24))}]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "min_acceptance": 0})
    results = {}
    for backend, config in (("torch", None), ("triton", spec)):
        with forced_kernels(backend):
            llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_loras=1, speculative_config=config,
                      lora_modules={"a0": str(tiny_adapters[0])})
        results[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, adapter=[None, "a0"])]
    assert results["triton"] == results["torch"]
    counters = llm.engine.core.drafter.counters
    assert counters.num_draft_tokens >= 8 and counters.num_accepted_tokens > 0


def test_deterministic_mode_on_triton_runs_the_invariant_kernels(tiny_model_dir, tiny_adapters):
    """--deterministic on the Triton backend (the interpreter here): the invariant matmul, unsplit attention and
    SGMV in the real step, with chunked prefill and an adapter beside the base; greedy tokens as the PyTorch path
    gives them (bitwise invariance itself is the GPU check's: numpy stands in for the tensor cores here)."""
    from loraplex.kernels.linear_methods import InvariantLinear

    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 21)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        with forced_kernels(backend):
            llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_loras=1, max_num_batched_tokens=8,
                      deterministic=backend == "triton", lora_modules={"a0": str(tiny_adapters[0])})
        results[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, adapter=["a0", None])]
    assert isinstance(llm.engine.core.executor.worker.model.layers[0].mlp.down_proj.method, InvariantLinear)
    assert results["triton"] == results["torch"]


def test_adapter_kinds_on_stacked_slots_with_verified_drafts_match_peft(tmp_path):
    """DoRA's factors and B's biases copied into stacked slots (the CUDA layout) next to the Triton kernels, with
    ngram drafts verified under each adapter: peft's greedy tokens."""
    import json

    from tests.adapters.test_adapter_kinds import kinds_for
    from tests.conftest import make_tiny_model, peft_greedy

    base = make_tiny_model(tmp_path / "base", "qwen2", seed=5)
    folders = kinds_for(base, tmp_path)
    names = ["dora", "bias", "pattern", None]
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], list(range(3, 24)), [9, 10, 9, 10, 9, 10], list(range(30, 40))]
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "min_acceptance": 0})
    with forced_kernels("triton"):
        llm = LLM(str(base), dtype="float32", num_kv_blocks=64, max_loras=3, speculative_config=spec,
                  lora_modules={n: str(folders[n]) for n in names if n})
    assert llm.engine.adapters.slots.stacked
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, adapter=names)
    assert [list(o.outputs[0].token_ids) for o in outs] == peft_greedy(base, [folders.get(n) for n in names],
                                                                       prompts, 8)
    assert llm.engine.core.drafter.counters.num_draft_tokens > 0
