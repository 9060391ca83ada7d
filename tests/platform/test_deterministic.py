"""--deterministic: a request's token ids and logprobs (every returned alternative) bitwise the same (a) alone and in
batches of 2..64 beside prompts of other lengths, (b) with and without its prefix in the cache, (c) across prefill
chunk sizes, (d) beside requests on other adapters, mixes and grammars, (e) after preemption and recompute, (f) after a
restart, in a fresh engine or process; greedy and seeded sampling; on every family, in float32 and bfloat16. Also the
offline check an RL trainer makes: the logprobs equal a single-sequence prefill of prompt + output."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FAMILY_CLASSES, assert_all_blocks_free, make_tiny_model
from loraplex.grammar.backend import StructuredOutputs
from loraplex.platform import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("every_core")  # bits that must not depend on how work splits over threads

DTYPES = ("float32", "bfloat16")
_rng = random.Random(0)
PROMPT = [_rng.randrange(5, 440) for _ in range(45)]  # crosses two block boundaries
OTHERS = [[_rng.randrange(5, 440) for _ in range(_rng.randrange(3, 90))] for _ in range(63)]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}, "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}


def greedy(salt: str, **kw) -> SamplingParams:
    """`salt` keeps requests from sharing cached prefixes unless a test means them to."""
    return SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3, cache_salt=salt, **kw)


def seeded(salt: str) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=10, ignore_eos=True, logprobs=2,
                          cache_salt=salt)


def signature(out) -> list:
    """Each completion's token ids and every logprob it returned (the sampled token's and the alternatives')."""
    return [(c.token_ids, [{t: lp.logprob for t, lp in step.items()} for step in c.logprobs]) for c in out.outputs]


def build(folder, dtype: str, **kw) -> LLM:
    args = dict(dtype=dtype, deterministic=True, num_kv_blocks=512, max_num_seqs=64, max_num_batched_tokens=512,
                max_loras=2)
    args.update(kw)
    return LLM(str(folder), **args)


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    made = {}

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = make_tiny_model(tmp_path_factory.mktemp(f"det-{arch}"), arch)
        return made[arch]

    return get


def ids(prompt) -> dict:
    return {"prompt_token_ids": prompt}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", sorted(FAMILY_CLASSES))
