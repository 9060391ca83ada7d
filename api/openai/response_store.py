"""Stored responses (`store: true`, the Responses API's default): each kept with its input items and the
conversation it ends, so `previous_response_id` continues it and GET / DELETE find it. Bounded by count and
bytes (`--responses-store-max-count`, `--responses-store-max-bytes`), the oldest evicted first; kept in
memory (a restart forgets them, as a restarted conversation would start again). Each entry has an owner:
another owner's id reads exactly as an unknown id."""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoredResponse:
    owner: str
    response: dict  # the Response object as answered
    input_items: list[dict]  # this turn's input, as items with ids
    conversation: list[dict]  # chat messages up to and including this turn's output (no instructions)
    size: int


class ResponseStore:
    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count, self.max_bytes = max_count, max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # a Ray replica's app and its heartbeat read it from two threads

    def put(self, owner: str, response: dict, input_items: list[dict], conversation: list[dict]) -> bool:
        """Keeps the response; False when it alone is larger than the whole store (it is then not kept)."""
        size = len(json.dumps([response, input_items, conversation], ensure_ascii=False))
        if size > self.max_bytes or self.max_count < 1:
            log.warning("response %s (%d bytes) is larger than the response store; not stored", response["id"], size)
            return False
        entry = StoredResponse(owner, response, input_items, conversation, size)
        with self._lock:
            self._drop(response["id"])
            self._entries[response["id"]] = entry
            self._bytes += size
            while len(self._entries) > self.max_count or self._bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))
        return True

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get(response_id)
        return entry if entry is not None and entry.owner == owner else None

    def delete(self, owner: str, response_id: str) -> bool:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None or entry.owner != owner:
                return False
            self._drop(response_id)
            return True

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry.size
