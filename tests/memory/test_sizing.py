"""One function sizes every tier (memory/sizing.py): `moeserve plan` prints exactly the lines the engine logs, on
a fake discrete GPU + host RAM (a fake `Machine`: no CUDA needed), the host tier included."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from moeserve.cli import main
from moeserve.config import EngineSettings
from moeserve.engine import llm_engine
from moeserve.engine.llm_engine import LLMEngine
from moeserve.errors import ConfigError
from moeserve.memory import topology
from moeserve.memory.topology import Machine

GiB = 2**30
NAMES = ("memory", "memory budget", "KV pool", "placement", "max_model_len", "host tier")
RTX_5080 = SimpleNamespace(name="NVIDIA GeForce RTX 5080", is_integrated=0, total_memory=int(15.5 * GiB))


class _Stop(Exception):
    """Raised in place of build_model: the engine has sized its tiers and would now allocate them on the GPU."""


def _fake_gpu(monkeypatch: pytest.MonkeyPatch, host_free: int) -> None:
    machine = Machine(host_total_bytes=64 * GiB, host_free_bytes=host_free, gpu=RTX_5080, gpu_free_bytes=2 * GiB)
    monkeypatch.setattr(topology, "read_machine", lambda device: machine)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # device=cuda is chosen; nothing runs on it


def _engine_lines(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, **settings: object) -> list[str]:
    def stop(*args: object, **kwargs: object) -> None:
        raise _Stop

    monkeypatch.setattr(llm_engine, "build_model", stop)
    with caplog.at_level(logging.DEBUG, logger="moeserve"), pytest.raises(_Stop):
        LLMEngine(EngineSettings(device="cuda", skip_tokenizer_init=True, **settings))  # type: ignore[arg-type]
    lines = [r.getMessage() for r in caplog.records]
    return [line for line in lines if line.split(": ", 1)[0] in NAMES]


def _plan_lines(capsys: pytest.CaptureFixture[str], args: list[str]) -> list[str]:
    assert main(["plan", *args, "--device", "cuda", "--no-probe"]) == 0
    out = capsys.readouterr().out.splitlines()
    return [line for line in out if line.split(": ", 1)[0] in NAMES]


@pytest.mark.parametrize("host_cache_gb", [None, 0.0001])
def test_plan_prints_the_sizes_the_engine_logs(tiny_checkpoint, monkeypatch, caplog, capsys, host_cache_gb):
    folder = str(tiny_checkpoint("qwen3_moe"))
    _fake_gpu(monkeypatch, host_free=40 * GiB)
    settings = {"model": folder, "expert_cache_gb": 0.0001, "max_model_len": 64}
    args = [folder, "--expert-cache-gb", "0.0001", "--max-model-len", "64"]
    if host_cache_gb is not None:
        settings["host_cache_gb"] = host_cache_gb
        args += ["--host-cache-gb", str(host_cache_gb)]
    engine = _engine_lines(monkeypatch, caplog, **settings)
    plan = _plan_lines(capsys, args)
    assert [line.split(": ", 1)[0] for line in engine] == list(NAMES)
    assert plan == engine
    assert engine[0].startswith("memory: NVIDIA GeForce RTX 5080: discrete, fast tier = GPU memory")
    host = engine[-1]
    assert "pinned where the driver allows" in host
    assert ("host_cache_gb=0.0001, set" if host_cache_gb else "auto: 40.00 GiB available less 4.00 GiB") in host
    assert "copier staging 2 x " in host  # the pinned staging buffers: counted, and named in both


def test_both_refuse_a_host_cache_beyond_ram_with_the_same_line(tiny_checkpoint, monkeypatch, caplog, capsys):
    folder = str(tiny_checkpoint("qwen3_moe"))
    _fake_gpu(monkeypatch, host_free=GiB)  # all of it headroom: nothing may be locked
    with pytest.raises(ConfigError) as engine_err:
        _engine_lines(monkeypatch, caplog, model=folder, expert_cache_gb=0.0001, max_model_len=64, host_cache_gb=0.5)
    assert main(["plan", folder, "--device", "cuda", "--no-probe", "--expert-cache-gb", "0.0001",
                 "--max-model-len", "64", "--host-cache-gb", "0.5"]) == 1
    plan_err = capsys.readouterr().err.strip()
    assert plan_err == f"error: {engine_err.value}"
    assert "host_cache_gb=0.5 needs" in plan_err and "more than the 0.0 MiB that can be locked safely (1.00 GiB available" in plan_err


def test_gpu_activations_are_budgeted_from_the_shapes(tiny_checkpoint, monkeypatch, capsys):
    """On the (fake) GPU the runtime part of the split is one step's activations computed from the model's shapes
    (memory/split.py activation_bytes), beside the derived budget's headroom: it grows with the tokens per step."""
    import re

    folder = str(tiny_checkpoint("qwen3_moe"))
    _fake_gpu(monkeypatch, host_free=40 * GiB)
    runtime = {}
    for tokens in (256, 4096):
        lines = _plan_lines(capsys, [folder, "--max-model-len", "64", "--max-num-batched-tokens", str(tokens)])
        budget = next(line for line in lines if line.startswith("memory budget: "))
        assert "derived: 2.00 GiB free less 1.00 GiB headroom" in budget  # the GPU's free memory, not RAM
        runtime[tokens] = float(re.search(r"runtime ([\d.]+) MiB", budget).group(1))  # type: ignore[union-attr]
    assert runtime[4096] > 4 * runtime[256]  # 16x the tokens: the per-token activations dominate


