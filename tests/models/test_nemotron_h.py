"""Nemotron-H (NemotronHForCausalLM): Mamba-2 / attention / MoE / MLP one-part blocks.

- The spec of the published Nemotron-3-Nano-30B-A3B config.json (pattern, Mamba shapes, relu2 experts, noaux_tc);
  `layers_block_type` read like the pattern; a bad pattern refused in one line.
- Tiny checkpoints transformers writes (pattern ME*-M*EE-M: every block kind, two mixers and two MLP blocks in a
  row; correction biases, norm weights, D, dt_bias and A_log randomized; 2 expert groups, a shared expert), fp32:
  transformers' greedy tokens and log-probabilities within 1e-4, prompts over two chunks of the scan, decoded
  together; the C++ kernels and torch alike.
- bf16, default settings: a prompt prefilled in chunks gives the logits of one pass bit for bit; sequences batched
  and preempted (recomputed) finish with their solo tokens and logprobs; offloaded experts (3 slots) == resident.
- Nemotron-3-Nano's real dimensions (6 layers, MEM*E-): tests/models/test_real_dims_exactness.py.
The comparisons run through the shared driver tests/models/exactness.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moeserve import LLM
from moeserve.errors import CheckpointError
from moeserve.models.registry import get_architecture
from tests.engine.test_parity_transformers import hf_model
from tests.fixtures.nemotron_h import NEMOTRON_3_NANO, write_nemotron_h
from tests.models import exactness as X
from tests.models.exactness import STEPS, assert_matches_transformers
from tests.models.test_qwen3_next import long_prompts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("nemotron_h")
    return {"float32": write_nemotron_h(root / "fp32"), "bfloat16": write_nemotron_h(root / "bf16", torch.bfloat16)}


def test_spec_of_the_published_config() -> None:
    spec = get_architecture(NEMOTRON_3_NANO, "config.json").spec(NEMOTRON_3_NANO, "config.json")
    pattern = NEMOTRON_3_NANO["hybrid_override_pattern"]
    m, moe, a = spec.mamba, spec.moe, spec.attention
    assert m is not None and spec.num_layers == 52
    assert m.layers == tuple(i for i, ch in enumerate(pattern) if ch == "M") and len(m.layers) == 23
    assert spec.moe_layer_ids == [i for i, ch in enumerate(pattern) if ch == "E"]
    assert spec.attention_layers == tuple(ch == "*" for ch in pattern)
    assert spec.mixerless_layers == tuple(i for i, ch in enumerate(pattern) if ch in "E-")
    assert spec.mlpless_layers == tuple(i for i, ch in enumerate(pattern) if ch in "M*")
    assert (m.num_heads, m.head_dim, m.n_groups, m.state_size, m.conv_kernel) == (64, 64, 8, 128, 4)
    assert m.conv_dim == 64 * 64 + 2 * 8 * 128 and m.conv_bias and not m.proj_bias and m.time_step_min == 0.001
    assert (moe.expert_kind, moe.routing, moe.num_experts, moe.top_k, moe.intermediate_size) == (
        "relu2", "sigmoid_groups", 128, 6, 1856)
    assert moe.routed_scaling_factor == 2.5 and moe.correction_bias and moe.shared_intermediate_size == 3712
    assert not moe.shared_gated and spec.mlp_kind == "relu2" and spec.norm_style == "scale_in_fp32"
    assert (a.num_heads, a.num_kv_heads, a.head_dim) == (32, 2, 128) and spec.rope.rope_type == "none"


def test_layers_block_type_and_bad_patterns() -> None:
    kinds = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
    listed = {k: v for k, v in NEMOTRON_3_NANO.items() if k != "hybrid_override_pattern"}
    listed["layers_block_type"] = [kinds[ch] for ch in NEMOTRON_3_NANO["hybrid_override_pattern"]]
    arch = get_architecture(listed, "config.json")
    assert arch.spec(listed, "c") == arch.spec(NEMOTRON_3_NANO, "c")
    with pytest.raises(CheckpointError, match="'hybrid_override_pattern' must be a string of M, \\*, E and -"):
        arch.spec({**NEMOTRON_3_NANO, "hybrid_override_pattern": "MEX"}, "config.json")


@pytest.mark.parametrize("kernels", ["auto", "torch"])
def test_tiny_matches_transformers(tiny: dict[str, Path], kernels: str) -> None:
    folder = tiny["float32"]
    assert_matches_transformers(folder, hf_model(folder, torch.float32), long_prompts(), kernels=kernels)


def test_sequence_memory_of_each_block_kind(tiny: dict[str, Path]) -> None:
    """Mamba layers keep a state slot per sequence, attention layers KV blocks, MoE and MLP blocks nothing."""
    llm = LLM(str(tiny["bfloat16"]), skip_tokenizer_init=True, max_model_len=256)
    e = llm.engine
    assert [(type(g.kind).__name__, g.layers) for g in e.kv_groups] == [("RecurrentState", (0, 4, 9)),
                                                                        ("FullAttention", (2, 5))]
    # the fused step takes Nemotron-H's blocks (tests/models/test_decode_stack_mamba2.py) but not these widths
    assert "'onednn' layout" in e.choices["decode step"]
    assert "relu2 experts" in e.choices["experts"]
    e.close()


def test_chunked_prefill_equals_one_pass_bit_for_bit(tiny: dict[str, Path]) -> None:
    """A 200-token prompt in one step and in chunks (the scheduler cuts on the 64-position grid): the same bits."""
    folder = tiny["bfloat16"]
    prompt = long_prompts(1)[0] + long_prompts(2)[2][:50]
    whole = X.run_together(folder, [prompt])
    chunked = X.assert_chunked_equals_one_pass(folder, prompt, (80,), whole)[80]
    assert (len(whole.logits), len(chunked.logits)) == (STEPS, STEPS + 2)  # 200 tokens: 64 + 64 + 72 (the end)


def test_batched_and_preempted_sequences_keep_their_solo_numbers(tiny: dict[str, Path]) -> None:
    """Four sequences in an attention pool of 12 blocks: preempted and recomputed (output tokens by the
    selective-state update again); each ends with the tokens and logprobs it gets alone (bf16)."""
    prompts = X.random_prompts(7, (40,) * 4)
    X.assert_batched_and_preempted_equal_solo(tiny["bfloat16"], [(0, p) for p in prompts], 12, 30, 128)


def test_offloaded_equals_resident_in_bf16(tiny: dict[str, Path]) -> None:
    """bf16, default settings: 3 expert slots give the resident run's logits and outputs bit for bit."""
    X.assert_offloaded_equals_resident(tiny["bfloat16"], long_prompts(3))


