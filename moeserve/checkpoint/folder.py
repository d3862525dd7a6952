"""A Hugging Face model folder: config.json, generation_config.json, safetensors shards, tokenizer files.

`open_checkpoint(model)` resolves a folder path, or a model id already in the local Hugging Face cache
(``$HF_HUB_CACHE`` or ``~/.cache/huggingface/hub/models--org--name/snapshots/<rev>``) without any network
access, reads the JSON files and every shard header, and validates them. Tensor data is not touched here.
A GGUF file (or split files, or a folder holding them and no config.json) opens as the same `Checkpoint`
(checkpoint/gguf/open.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from moeserve.checkpoint import strict_json
from moeserve.checkpoint.base import Checkpoint
from moeserve.checkpoint.safetensors_file import TensorRef, parse_header
from moeserve.errors import CheckpointError

__all__ = ["Checkpoint", "hf_hub_cache", "open_checkpoint", "read_json", "resolve_model_path"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# config.json, generation_config.json and the shard index are kilobytes (an index of 100k tensors ~10 MB); a
# larger file is not one of them, and parsing it could take gigabytes.
MAX_JSON_BYTES = 64 * 2**20


def hf_hub_cache() -> Path:
    """The local Hugging Face hub cache folder, honouring HF_HUB_CACHE and HF_HOME."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home) / "hub"


def resolve_model_path(model: str) -> Path:
    """A local folder for `model` (a path, or an org/name id found in the local HF cache). Never downloads."""
    path = Path(model).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    if path.exists():
        raise CheckpointError(f"{model}: expected a model folder or a .gguf file, got another file")
    if "/" in model and not model.startswith((".", "/", "~")) and model.count("/") == 1:
        repo = hf_hub_cache() / ("models--" + model.replace("/", "--"))
        snapshots = repo / "snapshots"
        ref = repo / "refs" / "main"
        if ref.is_file():
            snap = snapshots / ref.read_text().strip()
            if snap.is_dir():
                return snap
        if snapshots.is_dir():
            candidates = sorted((p for p in snapshots.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
            if candidates:
                return candidates[-1]
        raise CheckpointError(
            f"{model}: not a folder and not in the local Hugging Face cache ({hf_hub_cache()}); "
            f"moeserve never downloads: fetch it first (e.g. `hf download {model}`) or pass a folder path"
        )
    raise CheckpointError(f"{model}: no such model folder")


def read_json(path: Path, required: bool = True) -> dict[str, Any]:
    """Parse a JSON object file; a missing optional file gives {}. Errors name the file: invalid UTF-8 or JSON,
    a key given twice, nesting too deep, a file too large to be a config (see MAX_JSON_BYTES)."""
    if not path.is_file():
        if required:
            raise CheckpointError(f"{path}: missing (a model folder needs config.json)")
        return {}
    try:
        size = path.stat().st_size
        if size > MAX_JSON_BYTES:
            raise CheckpointError(f"{path}: {size} bytes, too large for a config file (at most {MAX_JSON_BYTES})")
        data = strict_json.loads(path.read_bytes())
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read ({err.strerror})") from None
    except ValueError as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CheckpointError(f"{path}: invalid JSON ({err})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: invalid JSON (expected an object)")
    return data


def open_checkpoint(model: str | os.PathLike[str]) -> Checkpoint:
    """Resolve and validate a model folder (or GGUF model). Reads config files and shard headers only."""
    path = resolve_model_path(str(model))
    from moeserve.checkpoint.gguf.open import is_gguf, open_gguf

    if is_gguf(path):
        return open_gguf(path)
    config = read_json(path / "config.json")
    generation_config = read_json(path / "generation_config.json", required=False)
    index_path = path / INDEX_FILE
    if index_path.is_file():
        weight_map: dict[str, str] | None = _weight_map(path, index_path)
        shard_names = sorted(set(weight_map.values())) if weight_map else []
    elif (path / SINGLE_FILE).is_file():
        weight_map, shard_names = None, [SINGLE_FILE]
    else:
        raise CheckpointError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors checkpoints are read)")

    tensors: dict[str, TensorRef] = {}
    for shard in shard_names:
        shard_path = path / shard
        if not shard_path.is_file():
            raise CheckpointError(f"{shard_path}: shard named in {INDEX_FILE} is missing")
        for name, ref in parse_header(shard_path).items():
            if name in tensors:  # which copy would be read depends on the shard order: refuse, as for one file
                raise CheckpointError(
                    f"{shard_path}: tensor '{name}' is also in {tensors[name].path.name}; a tensor must be stored "
                    "once"
                )
            tensors[name] = ref
    if weight_map is not None:
        for name, shard in weight_map.items():
            if name not in tensors or tensors[name].path.name != Path(shard).name:
                raise CheckpointError(f"{path / shard}: tensor '{name}' named in {INDEX_FILE} is not in that shard")
    return Checkpoint(path=path, config=config, generation_config=generation_config, tensors=tensors)


def _weight_map(folder: Path, index_path: Path) -> dict[str, str]:
    """The index's tensor -> shard file map; every shard a plain file name in `folder`."""
    weight_map = read_json(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path}: invalid index (no weight_map)")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard or Path(shard).name != shard or shard in (".", ".."):
            raise CheckpointError(
                f"{index_path}: tensor '{name}' maps to {str(shard)[:80]!r}, not a shard file name in {folder}"
            )
    return weight_map
