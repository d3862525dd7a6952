"""What the engine sizes from a model's shapes before anything is loaded (engine/plan.py, which `moeserve plan`
calls too), shared with the bench's ceilings: the sequence-memory groups of a model (`spec_kv_groups`) and what
the memory split divides the budget among (`memory_needs`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moeserve.config import EngineSettings
from moeserve.experts.store import BYPASS_BUFFERS
from moeserve.memory.split import MemoryNeeds, activation_bytes
from moeserve.models.experts.kernels import batched_workspace_bytes
from moeserve.models.mixers.gated_delta_rule import CHUNK
from moeserve.models.mixers.mamba2_ssd import CHUNK as MAMBA_CHUNK
from moeserve.state.kinds import LatentKV, RecurrentState
from moeserve.state.kv_cache import KVGroup, fixed_pool_bytes, kv_groups


def memory_needs(spec, s: EngineSettings, dtype: torch.dtype, groups: Sequence[KVGroup],  # noqa: ANN001
                 block_bytes: Sequence[int], nonexpert: int, unit: int, total: int, batched_tokens: int,
                 runtime_bytes: int) -> MemoryNeeds:
    """What memory/split.py splits the budget among (engine/plan.py, for the engine and `moeserve plan` alike):
    sizes from shapes (`groups` and their `block_bytes` as the engine holds them), and `runtime_bytes`, what the
    process holds before the weights (the engine measures its RSS; `plan` states a figure). The runtime and the
    sliding-window pools are sized for the set max_model_len or the model's full context."""
    a, m = spec.attention, spec.moe
    model_max = s.max_model_len or spec.max_position_embeddings
    fixed_kv, kv_per_token = fixed_pool_bytes(groups, block_bytes, s.block_size, s.max_num_seqs, batched_tokens,
                                              model_max)
    # torch's attention (kernels=torch, CUDA) gathers one sequence's K and V of one layer at a time (with attention
    # sinks, repeated per query head); the C++ ops read the blocks in place
    kv_width = (a.num_heads if a.sinks else a.num_kv_heads) * a.head_dim
    acts = activation_bytes(batched_tokens, spec.hidden_size, m.intermediate_size or 0, m.top_k,
                            (a.num_heads + 2 * a.num_kv_heads) * a.head_dim, spec.vocab_size, s.max_num_seqs,
                            dtype.itemsize, context=model_max, kv_width=kv_width)
    rotary = 16 * model_max * a.head_dim  # cos/sin tables and their fp32 build
    # the store's read buffers, + admission=policy's bypass buffers
    staging = (4 + (BYPASS_BUFFERS if s.expert_admission == "policy" else 0)) * unit
    workspace = batched_workspace_bytes(spec.hidden_size, m.intermediate_size or 0, dtype.itemsize, unit)
    return MemoryNeeds(nonexpert, unit, total, kv_per_token, fixed_kv, s.block_size, spec.max_position_embeddings,
                       staging, acts + rotary, runtime_bytes, workspace)


def spec_kv_groups(spec, snapshots: int = 0) -> list[KVGroup]:  # noqa: ANN001 - ModelSpec
    """The sequence-memory groups of a model: attention layers by window, linear-attention layers as one
    recurrent group (a state slot per sequence: the conv's last inputs and the [v heads, k dim, v dim] state, and
    `snapshots` slots more for prefix snapshots)."""
    la, mamba = spec.linear_attention, spec.mamba
    latent = LatentKV(spec.mla.latent_width) if spec.mla is not None else None  # MLA: one latent row per token
    windows, stateless = spec.attention.sliding_window, spec.mixerless_layers
    if mamba is not None:  # Mamba-2: the conv's last inputs and the [heads, head_dim, state] SSM state
        kind = RecurrentState(conv_shape=(mamba.conv_kernel - 1, mamba.conv_dim),
                              state_shape=(mamba.num_heads, mamba.head_dim, mamba.state_size),
                              prefill_chunk=MAMBA_CHUNK, snapshots=snapshots)
        return kv_groups(windows, kind, mamba.layers, latent, stateless)
    if la is None:
        return kv_groups(windows, latent=latent, stateless_layers=stateless)
    kind = RecurrentState(conv_shape=(la.conv_kernel - 1, la.conv_dim),
                          state_shape=(la.num_v_heads, la.k_head_dim, la.v_head_dim), prefill_chunk=CHUNK, snapshots=snapshots)
    return kv_groups(windows, kind, la.layers, latent, stateless)
