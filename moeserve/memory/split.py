"""One memory budget, split once. The engine (at start-up, before any weight is loaded) and `moeserve plan` call
`split_memory` with the same needs and print the same lines; nothing else sizes the expert cache or the KV pool.

Rules, in order:

1. Budget B = memory_gb (everything the process holds), or, without it, free memory less the headroom of
   memory/budget.py (max(HEADROOM_MIN_BYTES, HEADROOM_FRACTION of free)), logged as derived. A memory_gb above
   what is free now is allowed; its line says so (the OS may swap).
2. The fixed parts come first: resident weights (everything but the experts), the expert store's read buffers,
   what the HTTP server's requests may hold (request_memory_mb, `moeserve serve` only), and the runtime: one step's activations (`activation_bytes`) and the rotary tables, plus, with memory_gb only,
   the process's RSS measured at start-up (interpreter, torch, tokenizer) and what it grows by later
   (`process_growth_bytes`: 2%, at least 8 MiB). Without memory_gb that RSS is already
   outside free memory and is not charged twice. room = B - fixed.
3. room must hold one expert and the KV of one sequence of max_model_len tokens (when set), else of
   min(the model's context, MIN_CONTEXT) tokens; otherwise ConfigError, one line naming each part and what to
   change. The same holds for every override below: what cannot fit is refused, never trimmed silently.
4. The expert cache, when expert_cache_gb is set: that many whole experts (at least one, at most all).
5. The KV pool: kv_cache_gb when set; else, with expert_cache_gb set, what the experts leave, capped at
   max_num_seqs sequences of the full context; else, when every expert fits beside a pool of max_num_seqs
   sequences of the full context (max_model_len, or the model's), that pool and all experts; else
   min(one full-context sequence, KV_SHARE of room) (so the experts keep most of the memory), never less than the
   step-3 minimum, never so much that not one expert fits, and more when all experts fit beside a larger pool.
6. The expert cache, when expert_cache_gb is not set: all that room - KV pool holds (whole experts, at most all).
7. max_model_len: when set, kept (step 3 guarantees one sequence of it fits the pool; above the model's own it is
   refused). When not set: the model's max_position_embeddings, lowered to what one sequence can hold in the KV
   pool (a multiple of 16, never below the step-3 minimum), with the reason in its line. The engine then sizes
   the runtime for the context it serves (engine/sizing.py `size_for_context`) and splits again with that
   context as if set (`context_chosen`: its line says it was chosen, not set).

With memory_gb, resident + read buffers + runtime + KV pool + expert cache <= B always (tests/memory/test_split.py
checks it on random cases). Every line names its figures (GiB, or MiB below 1 GiB) and its reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil

from moeserve.errors import ConfigError
from moeserve.memory.budget import HEADROOM_FRACTION, HEADROOM_MIN_BYTES, fmt_bytes

GiB = 1024**3
MiB = 2**20
MIN_CONTEXT = 256  # the shortest context worth serving when max_model_len is lowered to fit
KV_SHARE = 0.25  # the KV pool's share of room when the experts do not all fit
LEN_MULTIPLE = 16  # an automatic max_model_len is a multiple of this


@dataclass(frozen=True)
class MemoryNeeds:
    """What the split needs, from shapes and start-up measurements (nothing loaded)."""

    resident_bytes: int  # non-expert weights in memory
    unit_nbytes: int  # one expert unit in the fast tier
    total_experts: int
    kv_bytes_per_token: int  # KV bytes one token takes in the full-attention layers (all of them together)
    kv_fixed_bytes: int  # the sliding-window layers' pools (bounded whatever the context)
    block_size: int  # tokens per KV block
    model_max_len: int  # the model's max_position_embeddings
    staging_bytes: int  # the expert store's read/staging buffers
    overhead_bytes: int  # runtime growth: one step's activations and the rotary tables
    process_bytes: int = 0  # the process's RSS at start-up: charged against memory_gb (free memory excludes it)
    # the GPU's batched expert kernel's stacked (dequantized) weights; charged as runtime on CUDA only (sizing.py)
    expert_workspace_bytes: int = 0
    request_bytes: int = 0  # what the HTTP server's requests may hold (request_memory_mb; server/request_memory.py)


@dataclass(frozen=True)
class MemorySplit:
    memory_bytes: int | None  # memory_gb, if given (None: the budget was derived from free memory)
    budget_bytes: int  # the budget actually split
    resident_bytes: int
    staging_bytes: int
    overhead_bytes: int
    expert_capacity: int  # experts in the fast tier
    expert_bytes: int
    kv_bytes: int  # the KV pool
    max_model_len: int
    # (name, value with its reason), in this order: "memory budget", "KV pool", "placement", "max_model_len".
    # The engine logs them at start-up as "name: value" (its choices), `moeserve plan` prints them the same way.
    lines: tuple[tuple[str, str], ...]
    request_bytes: int = 0  # the server's requests (a fixed part, named in the "memory budget" line when set)

    @property
    def total_bytes(self) -> int:
        return (self.resident_bytes + self.staging_bytes + self.overhead_bytes + self.expert_bytes + self.kv_bytes
                + self.request_bytes)


def kv_for(needs: MemoryNeeds, tokens: int, seqs: int = 1) -> int:
    """KV pool bytes that hold `seqs` sequences of `tokens` tokens each (one spare block per sequence: a sequence
    of t tokens takes ceil(t / block_size) blocks, and the step that grows it may open one more)."""
    return needs.kv_fixed_bytes + needs.kv_bytes_per_token * seqs * (tokens + needs.block_size)


@dataclass(frozen=True)
class _Budget:
    """Step 1: the budget, how error lines name it and what they tell the user to change, and the runtime charged."""

    nbytes: int
    of: str  # "memory_gb=4", or "the 3.1 GiB derived from free memory"
    why: str  # the "memory budget" line's head: the figure and where it came from
    to_raise: str  # what to change to raise it
    runtime: int  # activations and rotary tables, plus, with memory_gb, the process's RSS and its growth


@dataclass(frozen=True)
class _Room:
    """Steps 2-3: what the fixed parts leave and the least KV pool (one sequence of `min_ctx` tokens)."""

    fixed: int  # resident weights + read buffers + runtime
    room: int  # the budget less `fixed`
    parts: str  # the fixed parts, named with their sizes, for error lines
    ctx: int  # max_model_len, or the model's
    min_ctx: int  # the shortest context a sequence must be able to hold
    kv_min: int  # KV of one `min_ctx`-token sequence


def split_memory(needs: MemoryNeeds, *, memory_gb: float | None, expert_cache_gb: float | None,
                 kv_cache_gb: float | None, max_model_len: int | None, max_num_seqs: int,
                 free_bytes: int, context_chosen: bool = False) -> MemorySplit:
    """Split the budget among the parts (module docstring). Raises ConfigError, one line, when it cannot fit.
    `context_chosen`: max_model_len is the engine's choice (the longest context that fits), not the user's."""
    n = needs
    if max_model_len is not None and max_model_len > n.model_max_len:
        raise ConfigError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                          f"{n.model_max_len}")
    budget = _budget(n, memory_gb, free_bytes)
    r = _room(n, budget, max_model_len)
    capacity = None if expert_cache_gb is None else _set_capacity(n, budget, r, expert_cache_gb)
    kv, kv_why = _kv_pool(n, budget, r, capacity, kv_cache_gb, expert_cache_gb, max_model_len, max_num_seqs)
    if capacity is None:  # 6. the expert cache from what is left
        capacity = min(n.total_experts, (r.room - kv) // n.unit_nbytes)
        exp_why = ("all fit" if capacity == n.total_experts else
                   "what the other parts leave; the rest are read from disk on demand")
    else:
        exp_why = f"expert_cache_gb={expert_cache_gb:g}, set" + (
            ", capped at all" if capacity == n.total_experts and
            int((expert_cache_gb or 0) * GiB) > n.unit_nbytes * n.total_experts else "")
    expert_bytes = capacity * n.unit_nbytes
    ctx, ctx_line = _context(n, budget, r, kv, max_model_len, context_chosen)
    total = r.fixed + kv + expert_bytes
    lines = (
        ("memory budget", f"{budget.why}: resident weights {fmt_bytes(n.resident_bytes)} + read buffers "
                          f"{fmt_bytes(n.staging_bytes)} + runtime {fmt_bytes(budget.runtime)}{_requests(n)} + KV pool "
                          f"{fmt_bytes(kv)} + experts {fmt_bytes(expert_bytes)} = {fmt_bytes(total)}"),
        ("KV pool", f"{fmt_bytes(kv)} ({kv_why})"),
        ("placement", f"{capacity} of {n.total_experts} experts in the fast tier, {fmt_bytes(expert_bytes)} "
                      f"({fmt_bytes(n.unit_nbytes)} each; {exp_why})"),
        ("max_model_len", ctx_line),
    )
    return MemorySplit(None if memory_gb is None else budget.nbytes, budget.nbytes, n.resident_bytes,
                       n.staging_bytes, budget.runtime, capacity, expert_bytes, kv, ctx, lines, n.request_bytes)


def _requests(n: MemoryNeeds) -> str:
    """The server's request memory as a term of the budget's sum (nothing when there is none)."""
    return f" + requests {fmt_bytes(n.request_bytes)} (request_memory_mb)" if n.request_bytes else ""


def _budget(n: MemoryNeeds, memory_gb: float | None, free_bytes: int) -> _Budget:
    """1. memory_gb, or free memory less headroom (the process's own RSS is then outside it, not charged)."""
    if memory_gb is not None:
        budget = int(memory_gb * GiB)
        why = f"{fmt_bytes(budget)} (memory_gb={memory_gb:g}, set" + (
            f"; warning: only {fmt_bytes(free_bytes)} is free now, the OS may swap)" if budget > free_bytes else ")")
        runtime = n.overhead_bytes + n.process_bytes + process_growth_bytes(n.process_bytes)
        return _Budget(budget, f"memory_gb={memory_gb:g}", why, "raise memory_gb", runtime)
    headroom = max(HEADROOM_MIN_BYTES, int(free_bytes * HEADROOM_FRACTION))
    budget = max(0, free_bytes - headroom)
    why = (f"{fmt_bytes(budget)} (derived: {fmt_bytes(free_bytes)} free less {fmt_bytes(headroom)} "
           "headroom; set memory_gb to choose it)")
    return _Budget(budget, f"the {fmt_bytes(budget)} derived from free memory", why,
                   "free memory or set memory_gb", n.overhead_bytes)


def _room(n: MemoryNeeds, b: _Budget, max_model_len: int | None) -> _Room:
    """2. the fixed parts first; 3. what they leave must hold one expert and the KV of one sequence."""
    fixed = n.resident_bytes + n.staging_bytes + b.runtime + n.request_bytes
    parts = (f"resident weights {fmt_bytes(n.resident_bytes)} + read buffers {fmt_bytes(n.staging_bytes)} + "
             f"runtime {fmt_bytes(b.runtime)}{_requests(n)}")
    min_ctx = max_model_len or min(MIN_CONTEXT, n.model_max_len)
    r = _Room(fixed, b.nbytes - fixed, parts, max_model_len or n.model_max_len, min_ctx, kv_for(n, min_ctx))
    unit = n.unit_nbytes
    if r.room < r.kv_min + unit:
        lower = "lower max_model_len or max_num_batched_tokens" if max_model_len is not None else \
            "lower max_num_batched_tokens"
        raise ConfigError(f"does not fit: {parts} + KV of one {min_ctx}-token sequence {fmt_bytes(r.kv_min)} + "
                          f"one expert {fmt_bytes(unit)} = {fmt_bytes(fixed + r.kv_min + unit)} exceed {b.of}; "
                          f"{b.to_raise}, or {lower} (its activations are in the runtime)")
    return r


def _set_capacity(n: MemoryNeeds, b: _Budget, r: _Room, expert_cache_gb: float) -> int:
    """4. expert_cache_gb: that many whole experts (at least one, at most all), beside the least KV pool."""
    unit = n.unit_nbytes
    capacity = max(1, min(n.total_experts, int(expert_cache_gb * GiB) // unit))
    if capacity * unit > r.room - r.kv_min:
        raise ConfigError(f"does not fit: {r.parts} + expert cache {fmt_bytes(capacity * unit)} "
                          f"(expert_cache_gb={expert_cache_gb:g}) + KV of one {r.min_ctx}-token sequence "
                          f"{fmt_bytes(r.kv_min)} exceed {b.of}; lower expert_cache_gb or {b.to_raise}")
    return capacity


def _kv_pool(n: MemoryNeeds, b: _Budget, r: _Room, capacity: int | None, kv_cache_gb: float | None,
             expert_cache_gb: float | None, max_model_len: int | None, max_num_seqs: int) -> tuple[int, str]:
    """5. (KV pool bytes, why): kv_cache_gb; else what expert_cache_gb leaves; else a full pool beside all experts
    when it fits; else `_shared_kv_pool`."""
    unit, want_kv = n.unit_nbytes, kv_for(n, r.ctx, max_num_seqs)
    full = f"{max_num_seqs} sequences x {r.ctx} tokens"
    if kv_cache_gb is not None:
        kv = int(kv_cache_gb * GiB)
        if kv < r.kv_min:
            raise ConfigError(f"kv_cache_gb={kv_cache_gb:g} ({fmt_bytes(kv)}) cannot hold one {r.min_ctx}-token "
                              f"sequence ({fmt_bytes(r.kv_min)}): raise kv_cache_gb"
                              + (" or lower max_model_len" if max_model_len is not None else ""))
        need = kv + (unit if capacity is None else capacity * unit)
        if need > r.room:
            experts = (f"one expert {fmt_bytes(unit)}" if capacity is None else
                       f"expert cache {fmt_bytes(capacity * unit)} (expert_cache_gb={expert_cache_gb:g})")
            raise ConfigError(f"does not fit: {r.parts} + KV pool {fmt_bytes(kv)} (kv_cache_gb={kv_cache_gb:g})"
                              f" + {experts} = {fmt_bytes(r.fixed + need)} exceed {b.of}; lower kv_cache_gb"
                              + (" or expert_cache_gb" if capacity is not None else "") + f", or {b.to_raise}")
        return kv, f"kv_cache_gb={kv_cache_gb:g}, set"
    if capacity is not None:
        kv = min(want_kv, r.room - capacity * unit)
        return kv, "what expert_cache_gb leaves" + (f", capped at {full}" if kv == want_kv else "")
    if r.room - unit * n.total_experts >= want_kv:
        return want_kv, f"{full}, beside all experts"
    return _shared_kv_pool(n, r, full)


def _shared_kv_pool(n: MemoryNeeds, r: _Room, full: str) -> tuple[int, str]:
    """5, when the experts do not all fit: min(one full-context sequence, KV_SHARE of room), never less than the
    least pool, never so much that not one expert fits, more when all experts fit beside a larger pool."""
    all_bytes = n.unit_nbytes * n.total_experts
    share = min(kv_for(n, r.ctx), int(KV_SHARE * r.room))
    kv = min(max(share, r.kv_min, r.room - all_bytes), r.room - n.unit_nbytes)
    if kv == r.room - all_bytes and kv > max(share, r.kv_min):
        return kv, f"what all experts leave, less than {full}"
    if kv == kv_for(n, r.ctx):
        return kv, f"one {r.ctx}-token sequence: the experts do not all fit, they get the rest"
    if kv == r.kv_min:
        return kv, f"one {r.min_ctx}-token sequence, the least: the experts do not all fit, they get the rest"
    return kv, f"{KV_SHARE:.0%} of what the fixed parts leave: the experts do not all fit, they get the rest"


def _context(n: MemoryNeeds, b: _Budget, r: _Room, kv: int, max_model_len: int | None,
             chosen: bool = False) -> tuple[int, str]:
    """7. (max_model_len, its line): as set, else the model's lowered to what one sequence can hold in the pool."""
    if max_model_len is not None and chosen:
        return r.ctx, (f"{max_model_len} (auto: the model's {n.model_max_len} does not fit {b.of}; the longest "
                       f"context that fits with the runtime it needs; set max_model_len or {b.to_raise})")
    if max_model_len is not None:
        return r.ctx, f"{max_model_len} (set)"
    ctx = r.ctx
    fits = (kv - n.kv_fixed_bytes) // n.kv_bytes_per_token - n.block_size if n.kv_bytes_per_token else ctx
    if fits < ctx:
        ctx = max(r.min_ctx, fits // LEN_MULTIPLE * LEN_MULTIPLE)
        return ctx, (f"{ctx} (auto: the model's {n.model_max_len} does not fit the {fmt_bytes(kv)} KV pool of "
                     f"{b.of}; set max_model_len or {b.to_raise})")
    return ctx, f"{ctx} (auto: the model's max_position_embeddings)"


# ------------------------------------------------------------------------------------------------ runtime
PROCESS_GROWTH_MIN_BYTES = 8 * 2**20
PROCESS_GROWTH_FRACTION = 0.02


def process_growth_bytes(process_bytes: int) -> int:
    """What the process's own pages grow by after its RSS was measured at start-up (code pages of the kernels first
    run later, thread stacks, allocator slack): 2% of that RSS, at least 8 MiB; charged with it against memory_gb
    (a run at memory_gb=0.9 peaked 0.25 MiB above it without this allowance). Nothing when no RSS is charged."""
    return max(PROCESS_GROWTH_MIN_BYTES, int(process_bytes * PROCESS_GROWTH_FRACTION)) if process_bytes > 0 else 0


def process_rss_bytes() -> int:
    """Resident set size of this process now."""
    return int(psutil.Process().memory_info().rss)


def activation_bytes(tokens: int, hidden: int, expert_width: int, top_k: int, qkv_width: int, vocab: int,
                     num_seqs: int, itemsize: int, *, context: int = 0, kv_width: int = 0) -> int:
    """A generous bound on the transient tensors of one step of `tokens` tokens (every element counted at
    max(itemsize, 4) bytes, as if fp32), twice over for temporaries:

    - per token: the hidden states, residual and norms (6 x hidden), q|k|v (qkv_width), the attention output
      (hidden), and each of the top_k routed experts' gate|up and activation (3 x expert_width);
    - the logits of the sampled rows only (each sequence's last token), fp32, three times (logits, softmax, sort);
    - with `context` and `kv_width` (num_kv_heads x head_dim, or num_heads x head_dim where the keys are repeated
      per head): the K and V of one layer of one sequence at `context` tokens, gathered from the paged blocks by
      torch's attention (it attends one sequence at a time, or a padded batch no larger; models/layers/base.py).
    """
    per_token = 6 * hidden + qkv_width + hidden + 3 * top_k * expert_width
    gathered = 2 * context * kv_width
    return 2 * (tokens * per_token + gathered) * max(itemsize, 4) + 3 * num_seqs * vocab * 4
