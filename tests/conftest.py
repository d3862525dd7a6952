"""Shared fixtures: tiny checkpoints written by transformers' own save_pretrained (the independent reference).

`tiny_checkpoint(arch, dtype="float32", **config_overrides)` returns the folder of a random-init model of that
architecture, built once per test session per argument set. `tiny_text_model` adds a byte-level BPE tokenizer
(trained with the `tokenizers` library) with a ChatML chat template, for tests that need text. The writers live in
moeserve/bench/checkpoints.py and real_dims.py (the benchmarks use them too) and tests/fixtures/.

`TESTS_EMULATE_CPU=avx2` (with `ATEN_CPU_CAPABILITY=avx2`; `make test-as-avx2` sets both) runs the suite as on an
AVX2-only CPU on a wider one (tests/cpu_emulation says what changes and what cannot): one of CI's machines is an
AVX2-only AMD EPYC. Not a MOESERVE_* name: moeserve refuses unknown MOESERVE_* variables.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from moeserve.bench.checkpoints import (
    write_synthetic_checkpoint,
    write_tiny_checkpoint,
    write_tiny_text_model,
)
from tests import cpu_emulation, tiers, watch

# TESTS_EMULATE_CPU=avx2 (`make test-as-avx2`): the run as on an AVX2-only CPU, on a wider one: our kernels built for
# avx2 (MOESERVE_CPU_ISA), ATen's avx2 kernels, oneDNN off, here and in subprocesses (tests/cpu_emulation). Applied
# at import, before any torch op: ATen picks its CPU kernels at the first one.
EMULATION = cpu_emulation.apply()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    cache: dict[str, Path] = {}

    def make(arch: str, dtype: str = "float32", seed: int = 0, **overrides: Any) -> Path:
        key = json.dumps([arch, dtype, seed, overrides], sort_keys=True)
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"tiny_{arch}_{dtype}")
            cache[key] = write_tiny_checkpoint(folder, arch, dtype, seed, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def checkpoint_once(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, Callable[[Path], Path]], Path]:
    """`get(key, build)`: the folder `build(empty_folder)` returned the first time `key` was asked for in this
    session; later calls (from any module) get the same folder. Tests must not write into it (copy_checkpoint)."""
    cache: dict[str, Path] = {}

    def get(key: str, build: Callable[[Path], Path]) -> Path:
        if key not in cache:
            cache[key] = build(tmp_path_factory.mktemp(key.replace(".", "_").replace("/", "_")))
        return cache[key]

    return get


@pytest.fixture(scope="session")
def synthetic_checkpoint(checkpoint_once: Callable[[str, Callable[[Path], Path]], Path]) -> Path:
    """The synthetic Qwen3-MoE checkpoint (moeserve/bench/checkpoints.py SYNTH_CONFIG, 2.3 GB streamed to disk) the
    memory-bound tests serve offloaded: written once per session (tests/test_offload_rss.py,
    tests/test_memory_budget_rss.py)."""
    return checkpoint_once("synthetic-qwen3_moe", write_synthetic_checkpoint)


@pytest.fixture(scope="session")
def real_dims_checkpoint(checkpoint_once: Callable[[str, Callable[[Path], Path]], Path]) -> Callable[[str], Path]:
    """`name`'s checkpoint at real dimensions (moeserve/bench/real_dims.py, seed 0, 2 layers), written once per
    session: the engine, batch-invariance and offload suites read the same folders. `NAME-mxfp4` is NAME's checkpoint
    with its experts in MXFP4 (gpt-oss's published layout, moeserve/bench/real_dims.py)."""
    from moeserve.bench.real_dims import write_gpt_oss_mxfp4, write_real_dims

    def get(name: str) -> Path:
        if name.endswith("-mxfp4"):
            bf16 = get(name.removesuffix("-mxfp4"))
            return checkpoint_once(f"real_dims-{name}", lambda folder: write_gpt_oss_mxfp4(bf16, folder))
        return checkpoint_once(f"real_dims-{name}", lambda folder: write_real_dims(folder, name))

    return get


@pytest.fixture
def copy_checkpoint(tmp_path: Path) -> Callable[[Path], Path]:
    """A private copy of a checkpoint folder that a test may corrupt."""

    def copy(src: Path) -> Path:
        dst = tmp_path / "model"
        shutil.copytree(src, dst)
        return dst

    return copy


@pytest.fixture(scope="session")
def tiny_text_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE checkpoint with a tokenizer and chat template (random weights)."""
    return write_tiny_text_model(tmp_path_factory.mktemp("tiny_text_model"))


def has_cuda() -> bool:
    return torch.cuda.is_available()


def pytest_report_header(config: pytest.Config) -> str | None:
    return EMULATION


def pytest_terminal_summary(terminalreporter: Any) -> None:  # -q hides the header: say it at the end too
    if EMULATION:
        terminalreporter.write_line(EMULATION)


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(tiers.SlowFastTests(), "moeserve-slow-fast-tests")
    config.pluginmanager.register(watch.RunWatch(config), "moeserve-run-watch")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker: the tier markers must be on by then
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tiers.mark_slow(items)  # the test tiers (make test, make test-fast): tests/tiers.py
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not has_cuda():
            item.add_marker(skip_gpu)


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the last case of a test function, the transformers model its cases kept for their reference runs goes
    (tests/engine/test_parity_transformers.py hf_model: kept across the kernels=auto and =torch cases of a test), so
    that a real-dims model is not held through the tests after it."""
    parity = sys.modules.get("tests.engine.test_parity_transformers")
    if parity is not None and (nextitem is None or _function_of(nextitem) != _function_of(item)):
        parity.forget_transformers_models()


def _function_of(item: pytest.Item) -> tuple[Path, str]:
    return item.path, getattr(item, "originalname", item.name)


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True, scope="session")
def _int8_spill_files_in_a_temporary_folder(tmp_path_factory: pytest.TempPathFactory):
    """quantization=int8 offloaded writes its spill file under ~/.cache by default: tests keep theirs in a
    temporary folder (an explicit int8_cache_dir still wins)."""
    old = os.environ.get("MOESERVE_INT8_CACHE_DIR")
    os.environ["MOESERVE_INT8_CACHE_DIR"] = str(tmp_path_factory.mktemp("int8-spill"))
    yield
    if old is None:
        os.environ.pop("MOESERVE_INT8_CACHE_DIR", None)
    else:
        os.environ["MOESERVE_INT8_CACHE_DIR"] = old
