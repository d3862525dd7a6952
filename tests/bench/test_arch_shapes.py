"""The hybrid, MLA and Mamba-2 bench shapes: real layouts, loaded as their architecture, their sequence memory counted.

- Each tiny shape's tensor list (names, shapes, dtypes) is the checkpoint transformers writes for its config.json.
- A tiny shape's synthetic checkpoint is read by moeserve as its architecture (every tensor's shape checked).
- The ceiling's sequence-memory bytes and the MLA KV-per-token figures against counts made here from the config.
- `moeserve bench` on the tiny shapes prints the sequence-memory line (and MLA's KV per token).
"""

from __future__ import annotations

import json
import math

import pytest

from moeserve.bench import ceilings
from moeserve.bench.shapes import SHAPES

TINY = ["hybrid-tiny", "mla-tiny", "mamba-hybrid-tiny"]
ARCHS = {"hybrid-tiny": "Qwen3NextForCausalLM", "mla-tiny": "DeepseekV3ForCausalLM",
         "mamba-hybrid-tiny": "NemotronHForCausalLM"}


@pytest.mark.parametrize("name", TINY)
def test_tensors_are_those_transformers_writes(name: str, tmp_path) -> None:
    """Names, shapes and dtypes of the tiny shape's tensor list == the checkpoint transformers saves for a model of
    the same config (the published layout: per-expert tensors, Nemotron-H's backbone.*, fp32 correction biases).
    The bench-size shapes come from the same config builders with other numbers."""
    transformers = pytest.importorskip("transformers")
    import torch

    from moeserve.checkpoint.folder import open_checkpoint

    shape = SHAPES[name]
    config = transformers.AutoConfig.for_model(**{k: v for k, v in shape.hf_config().items() if k != "architectures"})
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp_path)
    theirs = {n: (r.shape, r.dtype_code) for n, r in open_checkpoint(tmp_path).tensors.items()}
    tensors = shape.outer_tensors() + [t for L in range(shape.num_layers) for t in shape.layer_tensors(L)]
    ours = {n: (s, "F32" if n in shape.fp32_tensors() else "BF16") for n, s in tensors}
    assert ours == theirs


def test_new_shapes_are_sized_like_small() -> None:
    small = SHAPES["small"].total_params
    for name in ("hybrid", "mla", "mamba-hybrid"):
        assert 0.7 * small < SHAPES[name].total_params < 1.2 * small, name  # ~1.4-2.1 GB in bf16
    mla = SHAPES["mla"].spec().mla
    assert (mla.kv_lora_rank, mla.qk_rope_head_dim) == (512, 64)  # DeepSeek-V3's latent, kept


@pytest.mark.parametrize("name", TINY)
def test_tiny_checkpoint_reads_as_its_architecture(name: str, tmp_path) -> None:
    from moeserve.bench.synth import ensure_checkpoint
    from moeserve.checkpoint.folder import open_checkpoint
    from moeserve.models.validate import read_model

    shape = SHAPES[name]
    folder = ensure_checkpoint(shape, tmp_path)
    ckpt = open_checkpoint(folder)
    arch, spec = read_model(ckpt)  # every non-expert tensor's shape checked against the spec
    assert json.loads((folder / "config.json").read_text())["architectures"] == [ARCHS[name]]
    assert spec.num_layers == shape.num_layers and len(spec.moe_layer_ids) == shape.moe_layer_count
    for bias in shape.fp32_tensors():  # routers and correction biases in float32, as transformers stores them
        assert ckpt.ref(bias).dtype_code == "F32"


def test_hybrid_sequence_bytes_counted_from_the_config() -> None:
    shape, context = SHAPES["hybrid-tiny"], 40
    c = shape.hf_config()
    linear = [L for L in range(c["num_hidden_layers"]) if (L + 1) % c["full_attention_interval"]]
    key_dim = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    conv_dim = 2 * key_dim + c["linear_num_value_heads"] * c["linear_value_head_dim"]
    conv = (c["linear_conv_kernel_dim"] - 1) * conv_dim * 2  # the conv's last inputs, bf16
    state = c["linear_num_value_heads"] * c["linear_key_head_dim"] * c["linear_value_head_dim"] * 4  # fp32
    kv_row = 2 * c["num_key_value_heads"] * c["head_dim"] * 2  # K and V, bf16
    full = c["num_hidden_layers"] - len(linear)
    got = ceilings.sequence_bytes_per_step(shape, context)
    # the recurrent state read and written back; context + 1 KV rows read (the new token's too), one written
    assert got == {"recurrent state": len(linear) * 2 * (conv + state), "full attention": full * (context + 2) * kv_row}


