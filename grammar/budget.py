"""Valid inside max_tokens: how many tokens a constrained output still needs to end valid, and a guard that never
lets it need more than it has left.

A `Planner` finds, from a matcher's state, a short text the grammar accepts as the rest of the output. It walks a
copy of the matcher byte by byte: the bytes the grammar forces, else a closer (`"`, `}`, `]`) that closes something
(after it a text character is refused: inside a string `}` is text), else a hint (the spec's enum and const
strings, examples of its formats, a short example and the literal runs of its patterns, its choices), else one
plain byte, tried in a fixed order; it does this for a few orders (digits first, punctuation first, letters first)
and keeps the one with the fewest tokens; each walk within a bound of bytes and of matcher steps (a long walk
only where no short one ends). The text is cut into the tokenizer's own tokens and checked on another
copy: a plan is always a completion the grammar accepts, and its length an upper bound on the shortest one (the
shortest itself in the usual cases: a closing quote and brackets, the required keys with their smallest values).
Where no order ends within those bounds there is no plan, and the sequence is not guarded (the soft
`--json-close-window` steer applies instead) until one is found again: never a wrong answer, only no promise.

A `BudgetGuard` keeps one sequence's invariant: a plan from its state fits the tokens it has left. The sampler asks
`fits(token, left)` of each token it picks; a token that would leave more to write than there is room for is
replaced by the best-ranked one that fits, else by the plan's next token. Checking a token is cheap in the
usual case: the plan from before the token is tried again after it (inside a string it still ends the output), and
a new plan is searched only where that fails.
"""

from __future__ import annotations

import json
import logging
import re
import string
import threading

from loraplex.grammar.schema.json_schema import walk

log = logging.getLogger(__name__)

# a walk stops past these many bytes or matcher steps: the short walks (a few orders), then one long one
SHORT_PLAN_BYTES, SHORT_WALK_OPS = 1024, 8_000
MAX_PLAN_BYTES, MAX_PLAN_OPS = 8192, 20_000
MAX_HINTS, MAX_HINT_BYTES = 64, 64
RETRY_AFTER, MAX_RETRY_AFTER = 16, 256  # tokens before a state without a plan is searched again (doubling)
MAX_HISTORY = 256  # rollbacks reach back at most this far (drafts, a jump-forward's dry run)
CLOSERS = '"}]'
CLOSER_LOOKAHEAD = 3
PROBES = "~`^|"
_PUNCT = "-.:@/_T+ ,#!$%&*=?~;|<>()[{^"
ORDERS = (string.digits + _PUNCT + string.ascii_lowercase + string.ascii_uppercase,
          _PUNCT + string.ascii_lowercase + string.digits + string.ascii_uppercase,
          string.ascii_lowercase + string.digits + _PUNCT + string.ascii_uppercase)
# one short valid example of each format a backend has a grammar for: a hint (tried, never trusted)
FORMAT_EXAMPLES = {"date-time": "2000-01-01T00:00:00Z", "date": "2000-01-01", "time": "00:00:00Z",
                   "duration": "P1D", "email": "a@a.aa", "hostname": "a", "ipv4": "0.0.0.0", "ipv6": "::",
                   "uri": "a:", "uri-reference": "a", "uuid": "00000000-0000-0000-0000-000000000000",
                   "json-pointer": "/a"}


