"""Verified bytes: expert bytes that change on disk under a running offloaded engine never become a wrong answer.

A request whose step needs the changed expert fails with a 500 naming the file; requests that do not need it go
on with the same output as before; `/health` says the engine is degraded; the changed unit then fails at once. A
truncated shard met at run time is a 500 too (a server fault, not the request's).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx

from moeserve.experts.verify import choose_checksum
from tests.server.conftest import MODEL_NAME, ThreadServer, engine_factory, make_state

PROMPTS = [[5, 9, 33, 2], [17, 250, 33, 4, 8, 120], [7, 7, 100, 3], [44, 12, 90, 61, 8], [1, 2, 3], [200, 150, 3]]


def complete(url: str, prompt: list[int]) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 5, "temperature": 0, "logprobs": 1}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


class RoutingLog:
    """(layer, expert) pairs each request routes to, recorded by the model's trace hook on the engine's thread
    (requests run one at a time: max_num_seqs=1, or a plain engine stepped to the end of each)."""

    def __init__(self, engine: Any) -> None:
        self.current: set[tuple[int, int]] = set()
        engine.model.set_trace_hook(lambda layer, ids, _: self.current.update((layer, int(e)) for e in ids.reshape(-1)))

    def take(self) -> set[tuple[int, int]]:
        used, self.current = self.current, set()
        return used


def pick_target(used: dict[int, set[tuple[int, int]]]) -> tuple[tuple[int, int], list[int]]:
    """An expert prompt 0 needs and at least one other prompt does not; those other prompts."""
    target = next(k for k in sorted(used[0]) if any(k not in used[j] for j in used if j))
    return target, [j for j in used if j and target not in used[j]]


def flip_expert_bytes(engine: Any, key: tuple[int, int]) -> Path:
    """Change a byte in the middle of the first stored tensor of expert `key`, in place, as an edit would."""
    ref = engine.model.store.source.sources[key][0].refs[0]
    with open(ref.path, "r+b") as f:
        f.seek(ref.offset + ref.nbytes // 2)
        byte = f.read(1)
        f.seek(ref.offset + ref.nbytes // 2)
        f.write(bytes([byte[0] ^ 0x10]))
        f.flush()
        os.fsync(f.fileno())
    return Path(ref.path)


def test_expert_bytes_changed_under_a_running_server(thread_server: Any, tiny_text_model: Path,
                                                      copy_checkpoint: Any) -> None:
    model = copy_checkpoint(tiny_text_model)
    # a cache of one unit: every layer call re-reads its experts from the checkpoint
    state = make_state(engine_factory(model, expert_cache_gb=1e-9, max_num_seqs=1))
    server: ThreadServer = thread_server(state)
    engine = state.engine.engine
    assert engine.model.store.loader.verifier.checksum.name == choose_checksum().name
    routing = RoutingLog(engine)
    before, used = {}, {}
    for i, p in enumerate(PROMPTS):  # every unit these prompts need is read (its checksum taken) here
        before[i] = complete(server.url, p).json()["choices"][0]
        used[i] = routing.take()
    target, others = pick_target(used)
    path = flip_expert_bytes(engine, target)

    bad = complete(server.url, PROMPTS[0])
    assert bad.status_code == 500, bad.text
    error = bad.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "expert_load_failed"
    assert path.name in error["message"] and "differ from those read before" in error["message"]
    for j in others:  # the engine goes on: what does not need the changed expert answers as before
        ok = complete(server.url, PROMPTS[j])
        assert ok.status_code == 200 and ok.json()["choices"][0] == before[j]
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    assert path.name in health.json()["reason"]
    strict = httpx.get(server.url + "/health", params={"strict": "true"})  # what a load balancer probes
    assert strict.status_code == 503 and strict.json()["error"]["code"] == "degraded"
    assert f'moeserve:expert_units_bad{{model_name="{MODEL_NAME}"}} 1.0' in httpx.get(server.url + "/metrics").text
    again = complete(server.url, PROMPTS[0])  # marked bad: fails at once, the same way
    assert again.status_code == 500 and path.name in again.json()["error"]["message"]


def test_units_no_request_read_yet_are_caught_after_the_reference_scan(thread_server: Any, tiny_text_model: Path,
                                                                       copy_checkpoint: Any) -> None:
    """The tester's case: experts zeroed in the checkpoint under a running server before any request read them.
    The reference scan (idle, after the load) recorded every unit's checksum: the request fails, no garbage 200."""
    model = copy_checkpoint(tiny_text_model)
    state = make_state(engine_factory(model, expert_cache_gb=1e-9, max_num_seqs=1))
    server: ThreadServer = thread_server(state)
    store = state.engine.engine.model.store
    scan = store.reference_scan
    assert scan is not None and scan.done.wait(300)  # a readiness signal, not a sleep
    assert scan.scanned == store.total_experts and not store.stats.bytes_read  # no request has run
    layer = store.layers[0]
    for expert in range(store.num_experts):  # whichever experts a prompt routes to in this layer: zeroed
        ref = store.source.sources[(layer, expert)][0].refs[0]
        with open(ref.path, "r+b") as f:
            f.seek(ref.offset)
            f.write(bytes(ref.nbytes))
    resp = complete(server.url, PROMPTS[0])
    assert resp.status_code == 500 and resp.json()["error"]["code"] == "expert_load_failed", resp.text
    assert ref.path.name in resp.json()["error"]["message"]
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "degraded" and ref.path.name in health["reason"]


