"""`loraplex usage`: the usage ledger's rows in a window, summed per UTC day, tenant and adapter,
as CSV (one line each, a mix under its names joined with '+', so the lines add up to the totals) or
as the JSON `GET /v1/usage` answers. Reads the SQLite file directly: the server may be running."""

from __future__ import annotations

import csv
import datetime
import io
import json
from pathlib import Path

from loraplex.api.admin.ledger import COUNTS, UsageLedger, UsageRow, parse_time

HEADER = ("day", "tenant", "adapter", *COUNTS)


def export(path: str, since: str | None, until: str | None, form: str) -> str:
    if not Path(path).is_file():
        raise ValueError(f"no usage ledger at {path} (--usage-db, or --port of the server that wrote it)")
    window = parse_time(since, "--since"), parse_time(until, "--until")
    ledger = UsageLedger(path)
    try:
        if form == "json":
            return json.dumps(ledger.usage(*window), indent=2, sort_keys=True)
        return as_csv(ledger.rows(*window))
    finally:
        ledger.close()


def as_csv(rows: list[UsageRow]) -> str:
    lines: dict[tuple[str, str, str], list[int]] = {}
    for row in rows:
        day = datetime.datetime.fromtimestamp(row.at, datetime.timezone.utc).date().isoformat()
        sums = lines.setdefault((day, row.tenant, row.adapter), [0] * len(COUNTS))
        for i, name in enumerate(COUNTS):
            sums[i] += getattr(row, name)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(HEADER)
    for key in sorted(lines):
        writer.writerow([*key, *lines[key]])
    return out.getvalue()
