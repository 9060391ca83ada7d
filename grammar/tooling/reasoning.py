"""Reasoning output (`--reasoning-parser`, vLLM's names `qwen3` and `deepseek_r1`): the model
thinks in `<think> ... </think>` before it answers; the thinking is `reasoning_content`, the
rest `content`.

Where the output starts depends on the prompt: one that ends in `<think>` (DeepSeek-R1's
templates) puts it inside the reasoning, one that ends in `</think>` (a template told not to
think) leaves no reasoning at all; otherwise qwen3 reasons when the output opens with `<think>`,
and deepseek_r1 starts inside the reasoning whether or not it writes the open tag. The reasoning
ends at the first `</think>` (a cut-off one stays reasoning); the whitespace after it is not
content.

Three readers agree on that, by construction: the grammar (`lark_rules`: free text without the
close tag, the close tag, then the constrained part: `response_format` and tool calls apply only
after the reasoning), `ReasoningGate` (which counts the reasoning's tokens and, once
`max_reasoning_tokens` are spent, allows only the close tag's tokens) and `ReasoningSplitter`
(which splits the text as it streams). The gate and the splitter run the same state machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from loraplex.grammar.tooling.tool_parsing import held

if TYPE_CHECKING:  # a compile worker imports this module without torch
    import torch

PARSERS = ("qwen3", "deepseek_r1")
OPEN, CLOSE = "<think>", "</think>"
STARTS = ("fresh", "inside", "closed")  # how the prompt leaves the output (see `prompt_start`)
GAP = 4  # whitespace the grammar allows between the close tag and what it constrains
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Reasoning:
    parser: str
    max_tokens: int | None = None  # output tokens before the close tag (its open tag included); then it is forced
    start: str = "fresh"  # set by the input processor from the prompt's end

    def __post_init__(self) -> None:
        if self.parser not in PARSERS:
            raise ValueError(f"reasoning parser must be one of {PARSERS}, got {self.parser!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool)
                                            or not 0 <= self.max_tokens <= INT32_MAX):
            raise ValueError(f"max_reasoning_tokens must be an integer in [0, {INT32_MAX}], got {self.max_tokens!r}")
        if self.start not in STARTS:
            raise ValueError(f"reasoning start must be one of {STARTS}, got {self.start!r}")

    @property
    def active(self) -> bool:
        """Whether the output can hold reasoning at all."""
        return self.start != "closed"

    @property
    def starts_inside(self) -> bool:
        return self.start == "inside" or (self.start == "fresh" and self.parser == "deepseek_r1")

    def key_payload(self) -> list:
        return [self.parser, self.max_tokens, self.start]


def prompt_start(prompt_tail: str) -> str:
    """How a prompt (its last characters, special tokens included) leaves the output."""
    tail = prompt_tail.rstrip()
    return "inside" if tail.endswith(OPEN) else "closed" if tail.endswith(CLOSE) else "fresh"


# ---- the grammar ------------------------------------------------------------------------------------

def lark_rules(reasoning: Reasoning, lit) -> tuple[str, list[str]]:
    """What comes before the constrained part, as (an expression for the start rule, the rules
    it uses). `lit` writes a marker as the tokenizer holds it (grammar/tool_formats.Markers)."""
    close = lit.token(CLOSE)
    if close is not None:  # one token: the thought may not spell it out in text
        rules = [f"rs_thought: RS_THOUGHT {lit(CLOSE)}", "RS_THOUGHT: /(?s:.*)/ & ~/(?s:.*)<\\/think>(?s:.*)/"]
    else:  # a lazy lexeme: the first close tag ends it
        rules = ["rs_thought[lazy]: /(.|\\n)*<\\/think>/"]
    rules.append(f"RS_GAP: /[ \\t\\r\\n]{{1,{GAP}}}/")
    thought = "rs_thought RS_GAP?"
    if reasoning.start == "inside":
        return thought, rules
    if reasoning.parser == "deepseek_r1":
        return f"{lit(OPEN)}? {thought}", rules
    return f"({lit(OPEN)} {thought})?", rules


# ---- the text ---------------------------------------------------------------------------------------

class ReasoningSplitter:
    """An output's text, piece by piece, into (reasoning, content); a piece that could be the
    start of a marker waits for the next (`final=True` flushes it)."""

    def __init__(self, reasoning: Reasoning) -> None:
        # before: an open tag may come (qwen3, deepseek_r1 without one in the prompt); gap: the
        # whitespace after the close tag
        self.phase = "content" if not reasoning.active else "before" if reasoning.start == "fresh" else "reasoning"
        self._unopened = "reasoning" if reasoning.starts_inside else "content"  # where `before` goes without a tag
        self._buffer = ""

    @property
    def thinking(self) -> bool:
        """Whether the output is (so far) inside the reasoning."""
        return self.phase == "reasoning" or (self.phase == "before" and self._unopened == "reasoning")

    def state(self) -> tuple[str, str]:
        return self.phase, self._buffer

    def restore(self, state: tuple[str, str]) -> None:
        self.phase, self._buffer = state

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self._buffer += text
        reasoning, content = [], []
        while getattr(self, f"_{self.phase}")(final, reasoning, content):
            pass
        return "".join(reasoning), "".join(content)

    def _before(self, final: bool, reasoning: list, content: list) -> bool:
        stripped = self._buffer.lstrip()
        if stripped.startswith(OPEN):
            self._buffer, self.phase = stripped[len(OPEN):], "reasoning"
        elif OPEN.startswith(stripped) and not final:
            return False
        else:
            self.phase = self._unopened
        return True

    def _reasoning(self, final: bool, reasoning: list, content: list) -> bool:
        at = self._buffer.find(CLOSE)
        if at >= 0:
            reasoning.append(self._buffer[:at])
            self._buffer, self.phase = self._buffer[at + len(CLOSE):], "gap"
            return True
        keep = 0 if final else held(self._buffer, CLOSE)
        reasoning.append(self._buffer[:len(self._buffer) - keep])
        self._buffer = self._buffer[len(self._buffer) - keep:]
        return False

    def _gap(self, final: bool, reasoning: list, content: list) -> bool:
        self._buffer = self._buffer.lstrip()
        if not self._buffer:
            return False
        self.phase = "content"
        return True

    def _content(self, final: bool, reasoning: list, content: list) -> bool:
        content.append(self._buffer)
        self._buffer = ""
        return False


def split_reasoning(reasoning: Reasoning, text: str) -> tuple[str, str]:
    """A whole output's (reasoning, content)."""
    return ReasoningSplitter(reasoning).feed(text, final=True)


