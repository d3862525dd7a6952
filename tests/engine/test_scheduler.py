"""Scheduler (engine/scheduler.py) over the block manager (state/manager.py), pure Python, driven the way LLMEngine
drives it: chunked prefill within the token budget, decodes first, first-come-first-served admission, preemption by
recompute, prefix sharing of n > 1, unservable sequences, aborts; and a seeded random workload on a small mixed
(full + sliding) pool checked step by step against a model of what every KV slot holds."""

from __future__ import annotations

import random

import pytest

from moeserve.engine.sampling_params import SamplingParams
from moeserve.engine.scheduler import Scheduler
from moeserve.engine.sequence import Sequence, Status
from moeserve.state.kinds import CacheKind, FullAttention, SlidingWindow
from moeserve.state.manager import SequenceMemory

BS = 16
TOKEN = 7  # what the fake model samples


def request(rid: str, prompt_len: int, max_tokens: int = 4, n: int = 1, max_model_len: int = 4096,
            prompt: list[int] | None = None) -> list[Sequence]:
    ids = prompt if prompt is not None else [random.Random(rid).randrange(1000) for _ in range(prompt_len)]
    seqs = [Sequence(rid, i, ids, SamplingParams(max_tokens=max_tokens), max_model_len, set()) for i in range(n)]
    for s in seqs:
        s.first_sibling = seqs[0]  # as LLMEngine.add_request does
    return seqs


def make(blocks: int = 64, max_num_seqs: int = 4, budget: int = 64, prefix: bool = True,
         kinds: list[CacheKind] | None = None) -> Scheduler:
    kinds = kinds or [FullAttention()]
    return Scheduler(max_num_seqs, budget, SequenceMemory(kinds, [blocks] * len(kinds), BS, prefix))


def step(sched: Scheduler) -> list[tuple[Sequence, int]]:
    """One engine step as LLMEngine runs it: TOKEN is sampled where a sequence's tokens are all computed."""
    out = sched.schedule()
    assert sum(n for _, n in out) <= sched.max_num_batched_tokens, "token budget exceeded"
    assert len({id(s) for s, _ in out}) == len(out), "a sequence scheduled twice in one step"
    assert len(sched.running) <= sched.max_num_seqs
    assert all(s.status == Status.RUNNING and n >= 1 for s, n in out)
    sched.computed(out)
    for seq, _ in out:
        if seq.num_cached == seq.length:
            seq.append(TOKEN, None, None)
            if seq.status == Status.FINISHED:
                sched.finish(seq)
    return out


def run(sched: Scheduler, limit: int = 1000) -> int:
    steps = 0
    while sched.has_work():
        step(sched)
        steps += 1
        assert steps < limit, "the scheduler made no progress"
    return steps


def by_id(out: list[tuple[Sequence, int]]) -> dict[str, int]:
    return {f"{s.request_id}{'.' + str(s.index) if s.index else ''}": n for s, n in out}


def pool_free(sched: Scheduler) -> list[int]:
    return [p.num_free for p in sched.memory.pools]


# ------------------------------------------------------------------------------------------------ basics
def test_the_budget_must_hold_one_decode_per_sequence() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make(max_num_seqs=8, budget=4)
    make(max_num_seqs=8, budget=8)  # exactly one each is fine


def test_has_work_follows_waiting_and_running() -> None:
    sched = make()
    assert not sched.has_work() and sched.schedule() == []
    sched.add(request("a", 10, max_tokens=2))
    assert sched.has_work() and sched.num_waiting == 1
    step(sched)
    assert sched.has_work() and sched.num_waiting == 0 and len(sched.running) == 1
    step(sched)
    assert not sched.has_work() and pool_free(sched) == [64]


def test_fcfs_admission_up_to_max_num_seqs() -> None:
    sched = make(max_num_seqs=2)
    for rid in "abc":
        sched.add(request(rid, 10, max_tokens=3))
    assert by_id(step(sched)) == {"a": 10, "b": 10}
    assert [s.request_id for s in sched.waiting] == ["c"]
    sched.add(request("d", 10, max_tokens=3))
    assert by_id(step(sched)) == {"a": 1, "b": 1}, "no admission while max_num_seqs run"
    assert by_id(step(sched)) == {"a": 1, "b": 1}  # a and b finish here (3 tokens each)
    assert by_id(step(sched)) == {"c": 10, "d": 10}, "admitted in arrival order as soon as they fit"
    run(sched)
    assert pool_free(sched) == [64]


