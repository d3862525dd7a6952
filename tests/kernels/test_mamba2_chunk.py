"""The C++ SSD chunk scan (csrc/mamba2_chunk.cpp mamba2_scan_, through mamba2_ssd.CppMamba2.scan) of Mamba-2's
prompt tokens:

- within 1e-6 (relative to the largest value) of transformers' torch chunk scan (`mamba2_chunk_scan`, fp32) in y
  and in the state after the prompt, continuing from a state: tiny dimensions and Nemotron-3-Nano's (heads of 64,
  state 128, 8 heads per group; a few heads), prompts shorter than a chunk, on the grid and past it; and of the
  torch scan (`TorchMamba2.scan`) for a piece starting off the grid;
- consistent with itself bit for bit: a prompt cut on the chunk grid into several calls == one call; a batch of
  sequences (bf16 and fp32 inputs, each in its own slot, fresh and continued) == each alone; 1 thread == 2 threads;
- bad inputs refused with a one-line error.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeserve.models.mixers.mamba2_ssd import CHUNK, CppMamba2, Mamba2Kernels, Piece, TorchMamba2
from moeserve.models.spec import MambaSpec
from tests.kernels.ops import cpp_ops

SHAPES = {"tiny": (8, 2, 8, 16), "nano-16-heads": (16, 2, 64, 128)}  # H, G, P, S (Nano: 64 heads, 8 groups)


def spec_of(heads: int, groups: int, head_dim: int, state: int) -> MambaSpec:
    return MambaSpec(layers=(0,), num_heads=heads, head_dim=head_dim, n_groups=groups, state_size=state,
                     conv_kernel=4, conv_bias=True, proj_bias=False, eps=1e-5, time_step_min=1e-3)


def scan_inputs(spec: MambaSpec, n: int, dtype: torch.dtype, seed: int):  # noqa: ANN201 - a tuple of tensors
    """xbc (SiLU'd) [n, C] in `dtype`, dt (softplus'd, clamped) [n, H] fp32, a and d [H] fp32, as the mixer makes
    them."""
    gen = torch.Generator().manual_seed(seed)
    xbc = F.silu(torch.randn(n, spec.conv_dim, generator=gen) * 2).to(dtype)
    dt = F.softplus(torch.randn(n, spec.num_heads, generator=gen) - 3).clamp(min=spec.time_step_min)
    a = -(torch.rand(spec.num_heads, generator=gen) * 15 + 1)
    return xbc, dt, a, 1 + 0.2 * torch.randn(spec.num_heads, generator=gen)


def states_of(spec: MambaSpec, slots: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(slots, spec.num_heads, spec.head_dim, spec.state_size, generator=gen) * 0.3


def scan(kernels: Mamba2Kernels, spec: MambaSpec, xbc: torch.Tensor, dt: torch.Tensor, a: torch.Tensor,
         d: torch.Tensor, states: torch.Tensor, pieces: list[Piece]) -> torch.Tensor:
    """y [N, H, P] of the pieces (zeros elsewhere); `states` updated."""
    y = torch.zeros(xbc.shape[0], spec.num_heads, spec.head_dim)
    kernels.scan(xbc, dt, a, d, states, y, pieces, spec)
    return y


def relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("n", [5, CHUNK, 150], ids=["short", "one-chunk", "three-chunks"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kernels", [CppMamba2, TorchMamba2], ids=["cpp", "torch"])
def test_scan_within_1e6_of_transformers(kernels: type[Mamba2Kernels], shape: str, n: int) -> None:
    # transformers' modeling module takes seconds to import: here, not at collection
    from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan

    cpp_ops()
    spec = spec_of(*SHAPES[shape])
    h, g, p, s = SHAPES[shape]
    xbc, dt, a, d = scan_inputs(spec, n, torch.float32, seed=n)
    states = states_of(spec, 3, seed=1)
    start_state = states[2].clone()
    y = scan(kernels(), spec, xbc, dt, a, d, states, [(0, n, 0, 2)])
    x, b, c = xbc.split([h * p, g * s, g * s], dim=-1)
    ref_y, ref_state = mamba2_chunk_scan(x.reshape(1, n, h, p), dt[None], a, b.reshape(1, n, g, s),
                                         c.reshape(1, n, g, s), CHUNK, D=d, initial_states=start_state[None],
                                         return_final_states=True)
    assert relative(y, ref_y[0]) < 1e-6
    assert relative(states[2], ref_state[0]) < 1e-6
    assert torch.equal(states[:2], states_of(spec, 3, seed=1)[:2])  # other slots untouched


@pytest.mark.parametrize("shape", list(SHAPES))
def test_piece_off_the_grid_within_1e6_of_the_torch_scan(shape: str) -> None:
    """A piece starting at position 100 finishes its chunk first (to 128), then goes on on the grid."""
    cpp_ops()
    spec = spec_of(*SHAPES[shape])
    xbc, dt, a, d = scan_inputs(spec, 90, torch.float32, seed=7)
    states, torch_states = states_of(spec, 2, seed=2), states_of(spec, 2, seed=2)
    y = scan(CppMamba2(), spec, xbc, dt, a, d, states, [(0, 90, 100, 1)])
    ref = scan(TorchMamba2(), spec, xbc, dt, a, d, torch_states, [(0, 90, 100, 1)])
    assert relative(y, ref) < 1e-6 and relative(states, torch_states) < 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_prompt_cut_on_the_grid_equals_one_call(dtype: torch.dtype) -> None:
    cpp_ops()
    spec = spec_of(*SHAPES["nano-16-heads"])
    xbc, dt, a, d = scan_inputs(spec, 150, dtype, seed=3)
    one, cut = torch.zeros(1, spec.num_heads, spec.head_dim, spec.state_size), states_of(spec, 1, seed=9)
    cut.zero_()
    whole = scan(CppMamba2(), spec, xbc, dt, a, d, one, [(0, 150, 0, 0)])
    parts = [scan(CppMamba2(), spec, xbc[lo:hi], dt[lo:hi], a, d, cut, [(0, hi - lo, lo, 0)])
             for lo, hi in ((0, 64), (64, 128), (128, 150))]
    assert torch.equal(torch.cat(parts), whole) and torch.equal(cut, one)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_batch_equals_each_alone(dtype: torch.dtype) -> None:
    """Three sequences in one call (a fresh prompt, a prompt continued at 64, a short one) == each alone."""
    cpp_ops()
    spec = spec_of(*SHAPES["nano-16-heads"])
    xbc, dt, a, d = scan_inputs(spec, 150 + 70 + 9, dtype, seed=4)
    pieces = [(0, 150, 0, 3), (150, 70, 64, 0), (220, 9, 0, 2)]
    together = states_of(spec, 4, seed=5)
    alone = together.clone()
    y = scan(CppMamba2(), spec, xbc, dt, a, d, together, pieces)
    for o, n, start, slot in pieces:
        ref = scan(CppMamba2(), spec, xbc[o : o + n], dt[o : o + n], a, d, alone, [(0, n, start, slot)])
        assert torch.equal(y[o : o + n], ref)
    assert torch.equal(together, alone)


def test_thread_count_changes_no_bit() -> None:
    """Nemotron-3-Nano's 64 heads of 64 in 8 groups, two sequences: 1 thread == 2 threads."""
    cpp_ops()
    spec = spec_of(64, 8, 64, 128)
    xbc, dt, a, d = scan_inputs(spec, 200, torch.bfloat16, seed=6)
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            states = states_of(spec, 2, seed=8)
            runs.append((scan(CppMamba2(), spec, xbc, dt, a, d, states, [(0, 130, 0, 1), (130, 70, 128, 0)]),
                         states))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


