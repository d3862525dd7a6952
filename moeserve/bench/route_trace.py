"""Trace-driven routing for the benchmark (`moeserve bench --route-trace FILE`): the synthetic model's experts
are chosen by a recorded routing trace instead of its random routers, so offloaded speed is measured under a real
model's locality (hot experts per layer, tokens sharing experts with their neighbours).

BENCHMARK ONLY. The engine's hook (`MoeModel.force_routing`, models/experts/moe.py `ForcedRouting`) is reached from here
alone: no setting, flag or environment variable names it, and engine/ and server/ cannot import bench/
(tests/test_import_graph.py), so `serve`, `generate` and `chat` cannot route by a trace.

Mapping a trace onto a model whose sizes differ (each difference logged once, at install):
- trace MoE layers -> the model's MoE layers: model MoE layer i follows trace MoE layer i modulo their count;
- trace experts -> model experts: id modulo the model's num_experts; an id that lands on one already in the
  token's row is dropped and the token's next trace id taken instead (counted and logged);
- top-k: a trace token keeps its first k distinct ids (FLAME rows are in descending score order); a row left with
  fewer than k is filled with the next free ids (mod E; counted and logged);
- tokens: the trace's tokens (every step's rows, in order) are one long stream; each forward pass of N tokens takes
  the next N, cycling back to the start at the end.

The mapping is plain numpy; `TraceRouter` is the callable the hook calls, `(moe_index, n_tokens) -> [N, k] ids`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moeserve.experts.traces.moetrace import Step, TraceError, TraceHeader

log = logging.getLogger("moeserve.bench")


@dataclass
class MappedTrace:
    """A trace's tokens mapped onto a model: ``ids[t, i]`` = the top-k experts of token t in model MoE layer i."""

    ids: np.ndarray  # [tokens, model MoE layers, top_k] int64
    notes: list[str] = field(default_factory=list)  # one line per mapping that changed something


def trace_tokens(header: TraceHeader, steps: Iterable[Step]) -> np.ndarray:
    """Every token of every step, in order: [tokens, trace MoE layers, trace top_k] ids. Each step must hold every
    MoE layer of the header once, all with the same number of tokens."""
    layers = list(header.moe_layers)
    rows: list[np.ndarray] = []
    for number, step in enumerate(steps):
        if [rec.layer for rec in step] != layers:
            raise TraceError(f"step {number}: layers {[rec.layer for rec in step]}, expected every MoE layer once "
                             f"in order ({layers}): a trace-driven bench needs each token's routing in every layer")
        counts = {rec.topk_ids.shape[0] for rec in step}
        if len(counts) != 1:
            raise TraceError(f"step {number}: its layers route different numbers of tokens ({sorted(counts)})")
        rows.append(np.stack([np.asarray(rec.topk_ids, dtype=np.int64) for rec in step], axis=1))  # [n, L, k]
    if not rows:
        raise TraceError("the trace has no steps")
    return np.concatenate(rows)


def _fit_row(row: np.ndarray, num_experts: int, top_k: int) -> tuple[list[int], int, int]:
    """One token's ids for one layer -> (top_k distinct model ids, ids dropped as collisions, ids filled)."""
    chosen: list[int] = []
    dropped = 0
    for e in row.tolist():
        if len(chosen) == top_k:
            break
        if e % num_experts in chosen:
            dropped += 1  # the token's next trace id is taken instead
        else:
            chosen.append(e % num_experts)
    filled = top_k - len(chosen)
    e = chosen[-1] if chosen else 0
    while len(chosen) < top_k:
        while e in chosen:
            e = (e + 1) % num_experts
        chosen.append(e)
    return chosen, dropped, filled


def map_trace(tokens: np.ndarray, model_moe_layers: int, num_experts: int, top_k: int) -> MappedTrace:
    """Map trace tokens [T, trace layers, trace k] onto a model (see the module docstring)."""
    t_count, trace_layers, trace_k = tokens.shape
    if top_k > num_experts:
        raise TraceError(f"top_k {top_k} > num_experts {num_experts}")
    notes = []
    if trace_layers != model_moe_layers:
        notes.append(f"trace has {trace_layers} MoE layers, model {model_moe_layers}: model MoE layer i follows "
                     f"trace MoE layer i mod {trace_layers}")
    source = tokens[:, [i % trace_layers for i in range(model_moe_layers)], :]  # [T, model layers, trace k]
    out = np.empty((t_count, model_moe_layers, top_k), dtype=np.int64)
    dropped = filled = 0
    for t in range(t_count):
        for i in range(model_moe_layers):
            out[t, i], m, f = _fit_row(source[t, i], num_experts, top_k)
            dropped, filled = dropped + m, filled + f
    if int(tokens.max(initial=0)) >= num_experts:
        notes.append(f"trace expert ids reach {int(tokens.max())}, model has {num_experts} experts: id mod "
                     f"{num_experts}; {dropped} of {t_count * model_moe_layers * min(top_k, trace_k)} ids collided with "
                     "one already chosen for the token and were dropped (its next trace id taken)")
    if trace_k > top_k:
        notes.append(f"trace top-k {trace_k} > model top-k {top_k}: each token keeps its first {top_k} distinct ids")
    if filled:
        notes.append(f"{filled} ids filled with the next free id (trace top-k {trace_k}, model top-k {top_k}: rows "
                     "left with too few distinct ids)")
    return MappedTrace(out, notes)


class TraceRouter:
    """The hook's callable: `router(moe_index, n)` -> [n, k] ids (torch long). MoE block 0 takes the next n trace
    tokens (cycling); the later blocks of the same forward pass route those same tokens."""

    def __init__(self, mapped: MappedTrace) -> None:
        self.ids = mapped.ids
        self.cursor = 0  # the next trace token
        self.rows = np.arange(0)  # the trace tokens of the current forward pass
        self.passes = 0

    def __call__(self, moe_index: int, n_tokens: int) -> torch.Tensor:
        if moe_index == 0:
            total = self.ids.shape[0]
            self.rows = (self.cursor + np.arange(n_tokens)) % total
            self.cursor = (self.cursor + n_tokens) % total
            self.passes += 1
        if self.rows.shape[0] != n_tokens:
            raise TraceError(f"MoE layer {moe_index} routes {n_tokens} tokens, the pass's first layer "
                             f"{self.rows.shape[0]}")
        return torch.from_numpy(np.ascontiguousarray(self.ids[self.rows, moe_index]))


def install(model: Any, path: str | Path) -> TraceRouter:
    """Load the trace at `path` (any format `bench.traces.load_trace` reads: moetrace, JSON lines, a FLAME
    folder), map it onto `model` (a MoeModel) and force its routing to it. Logged loudly: from here on the model
    routes by the trace, not by its routers."""
    from moeserve.bench.traces import load_trace

    trace = load_trace(path)
    moe = model.spec.moe
    mapped = map_trace(trace_tokens(trace.header, trace.steps), len(model.moe_blocks), moe.num_experts, moe.top_k)
    router = TraceRouter(mapped)
    model.force_routing(router)
    log.warning("ROUTING FORCED BY A TRACE (benchmark only): %s (%s, %d tokens, %d MoE layers, %d experts, top-%d); "
                "every forward pass routes the next trace tokens, cycling; the per-op layer pass runs (the fused "
                "decode step routes inside C++)", path, trace.fmt, mapped.ids.shape[0], len(trace.header.moe_layers),
                trace.header.num_experts, trace.header.top_k)
    for note in trace.notes + mapped.notes:
        log.warning("route trace: %s", note)
    return router
