"""The batched expert kernel (the GPU's, models/experts/kernels.BatchedExperts) through three tiers on CPU: the
engine built with default settings but the batched kernel (the test hook below: no user setting selects it on the
CPU), its store given the asynchronous fake fast tier + a host tier of half the experts + the disk, equal to the
all-resident run (same kernel) bit for bit in bf16, for every architecture and format of test_three_tiers.py.

Resident and offloaded runs group a layer's experts differently (one chunk vs chunks of FAST_UNITS); the kernel's
calls have one shape whatever the grouping, which is what makes them equal (see BatchedExperts).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from moeserve.bench.checkpoints import ARCHS
from moeserve.models import model as model_module
from moeserve.models.experts.kernels import BatchedExperts, choose_expert_kernel
from tests.experts.test_three_tiers import FORMATS, check_three_tiers_equal_resident, folder_of, three_tiers

__all__ = ["folder_of", "three_tiers"]  # fixtures, used by name


@pytest.fixture
def batched(monkeypatch: pytest.MonkeyPatch) -> list[BatchedExperts]:
    """Every model built from now on runs its experts with the batched kernel; returns the kernels made."""
    made: list[BatchedExperts] = []

    def choose(*args, **kwargs):  # type: ignore[no-untyped-def]
        kernel = choose_expert_kernel(*args, **{**kwargs, "batched": True})
        made.append(kernel)
        return kernel

    monkeypatch.setattr(model_module, "choose_expert_kernel", choose)
    return made


def _check(folder_of: Callable, three_tiers: Callable, batched: list, case: str, **settings: object) -> None:
    check_three_tiers_equal_resident(folder_of(case), three_tiers, f"{case} batched", **settings)
    assert len(batched) == 2 and all(isinstance(k, BatchedExperts) for k in batched)


@pytest.mark.parametrize("arch", [*ARCHS, "gpt_oss"])
def test_batched_kernel_every_architecture_through_three_tiers_equals_resident(folder_of, three_tiers, batched,
                                                                                arch: str) -> None:
    _check(folder_of, three_tiers, batched, arch)


@pytest.mark.parametrize("fmt", FORMATS)
def test_batched_kernel_every_format_through_three_tiers_equals_resident(folder_of, three_tiers, batched,
                                                                          fmt: str) -> None:
    settings = {"quantization": "int8"} if fmt.startswith("int8") else {}
    _check(folder_of, three_tiers, batched, fmt, **settings)


def test_batched_kernel_with_prefetch_equals_resident(folder_of, three_tiers, batched) -> None:
    _check(folder_of, three_tiers, batched, "qwen3_moe", offload={"prefetch": True})


