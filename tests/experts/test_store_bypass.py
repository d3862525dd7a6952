"""Admission control in the engine's store (expert_admission=policy): a miss the policy does not admit against its
victim is read into a bypass buffer, lent for that call, dropped; the victim stays cached.

- The compute reads the same bytes: offloaded with bypass == resident, every step's logits `torch.equal`, tokens
  and logprobs equal, in bf16 with default settings, for several architectures, with prefetch on and off, and
  through the fake asynchronous fast tier + host tier (the bypass buffer is lent through the copier like a slot).
- The store's hits, misses and bypasses are `simulate(admission=True)`'s on the trace the same run recorded, per-op
  and through the fused decode step (which stops at a layer whose bypassed expert is not in `slot_table`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Container
from pathlib import Path
from typing import Any

import pytest
import torch

from moeserve.bench.checkpoints import write_tiny_checkpoint
from moeserve.bench.simulate import calls_from_steps, simulate
from moeserve.engine.llm import LLM
from moeserve.engine.sampling_params import SamplingParams
from moeserve.errors import ConfigError
from moeserve.experts.policies import DeferredHits, LRUPolicy, make_policy
from moeserve.experts.policies.base import Key
from moeserve.experts.store import ExpertStore
from moeserve.experts.traces.moetrace import read_trace
from tests.experts.test_sim_engine_replay import DEMO
from tests.experts.test_sim_engine_replay import run as run_demo
from tests.experts.test_three_tiers import three_tiers  # noqa: F401 - the fixture
from tests.fixtures import checkpoints as C
from tests.logits_capture import generate_capturing_logits

PROMPTS = [{"prompt_token_ids": [3, 17, 42, 9, 250, 8, 61]}, {"prompt_token_ids": [11, 5, 77]},
           {"prompt_token_ids": [200, 4]}]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
FAST_UNITS = 3  # fewer than a prefill layer needs: chunks, evictions, and refusals to weigh


@pytest.fixture(scope="module")
def folder_of(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    root = tmp_path_factory.mktemp("bypass")

    @functools.cache
    def make(arch: str) -> Path:
        if arch == "gpt_oss":
            return C.write_gpt_oss(root / arch)
        return write_tiny_checkpoint(root / arch, arch, "bfloat16")

    return make


def run(folder: Path, **settings: Any) -> tuple[list[torch.Tensor], list, ExpertStore]:
    llm = LLM(str(folder), skip_tokenizer_init=True, threads=1, **settings)
    assert llm.engine.dtype == torch.bfloat16  # dtype auto: the checkpoints' bf16
    logits, outs = generate_capturing_logits(llm, PROMPTS, PARAMS)
    store = llm.engine.model.store
    llm.engine.close()
    return logits, [o.outputs[0] for o in outs], store


def check_equal(ref: tuple, got: tuple, label: str) -> None:
    (ref_logits, ref_outs, _), (logits, outs, _) = ref, got
    assert len(logits) == len(ref_logits)
    for step, (a, b) in enumerate(zip(logits, ref_logits)):
        assert torch.equal(a, b), f"{label}: logits differ at step {step}"
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref_outs]
    tables = [[{t: e.logprob for t, e in lp.items()} for lp in o.logprobs] for o in outs]
    assert tables == [[{t: e.logprob for t, e in lp.items()} for lp in o.logprobs] for o in ref_outs]


class Refusing(LRUPolicy):
    """LRU that admits no miss while the cache is full: every miss after the first `capacity` is a bypass."""

    def admit(self, key: Key, victim: Key) -> bool:
        return False


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen3_next", "gpt_oss"])
@pytest.mark.parametrize("prefetch", [False, True])
def test_bypass_equals_resident(folder_of, arch: str, prefetch: bool) -> None:
    folder = folder_of(arch)
    ref = run(folder)
    assert ref[2].resident
    got = run(folder, expert_cache_gb=FAST_UNITS * ref[2].unit_nbytes / 2**30, expert_admission="policy",
              prefetch=prefetch)
    store = got[2]
    assert not store.resident and store.admission and store.capacity == FAST_UNITS
    assert store.stats.bypassed > 0, f"{arch}: the policy refused nothing: the bypass path did not run"
    assert store.stats.bytes_read > 0
    check_equal(ref, got, f"{arch} prefetch={prefetch}")


def test_every_refused_miss_is_computed_from_the_bypass_buffer(folder_of, monkeypatch) -> None:
    """A policy that refuses every miss once the cache is full: most experts come from the one bypass buffer,
    and the answer is still the resident one bit for bit."""
    original = make_policy
    monkeypatch.setattr("moeserve.experts.store.make_policy",
                        lambda name, **kw: Refusing() if name == "lru" else original(name, **kw))
    folder = folder_of("qwen3_moe")
    ref = run(folder)
    got = run(folder, expert_cache_gb=FAST_UNITS * ref[2].unit_nbytes / 2**30, expert_admission="policy",
              cache_policy="lru")
    stats = got[2].stats
    assert stats.bypassed > stats.misses - stats.bypassed > 0  # most misses bypassed, the first ones cached
    check_equal(ref, got, "refusing")


def test_landed_bypass_reads_join_the_run_of_the_experts_beside_them(folder_of, monkeypatch) -> None:
    """A refused miss read ahead and landed is lent in one run with its neighbours (no extra call per bypass);
    one not landed yet starts its own run. Reads ahead made to land at once, so no timing decides it."""
    from concurrent.futures import Future

    original = make_policy
    monkeypatch.setattr("moeserve.experts.store.make_policy",
                        lambda name, **kw: Refusing() if name == "lru" else original(name, **kw))
    folder = folder_of("qwen3_moe")
    unit = run(folder)[2].unit_nbytes
    llm = LLM(str(folder), skip_tokenizer_init=True, threads=1, expert_cache_gb=FAST_UNITS * unit / 2**30,
              expert_admission="policy", cache_policy="lru")
    store = llm.engine.model.store
    held: list[Future[None]] = []

    def read_ahead(fn: Callable[[Key, int], None], key: Key, buffer: int, land: bool) -> Future[None]:
        future: Future[None] = Future()
        fn(key, buffer)
        if land:
            future.set_result(None)
        else:
            held.append(future)
        return future

    try:
        layer = store.layers[0]
        for e in range(FAST_UNITS):  # fill the cache: from here on every miss is refused
            list(store.experts(layer, [e]))
        hits = list(range(FAST_UNITS))
        refused = list(range(FAST_UNITS, 2 * FAST_UNITS))
        monkeypatch.setattr(store._misses, "submit", functools.partial(read_ahead, land=True), raising=False)
        runs = [[e for e, _ in run_] for run_ in store.experts(layer, hits[:1] + refused[:2])]
        assert runs == [hits[:1] + refused[:2]]  # one run: cached slot, then two landed bypass buffers
        monkeypatch.setattr(store._misses, "submit", functools.partial(read_ahead, land=False), raising=False)
        chunks = store.experts(layer, hits[:1] + refused[2:3])
        assert [e for e, _ in next(chunks)] == hits[:1]  # the refused one has not landed: it waits for its own run
        held[0].set_result(None)
        assert [[e for e, _ in run_] for run_ in chunks] == [refused[2:3]]
        assert store.stats.bypassed == 3
    finally:
        llm.engine.close()


def test_bypass_through_the_fake_device_and_host_tier(folder_of, three_tiers) -> None:  # noqa: F811
    """The bypass buffer is a row of the device pool, filled through the copier and waited for like a slot."""
    folder = folder_of("qwen3_moe")
    ref = run(folder)
    made = three_tiers(ref[2].total_experts // 2)
    got = run(folder, expert_cache_gb=FAST_UNITS * ref[2].unit_nbytes / 2**30, expert_admission="policy")
    store = got[2]
    assert store.copier is not None and store.stats.bypassed > 0 and store.stats.bytes_from_host > 0
    (ops,) = made
    assert ops.errors == [] and ops.violations == []
    check_equal(ref, got, "three tiers")


def test_admission_always_never_bypasses(folder_of) -> None:
    folder = folder_of("qwen3_moe")
    ref = run(folder)
    got = run(folder, expert_cache_gb=FAST_UNITS * ref[2].unit_nbytes / 2**30)
    assert not got[2].admission and got[2].stats.bypassed == 0 and got[2].bypass_buffers == 0
    assert "admission always" in got[2].describe()


def test_bad_admission_value_is_refused_with_did_you_mean(folder_of) -> None:
    with pytest.raises(ConfigError, match="polic"):
        LLM(str(folder_of("qwen3_moe")), skip_tokenizer_init=True, expert_admission="polcy")


def test_deferred_hits_forward_admission_to_the_policy() -> None:
    """The store wraps its policy in DeferredHits: admit and on_bypass must reach the real one, after the log."""
    seen: list[tuple[str, Key]] = []

    class Spy(Refusing):
        def on_bypass(self, key: Key) -> None:
            seen.append(("bypass", key))

        def on_hit(self, key: Key) -> None:
            seen.append(("hit", key))
            super().on_hit(key)

        def choose_victim(self, pinned: Container[Key], layers: Container[int] | None = None) -> Key:
            return super().choose_victim(pinned, layers)

    wrapped = DeferredHits(Spy())
    wrapped.on_insert((0, 1))
    wrapped.on_hit((0, 1))
    assert wrapped.admit((0, 2), (0, 1)) is False
    wrapped.on_bypass((0, 2))
    assert seen == [("hit", (0, 1)), ("bypass", (0, 2))]


demo = pytest.mark.skipif(not (DEMO / "model.safetensors").is_file(), reason="demo model not built")


@demo
@pytest.mark.parametrize("policy", ["lfru", "reuse"])
@pytest.mark.parametrize("capacity", [12, 16])
def test_store_counts_equal_simulate_with_admission(tmp_path, policy: str, capacity: int) -> None:
    engine, tokens, trace, _ = run_demo(tmp_path, "float32", capacity, policy, expert_admission="policy")
    always, always_tokens, _, _ = run_demo(tmp_path, "float32", capacity, policy, trace=False)
    assert trace is not None and tokens == always_tokens
    steps = calls_from_steps(read_trace(trace))
    sim = simulate(steps, policy, capacity, admission=True)
    assert sim.per_layer == engine
    assert sim.bypassed > 0 and sim.hits > 0  # admission refused some misses: the comparison means something
    assert simulate(steps, policy, capacity).per_layer == always  # and the default is the simulator's plain replay


@demo
def test_fused_decode_step_counts_bypasses_as_the_simulator(tmp_path) -> None:
    """The C++ decode stack runs layers whose experts are all in `slot_table` without asking the store; a bypassed
    expert never is, so its layer goes through `experts`: the counts are still the simulator's."""
    traced, tokens, trace, _ = run_demo(tmp_path, "bfloat16", 12, "lfru", expert_admission="policy")
    fused, fused_tokens, _, reported = run_demo(tmp_path, "bfloat16", 12, "lfru", trace=False,
                                                expert_admission="policy")
    _, always_tokens, _, _ = run_demo(tmp_path, "bfloat16", 12, "lfru", trace=False)
    assert trace is not None and fused_tokens == tokens == always_tokens
    if not reported:
        pytest.skip("the fused decode step does not run here (it needs the C++ kernels with AVX512-BF16)")
    sim = simulate(calls_from_steps(read_trace(trace)), "lfru", 12, admission=True)
    assert sim.per_layer == traced == fused
    assert sim.bypassed > 0


