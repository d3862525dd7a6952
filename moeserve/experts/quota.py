"""Capacity modes of the expert cache: how its slots are shared among the MoE layers (pure Python).

- ``shared``: one pool; any layer may take any slot (the eviction policy alone decides).
- ``per_layer``: every layer owns an equal quota (the remainder to the first layers); a layer at its quota evicts
  one of its own experts, and never takes another layer's slot. Needs at least one slot per layer.
- ``mixed``: every layer keeps a floor (``floor_fraction`` of its equal share); the rest is shared. A victim comes
  from the requesting layer or from a layer above its floor.

`SlotCache` (experts/slot_cache.py) asks a `CacheQuota` two questions per read: may this layer take a free slot
(`may_grow`), and from which layers may the victim come (`victim_layers`, passed to the policy's
``choose_victim``). The store chunks a layer call at `chunk_limit` so that one chunk always fits.
"""

from __future__ import annotations

import difflib
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass

from moeserve.errors import ConfigError

CACHE_MODES: tuple[str, ...] = ("shared", "per_layer", "mixed")
DEFAULT_CACHE_MODE = "shared"
MIXED_FLOOR_FRACTION = 0.5  # mixed: half of each layer's equal share is its floor, the other half is shared


class _VictimLayers:
    """The layers a victim may come from: the requesting one, and those holding more than their floor."""

    def __init__(self, layer: int, held: Mapping[int, int], floors: Mapping[int, int]) -> None:
        self._layer = layer
        self._held = held
        self._floors = floors

    def __contains__(self, layer: object) -> bool:
        if layer == self._layer:
            return True
        assert isinstance(layer, int)
        return self._held.get(layer, 0) > self._floors.get(layer, 0)


@dataclass(frozen=True)
class CacheQuota:
    """Per layer: `floors` (slots no other layer can take from it) and `ceilings` (most slots it may hold)."""

    mode: str
    capacity: int
    floors: Mapping[int, int]
    ceilings: Mapping[int, int]

    def may_grow(self, layer: int, held: int) -> bool:
        """`layer`, holding `held` slots (ready or loading), may take one more (a free one, or another layer's)."""
        return held < self.ceilings.get(layer, self.capacity)

    def victim_layers(self, layer: int, held: Mapping[int, int]) -> Container[int] | None:
        """Where the victim for a read of `layer` may come from (None: anywhere). `held`: slots per layer now."""
        if self.mode == "shared":
            return None
        if not self.may_grow(layer, held.get(layer, 0)):
            return (layer,)
        return _VictimLayers(layer, held, self.floors)

    def chunk_limit(self, layer: int) -> int:
        """Most experts one call of `layer` may pin at once: its ceiling, less the other layers' floors."""
        others = sum(f for other, f in self.floors.items() if other != layer)
        return max(1, min(self.ceilings.get(layer, self.capacity), self.capacity - others))

    def describe(self) -> str:
        """One line for the start-up log."""
        if self.mode == "shared":
            return f"shared: one pool of {self.capacity} slots for all {len(self.floors) or 'the'} MoE layers"
        values = sorted(set(self.floors.values()))
        span = f"{values[0]}" if len(values) == 1 else f"{values[0]}-{values[-1]}"
        if self.mode == "per_layer":
            return f"per_layer: {span} slots per MoE layer ({len(self.floors)} layers, {self.capacity} slots)"
        shared = self.capacity - sum(self.floors.values())
        return (f"mixed: a floor of {span} slots per MoE layer ({len(self.floors)} layers), "
                f"{shared} of {self.capacity} slots shared")


def make_quota(mode: str, capacity: int, layers: Sequence[int], floor_fraction: float = MIXED_FLOOR_FRACTION
               ) -> CacheQuota:
    """The quota of `mode` for a cache of `capacity` slots over the MoE `layers`. ConfigError on an unknown mode
    (with the closest name) or a per-layer split that cannot give every layer a slot."""
    if mode not in CACHE_MODES:
        close = difflib.get_close_matches(mode, CACHE_MODES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; choose one of {', '.join(CACHE_MODES)}"
        raise ConfigError(f"unknown expert cache mode {mode!r}{hint}")
    if not 0.0 <= floor_fraction <= 1.0:
        raise ConfigError(f"expert cache floor fraction {floor_fraction} must be in [0, 1]")
    layers = sorted(set(layers))
    if mode == "shared" or not layers:
        return CacheQuota("shared", capacity, {}, {})
    n = len(layers)
    share, extra = divmod(capacity, n)
    equal = {layer: share + (i < extra) for i, layer in enumerate(layers)}
    if mode == "per_layer":
        if share < 1:
            raise ConfigError(f"expert_cache_mode=per_layer: {capacity} slots cannot give each of the {n} MoE "
                              "layers one; use shared or mixed, or a larger expert cache")
        return CacheQuota(mode, capacity, equal, equal)
    floors = {layer: int(q * floor_fraction) for layer, q in equal.items()}
    return CacheQuota(mode, capacity, floors, {})
