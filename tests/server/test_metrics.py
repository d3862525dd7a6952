"""/metrics: Prometheus text format, token counters equal to usage, latency histograms, expert-cache counters."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx

from tests.server.conftest import MODEL_NAME, ThreadServer, engine_factory, make_state

SAMPLE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_]+="[^"]*",?)*\})? -?[0-9.e+-]+$|^[a-zA-Z_:].* \+?Inf$')


def scrape(url: str) -> dict[str, float]:
    """Parse the exposition text (asserting every line is well formed): 'name{labels}' -> value."""
    resp = httpx.get(url + "/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    samples = {}
    for line in resp.text.splitlines():
        if line.startswith("#"):
            assert re.match(r"^# (HELP|TYPE) (moeserve|vllm):\w+ ", line), line
            continue
        assert SAMPLE.match(line), line
        key, value = line.rsplit(" ", 1)
        samples[key] = float(value)
    return samples


def total(samples: dict[str, float], name: str) -> float:
    return sum(v for k, v in samples.items() if k.split("{")[0] == "moeserve:" + name)


def test_counters_follow_usage(live_server: ThreadServer) -> None:
    before = scrape(live_server.url)
    stream = live_server.client().completions.create(
        model=MODEL_NAME, prompt="The fox", max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    usage = [c.usage for c in stream if c.usage is not None][0]
    after = scrape(live_server.url)

    def delta(name: str) -> float:
        return total(after, name) - total(before, name)

    assert delta("prompt_tokens_total") == usage.prompt_tokens
    assert delta("generation_tokens_total") == usage.completion_tokens == 6
    assert delta("time_to_first_token_seconds_count") == 1
    assert delta("inter_token_latency_seconds_count") == 5  # one gap between each pair of the 6 tokens
    assert delta("e2e_request_latency_seconds_count") == 1
    label = f'moeserve:request_success_total{{finished_reason="length",model_name="{MODEL_NAME}"}}'
    assert after[label] - before.get(label, 0) == 1
    assert total(after, "num_requests_running") == 0
    assert total(after, "expert_cache_hits_total") > total(before, "expert_cache_hits_total")


def test_sequence_memory_counters(live_server: ThreadServer) -> None:
    """KV blocks (used + free = the pool), prefill tokens, steps, and the prefix cache: the same 40-token prompt twice
    hits its 2 full 16-token blocks the second time (the last, partial block and the last token are computed)."""
    prompt = [(7 * i + 3) % 90 + 5 for i in range(40)]
    before = scrape(live_server.url)
    for _ in range(2):
        live_server.client().completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3, temperature=0,
                                                extra_body={"ignore_eos": True})
    after = scrape(live_server.url)

    def delta(name: str) -> float:
        return total(after, name) - total(before, name)

    assert delta("prefix_cache_queries_total") == 2 * 40
    assert delta("prefix_cache_hits_total") == 32
    assert delta("prefill_tokens_total") == 40 + 8  # the second request computes only what the cache did not hold
    assert delta("engine_steps_total") >= 2 * 3
    used = after[f'moeserve:kv_cache_blocks{{model_name="{MODEL_NAME}",state="used"}}']
    free = after[f'moeserve:kv_cache_blocks{{model_name="{MODEL_NAME}",state="free"}}']
    assert used == 0 and free > 0 and total(after, "kv_cache_usage_perc") == 0  # idle: nothing held
    assert total(after, "last_step_prefill_tokens") == 0  # the last step decoded


def test_expert_cache_counters_match_the_store(thread_server: Any, tiny_text_model: Path) -> None:
    # A fast tier far smaller than the experts: every step misses and reads from disk.
    server: ThreadServer = thread_server(make_state(engine_factory(tiny_text_model, expert_cache_gb=1e-6)))
    server.client().completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=4, temperature=0)
    samples = scrape(server.url)
    stats = server.state.llm.model.store.stats
    assert stats.misses > 0
    assert total(samples, "expert_cache_misses_total") == stats.misses
    assert total(samples, "expert_cache_hits_total") == stats.hits
    disk = f'moeserve:expert_bytes_loaded_total{{model_name="{MODEL_NAME}",tier="disk"}}'
    assert samples[disk] == stats.bytes_from_disk > 0


def test_periodic_stats_line(live_server: ThreadServer) -> None:
    from moeserve.server.metrics import StatsLogger

    stats = StatsLogger(live_server.state.metrics, live_server.state.engine)
    live_server.client().completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=5, temperature=0,
                                            extra_body={"ignore_eos": True})
    line = stats.line()
    assert line is not None and line.startswith("engine: 0 running, 0 waiting; generation ")
    assert "expert cache hit rate 100.0% (0 misses)" in line  # everything is resident in this server
    assert stats.line() is None  # idle: nothing to say


def series(samples: dict[str, float], name: str) -> dict[str, float]:
    """The samples of family `name` (a histogram's _bucket, _sum and _count too), keyed by what follows the name."""
    return {k[len(name):]: v for k, v in samples.items()
            if k.startswith(name) and k[len(name):][:1] in ("{", "") or k.startswith(name + "_")}


def test_vllm_names_beside_ours(live_server: ThreadServer) -> None:
    """The metrics that mean what vLLM's mean are exposed under vLLM's names too, with the same values and types."""
    from moeserve.server.metrics import VLLM_NAMES

    live_server.client().completions.create(model=MODEL_NAME, prompt="The fox", max_tokens=2, temperature=0)
    text = httpx.get(live_server.url + "/metrics").text
    samples = scrape(live_server.url)
    for ours, theirs in VLLM_NAMES.items():
        for name in theirs:
            kind = re.search(rf"^# TYPE moeserve:{ours} (\w+)$", text, re.M)
            assert kind is not None and f"# TYPE vllm:{name} {kind.group(1)}" in text
            mine = series(samples, "moeserve:" + ours)
            assert mine and series(samples, "vllm:" + name) == mine, (ours, name)
    assert samples[f'vllm:gpu_cache_usage_perc{{model_name="{MODEL_NAME}"}}'] == \
        samples[f'moeserve:kv_cache_usage_perc{{model_name="{MODEL_NAME}"}}']
    assert samples[f'vllm:prompt_tokens_total{{model_name="{MODEL_NAME}"}}'] > 0
    assert f'vllm:time_to_first_token_seconds_bucket{{le="+Inf",model_name="{MODEL_NAME}"}}' in samples
