"""The Mamba-2 mixer's state math (models/mixers/mamba2.py), and its two kernels: torch and the C++ ops.

- `ssd_chunk`: the SSD chunk form for one chunk of prompt tokens (fp32); `scan_torch` runs it over one sequence's
  prompt tokens on the CHUNK grid, carrying the state from chunk to chunk.
- `ssd_step`: the selective-state update of one later token, in the compute dtype as transformers' torch step,
  except that y = state . C is summed over the state dim by halving (`ssd_sum_last`) instead of by torch.bmm, whose
  order is its own: csrc/mamba2.cpp mamba2_step_ takes the same order, so the two give the same bits.
- `conv_torch`: the causal depthwise conv of one sequence's new inputs after its history; csrc mamba2_conv_ is the
  same sums in the same order for every sequence of a batch in one call.

`Mamba2Kernels` is the seam: `TorchMamba2` (kernels=torch, not CPU, or the C++ ops unavailable) runs the torch
functions per sequence (and token); `CppMamba2` runs the batch's conv in one mamba2_conv_ call, its prompt tokens in
one mamba2_scan_ call (csrc/mamba2_chunk.cpp) and all its stepped tokens in one mamba2_step_ call. The conv and the
step give the torch functions' bits (tests/kernels/test_mamba2_ops.py); the C++ scan is within fp32 rounding of the
torch scan, not its bits (tests/kernels/test_mamba2_chunk.py), so one of the two is chosen for the whole process
(`choose_mamba2_kernels`, when the model is built) and each is consistent with itself: a prompt's result depends
on its tokens and the chunk grid only, never on the batch, the split of the prompt on the grid or the threads.
Shapes: N tokens, H heads, P head_dim, G groups, S state size, C conv channels, K conv taps.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

from moeserve.models.numerics import Numerics
from moeserve.models.spec import MambaSpec

Piece = tuple[int, int, int, int]  # (offset in the batch, new tokens, first position, state slot) of a sequence
CHUNK = 64  # tokens per chunk of the prefill scan (the grid prompts are cut on: state/kinds.py prefill_end)


def segment_sum(a: torch.Tensor) -> torch.Tensor:
    """a [T, H] -> [H, T, T]: out[h, i, j] = sum of a[j+1 .. i, h] for j <= i, -inf above the diagonal (summed
    from the masked inputs, as transformers does: no difference of two long cumulative sums)."""
    t = a.shape[0]
    x = a.t()[..., None].expand(-1, t, t)  # [H, T(k), T(j)]
    x = x.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool, device=a.device), diagonal=-1), 0)
    out = torch.cumsum(x, dim=-2)
    return out.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool, device=a.device)), -torch.inf)


def ssd_chunk(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
              d: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One chunk of T tokens (fp32): x [T, H, P], dt [T, H], a [H], b / c [T, H, S], d [H]; `state` [H, P, S]
    is read and replaced by the state after the chunk. Returns y [T, H, P]."""
    da = dt * a  # [T, H]
    cum = torch.cumsum(da, dim=0)
    xdt = x * dt[..., None]
    decay = torch.exp(segment_sum(da))  # [H, T, T]
    scores = torch.einsum("lhn,shn->hls", c, b) * decay
    y = torch.einsum("hls,shp->lhp", scores, xdt)
    y = y + torch.einsum("lhn,hpn->lhp", c, state) * torch.exp(cum)[..., None]
    to_end = torch.exp(cum[-1:] - cum)  # [T, H]
    chunk_state = torch.einsum("lhn,lhp->hpn", b * to_end[..., None], xdt)
    state.copy_(state * torch.exp(cum[-1])[:, None, None] + chunk_state)
    return y + d[:, None] * x


def ssd_sum_last(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] summed over n by halving: with m = ceil(n / 2), element i becomes x[i] + x[i + m] (those with no
    partner pass as they are), until one is left. Each step is an element-wise fp32 add: one order, anywhere."""
    n = x.shape[-1]
    while n > 1:
        m = (n + 1) // 2
        pairs = x[..., : n - m] + x[..., m:n]
        x = pairs if 2 * m == n else torch.cat([pairs, x[..., n - m : m]], dim=-1)
        n = m
    return x[..., 0]


def ssd_step(x: torch.Tensor, dt: torch.Tensor, decay: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
             d: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One token in the compute dtype: x [H, P], dt [H] (softplus'd), decay = exp(dt * A) [H] fp32, b / c [H, S],
    d [H]; `state` [H, P, S] fp32, updated in place. The discretised input dt * B * x is rounded to the compute
    dtype, and the state to it before C reads it, as transformers' torch step does. Returns y [H, P]."""
    dbx = (dt[:, None] * b)[:, None, :] * x[..., None]  # [H, P, S] compute dtype
    state.copy_(state * decay[:, None, None] + dbx)
    y = ssd_sum_last(state.to(c.dtype).float() * c.float()[:, None, :])  # [H, P] fp32: bf16 products are exact
    return y.to(x.dtype) + x * d[:, None]


