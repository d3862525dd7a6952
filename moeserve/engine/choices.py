"""The start-up choices, each a pure function of the settings and what was read about the model and the machine.

Each returns `(value, line)`: `line` is what the start-up log prints after "name: " (the value and its reason),
and what `LLMEngine.choices` and the server's /v1/models record keep. A setting that cannot apply raises
ConfigError with one line. `engine/plan.py` `make_engine_plan` calls them in order; nothing here allocates a
tensor or reads a weight.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from moeserve.config import EngineSettings, did_you_mean
from moeserve.errors import ConfigError
from moeserve.experts.calls import static_policy_options
from moeserve.experts.policies import ONLINE_POLICY_NAMES
from moeserve.experts.store import StoreOptions
from moeserve.memory.budget import fmt_bytes
from moeserve.models.experts.plans import ExpertPlan, can_interleave_experts
from moeserve.state.kv_cache import KVGroup

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# safetensors dtype codes -> the compute dtype of that name (dtype=auto without a config.json dtype)
STORED_DTYPE_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


def dtype_name(dtype: torch.dtype) -> str:
    """"bfloat16" for torch.bfloat16: the name settings and log lines use."""
    return str(dtype).removeprefix("torch.")


def choose_device(want: str, cuda_available: bool) -> tuple[torch.device, str]:
    """EngineSettings.device (auto, cpu, cuda); cuda without a CUDA device raises ConfigError."""
    if want == "cuda" and not cuda_available:
        raise ConfigError("device=cuda but no CUDA device is available (use device=cpu or auto)")
    if want == "auto":
        dev = "cuda" if cuda_available else "cpu"
        return torch.device(dev), f"{dev} (auto: {'CUDA available' if dev == 'cuda' else 'no CUDA device'})"
    return torch.device(want), f"{want} (set)"


def choose_dtype(want: str, config_dtype: str | None, stored_code: str) -> tuple[torch.dtype, str]:
    """The compute dtype: as set, else config.json's `dtype`, else the dtype most weights are stored in
    (`stored_code`, a safetensors code such as "BF16"; bfloat16 for a code with no compute dtype)."""
    if want != "auto":
        return DTYPES[want], f"{want} (set)"
    name = config_dtype if config_dtype in DTYPES else STORED_DTYPE_NAMES.get(stored_code, "bfloat16")
    why = "config.json dtype" if config_dtype in DTYPES else f"most weights are stored as {stored_code}"
    return DTYPES[str(name)], f"{name} (auto: {why})"


def choose_threads(want: int | None, usable_cores: int) -> tuple[int, str]:
    """torch's compute threads: as set, else every core this process may run on."""
    n = want or usable_cores
    return n, f"{n} ({'set' if want else f'auto: all {usable_cores} usable cores'})"


NGRAM_RESIDENT_SHARE = 4  # the n-gram tables stay whole when they take at most 1/4 of the memory budget ...
NGRAM_CACHE_SHARE = 16  # ... else their cache takes 1/16 of it (a token reads a few rows: the hit rate barely pays)


