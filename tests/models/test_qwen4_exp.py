"""Qwen3.8-Flash-Next (transformers' qwen4_exp).

- the n-gram hash (models/ngram_hash.py) against transformers' own functions and the buffers its save_pretrained
  writes: head vocabularies (primes), row offsets and hash multipliers;
- the spec reads what transformers writes (every tensor's shape checked by read_model) and config.json errors are
  one line;
- parameter counts from the config alone equal transformers' model built on the meta device at the flagship sizes;
- the parts against transformers' modules, then the whole model: fp32 tokens and log-probabilities, and in bf16
  chunked == unchunked, batched/preempted == alone, offloaded == resident, prefix hit == miss (tests/models/exactness.py).
tests/cli/test_config_only.py checks `plan` and `inspect` from its config against the checkpoint (CASES).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from moeserve.checkpoint.folder import open_checkpoint
from moeserve.errors import CheckpointError, MoeserveError
from moeserve.models.config_only import parameter_counts
from moeserve.models.ngram_hash import head_vocab_sizes, layer_multipliers, padded_rows
from moeserve.models.registry import get_architecture
from moeserve.models.validate import ngram_table_shards, read_model
from tests.fixtures.qwen4_exp import TINY_QWEN4_EXP, write_tiny_qwen4_exp
from tests.models import exactness as X

# The flagship's shapes: transformers' Qwen4ExpTextConfig defaults (hidden 2048, 40 layers, 512 experts top-10,
# vocabulary 248320) plus the fields it leaves unset, chosen here (no published config.json was found offline): one
# PLE layer of ple_embed_dim 2560 (16 heads of 160: a 51.2 B-parameter table), a 32-head indexer of dim 128, and
# Qwen3.5's rotary (a quarter of each head) so the rotated dims fit the index head.
FLAGSHIP_FIELDS = dict(eos_token_id=248046, ple_layer_ids=[1], ple_embed_dim=2560, indexer_n_heads=32,
                       indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=2048, indexer_compress_ratio=4,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                        "partial_rotary_factor": 0.25})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen4_exp(tmp_path_factory.mktemp("qwen4_exp") / "ckpt", torch.float32)


def test_ngram_hash_equals_transformers() -> None:
    from transformers.models.qwen4_exp import modeling_qwen4_exp as ref

    for base, layers, heads in ((1000, 3, 4), (20_000_000, 2, 2)):  # transformers' search is quadratic: few heads
        ours = head_vocab_sizes(base, layers, heads)
        for j in range(layers):
            assert ours[j] == tuple(ref._find_nth_prime_after(base - 1, j * heads + h + 1) for h in range(heads))
    for index in range(3):
        assert layer_multipliers(248320, 3, index, 1234) == ref._build_layer_multipliers(248320, 3, index,
                                                                                         1234).tolist()


def test_spec_equals_the_hash_buffers_transformers_wrote(tiny: Path) -> None:
    from safetensors.torch import load_file

    arch, spec = read_model(open_checkpoint(tiny))  # every served tensor's shape checked
    state = load_file(tiny / "model.safetensors")
    ng = spec.ngram
    assert ng is not None and ng.layers == (0, 2) and spec.hyper is not None and spec.hyper.streams == 3
    assert spec.qsa is not None and spec.qsa.budget == 8 and spec.linear_attention is not None
    assert spec.linear_attention.layers == (0, 2)
    for index, L in enumerate(ng.layers):
        prefix = f"model.layers.{L}.ple.ple_embedding."
        sizes = state[prefix + "ngram_heads_vocab_sizes"].tolist()
        assert list(ng.head_vocab_sizes[index]) == sizes
        assert state[prefix + "ngram_heads_offsets"].tolist() == [sum(sizes[:h]) for h in range(len(sizes))]
        assert layer_multipliers(spec.vocab_size, ng.ngram_size, index, ng.seed) == \
            state[prefix + "layer_multipliers"].tolist()
        table = [t for name, t in state.items() if name.startswith(prefix + "ngram_embedding.shard_")]
        assert sum(t.shape[0] for t in table) == ng.rows[index] == padded_rows(tuple(sizes), 16)


@pytest.mark.parametrize(("change", "message"), [
    ({"ple_layer_ids": [2]}, "ple_layer_ids [2] are not linear-attention layers"),
    ({"indexer_budget": 6}, "indexer_budget=6 is not a multiple of indexer_compress_ratio=4"),
    ({"indexer_head_dim": None}, "need indexer_head_dim"),
    ({"eos_token_id": None}, "'eos_token_id' must be set"),
    ({"ple_embed_dim": 30}, "ple_embed_dim=30 is not a multiple of the 4 n-gram heads"),
    ({"hc_count": 1}, "'hc_count' = 1 is out of range"),
])
def test_bad_config_fields_are_one_line(change: dict, message: str) -> None:
    config = {**TINY_QWEN4_EXP, "architectures": ["Qwen4ExpForCausalLM"], **change}
    with pytest.raises(CheckpointError, match=re.escape(message)) as err:
        get_architecture(config, "config.json").spec(config, "config.json")
    assert "\n" not in str(err.value)


def test_flagship_counts_equal_transformers_on_the_meta_device() -> None:
    """Every parameter and stored buffer of transformers' model at the flagship sizes, built on the meta device; the
    n-gram table apart: 51.2 B of 118.6 B."""
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    config = Qwen4ExpTextConfig(**FLAGSHIP_FIELDS)
    with torch.device("meta"):
        model = Qwen4ExpForCausalLM(config)
    stored = model.state_dict()
    data = {**config.to_dict(), "architectures": ["Qwen4ExpForCausalLM"]}
    arch = get_architecture(data, "config.json")
    counts = parameter_counts(arch, arch.spec(data, "config.json"))
    assert counts.total == sum(t.numel() for t in stored.values())
    assert counts.ngram_table == sum(t.numel() for name, t in stored.items() if "ngram_embedding" in name)


def _row_reader(ple_index: int, layer: int):  # noqa: ANN202
    """transformers' n-gram embedding of the tiny config whose table row r holds r: it returns the rows it reads."""
    from transformers import Qwen4ExpTextConfig
    from transformers.models.qwen4_exp import modeling_qwen4_exp as ref

    config = Qwen4ExpTextConfig(**TINY_QWEN4_EXP)
    embedding = ref.Qwen4ExpTextNGramEmbedding(config, TINY_QWEN4_EXP["ple_embed_dim"], layer, ple_index)
    table = embedding.ngram_embedding.weight
    with torch.no_grad():
        table.copy_(torch.arange(table.shape[0], dtype=torch.float32)[:, None].expand_as(table))
    return config, embedding


