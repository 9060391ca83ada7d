"""Sliding-window attention end to end on a tiny Mistral whose window (8 positions) is shorter than its
prompts: logits and greedy tokens match transformers', chunked prefill crosses the window, the blocks no
query can read go back to the pool during a long decode (and all of them at the end), and prefix caching,
forks and preemption leave the tokens unchanged."""

import pytest
import torch

from conftest import assert_all_blocks_free, forced_kernels, make_tiny_model, peft_greedy
from loraplex.platform import LLM, SamplingParams
from loraplex.platform.config import EngineConfig
from loraplex.platform.engine.llm_engine import Engine
from test_model import prompt_logits

WINDOW, BLOCK = 8, 4
NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def random_ids(seed: int, n: int) -> list[int]:
    return torch.randint(3, 448, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [random_ids(seed, n) for seed, n in enumerate([5, 13, 20, 31])]  # inside, past and far past the window


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-mistral-window"), "mistral", seed=1, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def expected_tokens(mistral_dir):
    """transformers' greedy generate (its own sliding-window mask and cache), one prompt at a time."""
    return peft_greedy(mistral_dir, [None] * len(PROMPTS), PROMPTS, NEW_TOKENS)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("backend,chunks", [("auto", (40, 5, 1)), ("torch", (40, 5)), ("triton", (40, 5))])
def test_logits_match_transformers_past_the_window(mistral_dir, backend, chunks):
    """A 40-token prompt in one pass and in chunks that cross the window and the blocks (the C kernel for
    short chunks, the reference for long ones; the PyTorch path; Triton's interpreter), in float32."""
    from transformers import AutoModelForCausalLM

    with forced_kernels(backend):
        engine = Engine(EngineConfig(model=str(mistral_dir), dtype="float32", num_kv_blocks=32, block_size=BLOCK))
    assert engine.core.kv.sliding_window == WINDOW and engine.max_model_len == 512  # not capped to the window
    ids = torch.tensor([random_ids(7, 40)])
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(mistral_dir, dtype=torch.float32)(ids).logits[0]
        unwindowed = AutoModelForCausalLM.from_pretrained(mistral_dir, dtype=torch.float32,
                                                          sliding_window=None)(ids).logits[0]
    assert not torch.allclose(expected[WINDOW:], unwindowed[WINDOW:], atol=1e-2)  # the window matters here
    for chunk in chunks:
        with forced_kernels(backend):
            got = prompt_logits(engine, ids[0].tolist(), chunk)
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
    assert_all_blocks_free(engine)


def test_greedy_decode_past_the_window_matches_transformers(mistral_dir, expected_tokens):
    llm = LLM(str(mistral_dir), dtype="float32", num_kv_blocks=64, block_size=BLOCK, enable_prefix_caching=False)
    assert tokens(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)) == expected_tokens
    assert_all_blocks_free(llm.engine)


def test_blocks_are_freed_during_a_long_decode(mistral_dir, expected_tokens):
    """One request decoding far past the window holds at most the blocks its window spans (plus the one
    being written), counted after every step; the pool gets every block back at the end."""
    engine = Engine(EngineConfig(model=str(mistral_dir), dtype="float32", num_kv_blocks=32, block_size=BLOCK,
                                 enable_prefix_caching=False))
    prompt, params = PROMPTS[3], SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    engine.add(engine.inputs.process("long", {"prompt_token_ids": prompt}, params))
    held, out = [], []
    while engine.has_unfinished():
        for delta in engine.step():
            out += delta.outputs[0].token_ids
        held.append(engine.core.kv.pool.num_blocks - engine.core.kv.num_free_blocks)
    assert out[:NEW_TOKENS] == expected_tokens[3] and len(out) == 80
    window_blocks = -(-WINDOW // BLOCK) + 1  # a window that straddles a block boundary
    assert held[0] == -(-len(prompt) // BLOCK)  # the prompt in one step: every block read by some query
    assert max(held[1:-1]) == window_blocks < -(-(len(prompt) + 80) // BLOCK)  # 28 blocks without freeing
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("args", [
    dict(num_kv_blocks=64, max_num_batched_tokens=5),  # chunked prefill across the window beside decodes
    dict(num_kv_blocks=64),  # prefix caching: the second run hits blocks the window freed
    dict(num_kv_blocks=14, max_num_batched_tokens=16),  # too few blocks for all at once: preemption
])
def test_scheduling_paths_give_the_same_tokens(mistral_dir, expected_tokens, args):
    llm = LLM(str(mistral_dir), dtype="float32", block_size=BLOCK, **args)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS + PROMPTS[1:]]  # 7 at once
    expected = expected_tokens + expected_tokens[1:]
    assert tokens(llm.generate(prompts, GREEDY)) == expected
    second = llm.generate(prompts, GREEDY)
    assert tokens(second) == expected
    if args["num_kv_blocks"] == 14:
        assert llm.engine.core.scheduler.num_preemptions > 0
    elif "max_num_batched_tokens" not in args:
        assert sum(o.num_cached_tokens for o in second) > 0
    assert_all_blocks_free(llm.engine)


def test_forks_decode_past_the_window_on_shared_blocks(mistral_dir, expected_tokens):
    """n = 2 greedy sequences fork after the prompt (already past the window: its first blocks freed), share
    what is left of it, and each frees its own references."""
    llm = LLM(str(mistral_dir), dtype="float32", num_kv_blocks=64, block_size=BLOCK)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, n=2)
    (out,) = llm.generate([{"prompt_token_ids": PROMPTS[3]}], params)
    assert [c.token_ids for c in out.outputs] == [expected_tokens[3]] * 2
    assert_all_blocks_free(llm.engine)


def test_gemma2_keeps_every_block_and_matches_transformers_with_window_and_cap(tmp_path):
    """Gemma 2 alternates sliding and global layers, and soft-caps its scores: nothing is given back (a global
    layer reads every position), and the logits past the window, with a cap that bites, match transformers'."""
    from transformers import AutoModelForCausalLM

    folder = make_tiny_model(tmp_path / "gemma2", "gemma2", seed=1, sliding_window=WINDOW, head_dim=16,
                             attn_logit_softcapping=0.05)
    engine = Engine(EngineConfig(model=str(folder), dtype="float32", num_kv_blocks=32, block_size=BLOCK))
    assert engine.model_config.layer_windows == (WINDOW, None) and engine.core.kv.sliding_window is None
    ids = torch.tensor([random_ids(7, 40)])
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                        attn_implementation="eager")(ids).logits[0]
        uncapped = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                                        attn_logit_softcapping=None)(ids).logits[0]
    assert not torch.allclose(expected, uncapped, atol=1e-2)  # the cap matters here
    for chunk in (40, 5):
        torch.testing.assert_close(prompt_logits(engine, ids[0].tolist(), chunk), expected, atol=2e-4, rtol=1e-4)
    assert_all_blocks_free(engine)
