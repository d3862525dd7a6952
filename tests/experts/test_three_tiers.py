"""A whole model through three tiers on CPU: fast tier (the asynchronous fake device, tests/experts/async_device.py)
<- host tier (RAM) <- disk, equal to the all-resident run bit for bit, for every architecture and every stored
format, in the default dtype (bf16 for these checkpoints) with default settings.

The test hook, `three_tiers`, is test-only (no user setting): it wraps `store_options` of engine/plan.py so that the
engine's store gets `AsyncFakeOps` as its device ops (copies run late on the fake copy stream, the model's ops run
on the calling thread, which is the fake's compute stream) and a host tier smaller than the experts, so host-tier
evictions happen. Everything else is the engine as a user builds it: the real store, loader, host tier, copier,
expert kernels, decode steps. A missing wait reads a slot before its copy ran, or a host buffer refilled under its
copy, and changes the logits (`test_whole_model_needs_the_compute_wait`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from moeserve.bench.checkpoints import ARCHS, write_tiny_checkpoint
from moeserve.engine import plan as engine_plan
from moeserve.engine.llm import LLM
from moeserve.engine.sampling_params import SamplingParams
from moeserve.experts.store import ExpertStore
from moeserve.experts.transfer import HostToDevice
from moeserve.memory.chunks import plan_chunks
from tests.experts.async_device import AsyncFakeOps, Timing
from tests.fixtures import checkpoints as C
from tests.logits_capture import generate_capturing_logits

PROMPTS = [{"prompt_token_ids": [3, 17, 42, 9, 250, 8, 61]}, {"prompt_token_ids": [11, 5, 77]}]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
FAST_UNITS = 3  # fast-tier slots: fewer than a prefill layer needs, so layers come in chunks

# Stored formats (moeserve/formats/catalog.py) -> (base checkpoint builder, quantizer, quantization_config,
# extra files, engine settings). "dense" is every architecture's bf16 checkpoint; int8 is quantized on load.
QUANTIZED = {
    "nvfp4-ct": (C.nvfp4_ct_quantize, C.NVFP4_CT_CONFIG, {}),
    "nvfp4-modelopt": (C.nvfp4_modelopt_quantize, None, {"hf_quant_config.json": C.MODELOPT_HF_QUANT_CONFIG}),
    "fp8-block": (C.fp8_block_quantize, C.FP8_CONFIG, {}),
    "mxfp4-ct": (C.mxfp4_ct_quantize, C.MXFP4_CT_CONFIG, {}),
}
FORMATS = [*QUANTIZED, "mxfp4-gpt-oss", "int8", "int8-gpt-oss"]


@pytest.fixture(scope="module")
def folder_of(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """bf16 checkpoints by case name (an architecture or a format), written on first use."""
    root = tmp_path_factory.mktemp("three_tiers")

    @functools.cache
    def make(name: str) -> Path:
        if name in ("gpt_oss", "int8-gpt-oss"):
            return C.write_gpt_oss(root / "gpt_oss")
        if name == "mxfp4-gpt-oss":
            return C.write_gpt_oss_mxfp4(make("gpt_oss"), root / name)
        if name == "gguf-gpt-oss":  # llama.cpp's layout: MXFP4 gate and up apart, gate rows then up rows in a unit
            from tests.fixtures.gguf_gpt_oss import write_gguf

            return write_gguf(make("gpt_oss"), root / "gpt-oss.gguf")
        if name in QUANTIZED:
            quantize, config, extra = QUANTIZED[name]
            return C.quantize_checkpoint(make("qwen3_moe"), root / name, quantize, config, extra)
        if name == "int8":
            return make("qwen3_moe")
        return write_tiny_checkpoint(root / name, name, "bfloat16")

    return make


@pytest.fixture
def three_tiers(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[int], list[AsyncFakeOps]]]:
    """`install(host_units)`: from now on every engine built gets the fake fast tier and a host tier of
    `host_units` units. Returns the list the fakes made are appended to (closed at teardown)."""
    made: list[AsyncFakeOps] = []
    original = engine_plan.store_options

    def install(host_units: int, seed: int = 0, copies: Timing = "late",
                pin_limit_bytes: int | None = None) -> list[AsyncFakeOps]:
        def store_options(s: Any, capacity: int, host_capacity: int) -> Any:
            ops = AsyncFakeOps(seed, copies=copies, kernels="host", pin_limit_bytes=pin_limit_bytes)
            made.append(ops)
            return replace(original(s, capacity, host_capacity), host_capacity=host_units, ops=ops)

        monkeypatch.setattr(engine_plan, "store_options", store_options)
        return made

    yield install
    for ops in made:
        ops.close()


def run(folder: Path, **settings: Any) -> tuple[list[torch.Tensor], list, ExpertStore]:
    """(logits of every engine step, outputs, store) of a greedy run with default settings plus `settings`."""
    llm = LLM(str(folder), skip_tokenizer_init=True, threads=1, **settings)
    assert llm.engine.dtype == torch.bfloat16  # dtype auto: the checkpoints' bf16
    logits, outs = generate_capturing_logits(llm, PROMPTS, PARAMS)
    return logits, [o.outputs[0] for o in outs], llm.engine.model.store


def logprob_tables(outs: list) -> list[list[dict[int, float]]]:
    return [[{t: e.logprob for t, e in lp.items()} for lp in out.logprobs] for out in outs]


def check_three_tiers_equal_resident(folder: Path, three_tiers: Callable[..., list[AsyncFakeOps]],
                                     label: str, fake: dict[str, Any] | None = None, **settings: Any) -> None:
    """`fake`: AsyncFakeOps options (copies timing, pin_limit_bytes); `settings`: engine settings of both runs
    (the three-tier run may add its own through `offload`)."""
    offload = settings.pop("offload", {})
    ref_logits, ref_outs, resident = run(folder, **settings)
    assert resident.resident and resident.copier is None
    assert ref_logits[0].dtype == torch.float32  # fp32 logits of a bf16 model (the engine's default dtype)
    total = resident.total_experts
    made = three_tiers(total // 2, **(fake or {}))
    logits, outs, store = run(folder, expert_cache_gb=FAST_UNITS * resident.unit_nbytes / 2**30, **offload,
                              **settings)
    host = store.loader.host
    assert not store.resident and store.capacity == FAST_UNITS and store.copier is not None
    assert host is not None and host.capacity == total // 2
    assert host.evictions > 0, f"{label}: no host-tier eviction"
    assert store.stats.bytes_from_host > 0 and store.stats.misses > 0
    (ops,) = made
    assert ops.errors == [] and ops.violations == []
    if (fake or {}).get("pin_limit_bytes") is None:
        assert ops.async_copies > 0
    else:  # the host tier's chunks were refused pinning: its copies are synchronous
        assert ops.sync_copies > 0
    assert (store.prefetcher is not None) == bool(offload.get("prefetch"))
    assert len(logits) == len(ref_logits)
    for step, (a, b) in enumerate(zip(logits, ref_logits)):
        assert torch.equal(a, b), f"{label}: logits differ at step {step}"
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref_outs]
    assert logprob_tables(outs) == logprob_tables(ref_outs)


@pytest.mark.parametrize("arch", [*ARCHS, "gpt_oss"])
def test_every_architecture_through_three_tiers_equals_resident(folder_of, three_tiers, arch: str) -> None:
    check_three_tiers_equal_resident(folder_of(arch), three_tiers, arch)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_through_three_tiers_equals_resident(folder_of, three_tiers, fmt: str) -> None:
    settings = {"quantization": "int8"} if fmt.startswith("int8") else {}
    check_three_tiers_equal_resident(folder_of(fmt), three_tiers, fmt, **settings)


# Beside the default (copies run late, everything pinned): copies after random delays, the caller's prefetch
# guesses... and the engine's own (affinity) prefetch, and a host tier that pinning refused (its copies synchronous,
# the staging buffers still pinned and asynchronous).
VARIANTS = {
    "random-copies": ({"copies": "random", "seed": 1}, {}),
    "prefetch": ({}, {"offload": {"prefetch": True}}),
    "pageable-host": ({"pin_limit_bytes": 2**15}, {}),  # the tier's larger chunks refused, units' buffers pinned
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_three_tier_variants_equal_resident(folder_of, three_tiers, arch: str, variant: str) -> None:
    fake, settings = VARIANTS[variant]
    check_three_tiers_equal_resident(folder_of(arch), three_tiers, f"{arch} {variant}", fake, **settings)


def before_use_without_wait(self: HostToDevice, slot: int) -> None:
    with self._lock:
        self._filled[slot] = None  # the copy's event, dropped: the model reads the slot before the copy ran


def check_host_tier_mechanism(folder: Path, run_offloaded: Callable[..., tuple[list, list, ExpertStore]],
                              ref: tuple[list, list, ExpertStore], label: str, **settings: Any) -> None:
    """Host-tier hits and evictions forced by construction, not left to the workload's reuse distances: ONE
    fast-tier slot (fewer than one token's experts at one layer, so every expert use is a miss and each unit is
    missed once per use), then (a) a host tier holding every unit: every unit missed twice must come from it
    (more misses than units guarantees one: pigeonhole), nothing evicted; (b) a host tier of half the units: the
    units the run reads (= (a)'s disk reads, the same routing since both equal resident) outnumber it, so it must
    evict. `run_offloaded(folder, host_units, **settings)` builds the three-tier engine; `ref`: the resident run.
    Both runs equal resident bit for bit."""
    ref_logits, ref_outs, resident = ref
    total, unit = resident.total_experts, resident.unit_nbytes
    for host_units in (total, total // 2):
        logits, outs, store = run_offloaded(folder, host_units, expert_cache_gb=unit / 2**30, **settings)
        host = store.loader.host
        if host is None:
            pytest.skip("no host tier on this machine (unified memory): GPU slots + disk only")
        assert store.capacity == 1 and host.capacity == host_units
        for step, (a, b) in enumerate(zip(logits, ref_logits, strict=True)):
            assert torch.equal(a.cpu(), b.cpu()), f"{label}, host tier of {host_units}: logits differ at step {step}"
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref_outs]
        if host_units == total:
            assert store.stats.misses > total, f"{label}: the run must miss more often than it has units"
            assert store.stats.bytes_from_host > 0 and host.evictions == 0, f"{label}: no host-tier hit"
            units_read = store.stats.bytes_from_disk // unit  # each unit read from disk once, then kept
        else:
            assert units_read > host_units, f"{label}: the run reads only {units_read} units"
            assert host.evictions > 0, f"{label}: a host tier of {host_units} units never evicted"


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_host_tier_hits_and_evictions_are_forced(folder_of, three_tiers, arch: str) -> None:
    folder = folder_of(arch)

    def offloaded(folder: Path, host_units: int, **settings: Any) -> tuple[list, list, ExpertStore]:
        three_tiers(host_units)
        return run(folder, **settings)

    check_host_tier_mechanism(folder, offloaded, run(folder), arch)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [*ARCHS, "gpt_oss", "nvfp4-ct", "fp8-block", "mxfp4-gpt-oss", "int8"])
def test_cuda_host_tier_hits_and_evictions_are_forced(folder_of, case: str) -> None:
    """The CUDA form of the check above: the pinned host tier sized to `host_units` by its chunk plan."""
    folder = folder_of(case)
    settings: dict[str, Any] = {"device": "cuda", "quantization": "int8" if case == "int8" else "none"}
    ref = run(folder, **settings)

    def offloaded(folder: Path, host_units: int, **more: Any) -> tuple[list, list, ExpertStore]:
        host_gb = plan_chunks(host_units, ref[2].unit_nbytes).nbytes / 2**30
        return run(folder, host_cache_gb=host_gb, **settings, **more)

    if ref[2].copier is None or not ref[2].copier.mode.asynchronous:
        pytest.skip("no asynchronous copier on this device")
    check_host_tier_mechanism(folder, offloaded, ref, f"{case} on CUDA")


@pytest.mark.gpu
@pytest.mark.parametrize("case", [*ARCHS, "gpt_oss", "nvfp4-ct", "fp8-block", "mxfp4-gpt-oss", "int8"])
def test_cuda_three_tiers_equal_resident(folder_of, case: str) -> None:
    # The real thing (scripts/gpu_acceptance.sh): GPU slots + pinned host tier + disk vs everything on the GPU.
    folder = folder_of(case)
    settings: dict[str, Any] = {"device": "cuda", "quantization": "int8" if case == "int8" else "none"}
    ref_logits, ref_outs, resident = run(folder, **settings)
    assert resident.resident
    # exactly the fake's host tier of half the experts: its chunk plan's bytes (slack included) hold that many
    # (the bare unit bytes held fewer: on an H200 gpt-oss, mxfp4 and int8 then never hit their host tier)
    host_gb = plan_chunks(resident.total_experts // 2, resident.unit_nbytes).nbytes / 2**30
    logits, outs, store = run(folder, expert_cache_gb=FAST_UNITS * resident.unit_nbytes / 2**30,
                              host_cache_gb=host_gb, **settings)
    assert not store.resident and store.copier is not None and store.copier.mode.asynchronous
    for step, (a, b) in enumerate(zip(logits, ref_logits, strict=True)):
        assert torch.equal(a.cpu(), b.cpu()), f"{case} on CUDA: logits differ at step {step}"
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref_outs]
    assert logprob_tables(outs) == logprob_tables(ref_outs)
    if store.loader.host is None:
        pytest.skip("no host tier on this machine (unified memory): GPU slots + disk only")
    # whether THIS workload re-reads a unit while it is in the host tier is its routing's business (an H200's
    # bf16 gpt-oss routing never did): hits and evictions are forced in test_cuda_host_tier_hits_and_evictions_...
    assert store.loader.host.capacity >= resident.total_experts // 2 and store.stats.misses > 0


def test_whole_model_needs_the_compute_wait(folder_of, three_tiers, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = folder_of("qwen3_moe")
    ref_logits, _, resident = run(folder)
    three_tiers(resident.total_experts // 2)
    monkeypatch.setattr(HostToDevice, "before_use", before_use_without_wait)
    logits, _, _ = run(folder, expert_cache_gb=FAST_UNITS * resident.unit_nbytes / 2**30)
    assert any(not torch.equal(a, b) for a, b in zip(logits, ref_logits))
