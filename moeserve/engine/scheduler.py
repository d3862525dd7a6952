"""Scheduler: which sequences run in the next step. Pure Python (no torch), unit-testable.

Continuous batching: at every step boundary, waiting requests are admitted while KV slots are free and fewer
than max_num_seqs sequences run; finished and aborted sequences leave. One step runs the prefill of newly
admitted sequences and one decode token of every running sequence together, so the MoE layers see all of the
batch's tokens at once and fetch each expert once for all of them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from moeserve.engine.sequence import Sequence, Status


class Scheduler:
    def __init__(self, max_num_seqs: int, allocate_slot: Callable[[], int], release_slot: Callable[[int], None],
                 free_slots: Callable[[], int]) -> None:
        self.max_num_seqs = max_num_seqs
        self._allocate, self._release, self._free_slots = allocate_slot, release_slot, free_slots
        self.waiting: deque[list[Sequence]] = deque()  # one entry per request: its n sequences
        self.running: list[Sequence] = []

    def add(self, seqs: list[Sequence]) -> None:
        self.waiting.append(seqs)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return sum(len(g) for g in self.waiting)

    def schedule(self) -> list[Sequence]:
        """Admit what fits (whole requests, first come first served), then return every running sequence."""
        while self.waiting:
            group = self.waiting[0]
            if len(self.running) + len(group) > self.max_num_seqs or self._free_slots() < len(group):
                break
            self.waiting.popleft()
            for seq in group:
                seq.slot = self._allocate()
                seq.status = Status.RUNNING
                self.running.append(seq)
        return list(self.running)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its KV slot."""
        if seq in self.running:
            self.running.remove(seq)
            self._release(seq.slot)
            seq.slot = -1

    def abort(self, request_id: str) -> list[Sequence]:
        """Abort every sequence of `request_id`, waiting or running; returns them."""
        aborted: list[Sequence] = []
        for group in list(self.waiting):
            if group and group[0].request_id == request_id:
                self.waiting.remove(group)
                aborted.extend(group)
        for seq in [s for s in self.running if s.request_id == request_id]:
            self.finish(seq)
            aborted.append(seq)
        for seq in aborted:
            seq.abort()
        return aborted
