"""A checkpoint checked as a whole before anything is sized from it.

`read_model(ckpt)` is how every entry point (the engine, `moeserve inspect`, `moeserve plan`) turns an opened
checkpoint into its architecture and spec. By the time it returns:

- every config.json field that sizes memory is an integer within `spec.INT_BOUNDS`, every float finite and in
  `spec.FLOAT_BOUNDS` (checked as the spec is read, so no tuple per layer is built from a corrupt layer count);
- the fields agree with each other (`spec.check_spec`: top-k within the experts, heads a multiple of kv heads);
- every non-expert tensor the model will read is in the checkpoint with the shape config.json implies, and the
  checkpoint holds no layer beyond num_hidden_layers. Expert tensors are checked by the expert plan
  (`expert_plan`), which the engine builds before it allocates any expert memory.

Shard headers were validated by `open_checkpoint` (offsets inside the files, no overlaps, names unique), so
a shape that matches here is a byte range that can be read.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from moeserve.checkpoint.folder import Checkpoint
from moeserve.errors import CheckpointError
from moeserve.models.quantized import check_dense_shape, checkpoint_scheme, is_stored_dense, linear_format
from moeserve.models.registry import Architecture, get_architecture
from moeserve.models.spec import ModelSpec, check_spec

# (checkpoint name, shape, is a Linear prefix: its weight may be stored in a quantized format)
Expected = tuple[str, tuple[int, ...], bool]


def read_model(ckpt: Checkpoint) -> tuple[Architecture, ModelSpec]:
    """The architecture and spec of `ckpt`, validated as the module docstring says; CheckpointError (or
    UnsupportedModelError) naming the file otherwise."""
    where = str(ckpt.path / "config.json")
    arch = get_architecture(ckpt.config, where)
    spec = arch.spec(ckpt.config, where)
    check_spec(spec, where)
    check_tensor_shapes(ckpt, arch, spec)
    return arch, spec


def check_tensor_shapes(ckpt: Checkpoint, arch: Architecture, spec: ModelSpec) -> None:
    """Every non-expert tensor present with the shape `spec` implies; no layer past spec.num_layers."""
    _check_layer_count(ckpt, arch, spec)
    scheme = checkpoint_scheme(ckpt)
    for name, shape, is_linear in expected_tensors(ckpt, arch, spec):
        if not is_linear:
            ckpt.ref(name, shape)
            continue
        fmt = linear_format(ckpt, scheme, name)
        if is_stored_dense(fmt):
            ckpt.ref(name + ".weight", shape)
        else:
            check_dense_shape(ckpt, fmt, name, shape)


def expected_tensors(ckpt: Checkpoint, arch: Architecture, spec: ModelSpec) -> Iterator[Expected]:
    """The non-expert tensors `build_model` reads, with the shapes it asks for."""
    names, h = arch.names, spec.hidden_size
    yield names.embed, (spec.vocab_size, h), False
    if spec.hyper is None:
        yield names.final_norm, (h,), False
    else:
        yield from _hyper_tensors(names.hc_final, spec, inject=False)
    if spec.mhc is not None:
        yield from _mhc_tensors(names.mhc_head, spec, 1)
    if not (spec.tie_word_embeddings and not ckpt.has(names.lm_head + ".weight")):
        yield names.lm_head, (spec.vocab_size, h), True
    for L in range(spec.num_layers):
        yield from _layer_tensors(arch, spec, L)


def _layer_tensors(arch: Architecture, spec: ModelSpec, L: int) -> Iterator[Expected]:
    names, h, a = arch.names, spec.hidden_size, spec.attention_at(L)
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim

    def n(template: str) -> str:
        return template.format(L=L)

    if spec.compressed is not None:
        yield n(names.input_norm), (h,), False
        yield n(names.post_norm), (h,), False
        yield from _mhc_tensors(n(names.mhc_attn), spec, 3)
        yield from _mhc_tensors(n(names.mhc_mlp), spec, 3)
        yield from _compressed_attention_tensors(arch, spec, L)
        yield from _mlp_tensors(arch, spec, L)
        return
    if spec.sandwich is not None:  # norms around the MLP part, the layer's output scale
        yield from ((n(t), (h,), False) for t in (names.pre_mlp_norm, names.post_mlp_norm))
        yield n(names.layer_scalar), (1,), False

    if spec.hyper is not None:  # gated residuals in place of the two norms
        yield from _hyper_tensors(n(names.hc_attn), spec, inject=True)
        yield from _hyper_tensors(n(names.hc_mlp), spec, inject=True)
    else:
        if L not in spec.mixerless_layers:
            yield n(names.input_norm), (h,), False
        if L not in spec.mlpless_layers:
            yield n(names.post_norm), (h,), False
    if spec.ngram is not None and L in spec.ngram.layers:
        yield from _ngram_tensors(arch, spec, L)
    if L in spec.mixerless_layers:
        yield from _mlp_tensors(arch, spec, L)
        return
    if spec.mamba is not None and L in spec.mamba.layers:
        yield from _mamba_tensors(arch, spec, L)
        return
    if not spec.attention_layers[L]:
        yield from _linear_attention_tensors(arch, spec, L)
        yield from _mlp_tensors(arch, spec, L)
        return
    if spec.mla is not None:
        yield from _mla_tensors(arch, spec, L)
        yield from _mlp_tensors(arch, spec, L)
        return
    if a.qk_norm != "none":
        per_head = a.qk_norm == "per_head"
        yield n(names.q_norm), (a.head_dim if per_head else q,), False
        yield n(names.k_norm), (a.head_dim if per_head else kv,), False
    q_rows = 2 * q if a.output_gate else q  # with an output gate, q_proj gives each head's gate beside its query
    for prefix, rows, cols, bias in ((names.q_proj, q_rows, h, a.qkv_bias), (names.k_proj, kv, h, a.qkv_bias),
                                     (names.v_proj, kv, h, a.qkv_bias), (names.o_proj, h, q, a.o_bias)):
        if prefix != names.v_proj or not a.k_eq_v:  # keys as values: no v_proj
            yield from _linear(n(prefix), rows, cols, bias)
    if a.sinks:
        yield n(names.sinks), (a.num_heads,), False
    if spec.qsa is not None:
        yield from _linear(n(names.indexer) + ".index_qk_proj", (spec.qsa.num_heads + 1) * spec.qsa.head_dim, h, False)
        yield n(names.indexer) + ".q_layernorm.weight", (spec.qsa.head_dim,), False
        yield n(names.indexer) + ".k_layernorm.weight", (spec.qsa.head_dim,), False
    if L not in spec.mlpless_layers:
        yield from _mlp_tensors(arch, spec, L)


def _hyper_tensors(prefix: str, spec: ModelSpec, inject: bool) -> Iterator[Expected]:
    """A gated residual of the hyper-connections (ModelSpec.hyper): its grouped norm, low-rank input mixer and
    (`inject`: every one but the last, before the head) the weights that add its part's output to each stream."""
    hc = spec.hyper
    assert hc is not None
    width = hc.streams * spec.hidden_size
    yield prefix + ".hc_norm.weight", (width,), False
    yield from _linear(prefix + ".input_mix_weight_down", hc.rank, width, False)
    yield from _linear(prefix + ".input_mix_weight_up", width, hc.rank, False)
    if inject:
        yield from _linear(prefix + ".block_inject_weight", hc.streams, width, False)


