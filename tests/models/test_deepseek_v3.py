"""DeepSeek-V3 / Kimi-K2 (DeepseekV3ForCausalLM): multi-head latent attention over a latent cache (models/mixers/mla.py).

- The specs of the published DeepSeek-V3 and Kimi-K2 config.json files (shared/reference/configs): latent dims,
  yarn's softmax scale, noaux_tc routing, first_k_dense_replace, MTP layers announced.
- Tiny checkpoints transformers writes (correction biases randomized, 2 shared experts, a dense first layer), fp32:
  transformers' greedy tokens and log-probabilities within 1e-4, with q_lora_rank set and null, interleaved and
  half-split rope, yarn with mscale != mscale_all_dim, attention biases; C++ kernels and torch.
- bf16, default settings: chunked prefill equals one pass, a prefix-cache hit equals a cold run, sequences batched
  and preempted keep their solo numbers, offloaded experts equal resident ones, all bit for bit.
- The latent cache holds kv_lora_rank + rope values per token and layer, logged beside the full-KV figure.
- DeepSeek-V3's real dimensions truncated to 2 layers (one dense, one MoE; 16 of 256 experts):
  tests/models/test_real_dims_exactness.py.
The comparisons run through the shared driver tests/models/exactness.py.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeserve import LLM, SamplingParams
from moeserve.models.registry import get_architecture
from tests.engine.test_parity_transformers import hf_model
from tests.logits_capture import generate_capturing_logits
from tests.models import exactness as X

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "reference_configs"  # copies of shared/reference/configs
STEPS = 6
TINY = dict(
    hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=2,
    first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
    routed_scaling_factor=2.5, norm_topk_prob=True, vocab_size=300, max_position_embeddings=512,
    initializer_range=0.08,
)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}
VARIANTS: dict[str, dict[str, Any]] = {
    "q-lora": {},
    "no-q-lora-yarn": dict(q_lora_rank=None, rope_parameters=YARN),
    "half-split-rope-bias-one-group": dict(rope_interleave=False, attention_bias=True, n_group=1, topk_group=1),
}


def write_tiny(folder: Path, dtype: torch.dtype = torch.float32, seed: int = 0, model_type: str = "deepseek_v3",
               **overrides: Any) -> Path:
    """A random DeepseekV3ForCausalLM (or another `model_type` of its family) saved by transformers' save_pretrained
    (correction biases randomized)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from moeserve.bench.checkpoints import randomize_zero_inits

    config = AutoConfig.for_model(model_type, **{**TINY, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    randomize_zero_inits(model)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    cache: dict[str, Path] = {}

    def make(variant: str = "q-lora", dtype: torch.dtype = torch.float32) -> Path:
        key = f"{variant}-{dtype}"
        if key not in cache:
            cache[key] = write_tiny(tmp_path_factory.mktemp(key), dtype, **VARIANTS[variant])
        return cache[key]

    return make


@pytest.mark.parametrize("name", ["DeepSeek-V3", "Kimi-K2"])
def test_spec_of_the_published_configs(name: str) -> None:
    config = json.loads((CONFIGS / f"{name}.json").read_text())
    spec = get_architecture(config, "config.json").spec(config, "config.json")
    m, moe = spec.mla, spec.moe
    assert m is not None
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (
        1536, 512, 128, 64, 128)
    assert m.latent_width == 576 and m.interleaved_rope and spec.attention.head_dim == 64
    assert moe.routing == "sigmoid_groups" and moe.correction_bias and moe.shared_intermediate_size == 2048
    if name == "DeepSeek-V3":  # yarn factor 40, mscale_all_dim 1: scale 192**-0.5 * (0.1 ln 40 + 1)**2
        assert m.softmax_scale == pytest.approx(192**-0.5 * (0.1 * torch.log(torch.tensor(40.0)).item() + 1) ** 2)
        assert spec.rope.param("attention_factor") == 1.0  # mscale / mscale_all_dim
        assert spec.moe_layers == (False,) * 3 + (True,) * 58 and spec.skipped_layers == 1
        assert (moe.num_experts, moe.n_group, moe.topk_group, moe.routed_scaling_factor) == (256, 8, 4, 2.5)
    else:
        assert m.softmax_scale == 192**-0.5 and spec.rope.rope_type == "default"
        assert spec.moe_layers == (False,) + (True,) * 60 and moe.num_experts == 384


def test_unsupported_routing_is_refused_in_one_line() -> None:
    from moeserve.errors import UnsupportedModelError

    config = {**json.loads((CONFIGS / "DeepSeek-V3.json").read_text()), "topk_method": "greedy"}
    with pytest.raises(UnsupportedModelError, match="topk_method='greedy' is not supported") as err:
        get_architecture(config, "config.json").spec(config, "config.json")
    assert "\n" not in str(err.value)


def prompts(seed: int = 0, lengths: tuple[int, ...] = (40, 5, 23)) -> list[list[int]]:
    return X.random_prompts(seed, lengths)


@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tiny_matches_transformers(tiny, variant: str, kernels: str) -> None:
    """fp32, three prompts decoded together: transformers' greedy tokens, log-probabilities within 1e-4."""
    folder = tiny(variant)
    X.assert_matches_transformers(folder, hf_model(folder, torch.float32), prompts(), kernels=kernels)


def test_chunked_prefill_equals_one_pass_bit_for_bit(tiny) -> None:
    """Chunks that end inside a query block (37) and on one (64)."""
    folder = tiny(dtype=torch.bfloat16)
    whole = X.run_together(folder, prompts(1, (150,)), max_model_len=256)
    X.assert_chunked_equals_one_pass(folder, prompts(1, (150,))[0], (37, 64), whole, max_model_len=256)
    assert whole.logits[0].dtype == torch.float32 and len(whole.logits) == STEPS


def test_prefix_cache_hit_equals_a_cold_run(tiny) -> None:
    """A second request sharing 64 prompt tokens (4 latent blocks) takes them from the cache: its numbers are those
    of a run without prefix caching."""
    first, second = prompts(2, (70, 30))
    choices = X.assert_prefix_hit_equals_cold(tiny(dtype=torch.bfloat16), first, first[:64] + second, 64,
                                              max_model_len=256)
    assert "latent attention (40 values per token)" in choices["KV cache"]


@pytest.mark.slow  # ~80 s on 2 busy cores: 4 solo runs and a preempting batch of 30 tokens each
def test_batched_and_preempted_sequences_keep_their_solo_numbers(tiny) -> None:
    batch = prompts(7, (40, 33, 47, 12))
    X.assert_batched_and_preempted_equal_solo(tiny(dtype=torch.bfloat16), [(0, p) for p in batch], 12, 30, 128)


def test_offloaded_equals_resident_in_bf16(tiny) -> None:
    folder = tiny(dtype=torch.bfloat16)
    resident = X.run_together(folder, prompts(3), max_model_len=256)
    # per op: q_lora_rank 24 is outside the C++ GEMV layouts (the fused step on DeepSeek-V3:
    # tests/models/test_decode_stack_kinds.py)
    assert "'onednn' layout" in resident.choices["decode step"]
    X.assert_offloaded_equals_resident(folder, prompts(3), resident, max_model_len=256)


def deepseek_header_only(folder: Path, config: dict[str, Any]) -> Path:
    """A bf16 checkpoint of `config` with real headers and no data (tests.models.checkpoints.write_header_only), the
    tensor names and shapes of the published DeepSeek-V3 checkpoints written out here, MTP layers included."""
    from tests.fixtures.checkpoints import write_header_only

    c = config
    h, nh, q_lora, kv_lora = c["hidden_size"], c["num_attention_heads"], c["q_lora_rank"], c["kv_lora_rank"]
    qk, v, rope, moe_i = c["qk_nope_head_dim"] + c["qk_rope_head_dim"], c["v_head_dim"], c["qk_rope_head_dim"], c[
        "moe_intermediate_size"]
    shapes = {"model.embed_tokens.weight": [c["vocab_size"], h], "model.norm.weight": [h],
              "lm_head.weight": [c["vocab_size"], h]}
    for L in range(c["num_hidden_layers"] + c["num_nextn_predict_layers"]):
        p = f"model.layers.{L}."
        shapes |= {p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h],
                   p + "self_attn.q_a_proj.weight": [q_lora, h], p + "self_attn.q_a_layernorm.weight": [q_lora],
                   p + "self_attn.q_b_proj.weight": [nh * qk, q_lora],
                   p + "self_attn.kv_a_proj_with_mqa.weight": [kv_lora + rope, h],
                   p + "self_attn.kv_a_layernorm.weight": [kv_lora],
                   p + "self_attn.kv_b_proj.weight": [nh * (qk - rope + v), kv_lora],
                   p + "self_attn.o_proj.weight": [h, nh * v]}
        mlps = [("mlp.", c["intermediate_size"])]
        if L >= c["first_k_dense_replace"]:
            mlps = [(f"mlp.experts.{e}.", moe_i) for e in range(c["n_routed_experts"])] + [
                ("mlp.shared_experts.", moe_i * c["n_shared_experts"])]
            shapes |= {p + "mlp.gate.weight": [c["n_routed_experts"], h],
                       p + "mlp.gate.e_score_correction_bias": [c["n_routed_experts"]]}
        for m, width in mlps:
            shapes |= {p + m + "gate_proj.weight": [width, h], p + m + "up_proj.weight": [width, h],
                       p + m + "down_proj.weight": [h, width]}
    fp32 = {n for n in shapes if n.endswith(("mlp.gate.weight", "e_score_correction_bias"))}
    return write_header_only(folder, {n: ("F32" if n in fp32 else "BF16", s) for n, s in shapes.items()}, config)


def test_latent_kv_per_token_is_logged_and_planned(tiny, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The engine's start-up line and `moeserve plan` (from config.json and headers: DeepSeek-V3 as published, in
    bf16) give the latent cache's bytes per token beside full per-head K and V."""
    from moeserve.cli import main

    llm = LLM(str(tiny()), skip_tokenizer_init=True, dtype="float32", max_model_len=64)
    line = llm.engine.choices["KV per token"]
    llm.engine.close()
    # 3 layers x (32 + 8) fp32 values; 3 layers x 4 heads x (24 + 12) fp32 values
    assert line.startswith("480 bytes/token in the latent cache") and "1728 bytes/token with full per-head" in line
    config = {k: v for k, v in json.loads((CONFIGS / "DeepSeek-V3.json").read_text()).items()
              if k != "quantization_config" and not k.startswith("_")}
    folder = deepseek_header_only(tmp_path / "dsv3", config)
    capsys.readouterr()
    assert main(["plan", str(folder), "--no-probe", "--max-model-len", "4096", "--memory-gb", "2000"]) == 0
    out = capsys.readouterr().out
    # 61 layers x 576 bf16 values = 70272 B; 61 layers x 128 heads x (192 + 128) bf16 values = 4997120 B
    assert ("KV per token: 70272 bytes/token in the latent cache (61 layers x 576 values: kv_lora_rank 512 + rope "
            "64); 4997120 bytes/token with full per-head keys and values (128 heads x (key 192 + value 128)): "
            "71.1x less") in out, out


@pytest.fixture(scope="module")
def fp8(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the tiny model with every *_proj Linear in FP8 with 32x32 blocks as DeepSeek-V3 ships them: weight float8_e4m3fn,
    weight_scale_inv float32; router and lm_head bf16, the reference: the same model with each of those Linears
    replaced by a numpy decoder's dequantization, fp32). Widths 72 / 40 / 24 / 112 leave partial edge blocks."""
    from tests.fixtures import checkpoints as C

    root = tmp_path_factory.mktemp("fp8")
    src = write_tiny(root / "bf16", torch.bfloat16, intermediate_size=72, moe_intermediate_size=40)
    quantized = C.quantize_checkpoint(src, root / "fp8", C.fp8_block_quantize, C.FP8_CONFIG)
    return quantized, C.dequantized_reference(src, quantized, root / "ref", C.fp8_block_reference, torch.float32)


def test_fp8_block_checkpoint_matches_transformers_on_its_dequantization(fp8: tuple[Path, Path]) -> None:
    from moeserve.checkpoint.folder import open_checkpoint

    quantized, reference = fp8
    names = open_checkpoint(quantized).tensors
    for kind in ("self_attn.kv_b_proj", "self_attn.q_a_proj", "mlp.experts.3.down_proj", "mlp.shared_experts.up_proj"):
        weight = names[f"model.layers.1.{kind}.weight"]
        assert weight.dtype_code == "F8_E4M3" and f"model.layers.1.{kind}.weight_scale_inv" in names
    choices = X.assert_matches_transformers(quantized, hf_model(reference, torch.float32), prompts())
    assert "fp8" in choices["experts"].lower()


def test_fp8_experts_stay_fp8_offloaded_and_equal_resident(fp8: tuple[Path, Path]) -> None:
    """bf16, one expert slot: every miss reads exactly the stored FP8 bytes of one expert (codes + scales), and the
    logits equal the resident run's bit for bit."""
    from moeserve.checkpoint.folder import open_checkpoint

    quantized, _ = fp8
    ref = X.run_together(quantized, prompts(4), max_model_len=256)
    llm = LLM(str(quantized), skip_tokenizer_init=True, max_model_len=256, expert_cache_gb=1e-9)
    store, reader = llm.engine.model.store, llm.engine.checkpoint.reader
    assert not store.resident and store.capacity == 1
    before = reader.bytes_read
    got, outs = generate_capturing_logits(llm, [{"prompt_token_ids": p} for p in prompts(4)], X.greedy())
    stored = sum(r.nbytes for n, r in open_checkpoint(quantized).tensors.items()
                 if n.startswith("model.layers.1.mlp.experts.0."))
    assert stored < 3 * 64 * 40 * 2 / 1.8  # FP8 codes and scales, not bf16
    assert store.stats.misses > 0 and reader.bytes_read - before == store.stats.misses * stored
    X.assert_same_run(X.Run(got, [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]), ref,
                      "one expert slot, FP8 units")


def test_mtp_layers_are_skipped_at_load(tiny, tmp_path: Path) -> None:
    """A DeepSeek-style MTP layer past the last (model.layers.3.*: a decoder layer plus eh_proj, enorm, hnorm,
    shared_head): not read, logged with its size, in no resident size; the tokens of the checkpoint without it."""
    from tests.models.test_glm4_moe import with_mtp_layer

    src = tiny()
    folder = with_mtp_layer(src, tmp_path / "mtp", announced=1)
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=3)
    runs = []
    for path in (src, folder):
        llm = LLM(str(path), skip_tokenizer_init=True, dtype="float32", max_model_len=64)
        out = llm.generate([{"prompt_token_ids": p} for p in prompts(5, (9, 4))], params)
        runs.append(([o.outputs[0].token_ids for o in out], [o.outputs[0].logprobs for o in out],
                     llm.engine.model.resident_bytes, dict(llm.engine.choices)))
        llm.engine.close()
    assert runs[0][:3] == runs[1][:3]
    assert "(0 tensors" not in runs[1][3]["skipped layers"] and "not loaded (" in runs[1][3]["skipped layers"]


# ---------------------------------------------------------------------------------------------- Kimi-K2.5 / K2.6
def write_tiny_kimi_k25(folder: Path, dtype: torch.dtype = torch.float32, seed: int = 0) -> Path:
    """A random Kimi_K25ForConditionalGeneration (a one-block vision tower and its projector beside the DeepSeek-V3
    text model of TINY, model_type kimi_k2 as published, lm_head untied) saved by transformers' save_pretrained."""
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    from moeserve.bench.checkpoints import randomize_zero_inits

    config = Kimi_K25Config(text_config={**TINY, "model_type": "kimi_k2"}, tie_word_embeddings=False,
                            vision_config=dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                               num_attention_heads=2), projection_hidden_size=32)
    torch.manual_seed(seed)
    model = Kimi_K25ForConditionalGeneration._from_config(config, dtype=dtype).eval()  # routers kept in fp32
    randomize_zero_inits(model)
    model.save_pretrained(folder)
    # transformers 5.24 writes the text model's layers as language_model.model.blocks.* (its load-time rename
    # blocks -> layers, meant for the vision tower, reversed onto every name); the published checkpoints name them
    # language_model.model.layers.*, which transformers loads unchanged: restore that layout
    state = load_file(folder / "model.safetensors")
    state = {n.replace("language_model.model.blocks.", "language_model.model.layers.", 1): t for n, t in state.items()}
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def kimi(tmp_path_factory: pytest.TempPathFactory):
    return functools.cache(lambda dtype: write_tiny_kimi_k25(tmp_path_factory.mktemp(f"kimi-{dtype}"), dtype))


