"""Expert parallelism at start-up: the head's rendezvous and handshake, and the expert worker's whole life.

    head   = start_head(settings, ckpt)       # waits for the workers; their budgets -> who owns which experts
    plan   = make_engine_plan(..., experts_held=head.held(spec))   # the head's store budgets only its experts
    head.confirm(numerics_id(plan))            # every worker computes the same bits, or start-up stops here
    worker: run_worker(settings, "HOST:PORT")  # join, handshake, build its store and kernel, serve layer calls

The handshake: each worker sends its version, checkpoint and config hashes and memory_gb; the head refuses a
mismatch in one line naming the field, splits the experts (parallel/ownership.py, printed at start-up) and sends the
split; after planning, each worker sends its numerics id and the head refuses a mismatch again. Each rank reads its
experts from its own copy of the checkpoint: nothing is pushed or downloaded.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moeserve import kernels
from moeserve.checkpoint.base import Checkpoint
from moeserve.checkpoint.folder import open_checkpoint
from moeserve.config import EngineSettings
from moeserve.engine.choices import choose_dtype, choose_expert_layout, choose_threads, store_options
from moeserve.engine.plan import StartupProbe, _expert_plans, _held_plan
from moeserve.errors import ConfigError
from moeserve.experts.owned import OwnedSource
from moeserve.experts.store import ExpertStore
from moeserve.memory.rss import fix_mmap_threshold
from moeserve.models.experts.kernels import choose_expert_kernel
from moeserve.models.experts.plans import ExpertPlan
from moeserve.models.experts.remote import serve_layer_calls
from moeserve.models.numerics import Numerics, choose_numerics
from moeserve.models.spec import ModelSpec
from moeserve.models.validate import read_model
from moeserve.parallel.identity import digest, first_mismatch, tensor_index_digest
from moeserve.parallel.link import Link, PeerLost, connect_head, connect_worker
from moeserve.parallel.ownership import assign_experts, describe_ownership, format_ids, owned

log = logging.getLogger("moeserve")
HELLO, SPLIT, NUMERICS, VERDICT = 1, 2, 3, 4  # handshake tags


def checkpoint_identity(ckpt: Checkpoint) -> dict[str, str]:
    """The version, checkpoint and config fields of the handshake (parallel/identity.py). The version is a hash
    of moeserve's own Python sources: two builds of one version number that differ are told apart."""
    index = ((name, ref.dtype_code, ref.shape, ref.nbytes) for name, ref in ckpt.tensors.items())
    return {"version": source_digest(), "checkpoint": tensor_index_digest(index), "config": digest(ckpt.config)}


