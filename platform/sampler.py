"""Logits -> next tokens: grammar bitmask, penalties, temperature, top-k / top-p / min-p, seeded
sampling, logprobs.

Rows are requests; each transform touches only the rows that asked for it. Logprobs are those
of the raw model distribution (before any transform), as vLLM reports them.

The logits stay on the engine's device; per-request values go there as small tensors, and the
exponential noise of seeded sampling is drawn on the host from each request's own generator, so
a seed gives the same tokens on any device. The one read back is the sampled token ids (and,
when a request asks for logprobs, its rows of them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraplex.kernels.dispatch import to_device
from loraplex.platform.request import Logprob, Request


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...], seed: int = 0, grammars=None,
                 json_close_window: int = 0, device: torch.device = torch.device("cpu")) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.grammars = grammars  # a GrammarManager: fills and applies the structured rows' bitmask
        self.json_close_window = json_close_window
        self.eos_token_ids = list(eos_token_ids)
        self.generator = torch.Generator().manual_seed(seed)  # for requests without a seed

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """logits [R, vocab] in the model's dtype, one row per request."""
        if self._argmax_only(requests):  # bf16 -> float32 is exact: the same picks, without widening the rows
            return SamplerOutput(argmax(logits).tolist(), [None] * len(requests))
        logits = logits.float()
        raw_logprobs = None
        if any(r.params.logprobs is not None for r in requests):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        structured = self.grammars is not None and any(r.grammar is not None for r in requests)
        if structured or any(_edits_logits(r.params, len(r.output_token_ids)) for r in requests):
            logits = logits.clone()  # the transforms below write in place; the caller's logits stay
        if structured:
            self.grammars.apply(logits, [r.grammar for r in requests],  # before any other transform
                                [self._closing(r) for r in requests])
        self._block_early_stop(logits, requests)
        self._apply_penalties(logits, requests)
        self._apply_logit_bias(logits, requests)
        token_ids = self._sample(logits, requests)
        if raw_logprobs is not None:
            raw_logprobs = raw_logprobs.cpu()
        logprobs = [
            _logprobs_of(raw_logprobs[i], token_ids[i], r.params.logprobs) if r.params.logprobs is not None else None
            for i, r in enumerate(requests)
        ]
        return SamplerOutput(token_ids, logprobs)

    def _argmax_only(self, requests: list[Request]) -> bool:
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
            if (p.presence_penalty or p.frequency_penalty) and r.output_token_ids:
                counts = torch.bincount(self._put(r.output_token_ids), minlength=logits.shape[1]).float()
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()

    def _apply_logit_bias(self, logits: torch.Tensor, requests: list[Request]) -> None:
        """OpenAI's logit_bias, after the grammar mask (a bias never un-masks a token: -inf stays)."""
        for i, r in enumerate(requests):
            if r.params.logit_bias:
                ids = self._put(list(r.params.logit_bias))
                logits[i, ids] += self._put(list(r.params.logit_bias.values()), logits.dtype)

    def _put(self, values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=dtype, device="cpu"), self.device)

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        out = argmax(logits)
        picked = [i for i, r in enumerate(requests) if not r.params.greedy]
        if not picked:
            return out.tolist()
        rows = self._put(picked)
        sampled = [requests[i] for i in picked]
        temps = self._put([r.params.temperature for r in sampled], logits.dtype)[:, None]
        probs = filter_and_softmax(logits[rows] / temps, sampled)
        # Exponential race (Gumbel-max): argmax(p / E) with E ~ Exp(1) draws from p. Each
        # request with a seed draws E from its own generator, so its tokens do not depend on
        # what else shares the batch (nor on the device: E is drawn on the host).
        noise = torch.empty(probs.shape, dtype=probs.dtype, device="cpu")
        for j, r in enumerate(sampled):
            noise[j].exponential_(generator=r.generator or self.generator)
        out[rows] = argmax(probs / to_device(noise, probs.device))
        return out.tolist()


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's maximum, the first of ties (argmax's answer): on CPU `max` finds it
    2.6-2.8x faster than `argmax` over a vocabulary-wide row (0.85 vs 2.2 ms at batch 64)."""
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
        sorted_logits, order = logits.sort(dim=-1, descending=True)
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


PROMPT_LOGPROB_ROWS = 128  # prompt positions turned into logits at once (each row is vocab-sized)


def prompt_logprobs(compute_logits, hidden: torch.Tensor, targets: list[int], num_top: int
                    ) -> list[dict[int, Logprob]]:
    """Each row's logprob of its target token (and the `num_top` best), from the raw logits:
    what the model thought of the prompt, before any sampling transform."""
    out = []
    for start in range(0, len(targets), PROMPT_LOGPROB_ROWS):
        rows = torch.log_softmax(compute_logits(hidden[start:start + PROMPT_LOGPROB_ROWS]).float(), dim=-1).cpu()
        out += [_logprobs_of(row, target, num_top) for row, target in zip(rows, targets[start:])]
    return out


def _logprobs_of(row: torch.Tensor, token_id: int, num_top: int) -> dict[int, Logprob]:
    chosen = float(row[token_id])
    out = {token_id: Logprob(chosen, int((row > row[token_id]).sum()) + 1)}
    if num_top:
        values, ids = row.topk(num_top)
        for rank, (v, t) in enumerate(zip(values.tolist(), ids.tolist()), start=1):
            out.setdefault(t, Logprob(v, rank))
    return out
