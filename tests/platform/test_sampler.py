import pytest
import torch

from loraplex.platform.request import Request, SamplingParams
from loraplex.platform.sample.sampler import Sampler, argmax, filter_and_softmax, logprobs_of, ranked_top

V = 50


def req(params, output=(), prompt=(1, 2, 3), rid="r"):
    r = Request(rid, list(prompt), params)
    r.output_token_ids = list(output)
    return r


def logits_rows(n, seed=0):
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_and_degenerate_filters_pick_the_argmax():
    logits = logits_rows(4)
    s = Sampler(V, (0,))
    reqs = [req(SamplingParams(temperature=0)), req(SamplingParams(top_k=1, seed=1)),
            req(SamplingParams(top_p=1e-6, seed=2)), req(SamplingParams(min_p=1.0, seed=3))]
    assert s(logits, reqs).token_ids == logits.argmax(-1).tolist()


def test_argmax_is_torchs_including_ties_and_infinities():
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 4, (64, 3000), generator=gen).float()  # many tied maxima per row
    rows[0, 10] = rows[0, 20] = float("inf")
    rows[1] = -float("inf")
    assert torch.equal(argmax(rows), rows.argmax(dim=-1))
    assert argmax(rows)[0] == 10 and argmax(rows)[1] == 0


def test_bf16_logits_give_the_picks_of_their_float32_values():
    """The model's logits come in its dtype: an all-greedy batch takes the argmax of the bf16 rows as
    they are (exact: bf16 widens to float32 without rounding, ties included), any other request
    makes the whole batch float32; logprobs are float32 either way."""
    gen = torch.Generator().manual_seed(1)
    rows = (torch.randint(0, 6, (8, V), generator=gen) + torch.rand(8, V, generator=gen) / 8).bfloat16()  # ties
    s = Sampler(V, (0,))
    greedy = [req(SamplingParams(temperature=0), rid=f"g{i}") for i in range(8)]
    assert s(rows, greedy).token_ids == rows.float().argmax(-1).tolist()
    mixed = greedy[:6] + [req(SamplingParams(temperature=0, logprobs=2)), req(SamplingParams(temperature=0.7, seed=3))]
    out = s(rows, mixed)
    assert out.token_ids[:7] == rows.float().argmax(-1).tolist()[:7]
    assert out.logprobs[6] is not None and all(lp is None for lp in out.logprobs[:6])
    penalized = lambda: [req(SamplingParams(temperature=0, repetition_penalty=1.5), output=[3])]  # noqa: E731
    assert s(rows[:1], penalized()).token_ids == s(rows[:1].float(), penalized()).token_ids


def test_filters_keep_exactly_the_expected_support():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = lambda **kw: filter_and_softmax(logits.clone(), [req(SamplingParams(**kw))])[0]
    assert (probs(top_k=2) > 0).tolist() == [True, True, False, False]
    assert (probs(top_p=0.8) > 0).tolist() == [True, True, False, False]
    assert (probs(top_p=0.81) > 0).tolist() == [True, True, True, False]
    assert (probs(min_p=0.5) > 0).tolist() == [True, True, False, False]
    torch.testing.assert_close(probs(top_k=2), torch.tensor([0.625, 0.375, 0, 0]))


def test_seeded_request_is_independent_of_the_batch():
    logits = logits_rows(3)
    target = SamplingParams(temperature=1.0, seed=1234)
    alone = [Sampler(V, (), seed=s)(logits[1:2], [req(target)]).token_ids[0] for s in range(1)]
    outs = []
    for other_seed in range(5):  # different neighbours, different global generator
        s = Sampler(V, (), seed=other_seed)
        batch = [req(SamplingParams(temperature=1.0)), req(target), req(SamplingParams(temperature=0.7, seed=other_seed))]
        outs.append(s(logits, batch).token_ids[1])
    assert set(outs) == set(alone)


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).repeat(3000, 1)
    s = Sampler(3, (), seed=0)
    tokens = torch.tensor(s(logits, [req(SamplingParams()) for _ in range(3000)]).token_ids)
    freq = torch.bincount(tokens, minlength=3).float() / 3000
    torch.testing.assert_close(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03, rtol=0)