def source_digest() -> str:
    """A hash of every .py file of the moeserve package (its path and bytes)."""
    root = Path(kernels.__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return "sources " + h.hexdigest()[:16]


def numerics_id(numerics: Numerics, cpp: bool, isa: str, experts: ExpertPlan, dtype: torch.dtype) -> str:
    """What two ranks must share to compute the same bits: numerics, kernel build, expert layout, dtype."""
    build = "torch ops"
    if cpp:
        code = hashlib.sha256(b"".join(p.read_bytes() for p in kernels.sources())).hexdigest()[:12]
        build = f"C++ ops {code}, {kernels.built_for(kernels.isa_level(isa))}"
    return (f"{numerics.id}; {build}; torch {torch.__version__}; {experts.description}; "
            f"{str(dtype).removeprefix('torch.')}")


def _need_budget(s: EngineSettings, who: str) -> float:
    if s.memory_gb is None:
        raise ConfigError(f"expert parallelism: {who} needs --memory-gb (its share of the experts is sized by it)")
    return s.memory_gb


@dataclass
class Head:
    """The head's side of the group: the link, who owns which expert, the start-up lines."""

    link: Link
    owners: list[int]
    identity: dict[str, str]
    lines: list[str] = field(default_factory=list)

    def held(self, spec: ModelSpec) -> int:
        """Units the head's own store holds at most: its experts of every MoE layer."""
        return len(spec.moe_layer_ids) * len(owned(self.owners, 0))

    def confirm(self, numerics: str, device: torch.device) -> None:
        """Compare every worker's numerics id with the head's; refuse (ConfigError, every worker told) or go. The
        head computes on the CPU (its rows go to the workers through gloo's CPU tensors)."""
        mine = {**self.identity, "numerics": numerics}
        problem = None
        if device.type != "cpu":
            problem = (f"expert parallelism runs on CPU ranks only (the head's device is {device.type}): set "
                       "--device cpu on the head")
        with start_up_errors():
            for rank in range(1, self.link.size):
                theirs = self.link.recv_json(rank, NUMERICS, f"rank {rank}'s numerics")
                problem = problem or first_mismatch(mine, {**self.identity, **theirs}, rank, ("numerics",))
            for rank in range(1, self.link.size):
                self.link.send_json({"error": problem} if problem else {"ok": True}, rank, VERDICT, "the verdict")
        if problem:
            self.link.close()
            raise ConfigError(problem)


@contextmanager
def start_up_errors() -> Iterator[None]:
    """A rank lost during start-up is a one-line error (a ConfigError), not a traceback."""
    try:
        yield
    except PeerLost as err:
        raise ConfigError(str(err)) from None


def start_head(s: EngineSettings, ckpt: Checkpoint, num_experts: int) -> Head:
    """Wait for `s.ep_workers` workers at `s.ep_listen`, check each one's hello and send the expert split."""
    budget = _need_budget(s, "the head")
    if not s.ep_listen:
        raise ConfigError("expert parallelism: --ep-workers needs --ep-listen HOST:PORT (where the workers join)")
    log.info("expert parallelism: waiting for %d worker(s) on %s", s.ep_workers, s.ep_listen)
    with start_up_errors():
        return _handshake(s, ckpt, num_experts, budget)


def _handshake(s: EngineSettings, ckpt: Checkpoint, num_experts: int, budget: float) -> Head:
    t0 = time.monotonic()
    link = connect_head(s.ep_listen or "", s.ep_workers, s.ep_timeout, s.ep_any_interface, s.ep_join_timeout)
    identity = checkpoint_identity(ckpt)
    budgets, problem = [budget], None
    for rank in range(1, link.size):
        hello = link.recv_json(rank, HELLO, f"rank {rank}'s hello")
        problem = problem or first_mismatch(identity, hello, rank, ("version", "checkpoint", "config"))
        budgets.append(float(hello.get("memory_gb", 0)))
    if problem is None:
        try:
            owners = assign_experts(num_experts, budgets, s.ep_ownership)
        except ValueError as err:
            problem = f"expert parallelism: {err}"
    for rank in range(1, link.size):
        link.send_json({"error": problem} if problem else {"owners": owners}, rank, SPLIT, f"rank {rank}'s split")
    if problem:
        link.close()
        raise ConfigError(problem)
    lines = [f"{link.size} ranks joined in {time.monotonic() - t0:.1f} s over gloo ({s.ep_listen}; timeout "
             f"{s.ep_timeout:g} s)", *describe_ownership(owners, budgets, s.ep_ownership)]
    return Head(link, owners, identity, lines)


def run_worker(s: EngineSettings, head: str) -> int:
    """An expert worker: join `head`, handshake, build the store of its experts only, serve layer calls until the
    head stops it (0) or is lost (PeerLost)."""
    budget = _need_budget(s, "an expert worker")
    ckpt = open_checkpoint(s.model) if s.model else None
    if ckpt is None:
        raise ConfigError("moeserve ep-worker needs MODEL: its own local copy of the head's model")
    arch, spec = read_model(ckpt)
    probe = StartupProbe(fix_mmap_threshold())
    with start_up_errors():
        link, store, kernel, mine = _join(s, ckpt, arch, spec, probe, head, budget)
    log.info("expert parallelism: rank %d serves experts %s of each of %d MoE layers (%s; %s)", link.rank,
             format_ids(mine), len(spec.moe_layer_ids), store.describe(), kernel.describe())
    try:
        serve_layer_calls(link, kernel, store, spec.hidden_size)
    except PeerLost as err:
        raise ConfigError(f"{err}: the head is gone") from None
    finally:
        store.close()
    log.info("expert parallelism: rank %d stopped by the head", link.rank)
    return 0


def _join(s: EngineSettings, ckpt: Checkpoint, arch: Any, spec: ModelSpec, probe: StartupProbe, head: str,
          budget: float) -> tuple[Link, ExpertStore, Any, list[int]]:
    """A worker's start-up: join, hello, the split, its store and kernel, the numerics verdict."""
    link = connect_worker(head, s.ep_timeout, s.ep_join_timeout)
    log.info("expert parallelism: joined %s as rank %d of %d", head, link.rank, link.size)
    link.send_json({**checkpoint_identity(ckpt), "memory_gb": budget}, 0, HELLO, "the hello")
    split = link.recv_json(0, SPLIT, "the expert split")
    if "error" in split:
        raise ConfigError(str(split["error"]))
    mine = owned(split["owners"], link.rank)
    store, kernel, numerics = _worker_store(ckpt, arch, spec, s, probe, mine, budget)
    link.send_json({"numerics": numerics}, 0, NUMERICS, "the numerics")
    verdict = link.recv_json(0, VERDICT, "the verdict")
    if "error" in verdict:
        store.close()
        raise ConfigError(str(verdict["error"]))
    return link, store, kernel, mine


def _worker_store(ckpt: Checkpoint, arch: Any, spec: ModelSpec, s: EngineSettings, probe: StartupProbe,
                  mine: list[int], budget_gb: float) -> tuple[ExpertStore, Any, str]:
    """(the store of `mine` within the budget, the kernel, the numerics id): the engine plan's own choices for the
    experts (dtype, kernels, quantization, layout, numerics), without the parts a worker does not hold."""
    device = torch.device("cpu")
    dtype, _ = choose_dtype(s.dtype, spec.config_dtype, ckpt.stored_dtype())
    threads, _ = choose_threads(s.threads, probe.usable_cores())
    torch.set_num_threads(threads)
    cpp, _ = probe.kernels(s.kernels, device.type, s.cpu_isa)
    dense, sized = _expert_plans(ckpt, arch, spec, dtype, s)
    interleaved, _ = choose_expert_layout(dense, dtype, s.quantization, s.expert_layout, cpp, probe.interleaved_ops)
    held = _held_plan(dense, sized, dtype, s, interleaved)
    numerics, _ = choose_numerics(cpp, s.batch_invariant, dtype, device)
    total = len(spec.moe_layer_ids) * len(mine)
    capacity = worker_capacity(budget_gb, probe.runtime_bytes(), held.layout.nbytes, total, spec, s, dtype)
    store = ExpertStore(OwnedSource(held.source(ckpt), mine), spec.moe_layer_ids, len(mine), capacity, device,
                        s.cache_policy, None, store_options(s, capacity, 0))
    kernel = choose_expert_kernel(held.math, numerics, dtype, device, top_k=spec.moe.top_k)
    return store, kernel, numerics_id(numerics, cpp, s.cpu_isa, held, dtype)


def worker_capacity(budget_gb: float, runtime_bytes: int, unit_nbytes: int, total: int, spec: ModelSpec,
                    s: EngineSettings, dtype: torch.dtype) -> int:
    """Units a worker's store holds: what its budget leaves after the process (`runtime_bytes`, measured), the read
    buffers (4 units) and one layer call's activations (a batch's tokens x top_k pairs: rows, outputs and the
    kernel's intermediates), and at most `expert_cache_gb` when set; all its experts when they fit. ConfigError when
    not even one unit fits."""
    pairs = (s.max_num_batched_tokens or 2048) * spec.moe.top_k
    inter = spec.moe.intermediate_size or spec.hidden_size
    activations = pairs * (4 * spec.hidden_size + 3 * inter) * dtype.itemsize
    free = int(budget_gb * 2**30) - runtime_bytes - 4 * unit_nbytes - activations
    if s.expert_cache_gb is not None:  # set: the expert cache at most that, as on the head
        free = min(free, max(unit_nbytes, int(s.expert_cache_gb * 2**30)))
    capacity = min(total, free // unit_nbytes)
    if capacity < 1:
        raise ConfigError(f"expert parallelism: memory_gb={budget_gb:g} holds no expert unit ({unit_nbytes / 2**20:.1f}"
                          f" MiB) after the process ({runtime_bytes / 2**20:.0f} MiB), read buffers and activations "
                          f"({activations / 2**20:.0f} MiB): give this worker more memory")
    return int(capacity)
