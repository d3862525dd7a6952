"""DeepSeek-V4 (models/archs/deepseek_v4.py): the spec read from both config.json spellings, its stored formats
(FP8 with E8M0 scales, MXFP4 experts as DeepSeek ships them) against transformers' decoders, `plan` from the
published config alone at 24 and 64 GB, and the served model's parts against transformers' (its engine runs:
tests/models/test_deepseek_v4_serving.py). The tensor map
against the headers transformers writes: tests/cli/test_config_only.py (case deepseek_v4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moeserve.formats.catalog import DeepseekMxfp4Format, Fp8BlockE8m0Format
from moeserve.formats.quant_config import load_quant_scheme
from moeserve.models.registry import get_architecture
from tests.cli.test_config_only import _lines
from tests.fixtures.deepseek_v4 import TINY, published_config


def _spec(config: dict):
    return get_architecture(config, "config.json").spec(config, "config.json")


def test_the_published_spelling_reads_as_transformers_reads_it() -> None:
    """The published config.json (compress_ratios, num_hash_layers, qk_rope_head_dim, rope_scaling) and the one
    transformers' DeepseekV4Config writes from it (layer_types, mlp_layer_types, partial_rotary_factor,
    rope_parameters {main, compress}) give one spec, and it says what transformers' config says."""
    from transformers import DeepseekV4Config

    published = published_config(256)
    hf = DeepseekV4Config(**{k: v for k, v in published.items() if k != "quantization_config"})
    written = {**hf.to_dict(), "architectures": published["architectures"]}
    spec = _spec(published)
    assert _spec(written) == spec
    ca = spec.compressed
    assert [{0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}[r]
            for r in ca.ratios] == hf.layer_types
    assert [L in spec.moe.hash_layers for L in range(spec.num_layers)] == [t == "hash_moe" for t in hf.mlp_layer_types]
    assert [i for i, x in enumerate(ca.indexed) if x] == [i for i, t in enumerate(hf.layer_types)
                                                          if t == "compressed_sparse_attention"]
    assert spec.rope.rotary_dim(spec.attention.head_dim) == hf.qk_rope_head_dim == 64
    compress = hf.rope_parameters["compress"]
    assert ca.compress_rope.theta == compress["rope_theta"] and ca.compress_rope.rope_type == compress["rope_type"]
    assert ca.compress_rope.param("attention_factor") == compress["attention_factor"] == 1.0
    assert spec.rope.theta == hf.rope_parameters["main"]["rope_theta"] and spec.rope.rope_type == "default"
    assert (spec.mhc.streams, spec.mhc.sinkhorn_iters, spec.mhc.eps) == (hf.hc_mult, hf.hc_sinkhorn_iters, hf.hc_eps)


def test_the_tiny_config_reads_its_layer_kinds() -> None:
    from transformers import DeepseekV4Config

    config = {**DeepseekV4Config(**TINY).to_dict(), "architectures": ["DeepseekV4ForCausalLM"]}
    spec = _spec(config)
    assert spec.compressed.ratios == (0, 4, 8, 4) and spec.compressed.indexed == (False, True, False, True)
    assert spec.moe.hash_layers == (0,) and spec.moe.routing == "sqrtsoftplus"


def _fp8_dequantizer():
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize.__new__(Fp8Dequantize)  # its decoders read no state


def test_mxfp4_experts_decode_as_transformers_unpacks_them() -> None:
    """Codes two per int8 byte (the low nibble first) times 2**(scale - 127) per 32 inputs: transformers' FP4 table
    and unpacking (finegrained_fp8 Fp8Dequantize._unpack_fp4) applied by hand."""
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(-128, 128, (6, 32), generator=g, dtype=torch.int8)
    scale_bytes = torch.randint(110, 140, (6, 2), generator=g, dtype=torch.uint8)
    want = _fp8_dequantizer()._unpack_fp4(packed) * torch.exp2(scale_bytes.float() - 127).repeat_interleave(32, -1)
    out = torch.empty(6, 64, dtype=torch.float32)
    DeepseekMxfp4Format().dequantize({"weight": packed, "scale": scale_bytes.view(torch.float8_e8m0fnu)}, out)
    assert torch.equal(out, want)