@pytest.mark.parametrize("ple_index", [0, 1])
def test_ngram_rows_equal_transformers_whole_and_in_steps(ple_index: int) -> None:
    """The rows each token reads (end-of-text ids inside the sequence included) equal the ones transformers' embedding
    reads, for the sequence in one forward and in steps through its cache (prompt chunks, then single tokens)."""
    from transformers import DynamicCache

    from moeserve.models.archs.qwen4_exp import qwen4_exp_spec
    from moeserve.models.ngram import NgramHash
    from moeserve.models.spec import ConfigReader

    spec = qwen4_exp_spec("Qwen4ExpForCausalLM", ConfigReader(dict(TINY_QWEN4_EXP), "config.json"), None)
    assert spec.ngram is not None
    layer = spec.ngram.layers[ple_index]
    config, embedding = _row_reader(ple_index, layer)
    ours = NgramHash.of(spec.ngram, spec.vocab_size, ple_index)
    tokens = torch.randint(0, spec.vocab_size, (23,), generator=torch.Generator().manual_seed(ple_index))
    tokens[[4, 5, 11, 20]] = spec.ngram.eos_token_id

    def rows_of(out: torch.Tensor) -> torch.Tensor:
        return out[0].view(out.shape[1], spec.ngram.heads, spec.ngram.head_dim)[..., 0].long()

    whole = ours.rows(ours.start_context(), tokens)
    assert torch.equal(whole, rows_of(embedding(tokens[None], None)))
    cache, context, got = DynamicCache(config=config), ours.start_context(), []
    for a, b in ((0, 1), (1, 7), (7, 8), (8, 21), (21, 22), (22, 23)):
        want = rows_of(embedding(tokens[None, a:b], cache))
        got.append(ours.rows(context, tokens[a:b]))
        assert torch.equal(got[-1], want), (a, b)
        context = ours.next_context(context, tokens[a:b])
    assert torch.equal(torch.cat(got), whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("last", [False, True])
def test_gated_residual_equals_transformers(dtype: torch.dtype, last: bool) -> None:
    """A hyper-connection's input and stream weights, and the residual update, bit for bit as transformers'
    Qwen4ExpTextGatedResidual (random weights, the norm's included), in float32 and bfloat16."""
    import torch.nn.functional as F
    from transformers import Qwen4ExpTextConfig
    from transformers.models.qwen4_exp import modeling_qwen4_exp as ref

    from moeserve.models.layers.hyper import GatedResidual

    torch.manual_seed(3)
    module = ref.Qwen4ExpTextGatedResidual(Qwen4ExpTextConfig(**TINY_QWEN4_EXP), use_combine=not last)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.2)
    module = module.to(dtype)
    h = torch.randn(7, 3 * 64).to(dtype)
    with torch.no_grad():
        want = module(h)
        w = {n: p.detach() for n, p in module.named_parameters()}

        def linear(name: str):  # noqa: ANN202
            return lambda x: F.linear(x, w[name])

        ours = GatedResidual(1.0 + w["hc_norm.weight"].float(), linear("input_mix_weight_down.weight"),
                             linear("input_mix_weight_up.weight"),
                             None if last else linear("block_inject_weight.weight"), 3, 1e-6)
        x, weights = ours.read(h)
        if last:
            assert weights is None and torch.equal(x, want)
            return
        assert torch.equal(x, want[0]) and torch.equal(weights, want[2])
        out = torch.randn(7, 64).to(dtype)
        injected = want[1] + (out.unsqueeze(-2) * want[2].unsqueeze(-1)).flatten(-2)  # the decoder layer's update
        assert torch.equal(GatedResidual.add(h, out, weights), injected)


