"""`moeserve inspect MODEL`: what a checkpoint holds, without loading any weights.

Architecture, parameter counts, bytes of expert vs non-expert weights, bytes read per decoded token, and the
storage formats found (dtype of each tensor group, and the quantization scheme from config.json).
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from typing import Any

from moeserve.cli.common import add_model_argument

GiB = 1024**3


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="describe a checkpoint: architecture, sizes, bytes per token, formats")
    add_model_argument(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def inspect_checkpoint(model: str) -> dict[str, Any]:
    """The report as a dict (used by tests and --json)."""
    from moeserve.checkpoint.folder import open_checkpoint
    from moeserve.engine.llm_engine import demo_model_path
    from moeserve.models.registry import get_architecture

    ckpt = open_checkpoint(model or str(demo_model_path()))
    where = str(ckpt.path / "config.json")
    arch = get_architecture(ckpt.config, where)
    spec = arch.spec(ckpt.config, where)
    expert_re = re.compile(r"\.experts\.")
    expert_bytes = expert_params = other_bytes = other_params = 0
    groups: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for name, ref in ckpt.tensors.items():
        is_expert = bool(expert_re.search(name))
        if is_expert:
            expert_bytes += ref.nbytes
            expert_params += ref.numel
        else:
            other_bytes += ref.nbytes
            other_params += ref.numel
        group = re.sub(r"\.\d+\.", ".N.", name)
        group = re.sub(r"\.\d+\.", ".N.", group)
        groups[group][ref.dtype_code] += ref.nbytes
    num_moe = len(spec.moe_layer_ids)
    total_experts = num_moe * spec.moe.num_experts
    per_expert = expert_bytes // max(total_experts, 1)
    embed_bytes = ckpt.tensors[arch.names.embed].nbytes if arch.names.embed in ckpt.tensors else 0
    # One decoded token reads every non-expert weight except the embedding table (one row of it), plus top_k
    # experts in each MoE layer.
    row = embed_bytes // max(spec.vocab_size, 1)
    per_token = other_bytes - embed_bytes + row + num_moe * spec.moe.top_k * per_expert
    quant = ckpt.config.get("quantization_config")
    return {
        "path": str(ckpt.path),
        "architecture": spec.architecture,
        "layers": spec.num_layers,
        "moe_layers": num_moe,
        "experts_per_layer": spec.moe.num_experts,
        "experts_per_token": spec.moe.top_k,
        "params_total": expert_params + other_params,
        "params_expert": expert_params,
        "params_active_per_token": other_params + num_moe * spec.moe.top_k * expert_params // max(total_experts, 1),
        "bytes_expert": expert_bytes,
        "bytes_non_expert": other_bytes,
        "bytes_per_expert": per_expert,
        "bytes_read_per_token": per_token,
        "quantization": quant.get("quant_method") if isinstance(quant, dict) else None,
        "formats": {g: dict(d) for g, d in sorted(groups.items())},
    }


def run(args: argparse.Namespace) -> int:
    report = inspect_checkpoint(args.model)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    r = report
    print(f"model:            {r['path']}")
    print(f"architecture:     {r['architecture']} ({r['layers']} layers, {r['moe_layers']} MoE)")
    print(f"experts:          {r['experts_per_layer']} per layer, {r['experts_per_token']} per token")
    print(f"parameters:       {r['params_total'] / 1e6:.2f} M total, {r['params_expert'] / 1e6:.2f} M in experts, "
          f"{r['params_active_per_token'] / 1e6:.2f} M active per token")
    print(f"expert weights:   {r['bytes_expert'] / GiB:.3f} GiB ({r['bytes_per_expert'] / 2**20:.3f} MiB each)")
    print(f"other weights:    {r['bytes_non_expert'] / GiB:.3f} GiB (resident)")
    print(f"read per token:   {r['bytes_read_per_token'] / 2**20:.2f} MiB (stored format)")
    print(f"quantization:     {r['quantization'] or 'none'}")
    print("formats (tensor group: dtype bytes):")
    for group, dtypes in r["formats"].items():
        desc = ", ".join(f"{code} {n / 2**20:.2f} MiB" for code, n in dtypes.items())
        print(f"  {group}: {desc}")
    return 0