def test_fp8_with_e8m0_scales_decodes_per_block() -> None:
    g = torch.Generator().manual_seed(1)
    weight = (torch.randn(8, 12, generator=g) * 4).to(torch.float8_e4m3fn)
    scale_bytes = torch.randint(118, 134, (2, 3), generator=g, dtype=torch.uint8)
    want = weight.float() * torch.exp2(scale_bytes.float() - 127).repeat_interleave(4, 0).repeat_interleave(4, 1)
    out = torch.empty(8, 12, dtype=torch.float32)
    Fp8BlockE8m0Format(block_size=(4, 4)).dequantize({"weight": weight, "scale": scale_bytes.view(
        torch.float8_e8m0fnu)}, out)
    assert torch.equal(out, want)


def test_the_published_scheme_is_fp8_with_mxfp4_experts(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(published_config(256)))
    scheme = load_quant_scheme(tmp_path)
    assert isinstance(scheme.format_for("model.layers.3.ffn.experts.7.w1"), DeepseekMxfp4Format)
    assert isinstance(scheme.format_for("model.layers.3.ffn.shared_experts.w1"), Fp8BlockE8m0Format)
    assert isinstance(scheme.format_for("model.layers.3.attn.wq_a"), Fp8BlockE8m0Format)


@pytest.mark.parametrize("experts", [256, 160])
def test_plan_from_the_published_config_at_24_and_64_gb(experts: int, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    """As shipped (FP8 dense weights, MXFP4 experts of 12.75 MiB): placed at 24 GB with some experts in RAM and the
    rest read from disk, at 64 GB with several times as many; the compressed entries cost bytes per token."""
    (tmp_path / "config.json").write_text(json.dumps(published_config(experts)))
    placed = {}
    for gb in (24, 64):
        lines = _lines(capsys, ["plan", str(tmp_path), "--memory-gb", str(gb), "--device", "cpu", "--no-probe"])
        assert lines[0] == "exit 0", lines
        placement = next(line for line in lines if line.startswith("placement:")).split()
        assert placement[3] == str(43 * experts)
        placed[gb] = int(placement[1])
        state = next(line for line in lines if line.startswith("sequence state:"))
        assert int(state.split()[2]) > 0, state  # bytes/token of the compressed entries
    assert 0 < placed[24] and 3 * placed[24] < placed[64] < 43 * experts, placed


def _routers(dtype: torch.dtype):
    """transformers' top-k and hash routers of the tiny config (random weights, correction bias and table) in
    `dtype`, and moeserve's rules over the same tensors."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
        DeepseekV4HashRouter,
        DeepseekV4TopKRouter,
    )

    from moeserve.models.experts.moe import choose_routing
    from moeserve.models.numerics import Numerics

    config = DeepseekV4Config(**TINY)
    torch.manual_seed(0)
    topk, hashed = DeepseekV4TopKRouter(config).to(dtype), DeepseekV4HashRouter(config).to(dtype)
    with torch.no_grad():
        for router in (topk, hashed):
            router.weight.normal_(0.0, 0.5)
        topk.e_score_correction_bias = torch.randn(TINY["n_routed_experts"]) * 0.1  # a buffer, kept in fp32
        hashed.tid2eid.copy_(torch.rand(TINY["vocab_size"], TINY["n_routed_experts"]).argsort(-1)[:, :2])
    moe = _spec({**config.to_dict(), "architectures": ["DeepseekV4ForCausalLM"]}).moe
    ours = (choose_routing(moe, Numerics(cpp=False), topk.e_score_correction_bias),
            choose_routing(moe, Numerics(cpp=False), None, hashed.tid2eid))
    return (topk, hashed), ours


def _by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sqrtsoftplus_and_hash_routing_equal_transformers(dtype: torch.dtype) -> None:
    """The experts and weights of DeepseekV4TopKRouter and DeepseekV4HashRouter, bit for bit, from the same logits;
    the routed pairs carry the same weights."""
    (topk, hashed), (rule, by_token) = _routers(dtype)
    x = torch.randn(40, TINY["hidden_size"], dtype=dtype)
    token_ids = torch.randint(0, TINY["vocab_size"], (40,))
    for theirs, ours, args in ((topk, rule, ()), (hashed, by_token, (token_ids,))):
        logits, want_w, want_ids = theirs(x, *args)
        if args:
            routed = ours.route(x, logits, token_ids)
            got_ids = hashed.tid2eid[token_ids]
            got_w = ours.weights(ours.scores(logits), got_ids)
        else:
            got_w, got_ids = ours.weights_and_ids(logits)
            routed = ours.route(x, logits)
        w1, i1 = _by_expert(got_w, got_ids)
        w2, i2 = _by_expert(want_w, want_ids)
        assert torch.equal(i1, i2) and torch.equal(w1, w2) and w1.dtype == dtype
        assert torch.equal(torch.sort(routed.ids, dim=-1).values, torch.sort(want_ids, dim=-1).values)


def test_sqrtsoftplus_routing_of_a_token_is_the_same_in_any_batch() -> None:
    """Batch-invariant numerics: a token's experts and weights alone equal its row in a batch of 67 (the scores in
    fixed row blocks), bf16."""
    from moeserve.models.experts.moe import SqrtSoftplus
    from moeserve.models.numerics import Numerics

    (_topk, _hashed), (rule, _by_token) = _routers(torch.bfloat16)
    invariant = SqrtSoftplus(rule.spec, rule.bias, Numerics(cpp=False, batch_invariant=True, row_block=16))
    logits = torch.randn(67, TINY["n_routed_experts"], dtype=torch.bfloat16) * 3
    weights, ids = invariant.weights_and_ids(logits)
    for i in (0, 17, 66):
        w, j = invariant.weights_and_ids(logits[i:i + 1])
        assert torch.equal(_by_expert(w, j)[0], _by_expert(weights[i:i + 1], ids[i:i + 1])[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hyper_connections_equal_transformers(dtype: torch.dtype) -> None:
    """MhcMix and MhcHead against transformers' DeepseekV4HyperConnection / DeepseekV4HyperHead (fp32 parameters,
    streams in `dtype`): the part's input, post, the Sinkhorn-projected comb and the mixed streams, bit for bit; and
    in fixed row blocks (batch-invariant numerics) a token's row alone equals its row in the batch."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
        DeepseekV4HyperConnection,
        DeepseekV4HyperHead,
    )

    from moeserve.models.layers.mhc import MhcHead, MhcMix
    from moeserve.models.numerics import Numerics

    config = DeepseekV4Config(**{**TINY, "hc_mult": 3})
    torch.manual_seed(0)
    hc, head = DeepseekV4HyperConnection(config), DeepseekV4HyperHead(config)
    with torch.no_grad():
        for p in (hc.fn, hc.base, hc.scale, head.hc_fn, head.hc_base, head.hc_scale):
            p.normal_(0.0, 0.5)
    h = torch.randn(1, 37, 3, TINY["hidden_size"], dtype=dtype)
    out = torch.randn(37, TINY["hidden_size"], dtype=dtype)
    want_post, want_comb, want_x = hc(h)
    want_h = want_post.to(dtype).unsqueeze(-1) * out.unsqueeze(0).unsqueeze(-2) + torch.matmul(
        want_comb.to(dtype).transpose(-1, -2), h)
    mix = MhcMix(hc.fn.data, hc.base.data, hc.scale.data, 3, config.hc_sinkhorn_iters, config.hc_eps,
                 config.rms_norm_eps)
    x, post, comb = mix.read(h[0])
    assert torch.equal(x, want_x[0]) and torch.equal(post, want_post[0]) and torch.equal(comb, want_comb[0])
    assert torch.equal(MhcMix.add(h[0], out, post, comb), want_h[0])
    collapse = MhcHead(head.hc_fn.data, head.hc_base.data, head.hc_scale.data, config.hc_eps, config.rms_norm_eps)
    assert torch.equal(collapse(h[0]), head(h)[0])
    # batch-invariant numerics (fixed blocks of 8 rows): a token alone reads as in the batch
    blocks = Numerics(batch_invariant=True, row_block=8)
    mix = MhcMix(hc.fn.data, hc.base.data, hc.scale.data, 3, config.hc_sinkhorn_iters, config.hc_eps,
                 config.rms_norm_eps, blocks)
    collapse = MhcHead(head.hc_fn.data, head.hc_base.data, head.hc_scale.data, config.hc_eps, config.rms_norm_eps,
                       blocks)
    batched, alone = mix.read(h[0]), mix.read(h[0, 20:21])
    assert all(torch.equal(a, b[20:21]) for a, b in zip(alone, batched))
    assert torch.equal(collapse(h[0, 20:21]), collapse(h[0])[20:21])


