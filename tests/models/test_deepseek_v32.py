"""DeepSeek Sparse Attention: DeepSeek-V3.2 (DeepseekV32ForCausalLM) and GLM-5 (GlmMoeDsaForCausalLM).

- The tie rule of the key choice (models/mixers/indexer.py top_keys): higher score first, then the earlier position.
- The specs of transformers 5.24's config defaults (the published sizes; no published config.json was found
  offline): indexer heads and dims, top-k, rotary layouts; GLM-5's "shared" indexer layers (reusing the choice of
  the layer before) read as transformers derives them, against transformers and chunked == one pass.
- Tiny checkpoints transformers writes (index_topk 20, so prompts of 23 and 40 tokens choose keys and a query block
  ending at 16 does not), fp32: transformers' greedy tokens and log-probabilities within 1e-4, C++ kernels and torch.
  transformers breaks index-score ties by no stated rule, so these comparisons use inputs without them: 8 indexer
  heads (a score is 0, and ties, only when all 8 dot products are negative) and a check, counting inside
  transformers' own indexer, that no query's k-th and (k+1)-th visible scores are equal (`index_ties`); the
  comparison with index_topk raised to 512 (dense MLA) fails, so the choice is tested.
- bf16, default settings, on a GLM-5 with ONE indexer head (ties everywhere: every key with a negative dot product
  scores 0, counted in transformers' own indexer): chunked prefill == one pass, prefix-cache hit == a cold run,
  batched and preempted == alone, offloaded == resident, bit for bit. The same on DeepSeek-V3.2 (half-split indexer
  rotary): chunked == one pass and offloaded == resident.
- The indexer's keys are a sequence-memory kind on the latent's blocks (IndexedLatentKV), logged and planned.
- FP8 blocks as DeepSeek-V3.2 ships them (the indexer's wq_b and wk too) against transformers on their dequantization.
- GLM-5's real dimensions truncated to one MoE layer against transformers in fp32 (slow).
The comparisons run through the shared driver tests/models/exactness.py.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from moeserve import LLM
from moeserve.errors import UnsupportedModelError
from moeserve.models.mixers.indexer import top_keys
from moeserve.models.registry import get_architecture
from tests.engine.test_parity_transformers import hf_model
from tests.models import exactness as X
from tests.models.test_deepseek_v3 import TINY as DEEPSEEK_TINY
from tests.models.test_deepseek_v3 import write_tiny as write_deepseek

ARCHS = {"deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM"}
TINY = {**DEEPSEEK_TINY, "index_topk": 20, "index_head_dim": 16, "index_n_heads": 8}
ONE_HEAD = {"index_n_heads": 1}  # one head: every key whose dot product is negative scores exactly 0
PROMPTS = X.random_prompts(0, (40, 5, 23))


def write_tiny(folder: Path, model_type: str, dtype: torch.dtype, seed: int = 0, **overrides: Any) -> Path:
    """A random DSA model of TINY saved by transformers' save_pretrained (correction biases randomized)."""
    return write_deepseek(folder, dtype, seed, model_type=model_type, **{**TINY, **overrides})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    cache: dict[tuple, Path] = {}

    def make(model_type: str, dtype: torch.dtype = torch.float32, heads: int = 8) -> Path:
        key = (model_type, dtype, heads)
        if key not in cache:
            cache[key] = write_tiny(tmp_path_factory.mktemp(f"{model_type}-{heads}"), model_type, dtype,
                                    index_n_heads=heads)
        return cache[key]

    return make


@contextmanager
def index_ties(model: Any) -> Iterator[list[int]]:
    """While inside: transformers' indexers of `model` counted as they choose, [queries that see more than k keys,
    those whose k-th and (k+1)-th visible index scores are equal] (a tie at the cut: torch.topk picks either)."""
    counts, inside = [0, 0], []
    original = torch.Tensor.topk

    def counted(self: torch.Tensor, k: int, *args: Any, **kwargs: Any) -> Any:
        if inside and self.shape[-1] > k:
            top = original(self, k + 1, dim=-1).values
            sees_more = top[..., k] > -1e30  # masked keys are -inf (or the dtype's lowest)
            counts[0] += int(sees_more.sum())
            counts[1] += int((sees_more & (top[..., k - 1] == top[..., k])).sum())
        return original(self, k, *args, **kwargs)

    hooks = []
    for module in model.modules():
        if type(module).__name__.endswith("Indexer"):
            hooks.append(module.register_forward_pre_hook(lambda *_: inside.append(1)))  # returns None: inputs kept
            hooks.append(module.register_forward_hook(lambda *_: inside.clear()))  # None: the output kept
    torch.Tensor.topk = counted  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        torch.Tensor.topk = original  # type: ignore[method-assign]
        for hook in hooks:
            hook.remove()


