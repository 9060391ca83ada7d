"""Regex features whose meaning a grammar backend may not keep, found by name.

A grammar can only hold output to a regular language: lookaround, backreferences, atomic
groups and possessive quantifiers, conditionals, recursion, word boundaries and some anchors
are beyond it. Backends differ in what they do with them: refuse them, read them as something
else (xgrammar reads `\\A` as the letter A and drops a lookahead inside a schema `pattern`;
llguidance and outlines read `a*+` as `(a*)+`), or enforce them. Each backend names the
features it enforces exactly (checked in tests/grammar/test_refusals_final.py); any other found
here is refused by name, for `regex` specs and for every `pattern` / `patternProperties` of a
schema alike.

A scanner, not a parser: it needs only to find these constructs, outside character classes and
escapes, in any of the dialects a request may use (ECMA-262, Python, Rust, PCRE).
"""

from __future__ import annotations

import re

LOOKAHEAD, LOOKBEHIND, BACKREFERENCE = "lookahead", "lookbehind", "backreference"
ATOMIC, POSSESSIVE, CONDITIONAL, RECURSION = "atomic group", "possessive quantifier", "conditional group", "recursion"
WORD_BOUNDARY, ABSOLUTE_ANCHOR, INNER_ANCHOR = "word boundary", "absolute anchor", "anchor inside the pattern"
MULTILINE = "multiline flag"
ALL = (LOOKAHEAD, LOOKBEHIND, BACKREFERENCE, ATOMIC, POSSESSIVE, CONDITIONAL, RECURSION, WORD_BOUNDARY,
       ABSOLUTE_ANCHOR, INNER_ANCHOR, MULTILINE)

# what follows "(?" and what it makes the group
_GROUPS = (("<=", LOOKBEHIND), ("<!", LOOKBEHIND), ("=", LOOKAHEAD), ("!", LOOKAHEAD), (">", ATOMIC),
           ("(", CONDITIONAL), ("P=", BACKREFERENCE), ("P>", RECURSION), ("&", RECURSION), ("R)", RECURSION))
_RECURSION_NUMBER = re.compile(r"[+-]?\d+\)")
_FLAGS = re.compile(r"[a-zA-Z]*(?:-[a-zA-Z]*)?[:)]")
_COUNTED = re.compile(r"\{\d*(?:,\d*)?\}")
_NUMBER = re.compile(r"[-\d]")


def features(pattern: str) -> dict[str, str]:
    """Each feature the pattern uses, with the text that uses it first."""
    found: dict[str, str] = {}
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i = _escape(pattern, i, found)
            continue
        if c == "[":
            i = _class_end(pattern, i)
            continue
        if c == "(" and pattern.startswith("(?", i):
            _group(pattern[i + 2:], found)
        elif c in "*+?" and i > 0 and pattern[i - 1] != "(":
            if pattern[i + 1:i + 2] == "+":
                found.setdefault(POSSESSIVE, pattern[i:i + 2])
        elif c == "{":
            counted = _COUNTED.match(pattern, i)
            if counted and counted.end() < n and pattern[counted.end()] == "+":
                found.setdefault(POSSESSIVE, counted.group() + "+")
        elif c == "^" and i > 0:
            found.setdefault(INNER_ANCHOR, "^")
        elif c == "$" and i < n - 1:
            found.setdefault(INNER_ANCHOR, "$")
        i += 1
    return found


def _escape(pattern: str, i: int, found: dict[str, str]) -> int:
    """Past the escape at `i`, noting what it is."""
    d, after = pattern[i + 1:i + 2], pattern[i + 2:i + 3]
    if (d and d in "123456789") or (d in ("k", "g") and (after in ("<", "{", "'") or _NUMBER.match(after))):
        found.setdefault(BACKREFERENCE, pattern[i:i + 3])
    elif d in ("b", "B"):
        found.setdefault(WORD_BOUNDARY, "\\" + d)
    elif d in ("A", "Z", "z", "G"):
        found.setdefault(ABSOLUTE_ANCHOR, "\\" + d)
    if d in ("p", "P", "x", "u", "N") and after == "{":  # a braced argument holds no syntax
        close = pattern.find("}", i + 3)
        return len(pattern) if close < 0 else close + 1
    return i + 2


def _class_end(pattern: str, i: int) -> int:
    """Past the character class opening at `i` (a `]` first in it is a literal)."""
    j, n = i + 1, len(pattern)
    if pattern[j:j + 1] == "^":
        j += 1
    if pattern[j:j + 1] == "]":
        j += 1
    while j < n and pattern[j] != "]":
        j += 2 if pattern[j] == "\\" else 1
    return j + 1


def _group(after: str, found: dict[str, str]) -> None:
    for prefix, name in _GROUPS:
        if after.startswith(prefix):
            found.setdefault(name, "(?" + prefix)
            return
    if _RECURSION_NUMBER.match(after):
        found.setdefault(RECURSION, "(?" + after[:after.index(")") + 1])
        return
    flags = _FLAGS.match(after)
    if flags and "m" in flags.group().split("-")[0]:
        found.setdefault(MULTILINE, "(?" + flags.group())


def unenforced(pattern: str, enforced: frozenset[str]) -> tuple[str, str] | None:
    """The first feature of `pattern` outside `enforced`, and its text; None when there is none."""
    for name, text in features(pattern).items():
        if name not in enforced:
            return name, text
    return None
