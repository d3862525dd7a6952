"""The MoE layer: a router picks each token's experts, the store lends their units, an ExpertKernel computes them.

    routed = router.route(x)                       # RoutedTokens: pairs grouped by expert, ascending
    chunks = store.experts(layer, routed.experts)  # units, pinned while in use, loaded on a miss
    kernel.run(out, routed, chunks)                # experts added in ascending id order: placement changes no bit

The routing (`Routing`: torch ops, or one C++ op with the same ATen kernels) and the kernel are chosen once when
the model is built; this layer never asks what they are.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from moeserve.experts.store import ExpertStore
from moeserve.models.expert_kernels import ExpertKernel, RoutedTokens
from moeserve.models.layers import MLP, DenseMLP
from moeserve.models.linear import Linear, in_row_blocks
from moeserve.models.spec import MoeSpec


class Routing(ABC):
    """Router logits -> each token's experts and weights, as (token, expert) pairs grouped by expert."""

    def __init__(self, spec: MoeSpec) -> None:
        self.spec = spec

    @abstractmethod
    def route(self, x: torch.Tensor, logits: torch.Tensor) -> RoutedTokens: ...


class TorchRouting(Routing):
    """softmax / top-k / renormalisation as transformers computes them, then a stable sort by expert."""

    def weights_and_ids(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [N, k], expert ids [N, k]) from the router logits [N, E]."""
        s = self.spec
        if s.routing == "topk_softmax":
            top, ids = torch.topk(logits, s.top_k, dim=-1)
            return torch.softmax(top, dim=-1, dtype=top.dtype), ids
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, s.top_k, dim=-1)
        if s.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return (top if s.weights_in_fp32 else top.to(logits.dtype)), ids

    def route(self, x: torch.Tensor, logits: torch.Tensor) -> RoutedTokens:
        weights, ids = self.weights_and_ids(logits)
        flat = ids.reshape(-1)  # [N*k]
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.spec.num_experts).tolist()
        return RoutedTokens.from_counts(x, ids, order // ids.shape[1], weights.reshape(-1)[order], counts)


class CppRouting(Routing):
    """The same ATen softmax / top-k kernels and a stable counting sort in one C++ call (csrc/routing.cpp)."""

    def route(self, x: torch.Tensor, logits: torch.Tensor) -> RoutedTokens:
        s = self.spec
        mode = 1 if s.routing == "topk_softmax" else 0
        token_of, weight_of, counts, ids = torch.ops.moeserve.moe_route_pairs(logits, s.top_k, mode, s.norm_topk_prob,
                                                                          s.weights_in_fp32)
        return RoutedTokens.from_counts(x, ids, token_of, weight_of, counts.tolist())  # the one host sync per layer


class MoEBlock(MLP):
    """Router + experts (from the store) + optional shared expert with a sigmoid gate."""

    def __init__(self, spec: MoeSpec, layer: int, router: Linear, store: ExpertStore, experts: ExpertKernel,
                 routing: Routing, shared: DenseMLP | None = None, shared_gate: Linear | None = None,
                 invariant: bool = False) -> None:
        self.spec, self.layer, self.router, self.store = spec, layer, router, store
        self.invariant = invariant  # the gated shared expert in fixed row blocks (see DenseMLP)
        self.experts, self.routing = experts, routing
        self.shared, self.shared_gate = shared, shared_gate
        # (layer, topk ids [N, k], experts predicted for the next MoE layer or None): --record-trace
        self.trace_hook: Callable[[int, torch.Tensor, list[int] | None], None] | None = None
        # (next MoE layer, its router): set when the store prefetches, so this block can predict that layer
        self.predict_next: tuple[int, Linear] | None = None

    def predict(self, x: torch.Tensor) -> list[int]:
        """The next MoE layer's experts for x [N, H], most often chosen first: its router applied to this
        layer's input (hidden states change little from one layer to the next). A guess; only costs I/O."""
        assert self.predict_next is not None
        top = torch.topk(self.predict_next[1](x), self.spec.top_k, dim=-1).indices  # [N, k]
        counts = torch.bincount(top.reshape(-1), minlength=self.spec.num_experts)  # [E]
        order = torch.argsort(counts, descending=True, stable=True)
        return order[counts[order] > 0].tolist()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.routing.route(x, self.router(x))
        # The next router's guess costs a GEMV over the next layer's router and a top-k: only when something uses
        # it (the store prefetching the caller's hints, or a trace recording it), not with the store's own predictor.
        wanted = self.trace_hook is not None or self.store.takes_hints
        predicted = self.predict(x) if self.predict_next is not None and wanted else None
        if self.trace_hook is not None:
            self.trace_hook(self.layer, routed.ids, predicted)
        hint = (self.predict_next[0], predicted) if self.predict_next is not None and predicted else None
        out = torch.zeros_like(x)
        self.experts.run(out, routed, self.store.experts(self.layer, routed.experts, prefetch=hint))
        if self.shared is not None and self.shared_gate is not None:
            out = out + (in_row_blocks(self._gated_shared, x) if self.invariant else self._gated_shared(x))
        return out

    def _gated_shared(self, x: torch.Tensor) -> torch.Tensor:
        assert self.shared is not None and self.shared_gate is not None
        return torch.sigmoid(self.shared_gate(x)) * self.shared._mlp(x)

    def linears(self) -> list[Linear]:
        shared = [] if self.shared is None else self.shared.linears()
        return [self.router, *shared] + ([] if self.shared_gate is None else [self.shared_gate])

    # --------------------------------------------------------------------- the fused decode stack (decode_stack.py)
    def why_not_stacked(self) -> str | None:
        """None when the decode stack can run this layer, else why not (one line)."""
        units = self.experts.stack_units
        if self.shared is not None:
            return "a shared expert"
        if units is None or (self.store.resident and not units.interleaved):
            return ("experts are not row-interleaved units (expert_layout=plain, or a kernel without the fused op)"
                    if self.store.resident else "experts in a layout without a fused C++ op")
        if self.router.layout != "interleaved":
            return f"a router in the {self.router.layout!r} layout"
        return None

    def add_to_stack(self, stack: Any) -> None:
        """This layer's router and, from a resident store, its units (held by the stack for the process's life);
        offloaded, the caller feeds the units at each step (decode_stack.FusedOffloaded)."""
        units = self.experts.stack_units
        assert units is not None
        if not self.store.resident:
            stack.add_moe_external(self.router.gemv_tensors()[0], self.router.bias, not units.interleaved)
            return
        held = self.store.resident_units(self.layer)
        stack.add_moe(self.router.gemv_tensors()[0], self.router.bias,
                      *([] if f is None else [u[f] for u in held] for f in units.fields))
