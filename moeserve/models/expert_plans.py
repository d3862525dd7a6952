"""Expert plans for quantized experts and for gpt-oss, registered in `EXPERT_PLANNERS`.

A plan says what one ExpertUnit holds and which kernel computes it. Quantized experts stay in their STORED
format in every tier: the unit holds the stored tensors of every projection (packed codes, block scales,
global scales) plus the biases, so a 4-bit expert is 4-bit on disk, in host memory and in the cache, and a
miss moves exactly its stored bytes. The kernel dequantizes each projection at use into a buffer it owns and
reuses for every call (one per projection and device), then runs the expert's math on the dense weights.

Fused projections keep one shard per stored weight: Qwen's gate and up become rows [0, I) and [I, 2I) of one
gate_up buffer, each shard dequantized with its own scales (NVFP4 global scales are never merged).
"""

from __future__ import annotations

import inspect
import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from moeserve.checkpoint.finite import check_expert_unit
from moeserve.checkpoint.folder import Checkpoint
from moeserve.checkpoint.safetensors_file import Placer, TensorRef
from moeserve.errors import ConfigError, UnsupportedModelError
from moeserve.experts.spill import UnitSpill, fingerprint, open_or_build
from moeserve.experts.store import ExpertWeights
from moeserve.experts.unit import ExpertSource, FieldSources, UnitLayout
from moeserve.formats import Format, QuantScheme
from moeserve.formats.int8 import dequantize_int8_per_channel, quantize_int8_per_channel
from moeserve.models.layers import (
    ExpertKernel,
    deinterleave_rows,
    gpt_oss_expert_math,
    pack_int8_rows,
    swiglu_expert,
    unpack_int8_rows,
)
from moeserve.models.model import EXPERT_PLANNERS, ExpertPlan, swiglu_expert_plan
from moeserve.models.quantized import check_dense_shape, checkpoint_scheme
from moeserve.models.registry import Architecture
from moeserve.models.spec import ModelSpec

# (x [T, H], dense weights [out, in] per projection, bias per projection or None) -> [T, H]
ExpertMath = Callable[[torch.Tensor, tuple[torch.Tensor, ...], tuple[torch.Tensor | None, ...]], torch.Tensor]


@dataclass(frozen=True)
class ProjectionSource:
    """Where one projection of an expert is stored. Templates take {L} (layer) and {E} (expert)."""

    name: str  # "gate_up" / "down"
    shape: tuple[int, int]  # dense [out, in]
    shard_prefixes: tuple[str, ...]  # one Linear prefix per shard; each fills out / len(shards) rows
    stacked: bool  # all experts of a layer along dim 0 of one tensor (gpt-oss), else one tensor per expert
    bias: str | None = None  # tensor name template of the bias [out], or None


@dataclass(frozen=True)
class Shard:
    """One stored weight of a projection: its format, its rows of the dense buffer, its unit fields by role."""

    fmt: Format
    rows: tuple[int, int]
    role_fields: tuple[tuple[str, int], ...]  # (role, index into the unit's field views)


@dataclass(frozen=True)
class Projection:
    shape: tuple[int, int]
    shards: tuple[Shard, ...]
    bias_field: int | None