def test_kimi_k25_serves_the_language_model_only(kimi) -> None:
    """fp32: transformers' greedy tokens and log-probabilities (within 1e-4) of the whole multimodal class on text;
    the vision tower and projector never read, logged, out of the resident size."""
    from transformers import Kimi_K25ForConditionalGeneration

    folder = kimi(torch.float32)
    ref = Kimi_K25ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    X.assert_matches_transformers(folder, ref, prompts())
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32")
    e = llm.engine
    assert "the vision tower" in e.choices["not loaded: vision_tower.*"]
    assert "the vision tower" in e.choices["not loaded: mm_projector.*"]
    names = e.checkpoint.tensors
    language = sum(r.nbytes for n, r in names.items() if n.startswith("language_model.") and ".mlp.experts." not in n)
    assert any(n.startswith("vision_tower.") for n in names) and e.model.resident_bytes == language
    e.close()


def test_kimi_k25_bf16_offloaded_and_batched_equal_resident_alone(kimi) -> None:
    """bf16, default settings: one expert slot == all resident, and sequences batched and preempted == each alone,
    bit for bit."""
    folder = kimi(torch.bfloat16)
    X.assert_offloaded_equals_resident(folder, prompts(3), max_model_len=256)
    X.assert_batched_and_preempted_equal_solo(folder, [(0, p) for p in prompts(8, (30, 21, 9))], 6, 12, 64)
