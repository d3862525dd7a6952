"""`moeserve plan MODEL [--memory-gb N] [engine settings]`: will it fit, how, and how fast can it go? Loads no weights.

Reads config.json and the shard headers (or config.json alone: models/config_only.py) and makes the engine's own
start-up plan (engine/plan.py `make_engine_plan`; every tier sized by memory/sizing.py `size_tiers` from the engine
setting memory_gb: --memory-gb, MOESERVE_MEMORY_GB; default free memory less headroom; host_cache_gb;
unified_memory), printing from it the same "name: value" lines the engine logs. The runtime part is
RUNTIME_OVERHEAD_BYTES (plan is not the serving process, which measures its own RSS: `PlanningProbe`) plus one
step's activations. Then it probes RAM and disk bandwidth for a fraction of a second (skip with --no-probe), and
host -> GPU copies on a discrete GPU (pageable where pinning is unavailable, said so), and prints the decode speed
ceilings that follow.
Refuses (exit 1, one line) what the engine's plan refuses: a setting that cannot apply, a budget the parts cannot
fit in.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from moeserve.cli.common import add_engine_arguments, add_model_argument, engine_settings
from moeserve.config import EngineSettings
from moeserve.memory.plan import RUNTIME_OVERHEAD_BYTES, MemoryPlan, ModelFootprint, decode_ceiling
from moeserve.models.ngram_table import table_units

if TYPE_CHECKING:
    from moeserve.checkpoint.folder import Checkpoint
    from moeserve.engine.plan import EnginePlan
    from moeserve.models.spec import ModelSpec

MiB = 2**20


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="print the memory plan and speed ceilings of a model (loads nothing)")
    add_model_argument(p)
    p.add_argument("--no-probe", action="store_true", help="skip the RAM/disk bandwidth probes")
    p.add_argument("--ep-budgets", default=None, metavar="GB,GB,...",
                   help="expert parallelism: each rank's memory_gb, the head's first (e.g. 20,60,60): print which "
                   "experts each rank owns (--ep-ownership) and what it holds, instead of the one-process plan")
    add_engine_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moeserve.engine.llm_engine import demo_model_path
    from moeserve.engine.plan import PlanningProbe, make_engine_plan
    from moeserve.models.config_only import open_for_sizing
    from moeserve.models.validate import read_model

    s = engine_settings(args, config_file_ok=True)
    ckpt = open_for_sizing(s.model or str(demo_model_path()))
    try:
        arch, spec = read_model(ckpt)
        if args.ep_budgets is not None:
            _print_ep_plan(ckpt, arch, spec, s, _budgets(args.ep_budgets))
            return 0
        plan = make_engine_plan(ckpt, arch, spec, s, PlanningProbe())  # the engine's own plan, from shapes alone
        memory = MemoryPlan(_footprint(plan, spec), plan.sizes)
        _print_plan(plan, memory, ckpt, spec, s)
        fast_bw = host_bw = disk_bw = None
        if not args.no_probe:
            fast_bw, host_bw, disk_bw = _bandwidths(plan, ckpt)
        for line in _ceilings(memory, fast_bw, host_bw, disk_bw, plan.device.type):
            print(line)
    finally:
        ckpt.close()
    return 0


def _print_plan(plan: EnginePlan, memory: MemoryPlan, ckpt: Checkpoint, spec: ModelSpec, s: EngineSettings) -> None:
    """The sizes of `plan`: the lines the engine logs at start-up, then the sequence state, runtime and experts."""
    from moeserve.models.config_only import has_weights

    print(f"model: {ckpt.path} ({spec.architecture}), dtype {plan.dtype_name}, device {plan.device.type}")
    if not has_weights(ckpt):
        print("weights: none here; sized from config.json and the architecture spec (moeserve/models/config_only.py)")
    for name, line in plan.sizes.lines:  # the very lines the engine logs at start-up (memory/sizing.py)
        print(f"{name}: {line}")
    tables = dict(plan.choices).get("n-gram tables")  # Qwen3.8-Flash-Next's PLE tables: the units held
    if tables is not None:
        print(f"n-gram tables: {tables}")
    kv_line = dict(plan.kv_choices).get("KV per token")  # latent attention: what its cache saves
    if kv_line is not None:
        print(f"KV per token: {kv_line}")
    needs = plan.needs
    recurrent = any(not g.kind.holds_token_blocks for g in plan.kv_groups)
    snapshots = plan.prefix_snapshots if recurrent else 0
    with_snapshots = f" and {snapshots} recurrent-state prefix snapshots" if snapshots else ""
    print(f"sequence state: {needs.kv_bytes_per_token} bytes/token in the full-attention (or latent) layers' cache; "
          f"{needs.kv_fixed_bytes / MiB:.1f} MiB fixed for {s.max_num_seqs} sequences whatever their length"
          f"{with_snapshots} (sliding-window and recurrent layers)")
    acts = f"{needs.overhead_bytes / MiB:.1f} MiB for one step's activations and the rotary tables (from shapes)"
    if s.memory_gb is not None:
        print(f"runtime: {RUNTIME_OVERHEAD_BYTES / MiB:.0f} MiB stated for the serving process's RSS at start-up "
              f"(plan is not that process; the engine measures its own) + {acts}")
    else:  # a budget derived from free memory: the process's own RSS is outside it (memory/split.py)
        print(f"runtime: {acts}; the serving process's own RSS is outside free memory, not charged")
    for line in _sizes(memory):
        print(line)


def _bandwidths(plan: EnginePlan, ckpt: Checkpoint) -> tuple[float | None, float | None, float | None]:
    """Probe RAM, disk (the checkpoint's own expert tensors) and host -> GPU copies; print them and return (fast
    tier, host tier, disk) bytes/s, None where not measured."""
    from moeserve.memory.probes import host_to_device_bandwidth, ram_copy_bandwidth, tensor_read_bandwidth
    from moeserve.models.config_only import has_weights

    device, topology = plan.device, plan.sizes.topology
    expert_refs = [r for fs in plan.expert_plan.sources.values() for f in fs for r in f.refs]
    host_bw = None
    ram = ram_copy_bandwidth()
    disk = tensor_read_bandwidth(expert_refs if has_weights(ckpt) else [])  # no weights: no disk to probe
    fast_bw = ram.bytes_per_s if device.type == "cpu" or topology.unified else None
    disk_bw = disk.bytes_per_s if disk is not None else None
    h2d = None
    if device.type == "cuda" and not topology.unified:  # pragma: no cover - needs a GPU
        from moeserve.memory.device import CudaOps

        h2d = host_to_device_bandwidth(CudaOps(device), device)
        host_bw = h2d.bytes_per_s
    print(f"bandwidth: RAM copy {ram.gb_per_s:.1f} GB/s"
          + (f"; disk read {disk.gb_per_s:.2f} GB/s (cold, {disk.nbytes / MiB:.0f} MiB{_note(disk.note)})"
             if disk is not None else "")
          + (f"; host->GPU {h2d.gb_per_s:.1f} GB/s{_note(h2d.note)}" if h2d is not None else ""))
    return fast_bw, host_bw, disk_bw


def _ngram_held_bytes(plan: EnginePlan, spec: ModelSpec) -> int:
    """Bytes of the n-gram tables' units held in memory (0 without them)."""
    if spec.ngram is None:
        return 0
    units, unit_nbytes, table_bytes = table_units(spec, plan.dtype)
    return table_bytes if plan.ngram_capacity is None else plan.ngram_capacity * unit_nbytes


