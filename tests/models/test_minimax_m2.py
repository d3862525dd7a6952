"""MiniMax-M2 (MiniMaxM2ForCausalLM): full q/k norm, partial rotary, sigmoid routing with a correction bias.

- The spec of transformers' MiniMaxM2Config defaults (the published MiniMax-M2 sizes; no published config.json was
  found offline) with the published config's own spellings (rotary_dim, scoring_func, use_qk_norm, num_mtp_modules).
- Tiny checkpoints transformers writes: tests/engine/test_parity_transformers.py (fp32 tokens and logprobs, bf16,
  C++ and torch), tests/test_offload.py and tests/experts/ (offloaded == resident) through TINY_CONFIGS.
- As it ships: every attention and expert Linear FP8 with block scales (router, correction bias and lm_head not),
  against transformers on an independent dequantization of the same bytes (fp32, within 1e-4), and offloaded FP8
  experts equal resident ones bit for bit in bf16; sequences batched and preempted keep their solo numbers.
- MTP layers past num_hidden_layers (num_mtp_modules) are skipped at load.
- Real dimensions (hidden 3072, 48 heads, 1536-wide experts) truncated: tests/models/test_real_dims_exactness.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from moeserve import LLM
from moeserve.models.registry import get_architecture
from tests.engine.test_parity_transformers import hf_model
from tests.models import exactness as X

# transformers 5.24's MiniMaxM2Config defaults (its docstring: the MiniMaxAI/MiniMax-M2 checkpoint) with the fields the
# published config.json spells its own way: rotary_dim 64 of head_dim 128, 3 MTP modules
PUBLISHED = dict(
    architectures=["MiniMaxM2ForCausalLM"], model_type="minimax_m2", vocab_size=200064, hidden_size=3072,
    intermediate_size=1536, num_hidden_layers=62, num_attention_heads=48, num_key_value_heads=8, head_dim=128,
    rotary_dim=64, rope_theta=5000000, max_position_embeddings=196608, num_local_experts=256, num_experts_per_tok=8,
    scoring_func="sigmoid", use_routing_bias=True, use_qk_norm=True, qk_norm_type="per_layer", use_mtp=True,
    num_mtp_modules=3, rms_norm_eps=1e-6, tie_word_embeddings=False, torch_dtype="bfloat16",
)


def test_spec_of_the_published_config() -> None:
    spec = get_architecture(PUBLISHED, "config.json").spec(PUBLISHED, "config.json")
    a, m = spec.attention, spec.moe
    assert (a.num_heads, a.num_kv_heads, a.head_dim, a.qk_norm) == (48, 8, 128, "full")
    assert spec.rope.rotary_dim(a.head_dim) == 64 and spec.rope.theta == 5e6
    assert (m.routing, m.n_group, m.topk_group, m.routed_scaling_factor) == ("sigmoid_groups", 1, 1, 1.0)
    assert m.correction_bias and not m.router_fp32 and m.norm_topk_prob and m.shared_intermediate_size == 0
    assert all(spec.moe_layers) and spec.skipped_layers == 3 and spec.dense_intermediate_size == 0


@pytest.mark.parametrize("field", [dict(scoring_func="softmax"), dict(use_routing_bias=False),
                                   dict(qk_norm_type="per_head")])
def test_unsupported_variants_are_refused_in_one_line(field: dict[str, Any]) -> None:
    from moeserve.errors import UnsupportedModelError

    config = {**PUBLISHED, **field}
    with pytest.raises(UnsupportedModelError, match=f"{next(iter(field))}=.* is not supported") as err:
        get_architecture(config, "config.json").spec(config, "config.json")
    assert "\n" not in str(err.value)


def is_fp8_linear(name: str) -> bool:
    """What the published checkpoint stores in FP8: attention projections and experts (w1 / w2 / w3); not the router
    (block_sparse_moe.gate), lm_head, norms or embeddings."""
    return name.endswith(("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight"))


def write_fp8(folder: Path, **overrides: Any) -> tuple[Path, Path]:
    """(the tiny MiniMax-M2 in bf16 with every `is_fp8_linear` weight FP8 in 32 x 32 blocks, its reference: the same
    model with those weights replaced by a numpy decoder's dequantization, fp32). Expert width 40 leaves partial
    edge blocks."""
    from moeserve.bench.checkpoints import write_tiny_checkpoint
    from tests.fixtures import checkpoints as C

    src = write_tiny_checkpoint(folder / "bf16", "minimax_m2", "bfloat16", intermediate_size=40, **overrides)
    # the published MiniMax-M2 quantization_config's spelling (fmt float8_e4m3fn) with this test's block size
    config = {**C.FP8_CONFIG, "fmt": "float8_e4m3fn",
              "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}
    return C.quantized_pair(src, folder, is_fp8_linear, config)


@pytest.fixture(scope="module")
def fp8(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_fp8(tmp_path_factory.mktemp("minimax-fp8"))


def test_fp8_checkpoint_matches_transformers_on_its_dequantization(fp8: tuple[Path, Path]) -> None:
    from moeserve.checkpoint.folder import open_checkpoint

    quantized, reference = fp8
    names = open_checkpoint(quantized).tensors
    for kind in ("self_attn.q_proj", "block_sparse_moe.experts.3.w2"):
        assert names[f"model.layers.1.{kind}.weight"].dtype_code == "F8_E4M3"
    assert names["model.layers.1.block_sparse_moe.gate.weight"].dtype_code == "BF16"
    choices = X.assert_matches_transformers(quantized, hf_model(reference, torch.float32), X.random_prompts(0, (40, 7)))
    assert "fp8" in choices["experts"].lower()


def test_fp8_bf16_offloaded_equals_resident_and_batched_equals_alone(fp8: tuple[Path, Path]) -> None:
    quantized, _ = fp8
    prompts = X.random_prompts(3, (40, 5, 23))
    X.assert_offloaded_equals_resident(quantized, prompts, max_model_len=256)
    X.assert_batched_and_preempted_equal_solo(quantized, [(0, p) for p in X.random_prompts(8, (30, 21, 9))], 6, 12,
                                              64)


def test_mtp_layers_are_skipped_at_load(tiny_checkpoint, tmp_path: Path) -> None:
    """Three MTP layers past the last (model.layers.2.* to 4.*, num_mtp_modules 3): not read, logged, in no resident
    size; the same tokens as the checkpoint without them. One more layer than announced is refused."""
    from safetensors.torch import save_file

    from moeserve.errors import CheckpointError

    src = tiny_checkpoint("minimax_m2")
    state = load_file(src / "model.safetensors")
    extra = {n.replace("model.layers.1.", f"model.layers.{L}.", 1): t.clone() for L in (2, 3, 4)
             for n, t in state.items() if n.startswith("model.layers.1.")}
    folder = tmp_path / "mtp"
    folder.mkdir()
    save_file(state | extra, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    runs = []
    for path, mtp in ((src, 0), (folder, 3)):
        (folder / "config.json").write_text(json.dumps({**config, "num_mtp_modules": mtp}))
        llm = LLM(str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=64)
        out = llm.generate([{"prompt_token_ids": p} for p in X.random_prompts(5, (9, 4))], X.greedy())
        runs.append(([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in out], llm.engine.model.resident_bytes,
                     dict(llm.engine.choices)))
        llm.engine.close()
    assert runs[0][:2] == runs[1][:2] and "not loaded (" in runs[1][2]["skipped layers"]
    (folder / "config.json").write_text(json.dumps({**config, "num_mtp_modules": 2}))
    with pytest.raises(CheckpointError, match="holds tensors of layer 4"):
        LLM(str(folder), skip_tokenizer_init=True, dtype="float32")
