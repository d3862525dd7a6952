"""Scheduler (engine/scheduler.py) over the block manager (state/manager.py), pure Python: chunked prefill within
the token budget, decodes first, admission order, preemption by recompute, prefix sharing of n > 1, aborts."""

from __future__ import annotations

import pytest

from moeserve.engine.sampling_params import SamplingParams
from moeserve.engine.scheduler import Scheduler
from moeserve.engine.sequence import Sequence, Status
from moeserve.state.kinds import FullAttention
from moeserve.state.manager import SequenceMemory


def request(rid: str, prompt_len: int, max_tokens: int = 4, n: int = 1) -> list[Sequence]:
    prompt = [hash((rid, i)) % 1000 for i in range(prompt_len)]
    seqs = [Sequence(rid, i, prompt, SamplingParams(max_tokens=max_tokens), 4096, set()) for i in range(n)]
    for s in seqs:
        s.first_sibling = seqs[0]
    return seqs


def make(blocks: int = 64, max_num_seqs: int = 4, budget: int = 64, prefix: bool = True) -> Scheduler:
    return Scheduler(max_num_seqs, budget, SequenceMemory([FullAttention()], [blocks], 16, prefix))


def step(sched: Scheduler) -> list[tuple[Sequence, int]]:
    """One engine step as LLMEngine runs it (token 7 sampled where a sequence's tokens are all computed)."""
    out = sched.schedule()
    assert sum(n for _, n in out) <= sched.max_num_batched_tokens
    sched.computed(out)
    for seq, _ in out:
        if seq.num_cached == seq.length:
            seq.append(7, None, None)
            if seq.status == Status.FINISHED:
                sched.finish(seq)
    return out


def run(sched: Scheduler, limit: int = 500) -> int:
    steps = 0
    while sched.has_work():
        step(sched)
        steps += 1
        assert steps < limit, "the scheduler made no progress"
    return steps


def test_a_long_prompt_is_chunked_while_a_running_sequence_decodes_every_step() -> None:
    sched = make(budget=32)
    short = request("short", 5, max_tokens=20)
    sched.add(short)
    step(sched)
    long = request("long", 100)
    sched.add(long)
    chunks = []
    while long[0].num_cached < 100:
        out = dict((s.request_id, n) for s, n in step(sched))
        assert out["short"] == 1, "the decode is never skipped for the prefill"
        chunks.append(out["long"])
    assert chunks == [31, 31, 31, 7] and sum(chunks) == 100


def test_fcfs_admission_up_to_max_num_seqs() -> None:
    sched = make(max_num_seqs=2)
    for rid in "abc":
        sched.add(request(rid, 10))
    assert [s.request_id for s, _ in step(sched)] == ["a", "b"]
    assert [s.request_id for s in sched.waiting] == ["c"]
    run(sched)
    assert sched.memory.pools[0].num_free == 64


def test_preemption_frees_the_newest_and_everything_still_finishes() -> None:
    sched = make(blocks=6, max_num_seqs=4, budget=64, prefix=False)
    seqs = [request(f"r{i}", 40, max_tokens=20)[0] for i in range(3)]
    for s in seqs:
        sched.add([s])
    step(sched)  # two fit (3 blocks each); the third waits for blocks
    assert sched.running == seqs[:2] and list(sched.waiting) == [seqs[2]]
    run(sched)
    assert sched.stats.preemptions > 0
    assert all(len(s.output_token_ids) == 20 and s.status == Status.FINISHED for s in seqs)
    assert sched.memory.pools[0].num_free == 6


def test_a_sequence_that_cannot_fit_alone_is_unservable() -> None:
    sched = make(blocks=2, prefix=False)
    sched.add(request("big", 40))
    assert sched.schedule() == [] and [s.request_id for s in sched.unservable] == ["big"]
    assert not sched.has_work()


def test_siblings_wait_for_the_prompt_then_share_its_blocks() -> None:
    sched = make(budget=64)
    seqs = request("n3", 40, n=3)
    sched.add(seqs)
    first = step(sched)
    assert [(s.index, n) for s, n in first] == [(0, 40)], "siblings wait while sequence 0 computes the prompt"
    second = dict((s.index, n) for s, n in step(sched))
    assert second == {0: 1, 1: 8, 2: 8}, "the siblings take 2 cached blocks and compute the last 8 tokens"
    shared = seqs[0].blocks.tables[0][:2]  # type: ignore[union-attr]
    assert all(s.blocks.tables[0][:2] == shared for s in seqs)  # type: ignore[union-attr]
    assert sched.memory.pools[0].refs(shared[0]) == 3
    assert sched.memory.stats.hit_tokens == 64


def test_abort_frees_waiting_and_running_sequences() -> None:
    sched = make(max_num_seqs=1)
    sched.add(request("a", 20))
    sched.add(request("b", 20))
    step(sched)
    assert {s.request_id for s in sched.abort("a")} == {"a"} and sched.abort("b")[0].finish_reason == "abort"
    assert not sched.has_work() and sched.memory.pools[0].num_free == 64


def test_the_budget_must_hold_one_decode_per_sequence() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make(max_num_seqs=8, budget=4)