# ---- the budget -------------------------------------------------------------------------------------

class ReasoningGate:
    """A grammar whose constrained part starts after the reasoning (`lark_rules`), plus the
    budget: once the output has `max_tokens` tokens and is still thinking, only the close tag's
    tokens are allowed, one after the other (from the first character boundary: a character
    whose bytes span tokens is finished first, as the grammar requires). It reads each token's
    text with the splitter's state machine, so it agrees with the split the client gets;
    rollback restores it."""

    guard = None  # no budget guard (grammar/budget.py): llguidance grammars only

    def __init__(self, inner, reasoning: Reasoning, close_ids: list[int], token_texts: list[str]) -> None:
        self.inner = inner
        self.budget = reasoning.max_tokens
        self.close_ids = close_ids
        self.texts = token_texts
        self.splitter = ReasoningSplitter(reasoning)
        self.num_tokens = 0
        self.closed = 0  # the close tag's tokens written since the budget ran out
        self._history: list[tuple] = []

    @property
    def thinking(self) -> bool:
        return self.splitter.thinking

    @property
    def forcing(self) -> bool:
        return self.budget is not None and self.num_tokens >= self.budget and self.thinking

    @staticmethod
    def fill_many(rows: list[tuple["ReasoningGate", int]], bitmask: torch.Tensor) -> None:
        by_kind: dict[type, list] = {}
        for gate, row in rows:
            by_kind.setdefault(type(gate.inner), []).append((gate.inner, row))
        for kind, items in by_kind.items():
            if hasattr(kind, "fill_many") and len(items) > 1:
                kind.fill_many(items, bitmask)
            else:
                for grammar, row in items:
                    grammar.fill_bitmask(bitmask, row)
        for gate, row in rows:
            gate._force(bitmask, row)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.inner.fill_bitmask(bitmask, row)
        self._force(bitmask, row)

    def _force(self, bitmask: torch.Tensor, row: int) -> None:
        """Past the budget: the row allows the close tag's next token alone, where the grammar
        allows it (inside the reasoning it always does, but mid-character)."""
        if not self.forcing or self.closed >= len(self.close_ids):
            return
        word, bit = divmod(self.close_ids[self.closed], 32)
        kept = int(bitmask[row, word]) & (1 << bit)
        if kept:
            bitmask[row].zero_()
            bitmask[row, word] = kept - 2**32 if kept >= 2**31 else kept  # the int32 word with that bit alone

    def accept_token(self, token_id: int) -> bool:
        if not self.inner.accept_token(token_id):
            return False
        self._history.append((self.splitter.state(), self.closed))
        if self.forcing and self.closed < len(self.close_ids) and token_id == self.close_ids[self.closed]:
            self.closed += 1
        self.num_tokens += 1
        if self.splitter.phase != "content":
            self.splitter.feed(self.texts[token_id] if token_id < len(self.texts) else "")
        return True

    def rollback(self, num_tokens: int) -> None:
        self.inner.rollback(num_tokens)
        if num_tokens:
            state, self.closed = self._history[-num_tokens]
            self.splitter.restore(state)
            del self._history[-num_tokens:]
            self.num_tokens -= num_tokens

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def jump_forward_string(self) -> str:
        """Nothing while thinking (any text may come); the grammar's forced text after."""
        return "" if self.thinking else self.inner.jump_forward_string()
