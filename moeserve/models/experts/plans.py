"""Expert plans: what one ExpertUnit holds, where its bytes come from, and which UnitMath computes it.

Every planner lives here and is registered in `EXPERT_PLANNERS` by expert kind (ModelSpec.moe.expert_kind); the
model asks `expert_plan` and never branches on the format or the architecture. Transformations of a plan (int8
and int4 on load: models/experts/on_load.py; row-interleaved units) are functions of a plan returning a plan.

Quantized experts stay in their STORED format in every tier: the unit holds the stored tensors of every
projection (packed codes, block scales, global scales) plus the biases, so a 4-bit expert is 4-bit on disk, in
host memory and in the cache, and a miss moves exactly its stored bytes. Their UnitMath (DequantizingKernel)
dequantizes each projection at use into a buffer it owns and reuses for every call, then runs the math.

Fused projections keep one shard per stored weight: Qwen's gate and up become rows [0, I) and [I, 2I) of one
gate_up buffer, each shard dequantized with its own scales (NVFP4 global scales are never merged).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from functools import partial

import torch

from moeserve.checkpoint.folder import Checkpoint
from moeserve.checkpoint.safetensors_file import TensorRef
from moeserve.errors import UnsupportedModelError
from moeserve.experts.unit import ExpertSource, FieldSources, UnitLayout
from moeserve.formats import Format, QuantScheme
from moeserve.formats.gguf import GGUFFormat, LayerMixedGGUFFormat
from moeserve.models.experts.fused_spec import Activation, bf16_interleaved_units, q4_units
from moeserve.models.experts.sources import (
    InterleavedExpertSource,
    LayerTaggedSource,
)
from moeserve.models.experts.unit_math import (
    ClampedSwiGLUMath,
    DequantizingKernel,
    ExpertMath,
    GeGLUMath,
    GptOssMath,
    InterleavedGptOss,
    InterleavedSwiGLU,
    Projection,
    Relu2Math,
    Shard,
    SplitGptOssMath,
    SwiGLUMath,
    UnitMath,
    clamped_swiglu_expert,
    gpt_oss_expert_math,
    relu2_expert,
    swiglu_expert,
)
from moeserve.models.quantized import check_dense_shape, checkpoint_scheme
from moeserve.models.registry import Architecture
from moeserve.models.spec import ModelSpec


@dataclass(frozen=True)
class ExpertPlan:
    """How experts are laid out in units and computed: the layout, the unit math, and per-expert sources."""

    layout: UnitLayout
    math: UnitMath
    sources: dict[tuple[int, int], tuple[FieldSources, ...]]
    description: str = "experts in the compute dtype"  # for the start-up log: format in each tier, kernel
    # Builds the unit reader; None = a plain ExpertSource (stored bytes copied, float dtypes converted).
    make_source: Callable[[Checkpoint], ExpertSource] | None = None
    quantized: bool = False  # the checkpoint stores these experts quantized (kept so in every tier)

    def source(self, ckpt: Checkpoint) -> ExpertSource:
        if self.make_source is not None:
            return self.make_source(ckpt)
        return ExpertSource(ckpt, self.layout, self.sources)


Planner = Callable[[Checkpoint, Architecture, ModelSpec, torch.dtype], ExpertPlan]
# Expert kind (ModelSpec.moe.expert_kind) -> its planner (registered below, once per kind).
EXPERT_PLANNERS: dict[str, Planner] = {}


def register_planner(kind: str) -> Callable[[Planner], Planner]:
    def add(planner: Planner) -> Planner:
        if kind in EXPERT_PLANNERS:
            raise ValueError(f"expert kind {kind!r} already has a planner")
        EXPERT_PLANNERS[kind] = planner
        return planner

    return add


def expert_plan(ckpt: Checkpoint, arch: Architecture, spec: ModelSpec, dtype: torch.dtype) -> ExpertPlan:
    """The plan of `spec`'s expert kind."""
    return EXPERT_PLANNERS[spec.moe.expert_kind](ckpt, arch, spec, dtype)


@dataclass(frozen=True)
class ProjectionSource:
    """Where one projection of an expert is stored. Templates take {L} (layer) and {E} (expert)."""

    name: str  # "gate_up" / "down"
    shape: tuple[int, int]  # dense [out, in]
    shard_prefixes: tuple[str, ...]  # one Linear prefix per shard; each fills out / len(shards) rows
    stacked: bool  # all experts of a layer along dim 0 of one tensor (gpt-oss), else one tensor per expert
    bias: tuple[str, ...] = ()  # tensor name templates of the bias [out] (one per shard: a GGUF's gpt-oss), or none


