"""Every setting checked before anything loads (a bad choice, a busy port, an unwritable trace path: one line, exit 1,
no "Loading" line before it), and the log flags: --log-level on every command, serve's --disable-log-requests,
GET /health polls never logged."""

from __future__ import annotations

import argparse
import ast
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from moeserve.cli import log_level
from moeserve.config import EngineSettings, build_settings
from moeserve.errors import CheckpointError, ConfigError
from moeserve.preflight import check_engine_settings
from tests.server.conftest import start_subprocess_server, wait_healthy


def moeserve(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "moeserve", *argv], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def assert_refused_before_loading(proc: subprocess.CompletedProcess[str], message: str) -> None:
    """Exit 1 with exactly one line, `error: ...message...`, and nothing loaded before it."""
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr
    assert "Loading" not in proc.stderr + proc.stdout
    assert "model:" not in proc.stderr  # not even the checkpoint was opened


@pytest.mark.parametrize("command", ["generate", "serve", "chat"])
def test_a_bad_cache_policy_is_refused_before_loading(command: str) -> None:
    port = ["--port", str(free_port())] if command == "serve" else []
    proc = moeserve(command, "--cache-policy", "lfr", *port)
    assert_refused_before_loading(proc, "unknown cache_policy 'lfr' (did you mean 'lfru'?)")


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_an_unwritable_trace_path_is_refused_before_loading(command: str, tmp_path: Path) -> None:
    port = ["--port", str(free_port())] if command == "serve" else []
    missing = tmp_path / "no-such-folder" / "trace.bin"
    proc = moeserve(command, "--record-trace", str(missing), *port)
    assert_refused_before_loading(proc, f"record_trace={missing}: the folder {missing.parent} does not exist")
    proc = moeserve(command, "--record-trace", str(tmp_path), *port)
    assert_refused_before_loading(proc, f"record_trace={tmp_path}: a folder, not a file")


def test_a_busy_port_is_refused_before_loading() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = moeserve("serve", "--port", str(port))
    assert_refused_before_loading(proc, f"cannot listen on 127.0.0.1:{port}")


def test_a_missing_model_is_refused_before_the_server_starts(tmp_path: Path) -> None:
    proc = moeserve("serve", str(tmp_path / "nothing"), "--port", str(free_port()))
    assert_refused_before_loading(proc, "nothing: no such model folder")
    assert "Uvicorn running" not in proc.stderr


def settings(**values: object) -> EngineSettings:
    return build_settings(EngineSettings, values, environ={})  # type: ignore[no-any-return]


