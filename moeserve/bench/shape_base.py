"""The interface every benchmark shape gives the writer, the ceilings, the peers and the CLI.

A shape is one synthetic model: its Hugging Face config and the name and shape of every tensor of the checkpoint
that config implies. Everything the ceilings need follows from those two: the element counts from the tensor list
(so no formula per architecture), the sequence memory from moeserve's own `ModelSpec` of the config.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from functools import cached_property
from typing import Any

Tensors = list[tuple[str, tuple[int, ...]]]


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class Shape(ABC):
    """One named synthetic model (implementations: shapes.BenchShape, arch_shapes.ArchShape)."""

    name: str
    purpose: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    num_experts: int  # routed experts per MoE layer
    top_k: int
    max_position_embeddings: int
    router_correlation: float  # see shapes.BenchShape (0: independent routers)

    @abstractmethod
    def hf_config(self, dtype: str = "bfloat16") -> dict[str, Any]:
        """config.json as transformers writes it for this architecture."""

    @abstractmethod
    def layer_tensors(self, layer: int) -> Tensors:
        """(name, shape) of every tensor of decoder layer `layer`."""

    @abstractmethod
    def outer_tensors(self) -> Tensors:
        """Embeddings, final norm and LM head."""

    @property
    @abstractmethod
    def expert_params(self) -> int:
        """Parameters of one routed expert."""

    @property
    @abstractmethod
    def moe_layer_count(self) -> int:
        """Layers with routed experts."""

    @property
    @abstractmethod
    def embedding_name(self) -> str:
        """The embedding table's tensor (a decode step reads one row of it per sequence)."""

    def fp32_tensors(self) -> frozenset[str]:
        """Tensors the checkpoint stores in float32 whatever its dtype (routers, correction biases)."""
        return frozenset()

    def dense_bytes_int8(self, batch: int = 1) -> int:
        """Non-expert bytes of one decode step of moeserve with quantization="int8" (which Linears it quantizes is
        the architecture's: known for the Qwen3-MoE shapes only)."""
        from moeserve.errors import ConfigError

        raise ConfigError(f"shape '{self.name}': the int8 byte accounting is known only for the Qwen3-MoE shapes "
                          "(run it without --quantization int8)")

    def is_expert(self, name: str) -> bool:
        """A routed expert's tensor (every architecture here names them `...experts.<id>....`)."""
        return ".experts." in name

    # ------------------------------------------------------------------------------- counts from the tensors
    @cached_property
    def dense_layer_params(self) -> int:
        """Non-expert parameters of all decoder layers (attention or mixer, routers, norms, shared experts, dense
        MLPs): every decode step reads them all."""
        return sum(numel(s) for L in range(self.num_layers) for n, s in self.layer_tensors(L) if not self.is_expert(n))

    @cached_property
    def head_params(self) -> int:
        """The final norm and the LM head: read every step (the embedding table is not: one row per sequence)."""
        return sum(numel(s) for n, s in self.outer_tensors() if n != self.embedding_name)

    @cached_property
    def total_params(self) -> int:
        layers = sum(numel(s) for L in range(self.num_layers) for _, s in self.layer_tensors(L))
        return layers + sum(numel(s) for _, s in self.outer_tensors())

    @property
    def total_experts(self) -> int:
        return self.moe_layer_count * self.num_experts

    def spec(self) -> Any:
        """moeserve's ModelSpec of hf_config() (the engine's own reading of it)."""
        from moeserve.models.registry import get_architecture

        config = self.hf_config()
        return get_architecture(config, self.name).spec(config, self.name)
