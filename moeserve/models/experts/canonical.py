"""The GPU side of the hybrid placement: experts computed in the canonical order of the CPU's C++ ops, in torch ops.

An expert's output must not depend on which device computed it (a cache that warms would change the answer), so
the GPU computes each expert with the same numbers as the CPU's C++ ops (csrc/moe_interleaved.h, moe_plain.h):

    gu  = round_bf16(dot(gate_up row, x) [* row scale])        for the 2I rows (gate rows first, then up)
    act = round_bf16(round_bf16(silu(g)) * u)                  silu(g) = g / (1 + expf(-g)) in fp32
    d   = dot(down row, act) [* row scale]                     for the H rows
    contribution = round_bf16(round_bf16(d) * routing weight)  added into the token's row in ascending expert order

(units read by moe_q4_experts_, csrc/moe_experts_q4.cpp: 4-bit formats and gpt-oss, take the weights as the op
decodes them, `UnitMath.dense_projections`, a bias after each projection's rounding, and the op's swiglu, relu2 or
gpt-oss clamped-SwiGLU activation with the same roundings) where every dot is csrc/canonical_dot.h's order: 16 fp32 lanes over the 32-element chunks in order, each lane
taking its odd element then its even one with one rounding per fused multiply-add (inputs with a zero exponent
read as zeros, results below 2^-126 flushed after rounding), then a fixed halving sum; int8 codes are their own
(exact) bf16 values in the same order, the row's fp32 dot then times its scale. Here a lane step is computed in
float64 (a product of two bf16 is exact, and the sum rounded to 53 bits then to 24 is the correctly rounded fp32
sum, as canonical_dot.h's scalar reference argues), and silu and sigmoid take tables of all 65536 bf16 inputs made
with the C library's own expf (the function the C++ ops call), so the same torch code is the CPU reference of the GPU kernel
and runs on a GPU as it stands (float64 lanes: correct on any device, not fast; its GPU speed is unmeasured).

`CanonicalExperts.contributions` gives each (token, expert) pair's contribution; `run` adds them in expert order
(kernels.add_in_expert_order: one rounding per add, the C++ op's adds). tests/models/test_canonical_experts.py
and tests/engine/test_hybrid.py (a model's own units in every format) check it against the C++ ops bit for bit.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Iterable

import torch

from moeserve.experts.store import ExpertWeights
from moeserve.models.experts.kernels import Chunk, ExpertKernel, RoutedTokens, add_in_expert_order
from moeserve.models.experts.unit_math import FusedUnits, UnitMath
from moeserve.models.layers.linear import deinterleave_rows, unpack_int8_rows

TINY = 2.0**-126  # the smallest normal fp32
ROW_BLOCK = 64  # token rows per pass: bounds the float64 lanes [rows, out rows, 16] a dot holds


def expf_tables() -> torch.Tensor:
    """[2, 65536] fp32: silu(v) = v / (1 + expf(-v)) and sigmoid(v) = 1 / (1 + expf(-v)) for every bf16 bit pattern
    v (index: the bits as uint16), as the C++ ops compute them, with the C library's expf."""
    libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    libm.expf.restype, libm.expf.argtypes = ctypes.c_float, [ctypes.c_float]
    v = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    one_plus = 1.0 + torch.tensor([libm.expf(-x) for x in v.tolist()], dtype=torch.float32)  # fp32: one rounding
    return torch.stack([v / one_plus, 1.0 / one_plus])


def _number(word: str) -> float:
    """A spec number: decimal or C99 hex ("0x1.b3b6p+0"), as the op's strtof reads it (then rounded to fp32)."""
    return float.fromhex(word) if "x" in word.lower() else float(word)


