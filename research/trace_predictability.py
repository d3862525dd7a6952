"""How well can a step's experts in one MoE layer be predicted from its experts in the layers before (the
cross-layer co-occurrence that prefetching from routing history uses)? Precision of the top-k guesses of a
pairwise-conditional predictor: score(e) = sum over the experts e' the step used in an earlier layer of
P(e used in this layer | e' used in that layer), guesses = the k best scores. Fitted on the first half of the
steps and scored on the second ("out of sample": what an online predictor could at best learn from that much
history), and fitted on the second half itself ("in sample": an optimistic bound; the predictor has seen the
answers). Per step; meaningful for batch-1 traces (one token per step). docs/flame-bound.md:

    .venv/bin/python research/trace_predictability.py /work/shared/traces/flame-moe-290m
"""

from __future__ import annotations

import argparse

import numpy as np

from moeserve.cli.simulate import load_calls

KS = (1, 2, 3, 6)


def used_matrix(path: str) -> np.ndarray:
    """[steps, MoE layers, experts] bool: which experts each step used in each MoE layer."""
    header, steps, _ = load_calls(path)
    layer_index = {layer: i for i, layer in enumerate(header.moe_layers)}
    used = np.zeros((len(steps), len(header.moe_layers), header.num_experts), bool)
    for t, step in enumerate(steps):
        for call in step:
            used[t, layer_index[call.layer], list(call.expert_ids)] = True
    return used


def precision(used: np.ndarray, fit: np.ndarray, scored: np.ndarray, all_previous: bool) -> dict[int, float]:
    """Mean precision of the top-k guesses for every layer but the first, over the `scored` steps."""
    hits: dict[int, list[float]] = {k: [] for k in KS}
    for layer in range(1, used.shape[1]):
        sources = range(layer) if all_previous else [layer - 1]
        cond = {}
        for src in sources:
            a, b = used[fit, src].astype(float), used[fit, layer].astype(float)
            cond[src] = (a.T @ b) / np.maximum(a.sum(0)[:, None], 1.0)  # [E, E]: P(b | a)
        for t in scored:
            score = sum(used[t, src].astype(float) @ cond[src] for src in sources)
            order = np.argsort(-score, kind="stable")
            for k in KS:
                hits[k].append(float(used[t, layer, order[:k]].mean()))
    return {k: float(np.mean(v)) for k, v in hits.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="any trace moeserve reads")
    args = ap.parse_args()
    used = used_matrix(args.trace)
    half = used.shape[0] // 2
    first, second = np.arange(half), np.arange(half, used.shape[0])
    print("predictor | " + " | ".join(f"top-{k} precision" for k in KS))
    for name, fit, prev in (("previous layer, out of sample", first, False),
                            ("all earlier layers, out of sample", first, True),
                            ("previous layer, in sample", second, False),
                            ("all earlier layers, in sample", second, True)):
        p = precision(used, fit, second, prev)
        print(f"{name} | " + " | ".join(f"{p[k]:.3f}" for k in KS))


if __name__ == "__main__":
    main()
