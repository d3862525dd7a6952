"""gpt-oss against transformers on tiny checkpoints it wrote: the bf16 HF layout and the MXFP4 layout (experts
packed by our test packer into the real `_blocks`/`_scales` tensors; transformers dequantizes them on CPU).

Prompts are longer than the sliding window (4), so the windowed layer 0 and the full layer 1 both matter; the
checkpoint has non-zero expert biases and sinks, so every bias path is exercised.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.bench.real_dims import write_gpt_oss_mxfp4
from moeserve.models.layers.base import rope_inv_freq
from moeserve.models.registry import get_architecture
from tests.fixtures.checkpoints import write_gpt_oss

STEPS = 16
PROMPTS = [[5], [11, 42, 7, 99, 3, 8], [17, 250, 33, 4, 8, 120, 64, 2, 77, 45, 13, 200], list(range(40, 63))]


@pytest.fixture(scope="module")
def gpt_oss_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpt_oss")
    bf16 = write_gpt_oss(root / "bf16")
    return {"bf16": bf16, "mxfp4": write_gpt_oss_mxfp4(bf16, root / "mxfp4")}


@functools.cache
def hf_model(folder: Path, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def hf_logprobs(folder: Path, prompt: list[int], tokens: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
    """transformers' own forward, no cache, teacher-forced on `tokens`: the full log-softmax before each."""
    model = hf_model(folder, dtype)
    ids, logps = list(prompt), []
    with torch.no_grad():
        for token in tokens:
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            logps.append(torch.log_softmax(logits, dim=-1))
            ids.append(token)
    return logps


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["bf16", "mxfp4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_matches_transformers(gpt_oss_folders, layout: str, dtype: str) -> None:
    """Every step's logprobs within tolerance of transformers' on the same prefix, and every greedy token is
    transformers' argmax unless its top two are closer than that tolerance (a bf16 near-tie: 1.7e-4 apart at one
    step here, where transformers' bf16 and fp32 runs disagree with each other)."""
    folder = gpt_oss_folders[layout]
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype=dtype)
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    tol = 1e-4 if dtype == "float32" else 5e-2
    for prompt, out in zip(PROMPTS, outs):
        ours = out.outputs[0]
        ref_logps = hf_logprobs(folder, prompt, ours.token_ids, getattr(torch, dtype))
        for step, (token, lp, ref) in enumerate(zip(ours.token_ids, ours.logprobs, ref_logps)):
            top2 = torch.topk(ref, 2).values
            if float(top2[0] - top2[1]) > tol:
                assert token == int(ref.argmax()), f"{layout} {dtype} prompt len {len(prompt)} step {step}"
            for token_id, entry in lp.items():
                assert abs(entry.logprob - float(ref[token_id])) < tol, (layout, dtype, step, token_id)


def test_mxfp4_experts_stay_mxfp4_in_the_cache(gpt_oss_folders) -> None:
    llm = LLM(str(gpt_oss_folders["mxfp4"]), skip_tokenizer_init=True, dtype="bfloat16")
    layout = llm.engine.model.store.layout
    dtypes = {f.name: f.dtype for f in layout.fields}
    assert dtypes["gate_up.0.blocks"] == dtypes["gate_up.0.scales"] == torch.uint8
    assert dtypes["down.0.blocks"] == torch.uint8
    h = i = 64
    bf16_expert_bytes = (2 * i * h + h * i + 2 * i + h) * 2
    # 4.25 bits per weight (+ bf16 biases and alignment): well under a third of the bf16 expert.
    assert layout.nbytes < bf16_expert_bytes / 3