def test_in_a_batch_only_the_requests_that_need_the_changed_unit_fail(tiny_text_model: Path,
                                                                     copy_checkpoint: Any) -> None:
    """All prompts in one batch after an expert changed on disk: the step fails on the changed unit, the engine runs
    each request alone, and only requests that route to the unit fail; every other answer is its solo answer."""
    from moeserve import SamplingParams

    engine = engine_factory(copy_checkpoint(tiny_text_model), expert_cache_gb=1e-9, max_num_seqs=8)()
    try:
        check_only_requests_needing_a_changed_unit_fail(engine, SamplingParams(temperature=0, max_tokens=5,
                                                                               ignore_eos=True))
    finally:
        engine.close()


def check_only_requests_needing_a_changed_unit_fail(engine: Any, params: Any,
                                                   answer: Any = lambda out: out.outputs[0].token_ids) -> None:
    """Each prompt alone (its answer and the experts it routes to), then an expert only some need changed on disk
    and every prompt in one batch: the step fails on the unit, only requests routed to it fail (naming the file),
    every other `answer(output)` equals its solo one, and the engine reports itself degraded."""
    from moeserve.errors import ExpertLoadError

    routing = RoutingLog(engine)
    solo, used = {}, {}
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, params, str(i))
        while engine.has_unfinished_requests():
            solo.update({out.request_id: answer(out) for out in engine.step() if out.finished})
        used[i] = routing.take()
    target, others = pick_target(used)
    path = flip_expert_bytes(engine, target)
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, params, f"b{i}")
    final = {}
    while engine.has_unfinished_requests():
        final.update({out.request_id: out for out in engine.step() if out.finished})
    assert len(final) == len(PROMPTS)
    failed = {int(rid[1:]) for rid, out in final.items() if out.error is not None}
    assert 0 in failed and not failed & set(others)
    assert failed <= {i for i in used if target in used[i]}  # only requests routed to the changed unit
    for rid, out in final.items():
        if out.error is not None:
            assert isinstance(out.error, ExpertLoadError) and path.name in str(out.error)
        else:  # never a different answer
            assert answer(out) == solo[rid[1:]], rid
    assert engine.health_problem() is not None and path.name in engine.health_problem()


def test_a_truncated_shard_at_run_time_is_a_server_error(thread_server: Any, tiny_text_model: Path,
                                                         copy_checkpoint: Any) -> None:
    model = copy_checkpoint(tiny_text_model)
    server: ThreadServer = thread_server(make_state(engine_factory(model, expert_cache_gb=1e-9)))
    assert complete(server.url, PROMPTS[0]).status_code == 200
    shard = next(model.glob("*.safetensors"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 8)  # the experts' bytes are gone; resident weights were loaded
    resp = complete(server.url, PROMPTS[1])
    assert resp.status_code == 500 and resp.json()["error"]["type"] == "server_error", resp.text