def test_bypass_reads_ahead_into_their_own_buffers_then_in_turn_into_the_last() -> None:
    """experts/bypass.py: the first len(buffers) - 1 refused misses go to the I/O threads, each in its own buffer;
    the rest are read by the caller, at its turn, into the last buffer; bytes counted per tier."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from moeserve.experts.bypass import BypassReads
    from moeserve.experts.slot_cache import StoreStats

    filled: list[tuple[Key, int, str]] = []

    def fill(key: Key, slot: int) -> tuple[int, bool]:
        filled.append((key, slot, threading.current_thread().name))
        return 100, key[1] % 2 == 1

    stats = StoreStats()
    with ThreadPoolExecutor(2, thread_name_prefix="io") as pool:
        reads = BypassReads(fill, threading.Condition(), stats, range(10, 14), pool.submit)
        keys = [(0, e) for e in range(6)]
        reads.start(keys)
        assert [reads.take(k) for k in keys] == [10, 11, 12, 13, 13, 13]
        reads.settle()
    by_key = {key: (slot, thread) for key, slot, thread in filled}
    assert all(by_key[(0, e)][1].startswith("io") for e in range(3))
    assert all(not by_key[(0, e)][1].startswith("io") for e in range(3, 6))
    assert stats.layer(0).bytes_from_disk == 300 and stats.layer(0).bytes_from_host == 300
    alone = BypassReads(fill, threading.Condition(), StoreStats(), range(5, 6), None)  # no I/O threads
    alone.start([(1, 0), (1, 1)])
    assert [alone.take((1, 0)), alone.take((1, 1))] == [5, 5]


def test_bypass_buffers_are_counted_in_the_read_buffers(folder_of) -> None:
    folder = folder_of("qwen3_moe")
    unit = run(folder)[2].unit_nbytes
    always = run(folder, expert_cache_gb=FAST_UNITS * unit / 2**30)[2]
    policy = run(folder, expert_cache_gb=FAST_UNITS * unit / 2**30, expert_admission="policy")[2]
    assert policy.bypass_buffers == 4 and policy.io_threads > 0
    assert policy.staging_nbytes - always.staging_nbytes == 4 * unit
    assert "4 bypass buffers" in policy.describe()


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_cuda_bypass_equals_resident(folder_of, arch: str) -> None:
    """On a real GPU: the bypass buffers are device rows filled through the pinned copier (not run in this session:
    no GPU was lent; scripts/gpu_acceptance.sh runs `pytest -m gpu`)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    folder = folder_of(arch)
    ref = run(folder, device="cuda")
    got = run(folder, device="cuda", expert_cache_gb=FAST_UNITS * ref[2].unit_nbytes / 2**30,
              expert_admission="policy")
    assert got[2].copier is not None and got[2].stats.bypassed > 0
    ref = ([t.cpu() for t in ref[0]], ref[1], ref[2])
    check_equal(ref, ([t.cpu() for t in got[0]], got[1], got[2]), f"{arch} on CUDA")
