"""What the engine sizes from a model's shapes before anything is loaded (engine/plan.py, which `moeserve plan`
calls too), shared with the bench's ceilings: the sequence-memory groups of a model (`spec_kv_groups`) and what
the memory split divides the budget among (`memory_needs`), and the context the runtime reserve is sized for
(`size_for_context`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from moeserve.config import EngineSettings
from moeserve.errors import ConfigError
from moeserve.experts.store import BYPASS_BUFFERS
from moeserve.memory.budget import fmt_bytes
from moeserve.memory.sizing import TierSizes
from moeserve.memory.split import LEN_MULTIPLE, MIN_CONTEXT, MemoryNeeds, activation_bytes, kv_for
from moeserve.models.experts.kernels import batched_workspace_bytes
from moeserve.models.mixers.gated_delta_rule import CHUNK
from moeserve.models.mixers.mamba2_ssd import CHUNK as MAMBA_CHUNK
from moeserve.state.kinds import IndexedLatentKV, LatentKV, NgramState, RecurrentState
from moeserve.state.kv_cache import KVGroup, fixed_pool_bytes, kv_groups


def memory_needs(spec, s: EngineSettings, dtype: torch.dtype, groups: Sequence[KVGroup],  # noqa: ANN001
                 block_bytes: Sequence[int], nonexpert: int, unit: int, total: int, batched_tokens: int,
                 runtime_bytes: int) -> MemoryNeeds:
    """What memory/split.py splits the budget among (engine/plan.py, for the engine and `moeserve plan` alike):
    sizes from shapes (`groups` and their `block_bytes` as the engine holds them), and `runtime_bytes`, what the
    process holds before the weights (the engine measures its RSS; `plan` states a figure). The runtime and the
    sliding-window pools are sized for the set max_model_len or the model's full context."""
    a, m = widest_attention(spec), spec.moe
    model_max = s.max_model_len or spec.max_position_embeddings
    fixed_kv, kv_per_token = fixed_pool_bytes(groups, block_bytes, s.block_size, s.max_num_seqs, batched_tokens,
                                              model_max)
    # torch's attention (kernels=torch, CUDA) gathers one sequence's K and V of one layer at a time (with attention
    # sinks, repeated per query head); the C++ ops read the blocks in place
    kv_width = (a.num_heads if a.sinks else a.num_kv_heads) * a.head_dim
    o = spec.attention_override  # its layers' own tables beside the model's (Gemma-4's global layers)
    rotary_dims = spec.attention.head_dim + (o.attention.head_dim if o else 0)
    if spec.compressed is not None:  # DeepSeek-V4: a query block gathers its sequence's cache rows (the widest)
        from moeserve.models.mixers.compressed_mixer import row_width

        kv_width = max(row_width(spec, L) for L in range(spec.num_layers))
        rotary_dims = 2 * spec.rope.rotary_dim(a.head_dim)  # the main and the compressed layers' tables
    acts = activation_bytes(batched_tokens, spec.hidden_size, m.intermediate_size or 0, m.top_k,
                            (a.num_heads + 2 * a.num_kv_heads) * a.head_dim, spec.vocab_size, s.max_num_seqs,
                            dtype.itemsize, context=model_max, kv_width=kv_width)
    rotary = 16 * model_max * rotary_dims  # cos/sin tables and their fp32 build
    # the store's read buffers, + admission=policy's bypass buffers
    staging = (4 + (BYPASS_BUFFERS if s.expert_admission == "policy" else 0)) * unit
    workspace = batched_workspace_bytes(spec.hidden_size, m.intermediate_size or 0, dtype.itemsize, unit)
    return MemoryNeeds(nonexpert, unit, total, kv_per_token, fixed_kv, s.block_size, spec.max_position_embeddings,
                       staging, acts + rotary, runtime_bytes, workspace,
                       request_bytes=int((s.request_memory_mb or 0) * 2**20))


def widest_attention(spec):  # noqa: ANN001, ANN201 - ModelSpec -> AttentionSpec
    """The attention whose activations are widest (the override's layers may be wider: Gemma-4's global)."""
    o = spec.attention_override
    if o is None:
        return spec.attention
    return max((spec.attention, o.attention), key=lambda a: (a.num_heads + 2 * a.num_kv_heads) * a.head_dim)


