"""A GGUF model (one file, split files ``-00001-of-0000N.gguf``, or a folder holding them) as a `Checkpoint`.

Only the headers are read. The checkpoint is what the HF folder of the same model would be: config.json from the
metadata (archs.py), every tensor under its HF name, as a byte range of the GGUF file:
- expert tensors stay as stored: a layer's stacked experts [E, out, in] become E per-expert refs, each one
  contiguous range (uint8 [out, row bytes] for a quantized type, read by the `gguf-*` formats of
  formats/gguf.py, which the `quantization_config` {"quant_method": "gguf"} names per projection);
- other tensors stored as F32 / F16 / BF16 with nothing to undo are plain refs; the rest (quantized, or permuted by
  the converter) are `DecodedRef`s: float32 (or their float type), dequantized and transformed when read, at load.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moeserve.checkpoint.base import Checkpoint
from moeserve.checkpoint.gguf.archs import GGUFArch, Join, Transform, gguf_arch
from moeserve.checkpoint.gguf.header import GGUFHeader, TensorInfo, read_header
from moeserve.checkpoint.gguf.quants import dequantize, is_readable
from moeserve.checkpoint.safetensors_file import DTYPES, FileReader, TensorRef
from moeserve.errors import CheckpointError, UnsupportedModelError

log = logging.getLogger("moeserve")
GGUF_METHOD = "gguf"  # quantization_config.quant_method of a GGUF checkpoint
_SPLIT = re.compile(r"(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")
_EXPERT_INDEX = re.compile(r"\.experts\.\d+\.")


def is_gguf(path: Path) -> bool:
    """A .gguf file, or a folder holding .gguf files and no config.json."""
    if path.is_file():
        return path.suffix == ".gguf"
    return path.is_dir() and not (path / "config.json").is_file() and any(path.glob("*.gguf"))


def gguf_files(path: Path) -> list[Path]:
    """The files of the GGUF model at `path`, first shard first (one line when a folder holds several models)."""
    if path.is_dir():
        files = sorted(path.glob("*.gguf"))
        firsts = [f for f in files if (m := _SPLIT.fullmatch(f.name)) is None or int(m["no"]) == 1]
        if len(firsts) != 1:
            raise CheckpointError(f"{path}: holds {len(firsts)} GGUF models ({', '.join(f.name for f in firsts)}); "
                                  "pass the file to serve")
        path = firsts[0]
    m = _SPLIT.fullmatch(path.name)
    if m is None:
        return [path]
    count = int(m["count"])
    shards = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [s.name for s in shards if not s.is_file()]
    if missing:
        raise CheckpointError(f"{path}: split GGUF of {count} files; missing {', '.join(missing)}")
    return shards


@dataclass(frozen=True)
class DecodedRef(TensorRef):
    """A tensor made, when read, from stored GGUF tensors: dequantized to float32, then `transform`ed (one part) or
    `join`ed (several: deepseek2's attn_k_b and attn_v_b)."""

    stored: tuple[TensorInfo, ...] = ()
    transform: Transform | None = None
    join: Join | None = None

    def decode(self, raw: Sequence[torch.Tensor]) -> torch.Tensor:
        parts = [dequantize(r.view(*info.shape[:-1], -1), info.ggml_type).reshape(info.shape)
                 for r, info in zip(raw, self.stored, strict=True)]
        if self.join is not None:
            return self.join(parts)
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.transform(out) if self.transform is not None else out


class GGUFFileReader(FileReader):
    """A FileReader that decodes `DecodedRef`s (everything else is read as stored)."""

    def read_into(self, ref: TensorRef, out: torch.Tensor) -> None:
        if not isinstance(ref, DecodedRef):
            super().read_into(ref, out)
            return
        raw = []
        for info in ref.stored:
            buf = torch.empty(info.nbytes, dtype=torch.uint8)
            self.read_run(info.path, info.offset, [buf], f"{ref.name} ({info.name})")
            raw.append(buf)
        out.copy_(ref.decode(raw).reshape(out.shape))


def open_gguf(path: Path) -> Checkpoint:
    """The Checkpoint of the GGUF model at `path` (module docstring); reads the headers only."""
    files = gguf_files(path)
    headers = [read_header(f) for f in files]
    meta = headers[0].metadata
    _check_split(headers)
    infos: dict[str, TensorInfo] = {}
    for h in headers:
        for name, info in h.tensors.items():
            if name in infos:
                raise CheckpointError(f"{h.path}: tensor '{name}' is also in {infos[name].path.name}")
            infos[name] = info
    arch = gguf_arch(meta, files[0])
    config = arch.config(meta, {n: i.shape for n, i in infos.items()}, files[0])
    tensors, expert_types = _refs(arch, infos, config, files[0])
    config["quantization_config"] = {"quant_method": GGUF_METHOD, "tensor_types": expert_types}
    _log_types(files, infos, expert_types)
    generation = {"eos_token_id": eog} if (eog := end_of_generation_ids(meta)) else {}
    return Checkpoint(path=files[0], config=config, generation_config=generation, tensors=tensors,
                      reader=GGUFFileReader(), origin="gguf")


def _log_types(files: list[Path], infos: dict[str, TensorInfo], expert_types: dict[str, str]) -> None:
    """One line: the experts' types (kept in every tier) and the other tensors stored quantized (dequantized at load)."""
    experts = ", ".join(sorted(set(expert_types.values()))) or "a float type"
    decoded = sorted({i.ggml_type.name for n, i in infos.items() if "_exps." not in n and not i.ggml_type.is_float})
    count = sum(1 for n, i in infos.items() if "_exps." not in n and not i.ggml_type.is_float)
    log.info("%s: GGUF of %d file(s); experts kept as %s in every tier; %d other tensors stored as %s are dequantized "
             "at load into the compute dtype", files[0].name, len(files), experts, count, "/".join(decoded) or "-")


def end_of_generation_ids(meta: dict[str, Any]) -> list[int]:
    """tokenizer.ggml's eos, eot and eom ids: the tokens llama.cpp ends a generation at."""
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    return sorted({v for k in keys if isinstance(v := meta.get(f"tokenizer.ggml.{k}"), int)})


def _check_split(headers: list[GGUFHeader]) -> None:
    count = headers[0].metadata.get("split.count", 1)
    if count != len(headers):
        raise CheckpointError(f"{headers[0].path}: split.count={count}, but {len(headers)} files were found")
    for i, h in enumerate(headers):
        if h.metadata.get("split.no", 0) != i:
            raise CheckpointError(f"{h.path}: split.no={h.metadata.get('split.no')}, expected {i}")


def _refs(arch: GGUFArch, infos: dict[str, TensorInfo], config: dict[str, Any], where: Path
          ) -> tuple[dict[str, TensorRef], dict[str, str]]:
    """HF name -> ref of every tensor, and the ggml type of each quantized expert projection (its module, experts
    written `*`)."""
    tensors: dict[str, TensorRef] = {}
    expert_types: dict[str, str] = {}
    num_experts = int(next((config[k] for k in ("num_experts", "num_local_experts", "n_routed_experts")
                            if k in config), 0))
    skipped = 0
    parts: dict[str, dict[int, TensorInfo]] = {}  # HF name -> its stored parts by index (arch.joined)
    for name, info in infos.items():
        mapped = arch.tensor_names(name, num_experts, config["num_hidden_layers"])
        if mapped is None:
            raise UnsupportedModelError(f"{where}: tensor '{name}' is not one moeserve maps for {arch.gguf_name}")
        kind, hf_names = mapped
        if kind == "skipped":
            skipped += 1
            continue
        if kind.startswith("part "):
            parts.setdefault(hf_names[0], {})[int(kind.split()[1])] = info
            continue
        if not is_readable(info.ggml_type):
            raise UnsupportedModelError(f"{where}: tensor '{name}' is stored as {info.ggml_type.name}; moeserve "
                                        "reads F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K and MXFP4")
        if kind == "expert":
            bias = name.endswith(".bias")  # gpt-oss's expert biases [E, out]
            if len(info.shape) != 2 + (not bias) or info.shape[0] != num_experts:
                raise CheckpointError(f"{where}: tensor '{name}' has shape {list(info.shape)}; expected "
                                      f"[{num_experts}, out{'' if bias else ', in'}] ({arch.gguf_name}.expert_count="
                                      f"{num_experts})")
            for e, hf in enumerate(hf_names):
                tensors[hf] = _expert_ref(hf, info, e)
            if not info.ggml_type.is_float:
                expert_types[_EXPERT_INDEX.sub(".experts.*.", hf_names[0]).removesuffix(".weight")] = \
                    info.ggml_type.name
        else:
            tensors[hf_names[0]] = _dense_ref(hf_names[0], info, arch.transform(name, config))
    for hf, stored in parts.items():
        tensors[hf] = _joined_ref(arch, hf, stored, config, where)
    if skipped:
        log.info("%s: %d tensors of the blocks past num_hidden_layers=%d (the NextN layers) are not read", where.name,
                 skipped, config["num_hidden_layers"])
    return tensors, expert_types


def _joined_ref(arch: GGUFArch, hf: str, stored: dict[int, TensorInfo], config: dict[str, Any], where: Path
                ) -> TensorRef:
    """The float32 DecodedRef of HF tensor `hf`, joined from the GGUF tensors `arch.joined` names for it."""
    names = arch.joined[re.sub(r"\.layers\.\d+\.", ".layers.{L}.", hf)]
    missing = [n for i, n in enumerate(names) if i not in stored]
    if missing or arch.join is None:
        layer = next(iter(stored.values())).name.split(".")[1]
        raise CheckpointError(f"{where}: tensor 'blk.{layer}.{missing[0] if missing else names[0]}' is missing "
                              f"(with {', '.join(names)} it makes {hf})")
    infos = tuple(stored[i] for i in range(len(names)))
    join = arch.join(config)
    shape = tuple(join([torch.empty(i.shape, device="meta") for i in infos]).shape)
    numel = 1
    for d in shape:
        numel *= d
    dtype, itemsize = DTYPES["F32"]
    return DecodedRef(hf, infos[0].path, infos[0].offset, numel * itemsize, dtype, "F32", shape, infos, join=join)


def _expert_ref(name: str, info: TensorInfo, expert: int) -> TensorRef:
    """Expert `expert`'s slice of a layer's stacked experts [E, out, in] (or of their biases [E, out])."""
    per = info.nbytes // info.shape[0]
    code = info.ggml_type.name if info.ggml_type.is_float else "U8"
    *rows, cols = info.shape[1:]
    shape = (*rows, cols if info.ggml_type.is_float else info.ggml_type.row_bytes(cols))
    dtype, _ = DTYPES[code]
    return TensorRef(name, info.path, info.offset + expert * per, per, dtype, code, shape)


def _dense_ref(name: str, info: TensorInfo, transform: Callable[[torch.Tensor], torch.Tensor] | None) -> TensorRef:
    gtype = info.ggml_type
    if gtype.is_float and transform is None:
        dtype, _ = DTYPES[gtype.name]
        return TensorRef(name, info.path, info.offset, info.nbytes, dtype, gtype.name, info.shape)
    code = gtype.name if gtype.is_float else "F32"
    dtype, itemsize = DTYPES[code]
    shape = tuple(transform(torch.empty(info.shape, device="meta")).shape) if transform else info.shape
    numel = 1
    for d in shape:
        numel *= d
    return DecodedRef(name, info.path, info.offset, numel * itemsize, dtype, code, shape, (info,), transform)