class Planner:
    """Plans for one tokenizer (an `llguidance.LLTokenizer`): see the module's docstring."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.byte_tokens: dict[str, int] = {}  # the printable ASCII characters that are a token of their own
        for char in string.printable:
            ids = tokenizer.tokenize_bytes(char.encode())
            if len(ids) == 1:
                self.byte_tokens[char] = ids[0]
        self.closers = [self.byte_tokens[c] for c in CLOSERS if c in self.byte_tokens]
        # a character only text takes (None: every closer counts as closing)
        self.probe = next((self.byte_tokens[c] for c in PROBES if c in self.byte_tokens), None)
        self._local = threading.local()  # the matcher steps of this thread's current plan

    def hints(self, texts) -> tuple[tuple[int, ...], ...]:
        """The hint texts as token ids, shortest first, at most MAX_HINTS."""
        unique = sorted({t for t in texts if 0 < len(t.encode()) <= MAX_HINT_BYTES}, key=lambda t: (len(t), t))
        return tuple(tuple(self.tokenizer.tokenize_bytes(t.encode())) for t in unique[:MAX_HINTS])

    def plan(self, matcher, hints=()) -> tuple[int, ...] | None:
        """The fewest tokens, over the orders, of a completion from `matcher`'s state, found on a copy (the
        matcher may be a compile's start state that other threads copy). Short walks first, each within
        SHORT_PLAN_BYTES and its share of matcher steps; one long walk only where none of them ends."""
        m, best = matcher.deep_copy(), None
        for order in ORDERS:
            found = self._attempt(m, hints, order, SHORT_PLAN_BYTES, SHORT_WALK_OPS)
            if found is not None and (best is None or len(found) < len(best)):
                best = found
            if best is not None and len(best) <= 1:
                return best
        if best is None:  # a byte each order keeps picking (an email's local part): the least used byte first
            best = self._attempt(m, hints, ORDERS[0], SHORT_PLAN_BYTES, SHORT_WALK_OPS, least_used=True)
        if best is None:  # a long shortest answer (300 required items, a 3,000-character string)
            best = self._attempt(m, hints, ORDERS[0], MAX_PLAN_BYTES, MAX_PLAN_OPS)
        return best

    def _attempt(self, m, hints, order: str, max_bytes: int, max_ops: int, least_used: bool = False):
        self._local.ops, self._local.limit = 0, max_ops
        try:
            return self._tokens(m, self._walk(m, hints, order, max_bytes, least_used))
        except _OutOfSteps:
            return None

    def _walk(self, matcher, hints, order: str, max_bytes: int, least_used: bool = False) -> bytes | None:
        m = matcher.deep_copy()
        out, used, tried = bytearray(), dict.fromkeys(order, 0), set()  # tried: hints since the last close
        while len(out) <= max_bytes:
            if m.is_accepting():
                return bytes(out)
            forced = m.compute_ff_bytes()
            if forced and self._eat(m, self._tokenize(forced)):
                out += forced
                tried.clear()
                continue
            step = self._closer(m)
            if step is not None:
                tried.clear()
            else:
                step = self._hint(m, hints, tried)
            # else a plain byte; else a closer as text, as the last resort
            step = step or self._byte(m, order, used, least_used) or self._first(m, [(t,) for t in self.closers])
            if step is None:
                return None
            out += self.tokenizer.decode_bytes(list(step))
        return None

    def _byte(self, m, order: str, used: dict, least_used: bool) -> tuple[int] | None:
        """The first byte of `order` (the least used so far, with `least_used`) the grammar takes, taken."""
        for char in sorted(order, key=used.__getitem__) if least_used else order:
            if char in self.byte_tokens and self._eat(m, (self.byte_tokens[char],)):
                used[char] += 1
                return (self.byte_tokens[char],)
        return None

    def _closer(self, m) -> tuple[int] | None:
        """A closer that closes something, taken: after it the text probe is refused (inside a string `}` is text,
        and at a key `"` opens one: neither closes). Of those, the one that ends the output in the fewest closers
        after it."""
        best, best_steps = None, None
        for token in self.closers:
            if self._closes(m, token):
                self._eat(m, (token,))
                steps = self._closing_steps(m, CLOSER_LOOKAHEAD)
                m.rollback(1)
                if best is None or steps < best_steps:
                    best, best_steps = token, steps
        if best is not None:
            self._eat(m, (best,))
        return (best,) if best is not None else None

    def _hint(self, m, hints, tried: set) -> tuple[int, ...] | None:
        """A hint not tried since the last close, taken: the first after which a closer closes, else the first the
        grammar takes (an enum's value where an email goes takes the email's turn, never twice)."""
        first = None
        for tokens in hints:
            if tokens in tried or not self._eat(m, tokens):
                continue
            if self._closes_next(m):
                tried.add(tokens)
                return tokens
            m.rollback(len(tokens))
            first = first or tokens
        if first is not None:
            self._eat(m, first)
            tried.add(first)
        return first

    def _closes_next(self, m) -> bool:
        return any(self._closes(m, token) for token in self.closers)

    def _closes(self, m, token: int) -> bool:
        """Whether the grammar takes closer `token` here as a close: the text probe refused after it (`m` left as
        it was)."""
        if not self._eat(m, (token,)):
            return False
        text = self.probe is not None and self._eat(m, (self.probe,))
        m.rollback(2 if text else 1)
        return not text

    def _closing_steps(self, m, depth: int) -> int:
        """Closers alone that end the output from `m`'s state: how few, up to `depth` (depth + 1: not within it)."""
        if m.is_accepting():
            return 0
        best = depth + 1
        for token in self.closers if depth else ():
            if self._eat(m, (token,)):
                best = min(best, 1 + self._closing_steps(m, depth - 1))
                m.rollback(1)
        return best

    def _first(self, m, candidates):
        return next((tokens for tokens in candidates if self._eat(m, tokens)), None)

    def _eat(self, m, tokens) -> bool:
        """Consume all of `tokens`, or none (a matcher step, counted)."""
        self._local.ops += 1
        if self._local.ops > self._local.limit:
            raise _OutOfSteps
        taken = m.try_consume_tokens(list(tokens))
        if taken == len(tokens):
            return True
        if taken:
            m.rollback(taken)
        return False

    def _tokens(self, matcher, text: bytes | None) -> tuple[int, ...] | None:
        """`text` in the tokenizer's own tokens, if the grammar takes them and ends there."""
        if text is None:
            return None
        tokens = tuple(self._tokenize(text))
        return tokens if completes(matcher, tokens) else None

    def _tokenize(self, text: bytes) -> list[int]:
        """The tokenizer's own tokens of `text`, where llguidance writes a special token (a marker such as
        `</tool_call>`) as 0xFF and its id in brackets."""
        tokens: list[int] = []
        for k, part in enumerate(_SPECIAL.split(text)):
            if k % 2:
                tokens.append(int(part))
            elif part:
                tokens += self.tokenizer.tokenize_bytes(part)
        return tokens


