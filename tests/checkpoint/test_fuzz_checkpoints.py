"""Generated corruptions of a model folder: every one ends in a one-line error naming a file of the folder, or in
a correct run (`corrupt.outcome` checks both). Deterministic: each case is built from its seed.

- config.json: sizing fields set to values of every wrong kind (0, negative, huge, float, string, bool, list,
  null), random edits of random keys, and broken text (NaN, Infinity, overflow, deep nesting, bad UTF-8,
  repeated keys, truncation);
- safetensors headers: named structural breaks (lengths, dtypes, shapes, offsets, overlaps, nesting, repeated
  names) and random byte flips in the header;
- safetensors bodies: a random weight made NaN or infinite (refused at load, naming the tensor) or changed in
  its low mantissa bits (a correct run).

The size bombs (configs that used to allocate gigabytes before any check) run through the CLI in a child
process whose peak RSS is asserted below PEAK_RSS_BOUND.
"""

from __future__ import annotations

import json
import os
import random
import re
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.corrupt import (
    WEIGHTS,
    flip_bytes,
    header_of,
    outcome,
    read_config,
    rewrite_header,
    tensor_names,
    write_config,
    write_header_text,
)

SIZING_FIELDS = ["num_hidden_layers", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_experts",
                 "num_experts_per_tok", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                 "max_position_embeddings", "rms_norm_eps"]
WRONG_VALUES: list[Any] = [0, -1, 10**9, 2**64, 64.0, "64", True, None, [64]]
RANDOM_VALUES: list[Any] = [0, -1, 1, 2, 3, 7, 31, 10**9, 10**12, -(2**63), 0.5, 1e-9, 1e300, "", "x", True,
                            False, None, [], [1, 2], {}, {"rope_type": "yarn"}]
ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")


@pytest.fixture
def model(tiny_checkpoint, copy_checkpoint) -> Path:
    return copy_checkpoint(tiny_checkpoint("qwen3_moe"))


# ------------------------------------------------------------------------------------------------ config.json
@pytest.mark.parametrize("key", SIZING_FIELDS)
def test_sizing_fields_of_every_wrong_kind(model: Path, key: str) -> None:
    base = read_config(model)
    for value in WRONG_VALUES:
        write_config(model, {**base, key: value})
        result = outcome(model)
        if value is not None:  # null means "the default" where the architecture has one: a correct run or an error
            assert "config.json" in result, (key, value, result)


@pytest.mark.parametrize("seed", range(24))
def test_random_config_edits(tiny_checkpoint, copy_checkpoint, seed: int) -> None:
    rng = random.Random(seed)
    folder = copy_checkpoint(tiny_checkpoint(ARCHS[seed % len(ARCHS)]))
    config = read_config(folder)
    for _ in range(rng.randint(1, 3)):
        key = rng.choice(sorted(config) + SIZING_FIELDS)
        config[key] = rng.choice(RANDOM_VALUES)
    write_config(folder, config)
    outcome(folder)


