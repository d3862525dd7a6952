"""serve's access-log filter: uvicorn's line for each GET /health poll is dropped, every other request keeps its
line (the records are built the way uvicorn.protocols.http logs them: client, method, path, version, status)."""

from __future__ import annotations

import logging

from moeserve.cli.serve import _quiet_health_polls


def access(method: str, path: str, status: int) -> logging.LogRecord:
    return logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                             ("127.0.0.1:5000", method, path, "1.1", status), None)


def test_health_polls_are_dropped_and_requests_kept() -> None:
    assert not _quiet_health_polls(access("GET", "/health", 503))
    assert not _quiet_health_polls(access("GET", "/health", 200))
    assert not _quiet_health_polls(access("GET", "/health?strict=true", 503))
    assert _quiet_health_polls(access("POST", "/v1/completions", 200))
    assert _quiet_health_polls(access("GET", "/metrics", 200))
    assert _quiet_health_polls(access("GET", "/healthz", 404))
    assert _quiet_health_polls(logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, "plain", None, None))
    assert access("GET", "/health", 200).getMessage() == '127.0.0.1:5000 - "GET /health HTTP/1.1" 200'
