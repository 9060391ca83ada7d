"""Speculative decoding: what is drafted, and for whom.

A running request in decode gets up to k draft tokens before each step; the step computes them with
the request's next token, as one multi-token chunk (`Request.spec_token_ids`), and `verify.py` keeps
the longest prefix the model itself would have produced. Drafts come from two proposers, behind
`propose`:

- grammar-forced tokens: what a request's grammar forces next (keys, punctuation, closing brackets),
  the text jump-forward would append, here drafted and verified instead of appended unseen;
- n-gram prompt lookup (vLLM's `ngram`): the last n tokens (n from `prompt_lookup_max` down to
  `prompt_lookup_min`) matched at their latest earlier place in the prompt and output, and what
  followed there proposed.

A draft is cut at the first token its grammar rejects (a dry run on the matcher, rolled back), at
max_tokens and at max_model_len. `Acceptance` adapts each request's k to what it has been accepting
(0 pauses it, with a growing back-off); a batch wider than `disable_by_batch_size` drafts nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

class NgramIndex:
    """A request's n-grams (n in [lo, hi]) -> the latest place each starts, kept as tokens are appended: every
    n-gram but the newest (the suffix itself) is in, so a lookup finds the latest earlier occurrence in O(hi)."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(lo, hi + 1)}
        self.tokens: list[int] = []

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens) - 1  # the n-gram ending just before the new token is no longer the suffix
            for n, table in self.tables.items():
                if end >= n:
                    table[tuple(self.tokens[end - n:end])] = end - n

    def propose(self, k: int, tail: list[int] = ()) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix found of the tokens
        and then `tail` (drafts already taken)."""
        recent = self.tokens[-self.hi:] + list(tail)
        total = len(self.tokens) + len(tail)
        for n in range(self.hi, self.lo - 1, -1):
            if total <= n:
                continue
            start = self.tables[n].get(tuple(recent[-n:]))
            if start is not None:
                return self.tokens[start + n:start + n + k]
        return []


FIRST_BACKOFF = 8  # steps, the first pause
MAX_BACKOFF = 256  # steps, the longest pause


@dataclass
class Acceptance:
    """A request's recent acceptance (an exponential average of accepted / drafted) and its back-off."""

    rate: float = 1.0  # optimistic: a request's first drafts are tried at full length
    paused_until: int = 0  # step before which it drafts nothing
    # steps the next pause lasts: doubles each pause, up to MAX_BACKOFF, and starts over at a draft accepted whole
    # (a request that copies, invents, then copies again is not held to the pauses of its inventing)
    backoff: int = FIRST_BACKOFF

    def k(self, step: int, most: int, min_acceptance: float) -> int:
        """The request's k at this step; an acceptance below `min_acceptance` starts a pause here."""
        if step < self.paused_until:
            return 0
        if self.rate < min_acceptance:
            self.paused_until, self.backoff = step + self.backoff, min(2 * self.backoff, MAX_BACKOFF)
            self.rate = min_acceptance  # a probe after the pause: one miss pauses it again
            return 0
        return max(1, min(most, math.ceil(most * 2 * self.rate)))  # at rate >= 0.5, all of them

    def record(self, drafted: int, accepted: int) -> None:
        if not drafted:
            return
        self.rate = 0.5 * self.rate + 0.5 * accepted / drafted
        if accepted == drafted:
            self.backoff = FIRST_BACKOFF



@dataclass
class DraftState:
    """What the drafter keeps on a sequence (`Request.draft_state`)."""

    index: NgramIndex | None
    acceptance: Acceptance = field(default_factory=Acceptance)
    # grammar-forced drafts whose spelling is still to be compared with what the model wrote (and the output
    # length when they were drafted)
    forced: list[tuple[list[int], int]] = field(default_factory=list)
    # a token of forced text -> the tokens the model wrote its text in instead (JSON's `":"` as `":` `"`), drafted
    # so from then on; kept per sequence, so no request's drafts depend on another's output
    spelled: dict[int, tuple[int, ...]] = field(default_factory=dict)


@dataclass
class SpecCounters:
    """vLLM's spec-decode counters (drafts, draft tokens, accepted tokens, accepted per position)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < drafted:
            self.accepted_per_position += [0] * (drafted - len(self.accepted_per_position))
        for position in range(accepted):
            self.accepted_per_position[position] += 1

    def copy(self) -> SpecCounters:
        return SpecCounters(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                            list(self.accepted_per_position))
