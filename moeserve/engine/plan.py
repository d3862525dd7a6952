"""One start-up plan: every choice the engine makes before it allocates anything, made once by `make_engine_plan`.

    settings + checkpoint header (or config.json alone) + StartupProbe  ->  EnginePlan (frozen)
        device, dtype, threads, kernels, numerics, max_num_batched_tokens, KV groups and block sizes,
        memory split (memory/sizing.py size_tiers), expert plan and layout, store options, KV pool blocks,
        and the (name, line) of each choice, in the order the start-up log prints them

`LLMEngine.__init__` builds what the plan says (model, KV cache, scheduler) and logs `plan.choices`;
`moeserve plan` (cli/plan.py) calls the same function, on a config-only checkpoint too, and prints from it. Each
choice is a pure function of engine/choices.py; what the plan reads from the machine and the process comes through
a `StartupProbe`, asked in a fixed order: the engine's loads the C++ kernels and measures this process's RSS,
`moeserve plan`'s states what a planning process cannot measure. Nothing here reads a weight.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from moeserve import kernels
from moeserve.checkpoint.folder import Checkpoint
from moeserve.config import EngineSettings
from moeserve.engine.choices import (
    check_max_model_len,
    check_prefill_step,
    choose_batched_tokens,
    choose_device,
    choose_dtype,
    choose_expert_layout,
    choose_ngram_cache,
    choose_threads,
    dtype_name,
    kernels_line,
    least_batched_tokens,
    store_options,
)
from moeserve.engine.sizing import memory_needs, size_for_context, spec_kv_groups
from moeserve.experts.placement import Costs
from moeserve.experts.spill import default_spill_root
from moeserve.experts.store import StoreOptions
from moeserve.memory.device import CudaOps
from moeserve.memory.plan import RUNTIME_OVERHEAD_BYTES
from moeserve.memory.probes import (
    device_read_bandwidth,
    host_to_device_bandwidth,
    matmul_flops,
    memory_bandwidth,
)
from moeserve.memory.sizing import TierSizes, size_tiers
from moeserve.memory.split import MemoryNeeds, process_rss_bytes
from moeserve.memory.topology import MemoryTopology, detect_topology
from moeserve.models.experts.on_load import int4_expert_plan, int8_expert_plan
from moeserve.models.experts.plans import ExpertPlan, expert_plan, interleaved_expert_plan
from moeserve.models.inventory import resident_nbytes
from moeserve.models.mixers.mla import kv_per_token_line
from moeserve.models.model import ModelOptions
from moeserve.models.ngram_table import table_units
from moeserve.models.numerics import Numerics, choose_numerics
from moeserve.models.registry import Architecture
from moeserve.models.spec import ModelSpec
from moeserve.state.kv_cache import KVGroup, group_block_bytes, prefix_snapshots, size_pools, snapshot_line

T = TypeVar("T")


class StartupProbe:
    """What start-up reads from this machine and process (the serving process's: it loads the C++ kernels and
    measures its own RSS). `make_engine_plan` asks in this order: CUDA, cores, kernels, RSS, topology, the
    interleaved op; the kernels come before the RSS because their library is part of it. `allocator`: the line of
    what was done to the allocator before anything else was loaded (memory/rss.py fix_mmap_threshold)."""

    def __init__(self, allocator: str) -> None:
        self.allocator = allocator
        self.kernel_seconds = 0.0  # how long choosing the kernels took (a first build takes minutes)

    def cuda_available(self) -> bool:
        return torch.cuda.is_available()

    def usable_cores(self) -> int:
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

    def kernels(self, want: str, device_type: str, isa: str) -> tuple[bool, str]:
        """kernels.choose: (use the C++ ops, reason), building (for `isa`) and loading them where they apply."""
        t0 = time.monotonic()
        try:
            return kernels.choose(want, device_type, isa)
        finally:
            self.kernel_seconds = time.monotonic() - t0

    def placement_costs(self, device: torch.device) -> Costs | None:
        """The hybrid placement's costs (experts/placement.py), measured now on `device` and the host (~1 s); None
        on a CPU (nothing to place)."""
        if device.type != "cuda":
            return None
        h2d = host_to_device_bandwidth(CudaOps(device), device)
        return Costs(h2d.bytes_per_s, memory_bandwidth(256 * 2**20, 3), device_read_bandwidth(device),
                     matmul_flops(torch.device("cpu")), matmul_flops(device),
                     "measured at start-up" + (f"; {h2d.note}" if h2d.note else ""))

    def runtime_bytes(self) -> int:
        """What the process holds before the weights: its RSS now."""
        return process_rss_bytes()

    def topology(self, device: torch.device, unified_memory: str) -> MemoryTopology:
        return detect_topology(device, unified_memory)

    def interleaved_ops(self, int8: bool) -> bool:
        """The loaded kernels have the row-interleaved expert op (bf16, or int8 with `int8`)."""
        op = "moe_int8_interleaved_supported" if int8 else "moe_interleaved_supported"
        return bool(getattr(torch.ops.moeserve, op)())


class PlanningProbe(StartupProbe):
    """`moeserve plan`'s probe: that process is not the serving one, so it states RUNTIME_OVERHEAD_BYTES for the
    serving process's RSS, changes no allocator and loads no C++ kernels: they are taken to load where they can
    (CPU, kernels not torch), with the interleaved op; the choices they change (expert layout, numerics) size
    nothing."""

    def __init__(self) -> None:
        super().__init__("unchanged (moeserve plan is not the serving process)")

    def kernels(self, want: str, device_type: str, isa: str) -> tuple[bool, str]:
        return want != "torch" and device_type == "cpu", "assumed: moeserve plan does not load the C++ kernels"

    def runtime_bytes(self) -> int:
        return RUNTIME_OVERHEAD_BYTES

    def placement_costs(self, device: torch.device) -> Costs | None:
        return None  # not measured: moeserve plan builds no model

    def interleaved_ops(self, int8: bool) -> bool:
        return True


@dataclass(frozen=True)
class EnginePlan:
    """Everything the engine builds from, chosen before anything is allocated (see the module docstring)."""

    device: torch.device
    dtype: torch.dtype
    threads: int  # torch's compute threads
    cpp_kernels: bool  # the moeserve C++ ops are loaded and chosen
    numerics: Numerics
    numerics_reason: str  # logged by the model as "batch invariance"
    dense_int8: bool  # quantization=int8 / int4: the dense Linears as int8 (with the C++ ops)
    decode_step: str  # EngineSettings.decode_step; the model resolves auto against its built layers
    max_num_batched_tokens: int
    kv_groups: tuple[KVGroup, ...]  # the sequence-memory groups (layers of one cache kind)
    block_bytes: tuple[int, ...]  # bytes of one block of each group
    kv_blocks: tuple[int, ...]  # blocks in each group's pool (state/kv_cache.py size_pools)
    prefix_snapshots: int  # recurrent-state snapshot slots beside the running ones (0: none)
    needs: MemoryNeeds  # what the memory split divided
    sizes: TierSizes  # the fast tier's split (KV pool, expert cache, max_model_len) and the host tier
    expert_plan: ExpertPlan  # the experts as the store holds them (int8, row-interleaved)
    store_options: StoreOptions
    choices: tuple[tuple[str, str], ...]  # (name, line) of each choice, as logged, in order
    kv_choices: tuple[tuple[str, str], ...]  # lines logged after the built KV cache's own ("KV cache")
    placement: str = "auto"  # EngineSettings.placement; the model resolves it against its units (models/experts/hybrid.py)
    placement_costs: Costs | None = None  # measured when a CUDA engine is asked for placement=hybrid or cpu
    ngram_capacity: int | None = None  # n-gram table units held in memory (models/ngram_table.py); None: all

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    @property
    def max_model_len(self) -> int:
        """As set, or the model's lowered to what one sequence can hold in the KV pool (memory/split.py)."""
        return self.sizes.split.max_model_len

    @property
    def kv_bytes(self) -> int:
        return self.sizes.split.kv_bytes

    @property
    def expert_capacity(self) -> int:
        """Experts held in the fast tier."""
        return self.sizes.split.expert_capacity

    @property
    def load_bytes(self) -> int:
        """Bytes read at load: the resident weights, and the experts when all of them fit the fast tier."""
        n = self.needs
        return n.resident_bytes + (n.total_experts * n.unit_nbytes if self.expert_capacity >= n.total_experts else 0)

    @property
    def model_options(self) -> ModelOptions:
        return ModelOptions(self.numerics, self.numerics_reason, self.dense_int8, self.decode_step, self.placement,
                            self.placement_costs, ngram_capacity=self.ngram_capacity)


