"""`moeserve inspect MODEL`: what a checkpoint holds, without loading any weights.

Without weights (a config.json file, or a folder holding only config.json: models/config_only.py), the same
report from config.json and the architecture spec. Architecture, parameter counts, bytes of expert vs non-expert weights, bytes read per decoded token, and the
storage formats found (dtype of each tensor group, and the quantization scheme from config.json).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import Any

from moeserve.cli.common import add_model_argument

GiB = 1024**3


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="describe a checkpoint: architecture, sizes, bytes per token, formats")
    add_model_argument(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def inspect_checkpoint(model: str | None) -> dict[str, Any]:
    """The report as a dict (used by tests and --json). Reads config files and shard headers only."""
    import torch

    from moeserve.engine.llm_engine import demo_model_path
    from moeserve.models.config_only import expert_parameters, open_for_sizing, parameter_counts
    from moeserve.models.experts.plans import expert_plan
    from moeserve.models.inventory import describe_formats, expert_tensor_names, not_loaded
    from moeserve.models.validate import read_model

    opened = open_for_sizing(model or str(demo_model_path()))
    arch, spec = read_model(opened)
    # what the engine never loads (a vision tower, MTP layers, activation scales) is counted apart from the served weights
    unserved = {n: opened.tensors[n] for n in not_loaded(opened, arch, spec)}
    ckpt = replace(opened, tensors={n: r for n, r in opened.tensors.items() if n not in unserved})
    plan = expert_plan(ckpt, arch, spec, torch.bfloat16)  # the dtype only matters for unquantized units
    experts = expert_tensor_names(plan)
    expert_bytes = sum(ref.nbytes for name, ref in ckpt.tensors.items() if name in experts)
    other_bytes = sum(ref.nbytes for name, ref in ckpt.tensors.items() if name not in experts)
    report = describe_formats(ckpt)
    num_moe = len(spec.moe_layer_ids)
    counts = parameter_counts(arch, spec)
    return {
        "path": str(ckpt.path),
        "architecture": spec.architecture,
        "layers": spec.num_layers,
        "moe_layers": num_moe,
        "experts_per_layer": spec.moe.num_experts,
        "experts_per_token": spec.moe.top_k,
        "params_expert": expert_parameters(arch, spec),
        "params_non_expert": sum(r.numel for n, r in ckpt.tensors.items() if n not in experts),
        "params_total": counts.total,
        "params_active": counts.active,
        "params_active_without_embedding": counts.active_without_embedding,
        "params_ngram_table": counts.ngram_table,
        "bytes_expert": expert_bytes,
        "bytes_non_expert": other_bytes,
        "bytes_per_expert": report.expert_stored_bytes,
        "bytes_read_per_token": report.bytes_per_token,
        "quantization": report.scheme,
        "not_served": {"tensors": len(unserved), "bytes": sum(r.nbytes for r in unserved.values())},
        "formats": [{"group": g.group, "format": g.format, "tensors": g.tensors, "bytes": g.stored_bytes}
                    for g in report.groups],
    }


def run(args: argparse.Namespace) -> int:
    report = inspect_checkpoint(args.model)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    r = report
    print(f"model:            {r['path']}")
    print(f"architecture:     {r['architecture']} ({r['layers']} layers, {r['moe_layers']} MoE)")
    print(f"experts:          {r['experts_per_layer']} per layer, {r['experts_per_token']} per token, "
          f"{r['params_expert'] / 1e6:.2f} M expert parameters")
    print(f"other parameters: {r['params_non_expert'] / 1e6:.2f} M (stored elements)")
    print(f"parameters:       {r['params_total'] / 1e9:.2f} B total, {r['params_active'] / 1e9:.2f} B active per token "
          f"({r['params_active_without_embedding'] / 1e9:.2f} B without the embedding table)")
    if r["params_ngram_table"]:
        print(f"n-gram tables:    {r['params_ngram_table'] / 1e9:.2f} B parameters of the total (the per-layer "
              f"embedding: one row per head read per token); {(r['params_total'] - r['params_ngram_table']) / 1e9:.2f}"
              " B without them")
    print(f"expert weights:   {r['bytes_expert'] / GiB:.3f} GiB stored ({r['bytes_per_expert'] / 2**20:.3f} MiB "
          "per expert)")
    print(f"other weights:    {r['bytes_non_expert'] / GiB:.3f} GiB stored (resident)")
    print(f"read per token:   {r['bytes_read_per_token'] / 2**20:.2f} MiB in stored format "
          "(non-expert weights + top-k experts per MoE layer)")
    if r["not_served"]["tensors"]:
        print(f"not served:       {r['not_served']['tensors']} tensors, {r['not_served']['bytes'] / GiB:.3f} GiB stored "
              "(a vision tower, MTP layers, activation scales: never loaded)")
    print(f"quantization:     {r['quantization']}")
    print("formats (tensor group: format, tensors, stored size):")
    for g in r["formats"]:
        print(f"  {g['group']}: {g['format']}, {g['tensors']}, {g['bytes'] / 2**20:.2f} MiB")
    return 0