def test_qsa_selection_equals_transformers_where_scores_do_not_tie() -> None:
    """The positions each query attends equal the mask transformers' Qwen4ExpTextQSAIndexer gives (37 tokens,
    blocks of 4, 2 chosen per query), on random weights whose block scores have no tie at any query's cut (checked:
    transformers' topk picks among tied blocks by its kernel's order, moeserve by block position)."""
    import torch.nn.functional as F
    from transformers import Qwen4ExpTextConfig
    from transformers.models.qwen4_exp import modeling_qwen4_exp as ref

    from moeserve.models.archs.qwen4_exp import qwen4_exp_spec
    from moeserve.models.layers.base import Rotary, rms_norm_fp32_scale
    from moeserve.models.mixers.qsa_select import block_keys, select
    from moeserve.models.spec import ConfigReader

    fields = {**TINY_QWEN4_EXP, "indexer_n_heads": 8}
    config = Qwen4ExpTextConfig(**fields)
    spec = qwen4_exp_spec("Qwen4ExpForCausalLM", ConfigReader(fields, "config.json"), None)
    qsa, T = spec.qsa, 37
    assert qsa is not None
    torch.manual_seed(5)
    indexer = ref.Qwen4ExpTextQSAIndexer(config, 1)
    for p in indexer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(1, T, 64)
    positions = torch.arange(T)
    with torch.no_grad():
        cos_sin = ref.Qwen4ExpTextRotaryEmbedding(config)(x, positions.view(1, 1, T).expand(3, 1, T))
        causal = torch.ones(T, T, dtype=torch.bool).tril().view(1, 1, T, T)
        want = indexer(x, cos_sin, causal, None)[0, 0]
        w = {n: t.detach() for n, t in indexer.named_parameters()}
    rotary = Rotary(spec.rope, spec.attention.head_dim, 64, torch.float32, torch.device("cpu"))
    qk = F.linear(x[0], w["index_qk_proj.weight"])
    q = qk[:, : qsa.num_heads * qsa.head_dim].view(T, qsa.num_heads, qsa.head_dim)
    q = rotary.apply(rms_norm_fp32_scale(q, 1.0 + w["q_layernorm.weight"], 1e-6), positions)
    keys = block_keys(qk[:, qsa.num_heads * qsa.head_dim:], qsa.compress_ratio, 1.0 + w["k_layernorm.weight"], 1e-6,
                      rotary)
    got = select(q, positions, keys, qsa.compress_ratio, qsa.budget, T)
    # no tie at any query's cut between its last chosen and first unchosen complete block
    scores = torch.relu((q.unsqueeze(2) * keys.unsqueeze(0).unsqueeze(0)).sum(-1)).sum(1)
    for p in range(T):
        complete = (p + 1) // qsa.compress_ratio
        ranked = scores[p, :complete].sort(descending=True).values
        k = qsa.budget // qsa.compress_ratio
        assert complete <= k or ranked[k - 1] != ranked[k], p
    assert got.sum() > T and not torch.equal(got, causal[0, 0])  # a real selection, not every causal position
    assert torch.equal(got, want)


