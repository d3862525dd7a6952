"""The `Format` interface: how one stored weight is named on disk and turned into a dense tensor.

A checkpoint stores each weight as one or more tensors, each with a role (``weight_packed``, ``weight_scale``,
...). A Format names them for a given module prefix, reports the dense shape, and dequantizes into a tensor
the caller owns. Callers go through this interface and never branch on the format.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from moeserve.errors import CheckpointError


@dataclass(frozen=True)
class FusedCodes:
    """How the C++ expert op (csrc/moe_experts_q4.cpp: q4_codes.cpp, gguf_codes.cpp) reads a weight of a format as
    stored: its format word in the op's spec, the elements per group scale, and the roles of the packed codes (two
    per byte, the low nibble first), the group scales (None: in the codes' blocks) and the float32 tensor scale
    (None: the format has none). `scale_dtype`: the group scales' dtype the op reads (None: any the format stores, 1
    byte). GGUF blocks: `ggml` the ggml type names the weight may hold (several: its layers differ) and `type_role`
    the role of the unit's int32 index into them (None: one type)."""

    word: str
    group: int
    codes: str
    scales: str | None
    tensor_scale: str | None = None
    scale_dtype: torch.dtype | None = None
    ggml: tuple[str, ...] = ()
    type_role: str | None = None


class Format(ABC):
    """One stored-weight format. Instances are immutable and cheap; parameters (block sizes) are fields."""

    name: ClassVar[str]  # registry key, e.g. "nvfp4-ct"
    roles: ClassVar[tuple[str, ...]]  # the stored tensors one weight needs, e.g. ("weight_packed", ...)
    separator: ClassVar[str] = "."  # between prefix and role; gpt-oss experts use "_" (gate_up_proj_blocks)
    # Tensors a producer stores beside the weight for quantizing the activations (a W4A4 checkpoint's input scale).
    # moeserve computes activations in the compute dtype (weights dequantized), so they are never read: not loaded,
    # not sized, logged at start-up (models/quantized.py activation_scales).
    activation_roles: ClassVar[tuple[str, ...]] = ()

    def stored_name(self, prefix: str, role: str) -> str:
        """Return the checkpoint name of tensor ``role`` for the weight at ``prefix``."""
        return f"{prefix}{self.separator}{role}"

    def tensor_names(self, prefix: str) -> tuple[str, ...]:
        """Return the checkpoint names of every tensor the weight at ``prefix`` needs, in `roles` order."""
        return tuple(self.stored_name(prefix, role) for role in self.roles)

    def select(self, prefix: str, tensors_by_name: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Pick this weight's tensors out of a name -> tensor mapping and key them by role.

        Raises `CheckpointError` naming the first missing tensor.
        """
        selected: dict[str, Tensor] = {}
        for role in self.roles:
            name = self.stored_name(prefix, role)
            if name not in tensors_by_name:
                raise CheckpointError(f"tensor '{name}' is missing ({self.name} weight '{prefix}' needs it)")
            selected[role] = tensors_by_name[name]
        return selected

    @abstractmethod
    def dequantized_shape(self, tensors: Mapping[str, Tensor]) -> tuple[int, ...]:
        """Return the dense shape of the weight held by ``tensors`` (keyed by role), e.g. ``(out, in)``.

        Raises `CheckpointError` if the tensors do not fit together.
        """

    @abstractmethod
    def stored_shapes(self, shape: tuple[int, ...], dense_code: str) -> dict[str, tuple[str, tuple[int, ...]]]:
        """The inverse of `dequantized_shape`: for a weight of dense ``shape``, each stored tensor's safetensors
        dtype code and shape, keyed by role (sizes a checkpoint from config.json alone). ``dense_code`` is the
        dtype code of unquantized tensors (e.g. "BF16")."""

    @abstractmethod
    def dequantize(self, tensors: Mapping[str, Tensor], out: Tensor) -> None:
        """Write the dense weight into ``out`` (contiguous, shape `dequantized_shape`, any float dtype).

        ``tensors`` is keyed by role. Bit-exact with the format's reference decoder; allocates only bounded
        temporaries (documented per format).
        """

    def fused_codes(self) -> FusedCodes | None:
        """Where the C++ expert op finds this format's codes and scales (it decodes them to exactly what
        `dequantize` writes into bf16); None: the op does not read this format."""
        return None