def test_mla_latent_bytes_and_kv_per_token_counted_from_the_config() -> None:
    shape, context = SHAPES["mla"], 100
    c = shape.hf_config()
    width = c["kv_lora_rank"] + c["qk_rope_head_dim"]  # 576 values per token and layer, bf16
    got = ceilings.sequence_bytes_per_step(shape, context)
    assert list(got.values()) == [c["num_hidden_layers"] * (context + 2) * width * 2]
    latent = c["num_hidden_layers"] * width * 2
    full = c["num_hidden_layers"] * c["num_attention_heads"] * (
        c["qk_nope_head_dim"] + c["qk_rope_head_dim"] + c["v_head_dim"]) * 2
    line = ceilings.kv_per_token(shape)
    assert line is not None and f"{latent} bytes/token" in line and f"{full} bytes/token" in line
    assert (latent, full) == (18432, 163840)  # 8.9x less
    assert ceilings.kv_per_token(SHAPES["hybrid"]) is None


def test_mamba_sequence_bytes_counted_from_the_config() -> None:
    shape = SHAPES["mamba-hybrid-tiny"]
    c = shape.hf_config()
    pattern = c["hybrid_override_pattern"]
    inner = c["mamba_num_heads"] * c["mamba_head_dim"]
    conv_dim = inner + 2 * c["n_groups"] * c["ssm_state_size"]
    conv = (c["conv_kernel"] - 1) * conv_dim * 2
    state = c["mamba_num_heads"] * c["mamba_head_dim"] * c["ssm_state_size"] * 4
    kv_row = 2 * c["num_key_value_heads"] * c["head_dim"] * 2
    got = ceilings.sequence_bytes_per_step(shape, 10)
    assert got == {"recurrent state": pattern.count("M") * 2 * (conv + state),
                   "full attention": pattern.count("*") * 12 * kv_row}


def test_resident_step_counts_moe_layers_and_sequence_memory() -> None:
    shape = SHAPES["mla"]  # the first layer dense: 15 MoE layers of 32 experts, 4 active
    step = ceilings.resident_step_bytes(shape, 2, batch=1, context=64)
    assert step.expert_bytes_fast == pytest.approx(15 * 4 * 3 * 1024 * 512 * 2)
    assert step.sequence_bytes == sum(ceilings.sequence_bytes_per_step(shape, 64).values()) > 0
    assert step.fast_bytes == step.dense_bytes + step.expert_bytes_fast + step.sequence_bytes
    # every non-expert tensor of every layer, counted from the tensor list: MLA, norms, routers with their
    # correction biases, the shared experts and the first layer's dense MLP
    dense = sum(math.prod(s) for L in range(shape.num_layers) for n, s in shape.layer_tensors(L)
                if ".experts." not in n)
    assert shape.dense_layer_params == dense
    assert any("shared_experts" in n for n, _ in shape.layer_tensors(1))
    assert any(n.endswith("mlp.gate_proj.weight") for n, _ in shape.layer_tensors(0))  # first_k_dense_replace


@pytest.mark.parametrize("name", ["hybrid-tiny", "mla-tiny"])
def test_bench_prints_sequence_memory(name: str, tmp_path, capsys) -> None:
    from moeserve.cli import main

    out = tmp_path / "bench.json"
    assert main(["bench", "--shape", name, "--cache-dir", str(tmp_path / "cache"), "--tokens", "2", "--repeats",
                 "1", "--prompt-len", "4", "--cases", "decode-b1", "--peers", "none", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    row = summary["rows"][0]
    assert row["sequence_bytes_per_token"] == sum(summary["sequence_memory"]["bytes_per_step"].values()) > 0
    printed = capsys.readouterr().out
    assert "sequence memory read+written per decode step" in printed and "decode-b1" in printed
    assert ("KV per token:" in printed) == (name == "mla-tiny")