def _stored_sources(ckpt: Checkpoint, layers: Sequence[int], num_experts: int,
                    field_names: list[tuple[str, str, ProjectionSource]]
                    ) -> dict[tuple[int, int], tuple[FieldSources, ...]]:
    """Each (layer, expert) unit's fields read from the tensors as stored (field, tensor name template, projection;
    a field named several times is filled by those tensors end to end)."""
    def unit(layer: int, e: int) -> tuple[FieldSources, ...]:
        refs: dict[str, list[TensorRef]] = {}
        for field, template, p in field_names:
            refs.setdefault(field, []).append(_ref(ckpt, template, layer, e, p.stacked))
        return tuple(FieldSources(field, tuple(r)) for field, r in refs.items())

    return {(layer, e): unit(layer, e) for layer in layers for e in range(num_experts)}


@dataclass
class _StoredFields:
    """The fields of a stored-format unit, added shard by shard: (field, dtype, shape) specs; (field, tensor name
    template, projection) of those read from the checkpoint; the type fields of projections whose ggml type changes
    across layers (field -> layer -> index into its LayerMixedGGUFFormat's formats) and the fields sized for the
    widest of them."""

    specs: list[tuple[str, torch.dtype, tuple[int, ...]]] = dataclass_field(default_factory=list)
    names: list[tuple[str, str, ProjectionSource]] = dataclass_field(default_factory=list)
    tags: dict[str, dict[int, int]] = dataclass_field(default_factory=dict)
    padded: list[tuple[str, str, ProjectionSource]] = dataclass_field(default_factory=list)
    formats: set[str] = dataclass_field(default_factory=set)

    def shard(self, ckpt: Checkpoint, scheme: QuantScheme, spec: ModelSpec, p: ProjectionSource, s: int) -> Shard:
        """Shard `s` of projection `p`: its format (checked against the stored shapes of every layer's) and fields."""
        layers, template = spec.moe_layer_ids, p.shard_prefixes[s]
        rows = p.shape[0] // len(p.shard_prefixes)
        by_layer = {layer: scheme.format_for(template.format(L=layer, E=0)) for layer in layers}
        fmt = _projection_format(template, by_layer)
        self.formats.update(f.name for f in by_layer.values())
        for layer in {f: layer for layer, f in reversed(by_layer.items())}.values():  # each stored format once
            if not p.stacked:
                _check_per_expert(ckpt, by_layer[layer], template, layer)
            stack = (spec.moe.num_experts,) if p.stacked else ()
            check_dense_shape(ckpt, by_layer[layer], template.format(L=layer, E=0), (*stack, rows, p.shape[1]))
        role_fields = []
        for role in fmt.roles:
            field = f"{p.name}.{s}.{role}"
            role_fields.append((role, len(self.specs)))
            if isinstance(fmt, LayerMixedGGUFFormat) and role == "type":  # written by the source, per layer
                self.specs.append((field, torch.int32, (1,)))
                self.tags[field] = {layer: fmt.formats.index(f) for layer, f in by_layer.items()}
                continue
            widest = next(layer for layer, f in by_layer.items() if f == getattr(fmt, "largest", f))
            ref = _ref(ckpt, fmt.stored_name(template, role), widest, 0, p.stacked)
            self.specs.append((field, ref.dtype, ref.shape))  # stored dtype: nothing is converted
            self.names.append((field, fmt.stored_name(template, role), p))
            if isinstance(fmt, LayerMixedGGUFFormat):
                self.padded.append(self.names[-1])
        return Shard(fmt, (s * rows, (s + 1) * rows), tuple(role_fields))


