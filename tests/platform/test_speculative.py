"""Speculative decoding end to end on the tiny model: drafts verified in the mixed batch give the tokens decoding
without them gives (greedy, seeded), keep the sampled distribution, and leave the KV pool and the prefix cache
as they would be; the proposers and the adaptive k on their own."""

import json
from collections import Counter

import pytest
import torch

from conftest import assert_all_blocks_free
from loraplex.grammar.backend import StructuredOutputs
from loraplex.platform import LLM, SamplingParams
from loraplex.platform.config import EngineConfig
from loraplex.platform.spec_decode.drafter import Drafter
from loraplex.platform.config import SpeculativeConfig
from loraplex.platform.spec_decode.speculative import Acceptance, DraftState, NgramIndex

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 64})
ALWAYS = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "min_acceptance": 0})  # never paused
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}


def key(req) -> tuple:
    mix = req.mix.entries if req.mix is not None else None
    return tuple(req.prompt_token_ids), req.adapter, str(mix), req.index


class Oracle:
    """Drafts the reference continuation (decoding without drafts), one token of it wrong on every third step:
    both accepted and rejected drafts, at every position."""

    always = False  # held to the request's adaptive k, as the n-gram lookup is

    def __init__(self, reference: dict, vocab: int, wrong_every: int = 3) -> None:
        self.reference, self.vocab, self.wrong_every = reference, vocab, wrong_every
        self.steps = 0

    def propose(self, req, drafts, room):
        self.steps += 1
        done = len(req.output_token_ids)
        out = list(self.reference.get(key(req), [])[done:done + room])
        if out and self.steps % self.wrong_every == 0:
            at = self.steps % len(out)
            out[at] = (out[at] + 1) % self.vocab
        return out


def build(model_dir, spec: str | None, adapters=(), **kw) -> LLM:
    args = dict(dtype="float32", num_kv_blocks=96, max_num_seqs=16, max_num_batched_tokens=64, max_loras=2)
    args.update(kw)
    return LLM(str(model_dir), speculative_config=spec, lora_modules={f"a{i}": str(p) for i, p in enumerate(adapters)},
               **args)


def run(llm: LLM, prompts, params, adapters=None, oracle_from=None):
    """Outputs, and (with `oracle_from`: a run without drafts) the oracle proposer in place of the engine's."""
    if oracle_from is not None:
        reference = {}
        llm.engine.core.drafter.proposers = [Oracle(reference, llm.engine.model_config.vocab_size)]
        reference.update(oracle_from)
    return llm.generate(prompts, params, adapter=adapters)


def recorded(llm: LLM, prompts, params, adapters=None) -> tuple[list, dict]:
    """A run without drafts, and each sequence's tokens keyed as the oracle looks them up."""
    seen = {}
    engine = llm.engine
    original = engine.core.scheduler.finish

    def finish(req, status):
        seen[key(req)] = list(req.output_token_ids)
        original(req, status)

    engine.core.scheduler.finish = finish
    try:
        outs = llm.generate(prompts, params, adapter=adapters)
    finally:
        engine.core.scheduler.finish = original
    return outs, seen


def tokens(outs) -> list[list[list[int]]]:
    return [[o.token_ids for o in out.outputs] for out in outs]