def spec_kv_groups(spec, snapshots: int = 0) -> list[KVGroup]:  # noqa: ANN001 - ModelSpec
    """The sequence-memory groups of a model: attention layers by window, linear-attention layers as one
    recurrent group (a state slot per sequence: the conv's last inputs and the [v heads, k dim, v dim] state, and
    `snapshots` slots more for prefix snapshots)."""
    la, mamba = spec.linear_attention, spec.mamba
    if spec.compressed is not None:
        return compressed_kv_groups(spec)
    latent = _latent_kind(spec)
    windows, stateless = spec.attention.sliding_window, spec.mixerless_layers
    if mamba is not None:  # Mamba-2: the conv's last inputs and the [heads, head_dim, state] SSM state
        kind = RecurrentState(conv_shape=(mamba.conv_kernel - 1, mamba.conv_dim),
                              state_shape=(mamba.num_heads, mamba.head_dim, mamba.state_size),
                              prefill_chunk=MAMBA_CHUNK, snapshots=snapshots)
        return kv_groups(windows, kind, mamba.layers, latent, stateless)
    if la is None:
        unindexed = spec.mla.indexer.shared if spec.mla is not None and spec.mla.indexer is not None else ()
        o = spec.attention_override  # layers caching another head shape (Gemma-4's global layers)
        heads = {L: (o.attention.num_kv_heads, o.attention.head_dim) for L in o.layers} if o is not None else None
        return kv_groups(windows, latent=latent, stateless_layers=stateless, unindexed_layers=unindexed, heads=heads)
    kind = RecurrentState(conv_shape=(la.conv_kernel - 1, la.conv_dim),
                          state_shape=(la.num_v_heads, la.k_head_dim, la.v_head_dim), prefill_chunk=CHUNK, snapshots=snapshots)
    groups = kv_groups(windows, kind, la.layers, latent, stateless)
    ng = spec.ngram
    if ng is not None and spec.hyper is not None:  # PLE: its own group, layer ids past the model's (ngram_state_layer)
        ple = NgramState(conv_shape=((ng.conv_kernel - 1) * ng.ngram_size, spec.hyper.streams * spec.hidden_size),
                         state_shape=(ng.ngram_size - 1,), prefill_chunk=CHUNK, snapshots=snapshots)
        groups.append(KVGroup(ple, tuple(spec.num_layers + i for i in range(len(ng.layers)))))
    return groups


def compressed_kv_groups(spec) -> list[KVGroup]:  # noqa: ANN001 - ModelSpec
    """DeepSeek-V4 (ModelSpec.compressed): per layer one cache row per token (models/mixers/compressed_mixer.py
    row_width: its key=value row and its compressors' projections), paged as latent rows; one group per width (the
    sliding, heavily compressed and compressed sparse layers)."""
    from moeserve.models.mixers.compressed_mixer import row_width

    widths: dict[int, list[int]] = {}
    for L in range(spec.num_layers):
        widths.setdefault(row_width(spec, L), []).append(L)
    return [KVGroup(LatentKV(width), tuple(layers)) for width, layers in widths.items()]


def _latent_kind(spec) -> LatentKV | None:  # noqa: ANN001 - ModelSpec
    """MLA: one latent row per token and layer, and with DeepSeek Sparse Attention the indexer's key beside it; Qwen
    sparse attention (no MLA): one row of keys, values and the raw index key."""
    m = spec.mla
    if m is None:  # Qwen sparse attention: a token's keys, values and raw index key in one row
        qsa = spec.qsa
        return None if qsa is None else LatentKV(2 * spec.attention.num_kv_heads * spec.attention.head_dim + qsa.head_dim)
    if m.indexer is not None:
        return IndexedLatentKV(m.latent_width, m.indexer.head_dim)
    return LatentKV(m.latent_width)


# (context the runtime is sized for, max_num_batched_tokens) -> what the split needs
NeedsAt = Callable[[int, int], MemoryNeeds]
# (needs, max_model_len or None for automatic, whether that max_model_len was chosen here) -> the tiers
SplitAt = Callable[[MemoryNeeds, int | None, bool], TierSizes]