def test_admission_keeps_arrival_order_when_the_budget_runs_out() -> None:
    sched = make(max_num_seqs=4, budget=20)
    for rid in "abc":
        sched.add(request(rid, 15))
    assert by_id(step(sched)) == {"a": 15, "b": 5}, "b starts with what the budget leaves; c waits"
    assert [s.request_id for s in sched.waiting] == ["c"]
    assert by_id(step(sched)) == {"a": 1, "c": 15, "b": 4}, "decode, then admission, then b's next chunk"


# ------------------------------------------------------------------------------------------------ chunking
def test_a_long_prompt_is_chunked_while_a_running_sequence_decodes_every_step() -> None:
    sched = make(budget=32)
    short = request("short", 5, max_tokens=20)
    sched.add(short)
    assert by_id(step(sched)) == {"short": 5}
    long = request("long", 100)
    sched.add(long)
    chunks = []
    while long[0].num_cached < 100:
        out = step(sched)
        assert out[0] == (short[0], 1), "the decode comes first and is never skipped for the prefill"
        assert by_id(out) == {"short": 1, "long": out[1][1]} and sched.stats.last_step_tokens <= 32
        chunks.append(out[1][1])
    assert chunks == [31, 31, 31, 7] and sum(chunks) == 100
    assert len(long[0].output_token_ids) == 1, "the first token comes with the last chunk"
    assert len(short[0].output_token_ids) == 1 + len(chunks)
    assert sched.stats.prefill_tokens == 5 + 100
    assert by_id(step(sched)) == {"short": 1, "long": 1}


def test_decodes_come_before_prefill_chunks_even_of_older_sequences() -> None:
    sched = make(budget=32)
    long = request("long", 100)[0]
    sched.add([long])
    assert by_id(step(sched)) == {"long": 32}
    short = request("short", 5, max_tokens=10)[0]
    sched.add([short])
    out = step(sched)
    assert [(s.request_id, n) for s, n in out] == [("short", 5), ("long", 27)], \
        "a short request arriving during a long prefill is admitted at the next step, before the next chunk"
    out = step(sched)
    assert [(s.request_id, n) for s, n in out] == [("short", 1), ("long", 31)], "its decode then goes first"


def test_the_budget_is_never_exceeded_with_many_prompts_and_decodes() -> None:
    sched = make(blocks=200, max_num_seqs=6, budget=24)
    rng = random.Random(0)
    seqs = [request(f"r{i}", rng.randrange(1, 80), max_tokens=rng.randrange(1, 12))[0] for i in range(20)]
    sched.add(seqs)
    steps = 0
    while sched.has_work():
        decoders = [s for s in sched.running if s.length - s.num_cached == 1]
        out = step(sched)  # asserts the budget
        assert [s for s, _ in out[: len(decoders)]] == decoders, "every decode first, oldest first"
        steps += 1
    assert all(s.status == Status.FINISHED and len(s.output_token_ids) == s.params.max_tokens for s in seqs)
    total = sum(len(s.prompt_token_ids) + s.params.max_tokens - 1 for s in seqs)
    assert steps >= total / 24 and pool_free(sched) == [200]


