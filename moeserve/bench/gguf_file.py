"""The streaming GGUF file writer every architecture's writer shares (bench/gguf_export.py, bench/gguf_arch.py).

A GGUF declares every tensor's shape and byte size before any data, so each tensor is described first
(`GGUFTensor`: its GGUF name, the checkpoint tensors it is made of, the transform llama.cpp's converter applies) and
its shape is found by running the transform on meta tensors; the data is then read, transformed and written one
tensor at a time, so a 2 GB checkpoint never sits in memory.

Types as llama.cpp's converter picks them (`keeps_f32`): 1-D tensors, norms, routers, SSM conv kernels and
anything not named `.weight` (SSM A / D, biases) in F32; the rest BF16, or Q8_0 where its rows hold whole 32-value
blocks (BF16 otherwise, as llama.cpp's converter falls back).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moeserve.checkpoint.folder import Checkpoint

GGUF_KINDS = ("bf16", "q8_0")
F32_SUFFIXES = ("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")


def identity(t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass(frozen=True)
class GGUFTensor:
    """One GGUF tensor: `sources` read from the checkpoint (several are stacked on a new first dimension: a layer's
    experts), in fp32, then `transform`ed; HF orientation (the GGUF stores the reversed shape, as llama.cpp reads
    it). `f32` forces F32 where llama.cpp's rule (`keeps_f32`) would not."""

    name: str
    sources: tuple[str, ...]
    transform: Callable[[torch.Tensor], torch.Tensor] = identity
    f32: bool = False

    def _stack(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return parts[0] if len(parts) == 1 else torch.stack(parts)

    def shape(self, ckpt: Checkpoint) -> tuple[int, ...]:
        parts = [torch.empty(ckpt.ref(n).shape, dtype=torch.float32, device="meta") for n in self.sources]
        return tuple(self.transform(self._stack(parts)).shape)

    def load(self, ckpt: Checkpoint) -> torch.Tensor:
        parts = [ckpt.reader.read(ckpt.ref(n)).float() for n in self.sources]
        return self.transform(self._stack(parts)).contiguous()


def keeps_f32(name: str, ndim: int) -> bool:
    """llama.cpp's converter's rule: these tensors are F32 whatever the file type (its ops read them as F32)."""
    return ndim <= 1 or name.endswith(F32_SUFFIXES) or not name.endswith(".weight")


def _ggml_type(hf_shape: tuple[int, ...], kind: str, keep_f32: bool):  # type: ignore[no-untyped-def]
    import gguf

    Q = gguf.GGMLQuantizationType
    if keep_f32 or len(hf_shape) == 1:
        return Q.F32
    if kind == "q8_0" and hf_shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0] == 0:
        return Q.Q8_0
    return Q.BF16


def tensor_info(hf_shape: tuple[int, ...], kind: str, keep_f32: bool) -> tuple[tuple[int, ...], type, int, object]:
    """(numpy shape, numpy dtype, nbytes, GGML type or None for F32) of a tensor as `encode` will write it."""
    import gguf

    Q = gguf.GGMLQuantizationType
    numel = int(np.prod(hf_shape))
    qtype = _ggml_type(hf_shape, kind, keep_f32)
    if qtype == Q.F32:
        return hf_shape, np.float32, 4 * numel, None
    if qtype == Q.BF16:
        return hf_shape, np.uint16, 2 * numel, Q.BF16
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[Q.Q8_0]
    byte_shape = (*hf_shape[:-1], hf_shape[-1] // block_elems * block_bytes)
    return byte_shape, np.uint8, int(np.prod(byte_shape)), Q.Q8_0


def encode(t: torch.Tensor, kind: str, keep_f32: bool) -> np.ndarray:
    """The bytes `tensor_info` declared for `t`."""
    import gguf

    Q = gguf.GGMLQuantizationType
    qtype = _ggml_type(tuple(t.shape), kind, keep_f32)
    if qtype == Q.F32:
        return t.float().numpy()
    if qtype == Q.BF16:
        return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return gguf.quants.quantize(t.float().numpy(), Q.Q8_0)


def file_type(kind: str) -> int:
    import gguf

    return int(gguf.LlamaFileType.MOSTLY_BF16 if kind == "bf16" else gguf.LlamaFileType.MOSTLY_Q8_0)


Entry = tuple[str, tuple[int, ...], Callable[[], torch.Tensor], bool]  # (GGUF name, HF shape, loader, keep F32)


def bytes_per_param(path: str | Path) -> tuple[float, float]:
    """(dense, expert) bytes per parameter of a GGUF as stored, whatever its mix of types: the experts are the
    `*_exps` tensors, dense every other one but the token embedding (a decode step reads one row of it)."""
    import gguf

    sums = {True: [0, 0], False: [0, 0]}  # expert?: [bytes, params]
    for t in gguf.GGUFReader(str(path)).tensors:
        if t.name == "token_embd.weight":
            continue
        acc = sums["_exps." in t.name]
        acc[0] += int(t.n_bytes)
        acc[1] += int(t.n_elements)
    return sums[False][0] / max(sums[False][1], 1), sums[True][0] / max(sums[True][1], 1)


def write_entries(writer, entries: Iterable[Entry], kind: str) -> None:  # type: ignore[no-untyped-def]
    """Tensor infos first (they follow from the shapes alone), then each tensor read, encoded and written in turn;
    `writer` (a gguf.GGUFWriter with its metadata added) is closed."""
    entries = list(entries)
    for name, hf_shape, _, keep in entries:
        np_shape, np_dtype, nbytes, raw = tensor_info(hf_shape, kind, keep)
        writer.add_tensor_info(name, np_shape, np.dtype(np_dtype), nbytes, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, _, load, keep in entries:
        writer.write_tensor_data(encode(load(), kind, keep))
    writer.close()


def write_tensors(writer, ckpt: Checkpoint, tensors: Iterable[GGUFTensor], kind: str) -> None:  # type: ignore[no-untyped-def]
    """`write_entries` for `GGUFTensor`s of `ckpt`, typed by llama.cpp's rule."""

    def entry(t: GGUFTensor) -> Entry:
        shape = t.shape(ckpt)
        return t.name, shape, lambda: t.load(ckpt), t.f32 or keeps_f32(t.name, len(shape))

    write_entries(writer, [entry(t) for t in tensors], kind)


def open_writer(out: Path, arch: str):  # type: ignore[no-untyped-def]
    import gguf

    return gguf.GGUFWriter(out, arch)