def _compressors(dtype: torch.dtype):
    """transformers' CSA and HCA compressors of the tiny config with yarn on the compressed layers' rotary (as
    DeepSeek-V4-Flash), random gate biases, in `dtype` (their fp32-kept parts in fp32)."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
        DeepseekV4CSACompressor,
        DeepseekV4HCACompressor,
    )

    yarn = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}
    config = DeepseekV4Config(**TINY, rope_parameters=yarn)
    torch.manual_seed(0)
    csa, hca = DeepseekV4CSACompressor(config), DeepseekV4HCACompressor(config)
    with torch.no_grad():
        for module in (csa, csa.indexer, hca):
            module.position_bias.normal_(0.0, 1.0)
            module.kv_norm.weight.normal_(1.0, 0.2)
    for module in (csa, hca):  # the Linears in `dtype`; gate biases, norms and rotary tables stay fp32
        for part in module.modules():
            if isinstance(part, torch.nn.Linear):
                part.to(dtype)
    return config, csa, hca


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compressed_entries_equal_transformers_and_any_chunking(dtype: torch.dtype) -> None:
    """The entries of a 27-token prompt (6 windows of 4, 3 of 8, the rest open) bit for bit as transformers'
    compressors emit them (CSA, HCA; yarn rotary; the indexer's compressor is CSA's at index_head_dim), and the same entries window by window (each from
    its own tokens and, overlapping, the window before): what chunked prefill and decode compute."""
    from moeserve.models.mixers.compressor import Compressor, RopeTable

    config, csa, hca = _compressors(dtype)
    x = torch.randn(1, 27, TINY["hidden_size"], dtype=dtype)
    positions = torch.arange(27)[None]
    spec = _spec({**config.to_dict(), "architectures": ["DeepseekV4ForCausalLM"]})
    rope = RopeTable(spec.compressed.compress_rope, 8, 64, torch.device("cpu"))
    q_residual = torch.randn(1, 27, TINY["q_lora_rank"], dtype=dtype)
    with torch.no_grad():
        cases = ((csa, 4, 32, True, csa(x, q_residual, positions, None, 0)[0][0, 0]),
                 (hca, 8, 32, False, hca(x, q_residual, positions, None, 0)[0][0, 0]))
    for module, ratio, width, overlap, want in cases:
        ours = Compressor(module.position_bias.data, module.kv_norm.weight.data, ratio, width, overlap, rope,
                          config.rms_norm_eps)
        with torch.no_grad():
            kv, gate = module.kv_proj(x[0]), module.gate_proj(x[0])
        n = 27 // ratio
        got = ours.entries(kv[: n * ratio], gate[: n * ratio], 0)
        assert got.dtype == dtype and torch.equal(got, want), (ratio, (got.float() - want.float()).abs().max())
        for w in range(n):
            lo = max(w - 1, 0) * ratio if overlap else w * ratio
            assert torch.equal(ours.entries(kv[lo: (w + 1) * ratio], gate[lo: (w + 1) * ratio], w), want[w: w + 1])


def _captured_attention(seed: int = 0):
    """A float32 tiny DeepseekV4Model (yarn on the compressed layers), a 27-token prompt run through it; per layer
    its attention's input, keyword arguments and output."""
    from transformers import DeepseekV4Config, DeepseekV4Model

    yarn = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}
    # 16 indexer heads: an index score is 0 (a tie) only where all 16 relu(q . k) are
    config = DeepseekV4Config(**{**TINY, "index_n_heads": 16}, rope_parameters=yarn)
    torch.manual_seed(seed)
    model = DeepseekV4Model(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "position_bias")):
                p.normal_(0.0, 1.0)
    seen = {}

    def hook(module, args, kwargs, output):  # noqa: ANN001, ANN202
        seen[module.layer_idx] = (kwargs["hidden_states"] if "hidden_states" in kwargs else args[0], kwargs,
                                  output[0])

    for layer in model.layers:
        layer.self_attn.register_forward_hook(hook, with_kwargs=True)
    with torch.no_grad():
        model(torch.randint(0, TINY["vocab_size"], (1, 27)))
    return config, model, seen


