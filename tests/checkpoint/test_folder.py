"""Model folder resolution (local HF cache, never the network) and lazy, exact tensor reads."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from moeserve.checkpoint.folder import open_checkpoint, resolve_model_path
from moeserve.errors import CheckpointError


def test_model_id_from_local_hf_cache(tiny_checkpoint, tmp_path: Path, monkeypatch) -> None:
    src = tiny_checkpoint("mixtral")
    repo = tmp_path / "hub" / "models--acme--tiny-mixtral"
    snap = repo / "snapshots" / "0123abcd"
    shutil.copytree(src, snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model_path("acme/tiny-mixtral") == snap
    assert open_checkpoint("acme/tiny-mixtral").config["architectures"] == ["MixtralForCausalLM"]
    with pytest.raises(CheckpointError, match="not in the local Hugging Face cache.*never downloads") as err:
        resolve_model_path("acme/absent")
    assert "`hf download acme/absent`" in str(err.value) and "{" not in str(err.value)


def test_reads_equal_safetensors_library(tiny_checkpoint) -> None:
    folder = tiny_checkpoint("olmoe", "bfloat16")
    ckpt = open_checkpoint(folder)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for name in f.keys():
            assert torch.equal(ckpt.reader.read(ckpt.tensors[name]), f.get_tensor(name)), name


def test_row_slice_reads_one_expert_of_a_stacked_tensor(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    stacked = torch.randn(4, 3, 5)
    save_file({"w": stacked}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    ckpt = open_checkpoint(tmp_path)
    assert torch.equal(ckpt.reader.read(ckpt.tensors["w"].row_slice(2)), stacked[2])