def mixed_batch():
    prompts = [{"prompt_token_ids": list(range(3 + i, 20 + 2 * i))} for i in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    structured = [SamplingParams(temperature=0, max_tokens=40, structured=StructuredOutputs(json=SCHEMA)),
                  SamplingParams(temperature=0, max_tokens=30, structured=StructuredOutputs(regex=r"[a-f]{3}( [0-9]+)+"))]
    params = [greedy, greedy, greedy, greedy, *structured]
    adapters = [None, "a0", "a1", {"a0": 0.7, "a1": 0.3}, "a1", None]
    return prompts, params, adapters


def test_greedy_tokens_equal_with_and_without_drafts_over_a_mixed_batch(tiny_model_dir, tiny_adapters):
    """Base, two adapters, a mix, a JSON Schema and a regex in one batch: with drafts verified (right and wrong
    ones, at every position), each request's tokens and logprobs are those of decoding without drafts."""
    prompts, params, adapters = mixed_batch()
    plain, reference = recorded(build(tiny_model_dir, None, tiny_adapters[:2]), prompts, params, adapters)
    spec = build(tiny_model_dir, SPEC, tiny_adapters[:2])
    drafted = run(spec, prompts, params, adapters, oracle_from=reference)
    assert tokens(drafted) == tokens(plain)
    assert [o.outputs[0].text for o in drafted] == [o.outputs[0].text for o in plain]
    json.loads(drafted[4].outputs[0].text)  # the schema's output, whole
    for got, want in zip(drafted[:4], plain[:4]):
        for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    counters = spec.engine.core.drafter.counters
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens  # both kinds happened
    assert set(spec.engine.core.drafter.by_adapter) == {"a0", "a1"}
    assert_all_blocks_free(spec.engine)


def test_the_engines_own_proposers_keep_greedy_tokens(tiny_model_dir):
    """n-gram lookup and grammar-forced drafts as the engine makes them (a random model repeats itself)."""
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]}, {"prompt_token_ids": list(range(40, 60))}]
    params = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=40, structured=StructuredOutputs(json=SCHEMA))]
    plain = build(tiny_model_dir, None).generate(prompts, params)
    spec = build(tiny_model_dir, SPEC)
    assert tokens(spec.generate(prompts, params)) == tokens(plain)
    assert spec.engine.core.drafter.counters.num_accepted_tokens > 0


@pytest.mark.parametrize("args", [
    dict(num_kv_blocks=9, max_num_seqs=4),  # preemption (recomputed later)
    dict(max_num_batched_tokens=8),  # chunked prefill beside verified drafts, drafts cut to the budget
])
def test_preemption_chunks_n_stops_and_max_tokens_behave_as_without_drafts(tiny_model_dir, args):
    prompts = [{"prompt_token_ids": list(range(3 + i, 30 + i))} for i in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0.9, seed=7, n=2, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, stop=["e"]),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)]
    plain_llm = build(tiny_model_dir, None, **args)
    plain, reference = recorded(plain_llm, prompts, params)
    spec = build(tiny_model_dir, SPEC, **args)
    drafted = run(spec, prompts, params, oracle_from=reference)
    assert tokens(drafted) == tokens(plain)
    assert [[o.text for o in r.outputs] for r in drafted] == [[o.text for o in r.outputs] for r in plain]
    assert [[o.finish_reason for o in r.outputs] for r in drafted] == [[o.finish_reason for o in r.outputs]
                                                                       for r in plain]
    assert len(drafted[3].outputs[0].token_ids) == 7
    if "num_kv_blocks" in args:
        assert spec.engine.core.scheduler.num_preemptions > 0
    assert spec.engine.core.drafter.counters.num_accepted_tokens > 0
    assert_all_blocks_free(spec.engine)


def wrong_drafts(llm: LLM, reference: dict, vocab: int = 448) -> None:
    """Every draft wrong (each reference token shifted by one), never paused."""
    llm.engine.core.drafter.proposers = [Oracle({k: [(t + 1) % vocab for t in v] for k, v in reference.items()}, vocab,
                                           wrong_every=10**9)]


def test_a_stop_string_completed_by_a_draft_ends_the_sequence_before_max_tokens_does(tiny_model_dir):
    """The drafts of one step complete a stop string and then reach max_tokens: the stop string wins, as it does
    without drafts (where the tokens after it never exist)."""
    prompt = {"prompt_token_ids": list(range(3, 15))}
    probe = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain_llm = build(tiny_model_dir, None)
    text = plain_llm.generate([prompt], probe)[0].outputs[0].text
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop=[text[-4:-2]])
    plain = plain_llm.generate([prompt], params)
    _, full = recorded(build(tiny_model_dir, None), [prompt], probe)
    spec = build(tiny_model_dir, SPEC)
    spec.engine.core.drafter.proposers = [Oracle(full, 448, wrong_every=10**9)]  # drafts past the stop to max_tokens
    drafted = spec.generate([prompt], params)[0].outputs[0]
    want = plain[0].outputs[0]
    assert want.finish_reason == "stop" and len(want.token_ids) < 6
    assert (drafted.token_ids, drafted.text, drafted.finish_reason, drafted.stop_reason) == \
        (want.token_ids, want.text, want.finish_reason, want.stop_reason)


