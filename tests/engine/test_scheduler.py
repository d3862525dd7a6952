"""Scheduler (engine/scheduler.py): admission of whole requests first come first served, within max_num_seqs and
the free KV slots; finishing and aborting free slots; a request that does not fit waits and blocks the later ones."""

from __future__ import annotations

from moeserve.engine.sampling_params import SamplingParams
from moeserve.engine.scheduler import Scheduler
from moeserve.engine.sequence import Sequence, Status


class Slots:
    """A slot pool standing in for the KV cache: allocate / release / free, with the calls checked."""

    def __init__(self, n: int) -> None:
        self.free = list(range(n - 1, -1, -1))
        self.taken: set[int] = set()

    def allocate(self) -> int:
        assert self.free, "allocated with no free slot"
        slot = self.free.pop()
        self.taken.add(slot)
        return slot

    def release(self, slot: int) -> None:
        assert slot in self.taken, f"released slot {slot} twice or never taken"
        self.taken.remove(slot)
        self.free.append(slot)


def request(rid: str, n: int = 1) -> list[Sequence]:
    return [Sequence(rid, i, [1, 2, 3], SamplingParams(max_tokens=4), 64, set()) for i in range(n)]


def make(max_num_seqs: int, slots: int) -> tuple[Scheduler, Slots]:
    pool = Slots(slots)
    return Scheduler(max_num_seqs, pool.allocate, pool.release, lambda: len(pool.free)), pool


def ids(seqs: list[Sequence]) -> list[tuple[str, int]]:
    return [(s.request_id, s.index) for s in seqs]


def test_admits_in_arrival_order_up_to_max_num_seqs() -> None:
    sched, pool = make(max_num_seqs=2, slots=8)
    for rid in "abc":
        sched.add(request(rid))
    assert ids(sched.schedule()) == [("a", 0), ("b", 0)]
    assert sched.num_waiting == 1 and len(pool.taken) == 2
    assert all(s.status == Status.RUNNING and s.slot >= 0 for s in sched.running)
    assert ids(sched.schedule()) == [("a", 0), ("b", 0)]  # nothing changed: the same batch again


def test_finishing_frees_the_slot_and_admits_the_next_request() -> None:
    sched, pool = make(max_num_seqs=2, slots=2)
    for rid in "abc":
        sched.add(request(rid))
    a, _ = sched.schedule()
    slot = a.slot
    sched.finish(a)
    assert a.slot == -1 and slot in pool.free
    assert ids(sched.schedule()) == [("b", 0), ("c", 0)]
    sched.finish(a)  # finishing twice is harmless: nothing released twice
    assert len(pool.taken) == 2


def test_a_request_is_admitted_whole_or_not_at_all_and_blocks_later_ones() -> None:
    sched, pool = make(max_num_seqs=4, slots=4)
    sched.add(request("a", n=2))
    sched.add(request("big", n=3))  # does not fit beside a
    sched.add(request("c", n=1))  # would fit, but first come first served
    assert ids(sched.schedule()) == [("a", 0), ("a", 1)]
    assert sched.num_waiting == 4
    for seq in list(sched.running):
        sched.finish(seq)
    assert ids(sched.schedule()) == [("big", 0), ("big", 1), ("big", 2), ("c", 0)]


def test_free_slots_bound_admission_below_max_num_seqs() -> None:
    sched, pool = make(max_num_seqs=8, slots=3)
    for rid in "abcd":
        sched.add(request(rid))
    assert len(sched.schedule()) == 3 and not pool.free


def test_abort_removes_waiting_and_running_sequences_and_frees_their_slots() -> None:
    sched, pool = make(max_num_seqs=2, slots=2)
    sched.add(request("a", n=2))
    sched.add(request("b"))
    sched.schedule()
    aborted = sched.abort("a")
    assert ids(aborted) == [("a", 0), ("a", 1)] and all(s.status == Status.FINISHED for s in aborted)
    assert not pool.taken
    assert ids(sched.schedule()) == [("b", 0)]
    sched.add(request("w"))
    sched.add(request("x", n=2))  # waits: b holds a slot
    assert ids(sched.abort("x")) == [("x", 0), ("x", 1)] and sched.num_waiting == 1
    assert sched.abort("nobody") == []


def test_has_work_until_everything_finished() -> None:
    sched, _ = make(max_num_seqs=1, slots=1)
    assert not sched.has_work()
    sched.add(request("a"))
    assert sched.has_work()
    (a,) = sched.schedule()
    sched.finish(a)
    assert not sched.has_work()
