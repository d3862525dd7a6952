"""`Checkpoint`: a model's parsed configs and the map of every tensor to its byte range, whatever files it came from
(a HF folder: checkpoint/folder.py; a GGUF: checkpoint/gguf/open.py; config.json alone: models/config_only.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moeserve.checkpoint.safetensors_file import FileReader, TensorRef
from moeserve.errors import CheckpointError


@dataclass
class Checkpoint:
    """A validated model folder: parsed configs and a map of every tensor to its byte range."""

    path: Path
    config: dict[str, Any]
    generation_config: dict[str, Any]
    tensors: dict[str, TensorRef]
    reader: FileReader = field(default_factory=FileReader, repr=False)
    # "safetensors" (a HF folder), "gguf" (config and names made from a GGUF's header: checkpoint/gguf/open.py) or
    # "config" (config.json alone, no weights: models/config_only.py)
    origin: str = "safetensors"

    def ref(self, name: str, shape: tuple[int, ...] | None = None) -> TensorRef:
        """The TensorRef of `name`; if `shape` is given, check it matches what the config implies."""
        ref = self.tensors.get(name)
        if ref is None:
            raise CheckpointError(f"{self.path}: tensor '{name}' is missing from the checkpoint")
        if shape is not None and tuple(ref.shape) != tuple(shape):
            raise CheckpointError(
                f"{ref.path}: tensor '{name}' has shape {list(ref.shape)}, but config.json implies {list(shape)}"
            )
        return ref

    def has(self, name: str) -> bool:
        return name in self.tensors

    def stored_dtype(self) -> str:
        """The dtype code most bytes are stored in (the checkpoint's dtype)."""
        totals: dict[str, int] = {}
        for ref in self.tensors.values():
            totals[ref.dtype_code] = totals.get(ref.dtype_code, 0) + ref.nbytes
        return max(totals, key=lambda k: totals[k]) if totals else "F32"

    @property
    def total_bytes(self) -> int:
        return sum(r.nbytes for r in self.tensors.values())

    def close(self) -> None:
        self.reader.close()
