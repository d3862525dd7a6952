"""Read a model folder's quantization scheme into a frozen `QuantScheme`.

Sources, in order: ``config.json`` ``quantization_config``; else ``hf_quant_config.json`` (NVIDIA ModelOpt);
else the model is unquantized. Supported schemes (anything else raises `UnsupportedModelError`):
- ``mxfp4`` (gpt-oss): experts as ``*_blocks``/``*_scales``; ``modules_to_not_convert`` stay dense;
- ``compressed-tensors`` with format ``nvfp4-pack-quantized`` or ``mxfp4-pack-quantized``; ``ignore`` list;
- ``compressed-tensors`` ``pack-quantized`` int4, symmetric, group strategy (Kimi-K2-Thinking's W4A16); ``ignore``;
- ``modelopt`` with ``quant_algo`` ``NVFP4``; ``exclude_modules`` wildcards;
- ``fp8`` with ``weight_block_size``; ``modules_to_not_convert`` stay dense; with ``expert_dtype`` (DeepSeek-V4,
  config.json's top level or the quantization config, as transformers folds it in) the DeepSeek-V4 layout: E8M0
  ``scale`` tensors, and with ``fp4`` the routed experts in MXFP4 (``DeepseekMxfp4Format``);
- ``gguf`` (a GGUF file's checkpoint, checkpoint/gguf/open.py): ``tensor_types`` gives each quantized expert
  projection's ggml type (experts written ``*``); every other tensor is read dense (dequantized as it is read).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor

from moeserve.checkpoint import strict_json
from moeserve.errors import CheckpointError, UnsupportedModelError
from moeserve.formats.base import Format
from moeserve.formats.catalog import (
    CompressedTensorsInt4Format,
    CompressedTensorsMxfp4Format,
    CompressedTensorsNvfp4Format,
    DeepseekMxfp4Format,
    DenseFormat,
    Fp8BlockE8m0Format,
    Fp8BlockFormat,
    GptOssMxfp4Format,
    ModelOptNvfp4Format,
)
from moeserve.formats.gguf import GGUF_FORMATS
from moeserve.formats.module_match import ModuleMatcher

UNQUANTIZED = "none"
SUPPORTED_SCHEMES = (
    "mxfp4 (gpt-oss)",
    "compressed-tensors nvfp4-pack-quantized",
    "compressed-tensors mxfp4-pack-quantized",
    "compressed-tensors pack-quantized (int4, symmetric, group strategy)",
    "modelopt NVFP4",
    "fp8 with weight_block_size",
)
_CT_FORMATS: Mapping[str, Format] = {
    "nvfp4-pack-quantized": CompressedTensorsNvfp4Format(),
    "mxfp4-pack-quantized": CompressedTensorsMxfp4Format(),
}
_CT_GROUP_SIZES = {"nvfp4-pack-quantized": 16, "mxfp4-pack-quantized": 32}
_CT_INT4 = "pack-quantized"
# The weights args of an int4 pack-quantized group moeserve decodes, each with compressed-tensors' default when the
# field is absent (QuantizationArgs): anything else (int8, asymmetric / zero points, activation ordering (g_idx),
# channel or block strategies, dynamic weights) is refused naming the field.
_CT_INT4_WEIGHTS: Mapping[str, tuple[Any, Any]] = {  # field -> (required value, default)
    "num_bits": (4, 8),
    "type": ("int", "int"),
    "strategy": ("group", "group"),
    "symmetric": (True, True),
    "actorder": (None, None),
    "dynamic": (False, False),
    "block_structure": (None, None),
}
_MODELOPT_NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")
_DENSE = DenseFormat()


@dataclass(frozen=True)
class QuantScheme:
    """Which modules of a model are quantized, and the `Format` their weights are stored in.

    ``method`` is the config's ``quant_method`` (``"none"`` when unquantized). A module is quantized when it
    matches ``targets`` and not ``excluded``; callers ask only about Linear-like weights (and gpt-oss
    expert projections such as ``model.layers.0.mlp.experts.gate_up_proj``), never norms or embeddings.
    """

    method: str
    weight_format: Format = field(default_factory=DenseFormat)
    targets: ModuleMatcher = ModuleMatcher("compressed-tensors", ("Linear",))
    excluded: ModuleMatcher = ModuleMatcher("transformers")

    def is_quantized(self, module_name: str) -> bool:
        """Return True if the weight of ``module_name`` is stored quantized in this checkpoint."""
        if self.method == UNQUANTIZED:
            return False
        return self.targets.matches(module_name) and not self.excluded.matches(module_name)

    def format_for(self, module_name: str) -> Format:
        """Return the `Format` of ``module_name``'s weight: the scheme's format, or dense if not quantized."""
        return self.weight_format if self.is_quantized(module_name) else _DENSE

    def tensor_names(self, prefix: str) -> tuple[str, ...]:
        """Return the checkpoint tensor names the weight at ``prefix`` is stored as."""
        return self.format_for(prefix).tensor_names(prefix)

    def dequantize(self, prefix: str, tensors: Mapping[str, Tensor], out: Tensor) -> None:
        """Dequantize the weight at ``prefix`` from its tensors (keyed by role, see `Format.select`) into out."""
        self.format_for(prefix).dequantize(tensors, out)


@dataclass(frozen=True)
class GGUFScheme(QuantScheme):
    """A GGUF's experts: one ggml type per projection module (experts written ``*``), each its `GGUFFormat`."""

    types: tuple[tuple[str, str], ...] = ()  # (module, ggml type name)

    def _type(self, module_name: str) -> str | None:
        return dict(self.types).get(_GGUF_EXPERT.sub(".experts.*.", module_name))

    def is_quantized(self, module_name: str) -> bool:
        return self._type(module_name) is not None

    def format_for(self, module_name: str) -> Format:
        name = self._type(module_name)
        return _DENSE if name is None else GGUF_FORMATS[name]()


