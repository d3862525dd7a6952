"""What the ranks of one expert-parallel run compare before serving: every rank must compute the same bits.

    mine = {"version": ..., "checkpoint": ..., "config": ..., "numerics": ...}
    first_mismatch(head, worker, rank=1)   # None, or one line naming the first field that differs

`checkpoint` hashes the tensor index (every tensor's name, dtype, shape and byte count: what each rank reads its
experts from its own copy by), `config` the parsed config.json; `numerics` names the numerics (batch invariance and
row block), the kernel build (sources, ISA level, bf16 dot implementation, torch version), the experts' layout and
format, and the compute dtype.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

FIELDS = ("version", "checkpoint", "config", "numerics")
WHY = {
    "version": "the moeserve versions differ",
    "checkpoint": "the checkpoints differ (tensor names, dtypes, shapes or sizes): each rank must hold the same "
                  "model",
    "config": "the config.json files differ",
    "numerics": "the numerics differ (kernel build, batch invariance and row block, expert layout, dtype: every "
                "rank must compute the same bits; give every rank the same settings and moeserve build)",
}


def digest(obj: Any) -> str:
    """A short stable hash of a JSON-able value."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def tensor_index_digest(tensors: Iterable[tuple[str, str, tuple[int, ...], int]]) -> str:
    """The hash of a checkpoint's tensor index: (name, dtype, shape, bytes) of every tensor, in name order."""
    return digest(sorted([name, dtype, list(shape), nbytes] for name, dtype, shape, nbytes in tensors))


def first_mismatch(head: Mapping[str, Any], worker: Mapping[str, Any], rank: int,
                   fields: Iterable[str] = FIELDS) -> str | None:
    """One line naming the first of `fields` where rank `rank` differs from the head (both values shown), or None."""
    for name in fields:
        if head.get(name) != worker.get(name):
            return (f"expert parallelism: rank {rank} refused: {name} differs ({WHY.get(name, name)}): head "
                    f"{head.get(name)!r}, rank {rank} {worker.get(name)!r}")
    return None
