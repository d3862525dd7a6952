"""How the model's ops reduce: one frozen `Numerics`, chosen once at start-up and handed to every layer.

Batch invariance (EngineSettings.batch_invariant): torch's CPU GEMMs pick their blocking by the row count, so a
row's result changes with the number of rows beside it (measured: F.linear bf16 [1, 2880] x [2880, 5760]^T differs
at 33+ rows). Where moeserve's C++ ops (one fixed order per row) do not apply, torch ops see rows in blocks of
exactly `row_block` (the last one zero-padded): one call shape for every batch, and within a call shape a row's
result does not depend on its position or neighbours (tests/engine/test_batch_invariance.py checks both). The block
is chosen from the CPU (`choose_row_block`): with AMX, a 32-row bf16 GEMM costs about what a 1-row one does;
without it, every padded row is compute.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

ROW_BLOCK_AMX, ROW_BLOCK_DEFAULT = 32, 16


@dataclass(frozen=True)
class Numerics:
    """The numerics every layer of one model computes with (never changed after the model is built)."""

    cpp: bool = False  # the moeserve C++ ops compute (kernels=cpp, and CPU with bf16 or fp32)
    batch_invariant: bool = False  # every op reduces each row alone, in one fixed order, whatever the batch
    row_block: int = ROW_BLOCK_DEFAULT  # rows per call of the torch ops that remain, when batch-invariant

    @property
    def invariant_rows(self) -> int:
        """The row block the C++ ops are told to mimic for torch fallbacks: `row_block`, or 0 when batch-variant."""
        return self.row_block if self.batch_invariant else 0

    def rows(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """fn(x) for a row-wise fn: in fixed blocks of `row_block` rows when batch-invariant, else in one call."""
        return in_row_blocks(fn, x, self.row_block) if self.batch_invariant else fn(x)

    @property
    def id(self) -> str:
        """A short stable name of these numerics (what two processes must share to give the same bits)."""
        return f"{'cpp' if self.cpp else 'torch'}-{'inv' + str(self.row_block) if self.batch_invariant else 'var'}"


def in_row_blocks(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, block: int) -> torch.Tensor:
    """fn(x) for a row-wise fn, computed on blocks of exactly `block` rows of x [N, ...] (the last zero-padded)."""
    n = x.shape[0]
    pad = -n % block
    if pad:
        x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
    outs = [fn(x[i : i + block]) for i in range(0, n + pad, block)]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out[:n] if pad else out


def choose_row_block(cpuinfo: str | None = None) -> tuple[int, str]:
    """(rows, reason) for this CPU (`cpuinfo`: the text of /proc/cpuinfo, read when None)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    if " amx_bf16" in cpuinfo:
        return ROW_BLOCK_AMX, f"{ROW_BLOCK_AMX} rows (AMX: a padded row costs little)"
    return ROW_BLOCK_DEFAULT, f"{ROW_BLOCK_DEFAULT} rows (no AMX: padded rows are compute)"


def choose_numerics(cpp: bool, batch_invariant: bool, dtype: torch.dtype, device: torch.device,
                    cpuinfo: str | None = None) -> tuple[Numerics, str]:
    """The model's numerics and the start-up log's reason. The C++ ops cover bf16 and fp32 on CPU; elsewhere `cpp`
    is off whatever was asked."""
    cpp = cpp and device.type == "cpu" and dtype in (torch.bfloat16, torch.float32)
    row_block, block_reason = choose_row_block(cpuinfo)
    numerics = Numerics(cpp=cpp, batch_invariant=batch_invariant, row_block=row_block)
    if not batch_invariant:
        return numerics, "off (set): torch's batch-dependent GEMMs and attention where the C++ ops do not apply"
    if not cpp:
        return numerics, (f"on (kernels=torch: GEMMs in fixed blocks of {block_reason}, attention sequence by "
                          "sequence; torch's CPU norms and softmax reduce each row alone)")
    return numerics, f"on (every op reduces each row in one fixed order; torch fallbacks in fixed blocks of {block_reason})"
