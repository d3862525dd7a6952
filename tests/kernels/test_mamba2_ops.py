"""The C++ Mamba-2 ops (csrc/mamba2.cpp) against the torch functions they replace (models/mixers/mamba2_ssd.py):

- mamba2_step_ == ssd_step bit for bit (y and every state slot) for a batch of sequences in their own slots, two
  tokens of one sequence in one call, several steps in a row: tiny and Nemotron-3-Nano dimensions (64 heads of 64,
  8 groups, state 128), batch 1 and 5, bf16 and fp32.
- mamba2_conv_ == conv_torch bit for bit (outputs and histories): prompt chunks and decode tokens, fresh and
  continuing sequences, with and without a bias.
- A whole tiny Nemotron-H model (bf16, default settings, kernels=cpp, the shared exactness driver): its Mamba-2
  layers' conv and step on the C++ ops give the logits of the same model with them on torch at every step, tokens
  and logprobs (prompts decoded together); kernels=cpp builds them on CppMamba2 and logs it. In fp32 kernels=auto
  (= cpp, C++ scan included) and kernels=torch each match transformers within 1e-4 (test_nemotron_h).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moeserve.models.mixers import mamba2
from moeserve.models.mixers.mamba2 import Mamba2Mixer
from moeserve.models.mixers.mamba2_ssd import CppMamba2, Mamba2Kernels, TorchMamba2
from moeserve.models.spec import MambaSpec
from tests.kernels.ops import cpp_ops
from tests.models import exactness as X

SHAPES = {"tiny": (8, 2, 8, 16), "nano": (64, 8, 64, 128), "one-group": (4, 1, 64, 128)}  # H, G, P, S


def spec_of(heads: int, groups: int, head_dim: int, state: int) -> MambaSpec:
    return MambaSpec(layers=(0,), num_heads=heads, head_dim=head_dim, n_groups=groups, state_size=state,
                     conv_kernel=4, conv_bias=True, proj_bias=False, eps=1e-5, time_step_min=1e-3)


def step_inputs(spec: MambaSpec, n: int, dtype: torch.dtype, gen: torch.Generator):
    """xbc (SiLU'd), dt (softplus'd), decay = exp(dt A) as the mixer makes them, for n tokens."""
    xbc = torch.nn.functional.silu(torch.randn(n, spec.conv_dim, generator=gen) * 2).to(dtype)
    dt = torch.nn.functional.softplus(torch.randn(n, spec.num_heads, generator=gen) - 3).to(dtype)
    a = -torch.rand(spec.num_heads, generator=gen) * 15 - 1
    return xbc, dt, torch.exp(dt.float() * a)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("slots", [[3], [5, 0, 2, 4, 1], [2, 2, 0]], ids=["batch1", "batch5", "two-tokens-of-one"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_step_equals_the_torch_step(shape: str, slots: list[int], dtype: torch.dtype) -> None:
    cpp_ops()
    spec = spec_of(*SHAPES[shape])
    gen = torch.Generator().manual_seed(len(slots) + spec.num_heads)
    states = torch.randn(6, spec.num_heads, spec.head_dim, spec.state_size, generator=gen) * 0.3
    torch_states = states.clone()
    d = (1 + 0.2 * torch.randn(spec.num_heads, generator=gen)).to(dtype)
    rows = [1 + 2 * i for i in range(len(slots))]  # among other tokens (a prompt's, say) of the batch
    for _ in range(3):
        xbc, dt, decay = step_inputs(spec, 2 * len(slots) + 1, dtype, gen)
        got = CppMamba2().step(xbc, dt, decay, d, states, rows, slots, spec)
        ref = TorchMamba2().step(xbc, dt, decay, d, torch_states, rows, slots, spec)
        assert got.dtype == dtype and torch.equal(got, ref)
        assert torch.equal(states, torch_states)  # the slots in use updated alike, the others untouched
    assert not torch.equal(states[slots[0]], torch.randn(1))  # (the states really moved: compared non-trivially)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_conv_equals_the_torch_conv(dtype: torch.dtype, bias: bool) -> None:
    cpp_ops()
    gen = torch.Generator().manual_seed(int(bias))
    channels, taps = 200, 4
    weight = torch.randn(channels, taps, generator=gen).to(dtype)
    b = torch.randn(channels, generator=gen).to(dtype) if bias else None
    history = torch.randn(5, taps - 1, channels, generator=gen).to(dtype)
    torch_history = history.clone()
    # (offset, new tokens, first position, slot): a fresh prompt chunk, a continued one, decode tokens, 2 tokens
    for pieces in ([(0, 70, 0, 4), (70, 64, 64, 1), (134, 1, 9, 0)], [(0, 1, 70, 4), (1, 2, 128, 1), (3, 1, 10, 0)]):
        n = sum(p[1] for p in pieces)
        x = torch.randn(n, channels, generator=gen).to(dtype)
        got = CppMamba2().conv(x, weight, b, history, pieces)
        ref = TorchMamba2().conv(x, weight, b, torch_history, pieces)
        assert torch.equal(got, ref) and torch.equal(history, torch_history)


def test_bad_inputs_are_refused() -> None:
    ops = cpp_ops()
    spec = spec_of(*SHAPES["tiny"])
    xbc, dt, decay = step_inputs(spec, 2, torch.float32, torch.Generator().manual_seed(0))
    states, d = torch.zeros(2, 8, 8, 16), torch.ones(8)
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops.mamba2_step_(xbc, dt, decay, d, states, torch.tensor([0]), torch.tensor([2]), 2)
    with pytest.raises(RuntimeError, match="row out of range"):
        ops.mamba2_step_(xbc, dt, decay, d, states, torch.tensor([2]), torch.tensor([0]), 2)
    with pytest.raises(RuntimeError, match="one dtype"):
        ops.mamba2_step_(xbc.bfloat16(), dt, decay, d, states, torch.tensor([0]), torch.tensor([0]), 2)
    with pytest.raises(RuntimeError, match="multiple of n_groups"):
        ops.mamba2_step_(xbc, dt, decay, d, states, torch.tensor([0]), torch.tensor([0]), 3)
    x, w = torch.zeros(3, 6), torch.zeros(6, 4)
    with pytest.raises(RuntimeError, match="counts must add up"):
        ops.mamba2_conv_(x, w, None, torch.zeros(2, 3, 6), torch.tensor([0]), torch.tensor([2]), torch.tensor([1]))


# ------------------------------------------------------------------------------------------- the whole model
class CppStepTorchScan(CppMamba2):
    """The C++ conv and selective-state update beside the torch prompt scan (the C++ scan is not the torch scan's
    bits: tests/kernels/test_mamba2_chunk.py): what must give TorchMamba2's bits."""

    scan = TorchMamba2.scan