_GGUF_EXPERT = re.compile(r"\.experts\.\d+\.")


@dataclass(frozen=True)
class ExpertSplitScheme(QuantScheme):
    """One format for the routed experts' projections (``.experts.<id>.`` modules), `weight_format` for the other
    quantized modules (DeepSeek-V4: MXFP4 experts beside FP8 attention and shared experts)."""

    expert_format: Format = field(default_factory=DenseFormat)

    def format_for(self, module_name: str) -> Format:
        if not self.is_quantized(module_name):
            return _DENSE
        return self.expert_format if _ROUTED_EXPERT.search(module_name) else self.weight_format


_ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.")


def _parse_gguf(quant_config: Mapping[str, Any]) -> QuantScheme:
    types = quant_config.get("tensor_types") or {}
    unknown = sorted(t for t in types.values() if t not in GGUF_FORMATS)
    if unknown:
        raise _unsupported(f"gguf type {unknown[0]}")
    return GGUFScheme("gguf", types=tuple(sorted(types.items())))


def load_quant_scheme(model_dir: str | Path) -> QuantScheme:
    """Read the quantization scheme of the model folder ``model_dir`` (see module docstring), or of a config file
    given by its path (a config without its weights: models/config_only.py)."""
    model_dir = Path(model_dir)
    where = model_dir / "config.json"
    if model_dir.is_file():
        where, model_dir = model_dir, model_dir.parent
    config = _read_json(where)
    quant_config = config.get("quantization_config")
    if isinstance(quant_config, dict) and config.get("expert_dtype") is not None:  # DeepSeek-V4 (as transformers)
        quant_config = {"expert_dtype": config["expert_dtype"], **quant_config}
    modelopt_file = model_dir / "hf_quant_config.json"
    if quant_config is None and modelopt_file.is_file():
        where = modelopt_file
        quant_config = {"quant_method": "modelopt", **_read_json(modelopt_file)}
    if quant_config is not None and not isinstance(quant_config, dict):
        raise CheckpointError(f"{where}: 'quantization_config' must be an object, got {str(quant_config)[:40]}")
    try:
        return parse_quant_config(quant_config)
    except (AttributeError, TypeError, ValueError) as err:  # a field of the wrong JSON type
        raise CheckpointError(f"{where}: invalid quantization config ({err})") from None
    except (CheckpointError, UnsupportedModelError) as err:  # name the file the scheme came from
        raise type(err)(f"{where}: {err}") from None