def test_each_checked_setting_names_itself(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    check_engine_settings(settings(record_trace=str(tmp_path / "new.bin"), cache_trace=str(a_file),
                                   cache_policy="static", int8_cache_dir=str(tmp_path / "a" / "b")))
    assert not (tmp_path / "new.bin").exists()  # nothing is created by a check
    cases = {
        "cache_policy=static pins the most used experts": dict(cache_policy="static"),
        "cache_trace=": dict(cache_policy="static", cache_trace=str(tmp_path / "none.bin")),
        "chat_template=": dict(chat_template=str(tmp_path)),
        "tokenizer=": dict(tokenizer=str(a_file)),
        "int8_cache_dir=": dict(int8_cache_dir=str(a_file / "units")),
        "record_trace=": dict(record_trace=str(a_file / "trace.bin")),
    }
    for message, values in cases.items():
        with pytest.raises(ConfigError, match=message):
            check_engine_settings(settings(**values))
    with pytest.raises(CheckpointError, match="no such model folder"):
        check_engine_settings(settings(model=str(tmp_path / "nothing")))
    check_engine_settings(settings(int8_cache_dir="off"))


# ------------------------------------------------------------------------------------------------ logging
def test_log_level_comes_from_the_flag_then_the_environment(monkeypatch) -> None:
    monkeypatch.delenv("MOESERVE_LOG_LEVEL", raising=False)
    assert log_level(argparse.Namespace()) == logging.INFO
    assert log_level(argparse.Namespace(log_level="error")) == logging.ERROR
    assert log_level(argparse.Namespace(log_level="error", debug=True)) == logging.DEBUG
    monkeypatch.setenv("MOESERVE_LOG_LEVEL", "WARNING")
    assert log_level(argparse.Namespace()) == logging.WARNING
    assert log_level(argparse.Namespace(log_level="debug")) == logging.DEBUG
    monkeypatch.setenv("MOESERVE_LOG_LEVEL", "verbose")
    with pytest.raises(ConfigError, match="MOESERVE_LOG_LEVEL=verbose is not a log level"):
        log_level(argparse.Namespace())


@pytest.mark.slow
def test_log_level_on_every_command_and_before_it() -> None:
    loud = moeserve("generate", "--max-tokens", "2")
    assert loud.returncode == 0 and " INFO moeserve: Loading weights took" in loud.stderr
    for argv in (["generate", "--max-tokens", "2", "--log-level", "warning"],
                 ["--log-level", "WARNING", "generate", "--max-tokens", "2"]):
        quiet = moeserve(*argv)
        assert quiet.returncode == 0 and quiet.stdout.strip()
        assert " INFO " not in quiet.stderr, quiet.stderr
    bad = moeserve("plan", "--log-level", "loud")
    assert bad.returncode == 2 and "invalid choice: 'loud'" in bad.stderr


@pytest.mark.slow
@pytest.mark.parametrize("disable", [False, True])
def test_request_lines_are_logged_unless_disabled_and_health_polls_never(disable: bool) -> None:
    from moeserve.engine.llm_engine import demo_model_path

    proc, url = start_subprocess_server(demo_model_path(), *(["--disable-log-requests"] if disable else []))
    try:
        wait_healthy(url)
        for _ in range(3):
            assert httpx.get(url + "/health").status_code == 200
        body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
        assert httpx.get(url + "/v1/models").status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "GET /health" not in out
    assert ('"POST /v1/completions HTTP/1.1" 200' in out) is not disable
    assert ('"GET /v1/models HTTP/1.1" 200' in out) is not disable


@pytest.mark.parametrize("argv", [["serve", "--cache-policy", "lfr"], ["generate", "--record-trace", "/no/such/x"],
                                  ["--log-level", "error", "chat", "--cache-policy", "static"]])
def test_a_bad_setting_is_refused_before_torch_is_imported(argv: list[str]) -> None:
    """The first second, said without timing: the refusal comes before `import torch` (seconds on a busy machine);
    only the chosen subcommand's module is imported."""
    code = ("import sys; from moeserve.cli import main; status = main(sys.argv[1:]); "
            "print(status, 'torch' in sys.modules, sorted(m for m in sys.modules if m.startswith('moeserve.cli.')))")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    status, torch_imported, modules = proc.stdout.split(" ", 2)
    assert (status, torch_imported) == ("1", "False"), proc.stderr
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1
    command = next(a for a in argv if not a.startswith("-") and a != "error")
    from moeserve.cli import SUBCOMMANDS

    subcommands = {f"moeserve.cli.{name}" for name in SUBCOMMANDS}
    assert set(ast.literal_eval(modules)) & subcommands == {f"moeserve.cli.{command}"}


def test_help_still_lists_every_command(capsys) -> None:
    from moeserve.cli import SUBCOMMANDS, main

    assert main([]) == 2
    out = capsys.readouterr().out
    assert all(name.replace("_", "-") in out for name in SUBCOMMANDS)


def test_the_python_api_checks_first_too(tmp_path: Path) -> None:
    """LLM(...) (and the server's engine thread) run the same checks before anything is opened."""
    from moeserve import LLM

    with pytest.raises(ConfigError, match="record_trace=.*does not exist"):
        LLM(str(tmp_path / "not-a-model"), record_trace=str(tmp_path / "no" / "trace.bin"))