def _lookup(table: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """table[bits of the bf16 values v]."""
    return table[v.view(torch.int16).long() & 0xFFFF]


def _with_bias(v: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """bf16(dot), then bf16(that + bias) where there is a bias (x @ W, then + b, in bf16)."""
    v = v.bfloat16()
    return v if bias is None else (v.float() + bias.float()).bfloat16()


def _daz(v: torch.Tensor) -> torch.Tensor:
    """bf16 values as fp32, a zero exponent read as a zero of the same sign (vdpbf16ps' DAZ)."""
    f = v.float()
    return torch.where(f.abs() < TINY, f * 0.0, f)


def _round_ftz(s: torch.Tensor) -> torch.Tensor:
    """A float64 lane sum to fp32 as the canonical F rounds it: once, nearest-even; a result whose magnitude,
    rounded with an unbounded exponent, is below 2^-126 becomes a zero of its sign (else the smallest normal)."""
    f = s.float()
    scaled = (s * 2.0**100).float()  # |s| < 2^-126 lands in the normal range: its rounding with an unbounded exponent
    flushed = torch.where(scaled.abs() < 2.0**-26, torch.zeros_like(f), torch.full_like(f, TINY))
    return torch.where(s.abs() < TINY, torch.copysign(flushed, f), f)


def canonical_dots(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[P, R] fp32: the canonical dot of each row of w [R, K] with each row of x [P, K] (bf16 values, or int8 codes
    as exact values; K zero-padded to whole 32-element chunks as the C++ ops pad)."""
    r, k = w.shape
    pad = -k % 32
    wd = torch.nn.functional.pad(_daz(w), (0, pad)).double().view(r, -1, 16, 2)
    out = []
    for p0 in range(0, x.shape[0], ROW_BLOCK):
        xd = torch.nn.functional.pad(_daz(x[p0 : p0 + ROW_BLOCK]), (0, pad)).double().view(-1, 1, wd.shape[1], 16, 2)
        lanes = torch.zeros(xd.shape[0], r, 16, dtype=torch.float32, device=w.device)
        for c in range(wd.shape[1]):
            for j in (1, 0):  # vdpbf16ps: the odd element, then the even one
                lanes = _round_ftz(lanes.double() + xd[:, :, c, :, j] * wd[None, :, c, :, j])
        s8 = lanes[..., 8:] + lanes[..., :8]  # _mm512_reduce_add_ps's tree, plain fp32 adds
        s4 = s8[..., 4:] + s8[..., :4]
        s2 = s4[..., :2] + s4[..., 2:]
        out.append(s2[..., 0] + s2[..., 1])
    return torch.cat(out)


class CanonicalExperts(ExpertKernel):
    """SwiGLU units (bf16, or int8 codes with fp32 row scales; plain [out, in] or 4-row interleaved: `units`), and
    the units of moe_q4_experts_ (4-bit formats, gpt-oss; `units.spec`: as `UnitMath.dense_projections` decodes
    them, with that op's activations and biases, csrc/moe_experts_q4.cpp), computed in the canonical order on the
    units' device (module docstring)."""

    name = "canonical"

    def __init__(self, math: UnitMath, units: FusedUnits) -> None:
        super().__init__(math)
        self.units = units
        self._tables: dict[torch.device, torch.Tensor] = {}  # expf_tables, per device it was needed on
        words = dict(w.split("=", 1) for w in (units.spec or "").split())
        self.act = words.get("act", "swiglu")
        # the op parses alpha and limit as fp32; torch.clamp casts its bound to bf16
        self.alpha = torch.tensor(_number(words.get("alpha", "1")), dtype=torch.float32)
        self.limit = torch.tensor(_number(words.get("limit", "0")), dtype=torch.float32).bfloat16().float()

    @staticmethod
    def why_not(units: FusedUnits | None, dtype: torch.dtype) -> str | None:
        """None when these units have a canonical form on both devices (SwiGLU units of the fused C++ op, bf16 or
        int8, computed in bf16), else why not (one line)."""
        if dtype != torch.bfloat16:
            return f"the canonical expert order is bf16's (compute dtype {str(dtype).removeprefix('torch.')})"
        if units is not None and units.spec is not None:
            return None
        if units is None or units.stack_op != "fused":
            return "units without a fused C++ expert op (e.g. bf16 relu2): no canonical GPU kernel for them"
        return None

    def _matrix(self, w: ExpertWeights, field: int, rows: int, k: int) -> torch.Tensor:
        t = w[field]
        if not self.units.interleaved:
            return t.view(rows, k)
        return unpack_int8_rows(t, rows, k) if self.units.int8 else deinterleave_rows(t, rows, k)

    def expert(self, x: torch.Tensor, w: ExpertWeights, weight: torch.Tensor) -> torch.Tensor:
        """[T, H] bf16: the contributions of one expert to its tokens' rows x [T, H], routing weights [T]."""
        u = self.units
        if u.spec is not None:
            return self._q4_expert(x, w, weight)
        hidden = x.shape[1]
        inter = w[u.gate_up].numel() // (2 * hidden)
        gu = canonical_dots(self._matrix(w, u.gate_up, 2 * inter, hidden), x)  # [T, 2I]
        if u.gate_up_scale is not None:
            gu = gu * w[u.gate_up_scale]
        gu = gu.bfloat16()
        act = self._activation(gu, x.device)
        d = canonical_dots(self._matrix(w, u.down, hidden, inter), act)  # [T, H]
        if u.down_scale is not None:
            d = d * w[u.down_scale]
        return (d.bfloat16().float() * weight.float()[:, None]).bfloat16()

    def _q4_expert(self, x: torch.Tensor, w: ExpertWeights, weight: torch.Tensor) -> torch.Tensor:
        projections = self.math.dense_projections(w)
        assert projections is not None  # why_not: units with a spec come from maths that decode them
        (gu_w, gu_bias), (dn_w, dn_bias) = projections
        gu = _with_bias(canonical_dots(gu_w, x), gu_bias)  # [T, R1]
        d = _with_bias(canonical_dots(dn_w, self._activation(gu, x.device)), dn_bias)  # [T, H]
        return (d.float() * weight.float()[:, None]).bfloat16()

    def _activation(self, gu: torch.Tensor, device: torch.device) -> torch.Tensor:
        """a [T, I] bf16 from the gate_up outputs gu [T, R1] (bf16), with the C++ ops' roundings."""
        tables = self._tables.get(device)
        if tables is None:
            tables = self._tables[device] = expf_tables().to(device)
        if self.act == "relu2":
            u = gu.float()
            return torch.where((u > 0) | u.isnan(), u, torch.zeros_like(u)).square().bfloat16()
        if self.act.startswith("gptoss"):  # gate and up rows interleaved (split: gate rows then up rows); gate
            inter = gu.shape[1] // 2  # clamped above, up on both sides
            g, u = (gu[:, :inter], gu[:, inter:]) if self.act == "gptoss-split" else (gu[:, 0::2], gu[:, 1::2])
            g, u = g.float(), u.float()
            lim = self.limit.to(device)
            g = torch.where(g.isnan(), g, torch.minimum(g, lim))
            u = torch.where(u.isnan(), u, torch.minimum(torch.maximum(u, -lim), lim))
            sig = _lookup(tables[1], (g * self.alpha.to(device)).bfloat16()).bfloat16()
            glu = (g * sig.float()).bfloat16()
            return ((u + 1.0).bfloat16().float() * glu.float()).bfloat16()
        inter = gu.shape[1] // 2  # swiglu: gate rows, then up rows
        silu = _lookup(tables[0], gu[:, :inter]).bfloat16()
        return (silu.float() * gu[:, inter:].float()).bfloat16()

    def contributions(self, y: torch.Tensor, routed: RoutedTokens, chunks: Iterable[Chunk]) -> None:
        """y[p] = pair p's contribution for every pair of the chunks' experts (y [pairs, H], in pair order)."""
        for chunk in chunks:
            for e, w in chunk:
                lo, hi = routed.spans[e]
                y[lo:hi] = self.expert(routed.x[routed.token_of[lo:hi]], w, routed.weight_of[lo:hi])

    def run(self, out: torch.Tensor, routed: RoutedTokens, chunks: Iterable[Chunk]) -> None:
        y = routed.x.new_zeros(len(routed.token_of), routed.x.shape[1], dtype=torch.bfloat16)
        self.contributions(y, routed, chunks)
        add_in_expert_order(out, routed.token_of, y)

    def describe(self) -> str:
        if self.units.spec is not None:
            return (f"canonical ({self.units.spec.split()[0]} units as moe_q4_experts_ decodes them, {self.act}; "
                    "canonical_dot.h's order in torch ops; experts added in ascending order)")
        kind = ("int8 " if self.units.int8 else "bf16 ") + ("interleaved" if self.units.interleaved else "[out, in]")
        return f"canonical ({kind} SwiGLU units, canonical_dot.h's order in torch ops; experts added in ascending order)"
