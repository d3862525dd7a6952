"""Parts of one-part-block hybrids (Nemotron-H) as the shared DecoderLayer's parts:

- `Relu2MLP`: down(relu(up(x))^2), no gate: Nemotron-H's dense MLP ('-' layers) and its shared expert.
- `NoMixer` / `NoMLP`: the part a block does not have. Each returns zeros, so `h + part` is h exactly; a block
  whose only part is the MLP runs as a DecoderLayer with NoMixer, and the other way round. NoMixer keeps no
  sequence memory (its layer is in no KV group: ModelSpec.attention_layers is False for it). Both add their zeros
  to the fused decode stack too (csrc/decode_stack_mamba2.cpp NoMixer, decode_stack_ffn.cpp NoFfn).
- `NoRotary`: attention without position rotation (Nemotron-H): its cos/sin tables are 1 and 0, so the C++ op that
  rotates while it caches writes the keys unchanged (x * 1 + y * 0 = x), and the torch path skips the rotation.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from moeserve.models.layers.base import MLP, DenseMLP, ForwardBatch, Rotary, TokenMixer
from moeserve.models.layers.linear import Linear
from moeserve.models.numerics import Numerics
from moeserve.state.kv_cache import PagedKVCache


class Relu2MLP(DenseMLP):
    """down(relu(up(x))^2) (transformers' ACT2FN["relu2"]); row blocks as DenseMLP when batch-invariant."""

    def __init__(self, up: Linear, down: Linear, numerics: Numerics = Numerics()) -> None:  # noqa: D107 - no gate
        self.up, self.down, self.numerics = up, down, numerics

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.square(F.relu(self.up(x))))

    def linears(self) -> list[Linear]:
        return [self.up, self.down]

    def add_to_stack(self, stack: Any) -> None:
        stack.add_relu2_mlp(*(t for lin in self.linears() for t in lin.gemv_tensors()))

    def add_as_shared(self, stack: Any, gate: tuple[torch.Tensor | None, torch.Tensor | None]) -> None:
        stack.add_relu2_shared_expert(*(t for lin in self.linears() for t in lin.gemv_tensors()), *gate)


class NoMixer(TokenMixer):
    def __call__(self, x: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        return torch.zeros_like(x)

    def linears(self) -> list[Linear]:
        return []

    def why_not_stacked(self) -> str | None:
        return None

    def add_to_stack(self, stack: Any, kv: PagedKVCache, input_norm: torch.Tensor, post_norm: torch.Tensor) -> None:
        stack.add_no_mixer(input_norm, post_norm)


class NoMLP(MLP):
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)

    def linears(self) -> list[Linear]:
        return []

    def why_not_stacked(self) -> str | None:
        return None

    def add_to_stack(self, stack: Any) -> None:
        stack.add_no_ffn()


class NoRotary(Rotary):
    def __init__(self, head_dim: int, max_len: int, dtype: torch.dtype, device: torch.device) -> None:  # noqa: D107
        self.rotary_dim = head_dim
        self.cos = torch.ones((max_len, head_dim), dtype=dtype, device=device)
        self.sin = torch.zeros((max_len, head_dim), dtype=dtype, device=device)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return x
