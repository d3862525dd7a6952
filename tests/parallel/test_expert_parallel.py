"""Expert parallelism end to end on 127.0.0.1 (models/experts/remote.py, engine/ep.py): a head engine in this process
and 1-2 `moeserve ep-worker` child processes, each holding only its share of every MoE layer's experts. Every engine
step's logits are torch.equal to one process's, and so are the tokens and logprobs, for the demo model and tiny bf16
models of three architectures at top-4 and top-8 (Qwen3-MoE; Qwen2-MoE with a shared expert; Qwen3-Next, hybrid
linear attention), contiguous and round-robin ownership, the C++ and the torch kernels, prompts of mixed lengths
batched together with chunked prefill, then decode. Each worker's peak RSS stays within its memory_gb and its store
holds only its experts; a worker whose settings change the numerics is refused at start-up in one line naming the
field; a worker's expert read error (its own copy of the model truncated) fails the call in one line, and the next
call, once the file is whole, gives the right output."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.bench.checkpoints import write_tiny_checkpoint
from moeserve.engine.llm_engine import demo_model_path
from moeserve.errors import ConfigError, ExpertLoadError
from moeserve.models.experts.remote import ExpertParallel
from tests.logits_capture import generate_capturing_logits
from tests.parallel.cluster import (
    JOIN_TIMEOUT_S,
    free_address,
    in_process_gb,
    reap,
    start_worker,
    worker_flags,
    workers_said,
)

pytestmark = pytest.mark.slow

# mixed lengths: 37 tokens prefilled in chunks of 16 beside a 3-token prompt and a 9-token one, then all decode
PROMPTS = [{"prompt_token_ids": [(7 * i + 3) % 290 + 5 for i in range(37)]},
           {"prompt_token_ids": [11, 5, 77]},
           {"prompt_token_ids": [3, 17, 42, 9, 250, 8, 61, 100, 2]}]
PARAMS = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3)
SETTINGS = {"max_num_batched_tokens": 16, "threads": 1, "skip_tokenizer_init": True,
            "ep_join_timeout": JOIN_TIMEOUT_S}
WORKER_GB = 0.9  # the process (torch, the C++ ops) and a tiny model's experts


@pytest.fixture(scope="module")
def model_of(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("ep_models")

    @functools.cache
    def make(name: str) -> Path:
        if name == "demo":
            return demo_model_path()
        arch, experts, top_k = {"qwen3_moe-top4": ("qwen3_moe", 8, 4), "qwen2_moe-top8": ("qwen2_moe", 16, 8),
                                "qwen3_next-top4": ("qwen3_next", 8, 4)}[name]
        return write_tiny_checkpoint(root / name, arch, dtype="bfloat16", num_experts=experts,
                                     num_experts_per_tok=top_k)

    return make


def table(outs: list[Any]) -> list[Any]:
    return [[(o.token_ids, o.logprobs) for o in out.outputs] for out in outs]


def run_parallel(model: Path, worker_gbs: list[float], head_gb: float = 1.5,
                 **settings: Any) -> tuple[list[torch.Tensor], list[Any], list[tuple[int, int, str]], Any, Any]:
    """(logits of every step, outputs, each worker's (status, peak RSS, output), the head's kernel, its store)."""
    address = free_address()
    workers = [start_worker(model, address, gb, *worker_flags(settings)) for gb in worker_gbs]
    try:
        llm = LLM(model=str(model), memory_gb=in_process_gb(head_gb), ep_listen=address, ep_workers=len(workers),
                  **settings)
        kernel, store = llm.engine.model.moe_blocks[0].experts, llm.engine.model.store
        logits, outs = generate_capturing_logits(llm, PROMPTS, PARAMS)  # closes the engine: the workers stop
    except Exception as err:  # the head failed: the workers' own words say why
        raise AssertionError(f"the head failed: {err}\n" + workers_said([reap(w) for w in workers])) from err
    reaped = [reap(w) for w in workers]
    return logits, outs, reaped, kernel, store


def check_shares(store: Any, outputs: list[str], num_experts: int) -> None:
    """Each rank's store holds its own experts only: the head's and every worker's (from its start-up line) hold
    their count of experts per layer x the MoE layers, and the counts add up to the model's experts."""
    counts = [store.num_experts]
    assert store.total_experts == len(store.layers) * store.num_experts
    for output in outputs:
        found = re.search(r"serves experts (.+) of each of (\d+) MoE layers \(fast tier \(cpu\) (\d+) of (\d+) "
                          r"experts", output)
        assert found, output[-2000:]
        ids = [e for part in found[1].split(", ") for e in range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1)]
        assert int(found[4]) == int(found[2]) * len(ids)  # its store: its experts of every MoE layer
        counts.append(len(ids))
    assert sum(counts) == num_experts