def test_ties_go_to_the_earlier_position() -> None:
    scores = torch.tensor([[0.0, 0.0, 0.0, 9.0, 9.0],
                           [0.0, 1.0, 2.0, 1.0, 0.0],
                           [0.5, 0.5, 0.5, 0.5, 0.5]])
    # queries at positions 2, 3, 4 (the last row sees all 5 keys; keys past a query's position are never kept)
    kept = top_keys(scores, first=2, k=2)
    assert kept.tolist() == [[True, True, False, False, False],
                             [False, True, True, False, False],
                             [True, True, False, False, False]]
    assert top_keys(scores, first=0, k=2)[:2].tolist() == [[True, False, False, False, False],
                                                            [True, True, False, False, False]]  # sees <= k: all


def test_a_query_keeps_its_keys_whatever_follows_it() -> None:
    """A query's choice over keys [0, p] is the same whatever the keys past p score (a block ending later sees them)."""
    torch.manual_seed(0)
    scores = torch.relu(torch.randn(16, 48)).round(decimals=1)  # many exact ties
    longer = torch.cat([scores, torch.rand(16, 32) + 5], dim=1)  # later keys, higher scores, all past the queries
    assert torch.equal(top_keys(scores, first=20, k=6), top_keys(longer, first=20, k=6)[:, :48])


PUBLISHED = {  # transformers 5.24's config defaults: the published sizes (no published config.json was found offline)
    "glm_moe_dsa": dict(hidden=6144, heads=64, layers=78, experts=256, index=(32, 128, 2048), interleaved=True,
                        latent=(2048, 512, 192, 64, 256), groups=(1, 1), eps=1e-5),
    "deepseek_v32": dict(hidden=7168, heads=128, layers=61, experts=256, index=(64, 128, 2048), interleaved=False,
                         latent=(1536, 512, 128, 64, 128), groups=(8, 4), eps=1e-6),
}


def published_config(model_type: str) -> dict[str, Any]:
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type).to_dict()
    return {**config, "architectures": [ARCHS[model_type]]}


@pytest.mark.parametrize("model_type", sorted(ARCHS))
def test_spec_of_transformers_defaults(model_type: str) -> None:
    config, want = published_config(model_type), PUBLISHED[model_type]
    spec = get_architecture(config, "config.json").spec(config, "config.json")
    m, moe = spec.mla, spec.moe
    assert m is not None and m.indexer is not None
    assert (spec.hidden_size, spec.attention.num_heads, spec.num_layers, moe.num_experts) == (
        want["hidden"], want["heads"], want["layers"], want["experts"])
    assert (m.indexer.n_heads, m.indexer.head_dim, m.indexer.topk) == want["index"]
    assert m.indexer.interleaved_rope == want["interleaved"] and m.interleaved_rope
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == want["latent"]
    assert (moe.n_group, moe.topk_group, spec.rms_norm_eps) == (*want["groups"], want["eps"])
    assert spec.moe_layers == (False,) * 3 + (True,) * (want["layers"] - 3)


