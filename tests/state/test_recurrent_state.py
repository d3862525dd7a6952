"""RecurrentState (linear-attention layers) in the sequence memory: one slot per sequence, no prefix reuse without
snapshot slots (with them: tests/state/test_prefix_snapshots.py), prefill chunks on the layer's chunk grid, pools
sized per sequence whatever the context."""

from __future__ import annotations

import torch

from moeserve.engine.sampling_params import SamplingParams
from moeserve.engine.scheduler import Scheduler
from moeserve.engine.sequence import Sequence
from moeserve.state.kinds import FullAttention, RecurrentState
from moeserve.state.kv_cache import PagedKVCache, fixed_pool_bytes, group_block_bytes, kv_groups, size_pools
from moeserve.state.manager import SequenceMemory

KIND = RecurrentState(conv_shape=(3, 96), state_shape=(4, 16, 8), prefill_chunk=64)


def test_prefill_chunks_end_on_the_grid_or_at_the_prompt_end() -> None:
    assert KIND.prefill_end(0, 100, 300) == 64
    assert KIND.prefill_end(64, 250, 300) == 192
    assert KIND.prefill_end(192, 300, 300) == 300  # the prompt's end
    assert KIND.prefill_end(300, 301, 300) == 301  # past the prompt (recomputed output): any cut
    assert KIND.prefill_end(10, 40, 300) == 10  # no grid point inside: nothing this step
    assert FullAttention().prefill_end(0, 100, 300) == 100


def test_scheduler_cuts_prompts_on_the_grid() -> None:
    memory = SequenceMemory([FullAttention(), KIND], [64, 4], 16)
    assert not memory.prefix_caching  # a recurrent layer without snapshot slots: no prefix reuse
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=100, memory=memory)
    seq = Sequence("r", 0, list(range(250)), SamplingParams(max_tokens=4), 512, set())
    sched.add([seq])
    cuts = []
    while seq.num_cached < 250:
        [(s, n)] = sched.schedule()
        cuts.append(n)
        sched.computed([(s, n)])
    assert cuts == [64, 64, 64, 58]
    assert seq.blocks is not None and len(seq.blocks.tables[1]) == 1  # one state slot whatever the length


def test_pools_size_one_slot_per_sequence() -> None:
    groups = kv_groups([None] * 4, KIND, recurrent_layers=[0, 1, 2])
    assert [g.layers for g in groups] == [(0, 1, 2), (3,)] and groups[0].kind is KIND
    block_bytes = group_block_bytes(groups, 16, 2, 16, torch.bfloat16)
    assert block_bytes[0] == 3 * (3 * 96 * 2 + 4 * 16 * 8 * 4)
    sizes = size_pools(groups, block_bytes, 10 * 2**20, 16, max_num_seqs=5, max_num_batched_tokens=256,
                       max_model_len=4096)
    assert sizes[0] == 5
    fixed, per_token = fixed_pool_bytes(groups, block_bytes, 16, 5, 256, 4096)
    assert fixed == 5 * block_bytes[0] and per_token == block_bytes[1] // 16
    kv = PagedKVCache(groups, sizes, 16, 2, 16, torch.bfloat16, torch.device("cpu"))
    conv, state = kv.recurrent(1)
    assert conv.shape == (5, 3, 96) and conv.dtype == torch.bfloat16
    assert state.shape == (5, 4, 16, 8) and state.dtype == torch.float32
    assert kv.layer(3)[0].shape == (sizes[1], 2, 16, 16)


def test_a_step_without_room_for_a_grid_chunk_waits() -> None:
    """Two long prompts in steps of 70 tokens: every chunk is a whole grid step or a prompt's end; a sequence whose
    share of a step holds no grid point computes nothing that step (neither admitted nor cut off the grid)."""
    memory = SequenceMemory([FullAttention(), KIND], [64, 4], 16)
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=70, memory=memory)
    seqs = [Sequence(str(i), 0, list(range(130)), SamplingParams(max_tokens=2), 512, set()) for i in range(2)]
    sched.add(seqs)
    ends: dict[str, list[int]] = {"0": [], "1": []}
    while any(s.num_cached < 130 for s in seqs):
        step = sched.schedule()
        assert step and sum(n for _, n in step) <= 70
        for seq, n in step:
            ends[seq.request_id].append(seq.num_cached + n)
        sched.computed(step)
    assert all(e % 64 == 0 or e == 130 for v in ends.values() for e in v), ends
    assert ends["0"][-1] == ends["1"][-1] == 130
