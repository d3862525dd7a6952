"""Prefix caching for models with recurrent layers (state/kinds.py RecurrentState snapshots), bf16, default settings.

A tiny Qwen3-Next (Gated DeltaNet + gated attention) and a tiny Nemotron-H (Mamba-2 + attention), both written by
transformers; prompts of several hundred tokens (several 64-position chunks of the chunk form). In one engine,
one request after the other (S: 300 shared tokens, 18 full blocks of 16):

- A = S + a: nothing cached, one prefill step, no snapshot (its chunk ends off the grid);
- B = S + b: the attention blocks of S are cached but no snapshot on them, so no hit; B's prefill is cut at 256
  (the last snapshot point inside what it shares) and leaves a snapshot there;
- C = S + c: a hit of 256 tokens (it diverges inside block 18, past the last shared snapshot boundary);
- A again: a hit of 256 (S's snapshot), and it leaves one at 320 (its prompt's blocks were cached by its first run);
- A a third time: a hit of 320.

Every request's greedy tokens, logprobs and every sampling step's logits are torch.equal to the same requests run
with prefix caching off (bf16, default settings; and fp32, where resuming off the chunk grid was measured to differ:
snapshots every block instead of every 64 positions fail this test in fp32). Under memory pressure (max_num_seqs=1:
one snapshot slot), prompts sharing another prefix T after C evict S's snapshot: C again falls back to recompute
(no hit), still equal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from moeserve.checkpoint.folder import open_checkpoint
from moeserve.engine.sizing import spec_kv_groups
from moeserve.memory.rss import current_rss_bytes
from moeserve.models.validate import read_model
from tests.fixtures.nemotron_h import write_nemotron_h
from tests.fixtures.real_dims import write_nemotron_nano, write_qwen35
from tests.logits_capture import capturing_logits
from tests.models import exactness as X
from tests.models.exactness import STEPS

SHARED = 300


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("nemotron_h_prefix")
    return {"bfloat16": write_nemotron_h(root / "bf16", torch.bfloat16), "float32": write_nemotron_h(root / "fp32")}


# bf16 with default settings is the claim; fp32 is where a resume off the chunk grid shows (bf16 rounding hides it)
DTYPES = ["bfloat16", pytest.param("float32", marks=pytest.mark.slow)]


def prompts(seed: int) -> dict[str, list[int]]:
    """S + a, S + b, S + c (S: SHARED tokens), and T + d, T + e, T + f sharing another prefix T."""
    s, a, b, c, t, d, e, f = X.random_prompts(seed, (SHARED, 40, 50, 30, 200, 20, 30, 40))
    return {"A": s + a, "B": s + b, "C": s + c, "D": t + d, "E": t + e, "F": t + f}


def run_each(folder: Path, named: list[tuple[str, list[int]]], **settings: Any) -> dict[str, Any]:
    """Each prompt alone, in order, in one engine: per request (tokens, logprobs, its sampling steps' logits, prefix
    hit tokens), and the engine's snapshot counters and start-up choices."""
    llm = X.open_llm(folder, **settings)
    engine = llm.engine
    out: dict[str, Any] = {}
    try:
        with capturing_logits(engine) as logits:
            for i, (name, prompt) in enumerate(named):
                before, hit = len(logits), engine.memory.stats.hit_tokens
                done = llm.generate([{"prompt_token_ids": prompt}], X.greedy(STEPS))[0].outputs[0]
                out[f"{i}:{name}"] = (list(done.token_ids), done.logprobs, logits[before:][-STEPS:],
                                      engine.memory.stats.hit_tokens - hit)
        recurrent = [g for g, kind in enumerate(engine.memory.kinds) if not kind.holds_token_blocks]
        out["evictions"] = sum(engine.memory.pools[g].evictions for g in recurrent)
        out["stats"] = engine.memory.stats
        out["metrics"] = engine.sequence_memory_stats()
        out["choices"] = dict(engine.choices)
    finally:
        engine.close()
    return out


def assert_equal_to_uncached(got: dict[str, Any], ref: dict[str, Any]) -> None:
    for key, (tokens, logprobs, logits, _) in ((k, v) for k, v in got.items() if ":" in k):
        ref_tokens, ref_logprobs, ref_logits, _ = ref[key]
        assert len(logits) == len(ref_logits) == STEPS, key
        for step, (x, y) in enumerate(zip(logits, ref_logits)):
            assert x.dtype == y.dtype == torch.float32 and torch.equal(x, y), f"{key}: logits differ at step {step}"
        assert tokens == ref_tokens and logprobs == ref_logprobs, f"{key}: tokens or logprobs differ"


