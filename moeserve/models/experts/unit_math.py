"""What one expert computes from the fields of its unit: one `UnitMath` per kind of unit.

A unit (experts/unit.py) is one expert's bytes as a plan laid them out: SwiGLU matrices in the compute dtype, the
same matrices row-interleaved, int8 codes with scales, or any quantized format's stored tensors. Its UnitMath is
the reference computation on it, with torch: `bind(w)` does the per-unit work once (dequantization) and returns a
row-wise function of the tokens x [T, H] -> [T, H]; `bind_stacked(units)` does the same for G experts at once
(their fields stacked, dequantized as one batched op where the format allows) and returns a function of x [G, M, H]
-> [G, M, H], expert g on x[g]: the batched expert kernel's form. `fused_units()` says whether moeserve's fused C++ expert ops
can run these units directly, and where the fields they read are; the expert kernel factory
(models/experts/kernels.py) reads it once, when the model is built. Nothing else asks a UnitMath what it is.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeserve.experts.store import ExpertWeights
from moeserve.formats import Format
from moeserve.formats.int8 import dequantize_int8_per_channel
from moeserve.models.layers.linear import deinterleave_rows, unpack_int8_rows

RowFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class FusedUnits:
    """Units a fused C++ expert op reads directly: the unit field indices of gate_up [2I, H], down [H, I] and, for
    int8 codes, their per-row float32 scales; `interleaved`: the matrices are held flat in the 4-row interleaved
    layout (linear.interleave_rows / pack_int8_rows) instead of [out, in]. `spec`: the units are read by
    moe_q4_experts_ (4-bit formats as stored, gpt-oss experts), gate_up and down then being each projection's
    first field and the spec saying where the rest is (models/experts/fused_spec.py)."""

    interleaved: bool
    gate_up: int = 0
    gate_up_scale: int | None = None
    down: int = 1
    down_scale: int | None = None
    # the decode stack's ExpertOp (csrc/decode_stack.h): "fused", "relu2-loop", or "q4 <spec>"
    stack_op: str = "fused"
    spec: str | None = None

    @property
    def held_by_stack(self) -> bool:
        """Whether a resident store's units can be held by the decode stack as they are: the fused op reads held
        units row-interleaved; the relu2 loop reads [out, in] matrices."""
        return self.interleaved or self.stack_op != "fused"

    @property
    def int8(self) -> bool:
        return self.gate_up_scale is not None

    @property
    def fields(self) -> tuple[int, int | None, int, int | None]:
        return self.gate_up, self.gate_up_scale, self.down, self.down_scale


class UnitMath(ABC):
    """One expert's output for the tokens routed to it, from its unit's field views (in layout order)."""

    @abstractmethod
    def bind(self, w: ExpertWeights) -> RowFn:
        """The unit made ready once (e.g. dequantized into a reused buffer); the function runs any rows of x.
        Valid until the next `bind` of this object (buffers are shared: one forward at a time)."""

    def __call__(self, x: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
        return self.bind(w)(x)

    def bind_stacked(self, units: Sequence[ExpertWeights]) -> RowFn:
        """G units made ready at once; the function maps x [G, M, H] -> [G, M, H] (expert g on x[g]). Valid until
        the next bind. Default: each field stacked [G, ...] (one op per field) and `bind`, whose math must then
        broadcast over the leading G (the functions below do: `expert_linear`, `row_bias`)."""
        return self.bind(tuple(torch.stack(field) for field in zip(*units)))

    def fused_units(self) -> FusedUnits | None:
        """Where a fused C++ expert op finds its fields in these units; None: no such op (the torch loop runs)."""
        return None

    def loop_units(self) -> FusedUnits | None:
        """Where the decode stack's copy of the torch loop (expert_kernels.TorchExperts) finds these units' fields;
        None: the stack has no such loop for them."""
        return None

    def why_not_fused(self) -> str | None:
        """Why no fused op reads these units (`fused_units` is None), for the start-up log; None: nothing to say."""
        return None

    def dense_projections(self, w: ExpertWeights) -> tuple[tuple[torch.Tensor, torch.Tensor | None], ...] | None:
        """The units moe_q4_experts_ reads (`fused_units().spec`) as (weight [out, in] holding the values the op
        decodes, bias or None) per projection, gate_up then down (valid until the next call); None: not such
        units. The hybrid placement's GPU side computes on them (models/experts/canonical.py)."""
        return None