def _footprint(plan: EnginePlan, spec: ModelSpec) -> ModelFootprint:
    """The model's sizes in the plan's compute dtype, as the engine holds it (experts int8 under
    quantization=int8; stacked expert tensors and quantized dense Linears counted as the engine counts them)."""
    itemsize = plan.dtype.itemsize
    first = next(iter(plan.expert_plan.sources.values()))
    return ModelFootprint(
        resident_bytes=plan.needs.resident_bytes,
        # the embedding and the n-gram tables held: a token reads a few rows of them, not all
        embed_bytes=spec.vocab_size * spec.hidden_size * itemsize + _ngram_held_bytes(plan, spec),
        hidden_bytes=spec.hidden_size * itemsize,
        unit_nbytes=plan.needs.unit_nbytes,
        stored_unit_nbytes=sum(r.nbytes for f in first for r in f.refs),
        num_moe_layers=len(spec.moe_layer_ids),
        num_experts=spec.moe.num_experts,
        top_k=spec.moe.top_k,
    )


def _sizes(plan: MemoryPlan) -> list[str]:
    f = plan.footprint
    return [
        f"experts: {f.total_experts * f.unit_nbytes / MiB:.1f} MiB in all ({f.num_moe_layers} MoE layers x "
        f"{f.num_experts} experts of {f.unit_nbytes / MiB:.2f} MiB; top-{f.top_k} per token); the fast tier holds "
        f"{plan.capacity} = {plan.experts_per_layer:.1f} per layer of {f.num_experts}",
        f"bytes per token: fast tier {plan.fast_bytes_per_token / MiB:.1f} MiB; worst case from host "
        f"{plan.worst_host_bytes_per_token / MiB:.1f} MiB, from disk {plan.worst_disk_bytes_per_token / MiB:.1f} MiB",
    ]


