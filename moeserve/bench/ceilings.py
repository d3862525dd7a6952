"""Speed ceilings: pure arithmetic from bytes read per token and measured bandwidths.

A decode step that must read B bytes of weights from memory of bandwidth W cannot take less than B / W seconds.
With offloading, bytes that miss the fast tier come from disk at its bandwidth D, and the step takes at least
B_fast / W + B_missed / D. Units: bytes, bytes per second, tokens per second.
"""

from __future__ import annotations

from dataclasses import dataclass

from moeserve.bench.shape_base import Shape


@dataclass(frozen=True)
class StepBytes:
    """Bytes one forward step reads, split by where they come from."""

    dense_bytes: int  # non-expert weights every step reads (attention, router, norms, LM head, embedding rows)
    expert_bytes_fast: float  # expert bytes read from the fast tier (cache hits)
    expert_bytes_disk: float  # expert bytes read from disk (misses)
    # sequence memory the step reads and writes: KV rows, latent rows, recurrent state (sequence_bytes_per_step)
    sequence_bytes: float = 0.0

    @property
    def fast_bytes(self) -> float:
        return self.dense_bytes + self.expert_bytes_fast + self.sequence_bytes


def dense_bytes_per_step(shape: Shape, bytes_per_param: float, batch: int = 1) -> int:
    """Non-expert bytes of one decode step: every layer's non-expert tensors (attention or mixer, routers, norms,
    shared experts, dense MLPs), the final norm, the LM head, and one embedding row per sequence."""
    return int((shape.dense_layer_params + shape.head_params + batch * shape.hidden_size) * bytes_per_param)


def dense_bytes_per_step_int8(shape: Shape, batch: int = 1) -> int:
    """dense_bytes_per_step for moeserve with quantization="int8" (the shape's own accounting: Shape.dense_bytes_int8)."""
    return shape.dense_bytes_int8(batch)


def sequence_bytes_per_step(shape: Shape, context: int, itemsize: int = 2) -> dict[str, int]:
    """Bytes of sequence memory one decode step of one sequence reads and writes, by kind, for a sequence holding
    `context` tokens before the step: the kinds and their sizes are moeserve's own (engine.llm_engine.spec_kv_groups,
    state/kinds.py: KV and latent rows in the compute dtype, a recurrent layer's conv inputs in it and its state in
    fp32). A token-indexed kind reads the rows still live after the step (the new token's included) and writes one
    row; a recurrent kind reads its one state slot and writes it back."""
    from moeserve.engine.sizing import spec_kv_groups

    spec = shape.spec()
    a = spec.attention
    out: dict[str, int] = {}
    after = context + 1  # tokens held once the step's token is cached
    for group in spec_kv_groups(spec):
        kind = group.kind
        row = kind.block_bytes(len(group.layers), 1, a.num_kv_heads, a.head_dim, itemsize)
        rows_read = kind.blocks_for(after, 1) - kind.first_live_block(after, 1)
        out[kind.describe()] = out.get(kind.describe(), 0) + (rows_read + 1) * row
    return out


def kv_per_token(shape: Shape, itemsize: int = 2) -> str | None:
    """moeserve's line on the latent cache's bytes per token vs the same model with full KV (None without MLA)."""
    from moeserve.models.mixers.mla import kv_per_token_line

    return kv_per_token_line(shape.spec(), itemsize)


def expected_unique_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts a layer touches for `tokens` tokens, each picking top_k of num_experts
    uniformly at random: E * (1 - (1 - k/E)^T)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def resident_step_bytes(shape: Shape, bytes_per_param: float, batch: int = 1,
                        experts_per_layer: float | None = None, context: int | None = None) -> StepBytes:
    """Bytes of one decode step of `batch` sequences with every expert resident.

    experts_per_layer: distinct experts a MoE layer reads in one step (measured); default the uniform expectation.
    context: tokens each sequence holds before the step (its sequence memory counted); None: weights only.
    """
    if experts_per_layer is None:
        experts_per_layer = expected_unique_experts(shape.num_experts, shape.top_k, batch)
    expert = experts_per_layer * shape.moe_layer_count * shape.expert_params * bytes_per_param
    sequence = 0 if context is None else batch * sum(sequence_bytes_per_step(shape, context).values())
    return StepBytes(dense_bytes_per_step(shape, bytes_per_param, batch), expert, 0.0, sequence)


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
