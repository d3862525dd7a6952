"""The fused decode step on Nemotron-H's blocks (csrc/decode_stack_mamba2.cpp: Mamba-2's decode step and the absent
part of a one-part block; decode_stack_ffn.cpp: relu2 dense MLP and shared expert, the relu2 experts' torch loop):
every step's logits torch.equal to the per-op pass in bf16 with default settings (batch-invariant), tokens and store
traffic equal, resident and offloaded with some experts not cached, at batch 1 and for three sequences of
different lengths side by side."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moeserve.engine.llm import LLM
from tests.fixtures.nemotron_h import TINY_PATTERN, write_nemotron_h
from tests.models.test_decode_stack_kinds import (
    BATCH_1,
    BATCH_3,
    CACHE_GB,
    assert_fused_equals_per_op,
    interleaved_ok,
    tiny_shape,
)

__all__ = ["interleaved_ok"]  # the fixture

# transformers' tiny Nemotron-H with every block kind (Mamba, MoE, attention, dense relu2 MLP; two mixers and two
# FFN blocks in a row), its dense MLP and shared expert at widths the C++ GEMV takes (multiples of 32).
WIDTHS_32 = {"intermediate_size": 64, "moe_shared_expert_intermediate_size": 64}
_FOLDERS: dict[str, Path] = {}


def checkpoint(name: str, tmp_path_factory: pytest.TempPathFactory, **fields: object) -> Path:
    if name.endswith("-tiny"):
        return tiny_shape(name, tmp_path_factory)
    if name not in _FOLDERS:
        _FOLDERS[name] = randomize_biases(write_nemotron_h(tmp_path_factory.mktemp(name), torch.bfloat16, **fields))
    return _FOLDERS[name]


def randomize_biases(folder: Path) -> Path:
    """transformers initialises biases to zero: give every `*.bias` of the checkpoint spread values, so a bias the
    stack dropped is caught."""
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(1)
    for path in folder.glob("*.safetensors"):
        tensors = load_file(path)
        for name, t in tensors.items():
            if name.endswith(".bias"):
                tensors[name] = (0.2 * torch.randn(t.shape, generator=g)).to(t.dtype)
        save_file(tensors, path, metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("name", ["nemotron_h", "mamba-hybrid-tiny"])
@pytest.mark.parametrize("prompts", [BATCH_1, BATCH_3], ids=["batch1", "batch3"])
@pytest.mark.parametrize("offloaded", [False, True], ids=["resident", "offloaded"])
def test_fused_step_gives_the_per_op_logits(interleaved_ok, tmp_path_factory, name, prompts, offloaded):
    settings = {"expert_cache_gb": CACHE_GB} if offloaded else {}
    folder = checkpoint(name, tmp_path_factory, **WIDTHS_32)
    traffic = assert_fused_equals_per_op(folder, prompts, **settings)
    assert sum(m for _, m, _ in traffic.values()) > 0 if offloaded else sum(h for h, _, _ in traffic.values()) > 0


@pytest.mark.parametrize("offloaded", [False, True], ids=["resident", "offloaded"])
def test_projection_biases_and_no_conv_bias(interleaved_ok, tmp_path_factory, offloaded):
    """Mamba-2's in_proj / out_proj with biases (transformers' use_bias; randomized) and its conv without one."""
    folder = checkpoint("nemotron_h-bias", tmp_path_factory, **WIDTHS_32, use_bias=True, use_conv_bias=False)
    assert_fused_equals_per_op(folder, BATCH_3, **({"expert_cache_gb": CACHE_GB} if offloaded else {}))


@pytest.mark.parametrize("name", ["nemotron_h", "mamba-hybrid-tiny"])
def test_auto_chooses_the_fused_step(interleaved_ok, tmp_path_factory, name):
    """decode_step=auto (the default) takes every block: why_not_fused is None and the start-up line says so."""
    from moeserve.models.decode_stack import why_not_fused

    llm = LLM(str(checkpoint(name, tmp_path_factory, **WIDTHS_32)), skip_tokenizer_init=True, dtype="bfloat16")
    try:
        model = llm.engine.model
        assert why_not_fused(model) is None and model.decode_step is not None
        assert f"all {len(model.layers)} layers in one C++ call" in dict(model.choices)["decode step"]
    finally:
        llm.engine.close()


def test_the_pattern_covers_every_block_kind() -> None:
    assert set(TINY_PATTERN) == {"M", "E", "*", "-"}


def test_widths_outside_the_gemv_layouts_are_refused_with_their_reason(interleaved_ok, tmp_path_factory):
    """transformers' tiny widths (a dense MLP of 48, a shared expert of 40): per op, naming the layout."""
    llm = LLM(str(checkpoint("nemotron_h-48", tmp_path_factory)), skip_tokenizer_init=True, dtype="bfloat16")
    try:
        assert llm.engine.model.decode_step is None
        assert "'onednn' layout" in dict(llm.engine.model.choices)["decode step"]
    finally:
        llm.engine.close()


@pytest.mark.parametrize("prompts", [[{"prompt_token_ids": [7]}], [{"prompt_token_ids": [7]}, *BATCH_3]],
                         ids=["alone", "beside-others"])
def test_a_one_token_prompt_runs_its_scan(interleaved_ok, tmp_path_factory, prompts):
    """A 1-token prompt makes a batch of one new token per sequence that holds a prompt token: Mamba2Mixer.stack_takes
    sends it per op (the chunk scan, not the selective-state update the stack runs); every step's logits equal."""
    from tests.models.test_decode_stack_kinds import run

    folder = checkpoint("nemotron_h", tmp_path_factory, **WIDTHS_32)
    chosen, logits, tokens, steps, traffic = run(folder, "fused", prompts)
    _, ref_logits, ref_tokens, _, ref_traffic = run(folder, "per_op", prompts)
    assert chosen and steps > 0
    assert tokens == ref_tokens and traffic == ref_traffic
    assert len(logits) == len(ref_logits) and all(torch.equal(a, b) for a, b in zip(logits, ref_logits))
