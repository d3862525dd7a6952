"""Prefix snapshots of recurrent state (state/kinds.py RecurrentState, state/manager.py): which points, which hits,
the copies planned, holds and LRU eviction. Pure Python (no torch)."""

from __future__ import annotations

from moeserve.engine.sampling_params import SamplingParams
from moeserve.engine.scheduler import Scheduler
from moeserve.engine.sequence import Sequence
from moeserve.state.kinds import FullAttention, RecurrentState
from moeserve.state.manager import SequenceMemory

BS = 16
FULL, REC = 0, 1  # group indices below


def memory(snapshots: int = 4, live: int = 2, blocks: int = 200) -> SequenceMemory:
    kinds = [FullAttention(), RecurrentState(prefill_chunk=64, snapshots=snapshots)]
    return SequenceMemory(kinds, [blocks, live + snapshots], BS)


def run_prompt(mem: SequenceMemory, prompt: list[int], chunk: int = 10_000) -> tuple[int, list]:
    """Admit `prompt` and compute it as a scheduler would (chunks ending where prefill_end says, the copies taken
    before each step); returns (hit tokens, every copy planned). Frees the sequence at the end."""
    seq = mem.new()
    hit = mem.admit(seq, prompt, len(prompt))
    done, copies = hit, []
    while done < len(prompt):
        end = mem.prefill_end(done, min(done + chunk, len(prompt)), len(prompt), seq)
        assert end > done and mem.grow(seq, end)
        copies += mem.take_copies()
        mem.computed(seq, prompt, end, len(prompt))
        done = end
    copies += mem.take_copies()
    mem.free(seq)
    return hit, copies


def test_snapshot_points_are_block_boundaries_on_the_chunk_grid() -> None:
    kind = RecurrentState(prefill_chunk=64, snapshots=2)
    assert [p for p in range(0, 400, 16) if kind.snapshot_point(p, 16)] == [64, 128, 192, 256, 320, 384]
    assert [p for p in range(0, 400, 48) if kind.snapshot_point(p, 48)] == [192, 384]  # lcm(48, 64)
    assert not RecurrentState(prefill_chunk=64).snapshot_point(64, 16), "no snapshot slots: none"
    assert kind.fixed_blocks(3, 256, 16) == 5 and kind.caches_prefixes and not RecurrentState().caches_prefixes


def test_hit_needs_a_snapshot_at_its_last_block() -> None:
    kind = RecurrentState(prefill_chunk=64, snapshots=2)
    found = [None, None, None, 7, None, None]
    assert kind.usable_hit(found, 4, BS) and not kind.usable_hit(found, 5, BS) and kind.usable_hit(found, 0, BS)
    assert kind.restore_block(found, 4) == 7 and kind.restore_block(found, 0) is None


def test_shared_prefix_cut_snapshot_then_hit() -> None:
    mem = memory()
    s = list(range(300))
    a, b, c = s + [1000] * 40, s + [2000] * 50, s + [3000] * 30
    assert run_prompt(mem, a) == (0, [])  # shares nothing: one chunk, no cut, no snapshot
    # B shares S's 18 cached blocks (288 tokens) but no snapshot: no hit, cut at 256, a snapshot saved there
    hit, copies = run_prompt(mem, b)
    assert hit == 0 and len(copies) == 1 and copies[0][0] == REC
    assert mem.stats.snapshots_saved == 1
    # C diverges inside block 18: the hit stops at the last shared snapshot point, 256; the snapshot is copied in
    hit, copies = run_prompt(mem, c)
    assert hit == 256 and copies == [(REC, copies[0][1], copies[0][2])] and copies[0][1] != copies[0][2]
    assert mem.stats.snapshots_restored == 1
    mem.pools[FULL].check()
    mem.pools[REC].check()
    assert mem.pools[REC].num_used == 0, "every hold let go once its copies were taken"


def test_chunk_cut_at_the_planned_point_only() -> None:
    mem = memory()
    s = list(range(300))
    run_prompt(mem, s + [1] * 40)
    seq = mem.new()
    prompt = s + [2] * 50
    assert mem.admit(seq, prompt, len(prompt)) == 0 and seq.cuts == [256]
    assert mem.prefill_end(0, 350, 350, seq) == 256 and mem.prefill_end(256, 350, 350, seq) == 350
    assert mem.prefill_end(0, 200, 350, seq) == 192, "the chunk grid first"
    mem.free(seq)


