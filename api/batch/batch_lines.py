"""A batch's input file read into its request lines.

Each non-blank line is one request: {"custom_id", "method": "POST", "url": the batch's endpoint,
"body": {...}}. A line that is not one (not JSON, not an object, no custom_id, another method or
url, a body that is no object, a streamed body, a field OpenAI does not define) does not fail the
batch: it carries its `problem`, which becomes its 400 in the error file, so every line is answered.
Blank lines (a trailing newline, CRLF) are no requests. A repeated custom_id, which would make two
answers indistinguishable, is refused at creation, as OpenAI does."""

from __future__ import annotations

import json
from dataclasses import dataclass

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
FIELDS = {"custom_id", "method", "url", "body"}


@dataclass(frozen=True)
class Line:
    number: int  # 1-based, in the input file
    custom_id: str | None
    body: dict | None
    problem: str | None = None  # why it cannot run (its 400's message), None when it can
    param: str | None = None  # the field the problem is in


def read_lines(data: bytes, endpoint: str) -> list[Line]:
    lines = []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if raw.strip():
            lines.append(_line(number, raw, endpoint))
    return lines


def _line(number: int, raw: bytes, endpoint: str) -> Line:
    where = f"line {number}"
    try:
        request = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        return Line(number, None, None, f"{where}: not valid JSON ({exc})")
    if not isinstance(request, dict):
        return Line(number, None, None, f"{where}: a request line is a JSON object")
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return Line(number, None, None, f"{where}: custom_id: a non-empty string is required", "custom_id")

    def refused(problem: str, param: str) -> Line:
        return Line(number, custom_id, None, f"{where}: {problem}", param)

    unknown = sorted(set(request) - FIELDS)
    if unknown:
        return refused(f"unknown field {unknown[0]!r} (a line has {', '.join(sorted(FIELDS))})", unknown[0])
    if request.get("method") != "POST":
        return refused(f"method: must be \"POST\", got {request.get('method')!r}", "method")
    if request.get("url") != endpoint:
        return refused(f"url: must be the batch's endpoint {endpoint!r}, got {request.get('url')!r}", "url")
    body = request.get("body")
    if not isinstance(body, dict):
        return refused("body: must be a JSON object", "body")
    if body.get("stream") not in (None, False):
        return refused("body.stream: batch lines are not streamed", "body.stream")
    return Line(number, custom_id, body)


def repeated_custom_id(lines: list[Line]) -> str | None:
    """The message for the first custom_id that appears twice, or None."""
    seen: dict[str, int] = {}
    for line in lines:
        if line.custom_id is None:
            continue
        if line.custom_id in seen:
            return (f"custom_id {line.custom_id!r} appears on lines {seen[line.custom_id]} and {line.number}: each "
                    f"line needs its own")
        seen[line.custom_id] = line.number
    return None