def stored_format_plan(
    ckpt: Checkpoint,
    scheme: QuantScheme,
    spec: ModelSpec,
    dtype: torch.dtype,
    projections: Sequence[ProjectionSource],
    math: ExpertMath,
    what: str,
    act: Activation | None = None,
) -> ExpertPlan:
    """A plan whose units hold each projection's stored tensors (any `Format`) and biases in `dtype`; `act`: the
    activation as the fused C++ op names it (fused_spec.py), which then reads formats it decodes as stored. A GGUF
    projection whose ggml type changes across layers gets one field sized for the widest type (LayerMixedGGUFFormat)."""
    layers = spec.moe_layer_ids
    fields = _StoredFields()
    built: list[Projection] = []
    for p in projections:
        shards = tuple(fields.shard(ckpt, scheme, spec, p, s) for s in range(len(p.shard_prefixes)))
        bias_field = None
        if p.bias:
            bias_field = len(fields.specs)
            fields.specs.append((f"{p.name}.bias", dtype, (p.shape[0],)))
            fields.names.extend((f"{p.name}.bias", template, p) for template in p.bias)
        built.append(Projection(p.shape, shards, bias_field))
    layout = UnitLayout.build(fields.specs)
    sources = _stored_sources(ckpt, layers, spec.moe.num_experts, fields.names)
    fused = q4_units(built, layout, act, dtype)
    kernel = DequantizingKernel(built, dtype, math, fused)
    stored = max(sum(r.nbytes for f in sources[(layer, 0)] for r in f.refs) for layer in layers)
    at_use = (f"dequantized at use into reused {kernel.buffer_nbytes / 2**10:.1f} KiB "
              f"{str(dtype).removeprefix('torch.')} buffers")
    description = (
        f"{what} stored as {'/'.join(sorted(fields.formats))} in every tier ({stored / 2**10:.1f} KiB per "
        f"expert as stored, unit {layout.nbytes / 2**10:.1f} KiB); "
        + (at_use if isinstance(fused, str) else f"read as stored by the C++ expert op (or, on torch's path, {at_use})")
    )
    if not fields.tags:
        return ExpertPlan(layout, kernel, sources, description, quantized=True)
    pad = _padding(ckpt, layout, layers, spec.moe.num_experts, fields.padded)
    changing = ', '.join(sorted({name.split('.')[0] for name, _, _ in fields.padded}))
    description += (f"; the ggml type of {changing} changes across layers: units sized for the widest, a narrower "
                    f"layer's blocks padded to it ({pad / 2**20:.1f} MiB in all, "
                    f"{pad / (len(layers) * spec.moe.num_experts * layout.nbytes):.1%} of the units)")
    tags, padded = fields.tags, tuple(name for name, _, _ in fields.padded)
    return ExpertPlan(layout, kernel, sources, description, quantized=True,
                      make_source=lambda c: LayerTaggedSource(c, layout, sources, tags, padded))


def _padding(ckpt: Checkpoint, layout: UnitLayout, layers: Sequence[int], num_experts: int,
             padded: Sequence[tuple[str, str, ProjectionSource]]) -> int:
    """Bytes of the sized-for-the-widest fields that no layer's stored blocks fill, over every unit."""
    return sum((layout.field(field).nbytes - _ref(ckpt, template, layer, 0, p.stacked).nbytes) * num_experts
               for field, template, p in padded for layer in layers)


def _projection_format(template: str, by_layer: dict[int, Format]) -> Format:
    """The format of a projection's units: its layers' one format, or a GGUF projection whose layers differ in
    ggml type (llama.cpp's Q4_K_M mixes) read through one layout sized for the widest type."""
    fmts = sorted(set(by_layer.values()), key=lambda f: f.name)
    if len(fmts) == 1:
        return fmts[0]
    if all(isinstance(f, GGUFFormat) for f in fmts):
        return LayerMixedGGUFFormat(tuple(f for f in fmts if isinstance(f, GGUFFormat)))
    raise UnsupportedModelError(
        f"experts '{template}' are stored in different formats across layers "
        f"({', '.join(f.name for f in fmts)}); only a GGUF's ggml types may differ across layers"
    )


def _check_per_expert(ckpt: Checkpoint, fmt: Format, template: str, layer: int) -> None:
    """One line for experts stored fused (one tensor per projection for all experts, `experts.gate_up_proj...`) where
    the format's producers write one Linear per expert (`experts.{E}.gate_proj...`): a layout not read."""
    first = fmt.stored_name(template.format(L=layer, E=0), fmt.roles[0])
    if ckpt.has(first) or "{E}" not in template:
        return
    experts = template.format(L=layer, E="{E}").split("{E}")[0]  # "model.layers.0.mlp.experts."
    fused = sorted(n for n in ckpt.tensors if n.startswith(experts) and not n[len(experts):].split(".")[0].isdigit())
    if fused:
        named = next((n for n in fused if n.endswith(fmt.roles[0])), fused[0])
        raise UnsupportedModelError(
            f"{ckpt.path}: experts of layer {layer} are stored fused ('{named}' holds every expert); {fmt.name} "
            f"experts are read as one Linear per expert ('{first}'), the layout llm-compressor and ModelOpt write")