def test_drafts_never_preempt_nor_delay_other_requests(tiny_model_dir):
    """Every draft wrong, blocks and the token budget short: the same steps, preemptions and scheduled requests
    as without drafts (drafts are dropped before anyone is preempted, and take only budget left over)."""
    prompts = [{"prompt_token_ids": list(range(3 + i, 20 + i))} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    args = dict(num_kv_blocks=12, max_num_seqs=4, max_num_batched_tokens=8)
    _, reference = recorded(build(tiny_model_dir, None, **args), prompts, params)
    runs = []
    for spec in (None, ALWAYS):
        llm = build(tiny_model_dir, spec, **args)
        if spec is not None:
            wrong_drafts(llm, reference)
        scheduled = []
        schedule = llm.engine.core.scheduler.schedule

        def logged():
            out = schedule()
            scheduled.append(sorted(r.seq_id for r, _ in out.scheduled))
            return out

        llm.engine.core.scheduler.schedule = logged
        outs = llm.generate(prompts, params)
        runs.append((tokens(outs), scheduled, llm.engine.core.scheduler.num_preemptions))
    assert runs[0][2] > 0 and runs[1] == runs[0]


def test_rejected_drafts_do_not_evict_the_prefix_cache(tiny_model_dir):
    """A cached prompt, then a long decode with every draft wrong: the prompt is still found in the cache as
    often as without drafts (the blocks given back are taken again before a cached one is evicted)."""
    cached = {"prompt_token_ids": list(range(100, 140))}
    other = {"prompt_token_ids": list(range(3, 12))}
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    _, reference = recorded(build(tiny_model_dir, None, block_size=4, num_kv_blocks=24), [other], params)
    hits = []
    for spec in (None, ALWAYS):
        llm = build(tiny_model_dir, spec, block_size=4, num_kv_blocks=24)
        if spec is not None:
            wrong_drafts(llm, reference)
        llm.generate([cached], SamplingParams(max_tokens=1))
        llm.generate([other], params)
        hits.append(llm.generate([cached], SamplingParams(max_tokens=1))[0].num_cached_tokens)
    assert hits[0] > 0 and hits[1] == hits[0]


def test_rejected_drafts_leave_the_kv_pool_as_it_was(tiny_model_dir):
    """Every draft wrong: after each step the request holds the blocks, and the pool the free blocks, that the
    same step without drafts leaves."""
    prompt = {"prompt_token_ids": list(range(3, 17))}  # 14 tokens: drafts cross into new blocks at once
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    _, reference = recorded(build(tiny_model_dir, None, block_size=4, num_kv_blocks=40), [prompt], params)
    engines = [build(tiny_model_dir, None, block_size=4, num_kv_blocks=40),
               build(tiny_model_dir, ALWAYS, block_size=4, num_kv_blocks=40)]
    wrong = {k: [(t + 1) % 448 for t in v] for k, v in reference.items()}
    engines[1].engine.core.drafter.proposers = [Oracle(wrong, 448, wrong_every=10**9)]
    for llm in engines:
        llm.engine.add_request("r", prompt, params)
    while engines[0].engine.has_unfinished():
        for llm in engines:
            llm.engine.step()
        plain, spec = (llm.engine for llm in engines)
        assert spec.core.kv.num_free_blocks == plain.core.kv.num_free_blocks
        assert spec.core.kv.req_blocks.keys() == plain.core.kv.req_blocks.keys()
        for seq_id, blocks in plain.core.kv.req_blocks.items():
            assert len(spec.core.kv.req_blocks[seq_id]) == len(blocks)
    assert not engines[1].engine.has_unfinished()
    assert engines[1].engine.core.drafter.counters.num_draft_tokens > 25  # a draft every step
    assert engines[1].engine.core.drafter.counters.num_accepted_tokens == 0
    assert_all_blocks_free(engines[1].engine)


def test_the_prefix_cache_holds_only_verified_kv(tiny_model_dir):
    """Every block the prefix cache holds after a run with rejected drafts is cached without drafts too, with
    the same keys and values: no rejected draft's KV is ever found by a later prompt."""
    prompts = [{"prompt_token_ids": list(range(3 + i, 12 + i))} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain_llm = build(tiny_model_dir, None, block_size=4)
    _, reference = recorded(plain_llm, prompts, params)
    spec = build(tiny_model_dir, SPEC, block_size=4)
    run(spec, prompts, params, oracle_from=reference)
    plain_pool, spec_pool = plain_llm.engine.core.kv.pool, spec.engine.core.kv.pool
    assert spec_pool.cached and spec_pool.cached.keys() <= plain_pool.cached.keys()
    for block_hash, block in spec_pool.cached.items():
        want = plain_llm.engine.core.executor.worker.runner.kv_cache[:, :, plain_pool.cached[block_hash].block_id]
        torch.testing.assert_close(spec.engine.core.executor.worker.runner.kv_cache[:, :, block.block_id], want, atol=1e-5, rtol=1e-5)


def test_seeded_sampling_gives_the_same_tokens_with_drafts(tiny_model_dir):
    """A seeded request draws its noise token by token from its own generator: drafts change nothing."""
    prompts = [{"prompt_token_ids": list(range(3 + i, 15 + i))} for i in range(3)]
    params = [SamplingParams(temperature=t, seed=s, max_tokens=30, ignore_eos=True, top_k=k, top_p=p)
              for t, s, k, p in ((0.7, 1, 0, 1.0), (1.0, 2, 20, 1.0), (1.3, 3, 0, 0.9))]
    plain, reference = recorded(build(tiny_model_dir, None), prompts, params)
    spec = build(tiny_model_dir, SPEC)
    assert tokens(run(spec, prompts, params, oracle_from=reference)) == tokens(plain)
    assert spec.engine.core.drafter.counters.num_accepted_tokens > 0


def exact_three_token_law(model_dir, prompt: list[int], top_k: int) -> dict[tuple, float]:
    """P(t1, t2, t3) under temperature 1 and top-k, from transformers' own forward passes."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    law = {(): 1.0}
    for _ in range(3):
        grown = {}
        for seq, p in law.items():
            with torch.no_grad():
                logits = model(torch.tensor([prompt + list(seq)])).logits[0, -1]
            top = logits.topk(top_k)
            for token, q in zip(top.indices.tolist(), top.values.softmax(-1).tolist()):
                grown[seq + (token,)] = p * q
        law = grown
    return law


def chi_square_pvalue(observed: list[int], expected: list[float]) -> float:
    """Pearson's test: P(chi2 with len - 1 degrees of freedom >= the statistic)."""
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    return torch.special.gammaincc(torch.tensor((len(observed) - 1) / 2), torch.tensor(stat / 2)).item()


def test_sampled_acceptance_keeps_the_output_distribution(tiny_model_dir):
    """Unseeded sampling with drafts (the most likely continuation, so often accepted and often not): the
    3-token outputs of 1,600 requests follow the model's exact law (chi-square, fixed seed)."""
    prompt, top_k, n = [7, 8, 9, 10, 11], 2, 1600
    law = exact_three_token_law(tiny_model_dir, prompt, top_k)
    likely = max(law, key=law.get)
    spec = build(tiny_model_dir, SPEC, num_kv_blocks=400, max_num_seqs=64, max_num_batched_tokens=512)

    class Likely:
        always = True

        def propose(self, req, drafts, room):
            return list(likely[len(req.output_token_ids):])[:room]

    spec.engine.core.drafter.proposers = [Likely()]
    params = SamplingParams(temperature=1.0, top_k=top_k, max_tokens=3, ignore_eos=True)
    outs = spec.generate([{"prompt_token_ids": prompt}] * n, params)
    counts = Counter(tuple(o.outputs[0].token_ids) for o in outs)
    keys = sorted(law)
    assert set(counts) <= set(keys)
    counters = spec.engine.core.drafter.counters
    assert counters.num_accepted_tokens > 0.2 * n and counters.num_draft_tokens > counters.num_accepted_tokens
    assert chi_square_pvalue([counts[k] for k in keys], [law[k] * n for k in keys]) > 1e-3, (counts, law)


def test_a_request_that_opts_out_gets_no_drafts(tiny_model_dir):
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]}] * 2
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, speculative=False),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)]
    spec = build(tiny_model_dir, SPEC)
    drafted_by = []
    original = spec.engine.core.drafter.record
    spec.engine.core.drafter.record = lambda req, d, a: (d and drafted_by.append(req.params.speculative),
                                                    original(req, d, a))
    outs = spec.generate(prompts, params)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert drafted_by and all(drafted_by)