# ------------------------------------------------------------------------------------------------ preemption
def test_preemption_frees_the_newest_and_everything_still_finishes() -> None:
    sched = make(blocks=6, max_num_seqs=4, budget=128, prefix=False)
    a, b = request("a", 40, max_tokens=20)[0], request("b", 40, max_tokens=20)[0]
    sched.add([a, b])
    assert by_id(step(sched)) == {"a": 40, "b": 40} and pool_free(sched) == [0]  # 3 blocks each
    for _ in range(8):  # positions 40..47 still fit in the third blocks
        assert by_id(step(sched)) == {"a": 1, "b": 1}
    assert sched.stats.preemptions == 0 and a.num_cached == b.num_cached == 48
    out = step(sched)  # a's token 48 needs a fourth block: b, the newest, goes
    assert by_id(out) == {"a": 1}
    assert sched.stats.preemptions == 1
    assert b.status == Status.WAITING and b.num_cached == 0 and b.blocks is not None and not b.blocks.held
    assert list(sched.waiting) == [b] and sched.running == [a]
    assert len(b.output_token_ids) == 9, "its sampled tokens are kept: they are recomputed, not lost"
    assert pool_free(sched) == [2] and len(a.blocks.tables[0]) == 4  # type: ignore[union-attr]
    # b (49 tokens: 4 blocks) cannot come back while a holds 4 of the 6 blocks
    while a.status != Status.FINISHED:
        assert by_id(step(sched)) == {"a": 1}
    assert by_id(step(sched)) == {"b": 49}, "readmitted alone: its prompt and outputs recomputed"
    run(sched)
    assert sched.stats.preemptions == 1
    assert [len(s.output_token_ids) for s in (a, b)] == [20, 20] and b.status == Status.FINISHED
    assert pool_free(sched) == [6]


def test_preempted_sequences_go_back_to_the_front_oldest_first() -> None:
    sched = make(blocks=8, max_num_seqs=4, budget=128, prefix=False)
    seqs = [request(f"r{i}", 20, max_tokens=30)[0] for i in range(4)]  # 2 blocks each: the pool is full
    late = request("late", 20)[0]
    sched.add(seqs)
    step(sched)
    sched.add([late])
    for _ in range(12):  # positions 20..31
        assert by_id(step(sched)) == {"r0": 1, "r1": 1, "r2": 1, "r3": 1}
    # Position 32 needs a third block each: r0 forces out r3, r1 takes the other block r3 left, r2 is then the
    # newest running and goes itself.
    assert by_id(step(sched)) == {"r0": 1, "r1": 1}
    assert sched.stats.preemptions == 2 and sched.running == seqs[:2]
    assert list(sched.waiting) == [seqs[2], seqs[3], late], "preempted ones at the front, oldest first"
    assert all(s.num_cached == 0 and not s.blocks.held for s in seqs[2:])  # type: ignore[union-attr]
    run(sched)
    assert all(len(s.output_token_ids) == 30 for s in seqs) and len(late.output_token_ids) == 4
    assert pool_free(sched) == [8]


def test_no_admission_in_a_step_that_preempted() -> None:
    sched = make(blocks=4, max_num_seqs=4, budget=16, prefix=False)
    a, b = request("a", 20, max_tokens=30)[0], request("b", 20, max_tokens=30)[0]
    sched.add([a, b])
    while sched.stats.preemptions == 0:
        out = step(sched)
    # a's token 32 needs a third block: b goes. Its first 15-token chunk would fit in the block left over, but the
    # pools are short: it waits for the next step.
    assert by_id(out) == {"a": 1} and list(sched.waiting) == [b] and pool_free(sched) == [1]
    run(sched)
    assert [len(s.output_token_ids) for s in (a, b)] == [30, 30] and pool_free(sched) == [4]


def test_a_preempted_sequence_recomputes_little_with_the_prefix_cache() -> None:
    sched = make(blocks=7, max_num_seqs=4, budget=128, prefix=True)
    a, b = request("a", 40, max_tokens=20)[0], request("b", 40, max_tokens=20)[0]
    sched.add([a, b])
    step(sched)  # 3 blocks each, 1 free
    while sched.stats.preemptions == 0:
        step(sched)
    # At position 48 a took the free block and b, the newest, had to go itself; its 3 full blocks stay cached.
    assert sched.running == [a] and list(sched.waiting) == [b] and len(b.output_token_ids) == 9
    assert sched.memory.pools[0].num_cached == 3 + 3  # a's and b's full blocks
    while a.status != Status.FINISHED:
        assert by_id(step(sched)) == {"a": 1}, "b (4 blocks) does not fit beside a"
    assert by_id(step(sched)) == {"b": 1}, "48 of its 49 tokens hit its own cached blocks"
    assert sched.memory.stats.hit_tokens == 48
    run(sched)
    assert [len(s.output_token_ids) for s in (a, b)] == [20, 20] and pool_free(sched) == [7]