BROKEN_CONFIG_TEXT = {
    "nan": lambda t: t.replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": NaN'),
    "infinity": lambda t: t[:-1] + ', "rope_theta": Infinity}',
    "minus_infinity": lambda t: t[:-1] + ', "rms_norm_eps": -Infinity}',
    "overflow": lambda t: t[:-1] + ', "rms_norm_eps": 1e999}',
    "deep_nesting": lambda t: t[:-1] + ', "x": ' + "[" * 200_000 + "]" * 200_000 + "}",
    "repeated_key": lambda t: t[:-1] + ', "num_hidden_layers": 1}',
    "truncated": lambda t: t[: len(t) // 2],
    "empty": lambda t: "",
    "not_an_object": lambda t: "[" + t + "]",
    "huge_int": lambda t: t[:-1] + ', "num_hidden_layers": ' + "9" * 5000 + "}",
}


@pytest.mark.parametrize("how", sorted(BROKEN_CONFIG_TEXT))
def test_broken_config_text(model: Path, how: str) -> None:
    text = (model / "config.json").read_text()
    (model / "config.json").write_text(BROKEN_CONFIG_TEXT[how](json.dumps(json.loads(text))))
    assert "config.json" in outcome(model)


def test_config_not_utf8(model: Path) -> None:
    (model / "config.json").write_bytes(b'{"architectures": ["Qwen3MoeForCausalLM\xff"]}')
    assert "config.json" in outcome(model)


# ------------------------------------------------------------------------------------------ safetensors headers
def _edit_entry(name: str, **fields: Any):  # noqa: ANN202
    def edit(header: dict[str, Any]) -> None:
        header[name].update(fields)
    return edit


NORM = "model.norm.weight"
GATE = "model.layers.0.mlp.gate.weight"
HEADER_EDITS = {
    "dtype_unknown": _edit_entry(NORM, dtype="F4"),
    "dtype_not_a_string": _edit_entry(NORM, dtype=5),
    "dtype_other_width": _edit_entry(NORM, dtype="F16"),
    "shape_negative": _edit_entry(GATE, shape=[-8, -64]),
    "shape_float": _edit_entry(NORM, shape=[64.0]),
    "shape_bool": _edit_entry(NORM, shape=[True]),
    "shape_string": _edit_entry(NORM, shape="64"),
    "shape_swapped": _edit_entry(GATE, shape=[64, 8]),
    "shape_zero": _edit_entry(NORM, shape=[0]),
    "shape_many_dims": _edit_entry(NORM, shape=[64] + [1] * 100),
    "shape_overflow": _edit_entry(NORM, shape=[2**62, 2**62]),
    "offsets_reversed": lambda h: h[NORM].update(data_offsets=h[NORM]["data_offsets"][::-1]),
    "offsets_three": lambda h: h[NORM].update(data_offsets=h[NORM]["data_offsets"] + [0]),
    "offsets_past_end": lambda h: h[NORM].update(data_offsets=[o + 10**9 for o in h[NORM]["data_offsets"]]),
    "offsets_shifted_by_one": lambda h: h[NORM].update(data_offsets=[o + 1 for o in h[NORM]["data_offsets"]]),
    "offsets_overlap": lambda h: h[GATE].update(data_offsets=h[NORM]["data_offsets"][:1] * 2),
    "entry_missing_offsets": lambda h: h[NORM].pop("data_offsets"),
    "entry_not_an_object": lambda h: h.update({NORM: [1, 2]}),
    "extra_layer": lambda h: h.update({"model.layers.9.input_layernorm.weight": {
        "dtype": "F32", "shape": [0], "data_offsets": [0, 0]}}),
    "tensor_renamed": lambda h: h.update({GATE + "_": h.pop(GATE)}),
    "metadata_odd": lambda h: h.update({"__metadata__": [1, {"a": None}]}),
}


@pytest.mark.parametrize("how", sorted(HEADER_EDITS))
def test_header_edits(model: Path, how: str) -> None:
    path = model / WEIGHTS
    _, header = header_of(path)
    HEADER_EDITS[how](header)
    rewrite_header(path, header)
    outcome(model)


def _header_text(path: Path) -> str:
    n, _ = header_of(path)
    return path.read_bytes()[8 : 8 + n].decode().rstrip()


HEADER_TEXT = {
    "length_zero": lambda p: write_header_text(p, b"{}", declared_len=0),
    "length_huge": lambda p: write_header_text(p, _header_text(p).encode(), declared_len=2**64 - 1),
    "length_past_limit": lambda p: write_header_text(p, _header_text(p).encode(), declared_len=200 * 2**20),
    "length_minus_one": lambda p: write_header_text(p, _header_text(p).encode(), declared_len=header_of(p)[0] - 1),
    "length_plus_eight": lambda p: write_header_text(p, _header_text(p).encode(), declared_len=header_of(p)[0] + 8),
    "not_utf8": lambda p: write_header_text(p, b'{"\xff": 1}'),
    "deep_nesting": lambda p: write_header_text(p, b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    "not_an_object": lambda p: write_header_text(p, b"[1, 2, 3]"),
    "nan_offset": lambda p: write_header_text(p, _header_text(p).replace('"data_offsets":[0,', '"data_offsets":[NaN,',
                                                                          1).encode()),
    "repeated_name": lambda p: write_header_text(
        p, (_header_text(p)[:-1] + f', "{NORM}": ' + json.dumps(header_of(p)[1][NORM]) + "}").encode()),
    "repeated_field": lambda p: write_header_text(
        p, _header_text(p).replace('"dtype":"F32"', '"dtype":"F32","dtype":"F16"', 1).encode()),
    "file_empty": lambda p: p.write_bytes(b""),
    "file_seven_bytes": lambda p: p.write_bytes(b"\x01" * 7),
    "body_truncated": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
}


@pytest.mark.parametrize("how", sorted(HEADER_TEXT))
def test_header_text(model: Path, how: str) -> None:
    HEADER_TEXT[how](model / WEIGHTS)
    assert WEIGHTS in outcome(model)


@pytest.mark.parametrize("seed", range(24))
def test_random_header_byte_flips(model: Path, seed: int) -> None:
    rng = random.Random(1000 + seed)
    path = model / WEIGHTS
    n, _ = header_of(path)
    count = rng.randint(1, 4)
    flip_bytes(path, [rng.randrange(0, 8 + n) for _ in range(count)], [rng.randrange(256) for _ in range(count)])
    outcome(model)


BODY_FLIPS = ("nan", "inf", "-inf", "mantissa", "mantissa")


@pytest.mark.parametrize("seed", range(10))
def test_random_body_byte_flips(model: Path, seed: int) -> None:
    """A random element of a random tensor made NaN or +-infinity (refused at load, naming the tensor), or a
    random bit of its low 16 mantissa bits flipped (a weight off by < 2^-7 of itself: a correct run)."""
    rng = random.Random(2000 + seed)
    path = model / WEIGHTS
    n, header = header_of(path)
    name = rng.choice(tensor_names(path))
    begin, end = header[name]["data_offsets"]
    at = 8 + n + begin + 4 * rng.randrange((end - begin) // 4)  # one F32 element, little-endian
    how = rng.choice(BODY_FLIPS)
    raw = bytearray(path.read_bytes())
    if how == "mantissa":
        raw[at + rng.randrange(2)] ^= 1 << rng.randrange(8)
    else:
        raw[at : at + 4] = struct.pack("<f", float(how))
    path.write_bytes(bytes(raw))
    result = outcome(model)
    if how == "mantissa":
        assert result == "ok", result
    else:
        assert f"'{name}'" in result and ("1 NaN" if how == "nan" else "1 infinite") in result, result


# ------------------------------------------------------------------------------------------------- size bombs
PEAK_RSS_BOUND = int(1.5 * 2**30)  # the CLI with torch imported peaks near 250 MiB here, 0.8 GiB when bloated
CHILD = (
    "import atexit, os, sys\n"
    "from moeserve.memory.rss import peak_rss_bytes\n"
    "atexit.register(lambda: open(os.environ['PEAK_RSS_FILE'], 'w').write(str(peak_rss_bytes())))\n"
    "from moeserve.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)
GENERATE = ["generate", "--device", "cpu", "--skip-tokenizer-init", "--prompt-token-ids", "1,2,3", "--max-tokens", "2"]
# name -> (config.json edit or "header", command, text of the error line, whether that line names the folder)
BOMBS = {
    "layers_1e9_inspect": ({"num_hidden_layers": 10**9}, ["inspect"], "num_hidden_layers", True),
    "layers_1e9_plan": ({"num_hidden_layers": 10**9}, ["plan", "--no-probe"], "num_hidden_layers", True),
    "layers_1e9_serve": ({"num_hidden_layers": 10**9}, ["serve", "--port", "0", "--device", "cpu"],
                         "num_hidden_layers", True),
    "head_dim_1e7_generate": ({"head_dim": 10**7}, GENERATE, "head_dim", True),
    "vocab_1e12_generate": ({"vocab_size": 10**12}, GENERATE, "vocab_size", True),
    # a valid config whose one sequence of 2^24 tokens (2 x 3 layers x 2^24 x 2 x 16 x 4 bytes = 12 GiB of KV) is
    # asked for on the command line within a 4 GiB budget: refused before allocation, naming the settings to change
    "kv_cache_generate": ({"max_position_embeddings": 2**24},
                          [*GENERATE, "--max-model-len", str(2**24), "--memory-gb", "4"],
                          "raise memory_gb, or lower max_model_len", False),
    "header_length_huge_inspect": ("header", ["inspect"], "header length", True),
    # the largest header read, made of the smallest JSON values (parsing takes ~20x the header's bytes)
    "header_bloated_inspect": ("bloated", ["inspect"], "__metadata__ must map strings to strings", True),
}


def _bloated_header(path: Path) -> None:
    """A header of just under 32 MiB: {"__metadata__": {"a": ["ab", "ab", ...]}}."""
    size = 32 * 2**20 - 64
    text = b'{"__metadata__":{"a":[' + b'"ab",' * ((size - 40) // 5) + b'"ab"]}}'
    write_header_text(path, text)


@pytest.mark.parametrize("bomb", sorted(BOMBS))
def test_size_bombs_end_in_one_line_with_bounded_memory(model: Path, tmp_path: Path, bomb: str) -> None:
    edit, command, expected, names_folder = BOMBS[bomb]
    if edit == "header":
        path = model / WEIGHTS
        raw = path.read_bytes()
        path.write_bytes(struct.pack("<Q", 2**63) + raw[8:])
    elif edit == "bloated":
        _bloated_header(model / WEIGHTS)
    else:
        write_config(model, {**read_config(model), **edit})
    peak_file = tmp_path / "peak"
    argv = [command[0], str(model), *command[1:]]
    proc = subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PEAK_RSS_FILE": str(peak_file)})
    # `error: ...` alone (CLI) or after a log prefix (serve); not uvicorn's logger "uvicorn.error: ..."
    errors = [line for line in proc.stderr.splitlines() if re.search(r"(^|: )error: ", line)]
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(errors) == 1 and expected in errors[0], errors
    assert str(model) in errors[0] or not names_folder, errors
    peak = int(peak_file.read_text())
    assert peak < PEAK_RSS_BOUND, f"peak RSS {peak / 2**20:.0f} MiB"
