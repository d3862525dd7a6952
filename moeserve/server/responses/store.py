"""The responses behind `previous_response_id` and GET /v1/responses/{id}: in memory, bounded by a count and by bytes
(the JSON size of each stored conversation and response object); when either bound is passed the oldest go first. Nothing is written to disk, and a
restart forgets them all (then a `previous_response_id` is a 400 naming it)."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class Stored:
    messages: list[dict[str, Any]]  # the chat messages a later turn continues from (without the instructions)
    response: dict[str, Any]  # the response object, for GET /v1/responses/{id}
    size: int  # bytes of both as JSON


class ResponseStore:
    """response id -> its conversation and response object, oldest first."""

    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count, self.max_bytes = max_count, max_bytes
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, messages: list[dict[str, Any]], response: dict[str, Any]) -> bool:
        """Store a response, evicting the oldest to stay within bounds; False when it alone is over them."""
        size = len(json.dumps([messages, response], ensure_ascii=False).encode())
        if self.max_count == 0 or size > self.max_bytes:
            return False
        while self._items and (len(self._items) >= self.max_count or self.bytes + size > self.max_bytes):
            _, old = self._items.popitem(last=False)
            self.bytes -= old.size
        self._items[response_id] = Stored(messages, response, size)
        self.bytes += size
        return True

    def get(self, response_id: str) -> Stored | None:
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        found = self._items.pop(response_id, None)
        if found is not None:
            self.bytes -= found.size
        return found is not None
