"""The MoE layer: a router picks each token's experts, the store lends their units, an ExpertKernel computes them.

    routed = router.route(x)                       # RoutedTokens: pairs grouped by expert, ascending
    kernel.compute(out, routed, store, layer)      # = kernel.run(out, routed, store.experts(layer, routed.experts)):
                                                   # units pinned while in use, loaded on a miss; experts added in
                                                   # ascending id order, so placement changes no bit

The routing (`Routing`: torch ops, or one C++ op with the same ATen kernels) and the kernel are chosen once when
the model is built; this layer never asks what they are.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from moeserve.experts.store import ExpertStore
from moeserve.models.experts.kernels import ExpertKernel, RoutedTokens
from moeserve.models.layers.base import MLP, DenseMLP, not_in_gemv_layout
from moeserve.models.layers.linear import Linear
from moeserve.models.numerics import Numerics
from moeserve.models.spec import MoeSpec


class Routing(ABC):
    """Router logits -> each token's experts and weights, as (token, expert) pairs grouped by expert.

    One implementation per rule (MoeSpec.routing) and way of computing it, chosen once by `choose_routing`; the
    MoE block and the decode stack never ask which."""

    # The DecodeStack's routing mode (csrc/routing.cpp's moe_route_pairs), or None when the stack cannot route so.
    stack_mode: int | None = None

    def __init__(self, spec: MoeSpec) -> None:
        self.spec = spec

    def logits(self, router: Linear, x: torch.Tensor) -> torch.Tensor:
        """The router logits [N, E] of x [N, H]."""
        return router(x)

    @abstractmethod
    def route(self, x: torch.Tensor, logits: torch.Tensor, token_ids: torch.Tensor | None = None) -> RoutedTokens:
        """The pairs of x [N, H] from its router logits [N, E]; `token_ids` [N]: the tokens' ids, which only a
        rule that routes by token (`HashRouting`) reads."""

    def describe(self) -> str:
        """One line for the start-up log."""
        return type(self).__name__

    def why_not_stacked(self) -> str | None:
        """None when the fused decode stack can run this routing, else why not (one line)."""
        return None if self.stack_mode is not None else f"{self.spec.routing} routing (no decode-stack mode)"

    def add_to_stack(self, stack: Any, router: Linear) -> None:
        """Give the next MoE layer of a DecodeStack this rule, with its router (csrc/decode_stack_ffn.cpp)."""
        s = self.spec
        stack.route_by_pairs(*router.gemv_tensors(), router.bias, s.top_k, self.stack_mode, s.norm_topk_prob,
                             s.weights_in_fp32)


class TorchRouting(Routing):
    """A rule as torch ops (as transformers computes it), then a stable sort by expert. Subclasses give the rule."""

    @abstractmethod
    def weights_and_ids(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [N, k], expert ids [N, k]) from the router logits [N, E]."""

    def route(self, x: torch.Tensor, logits: torch.Tensor, token_ids: torch.Tensor | None = None) -> RoutedTokens:
        weights, ids = self.weights_and_ids(logits)
        return self.pairs(x, weights, ids)

    def pairs(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> RoutedTokens:
        """(token, expert) pairs of the chosen `ids` [N, k] and their `weights`, grouped by expert (a stable sort)."""
        flat = ids.reshape(-1)  # [N*k]
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.spec.num_experts).tolist()
        return RoutedTokens.from_counts(x, ids, order // ids.shape[1], weights.reshape(-1)[order], counts)

    def describe(self) -> str:
        return f"torch ({self.spec.routing})"


class SoftmaxTopk(TorchRouting):
    """softmax over all experts in fp32, top-k, optionally renormalised (Qwen, Mixtral, OLMoE)."""

    stack_mode = 0

    def weights_and_ids(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.spec
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, s.top_k, dim=-1)
        if s.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return (top if s.weights_in_fp32 else top.to(logits.dtype)), ids


class TopkSoftmax(TorchRouting):
    """top-k of the raw logits, softmax over the k chosen (gpt-oss)."""

    stack_mode = 1

    def weights_and_ids(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, ids = torch.topk(logits, self.spec.top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=top.dtype), ids


class SigmoidGroups(TorchRouting):
    """DeepSeek-V3's "noaux_tc" (GLM-4.5, DeepSeek-V3, Kimi-K2; MiniMax-M2 with one group), op for op as transformers' Glm4MoeTopkRouter: fp32
    logits from an fp32 router, sigmoid scores; the choice adds the layer's correction bias, keeps the topk_group
    groups (of n_group) whose top-2 scores sum highest and takes the top-k experts of those; the weights are the
    chosen experts' unbiased scores, renormalised (norm_topk_prob) and times routed_scaling_factor, in fp32.

    Batch-invariant (`numerics`): in fixed blocks of rows (Numerics.rows), since torch's vectorised sigmoid
    finishes a tensor's tail with scalar code that rounds otherwise: which scores fall in the tail must not depend on
    the batch."""

    def __init__(self, spec: MoeSpec, correction_bias: torch.Tensor, numerics: Numerics) -> None:
        super().__init__(spec)
        self.bias = correction_bias  # [E] fp32
        self.numerics = numerics

    def logits(self, router: Linear, x: torch.Tensor) -> torch.Tensor:
        """[N, E] fp32: of an fp32 router (MoeSpec.router_fp32) from x in fp32, else in the compute dtype (the router
        as stored, MiniMax-M2), cast to fp32 exactly."""
        return router(x.float()) if self.spec.router_fp32 else router(x).float()

    def weights_and_ids(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.numerics.batch_invariant:
            return self._weights_and_ids(logits)
        k = self.spec.top_k
        both = self.numerics.rows(lambda rows: torch.cat([t.float() for t in self._weights_and_ids(rows)], dim=1),
                                  logits)
        return both[:, :k], both[:, k:].long()  # ids < 2^24: exact in fp32

    def _weights_and_ids(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.spec
        n, e, groups = logits.shape[0], s.num_experts, s.n_group
        scores = logits.float().sigmoid()  # [N, E]
        choice = scores + self.bias
        group_scores = choice.view(n, groups, e // groups).topk(2, dim=-1)[0].sum(dim=-1)  # [N, G]
        group_idx = torch.topk(group_scores, k=s.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        expert_mask = group_mask.unsqueeze(-1).expand(n, groups, e // groups).reshape(n, e)
        choice = choice.masked_fill(~expert_mask.bool(), float("-inf"))
        ids = torch.topk(choice, k=s.top_k, dim=-1, sorted=False)[1]  # [N, k]
        weights = scores.gather(1, ids)
        if s.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * s.routed_scaling_factor, ids


class CppSigmoidGroups(SigmoidGroups):
    """noaux_tc as one C++ call (csrc/routing_noaux.cpp moe_route_noaux): the same ids, in the same order, and the
    same fp32 weights as SigmoidGroups, bit for bit (ATen's sigmoid and sum on the same row blocks, torch.topk's own
    algorithm, ties included), and the pairs grouped by a stable counting sort. The decode stack calls the same op
    (DecodeStack.route_by_noaux)."""

    def route(self, x: torch.Tensor, logits: torch.Tensor, token_ids: torch.Tensor | None = None) -> RoutedTokens:
        s = self.spec
        token_of, weight_of, counts, ids = torch.ops.moeserve.moe_route_noaux(
            logits, self.bias, s.top_k, s.n_group, s.topk_group, s.norm_topk_prob, s.routed_scaling_factor,
            self.numerics.invariant_rows)  # the torch path's row blocks (0: one block, batch-variant)
        return RoutedTokens.from_counts(x, ids, token_of, weight_of, counts.tolist())  # the one host sync per layer

    def describe(self) -> str:
        return f"C++ moe_route_noaux ({self.spec.routing})"

    def why_not_stacked(self) -> str | None:
        # the stack's noaux rule computes the logits in fp32 (csrc/decode_stack_ffn.cpp NoauxRouting)
        return None if self.spec.router_fp32 else "noaux_tc routing with a router in the compute dtype"

    def add_to_stack(self, stack: Any, router: Linear) -> None:
        s = self.spec
        stack.route_by_noaux(router.gemv_tensors()[0], router.bias, self.bias, s.top_k, s.n_group, s.topk_group,
                             s.norm_topk_prob, s.routed_scaling_factor)


class SqrtSoftplus(TorchRouting):
    """DeepSeek-V4's rule, op for op as transformers' DeepseekV4TopKRouter: scores sqrt(softplus(logits)) in the
    router's dtype; the choice is the top-k of the scores plus the layer's correction bias (fp32); the weights are
    the chosen experts' scores renormalised (+1e-20) and times routed_scaling_factor, in the scores' dtype.
    Batch-invariant (`numerics`) in fixed blocks of rows, as SigmoidGroups (softplus and sqrt finish a tensor's
    tail with scalar code)."""

    def __init__(self, spec: MoeSpec, correction_bias: torch.Tensor | None, numerics: Numerics) -> None:
        super().__init__(spec)
        self.bias = correction_bias  # [E] fp32; None in a hash-routed layer
        self.numerics = numerics

    def weights_and_ids(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.scores(logits)
        assert self.bias is not None
        ids = torch.topk(scores + self.bias, self.spec.top_k, dim=-1, sorted=False).indices
        return self.weights(scores, ids), ids

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        return self.numerics.rows(lambda rows: torch.nn.functional.softplus(rows).sqrt(), logits)

    def weights(self, scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        weights = scores.gather(1, ids)
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.spec.routed_scaling_factor


class HashRouting(SqrtSoftplus):
    """DeepSeek-V4's hash-routed layers (MoeSpec.hash_layers), as transformers' DeepseekV4HashRouter: each token's
    experts are its row of the token -> experts table (tid2eid [vocab, k]); the router's sqrtsoftplus scores of them
    weight them as in SqrtSoftplus."""

    def __init__(self, spec: MoeSpec, token_experts: torch.Tensor, numerics: Numerics) -> None:
        super().__init__(spec, None, numerics)
        self.token_experts = token_experts  # [vocab, k] int64

    def route(self, x: torch.Tensor, logits: torch.Tensor, token_ids: torch.Tensor | None = None) -> RoutedTokens:
        if token_ids is None:
            raise ValueError("hash routing needs the tokens' ids")
        ids = self.token_experts[token_ids]
        return self.pairs(x, self.weights(self.scores(logits), ids), ids)

    def describe(self) -> str:
        return "torch (by token id: tid2eid; sqrtsoftplus weights)"


class NormedSoftmaxTopk(TorchRouting):
    """Gemma-4's router, op for op as transformers' Gemma4TextRouter: its input RMS-normed without weight (fp32, cast
    back), times `input_scale` [H] and 1/sqrt(H), in the compute dtype; softmax over all experts in fp32, top-k,
    renormalised, each weight times its expert's scale `expert_scales` [E] (fp32 weights)."""

    def __init__(self, spec: MoeSpec, input_scale: torch.Tensor, expert_scales: torch.Tensor, eps: float,
                 norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]) -> None:
        super().__init__(spec)
        self.input_scale, self.expert_scales, self.eps, self.norm = input_scale, expert_scales, eps, norm
        self.ones = torch.ones(input_scale.shape[0], dtype=torch.float32, device=input_scale.device)
        self.root = input_scale.shape[0] ** -0.5

    def logits(self, router: Linear, x: torch.Tensor) -> torch.Tensor:
        return router(self.norm(x, self.ones, self.eps) * self.input_scale * self.root)

    def weights_and_ids(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, self.spec.top_k, dim=-1)
        return top / top.sum(dim=-1, keepdim=True) * self.expert_scales[ids], ids


class ForcedRouting(TorchRouting):
    """BENCHMARK ONLY (`moeserve bench --route-trace`): each token's experts come from `forced(n_tokens)` ([N, k]
    distinct ids per row, e.g. a recorded routing trace) instead of the router's top-k, so a synthetic model routes
    with a real model's locality. The router still runs (its cost stays in the step); the weights are the softmax of
    its logits at the forced experts. No stack mode: the per-op layer pass runs it. Installed only through
    `MoeModel.force_routing`, which no setting reaches (engine/ and server/ cannot import bench/)."""

    def __init__(self, inner: Routing, forced: Callable[[int], torch.Tensor]) -> None:
        super().__init__(inner.spec)
        self.inner, self.forced = inner, forced

    def logits(self, router: Linear, x: torch.Tensor) -> torch.Tensor:
        return self.inner.logits(router, x)

    def weights_and_ids(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.forced(logits.shape[0]).to(device=logits.device, dtype=torch.long)  # [N, k]
        weights = torch.softmax(logits.float().gather(1, ids), dim=-1)  # [N, k] fp32
        return (weights if self.spec.weights_in_fp32 else weights.to(logits.dtype)), ids

    def describe(self) -> str:
        return "forced by a routing trace (benchmark only; weights: softmax of the router's logits at those experts)"

    def why_not_stacked(self) -> str | None:
        return "routing forced by a trace (benchmark only)"


class CppRouting(Routing):
    """A rule of csrc/routing.cpp (`stack_mode`): the same ATen softmax / top-k kernels and a stable counting sort in
    one C++ call."""

    def __init__(self, spec: MoeSpec, mode: int) -> None:
        super().__init__(spec)
        self.stack_mode = mode

    def route(self, x: torch.Tensor, logits: torch.Tensor, token_ids: torch.Tensor | None = None) -> RoutedTokens:
        s = self.spec
        token_of, weight_of, counts, ids = torch.ops.moeserve.moe_route_pairs(logits, s.top_k, self.stack_mode,
                                                                          s.norm_topk_prob, s.weights_in_fp32)
        return RoutedTokens.from_counts(x, ids, token_of, weight_of, counts.tolist())  # the one host sync per layer

    def describe(self) -> str:
        return f"C++ moe_route_pairs ({self.spec.routing})"


def choose_routing(spec: MoeSpec, numerics: Numerics, correction_bias: torch.Tensor | None,
                   token_experts: torch.Tensor | None = None, scales: NormedSoftmaxTopk | None = None) -> Routing:
    """The Routing of `spec.routing`: its C++ op when the C++ ops compute (`numerics.cpp`) and the op has the rule,
    else torch.
    `correction_bias`: the layer's e_score_correction_bias [E] (fp32) when the rule has one; `token_experts`: a
    hash-routed layer's token -> experts table (MoeSpec.hash_layers); `scales`: the normed_softmax_topk router,
    built with its layer's scales (torch only). The only place that asks which rule a model routes by."""
    if token_experts is not None:
        return HashRouting(spec, token_experts, numerics)
    if spec.routing == "sqrtsoftplus":
        return SqrtSoftplus(spec, correction_bias, numerics)
    if spec.routing == "normed_softmax_topk":
        assert scales is not None
        return scales
    if spec.routing == "sigmoid_groups":
        assert correction_bias is not None
        return (CppSigmoidGroups if numerics.cpp else SigmoidGroups)(spec, correction_bias, numerics)
    rule: TorchRouting = SoftmaxTopk(spec) if spec.routing == "softmax_topk" else TopkSoftmax(spec)
    return CppRouting(spec, rule.stack_mode) if numerics.cpp and rule.stack_mode is not None else rule


class MoEBlock(MLP):
    """Router + experts (from the store) + optional shared expert, with a sigmoid gate (Qwen2-MoE) or without
    (GLM-4.5)."""

    def __init__(self, spec: MoeSpec, layer: int, router: Linear, store: ExpertStore, experts: ExpertKernel,
                 routing: Routing, shared: DenseMLP | None = None, shared_gate: Linear | None = None,
                 numerics: Numerics = Numerics(),
                 expert_norm: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """`expert_norm`: the experts read expert_norm(x) while the router reads x (Gemma-4's
        pre_feedforward_layernorm_2); None: both read x."""
        self.spec, self.layer, self.router, self.store = spec, layer, router, store
        self.expert_norm = expert_norm
        self.numerics = numerics  # batch-invariant: the gated shared expert in fixed row blocks (see DenseMLP)
        self.experts, self.routing = experts, routing
        self.shared, self.shared_gate = shared, shared_gate
        # (layer, topk ids [N, k], experts predicted for the next MoE layer or None): --record-trace
        self.trace_hook: Callable[[int, torch.Tensor, list[int] | None], None] | None = None
        # the next MoE block: set when the store prefetches, so this block can predict that layer's experts
        self.predict_next: MoEBlock | None = None

    def predict(self, x: torch.Tensor) -> list[int]:
        """The next MoE layer's experts for x [N, H], most often chosen first, ties (a single token's top-k
        among them) by the summed chance the tokens choosing them give them: its router applied to this layer's
        input (hidden states change little from one layer to the next). A guess; only costs I/O."""
        assert self.predict_next is not None
        nxt = self.predict_next
        probs = torch.softmax(nxt.routing.logits(nxt.router, x).float(), dim=-1)  # [N, E], monotone per token
        chance, top = torch.topk(probs, self.spec.top_k, dim=-1)  # [N, k]
        n = self.spec.num_experts
        counts = torch.bincount(top.reshape(-1), minlength=n)  # [E]
        summed = torch.zeros(n, dtype=torch.float64, device=top.device)
        summed.index_add_(0, top.reshape(-1), chance.reshape(-1).double())
        # each summed chance is below its count + 1 <= N + 1, so the count decides first
        order = torch.argsort(counts.double() * (x.shape[0] + 1) + summed, descending=True, stable=True)
        return order[counts[order] > 0].tolist()

    def __call__(self, x: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output for x [N, H]; `token_ids` [N] for a rule that routes by token (HashRouting)."""
        experts_x = x if self.expert_norm is None else self.expert_norm(x)
        routed = self.routing.route(experts_x, self.routing.logits(self.router, x), token_ids)
        # The next router's guess costs a GEMV over the next layer's router and a top-k: only when something uses
        # it (the store prefetching the caller's hints, or a trace recording it), not with the store's own predictor.
        wanted = self.trace_hook is not None or self.store.takes_hints
        predicted = self.predict(x) if self.predict_next is not None and wanted else None
        if self.trace_hook is not None:
            self.trace_hook(self.layer, routed.ids, predicted)
        hint = (self.predict_next.layer, predicted) if self.predict_next is not None and predicted else None
        out = torch.zeros_like(x)
        self.experts.compute(out, routed, self.store, self.layer, prefetch=hint)
        if self.shared_gate is not None:
            out = out + self.numerics.rows(self._gated_shared, x)
        elif self.shared is not None:
            out = out + self.shared(x)  # ungated (DenseMLP keeps its own row blocks)
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
        why_kernel = self.experts.why_not_stacked()
        if why_kernel is not None:
            return why_kernel
        why_routing = self.routing.why_not_stacked()
        if why_routing is not None:
            return why_routing
        if self.expert_norm is not None:
            return "experts reading a norm of the router's input (Gemma-4)"
        if units is None or (self.store.resident and not units.held_by_stack):
            return ("experts are not row-interleaved units (expert_layout=plain, or a kernel without the fused op)"
                    if self.store.resident else "experts in a layout without a fused C++ op")
        if not (self.router.layout == "interleaved" or (self.router.layout == "plain" and
                                                        self.router.gemv_tensors()[0].dtype == torch.float32)):
            return f"a router in the {self.router.layout!r} layout"
        if self.shared_gate is not None and self.shared_gate.bias is not None:
            return "a shared expert gate with a bias"
        if self.shared is not None:
            return self.shared.why_not_stacked() or not_in_gemv_layout([] if self.shared_gate is None
                                                                       else [self.shared_gate])
        return None

    def add_to_stack(self, stack: Any) -> None:
        """This layer's routing (with its router), shared expert and, from a resident store, its units (held by the
        stack for the process's life); offloaded, the caller feeds the units at each step
        (decode_stack.FusedOffloaded)."""
        units = self.experts.stack_units
        assert units is not None
        self.routing.add_to_stack(stack, self.router)
        if self.shared is not None:
            gate = (None, None) if self.shared_gate is None else self.shared_gate.gemv_tensors()
            self.shared.add_as_shared(stack, gate)
        stack.use_expert_op(units.stack_op)
        if not self.store.resident:
            stack.add_moe_external(not units.interleaved)
            return
        held = self.store.resident_units(self.layer)
        stack.add_moe(*([] if f is None else [u[f] for u in held] for f in units.fields))