def run_with(folder: Path, prompts: list[list[int]], mamba: type[Mamba2Kernels],
             monkeypatch: pytest.MonkeyPatch) -> X.Run:
    """The prompts decoded together (the shared exactness driver: bf16, default settings but kernels=cpp) with the
    Mamba-2 layers' kernels built as `mamba`."""
    with monkeypatch.context() as patch:
        patch.setattr(mamba2, "choose_mamba2_kernels", lambda numerics: mamba())
        return X.run_together(folder, prompts, steps=8, kernels="cpp")


@pytest.mark.slow  # ~30 s on the shared 2 cores
def test_model_with_the_cpp_mamba_ops_gives_the_torch_bits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Everything else on the C++ kernels: the Mamba-2 layers' conv and step on the C++ ops (CppStepTorchScan)
    and on torch give the same logits at every step (prefill in chunks of the scan, decode of three sequences of
    different lengths together), the same tokens and logprobs. (The rest of the model differs between kernels=cpp
    and kernels=torch by design, and so does the C++ scan; each matches transformers in fp32:
    test_nemotron_h.test_tiny_matches_transformers with kernels auto (= cpp here) and torch.)"""
    cpp_ops()
    from tests.fixtures.nemotron_h import write_nemotron_h

    folder = write_nemotron_h(tmp_path / "bf16", torch.bfloat16)
    prompts = X.random_prompts(3, (150, 5, 70))
    cpp = run_with(folder, prompts, CppStepTorchScan, monkeypatch)
    X.assert_same_run(cpp, run_with(folder, prompts, TorchMamba2, monkeypatch), "C++ conv and step vs torch")
    assert len(cpp.logits) > 5


def test_kernels_cpp_chooses_the_cpp_scan_and_says_so(tmp_path: Path) -> None:
    """kernels=cpp builds the Mamba-2 layers on CppMamba2 (scan, step and conv in C++), named in the start-up
    line."""
    cpp_ops()
    from tests.fixtures.nemotron_h import write_nemotron_h

    llm = X.open_llm(write_nemotron_h(tmp_path / "bf16", torch.bfloat16), kernels="cpp")
    mixers = [layer.attn for layer in llm.engine.model.layers if isinstance(layer.attn, Mamba2Mixer)]
    line = llm.engine.choices["mamba"]
    llm.engine.close()
    assert len(mixers) == 3 and all(isinstance(m.kernels, CppMamba2) for m in mixers)
    assert line.startswith("3 layers") and "C++ mamba2_scan_" in line and "C++ mamba2_step_" in line
