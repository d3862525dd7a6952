"""Expert compute: one `ExpertKernel` per way of running a MoE layer's experts, chosen once when the model is built.

    kernel.run(out, routed, chunks)   # adds every routed expert's weighted output into out

`routed` (RoutedTokens) is the layer's routing: each (token, expert) pair grouped by expert, ascending, each
expert's tokens in token order; `chunks` is what `ExpertStore.experts` yields for those experts (units in
ascending expert order, in as many chunks as the cache needs). Every kernel adds the experts in ascending id order
with one rounding per add, so where the experts live never changes a bit of the result.

| kernel            | units                                  | op                                       |
|-------------------|----------------------------------------|------------------------------------------|
| torch             | any (the plan's UnitMath)              | per-expert torch loop (CUDA, kernels=torch, formats without a fused op) |
| cpp-swiglu        | SwiGLU [out, in], bf16/fp32 or int8    | moe_swiglu_ / moe_swiglu_int8_ (decode-sized batches; the torch loop above 64 tokens unless batch-invariant) |
| cpp-interleaved   | SwiGLU 4-row interleaved, bf16 or int8 | moe_swiglu_interleaved_ / moe_swiglu_int8_interleaved_ (any batch) |

`choose_expert_kernel` is the only place that asks what the units are (UnitMath.fused_units). The MoE layer and the
decode stack call the interface; `stack_units` tells the decode stack (csrc/decode_stack.cpp) which fields it reads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from moeserve.experts.store import ExpertWeights
from moeserve.models.linear import in_row_blocks
from moeserve.models.unit_math import FusedUnits, UnitMath

Chunk = list[tuple[int, ExpertWeights]]  # (expert id, its unit's field views), ascending ids

# Batches of more tokens than this run the per-expert torch loop (oneDNN GEMMs) instead of the plain fused C++ op,
# which is built for decode: it reads each weight row once for all of an expert's tokens, but re-reads the tokens per
# row. (The interleaved op is tiled for any batch.)
FUSED_MAX_TOKENS = 64


@dataclass(frozen=True)
class RoutedTokens:
    """A MoE layer's routing of the tokens x [N, H]: the (token, expert) pairs grouped by expert, ascending."""

    x: torch.Tensor  # [N, H], contiguous
    ids: torch.Tensor  # [N, k] expert ids per token
    token_of: torch.Tensor  # [N*k] token index of each pair
    weight_of: torch.Tensor  # [N*k] routing weight of each pair (the router's dtype)
    spans: dict[int, tuple[int, int]]  # expert id -> its pairs' range in token_of / weight_of

    @staticmethod
    def from_counts(x: torch.Tensor, ids: torch.Tensor, token_of: torch.Tensor, weight_of: torch.Tensor,
                    counts: list[int]) -> RoutedTokens:
        spans, start = {}, 0
        for e, c in enumerate(counts):
            if c:
                spans[e] = (start, start + c)
                start += c
        return RoutedTokens(x.contiguous(), ids, token_of, weight_of, spans)

    @property
    def experts(self) -> list[int]:
        """The experts any token chose, ascending."""
        return list(self.spans)

    @property
    def num_tokens(self) -> int:
        return self.x.shape[0]


class ExpertKernel(ABC):
    """Runs a MoE layer's experts for its routed tokens. `math`: the units' reference computation (UnitMath)."""

    name: str = ""

    def __init__(self, math: UnitMath) -> None:
        self.math = math

    @abstractmethod
    def run(self, out: torch.Tensor, routed: RoutedTokens, chunks: Iterable[Chunk]) -> None:
        """out [N, H] += each expert's output for its tokens times their routing weights, in ascending expert order."""

    @property
    def stack_units(self) -> FusedUnits | None:
        """The unit fields the fused decode stack reads (the same C++ op as `run`); None: the stack cannot run them."""
        return None

    def describe(self) -> str:
        """One line for the start-up log."""
        return self.name