def test_a_wide_batch_drafts_nothing(tiny_model_dir):
    spec = build(tiny_model_dir, json.dumps({"method": "ngram", "disable_by_batch_size": 2}))
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]}] * 3
    spec.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert spec.engine.core.drafter.counters.num_drafts == 0


# ---- the proposers, the adaptive k and the config, on their own -------------------------------------------


def test_ngram_index_proposes_what_followed_the_latest_longest_match():
    index = NgramIndex(1, 3)
    index.extend([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3])
    assert index.propose(3) == [7, 5, 1]  # the latest earlier "1 2 3" (not the suffix itself)
    assert index.propose(1) == [7]
    assert index.propose(3, tail=[7]) == [5, 1, 2]  # "2 3 7" after the drafts already taken
    index.extend([4])
    assert index.propose(3) == []  # "3 4", "4": never seen before
    short = NgramIndex(2, 2)
    short.extend([8, 8])
    assert short.propose(2) == []  # the only "8 8" is the suffix itself


def test_acceptance_adapts_k_and_pauses_with_a_growing_backoff():
    acc = Acceptance()
    assert acc.k(0, 4, 0.25) == 4
    acc.record(4, 1)  # rate 0.625
    assert acc.k(1, 4, 0.25) == 4
    for step in range(2, 5):
        acc.record(4, 0)
    assert acc.rate < 0.25
    assert acc.k(5, 4, 0.25) == 0 and acc.paused_until == 13
    assert acc.k(12, 4, 0.25) == 0
    assert acc.k(13, 4, 0.25) == 2  # a probe
    acc.record(2, 0)
    assert acc.k(14, 4, 0.25) == 0 and acc.paused_until == 14 + 16


