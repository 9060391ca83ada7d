"""Incremental detokenization with stop strings.

Text is decoded from a sliding window of tokens (vLLM's prefix/read offsets) so that a token
that completes a multi-byte UTF-8 character, or a word that a later token changes, is emitted
only once it is final. Stop strings are matched on the text, so they match across token
boundaries; the text that could still become a stop string is held back from streaming.

`keep`: special tokens that stay in the text although special tokens are skipped (the markers a
tool-call format or a reasoning parser reads, where the tokenizer holds them as special tokens,
as vLLM keeps Mistral's `[TOOL_CALLS]`).
"""

from __future__ import annotations

CONTEXT_TOKENS = 5  # prompt tokens decoded alongside the output, for tokenizers that need them


class Detokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str] | None = None,
                 skip_special_tokens: bool = True, include_stop: bool = False,
                 keep: frozenset[int] = frozenset()) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._skipped = special_ids(tokenizer) - keep if skip_special_tokens and keep else frozenset()
        self.tokens = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""
        self.stop = stop or []
        self.include_stop = include_stop  # vLLM's include_stop_str_in_output: cut after the stop string
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        if self._skipped:  # skip the special tokens but those kept
            return self.tokenizer.decode([t for t in ids if t not in self._skipped], skip_special_tokens=False)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, token_id: int, check_stop: bool = True) -> str | None:
        """Add one token. Returns the stop string it completed, if any (text is cut before it, or
        after it with `include_stop`)."""
        self.tokens.append(token_id)
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # an unfinished character: wait for the next token
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        self.text += delta
        return self._find_stop(len(delta)) if check_stop else None

    def _find_stop(self, delta_len: int) -> str | None:
        for stop in self.stop:
            start = max(0, len(self.text) - delta_len - len(stop) + 1)
            idx = self.text.find(stop, start)
            if idx != -1:
                self.text = self.text[:idx + (len(stop) if self.include_stop else 0)]
                return stop
        return None

    def stream_end(self, finished: bool) -> int:
        """How much of `text` is safe to show now: all of it once finished, else all but the
        tail that a stop string could still claim."""
        return len(self.text) if finished or not self.stop else max(0, len(self.text) - self.hold_back)


def special_ids(tokenizer, texts: list[str] | None = None) -> frozenset[int]:
    """The ids of the tokenizer's special tokens (those `skip_special_tokens` drops); with
    `texts`, only those that are one of them."""
    ids = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    if texts is None:
        return frozenset(ids)
    return frozenset(i for i in ids if tokenizer.convert_ids_to_tokens(i) in texts)
