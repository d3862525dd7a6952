"""`moeserve plan MODEL [--memory-gb N] [engine settings]`: will it fit, how, and how fast can it go? Loads no weights.

Reads config.json and the shard headers (or config.json alone: models/config_only.py) and sizes every tier (the engine setting memory_gb: --memory-gb,
MOESERVE_MEMORY_GB; default free memory less headroom; host_cache_gb; unified_memory) with memory/sizing.py
`size_tiers`, the function the engine calls at start-up, printing the same "name: value" lines the engine logs.
The runtime part is RUNTIME_OVERHEAD_BYTES (plan is not the serving process, which measures its own RSS) plus one
step's activations. Then it probes RAM and disk bandwidth for a fraction of a second (skip with --no-probe), and
host -> GPU copies on a discrete GPU (pageable where pinning is unavailable, said so), and prints the decode speed
ceilings that follow.
Refuses (exit 1, one line) what the engine would refuse: a budget the parts cannot fit in.
"""

from __future__ import annotations

import argparse

import torch

from moeserve.cli.common import add_engine_arguments, add_model_argument, engine_settings
from moeserve.config import EngineSettings
from moeserve.memory.plan import RUNTIME_OVERHEAD_BYTES, MemoryPlan, ModelFootprint, decode_ceiling, make_plan
from moeserve.memory.split import MemoryNeeds

MiB = 2**20


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="print the memory plan and speed ceilings of a model (loads nothing)")
    add_model_argument(p)
    p.add_argument("--no-probe", action="store_true", help="skip the RAM/disk bandwidth probes")
    add_engine_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moeserve.engine.llm_engine import DTYPES, demo_model_path
    from moeserve.engine.sizing import spec_kv_groups
    from moeserve.memory.topology import detect_topology
    from moeserve.models.config_only import has_weights, open_for_sizing
    from moeserve.models.mixers.mla import kv_per_token_line
    from moeserve.models.validate import read_model
    from moeserve.state.kv_cache import prefix_snapshots

    s = engine_settings(args, config_file_ok=True)
    ckpt = open_for_sizing(s.model or str(demo_model_path()))
    arch, spec = read_model(ckpt)
    device = torch.device("cuda" if s.device == "cuda" or (s.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    footprint, dtype_name, expert_refs = _footprint(ckpt, arch, spec, s)
    topology = detect_topology(device, s.unified_memory)
    needs = _needs(spec, s, dtype_name, footprint)
    plan = make_plan(footprint, needs, topology, s)
    print(f"model: {ckpt.path} ({spec.architecture}), dtype {dtype_name}, device {device.type}")
    if not has_weights(ckpt):
        print("weights: none here; sized from config.json and the architecture spec (moeserve/models/config_only.py)")
    for name, line in plan.sizes.lines:  # the very lines the engine logs at start-up (memory/sizing.py)
        print(f"{name}: {line}")
    kv_line = kv_per_token_line(spec, DTYPES[dtype_name].itemsize)  # latent attention: what its cache saves
    if kv_line is not None:
        print(f"KV per token: {kv_line}")
    recurrent = any(not g.kind.holds_token_blocks for g in spec_kv_groups(spec))
    snapshots = prefix_snapshots(s.max_num_seqs, s.enable_prefix_caching) if recurrent else 0
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
    for line in _sizes(plan):
        print(line)
    fast_bw = host_bw = disk_bw = None
    if not args.no_probe:
        from moeserve.memory.probes import host_to_device_bandwidth, ram_copy_bandwidth, tensor_read_bandwidth

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
    for line in _ceilings(plan, fast_bw, host_bw, disk_bw, device.type):
        print(line)
    ckpt.close()
    return 0


def _needs(spec, s: EngineSettings, dtype_name: str, f: ModelFootprint) -> MemoryNeeds:  # noqa: ANN001
    """MemoryNeeds as the engine computes them, with RUNTIME_OVERHEAD_BYTES for the serving process's RSS."""
    from moeserve.engine.llm_engine import DEFAULT_MAX_NUM_BATCHED_TOKENS, DTYPES
    from moeserve.engine.sizing import memory_needs

    batched = s.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, s.max_num_seqs)
    return memory_needs(spec, s, DTYPES[dtype_name], f.resident_bytes, f.unit_nbytes, f.total_experts, batched,
                        RUNTIME_OVERHEAD_BYTES)


def _footprint(ckpt, arch, spec, s: EngineSettings):  # noqa: ANN001, ANN202 - internal glue
    """(ModelFootprint, dtype name, expert TensorRefs) as the engine would choose them."""
    from moeserve.engine.llm_engine import _CODE_TO_NAME, DTYPES
    from moeserve.models.experts.plans import expert_plan, int8_expert_plan
    from moeserve.models.inventory import resident_nbytes

    dtype_name: str
    if s.dtype != "auto":
        dtype_name = s.dtype
    elif spec.config_dtype in DTYPES:
        dtype_name = str(spec.config_dtype)
    else:
        dtype_name = _CODE_TO_NAME.get(ckpt.stored_dtype(), "bfloat16")
    dtype = DTYPES[dtype_name]
    plan = expert_plan(ckpt, arch, spec, dtype)
    if s.quantization == "int8":  # as the engine holds them: int8 codes + scales in the fast tier
        plan = int8_expert_plan(plan, dtype)
    refs = [r for fs in plan.sources.values() for f in fs for r in f.refs]
    # Stacked expert tensors (gpt-oss) and quantized dense Linears counted as the engine counts them.
    nonexpert = resident_nbytes(ckpt, plan, dtype)
    first = next(iter(plan.sources.values()))
    footprint = ModelFootprint(
        resident_bytes=nonexpert,
        embed_bytes=spec.vocab_size * spec.hidden_size * dtype.itemsize,
        hidden_bytes=spec.hidden_size * dtype.itemsize,
        unit_nbytes=plan.layout.nbytes,
        stored_unit_nbytes=sum(r.nbytes for f in first for r in f.refs),
        num_moe_layers=len(spec.moe_layer_ids),
        num_experts=spec.moe.num_experts,
        top_k=spec.moe.top_k,
    )
    return footprint, dtype_name, refs


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