def test_penalties():
    logits = torch.zeros(3, 6)
    logits[:, 1] = 2.0
    logits[:, 2] = -2.0
    s = Sampler(6, ())
    reqs = [req(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=[1, 2]),
            req(SamplingParams(temperature=0, presence_penalty=1.5), output=[1, 1]),
            req(SamplingParams(temperature=0, frequency_penalty=1.5), output=[1, 1])]
    work = logits.clone()
    s._apply_penalties(work, reqs)
    assert work[0, 1] == 1.0 and work[0, 2] == -4.0  # positive divided, negative multiplied
    assert work[1, 1] == 0.5 and work[2, 1] == -1.0
    assert work[:, 3].eq(0).all()


def test_min_tokens_blocks_eos_and_stop_tokens():
    logits = torch.zeros(1, V)
    logits[0, 7] = 10.0  # eos
    logits[0, 8] = 9.0  # a stop token
    s = Sampler(V, (7,))
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[8])
    assert s(logits, [req(p, output=[3])]).token_ids[0] not in (7, 8)
    assert s(logits, [req(p, output=[3, 4])]).token_ids == [7]


def test_logprobs_are_of_the_raw_distribution_with_ranks():
    logits = logits_rows(1)
    s = Sampler(V, ())
    out = s(logits, [req(SamplingParams(temperature=0, logprobs=3, repetition_penalty=1.5))])
    raw = torch.log_softmax(logits[0], -1)
    top = raw.topk(3)
    lp = out.logprobs[0]
    token = out.token_ids[0]
    assert lp[token].logprob == pytest.approx(raw[token].item())
    assert lp[token].rank == int((raw > raw[token]).sum()) + 1
    for rank, (value, t) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
        assert lp[t].logprob == pytest.approx(value) and lp[t].rank == rank


def test_tied_alternatives_are_the_lower_ids_whatever_the_batch_asks_for():
    """bf16 logits tie often: a request's alternatives must not depend on the largest `logprobs` of its batch
    (topk picks among ties by an internal order that changes with k)."""
    torch.manual_seed(0)
    rows = torch.randn(3, 4000).round(decimals=1)  # many ties at every value
    for k in (1, 2, 3, 5, 40):
        values, ids = ranked_top(rows, k)
        want = sorted(range(4000), key=lambda i: (-rows[1, i].item(), i))[:k]
        assert ids[1].tolist() == want and values[1].tolist() == rows[1, want].tolist()
    tokens = torch.tensor([0, 1, 2])
    alone = logprobs_of(rows[:1], tokens[:1], [2])[0]
    assert logprobs_of(rows, tokens, [2, 7, 1])[0] == alone
    assert ranked_top(rows, 0)[1].shape == (3, 0)


@pytest.mark.parametrize("field,value", [("temperature", -0.5), ("top_p", 0.0), ("top_p", 7), ("n", 0),
                                         ("max_tokens", 0), ("top_k", -2), ("min_p", 1.5), ("logprobs", 21),
                                         ("repetition_penalty", 0.0), ("presence_penalty", 3.0)])
def test_bad_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=5),
                                    SamplingParams(repetition_penalty=1.3, presence_penalty=0.5),
                                    SamplingParams(min_tokens=3), SamplingParams(logit_bias={3: 5.0})])
def test_callers_logits_are_never_changed(params):
    """The sampler copies the logits only when a transform writes into them."""
    logits = logits_rows(2)
    before = logits.clone()
    Sampler(V, eos_token_ids=(0,))(logits, [req(params, output=(1, 5)), req(params, rid="s")])
    assert torch.equal(logits, before)


@pytest.mark.parametrize("field,value", [
    ("temperature", float("inf")), ("temperature", float("nan")), ("repetition_penalty", float("inf")),
    ("top_p", float("nan")), ("min_p", float("inf")), ("presence_penalty", float("nan")),
    ("top_k", 2**63), ("top_k", -2), ("n", True), ("max_tokens", 2.5), ("seed", 2**64 - 1), ("seed", -2**63 - 1),
    ("logprobs", True), ("stop_token_ids", [2**40]), ("stop_token_ids", [True]),
])
def test_out_of_range_sampling_fields_are_refused_at_submission(field, value):
    """Anything that could raise inside a step (and fail the whole batch) is a ValueError here."""
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_extreme_but_valid_fields_sample_without_raising():
    """The largest seed with n > 1, and top_k far beyond the vocabulary, are served, not errors."""
    params = SamplingParams(n=2, seed=2**63 - 1, top_k=2**31 - 1, temperature=1e30, max_tokens=3)
    r0, r1 = Request("r", [1, 2], params), Request("r", [1, 2], params, index=1)
    assert r0.generator is not None and r1.generator is not None
    sampler = Sampler(vocab_size=16, eos_token_ids=(0,))
    out = sampler(torch.randn(2, 16), [r0, r1])
    assert all(0 <= t < 16 for t in out.token_ids)


