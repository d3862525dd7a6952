"""GLM-4.5 (glm4_moe) and the noaux_tc routing it shares with DeepSeek-V3.

- The routing (moe.SigmoidGroups) against transformers' own router (Glm4MoeTopkRouter) on random router weights,
  hidden states and correction biases: DeepSeek-V3's 256 experts in 8 groups (topk_group 4) and GLM's one group;
  the same experts and the same fp32 weights, in plain and batch-invariant (row block) form, and a row's routing
  alone equal to its routing in a batch.
- The spec of the published GLM-4.5-Air config.json.
- Variants of the tiny model against transformers (GLM-4.5-Air's switches: one group, no q/k norm, no rotary
  cut...); the base tiny config runs in tests/engine/test_parity_transformers.py and tests/test_offload.py.
- Multi-token-prediction layers in the checkpoint: skipped at load (logged), the same logits, out of the resident
  size; refused when config.json does not announce them.
- GLM-4.5-Air's real dimensions truncated to 2 layers: tests/models/test_real_dims_exactness.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeserve import LLM, SamplingParams
from moeserve.errors import CheckpointError
from moeserve.models.experts.moe import CppRouting, SigmoidGroups, SoftmaxTopk, TopkSoftmax, choose_routing
from moeserve.models.numerics import Numerics
from moeserve.models.registry import get_architecture
from moeserve.models.spec import MoeSpec
from tests.engine.test_parity_transformers import (
    PROMPTS,
    assert_fp32_batch_matches_transformers,
)

# The router shapes to test: (experts, n_group, topk_group, top_k, routed_scaling_factor, norm_topk_prob)
ROUTERS = {
    "deepseek-v3": (256, 8, 4, 8, 2.5, True),
    "glm-4.5": (128, 1, 1, 8, 1.0, True),
    "groups-no-renorm": (64, 4, 2, 6, 1.5, False),
}


def moe_spec(experts: int, groups: int, topk_group: int, k: int, scale: float, norm: bool) -> MoeSpec:
    return MoeSpec(num_experts=experts, top_k=k, intermediate_size=8, norm_topk_prob=norm, routing="sigmoid_groups",
                   router_bias=False, weights_in_fp32=True, expert_kind="swiglu", shared_intermediate_size=0,
                   shared_gated=False, router_fp32=True, n_group=groups, topk_group=topk_group,
                   routed_scaling_factor=scale, correction_bias=True)


def transformers_router(experts: int, groups: int, topk_group: int, k: int, scale: float, norm: bool, hidden: int,
                        seed: int):
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    config = Glm4MoeConfig(hidden_size=hidden, n_routed_experts=experts, num_experts_per_tok=k, n_group=groups,
                           topk_group=topk_group, routed_scaling_factor=scale, norm_topk_prob=norm)
    router = Glm4MoeTopkRouter(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, hidden, generator=gen) * 0.05)
        router.e_score_correction_bias.copy_(torch.randn(experts, generator=gen) * 0.1)
    return router, torch.randn(37, hidden, generator=gen)


def by_expert(weights: torch.Tensor, ids: torch.Tensor) -> list[dict[int, float]]:
    return [dict(zip(i.tolist(), w.tolist())) for w, i in zip(weights, ids)]


@pytest.mark.parametrize("invariant", [False, True], ids=["plain", "row-blocks"])
@pytest.mark.parametrize("name", list(ROUTERS))
def test_routing_equals_transformers_router(name: str, invariant: bool) -> None:
    shape = ROUTERS[name]
    ref, x = transformers_router(*shape, hidden=64, seed=len(name))
    with torch.no_grad():
        logits, ref_weights, ref_ids = ref(x)
    routing = SigmoidGroups(moe_spec(*shape), ref.e_score_correction_bias.detach().clone(),
                            Numerics(batch_invariant=invariant))
    weights, ids = routing.weights_and_ids(logits)
    assert weights.dtype == torch.float32 and ids.shape == ref_ids.shape
    assert by_expert(weights, ids) == by_expert(ref_weights, ref_ids)  # same experts, same fp32 weights
    routed = routing.route(x, logits)  # grouped by expert, ascending; each pair's weight its token's
    for e, (lo, hi) in routed.spans.items():
        for t, w in zip(routed.token_of[lo:hi].tolist(), routed.weight_of[lo:hi].tolist()):
            assert by_expert(weights, ids)[t][e] == w
    assert sum(hi - lo for lo, hi in routed.spans.values()) == ids.numel()


@pytest.mark.parametrize("name", ["deepseek-v3", "groups-no-renorm"])
def test_groups_and_bias_change_the_choice(name: str) -> None:
    """The test above can tell a router that ignored the groups or the bias: both change the experts of some rows."""
    experts, groups, topk_group, k, scale, norm = ROUTERS[name]
    ref, x = transformers_router(*ROUTERS[name], hidden=64, seed=len(name))
    with torch.no_grad():
        logits, _, ref_ids = ref(x)
    chosen = [set(row) for row in ref_ids.tolist()]
    scores = logits.sigmoid()
    no_groups = torch.topk(scores + ref.e_score_correction_bias, k, dim=-1).indices.tolist()
    unbiased = SigmoidGroups(moe_spec(*ROUTERS[name]), torch.zeros(experts), Numerics())
    no_bias = unbiased.weights_and_ids(logits)[1].tolist()
    assert sum(set(a) != b for a, b in zip(no_groups, chosen)) > 0
    assert sum(set(a) != b for a, b in zip(no_bias, chosen)) > 0


@pytest.mark.parametrize("name", list(ROUTERS))
def test_routing_of_a_row_never_depends_on_the_batch(name: str) -> None:
    shape = ROUTERS[name]
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(41, shape[0], generator=gen)
    bias = torch.randn(shape[0], generator=gen) * 0.1
    routing = SigmoidGroups(moe_spec(*shape), bias, Numerics(batch_invariant=True))
    weights, ids = routing.weights_and_ids(logits)
    for i in (0, 17, 40):
        w1, i1 = routing.weights_and_ids(logits[i : i + 1])
        assert torch.equal(w1[0], weights[i]) and torch.equal(i1[0], ids[i])


def test_each_rule_chooses_its_routing_once() -> None:
    spec = moe_spec(*ROUTERS["deepseek-v3"])
    groups = choose_routing(spec, Numerics(batch_invariant=True), correction_bias=torch.zeros(256))
    assert type(groups) is SigmoidGroups  # torch; C++ (kernels on): tests/kernels/test_routing_noaux.py
    assert groups.why_not_stacked() == "sigmoid_groups routing (no decode-stack mode)"
    assert "torch" in groups.describe()
    for rule, cls, mode in (("softmax_topk", SoftmaxTopk, 0), ("topk_softmax", TopkSoftmax, 1)):
        other = MoeSpec(num_experts=8, top_k=2, intermediate_size=8, norm_topk_prob=True, routing=rule,  # type: ignore[arg-type]
                        router_bias=False, weights_in_fp32=False, expert_kind="swiglu", shared_intermediate_size=0)
        cpp = choose_routing(other, Numerics(cpp=True, batch_invariant=True), correction_bias=None)
        assert isinstance(cpp, CppRouting) and cpp.stack_mode == mode and cpp.why_not_stacked() is None
        assert type(choose_routing(other, Numerics(batch_invariant=True), correction_bias=None)) is cls


# The published zai-org/GLM-4.5-Air config.json (shared/reference/configs/GLM-4.5-Air.json), the fields read.
GLM_45_AIR = {
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "first_k_dense_replace": 1, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 10944, "max_position_embeddings": 131072,
    "model_type": "glm4_moe", "moe_intermediate_size": 1408, "n_group": 1, "n_routed_experts": 128,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 96, "num_experts_per_tok": 8,
    "num_hidden_layers": 46, "num_key_value_heads": 8, "num_nextn_predict_layers": 1, "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000, "routed_scaling_factor": 1.0,
    "tie_word_embeddings": False, "topk_group": 1, "torch_dtype": "bfloat16", "use_qk_norm": False,
    "vocab_size": 151552,
}


def test_spec_of_glm_45_air() -> None:
    arch = get_architecture(GLM_45_AIR, "config.json")
    spec = arch.spec(GLM_45_AIR, "config.json")
    a, m = spec.attention, spec.moe
    assert spec.moe_layers == (False,) + (True,) * 45 and spec.dense_intermediate_size == 10944
    assert (a.num_heads, a.num_kv_heads, a.head_dim, a.qkv_bias, a.o_bias, a.qk_norm) == (96, 8, 128, True, False,
                                                                                          "none")
    assert spec.rope.rotary_dim(a.head_dim) == 64 and spec.rope.theta == 1e6
    assert (m.num_experts, m.top_k, m.intermediate_size, m.shared_intermediate_size) == (128, 8, 1408, 1408)
    assert (m.routing, m.n_group, m.topk_group, m.routed_scaling_factor) == ("sigmoid_groups", 1, 1, 1.0)
    assert not m.shared_gated and m.router_fp32 and m.correction_bias and spec.skipped_layers == 1
    # transformers' Glm4MoeConfig default: half of each head rotated when config.json names no factor
    unnamed = {k: v for k, v in GLM_45_AIR.items() if k != "partial_rotary_factor"}
    assert arch.spec(unnamed, "config.json").rope.rotary_dim(128) == 64


@pytest.mark.parametrize("change,message", [
    ({"n_group": 3}, "n_group=3 must divide the 128 experts"),
    ({"topk_group": 2}, "topk_group=2 lie in"),
    ({"n_group": 64, "topk_group": 1}, "num_experts_per_tok=8 is more than the experts of topk_group=1 groups"),
    ({"partial_rotary_factor": 1.5}, "'partial_rotary_factor' = 1.5"),
    ({"partial_rotary_factor": 0.01}, "rotates 1 dims"),
    ({"num_nextn_predict_layers": -1}, "'num_nextn_predict_layers' = -1 is out of range"),
])
def test_bad_glm_configs_are_refused_with_one_line(change: dict, message: str) -> None:
    from moeserve.models.spec import check_spec

    config = {**GLM_45_AIR, **change}
    with pytest.raises(CheckpointError, match=re.escape(message)) as err:
        arch = get_architecture(config, "config.json")
        check_spec(arch.spec(config, "config.json"), "config.json")
    assert "\n" not in str(err.value)


# Each exercises switches the base tiny config (tests/conftest.py) leaves off or sets otherwise.
VARIANTS = {
    "air-like": dict(n_group=1, topk_group=1, use_qk_norm=False, routed_scaling_factor=1.0, n_shared_experts=1),
    "full-rotary-no-renorm-3-groups": dict(n_routed_experts=12, n_group=3, topk_group=2, num_experts_per_tok=3,
                                           partial_rotary_factor=1.0, norm_topk_prob=False, attention_bias=False),
    "two-dense-layers": dict(first_k_dense_replace=2, num_hidden_layers=4, num_key_value_heads=1),
}


@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_match_transformers(tiny_checkpoint, variant: str, kernels: str) -> None:
    assert_fp32_batch_matches_transformers(tiny_checkpoint("glm4_moe", **VARIANTS[variant]), variant,
                                           kernels=kernels)


def with_mtp_layer(src: Path, folder: Path, announced: int) -> Path:
    """`src` plus a GLM-style MTP layer past the last (a copy of the last layer and the MTP extras), with
    config.json's num_nextn_predict_layers = `announced`."""
    state = load_file(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    last, h = config["num_hidden_layers"] - 1, config["hidden_size"]
    prefix = f"model.layers.{last}."
    extra = {name.replace(prefix, f"model.layers.{last + 1}."): t.clone() for name, t in state.items()
             if name.startswith(prefix)}
    mtp = f"model.layers.{last + 1}."
    extra |= {mtp + "eh_proj.weight": torch.randn(h, 2 * h), mtp + "enorm.weight": torch.ones(h),
              mtp + "hnorm.weight": torch.ones(h), mtp + "shared_head.norm.weight": torch.ones(h)}
    folder.mkdir(parents=True)
    save_file(state | extra, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": announced}))
    return folder


def test_mtp_layers_are_skipped_at_load(tiny_checkpoint, tmp_path: Path) -> None:
    from moeserve.models.experts.plans import expert_plan
    from moeserve.models.inventory import resident_nbytes

    src = tiny_checkpoint("glm4_moe")
    folder = with_mtp_layer(src, tmp_path / "mtp", announced=1)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    runs = []
    for path in (src, folder):
        llm = LLM(str(path), skip_tokenizer_init=True, dtype="bfloat16")
        e = llm.engine
        plan = expert_plan(e.checkpoint, e.arch, e.spec, torch.bfloat16)
        assert resident_nbytes(e.checkpoint, plan, torch.bfloat16) == e.model.resident_bytes
        out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params)
        runs.append(([o.outputs[0].token_ids for o in out], [o.outputs[0].logprobs for o in out],
                     e.model.resident_bytes, dict(e.model.choices)))
    assert runs[0][:3] == runs[1][:3]
    from moeserve.cli.inspect import inspect_checkpoint

    assert inspect_checkpoint(str(folder))["bytes_read_per_token"] == inspect_checkpoint(str(src))[
        "bytes_read_per_token"]
    assert "not loaded (" in runs[1][3]["skipped layers"] and "(0 tensors" not in runs[1][3]["skipped layers"]
    with pytest.raises(CheckpointError, match="holds tensors of layer 3"):
        LLM(str(with_mtp_layer(src, tmp_path / "unannounced", announced=0)), skip_tokenizer_init=True)
