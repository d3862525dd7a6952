"""What the engine says at start-up at the default log level: every choice it made, with its reason, one INFO line
each on the `moeserve.choices` logger (LLMEngine._chose; also kept in `LLMEngine.choices`, /v1/models?verbose=true),
then one summary line (`startup_summary`), and, when stderr is not a terminal (systemd, containers, a redirected
log), the weights' load progress as log lines (`LoadProgress`). `chat` quiets the choices logger below DEBUG (a
conversation starts in a few lines); `serve`, `generate` and the Python API print them."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from moeserve.memory.budget import fmt_bytes

log = logging.getLogger("moeserve")
CHOICES_LOG = "moeserve.choices"  # the logger of the per-choice start-up lines

PROGRESS_LOG_S = 5.0  # a load-progress line at most this often: a load of a few seconds prints none


def startup_summary(architecture: str, plan: Any) -> str:
    """One line: the model, device and dtype, the budget's split, where the experts are, the context. `plan`: the
    EnginePlan."""
    split = plan.sizes.split
    total = plan.needs.total_experts
    budget = (f"memory_gb={split.memory_bytes / 2**30:g}" if split.memory_bytes is not None
              else "derived from free memory")
    where = "all experts in the fast tier" if split.expert_capacity == total else (
        f"{split.expert_capacity} of {total} experts in the fast tier, the rest read on demand")
    return (f"{architecture} on {plan.device.type}, {plan.dtype_name}, {plan.threads} threads, "
            f"{'C++ kernels' if plan.cpp_kernels else 'torch ops'}; memory {fmt_bytes(split.budget_bytes)} "
            f"({budget}) = resident {fmt_bytes(split.resident_bytes)} + read buffers {fmt_bytes(split.staging_bytes)}"
            f" + runtime {fmt_bytes(split.overhead_bytes)}"
            + (f" + requests {fmt_bytes(split.request_bytes)}" if split.request_bytes else "")
            + f" + KV pool {fmt_bytes(split.kv_bytes)} + experts "
            f"{fmt_bytes(split.expert_bytes)}; {where}; max_model_len {split.max_model_len}")


class LoadProgress:
    """Context manager yielding `advance(nbytes)` over the bytes read while loading: a tqdm bar on a terminal,
    else a log line at most every PROGRESS_LOG_S seconds (none for a quick load)."""

    def __init__(self, total_bytes: int, tty: bool | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.done, self.clock = total_bytes, 0, clock
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.start = self.last = clock()
        self.bar: Any = None
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="Loading weights",
                            leave=False)

    def advance(self, nbytes: int) -> None:
        if self.bar is not None:
            self.bar.update(nbytes)
            return
        self.done += nbytes
        now = self.clock()
        if now - self.last >= PROGRESS_LOG_S:
            self.last = now
            share = self.done / self.total if self.total else 1.0
            log.info("Loading weights: %s of %s (%.0f%%) in %.0f s", fmt_bytes(self.done), fmt_bytes(self.total),
                     100 * share, now - self.start)

    def __enter__(self) -> Callable[[int], None]:
        return self.advance

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()
