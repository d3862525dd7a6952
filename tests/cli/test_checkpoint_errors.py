"""Every corruption of a model folder gives ONE actionable line naming the file (and tensor), exit code 1,
and no traceback, through the CLI entry point."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from moeserve.cli import main

ARGS = ["--skip-tokenizer-init", "--prompt-token-ids", "1,2,3", "--max-tokens", "2"]


def run_cli(folder: Path, capsys) -> tuple[int, str]:
    code = main(["generate", str(folder), *ARGS])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    return code, "\n".join(lines)


def header_of(path: Path) -> tuple[int, dict]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8 : 8 + n])


def rewrite_header(path: Path, header: dict) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    path.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n :])


@pytest.fixture
def model(tiny_checkpoint, copy_checkpoint) -> Path:
    return copy_checkpoint(tiny_checkpoint("qwen3_moe"))


def test_truncated_file(model: Path, capsys) -> None:
    f = model / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    code, err = run_cli(model, capsys)
    assert code == 1 and "model.safetensors" in err and "truncated" in err and "runs past the end" in err


def test_file_shorter_than_header_length(model: Path, capsys) -> None:
    (model / "model.safetensors").write_bytes(b"\x01\x02")
    code, err = run_cli(model, capsys)
    assert code == 1 and "truncated safetensors file" in err


def test_broken_header_json(model: Path, capsys) -> None:
    f = model / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[8:12] = b"}}}}"
    f.write_bytes(bytes(raw))
    code, err = run_cli(model, capsys)
    assert code == 1 and "broken safetensors header" in err and "invalid JSON" in err


def test_header_length_past_end(model: Path, capsys) -> None:
    f = model / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(struct.pack("<Q", len(raw) * 10) + raw[8:])
    code, err = run_cli(model, capsys)
    assert code == 1 and "header length" in err and "model.safetensors" in err


def test_tensor_range_past_end_of_file(model: Path, capsys) -> None:
    f = model / "model.safetensors"
    _, header = header_of(f)
    name = "model.norm.weight"
    b, e = header[name]["data_offsets"]
    header[name]["data_offsets"] = [b + 10**7, e + 10**7]
    rewrite_header(f, header)
    code, err = run_cli(model, capsys)
    assert code == 1 and f"tensor '{name}'" in err and "runs past the end of the file" in err


def test_missing_tensor(model: Path, capsys) -> None:
    f = model / "model.safetensors"
    _, header = header_of(f)
    del header["model.layers.0.self_attn.k_norm.weight"]
    rewrite_header(f, header)
    code, err = run_cli(model, capsys)
    assert code == 1 and "model.layers.0.self_attn.k_norm.weight" in err and "missing" in err


def test_wrong_shape_for_config(model: Path, capsys) -> None:
    cfg = json.loads((model / "config.json").read_text())
    cfg["moe_intermediate_size"] = 48  # experts on disk are 32 wide
    (model / "config.json").write_text(json.dumps(cfg))
    code, err = run_cli(model, capsys)
    assert code == 1 and "has shape" in err and "config.json implies" in err


def test_invalid_config_json(model: Path, capsys) -> None:
    (model / "config.json").write_text("{not json")
    code, err = run_cli(model, capsys)
    assert code == 1 and "config.json" in err and "invalid JSON" in err


def test_config_with_wrong_type(model: Path, capsys) -> None:
    cfg = json.loads((model / "config.json").read_text())
    cfg["hidden_size"] = "sixty-four"
    (model / "config.json").write_text(json.dumps(cfg))
    code, err = run_cli(model, capsys)
    assert code == 1 and "'hidden_size' must be an integer" in err


def test_unsupported_architecture(model: Path, capsys) -> None:
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (model / "config.json").write_text(json.dumps(cfg))
    code, err = run_cli(model, capsys)
    assert code == 1 and "LlamaForCausalLM is not supported" in err and "Qwen3MoeForCausalLM" in err


def _shard(tiny_checkpoint, tmp_path: Path) -> Path:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("qwen3_moe"))
    out = tmp_path / "sharded"
    model.save_pretrained(out, max_shard_size="40KB")
    return out


def test_sharded_checkpoint_loads_and_missing_shard_is_named(tiny_checkpoint, tmp_path: Path, capsys) -> None:
    sharded = _shard(tiny_checkpoint, tmp_path)
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1
    assert main(["generate", str(sharded), *ARGS]) == 0
    capsys.readouterr()
    shards[-1].unlink()
    code, err = run_cli(sharded, capsys)
    assert code == 1 and shards[-1].name in err and "shard named in model.safetensors.index.json is missing" in err


def test_no_traceback_and_exit_code_in_a_real_process(model: Path) -> None:
    (model / "config.json").write_text("[1, 2")
    proc = subprocess.run([sys.executable, "-m", "moeserve", "generate", str(model), *ARGS],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "config.json" in errors[0]
