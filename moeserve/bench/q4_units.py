"""Expert units in a stored 4-bit format, built as the expert plans build them (one byte buffer per expert, its
fields at a UnitLayout's offsets, fused_spec.q4_units saying where the C++ 4-bit op finds them): for the kernel
tests (tests/kernels/q4_cases.py) and research/bench_q4_experts.py, which need units without a checkpoint."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moeserve.experts.unit import UnitLayout
from moeserve.formats import Format
from moeserve.models.experts.fused_spec import Activation, q4_units
from moeserve.models.experts.unit_math import FusedUnits, Projection, Shard

# A stored weight: role -> tensor (e.g. {"blocks": ..., "scales": ...}).
Stored = dict[str, torch.Tensor]


@dataclass(frozen=True)
class ProjectionShape:
    """One projection of the expert: its dense [rows, cols], the stored weights its rows split into (Qwen's gate
    and up: 2), and whether it has a bf16 bias [rows] (gpt-oss)."""

    rows: int
    cols: int
    shards: int = 1
    bias: bool = False


@dataclass(frozen=True)
class Units:
    """Each expert's unit bytes, the layout of their fields and where the C++ op finds them."""

    unit_bytes: list[torch.Tensor]
    layout: UnitLayout
    fused: FusedUnits

    def views(self, e: int) -> tuple[torch.Tensor, ...]:
        """Expert e's field views (what the expert store lends)."""
        return self.layout.views(self.unit_bytes[e])

    def op_args(self, experts: Sequence[int]) -> tuple[list[torch.Tensor], list[torch.Tensor], str]:
        """(gate_up tensors, down tensors, spec) of moe_q4_experts_ for `experts`."""
        views = [self.views(e) for e in experts]
        spec = self.fused.spec
        assert spec is not None
        return [v[self.fused.gate_up] for v in views], [v[self.fused.down] for v in views], spec


def assemble(fmt: Format, shapes: Sequence[ProjectionShape], stored: Sequence[Sequence[Stored]],
             biases: Sequence[Sequence[torch.Tensor | None]], act: Activation, int8_activations: bool = False) -> Units:
    """Units of len(stored) experts: stored[e] holds expert e's weights (every shard of every projection, in
    order), biases[e] one bf16 bias or None per projection. Raises ValueError where the op cannot read them.
    `int8_activations`: INT4 units for the int4-q8 op (fused_spec.q4_units)."""
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    projections = []
    first = stored[0]
    at = 0
    for p, shape in enumerate(shapes):
        sub = shape.rows // shape.shards
        built = []
        for s in range(shape.shards):
            role_fields = []
            for role, t in first[at].items():
                role_fields.append((role, len(specs)))
                specs.append((f"p{p}.{s}.{role}", t.dtype, tuple(t.shape)))
            built.append(Shard(fmt, (s * sub, (s + 1) * sub), tuple(role_fields)))
            at += 1
        bias = None
        if shape.bias:
            bias = len(specs)
            specs.append((f"p{p}.bias", torch.bfloat16, (shape.rows,)))
        projections.append(Projection((shape.rows, shape.cols), tuple(built), bias))
    layout = UnitLayout.build(specs)
    fused = q4_units(projections, layout, act, torch.bfloat16, int8_activations)
    if isinstance(fused, str):
        raise ValueError(f"the C++ 4-bit op cannot read these units: {fused}")
    unit_bytes = []
    for weights, expert_biases in zip(stored, biases):
        buf = torch.zeros(layout.nbytes, dtype=torch.uint8)
        views = layout.views(buf)
        for proj, b in zip(projections, expert_biases):
            if b is not None and proj.bias_field is not None:
                views[proj.bias_field].copy_(b)
        shard_list = [s for proj in projections for s in proj.shards]
        for shard, tensors in zip(shard_list, weights):
            for role, i in shard.role_fields:
                views[i].copy_(tensors[role])
        unit_bytes.append(buf)
    return Units(unit_bytes, layout, fused)


def dequantized(fmt: Format, shapes: Sequence[ProjectionShape], stored: Sequence[Stored]) -> list[torch.Tensor]:
    """One expert's projections [rows, cols] in bf16, each shard by the format's reference decoder."""
    out, at = [], 0
    for shape in shapes:
        w = torch.empty(shape.rows, shape.cols, dtype=torch.bfloat16)
        sub = shape.rows // shape.shards
        for s in range(shape.shards):
            fmt.dequantize(stored[at], w[s * sub : (s + 1) * sub])
            at += 1
        out.append(w)
    return out
