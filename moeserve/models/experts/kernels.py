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
| cpp-q4            | MXFP4 / NVFP4 / INT4 / GGUF blocks as stored, gpt-oss bf16 interleaved | moe_q4_experts_ (any batch; SwiGLU, gpt-oss's clamped SwiGLU with biases, relu2) |
| batched           | any (UnitMath.bind_stacked)            | GPU: groups of min(top_k, GROUP) experts x ENTRY_ROWS tokens per batched matmul |

`choose_expert_kernel` is the only place that asks what the units are (UnitMath.fused_units). The MoE layer and the
decode stack call the interface; `stack_units` tells the decode stack (csrc/decode_stack.cpp) which fields it reads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from moeserve.experts.placement import Costs, PlacementStats
from moeserve.experts.store import ExpertStore, ExpertWeights
from moeserve.models.experts.unit_math import FusedUnits, UnitMath
from moeserve.models.numerics import Numerics

Chunk = list[tuple[int, ExpertWeights]]  # (expert id, its unit's field views), ascending ids

# Batches of more tokens than this run the per-expert torch loop (oneDNN GEMMs) instead of the plain fused C++ op,
# which is built for decode: it reads each weight row once for all of an expert's tokens, but re-reads the tokens per
# row. (The interleaved op is tiled for any batch.)
FUSED_MAX_TOKENS = 64

# The batched kernel's one call shape: `group` entries (an expert's block of tokens each) of ENTRY_ROWS rows, group =
# the model's top_k up to GROUP: one token's experts at a layer are one call, with no padding entry whose weights
# the call would read for nothing (decode on a GPU is bound by reading the weights).
GROUP, ENTRY_ROWS = 8, 16
CPU = torch.device("cpu")


@dataclass(frozen=True)
class RoutedTokens:
    """A MoE layer's routing of the tokens x [N, H]: the (token, expert) pairs grouped by expert, ascending."""

    x: torch.Tensor  # [N, H], contiguous
    ids: torch.Tensor  # [N, k] expert ids per token
    token_of: torch.Tensor  # [N*k] token index of each pair
    weight_of: torch.Tensor  # [N*k] routing weight of each pair (the router's dtype)
    spans: dict[int, tuple[int, int]]  # expert id -> its pairs' range in token_of / weight_of
    batch_tokens: int = 0  # the whole batch's tokens when x holds a part of them (expert parallelism), else 0

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
        """The batch's tokens (what a kernel that chooses by batch size looks at)."""
        return self.batch_tokens or self.x.shape[0]


class ExpertKernel(ABC):
    """Runs a MoE layer's experts for its routed tokens. `math`: the units' reference computation (UnitMath)."""

    name: str = ""

    def __init__(self, math: UnitMath) -> None:
        self.math = math

    @abstractmethod
    def run(self, out: torch.Tensor, routed: RoutedTokens, chunks: Iterable[Chunk]) -> None:
        """out [N, H] += each expert's output for its tokens times their routing weights, in ascending expert order."""

    def compute(self, out: torch.Tensor, routed: RoutedTokens, store: ExpertStore, layer: int,
                prefetch: tuple[int, Sequence[int]] | None = None) -> None:
        """`run` on the units `store` lends for `layer` (the MoE layer's call). The hybrid kernel
        (models/experts/hybrid.py) overrides it: it asks the store for some experts and computes others where they
        sit."""
        self.run(out, routed, store.experts(layer, routed.experts, prefetch=prefetch))

    @property
    def stack_units(self) -> FusedUnits | None:
        """The unit fields the fused decode stack reads (the same C++ op as `run`); None: the stack cannot run them."""
        return None

    def why_not_stacked(self) -> str | None:
        """Why the fused decode stack cannot run this kernel whatever its units (one line), or None."""
        return None

    def describe(self) -> str:
        """One line for the start-up log."""
        return self.name

    def close(self) -> None:
        """Stop any thread of this kernel's own (the hybrid's CPU worker); the model is closing. Idempotent."""
        return None

    def placement_stats(self) -> tuple[PlacementStats, Costs] | None:
        """Where this kernel's experts were computed, and the costs it weighs (/metrics); None: all where held."""
        return None


class TorchExperts(ExpertKernel):
    """The per-expert loop with torch: the plan's UnitMath on each expert's rows. Batch-invariant: in fixed
    blocks of rows (Numerics.rows), so a row's result never depends on how many rows share the call."""

    name = "torch"

    def __init__(self, math: UnitMath, numerics: Numerics) -> None:
        super().__init__(math)
        self.numerics = numerics

    def run(self, out: torch.Tensor, routed: RoutedTokens, chunks: Iterable[Chunk]) -> None:
        x, token_of, weight_of = routed.x, routed.token_of, routed.weight_of
        for chunk in chunks:
            for e, w in chunk:
                lo, hi = routed.spans[e]
                tokens = token_of[lo:hi]
                fn = self.math.bind(w)  # per-unit work (dequantization) once, whatever the number of row blocks
                rows = x[tokens]
                y = self.numerics.rows(fn, rows) * weight_of[lo:hi, None]
                # A token picks an expert at most once, so `tokens` has no repeats and a gathered add is the
                # same single rounding as index_add_, whose CPU kernel is slow for bf16.
                out[tokens] += y.to(out.dtype)

    @property
    def stack_units(self) -> FusedUnits | None:
        """The decode stack runs this loop's ATen ops for the units whose math it has (UnitMath.loop_units)."""
        return self.math.loop_units()

    def describe(self) -> str:
        blocks = ", in fixed row blocks" if self.numerics.batch_invariant else ""
        why = self.math.why_not_fused()
        return f"torch ({type(self.math).__name__} per expert{blocks}{'' if why is None else f'; no fused op: {why}'})"


class BatchedExperts(ExpertKernel):
    """The GPU experts: a chunk's experts in batched calls of exactly `group` entries x ENTRY_ROWS rows, each
    entry one expert's block of tokens (its units stacked and dequantized once per call, `UnitMath.bind_stacked`,
    then one batched matmul per projection), instead of one call per expert.

    Where the experts live never changes a bit: resident (one chunk) and offloaded (chunks as the cache allows)
    group the experts differently, so no call's shape may depend on the grouping. Every grouped call has the one
    shape [group, ENTRY_ROWS, H] (the last group padded by repeating a unit, its results dropped), so an expert's
    block gets the same kernel whatever its neighbours (a batched matmul computes each batch entry alone); an
    expert with more than ENTRY_ROWS tokens runs alone on its own rows (a shape set by that expert only), or,
    batch-invariant, in ENTRY_ROWS blocks like the rest. Outputs are added in rounds, round r adding each token's
    r-th expert of the chunk, so every token still gets its experts in ascending order, one rounding per add.
    """

    name = "batched"

    def __init__(self, math: UnitMath, numerics: Numerics, why: str, group: int = GROUP) -> None:
        super().__init__(math)
        self.numerics = numerics  # batch-invariant: every expert in ENTRY_ROWS blocks, however many tokens it has
        self.why, self.group = why, group

    def run(self, out: torch.Tensor, routed: RoutedTokens, chunks: Iterable[Chunk]) -> None:
        for chunk in chunks:
            first, last = routed.spans[chunk[0][0]][0], routed.spans[chunk[-1][0]][1]
            y = routed.x.new_empty(last - first, routed.x.shape[1])  # each pair's output, in pair order
            entries: list[tuple[ExpertWeights, int, int]] = []  # (unit, first pair, end pair), <= ENTRY_ROWS
            for e, w in chunk:
                lo, hi = routed.spans[e]
                if hi - lo > ENTRY_ROWS and not self.numerics.batch_invariant:
                    y[lo - first : hi - first] = self.math.bind(w)(routed.x[routed.token_of[lo:hi]])
                else:
                    entries += [(w, s, min(s + ENTRY_ROWS, hi)) for s in range(lo, hi, ENTRY_ROWS)]
            for g in range(0, len(entries), self.group):
                self._run_group(entries[g : g + self.group], routed, y, first)
            add_in_expert_order(out, routed.token_of[first:last], y * routed.weight_of[first:last, None])

    def _run_group(self, entries: list[tuple[ExpertWeights, int, int]], routed: RoutedTokens, y: torch.Tensor,
                   first: int) -> None:
        """One call of `group` entries: y[pair - first] = that pair's expert output, for every pair of `entries`."""
        units = [w for w, _, _ in entries]
        group = self.group
        units += [units[-1]] * (group - len(units))  # the call's shape never changes: padding repeats a unit
        pairs: list[int] = []  # the pair of each of the group x ENTRY_ROWS rows (padding: the group's first)
        rows: list[int] = []  # the rows holding real pairs
        for g, (_, lo, hi) in enumerate(entries):
            pairs += list(range(lo, hi)) + [entries[0][1]] * (ENTRY_ROWS - (hi - lo))
            rows += range(g * ENTRY_ROWS, g * ENTRY_ROWS + hi - lo)
        pairs += [entries[0][1]] * (group * ENTRY_ROWS - len(pairs))
        device = routed.x.device
        pair_index = torch.tensor(pairs, device=device)
        x = routed.x[routed.token_of[pair_index]].view(group, ENTRY_ROWS, -1)
        out = self.math.bind_stacked(units)(x).flatten(0, 1)  # [group * ENTRY_ROWS, H]
        real = torch.tensor(rows, device=device)
        y[pair_index[real] - first] = out[real]

    def describe(self) -> str:
        blocks = "every expert" if self.numerics.batch_invariant else f"experts of <= {ENTRY_ROWS} tokens"
        return (f"batched ({self.why}: {type(self.math).__name__} stacked, {blocks} in calls of {self.group} x "
                f"{ENTRY_ROWS} rows; experts added in ascending order)")


def add_in_expert_order(out: torch.Tensor, tokens: torch.Tensor, y: torch.Tensor) -> None:
    """out[tokens[p]] += y[p] for the pairs p of consecutive experts (ascending, each expert's tokens ascending):
    each token's adds in its experts' order, one rounding each, as the per-expert loop; in as many rounds as a
    token has experts here (a round's tokens are distinct, so a gathered add is the one rounding)."""
    y = y.to(out.dtype)
    order = torch.sort(tokens, stable=True).indices  # each token's pairs together, still in expert order
    by_token = tokens[order]
    rank = torch.empty_like(tokens)
    rank[order] = torch.arange(len(tokens), device=tokens.device) - torch.searchsorted(by_token, by_token)
    rounds = torch.sort(rank, stable=True).indices
    start = 0
    for count in torch.bincount(rank).tolist():  # one device sync per chunk
        sel = rounds[start : start + count]
        out[tokens[sel]] += y[sel]
        start += count


def batched_workspace_bytes(hidden: int, inter: int, itemsize: int, unit_nbytes: int) -> int:
    """A bound on what BatchedExperts holds at once besides activations: its GROUP stacked units as stored (the
    torch.stack of bf16 fields, or int8 codes), GROUP + 1 dequantized experts (the stacked buffers and the
    per-expert one of an expert run alone), each at most 3 matrices [inter, hidden] + biases in the compute dtype."""
    dense = (3 * hidden * inter + 3 * inter + hidden) * itemsize
    return GROUP * unit_nbytes + (GROUP + 1) * dense


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
        if routed.num_tokens > FUSED_MAX_TOKENS and not self.fallback.numerics.batch_invariant:
            self.fallback.run(out, routed, chunks)
        else:
            super().run(out, routed, chunks)

    def describe(self) -> str:
        return (f"{self.name} (the fused C++ op on [out, in] units up to {FUSED_MAX_TOKENS} tokens"
                + (", every batch: batch-invariant)" if self.fallback.numerics.batch_invariant
                   else ", the torch loop above)"))


class CppInterleavedSwiGLU(_FusedSwiGLU):
    """SwiGLU units held 4-row interleaved (bf16, or int8 codes with scales): the fused C++ op at any batch."""

    def __init__(self, math: UnitMath, units: FusedUnits) -> None:
        ops = torch.ops.moeserve
        super().__init__(math, units,
                         ops.moe_swiglu_int8_interleaved_ if units.int8 else ops.moe_swiglu_interleaved_)
        self.name = "cpp-interleaved" + ("-int8" if units.int8 else "")

    def describe(self) -> str:
        return f"{self.name} (the fused C++ op on row-interleaved units, every batch)"


class CppQ4Experts(_FusedSwiGLU):
    """Units read by moe_q4_experts_ (csrc/moe_experts_q4.cpp) as the spec says: 4-bit experts as stored, decoded in
    registers, and gpt-oss's bf16 experts row-interleaved; canonical bf16 dots, any batch."""

    def __init__(self, math: UnitMath, units: FusedUnits) -> None:
        spec = units.spec
        assert spec is not None
        op = torch.ops.moeserve.moe_q4_experts_
        super().__init__(math, units, lambda *args: op(*args, spec))
        words = dict(w.split("=", 1) for w in spec.split())
        self.fmt, self.act = words["fmt"], words["act"]
        self.name = f"cpp-q4-{self.fmt}"

    def describe(self) -> str:
        if self.fmt == "int4-q8":
            return (f"{self.name} (moe_q4_experts_: int4 codes read as stored times int8-quantized activations "
                    f"(a scale per 32), integer dots in one stated order (csrc/q4_q8.h), {self.act} activation; "
                    "every batch, batch-invariant)")
        what = {"bf16": None, "gguf": "GGUF blocks"}.get(self.fmt, f"{self.fmt} codes")
        how = ("bf16 rows interleaved in blocks of 4" if what is None else
               f"{what} read as stored and decoded in registers to the reference decoder's bf16 values")
        return (f"{self.name} (moe_q4_experts_: {how}, canonical bf16 dots, {self.act} activation; every batch, "
                "batch-invariant)")


def choose_expert_kernel(math: UnitMath, numerics: Numerics, dtype: torch.dtype, device: torch.device = CPU,
                         batched: bool | None = None, top_k: int = GROUP) -> ExpertKernel:
    """The kernel for units computed by `math`: on a GPU (any device but the CPU) the batched torch kernel;
    on the CPU a fused C++ op where the units and the compute dtype allow it and the C++ ops compute (`numerics.cpp`),
    else the torch loop. `batched`: True or False overrides the device's choice (tests run the batched kernel on
    the CPU through the fake fast tier). `top_k`: experts per token, the batched kernel's group (at most GROUP)."""
    if batched if batched is not None else device.type != "cpu":
        why = f"on {device.type}" if batched is None else "asked for"
        return BatchedExperts(math, numerics, why, max(1, min(top_k, GROUP)))
    torch_loop = TorchExperts(math, numerics)
    units = math.fused_units()
    if not numerics.cpp or units is None:
        return torch_loop
    if units.spec is not None:
        return CppQ4Experts(math, units)
    if units.interleaved:
        return CppInterleavedSwiGLU(math, units)
    if dtype in (torch.bfloat16, torch.float32):
        return CppSwiGLU(units, torch_loop)
    return torch_loop
