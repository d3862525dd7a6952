"""Decode-step time of one Mamba-2 mixer at Nemotron-3-Nano-30B-A3B's dimensions (tests/data/reference_configs:
64 heads of 64, 8 groups, state 128, conv 4 x 6144 channels, hidden 2688), batch 1, bf16: its kernels on torch
(TorchMamba2) vs on the C++ ops (CppMamba2), alternated round by round; printed, no assertion.

Two figures per kernel: the whole mixer call (in_proj and out_proj are the same C++ GEMVs in both: the C++ kernels
are on, as under kernels=cpp) and the part the kernels choice changes (conv, SiLU, softplus, decay, the
selective-state update). Random weights; the state and conv history advance every call, as in decoding.

    .venv/bin/python research/bench_mamba2_step.py [--rounds 7] [--calls 50] [--batch 1] [--threads N]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
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
from moeserve.models.mixers.mamba2 import Mamba2Mixer

# published config.json files (copies in the checkout's tests/data; read as data, nothing of tests is imported)
CONFIGS = Path(__file__).resolve().parents[1] / "tests" / "data" / "reference_configs"


def decode_batch(batch: int, start: int) -> ForwardBatch:
    """`batch` sequences (slots 0..batch-1) each adding one token after a prompt of `start` tokens."""
    table = [[b] for b in range(batch)]
    return ForwardBatch(torch.zeros(batch, dtype=torch.long), torch.full((batch,), start), [start] * batch,
                        [1] * batch, [torch.zeros(batch, dtype=torch.long)], [torch.tensor(table)], [table],
                        prompt_lens=[start] * batch)


def kernels_part(mixer: Mamba2Mixer, xbc: torch.Tensor, dt: torch.Tensor, kv: RecurrentSlots,
                 batch: int) -> Callable[[], torch.Tensor]:
    """The part of a decode call that the kernels choice changes, as Mamba2Mixer.__call__ runs it."""
    pieces = [(b, 1, 100, b) for b in range(batch)]
    rows, slots = list(range(batch)), list(range(batch))

    def run() -> torch.Tensor:
        conv = mixer.kernels.conv(xbc, mixer.conv_weight, mixer.conv_bias, kv.conv, pieces)
        x = mixer.numerics.rows(F.silu, conv)
        t = mixer.numerics.rows(lambda v: F.softplus(v + mixer.dt_bias), dt)
        decay = mixer.numerics.rows(lambda v: torch.exp(v.float() * mixer.a), t)
        return mixer.kernels.step(x, t, decay, mixer.d, kv.states, rows, slots, mixer.spec)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--batch", type=int, default=1)
    add_threads_flag(ap)
    args = ap.parse_args()
    spec = prepare(args, "bench_mamba2_step", CONFIGS / "Nemotron-3-Nano-30B-A3B.json")
    dtype, gen = torch.bfloat16, torch.Generator().manual_seed(0)
    mixers = mamba2_pair(spec, dtype)
    kv = RecurrentSlots(spec, args.batch, dtype)
    x = (torch.randn(args.batch, spec.hidden_size, generator=gen)).to(dtype)
    m = spec.mamba
    assert m is not None
    xbc = torch.randn(args.batch, m.conv_dim, generator=gen).to(dtype)
    dt = torch.randn(args.batch, m.num_heads, generator=gen).to(dtype)
    batch = decode_batch(args.batch, 100)
    times: dict[tuple[str, str], list[float]] = {}
    print(f"Nemotron-3-Nano Mamba-2 mixer, batch {args.batch}, bf16, {torch.get_num_threads()} threads, "
          f"{args.rounds} rounds x {args.calls} calls, alternated")
    for _ in range(args.rounds):
        for name, mixer in mixers.items():
            times.setdefault(("mixer", name), []).append(per_call_ms(lambda mx=mixer: mx(x, batch, kv), args.calls)[0])
            part = kernels_part(mixer, xbc, dt, kv, args.batch)
            times.setdefault(("kernels", name), []).append(per_call_ms(part, args.calls)[0])
    print_ratios(times, ("mixer", "kernels"))


if __name__ == "__main__":
    main()