def choose_ngram_cache(want_gb: float | None, units: int, unit_nbytes: int, budget_bytes: int) -> tuple[int, str]:
    """Units of the n-gram tables (models/ngram_table.py) held in memory: `want_gb` when set (at least one, at most
    all); else all when they take at most 1/NGRAM_RESIDENT_SHARE of the budget, else 1/NGRAM_CACHE_SHARE of it."""
    total = units * unit_nbytes
    if want_gb is not None:
        n = max(1, min(units, int(want_gb * 2**30) // unit_nbytes))
        how = f"ngram_cache_gb={want_gb:g}, set"
    elif total * NGRAM_RESIDENT_SHARE <= budget_bytes:
        n, how = units, f"auto: all, at most 1/{NGRAM_RESIDENT_SHARE} of the {fmt_bytes(budget_bytes)} budget"
    else:
        n = max(1, min(units, budget_bytes // NGRAM_CACHE_SHARE // unit_nbytes))
        how = (f"auto: 1/{NGRAM_CACHE_SHARE} of the {fmt_bytes(budget_bytes)} budget, as the tables exceed "
               f"1/{NGRAM_RESIDENT_SHARE} of it; the rest read from disk on a miss")
    return n, (f"{n} of {units} units ({fmt_bytes(n * unit_nbytes)} of {fmt_bytes(total)}, {unit_nbytes} bytes "
               f"each) in memory ({how})")


def kernels_line(want: str, use_cpp: bool, reason: str) -> str:
    """The log line of `kernels.choose(want, ...) -> (use_cpp, reason)` (the choice itself loads the library)."""
    return f"{'cpp' if use_cpp else 'torch'} ({want}: {reason})"


def check_max_model_len(want: int | None, model_max: int) -> None:
    """A set max_model_len above the model's is refused; unset, memory/split.py picks it (logged there)."""
    if want is not None and want > model_max:
        raise ConfigError(f"max_model_len={want} exceeds the model's max_position_embeddings={model_max}")


def choose_batched_tokens(want: int | None, max_num_seqs: int) -> tuple[int, str]:
    """Tokens per engine step: as set, else DEFAULT_MAX_NUM_BATCHED_TOKENS (at least max_num_seqs); it must hold
    one decode token of every sequence."""
    n = want if want is not None else max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_num_seqs)
    if n < max_num_seqs:
        raise ConfigError(f"max_num_batched_tokens={n} cannot hold one decode token of each of "
                          f"max_num_seqs={max_num_seqs} sequences: raise it or lower max_num_seqs")
    return n, (f"{n} ({'set' if want is not None else 'default'}): longer prompts are prefilled in chunks of this "
               "many tokens between decode steps")


def least_batched_tokens(groups: Sequence[KVGroup], max_num_seqs: int) -> int:
    """The least max_num_batched_tokens a step can run with: one prefill chunk of the recurrent layers (their
    `prefill_step` positions) beside one decode token of every sequence."""
    return max(g.kind.prefill_step for g in groups) + max_num_seqs


def check_prefill_step(groups: Sequence[KVGroup], batched_tokens: int, max_num_seqs: int) -> None:
    """A step must hold `least_batched_tokens`."""
    step = max(g.kind.prefill_step for g in groups)
    if batched_tokens < least_batched_tokens(groups, max_num_seqs):
        raise ConfigError(f"max_num_batched_tokens={batched_tokens} is too small for this model: its "
                          f"recurrent layers compute prompts in chunks of {step} positions, so a step needs room "
                          f"for one chunk beside max_num_seqs={max_num_seqs} decode tokens (set at least "
                          f"{step + max_num_seqs})")


def choose_expert_layout(plan: ExpertPlan, dtype: torch.dtype, quantization: str, want: str, cpp: bool,
                         interleaved_ops: Callable[[bool], bool]) -> tuple[bool, str]:
    """True: hold the experts row-interleaved for the fused C++ ops; expert_layout=interleaved raises ConfigError
    where it cannot apply. `plan`: the dense (not int8) plan; `interleaved_ops(int8)`: the built C++ kernels have
    the interleaved op (bf16, or int8 with `int8`: every build since both run the canonical dots on every ISA).

    The choice never depends on where the experts live: the plain and interleaved ops round bf16 differently
    once a row spans several blocks, so an offloaded run must use the layout (and op) a resident one uses, or
    offloading would change the numbers. Offloaded bf16 misses are permuted to the interleaved layout as they
    leave the read buffer (interleaved measured 0.96-1.05x plain there), int8 ones are read interleaved."""
    if want == "plain":
        return False, "plain (set)"
    if quantization == "int4":
        if want == "interleaved":
            raise ConfigError("expert_layout=interleaved is not possible with quantization=int4: int4 units are read "
                              "as stored (use auto or plain)")
        return False, "as stored (int4 units: the C++ 4-bit op reads them as they are)"
    why_not = None if cpp else "kernels=torch or the C++ kernels are unavailable"
    why_not = why_not or can_interleave_experts(plan, dtype)
    if why_not is None and not interleaved_ops(quantization == "int8"):
        why_not = "the kernels were built without AVX512-BF16" + ("/VBMI" if quantization == "int8" else "")
    if why_not is not None:
        if want == "interleaved":
            raise ConfigError(f"expert_layout=interleaved is not possible here: {why_not} (use auto or plain)")
        return False, f"plain ({why_not})"
    return True, ("rows interleaved in blocks of 4 (the fused C++ op streams each block; "
                  f"{'set' if want == 'interleaved' else 'auto'})")


def store_options(s: EngineSettings, capacity: int, host_capacity: int) -> StoreOptions:
    """How the expert store is built beyond its capacity: policy (cache_policy=static reads its trace here),
    host tier, prefetch, capacity mode, admission."""
    if s.cache_policy not in ONLINE_POLICY_NAMES:
        hint = did_you_mean(s.cache_policy, list(ONLINE_POLICY_NAMES))
        raise ConfigError(f"unknown cache_policy '{s.cache_policy}'{hint}")
    options: dict[str, Any] = {}
    if s.cache_policy == "static":
        if s.cache_trace is None:
            raise ConfigError("cache_policy=static pins the most used experts of a recorded trace: set "
                              "cache_trace=FILE (record one with record_trace=FILE)")
        options = static_policy_options(s.cache_trace, capacity)
    return StoreOptions(policy=s.cache_policy, policy_options=options, host_capacity=host_capacity,
                        prefetch=s.prefetch is not False, prefetch_auto=s.prefetch == "auto",
                        cache_mode=s.expert_cache_mode, admission=s.expert_admission)


def kv_cache_line(described: str, dtype: torch.dtype, prefix_caching: bool, groups: Sequence[KVGroup],
                  asked_prefix_caching: bool) -> str:
    """The "KV cache" line, of the cache as built (`described`: PagedKVCache.describe()); `prefix_caching`: on in
    the built SequenceMemory, which turns it off where a kind cannot reuse a prefix."""
    no_reuse = [g.kind.name for g in groups if not g.kind.caches_prefixes]
    why = (f" ({no_reuse[0]} layers: a state is valid only at the position it was left at)"
           if no_reuse and asked_prefix_caching else "")
    return f"paged: {described} ({dtype_name(dtype)}); prefix caching {'on' if prefix_caching else 'off'}{why}"