def test_qsa_ties_go_to_the_earlier_block() -> None:
    """Every block scoring 0 (all relu'd away): each query takes its first budget // ratio complete blocks and its
    incomplete tail, the same in one call and one query at a time."""
    from moeserve.models.mixers.qsa_select import select

    q, keys = -torch.ones(10, 2, 4), torch.ones(2, 4)  # blocks of 4: two complete at 10 tokens
    whole = select(q, torch.arange(10), keys, 4, 4, 10)  # budget 4: one block
    for p in range(10):
        assert torch.equal(select(q[p:p + 1], torch.tensor([p]), keys, 4, 4, 10)[0], whole[p])
    assert whole[9].tolist() == [True] * 4 + [False] * 4 + [True] * 2
    assert whole[3].tolist() == [True] * 4 + [False] * 6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ple_injection_equals_transformers_whole_and_in_steps(dtype: torch.dtype) -> None:
    """What a PLE layer adds to the streams, from the rows models/ngram.py picks and the conv state held here:
    within fp32 rounding of transformers' Qwen4ExpTextPLELayer (float32; its conv1d sums the taps in its own order),
    through its cache in steps as in one forward; and, batch-invariant, in both dtypes bit for bit the same split
    into steps as whole."""
    import torch.nn.functional as F
    from transformers import DynamicCache, Qwen4ExpTextConfig
    from transformers.models.qwen4_exp import modeling_qwen4_exp as ref

    from moeserve.models.archs.qwen4_exp import qwen4_exp_spec
    from moeserve.models.layers.ple import PleInjection
    from moeserve.models.ngram import NgramHash
    from moeserve.models.numerics import Numerics
    from moeserve.models.spec import ConfigReader

    config = Qwen4ExpTextConfig(**TINY_QWEN4_EXP)
    spec = qwen4_exp_spec("Qwen4ExpForCausalLM", ConfigReader(dict(TINY_QWEN4_EXP), "config.json"), None)
    assert spec.ngram is not None
    torch.manual_seed(7)
    layer = ref.Qwen4ExpTextPLELayer(config, 2, 1)
    for name, p in layer.named_parameters():
        torch.nn.init.normal_(p, std=0.5 if "conv" in name or "norm" in name else 0.2)
    layer = layer.to(dtype)
    w = {n: t.detach() for n, t in layer.named_parameters()}
    hashing = NgramHash.of(spec.ngram, spec.vocab_size, 1)
    ple = PleInjection(lambda e: F.linear(e, w["key_proj.weight"]), lambda e: F.linear(e, w["value_proj.weight"]),
                       tuple(1.0 + w[f"{n}.weight"].float() for n in ("norm_key", "norm_query", "norm_conv")),
                       w["conv1d.weight"][:, 0], 3, spec.ngram.ngram_size, 1e-6, Numerics(batch_invariant=True))
    tokens = torch.randint(0, spec.vocab_size, (19,), generator=torch.Generator().manual_seed(1))
    tokens[6] = spec.ngram.eos_token_id
    h = torch.randn(19, 3 * 64).to(dtype)
    table = w["ple_embedding.ngram_embedding.weight"]

    def ours(a: int, b: int, context: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        return ple(h[a:b], table[hashing.rows(context, tokens[a:b])].flatten(-2), history)

    with torch.no_grad():
        whole = ours(0, 19, hashing.start_context(), torch.zeros(ple.history_len, 192, dtype=dtype))
        cache, context, history, steps = DynamicCache(config=config), hashing.start_context(), \
            torch.zeros(ple.history_len, 192, dtype=dtype), []
        for a, b in ((0, 5), (5, 6), (6, 13), (13, 14), (14, 19)):
            steps.append(ours(a, b, context, history))
            context = hashing.next_context(context, tokens[a:b])
            if dtype == torch.float32:
                want = layer(h[None, a:b], tokens[None, a:b], cache)[0]
                torch.testing.assert_close(steps[-1], want, rtol=1e-5, atol=1e-5)
        if dtype == torch.float32:
            torch.testing.assert_close(whole, layer(h[None], tokens[None], None)[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.cat(steps), whole)


# ------------------------------------------------------------------------------------------- the whole model
@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_qwen4_exp(tmp_path_factory.mktemp("qwen4_exp_bf16") / "ckpt", torch.bfloat16)


def _prompts(count: int = 3) -> list[list[int]]:
    """Up to 40 tokens (10 complete index blocks: the indexer chooses 2), end-of-text ids (5) inside two of them."""
    prompts = X.random_prompts(1, (5, 23, 40)[:count], vocab=320)
    for p in prompts[1:3]:
        p[len(p) // 2] = 5
    return prompts


def test_tiny_matches_transformers(tiny: Path) -> None:
    from tests.engine.test_parity_transformers import hf_model

    choices = X.assert_matches_transformers(tiny, hf_model(tiny, torch.float32), _prompts()[1:])
    assert "2 layers; Qwen sparse attention" in choices["sparse attention"]


def test_chunked_prefill_equals_one_pass_bit_for_bit(tiny_bf16: Path) -> None:
    """A 100-token prompt in one step and in chunks (64 + 36: the linear layers' grid): the same bits."""
    prompt = X.random_prompts(2, (100,), vocab=320)[0]
    X.assert_chunked_equals_one_pass(tiny_bf16, prompt, (80,), X.run_together(tiny_bf16, [prompt]))


def test_batched_and_preempted_sequences_keep_their_solo_numbers(tiny_bf16: Path) -> None:
    """Four sequences in an attention pool of 8 blocks: preempted and recomputed; each keeps its solo numbers."""
    prompts = X.random_prompts(7, (30,) * 4, vocab=320)
    solo = X.run_alone(tiny_bf16, prompts, 10, max_model_len=64)
    X.assert_batched_and_preempted_equal_solo(tiny_bf16, [(0, p) for p in prompts], 8, 10, 64, solo)


def test_offloaded_equals_resident_in_bf16(tiny_bf16: Path) -> None:
    prompts = _prompts()
    resident = X.run_together(tiny_bf16, prompts)
    assert "hyper-connections" in resident.choices["decode step"] or "C++" not in resident.choices["kernels"]
    X.assert_offloaded_equals_resident(tiny_bf16, prompts, resident)


def test_prefix_hits_are_exact(tiny_bf16: Path) -> None:
    """Prompts sharing a 64-token prefix (the snapshot grid): the n-gram state and the linear layers' state resumed
    from snapshots, the sparse attention's rows from cached blocks; every step's logits equal those without prefix
    caching."""
    from tests.models.test_prefix_cache_recurrent import assert_equal_to_uncached, hits, run_each

    shared, a, b, c = X.random_prompts(3, (64, 10, 12, 8), vocab=320)
    order = [("A", shared + a), ("B", shared + b), ("C", shared + c)]
    cached = run_each(tiny_bf16, order)
    assert hits(cached) == [0, 0, 64]  # B leaves the shared prefix's snapshot, C resumes from it
    assert_equal_to_uncached(cached, run_each(tiny_bf16, order, enable_prefix_caching=False))


# ------------------------------------------------------------------- the n-gram tables as units of a store
def _table_units(folder: Path, units: int, dtype: torch.dtype) -> tuple[float, int]:
    """(ngram_cache_gb holding `units` units of the n-gram tables of `folder` in `dtype`, the units of all)."""
    from moeserve.models.ngram_table import table_units

    _arch, spec = read_model(open_checkpoint(folder))
    every, unit_nbytes, _table = table_units(spec, dtype)
    return units * unit_nbytes / 2**30 * 1.001, every


def test_ngram_table_on_disk_equals_resident(tiny: Path, tiny_bf16: Path) -> None:
    """Three units of the n-gram tables in memory (of 34 in bf16, 68 in fp32), the rest read from the checkpoint on a miss: every step's
    logits and outputs those of the tables resident, bit for bit, in bf16 and in fp32 (the fp32 resident run is
    transformers' within 1e-4: test_tiny_matches_transformers)."""
    prompts = _prompts()[1:]
    for folder, dtype in ((tiny_bf16, torch.bfloat16), (tiny, torch.float32)):
        name = str(dtype).removeprefix("torch.")
        gb, every = _table_units(folder, 3, dtype)
        resident = X.run_together(folder, prompts, 4, dtype=name)
        got = X.run_together(folder, prompts, 4, dtype=name, ngram_cache_gb=gb)
        assert resident.ngram_misses == 0 and got.ngram_misses > 10, (resident.ngram_misses, got.ngram_misses)
        assert got.choices["n-gram tables"].startswith(f"3 of {every} units"), got.choices["n-gram tables"]
        assert "all" in resident.choices["n-gram tables"]
        X.assert_same_run(got, resident, f"the n-gram tables on disk ({name})")


def test_a_changed_table_byte_is_an_error_naming_its_unit(tiny_bf16: Path, tmp_path: Path) -> None:
    """One unit in memory: a prompt's second run reads its units again; a table block changed on disk since is
    refused with an error naming the unit and the file, not a wrong answer."""
    import shutil

    from moeserve import LLM

    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_bf16, folder)
    prompt = _prompts()[2]
    llm = LLM(str(folder), skip_tokenizer_init=True, ngram_cache_gb=_table_units(tiny_bf16, 1, torch.bfloat16)[0])
    try:
        first = llm.generate([{"prompt_token_ids": prompt}], X.greedy(2))
        assert len(first[0].outputs[0].token_ids) == 2
        arch, spec = read_model(open_checkpoint(folder))
        assert spec.ngram is not None
        name = ngram_table_shards(arch, spec, spec.ngram.layers[1])[0][0]  # the first rows of layer 2's table
        path = folder / "model.safetensors"
        ref = llm.engine.checkpoint.tensors[name]
        data = bytearray(path.read_bytes())
        data[ref.offset: ref.offset + ref.nbytes] = bytes(b ^ 0x40 for b in data[ref.offset: ref.offset + ref.nbytes])
        path.write_bytes(bytes(data))
        with pytest.raises(MoeserveError, match=r"n-gram table unit 0 \(rows 0-255\) of layer 2: the bytes read from "
                                            r".*model\.safetensors differ from those read before"):
            llm.generate([{"prompt_token_ids": prompt}], X.greedy(2))
    finally:
        llm.engine.close()