def parse_quant_config(quant_config: Mapping[str, Any] | None) -> QuantScheme:
    """Build a `QuantScheme` from a ``quantization_config`` dict (None means unquantized)."""
    if quant_config is None:
        return QuantScheme(method=UNQUANTIZED)
    method = str(quant_config.get("quant_method", "")).lower()
    parser = _PARSERS.get(method)
    if parser is None:
        raise _unsupported(f"quantization method '{method or '<missing quant_method>'}'")
    return parser(quant_config)


def _parse_gpt_oss_mxfp4(quant_config: Mapping[str, Any]) -> QuantScheme:
    excluded = _string_list(quant_config, "modules_to_not_convert")
    return QuantScheme("mxfp4", GptOssMxfp4Format(), excluded=ModuleMatcher("transformers", excluded))


def _parse_compressed_tensors(quant_config: Mapping[str, Any]) -> QuantScheme:
    groups = quant_config.get("config_groups") or {}
    default_format = quant_config.get("format")
    formats = {group.get("format") or default_format for group in groups.values()} or {default_format}
    if len(formats) != 1:
        raise _unsupported(f"compressed-tensors with mixed formats {sorted(map(str, formats))}")
    ct_format = str(next(iter(formats)))
    if ct_format not in _CT_FORMATS and ct_format != _CT_INT4:
        raise _unsupported(f"compressed-tensors format '{ct_format}'")
    targets: list[str] = []
    for group_name, group in groups.items():
        if ct_format != _CT_INT4:
            _check_ct_weights(group_name, group.get("weights") or {}, ct_format)
        targets += group.get("targets") or []
    weight_format = _CT_FORMATS.get(ct_format) or _ct_int4_format(groups)
    return QuantScheme(
        "compressed-tensors",
        weight_format,
        targets=ModuleMatcher("compressed-tensors", tuple(targets) or ("Linear",)),
        excluded=ModuleMatcher("compressed-tensors", _string_list(quant_config, "ignore")),
    )


def _check_ct_weights(group_name: str, weights: Mapping[str, Any], ct_format: str) -> None:
    group_size = weights.get("group_size", _CT_GROUP_SIZES[ct_format])
    if group_size != _CT_GROUP_SIZES[ct_format] or weights.get("symmetric", True) is False:
        raise _unsupported(
            f"compressed-tensors {ct_format} group '{group_name}' with group_size={group_size}, "
            f"symmetric={weights.get('symmetric', True)}"
        )


def _ct_int4_format(groups: Mapping[str, Any]) -> Format:
    """The int4 `Format` of compressed-tensors ``pack-quantized`` groups, one group size for all (one line naming the
    field otherwise)."""
    sizes = set()
    for group_name, group in groups.items():
        weights = group.get("weights") or {}
        for arg, (required, default) in _CT_INT4_WEIGHTS.items():
            if weights.get(arg, default) != required:
                raise _unsupported(
                    f"compressed-tensors pack-quantized group '{group_name}' with weights.{arg}="
                    f"{json.dumps(weights.get(arg, default))} (moeserve reads {json.dumps(required)})"
                )
        size = weights.get("group_size")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0 or size % 2:
            raise _unsupported(
                f"compressed-tensors pack-quantized group '{group_name}' with weights.group_size={json.dumps(size)} "
                f"(moeserve reads a positive even group size)"
            )
        sizes.add(size)
    if len(sizes) != 1:
        raise _unsupported(f"compressed-tensors pack-quantized groups with weights.group_size {sorted(sizes)}")
    return CompressedTensorsInt4Format(group_size=sizes.pop())