def _ceilings(plan: MemoryPlan, fast_bw: float | None, host_bw: float | None, disk_bw: float | None,
              device_type: str) -> list[str]:
    def fmt(x: float | None) -> str:
        return "not measured" if x is None else f"{x:.1f} tok/s"

    hit = plan.uniform_hit_rate
    all_hits = decode_ceiling(plan, fast_bw, host_bw, disk_bw, 0.0)
    uniform = decode_ceiling(plan, fast_bw, host_bw, disk_bw, 1.0 - hit)
    worst = decode_ceiling(plan, fast_bw, host_bw, disk_bw, 1.0)
    lines = [f"decode ceiling (batch 1): every expert a hit {fmt(all_hits)}; uniform routing "
             f"(hit rate {100 * hit:.0f}%) {fmt(uniform)}; every expert missed {fmt(worst)}"]
    if fast_bw is None and device_type == "cuda":
        lines.append("  (GPU memory bandwidth is not probed: the ceilings need it)")
    return lines


def _note(note: str) -> str:
    return f"; {note}" if note else ""


def _budgets(text: str) -> list[float]:
    from moeserve.errors import ConfigError

    try:
        budgets = [float(part) for part in text.split(",")]
    except ValueError:
        budgets = []
    if len(budgets) < 2 or any(b <= 0 for b in budgets):
        raise ConfigError(f"--ep-budgets {text!r}: expected two or more positive GiB figures, the head's first "
                          "(e.g. 20,60,60)")
    return budgets


def _print_ep_plan(ckpt: Checkpoint, arch: object, spec: ModelSpec, s: EngineSettings, budgets: list[float]) -> None:
    """Expert parallelism's placement from shapes alone: who owns which experts, each rank's bytes of experts and
    how many of them its store holds (the head: the engine's plan for its share; a worker: engine/ep.py's sizing),
    and the activations a token sends per MoE layer."""
    from moeserve.engine.ep import worker_capacity
    from moeserve.engine.plan import PlanningProbe, make_engine_plan
    from moeserve.errors import ConfigError
    from moeserve.parallel.ownership import assign_experts, describe_ownership, owned

    layers, experts = len(spec.moe_layer_ids), spec.moe.num_experts
    try:
        owners = assign_experts(experts, budgets, s.ep_ownership)
    except ValueError as err:
        raise ConfigError(f"--ep-budgets: {err}") from None
    held = layers * len(owned(owners, 0))
    head = make_engine_plan(ckpt, arch, spec, s.model_copy(update={"memory_gb": budgets[0]}),  # type: ignore[arg-type]
                            PlanningProbe(), experts_held=held)
    unit = head.needs.unit_nbytes
    print(f"model: {ckpt.path} ({spec.architecture}), dtype {head.dtype_name}: {layers} MoE layers x {experts} "
          f"experts of {unit / MiB:.2f} MiB ({layers * experts * unit / 2**30:.2f} GiB), top-{spec.moe.top_k}")
    for rank, line in enumerate(describe_ownership(owners, budgets, s.ep_ownership)):
        total = layers * len(owned(owners, rank))
        cap = head.expert_capacity if rank == 0 else worker_capacity(budgets[rank], RUNTIME_OVERHEAD_BYTES, unit,
                                                                      total, spec, s, head.dtype)
        where = "all resident" if cap >= total else f"{cap} in memory, the rest read from its disk on a miss"
        print(f"{line}: {total * unit / 2**30:.2f} GiB of experts; {where}")
    row = spec.hidden_size * head.dtype.itemsize
    print(f"exchange per token per MoE layer: at most {(len(budgets) - 1) * row / 1024:.1f} KiB of activations out "
          f"(one row to each other rank) and {spec.moe.top_k * row / 1024:.1f} KiB back (a row per remote expert, "
          f"fewer where a rank leads a token's experts), vs {unit / MiB:.2f} MiB to move one expert")
