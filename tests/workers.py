"""The suite in several processes (pytest-xdist; scripts/run_tests.sh picks how many): each worker gets its own
cores, and a checkpoint the session builds once is built once for all workers.

- `pin_this_worker()`: worker i of n keeps the i-th share of the cores the run was given (sched_setaffinity), so
  that the workers' engines and their subprocesses (which size their thread pools from the affinity mask) never
  run more threads than cores. Without it two workers on 2 cores run 4 OpenMP threads that spin on each other.
- `shared_folder(base, key, build)`: `build(folder)`'s result, built by the first worker that asks and reused by
  the others (a file lock and a completion mark beside it); without xdist, a folder of this process's own.
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from filelock import FileLock

WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ... in a worker; "" otherwise
WORKER_COUNT = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)


def pin_this_worker() -> str | None:
    """Pins this worker to its share of the cores; returns what it did (for the report header) or None."""
    if not WORKER or WORKER_COUNT < 2 or not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < WORKER_COUNT:
        return None
    mine = cores[int(WORKER.removeprefix("gw")) % WORKER_COUNT::WORKER_COUNT]
    os.sched_setaffinity(0, mine)
    torch.set_num_threads(len(mine))  # OpenMP sized its pool from the mask it saw at import
    return f"{WORKER}: cores {mine} of {cores}"


def shared_folder(base: Path, key: str, build: Callable[[Path], Path]) -> Path:
    """The folder `build(empty folder)` returned for `key`, built once per run across the workers. `base` is this
    process's pytest base temp folder; the workers' base folders are siblings."""
    name = key.replace(".", "_").replace("/", "_")
    root = (base.parent if WORKER else base) / "built-once"
    root.mkdir(parents=True, exist_ok=True)
    done = root / f"{name}.done"  # holds build's result relative to the folder: written only once it returned
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            folder = root / name
            shutil.rmtree(folder, ignore_errors=True)  # what a build that failed in another worker left
            folder.mkdir()
            done.write_text(build(folder).relative_to(root).as_posix())
        return root / done.read_text()


def heavy_modules_first(items: list[pytest.Item]) -> None:
    """Orders the modules by how many slow tests each holds, most first, keeping each module's own order: the
    workers take whole modules (--dist loadfile) in this order, so the long ones start early and the run does not
    end on one of them alone."""
    slow: dict[str, int] = {}
    for item in items:
        slow[item.nodeid.split("::")[0]] = slow.get(item.nodeid.split("::")[0], 0) + ("slow" in item.keywords)
    items.sort(key=lambda item: -slow[item.nodeid.split("::")[0]])
