"""The conversations behind `previous_response_id`: in memory, bounded by a count and by bytes (the JSON size of the
stored messages); when either bound is passed the oldest responses go first. Nothing is written to disk, and a
restart forgets them all (then a `previous_response_id` is a 400 naming it)."""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any


class ResponseStore:
    """response id -> the chat messages a later turn continues from (without the request's instructions)."""

    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count, self.max_bytes = max_count, max_bytes
        self._items: OrderedDict[str, tuple[list[dict[str, Any]], int]] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> bool:
        """Store a conversation, evicting the oldest to stay within bounds; False when it alone is over them."""
        size = len(json.dumps(messages, ensure_ascii=False).encode())
        if self.max_count == 0 or size > self.max_bytes:
            return False
        while self._items and (len(self._items) >= self.max_count or self.bytes + size > self.max_bytes):
            _, (_, old) = self._items.popitem(last=False)
            self.bytes -= old
        self._items[response_id] = (messages, size)
        self.bytes += size
        return True

    def get(self, response_id: str) -> list[dict[str, Any]] | None:
        found = self._items.get(response_id)
        return list(found[0]) if found is not None else None