class TorchExperts(ExpertKernel):
    """The per-expert loop with torch: the plan's UnitMath on each expert's rows. Batch-invariant: in fixed
    blocks of rows (linear.ROW_BLOCK), so a row's result never depends on how many rows share the call."""

    name = "torch"

    def __init__(self, math: UnitMath, invariant: bool) -> None:
        super().__init__(math)
        self.invariant = invariant

    def run(self, out: torch.Tensor, routed: RoutedTokens, chunks: Iterable[Chunk]) -> None:
        x, token_of, weight_of = routed.x, routed.token_of, routed.weight_of
        for chunk in chunks:
            for e, w in chunk:
                lo, hi = routed.spans[e]
                tokens = token_of[lo:hi]
                fn = self.math.bind(w)  # per-unit work (dequantization) once, whatever the number of row blocks
                rows = x[tokens]
                y = (in_row_blocks(fn, rows) if self.invariant else fn(rows)) * weight_of[lo:hi, None]
                # A token picks an expert at most once, so `tokens` has no repeats and a gathered add is the
                # same single rounding as index_add_, whose CPU kernel is slow for bf16.
                out[tokens] += y.to(out.dtype)

    def describe(self) -> str:
        return f"torch ({type(self.math).__name__} per expert{', in fixed row blocks' if self.invariant else ''})"


class _FusedSwiGLU(ExpertKernel):
    """One C++ call per chunk: every expert's SwiGLU for its tokens, weighted, added into `out` in ascending
    expert order with the roundings of the torch loop (csrc/moe_experts.cpp)."""

    def __init__(self, math: UnitMath, units: FusedUnits, op: Callable[..., object]) -> None:
        super().__init__(math)
        self.units, self._op = units, op
        self._fields = tuple(f for f in units.fields if f is not None)  # gate_up, [its scales], down, [its scales]

    @property
    def stack_units(self) -> FusedUnits:
        return self.units

    def run(self, out: torch.Tensor, routed: RoutedTokens, chunks: Iterable[Chunk]) -> None:
        weight_of = routed.weight_of.float()
        for chunk in chunks:
            spans = [i for e, _ in chunk for i in routed.spans[e]]
            fields = [[w[f] for _, w in chunk] for f in self._fields]
            self._op(out, routed.x, *fields, routed.token_of, weight_of, spans)



class CppSwiGLU(_FusedSwiGLU):
    """SwiGLU units as [out, in] matrices (bf16 / fp32, or int8 codes with scales) for decode-sized batches; the
    torch loop above FUSED_MAX_TOKENS tokens, unless batch-invariant (then the op runs every batch: one order)."""

    def __init__(self, units: FusedUnits, fallback: TorchExperts) -> None:
        ops = torch.ops.moeserve
        super().__init__(fallback.math, units, ops.moe_swiglu_int8_ if units.int8 else ops.moe_swiglu_)
        self.fallback = fallback
        self.name = "cpp-swiglu" + ("-int8" if units.int8 else "")

    def run(self, out: torch.Tensor, routed: RoutedTokens, chunks: Iterable[Chunk]) -> None:
        if routed.num_tokens > FUSED_MAX_TOKENS and not self.fallback.invariant:
            self.fallback.run(out, routed, chunks)
        else:
            super().run(out, routed, chunks)

    def describe(self) -> str:
        return (f"{self.name} (the fused C++ op on [out, in] units up to {FUSED_MAX_TOKENS} tokens"
                + (", every batch: batch-invariant)" if self.fallback.invariant else ", the torch loop above)"))


class CppInterleavedSwiGLU(_FusedSwiGLU):
    """SwiGLU units held 4-row interleaved (bf16, or int8 codes with scales): the fused C++ op at any batch."""

    def __init__(self, math: UnitMath, units: FusedUnits) -> None:
        ops = torch.ops.moeserve
        super().__init__(math, units,
                         ops.moe_swiglu_int8_interleaved_ if units.int8 else ops.moe_swiglu_interleaved_)
        self.name = "cpp-interleaved" + ("-int8" if units.int8 else "")

    def describe(self) -> str:
        return f"{self.name} (the fused C++ op on row-interleaved units, every batch)"


def choose_expert_kernel(math: UnitMath, cpp: bool, dtype: torch.dtype, invariant: bool) -> ExpertKernel:
    """The kernel for units computed by `math`: a fused C++ op where the units and the compute dtype allow it and
    the C++ kernels are on (`cpp`), else the torch loop."""
    torch_loop = TorchExperts(math, invariant)
    units = math.fused_units()
    if not cpp or units is None:
        return torch_loop
    if units.interleaved:
        return CppInterleavedSwiGLU(math, units)
    if dtype in (torch.bfloat16, torch.float32):
        return CppSwiGLU(units, torch_loop)
    return torch_loop