def test_bad_inputs_are_refused() -> None:
    ops = cpp_ops()
    spec = spec_of(*SHAPES["tiny"])
    xbc, dt, a, d = scan_inputs(spec, 10, torch.float32, seed=0)
    states, y = states_of(spec, 2, seed=0), torch.zeros(10, spec.num_heads, spec.head_dim)

    def call(pieces: list[Piece], **changed: torch.Tensor) -> None:
        args = {"xbc": xbc, "dt": dt, "a": a, "d": d, "states": states, "y": y, **changed}
        meta = torch.tensor(pieces).t()
        ops.mamba2_scan_(*args.values(), meta[0], meta[1], meta[2], meta[3], spec.n_groups, CHUNK)

    with pytest.raises(RuntimeError, match="slot out of range"):
        call([(0, 10, 0, 2)])
    with pytest.raises(RuntimeError, match="two pieces in one slot"):
        call([(0, 5, 0, 1), (5, 5, 0, 1)])
    with pytest.raises(RuntimeError, match="piece rows out of range"):
        call([(5, 6, 0, 0)])
    with pytest.raises(RuntimeError, match="dt, a, d and y fp32"):
        call([(0, 10, 0, 0)], dt=dt.bfloat16())
    with pytest.raises(RuntimeError, match="xbc"):
        call([(0, 10, 0, 0)], xbc=xbc[:, 1:])