def _ref(ckpt: Checkpoint, template: str, layer: int, expert: int, stacked: bool) -> TensorRef:
    ref = ckpt.ref(template.format(L=layer, E=expert))
    return ref.row_slice(expert) if stacked else ref


# ------------------------------------------------------------------------------------------ SwiGLU (Qwen...)
def swiglu_stored_math(
    x: torch.Tensor, dense: tuple[torch.Tensor, ...], biases: tuple[torch.Tensor | None, ...]
) -> torch.Tensor:
    return swiglu_expert(x, dense)


def swiglu_dense_plan(ckpt: Checkpoint, arch: Architecture, spec: ModelSpec, dtype: torch.dtype) -> ExpertPlan:
    """Per-expert gate/up/down Linears in the compute dtype: unit = gate_up [2I, H] + down [H, I]."""
    names, h, i = arch.names, spec.hidden_size, spec.moe.intermediate_size
    layout = UnitLayout.build([("gate_up", dtype, (2 * i, h)), ("down", dtype, (h, i))])
    sources: dict[tuple[int, int], tuple[FieldSources, ...]] = {}
    for layer in spec.moe_layer_ids:
        for e in range(spec.moe.num_experts):
            gate, up, down = (ckpt.ref(t.format(L=layer, E=e) + ".weight", shape) for t, shape in
                              ((names.expert_gate, (i, h)), (names.expert_up, (i, h)), (names.expert_down, (h, i))))
            sources[(layer, e)] = (FieldSources("gate_up", (gate, up)), FieldSources("down", (down,)))
    return ExpertPlan(layout, SwiGLUMath(), sources)


@register_planner("swiglu")
def swiglu_plan(ckpt: Checkpoint, arch: Architecture, spec: ModelSpec, dtype: torch.dtype) -> ExpertPlan:
    """Per-expert gate/up/down Linears (Qwen, Mixtral, OLMoE): units in the compute dtype if unquantized, else in
    the stored format."""
    scheme = checkpoint_scheme(ckpt)
    names, h, i = arch.names, spec.hidden_size, spec.moe.intermediate_size
    first = names.expert_gate.format(L=spec.moe_layer_ids[0], E=0)
    if not scheme.is_quantized(first):
        return swiglu_dense_plan(ckpt, arch, spec, dtype)
    projections = (
        ProjectionSource("gate_up", (2 * i, h), (names.expert_gate, names.expert_up), stacked=False),
        ProjectionSource("down", (h, i), (names.expert_down,), stacked=False),
    )
    return stored_format_plan(ckpt, scheme, spec, dtype, projections, swiglu_stored_math, "experts", Activation("swiglu"))


# ------------------------------------------------------------------------- clamped SwiGLU (DeepSeek-V4)
@register_planner("swiglu_clamp")
def clamped_swiglu_plan(ckpt: Checkpoint, arch: Architecture, spec: ModelSpec, dtype: torch.dtype) -> ExpertPlan:
    """SwiGLU's per-expert Linears with the gate and up clamped at swiglu_limit (DeepSeek-V4): units as swiglu_plan
    lays them out (in the compute dtype, or in the stored format: MXFP4 as shipped), computed by torch."""
    limit = spec.moe.swiglu_limit
    assert limit is not None
    plan = swiglu_plan(ckpt, arch, spec, dtype)
    if not isinstance(plan.math, SwiGLUMath):  # stored format: dequantized at use, then the clamped math
        names, h, i = arch.names, spec.hidden_size, spec.moe.intermediate_size
        projections = (
            ProjectionSource("gate_up", (2 * i, h), (names.expert_gate, names.expert_up), stacked=False),
            ProjectionSource("down", (h, i), (names.expert_down,), stacked=False),
        )
        return stored_format_plan(ckpt, checkpoint_scheme(ckpt), spec, dtype, projections,
                                  partial(clamped_swiglu_stored_math, limit), "clamped SwiGLU experts")
    return ExpertPlan(plan.layout, ClampedSwiGLUMath(limit), plan.sources,
                      f"clamped SwiGLU experts (swiglu_limit {limit:g}) in {str(dtype).removeprefix('torch.')}")


