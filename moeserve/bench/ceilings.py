"""Speed ceilings: pure arithmetic from bytes read per token and measured bandwidths.

A decode step that must read B bytes of weights from memory of bandwidth W cannot take less than B / W seconds.
With offloading, bytes that miss the fast tier come from disk at its bandwidth D, and the step takes at least
B_fast / W + B_missed / D. Units: bytes, bytes per second, tokens per second.
"""

from __future__ import annotations

from dataclasses import dataclass

from moeserve.bench.shapes import BenchShape


@dataclass(frozen=True)
class StepBytes:
    """Weight bytes one forward step reads, split by where they come from."""

    dense_bytes: int  # non-expert weights every step reads (attention, router, norms, LM head, embedding rows)
    expert_bytes_fast: float  # expert bytes read from the fast tier (cache hits)
    expert_bytes_disk: float  # expert bytes read from disk (misses)

    @property
    def fast_bytes(self) -> float:
        return self.dense_bytes + self.expert_bytes_fast


def dense_bytes_per_step(shape: BenchShape, bytes_per_param: float, batch: int = 1) -> int:
    """Non-expert bytes of one decode step: every layer's attention, router and norms, the final norm, the LM
    head, and one embedding row per sequence."""
    per_layer = shape.layer_dense_params * shape.num_layers
    head = shape.vocab_size * shape.hidden_size + shape.hidden_size
    return int((per_layer + head + batch * shape.hidden_size) * bytes_per_param)


def dense_bytes_per_step_int8(shape: BenchShape, batch: int = 1) -> int:
    """dense_bytes_per_step for moeserve with quantization="int8": the attention projections and the LM head as
    int8 codes (1 byte per weight) plus a float32 scale per output row; routers, norms, the final norm and the
    embedding rows in bf16 (moeserve keeps them so, see moeserve.models.model.build_model)."""
    h, d = shape.hidden_size, shape.head_dim
    attn_rows = (shape.num_heads + 2 * shape.num_kv_heads) * d + h  # q/k/v stacked, then o_proj
    int8_layer = shape.attention_params + 4 * attn_rows
    bf16_layer = 2 * (shape.layer_dense_params - shape.attention_params)  # router + norm vectors
    head = shape.vocab_size * h + 4 * shape.vocab_size
    return shape.num_layers * (int8_layer + bf16_layer) + head + 2 * h + 2 * batch * h


def expected_unique_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts a layer touches for `tokens` tokens, each picking top_k of num_experts
    uniformly at random: E * (1 - (1 - k/E)^T)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def resident_step_bytes(shape: BenchShape, bytes_per_param: float, batch: int = 1,
                        experts_per_layer: float | None = None) -> StepBytes:
    """Bytes of one decode step of `batch` sequences with every expert resident.

    experts_per_layer: distinct experts a layer reads in one step (measured); default the uniform expectation.
    """
    if experts_per_layer is None:
        experts_per_layer = expected_unique_experts(shape.num_experts, shape.top_k, batch)
    expert = experts_per_layer * shape.num_layers * shape.expert_params * bytes_per_param
    return StepBytes(dense_bytes_per_step(shape, bytes_per_param, batch), expert, 0.0)


def tokens_per_second_ceiling(step: StepBytes, memory_bytes_per_s: float, disk_bytes_per_s: float | None = None,
                              tokens_per_step: int = 1) -> float:
    """The fastest a step can go: tokens_per_step / (fast bytes / memory bandwidth + disk bytes / disk bandwidth)."""
    seconds = step.fast_bytes / memory_bytes_per_s
    if step.expert_bytes_disk:
        if not disk_bytes_per_s:
            raise ValueError("a step that reads from disk needs the disk bandwidth")
        seconds += step.expert_bytes_disk / disk_bytes_per_s
    return tokens_per_step / seconds


def fraction_of_ceiling(measured_tokens_per_s: float, ceiling_tokens_per_s: float) -> float:
    return measured_tokens_per_s / ceiling_tokens_per_s if ceiling_tokens_per_s > 0 else 0.0
