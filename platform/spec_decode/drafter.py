"""Proposes each running request's drafts for the next step (`speculative.py` says what is drafted and when), and
is the one source of grammar-forced tokens.

The proposers run on the host after a step's update, on the sequences in decode; what they return is
cut to the request's room (max_tokens, max_model_len) and to what its grammar accepts, and left in
`Request.spec_token_ids` for the scheduler, which verifies them.

The text a grammar forces next (`GrammarForced`) becomes tokens one of two ways. Drafted (a request in speculative
decoding): verified like any draft, so the model may pick another tokenization. Otherwise (`--jump-forward`) its
canonical tokens are drafts accepted as they are proposed: appended after the step's sampled token, they are
computed with the next step's chunk instead of one forward pass each.
"""

from __future__ import annotations

from typing import Protocol

from loraplex.grammar.budget import guarded

from loraplex.platform.request import Request
from loraplex.platform.config import SpeculativeConfig
from loraplex.platform.spec_decode.speculative import DraftState, NgramIndex, SpecCounters


MAX_SPELLING = 4  # tokens a learned spelling of one forced token may take


class Proposer(Protocol):
    """One source of drafts: up to `room` tokens to follow the request's tokens and `drafts` (what the
    proposers before it gave). `always`: its drafts are not held to the request's adaptive k."""

    always: bool

    def propose(self, req: Request, drafts: list[int], room: int) -> list[int]: ...


class GrammarForced:
    """The tokens of the text the request's grammar forces next: `propose`, where they decode back to it (a draft:
    the model may still pick another tokenization, and verification keeps what it picks); `accepted`, its canonical
    tokens taken without the model (jump-forward)."""

    always = True  # nearly always accepted: drafted whatever the request's recent acceptance

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def propose(self, req: Request, drafts: list[int], room: int) -> list[int]:
        if req.grammar is None or drafts:
            return []
        self._learn(req)
        forced = req.grammar.jump_forward_string()
        if not forced:
            return []
        tokens = self.tokenizer.encode(forced, add_special_tokens=False)
        if self.tokenizer.decode(tokens) != forced:
            return []
        spelled = req.draft_state.spelled
        tokens = [t for token in tokens for t in spelled.get(token, (token,))]
        req.draft_state.forced.append((tokens, len(req.output_token_ids)))
        return tokens[:room]

    def accepted(self, req: Request) -> list[int]:
        """The forced tokens taken without the model: only a canonical tokenization (the forced text encodes the
        same alone and after the last token), without its last token, which could merge with what follows (left
        for the model), within max_tokens and what the matcher takes (a dry run)."""
        forced = req.grammar.jump_forward_string()
        if not forced:
            return []
        tokens = self.tokenizer.encode(forced, add_special_tokens=False)
        last = req.output_token_ids[-1]
        joined = self.tokenizer.encode(self.tokenizer.decode([last]) + forced, add_special_tokens=False)
        if self.tokenizer.decode(tokens) != forced or joined != [last, *tokens]:
            return []
        left = req.params.max_tokens - len(req.output_token_ids)
        tokens = grammar_prefix(req.grammar, tokens[:-1][:left])
        # an output kept inside its budget (grammar/budget.py): only where the rest still fits after them
        fits = not tokens or guarded(req.grammar, lambda guard: guard.fits(tuple(tokens), left), True, req.request_id)
        return tokens if fits else []

    def _learn(self, req: Request) -> None:
        """Where the model wrote the text of the first forced token it did not take in several tokens of its own,
        keep that spelling for this sequence (a draft whose text the model has only begun stays for next step)."""
        state = req.draft_state
        state.forced = [pending for pending in state.forced if not self._settle(req, *pending)]

    def _settle(self, req: Request, proposed: list[int], start: int) -> bool:
        """Whether what the model wrote since `start` decides how it spells `proposed` (recorded if differently)."""
        written = req.output_token_ids[start:]
        i = next((i for i, (a, b) in enumerate(zip(proposed, written)) if a != b), None)
        if i is None:
            return len(written) >= len(proposed)
        text = self.tokenizer.decode([proposed[i]])
        for j in range(i + 1, min(len(written), i + MAX_SPELLING) + 1):
            piece = self.tokenizer.decode(written[i:j])
            if piece == text and j - i > 1:
                req.draft_state.spelled[proposed[i]] = tuple(written[i:j])
            if piece == text or not text.startswith(piece):
                return True
        return len(written) - i >= MAX_SPELLING