_SPECIAL = re.compile(rb"\xff\[(\d+)\]")


class _OutOfSteps(Exception):
    pass


def guarded(grammar, call, otherwise=None, who: str = ""):
    """`call(guard)` of a grammar's budget guard, `otherwise` without one. A guard that fails is dropped and the
    sequence (`who`) goes on unguarded: a bug here must not fail the engine's step."""
    guard = grammar.guard if grammar is not None else None
    if guard is None:
        return otherwise
    try:
        return call(guard)
    except Exception:
        log.exception("grammar budget: the guard failed; %s goes on unguarded", who or "a sequence")
        grammar.guard = None
        return otherwise


def completes(matcher, tokens) -> bool:
    """Whether `tokens` take `matcher` (left as it was) to a state where the output may end."""
    taken = matcher.try_consume_tokens(list(tokens))
    done = taken == len(tokens) and matcher.is_accepting()
    if taken:
        matcher.rollback(taken)
    return done


class BudgetGuard:
    """One sequence's plan, kept for the state its matcher is in (`grammar/backends/llguidance_backend.py` tells
    it of each token taken and each rollback). Where no plan is found the sequence is not guarded, and the search
    is tried again only RETRY_AFTER tokens later (a search that finds nothing is the costly kind)."""

    def __init__(self, matcher, planner: Planner, hints, stop_token_ids, start_plan: tuple[int, ...]) -> None:
        self.matcher, self.planner, self.hints = matcher, planner, hints
        self.stop_token_ids = stop_token_ids
        self.plan: tuple[int, ...] | None = start_plan  # None: not known for this state (or none found)
        self._stale: tuple[int, ...] | None = None  # the last known plan, tried first when a new one is needed
        self._pending: tuple[tuple[int, ...], tuple[int, ...] | None] | None = None  # (tokens, the plan after)
        self._wait = 0  # tokens until a plan is searched again, after a search that found none
        self._backoff = 0  # that wait, doubled after each search that finds none
        self._history: list[tuple] = []  # the state before each token taken, for rollbacks (the last MAX_HISTORY)

    def accepted(self, token: int) -> None:
        self._history.append((self.plan, self._stale, self._pending, self._wait))
        del self._history[:-MAX_HISTORY]
        self._wait = max(self._wait - 1, 0)
        pending, self._pending = self._pending, None
        if pending is not None and pending[0][:1] == (token,):
            if len(pending[0]) == 1:  # the tokens `fits` checked, all taken: the plan it found after them
                self._stale, self.plan = self.plan or self._stale, pending[1]
                return
            self._pending = (pending[0][1:], pending[1])
        if self.plan is not None and self.plan[:1] == (token,):
            self.plan = self.plan[1:]
        else:
            self._stale, self.plan = self.plan or self._stale, None

    def rolled_back(self, num_tokens: int) -> None:
        """The last `num_tokens` taken back (a dry run's, a rejected draft's): the plans known before them."""
        if num_tokens > len(self._history):
            self._stale, self.plan, self._pending, self._history = self.plan or self._stale, None, None, []
            return
        self.plan, self._stale, self._pending, self._wait = self._history[-num_tokens]
        del self._history[-num_tokens:]

    def current(self) -> tuple[int, ...] | None:
        """A plan from the matcher's state; None where none is found (not searched again for a while)."""
        if self.plan is None and not self._wait:
            self.plan = self._search(self.matcher, None)
            self._backoff = 0 if self.plan is not None else min(max(2 * self._backoff, RETRY_AFTER), MAX_RETRY_AFTER)
            self._wait = self._backoff
        return self.plan

    def fits(self, tokens: tuple[int, ...], left: int) -> bool:
        """Whether taking `tokens` now leaves a completion within the rest of `left` tokens (none found after them:
        they do not fit, whatever the room)."""
        self._pending = None
        plan = self.current()
        if plan is None:
            return True  # not guarded from here: no promise to keep
        if tokens[-1] in self.stop_token_ids:
            return self.matcher.is_accepting() and len(tokens) == 1
        if plan[:len(tokens)] == tokens:
            return len(plan) <= left
        m = self.matcher.deep_copy()
        if m.try_consume_tokens(list(tokens)) != len(tokens):
            return False
        room = left - len(tokens)
        after = self._search(m, room)
        if after is None or len(after) > room:  # no completion known after them: the promise forbids them
            return False
        self._pending = (tokens, after)
        return True

    def fallback(self) -> int | None:
        """The token that keeps the promise whatever else: the plan's next, or a stop token where it is done."""
        plan = self.current()
        if plan:
            return plan[0]
        return min(self.stop_token_ids) if plan is not None and self.stop_token_ids else None

    def _search(self, m, room: int | None) -> tuple[int, ...] | None:
        """The last known plan if it still completes from `m`'s state (and fits `room`), else a new one."""
        for known in (self.plan, self._stale):
            if known is not None and (room is None or len(known) <= room) and completes(m, known):
                return known
        return self.planner.plan(m, self.hints)