def _mhc_tensors(prefix: str, spec: ModelSpec, scales: int) -> Iterator[Expected]:
    """A manifold-constrained hyper-connection (ModelSpec.mhc): the projection of the flattened streams to its
    weights (collapse and add-back: streams each, the mixing matrix: streams**2; the head's: the collapse only),
    their biases and `scales` scales."""
    hc = spec.mhc
    assert hc is not None
    n = hc.streams
    rows = n if scales == 1 else (2 + n) * n
    yield prefix + "_fn", (rows, n * spec.hidden_size), False
    yield prefix + "_base", (rows,), False
    yield prefix + "_scale", (scales,), False


def _compressor_tensors(prefix: str, spec: ModelSpec, ratio: int, width: int, overlap: bool) -> Iterator[Expected]:
    """A compressor of `width`-value entries, one per `ratio` tokens (two series side by side when `overlap`):
    its per-slot gate bias (ape), kv and gate projections (stored unquantized) and norm."""
    series = 2 if overlap else 1
    yield prefix + ".ape", (ratio, series * width), False
    yield prefix + ".wkv.weight", (series * width, spec.hidden_size), False
    yield prefix + ".wgate.weight", (series * width, spec.hidden_size), False
    yield prefix + ".norm.weight", (width,), False


def _compressed_attention_tensors(arch: Architecture, spec: ModelSpec, L: int) -> Iterator[Expected]:
    """DeepSeek-V4's attention (ModelSpec.compressed): sinks, the low-rank query and its norm, the shared key=value
    projection and its norm, the grouped output pair; with a ratio, the compressor; indexed, the indexer's own
    compressor, query projection and head weights."""
    ca, a, h = spec.compressed, spec.attention, spec.hidden_size
    assert ca is not None
    prefix = arch.names.compressed_attn.format(L=L)
    yield prefix + ".attn_sink", (a.num_heads,), False
    yield from _linear(prefix + ".wq_a", ca.q_lora_rank, h, False)
    yield prefix + ".q_norm.weight", (ca.q_lora_rank,), False
    yield from _linear(prefix + ".wq_b", a.num_heads * a.head_dim, ca.q_lora_rank, False)
    yield from _linear(prefix + ".wkv", a.head_dim, h, False)
    yield prefix + ".norm.weight", (a.head_dim,), False
    yield from _linear(prefix + ".wo_a", ca.o_groups * ca.o_lora_rank, a.num_heads * a.head_dim // ca.o_groups, False)
    yield from _linear(prefix + ".wo_b", h, ca.o_groups * ca.o_lora_rank, False)
    ratio, indexed = ca.ratios[L], ca.indexed[L]
    if ratio:
        yield from _compressor_tensors(prefix + ".compressor", spec, ratio, a.head_dim, indexed)
    if ratio and indexed:
        yield from _compressor_tensors(prefix + ".indexer.compressor", spec, ratio, ca.index_head_dim, True)
        yield from _linear(prefix + ".indexer.wq_b", ca.index_n_heads * ca.index_head_dim, ca.q_lora_rank, False)
        yield prefix + ".indexer.weights_proj.weight", (ca.index_n_heads, h), False


def ngram_table_shards(arch: Architecture, spec: ModelSpec, L: int) -> list[tuple[str, int]]:
    """PLE layer L's n-gram table as the checkpoint stores it: (tensor name, rows) per row block, split_parts blocks
    as torch.chunk cuts the table (transformers' save_pretrained: equal blocks of ceil(rows / parts), the last
    shorter, fewer blocks when that size covers the table sooner)."""
    ng = spec.ngram
    assert ng is not None and spec.hyper is not None
    rows = ng.rows[ng.layers.index(L)]
    size = -(-rows // ng.split_parts)
    prefix = arch.names.ple.format(L=L) + ".ple_embedding.ngram_embedding"
    return [(f"{prefix}.shard_{i}.weight", min(size, rows - i * size)) for i in range(-(-rows // size))]


def ngram_tables(arch: Architecture, spec: ModelSpec) -> set[str]:
    """The checkpoint names of every row block of every n-gram table (none without ModelSpec.ngram)."""
    layers = spec.ngram.layers if spec.ngram is not None else ()
    return {name for L in layers for name, _rows in ngram_table_shards(arch, spec, L)}


def ngram_hash_buffers(arch: Architecture, spec: ModelSpec, L: int) -> list[tuple[str, tuple[int, ...]]]:
    """The int64 buffers transformers stores beside PLE layer L's table (hash multipliers, each head's vocabulary
    size and first row): models/ngram_hash.py computes them from config.json."""
    ng = spec.ngram
    assert ng is not None
    prefix = arch.names.ple.format(L=L) + ".ple_embedding."
    return [(prefix + "layer_multipliers", (ng.ngram_size,)), (prefix + "ngram_heads_vocab_sizes", (ng.heads,)),
            (prefix + "ngram_heads_offsets", (ng.heads,))]


def _ngram_tensors(arch: Architecture, spec: ModelSpec, L: int) -> Iterator[Expected]:
    """Layer L's n-gram per-layer embedding: the table's row blocks, the key and value projections, three grouped
    norms, the dilated depthwise conv, and the hash's int64 buffers (`ngram_hash_buffers`)."""
    ng, h, prefix = spec.ngram, spec.hidden_size, arch.names.ple.format(L=L)
    assert ng is not None and spec.hyper is not None
    width = spec.hyper.streams * h
    for name, rows in ngram_table_shards(arch, spec, L):
        yield name, (rows, ng.head_dim), False
    for name, shape in ngram_hash_buffers(arch, spec, L):
        yield name, shape, False
    yield from _linear(prefix + ".key_proj", width, ng.embed_dim, False)
    yield from _linear(prefix + ".value_proj", h, ng.embed_dim, False)
    for norm in ("norm_key", "norm_query", "norm_conv"):
        yield f"{prefix}.{norm}.weight", (width,), False
    yield prefix + ".conv1d.weight", (width, 1, ng.conv_kernel), False


def _mamba_tensors(arch: Architecture, spec: ModelSpec, L: int) -> Iterator[Expected]:
    """A Mamba-2 mixer (models/mixers/mamba2.py build_mamba); its block has no MLP."""
    m, names, h = spec.mamba, arch.names, spec.hidden_size
    assert m is not None
    yield from _linear(names.mamba_in.format(L=L), m.inner + m.conv_dim + m.num_heads, h, m.proj_bias)
    yield names.mamba_conv.format(L=L), (m.conv_dim, 1, m.conv_kernel), False
    if m.conv_bias:
        yield names.mamba_conv_bias.format(L=L), (m.conv_dim,), False
    for template in (names.mamba_a_log, names.mamba_d, names.mamba_dt_bias):
        yield template.format(L=L), (m.num_heads,), False
    yield names.mamba_norm.format(L=L), (m.inner,), False
    yield from _linear(names.mamba_out.format(L=L), h, m.inner, m.proj_bias)


def linear_attention_parts(arch: Architecture, spec: ModelSpec, L: int) -> list[tuple[str, int]]:
    """The input projections of linear-attention layer L as (Linear prefix, output rows), in checkpoint order."""
    la, names = spec.linear_attention, arch.names
    assert la is not None
    if la.projections == "qkvz_ba":
        return [(names.linear_qkvz.format(L=L), 2 * la.key_dim + 2 * la.value_dim),
                (names.linear_ba.format(L=L), 2 * la.num_v_heads)]
    return [(names.linear_qkv.format(L=L), la.conv_dim), (names.linear_z.format(L=L), la.value_dim),
            (names.linear_b.format(L=L), la.num_v_heads), (names.linear_a.format(L=L), la.num_v_heads)]


def _linear_attention_tensors(arch: Architecture, spec: ModelSpec, L: int) -> Iterator[Expected]:
    la, names, h = spec.linear_attention, arch.names, spec.hidden_size
    assert la is not None
    for prefix, rows in linear_attention_parts(arch, spec, L):
        yield from _linear(prefix, rows, h, False)
    yield names.linear_conv.format(L=L), (la.conv_dim, 1, la.conv_kernel), False
    yield names.linear_a_log.format(L=L), (la.num_v_heads,), False
    yield names.linear_dt_bias.format(L=L), (la.num_v_heads,), False
    yield names.linear_norm.format(L=L), (la.v_head_dim,), False
    yield from _linear(names.linear_out.format(L=L), h, la.value_dim, False)


def _mla_tensors(arch: Architecture, spec: ModelSpec, L: int) -> Iterator[Expected]:
    """Latent attention (models/mixers/mla.py build_mla): the query's projections, the latent's, their norms, o_proj."""
    m, names, h, nh = spec.mla, arch.names, spec.hidden_size, spec.attention.num_heads
    assert m is not None
    if m.q_lora_rank is not None:
        yield from _linear(names.mla_q_a.format(L=L), m.q_lora_rank, h, m.bias)
        yield names.mla_q_a_norm.format(L=L), (m.q_lora_rank,), False
        yield from _linear(names.mla_q_b.format(L=L), nh * m.qk_head_dim, m.q_lora_rank, False)
    else:
        yield from _linear(names.q_proj.format(L=L), nh * m.qk_head_dim, h, False)
    yield from _linear(names.mla_kv_a.format(L=L), m.latent_width, h, m.bias)
    yield names.mla_kv_a_norm.format(L=L), (m.kv_lora_rank,), False
    yield from _linear(names.mla_kv_b.format(L=L), nh * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, False)
    yield from _linear(names.o_proj.format(L=L), h, nh * m.v_head_dim, m.bias)
    if m.indexer is not None and m.q_lora_rank is not None and L not in m.indexer.shared:  # mla.build_indexer
        ix = m.indexer
        yield from _linear(names.indexer_wq_b.format(L=L), ix.n_heads * ix.head_dim, m.q_lora_rank, False)
        yield from _linear(names.indexer_wk.format(L=L), ix.head_dim, h, False)
        yield names.indexer_k_norm.format(L=L) + ".weight", (ix.head_dim,), False
        yield names.indexer_k_norm.format(L=L) + ".bias", (ix.head_dim,), False
        yield names.indexer_weights.format(L=L) + ".weight", (ix.n_heads, h), False


def _mlp_tensors(arch: Architecture, spec: ModelSpec, L: int) -> Iterator[Expected]:
    names, h, m = arch.names, spec.hidden_size, spec.moe
    if not spec.moe_layers[L]:
        yield from _dense_mlp_tensors(spec, (names.dense_gate, names.dense_up, names.dense_down), L,
                                      spec.dense_intermediate_size)
        return
    if m.router_fp32:  # read as stored, in fp32 (never a quantized Linear)
        yield names.router.format(L=L) + ".weight", (m.num_experts, h), False
    else:
        yield from _linear(names.router.format(L=L), m.num_experts, h, m.router_bias)
    if m.correction_bias and L not in m.hash_layers:
        yield names.router_correction_bias.format(L=L), (m.num_experts,), False
    if L in m.hash_layers:
        yield names.router_hash.format(L=L), (spec.vocab_size, m.top_k), False
    if m.expert_scales:
        yield names.router_scale.format(L=L), (h,), False
        yield names.router_expert_scale.format(L=L), (m.num_experts,), False
    if spec.sandwich is not None:  # the dense MLP beside the MoE, its norm after it, the experts' before and after
        yield from _dense_mlp_tensors(spec, (names.dense_gate, names.dense_up, names.dense_down), L,
                                      spec.dense_intermediate_size)
        for template in (names.post_dense_norm, names.post_moe_norm, names.pre_moe_norm):
            yield template.format(L=L), (h,), False
    if m.shared_intermediate_size:
        yield from _dense_mlp_tensors(spec, (names.shared_gate, names.shared_up, names.shared_down), L,
                                      m.shared_intermediate_size)
        if m.shared_gated:
            yield from _linear(names.shared_expert_gate.format(L=L), 1, h, False)


def _dense_mlp_tensors(spec: ModelSpec, names: tuple[str, str, str], L: int, width: int) -> Iterator[Expected]:
    """A dense or shared-expert MLP (model._dense_mlp): SwiGLU's gate, up and down, or relu2's up and down."""
    h, (gate, up, down) = spec.hidden_size, names
    parts = [(up, width, h), (down, h, width)] if spec.mlp_kind == "relu2" else [(gate, width, h), (up, width, h),
                                                                                  (down, h, width)]
    for prefix, rows, cols in parts:
        yield from _linear(prefix.format(L=L), rows, cols, False)


def _linear(prefix: str, rows: int, cols: int, bias: bool) -> Iterator[Expected]:
    yield prefix, (rows, cols), True
    if bias:
        yield prefix + ".bias", (rows,), False


def layer_of(arch: Architecture, name: str) -> int | None:
    """The decoder layer a checkpoint tensor belongs to ("model.layers.7.mlp..." -> 7), or None."""
    prefix = arch.names.input_norm.split("{L}")[0]  # "model.layers."
    if not name.startswith(prefix):
        return None
    index = name[len(prefix):].partition(".")[0]
    return int(index) if index.isascii() and index.isdigit() and len(index) <= 9 else None


def is_skipped(arch: Architecture, spec: ModelSpec, name: str) -> bool:
    """A tensor the checkpoint holds but the model does not serve: of a layer past the last (spec.skipped_layers:
    MTP layers), or under one of the architecture's `unserved` prefixes (a vision tower, separate MTP modules)."""
    if any(name.startswith(prefix) for prefix, _ in arch.unserved):
        return True
    layer = layer_of(arch, name)
    return layer is not None and layer >= spec.num_layers


def kept_in_fp32(arch: Architecture, spec: ModelSpec) -> set[str]:
    """Checkpoint tensors `build_model` holds in float32 whatever the compute dtype: the routers of MoeSpec.router_fp32
    and the routing correction biases (transformers keeps them so), and the norms of a style that scales in fp32."""
    from moeserve.models.layers.base import RMS_NORMS  # layers imports torch: only here

    names, m = arch.names, spec.moe
    out: set[str] = set()
    for L in spec.moe_layer_ids:
        if m.router_fp32:
            out.add(names.router.format(L=L) + ".weight")
        if m.correction_bias:
            out.add(names.router_correction_bias.format(L=L))
    if RMS_NORMS[spec.norm_style][1] == torch.float32:
        out |= {names.final_norm} | {t.format(L=L) for L in range(spec.num_layers)
                                     for t in (names.input_norm, names.post_norm)}
        if spec.attention.qk_norm == "per_head":
            out |= {t.format(L=L) for L in range(spec.num_layers) if spec.attention_layers[L]
                    for t in (names.q_norm, names.k_norm)}
        if spec.hyper is not None:  # the gated residuals', PLE's and the indexer's norms are of the same style
            empty = Checkpoint(path=Path("config.json"), config={}, generation_config={}, tensors={})
            out |= {name for name, shape, _ in expected_tensors(empty, arch, spec)
                    if name.endswith("norm.weight") and len(shape) == 1}
    return out


def _check_layer_count(ckpt: Checkpoint, arch: Architecture, spec: ModelSpec) -> None:
    """A tensor of layer >= num_hidden_layers (+ the skipped MTP layers) means config.json and the weights disagree
    on the depth."""
    deepest = max((layer for name in ckpt.tensors if (layer := layer_of(arch, name)) is not None), default=-1)
    if deepest >= spec.num_layers + spec.skipped_layers:
        skipped = f" + {spec.skipped_layers} skipped (num_nextn_predict_layers or num_mtp_modules)" if spec.skipped_layers else ""
        raise CheckpointError(
            f"{ckpt.path / 'config.json'}: num_hidden_layers={spec.num_layers}{skipped}, but the checkpoint holds "
            f"tensors of layer {deepest} ({deepest + 1} layers); the config does not belong to these weights"
        )
