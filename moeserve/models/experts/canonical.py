"""The GPU side of the hybrid placement: SwiGLU experts computed in the canonical order, in torch ops.

An expert's output must not depend on which device computed it (a cache that warms would change the answer), so
the GPU computes each expert with the same numbers as the CPU's C++ ops (csrc/moe_interleaved.h, moe_plain.h):

    gu  = round_bf16(dot(gate_up row, x) [* row scale])        for the 2I rows (gate rows first, then up)
    act = round_bf16(round_bf16(silu(g)) * u)                  silu(g) = g / (1 + expf(-g)) in fp32
    d   = dot(down row, act) [* row scale]                     for the H rows
    contribution = round_bf16(round_bf16(d) * routing weight)  added into the token's row in ascending expert order

where every dot is csrc/canonical_dot.h's order: 16 fp32 lanes over the 32-element chunks in order, each lane
taking its odd element then its even one with one rounding per fused multiply-add (inputs with a zero exponent
read as zeros, results below 2^-126 flushed after rounding), then a fixed halving sum; int8 codes are their own
(exact) bf16 values in the same order, the row's fp32 dot then times its scale. Here a lane step is computed in
float64 (a product of two bf16 is exact, and the sum rounded to 53 bits then to 24 is the correctly rounded fp32
sum, as canonical_dot.h's scalar reference argues), and silu takes a table of all 65536 bf16 inputs made with the
C library's own expf (the function the C++ ops call), so the same torch code is the CPU reference of the GPU kernel
and runs on a GPU as it stands (float64 lanes: correct on any device, not fast; its GPU speed is unmeasured).

`CanonicalExperts.contributions` gives each (token, expert) pair's contribution; `run` adds them in expert order
(kernels.add_in_expert_order: one rounding per add, the C++ op's adds). tests/models/test_canonical_experts.py
checks it against the C++ ops bit for bit.
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


def silu_table() -> torch.Tensor:
    """fp32 silu(g) for every bf16 bit pattern g (index: the bits as uint16), as the C++ ops compute it:
    g / (1 + expf(-g)) in fp32 with the C library's expf."""
    libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    libm.expf.restype, libm.expf.argtypes = ctypes.c_float, [ctypes.c_float]
    g = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    e = torch.tensor([libm.expf(-v) for v in g.tolist()], dtype=torch.float32)
    return g / (1.0 + e)  # fp32 add and divide: one rounding each, as in C++


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
    """SwiGLU units (bf16, or int8 codes with fp32 row scales; plain [out, in] or 4-row interleaved: `units`)
    computed in the canonical order on the units' device (module docstring)."""

    name = "canonical"

    def __init__(self, math: UnitMath, units: FusedUnits) -> None:
        super().__init__(math)
        self.units = units
        self._silu: dict[torch.device, torch.Tensor] = {}  # the table, per device it was needed on

    @staticmethod
    def why_not(units: FusedUnits | None, dtype: torch.dtype) -> str | None:
        """None when these units have a canonical form on both devices (SwiGLU units of the fused C++ op, bf16 or
        int8, computed in bf16), else why not (one line)."""
        if dtype != torch.bfloat16:
            return f"the canonical expert order is bf16's (compute dtype {str(dtype).removeprefix('torch.')})"
        if units is not None and units.spec is not None:
            return "4-bit and gpt-oss units (moe_q4_experts_): no canonical GPU kernel for them yet"
        if units is None or units.stack_op != "fused":
            return "units without a fused C++ SwiGLU op (stored formats, relu2): no canonical GPU kernel for them yet"
        return None

    def _matrix(self, w: ExpertWeights, field: int, rows: int, k: int) -> torch.Tensor:
        t = w[field]
        if not self.units.interleaved:
            return t.view(rows, k)
        return unpack_int8_rows(t, rows, k) if self.units.int8 else deinterleave_rows(t, rows, k)

    def expert(self, x: torch.Tensor, w: ExpertWeights, weight: torch.Tensor) -> torch.Tensor:
        """[T, H] bf16: the contributions of one expert to its tokens' rows x [T, H], routing weights [T]."""
        u = self.units
        hidden = x.shape[1]
        inter = w[u.gate_up].numel() // (2 * hidden)
        gu = canonical_dots(self._matrix(w, u.gate_up, 2 * inter, hidden), x)  # [T, 2I]
        if u.gate_up_scale is not None:
            gu = gu * w[u.gate_up_scale]
        gu = gu.bfloat16()
        table = self._silu.get(x.device)
        if table is None:
            table = self._silu[x.device] = silu_table().to(x.device)
        g, up = gu[:, :inter], gu[:, inter:]
        silu = table[g.view(torch.int16).long() & 0xFFFF].bfloat16()
        act = (silu.float() * up.float()).bfloat16()
        d = canonical_dots(self._matrix(w, u.down, hidden, inter), act)  # [T, H]
        if u.down_scale is not None:
            d = d * w[u.down_scale]
        return (d.bfloat16().float() * weight.float()[:, None]).bfloat16()

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
        kind = ("int8 " if self.units.int8 else "bf16 ") + ("interleaved" if self.units.interleaved else "[out, in]")
        return f"canonical ({kind} SwiGLU units, canonical_dot.h's order in torch ops; experts added in ascending order)"