@pytest.mark.parametrize(("fields", "shared"), [
    (dict(indexer_types=["full", "shared", "full", "full"]), (1,)),
    (dict(index_topk_pattern="FSFS"), (1, 3)),
    (dict(index_topk_freq=2), (2,)),  # full where max(i - 2 + 1, 0) % 2 == 0 (index_skip_topk_offset 2): 0, 1, 3
])
def test_shared_indexer_layers_are_read_as_transformers_derives_them(fields: dict[str, Any],
                                                                     shared: tuple[int, ...]) -> None:
    from transformers import GlmMoeDsaConfig

    config = {**published_config("glm_moe_dsa"), "num_hidden_layers": 4, "mlp_layer_types": None,
              "indexer_types": None, **fields}
    spec = get_architecture(config, "config.json").spec(config, "config.json")
    assert spec.mla is not None and spec.mla.indexer is not None and spec.mla.indexer.shared == shared
    types = GlmMoeDsaConfig(num_hidden_layers=4, **fields).indexer_types  # transformers' own derivation
    assert tuple(i for i, kind in enumerate(types) if kind == "shared") == shared


def test_a_shared_first_layer_is_refused_in_one_line() -> None:
    config = {**published_config("glm_moe_dsa"), "num_hidden_layers": 2, "mlp_layer_types": None,
              "indexer_types": ["shared", "full"]}
    with pytest.raises(UnsupportedModelError, match="the first layer has no earlier layer's key choice") as err:
        get_architecture(config, "config.json").spec(config, "config.json")
    assert "\n" not in str(err.value)


def test_shared_layers_match_transformers_and_chunked_equals_one_pass(tmp_path: Path) -> None:
    """GLM-5 with layer 1 reusing layer 0's choice (no indexer tensors of its own): fp32 against transformers (no tie
    at its cut); bf16 on one indexer head: chunked prefill == one pass."""
    from moeserve.checkpoint.folder import open_checkpoint

    folder = write_tiny(tmp_path / "fp32", "glm_moe_dsa", torch.float32, indexer_types=["full", "shared", "full"])
    assert not any(".layers.1.self_attn.indexer." in n for n in open_checkpoint(folder).tensors)
    ref = hf_model(folder, torch.float32)
    with index_ties(ref) as ties:
        choices = X.assert_matches_transformers(folder, ref, PROMPTS)
    assert ties[0] > 0 and ties[1] == 0, ties
    assert "1 layers reuse the choice of the layer before them" in choices["latent attention"]
    # two latent groups: the shared layer keeps no indexer keys
    assert "2 latent attention (40 values per token) + indexer keys" in choices["KV cache"]
    assert "for 1 latent attention (40 values per token) layers" in choices["KV cache"]
    assert "(3 layers x 56 values: kv_lora_rank 32 + rope 8 + indexer key 16 in 2 of them)" in choices["KV per token"]
    bf16 = write_tiny(tmp_path / "bf16", "glm_moe_dsa", torch.bfloat16, index_n_heads=1,
                      indexer_types=["full", "shared", "full"])
    whole = X.run_together(bf16, [long_prompt()], max_model_len=256)
    X.assert_chunked_equals_one_pass(bf16, long_prompt(), (37,), whole, max_model_len=256)


@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("model_type", sorted(ARCHS))
def test_tiny_matches_transformers(tiny, model_type: str, kernels: str) -> None:
    """fp32, three prompts decoded together; transformers' indexers see no tie at their cut."""
    folder = tiny(model_type)
    ref = hf_model(folder, torch.float32)
    with index_ties(ref) as ties:
        choices = X.assert_matches_transformers(folder, ref, PROMPTS, kernels=kernels)
    if ties[0]:  # transformers ran here (not cached from the other kernels' run)
        assert ties[1] == 0, f"{ties[1]} of {ties[0]} queries tie at transformers' cut"
    assert "DeepSeek Sparse Attention" in choices["latent attention"]
    assert "indexer keys (16 values per token)" in choices["KV cache"]


def test_the_key_choice_is_tested(tiny, tmp_path: Path) -> None:
    """The same checkpoint with index_topk raised past every prompt (plain MLA) no longer matches transformers."""
    import json
    import shutil

    folder = tiny("glm_moe_dsa")
    dense = shutil.copytree(folder, tmp_path / "dense")
    config = json.loads((dense / "config.json").read_text())
    (dense / "config.json").write_text(json.dumps({**config, "index_topk": 512}))
    with pytest.raises(AssertionError):
        X.assert_matches_transformers(dense, hf_model(folder, torch.float32), PROMPTS)