# ---- hints: texts a schema, regex, choice or grammar asks for ------------------------------------------------

_CLASS_OR_ESCAPE = re.compile(r"\\.|\[(?:\\.|[^\]])*\]|\{\d*,?\d*\}|\(\?[:=!<]*")
_LITERAL_RUN = re.compile(r"[A-Za-z0-9_ #@:/.=-]{2,}")


def hint_texts(spec) -> list[str]:
    """What the spec names literally: a string's text without its quotes (the closer opens it)."""
    texts: list[str] = []
    if spec.kind == "json":
        for node, _ in walk(spec.json):
            texts += _node_hints(node)
    elif spec.kind == "regex":
        texts += _literal_runs(spec.regex)
    elif spec.kind == "choice":
        texts += spec.choice
    elif spec.kind == "grammar":
        texts += [json.loads(q) for q in re.findall(r'"(?:\\.|[^"\\])*"', spec.grammar) if _loads(q)]
    return texts


def _node_hints(node: dict) -> list[str]:
    out = []
    values = list(node["enum"]) if isinstance(node.get("enum"), list) else []
    values += [node["const"]] if "const" in node else []
    for value in values:
        out.append(json.dumps(value)[1:-1] if isinstance(value, str) else json.dumps(value))
    if isinstance(node.get("format"), str) and node["format"] in FORMAT_EXAMPLES:
        out.append(FORMAT_EXAMPLES[node["format"]])
    patterns = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
    patterns += list(node["patternProperties"]) if isinstance(node.get("patternProperties"), dict) else []
    names = node.get("propertyNames")
    patterns += [names["pattern"]] if isinstance(names, dict) and isinstance(names.get("pattern"), str) else []
    for pattern in patterns:
        out += _literal_runs(pattern)
    return out