def test_spec_reads_windows_sinks_router_and_yarn(gpt_oss_folders) -> None:
    config = json.loads((gpt_oss_folders["bf16"] / "config.json").read_text())
    spec = get_architecture(config, "config.json").spec(config, "config.json")
    assert spec.attention.sliding_window == (4, None)
    assert spec.attention.sinks and spec.attention.qkv_bias and spec.attention.o_bias
    assert spec.moe.routing == "topk_softmax" and spec.moe.router_bias
    assert (spec.moe.swiglu_limit, spec.moe.swiglu_alpha) == (7.0, 1.702)
    assert spec.rope.rope_type == "yarn" and spec.rope.param("truncate") is False


def test_yarn_matches_transformers_at_real_gpt_oss_size() -> None:
    """gpt-oss-20b rope (head_dim 64, factor 32, truncate false): same inv_freq and attention factor."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = AutoConfig.for_model("gpt_oss")  # defaults = the released model's rope
    ref_inv_freq, ref_scaling = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    config = {**hf_config.to_dict(), "architectures": ["GptOssForCausalLM"]}
    spec = get_architecture(config, "c").spec(config, "c")
    inv_freq, scaling = rope_inv_freq(spec.rope, spec.attention.head_dim)
    assert torch.equal(inv_freq, ref_inv_freq)
    assert scaling == pytest.approx(ref_scaling, rel=0, abs=0) and scaling == pytest.approx(
        1.3465735902799727
    )


def test_gpt_oss_20b_shapes_plan_and_report(tmp_path: Path) -> None:
    """Real gpt-oss-20b shapes (header only, nothing read): the expert unit is exactly its stored MXFP4 bytes,
    and describe_formats gives the stored bytes a decoded token reads."""
    from moeserve.checkpoint.folder import open_checkpoint
    from moeserve.models.experts.plans import expert_plan
    from moeserve.models.inventory import describe_formats
    from tests.fixtures.checkpoints import gpt_oss_20b_header_only

    ckpt = open_checkpoint(gpt_oss_20b_header_only(tmp_path / "gpt-oss-20b"))
    arch = get_architecture(ckpt.config, "c")
    spec = arch.spec(ckpt.config, "c")
    assert spec.attention.sliding_window[:2] == (128, None) and spec.moe.top_k == 4
    plan = expert_plan(ckpt, arch, spec, torch.bfloat16)
    h = i = 2880
    gate_up = 2 * i * (h // 32) * 16 + 2 * i * (h // 32) + 2 * i * 2  # blocks + E8M0 scales + bf16 bias
    down = h * (i // 32) * 16 + h * (i // 32) + h * 2
    assert plan.layout.nbytes == gate_up + down == 13_236_480  # 3.76x smaller than the bf16 expert
    report = describe_formats(ckpt)
    assert report.scheme == "mxfp4" and report.expert_stored_bytes == gate_up + down
    formats = {g.group: g.format for g in report.groups}
    assert formats["model.layers.*.mlp.experts.gate_up_proj_blocks"] == "mxfp4-gpt-oss"
    assert formats["model.layers.*.mlp.experts.down_proj_scales"] == "mxfp4-gpt-oss"
    assert formats["model.layers.*.self_attn.q_proj.weight"] == "BF16"
    experts = sum(r.nbytes for n, r in ckpt.tensors.items() if ".experts." in n)
    nonexpert = ckpt.total_bytes - experts - ckpt.ref("model.embed_tokens.weight").nbytes
    assert report.bytes_per_token == nonexpert + 24 * 4 * (gate_up + down)


def test_clamped_swiglu_matches_transformers_beyond_the_limit() -> None:
    """Values up to +-30 so the clamp (limit 7, gate above only, up both sides) really acts."""
    from transformers import AutoConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from moeserve.models.experts.unit_math import clamped_swiglu

    experts = GptOssExperts(AutoConfig.for_model("gpt_oss", hidden_size=8, intermediate_size=8))
    gate_up = torch.randn(5, 16, generator=torch.Generator().manual_seed(0)) * 15
    assert (gate_up.abs() > 7).any()
    assert torch.equal(clamped_swiglu(gate_up, 7.0, 1.702), experts._apply_gate(gate_up))
