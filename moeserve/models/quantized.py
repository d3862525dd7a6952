"""Quantized checkpoints on the model side: the scheme of a checkpoint, dense quantized Linears dequantized at
load, and `describe_formats` (what `moeserve inspect` prints: the format of each tensor group and the bytes a
token reads in stored format).

The byte layouts and exact dequantization live in `moeserve.formats`; this module only asks a `Format` for
its tensors and calls it, never branching on which format it is.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moeserve.checkpoint.folder import Checkpoint
from moeserve.errors import CheckpointError
from moeserve.formats import Format, QuantScheme, load_quant_scheme
from moeserve.formats.catalog import DenseFormat

_DENSE = DenseFormat()

if TYPE_CHECKING:
    from moeserve.models.model import ExpertPlan


def checkpoint_scheme(ckpt: Checkpoint) -> QuantScheme:
    """The quantization scheme of a checkpoint (config.json quantization_config or hf_quant_config.json)."""
    return load_quant_scheme(ckpt.path)


def linear_format(ckpt: Checkpoint, scheme: QuantScheme, prefix: str) -> Format:
    """The format the Linear at `prefix` is stored in. A module the scheme would quantize but whose checkpoint
    holds a plain float `weight` and none of the format's other tensors is read as dense: producers leave
    lm_head and similar output layers unconverted without always listing them (transformers does the same)."""
    fmt = scheme.format_for(prefix)
    if is_stored_dense(fmt):
        return fmt
    stored = fmt.tensor_names(prefix)
    plain = ckpt.tensors.get(prefix + ".weight")
    if (
        plain is not None
        and plain.dtype.is_floating_point
        and plain.dtype.itemsize >= 2
        and not any(n in ckpt.tensors for n in stored if n != plain.name)
    ):
        return _DENSE
    return fmt


def is_stored_dense(fmt: Format) -> bool:
    """True when the weight is a plain float ``weight`` tensor (read directly, nothing to dequantize)."""
    return isinstance(fmt, DenseFormat)


def meta_tensors(ckpt: Checkpoint, fmt: Format, prefix: str) -> dict[str, torch.Tensor]:
    """Shape-and-dtype-only stand-ins for the stored tensors of the weight at `prefix`, keyed by role."""
    out = {}
    for role in fmt.roles:
        ref = ckpt.ref(fmt.stored_name(prefix, role))
        out[role] = torch.empty(ref.shape, dtype=ref.dtype, device="meta")
    return out


def check_dense_shape(ckpt: Checkpoint, fmt: Format, prefix: str, shape: tuple[int, ...]) -> None:
    """Raise CheckpointError unless the weight at `prefix` dequantizes to `shape` (what config.json implies)."""
    got = fmt.dequantized_shape(meta_tensors(ckpt, fmt, prefix))
    if tuple(got) != tuple(shape):
        raise CheckpointError(
            f"{ckpt.path}: {fmt.name} weight '{prefix}' holds shape {list(got)}, but config.json implies {list(shape)}"
        )


def dequantize_at_load(
    ckpt: Checkpoint, fmt: Format, prefix: str, shape: tuple[int, ...], dtype: torch.dtype
) -> tuple[torch.Tensor, int]:
    """Read the stored tensors of the weight at `prefix` and dequantize them into a new CPU tensor of `dtype`.

    Returns (dense weight, stored bytes read). Transient memory: the stored tensors of this one weight.
    """
    check_dense_shape(ckpt, fmt, prefix, shape)
    refs = {role: ckpt.ref(fmt.stored_name(prefix, role)) for role in fmt.roles}
    stored = {role: ckpt.reader.read(ref) for role, ref in refs.items()}
    out = torch.empty(shape, dtype=dtype)
    fmt.dequantize(stored, out)
    return out, sum(r.nbytes for r in refs.values())


def expert_tensor_names(plan: ExpertPlan) -> set[str]:
    """Checkpoint names of the tensors that hold experts (a stacked tensor once, whatever slices it gives)."""
    # Row slices are named "<tensor>[<expert>]" (TensorRef.row_slice).
    return {r.name.partition("[")[0] for fs in plan.sources.values() for f in fs for r in f.refs}


def resident_nbytes(ckpt: Checkpoint, plan: ExpertPlan, dtype: torch.dtype) -> int:
    """Bytes the non-expert weights take once loaded in `dtype`: quantized Linears count at their dequantized
    size (they are dequantized at load), every other tensor at its element count times the dtype size."""
    scheme = checkpoint_scheme(ckpt)
    experts = expert_tensor_names(plan)
    total, seen_modules = 0, set()
    for name, ref in ckpt.tensors.items():
        if name in experts:
            continue
        module = _quantized_module(scheme, name, ckpt.tensors)
        if module is None:
            total += ref.numel * dtype.itemsize
        elif module not in seen_modules:
            seen_modules.add(module)
            fmt = scheme.format_for(module)
            numel = 1
            for d in fmt.dequantized_shape(meta_tensors(ckpt, fmt, module)):
                numel *= d
            total += numel * dtype.itemsize
    return total


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


_INDEX = re.compile(r"\.(\d+)(?=\.|$)")


def describe_formats(ckpt: Checkpoint) -> FormatReport:
    """The format of each tensor group of `ckpt` and the stored bytes a decoded token reads.

    Groups key on the tensor name with every numeric index replaced by '*' (so all layers and experts of one
    projection form one group). A tensor's format is the scheme's format for the module it belongs to when it
    is one of that format's stored tensors, otherwise its dtype code. Bytes per token count every non-expert
    tensor except the embedding table (one row per token, negligible) plus top_k experts per MoE layer, each at
    its stored size: the decode-time memory traffic of the weights.
    """
    from moeserve.models.expert_plans import expert_plan_for
    from moeserve.models.registry import get_architecture

    scheme = checkpoint_scheme(ckpt)
    where = str(ckpt.path / "config.json")
    arch = get_architecture(ckpt.config, where)
    spec = arch.spec(ckpt.config, where)
    groups: dict[tuple[str, str], list[int]] = {}
    for name, ref in ckpt.tensors.items():
        key = (_INDEX.sub(".*", name), _format_of(scheme, name, ref.dtype_code, ckpt.tensors))
        entry = groups.setdefault(key, [0, 0])
        entry[0] += 1
        entry[1] += ref.nbytes
    plan = expert_plan_for(ckpt, arch, spec, torch.bfloat16)
    expert_names = expert_tensor_names(plan)
    one_expert = sum(r.nbytes for f in next(iter(plan.sources.values())) for r in f.refs)
    nonexpert = sum(
        r.nbytes for n, r in ckpt.tensors.items() if n not in expert_names and n != arch.names.embed
    )
    per_token = nonexpert + len(spec.moe_layer_ids) * spec.moe.top_k * one_expert
    if spec.tie_word_embeddings and not ckpt.has(arch.names.lm_head + ".weight"):
        per_token += ckpt.ref(arch.names.embed).nbytes  # the tied head reads the whole table every token
    rows = tuple(TensorGroup(g, f, n, b) for (g, f), (n, b) in sorted(groups.items()))
    return FormatReport(rows, scheme.method, one_expert, per_token)


def _format_of(scheme: QuantScheme, name: str, dtype_code: str, names: Collection[str]) -> str:
    module = _quantized_module(scheme, name, names)
    return dtype_code if module is None else scheme.format_for(module).name


def _quantized_module(scheme: QuantScheme, name: str, names: Collection[str]) -> str | None:
    """The quantized module whose stored tensors (all present in `names`) include `name`, or None."""
    for module in _candidate_modules(name):
        fmt = scheme.format_for(module)
        if is_stored_dense(fmt):
            continue
        stored = fmt.tensor_names(module)
        # "embed_tokens.weight" is named like a ModelOpt/FP8 weight, but without its scales it is a plain tensor.
        if name in stored and all(n in names for n in stored):
            return module
    return None


def _candidate_modules(name: str) -> list[str]:
    # "a.b.weight_packed" -> module "a.b"; gpt-oss "experts.gate_up_proj_blocks" -> "experts.gate_up_proj".
    out = [name.rsplit(".", 1)[0]] if "." in name else []
    if "_" in name.rsplit(".", 1)[-1]:
        out.append(name.rsplit("_", 1)[0])
    return out