def test_unified_memory_charges_the_staging_buffers_to_the_one_pool():
    """On unified memory the copier's pinned staging buffers come out of the pool the split divides: its read
    buffers grow by them (two units, each rounded up to a power of two); on the CPU no copier, nothing added."""
    from moeserve.memory.sizing import size_tiers
    from moeserve.memory.split import MemoryNeeds
    from moeserve.memory.topology import MemoryTopology

    unit = 3 * 2**20  # 3 MiB: each staging buffer pins 4 MiB
    needs = MemoryNeeds(GiB, unit, 1000, 1024, 0, 16, 4096, 4 * unit, 64 * 2**20)
    settings = SimpleNamespace(memory_gb=None, expert_cache_gb=None, kv_cache_gb=None, host_cache_gb=None,
                               max_model_len=1024, max_num_seqs=4)
    staging = {}
    for device, unified in (("cuda", True), ("cpu", False)):
        topo = MemoryTopology(device, unified, 32 * GiB, 32 * GiB, 64 * GiB, "fake")
        sizes = size_tiers(needs, topo, settings)
        staging[device] = sizes.split.staging_bytes
        assert sizes.host.capacity == 0
    assert staging["cpu"] == 4 * unit and staging["cuda"] == 4 * unit + 2 * 4 * 2**20


def test_the_batched_expert_kernels_workspace_is_runtime_on_cuda_only():
    """On CUDA the experts run in the batched kernel, whose stacked weights (MemoryNeeds.expert_workspace_bytes,
    models/experts/kernels.batched_workspace_bytes) are charged as runtime; on the CPU they are not held."""
    from moeserve.memory.sizing import size_tiers
    from moeserve.memory.split import MemoryNeeds
    from moeserve.memory.topology import MemoryTopology
    from moeserve.models.experts.kernels import GROUP, batched_workspace_bytes

    unit = 2**20
    workspace = batched_workspace_bytes(1024, 512, 2, unit)
    assert workspace == GROUP * unit + (GROUP + 1) * (3 * 1024 * 512 + 3 * 512 + 1024) * 2
    needs = MemoryNeeds(GiB, unit, 1000, 1024, 0, 16, 4096, 4 * unit, 64 * 2**20, expert_workspace_bytes=workspace)
    settings = SimpleNamespace(memory_gb=None, expert_cache_gb=None, kv_cache_gb=None, host_cache_gb=0.0,
                               max_model_len=1024, max_num_seqs=4)
    runtime = {}
    for device in ("cuda", "cpu"):
        topo = MemoryTopology(device, False, 32 * GiB, 32 * GiB, 64 * GiB, "fake")
        runtime[device] = size_tiers(needs, topo, settings).split.overhead_bytes
    assert runtime["cpu"] == 64 * 2**20 and runtime["cuda"] == 64 * 2**20 + workspace
