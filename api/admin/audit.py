"""The audit log (`--audit-log FILE`): one JSON object per line for each admin action (adapter loads
and unloads, tenant reloads) and each refusal of a caller (401, 403, 429), with the time, the tenant
(or "admin"), the route and the outcome. Appended and flushed line by line; without a file, nothing."""

from __future__ import annotations

import json
import logging
import threading
import time

log = logging.getLogger(__name__)


class AuditLog:
    def __init__(self, path: str | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._file = open(path, "a", encoding="utf-8") if path else None  # noqa: SIM115 (held for the server's life)

    def write(self, event: str, **fields) -> None:
        if self._file is None:
            return
        line = json.dumps({"time": round(time.time(), 3), "event": event, **fields}, ensure_ascii=False,
                          default=str)
        with self._lock:
            try:
                self._file.write(line + "\n")
                self._file.flush()
            except (OSError, ValueError) as exc:  # a full disk must not fail the request being logged
                log.warning("audit log %s: %s", self.path, exc)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
