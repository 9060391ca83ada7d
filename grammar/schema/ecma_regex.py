"""JSON Schema patterns are ECMA-262 regexes: when Python's `re` reads one as ECMA-262 does
(`python_syntax`, `ecma_search`), and `exact_dots`, which writes each `.` as ECMA-262 means it
(no line terminator) for an engine whose `.` lets a carriage return or U+2028 through.
"""

from __future__ import annotations

import re
import warnings

# An escaped character that means the same to ECMA-262 and to Python's `re` (ASCII).
_SAME_ESCAPES = set("dDwWsStnrvf") | set("\\^$.|?*+()[]{}/-")
# Text whose meaning differs between the two: empty classes, Python-only groups, `{,n}`, set operations.
_DIFFERENT = ("[]", "[^]", "{,", "[[", "&&", "--", "~~", "||")
ECMA_DOT = "[^\\n\\r\\u2028\\u2029]"  # what `.` matches in ECMA-262


def python_syntax(pattern: str) -> bool:
    """Does Python's `re` (ASCII) read `pattern` as ECMA-262 does, over ASCII keys without line
    breaks? False where the two may differ."""
    if "(?" in pattern.replace("(?:", "") or any(text in pattern for text in _DIFFERENT):
        return False
    i = 0
    while i < len(pattern):
        if pattern[i] != "\\":
            i += 1
        elif pattern[i + 1:i + 2] == "x" and re.fullmatch(r"[0-9a-fA-F]{2}", pattern[i + 2:i + 4]):
            i += 4
        elif pattern[i + 1:i + 2] == "u" and re.fullmatch(r"[0-9a-fA-F]{4}", pattern[i + 2:i + 6]):
            i += 6
        elif pattern[i + 1:i + 2] in _SAME_ESCAPES and pattern[i + 1:i + 2]:
            i += 2
        else:
            return False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a FutureWarning marks syntax Python may read otherwise
        try:
            re.compile(pattern, re.ASCII)
        except (re.error, Warning):
            return False
    return True


def ecma_search(pattern: str, key: str) -> bool | None:
    """Does the ECMA-262 regex `pattern` match somewhere in `key`? None where Python's `re`
    might answer otherwise (a key with line breaks or beyond ASCII)."""
    if not key.isascii() or any(c in key for c in "\n\r") or not python_syntax(pattern):
        return None
    return re.search(pattern, key, re.ASCII) is not None


def exact_dots(pattern: str) -> str:
    """`pattern` with each `.` outside a class written as ECMA-262 means it (no line terminator):
    a backend's `.` may let a carriage return through."""
    out, i = [], 0
    while i < len(pattern):
        if pattern[i] == "\\":
            out.append(pattern[i:i + 2])
            i += 2
        elif pattern[i] == "[":
            end = _class_end(pattern, i)
            out.append(pattern[i:end])
            i = end
        else:
            out.append(ECMA_DOT if pattern[i] == "." else pattern[i])
            i += 1
    return "".join(out)


def _class_end(pattern: str, i: int) -> int:
    """Past the character class opening at `i` (ECMA-262: the first `]` closes it)."""
    j = i + 1
    while j < len(pattern) and pattern[j] != "]":
        j += 2 if pattern[j] == "\\" else 1
    return j + 1
