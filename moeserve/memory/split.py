"""One memory budget, split once: the engine (at start-up, before any weight is loaded) and `moeserve plan` call
`split_memory` with the same needs and print the same lines.

Budget B = memory_gb (everything the process holds), or, without it, free memory less the headroom of
memory/budget.py (logged as derived). From B come, in this order:

1. the fixed parts: resident weights (everything but the experts), the expert store's read buffers, and the
   runtime overhead (the process's RSS measured at start-up: interpreter, torch, tokenizer; plus the activations
   of one step of max_num_batched_tokens tokens);
2. the KV pool: kv_cache_gb when set; else, when every expert fits beside a pool of max_num_seqs sequences of
   the full context, that pool (all experts resident); else at least one sequence of the full context and at most
   a quarter of what is left, so the experts keep most of the memory;
3. the expert cache: expert_cache_gb when set, else all that is left (at least one unit).

max_model_len, when not set, is the model's own, lowered (to a multiple of 16, logged) when even one sequence of it
does not fit the KV pool. Anything that cannot fit raises ConfigError with one line naming each part, before
anything is allocated. With memory_gb, the parts always sum to at most B.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil

from moeserve.errors import ConfigError
from moeserve.memory.budget import HEADROOM_FRACTION, HEADROOM_MIN_BYTES

GiB = 1024**3
MiB = 2**20
MIN_CONTEXT = 256  # the shortest context worth serving when max_model_len is lowered to fit
KV_SHARE = 0.25  # the KV pool's share of what is left when the experts do not all fit


@dataclass(frozen=True)
class MemoryNeeds:
    """What the split needs, from shapes and start-up measurements."""

    resident_bytes: int  # non-expert weights
    unit_nbytes: int  # one expert unit in the fast tier
    total_experts: int
    kv_bytes_per_token: int  # the full-attention groups, per token
    kv_fixed_bytes: int  # the sliding-window groups' pools (bounded whatever the context)
    block_size: int
    model_max_len: int
    staging_bytes: int  # the expert store's read buffers
    overhead_bytes: int  # runtime: RSS at start-up + one step's activations


@dataclass(frozen=True)
class MemorySplit:
    memory_bytes: int | None  # memory_gb, if given
    budget_bytes: int  # what was split
    resident_bytes: int
    staging_bytes: int
    overhead_bytes: int
    expert_capacity: int
    expert_bytes: int
    kv_bytes: int
    max_model_len: int
    lines: tuple[tuple[str, str], ...]  # (name, value with its reason): the start-up log and `plan` print them

    @property
    def total_bytes(self) -> int:
        return self.resident_bytes + self.staging_bytes + self.overhead_bytes + self.expert_bytes + self.kv_bytes


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def kv_for(needs: MemoryNeeds, tokens: int) -> int:
    """KV pool bytes that hold one sequence of `tokens` tokens (one spare block for the step that grows it)."""
    return needs.kv_fixed_bytes + needs.kv_bytes_per_token * (tokens + needs.block_size)


def split_memory(needs: MemoryNeeds, *, memory_gb: float | None, expert_cache_gb: float | None,
                 kv_cache_gb: float | None, max_model_len: int | None, max_num_seqs: int,
                 free_bytes: int) -> MemorySplit:
    n = needs
    given = memory_gb is not None
    if memory_gb is not None:
        budget = int(memory_gb * GiB)
        why = f"memory_gb={memory_gb:g} (set)" + (
            f"; only {_gib(free_bytes)} is free now" if budget > free_bytes else "")
    else:
        headroom = max(HEADROOM_MIN_BYTES, int(free_bytes * HEADROOM_FRACTION))
        budget = max(0, free_bytes - headroom)
        why = f"{_gib(budget)} (derived: {_gib(free_bytes)} free less {_gib(headroom)} headroom; set memory_gb)"
    fixed = n.resident_bytes + n.staging_bytes + n.overhead_bytes
    room = budget - fixed
    ctx = max_model_len or n.model_max_len
    min_ctx = max_model_len or min(MIN_CONTEXT, n.model_max_len)
    parts = (f"resident weights {_gib(n.resident_bytes)} + read buffers {_gib(n.staging_bytes)} + runtime "
             f"{_gib(n.overhead_bytes)} + KV for one {min_ctx}-token sequence {_gib(kv_for(n, min_ctx))} + one expert "
             f"{_gib(n.unit_nbytes)}")
    if room < kv_for(n, min_ctx) + n.unit_nbytes:
        what = f"memory_gb={memory_gb:g}" if given else f"the {_gib(budget)} free"
        raise ConfigError(f"does not fit: {parts} exceed {what}; raise memory_gb, free memory, or lower "
                          "max_model_len / max_num_batched_tokens")
    all_experts = n.unit_nbytes * n.total_experts
    want_kv = kv_for(n, max_num_seqs * ctx)
    expert_fixed = None if expert_cache_gb is None else min(all_experts, int(expert_cache_gb * GiB))
    if kv_cache_gb is not None:
        kv, kv_why = int(kv_cache_gb * GiB), f"kv_cache_gb={kv_cache_gb:g} (set)"
    elif expert_fixed is not None:
        kv = min(want_kv, room - expert_fixed)
        kv_why = "what expert_cache_gb leaves" + (f", capped at {max_num_seqs} x {ctx} tokens" if kv == want_kv else "")
    elif room - all_experts >= want_kv:
        kv, kv_why = want_kv, f"{max_num_seqs} sequences x {ctx} tokens, beside all experts"
    else:
        kv = max(kv_for(n, min_ctx), min(kv_for(n, ctx), int(KV_SHARE * room)))
        kv_why = (f"one {ctx}-token sequence" if kv == kv_for(n, ctx) else
                  f"{KV_SHARE:.0%} of what the fixed parts leave") + ": the experts do not all fit, they get the rest"
    if kv < kv_for(n, min_ctx):
        raise ConfigError(f"kv_cache_gb={kv_cache_gb:g} cannot hold one sequence of {min_ctx} tokens "
                          f"({_gib(kv_for(n, min_ctx))}): raise kv_cache_gb or lower max_model_len")
    left = room - kv
    if expert_fixed is not None:
        capacity = max(1, expert_fixed // n.unit_nbytes)
        exp_why = f"expert_cache_gb={expert_cache_gb:g} (set)"
    else:
        capacity = min(n.total_experts, max(0, left) // n.unit_nbytes)
        exp_why = "what is left"
    if capacity * n.unit_nbytes > left or capacity < 1:
        raise ConfigError(f"does not fit: {parts.rsplit(' + one expert', 1)[0]}, KV pool {_gib(kv)} and expert cache "
                          f"{_gib(max(1, capacity) * n.unit_nbytes)} exceed {_gib(budget)}; lower kv_cache_gb or "
                          "expert_cache_gb, or raise memory_gb")
    if max_model_len is None:
        fits = (kv - n.kv_fixed_bytes) // n.kv_bytes_per_token - n.block_size if n.kv_bytes_per_token else ctx
        if fits < ctx:
            ctx = max(min_ctx, fits // 16 * 16)
            ctx_line = (f"{ctx} (auto: the model's {n.model_max_len} does not fit the {_gib(kv)} KV pool; set "
                        "max_model_len or raise memory_gb)")
        else:
            ctx_line = f"{ctx} (auto: the model's max_position_embeddings)"
    else:
        if kv < kv_for(n, max_model_len):
            raise ConfigError(f"max_model_len={max_model_len} needs {_gib(kv_for(n, max_model_len))} of KV for one "
                              f"sequence, more than the {_gib(kv)} KV pool: lower it or raise kv_cache_gb / memory_gb")
        ctx_line = f"{max_model_len} (set)"
    total = fixed + kv + capacity * n.unit_nbytes
    lines = (
        ("memory budget", f"{why}: resident weights {_gib(n.resident_bytes)}, read buffers {_gib(n.staging_bytes)}, "
                          f"runtime {_gib(n.overhead_bytes)}, KV pool {_gib(kv)}, experts "
                          f"{_gib(capacity * n.unit_nbytes)} = {_gib(total)}"),
        ("KV pool", f"{_gib(kv)} ({kv_why})"),
        ("placement", f"{capacity} of {n.total_experts} experts, {_gib(capacity * n.unit_nbytes)} ({exp_why})"),
        ("max_model_len", ctx_line),
    )
    return MemorySplit(int(memory_gb * GiB) if memory_gb is not None else None, budget, n.resident_bytes,
                       n.staging_bytes, n.overhead_bytes, capacity, capacity * n.unit_nbytes, kv, ctx, lines)


def process_rss_bytes() -> int:
    return int(psutil.Process().memory_info().rss)


def activation_bytes(tokens: int, hidden: int, expert_width: int, top_k: int, qkv_width: int, vocab: int,
                     num_seqs: int, itemsize: int) -> int:
    """A generous bound on one step's transient tensors: per token the hidden states and norms (x6), q|k|v, the
    attention output, each routed expert's gate|up and activation (x3 per pair), twice for temporaries; and the
    fp32 logits of each sequence's last token (x3: logits, softmax, sort)."""
    per_token = 6 * hidden + qkv_width + hidden + 3 * top_k * expert_width
    return 2 * tokens * per_token * max(itemsize, 4) + 3 * num_seqs * vocab * 4