def test_a_sequence_that_cannot_fit_alone_is_unservable() -> None:
    sched = make(blocks=2, prefix=False)
    big, small = request("big", 40)[0], request("small", 20, max_tokens=2)[0]
    sched.add([big, small])
    assert by_id(sched.schedule()) == {"small": 20}, "the one that fits is admitted past it"
    assert sched.unservable == [big] and pool_free(sched) == [0]
    sched.computed([(small, 20)])


def test_a_sequence_outgrowing_the_pool_alone_becomes_unservable_and_frees_its_blocks() -> None:
    sched = make(blocks=3, prefix=False)
    seq = request("grow", 40, max_tokens=20)[0]  # fits at first (3 blocks), needs a fourth at token 48
    sched.add([seq])
    steps = 0
    while sched.has_work():
        step(sched)
        steps += 1
    assert sched.unservable == [seq] and seq.num_cached == 0 and len(seq.output_token_ids) == 9
    assert steps == 10 and pool_free(sched) == [3] and not sched.running and not sched.waiting


# ------------------------------------------------------------------------------------------------ n > 1
def test_siblings_wait_for_the_prompt_then_share_its_blocks() -> None:
    sched = make(budget=64)
    seqs = request("n3", 40, n=3)
    sched.add(seqs)
    assert by_id(step(sched)) == {"n3": 40}, "siblings wait while sequence 0 computes the prompt"
    assert [s.status for s in seqs] == [Status.RUNNING, Status.WAITING, Status.WAITING]
    assert by_id(step(sched)) == {"n3": 1, "n3.1": 8, "n3.2": 8}, \
        "the siblings take the 2 cached full blocks and compute only the partial last block"
    shared = seqs[0].blocks.tables[0][:2]  # type: ignore[union-attr]
    assert all(s.blocks.tables[0][:2] == shared for s in seqs)  # type: ignore[union-attr]
    assert [sched.memory.pools[0].refs(b) for b in shared] == [3, 3]
    assert len({s.blocks.tables[0][2] for s in seqs}) == 3, "each its own partial block"  # type: ignore[union-attr]
    assert sched.memory.stats.hit_tokens == 64 and sched.memory.stats.queried_tokens == 3 * 40
    run(sched)
    assert all(len(s.output_token_ids) == 4 for s in seqs) and pool_free(sched) == [64]


def test_siblings_of_a_chunked_prompt_wait_for_its_last_chunk() -> None:
    sched = make(budget=32)
    seqs = request("n3", 96, n=3)  # 6 full blocks: the siblings recompute the last one
    other = request("other", 8)[0]
    sched.add(seqs)
    sched.add([other])
    chunks = [by_id(step(sched)) for _ in range(3)]
    assert chunks == [{"n3": 32}] * 3, "siblings and the request behind them wait while the prompt is computed"
    assert seqs[0].num_cached == 96 and len(seqs[0].output_token_ids) == 1
    assert by_id(step(sched)) == {"n3": 1, "n3.1": 16, "n3.2": 15}, "80 of 96 prompt tokens hit the cache"
    assert seqs[1].blocks.tables[0][:5] == seqs[0].blocks.tables[0][:5]  # type: ignore[union-attr]
    assert by_id(step(sched)) == {"n3": 1, "n3.1": 1, "other": 8, "n3.2": 1}
    run(sched)
    assert all(len(s.output_token_ids) == 4 for s in [*seqs, other]) and pool_free(sched) == [64]


def test_siblings_do_not_wait_without_prefix_caching() -> None:
    sched = make(budget=128, prefix=False)
    seqs = request("n3", 40, n=3)
    sched.add(seqs)
    assert by_id(step(sched)) == {"n3": 40, "n3.1": 40, "n3.2": 40}
    assert sched.memory.stats.hit_tokens == 0