def clamped_swiglu_stored_math(limit: float, x: torch.Tensor, dense: tuple[torch.Tensor, ...],
                               biases: tuple[torch.Tensor | None, ...]) -> torch.Tensor:
    return clamped_swiglu_expert(x, dense, limit)


# ------------------------------------------------------------------------------------ relu2 (Nemotron-H)
def relu2_stored_math(
    x: torch.Tensor, dense: tuple[torch.Tensor, ...], biases: tuple[torch.Tensor | None, ...]
) -> torch.Tensor:
    return relu2_expert(x, dense)


@register_planner("relu2")
def relu2_plan(ckpt: Checkpoint, arch: Architecture, spec: ModelSpec, dtype: torch.dtype) -> ExpertPlan:
    """Per-expert up/down Linears without a gate (Nemotron-H): unit = up [I, H] + down [H, I] in the compute dtype
    if unquantized, else each projection's stored tensors (NVFP4, FP8...) in every tier."""
    scheme = checkpoint_scheme(ckpt)
    names, h, i = arch.names, spec.hidden_size, spec.moe.intermediate_size
    projections = (
        ProjectionSource("up", (i, h), (names.expert_up,), stacked=False),
        ProjectionSource("down", (h, i), (names.expert_down,), stacked=False),
    )
    if scheme.is_quantized(names.expert_up.format(L=spec.moe_layer_ids[0], E=0)):
        return stored_format_plan(ckpt, scheme, spec, dtype, projections, relu2_stored_math, "relu2 experts",
                                  Activation("relu2"))
    layout = UnitLayout.build([("up", dtype, (i, h)), ("down", dtype, (h, i))])
    sources = {
        (layer, e): tuple(FieldSources(p.name, (ckpt.ref(p.shard_prefixes[0].format(L=layer, E=e) + ".weight",
                                                          p.shape),)) for p in projections)
        for layer in spec.moe_layer_ids
        for e in range(spec.moe.num_experts)
    }
    return ExpertPlan(layout, Relu2Math(), sources, f"relu2 experts in {str(dtype).removeprefix('torch.')}")


# ------------------------------------------------------------------------------------------- GeGLU (Gemma-4)
@register_planner("geglu")
def geglu_plan(ckpt: Checkpoint, arch: Architecture, spec: ModelSpec, dtype: torch.dtype) -> ExpertPlan:
    """Every expert of a layer in one tensor per projection, output-major: gate_up [E, 2I, H] (gate rows first), down
    [E, H, I]; unit = expert e's rows of each, gate_up [2I, H] + down [H, I], in the compute dtype."""
    names, h, i, e = arch.names, spec.hidden_size, spec.moe.intermediate_size, spec.moe.num_experts
    fields = (("gate_up", names.stacked_gate_up, (2 * i, h)), ("down", names.stacked_down, (h, i)))
    layer0 = spec.moe_layer_ids[0]
    if checkpoint_scheme(ckpt).is_quantized(names.stacked_gate_up.format(L=layer0)):
        raise UnsupportedModelError(f"{ckpt.path}: quantized GeGLU experts are not read (Gemma-4 ships in bf16)")
    for layer in spec.moe_layer_ids:
        for _, template, shape in fields:
            ckpt.ref(template.format(L=layer), (e, *shape))  # checks the stacked shape
    layout = UnitLayout.build([(name, dtype, shape) for name, _, shape in fields])
    sources = {(layer, x): tuple(FieldSources(name, (_ref(ckpt, template, layer, x, True),))
                                 for name, template, _ in fields)
               for layer in spec.moe_layer_ids for x in range(e)}
    return ExpertPlan(layout, GeGLUMath(), sources, f"GeGLU experts in {str(dtype).removeprefix('torch.')}")