class PromptLookup:
    """vLLM's n-gram proposer over the request's prompt and output (its `NgramIndex`, kept on the request)."""

    always = False  # within the request's adaptive k

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi

    def propose(self, req: Request, drafts: list[int], room: int) -> list[int]:
        index = req.draft_state.index
        if index is None:  # a structured output's values start glued to its punctuation ("The): one token found
            index = req.draft_state.index = NgramIndex(1 if req.grammar is not None else self.lo, self.hi)
        index.extend(req.token_slice(len(index.tokens), req.num_tokens))
        return index.propose(room, drafts)


class Drafter:
    def __init__(self, config: SpeculativeConfig | None, tokenizer, max_model_len: int,
                 jump_forward: bool = True) -> None:
        """`config`: None without speculative decoding (no drafts to verify; forced tokens still accepted where
        `jump_forward`)."""
        self.config = config
        self.max_model_len = max_model_len
        self.forced = GrammarForced(tokenizer)
        self.jump_forward = jump_forward
        self.proposers: list[Proposer] = [self.forced] if config is not None and config.grammar_drafts else []
        if config is not None and config.method == "ngram":
            self.proposers.append(PromptLookup(config.prompt_lookup_min, config.prompt_lookup_max))
        self.step = 0
        self.counters = SpecCounters()
        self.by_adapter: dict[str, SpecCounters] = {}  # an adapter's own requests (a mix: each of its adapters)
        self.num_jump_forward_tokens = 0  # forced tokens accepted as proposed

    def accept_forced(self, req: Request, batch_size: int) -> list[int]:
        """The forced tokens `req` takes now, without the model, in a batch of `batch_size` running sequences:
        none where they are drafted and verified instead (`_drafts_forced`)."""
        if not self.jump_forward or req.grammar is None or self._drafts_forced(req, batch_size):
            return []
        tokens = self.forced.accepted(req)
        self.num_jump_forward_tokens += len(tokens)
        return tokens

    def _drafts_forced(self, req: Request, batch_size: int) -> bool:
        return self._drafting(batch_size) and self.config.grammar_drafts and req.params.speculative

    def _drafting(self, batch_size: int) -> bool:
        return self.config is not None and batch_size <= self.config.disable_by_batch_size

    def propose(self, running: list[Request]) -> None:
        """Set the drafts of every running sequence in decode; a batch wider than `disable_by_batch_size`
        drafts nothing (a wide batch's step costs about its tokens: drafts stop being nearly free)."""
        if self.config is None:
            return
        self.step += 1
        drafting = self._drafting(len(running))
        for req in running:  # last step's drafts of a request not scheduled then go: proposed again from here
            in_decode = req.num_tokens - req.num_computed_tokens == 1 and bool(req.output_token_ids)
            req.spec_token_ids = self._draft(req) if drafting and in_decode and req.params.speculative else []

    def record(self, req: Request, drafted: int, accepted: int) -> None:
        """A verified draft: the counters, and the request's acceptance that sets its next k."""
        if not drafted:
            return
        self.counters.add(drafted, accepted)
        for name in req.adapter_names:
            self.by_adapter.setdefault(name, SpecCounters()).add(drafted, accepted)
        req.draft_state.acceptance.record(drafted, accepted)

    def _draft(self, req: Request) -> list[int]:
        """The proposers' drafts in order, within num_speculative_tokens (the adaptive k for proposers not
        `always`), max_tokens and max_model_len, up to the first token its grammar rejects."""
        state = req.draft_state = req.draft_state or DraftState(None)
        cap = min(self.config.num_speculative_tokens, req.params.max_tokens - len(req.output_token_ids) - 1,
                  self.max_model_len - req.num_tokens - 1)
        if cap <= 0:
            return []
        k = min(cap, state.acceptance.k(self.step, self.config.num_speculative_tokens, self.config.min_acceptance))
        drafts: list[int] = []
        for proposer in self.proposers:
            room = (cap if proposer.always else k) - len(drafts)
            if room > 0:
                drafts += proposer.propose(req, drafts, room)[:room]
        return grammar_prefix(req.grammar, drafts) if req.grammar is not None and drafts else drafts


def grammar_prefix(grammar, tokens: list[int]) -> list[int]:
    """The tokens up to the first the grammar rejects (a dry run on the matcher, rolled back): drafts, verified or
    accepted as proposed."""
    accepted = 0
    for token in tokens:
        if grammar.is_terminated() or not grammar.accept_token(token):
            break
        accepted += 1
    grammar.rollback(accepted)
    return tokens[:accepted]
