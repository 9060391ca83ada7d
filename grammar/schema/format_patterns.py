"""Formats whose language is regular, written as the `pattern` that is exactly that language, for
the formats no backend has an exact grammar for (llguidance refuses them, and under `auto` its
refusal is final). Each regex is transcribed rule by rule from the format's own ABNF, and uses
only what ECMA-262, Rust's regex and Python's `re` read alike (no `.`, no lookaround, anchors at
the ends only).

- `uri-reference`: RFC 3986 section 4.1, `URI / relative-ref`. IPv4address is a reg-name too, so
  `host` is `IP-literal / reg-name`.
- `json-pointer`: RFC 6901 section 3.
"""

from __future__ import annotations

_HEX = "[0-9A-Fa-f]"
_UNRESERVED = "A-Za-z0-9\\-._~"
_SUB_DELIMS = "!$&'()*+,;="


def _chars(extra: str = "") -> str:
    """One unreserved, sub-delims or `extra` character, or a percent-encoded octet."""
    return f"(?:[{_UNRESERVED}{_SUB_DELIMS}{extra}]|%{_HEX}{_HEX})"


def _ipv6() -> str:
    """RFC 3986's nine IPv6address forms: n pieces before "::" and 6 - n (ls32 as two) after."""
    h16 = f"{_HEX}{{1,4}}"
    octet = "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
    ls32 = f"(?:{h16}:{h16}|{octet}(?:\\.{octet}){{3}})"
    forms = [f"(?:{h16}:){{6}}{ls32}", f"::(?:{h16}:){{5}}{ls32}", f"(?:{h16})?::(?:{h16}:){{4}}{ls32}"]
    for before, after in ((1, f"(?:{h16}:){{3}}{ls32}"), (2, f"(?:{h16}:){{2}}{ls32}"), (3, f"{h16}:{ls32}"),
                          (4, ls32), (5, h16), (6, "")):
        forms.append(f"(?:(?:{h16}:){{0,{before}}}{h16})?::{after}")
    return "(?:" + "|".join(forms) + ")"


def _uri_reference() -> str:
    pchar = _chars(":@")
    segment, segment_nz = f"{pchar}*", f"{pchar}+"
    ip_literal = f"\\[(?:{_ipv6()}|[vV]{_HEX}+\\.[{_UNRESERVED}{_SUB_DELIMS}:]+)\\]"
    authority = f"(?:{_chars(':')}*@)?(?:{ip_literal}|{_chars()}*)(?::[0-9]*)?"
    rest = f"(?:/{segment})*"
    absolute = f"/(?:{segment_nz}{rest})?"
    hier = f"(?://{authority}{rest}|{absolute}|{segment_nz}{rest}|)"  # path-rootless
    relative = f"(?://{authority}{rest}|{absolute}|{_chars('@')}+{rest}|)"  # path-noscheme: no ":" before a "/"
    tail = f"(?:\\?(?:{pchar}|[/?])*)?(?:#(?:{pchar}|[/?])*)?"
    return f"^(?:[A-Za-z][A-Za-z0-9+\\-.]*:{hier}{tail}|{relative}{tail})$"


FORMAT_PATTERNS = {
    "uri-reference": _uri_reference(),
    "json-pointer": "^(?:/(?:[^/~]|~[01])*)*$",
}