def expert_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x W^T for one expert (x [T, in], W [out, in]: F.linear) or G stacked ones (x [G, M, in], W [G, out, in])."""
    return F.linear(x, w) if w.dim() == 2 else torch.matmul(x, w.mT)


def row_bias(bias: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A bias [out] (one expert) or [G, out] (stacked) shaped to add to rows x [T, out] or [G, M, out]."""
    return bias if x.dim() == 2 else bias.unsqueeze(-2)


def swiglu_expert(x: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
    """Unit fields: gate_up [2I, H] (gate rows first), down [H, I] (or both stacked over G experts)."""
    gate_up, down = w[0], w[1]
    gate, up = expert_linear(x, gate_up).chunk(2, dim=-1)
    return expert_linear(F.silu(gate) * up, down)


class SwiGLUMath(UnitMath):
    """Qwen / Mixtral / OLMoE experts in the compute dtype: gate_up [2I, H] (gate rows first) and down [H, I]."""

    def bind(self, w: ExpertWeights) -> RowFn:
        return lambda x: swiglu_expert(x, w)

    def fused_units(self) -> FusedUnits:
        return FusedUnits(interleaved=False)


class InterleavedSwiGLU(UnitMath):
    """SwiGLU units whose gate_up and down are held flat in the 4-row interleaved layout of the dense C++ GEMV,
    read by `moe_swiglu_interleaved_` as one sequential stream per 4 rows (csrc/moe_experts.cpp). The torch form
    here computes on de-interleaved copies: a slow reference, never the hot path."""

    def __init__(self, hidden: int, inter: int) -> None:
        self.hidden, self.inter = hidden, inter

    def bind(self, w: ExpertWeights) -> RowFn:
        h, i = self.hidden, self.inter
        dense = (deinterleave_rows(w[0], 2 * i, h), deinterleave_rows(w[1], h, i))
        return lambda x: swiglu_expert(x, dense)

    def bind_stacked(self, units: Sequence[ExpertWeights]) -> RowFn:
        h, i = self.hidden, self.inter  # a reference form: de-interleaved per unit, then stacked
        dense = (torch.stack([deinterleave_rows(w[0], 2 * i, h) for w in units]),
                 torch.stack([deinterleave_rows(w[1], h, i) for w in units]))
        return lambda x: swiglu_expert(x, dense)

    def fused_units(self) -> FusedUnits:
        return FusedUnits(interleaved=True)


def clamped_swiglu_expert(x: torch.Tensor, w: ExpertWeights, limit: float) -> torch.Tensor:
    """DeepSeek-V4's experts (transformers' DeepseekV4Experts): SwiGLU's units with the gate clamped from above and
    the up projection to [-limit, limit] before silu(gate) * up."""
    gate, up = expert_linear(x, w[0]).chunk(2, dim=-1)
    return expert_linear(F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit), w[1])


class ClampedSwiGLUMath(UnitMath):
    """DeepSeek-V4's clamped SwiGLU experts in the compute dtype: gate_up [2I, H] (gate rows first), down [H, I]."""

    def __init__(self, limit: float) -> None:
        self.limit = limit

    def bind(self, w: ExpertWeights) -> RowFn:
        return lambda x: clamped_swiglu_expert(x, w, self.limit)

    def why_not_fused(self) -> str | None:
        return "the C++ expert ops compute SwiGLU without DeepSeek-V4's clamp"