def test_a_request_is_bitwise_the_same_whatever_the_batch_cache_chunks_or_preemption(family_dir, arch, dtype):
    folder = family_dir(arch)
    llm = build(folder, dtype)
    alone = [signature(llm.generate(ids(PROMPT), p("alone"))[0]) for p in (greedy, seeded)]
    cached = llm.generate(ids(PROMPT), greedy("alone"))[0]  # (b) its prefix cached by the first request
    assert cached.num_cached_tokens >= 32
    assert signature(cached) == alone[0]
    for size in (2, 17, 64):  # (a) the prompt in the middle of others of other lengths, each with its own salt
        batch = [ids(q) for q in OTHERS[:size - 1]]
        batch.insert(size // 2, ids(PROMPT))
        for p, want in zip((greedy, seeded), alone):
            params = [p(f"other{i}") for i in range(size)]
            params[size // 2] = p(f"batch{size}")
            assert signature(llm.generate(batch, params)[size // 2]) == want, (size, p.__name__)
    assert_all_blocks_free(llm.engine)
    chunked = build(folder, dtype, max_num_batched_tokens=8)  # (c) prefill in chunks of 8, beside decodes
    outs = chunked.generate([ids(PROMPT), ids(OTHERS[0])], [greedy("c"), seeded("c2")])
    assert signature(outs[0]) == alone[0]
    assert signature(chunked.generate(ids(PROMPT), seeded("c3"))[0]) == alone[1]
    tight = build(folder, dtype, num_kv_blocks=14, max_num_seqs=8)  # (e) preempted and recomputed
    outs = tight.generate([ids(q) for q in OTHERS[10:17]] + [ids(PROMPT)], [greedy(f"t{i}") for i in range(8)])
    assert tight.engine.core.scheduler.num_preemptions > 0
    assert signature(outs[-1]) == alone[0]
    assert_all_blocks_free(tight.engine)
    restarted = build(folder, dtype)  # (f) a fresh engine
    assert [signature(restarted.generate(ids(PROMPT), p("r"))[0]) for p in (greedy, seeded)] == alone


@pytest.mark.parametrize("dtype", DTYPES)
def test_neighbours_on_adapters_mixes_and_grammars_change_nothing(tiny_model_dir, tiny_adapters, dtype):
    """(d): each request of a batch of base, two adapters, a weighted mix, a JSON Schema and a regex gives what it
    gives alone."""
    llm = build(tiny_model_dir, dtype, lora_modules={"a0": str(tiny_adapters[0]), "a1": str(tiny_adapters[1])})
    prompts = [ids(PROMPT), ids(OTHERS[1]), ids(PROMPT), ids(OTHERS[2]), ids(OTHERS[3]), ids(PROMPT)]
    params = [greedy("x0"), seeded("x1"), greedy("x2"), greedy("x3"),
              SamplingParams(temperature=0, max_tokens=30, logprobs=1, structured=StructuredOutputs(json=SCHEMA)),
              SamplingParams(temperature=0, max_tokens=12, logprobs=1, structured=StructuredOutputs(regex=r"[a-f]{3}( [0-9]+)+"))]
    adapters = [None, "a0", "a1", {"a0": 0.7, "a1": 0.3}, "a1", "a0"]
    together = llm.generate(prompts, params, adapter=adapters)
    json.loads(together[4].outputs[0].text)
    for i, (prompt, param, adapter) in enumerate(zip(prompts, params, adapters)):
        alone = build(tiny_model_dir, dtype, lora_modules={"a0": str(tiny_adapters[0]), "a1": str(tiny_adapters[1])})
        assert signature(alone.generate(prompt, param, adapter=adapter)[0]) == signature(together[i]), i


@pytest.mark.parametrize("dtype", DTYPES)
def test_logprobs_equal_a_single_prefill_of_prompt_and_output(tiny_model_dir, dtype):
    """What an RL trainer recomputes: the sampled tokens' logprobs are the prompt logprobs of prompt + output,
    prefilled as one sequence (every alternative too)."""
    llm = build(tiny_model_dir, dtype)
    out = llm.generate(ids(PROMPT), seeded("rl"))[0].outputs[0]
    replay = llm.generate(ids(PROMPT + out.token_ids),
                          SamplingParams(max_tokens=1, prompt_logprobs=2, cache_salt="replay"))[0]
    recomputed = replay.prompt_logprobs[len(PROMPT):]
    for token, step, again in zip(out.token_ids, out.logprobs, recomputed):
        assert step[token].logprob == again[token].logprob
        assert all(step[t].logprob == again[t].logprob for t in step if t in again)


RESTART = """
import json, sys
from loraplex.platform import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype=sys.argv[2], deterministic=True, num_kv_blocks=64)
out = llm.generate({"prompt_token_ids": json.loads(sys.argv[3])},
                   SamplingParams(temperature=0.9, seed=11, max_tokens=10, ignore_eos=True, logprobs=2))[0].outputs[0]
print(json.dumps([out.token_ids, [{str(t): lp.logprob for t, lp in s.items()} for s in out.logprobs]]))
"""


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_restarted_process_gives_the_same_bits(tiny_model_dir, dtype):
    """(f) across processes: two fresh interpreters (the C kernels loaded anew, their thread pools started anew)."""
    def run() -> str:
        done = subprocess.run([sys.executable, "-c", RESTART, str(tiny_model_dir), dtype, json.dumps(PROMPT)],
                              capture_output=True, text=True, timeout=300, check=True)
        return done.stdout.strip().splitlines()[-1]

    first = run()
    assert json.loads(first)[0] and run() == first


def test_the_default_model_is_bitwise_the_same_alone_batched_cached_and_chunked(default_model_dir):
    """The 135M model in the dtype auto picks: what the issue saw change (tokens in bf16, logprobs in float32)."""
    prompt = ("The moon is Earth's only natural satellite. It formed about 4.5 billion years ago and its pull "
              "raises the tides. Write three more facts about the moon, one per line:")
    llm = LLM(str(default_model_dir), deterministic=True, max_num_seqs=16)
    messages = [ids(llm.get_tokenizer().encode(prompt))] + [f"Question {i}: what is {i} + {i * 3}?" for i in range(15)]

    def params(salt):
        return SamplingParams(temperature=0, max_tokens=16, logprobs=2, cache_salt=salt)

    alone = signature(llm.generate(messages[0], params("a"))[0])
    batched = llm.generate(messages, [params("b")] + [params(f"o{i}") for i in range(15)])
    assert signature(batched[0]) == alone
    cached = llm.generate(messages[0], params("a"))[0]
    assert cached.num_cached_tokens >= 16 and signature(cached) == alone
    chunked = LLM(str(default_model_dir), deterministic=True, max_num_batched_tokens=4)
    assert signature(chunked.generate(messages[0], params("c"))[0]) == alone


def test_the_mode_refuses_what_it_cannot_make_invariant(tiny_model_dir):
    with pytest.raises(ValueError, match="--deterministic needs dense weights"):
        LLM(str(tiny_model_dir), deterministic=True, quantization="int8", dtype="float32")
    with pytest.raises(ValueError, match="--deterministic needs float32 or bfloat16 on CPU"):
        LLM(str(tiny_model_dir), deterministic=True, dtype="float16")