class DequantizingKernel:
    """An ExpertKernel over units in stored format: dequantize each projection into a reused buffer, then math.

    The buffers (one per projection, in the compute dtype, allocated on first use per device) are shared by
    every layer: a kernel call finishes with them before the next call starts (one forward at a time).
    """

    def __init__(self, projections: Sequence[Projection], dtype: torch.dtype, math: ExpertMath) -> None:
        self.projections, self.dtype, self.math = tuple(projections), dtype, math
        self._buffers: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def buffers(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        bufs = self._buffers.get(device)
        if bufs is None:
            with torch.inference_mode(False):  # ordinary tensors: writable inside and outside inference mode
                bufs = tuple(torch.empty(p.shape, dtype=self.dtype, device=device) for p in self.projections)
            self._buffers[device] = bufs
        return bufs

    def dequantize(self, w: ExpertWeights) -> tuple[torch.Tensor, ...]:
        """Dense [out, in] weights of the unit `w` (views of this kernel's buffers, valid until the next call)."""
        bufs = self.buffers(w[0].device)
        for proj, buf in zip(self.projections, bufs):
            for shard in proj.shards:
                tensors = {role: w[index] for role, index in shard.role_fields}
                shard.fmt.dequantize(tensors, buf[shard.rows[0] : shard.rows[1]])
        return bufs

    def __call__(self, x: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
        return self.bind(w)(x)

    def bind(self, w: ExpertWeights) -> Callable[[torch.Tensor], torch.Tensor]:
        """The unit dequantized once; the returned row-wise function runs the math on any rows of x."""
        biases = tuple(None if p.bias_field is None else w[p.bias_field] for p in self.projections)
        dense = self.dequantize(w)
        return lambda x: self.math(x, dense, biases)

    @property
    def buffer_nbytes(self) -> int:
        return sum(p.shape[0] * p.shape[1] for p in self.projections) * self.dtype.itemsize


def stored_format_plan(
    ckpt: Checkpoint,
    scheme: QuantScheme,
    spec: ModelSpec,
    dtype: torch.dtype,
    projections: Sequence[ProjectionSource],
    math: ExpertMath,
    what: str,
) -> ExpertPlan:
    """A plan whose units hold each projection's stored tensors (any `Format`) and biases in `dtype`."""
    layers = spec.moe_layer_ids
    field_specs: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    field_names: list[tuple[str, str, ProjectionSource]] = []  # (field, tensor name template, projection)
    built: list[Projection] = []
    formats: set[str] = set()
    for p in projections:
        rows = p.shape[0] // len(p.shard_prefixes)
        shards = []
        for s, template in enumerate(p.shard_prefixes):
            fmt = _one_format(scheme, template, layers)
            formats.add(fmt.name)
            prefix = template.format(L=layers[0], E=0)
            if p.stacked:  # the stored tensors hold every expert: check the shape of the whole stack
                check_dense_shape(ckpt, fmt, prefix, (spec.moe.num_experts, rows, p.shape[1]))
            else:
                check_dense_shape(ckpt, fmt, prefix, (rows, p.shape[1]))
            role_fields = []
            for role in fmt.roles:
                ref = _ref(ckpt, fmt.stored_name(template, role), layers[0], 0, p.stacked)
                field = f"{p.name}.{s}.{role}"
                role_fields.append((role, len(field_specs)))
                field_specs.append((field, ref.dtype, ref.shape))  # stored dtype: nothing is converted
                field_names.append((field, fmt.stored_name(template, role), p))
            shards.append(Shard(fmt, (s * rows, (s + 1) * rows), tuple(role_fields)))
        bias_field = None
        if p.bias is not None:
            bias_field = len(field_specs)
            field_specs.append((f"{p.name}.bias", dtype, (p.shape[0],)))
            field_names.append((f"{p.name}.bias", p.bias, p))
        built.append(Projection(p.shape, tuple(shards), bias_field))
    layout = UnitLayout.build(field_specs)
    sources: dict[tuple[int, int], tuple[FieldSources, ...]] = {}
    for layer in layers:
        for e in range(spec.moe.num_experts):
            sources[(layer, e)] = tuple(
                FieldSources(field, (_ref(ckpt, template, layer, e, p.stacked),))
                for field, template, p in field_names
            )
    kernel = DequantizingKernel(built, dtype, math)
    stored = sum(r.nbytes for f in sources[(layers[0], 0)] for r in f.refs)
    description = (
        f"{what} stored as {'/'.join(sorted(formats))} in every tier ({stored / 2**10:.1f} KiB per "
        f"expert as stored, unit {layout.nbytes / 2**10:.1f} KiB); dequantized at use into reused "
        f"{kernel.buffer_nbytes / 2**10:.1f} KiB {str(dtype).removeprefix('torch.')} buffers"
    )
    return ExpertPlan(layout, kernel, sources, description)


def _one_format(scheme: QuantScheme, template: str, layers: Sequence[int]) -> Format:
    """The format of a projection; every MoE layer must store it the same way (one unit layout per model)."""
    fmts = {scheme.format_for(template.format(L=layer, E=0)) for layer in layers}
    if len(fmts) != 1:
        raise UnsupportedModelError(
            f"experts '{template}' are stored in different formats across layers "
            f"({', '.join(sorted(f.name for f in fmts))}); one format per expert projection is supported"
        )
    return fmts.pop()


def _ref(ckpt: Checkpoint, template: str, layer: int, expert: int, stacked: bool) -> TensorRef:
    ref = ckpt.ref(template.format(L=layer, E=expert))
    return ref.row_slice(expert) if stacked else ref


# ------------------------------------------------------------------------------------------ SwiGLU (Qwen...)
def _swiglu_math(
    x: torch.Tensor, dense: tuple[torch.Tensor, ...], biases: tuple[torch.Tensor | None, ...]
) -> torch.Tensor:
    return swiglu_expert(x, dense)


def swiglu_plan(ckpt: Checkpoint, arch: Architecture, spec: ModelSpec, dtype: torch.dtype) -> ExpertPlan:
    """Per-expert gate/up/down Linears: units in compute dtype if unquantized, else in the stored format."""
    scheme = checkpoint_scheme(ckpt)
    names, h, i = arch.names, spec.hidden_size, spec.moe.intermediate_size
    first = names.expert_gate.format(L=spec.moe_layer_ids[0], E=0)
    if not scheme.is_quantized(first):
        return swiglu_expert_plan(ckpt, arch, spec, dtype)
    projections = (
        ProjectionSource("gate_up", (2 * i, h), (names.expert_gate, names.expert_up), stacked=False),
        ProjectionSource("down", (h, i), (names.expert_down,), stacked=False),
    )
    return stored_format_plan(ckpt, scheme, spec, dtype, projections, _swiglu_math, "experts")


# -------------------------------------------------------------------------------------------------- gpt-oss
def _gpt_oss_stored_math(
    limit: float,
    alpha: float,
    x: torch.Tensor,
    dense: tuple[torch.Tensor, ...],
    biases: tuple[torch.Tensor | None, ...],
) -> torch.Tensor:
    gate_up, down = dense  # [2I, H], [H, I] (output-major, as stored)
    gate_up_bias, down_bias = biases
    assert gate_up_bias is not None and down_bias is not None
    return gpt_oss_expert_math(x, gate_up.t(), gate_up_bias, down.t(), down_bias, limit, alpha)


def _gpt_oss_dense_kernel(limit: float, alpha: float, x: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
    gate_up_t, gate_up_bias, down_t, down_bias = w  # [H, 2I], [2I], [I, H], [H] (input-major, as stored)
    return gpt_oss_expert_math(x, gate_up_t, gate_up_bias, down_t, down_bias, limit, alpha)


def gpt_oss_plan(ckpt: Checkpoint, arch: Architecture, spec: ModelSpec, dtype: torch.dtype) -> ExpertPlan:
    """gpt-oss stacked experts: bf16 layout -> units in compute dtype; MXFP4 layout -> units in MXFP4."""
    scheme = checkpoint_scheme(ckpt)
    names, h, i, m = arch.names, spec.hidden_size, spec.moe.intermediate_size, spec.moe
    assert m.swiglu_limit is not None and m.swiglu_alpha is not None
    layer0 = spec.moe_layer_ids[0]
    if scheme.is_quantized(names.stacked_gate_up.format(L=layer0)):
        projections = (
            ProjectionSource(
                "gate_up",
                (2 * i, h),
                (names.stacked_gate_up,),
                stacked=True,
                bias=names.stacked_gate_up + "_bias",
            ),
            ProjectionSource(
                "down", (h, i), (names.stacked_down,), stacked=True, bias=names.stacked_down + "_bias"
            ),
        )
        math = partial(_gpt_oss_stored_math, m.swiglu_limit, m.swiglu_alpha)
        return stored_format_plan(ckpt, scheme, spec, dtype, projections, math, "gpt-oss experts")
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
    kernel = partial(_gpt_oss_dense_kernel, m.swiglu_limit, m.swiglu_alpha)
    return ExpertPlan(layout, kernel, sources, f"gpt-oss experts in {str(dtype).removeprefix('torch.')}")


def expert_plan_for(ckpt: Checkpoint, arch: Architecture, spec: ModelSpec, dtype: torch.dtype) -> ExpertPlan:
    """The plan of `spec`'s expert kind (same as `moeserve.models.model.expert_plan`)."""
    return EXPERT_PLANNERS[spec.moe.expert_kind](ckpt, arch, spec, dtype)


EXPERT_PLANNERS["swiglu"] = swiglu_plan
EXPERT_PLANNERS["gpt_oss"] = gpt_oss_plan


# ------------------------------------------------------------------------------------- on-load int8 (optional)
class Int8ExpertSource(ExpertSource):
    """Reads an expert of a 16/32-bit checkpoint through the dense plan, then quantizes every matrix field to
    int8 with one float32 scale per row, into a unit of the int8 layout. The result is deterministic, so a
    re-read after eviction gives the same bytes and offloading stays bit-exact.

    Offloaded (`prepare_offload`), every unit is quantized once during the load and written to a spill file
    under `spill_root` (see `moeserve.experts.spill`); misses then read the int8 unit from it: half the bytes
    of the 16-bit expert, and no quantization per miss. The spill holds the very bytes a miss would make.
    """

    def __init__(
        self,
        ckpt: Checkpoint,
        dense: ExpertPlan,
        int8_layout: UnitLayout,
        targets: tuple[tuple[int, int | None], ...],
        spill_root: Path | None = None,
    ) -> None:
        super().__init__(ckpt, int8_layout, dense.sources)
        self.dense_source = ExpertSource(ckpt, dense.layout, dense.sources)
        self.targets = (
            targets  # per dense field: (int8 field index, scale field index or None = copied as is)
        )
        self._scratch = torch.empty(dense.layout.nbytes, dtype=torch.uint8)
        self._scratch_lock = threading.Lock()
        self.spill_root = spill_root
        self.spill: UnitSpill | None = None

    @property
    def staging_nbytes(self) -> int:
        return super().staging_nbytes + self._scratch.numel()  # + the 16/32-bit unit each quantization reads into

    @property
    def stored_nbytes(self) -> int:
        """Bytes a miss reads: the int8 unit from the spill file, else the 16/32-bit expert."""
        return self.layout.nbytes if self.spill is not None else super().stored_nbytes

    def prepare_offload(self) -> str | None:
        if self.spill_root is None:
            return "int8 misses read the 16-bit expert and quantize it (spill file off)"
        files = sorted({r.path for fs in self.sources.values() for f in fs for r in f.refs})
        how = "|".join((inspect.getsource(quantize_int8_per_channel), torch.__version__, repr(self.layout),
                        repr(self.dense_source.layout), json.dumps(self.checkpoint.config, sort_keys=True)))
        self.spill = open_or_build(self.spill_root, fingerprint(files, how), sorted(self.sources),
                                   self.layout.nbytes, lambda key, out: self.quantize_unit(*key, out),
                                   "int8 experts")
        if self.spill is None:
            return "int8 misses read the 16-bit expert and quantize it (no spill file)"
        return f"int8 misses read from the spill file {self.spill.path}"

    def unit_files(self, layer: int, expert: int) -> str:
        return str(self.spill.path) if self.spill is not None else super().unit_files(layer, expert)

    def corrupt_advice(self, layer: int, expert: int) -> str:
        if self.spill is None:
            return super().corrupt_advice(layer, expert)
        return "delete it and restart the server (it is made again from the checkpoint)"

    def known_checksums(self) -> tuple[str, dict[tuple[int, int], int]]:
        """The spill header's per-unit checksums, written when the units were made at load."""
        if self.spill is None:
            return "", {}
        return self.spill.checksum_name, self.spill.checksums()

    def read_unit(self, layer: int, expert: int, unit_bytes: torch.Tensor) -> None:
        if self.spill is not None:
            self.spill.read_unit((layer, expert), unit_bytes)
        else:
            self.quantize_unit(layer, expert, unit_bytes)

    def quantize_unit(self, layer: int, expert: int, unit_bytes: torch.Tensor) -> None:
        with self._scratch_lock:
            self.dense_source.read_unit(layer, expert, self._scratch)
            # int8 quantization turns NaN into finite codes: check what it reads. The resident load and the spill
            # build quantize every expert during the load; a miss without a spill file pays 0.8 ms against 14 ms
            # of quantization (a 9.4 MB bf16 Qwen3-30B expert, one thread, measured here).
            check_expert_unit(self.dense_source, layer, expert, self._scratch)
            out = self.layout.views(unit_bytes)
            for dense, (index, scale_index) in zip(
                self.dense_source.layout.views(self._scratch), self.targets
            ):
                if scale_index is None:
                    out[index].copy_(dense)
                else:
                    codes, scale = quantize_int8_per_channel(dense)
                    out[index].copy_(pack_int8_rows(codes) if out[index].dim() == 1 else codes)
                    out[scale_index].copy_(scale)

    def close(self) -> None:
        if self.spill is not None:
            self.spill.close()


class Int8Kernel:
    """Dequantizes the int8 matrices of a unit into reused buffers and runs the dense plan's kernel on them.

    Over SwiGLU units, `fused_int8_fields` (unit field indices of gate_up, its scales, down, its scales) lets
    MoEBlock run the fused C++ op on the int8 codes directly instead (half the bytes of bf16 streamed, no
    dequantized buffer): it computes dot(codes, x) * scale in fp32, where this class computes with codes * scale
    rounded to the compute dtype, so the two differ by that one rounding per weight (csrc/moe_experts.cpp).
    """

    def __init__(
        self,
        dense_kernel: ExpertKernel,
        dense_layout: UnitLayout,
        targets: tuple[tuple[int, int | None], ...],
        dtype: torch.dtype,
        interleaved: bool = False,
    ) -> None:
        self.dense_kernel, self.targets, self.dtype = dense_kernel, targets, dtype
        # codes held flat in pack_int8_rows' layout: MoEBlock runs moe_swiglu_int8_interleaved_ for every batch
        self.fused_interleaved = interleaved
        self.shapes = tuple(f.shape for f in dense_layout.fields)
        self._buffers: dict[torch.device, list[torch.Tensor | None]] = {}
        self.fused_int8_fields: tuple[int, int, int, int] | None = None
        if dense_kernel is swiglu_expert and all(s is not None for _, s in targets) and len(targets) == 2:
            (gate_up, gate_up_scale), (down, down_scale) = targets
            assert gate_up_scale is not None and down_scale is not None
            self.fused_int8_fields = (gate_up, gate_up_scale, down, down_scale)

    def __call__(self, x: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
        return self.bind(w)(x)

    def bind(self, w: ExpertWeights) -> Callable[[torch.Tensor], torch.Tensor]:
        """The unit dequantized once; the returned row-wise function runs the dense kernel on any rows of x."""
        bufs = self._buffers.get(w[0].device)
        if bufs is None:
            with torch.inference_mode(False):
                bufs = [
                    None if s is None else torch.empty(shape, dtype=self.dtype, device=w[0].device)
                    for shape, (_, s) in zip(self.shapes, self.targets)
                ]
            self._buffers[w[0].device] = bufs
        dense = []
        for buf, (index, scale_index) in zip(bufs, self.targets):
            if buf is None or scale_index is None:
                dense.append(w[index])
            else:
                codes = unpack_int8_rows(w[index], *buf.shape) if self.fused_interleaved else w[index]
                dequantize_int8_per_channel(codes, w[scale_index], buf)
                dense.append(buf)
        weights, kernel = tuple(dense), self.dense_kernel
        return lambda x: kernel(x, weights)


def int8_expert_plan(dense: ExpertPlan, dtype: torch.dtype, spill_root: Path | None = None,
                     interleaved: bool = False) -> ExpertPlan:
    """`dense` with every 2-D field held as int8 + per-row float32 scales in every tier (1-D fields, the
    biases, stay as they are). For `quantization="int8"` on a 16/32-bit checkpoint. `spill_root`: where an
    offloaded store keeps the quantized units for its misses (None: misses quantize again). `interleaved`
    (SwiGLU units, see `can_interleave_experts`): the codes held flat in pack_int8_rows' row-interleaved layout for
    the fused C++ op."""
    if isinstance(dense.kernel, DequantizingKernel):
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
    kernel = Int8Kernel(dense.kernel, dense.layout, frozen_targets, dtype, interleaved)
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
        kernel,
        dense.sources,
        description,
        make_source=lambda ckpt: Int8ExpertSource(ckpt, dense, layout, frozen_targets, spill_root),
    )


# ------------------------------------------------------------------------------ row-interleaved SwiGLU units
class InterleavedSwiGLU:
    """The SwiGLU kernel over units whose gate_up [2I, H] and down [H, I] are held flat in the row-interleaved
    layout of the dense C++ GEMV (`layers.interleave_rows`: blocks of 4 rows, their 32-element chunks side by
    side), read by `torch.ops.moeserve.moe_swiglu_interleaved_` as one sequential stream per 4 rows
    (csrc/moe_experts.cpp). MoEBlock runs that op for every batch size (`fused_interleaved`); calling this object
    computes the same expert with torch on de-interleaved copies (a slow reference, not the hot path)."""

    fused_interleaved = True

    def __init__(self, hidden: int, inter: int) -> None:
        self.hidden, self.inter = hidden, inter

    def __call__(self, x: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
        h, i = self.hidden, self.inter
        return swiglu_expert(x, (deinterleave_rows(w[0], 2 * i, h), deinterleave_rows(w[1], h, i)))


class InterleavedExpertSource(ExpertSource):
    """Reads a SwiGLU unit and writes both matrices row-interleaved (blocks of 4 rows never straddle gate and up:
    I % 4 == 0, so each stored tensor is interleaved on its own). Where the checkpoint stores the compute dtype,
    the permutation IS the copy out of the read buffer (`placer`: one single-threaded C++ pass per tensor, run on
    the store's I/O threads); otherwise the expert is read and converted through the dense plan's source into a
    per-thread scratch unit first. Deterministic, so a re-read after eviction gives the same bytes. Needs the C++
    kernels (as the layout does)."""

    def __init__(self, ckpt: Checkpoint, dense: ExpertPlan, layout: UnitLayout) -> None:
        super().__init__(ckpt, layout, dense.sources)
        self.dense_source = ExpertSource(ckpt, dense.layout, dense.sources)
        # every stored tensor in the field dtype: placed straight from the read buffer, no scratch unit
        self._placed = all(r.dtype == layout.field(f.field).dtype for fs in dense.sources.values() for f in fs
                           for r in f.refs)
        self._local = threading.local()  # scratch per thread otherwise: the store reads on several threads

    @property
    def per_thread_staging_nbytes(self) -> int:
        return 0 if self._placed else self.dense_source.layout.nbytes

    def placer(self, field: str, ref: TensorRef) -> Placer | None:
        return partial(_interleave_placed, ref.shape)

    def read_unit(self, layer: int, expert: int, unit_bytes: torch.Tensor) -> None:
        if self._placed:
            super().read_unit(layer, expert, unit_bytes)
            return
        scratch = getattr(self._local, "unit", None)
        if scratch is None:
            scratch = self._local.unit = torch.empty(self.dense_source.layout.nbytes, dtype=torch.uint8)
        self.dense_source.read_unit(layer, expert, scratch)
        for plain, flat in zip(self.dense_source.layout.views(scratch), self.layout.views(unit_bytes)):
            # one thread (csrc/layout.cpp): a torch permute-copy here would start an OpenMP team per I/O thread
            torch.ops.moeserve.interleave_rows_into(flat, plain)


def _interleave_placed(shape: tuple[int, ...], dst: torch.Tensor, stored: torch.Tensor) -> None:
    """Placer of InterleavedExpertSource: `stored` (uint8, the bytes of a 2-byte [N, K] matrix) row-interleaved into
    `dst` (uint8, as many bytes)."""
    if stored.storage_offset() % 2:  # a tensor at an odd file offset: 2-byte views need an even start
        stored = stored.clone()
    torch.ops.moeserve.interleave_rows_into(dst.view(torch.int16), stored.view(torch.int16).view(shape))


def can_interleave_experts(plan: ExpertPlan, dtype: torch.dtype) -> str | None:
    """None when `plan`'s units can be held row-interleaved for the fused C++ op, else why not."""
    if plan.kernel is not swiglu_expert or plan.make_source is not None:
        return "only plain SwiGLU experts in the compute dtype have the interleaved op"
    if dtype != torch.bfloat16:
        return f"the interleaved op is bf16 only (compute dtype {str(dtype).removeprefix('torch.')})"
    (two_i, h), (h2, i) = (f.shape for f in plan.layout.fields)
    if h % 32 or i % 32:
        return f"hidden {h} and expert width {i} must be multiples of 32"
    return None


def interleaved_expert_plan(dense: ExpertPlan) -> ExpertPlan:
    """`dense` (plain SwiGLU units, bf16) with both matrices held flat and row-interleaved in every tier (same
    bytes per unit). Check `can_interleave_experts` first."""
    (two_i, h), (_, i) = (f.shape for f in dense.layout.fields)
    layout = UnitLayout.build([("gate_up", torch.bfloat16, (two_i * h,)), ("down", torch.bfloat16, (h * i,))])
    description = (f"{dense.description}, rows interleaved in blocks of 4 for the fused C++ expert op "
                   "(one sequential stream per 4 rows)")
    return ExpertPlan(layout, InterleavedSwiGLU(h, i), dense.sources, description,
                      make_source=lambda ckpt: InterleavedExpertSource(ckpt, dense, layout))
