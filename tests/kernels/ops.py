"""Shared helper of the kernel tests: the loaded `torch.ops.moeserve` namespace, or a skip saying why not."""

from __future__ import annotations

import pytest
import torch

from moeserve import kernels


def cpp_ops():  # noqa: ANN201 - torch.ops namespace
    status = kernels.load()
    if not status.available:
        pytest.skip(f"moeserve C++ kernels not available: {status.reason}")
    return torch.ops.moeserve
