"""The two test tiers, and the rule that sorts a test into one of them.

- `make test` runs every test (what CI runs: .ci/run).
- `make test-fast` runs the tests not marked `slow` (`pytest -m "not slow"`): the unit and contract tests, a few
  minutes on 2 cores.

A test is `slow` when it is marked so where it is written (`@pytest.mark.slow`, a module's `pytestmark`, a slow
`pytest.param`), or when it is listed in `SLOW` below: a folder, a module, or one test of a module (`module::name`,
every parametrization of it). What goes there: a whole model against transformers' decode, the same sequences
solo and batched with preemption, whole-trace simulations, benchmark runs and fuzzing at size: seconds to a
minute each, where a unit or contract test takes well under one. List the module when most of its time is such
tests, the test otherwise. Per-test durations of the whole suite (`--junitxml`, `--durations=0`) decide which.

So that a new slow test does not quietly make the fast tier slow, every run ends with the tests outside the slow
tier that took longer than `FAST_TEST_LIMIT_S` (setup, call and teardown together: a session fixture's first build
counts in its first user). Mark such a test `slow`, list it below, or make it quicker.
"""
from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

# Under tests/: a folder, a module, or `module::test`, and why it is slow. Seconds: all its tests, from one run on 2
# cores shared at a load of 5-8, where the tests left in the fast tier took 471 s (215 s on the same cores quiet).
SLOW: dict[str, str] = {
    "engine/test_parity_transformers.py": "every architecture's batched greedy decode against transformers (470 s)",
    "models/test_deepseek_v4_serving.py": "DeepSeek-V4 against transformers and through the exactness driver (55 s "
        "at a load of 5)",
    "models/test_qwen4_exp.py": "Qwen3.8-Flash-Next against transformers and through the exactness driver (120 s at "
        "a load of 12)",
    "bench/test_simulate_oracle.py": "oracle prefetch simulated over the flame trace at every capacity (83 s)",
    "bench/test_trace_convert.py": "a slice of the FLAME trace converted and simulated (32 s)",
    "bench/test_arch_shapes.py": "the hybrid, MLA and Mamba-2 shapes written, loaded and benchmarked (20 s)",
    "bench/test_cli_simulate.py": "`moeserve simulate` end to end (13 s)",
    "bench/test_memlimit.py": "a worker held to a real cgroup memory limit (11 s)",
    "bench/test_simulate_flame.py": "the FLAME traces simulated against their published figures (10 s)",
    "bench/test_trace_shuffle.py": "the permutation test on the FLAME trace (7 s)",
    "checkpoint/test_fuzz_checkpoints.py::test_size_bombs_end_in_one_line_with_bounded_memory":
        "each size bomb run through a command under a memory bound (59 s)",
    "checkpoint/test_gguf_models.py": "tiny GGUFs of four architectures against their dequantized checkpoints, "
        "transformers, and offloaded (50 s)",
    "checkpoint/test_gguf_archs.py": "tiny GLM-4.5 and DeepSeek-V3 GGUFs against their dequantized checkpoints, "
        "transformers, and offloaded (12 s)",
    "checkpoint/test_gguf_gpt_oss.py": "a tiny gpt-oss GGUF against its HF MXFP4 folder, transformers, and offloaded "
        "(18 s at a load of 9)",
    "checkpoint/test_gguf_qwen3next.py": "a tiny Qwen3-Next GGUF against its dequantized weights, transformers, and "
        "offloaded (11 s)",
    "models/test_quantized.py::test_offloaded_equals_resident_and_a_miss_reads_the_stored_bytes":
        "each quantized format's engine, resident and offloaded with a one-expert cache (35 s)",
    "models/test_quantized_int8.py::test_int8_experts_offloaded_equal_resident_and_cost_little_accuracy":
        "int8 experts offloaded and resident, and against bf16 (11 s)",
    "models/test_deepseek_v32.py": "DeepSeek-V3.2 and GLM-5 (DeepSeek Sparse Attention) against transformers, "
        "chunked, prefix-cached, batched and preempted, offloaded, FP8, NVFP4, real dimensions (91 s of CPU before "
        "NVFP4 and shared layers were added, 40 of them the real dimensions)",
    "cli/test_config_only.py::test_sparse_attention_models_plan_for_24_and_64_gb":
        "GLM-5 and DeepSeek-V3.2 planned from their configs at two budgets (12 s at a load of 15)",
    "models/test_gemma4.py::test_fp32_matches_transformers": "Gemma-4 against transformers' decode, C++ kernels and "
        "torch (10 s and 7 s at a load of 8, the first writing the module's checkpoint)",
    "models/test_gemma4.py::test_multimodal_wrapper_serves_its_language_model":
        "Gemma-4's multimodal checkpoint written and against transformers' decode (8 s at a load of 8)",
    "models/test_gemma4.py::test_bf16_offloaded_chunked_and_batched_are_exact":
        "Gemma-4 offloaded, chunked, batched and preempted against its resident, one-pass, solo runs (10 s at a load "
        "of 8)",
    "models/test_glm4_moe.py::test_variants_match_transformers": "GLM-4 MoE variants against transformers (31 s)",
    "models/test_qwen3_next.py::test_tiny_qwen3_next_matches_transformers": "Qwen3-Next against transformers (17 s)",
    "models/test_qwen3_next.py::test_batched_and_preempted_sequences_keep_their_solo_numbers":
        "Qwen3-Next solo, batched and preempted (11 s)",
    "models/test_nemotron_h.py::test_tiny_matches_transformers": "Nemotron-H against transformers (17 s)",
    "models/test_int4_pack_quantized.py::test_matches_transformers_on_the_decompressed_weights":
        "DeepSeek-V3, Kimi-K2.5 and Qwen3-MoE INT4 against transformers (4 to 22 s each at load 10)",
    "models/test_minimax_m2.py::test_fp8_checkpoint_matches_transformers_on_its_dequantization":
        "MiniMax-M2 FP8 written, dequantized and against transformers (12 s)",
    "models/test_deepseek_v3.py::test_kimi_k25_serves_the_language_model_only":
        "Kimi-K2.5 against transformers' multimodal class (6 s)",
    "models/test_deepseek_v3.py::test_kimi_k25_bf16_offloaded_and_batched_equal_resident_alone":
        "Kimi-K2.5 resident, offloaded, alone, batched and preempted (15 s at load 10)",
    "models/test_minimax_m2.py::test_fp8_bf16_offloaded_equals_resident_and_batched_equals_alone":
        "MiniMax-M2 FP8 resident, offloaded, alone, batched and preempted (11 s at load 10)",
    "models/test_qwen3_next.py::test_qwen35_text_only_class_matches_transformers":
        "Qwen3.5 text-only class against transformers (5 s)",
    "models/test_nemotron_h.py::test_batched_and_preempted_sequences_keep_their_solo_numbers":
        "Nemotron-H solo, batched and preempted (14 s)",
    "models/test_qwen3_5_nvfp4.py::test_matches_transformers_on_the_dequantized_bytes":
        "Qwen3.5 NVFP4 against transformers (13 s)",
    "models/test_qwen3_5_nvfp4.py::test_qwen3_next_nvfp4_matches_transformers":
        "Qwen3-Next NVFP4 against transformers (10 s)",
    "models/test_prefix_cache_recurrent.py::test_nemotron_h_evicted_snapshots_fall_back_to_recompute":
        "Nemotron-H prefix snapshots evicted and recomputed (11 s)",
    "experts/test_admission_victim.py::test_admitted_misses_choose_their_victim_once_and_cache_the_same":
        "a trace replayed with every policy, capacity and admission mode (15 s)",
}