def scan_torch(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
               d: torch.Tensor, start: int, state: torch.Tensor) -> torch.Tensor:
    """Prompt tokens at positions [start, start + n) of one sequence (fp32: x [n, H, P], dt [n, H], b / c
    [n, H, S]) in chunks of the CHUNK grid, each zero-padded to CHUNK tokens (a zero dt adds nothing to the state
    and decays nothing), `state` [H, P, S] carried through: y [n, H, P]."""
    n, outs, lo = x.shape[0], [], 0
    while lo < n:
        hi = min(n, lo + CHUNK - (start + lo) % CHUNK)
        pad = CHUNK - (hi - lo)
        parts = [F.pad(t[lo:hi], (0, 0) * (t.dim() - 1) + (0, pad)) for t in (x, dt, b, c)]
        outs.append(ssd_chunk(parts[0], parts[1], a, parts[2], parts[3], d, state)[: hi - lo])
        lo = hi
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def conv_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, history: torch.Tensor,
               fresh: bool) -> torch.Tensor:
    """Causal depthwise conv (+ bias) of one sequence's new inputs x [n, C] after its last K-1 inputs `history`
    [K-1, C] (zeroed first for a fresh sequence; replaced by the last K-1 inputs): one fp32 sum per output over the
    K taps in order, rounded once to the compute dtype, whatever the split of the sequence. weight [C, K]."""
    if fresh:
        history.zero_()
    k, n = weight.shape[1], x.shape[0]
    padded = torch.cat([history, x])  # [K-1+n, C]
    acc = padded[0:n].float() * weight[:, 0]
    for j in range(1, k):
        acc = acc + padded[j : j + n].float() * weight[:, j]
    if bias is not None:
        acc = acc + bias
    history.copy_(padded[-(k - 1):])
    return acc.to(x.dtype)


def split_xbc(xbc: torch.Tensor, spec: MambaSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """xBC [n, C] -> x [n, H, P], B and C [n, H, S] (each group's B and C repeated for its heads)."""
    s, n = spec, xbc.shape[0]
    x, b, c = xbc.split_with_sizes([s.inner, s.n_groups * s.state_size, s.n_groups * s.state_size], dim=-1)
    rep = s.num_heads // s.n_groups
    b = b.reshape(n, s.n_groups, s.state_size).repeat_interleave(rep, dim=1)
    c = c.reshape(n, s.n_groups, s.state_size).repeat_interleave(rep, dim=1)
    return x.reshape(n, s.num_heads, s.head_dim), b, c


class Mamba2Kernels(ABC):
    """The conv, the prompt scan and the selective-state update of a Mamba-2 layer for a whole batch;
    implementations give the same bits for the conv and the step, the scan's within fp32 rounding."""

    name: str

    @abstractmethod
    def conv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, history: torch.Tensor,
             pieces: list[Piece]) -> torch.Tensor:
        """x [N, C] (compute dtype), the batch's new conv inputs, sequence after sequence as `pieces` say;
        history [slots, K-1, C] (each sequence's slot read, zeroed first for a sequence at position 0, and
        replaced by its last K-1 inputs). Returns the conv outputs [N, C] (bias added, before the SiLU)."""

    @abstractmethod
    def scan(self, xbc: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, d: torch.Tensor, states: torch.Tensor,
             y: torch.Tensor, pieces: list[Piece], spec: MambaSpec) -> None:
        """The SSD chunk scan of each piece's prompt tokens xbc[offset : offset + n] (SiLU'd), dt [N, H] fp32
        (softplus'd, clamped), on the CHUNK grid from its first position, against states[slot] ([slots, H, P, S]
        fp32, replaced by the state after the piece); a, d [H] fp32. Writes the pieces' rows of y [N, H, P] fp32."""

    @abstractmethod
    def step(self, xbc: torch.Tensor, dt: torch.Tensor, decay: torch.Tensor, d: torch.Tensor, states: torch.Tensor,
             rows: list[int], slots: list[int], spec: MambaSpec) -> torch.Tensor:
        """The selective-state update (ssd_step) of the tokens xbc[rows[i]] (SiLU'd), dt (softplus'd) and decay
        [N, H] fp32, in order, each against states[slots[i]] ([slots, H, P, S] fp32, updated in place): y [M, H, P]
        in the compute dtype."""

    @abstractmethod
    def describe(self) -> str:
        """How prompt and later tokens are computed, for the start-up log."""


