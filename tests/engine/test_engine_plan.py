"""The start-up plan (engine/plan.py) and its choices (engine/choices.py), without loading a model: each choice is
a pure function of settings and facts, and `make_engine_plan` asks the machine only through its probe (a fake
here: no kernels loaded, no RSS measured), on a checkpoint's headers or config.json alone."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from moeserve.checkpoint.folder import open_checkpoint
from moeserve.config import EngineSettings
from moeserve.engine.choices import (
    check_max_model_len,
    check_prefill_step,
    choose_batched_tokens,
    choose_device,
    choose_dtype,
    choose_expert_layout,
    choose_threads,
    kernels_line,
    kv_cache_line,
    store_options,
)
from moeserve.engine.llm_engine import demo_model_path
from moeserve.engine.plan import EnginePlan, PlanningProbe, StartupProbe, make_engine_plan
from moeserve.engine.sizing import spec_kv_groups
from moeserve.errors import ConfigError
from moeserve.memory.topology import MemoryTopology
from moeserve.models.config_only import config_only_checkpoint
from moeserve.models.experts.plans import expert_plan
from moeserve.models.validate import read_model
from moeserve.state.kinds import RecurrentState
from moeserve.state.kv_cache import kv_groups

GiB = 2**30
# the order the start-up log prints the plan's choices in (the engine's record keeps it)
PLAN_CHOICES = ["device", "dtype", "threads", "allocator", "kernels", "max_num_batched_tokens", "memory",
                "memory budget", "KV pool", "placement", "max_model_len", "host tier", "expert layout", "experts"]


class FakeProbe(StartupProbe):
    """A machine with `cores` cores, 8 GiB free RAM, C++ kernels and the interleaved op as told; records what was
    asked, in order."""

    def __init__(self, cpp: bool = True, interleaved: bool = True, cuda: bool = False, cores: int = 4) -> None:
        super().__init__("fake allocator")
        self.cpp, self.interleaved, self.cuda, self.cores = cpp, interleaved, cuda, cores
        self.asked: list[str] = []

    def cuda_available(self) -> bool:
        self.asked.append("cuda")
        return self.cuda

    def usable_cores(self) -> int:
        self.asked.append("cores")
        return self.cores

    def kernels(self, want: str, device_type: str, isa: str) -> tuple[bool, str]:
        self.asked.append("kernels")
        return self.cpp and want != "torch", "fake kernels"

    def runtime_bytes(self) -> int:
        self.asked.append("runtime")
        return 300 * 2**20

    def topology(self, device: torch.device, unified_memory: str) -> MemoryTopology:
        self.asked.append("topology")
        return MemoryTopology("cpu", False, 8 * GiB, 8 * GiB, 16 * GiB, "fake CPU")

    def interleaved_ops(self, int8: bool) -> bool:
        self.asked.append("interleaved")
        return self.interleaved


def _plan(probe: StartupProbe | None = None, path: Path | None = None,
          told: Callable[[str, str], None] = lambda name, line: None, **settings: object) -> EnginePlan:
    ckpt = open_checkpoint(str(demo_model_path())) if path is None else config_only_checkpoint(path)
    arch, spec = read_model(ckpt)
    s = EngineSettings(skip_tokenizer_init=True, **settings)  # type: ignore[arg-type]
    return make_engine_plan(ckpt, arch, spec, s, probe or FakeProbe(), told)


# ------------------------------------------------------------------------------------------ the choices, alone
def test_device() -> None:
    assert choose_device("auto", False) == (torch.device("cpu"), "cpu (auto: no CUDA device)")
    assert choose_device("auto", True) == (torch.device("cuda"), "cuda (auto: CUDA available)")
    assert choose_device("cpu", True) == (torch.device("cpu"), "cpu (set)")
    with pytest.raises(ConfigError, match="device=cuda but no CUDA device"):
        choose_device("cuda", False)


def test_dtype() -> None:
    assert choose_dtype("float32", "bfloat16", "BF16") == (torch.float32, "float32 (set)")
    assert choose_dtype("auto", "float16", "BF16") == (torch.float16, "float16 (auto: config.json dtype)")
    assert choose_dtype("auto", None, "F32") == (torch.float32, "float32 (auto: most weights are stored as F32)")
    assert choose_dtype("auto", None, "U8")[0] == torch.bfloat16  # a code with no compute dtype


def test_threads_and_kernels_lines() -> None:
    assert choose_threads(None, 6) == (6, "6 (auto: all 6 usable cores)")
    assert choose_threads(2, 6) == (2, "2 (set)")
    assert kernels_line("auto", True, "cached x.so") == "cpp (auto: cached x.so)"
    assert kernels_line("torch", False, "kernels=torch") == "torch (torch: kernels=torch)"


def test_batched_tokens_and_context() -> None:
    assert choose_batched_tokens(None, 8)[0] == 2048 and choose_batched_tokens(None, 4096)[0] == 4096
    n, line = choose_batched_tokens(512, 8)
    assert n == 512 and line.startswith("512 (set): longer prompts are prefilled in chunks")
    with pytest.raises(ConfigError, match="cannot hold one decode token of each of max_num_seqs=8"):
        choose_batched_tokens(4, 8)
    check_max_model_len(None, 512)
    check_max_model_len(512, 512)
    with pytest.raises(ConfigError, match="exceeds the model's max_position_embeddings=512"):
        check_max_model_len(513, 512)


def test_a_step_holds_one_recurrent_chunk_beside_the_decodes() -> None:
    kind = RecurrentState(conv_shape=(3, 8), state_shape=(2, 4, 4), prefill_chunk=64)
    groups = kv_groups([None] * 3, kind, recurrent_layers=[0, 1])
    check_prefill_step(groups, 64 + 8, 8)
    with pytest.raises(ConfigError, match="set at least 72"):
        check_prefill_step(groups, 71, 8)


def test_expert_layout() -> None:
    ckpt = open_checkpoint(str(demo_model_path()))
    arch, spec = read_model(ckpt)
    dense = expert_plan(ckpt, arch, spec, torch.bfloat16)
    asked: list[bool] = []

    def ops(int8: bool) -> bool:
        asked.append(int8)
        return True

    assert choose_expert_layout(dense, torch.bfloat16, "none", "plain", True, ops) == (False, "plain (set)")
    use, line = choose_expert_layout(dense, torch.bfloat16, "int8", "auto", True, ops)
    assert use and line.endswith("auto)") and asked == [True]  # the int8 op asked for
    assert choose_expert_layout(dense, torch.bfloat16, "none", "auto", False, ops) == (
        False, "plain (kernels=torch or the C++ kernels are unavailable)")
    assert "bf16 only" in choose_expert_layout(dense, torch.float32, "none", "auto", True, ops)[1]
    assert "without AVX512-BF16" in choose_expert_layout(dense, torch.bfloat16, "none", "auto", True,
                                                          lambda int8: False)[1]
    with pytest.raises(ConfigError, match="expert_layout=interleaved is not possible here"):
        choose_expert_layout(dense, torch.bfloat16, "none", "interleaved", False, ops)


def test_store_options() -> None:
    opts = store_options(EngineSettings(prefetch="auto"), 10, 3)
    assert (opts.policy, opts.host_capacity, opts.prefetch, opts.prefetch_auto) == ("lfru", 3, True, True)
    with pytest.raises(ConfigError, match="unknown cache_policy 'lfr'"):
        store_options(EngineSettings(cache_policy="lfr"), 10, 0)
    with pytest.raises(ConfigError, match="set cache_trace=FILE"):
        store_options(EngineSettings(cache_policy="static"), 10, 0)


def test_kv_cache_line() -> None:
    groups = kv_groups([None] * 2, RecurrentState(conv_shape=(3, 8), state_shape=(2, 4, 4), prefill_chunk=64),
                       recurrent_layers=[0])
    line = kv_cache_line("2 blocks", torch.bfloat16, False, groups, True)
    assert line.startswith("paged: 2 blocks (bfloat16); prefix caching off (") and "layers: a state is valid" in line
    assert kv_cache_line("2 blocks", torch.bfloat16, True, groups[1:], True).endswith("prefix caching on")


# ------------------------------------------------------------------------------------------------- the plan
def test_the_plan_of_the_demo_model() -> None:
    probe = FakeProbe()
    plan = _plan(probe, memory_gb=1.0)
    assert [name for name, _ in plan.choices] == PLAN_CHOICES
    # the kernels before the RSS (their library is in it), the RSS before the free memory is read
    assert probe.asked == ["cuda", "cores", "kernels", "runtime", "topology", "interleaved"]
    lines = dict(plan.choices)
    assert lines["threads"] == "4 (auto: all 4 usable cores)" and lines["allocator"] == "fake allocator"
    assert lines["memory budget"].startswith("1.00 GiB (memory_gb=1, set)")
    assert (plan.device, plan.dtype, plan.threads, plan.cpp_kernels) == (torch.device("cpu"), torch.bfloat16, 4, True)
    assert plan.max_model_len == 512 and plan.expert_capacity == plan.needs.total_experts == 32
    assert plan.load_bytes == plan.needs.resident_bytes + 32 * plan.needs.unit_nbytes  # all experts resident
    assert sum(n * b for n, b in zip(plan.kv_blocks, plan.block_bytes)) <= plan.kv_bytes
    assert "rows interleaved" in plan.expert_plan.description and plan.kv_choices == ()
    options = plan.model_options
    assert options.numerics == plan.numerics and options.numerics.cpp and options.decode_step == "auto"


def test_settings_reach_the_plan() -> None:
    plan = _plan(FakeProbe(cpp=False), kernels="torch", quantization="int8", max_num_seqs=2, expert_cache_gb=0.001,
                 max_model_len=128, decode_step="per_op")
    assert not plan.cpp_kernels and not plan.numerics.cpp and plan.dense_int8 and plan.decode_step == "per_op"
    assert plan.max_model_len == 128 and plan.expert_capacity < plan.needs.total_experts
    assert plan.load_bytes == plan.needs.resident_bytes  # offloaded: only the resident weights are read at load
    assert "int8" in dict(plan.choices)["experts"] and plan.expert_plan.layout.nbytes == plan.needs.unit_nbytes
    assert dict(plan.choices)["expert layout"].startswith("plain (kernels=torch")


def test_refusals_come_from_the_plan() -> None:
    with pytest.raises(ConfigError, match="device=cuda but no CUDA device"):
        _plan(device="cuda")
    told: list[tuple[str, str]] = []
    with pytest.raises(ConfigError, match="does not fit"):
        _plan(told=lambda name, line: told.append((name, line)), memory_gb=0.1)
    assert [name for name, _ in told] == PLAN_CHOICES[:6]  # each told as made: the log has them before the error
    told.clear()
    plan = _plan(told=lambda name, line: told.append((name, line)))
    assert tuple(told) == plan.choices


def test_a_config_only_checkpoint_plans_alike() -> None:
    """From config.json alone the same plan: the same choices, sizes and groups (models/config_only.py)."""
    full = _plan(memory_gb=1.0, expert_cache_gb=0.005)
    bare = _plan(path=demo_model_path() / "config.json", memory_gb=1.0, expert_cache_gb=0.005)
    assert bare.choices == full.choices and bare.needs == full.needs and bare.kv_blocks == full.kv_blocks
    spec = read_model(open_checkpoint(str(demo_model_path())))[1]
    shape = [[(g.kind.name, g.layers) for g in groups] for groups in
             (bare.kv_groups, full.kv_groups, spec_kv_groups(spec, bare.prefix_snapshots))]
    assert shape[0] == shape[1] == shape[2]


def test_the_planning_probe_loads_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """`moeserve plan`'s probe: the stated runtime for the serving process's RSS, the kernels assumed, not loaded."""
    from moeserve import kernels
    from moeserve.memory.plan import RUNTIME_OVERHEAD_BYTES

    def no_load() -> None:
        raise AssertionError("moeserve plan loaded the C++ kernels")

    monkeypatch.setattr(kernels, "load", no_load)
    probe = PlanningProbe()
    assert probe.kernels("auto", "cpu", "auto")[0] and not probe.kernels("torch", "cpu", "auto")[0]
    assert not probe.kernels("auto", "cuda", "auto")[0] and probe.runtime_bytes() == RUNTIME_OVERHEAD_BYTES
    plan = _plan(probe, memory_gb=2.0)
    assert plan.needs.process_bytes == RUNTIME_OVERHEAD_BYTES and plan.cpp_kernels
