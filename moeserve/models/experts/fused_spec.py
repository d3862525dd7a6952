"""The spec of the C++ expert op for units the SwiGLU ops cannot read (csrc/moe_experts_q4.h): 4-bit experts as
stored (MXFP4, NVFP4, INT4), GGUF experts as stored (their blocks) and gpt-oss's bf16 experts, row-interleaved.

A unit is one byte buffer (experts/unit.py), so the op is given ONE tensor per projection and expert (the
projection's first field) and reads the others at the byte offsets the spec names: the same spec for every expert
of a model, and the decode stack holds the units with the two-list `Units` of the SwiGLU ops. `q4_units` says
where the op finds a plan's fields, or why it cannot run them (logged at start-up with the expert kernel).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moeserve.experts.unit import UnitLayout
from moeserve.models.experts.unit_math import FusedUnits, Projection


@dataclass(frozen=True)
class Activation:
    """The expert's activation as the op's spec words: swiglu (gate rows then up rows), relu2 (up rows only), or
    gptoss (gate/up rows interleaved, clamped at `limit`, sigmoid(alpha g); gptoss-split: gate rows then up rows,
    as a GGUF stores them)."""

    kind: str
    alpha: float = 0.0
    limit: float = 0.0

    def words(self) -> str:
        if not self.kind.startswith("gptoss"):
            return f"act={self.kind}"
        return f"act={self.kind} alpha={self.alpha.hex()} limit={self.limit.hex()}"


def _projection_words(name: str, proj: Projection, layout: UnitLayout) -> tuple[int, str] | str:
    """(the base field index, the spec words) of one stored-format projection, or why the op cannot read it."""
    fields = [i for shard in proj.shards for _, i in shard.role_fields]
    if proj.bias_field is not None:
        fields.append(proj.bias_field)
    base = min(fields, key=lambda i: layout.fields[i].offset)
    at = layout.fields[base].offset
    words = [f"{name}={proj.shape[0]}x{proj.shape[1]}"]
    if proj.bias_field is not None:
        bias = layout.fields[proj.bias_field]
        if bias.dtype != torch.bfloat16:
            return f"a {bias.dtype} bias"
        words.append(f"{name}.bias={bias.offset - at}")
    for shard in proj.shards:
        codes = shard.fmt.fused_codes()
        if codes is None:
            return f"{shard.fmt.name} weights"
        role = dict(shard.role_fields)
        scales_at = -1
        if codes.scales is not None:
            scales = layout.fields[role[codes.scales]]
            if (scales.dtype != codes.scale_dtype) if codes.scale_dtype is not None else scales.dtype.itemsize != 1:
                return f"{shard.fmt.name} scales in {scales.dtype}"
            scales_at = scales.offset - at
        tscale = -1
        if codes.tensor_scale is not None:
            field = layout.fields[role[codes.tensor_scale]]
            if field.dtype != torch.float32 or field.nbytes != 4:
                return f"a {shard.fmt.name} tensor scale of {field.dtype} {field.shape}"
            tscale = field.offset - at
        rows = shard.rows[1] - shard.rows[0]
        words.append(f"{name}.shard={rows}:{layout.fields[role[codes.codes]].offset - at}:{scales_at}:{tscale}")
        if codes.ggml:
            index = "" if codes.type_role is None else f"@{layout.fields[role[codes.type_role]].offset - at}"
            words.append(f"{name}.ggml={'|'.join(codes.ggml)}{index}")
    return base, " ".join(words)


def q4_units(projections: Sequence[Projection], layout: UnitLayout, act: Activation | None,
             dtype: torch.dtype, int8_activations: bool = False) -> FusedUnits | str:
    """Where moe_q4_experts_ finds the fields of units holding `projections` (gate_up or up, then down) in stored
    formats, or why it cannot run them. `int8_activations`: INT4 units (group 32) computed against int8-quantized
    activations with integer dots (`fmt=int4-q8`, csrc/q4_q8.h: quantization="int4"'s own numeric contract),
    instead of the reference decoder's bf16 weights against bf16 activations."""
    if act is None:
        return "no activation the op has"
    if dtype != torch.bfloat16:
        return f"the op computes in bf16 (compute dtype {str(dtype).removeprefix('torch.')})"
    if len(projections) != 2:
        return f"{len(projections)} projections"
    fmts = {(c.word, c.group) for p in projections for s in p.shards if (c := s.fmt.fused_codes()) is not None}
    if len(fmts) > 1:
        return "projections in different formats"
    (gu_rows, h), (h2, i) = projections[0].shape, projections[1].shape
    if h % 32 or i % 32 or gu_rows % 4 or h2 % 4:
        return f"hidden {h} and expert width {i} must be multiples of 32"
    gu_part, dn_part = (_projection_words(name, p, layout) for name, p in zip(("gu", "dn"), projections))
    if isinstance(gu_part, str):
        return gu_part
    if isinstance(dn_part, str):
        return dn_part
    (gu, gu_words), (dn, dn_words) = gu_part, dn_part
    word, group = fmts.pop() if fmts else ("?", 0)
    if group != 16 and (group < 32 or group & (group - 1)):
        return f"groups of {group} elements (the op takes 16, or 32 times a power of two)"
    if int8_activations:
        if (word, group) != ("int4", 32):
            return f"int8 activations need INT4 groups of 32, not {word} groups of {group}"
        word = "int4-q8"
    spec = f"fmt={word} group={group} {act.words()} {gu_words} {dn_words}"
    return FusedUnits(interleaved=False, gate_up=gu, down=dn, stack_op=f"q4 {spec}", spec=spec)


def bf16_interleaved_units(layout: UnitLayout, act: Activation, hidden: int, inter: int) -> FusedUnits:
    """Where moe_q4_experts_ finds gpt-oss units held as gate_up [2I * H] and down [H * I] bf16, row-interleaved
    (linear.interleave_rows), each followed by its bf16 bias: fields gate_up, gate_up_bias, down, down_bias."""
    gu, gub, dn, dnb = layout.fields
    spec = (f"fmt=bf16 {act.words()} gu={2 * inter}x{hidden} gu.bias={gub.offset - gu.offset} "
            f"gu.shard={2 * inter}:0:-1:-1 dn={hidden}x{inter} dn.bias={dnb.offset - dn.offset} "
            f"dn.shard={hidden}:0:-1:-1")
    return FusedUnits(interleaved=False, gate_up=0, down=2, stack_op=f"q4 {spec}", spec=spec)
