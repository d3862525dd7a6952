"""Prefill time of one Gated DeltaNet layer at Qwen3-Next-80B-A3B's dimensions (tests/data/reference_configs: 16 key
/ 32 value heads of 128, conv 4 x 8192 channels, hidden 2048), one fresh sequence of --tokens prompt tokens (512),
bf16: the chunk form in torch (gated_delta_rule.chunk_form) vs in C++ (gated_delta_chunk_), alternated round by
round; printed, no assertion.

Two figures: the whole mixer call (in_proj, conv, the gates, the chunk form, the gated norm, out_proj; everything but
the chunk form is the same code in both, with the C++ kernels on as under kernels=auto) and the chunk form alone on
the layer's real input shapes. Random weights; the sequence starts from a zero state each call.

    .venv/bin/python research/bench_gated_delta.py [--rounds 5] [--tokens 512] [--threads N]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch

from moeserve.bench.kernel_setup import add_threads_flag, bench_numerics, prepare, print_ratios
from moeserve.models.layers.base import ForwardBatch
from moeserve.models.layers.linear import Linear
from moeserve.models.mixers.gated_delta import ChunkForm, GatedDeltaNet, cpp_chunk_form
from moeserve.models.mixers.gated_delta_rule import chunk_form, l2norm
from moeserve.models.spec import LinearAttentionSpec

FORMS: dict[str, ChunkForm] = {"torch": chunk_form, "cpp": cpp_chunk_form}


class RecurrentSlot:
    """What GatedDeltaNet reads of the sequence memory: one group, one slot's conv history and state."""

    def __init__(self, la: LinearAttentionSpec, dtype: torch.dtype) -> None:
        self.conv = torch.zeros(1, la.conv_kernel - 1, la.conv_dim, dtype=dtype)
        self.states = torch.zeros(1, la.num_v_heads, la.k_head_dim, la.v_head_dim)

    def recurrent(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv, self.states

    def group_of(self, layer: int) -> int:
        return 0

# published config.json files (copies in the checkout's tests/data; read as data, nothing of tests is imported)
CONFIGS = Path(__file__).resolve().parents[1] / "tests" / "data" / "reference_configs"


def build(la: LinearAttentionSpec, hidden: int, eps: float, gen: torch.Generator) -> GatedDeltaNet:
    dtype = torch.bfloat16

    def rand(*shape: int, scale: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    rows = la.conv_dim + la.value_dim + 2 * la.num_v_heads  # q, k, v | z | b, a
    numerics = bench_numerics()
    in_proj = Linear(rand(rows, hidden), None, numerics)
    out_proj = Linear(rand(hidden, la.value_dim), None, numerics)
    a_log = torch.log(torch.rand(la.num_v_heads, generator=gen) * 15 + 1).to(dtype)
    return GatedDeltaNet(la, 0, in_proj, out_proj, rand(la.conv_dim, la.conv_kernel, scale=0.3), a_log,
                         rand(la.num_v_heads, scale=0.5), (1 + rand(la.v_head_dim, scale=0.2)).to(dtype), eps,
                         numerics)


def prompt_batch(n: int) -> ForwardBatch:
    """One sequence (slot 0) prefilling n prompt tokens from position 0."""
    return ForwardBatch(torch.zeros(n, dtype=torch.long), torch.arange(n), [0], [n], [torch.zeros(n, dtype=torch.long)],
                        [torch.tensor([[0]])], [[[0]]], prompt_lens=[n])


def seconds(fn: Callable[[], object]) -> float:
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=512)
    add_threads_flag(ap)
    args = ap.parse_args()
    spec = prepare(args, "bench_gated_delta", CONFIGS / "Qwen3-Next-80B-A3B.json")
    la = spec.linear_attention
    assert la is not None
    gen = torch.Generator().manual_seed(0)
    mixer = build(la, spec.hidden_size, spec.rms_norm_eps, gen)
    slot = RecurrentSlot(la, torch.bfloat16)
    x = torch.randn(args.tokens, spec.hidden_size, generator=gen).to(torch.bfloat16)
    batch = prompt_batch(args.tokens)
    n, h = args.tokens, la.num_v_heads
    q = l2norm(torch.randn(n, h, la.k_head_dim, generator=gen))
    k = l2norm(torch.randn(n, h, la.k_head_dim, generator=gen))
    v = torch.randn(n, h, la.v_head_dim, generator=gen)
    g, beta = -torch.rand(n, h, generator=gen) * 0.5, torch.rand(n, h, generator=gen)
    times: dict[tuple[str, str], list[float]] = {}
    print(f"Qwen3-Next-80B Gated DeltaNet layer, one sequence of {n} prompt tokens, bf16, {torch.get_num_threads()} "
          f"threads, {args.rounds} rounds, alternated torch / cpp")
    for form in FORMS.values():  # warm-up
        mixer.chunk_form = form
        mixer(x, batch, slot)
    for _ in range(args.rounds):
        for name, form in FORMS.items():
            mixer.chunk_form = form
            times.setdefault(("layer", name), []).append(seconds(lambda: mixer(x, batch, slot)))
            state = torch.zeros(h, la.k_head_dim, la.v_head_dim)
            times.setdefault(("chunk form", name), []).append(seconds(lambda f=form, s=state: f(q, k, v, g, beta, s)))
    print_ratios(times, ("layer", "chunk form"), scale=1e3)


if __name__ == "__main__":
    main()
