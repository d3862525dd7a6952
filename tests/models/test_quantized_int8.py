"""quantization="int8": experts of a 16-bit checkpoint quantized on load (per-row scales), int8 in every cache
tier, dequantized at use. Offloading must stay bit-exact; the accuracy cost is measured against the unquantized
model (first-step logprobs, same context)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.bench.checkpoints import write_tiny_checkpoint
from moeserve.errors import ConfigError
from tests.fixtures import checkpoints as C
from tests.kernels.ops import suite_isa

PROMPTS = [[5, 9], [17, 250, 33, 4, 8, 120, 64, 2, 77, 45, 13, 200]]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def bf16_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("int8")
    return {
        "qwen3_moe": write_tiny_checkpoint(root / "qwen3", "qwen3_moe", "bfloat16"),
        "gpt_oss": C.write_gpt_oss(root / "gpt_oss"),
    }


def run(folder: Path, **settings):
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", **settings)
    outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)]
    return llm, outs


def logprob_table(out) -> list[dict[int, float]]:
    return [{t: e.logprob for t, e in lp.items()} for lp in out.logprobs]


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_int8_experts_offloaded_equal_resident_and_cost_little_accuracy(bf16_folders, arch: str) -> None:
    folder = bf16_folders[arch]
    dense_llm, dense = run(folder)
    int8_llm, resident = run(folder, quantization="int8")
    offloaded_llm, offloaded = run(folder, quantization="int8", expert_cache_gb=1e-9)
    assert offloaded_llm.engine.model.store.stats.misses > 0
    for a, b in zip(offloaded, resident):
        assert a.token_ids == b.token_ids and logprob_table(a) == logprob_table(b)
    layout = int8_llm.engine.model.store.layout
    matrices = [f for f in layout.fields if len(f.shape) == 2]
    assert matrices and all(f.dtype == torch.int8 for f in matrices)
    assert layout.nbytes < dense_llm.engine.model.store.layout.nbytes / 3  # int8 + scales vs float32 units
    # Accuracy cost on the first step (same context for both): measured ~0.01 nats on these tiny models.
    deviations = [
        abs(q[0][t] - d[0][t])
        for qo, do in zip(resident, dense)
        for q, d in [(logprob_table(qo), logprob_table(do))]
        for t in set(q[0]) & set(d[0])
    ]
    assert 0 < max(deviations) < 0.05


def test_int8_refuses_an_already_quantized_checkpoint(bf16_folders, tmp_path: Path) -> None:
    quantized = C.write_gpt_oss_mxfp4(bf16_folders["gpt_oss"], tmp_path / "mxfp4")
    with pytest.raises(ConfigError, match="already quantized"):
        LLM(str(quantized), skip_tokenizer_init=True, quantization="int8")


# ------------------------------------------------------------------------------------------ dense Linears in int8
SEQ = [5, 9, 17, 250, 33, 4, 8, 120, 64, 2, 77, 45, 13, 200, 299, 1, 150, 88, 31, 260, 7, 99, 180, 42]


def teacher_forced(folder: Path, **settings):  # noqa: ANN201
    """The engine and the first-step top-5 logprobs after every prefix of SEQ (the next-token distribution with
    the same context for every engine)."""
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="bfloat16", max_num_seqs=8, **settings)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": SEQ[:i]} for i in range(1, len(SEQ) + 1)], params)
    return llm, [logprob_table(o.outputs[0])[0] for o in outs]


def test_int8_dense_linears_offloaded_equal_resident_and_close_to_bf16(bf16_folders, tmp_path: Path) -> None:
    """quantization="int8" with the C++ kernels: q/k/v, o_proj, the dense MLP and the LM head become int8 codes
    (routers and the embedding stay bf16). Offloading stays bit-exact. Against the bf16 engine on 24
    teacher-forced positions of this tiny random Qwen3-MoE (bf16 logprobs, so steps of 2^-7 and more), measured:
    top-1 agreement 22/24, both flips near-ties in bf16 (top-2 gaps 0.008 and 0.0 nats); max |logprob
    difference| over shared top-5 tokens 0.135 nats (int8 experts alone, kernels=torch: 23/24 and 0.152)."""
    from moeserve import kernels
    from moeserve.models.experts.moe import MoEBlock

    if not kernels.load(suite_isa()).available:
        pytest.skip("moeserve C++ kernels not available")
    folder = bf16_folders["qwen3_moe"]
    _, dense = teacher_forced(folder, kernels="cpp")
    int8_llm, resident = teacher_forced(folder, kernels="cpp", quantization="int8", int8_cache_dir="off")
    offloaded_llm, offloaded = teacher_forced(folder, kernels="cpp", quantization="int8", int8_cache_dir="off",
                                              expert_cache_gb=1e-9)
    assert offloaded_llm.engine.model.store.stats.misses > 0
    assert offloaded == resident  # bit-identical logprobs

    model = int8_llm.engine.model
    attn, dense_mlp, moe = model.layers[0].attn, model.layers[1].mlp, model.layers[0].mlp
    assert isinstance(moe, MoEBlock)
    assert [lin.layout for lin in (attn.qkv, attn.o, dense_mlp.gate, dense_mlp.up, dense_mlp.down, model._head)] \
        == ["int8"] * 6
    assert moe.router.layout != "int8" and model.embed.dtype == torch.bfloat16
    assert "routers" in dict(model.choices)["dense layers"]
    bf16_model = teacher_forced(folder, kernels="cpp")[0].engine.model
    assert model.resident_bytes < 0.75 * bf16_model.resident_bytes  # int8 codes counted at their size

    flips = [(q, d) for q, d in zip(resident, dense) if max(q, key=q.get) != max(d, key=d.get)]
    assert len(flips) <= 3
    for q, d in flips:  # a flip only where bf16 itself nearly ties the two tokens
        ours, theirs = max(q, key=q.get), max(d, key=d.get)
        assert d[theirs] - d.get(ours, -math.inf) <= 0.05
    deviations = [abs(q[t] - d[t]) for q, d in zip(resident, dense) for t in set(q) & set(d)]
    assert 0 < max(deviations) < 0.25


def test_int8_with_torch_kernels_keeps_dense_linears(bf16_folders) -> None:
    llm, _ = teacher_forced(bf16_folders["qwen3_moe"], kernels="torch", quantization="int8", int8_cache_dir="off")
    model = llm.engine.model
    assert model.layers[0].attn.qkv.layout != "int8" and "C++ kernels" in dict(model.choices)["dense layers"]


def test_int8_tied_head_is_a_quantized_copy(tmp_path: Path) -> None:
    from moeserve import kernels

    if not kernels.load(suite_isa()).available:
        pytest.skip("moeserve C++ kernels not available")
    folder = write_tiny_checkpoint(tmp_path / "tied", "qwen3_moe", "bfloat16", tie_word_embeddings=True)
    llm, tables = teacher_forced(folder, kernels="cpp", quantization="int8", int8_cache_dir="off")
    model = llm.engine.model
    assert model._head is not None and model._head.layout == "int8" and model.embed.dtype == torch.bfloat16
    _, dense = teacher_forced(folder, kernels="cpp")
    assert sum(max(q, key=q.get) == max(d, key=d.get) for q, d in zip(tables, dense)) >= len(SEQ) - 3
