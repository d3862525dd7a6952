"""Quantized checkpoints on the model side: the scheme of a checkpoint, dense quantized Linears dequantized at
load, and which module a stored tensor belongs to (models/inventory.py builds its reports on it).

The byte layouts and exact dequantization live in `moeserve.formats`; this module only asks a `Format` for
its tensors and calls it, never branching on which format it is.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from moeserve.checkpoint.folder import Checkpoint
from moeserve.errors import CheckpointError
from moeserve.formats import Format, QuantScheme, load_quant_scheme, parse_quant_config
from moeserve.formats.catalog import DenseFormat

_DENSE = DenseFormat()


def checkpoint_scheme(ckpt: Checkpoint) -> QuantScheme:
    """The quantization scheme of a checkpoint (config.json quantization_config or hf_quant_config.json; a GGUF's
    config made from its header holds its own)."""
    if ckpt.origin == "gguf":
        return parse_quant_config(ckpt.config["quantization_config"])
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


def activation_scales(ckpt: Checkpoint, scheme: QuantScheme) -> set[str]:
    """Names of the activation-quantization tensors (`Format.activation_roles`, e.g. a W4A4 checkpoint's
    ``input_global_scale``) stored beside quantized weights: never read, since activations stay in the compute dtype.
    A tensor counts only beside its module's complete stored weight (a lone ``input_scale`` is not one)."""
    out = set()
    roles = scheme.weight_format.activation_roles  # the only format with any: DenseFormat has none
    for name in ckpt.tensors:
        module, _, role = name.rpartition(".")
        if role in roles and scheme.is_quantized(module) and all(n in ckpt.tensors for n in
                                                                  scheme.weight_format.tensor_names(module)):
            out.add(name)
    return out


def format_of(scheme: QuantScheme, name: str, dtype_code: str, names: Collection[str]) -> str:
    module = quantized_module(scheme, name, names)
    return dtype_code if module is None else scheme.format_for(module).name


def quantized_module(scheme: QuantScheme, name: str, names: Collection[str]) -> str | None:
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