def test_a_draft_accepted_whole_starts_the_backoff_over():
    """A request that copies, invents, then copies again: its next pause is the first one's length, not the
    doubled length its inventing earned."""
    acc = Acceptance()
    for _ in range(3):
        acc.record(4, 0)
    assert acc.k(1, 4, 0.25) == 0 and acc.paused_until == 1 + 8
    assert acc.k(9, 4, 0.25) == 2  # the probe
    acc.record(2, 0)
    assert acc.k(10, 4, 0.25) == 0 and acc.paused_until == 10 + 16 and acc.backoff == 32
    assert acc.k(26, 4, 0.25) == 2
    acc.record(2, 2)  # copying again
    for _ in range(3):
        acc.record(4, 0)
    assert acc.k(30, 4, 0.25) == 0 and acc.paused_until == 30 + 8


def test_drafts_stop_at_max_tokens_max_model_len_and_the_grammar(tiny_model_dir):
    llm = build(tiny_model_dir, SPEC, max_model_len=64)
    drafter: Drafter = llm.engine.core.drafter

    class Fixed:
        always = True

        def propose(self, req, drafts, room):
            return [9, 9, 9, 9, 9, 9][:room]

    drafter.proposers = [Fixed()]
    req = llm.engine.inputs.process("x", {"prompt_token_ids": list(range(3, 13))},
                                    SamplingParams(temperature=0, max_tokens=4))
    req.output_token_ids = [5, 5]
    req.num_computed_tokens = req.num_tokens - 1
    assert drafter._draft(req) == [9]  # max_tokens 4: two out, one to verify with a draft before it
    req.params = SamplingParams(temperature=0, max_tokens=100)
    req.prompt_token_ids = list(range(3, 3 + 59))  # 61 tokens of max_model_len 64
    assert drafter._draft(req) == [9, 9]
    structured = llm.engine.inputs.process("y", {"prompt_token_ids": [3, 4]}, SamplingParams(
        temperature=0, max_tokens=50, structured=StructuredOutputs(choice=["abc"])))
    llm.engine.add(structured)
    tok = llm.engine.tokenizer
    first = tok.encode("a", add_special_tokens=False)
    structured.grammar.accept_token(first[0])
    structured.output_token_ids = first[:1]
    rest = tok.encode("bc", add_special_tokens=False)
    drafter.proposers = [Fixed()]
    assert drafter._draft(structured) == []  # 9 is not what the grammar takes next
    drafter.proposers = [type("Good", (), {"always": True, "propose": lambda self, r, d, room: rest + [9, 9]})()]
    assert drafter._draft(structured) == rest  # cut at the grammar's end
    assert structured.grammar.accept_token(rest[0])  # the dry run was rolled back