def long_prompt() -> list[int]:
    return X.random_prompts(1, (150,))[0]


def test_one_head_ties_are_everywhere_in_transformers(tiny) -> None:
    """The bf16 checks below run on a model whose index scores tie at the cut for many queries."""
    ref = hf_model(tiny("glm_moe_dsa", torch.bfloat16, heads=1), torch.bfloat16)
    with index_ties(ref) as ties, torch.no_grad():
        ref(torch.tensor([long_prompt()]))
    assert ties[1] > ties[0] // 4, ties  # 177 of 390 (3 layers x the 130 positions past index_topk 20)


@pytest.mark.parametrize("model_type", sorted(ARCHS))
def test_chunked_prefill_and_offloaded_equal_one_pass_resident(tiny, model_type: str) -> None:
    """DeepSeek-V3.2's offloaded experts: the FP8 test below."""
    folder = tiny(model_type, torch.bfloat16, heads=1)
    whole = X.run_together(folder, [long_prompt()], max_model_len=256)
    X.assert_chunked_equals_one_pass(folder, long_prompt(), (37, 64), whole, max_model_len=256)
    assert "DeepSeek Sparse Attention" in whole.choices["decode step"]  # the fused step declines the layer
    if model_type == "glm_moe_dsa":
        X.assert_offloaded_equals_resident(folder, X.random_prompts(3, (40, 5, 23)), max_model_len=256)


def test_prefix_cache_hit_equals_a_cold_run(tiny) -> None:
    """A second request sharing 64 prompt tokens (4 blocks of latent rows and indexer keys) takes them from the
    cache: its numbers are those of a run without prefix caching."""
    first, second = X.random_prompts(2, (70, 30))
    choices = X.assert_prefix_hit_equals_cold(tiny("glm_moe_dsa", torch.bfloat16, heads=1), first,
                                              first[:64] + second, 64, max_model_len=256)
    assert "indexer keys (16 values per token)" in choices["KV cache"]


def test_batched_and_preempted_sequences_keep_their_solo_numbers(tiny) -> None:
    folder = tiny("glm_moe_dsa", torch.bfloat16, heads=1)
    X.assert_batched_and_preempted_equal_solo(folder, [(0, p) for p in X.random_prompts(8, (50, 33, 9))], 8, 12, 96)


def test_indexer_keys_per_token_are_logged(tiny) -> None:
    llm = LLM(str(tiny("deepseek_v32")), skip_tokenizer_init=True, dtype="float32", max_model_len=64)
    line = llm.engine.choices["KV per token"]
    llm.engine.close()
    # 3 layers x (32 latent + 8 rope + 16 indexer key) fp32 values
    assert line.startswith("672 bytes/token in the latent cache (3 layers x 56 values: kv_lora_rank 32 + rope 8 + "
                           "indexer key 16)"), line


def is_fp8_linear(name: str) -> bool:
    """What DeepSeek-V3.2's FP8 checkpoint stores in FP8 (vLLM reads these Linears with the checkpoint's scheme):
    every attention, indexer (wq_b, wk) and MLP projection; not indexer.weights_proj (unquantized, run in fp32), the
    router, lm_head, norms or embeddings."""
    module = name.removesuffix(".weight").rsplit(".", 1)[-1] if name.endswith(".weight") else ""
    return ("_proj" in module or module in ("wq_b", "wk")) and module != "weights_proj"  # kv_a_proj_with_mqa too


def write_fp8(folder: Path, model_type: str = "deepseek_v32") -> tuple[Path, Path]:
    """(the tiny model in bf16 with every `is_fp8_linear` weight FP8 in 32 x 32 blocks, its reference: the same model
    with those weights replaced by a numpy decoder's dequantization, fp32). Widths 72 / 40 leave partial blocks."""
    from tests.fixtures import checkpoints as C

    src = write_tiny(folder / "bf16", model_type, torch.bfloat16, intermediate_size=72, moe_intermediate_size=40)
    return C.quantized_pair(src, folder, is_fp8_linear, C.FP8_CONFIG)


