"""Prefill time of one Mamba-2 mixer at Nemotron-3-Nano-30B-A3B's dimensions (tests/data/reference_configs: 64 heads
of 64, 8 groups, state 128, conv 4 x 6144 channels, hidden 2688), one prompt of --tokens tokens (512), bf16: the
prompt scan on torch (TorchMamba2.scan: the SSD chunk form in torch einsums per 64-token chunk) vs on C++
(CppMamba2.scan: mamba2_scan_), alternated round by round; printed, no assertion.

Two parts per kernel, each in wall and in process CPU time: the SSD chunk scan alone (what the choice changes: xbc SiLU'd and dt softplus'd given) and
the whole mixer call on a fresh sequence (in_proj, conv, scan, gated norm, out_proj; the same C++ GEMMs, conv and
norm in both: the C++ kernels are on, as under kernels=cpp). Random weights.

    .venv/bin/python research/bench_mamba2_chunk.py [--rounds 5] [--calls 3] [--tokens 512] [--threads N]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from moeserve.bench.kernel_setup import (
    RecurrentSlots,
    add_threads_flag,
    mamba2_pair,
    per_call_ms,
    prepare,
    print_ratios,
)
from moeserve.models.layers.base import ForwardBatch

# published config.json files (copies in the checkout's tests/data; read as data, nothing of tests is imported)
CONFIGS = Path(__file__).resolve().parents[1] / "tests" / "data" / "reference_configs"


def prefill_batch(tokens: int) -> ForwardBatch:
    """One fresh sequence (slot 0) whose whole prompt of `tokens` tokens is in the batch."""
    return ForwardBatch(torch.zeros(tokens, dtype=torch.long), torch.arange(tokens), [0], [tokens],
                        [torch.zeros(tokens, dtype=torch.long)], [torch.tensor([[0]])], [[[0]]], prompt_lens=[tokens])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=512)
    add_threads_flag(ap)
    args = ap.parse_args()
    spec = prepare(args, "bench_mamba2_chunk", CONFIGS / "Nemotron-3-Nano-30B-A3B.json")
    m, n = spec.mamba, args.tokens
    assert m is not None
    dtype, gen = torch.bfloat16, torch.Generator().manual_seed(0)
    mixers = mamba2_pair(spec, dtype)
    kv = RecurrentSlots(spec, 1, dtype)
    x = torch.randn(n, spec.hidden_size, generator=gen).to(dtype)
    xbc = F.silu(torch.randn(n, m.conv_dim, generator=gen)).to(dtype)
    dt = F.softplus(torch.randn(n, m.num_heads, generator=gen) - 3).clamp(min=m.time_step_min)
    y = torch.empty(n, m.num_heads, m.head_dim)
    batch = prefill_batch(n)
    times: dict[tuple[str, str], list[float]] = {}
    print(f"Nemotron-3-Nano Mamba-2 mixer, one prompt of {n} tokens, bf16, {torch.get_num_threads()} threads, "
          f"{args.rounds} rounds x {args.calls} calls, alternated; load average {os.getloadavg()[0]:.1f}")
    for _ in range(args.rounds):
        for name, mixer in mixers.items():
            def scan(mx=mixer) -> None:  # noqa: ANN001 - the round's mixer
                mx.kernels.scan(xbc, dt, mx.a, mx.d.float(), kv.states, y, [(0, n, 0, 0)], m)

            for part, fn in (("scan", scan), ("mixer", lambda mx=mixer: mx(x, batch, kv))):
                wall, cpu = per_call_ms(fn, args.calls)
                times.setdefault((part, name), []).append(wall)
                times.setdefault((f"{part} cpu", name), []).append(cpu)
    print_ratios(times, ("scan", "scan cpu", "mixer", "mixer cpu"))
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