def test_compressed_attention_equals_transformers() -> None:
    """Each layer kind's attention (sliding window only, heavily compressed, compressed sparse with its indexer's
    choice of 4 of 6 entries) rebuilt from the pure functions over transformers' own projections equals its output
    bit for bit (float32; the prompt's index scores have no tie at the cut, checked)."""
    from moeserve.models.layers.mhc import unweighted_rms_norm
    from moeserve.models.mixers.compressed_attention import (
        attend,
        choose_entries,
        grouped_output,
        index_scores,
        visible_entries,
    )
    from moeserve.models.mixers.compressor import Compressor, RopeTable, rope_tail

    config, model, seen = _captured_attention()
    spec = _spec({**config.to_dict(), "architectures": ["DeepseekV4ForCausalLM"]})
    compress = RopeTable(spec.compressed.compress_rope, 8, 64, torch.device("cpu"))
    positions = torch.arange(27)
    for L, (x, kwargs, want) in seen.items():
        attn, x = model.layers[L].self_attn, x[0]
        cos, sin = (t[0] for t in kwargs["position_embeddings"][attn.rope_layer_type])
        with torch.no_grad():
            q_resid = attn.q_a_norm(attn.q_a_proj(x))
            q = rope_tail(unweighted_rms_norm(attn.q_b_proj(q_resid).view(27, 4, 32), config.rms_norm_eps),
                          cos.unsqueeze(1), sin.unsqueeze(1))
            rows = rope_tail(attn.kv_norm(attn.kv_proj(x)), cos, sin)
            entries, kept = rows[:0], torch.zeros(27, 0, dtype=torch.bool)
            ratio, indexed = spec.compressed.ratios[L], spec.compressed.indexed[L]
            if ratio:
                c, n = attn.compressor, 27 // ratio
                entries = Compressor(c.position_bias, c.kv_norm.weight, ratio, 32, indexed, compress,
                                     config.rms_norm_eps).entries(c.kv_proj(x)[: n * ratio], c.gate_proj(x)[: n * ratio], 0)
                kept = visible_entries(positions, n, ratio)
            if indexed:
                ix = attn.compressor.indexer
                keys = Compressor(ix.position_bias, ix.kv_norm.weight, ratio, 16, True, compress,
                                  config.rms_norm_eps).entries(ix.kv_proj(x)[: n * ratio], ix.gate_proj(x)[: n * ratio], 0)
                ccos, csin = compress.at(positions, x.dtype)
                qi = rope_tail(ix.q_b_proj(q_resid).view(27, 16, 16), ccos.unsqueeze(1), csin.unsqueeze(1))
                scores = index_scores(qi, keys, ix.scorer.weights_proj(x).float() * 16**-0.5, 16)
                ranked = torch.sort(scores.masked_fill(~kept, float("-inf")), dim=-1, descending=True).values
                assert not (ranked[kept.sum(-1) > 4, 3] == ranked[kept.sum(-1) > 4, 4]).any()  # no tie at the cut
                kept = choose_entries(scores, kept, 4)
            out = attend(q, rows, entries, positions, config.sliding_window, kept, attn.sinks, 32**-0.5)
            got = attn.o_b_proj(grouped_output(out, cos, sin, attn.o_a_proj.weight, 2))
        assert torch.equal(got, want[0]), (L, (got - want[0]).abs().max())