def test_fp8_checkpoint_matches_transformers_and_its_experts_stay_fp8(tmp_path: Path) -> None:
    """FP8 blocks as DeepSeek-V3.2 ships them: fp32 against transformers on an independent dequantization of the
    same bytes (tokens equal, logprobs within 1e-4); bf16 with 3 expert slots == resident, the experts FP8 units."""
    from moeserve.checkpoint.folder import open_checkpoint

    quantized, reference = write_fp8(tmp_path)
    names = open_checkpoint(quantized).tensors
    for kind in ("self_attn.indexer.wq_b", "self_attn.indexer.wk", "self_attn.q_b_proj", "mlp.experts.3.down_proj"):
        assert names[f"model.layers.1.{kind}.weight"].dtype_code == "F8_E4M3", kind
    assert names["model.layers.1.self_attn.indexer.weights_proj.weight"].dtype_code == "BF16"  # read into fp32
    ref = hf_model(reference, torch.float32)
    with index_ties(ref) as ties:
        choices = X.assert_matches_transformers(quantized, ref, PROMPTS)
    assert ties[0] > 0 and ties[1] == 0, ties
    assert "fp8" in choices["experts"].lower()
    X.assert_offloaded_equals_resident(quantized, PROMPTS, max_model_len=256)


def write_nvfp4(folder: Path) -> tuple[Path, Path]:
    """(a tiny GLM-5 as ModelOpt exports NVFP4, hf_quant_config.json: the Linears of `is_fp8_linear` in NVFP4 (group
    16; q_lora_rank 32 so every input width is a multiple of it), the router, lm_head and indexer.weights_proj as
    stored; its reference: those weights dequantized by torchao's NVFP4Tensor in fp32)."""
    from tests.fixtures import checkpoints as C

    src = write_tiny(folder / "bf16", "glm_moe_dsa", torch.bfloat16, q_lora_rank=32)
    hf_quant = {**C.MODELOPT_HF_QUANT_CONFIG, "quantization": {
        **C.MODELOPT_HF_QUANT_CONFIG["quantization"], "exclude_modules": ["lm_head", "*.mlp.gate", "*weights_proj"]}}
    reference = functools.partial(C.nvfp4_modelopt_reference, dtype=torch.float32)
    return C.quantized_pair(src, folder, is_fp8_linear, None, C.nvfp4_modelopt_quantize, reference,
                            {"hf_quant_config.json": hf_quant})


def test_nvfp4_checkpoint_matches_transformers_on_its_dequantization(tmp_path: Path) -> None:
    """GLM-5 as NVFP4 ships it (ModelOpt): fp32 against transformers on an independent dequantization of the same
    bytes; the experts stay NVFP4."""
    from moeserve.checkpoint.folder import open_checkpoint

    quantized, reference = write_nvfp4(tmp_path)
    names = open_checkpoint(quantized).tensors
    assert "model.layers.1.self_attn.indexer.wq_b.weight_scale_2" in names
    ref = hf_model(reference, torch.float32)
    with index_ties(ref) as ties:
        choices = X.assert_matches_transformers(quantized, ref, PROMPTS)
    assert ties[0] > 0 and ties[1] == 0, ties
    assert "nvfp4" in choices["experts"].lower()


@pytest.mark.slow  # ~40 s of CPU: a 1.3 GB checkpoint written, transformers' fp32 forward at GLM-5's dimensions
def test_glm5_real_dimensions_match_transformers(tmp_path: Path) -> None:
    """GLM-5's dimensions (tests/fixtures/real_dims.py GLM_5: one MoE layer, 32 indexer heads of 128, index_topk cut
    to 16), fp32: transformers' greedy tokens and logprobs within 1e-4, no index-score tie at transformers' cut."""
    from tests.fixtures.real_dims import write_glm5

    folder = write_glm5(tmp_path / "glm5")
    ten = [3, 17, 42, 9, 250, 1000, 77, 5, 4000, 12]
    ref = hf_model(folder, torch.float32)
    with index_ties(ref) as ties:
        choices = X.assert_matches_transformers(folder, ref, [ten * 2 + ten[:4], [11, 5, 77]], 4, max_model_len=64)
    assert ties[0] > 0 and ties[1] == 0, ties
    assert "32 indexer heads of 128" in choices["latent attention"]

