"""The package's checkpoint writers (moeserve/bench/checkpoints.py, real_dims.py): the copy of Qwen3.5's published
dimensions matches tests/data/reference_configs, and the synthetic checkpoint's index names every tensor once."""

from __future__ import annotations

import json
from pathlib import Path

from moeserve.bench.checkpoints import SYNTH_CONFIG, synth_tensors, write_synthetic_checkpoint
from moeserve.bench.real_dims import NOT_DIMS, QWEN3_5_35B_A3B_TEXT

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "reference_configs"


def test_qwen35_dims_are_the_published_ones() -> None:
    published = json.loads((CONFIGS / "Qwen3.5-35B-A3B.json").read_text())["text_config"]
    published = {k: v for k, v in published.items() if k not in NOT_DIMS}
    mine = dict(QWEN3_5_35B_A3B_TEXT)
    # the package keeps the first period of the layer pattern; the published list repeats it
    period = mine.pop("layer_types")
    assert published.pop("layer_types")[: len(period)] == period
    assert mine == published


def test_synthetic_checkpoint_index_names_every_tensor(tmp_path: Path) -> None:
    cfg = {**SYNTH_CONFIG, "num_hidden_layers": 2, "num_experts": 4, "hidden_size": 64, "moe_intermediate_size": 32,
           "head_dim": 8, "vocab_size": 128}
    folder = write_synthetic_checkpoint(tmp_path / "synth", cfg)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(name for name, _ in synth_tensors(cfg))
    assert json.loads((folder / "config.json").read_text())["num_experts"] == 4
