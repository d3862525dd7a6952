"""`moeserve bench --device cuda`: refused in one line where torch has no CUDA device (before any model is built);
where it has one, moeserve's engines get device="cuda" and the CPU peers are skipped with the reason (the plumbing
checked here with a faked torch.cuda and a fake worker: no GPU on CI)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from moeserve.bench import runner
from moeserve.bench.shapes import get_shape
from moeserve.cli import main


def test_device_cuda_is_refused_in_one_line_without_cuda(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cache = tmp_path / "cache"
    assert main(["bench", "--device", "cuda", "--cache-dir", str(cache), "--peers", "none"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: --device cuda: no CUDA device available (torch ")
    assert not cache.exists()  # refused before the synthetic model was built


def test_an_unknown_device_is_an_argparse_error(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--device", "tpu"])
    assert "invalid choice: 'tpu'" in capsys.readouterr().err


class FakeWorker:
    made: list[tuple[str, dict[str, Any]]] = []

    def __init__(self, kind: str, cgroup: Any = None, **settings: Any) -> None:
        FakeWorker.made.append((kind, settings))

    def close(self) -> None:
        pass


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_moeserve_engines_get_the_device_and_cpu_peers_are_skipped(tmp_path: Path, monkeypatch, device) -> None:
    FakeWorker.made = []
    monkeypatch.setattr(runner, "Worker", FakeWorker)
    monkeypatch.setattr(runner, "drop_inputs", lambda paths, engine: None)
    started: list[str] = []
    monkeypatch.setattr(runner, "_start_peer", lambda peer, cfg, cache_dir: started.append(peer) or FakeWorker(peer))
    cfg = runner.BenchConfig(get_shape("small"), tmp_path, peers=("transformers", "moeserve-lru"), device=device)
    workers, skipped = runner.start_engines(cfg, tmp_path)
    assert set(workers) == ({"moeserve", "moeserve-lru", "transformers"} if device == "cpu"
                            else {"moeserve", "moeserve-lru"})
    ours = [settings for kind, settings in FakeWorker.made if kind == "moeserve"]
    assert len(ours) == 2 and all(s.get("device", "cpu") == device for s in ours)
    if device == "cuda":
        assert started == [] and [s.engine for s in skipped] == ["transformers"]
        assert "runs on the CPU here: not comparable with --device cuda" in skipped[0].reason


def test_the_cli_hands_the_device_to_the_run(tmp_path: Path, monkeypatch) -> None:
    """With CUDA reported available, `--device cuda` reaches BenchConfig (the run stopped at start_engines)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    seen: list[runner.BenchConfig] = []

    class Stop(Exception):
        pass

    def start(cfg: runner.BenchConfig, cache_dir: Path) -> Any:
        seen.append(cfg)
        raise Stop

    monkeypatch.setattr(runner, "start_engines", start)
    monkeypatch.setattr(runner, "measure_bandwidths", lambda checkpoint: {})
    monkeypatch.setattr("moeserve.bench.synth.ensure_checkpoint", lambda shape, cache_dir: tmp_path / "model")
    with pytest.raises(Stop):
        main(["bench", "--device", "cuda", "--cache-dir", str(tmp_path), "--peers", "none"])
    assert seen[0].device == "cuda"