class TorchMamba2(Mamba2Kernels):
    name = "torch"

    def scan(self, xbc: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, d: torch.Tensor, states: torch.Tensor,
             y: torch.Tensor, pieces: list[Piece], spec: MambaSpec) -> None:
        for o, n, start, slot in pieces:
            x, b, c = (t.float() for t in split_xbc(xbc[o : o + n], spec))
            y[o : o + n] = scan_torch(x, dt[o : o + n], a, b, c, d, start, states[slot])

    def conv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, history: torch.Tensor,
             pieces: list[Piece]) -> torch.Tensor:
        return torch.cat([conv_torch(x[o : o + n], weight, bias, history[slot], start == 0)
                          for o, n, start, slot in pieces])

    def step(self, xbc: torch.Tensor, dt: torch.Tensor, decay: torch.Tensor, d: torch.Tensor, states: torch.Tensor,
             rows: list[int], slots: list[int], spec: MambaSpec) -> torch.Tensor:
        x, b, c = split_xbc(xbc[rows], spec)
        return torch.stack([ssd_step(x[i], dt[r], decay[r], b[i], c[i], d, states[slot])
                            for i, (r, slot) in enumerate(zip(rows, slots))])

    def describe(self) -> str:
        return (f"prompt tokens by the torch SSD chunk scan (fp32, a {CHUNK}-position grid) per sequence, later "
                "tokens by the torch selective-state update per sequence and token, the conv per sequence "
                "(kernels=torch, not CPU, or the C++ kernels are unavailable)")


class CppMamba2(Mamba2Kernels):
    name = "cpp"

    def scan(self, xbc: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, d: torch.Tensor, states: torch.Tensor,
             y: torch.Tensor, pieces: list[Piece], spec: MambaSpec) -> None:
        meta = torch.tensor(pieces, dtype=torch.long).t()  # offsets, counts, starts, slots
        torch.ops.moeserve.mamba2_scan_(xbc, dt, a, d, states, y, meta[0], meta[1], meta[2], meta[3], spec.n_groups,
                                        CHUNK)

    def conv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, history: torch.Tensor,
             pieces: list[Piece]) -> torch.Tensor:
        meta = torch.tensor([(slot, n, start == 0) for _, n, start, slot in pieces], dtype=torch.long)  # one tensor
        return torch.ops.moeserve.mamba2_conv_(x, weight, bias, history, meta[:, 0], meta[:, 1], meta[:, 2])

    def step(self, xbc: torch.Tensor, dt: torch.Tensor, decay: torch.Tensor, d: torch.Tensor, states: torch.Tensor,
             rows: list[int], slots: list[int], spec: MambaSpec) -> torch.Tensor:
        meta = torch.tensor([rows, slots], dtype=torch.long)
        return torch.ops.moeserve.mamba2_step_(xbc, dt, decay, d, states, meta[0], meta[1], spec.n_groups)

    def describe(self) -> str:
        return (f"prompt tokens by C++ mamba2_scan_ (the SSD chunk scan, fp32, a {CHUNK}-position grid, fixed-order "
                "sums: within fp32 rounding of the torch scan, not its bits; every prompt piece of a batch in one "
                "call), later tokens by C++ mamba2_step_ (the selective-state update of every such token of a batch "
                "in one call), the conv of a batch in one mamba2_conv_ call (the C++ kernels are on)")


MAMBA2_KERNELS: dict[str, type[Mamba2Kernels]] = {"torch": TorchMamba2, "cpp": CppMamba2}


def choose_mamba2_kernels(numerics: Numerics) -> Mamba2Kernels:
    """The C++ ops when the model runs with them (numerics.cpp: loaded, CPU, bf16 or fp32), else torch."""
    return MAMBA2_KERNELS["cpp" if numerics.cpp else "torch"]()
