"""Ceiling arithmetic against answers computed by hand."""

from __future__ import annotations

import pytest

from moeserve.bench import ceilings
from moeserve.bench.report import BYTES_PER_PARAM, dense_bytes, step_bytes_from_store
from moeserve.bench.runner import BenchConfig, CaseResult, paired_ratio
from moeserve.bench.shapes import SHAPES


def test_shape_parameter_counts_by_hand():
    tiny = SHAPES["tiny"]  # H=64, d=16, 4 heads, 2 kv heads, 8 experts of 32, 2 layers, vocab 256
    assert tiny.attention_params == 64 * 64 + 32 * 64 + 32 * 64 + 64 * 64  # q, k, v, o = 12288
    assert tiny.expert_params == 3 * 64 * 32  # 6144
    assert tiny.layer_dense_params == 12288 + 8 * 64 + 2 * 64 + 2 * 16  # + router + 2 norms + q/k norm = 12960
    # embed + lm_head + final norm + 2 layers x (dense + 8 experts)
    assert tiny.total_params == 2 * 256 * 64 + 64 + 2 * (12960 + 8 * 6144)


def test_small_shape_is_the_issue_reference_model():
    small = SHAPES["small"]
    assert (small.hidden_size, small.num_layers, small.num_experts, small.moe_intermediate_size,
            small.top_k, small.vocab_size) == (1024, 16, 32, 512, 4, 32000)
    assert 1.7e9 < small.total_params * 2 < 1.9e9  # ~1.8 GB in bf16


def test_dense_bytes_per_step_by_hand():
    # 2 layers x 12960 + lm_head 256x64 + final norm 64 + one embedding row 64 = 42432 params, x2 bytes
    assert ceilings.dense_bytes_per_step(SHAPES["tiny"], 2) == 84864
    # a batch of 3 reads 3 embedding rows
    assert ceilings.dense_bytes_per_step(SHAPES["tiny"], 2, batch=3) == 84864 + 2 * 64 * 2


def test_dense_bytes_per_step_int8_by_hand():
    # per layer: attention 12288 int8 codes + (128 q/k/v + 64 o) rows x 4-byte scales = 13056; router 512 and
    # norms 160 params in bf16 = 1344. Head 256x64 codes + 256 scales x 4 = 17408; final norm and one embedding
    # row in bf16 = 256. 2 x 14400 + 17408 + 256 = 46464
    assert ceilings.dense_bytes_per_step_int8(SHAPES["tiny"]) == 46464
    assert ceilings.dense_bytes_per_step_int8(SHAPES["tiny"], batch=3) == 46464 + 2 * 64 * 2


def test_expected_unique_experts_by_hand():
    assert ceilings.expected_unique_experts(4, 2, 1) == pytest.approx(2.0)  # one token: exactly top_k
    assert ceilings.expected_unique_experts(4, 2, 2) == pytest.approx(3.0)  # 4 * (1 - (1/2)^2)
    assert ceilings.expected_unique_experts(8, 8, 5) == pytest.approx(8.0)  # every expert, every time


def test_resident_step_bytes_small_batch1():
    step = ceilings.resident_step_bytes(SHAPES["small"], 2, batch=1)
    assert step.expert_bytes_fast == pytest.approx(16 * 4 * 3 * 1024 * 512 * 2)  # 201,326,592
    assert step.expert_bytes_disk == 0


def test_ceiling_memory_only_and_with_disk():
    # 1 GB from memory at 10 GB/s: 0.1 s per token -> 10 tokens/s
    assert ceilings.tokens_per_second_ceiling(ceilings.StepBytes(10**9, 0, 0), 10e9) == pytest.approx(10.0)
    # 2 GB from memory (0.2 s) + 0.5 GB from disk at 1 GB/s (0.5 s) = 0.7 s per step of 7 tokens -> 10 tokens/s
    step = ceilings.StepBytes(10**9, 10**9, 5 * 10**8)
    assert ceilings.tokens_per_second_ceiling(step, 10e9, 1e9, tokens_per_step=7) == pytest.approx(10.0)
    with pytest.raises(ValueError):
        ceilings.tokens_per_second_ceiling(step, 10e9, None)
    assert ceilings.fraction_of_ceiling(8.5, 10.0) == pytest.approx(0.85)


def test_step_bytes_from_store_counters_by_hand():
    cfg = BenchConfig(SHAPES["tiny"], checkpoint=None)  # type: ignore[arg-type]
    # 2 steps, 6 hits + 2 misses: 4 distinct experts per step, a quarter of them from disk.
    step = step_bytes_from_store(cfg, (2.0, 2.0), 1, {"hits": 6, "misses": 2}, steps=2)
    expert_bytes = 4 * 6144 * 2  # 49152 per step
    assert step.expert_bytes_fast == pytest.approx(expert_bytes * 0.75)
    assert step.expert_bytes_disk == pytest.approx(expert_bytes * 0.25)
    assert step.dense_bytes == 84864
    # int8 experts: half the expert bytes, dense weights unchanged
    int8 = step_bytes_from_store(cfg, (2.0, 1.0), 1, {"hits": 6, "misses": 2}, steps=2)
    assert int8.expert_bytes_fast == pytest.approx(expert_bytes * 0.75 / 2) and int8.dense_bytes == 84864
    # moeserve with quantization=int8 reads its dense Linears as int8 too, except with the torch kernels
    bpp = BYTES_PER_PARAM["moeserve-int8"]
    assert dense_bytes(cfg, "moeserve", "moeserve-int8", bpp, 1) == 46464
    assert dense_bytes(cfg, "moeserve-torch-kernels", "moeserve-int8", bpp, 1) == 84864
    assert dense_bytes(cfg, "llama.cpp", "llama.cpp", BYTES_PER_PARAM["llama.cpp"], 1) == 84864