CASES = [  # (model, worker budgets, settings)
    ("demo", [WORKER_GB, WORKER_GB], {}),
    ("qwen3_moe-top4", [WORKER_GB], {"ep_ownership": "round_robin"}),
    ("qwen2_moe-top8", [WORKER_GB, 2 * WORKER_GB], {}),
    # recurrent layers prefill in chunks of 64 positions: a step holds one chunk and the decodes
    ("qwen3_next-top4", [WORKER_GB], {"kernels": "torch", "max_num_batched_tokens": 66, "max_num_seqs": 2}),
]


@pytest.mark.parametrize(("name", "worker_gbs", "extra"), CASES, ids=[c[0] for c in CASES])
def test_expert_parallel_steps_equal_one_process(model_of, name: str, worker_gbs: list[float],
                                                 extra: dict[str, Any]) -> None:
    model = model_of(name)
    settings = {**SETTINGS, **extra}
    ref_logits, ref_outs = generate_capturing_logits(
        LLM(model=str(model), memory_gb=in_process_gb(2),
            **{k: v for k, v in settings.items() if not k.startswith("ep_")}),
        PROMPTS, PARAMS)
    logits, outs, reaped, kernel, store = run_parallel(model, worker_gbs, **settings)
    for (status, peak, output), budget in zip(reaped, worker_gbs, strict=True):  # (ranks go by joining order)
        assert status == 0, output[-2000:]
        assert 100 * 2**20 < peak <= budget * 2**30, f"a worker's peak RSS {peak / 2**20:.0f} MiB > memory_gb={budget}"
        assert re.search(r"rank \d stopped by the head", output), output[-2000:]
    assert isinstance(kernel, ExpertParallel) and kernel.stats["bytes_received"] > 0
    check_shares(store, [output for _, _, output in reaped], len(kernel.owners))
    assert len(logits) == len(ref_logits)
    for step, (a, b) in enumerate(zip(logits, ref_logits, strict=True)):
        assert torch.equal(a, b), f"{name}: logits differ at step {step}"
    assert table(outs) == table(ref_outs)


def test_mismatched_numerics_are_refused_at_start_up(model_of) -> None:
    """A worker with batch_invariant off (other numerics) is refused by the head in one line naming the field,
    and says so itself; neither serves."""
    model = model_of("qwen3_moe-top4")
    address = free_address()
    worker = start_worker(model, address, WORKER_GB, *worker_flags({**SETTINGS, "batch_invariant": False}))
    with pytest.raises(ConfigError, match=r"rank 1 refused: numerics differs .*head 'cpp-inv\d+"):
        LLM(model=str(model), memory_gb=in_process_gb(1.5), ep_listen=address, ep_workers=1,
            **SETTINGS)
    status, _, output = reap(worker)
    assert status == 1 and "error: expert parallelism: rank 1 refused: numerics differs" in output, output[-2000:]
    assert "serves experts" not in output  # refused before serving


def test_a_workers_read_error_fails_the_call_and_the_next_call_works(tiny_checkpoint, copy_checkpoint) -> None:
    """The worker reads its experts from its own copy of the model (offloaded: a 1-unit cache); that copy's shard is
    truncated mid-run: the call fails with the worker's one-line read error, and once the file is whole again the
    next call gives the right output (the head and the worker stay in step after an error)."""
    original = tiny_checkpoint("qwen3_moe")
    mine = copy_checkpoint(original)
    shard = mine / "model.safetensors"
    address = free_address()
    worker = start_worker(mine, address, WORKER_GB, "--dtype", "float32", "--threads", "1", "--expert-cache-gb",
                          "4e-6", "--ep-join-timeout", str(JOIN_TIMEOUT_S))
    prompt, params = {"prompt_token_ids": [3, 17, 42, 9]}, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    try:
        llm = LLM(str(original), skip_tokenizer_init=True, dtype="float32", threads=1,
                  memory_gb=in_process_gb(1.5), ep_listen=address, ep_workers=1, ep_join_timeout=JOIN_TIMEOUT_S)
        try:
            expected = llm.generate(prompt, params)[0].outputs[0].token_ids
            whole = shard.read_bytes()
            with open(shard, "r+b") as f:
                f.truncate(len(whole) // 8)  # every expert's bytes are gone from the worker's copy
            with pytest.raises(ExpertLoadError, match=r"^rank 1: .*model\.safetensors") as err:
                llm.generate(prompt, params)
            assert "\n" not in str(err.value)
            shard.write_bytes(whole)
            assert llm.generate(prompt, params)[0].outputs[0].token_ids == expected
        finally:
            llm.engine.close()
    finally:
        status, _, output = reap(worker)
    assert status == 0, output[-2000:]
    offloaded = re.search(r"serves experts .* \(fast tier \(cpu\) 1 of (\d+) experts", output)
    assert offloaded and int(offloaded[1]) > 1, output[-2000:]  # its store held 1 of its experts: misses read