class _Lines:
    """The (name, line) of each choice in the order made, each told to `told` as it is made."""

    def __init__(self, told: Callable[[str, str], None]) -> None:
        self.items: list[tuple[str, str]] = []
        self.told = told

    def add(self, name: str, line: str) -> None:
        self.items.append((name, line))
        self.told(name, line)

    def take(self, name: str, choice: tuple[T, str]) -> T:
        value, line = choice
        self.add(name, line)
        return value


def make_engine_plan(ckpt: Checkpoint, arch: Architecture, spec: ModelSpec, s: EngineSettings,
                     probe: StartupProbe, told: Callable[[str, str], None] = lambda name, line: None,
                     experts_held: int | None = None) -> EnginePlan:
    """Every start-up choice for `ckpt` (a config-only checkpoint too) under settings `s`; `told(name, line)` hears
    each as it is made (the engine logs it: the lines before a refusal are logged too). Raises ConfigError, one
    line, for a setting that cannot apply or a budget the parts cannot fit in; allocates nothing. `experts_held`:
    the expert units this process holds at most (expert parallelism: its share), default all of them."""
    lines = _Lines(told)
    device = lines.take("device", choose_device(s.device, probe.cuda_available()))
    dtype = lines.take("dtype", choose_dtype(s.dtype, spec.config_dtype, ckpt.stored_dtype()))
    threads = lines.take("threads", choose_threads(s.threads, probe.usable_cores()))
    lines.add("allocator", probe.allocator)
    check_max_model_len(s.max_model_len, spec.max_position_embeddings)
    cpp, why = probe.kernels(s.kernels, device.type, s.cpu_isa)
    lines.add("kernels", kernels_line(s.kernels, cpp, why))
    batched = lines.take("max_num_batched_tokens", choose_batched_tokens(s.max_num_batched_tokens, s.max_num_seqs))
    snapshots = prefix_snapshots(s.max_num_seqs, s.enable_prefix_caching)
    groups = spec_kv_groups(spec, snapshots)
    check_prefill_step(groups, batched, s.max_num_seqs)
    a = spec.attention
    block_bytes = group_block_bytes(groups, s.block_size, a.num_kv_heads, a.head_dim, dtype)
    dense, sized = _expert_plans(ckpt, arch, spec, dtype, s)
    nonexpert = resident_nbytes(ckpt, sized, dtype)  # quantized Linears at their dequantized size
    runtime, topology = probe.runtime_bytes(), probe.topology(device, s.unified_memory)
    held_units = len(sized.sources) if experts_held is None else experts_held
    ngram_capacity, ngram_saved = _ngram_plan(spec, dtype, s, topology.fast_free_bytes, lines)
    nonexpert -= ngram_saved  # the tables' units not held

    def needs_at(context: int, tokens: int) -> MemoryNeeds:
        return memory_needs(spec, s.model_copy(update={"max_model_len": context}), dtype, groups, block_bytes,
                            nonexpert, sized.layout.nbytes, held_units, tokens, runtime)

    # every tier sized by the function memory/sizing.py gives both the engine and `moeserve plan`, the runtime
    # for the context served (engine/sizing.py)
    needs, sizes = size_for_context(
        needs_at, lambda n, ctx, chosen: size_tiers(n, topology, s, ctx, chosen), s.max_model_len,
        spec.max_position_embeddings, batched, least_batched_tokens(groups, s.max_num_seqs))
    for name, line in sizes.lines:
        lines.add(name, line)
    interleaved = lines.take("expert layout", choose_expert_layout(dense, dtype, s.quantization, s.expert_layout,
                                                                   cpp, probe.interleaved_ops))
    held = _held_plan(dense, sized, dtype, s, interleaved)  # the same bytes per unit: the split above stands
    lines.add("experts", f"{held.description} (quantization={s.quantization})")
    split = sizes.split
    options = store_options(s, split.expert_capacity, sizes.host.capacity)
    numerics, numerics_reason = choose_numerics(cpp, s.batch_invariant, dtype, device)
    kv_blocks = size_pools(groups, block_bytes, split.kv_bytes, s.block_size, s.max_num_seqs, batched,
                           split.max_model_len)
    costs = probe.placement_costs(device) if s.placement in ("hybrid", "cpu") else None
    if costs is not None:
        lines.add("placement costs", costs.describe())
    return EnginePlan(device, dtype, threads, cpp, numerics, numerics_reason, s.quantization in ("int8", "int4"),
                      s.decode_step, batched, tuple(groups), tuple(block_bytes), tuple(kv_blocks), snapshots, needs,
                      sizes, held, options, tuple(lines.items), _kv_choices(spec, dtype, groups, block_bytes, s),
                      s.placement, costs, ngram_capacity)