# -------------------------------------------------------------------------------------------------- gpt-oss
def gpt_oss_stored_math(
    limit: float,
    alpha: float,
    x: torch.Tensor,
    dense: tuple[torch.Tensor, ...],
    biases: tuple[torch.Tensor | None, ...],
    gate_first: bool = False,
) -> torch.Tensor:
    gate_up, down = dense  # [2I, H], [H, I] (output-major, as stored), or stacked [G, ...]
    gate_up_bias, down_bias = biases
    assert gate_up_bias is not None and down_bias is not None
    return gpt_oss_expert_math(x, gate_up.mT, gate_up_bias, down.mT, down_bias, limit, alpha, gate_first)


@register_planner("gpt_oss")
def gpt_oss_plan(ckpt: Checkpoint, arch: Architecture, spec: ModelSpec, dtype: torch.dtype) -> ExpertPlan:
    """gpt-oss stacked experts: bf16 layout -> units in compute dtype; MXFP4 layout -> units in MXFP4."""
    scheme = checkpoint_scheme(ckpt)
    names, h, i, m = arch.names, spec.hidden_size, spec.moe.intermediate_size, spec.moe
    assert m.swiglu_limit is not None and m.swiglu_alpha is not None
    layer0 = spec.moe_layer_ids[0]
    if ckpt.has(names.expert_gate.format(L=layer0, E=0) + ".weight"):
        return _split_gpt_oss_plan(ckpt, arch, spec, dtype)
    if scheme.is_quantized(names.stacked_gate_up.format(L=layer0)):
        projections = (
            ProjectionSource(
                "gate_up",
                (2 * i, h),
                (names.stacked_gate_up,),
                stacked=True,
                bias=(names.stacked_gate_up + "_bias",),
            ),
            ProjectionSource(
                "down", (h, i), (names.stacked_down,), stacked=True, bias=(names.stacked_down + "_bias",)
            ),
        )
        math = partial(gpt_oss_stored_math, m.swiglu_limit, m.swiglu_alpha)
        act = Activation("gptoss", m.swiglu_alpha, m.swiglu_limit)
        return stored_format_plan(ckpt, scheme, spec, dtype, projections, math, "gpt-oss experts", act)
    fields = (
        ("gate_up", names.stacked_gate_up, (h, 2 * i)),
        ("gate_up_bias", names.stacked_gate_up + "_bias", (2 * i,)),
        ("down", names.stacked_down, (i, h)),
        ("down_bias", names.stacked_down + "_bias", (h,)),
    )
    layout = UnitLayout.build([(name, dtype, shape) for name, _, shape in fields])
    for _, template, shape in fields:
        ckpt.ref(template.format(L=layer0), (m.num_experts, *shape))  # checks the stacked shape
    sources = {
        (layer, e): tuple(
            FieldSources(name, (_ref(ckpt, template, layer, e, True),)) for name, template, _ in fields
        )
        for layer in spec.moe_layer_ids
        for e in range(m.num_experts)
    }
    dense_math = GptOssMath(m.swiglu_limit, m.swiglu_alpha)  # [H, 2I], [2I], [I, H], [H] (input-major, as stored)
    return ExpertPlan(layout, dense_math, sources, f"gpt-oss experts in {str(dtype).removeprefix('torch.')}")