def size_for_context(needs_at: NeedsAt, split: SplitAt, set_len: int | None, model_len: int, batched: int,
                     least_batched: int) -> tuple[MemoryNeeds, TierSizes]:
    """(needs, tiers) with the runtime reserve (one step's activations, the rotary tables, sliding-window pools)
    sized for the context actually served. A set max_model_len: sized for it. Unset: the model's context when it
    fits; else the longest context C (a multiple of LEN_MULTIPLE) whose own runtime still leaves a KV pool of C
    tokens, then split exactly as `max_model_len=C` set by hand would be (the same experts kept). A refusal names
    the setting that saves the most, with how much (`_advice`)."""
    if set_len is not None:
        needs = needs_at(set_len, batched)
        try:
            return needs, split(needs, set_len, False)
        except ConfigError as err:
            raise ConfigError(f"{err}{_advice(needs_at, split, set_len, batched, least_batched)}") from None
    needs = needs_at(model_len, batched)
    full = _auto_split(split, needs)
    if full is not None and full.split.max_model_len >= model_len:
        return needs, full
    least = min(MIN_CONTEXT, model_len)
    if not _holds(split, needs_at(least, batched), least):
        needs = needs_at(least, batched)
        try:
            split(needs, None, False)  # raises: one line naming each part
        except ConfigError as err:
            raise ConfigError(f"{err}{_advice(needs_at, split, least, batched, least_batched)}") from None
    lo, hi = least, model_len  # holds(lo), not holds(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _holds(split, needs_at(mid, batched), mid) else (lo, mid)
    ctx = max(least, lo // LEN_MULTIPLE * LEN_MULTIPLE)
    needs = needs_at(ctx, batched)
    return needs, split(needs, ctx, True)


def _auto_split(split: SplitAt, needs: MemoryNeeds) -> TierSizes | None:
    try:
        return split(needs, None, False)
    except ConfigError:
        return None


def _holds(split: SplitAt, needs: MemoryNeeds, ctx: int) -> bool:
    """Whether the automatic split of `needs` (runtime sized for `ctx` tokens) keeps a context of `ctx` or more."""
    sizes = _auto_split(split, needs)
    return sizes is not None and sizes.split.max_model_len >= ctx


def _advice(needs_at: NeedsAt, split: SplitAt, ctx: int, batched: int, least_batched: int) -> str:
    """'; what saves the most: ...': max_model_len and max_num_batched_tokens, the larger saving first, each with
    the bytes it saves of runtime and one sequence's KV (max_model_len: the longest that fits, when one does)."""
    def cost(n: MemoryNeeds, tokens: int) -> int:
        return n.overhead_bytes + kv_for(n, tokens)

    now = cost(needs_at(ctx, batched), ctx)
    levers: list[tuple[int, str]] = []
    least = min(MIN_CONTEXT, ctx)
    if ctx > least:
        fits = [t for t in _descending(ctx, least) if _fits_set(split, needs_at(t, batched), t)][:1]
        t = fits[0] if fits else least
        levers.append((now - cost(needs_at(t, batched), t), f"max_model_len={t}" + (" fits" if fits else "")))
    if least_batched < batched:
        saved = now - cost(needs_at(ctx, least_batched), ctx)
        levers.append((saved, f"max_num_batched_tokens={least_batched}"))
    levers = sorted((lv for lv in levers if lv[0] > 0), reverse=True)
    if not levers:
        return ""
    return "; what saves the most: " + ", then ".join(f"{what} ({fmt_bytes(saved)} less)" for saved, what in levers)


def _descending(ctx: int, least: int) -> list[int]:
    """Contexts to try below `ctx`, longest first: halvings down to `least` (multiples of LEN_MULTIPLE)."""
    out, t = [], ctx // 2
    while t > least:
        out.append(t // LEN_MULTIPLE * LEN_MULTIPLE)
        t //= 2
    return [*out, least]


def _fits_set(split: SplitAt, needs: MemoryNeeds, ctx: int) -> bool:
    try:
        split(needs, ctx, False)
    except ConfigError:
        return False
    return True
