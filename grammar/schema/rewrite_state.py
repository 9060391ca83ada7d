"""What one rewrite() call shares across the modules that do its work (rewrite.py,
finite_keywords.py, disjoint.py, schema_values.py): the step and verdict budgets, the memo of
what was read off the schema's parts, and the two ways a rewrite gives up. rewrite() sets the
state at its start (one budget per call); the other modules only spend and read it.
"""

from __future__ import annotations

import threading

MAX_STEPS = 20_000  # schema nodes a rewrite may visit or build
MAX_VERDICTS = 200_000  # schema-against-value checks one rewrite may make for its proofs


class Inexpressible(Exception):
    """No exact rewrite without `not`."""


class TooBig(Exception):
    """The rewrite would grow past MAX_STEPS (negations of nested oneOf multiply)."""


budget = threading.local()


def spend() -> None:
    budget.left = getattr(budget, "left", MAX_STEPS) - 1
    if budget.left < 0:
        raise TooBig


def memo(kind: str, part, compute):
    """`compute()` for a part of the schema being rewritten, once per rewrite (outside one: each time)."""
    cache = getattr(budget, "memo", None)
    if cache is None:
        return compute()
    hit = cache.get((kind, id(part)))
    if hit is None or hit[0] is not part:  # the part itself is held, so its id names it alone
        hit = cache[(kind, id(part))] = (part, compute())
    return hit[1]
