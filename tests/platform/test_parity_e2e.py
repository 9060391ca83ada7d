"""Greedy parity with transformers on the default model (SmolLM2-135M-Instruct, float32).

Eight chat prompts of different lengths go through ONE `generate` call; each must give the
tokens transformers gives for that prompt alone. A divergence is allowed only where the
reference's top-2 logits tie within 1e-3 (then the rest of that sequence is not compared).
"""

import pytest
import torch

from conftest import assert_all_blocks_free
from loraplex.platform import LLM, SamplingParams

pytestmark = pytest.mark.e2e

QUESTIONS = [
    "Hi!",
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea, please, with vivid imagery of waves and salt.",
    "Explain in two sentences why the sky is blue, for a ten-year-old who loves science.",
    "List the planets of the solar system in order from the sun, and give one fact about each.",
    "I am planning a trip to Japan in spring. " * 4 + "What should I pack, and which cities should I visit first?",
    "Summarize the following: " + "Paged attention stores keys and values in fixed-size blocks. " * 10,
]
NEW_TOKENS = 32
PARAMS = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(default_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    return [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True, add_generation_prompt=True,
                                    return_dict=False) for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(default_model_dir, prompts):
    """transformers generate, one prompt at a time: (tokens, per-step logits)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # as ignore_eos
    out = []
    for ids in prompts:
        g = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                           output_logits=True, return_dict_in_generate=True)
        out.append((g.sequences[0, len(ids):].tolist(), torch.stack(g.logits)[:, 0]))
    return out


def assert_parity(outputs, reference):
    assert len({len(o.prompt_token_ids) for o in outputs}) == len(outputs)  # all lengths differ
    for got, (want, logits) in zip(outputs, reference):
        got = got.outputs[0].token_ids
        assert len(got) == NEW_TOKENS
        for step, (a, b) in enumerate(zip(got, want)):
            if a != b:
                top2 = logits[step].topk(2).values
                assert float(top2[0] - top2[1]) < 1e-3, f"diverged at step {step}: {got} vs {want}"
                break


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(str(default_model_dir), dtype="float32", max_model_len=1024, num_kv_blocks=256)


def test_one_batch_matches_transformers_then_prefix_cache_hits_do_too(llm, prompts, reference):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    assert_parity(outs, reference)
    assert_all_blocks_free(llm.engine)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    assert sum(o.num_cached_tokens for o in again) >= sum(len(p) for p in prompts) // 2
    assert_parity(again, reference)
    assert_all_blocks_free(llm.engine)


def test_chunked_prefill_matches(default_model_dir, prompts, reference):
    llm = LLM(str(default_model_dir), dtype="float32", max_model_len=1024, num_kv_blocks=256,
              max_num_batched_tokens=64)
    assert max(len(p) for p in prompts) > 64
    assert_parity(llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS), reference)
    assert_all_blocks_free(llm.engine)


def test_preemption_matches(default_model_dir, prompts, reference):
    llm = LLM(str(default_model_dir), dtype="float32", max_model_len=1024, num_kv_blocks=24)
    assert_parity(llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS), reference)
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert_all_blocks_free(llm.engine)


def test_chat_answer_is_sensible(llm):
    tok = llm.get_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     tokenize=False, add_generation_prompt=True)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20))[0].outputs[0]
    assert "Paris" in out.text and out.finish_reason == "stop"  # stops at <|im_end|>