def hits(run: dict[str, Any]) -> list[int]:
    return [v[3] for k, v in run.items() if ":" in k]


def check_model(folder: Path, **settings: Any) -> None:
    p = prompts(3)
    order = [("A", p["A"]), ("B", p["B"]), ("C", p["C"]), ("A", p["A"]), ("A", p["A"])]
    cached = run_each(folder, order, **settings)
    assert "prefix caching on" in cached["choices"]["KV cache"], cached["choices"]["KV cache"]
    assert "8 recurrent-state slots" in cached["choices"]["prefix snapshots"]
    assert hits(cached) == [0, 0, 256, 256, 320]
    assert (cached["stats"].snapshots_saved, cached["stats"].snapshots_restored) == (2, 3)  # B's 256, A's 320
    metrics = cached["metrics"]
    assert (metrics["prefix_hit_tokens"], metrics["prefix_snapshots_saved"], metrics["prefix_snapshots_restored"]) \
        == (256 + 256 + 320, 2, 3)
    assert_equal_to_uncached(cached, run_each(folder, order, enable_prefix_caching=False, **settings))


def check_eviction(folder: Path) -> None:
    p = prompts(4)
    order = [(n, p[n]) for n in ("A", "B", "C", "D", "E", "F", "C")]
    # max_num_seqs=1: 1 snapshot slot; a 10 MiB attention pool keeps every prompt's blocks
    cached = run_each(folder, order, max_num_seqs=1, kv_cache_gb=0.01)
    assert hits(cached) == [0, 0, 256, 0, 0, 192, 0], "C's second run: S's snapshot evicted by T's"
    assert cached["evictions"] > 0
    assert_equal_to_uncached(cached, run_each(folder, order, max_num_seqs=1, kv_cache_gb=0.01,
                                              enable_prefix_caching=False))


@pytest.mark.parametrize("dtype", DTYPES)
def test_qwen3_next_prefix_hits_are_exact(tiny_checkpoint, dtype: str) -> None:
    check_model(tiny_checkpoint("qwen3_next", dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_nemotron_h_prefix_hits_are_exact(nemotron: dict[str, Path], dtype: str) -> None:
    check_model(nemotron[dtype])


def test_qwen3_next_evicted_snapshots_fall_back_to_recompute(tiny_checkpoint) -> None:
    check_eviction(tiny_checkpoint("qwen3_next", dtype="bfloat16"))


def test_nemotron_h_evicted_snapshots_fall_back_to_recompute(nemotron: dict[str, Path]) -> None:
    check_eviction(nemotron["bfloat16"])


@pytest.mark.slow
def test_qwen3_5_real_dims_prefix_hits_are_exact(checkpoint_once) -> None:
    """Qwen3.5-35B-A3B's dimensions (hidden 2048, 32 value heads of 128: 2 MiB of state per layer; 4 layers, 12
    experts; the checkpoint tests/models/test_real_dims_exactness.py writes), bf16, default settings."""
    folder = checkpoint_once("real_dims-Qwen3.5-35B-A3B", write_qwen35)
    check_model(folder, memory_gb=6 + current_rss_bytes() / 2**30)


@pytest.mark.slow
def test_nemotron_nano_real_dims_prefix_hits_are_exact(tmp_path: Path) -> None:
    """Nemotron-3-Nano-30B-A3B's dimensions (6 blocks MEM*E-: Mamba-2 with 64 heads of 64 x 128 state, 8 experts),
    bf16, default settings."""
    check_model(write_nemotron_nano(tmp_path / "nano"), memory_gb=6 + current_rss_bytes() / 2**30)


def test_snapshots_are_sized_in_the_memory_budget(tiny_checkpoint) -> None:
    """The snapshot slots are part of the recurrent pool's fixed size, so the memory plan charges them."""
    _, spec = read_model(open_checkpoint(tiny_checkpoint("qwen3_next", dtype="bfloat16")))
    (plain,), (snap,) = ([g.kind for g in spec_kv_groups(spec, n) if not g.kind.holds_token_blocks] for n in (0, 6))
    assert (plain.fixed_blocks(4, 256, 16), snap.fixed_blocks(4, 256, 16)) == (4, 10)
    assert not plain.caches_prefixes and snap.caches_prefixes