def geglu_expert(x: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
    """Unit fields: gate_up [2I, H] (gate rows first), down [H, I]: SwiGLU's form with tanh GELU (Gemma-4)."""
    gate, up = expert_linear(x, w[0]).chunk(2, dim=-1)
    return expert_linear(F.gelu(gate, approximate="tanh") * up, w[1])


class GeGLUMath(UnitMath):
    """GeGLU experts in the compute dtype (Gemma-4): gate_up [2I, H] (gate rows first) and down [H, I]."""

    def bind(self, w: ExpertWeights) -> RowFn:
        return lambda x: geglu_expert(x, w)

    def why_not_fused(self) -> str | None:
        return "the C++ expert ops compute SwiGLU, relu2 and gpt-oss experts, not GeGLU"


def relu2_expert(x: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
    """Unit fields: up [I, H], down [H, I]: down(relu(up x)^2), no gate (Nemotron-H)."""
    return expert_linear(torch.square(F.relu(expert_linear(x, w[0]))), w[1])


class Relu2Math(UnitMath):
    """Non-gated relu2 experts in the compute dtype (Nemotron-H): up [I, H] and down [H, I]."""

    def bind(self, w: ExpertWeights) -> RowFn:
        return lambda x: relu2_expert(x, w)

    def loop_units(self) -> FusedUnits:
        return FusedUnits(interleaved=False, stack_op="relu2-loop")


def clamped_swiglu(gate_up: torch.Tensor, limit: float, alpha: float, gate_first: bool = False) -> torch.Tensor:
    """gpt-oss activation on INTERLEAVED rows of gate_up [T, 2I] (even = gate, odd = up; `gate_first`: gate rows
    then up rows, as a GGUF stores them) -> [T, I].

    gate is clamped above only, up on both sides; out = gate * sigmoid(alpha * gate) * (up + 1).
    """
    gate, up = gate_up.chunk(2, dim=-1) if gate_first else (gate_up[..., ::2], gate_up[..., 1::2])
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def gpt_oss_expert_math(x: torch.Tensor, gate_up_t: torch.Tensor, gate_up_bias: torch.Tensor,
                        down_t: torch.Tensor, down_bias: torch.Tensor, limit: float, alpha: float,
                        gate_first: bool = False) -> torch.Tensor:
    """One gpt-oss expert, operation by operation as transformers: x [T, H] @ gate_up_t [H, 2I] + bias,
    clamped SwiGLU, @ down_t [I, H] + bias -> [T, H]. The weights may be transposed views; or G experts stacked
    (x [G, M, H], weights [G, ...], biases [G, out]). `gate_first`: gate_up's columns are gate then up."""
    gate_up = x @ gate_up_t + row_bias(gate_up_bias, x)
    return clamped_swiglu(gate_up, limit, alpha, gate_first) @ down_t + row_bias(down_bias, x)


class GptOssMath(UnitMath):
    """gpt-oss experts in the compute dtype, as stored: gate_up [H, 2I], its bias, down [I, H], its bias."""

    def __init__(self, limit: float, alpha: float) -> None:
        self.limit, self.alpha = limit, alpha

    def bind(self, w: ExpertWeights) -> RowFn:
        gate_up_t, gate_up_bias, down_t, down_bias = w
        return lambda x: gpt_oss_expert_math(x, gate_up_t, gate_up_bias, down_t, down_bias, self.limit, self.alpha)


class SplitGptOssMath(UnitMath):
    """gpt-oss experts in the compute dtype as a GGUF stores them: gate_up [2I, H] (gate rows, then up rows), its
    bias, down [H, I], its bias (output-major)."""

    def __init__(self, limit: float, alpha: float) -> None:
        self.limit, self.alpha = limit, alpha

    def bind(self, w: ExpertWeights) -> RowFn:
        gate_up, gate_up_bias, down, down_bias = w
        return lambda x: gpt_oss_expert_math(x, gate_up.mT, gate_up_bias, down.mT, down_bias, self.limit,
                                             self.alpha, gate_first=True)


class InterleavedGptOss(UnitMath):
    """gpt-oss units held as gate_up [2I * H] and down [H * I] bf16, transposed to [out, in] and row-interleaved,
    each followed by its bias: read by moe_q4_experts_ (csrc/moe_experts_q4.cpp, fmt=bf16). The torch form here
    computes on de-interleaved copies: a slow reference, never the hot path."""

    def __init__(self, hidden: int, inter: int, limit: float, alpha: float, units: FusedUnits) -> None:
        self.hidden, self.inter, self.limit, self.alpha, self.units = hidden, inter, limit, alpha, units

    def _dense(self, w: ExpertWeights) -> tuple[torch.Tensor, ...]:
        h, i = self.hidden, self.inter
        return deinterleave_rows(w[0], 2 * i, h), w[1], deinterleave_rows(w[2], h, i), w[3]

    def bind(self, w: ExpertWeights) -> RowFn:
        gate_up, gate_up_bias, down, down_bias = self._dense(w)
        return lambda x: gpt_oss_expert_math(x, gate_up.t(), gate_up_bias, down.t(), down_bias, self.limit,
                                             self.alpha)

    def bind_stacked(self, units: Sequence[ExpertWeights]) -> RowFn:
        return GptOssMath(self.limit, self.alpha).bind_stacked(
            [(d[0].t(), d[1], d[2].t(), d[3]) for d in map(self._dense, units)])

    def fused_units(self) -> FusedUnits:
        return self.units

    def dense_projections(self, w: ExpertWeights) -> tuple[tuple[torch.Tensor, torch.Tensor | None], ...]:
        gate_up, gate_up_bias, down, down_bias = self._dense(w)
        return (gate_up, gate_up_bias), (down, down_bias)


# ------------------------------------------------------------------------------------ stored (quantized) formats
# (x [T, H], dense weights [out, in] per projection, bias per projection or None) -> [T, H]
ExpertMath = Callable[[torch.Tensor, tuple[torch.Tensor, ...], tuple[torch.Tensor | None, ...]], torch.Tensor]


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


class DequantizingKernel(UnitMath):
    """Units in a stored (quantized) format: dequantize each projection into a reused buffer, then the math.

    The buffers (one per projection, in the compute dtype, allocated on first use per device) are shared by
    every layer: a call finishes with them before the next call starts (one forward at a time).
    """

    def __init__(self, projections: Sequence[Projection], dtype: torch.dtype, math: ExpertMath,
                 fused: FusedUnits | str | None = None) -> None:
        self.projections, self.dtype, self.math = tuple(projections), dtype, math
        # where the C++ op reads these units as stored (models/experts/fused_spec.py), or why it cannot
        self._fused: FusedUnits | None = fused if isinstance(fused, FusedUnits) else None
        self._why_not: str | None = fused if isinstance(fused, str) else None
        self._buffers: dict[torch.device, tuple[torch.Tensor, ...]] = {}
        self._stacked: dict[tuple[torch.device, int], tuple[torch.Tensor, ...]] = {}  # (device, G) -> [G, out, in]

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

    def bind(self, w: ExpertWeights) -> RowFn:
        biases = tuple(None if p.bias_field is None else w[p.bias_field] for p in self.projections)
        dense = self.dequantize(w)
        return lambda x: self.math(x, dense, biases)

    def bind_stacked(self, units: Sequence[ExpertWeights]) -> RowFn:
        """Each unit dequantized into its slice of reused stacked buffers [G, out, in] (the formats' decoders
        take one weight each: several carry a per-tensor scale), then the math once on the stack."""
        g, device = len(units), units[0][0].device
        bufs = self._stacked.get((device, g))
        if bufs is None:
            with torch.inference_mode(False):
                bufs = tuple(torch.empty((g, *p.shape), dtype=self.dtype, device=device) for p in self.projections)
            self._stacked[(device, g)] = bufs
        for proj, buf in zip(self.projections, bufs):
            for shard in proj.shards:
                for out, w in zip(buf, units):
                    shard.fmt.dequantize({role: w[i] for role, i in shard.role_fields},
                                         out[shard.rows[0] : shard.rows[1]])
        biases = tuple(None if p.bias_field is None else torch.stack([w[p.bias_field] for w in units])
                       for p in self.projections)
        return lambda x: self.math(x, bufs, biases)

    @property
    def buffer_nbytes(self) -> int:
        return sum(p.shape[0] * p.shape[1] for p in self.projections) * self.dtype.itemsize

    def fused_units(self) -> FusedUnits | None:
        return self._fused

    def why_not_fused(self) -> str | None:
        return self._why_not

    def dense_projections(self, w: ExpertWeights) -> tuple[tuple[torch.Tensor, torch.Tensor | None], ...] | None:
        if self._fused is None or self._fused.spec is None:
            return None
        return tuple(zip(self.dequantize(w), (None if p.bias_field is None else w[p.bias_field]
                                              for p in self.projections), strict=True))


class Int8Kernel(UnitMath):
    """Units of a dense plan with every matrix as int8 codes + per-row float32 scales (quantization="int8"): the
    reference dequantizes the codes into reused buffers and runs the dense plan's math on them.

    Over SwiGLU units the fused C++ ops read the codes directly (`fused_units`): half the bytes of bf16 streamed,
    no dequantized buffer. They compute dot(codes, x) * scale in fp32, where this reference computes with
    codes * scale rounded to the compute dtype, so the two differ by that one rounding per weight.
    """

    def __init__(self, dense: UnitMath, dense_shapes: Sequence[tuple[int, ...]],
                 targets: tuple[tuple[int, int | None], ...], dtype: torch.dtype, interleaved: bool = False) -> None:
        self.dense, self.targets, self.dtype = dense, targets, dtype
        self.interleaved = interleaved  # codes held flat in pack_int8_rows' layout
        self.shapes = tuple(dense_shapes)
        self._buffers: dict[torch.device, list[torch.Tensor | None]] = {}
        self._fused: FusedUnits | None = None
        plain = dense.fused_units()
        if plain is not None and not plain.interleaved and len(targets) == 2 and all(s is not None
                                                                                      for _, s in targets):
            (gate_up, gate_up_scale), (down, down_scale) = targets
            self._fused = FusedUnits(interleaved, gate_up, gate_up_scale, down, down_scale)

    def fused_units(self) -> FusedUnits | None:
        return self._fused

    def bind_stacked(self, units: Sequence[ExpertWeights]) -> RowFn:
        """Codes and scales stacked, dequantized in one op per matrix ([G, out, in] codes x [G, out, 1] float32
        scales, cast once: the bits of `dequantize_int8_per_channel`), then the dense math on the stack."""
        dense = []
        for shape, (index, scale_index) in zip(self.shapes, self.targets):
            if scale_index is None:
                dense.append(torch.stack([w[index] for w in units]))
                continue
            codes = torch.stack([unpack_int8_rows(w[index], *shape) if self.interleaved else w[index]
                                 for w in units])
            scales = torch.stack([w[scale_index] for w in units])
            weight = torch.empty(codes.shape, dtype=self.dtype, device=codes.device)
            weight.copy_(codes)
            dense.append(weight.mul_(scales[..., None]))
        return self.dense.bind(tuple(dense))

    def bind(self, w: ExpertWeights) -> RowFn:
        bufs = self._buffers.get(w[0].device)
        if bufs is None:
            with torch.inference_mode(False):
                bufs = [None if s is None else torch.empty(shape, dtype=self.dtype, device=w[0].device)
                        for shape, (_, s) in zip(self.shapes, self.targets)]
            self._buffers[w[0].device] = bufs
        dense = []
        for buf, (index, scale_index) in zip(bufs, self.targets):
            if buf is None or scale_index is None:
                dense.append(w[index])
            else:
                codes = unpack_int8_rows(w[index], *buf.shape) if self.interleaved else w[index]
                dequantize_int8_per_channel(codes, w[scale_index], buf)
                dense.append(buf)
        return self.dense.bind(tuple(dense))