def test_snapshots_at_chunk_ends_on_the_grid_and_never_past_the_prompt() -> None:
    mem = memory()
    prompt = list(range(200))
    seq = mem.new()
    mem.admit(seq, prompt, 200)
    for end in (64, 128, 200):  # a budget of 64: chunk ends on the grid leave snapshots, the prompt's end does not
        mem.grow(seq, end)
        mem.computed(seq, prompt, end, 200)
    assert mem.stats.snapshots_saved == 2
    tokens = prompt + list(range(500, 560))  # 60 decoded tokens: 256 is past the prompt
    for n in range(201, 261):
        mem.grow(seq, n)
        mem.computed(seq, tokens, n, 200)
    assert mem.stats.snapshots_saved == 2 and len(seq.hashes) == 12, "no block past the prompt registered"
    mem.take_copies()
    mem.free(seq)
    # a sequence whose tokens past 200 were decoded: its hit stops inside its prompt (decode numerics differ)
    again = mem.new()
    assert mem.admit(again, tokens + [1], 200) == 128
    mem.free(again)
    mem.pools[REC].check()


def test_restore_is_planned_with_the_slot_and_given_back_if_not_admitted() -> None:
    mem = memory()
    prompt = list(range(140))
    run_prompt(mem, prompt, chunk=64)  # snapshots at 64 and 128
    seq = mem.new()
    assert mem.admit(seq, prompt, 140) == 128 and len(seq.restores) == 1
    snap = seq.restores[0][1]
    assert mem.pools[REC].refs(snap) == 1, "held from admission"
    mem.free(seq)  # e.g. no room this step
    assert mem.pools[REC].refs(snap) == 0 and mem.take_copies() == []
    seq = mem.new()
    assert mem.admit(seq, prompt, 140) == 128 and mem.grow(seq, 140)
    assert mem.take_copies() == [(REC, snap, seq.tables[REC][0])]
    assert mem.pools[REC].refs(snap) == 0
    mem.free(seq)


def test_snapshots_are_evicted_least_recently_used_and_never_take_a_live_slot() -> None:
    mem = memory(snapshots=2, live=1)
    prefixes = [[i * 1000 + t for t in range(70)] for i in range(3)]
    for p in prefixes:  # each prefix seen twice: the second run leaves a snapshot at 64
        run_prompt(mem, p + [1])
        run_prompt(mem, p + [2])
    assert mem.stats.snapshots_saved == 3 and mem.pools[REC].evictions >= 1
    assert run_prompt(mem, prefixes[2] + [3])[0] == 64, "the newest is kept"
    assert run_prompt(mem, prefixes[0] + [3])[0] == 0, "the oldest snapshot was evicted"
    # a snapshot takes only a free slot: with every slot held, none is taken (a snapshot never preempts)
    tight = memory(snapshots=1, live=2)
    x, y = tight.new(), tight.new()
    px, py = list(range(100)), list(range(1000, 1100))
    for seq, p in ((x, px), (y, py)):
        tight.admit(seq, p, 100)
        assert tight.grow(seq, 64)
    tight.computed(x, px, 64, 100)
    tight.computed(y, py, 64, 100)
    assert tight.stats.snapshots_saved == 1 and tight.pools[REC].num_free == 0
    assert len(tight.take_copies()) == 1 and tight.pools[REC].num_free == 1


def test_scheduler_cuts_a_prompt_where_it_leaves_a_shared_prefix() -> None:
    mem = memory(live=4)
    sched = Scheduler(4, 2048, mem)
    s = list(range(300))
    params = SamplingParams(max_tokens=1)
    for i, tail in enumerate(([1] * 40, [2] * 50)):
        seq = Sequence(f"r{i}", 0, s + tail, params, 512, set())
        sched.add([seq])
        steps = []
        while seq.num_cached < len(seq.prompt_token_ids):
            out = sched.schedule()
            mem.take_copies()
            steps.append(out[0][1])
            sched.computed(out)
        sched.finish(seq)
        assert steps == ([340] if i == 0 else [256, 94])


def test_siblings_resume_from_a_snapshot_near_the_prompts_end() -> None:
    """n > 1: the first sequence's prefill is cut at the last snapshot point its siblings can use (never the
    whole prompt: 144 of 150 -> 128), and they resume there."""
    mem = memory(live=4)
    sched = Scheduler(4, 2048, mem)
    params = SamplingParams(max_tokens=2, n=3)
    seqs = [Sequence("n3", i, list(range(150)), params, 512, set()) for i in range(3)]
    for s in seqs:
        s.first_sibling = seqs[0]
    sched.add(seqs)
    steps = []
    for _ in range(3):
        out = sched.schedule()
        mem.take_copies()
        steps.append(sorted(n for _, n in out))
        sched.computed(out)
    assert steps == [[128], [22], [22, 22]], "the siblings wait, then compute only what follows the snapshot"
    assert mem.stats.hit_tokens == 256 and mem.stats.snapshots_restored == 2
