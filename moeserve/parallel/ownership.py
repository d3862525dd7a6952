"""Which rank owns which experts: pure Python, the same answer on every rank from the same inputs.

    owners = assign_experts(num_experts, budgets_gb=[20, 60, 60], mode="contiguous")   # owners[e] = rank
    owned(owners, rank)                                                                 # that rank's expert ids

Every MoE layer is split the same way (every layer has the same experts), so a rank holds the same share of every
layer. `contiguous`: ranges in expert order, each sized in proportion to its rank's memory budget (within one
expert of its share, at least one each); `round_robin`: expert e on rank e % ranks, whatever the budgets.
"""

from __future__ import annotations

from collections.abc import Sequence

OWNERSHIP_MODES = ("contiguous", "round_robin")


def assign_experts(num_experts: int, budgets_gb: Sequence[float], mode: str = "contiguous") -> list[int]:
    """owners[e]: the rank that owns expert e of every MoE layer. Raises ValueError for an unknown mode, no ranks, a
    budget that is not positive, or more ranks than experts (a rank would own nothing)."""
    ranks = len(budgets_gb)
    if mode not in OWNERSHIP_MODES:
        raise ValueError(f"unknown expert ownership {mode!r} ({', '.join(OWNERSHIP_MODES)})")
    if ranks == 0 or any(b <= 0 for b in budgets_gb):
        raise ValueError(f"every rank needs a positive memory budget (got {list(budgets_gb)})")
    if ranks > num_experts:
        raise ValueError(f"{ranks} ranks for {num_experts} experts per layer: a rank would own none")
    if mode == "round_robin":
        return [e % ranks for e in range(num_experts)]
    counts = proportional_counts(num_experts, budgets_gb)
    return [rank for rank, count in enumerate(counts) for _ in range(count)]


def proportional_counts(total: int, weights: Sequence[float]) -> list[int]:
    """`total` split in proportion to `weights`, each part at least 1 (total >= len(weights)): each part's floor
    (at least 1), then one at a time to the part furthest below its share (or from the one furthest above it, never
    below 1); ties to the lower index."""
    whole = sum(weights)
    ideal = [total * w / whole for w in weights]
    counts = [max(1, int(x)) for x in ideal]
    while sum(counts) < total:
        i = max(range(len(counts)), key=lambda j: (ideal[j] - counts[j], -j))
        counts[i] += 1
    while sum(counts) > total:
        i = min((j for j in range(len(counts)) if counts[j] > 1), key=lambda j: (ideal[j] - counts[j], j))
        counts[i] -= 1
    return counts


def owned(owners: Sequence[int], rank: int) -> list[int]:
    """The expert ids `rank` owns, ascending."""
    return [e for e, r in enumerate(owners) if r == rank]


def describe_ownership(owners: Sequence[int], budgets_gb: Sequence[float], mode: str) -> list[str]:
    """One line per rank for the start-up log: its budget and the experts it owns (ranges where contiguous)."""
    lines = []
    for rank, budget in enumerate(budgets_gb):
        ids = owned(owners, rank)
        lines.append(f"rank {rank} ({'head' if rank == 0 else 'worker'}, memory_gb={budget:g}): "
                     f"{len(ids)} of {len(owners)} experts per layer ({format_ids(ids)}, {mode})")
    return lines


def format_ids(ids: Sequence[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    parts: list[str] = []
    start = prev = None
    for e in [*ids, None]:
        if start is not None and (e is None or e != prev + 1):  # type: ignore[operator]
            parts.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if e is not None and start is None:
            start = e
        prev = e
    return ", ".join(parts)
