"""generate / chat / inspect through the CLI entry point."""

from __future__ import annotations

import io
import json

from moeserve.cli import main
from moeserve.cli.inspect import inspect_checkpoint
from tests.conftest import TINY_CONFIGS


def test_generate_json_matches_python_api(tiny_text_model, capsys) -> None:
    from moeserve import LLM, SamplingParams

    assert main(["generate", str(tiny_text_model), "--prompt", "Once upon", "--max-tokens", "6", "--ignore-eos",
                 "--json", "--dtype", "float32"]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("{")][0]
    got = json.loads(line)
    ref = LLM(str(tiny_text_model), dtype="float32").generate(
        "Once upon", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    assert got["token_ids"] == ref.token_ids and got["text"] == ref.text


def test_chat_streams_answers_for_each_turn(tiny_text_model, monkeypatch, capsys) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\nHow are you?\n/exit\n"))
    assert main(["chat", str(tiny_text_model), "--max-tokens", "5", "--ignore-eos", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len([line for line in out if line.strip()]) == 2  # one answer line per user turn


def test_inspect_counts_by_hand(tiny_checkpoint, capsys) -> None:
    cfg = TINY_CONFIGS["qwen3_moe"]
    r = inspect_checkpoint(str(tiny_checkpoint("qwen3_moe")))
    h, i, e, k = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"], cfg["num_experts_per_tok"]
    moe_layers = cfg["num_hidden_layers"] - len(cfg["mlp_only_layers"])
    assert r["moe_layers"] == moe_layers
    assert r["bytes_per_expert"] == 3 * h * i * 4  # gate, up, down in float32
    assert r["bytes_expert"] == moe_layers * e * 3 * h * i * 4
    embed = cfg["vocab_size"] * h * 4
    assert r["bytes_read_per_token"] == r["bytes_non_expert"] - embed + moe_layers * k * 3 * h * i * 4
    assert {"group": "model.layers.*.mlp.experts.*.up_proj.weight", "format": "F32", "tensors": moe_layers * e,
            "bytes": moe_layers * e * h * i * 4} in r["formats"]
    assert main(["inspect", str(tiny_checkpoint("qwen3_moe"))]) == 0
    assert "Qwen3MoeForCausalLM" in capsys.readouterr().out


def test_version_prints_moeserve_and_torch(capsys) -> None:
    import pytest
    import torch

    import moeserve

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out == f"moeserve {moeserve.__version__} (torch {torch.__version__})"


def test_abbreviated_flags_are_refused(tiny_text_model, capsys) -> None:
    import pytest

    with pytest.raises(SystemExit) as exit_info:
        main(["generate", str(tiny_text_model), "--prompt", "Hi", "--max-tok", "3"])  # --max-tokens abbreviated
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --max-tok" in capsys.readouterr().err
