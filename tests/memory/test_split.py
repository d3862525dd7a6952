"""The one memory split (memory/split.py): defaults, overrides, refusals in one line, max_model_len lowered to fit,
the derived budget, and on random cases: the parts never exceed memory_gb, and nothing that fits is refused."""

from __future__ import annotations

import random
import subprocess
import sys
from dataclasses import replace

import pytest

from moeserve.errors import ConfigError
from moeserve.memory.budget import HEADROOM_MIN_BYTES
from moeserve.memory.split import (
    KV_SHARE,
    MemoryNeeds,
    MemorySplit,
    activation_bytes,
    fmt_bytes,
    kv_for,
    process_growth_bytes,
    split_memory,
)

GiB, MiB = 2**30, 2**20
# 1 GiB resident, 64 MiB buffers, 0.5 GiB runtime, 640 experts of 16 MiB (10 GiB), 128 KiB of KV per token
NEEDS = MemoryNeeds(resident_bytes=GiB, unit_nbytes=16 * MiB, total_experts=640, kv_bytes_per_token=128 * 1024,
                    kv_fixed_bytes=0, block_size=16, model_max_len=32768, staging_bytes=64 * MiB,
                    overhead_bytes=GiB // 2)
FIXED = GiB + 64 * MiB + GiB // 2


def split(needs: MemoryNeeds = NEEDS, *, memory_gb: float | None = None, expert_cache_gb: float | None = None,
          kv_cache_gb: float | None = None, max_model_len: int | None = None, max_num_seqs: int = 8,
          free_bytes: int = 1000 * GiB) -> MemorySplit:
    return split_memory(needs, memory_gb=memory_gb, expert_cache_gb=expert_cache_gb, kv_cache_gb=kv_cache_gb,
                        max_model_len=max_model_len, max_num_seqs=max_num_seqs, free_bytes=free_bytes)


def lines(s: MemorySplit) -> dict[str, str]:
    assert [name for name, _ in s.lines] == ["memory budget", "KV pool", "placement", "max_model_len"]
    return dict(s.lines)


def refusal(**kw: object) -> str:
    with pytest.raises(ConfigError) as err:
        split(**kw)  # type: ignore[arg-type]
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def test_all_experts_and_a_full_pool_when_they_fit():
    s = split(memory_gb=64)
    want = kv_for(NEEDS, 32768, 8)  # 8 sequences x 32768 tokens = 32 GiB (+ one block each)
    assert (s.expert_capacity, s.kv_bytes, s.max_model_len) == (640, want, 32768)
    assert s.total_bytes == FIXED + 10 * GiB + want <= 64 * GiB
    assert s.memory_bytes == s.budget_bytes == 64 * GiB
    text = lines(s)
    assert text["KV pool"].endswith("(8 sequences x 32768 tokens, beside all experts)")
    assert text["placement"].startswith("640 of 640 experts") and "all fit" in text["placement"]
    assert text["max_model_len"] == "32768 (auto: the model's max_position_embeddings)"
    assert text["memory budget"].startswith("64.00 GiB (memory_gb=64, set): resident weights 1.00 GiB + read "
                                            "buffers 64.0 MiB + runtime 512.0 MiB + KV pool")


def test_experts_keep_most_of_the_memory_when_they_do_not_all_fit():
    many = replace(NEEDS, total_experts=2000)  # 31.25 GiB of experts
    s = split(many, memory_gb=24)
    room = 24 * GiB - FIXED
    assert s.kv_bytes == kv_for(many, 32768) < KV_SHARE * room  # one full-context sequence (4 GiB)
    assert s.expert_capacity == (room - s.kv_bytes) // many.unit_nbytes < 2000
    assert s.max_model_len == 32768
    assert "one 32768-token sequence: the experts do not all fit" in lines(s)["KV pool"]
    assert "read from disk on demand" in lines(s)["placement"]
    small = split(memory_gb=12)  # one sequence (4 GiB) is more than a quarter of room: a quarter, context lowered
    assert small.kv_bytes == int(KV_SHARE * (12 * GiB - FIXED))
    assert "25% of what the fixed parts leave" in lines(small)["KV pool"]
    assert small.expert_capacity == (12 * GiB - FIXED - small.kv_bytes) // NEEDS.unit_nbytes < 640
    assert small.max_model_len < 32768 and small.max_model_len % 16 == 0
    assert small.kv_bytes >= kv_for(NEEDS, small.max_model_len)


def test_what_all_experts_leave_goes_to_the_pool():
    """All experts fit beside a pool smaller than max_num_seqs full sequences but larger than one: the pool gets
    the rest, nothing lies unused."""
    s = split(memory_gb=20)
    assert s.expert_capacity == 640
    assert s.kv_bytes == 20 * GiB - FIXED - 10 * GiB == s.budget_bytes - s.total_bytes + s.kv_bytes
    assert "what all experts leave" in lines(s)["KV pool"]


def test_max_model_len_lowered_to_what_the_pool_holds():
    big = replace(NEEDS, model_max_len=262144)
    s = split(big, memory_gb=8)
    assert s.max_model_len % 16 == 0 and kv_for(big, s.max_model_len) <= s.kv_bytes
    assert kv_for(big, s.max_model_len + 16) > s.kv_bytes  # the most that fits, to a multiple of 16
    assert lines(s)["max_model_len"] == (f"{s.max_model_len} (auto: the model's 262144 does not fit the "
                                         f"{s.kv_bytes / GiB:.2f} GiB KV pool of memory_gb=8; set max_model_len or "
                                         "raise memory_gb)")
    kept = split(big, memory_gb=8, max_model_len=4096)
    assert kept.max_model_len == 4096 and lines(kept)["max_model_len"] == "4096 (set)"


def test_refusal_names_every_part_in_one_line():
    msg = refusal(memory_gb=1.6)
    assert msg.startswith("does not fit: resident weights 1.00 GiB + read buffers 64.0 MiB + runtime 512.0 MiB + "
                          "KV of one 256-token sequence 34.0 MiB + one expert 16.0 MiB = ")
    assert "exceed memory_gb=1.6; raise memory_gb" in msg
    assert "lower max_model_len" in refusal(memory_gb=5, max_model_len=32768)  # one 4 GiB sequence does not fit
    assert "KV of one 32768-token sequence 4.00 GiB" in refusal(memory_gb=5, max_model_len=32768)
    derived = refusal(free_bytes=2 * GiB)
    assert "exceed the 1.00 GiB derived from free memory; free memory or set memory_gb" in derived
    assert "exceeds the model's max_position_embeddings=32768" in refusal(memory_gb=64, max_model_len=65536)


def test_kv_cache_gb_is_the_pool():
    s = split(memory_gb=12, kv_cache_gb=2)
    assert s.kv_bytes == 2 * GiB and s.expert_capacity == (12 * GiB - FIXED - 2 * GiB) // NEEDS.unit_nbytes
    assert lines(s)["KV pool"] == "2.00 GiB (kv_cache_gb=2, set)"
    assert s.max_model_len == 16368  # 2 GiB / 128 KiB = 16384 tokens, less a block, to a multiple of 16
    too_small = refusal(memory_gb=12, kv_cache_gb=0.01)
    assert too_small.startswith("kv_cache_gb=0.01 (10.2 MiB) cannot hold one 256-token sequence")
    too_big = refusal(memory_gb=12, kv_cache_gb=11)
    assert "KV pool 11.00 GiB (kv_cache_gb=11) + one expert 16.0 MiB" in too_big
    assert "exceed memory_gb=12; lower kv_cache_gb, or raise memory_gb" in too_big


def test_expert_cache_gb_is_the_cache():
    s = split(memory_gb=12, expert_cache_gb=4)
    assert s.expert_capacity == 256 and s.expert_bytes == 4 * GiB
    assert s.kv_bytes == 12 * GiB - FIXED - 4 * GiB  # the pool gets what the experts leave
    assert "expert_cache_gb=4, set" in lines(s)["placement"]
    assert "what expert_cache_gb leaves" in lines(s)["KV pool"]
    capped = split(memory_gb=64, expert_cache_gb=100)
    assert capped.expert_capacity == 640 and "capped at all" in lines(capped)["placement"]
    assert capped.kv_bytes == kv_for(NEEDS, 32768, 8) and "capped at 8 sequences" in lines(capped)["KV pool"]
    assert split(memory_gb=12, expert_cache_gb=0).expert_capacity == 1  # a few KB still runs (one slot)
    tight = split(memory_gb=1.65, expert_cache_gb=0)  # room for one expert and a little KV: still one slot
    assert tight.expert_capacity == 1 and tight.total_bytes <= tight.budget_bytes
    msg = refusal(needs=replace(NEEDS, total_experts=2000), memory_gb=12, expert_cache_gb=10.43)
    assert "expert cache 10.42 GiB (expert_cache_gb=10.43) + KV of one 256-token sequence 34.0 MiB exceed" in msg
    assert msg.endswith("lower expert_cache_gb or raise memory_gb")


def test_both_overrides_must_fit_together():
    s = split(memory_gb=12, expert_cache_gb=4, kv_cache_gb=2)
    assert (s.expert_bytes, s.kv_bytes) == (4 * GiB, 2 * GiB)
    msg = refusal(memory_gb=12, expert_cache_gb=6, kv_cache_gb=5)
    assert "KV pool 5.00 GiB (kv_cache_gb=5) + expert cache 6.00 GiB (expert_cache_gb=6)" in msg
    assert "lower kv_cache_gb or expert_cache_gb, or raise memory_gb" in msg


def test_derived_budget_is_free_memory_less_headroom():
    s = split(free_bytes=40 * GiB)
    assert s.memory_bytes is None and s.budget_bytes == 36 * GiB  # 10% headroom
    assert lines(s)["memory budget"].startswith("36.00 GiB (derived: 40.00 GiB free less 4.00 GiB headroom")
    small = split(free_bytes=5 * GiB)
    assert small.budget_bytes == 5 * GiB - HEADROOM_MIN_BYTES and small.total_bytes <= small.budget_bytes
    over = split(memory_gb=16, free_bytes=8 * GiB)  # allowed, with a warning in the line
    assert over.budget_bytes == 16 * GiB
    assert "warning: only 8.00 GiB is free now" in lines(over)["memory budget"]
    assert "warning" not in lines(split(memory_gb=16, free_bytes=32 * GiB))["memory budget"]


def test_random_cases_fit_the_budget_and_nothing_that_fits_is_refused():
    rng = random.Random(0)
    fitted = refused = 0
    for _ in range(3000):
        needs = MemoryNeeds(
            resident_bytes=rng.randrange(1, 8 * GiB), unit_nbytes=rng.randrange(MiB // 4, 512 * MiB),
            total_experts=rng.randrange(1, 4096), kv_bytes_per_token=rng.choice([0, rng.randrange(1, 512 * 1024)]),
            kv_fixed_bytes=rng.choice([0, rng.randrange(0, GiB)]), block_size=rng.choice([1, 16, 32, 256]),
            model_max_len=rng.choice([128, 300, 2048, 32768, 131072, 262144]),
            staging_bytes=rng.randrange(0, 256 * MiB), overhead_bytes=rng.randrange(0, 2 * GiB),
            process_bytes=rng.randrange(0, 2 * GiB))
        memory_gb = rng.choice([None, rng.uniform(0.5, 200)])
        expert_cache_gb = rng.choice([None, None, rng.uniform(0, 50)])
        kv_cache_gb = rng.choice([None, None, rng.uniform(0.001, 50)])
        max_model_len = rng.choice([None, None, rng.randrange(1, needs.model_max_len + 1)])
        max_num_seqs = rng.randrange(1, 64)
        free = rng.randrange(0, 256 * GiB)
        kw = dict(memory_gb=memory_gb, expert_cache_gb=expert_cache_gb, kv_cache_gb=kv_cache_gb,
                  max_model_len=max_model_len, max_num_seqs=max_num_seqs, free_bytes=free)
        try:
            s = split_memory(needs, **kw)  # type: ignore[arg-type]
        except ConfigError as err:
            assert "\n" not in str(err)
            refused += 1
            if expert_cache_gb is None and kv_cache_gb is None:  # refused only when the minimum cannot fit
                min_ctx = max_model_len or min(256, needs.model_max_len)
                budget = int(memory_gb * GiB) if memory_gb is not None else \
                    max(0, free - max(HEADROOM_MIN_BYTES, int(free * 0.1)))
                room = budget - needs.resident_bytes - needs.staging_bytes - needs.overhead_bytes - \
                    (needs.process_bytes if memory_gb is not None else 0)
                assert room < kv_for(needs, min_ctx) + needs.unit_nbytes, kw
            continue
        fitted += 1
        assert s.total_bytes <= s.budget_bytes, kw
        if memory_gb is not None:
            assert s.budget_bytes == s.memory_bytes == int(memory_gb * GiB)
        assert 1 <= s.expert_capacity <= needs.total_experts and s.expert_bytes == s.expert_capacity * needs.unit_nbytes
        assert s.kv_bytes >= kv_for(needs, s.max_model_len), kw  # one sequence of max_model_len always fits
        assert s.max_model_len <= needs.model_max_len
        if max_model_len is not None:
            assert s.max_model_len == max_model_len
        if kv_cache_gb is not None:
            assert s.kv_bytes == int(kv_cache_gb * GiB)
        if expert_cache_gb is None and s.expert_capacity < needs.total_experts:
            assert s.budget_bytes - s.total_bytes < needs.unit_nbytes, kw  # the experts got all that was left
        assert all(name and value for name, value in s.lines) and "\n" not in "".join(v for _, v in s.lines)
    assert fitted > 1000 and refused > 200


def test_the_process_rss_is_charged_to_memory_gb_only():
    """memory_gb covers everything the process holds, its start-up RSS included; a budget derived from free memory
    does not charge it again (free memory already excludes it): a test process that has grown to 11 GiB must not
    refuse a small model because of its own size."""
    needs = replace(NEEDS, process_bytes=11 * GiB)
    derived = split_memory(needs, memory_gb=None, expert_cache_gb=None, kv_cache_gb=None, max_model_len=None,
                           max_num_seqs=8, free_bytes=12 * GiB)
    assert derived.overhead_bytes == NEEDS.overhead_bytes
    assert f"runtime {fmt_bytes(NEEDS.overhead_bytes)}" in lines(derived)["memory budget"]
    charged = NEEDS.overhead_bytes + 11 * GiB + process_growth_bytes(11 * GiB)  # with what it grows by later
    with pytest.raises(ConfigError, match=f"runtime {fmt_bytes(charged)}"):
        split_memory(needs, memory_gb=12, expert_cache_gb=None, kv_cache_gb=None, max_model_len=None,
                     max_num_seqs=8, free_bytes=12 * GiB)
    given = split_memory(needs, memory_gb=40, expert_cache_gb=None, kv_cache_gb=None, max_model_len=None,
                         max_num_seqs=8, free_bytes=64 * GiB)
    assert given.overhead_bytes == charged and given.total_bytes <= 40 * GiB


def test_activation_estimate_is_generous():
    base = activation_bytes(2048, 4096, 1536, 8, 6144, 151936, 8, 2)
    per_token = 6 * 4096 + 6144 + 4096 + 3 * 8 * 1536
    assert base == 2 * 2048 * per_token * 4 + 3 * 8 * 151936 * 4  # counted as fp32, twice
    assert activation_bytes(2048, 4096, 1536, 8, 6144, 151936, 16, 2) > base  # more sampled rows
    gathered = activation_bytes(2048, 4096, 1536, 8, 6144, 151936, 8, 2, context=32768, kv_width=512)
    assert gathered - base == 2 * 2 * 32768 * 512 * 4  # one sequence's K and V of one layer, twice


def test_split_imports_no_torch():
    code = "import sys, moeserve.memory.split; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