FAST_TEST_LIMIT_S = 10.0  # a test outside the slow tier taking longer is listed at the end of the run


def listed(item: pytest.Item) -> bool:
    """`item` lies in a folder or module listed in SLOW, or is (a parametrization of) a test listed there."""
    try:
        module = Path(item.path).resolve().relative_to(TESTS).as_posix()
    except ValueError:  # a test outside tests/
        return False
    test = item.nodeid.split("::", 1)[1].split("[")[0] if "::" in item.nodeid else ""
    names = (module, f"{module}::{test}")
    return any(name == entry or name.startswith((entry + "/", entry + "::")) for entry in SLOW for name in names)


def mark_slow(items: list[pytest.Item]) -> None:
    """Add the `slow` marker to every item listed in SLOW."""
    for item in items:
        if listed(item):
            item.add_marker(pytest.mark.slow)


class SlowFastTests:
    """Sums each test's phases and lists, at the end of the run, those outside the slow tier over the limit."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.slow: set[str] = set()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration
        if "slow" in report.keywords:
            self.slow.add(report.nodeid)

    def pytest_terminal_summary(self, terminalreporter) -> None:  # noqa: ANN001 - pytest's TerminalReporter
        over = sorted(((s, n) for n, s in self.seconds.items() if n not in self.slow and s > FAST_TEST_LIMIT_S),
                      reverse=True)
        if not over:
            return
        terminalreporter.section(f"tests outside the slow tier over {FAST_TEST_LIMIT_S:.0f} s (tests/tiers.py)")
        for seconds, nodeid in over:
            terminalreporter.write_line(f"{seconds:7.1f} s  {nodeid}")
        terminalreporter.write_line("mark each slow, list its module in tests/tiers.py SLOW, or make it quicker")