# ------------------------------------------------------------------------------------------------ abort
def test_abort_frees_waiting_and_running_sequences() -> None:
    sched = make(max_num_seqs=2)
    sched.add(request("a", 20, n=2))
    sched.add(request("b", 20))
    sched.add(request("c", 20))
    step(sched)
    step(sched)
    assert {s.request_id for s in sched.running} == {"a"} and pool_free(sched) == [64 - 3]
    assert sched.abort("nope") == []
    aborted = sched.abort("a")
    assert sorted(s.index for s in aborted) == [0, 1]
    assert all(s.status == Status.FINISHED and s.finish_reason == "abort" for s in aborted)
    assert pool_free(sched) == [64] and not sched.running
    (b,) = sched.abort("b")
    assert b.finish_reason == "abort" and [s.request_id for s in sched.waiting] == ["c"]
    run(sched)
    assert not sched.has_work() and pool_free(sched) == [64]
    for pool in sched.memory.pools:
        pool.check()


def test_abort_of_a_finished_sequence_keeps_its_finish_reason() -> None:
    sched = make()
    seq = request("a", 5, max_tokens=1)[0]
    sched.add([seq])
    step(sched)
    assert seq.finish_reason == "length" and not sched.has_work()
    assert sched.abort("a") == [] and seq.finish_reason == "length"


