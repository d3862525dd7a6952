"""What a checkpoint holds, by the expert plan: which tensors are experts, what the rest takes once loaded, and
`describe_formats` (what `moeserve inspect` prints: the format of each tensor group and the bytes a token reads in
stored format)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from moeserve.checkpoint.folder import Checkpoint
from moeserve.models.experts.plans import ExpertPlan, expert_plan
from moeserve.models.quantized import (
    activation_scales,
    checkpoint_scheme,
    format_of,
    meta_tensors,
    quantized_module,
)
from moeserve.models.registry import Architecture, get_architecture
from moeserve.models.spec import ModelSpec
from moeserve.models.validate import is_skipped, kept_in_fp32, ngram_tables


def expert_tensor_names(plan: ExpertPlan) -> set[str]:
    """Checkpoint names of the tensors that hold experts (a stacked tensor once, whatever slices it gives)."""
    # Row slices are named "<tensor>[<expert>]" (TensorRef.row_slice).
    return {r.name.partition("[")[0] for fs in plan.sources.values() for f in fs for r in f.refs}


def resident_nbytes(ckpt: Checkpoint, plan: ExpertPlan, dtype: torch.dtype) -> int:
    """Bytes the non-expert weights take once loaded in `dtype`: quantized Linears count at their dequantized
    size (they are dequantized at load), tensors kept in fp32 (validate.kept_in_fp32) at 4 bytes an element, every
    other tensor at its element count times the dtype size; what is never loaded (`not_loaded`) not at all."""
    scheme = checkpoint_scheme(ckpt)
    arch, spec = _arch_spec(ckpt)
    skipped = not_loaded(ckpt, arch, spec) | expert_tensor_names(plan)
    fp32 = kept_in_fp32(arch, spec)
    total, seen_modules = 0, set()
    for name, ref in ckpt.tensors.items():
        if name in skipped:
            continue
        module = quantized_module(scheme, name, ckpt.tensors)
        if module is None:
            total += ref.numel * (torch.float32.itemsize if name in fp32 else dtype.itemsize)
        elif module not in seen_modules:
            seen_modules.add(module)
            fmt = scheme.format_for(module)
            numel = 1
            for d in fmt.dequantized_shape(meta_tensors(ckpt, fmt, module)):
                numel *= d
            total += numel * dtype.itemsize
    return total


def not_loaded(ckpt: Checkpoint, arch: Architecture, spec: ModelSpec) -> set[str]:
    """Checkpoint tensors the engine never reads: those the architecture does not serve (`validate.is_skipped`: a
    vision tower, MTP layers) and the activation scales of quantized Linears (`quantized.activation_scales`)."""
    skipped = {name for name in ckpt.tensors if is_skipped(arch, spec, name)}
    return skipped | activation_scales(ckpt, checkpoint_scheme(ckpt))


def _arch_spec(ckpt: Checkpoint) -> tuple[Architecture, ModelSpec]:
    where = str(ckpt.path / "config.json")
    arch = get_architecture(ckpt.config, where)
    return arch, arch.spec(ckpt.config, where)


@dataclass(frozen=True)
class TensorGroup:
    """Tensors of one kind (e.g. every layer's q_proj) with the format they are stored in."""

    group: str  # the tensor name with layer and expert indices replaced by '*'
    format: str  # a `Format` name, or the stored dtype code of tensors outside any Linear (norms, embeddings)
    tensors: int
    stored_bytes: int


@dataclass(frozen=True)
class FormatReport:
    groups: tuple[TensorGroup, ...]
    scheme: str  # the quant_method, "none" when unquantized
    expert_stored_bytes: int  # one expert of one layer, all its tensors, as stored
    bytes_per_token: int  # stored bytes a decoded token reads: non-expert weights + top_k experts per layer


_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)|(?<=\.shard_)\d+(?=\.)")  # a layer, expert or row-block number


def describe_formats(ckpt: Checkpoint) -> FormatReport:
    """The format of each tensor group of `ckpt` and the stored bytes a decoded token reads.

    Groups key on the tensor name with every numeric index replaced by '*' (so all layers and experts of one
    projection, and all row blocks of an n-gram table, form one group). A tensor's format is the scheme's format for the module it belongs to when it
    is one of that format's stored tensors, otherwise its dtype code. Bytes per token count every non-expert
    tensor except the embedding table (one row per token, negligible) plus top_k experts per MoE layer, each at
    its stored size, and of an n-gram table (ModelSpec.ngram) the row each head reads: the decode-time memory traffic of the weights.
    """
    scheme = checkpoint_scheme(ckpt)
    arch, spec = _arch_spec(ckpt)
    groups: dict[tuple[str, str], list[int]] = {}
    for name, ref in ckpt.tensors.items():
        key = (_INDEX.sub("*", name), format_of(scheme, name, ref.dtype_code, ckpt.tensors))
        entry = groups.setdefault(key, [0, 0])
        entry[0] += 1
        entry[1] += ref.nbytes
    plan = expert_plan(ckpt, arch, spec, torch.bfloat16)
    expert_names = expert_tensor_names(plan)
    one_expert = sum(r.nbytes for f in next(iter(plan.sources.values())) for r in f.refs)
    tables = ngram_tables(arch, spec)
    nonexpert = sum(r.nbytes for n, r in ckpt.tensors.items() if n not in expert_names and n not in tables
                    and n != arch.names.embed and not is_skipped(arch, spec, n))
    per_token = nonexpert + len(spec.moe_layer_ids) * spec.moe.top_k * one_expert
    if tables and spec.ngram is not None:  # an n-gram table: one row per head and PLE layer
        row = ckpt.tensors[next(iter(tables))]
        per_token += spec.ngram.heads * len(spec.ngram.layers) * row.nbytes // row.shape[0]
    if spec.tie_word_embeddings and not ckpt.has(arch.names.lm_head + ".weight"):
        per_token += ckpt.ref(arch.names.embed).nbytes  # the tied head reads the whole table every token
    rows = tuple(TensorGroup(g, f, n, b) for (g, f), (n, b) in sorted(groups.items()))
    return FormatReport(rows, scheme.method, one_expert, per_token)
