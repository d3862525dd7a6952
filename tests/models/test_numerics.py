"""models/numerics.py: the row block chosen from the CPU's flags, the C++ ops kept only where they compute (CPU, bf16
or fp32), `rows` giving a row-wise fn's one-call result in fixed blocks, and `id` telling numerics apart."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from moeserve.models.numerics import (
    ROW_BLOCK_AMX,
    ROW_BLOCK_DEFAULT,
    Numerics,
    choose_numerics,
    choose_row_block,
)

# /proc/cpuinfo excerpts: a Sapphire Rapids core (AMX) and an AMD EPYC Zen 4 core (AVX-512 BF16, no AMX)
AMX = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
NO_AMX = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_the_row_block_follows_amx() -> None:
    assert choose_row_block(AMX) == (ROW_BLOCK_AMX, "32 rows (AMX: a padded row costs little)")
    assert choose_row_block(NO_AMX) == (ROW_BLOCK_DEFAULT, "16 rows (no AMX: padded rows are compute)")
    assert choose_row_block("")[0] == ROW_BLOCK_DEFAULT  # no flags read: the default


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_cpp_ops_stay_on_for_cpu_bf16_and_fp32(dtype: torch.dtype) -> None:
    numerics, _ = choose_numerics(True, True, dtype, CPU, NO_AMX)
    assert numerics == Numerics(cpp=True, batch_invariant=True, row_block=ROW_BLOCK_DEFAULT)
    assert not choose_numerics(False, True, dtype, CPU, NO_AMX)[0].cpp  # never on when not asked


@pytest.mark.parametrize(("dtype", "device"), [(torch.bfloat16, CUDA), (torch.float32, torch.device("meta")),
                                               (torch.float16, CPU)], ids=["cuda", "meta", "fp16"])
def test_the_cpp_ops_turn_off_where_they_do_not_compute(dtype: torch.dtype, device: torch.device) -> None:
    numerics, reason = choose_numerics(True, True, dtype, device, AMX)
    assert numerics == Numerics(cpp=False, batch_invariant=True, row_block=ROW_BLOCK_AMX)
    assert reason.startswith("on (kernels=torch: GEMMs in fixed blocks of 32 rows (AMX")


def test_the_reasons_read_as_the_start_up_log() -> None:
    assert choose_numerics(True, True, torch.bfloat16, CPU, NO_AMX)[1] == (
        "on (every op reduces each row in one fixed order; torch fallbacks in fixed blocks of 16 rows (no AMX: padded "
        "rows are compute))")
    numerics, reason = choose_numerics(True, False, torch.bfloat16, CPU, NO_AMX)
    assert not numerics.batch_invariant and numerics.invariant_rows == 0
    assert reason.startswith("off (set)")


@pytest.mark.parametrize("n", [1, 5, 16, 17, 40])
def test_rows_equal_one_call_for_a_row_wise_fn(n: int) -> None:
    x = torch.randn(n, 7, 3, generator=torch.Generator().manual_seed(n))
    calls: list[torch.Tensor] = []

    def fn(t: torch.Tensor) -> torch.Tensor:  # row-wise: row i of the output reads row i of t only
        calls.append(t)
        return t.cumsum(dim=1) * 2 - 1

    one = fn(x)
    calls.clear()
    numerics = Numerics(batch_invariant=True, row_block=16)
    assert numerics.invariant_rows == 16
    assert torch.equal(numerics.rows(fn, x), one)
    assert [c.shape[0] for c in calls] == [16] * -(-n // 16)  # one call shape whatever n: the last block padded
    padding = torch.cat(calls)[n:]
    assert padding.shape[0] == -n % 16 and not padding.any()  # zero rows
    calls.clear()
    assert torch.equal(Numerics(row_block=16).rows(fn, x), one) and len(calls) == 1  # batch-variant: one call


def test_id_tells_numerics_apart() -> None:
    base = Numerics(cpp=True, batch_invariant=True, row_block=16)
    others = [replace(base, cpp=False), replace(base, batch_invariant=False), replace(base, row_block=32)]
    assert len({base.id, *(o.id for o in others)}) == 4
    assert base.id == Numerics(cpp=True, batch_invariant=True, row_block=16).id  # stable
    # batch-variant numerics never use the row block (`rows` is one call, the C++ ops are told 0): same bits, same id
    assert Numerics(row_block=16).id == Numerics(row_block=32).id


def test_numerics_are_frozen() -> None:
    with pytest.raises(AttributeError):
        Numerics().cpp = True  # type: ignore[misc]