def _parse_modelopt(quant_config: Mapping[str, Any]) -> QuantScheme:
    # hf_quant_config.json nests the fields under "quantization" and lists exclude_modules; the config.json form newer
    # ModelOpt writes beside it (convert_hf_quant_config_format) keeps them flat, the same list named "ignore".
    fields = quant_config.get("quantization") or quant_config
    algo = str(fields.get("quant_algo"))
    groups = (fields.get("config_groups") or {}).values()  # the config.json form's group sizes, per group
    sizes = {fields.get("group_size", 16)} | {(group.get("weights") or {}).get("group_size", 16) for group in groups}
    if algo.upper() not in _MODELOPT_NVFP4_ALGOS or sizes != {16}:
        raise _unsupported(f"modelopt quant_algo '{algo}' with group_size {', '.join(map(str, sorted(sizes)))}")
    excluded = _string_list(fields, "exclude_modules") + _string_list(fields, "ignore")
    return QuantScheme("modelopt", ModelOptNvfp4Format(), excluded=ModuleMatcher("fnmatch", excluded))


def _parse_fp8(quant_config: Mapping[str, Any]) -> QuantScheme:
    block_size = quant_config.get("weight_block_size")
    fmt = str(quant_config.get("fmt", "e4m3")).lower()
    if fmt not in ("e4m3", "float8_e4m3fn") or not (  # DeepSeek-V3 writes the one, MiniMax-M2 the other
        isinstance(block_size, list | tuple)
        and len(block_size) == 2
        and all(isinstance(size, int) and size > 0 for size in block_size)
    ):
        raise _unsupported(
            f"fp8 with fmt '{fmt}' and weight_block_size {block_size} (per-tensor fp8 is not read)"
        )
    excluded = _string_list(quant_config, "modules_to_not_convert")
    block = (block_size[0], block_size[1])
    expert_dtype = quant_config.get("expert_dtype")
    if expert_dtype is not None:  # DeepSeek-V4's layout
        if expert_dtype not in ("fp4", "fp8"):
            raise _unsupported(f"fp8 with expert_dtype '{expert_dtype}' (fp4 or fp8 are read)")
        experts = DeepseekMxfp4Format() if expert_dtype == "fp4" else Fp8BlockE8m0Format(block_size=block)
        return ExpertSplitScheme("fp8", Fp8BlockE8m0Format(block_size=block),
                                 excluded=ModuleMatcher("transformers", excluded), expert_format=experts)
    return QuantScheme("fp8", Fp8BlockFormat(block_size=block), excluded=ModuleMatcher("transformers", excluded))


_PARSERS: Mapping[str, Callable[[Mapping[str, Any]], QuantScheme]] = {
    "mxfp4": _parse_gpt_oss_mxfp4,
    "compressed-tensors": _parse_compressed_tensors,
    "modelopt": _parse_modelopt,
    "fp8": _parse_fp8,
    "gguf": _parse_gguf,
}


def _unsupported(what: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"{what} is not supported; supported schemes: {', '.join(SUPPORTED_SCHEMES)}"
    )


def _string_list(config: Mapping[str, Any], key: str) -> tuple[str, ...]:
    values = config.get(key) or []
    if not isinstance(values, list | tuple) or not all(isinstance(value, str) for value in values):
        raise CheckpointError(f"quantization config '{key}' must be a list of strings, got {values!r}")
    return tuple(values)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = strict_json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; a model folder needs a config.json") from None
    except OSError as err:
        raise CheckpointError(f"{path} cannot be read ({err.strerror})") from None
    except ValueError as err:  # invalid UTF-8 or JSON, a repeated key
        raise CheckpointError(f"{path} cannot be read as JSON: {err}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data