def test_speculative_config_is_checked_when_the_engine_config_is_made():
    assert EngineConfig(model="m").speculative is None
    spec = EngineConfig(model="m", speculative_config='{"method": "ngram", "num_speculative_tokens": 6}').speculative
    assert spec.num_speculative_tokens == 6 and spec.prompt_lookup_max == 4
    for bad, words in [('{"method": "eagle"}', "method"), ('{"num_speculative_tokens": 0}', ">= 1"),
                       ('{"prompt_lookup_min": 5}', "prompt_lookup_min"), ('{"k": 4}', "unknown key"),
                       ("[1]", "JSON object"), ("{", "not JSON"), ('{"min_acceptance": 1.5}', "min_acceptance")]:
        with pytest.raises(ValueError, match=words):
            EngineConfig(model="m", speculative_config=bad)
    assert SpeculativeConfig.parse(None) is None


class PieceTokenizer:
    """Token ids as fixed pieces of text; encode takes the longest piece first."""

    pieces = {1: '":"', 2: '":', 3: '"', 4: "R", 5: "ye"}

    def decode(self, ids):
        return "".join(self.pieces[i] for i in ids)

    def encode(self, text, add_special_tokens=False):
        out = []
        while text:
            token = max((i for i, p in self.pieces.items() if text.startswith(p)), key=lambda i: len(self.pieces[i]))
            out.append(token)
            text = text[len(self.pieces[token]):]
        return out


def test_the_models_own_spelling_of_forced_text_is_learned():
    """The grammar forces `":"`, drafted as its one token; the model writes `":` then `"`: from then on that
    text is drafted as the model wrote it."""
    from types import SimpleNamespace

    from loraplex.platform.spec_decode.drafter import GrammarForced
    from loraplex.platform.spec_decode.speculative import DraftState

    forced = ['":"']
    req = SimpleNamespace(grammar=SimpleNamespace(jump_forward_string=lambda: forced[0]), output_token_ids=[5],
                          draft_state=DraftState(None))
    proposer = GrammarForced(PieceTokenizer())
    assert proposer.propose(req, [], 4) == [1]
    req.output_token_ids += [2]  # the draft rejected: the model wrote `":`
    forced[0] = '"'
    assert proposer.propose(req, [], 4) == [3] and req.draft_state.spelled == {}  # undecided yet
    req.output_token_ids += [3, 4]
    forced[0] = '":"'
    assert proposer.propose(req, [], 4) == [2, 3] and req.draft_state.spelled == {1: (2, 3)}
    req.output_token_ids += [4, 5]  # a different text altogether: nothing learned from it
    assert proposer.propose(req, [], 4) == [2, 3] and req.draft_state.spelled == {1: (2, 3)}