def test_the_indexer_breaks_ties_by_position() -> None:
    from moeserve.models.mixers.compressed_attention import choose_entries

    scores = torch.tensor([[0.0, 1.0, 0.0, 0.0, 2.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    visible = torch.tensor([[True] * 5, [True, True, True, False, False]])
    kept = choose_entries(scores, visible, 3)
    assert kept.tolist() == [[True, True, False, False, True], [True, True, True, False, False]]


def test_shipped_formats_load_as_transformers_dequantizes_them(tmp_path: Path) -> None:
    """A tiny checkpoint stored as DeepSeek-V4-Flash ships (E8M0-scaled FP8 Linears, MXFP4 routed experts, bf16
    compressor projections): read_model accepts it, the expert plan reads every routed expert's MXFP4 tensors, and an
    expert projection and an FP8 Linear dequantize to what transformers' Fp8Dequantize gives (bf16, bit for bit)."""
    from moeserve.checkpoint.folder import open_checkpoint
    from moeserve.models.experts.plans import expert_plan
    from moeserve.models.inventory import expert_tensor_names
    from moeserve.models.quantized import checkpoint_scheme, linear_format
    from moeserve.models.validate import read_model
    from tests.fixtures.deepseek_v4 import write_tiny_shipped

    ckpt = open_checkpoint(write_tiny_shipped(tmp_path / "shipped"))
    arch, spec = read_model(ckpt)
    names = expert_tensor_names(expert_plan(ckpt, arch, spec, torch.bfloat16))
    assert names == {n for n in ckpt.tensors if ".ffn.experts." in n} and len(names) == 4 * 8 * 3 * 2
    scheme, reference = checkpoint_scheme(ckpt), _fp8_dequantizer()
    for prefix, kind in (("model.layers.2.ffn.experts.5.w2", DeepseekMxfp4Format),
                         ("model.layers.1.attn.wq_b", Fp8BlockE8m0Format)):
        fmt = linear_format(ckpt, scheme, prefix)
        assert isinstance(fmt, kind)
        stored = {role: ckpt.reader.read(ckpt.tensors[f"{prefix}.{role}"]) for role in fmt.roles}
        out = torch.empty(fmt.dequantized_shape(stored), dtype=torch.bfloat16)
        fmt.dequantize(stored, out)
        want = reference._dequantize_one(stored["weight"], stored["scale"], output_dtype=torch.bfloat16)
        assert torch.equal(out, want), prefix


@pytest.mark.parametrize("shipped", [False, True])
def test_clamped_experts_equal_transformers(shipped: bool, tmp_path: Path) -> None:
    """The expert plan of a tiny checkpoint (bf16, or as shipped: MXFP4) computes an expert as transformers'
    DeepseekV4Experts does with the same dense weights (the clamp at swiglu_limit reached: inputs scaled up), bf16,
    bit for bit; the C++ ops are not used for it (they have no clamp)."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts

    from moeserve.checkpoint.folder import open_checkpoint
    from moeserve.models.experts.plans import expert_plan
    from moeserve.models.validate import read_model
    from tests.fixtures.deepseek_v4 import write_tiny_deepseek_v4, write_tiny_shipped

    folder = (write_tiny_shipped if shipped else write_tiny_deepseek_v4)(tmp_path / "ckpt")
    ckpt = open_checkpoint(folder)
    arch, spec = read_model(ckpt)
    plan = expert_plan(ckpt, arch, spec, torch.bfloat16)
    assert plan.math.why_not_fused() is not None
    config = DeepseekV4Config(**TINY)
    theirs = DeepseekV4Experts(config).to(torch.bfloat16)
    x = torch.randn(5, TINY["hidden_size"], dtype=torch.bfloat16) * 30  # past the clamp
    dense = _dense_expert(plan, ckpt, 2, 5)
    with torch.no_grad():
        theirs.gate_up_proj[5] = dense[0]
        theirs.down_proj[5] = dense[1]
        want = theirs(x, torch.full((5, 1), 5), torch.ones(5, 1, dtype=torch.bfloat16))
    assert torch.equal(plan.math.bind(_unit(plan, ckpt, 2, 5))(x), want)
    assert (torch.nn.functional.linear(x, dense[0]).abs() > config.swiglu_limit).any()  # the clamp is reached


def _dense_expert(plan, ckpt, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """Expert `expert` of `layer` as transformers holds it: gate_up [2I, H] (w1 rows, then w3), down [H, I], bf16,
    dequantized from the checkpoint's own tensors by its format."""
    from moeserve.models.quantized import checkpoint_scheme, linear_format

    scheme, dense = checkpoint_scheme(ckpt), []
    for w in ("w1", "w3", "w2"):
        prefix = f"model.layers.{layer}.ffn.experts.{expert}.{w}"
        fmt = linear_format(ckpt, scheme, prefix)
        stored = {role: ckpt.reader.read(ckpt.tensors[fmt.stored_name(prefix, role)]) for role in fmt.roles}
        out = torch.empty(fmt.dequantized_shape(stored), dtype=torch.bfloat16)
        fmt.dequantize(stored, out)
        dense.append(out)
    return torch.cat(dense[:2]), dense[2]


def _unit(plan, ckpt, layer: int, expert: int) -> tuple[torch.Tensor, ...]:  # noqa: ANN001
    """The unit the store would hold for the expert: its bytes read by the plan's source, as the layout's fields."""
    unit = torch.empty(plan.layout.nbytes, dtype=torch.uint8)
    plan.source(ckpt).read_unit(layer, expert, unit)
    return plan.layout.views(unit)