def _ngram_plan(spec: ModelSpec, dtype: torch.dtype, s: EngineSettings, free_bytes: int,
                lines: _Lines) -> tuple[int | None, int]:
    """(n-gram table units held, None for all; the bytes of the tables left on disk): logged as "n-gram tables"."""
    if spec.ngram is None:
        return None, 0
    units, unit_nbytes, table_bytes = table_units(spec, dtype)
    budget = int(s.memory_gb * 2**30) if s.memory_gb is not None else free_bytes
    held = lines.take("n-gram tables", choose_ngram_cache(s.ngram_cache_gb, units, unit_nbytes, budget))
    return (None, 0) if held == units else (held, table_bytes - held * unit_nbytes)


def _spill_root(s: EngineSettings) -> Path | None:
    """Where quantization=int8 / int4 keeps quantized units for an offloaded store's misses (None: quantize again)."""
    return None if s.int8_cache_dir == "off" else Path(s.int8_cache_dir or default_spill_root()).expanduser()


def _expert_plans(ckpt: Checkpoint, arch: Architecture, spec: ModelSpec, dtype: torch.dtype,
                  s: EngineSettings) -> tuple[ExpertPlan, ExpertPlan]:
    """(the checkpoint's expert plan, the plan the memory is sized with: int8 / int4 under quantization=int8 / int4)."""
    dense = expert_plan(ckpt, arch, spec, dtype)
    if s.quantization == "int4":
        return dense, int4_expert_plan(dense, dtype, _spill_root(s))
    return dense, int8_expert_plan(dense, dtype, _spill_root(s)) if s.quantization == "int8" else dense


def _held_plan(dense: ExpertPlan, sized: ExpertPlan, dtype: torch.dtype, s: EngineSettings,
               interleaved: bool) -> ExpertPlan:
    """The experts as the store holds them: `sized`, row-interleaved where the layout choice says so."""
    if not interleaved or s.quantization == "int4":
        return sized
    if s.quantization == "int8":
        return int8_expert_plan(dense, dtype, _spill_root(s), interleaved=True)
    return interleaved_expert_plan(dense)


def _kv_choices(spec: ModelSpec, dtype: torch.dtype, groups: list[KVGroup], block_bytes: list[int],
                s: EngineSettings) -> tuple[tuple[str, str], ...]:
    """The lines logged after the built KV cache's: its recurrent prefix snapshots, latent attention's bytes per
    token (each only where the model has them)."""
    lines = []
    snapshots = snapshot_line(groups, block_bytes, s.max_num_seqs, s.block_size)
    if snapshots is not None:
        lines.append(("prefix snapshots", snapshots))
    per_token = kv_per_token_line(spec, dtype.itemsize)
    if per_token is not None:
        lines.append(("KV per token", per_token))
    return tuple(lines)