def test_paired_ratio_is_median_of_adjacent_pairs():
    def result(tps: list[float]) -> CaseResult:
        return CaseResult("x", "decode-b1", [{"tokens": t, "seconds": 1.0} for t in tps])

    # pairs: 10/5=2, 20/5=4, 30/10=3 -> median 3 (the ratio of medians would be 20/5 = 4)
    assert paired_ratio(result([10, 20, 30]), result([5, 5, 10])) == pytest.approx(3.0)
    assert paired_ratio(result([]), result([1])) is None


def test_each_run_is_set_against_the_bandwidth_probed_beside_it():
    from moeserve.bench.report import summarize

    cfg = BenchConfig(SHAPES["tiny"], checkpoint=None, cases=("decode-b1",), peers=())  # type: ignore[arg-type]
    # 2 steps of 1 token, every access a hit: 8 hits over 2 steps = 4 distinct experts read per step
    store = {"hits": 8, "misses": 0, "bytes_read": 0}
    runs = [{"tokens": 10, "seconds": 1.0, "steps": 2, "store": store, "peak_rss_bytes": 1,
             "memory_bytes_per_s": 1e9},   # 10 tok/s while the machine gave 1 GB/s
            {"tokens": 10, "seconds": 0.5, "steps": 2, "store": store, "peak_rss_bytes": 1,
             "memory_bytes_per_s": 4e9}]   # 20 tok/s while it gave 4 GB/s
    summary = summarize(cfg, [CaseResult("moeserve", "decode-b1", runs)], [],
                        {"memory_bytes_per_s": 4e9, "disk_bytes_per_s": 1e9}, {}, {})
    (row,) = summary["rows"]
    # dense (see above) + 4 bf16 experts = 134016, + the KV the step reads and writes: the prompt (32), its first
    # token and half the 32 timed steps = 49 tokens before the middle step, 50 rows read, 1 written, in 2 layers
    # of 2 kv heads x 16 dims, K and V in bf16: 2 x 51 x 128 = 13056
    step_bytes = 84864 + 4 * 6144 * 2 + 2 * 51 * 2 * 2 * 16 * 2
    c1, c4 = 1e9 / step_bytes, 4e9 / step_bytes  # ceilings at 1 and 4 GB/s
    assert row["ceiling_tokens_per_s"] == pytest.approx((c1 + c4) / 2)  # median of two = their mean
    assert row["fraction_of_ceiling"] == pytest.approx((10 / c1 + 20 / c4) / 2)
    assert row["best_probe_ceiling_tokens_per_s"] == pytest.approx(c4)
    assert row["fraction_of_best_probe_ceiling"] == pytest.approx(15 / c4)  # median tok/s 15 against the best probe


def test_quantized_engines_read_their_own_bytes_per_parameter():
    """moeserve with quantization=int4 counts its experts at a nibble + a bf16 scale per 32 weights and its dense
    Linears as int8 counts them (Shape.dense_bytes_int8); an engine whose weight file states its bytes (a quantized GGUF) is counted by those, over
    BYTES_PER_PARAM. By hand on the tiny shape: 4 experts of 6144 weights per step, all hits."""
    from moeserve.bench.report import summarize

    store = {"hits": 8, "misses": 0, "bytes_read": 0}
    run = {"tokens": 10, "seconds": 1.0, "steps": 2, "store": store, "peak_rss_bytes": 1}

    def row_bytes(quantization: str, engine: str, file_bytes: dict | None = None) -> float:
        cfg = BenchConfig(SHAPES["tiny"], checkpoint=None, cases=("prefill",), peers=(),  # type: ignore[arg-type]
                          prefill_len=1, quantization=quantization)
        results = [CaseResult("moeserve", "prefill", [run])]
        if engine != "moeserve":
            results.append(CaseResult(engine, "prefill", [{**run, "store": None}]))
        summary = summarize(cfg, results, [], {"memory_bytes_per_s": 1e9, "disk_bytes_per_s": 1e9}, {}, {},
                            file_bytes)
        return next(r for r in summary["rows"] if r["engine"] == engine)["bytes_per_token_memory"]

    assert row_bytes("none", "moeserve") == pytest.approx(84864 + 4 * 6144 * 2)
    assert row_bytes("int4", "moeserve") == pytest.approx(
        SHAPES["tiny"].dense_bytes_int8(1) + 4 * 6144 * (0.5 + 2 / 32))
    assert SHAPES["tiny"].dense_bytes_int8(1) < 0.75 * 84864
    # a GGUF of 1.25 bytes per dense parameter (84864 bytes are 42432 bf16 parameters) and 0.5 per expert one
    assert row_bytes("none", "llama.cpp-q4_0", {"llama.cpp-q4_0": (1.25, 0.5)}) == pytest.approx(
        42432 * 1.25 + 4 * 6144 * 0.5)
