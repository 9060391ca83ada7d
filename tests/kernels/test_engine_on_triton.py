"""The whole engine with its attention forced through the Triton kernels (the interpreter on
CPU) gives the same greedy tokens as the PyTorch path."""

import pytest

from loraplex.kernels import dispatch
from loraplex.platform import LLM, SamplingParams

pytest.importorskip("triton")


def test_engine_tokens_match_across_kernel_backends(tiny_model_dir):
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 21, 40)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=32, max_num_batched_tokens=24,
              enable_prefix_caching=False)
    results = {}
    for backend in ("torch", "triton"):
        with dispatch.forced_backend(backend):
            results[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert results["triton"] == results["torch"]
