"""serve: a busy port refused before loading; the access-log filter: uvicorn's line for each GET /health poll is dropped, every other request keeps its
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


def test_a_busy_port_is_refused_before_the_model_loads(tmp_path, capsys) -> None:
    """serve on a port another process listens on: one line, exit 1, at once (the model path does not even exist:
    nothing was opened before the check)."""
    import socket

    from moeserve.cli import main
    from moeserve.cli.serve import bind_socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", str(tmp_path / "no-such-model"), "--port", str(port)]) == 1
        err = capsys.readouterr().err
        assert f"error: cannot listen on 127.0.0.1:{port}:" in err and "another process is listening" in err
        assert "no-such-model" not in err
    bind_socket("127.0.0.1", port).close()  # free again once closed