# ------------------------------------------------------------------------------------------------ random
def run_random(seed: int, kinds: list[CacheKind], blocks: int, prefix: bool) -> dict[str, int]:
    """Random arrivals (shared prompt prefixes, n up to 3, random lengths), a few aborts, a small pool. Every step:
    the budget, decodes first, and a model of the KV: what each block's slots hold, written where the step computes
    (never into a shared block) and read over each kind's visible range, which must hold the sequence's own
    tokens. At the end every sequence finished with its max_tokens (or was aborted) and the pools are empty."""
    rng = random.Random(seed)
    sched = make(blocks=blocks, max_num_seqs=5, budget=40, prefix=prefix, kinds=kinds)
    mem = sched.memory
    content = [[[None] * BS for _ in range(blocks)] for _ in kinds]
    for g, pool in enumerate(mem.pools):
        orig = pool.allocate

        def allocate(orig=orig, g=g) -> int:  # type: ignore[no-untyped-def]
            b = orig()
            content[g][b] = [None] * BS  # a fresh block holds nothing readable
            return b
        pool.allocate = allocate  # type: ignore[method-assign]
    bases = [[rng.randrange(1000) for _ in range(70)] for _ in range(3)]
    all_seqs: list[Sequence] = []
    aborted: set[str] = set()
    counts = {"steps": 0, "preemptions": 0, "hit_tokens": 0, "preempting_steps": 0}
    for i in range(5000):
        if i >= 200 and not sched.has_work():
            break
        if i < 200 and rng.random() < 0.3:
            base = rng.choice(bases)
            ids = base[: rng.randrange(1, 70)] + [rng.randrange(1000) for _ in range(rng.randrange(0, 20))]
            seqs = request(f"r{i}", 0, max_tokens=rng.randrange(1, 30), n=rng.choice([1, 1, 2, 3]), prompt=ids)
            sched.add(seqs)
            all_seqs += seqs
        if i < 200 and rng.random() < 0.02 and all_seqs:
            victim = rng.choice(all_seqs).request_id
            if sched.abort(victim):
                aborted.add(victim)
        decoders = [s for s in sched.running if s.length - s.num_cached == 1]
        preemptions, was_waiting = sched.stats.preemptions, set(map(id, sched.waiting))
        out = sched.schedule()
        counts["steps"] += 1
        assert sum(n for _, n in out) <= sched.max_num_batched_tokens
        if sched.stats.preemptions == preemptions:
            assert [s for s, _ in out[: len(decoders)]] == decoders, "every decode scheduled, first"
        else:
            assert not any(id(s) in was_waiting for s, _ in out), "no admission in a step that preempted"
            counts["preempting_steps"] += 1
        for seq, n in out:
            start, end = seq.num_cached, seq.num_cached + n
            tokens = seq.all_token_ids
            assert end <= seq.length
            for g, (kind, pool) in enumerate(zip(kinds, mem.pools)):
                table = seq.blocks.tables[g]  # type: ignore[union-attr]
                assert len(table) == -(-end // BS), "the table covers exactly the computed tokens"
                for p in range(start, end):
                    b = table[p // BS]
                    assert b >= 0 and pool.refs(b) == 1, "a write into a shared or freed block"
                    content[g][b][p % BS] = tokens[p]
                lo = kind.first_live_block(start, BS) * BS  # the first query reads from here on
                for p in range(lo, end):
                    b = table[p // BS]
                    assert b >= 0 and content[g][b][p % BS] == tokens[p], (seed, g, p, "reads another's KV")
        sched.computed(out)
        for seq, _ in out:
            if seq.num_cached == seq.length:
                seq.append(rng.randrange(1000), None, None)
                if seq.status == Status.FINISHED:
                    sched.finish(seq)
        for s in sched.waiting:
            assert not s.blocks.held  # type: ignore[union-attr]
        for g, pool in enumerate(mem.pools):
            pool.check()
            held = [b for s in sched.running for b in s.blocks.tables[g] if b >= 0]  # type: ignore[union-attr]
            assert all(pool.refs(b) == held.count(b) for b in set(held)) and pool.num_used == len(set(held))
    assert not sched.has_work() and not sched.unservable
    for s in all_seqs:
        assert s.status == Status.FINISHED
        if s.request_id not in aborted:
            assert len(s.output_token_ids) == s.params.max_tokens and s.finish_reason == "length"
    assert all(p.num_free == blocks for p in mem.pools)
    counts["preemptions"] = sched.stats.preemptions
    counts["hit_tokens"] = mem.stats.hit_tokens
    return counts


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kinds", [[FullAttention()], [FullAttention(), SlidingWindow(20)]], ids=["full", "mixed"])
def test_random_workload_on_a_small_pool(kinds: list[CacheKind], seed: int) -> None:
    counts = run_random(seed, kinds, blocks=14, prefix=True)
    assert counts["preemptions"] > 0 and counts["hit_tokens"] > 0, counts


def test_random_workload_without_prefix_caching() -> None:
    counts = run_random(5, [FullAttention(), SlidingWindow(20)], blocks=14, prefix=False)
    assert counts["preemptions"] > 0 and counts["hit_tokens"] == 0, counts


def test_isolate_recomputes_a_failed_batch_one_request_at_a_time() -> None:
    """After a forward that overwrote part of its sequences' memory failed (LLMEngine.step), the batch's sequences
    are recomputed from their tokens, one request at a time: only that request is scheduled until it decodes again,
    then the next; a request outside the batch waits meanwhile and everyone continues together afterwards."""
    sched = make(budget=32)
    a, b, c = request("a", 20), request("b", 12), request("c", 5)
    sched.add(a + b)
    while any(s.length - s.num_cached > 1 for s in a + b):  # both prompts computed, now decoding
        step(sched)
    failed = [(s, 1) for s in a + b]  # the decode step that failed
    sched.add(c)
    sched.isolate(failed)
    assert [s.status for s in a + b] == [Status.WAITING] * 2 and a[0].num_cached == b[0].num_cached == 0
    seen = [{s.request_id for s, _ in step(sched)}]
    while len(seen[-1]) == 1:  # one request per step while isolated
        seen.append({s.request_id for s, _ in step(sched)})
        assert len(seen) < 50
    assert seen[0] == {"a"} and seen[-2] == {"b"} and set().union(*seen[:-1]) == {"a", "b"}
    assert seen[-1] == {"a", "b", "c"} and not sched.isolated  # together again, c admitted


def test_isolated_request_that_ends_leaves_isolation() -> None:
    sched = make()
    a, b = request("a", 20), request("b", 12)
    sched.add(a + b)
    out = step(sched)
    sched.isolate(out)
    sched.abort("a")  # the engine fails the isolated request whose recomputation fails again
    assert {s.request_id for s, _ in step(sched)} == {"b"} and sched.isolated == ["b"]
