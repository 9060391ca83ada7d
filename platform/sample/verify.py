"""Verification of drafts: each sequence's tokens taken one position at a time from its rows of the step's
logits, exactly as decoding without drafts would take them.

Round d samples row d of every sequence still going, with the sampler's every transform (grammar mask,
penalties, min_tokens, logit_bias, temperature, top-k / top-p / min-p, its seed), after the tokens of
rounds before it were appended (so the grammar mask, penalties and counts are those of that position).
A sequence goes on to round d + 1 only if it still runs and the token it got is its draft d: the KV
the step computed at that draft is then what decoding would have computed. So greedy output is token
for token the same. For sampled output this is rejection sampling of deterministic drafts (q = a point
mass on the draft d): accepting d with probability min(1, p(d) / q(d)) = p(d), else drawing from the
residual max(0, p - q) normalized, gives the same law as drawing t ~ p and accepting iff t = d, which
is what is done (and a seeded request draws the same noise per token as without drafts).
"""

from __future__ import annotations

from typing import Callable

import torch

from loraplex.kernels.dispatch import to_device
from loraplex.platform.request import Logprob, Request
from loraplex.platform.sample.sampler import Sampler, argmax, to_host

Append = Callable[[int, int, "dict[int, Logprob] | None"], bool]  # (batch index, token, logprobs) -> still runs


def verify(sampler: Sampler, logits: torch.Tensor, rows: list[int], batch: list[Request], append: Append
           ) -> list[int]:
    """`rows[i]`: the first of batch[i]'s rows (its next token's; one more after each of its drafts).
    Appends each sequence's tokens through `append`; returns how many drafts each accepted."""
    accepted = [0] * len(batch)
    greedy = _greedy_picks(sampler, logits, batch)
    live, depth = list(range(len(batch))), 0
    while live:
        index = [rows[i] + depth for i in live]
        if greedy is not None:
            tokens, logprobs = [greedy[r] for r in index], [None] * len(live)
        else:
            picked = to_device(torch.tensor(index, dtype=torch.long, device="cpu"), logits.device)
            out = sampler(logits[picked], [batch[i] for i in live])
            tokens, logprobs = out.token_ids, out.logprobs
        going = []
        for i, token, lp in zip(live, tokens, logprobs):
            drafts = batch[i].spec_token_ids
            if append(i, token, lp) and depth < len(drafts) and token == drafts[depth]:
                accepted[i] += 1
                going.append(i)
        live, depth = going, depth + 1
    return accepted


def _greedy_picks(sampler: Sampler, logits: torch.Tensor, batch: list[Request]) -> list[int] | None:
    """Every row's argmax in one read when nothing but argmax picks (what the sampler would do per row)."""
    return to_host(argmax(logits)) if sampler.argmax_only(batch) else None
