"""A rank's share of the experts, as an ExpertSource keyed by local ids (expert parallelism).

    source = OwnedSource(full_source, owned=[4, 5, 6, 7])   # (layer, 0) reads expert 4 of that layer
    store = ExpertStore(source, layers, len(owned), ...)    # budgets, caches and reads only those experts

The store, its tiers and its policy never see another rank's experts: its slot table, its capacity and its
counters are over the owned experts only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moeserve.checkpoint.safetensors_file import Placer, TensorRef
from moeserve.experts.unit import ExpertSource


class OwnedSource(ExpertSource):
    """`inner`'s units of the experts in `owned` (ascending global ids), under local ids 0..len(owned)-1."""

    def __init__(self, inner: ExpertSource, owned: Sequence[int]) -> None:
        # no super().__init__: a view of `inner`, which holds the staging buffer and the readers
        self.inner, self.owned = inner, list(owned)
        self.checkpoint, self.layout = inner.checkpoint, inner.layout
        local_of = {e: i for i, e in enumerate(self.owned)}
        self.sources = {(layer, local_of[e]): fs for (layer, e), fs in inner.sources.items() if e in local_of}

    @property
    def stored_nbytes(self) -> int:
        return self.inner.stored_nbytes

    @property
    def staging_nbytes(self) -> int:
        return self.inner.staging_nbytes

    @property
    def per_thread_staging_nbytes(self) -> int:
        return self.inner.per_thread_staging_nbytes

    def prepare_offload(self) -> str | None:
        return self.inner.prepare_offload()

    def close(self) -> None:
        self.inner.close()

    def read_unit(self, layer: int, expert: int, unit_bytes: torch.Tensor) -> None:
        self.inner.read_unit(layer, self.owned[expert], unit_bytes)

    def unit_files(self, layer: int, expert: int) -> str:
        return self.inner.unit_files(layer, self.owned[expert])

    def corrupt_advice(self, layer: int, expert: int) -> str:
        return self.inner.corrupt_advice(layer, self.owned[expert])

    def known_checksums(self) -> tuple[str, dict[tuple[int, int], int]]:
        name, sums = self.inner.known_checksums()
        local_of = {e: i for i, e in enumerate(self.owned)}
        return name, {(layer, local_of[e]): s for (layer, e), s in sums.items() if e in local_of}

    def placer(self, field: str, ref: TensorRef) -> Placer | None:
        return self.inner.placer(field, ref)
