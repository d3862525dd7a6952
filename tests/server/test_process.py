"""Concurrency and lifecycle: `moeserve serve` as a real process (start-up log, 16 streams with disconnects, RSS,
SIGTERM drain, bad model path) and an offloaded server under disconnects (tokens equal the resident server's)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.server.conftest import MODEL_NAME, start_subprocess_server, wait_healthy

PROMPTS = [f"{word} {i}" for i, word in enumerate(
    ["Once upon a time", "The fox", "Hello, how are you?", "One day the fox", "The quick brown fox",
     "What is your name?", "The fox liked to run", "A shiny stone"] * 2)]
KEEP_TOKENS = 24
DROP_AFTER_CHUNKS = 3
DROP_MAX_TOKENS = 450  # long enough that a dropped stream can only end by being aborted


async def stream_tokens(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int,
                        drop_after: int | None = None) -> list[str]:
    """Token texts of a greedy streamed completion; closes the connection after `drop_after` chunks."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 0,
            "ignore_eos": True, "stream": True}
    tokens: list[str] = []
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        chunks = 0
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            tokens += chunk["choices"][0]["logprobs"]["tokens"]
            chunks += 1
            if drop_after is not None and chunks >= drop_after:
                return tokens  # leaving the block closes the connection mid-stream
    return tokens


def metrics(url: str) -> dict[str, float]:
    """metric name -> value summed over label sets."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("moeserve:") and "_bucket" not in line:
            name = line.split("{")[0].split(" ")[0].removeprefix("moeserve:")
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def wait_idle(url: str, timeout: float = 600.0) -> dict[str, float]:  # a hang guard: returns once idle
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


async def concurrent_round(url: str) -> tuple[list[list[str]], list[list[str]]]:
    async with httpx.AsyncClient(timeout=120) as client:
        keep = [stream_tokens(client, url, p, KEEP_TOKENS) for p in PROMPTS[0::2]]
        drop = [stream_tokens(client, url, p, DROP_MAX_TOKENS, DROP_AFTER_CHUNKS) for p in PROMPTS[1::2]]
        results = await asyncio.gather(*[c for pair in zip(keep, drop) for c in pair])
    return list(results[0::2]), list(results[1::2])


async def alone(url: str, prompts: list[str]) -> list[list[str]]:
    async with httpx.AsyncClient(timeout=120) as client:
        return [await stream_tokens(client, url, p, KEEP_TOKENS) for p in prompts]


def _stop(proc: subprocess.Popen[str]) -> str:
    if proc.poll() is None:
        proc.kill()
    out, _ = proc.communicate(timeout=30)
    return out


@pytest.mark.slow
def test_concurrent_streams_disconnects_rss_and_sigterm_drain(tiny_text_model: Path) -> None:
    proc, url = start_subprocess_server(tiny_text_model, "--max-num-seqs", "8", "--shutdown-timeout", "30")
    try:
        wait_healthy(url, proc=proc)
        reference = asyncio.run(alone(url, PROMPTS[0::2]))
        assert all(len(t) == KEEP_TOKENS for t in reference)
        process = psutil.Process(proc.pid)
        baseline_rss = process.memory_info().rss

        kept, dropped = asyncio.run(concurrent_round(url))
        assert kept == reference  # every completed stream has the tokens it gets alone
        assert all(len(t) < DROP_MAX_TOKENS for t in dropped)
        after = wait_idle(url)
        assert after["num_requests_running"] == 0 and after["num_requests_waiting"] == 0
        # Only the 8 reference and 8 kept requests finished: the dropped ones were aborted, not run to the end.
        assert after["request_success_total"] == 16
        assert after["generation_tokens_total"] == 16 * KEEP_TOKENS
        rss_growth = process.memory_info().rss - baseline_rss
        print(f"server RSS: baseline {baseline_rss / 2**20:.1f} MiB, after 16 concurrent streams "
              f"{rss_growth / 2**20:+.1f} MiB")
        assert rss_growth < 32 * 2**20

        # SIGTERM while a stream is running: the stream completes, then the process exits 0.
        async def drain() -> list[str]:
            async with httpx.AsyncClient(timeout=120) as client:
                task = asyncio.ensure_future(stream_tokens(client, url, PROMPTS[0], 200))
                await asyncio.sleep(0.3)
                proc.send_signal(signal.SIGTERM)
                return await task

        drained = asyncio.run(drain())
        assert len(drained) == 200
        assert proc.wait(timeout=60) == 0
        log = _stop(proc)
    except BaseException:
        print(_stop(proc))
        raise
    assert "shutting down: no new requests" in log
    check_startup_log(log)


def check_startup_log(log: str) -> None:
    """The start-up log reads in order: the choices with their reasons, loading time, the one-line summary, the
    model, the address, startup complete, and the line printed at any log level."""
    wanted = ["moeserve.choices: placement:", "moeserve.choices: KV cache:", "Loading weights took",
              "Qwen3MoeForCausalLM on cpu, float32, 1 threads", "model: Qwen3MoeForCausalLM",
              "chat format: jinja chat template", "sampling defaults: ", "Uvicorn running on http://127.0.0.1:",
              "Application startup complete", f"moeserve: serving model '{MODEL_NAME}' at http://127.0.0.1:"]
    positions = [log.find(w) for w in wanted]
    assert all(p >= 0 for p in positions), list(zip(wanted, positions))
    assert positions == sorted(positions), list(zip(wanted, positions))


def test_bad_model_path_exits_1_with_one_line(tmp_path: Path) -> None:
    proc, _ = start_subprocess_server(tmp_path / "missing")
    out: Any = _stop(proc) if proc.wait(timeout=120) is not None else ""
    assert proc.returncode == 1
    assert "error:" in out and "Traceback" not in out


def test_offloaded_server_with_disconnects_matches_resident(thread_server: Any, tiny_text_model: Path,
                                                            live_server: Any) -> None:
    """Same streams against an expert cache far smaller than the experts (misses, prefetch, evictions) while
    half the clients walk away: the completed streams get exactly the resident server's tokens."""
    from tests.server.conftest import engine_factory, make_state

    offloaded = thread_server(make_state(engine_factory(tiny_text_model, expert_cache_gb=1e-6, max_num_seqs=4, prefetch=True)))
    reference = asyncio.run(alone(live_server.url, PROMPTS[0:8:2]))

    async def mixed() -> list[list[str]]:
        async with httpx.AsyncClient(timeout=120) as client:
            keep = [stream_tokens(client, offloaded.url, p, KEEP_TOKENS) for p in PROMPTS[0:8:2]]
            drop = [stream_tokens(client, offloaded.url, p, DROP_MAX_TOKENS, DROP_AFTER_CHUNKS)
                    for p in PROMPTS[1:8:2]]
            results = await asyncio.gather(*keep, *drop)
        return list(results[:4])

    assert asyncio.run(mixed()) == reference
    after = wait_idle(offloaded.url)
    assert after["num_requests_running"] == 0 and after["expert_cache_misses_total"] > 0
    llm = offloaded.state.llm
    assert not llm.has_unfinished_requests() and all(p.num_used == 0 for p in llm.memory.pools)
