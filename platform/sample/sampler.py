"""Logits -> next tokens: grammar bitmask, penalties, temperature, top-k / top-p / min-p, seeded
sampling, logprobs.

Rows are requests; each transform touches only the rows that asked for it. Logprobs are those
of the raw model distribution (before any transform), as vLLM reports them.

The logits stay on the engine's device; per-request values go there as small tensors. The exponential
noise of requests without a seed is drawn on the device in one call; a seeded request's rows are drawn
on the host from its own generator (only those rows cross to the device), so a seed gives the same
tokens on any device and whatever shares its batch. Penalty counts are a `scatter_add_` (no host read).
What comes back is the sampled token ids and, for requests that ask for logprobs, each one's chosen
logprob, rank and top-k (k columns, never a vocabulary-wide row): every read goes through `to_host`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from loraplex.grammar.budget import guarded
from loraplex.kernels.dispatch import to_device
from loraplex.platform.request import Logprob, Request


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...], seed: int = 0, grammars=None,
                 json_close_window: int = 0, device: torch.device = torch.device("cpu"),
                 max_model_len: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.max_model_len = max_model_len
        self.grammars = grammars  # a GrammarManager: fills and applies the structured rows' bitmask
        self.json_close_window = json_close_window
        self.eos_token_ids = list(eos_token_ids)
        self.generator = torch.Generator(device=device).manual_seed(seed)  # for requests without a seed

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """logits [R, vocab] in the model's dtype, one row per request."""
        if self.argmax_only(requests):  # bf16 -> float32 is exact: the same picks, without widening the rows
            return SamplerOutput(to_host(argmax(logits)), [None] * len(requests))
        logits = logits.float()
        wanted = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits[self._put(wanted)], dim=-1) if wanted else None
        structured = self.grammars is not None and any(r.grammar is not None for r in requests)
        if structured or any(_edits_logits(r.params, len(r.output_token_ids)) for r in requests):
            logits = logits.clone()  # the transforms below write in place; the caller's logits stay
        if structured:
            self.grammars.apply(logits, [r.grammar for r in requests],  # before any other transform
                                [self._closing(r) for r in requests])
        self._block_early_stop(logits, requests)
        self._apply_penalties(logits, requests)
        self._apply_logit_bias(logits, requests)
        tokens, ranked = self._sample(logits, requests)
        picked, changed = self._within_budget(tokens, ranked, requests) if structured else (None, False)
        if changed:
            tokens = self._put(picked)
        logprobs: list[dict[int, Logprob] | None] = [None] * len(requests)
        if raw_logprobs is not None:
            found = logprobs_of(raw_logprobs, tokens[self._put(wanted)], [requests[i].params.logprobs for i in wanted])
            for i, entry in zip(wanted, found):
                logprobs[i] = entry
        return SamplerOutput(picked if picked is not None else to_host(tokens), logprobs)

    @staticmethod
    def plain(r: Request) -> bool:
        """Sampled from its logits alone, whatever its tokens so far (no grammar, penalties over them, min_tokens
        still ahead, logprobs, forks or drafts): its pick may stay on the device while the next step is launched
        (--async-scheduling), and `on_device` picks it as `__call__` would."""
        p = r.params
        return (r.grammar is None and p.logprobs is None and p.prompt_logprobs is None and p.n == 1
                and not r.spec_token_ids and p.repetition_penalty == 1.0
                and not (p.presence_penalty or p.frequency_penalty) and len(r.output_token_ids) >= p.min_tokens)

    def on_device(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """The picks of `plain` requests [R], on the device (nothing read back): `__call__`'s numbers."""
        if self.argmax_only(requests):
            return argmax(logits)
        logits = logits.float()
        if any(r.params.logit_bias for r in requests):
            logits = logits.clone()
            self._apply_logit_bias(logits, requests)
        return self._sample(logits, requests)[0]

    def argmax_only(self, requests: list[Request]) -> bool:
        return all(r.params.greedy and r.params.logprobs is None and r.grammar is None
                   and not _edits_logits(r.params, len(r.output_token_ids)) for r in requests)

    def _closing(self, r: Request) -> bool:
        """A JSON output in the last max(json_close_window, max_tokens / 4) tokens of its budget
        (at most its second half): steer it to close rather than be cut off (an endless string,
        array or nesting is valid until max_tokens; closing a deep nesting takes a token per
        level or two)."""
        compiled = r.compiled_grammar
        if not self.json_close_window or r.grammar is None or compiled is None or not compiled.ends_in_json:
            return False
        if guarded(r.grammar, lambda guard: guard.current() is not None, False, r.request_id):
            return False  # kept inside its budget exactly
        window = min(max(self.json_close_window, r.params.max_tokens // 4), r.params.max_tokens // 2)
        return r.params.max_tokens - len(r.output_token_ids) <= window

    def _block_early_stop(self, logits: torch.Tensor, requests: list[Request]) -> None:
        """min_tokens: no EOS or stop token before the request has that many tokens, unless a
        grammar allows nothing else (its output is complete: ending beats an invalid token)."""
        for i, r in enumerate(requests):
            if len(r.output_token_ids) < r.params.min_tokens:
                stops = self._put([t for t in r.params.stop_token_ids +
                                   ([] if r.params.ignore_eos else self.eos_token_ids) if t < logits.shape[1]])
                kept = logits[i, stops].clone()
                logits[i, stops] = float("-inf")
                if r.grammar is not None:  # without a host read: keep `kept` where nothing else is left
                    logits[i, stops] = torch.where(torch.isinf(logits[i]).all(), kept, logits[i, stops])

    def _apply_penalties(self, logits: torch.Tensor, requests: list[Request]) -> None:
        for i, r in enumerate(requests):
            p = r.params
            if p.repetition_penalty != 1.0:
                seen = self._put(sorted(set(r.all_token_ids)))
                row = logits[i, seen]
                logits[i, seen] = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        counted = [i for i, r in enumerate(requests)
                   if (r.params.presence_penalty or r.params.frequency_penalty) and r.output_token_ids]
        if counted:
            self._apply_counts(logits, [requests[i] for i in counted], self._put(counted))

    def _apply_counts(self, logits: torch.Tensor, requests: list[Request], rows: torch.Tensor) -> None:
        """Presence and frequency penalties of these rows from their output tokens' counts, counted with
        `scatter_add_` into one [rows, vocab] tensor (`bincount` reads its input's maximum on the host)."""
        vocab = logits.shape[1]
        flat = self._put([k * vocab + t for k, r in enumerate(requests) for t in r.output_token_ids])
        counts = torch.zeros(len(requests) * vocab, dtype=logits.dtype, device=logits.device)
        counts.scatter_add_(0, flat, torch.ones(len(flat), dtype=logits.dtype, device=logits.device))
        counts = counts.view(len(requests), vocab)
        frequency = self._put([r.params.frequency_penalty for r in requests], logits.dtype)[:, None]
        presence = self._put([r.params.presence_penalty for r in requests], logits.dtype)[:, None]
        logits[rows] -= frequency * counts + presence * (counts > 0).float()

    def _apply_logit_bias(self, logits: torch.Tensor, requests: list[Request]) -> None:
        """OpenAI's logit_bias, after the grammar mask (a bias never un-masks a token: -inf stays)."""
        for i, r in enumerate(requests):
            if r.params.logit_bias:
                ids = self._put(list(r.params.logit_bias))
                logits[i, ids] += self._put(list(r.params.logit_bias.values()), logits.dtype)

    def _put(self, values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=dtype, device="cpu"), self.device)

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> tuple[torch.Tensor, Callable]:
        """The picked token of each row, on the device; and each row's ranking of the tokens (its row of scores,
        best first: the pick is its first), for a pick that must be taken back."""
        out = argmax(logits)
        picked = [i for i, r in enumerate(requests) if not r.params.greedy]
        if not picked:
            return out, lambda i: logits[i]
        rows = self._put(picked)
        sampled = [requests[i] for i in picked]
        temps = self._put([r.params.temperature for r in sampled], logits.dtype)[:, None]
        probs = filter_and_softmax(logits[rows] / temps, sampled)
        # Exponential race (Gumbel-max): argmax(p / E) with E ~ Exp(1) draws from p; the race's next places
        # draw from p without the tokens before them (a token taken back leaves the law of the rest as it was).
        race = probs / self._noise(probs, sampled)
        out[rows] = argmax(race)
        where = {i: k for k, i in enumerate(picked)}
        return out, lambda i: race[where[i]].masked_fill(race[where[i]] <= 0, float("-inf")) if i in where \
            else logits[i]

    def _within_budget(self, tokens: torch.Tensor, ranked: Callable, requests: list[Request]
                       ) -> tuple[list[int] | None, bool]:
        """The picks, on the host, with each guarded row's pick (grammar/budget.py) taken back where it would leave
        more to write than the tokens left: the next of its ranking that fits instead, else its plan's next token;
        and whether any was. (None, False) where no row is guarded (the picks stay on the device)."""
        rows = [i for i, r in enumerate(requests) if r.grammar is not None and r.grammar.guard is not None]
        if not rows:
            return None, False
        picks, changed = to_host(tokens), False
        for i in rows:
            r, left = requests[i], self._tokens_left(requests[i])
            if not guarded(r.grammar, lambda guard: guard.fits((picks[i],), left), True, r.request_id):
                fitting = guarded(r.grammar, lambda guard: self._first_fitting(guard, ranked(i), left, picks[i]),
                                  None, r.request_id)
                picks[i], changed = fitting if fitting is not None else picks[i], True
        return picks, changed

    def _first_fitting(self, guard, scores: torch.Tensor, left: int, taken_back: int) -> int:
        top = scores.topk(min(BUDGET_CANDIDATES, scores.shape[0]))
        values, ids = to_host(top.values), to_host(top.indices)
        for value, token in zip(values, ids):
            if value == float("-inf"):
                break
            if token != taken_back and guard.fits((token,), left):
                return token
        fallback = guard.fallback()
        return fallback if fallback is not None else taken_back

    def _tokens_left(self, r: Request) -> int:
        left = r.params.max_tokens - len(r.output_token_ids)
        return left if self.max_model_len is None else min(left, self.max_model_len - r.num_tokens)

    def _noise(self, probs: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Exp(1) noise shaped as `probs`: rows without a seed in one draw on the device from the sampler's
        generator; each seeded row on the host from its request's own generator, so its tokens depend neither
        on what else shares the batch nor on the device (only those rows are copied)."""
        noise = torch.empty_like(probs)
        seeded = [j for j, r in enumerate(requests) if r.generator is not None]
        if len(seeded) < len(requests):
            noise.exponential_(generator=self.generator)
        if seeded:
            host = torch.empty(len(seeded), probs.shape[1], dtype=probs.dtype, device="cpu")
            for row, j in zip(host, seeded):
                row.exponential_(generator=requests[j].generator)
            noise[self._put(seeded)] = to_device(host, probs.device)
        return noise


def to_host(values: torch.Tensor) -> list:
    """The one way a sampler result leaves the device (a host read: it waits for the device)."""
    return values.tolist()


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's maximum, the first of ties (argmax's answer): on CPU `max` finds it
    faster than `argmax` over a vocabulary-wide row (docs/benchmarks-history.md has the numbers)."""
    return x.max(dim=-1).indices


def _edits_logits(params, num_output_tokens: int) -> bool:
    return (num_output_tokens < params.min_tokens or params.repetition_penalty != 1.0
            or bool(params.presence_penalty or params.frequency_penalty) or bool(params.logit_bias))


def filter_and_softmax(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """top-k, then top-p, then min-p, each only where a request set it."""
    top_k = [r.params.top_k for r in requests]
    top_p = [r.params.top_p for r in requests]
    min_p = [r.params.min_p for r in requests]
    vocab, device = logits.shape[1], logits.device

    def put(values: list) -> torch.Tensor:
        return to_device(torch.tensor(values, device="cpu"), device)

    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # ties cut in id order
        k = put([min(k, vocab) if k > 0 else vocab for k in top_k])
        ranks = torch.arange(vocab, device=device)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly before each token: keeps the first
        sorted_logits = sorted_logits.masked_fill(before >= put(top_p)[:, None], float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    if any(p > 0 for p in min_p):
        threshold = put(min_p)[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


BUDGET_CANDIDATES = 4  # a pick taken back (grammar/budget.py): the ranking's next tried before the plan's token
PROMPT_LOGPROB_ROWS = 128  # prompt positions turned into logits at once (each row is vocab-sized)


def prompt_logprobs(compute_logits, hidden: torch.Tensor, targets: list[int], num_top: int
                    ) -> list[dict[int, Logprob]]:
    """Each row's logprob of its target token (and the `num_top` best), from the raw logits:
    what the model thought of the prompt, before any sampling transform."""
    out = []
    for start in range(0, len(targets), PROMPT_LOGPROB_ROWS):
        rows = torch.log_softmax(compute_logits(hidden[start:start + PROMPT_LOGPROB_ROWS]).float(), dim=-1)
        chunk = targets[start:start + len(rows)]
        tokens = to_device(torch.tensor(chunk, dtype=torch.long, device="cpu"), rows.device)
        out += logprobs_of(rows, tokens, [num_top] * len(chunk))
    return out


def logprobs_of(rows: torch.Tensor, tokens: torch.Tensor, num_tops: list[int]) -> list[dict[int, Logprob]]:
    """Each row's logprob of its token (with its rank: 1 + the entries above it) and its `num_top` best,
    found on the device: one read of [rows, 3 + 2k] values comes back, k the largest `num_top`."""
    k = min(max(num_tops), rows.shape[1])
    chosen = rows.gather(1, tokens[:, None])
    ranks = (rows > chosen).sum(dim=1, keepdim=True) + 1
    top_values, top_ids = ranked_top(rows, k)
    # float64 holds the float32 logprobs and every id and rank exactly: one tensor, one read
    packed = torch.cat([t.double() for t in (tokens[:, None], chosen, ranks, top_values, top_ids)], dim=1)
    return [_entry(row, k, num_top) for row, num_top in zip(to_host(packed), num_tops)]


def ranked_top(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k largest values and their ids, ties broken by the lower id: `topk` alone picks among ties by
    its own internal order, which changes with k (the batch's largest `logprobs`), so a request's alternatives
    would depend on its neighbours'."""
    if k == 0:
        return rows.topk(0, dim=-1)
    kth = rows.topk(k, dim=-1).values[:, -1:]
    above, ties = rows > kth, rows == kth
    keep = above | ties & (ties.cumsum(dim=1) <= k - above.sum(dim=1, keepdim=True))
    found = keep.nonzero()[:, 1]
    if found.numel() != rows.shape[0] * k:  # NaN in a row: no order to keep
        return rows.topk(k, dim=-1)
    ids = found.view(rows.shape[0], k)  # exactly k a row, in id order
    values, order = rows.gather(1, ids).sort(dim=1, descending=True, stable=True)
    return values, ids.gather(1, order)


def _entry(packed: list[float], k: int, num_top: int) -> dict[int, Logprob]:
    """A row of `logprobs_of`'s read: the chosen token's entry first, then its top `num_top`."""
    token, chosen, rank, values, ids = packed[0], packed[1], packed[2], packed[3:3 + k], packed[3 + k:]
    out = {int(token): Logprob(chosen, int(rank))}
    for place, (value, t) in enumerate(zip(values[:num_top], ids[:num_top]), start=1):
        out.setdefault(int(t), Logprob(value, place))
    return out