def _literal_runs(pattern: str) -> list[str]:
    """A short text the pattern matches (Python's reading of it: only a hint), and its literal runs."""
    example = regex_example(pattern)
    return ([example] if example else []) + _LITERAL_RUN.findall(_CLASS_OR_ESCAPE.sub("\0", pattern))


_CATEGORY_CHARS = {"CATEGORY_DIGIT": "0", "CATEGORY_WORD": "a", "CATEGORY_SPACE": " ", "CATEGORY_NOT_DIGIT": "a",
                   "CATEGORY_NOT_WORD": "-", "CATEGORY_NOT_SPACE": "a"}


def regex_example(pattern: str) -> str | None:
    """A short string `pattern` likely matches (each repeat its fewest times, each alternative its shortest, each
    class its first character), or None where Python cannot read the pattern."""
    import re._parser as parser  # Python's own regex parser: the tree it compiles

    try:  # never run the pattern itself here (a client's regex may backtrack for minutes): the matcher checks hints
        return _example(parser.parse(pattern))
    except (re.error, ValueError, TypeError, RecursionError, OverflowError):
        return None


def _example(items) -> str:
    return "".join(_item_example(op, arg) for op, arg in items)


def _item_example(op, arg) -> str:
    name = str(op)
    if name == "LITERAL":
        return chr(arg)
    if name in ("NOT_LITERAL", "ANY"):
        return "a" if arg != ord("a") else "b"
    if name == "IN":
        return _item_example(*arg[0]) if str(arg[0][0]) != "NEGATE" else "a"
    if name == "RANGE":
        return chr(arg[0])
    if name == "CATEGORY":
        return _CATEGORY_CHARS.get(str(arg), "a")
    if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
        low, _, sub = arg
        part = _example(sub)
        if len(part) * low > MAX_HINT_BYTES:  # no hint that long is kept: stop before building it
            raise ValueError("too long")
        return part * low
    if name in ("SUBPATTERN", "ATOMIC_GROUP"):
        return _example(arg[-1])
    if name == "BRANCH":
        return min((_example(alt) for alt in arg[1]), key=len)
    if name in ("AT", "ASSERT", "ASSERT_NOT", "GROUPREF"):
        return ""
    raise ValueError(name)


def _loads(quoted: str) -> bool:
    try:
        return isinstance(json.loads(quoted), str)
    except ValueError:
        return False