def test_grammar_forced_drafts_go_on_while_a_requests_lookup_is_paused(tiny_model_dir):
    llm = build(tiny_model_dir, json.dumps({"method": "ngram", "num_speculative_tokens": 16}))
    drafter = llm.engine.core.drafter

    class Lookup:
        always = False

        def propose(self, req, drafts, room):
            return [9] * room

    drafter.proposers = [drafter.proposers[0], Lookup()]
    req = llm.engine.inputs.process("y", {"prompt_token_ids": [3, 4]}, SamplingParams(
        temperature=0, max_tokens=50, structured=StructuredOutputs(json=SCHEMA)))
    llm.engine.add(req)
    tok = llm.engine.tokenizer
    req.output_token_ids = tok.encode("{", add_special_tokens=False)
    for token in req.output_token_ids:
        assert req.grammar.accept_token(token)
    req.num_computed_tokens = req.num_tokens - 1
    forced = tok.encode(req.grammar.jump_forward_string(), add_special_tokens=False)
    drafts = drafter._draft(req)  # the lookup's tokens after the forced ones, as far as the grammar takes them
    assert forced and drafts[:len(forced)] == forced and len(drafts) > len(forced)
    req.draft_state.acceptance.paused_until = 10**9
    assert drafter._draft(req) == forced  # no lookup tokens after them while paused


def test_forced_tokens_have_one_source_drafted_or_accepted_as_proposed(tiny_model_dir):
    """The grammar's forced text comes from the drafter's `GrammarForced` only: a request in speculative decoding
    drafts it (verified, none accepted unseen); one that opted out, or a batch too wide to draft, takes its canonical
    tokens as drafts accepted at once (what jump-forward was), a prefix of the same tokens."""
    llm = build(tiny_model_dir, json.dumps({"method": "ngram", "num_speculative_tokens": 8,
                                            "disable_by_batch_size": 4}))
    drafter, tok = llm.engine.core.drafter, llm.engine.tokenizer
    requests = []
    for rid, speculative in (("drafted", True), ("opted-out", False)):
        req = llm.engine.inputs.process(rid, {"prompt_token_ids": [3, 4]}, SamplingParams(
            temperature=0, max_tokens=50, speculative=speculative, structured=StructuredOutputs(json=SCHEMA)))
        llm.engine.add(req)
        req.output_token_ids = tok.encode("{", add_special_tokens=False)
        for token in req.output_token_ids:
            assert req.grammar.accept_token(token)
        requests.append(req)
    drafted, opted_out = requests
    forced = tok.encode(drafted.grammar.jump_forward_string(), add_special_tokens=False)
    drafted.draft_state = DraftState(None)
    assert len(forced) > 1 and drafter.forced.propose(drafted, [], 8) == forced
    assert drafter.accept_forced(drafted, batch_size=2) == []  # drafted and verified instead
    assert drafter.accept_forced(drafted, batch_size=5) == forced[:-1]  # too wide to draft: accepted as proposed
    assert drafter.accept_forced(opted_out, batch_size=2) == forced[:-1]
    assert drafter.num_jump_forward_tokens == 2 * (len(forced) - 1)
    drafter.jump_forward = False  # --no-jump-forward: the model writes the forced text itself
    assert drafter.accept_forced(opted_out, batch_size=2) == []
    for req in requests:
        llm.engine.abort(req.request_id)
    assert_all_blocks_free(llm.engine)
