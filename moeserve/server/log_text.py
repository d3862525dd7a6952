"""Client-chosen text made safe for one log line: escaped repr-style (a newline in a field name cannot forge a
log line, a lone surrogate cannot break the log handler's encoding) and cut (a 3 MB field name is not a 3 MB
line)."""

from __future__ import annotations

MAX_LOG_CHARS = 200


def client_text(text: str, limit: int = MAX_LOG_CHARS) -> str:
    """`text` with control and non-ASCII characters escaped (backslash forms), cut to `limit` characters."""
    escaped = text[: limit + 1].encode("unicode_escape", "backslashreplace").decode("ascii")
    if len(text) <= limit and len(escaped) <= limit:
        return escaped
    return f"{escaped[:limit]}... ({len(text)} characters)"