def test_logit_bias_moves_the_pick_but_never_unmasks():
    logits = logits_rows(2)
    top = int(logits[0].argmax())
    other = (top + 1) % V
    s = Sampler(V, (0,))
    out = s(logits, [req(SamplingParams(temperature=0, logit_bias={top: -100.0, other: 100.0})),
                     req(SamplingParams(temperature=0), rid="s")])
    assert out.token_ids == [other, int(logits[1].argmax())]  # the unbiased row is untouched
    masked = logits.clone()
    masked[0, other] = float("-inf")  # what a grammar mask leaves
    assert s(masked, [req(SamplingParams(temperature=0, logit_bias={other: 100.0}))] * 1 +
             [req(SamplingParams(temperature=0), rid="s")]).token_ids[0] != other


@pytest.mark.parametrize("bias", [{1: 101.0}, {1: float("nan")}, {-1: 1.0}, {True: 1.0}, {i: 1.0 for i in range(1025)}])
def test_bad_logit_bias_is_refused_at_submission(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


# ---- issue #39: what crosses between host and device, and the distributions it must keep ----------------------

import math  # noqa: E402

from loraplex.platform.sample import sampler as sampler_module  # noqa: E402
from loraplex.platform.device import HostSyncError, NoHostSync  # noqa: E402
from loraplex.platform.sample.sampler import prompt_logprobs  # noqa: E402

WIDE = 4096  # a vocabulary much wider than any per-request value list or logprob read


def _record_copies(monkeypatch):
    """Shapes of every tensor the sampler puts on the device, and of every tensor read back to the host
    (`.tolist()` / `.cpu()`, whichever way the code reads)."""
    puts, reads = [], []
    real_put, real_tolist, real_cpu = sampler_module.to_device, torch.Tensor.tolist, torch.Tensor.cpu

    def put(tensor, device):
        puts.append(tuple(tensor.shape))
        return real_put(tensor, device)

    def tolist(tensor):
        reads.append(tuple(tensor.shape))
        return real_tolist(tensor)

    def cpu(tensor, *args, **kwargs):
        reads.append(tuple(tensor.shape))
        return real_cpu(tensor, *args, **kwargs)

    monkeypatch.setattr(sampler_module, "to_device", put)
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    return puts, reads


def _wide_rows(n, seed=0):
    return torch.randn(n, WIDE, generator=torch.Generator().manual_seed(seed)) * 3


def test_unseeded_noise_never_crosses_from_the_host(monkeypatch):
    """Rows without a seed draw their noise on the device: nothing vocabulary-wide is put there. Seeded rows
    are drawn on the host from their own generator, and only those rows cross."""
    puts, _ = _record_copies(monkeypatch)
    unseeded = [req(SamplingParams(temperature=0.9, top_p=0.95), rid=f"u{i}") for i in range(6)]
    Sampler(WIDE, ())(_wide_rows(6), unseeded)
    assert puts and all(math.prod(shape) < WIDE for shape in puts)
    puts.clear()
    seeded = [req(SamplingParams(temperature=0.9, seed=i), rid=f"s{i}") for i in range(2)]
    Sampler(WIDE, ())(_wide_rows(8), unseeded + seeded)
    assert [shape for shape in puts if math.prod(shape) >= WIDE] == [(2, WIDE)]


def test_logprobs_read_back_only_k_columns(monkeypatch):
    """A request's chosen logprob, rank and top-k are found on the device: each read is [rows, 3 + 2k]."""
    _, reads = _record_copies(monkeypatch)
    batch = [req(SamplingParams(temperature=0, logprobs=3), rid="a"), req(SamplingParams(temperature=0.8), rid="b"),
             req(SamplingParams(temperature=0.8, logprobs=1, seed=4), rid="c")]
    out = Sampler(WIDE, ())(_wide_rows(3), batch)
    assert out.logprobs[1] is None and len(out.logprobs[0]) >= 3
    assert reads and all(math.prod(shape) <= 3 * (3 + 2 * 3) for shape in reads)
    reads.clear()
    hidden = _wide_rows(5)
    prompt_logprobs(lambda h: h, hidden, [1, 2, 3, 4, 5], 2)
    assert reads and all(math.prod(shape) <= 5 * (3 + 2 * 2) for shape in reads)


def test_logprobs_match_the_full_rows():
    """Per row its own k (0 included), the chosen token's rank among all entries, values of the raw rows."""
    logits = logits_rows(4, seed=5)
    ks = [0, 2, None, 5]
    batch = [req(SamplingParams(temperature=0.7, seed=i, logprobs=k), rid=f"r{i}") for i, k in enumerate(ks)]
    out = Sampler(V, ())(logits, batch)
    raw = torch.log_softmax(logits, dim=-1)
    for i, k in enumerate(ks):
        if k is None:
            assert out.logprobs[i] is None
            continue
        token = out.token_ids[i]
        expected = {token: (raw[i, token].item(), int((raw[i] > raw[i, token]).sum()) + 1)}
        top = raw[i].topk(k) if k else None
        for rank, (v, t) in enumerate(zip(top.values.tolist(), top.indices.tolist()) if k else (), start=1):
            expected.setdefault(t, (v, rank))
        assert {t: (lp.logprob, lp.rank) for t, lp in out.logprobs[i].items()} == expected


class _NoHostReads(NoHostSync):
    """What a capture refuses, and `bincount`, which reads its input's maximum to size its output."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name == "aten::bincount":
            raise HostSyncError("aten::bincount reads its input's maximum on the host")
        return super().__torch_dispatch__(func, types, args, kwargs)


def test_penalty_counts_read_nothing_back_and_match_bincount():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, V, generator=gen) * 3
    outputs = [torch.randint(0, V, (n,), generator=gen).tolist() for n in (7, 0, 30, 3)]
    params = [SamplingParams(presence_penalty=0.7, frequency_penalty=0.3), SamplingParams(frequency_penalty=1.0),
              SamplingParams(), SamplingParams(presence_penalty=-0.4, repetition_penalty=1.3)]
    batch = [req(p, output=o, rid=f"r{i}") for i, (p, o) in enumerate(zip(params, outputs))]
    expected = logits.clone()
    for i, (p, o) in enumerate(zip(params, outputs)):
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(batch[i].all_token_ids)))
            row = expected[i, seen]
            expected[i, seen] = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        if o:
            counts = torch.bincount(torch.tensor(o), minlength=V).float()
            expected[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    work = logits.clone()
    with _NoHostReads():
        Sampler(V, ())._apply_penalties(work, batch)
    assert torch.equal(work, expected)


def _race(logits_row, seed, temperature):
    """The seeded pick as the sampler has always made it: argmax(p / E), E ~ Exp(1) from the request's own host
    generator (seed + index), one vocabulary row per step."""
    noise = torch.empty(logits_row.shape[0]).exponential_(generator=torch.Generator().manual_seed(seed))
    return int(argmax(torch.softmax(logits_row / temperature, dim=-1) / noise))


def test_seeded_tokens_are_their_own_generators_race_in_any_batch():
    logits = logits_rows(5, seed=9)
    for neighbours in range(5):
        batch = [req(SamplingParams(temperature=0.8), rid=f"u{j}") for j in range(neighbours)]
        batch.insert(neighbours // 2, req(SamplingParams(temperature=0.6, seed=77), rid="seeded"))
        out = Sampler(V, (), seed=neighbours)(logits[:len(batch)], batch)
        assert out.token_ids[neighbours // 2] == _race(logits[neighbours // 2], 77, 0.6)


def test_unseeded_sampling_passes_a_chi_square_test():
    """6000 unseeded rows (beside seeded ones, which must not disturb them) drawn in one device call."""
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.07, 0.03])
    n = 6000
    logits = torch.log(probs).repeat(n + 2, 1)
    batch = [req(SamplingParams(), rid=f"u{i}") for i in range(n)]
    batch += [req(SamplingParams(seed=s), rid=f"s{s}") for s in range(2)]
    tokens = torch.tensor(Sampler(6, (), seed=0)(logits, batch).token_ids[:n])
    observed = torch.bincount(tokens, minlength=6).double()
    chi2 = float(((observed - n * probs.double()) ** 2 / (n * probs.double())).sum())
    assert chi2 < 20.52  # 5 degrees of freedom, p = 0.001