def _split_gpt_oss_plan(ckpt: Checkpoint, arch: Architecture, spec: ModelSpec, dtype: torch.dtype) -> ExpertPlan:
    """gpt-oss experts stored per expert with gate and up apart, each with its bias (a GGUF, checkpoint/gguf/archs.py):
    a unit holds gate rows then up rows, the clamped SwiGLU reads them so (`gate_first`). Quantized: in their stored
    format in every tier; float: in the compute dtype."""
    scheme = checkpoint_scheme(ckpt)
    names, h, i, m = arch.names, spec.hidden_size, spec.moe.intermediate_size, spec.moe
    assert m.swiglu_limit is not None and m.swiglu_alpha is not None
    gate, up, down = names.expert_gate, names.expert_up, names.expert_down
    if scheme.is_quantized(gate.format(L=spec.moe_layer_ids[0], E=0)):
        projections = (
            ProjectionSource("gate_up", (2 * i, h), (gate, up), stacked=False, bias=(gate + ".bias", up + ".bias")),
            ProjectionSource("down", (h, i), (down,), stacked=False, bias=(down + ".bias",)),
        )
        math = partial(gpt_oss_stored_math, m.swiglu_limit, m.swiglu_alpha, gate_first=True)
        act = Activation("gptoss-split", m.swiglu_alpha, m.swiglu_limit)
        return stored_format_plan(ckpt, scheme, spec, dtype, projections, math, "gpt-oss experts", act)
    fields = (("gate_up", (gate, up), (2 * i, h)), ("gate_up_bias", (gate, up), (2 * i,)),
              ("down", (down,), (h, i)), ("down_bias", (down,), (h,)))
    layout = UnitLayout.build([(name, dtype, shape) for name, _, shape in fields])
    sources = {
        (layer, e): tuple(FieldSources(name, tuple(
            ckpt.ref(t.format(L=layer, E=e) + (".bias" if name.endswith("bias") else ".weight"),
                     (shape[0] // len(templates), *shape[1:])) for t in templates)) for name, templates, shape in fields)
        for layer in spec.moe_layer_ids for e in range(m.num_experts)
    }
    return ExpertPlan(layout, SplitGptOssMath(m.swiglu_limit, m.swiglu_alpha), sources,
                      f"gpt-oss experts in {str(dtype).removeprefix('torch.')}, gate rows then up rows")


# ------------------------------------------------------------------------------ row-interleaved SwiGLU units
def can_interleave_experts(plan: ExpertPlan, dtype: torch.dtype) -> str | None:
    """None when `plan`'s units can be held row-interleaved for a fused C++ op, else why not."""
    if not isinstance(plan.math, (SwiGLUMath, GptOssMath)) or plan.make_source is not None:
        return "only SwiGLU and gpt-oss experts in the compute dtype have an interleaved op"
    if dtype != torch.bfloat16:
        return f"the interleaved op is bf16 only (compute dtype {str(dtype).removeprefix('torch.')})"
    h, i = _hidden_inter(plan)
    if h % 32 or i % 32:
        return f"hidden {h} and expert width {i} must be multiples of 32"
    return None


def _hidden_inter(plan: ExpertPlan) -> tuple[int, int]:
    """(hidden, expert width) of a dense SwiGLU ([2I, H], [H, I]) or gpt-oss ([H, 2I], [2I], [I, H], [H]) plan."""
    if isinstance(plan.math, GptOssMath):
        h, two_i = plan.layout.fields[0].shape
        return h, two_i // 2
    (_, h), (_, i) = (f.shape for f in plan.layout.fields)
    return h, i


def interleaved_expert_plan(dense: ExpertPlan) -> ExpertPlan:
    """`dense` (plain SwiGLU or gpt-oss units, bf16) with the matrices held flat and row-interleaved in every tier
    (same bytes per unit). Check `can_interleave_experts` first."""
    if isinstance(dense.math, GptOssMath):
        return _interleaved_gpt_oss_plan(dense, dense.math)
    (two_i, h), (_, i) = (f.shape for f in dense.layout.fields)
    layout = UnitLayout.build([("gate_up", torch.bfloat16, (two_i * h,)), ("down", torch.bfloat16, (h * i,))])
    description = (f"{dense.description}, rows interleaved in blocks of 4 for the fused C++ expert op "
                   "(one sequential stream per 4 rows)")
    return ExpertPlan(layout, InterleavedSwiGLU(h, i), dense.sources, description,
                      make_source=lambda ckpt: InterleavedExpertSource(dense.source(ckpt), layout))


def _interleaved_gpt_oss_plan(dense: ExpertPlan, math: GptOssMath) -> ExpertPlan:
    """gpt-oss units ([H, 2I] + bias, [I, H] + bias, input-major as stored) held as gate_up [2I * H] and down
    [H * I], each transposed and row-interleaved, with their biases: read by moe_q4_experts_ (fmt=bf16)."""
    h, i = _hidden_inter(dense)
    layout = UnitLayout.build([("gate_up", torch.bfloat16, (2 * i * h,)), ("gate_up_bias", torch.bfloat16, (2 * i,)),
                               ("down", torch.bfloat16, (h * i,)), ("down_bias", torch.bfloat16, (h,))])
    units = bf16_interleaved_units(layout, Activation("gptoss", math.alpha, math.limit), h, i)
    description = (f"{dense.description}, transposed to [out, in] and rows interleaved in blocks of 4 for the C++ "
                   "gpt-oss expert op")
    return ExpertPlan(layout, InterleavedGptOss(h, i, math.limit, math.alpha, units), dense.sources, description,
                      make_source=lambda ckpt: InterleavedExpertSource(dense.source(ckpt), layout, transposed=True))