# ------------------------------------------------------------------------------------------- NVFP4 (ModelOpt)
NEMOTRON_MODELOPT = {
    "producer": {"name": "modelopt"},
    "quantization": {"quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
                     "exclude_modules": ["lm_head", "*.mixer.gate"]},
}  # fmt: skip


def modelopt_float32(prefix: str, stored: dict[str, torch.Tensor]) -> torch.Tensor:
    """The stored NVFP4 bytes dequantized in float32 (formats/nvfp4.py, checked against torchao in
    tests/models/test_quantized.py)."""
    from moeserve.formats.nvfp4 import dequantize_nvfp4_modelopt, nvfp4_output_shape

    codes, scales = stored[f"{prefix}.weight"], stored[f"{prefix}.weight_scale"]
    out = torch.empty(nvfp4_output_shape(codes, scales), dtype=torch.float32)
    dequantize_nvfp4_modelopt(codes, scales, stored[f"{prefix}.weight_scale_2"], out)
    return out


def test_nvfp4_modelopt_experts_quantized_in_every_tier(tmp_path: Path) -> None:
    """Every *_proj Linear as ModelOpt NVFP4 (weight, weight_scale, weight_scale_2; the bytes of compressed-tensors'
    own compressor): the relu2 experts stay NVFP4 in the store (a miss reads exactly one expert's stored bytes,
    under 0.35x its bf16 size) and one expert slot gives the resident run's tokens and logprobs bit for bit (bf16);
    in fp32, transformers' greedy tokens and logprobs within 1e-4 on the same bytes dequantized."""
    from tests.fixtures import checkpoints as C
    from tests.models.test_quantized import greedy

    src = write_nemotron_h(tmp_path / "bf16", torch.bfloat16, moe_shared_expert_intermediate_size=48)
    folder = C.quantize_checkpoint(src, tmp_path / "nvfp4", C.nvfp4_modelopt_quantize, None,
                                   {"hf_quant_config.json": NEMOTRON_MODELOPT})
    reference = C.dequantized_reference(src, folder, tmp_path / "ref", modelopt_float32, torch.float32)
    resident = LLM(str(folder), skip_tokenizer_init=True, dtype="bfloat16")
    assert "relu2 experts stored as nvfp4-modelopt in every tier" in resident.engine.choices["experts"]
    ours = greedy(resident)
    resident.engine.close()
    offloaded = LLM(str(folder), skip_tokenizer_init=True, dtype="bfloat16", expert_cache_gb=1e-9)
    store = offloaded.engine.model.store
    before = offloaded.engine.checkpoint.reader.bytes_read
    assert greedy(offloaded) == ours and not store.resident and store.capacity == 1
    stored = sum(r.nbytes for n, r in offloaded.engine.checkpoint.tensors.items()
                 if n.startswith("backbone.layers.1.mixer.experts.0."))
    read = offloaded.engine.checkpoint.reader.bytes_read - before
    assert store.stats.misses > 0 and read == store.stats.misses * stored
    assert stored < 0.35 * 2 * 64 * 32 * 2  # up [32, 64] + down [64, 32] in bf16
    offloaded.engine.close()
    assert_matches_transformers(folder, hf_model(reference, torch.float32), long_prompts(5)[1:])
