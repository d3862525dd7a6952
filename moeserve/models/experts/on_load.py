"""On-load quantization of a 16/32-bit checkpoint's experts (`quantization="int8"` / `"int4"`): functions of a dense
`ExpertPlan` returning the plan whose units hold int8 or int4 codes in every tier (models/experts/plans.py)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from moeserve.errors import ConfigError
from moeserve.experts.unit import UnitLayout
from moeserve.formats.catalog import CompressedTensorsInt4Format
from moeserve.models.experts.fused_spec import Activation, q4_units
from moeserve.models.experts.plans import (
    ExpertPlan,
    gpt_oss_stored_math,
    relu2_stored_math,
    swiglu_stored_math,
)
from moeserve.models.experts.sources import Int4ExpertSource, Int8ExpertSource
from moeserve.models.experts.unit_math import (
    DequantizingKernel,
    ExpertMath,
    GptOssMath,
    Int8Kernel,
    Projection,
    Relu2Math,
    Shard,
    SplitGptOssMath,
    SwiGLUMath,
)


# ------------------------------------------------------------------------------------- on-load int8 (optional)
def int8_expert_plan(dense: ExpertPlan, dtype: torch.dtype, spill_root: Path | None = None,
                     interleaved: bool = False) -> ExpertPlan:
    """`dense` with every 2-D field held as int8 + per-row float32 scales in every tier (1-D fields, the
    biases, stay as they are). For `quantization="int8"` on a 16/32-bit checkpoint. `spill_root`: where an
    offloaded store keeps the quantized units for its misses (None: misses quantize again). `interleaved`
    (SwiGLU units, see `can_interleave_experts`): the codes held flat in pack_int8_rows' row-interleaved layout for
    the fused C++ op."""
    if dense.quantized:
        raise ConfigError(
            "quantization=int8 quantizes 16/32-bit experts on load, but this checkpoint's experts "
            "are already quantized: leave quantization at none"
        )
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    targets: list[tuple[int, int | None]] = []
    for f in dense.layout.fields:
        if len(f.shape) == 2:
            specs.append((f.name, torch.int8, (f.shape[0] * f.shape[1],) if interleaved else f.shape))
        else:
            specs.append((f.name, f.dtype, f.shape))
        if len(f.shape) == 2:
            specs.append((f.name + ".scale", torch.float32, (f.shape[0],)))
            targets.append((len(specs) - 2, len(specs) - 1))
        else:
            targets.append((len(specs) - 1, None))
    layout = UnitLayout.build(specs)
    frozen_targets = tuple(targets)
    math = Int8Kernel(dense.math, [f.shape for f in dense.layout.fields], frozen_targets, dtype, interleaved)
    description = (
        f"experts quantized on load to int8 with per-row scales, in every cache tier (unit "
        f"{layout.nbytes / 2**10:.1f} KiB instead of {dense.layout.nbytes / 2**10:.1f} KiB); "
        + ("rows interleaved in blocks of 4 for the fused C++ op; " if interleaved else
           f"dequantized at use into reused {str(dtype).removeprefix('torch.')} buffers; ")
        + ("a miss reads the checkpoint's 16/32-bit expert and quantizes it" if spill_root is None else
           f"offloaded, units are quantized once into a spill file under {spill_root} that misses read")
    )
    return ExpertPlan(
        layout,
        math,
        dense.sources,
        description,
        make_source=lambda ckpt: Int8ExpertSource(dense.source(ckpt), layout, frozen_targets, spill_root),
    )


# ------------------------------------------------------------------------------------- on-load int4 (optional)
INT4_GROUP = 32  # elements per bf16 scale: Kimi-K2's W4A16 scheme (4.5 bits per weight)


@dataclass(frozen=True)
class _DenseProjection:
    """One projection of a dense plan's unit: its matrix field (stored [in, out] where `transposed`: gpt-oss) and
    its bias field."""

    name: str
    field: int
    transposed: bool = False
    bias: int | None = None


def _dense_kind(dense: ExpertPlan) -> tuple[tuple[_DenseProjection, ...], ExpertMath, Activation]:
    """The projections (gate_up or up, then down), the stored-format math and the activation of a dense plan."""
    math = dense.math
    if isinstance(math, SwiGLUMath):
        return (_DenseProjection("gate_up", 0), _DenseProjection("down", 1)), swiglu_stored_math, Activation("swiglu")
    if isinstance(math, Relu2Math):
        return (_DenseProjection("up", 0), _DenseProjection("down", 1)), relu2_stored_math, Activation("relu2")
    if isinstance(math, GptOssMath):
        return ((_DenseProjection("gate_up", 0, True, 1), _DenseProjection("down", 2, True, 3)),
                partial(gpt_oss_stored_math, math.limit, math.alpha), Activation("gptoss", math.alpha, math.limit))
    if isinstance(math, SplitGptOssMath):  # a GGUF's: [out, in], gate rows then up rows
        return ((_DenseProjection("gate_up", 0, False, 1), _DenseProjection("down", 2, False, 3)),
                partial(gpt_oss_stored_math, math.limit, math.alpha, gate_first=True),
                Activation("gptoss-split", math.alpha, math.limit))
    raise ConfigError(f"quantization=int4 quantizes SwiGLU, relu2 and gpt-oss experts, not {type(math).__name__}")


def int4_expert_plan(dense: ExpertPlan, dtype: torch.dtype, spill_root: Path | None = None,
                     group: int = INT4_GROUP) -> ExpertPlan:
    """`dense` with every expert matrix held as int4 in compressed-tensors' pack-quantized layout (symmetric, one
    bf16 scale per `group` inputs: formats/int4.quantize_int4_packed) in every tier, biases as they are: units a
    Kimi-K2-style checkpoint would have, so the same reader (DequantizingKernel, the C++ 4-bit op) computes them.
    For `quantization="int4"` on a 16/32-bit checkpoint; `spill_root` as `int8_expert_plan`'s."""
    if dense.quantized:
        raise ConfigError("quantization=int4 quantizes 16/32-bit experts on load, but this checkpoint's experts are "
                          "already quantized: leave quantization at none")
    projections, math, act = _dense_kind(dense)
    fmt = CompressedTensorsInt4Format(group_size=group)
    specs: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    built: list[Projection] = []
    targets: list[tuple[int, bool, bool]] = [(0, False, False)] * len(dense.layout.fields)
    for p in projections:
        shape = dense.layout.fields[p.field].shape
        out, cols = (shape[1], shape[0]) if p.transposed else shape
        if cols % group:
            raise ConfigError(f"quantization=int4: expert {p.name} has {cols} inputs, not a multiple of {group}")
        first = len(specs)
        roles = (("weight_packed", torch.int32, (out, cols // 8)), ("weight_scale", torch.bfloat16, (out, cols // group)),
                 ("weight_shape", torch.int64, (2,)))
        # the codes keep the dense field's name (the checkpoint's sources name it), the scales and shape beside it
        name = dense.layout.fields[p.field].name
        specs += [(name if i == 0 else f"{name}.{role}", dt, s) for i, (role, dt, s) in enumerate(roles)]
        targets[p.field] = (first, p.transposed, True)
        bias = None
        if p.bias is not None:
            bias = len(specs)
            field = dense.layout.fields[p.bias]
            specs.append((field.name, field.dtype, (out,)))
            targets[p.bias] = (bias, False, False)
        role_fields = tuple((role, first + i) for i, (role, _, _) in enumerate(roles))
        built.append(Projection((out, cols), (Shard(fmt, (0, out), role_fields),), bias))
    layout = UnitLayout.build(specs)
    kernel = DequantizingKernel(built, dtype, math, q4_units(built, layout, act, dtype, int8_activations=True))
    description = (
        f"experts quantized on load to int4 (symmetric, a bf16 scale per {group} inputs, compressed-tensors' "
        f"pack-quantized layout), in every cache tier (unit {layout.nbytes / 2**10:.1f} KiB instead of "
        f"{dense.layout.nbytes / 2**10:.1f} KiB); "
        + ("a miss reads the checkpoint's 16/32-bit expert and quantizes it" if spill_root is None else
           f"offloaded, units are quantized once into a spill file under {spill_root} that misses read")
    )
    frozen = tuple(targets)
    return ExpertPlan(layout, kernel, dense.sources, description,
                      make_source=lambda ckpt: Int4ExpertSource(dense.source(ckpt), layout, frozen, group,
                                                                spill_root))
