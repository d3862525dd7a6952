"""A checkpoint is checked before anything is sized from it: the cases a tester found, one test each, and the
pieces of the check (strict JSON, config bounds and relations, header rules, the NaN check, the memory check)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from moeserve.checkpoint import strict_json
from moeserve.checkpoint.finite import check_tensor, is_finite
from moeserve.checkpoint.folder import open_checkpoint
from moeserve.engine.llm import LLM
from moeserve.errors import CheckpointError, ConfigError
from moeserve.models.validate import read_model
from tests.fixtures.corrupt import (
    WEIGHTS,
    header_of,
    outcome,
    poke_float,
    read_config,
    rewrite_header,
    write_config,
    write_header_text,
)


@pytest.fixture
def model(tiny_checkpoint, copy_checkpoint) -> Path:
    return copy_checkpoint(tiny_checkpoint("qwen3_moe"))


def set_raw(folder: Path, key: str, literal: str) -> None:
    """config.json with `key` set to the JSON text `literal` (NaN, Infinity: what Python's json writes)."""
    config = read_config(folder)
    config[key] = "__HERE__"
    (folder / "config.json").write_text(json.dumps(config).replace('"__HERE__"', literal))


# ------------------------------------------------------------------------------------- what the tester found
def test_nan_rms_norm_eps_is_refused(model: Path) -> None:
    set_raw(model, "rms_norm_eps", "NaN")
    message = outcome(model)
    assert "config.json" in message and "NaN" in message


def test_rope_theta_infinity_is_refused(model: Path) -> None:
    config = read_config(model)
    config.pop("rope_parameters", None)  # the legacy spelling: rope_theta at the top level is the one read
    write_config(model, config)
    set_raw(model, "rope_theta", "Infinity")
    message = outcome(model)
    assert "config.json" in message and "Infinity" in message


def test_rope_theta_infinity_inside_rope_parameters_is_refused(model: Path) -> None:
    config = read_config(model)
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": "__INF__"}
    (model / "config.json").write_text(json.dumps(config).replace('"__INF__"', "1e999"))  # overflows to inf
    assert "is not finite" in outcome(model)


def test_nan_expert_weight_names_the_tensor_and_file(model: Path) -> None:
    name = "model.layers.2.mlp.experts.5.down_proj.weight"
    poke_float(model / WEIGHTS, name, 7, float("nan"))
    message = outcome(model)
    assert f"'{name}'" in message and str(model / WEIGHTS) in message and "1 NaN" in message
    assert "expert 5 of layer 2" in message


def test_inf_in_a_dense_weight_names_the_tensor(model: Path) -> None:
    name = "model.layers.1.self_attn.o_proj.weight"
    poke_float(model / WEIGHTS, name, 0, float("-inf"))
    message = outcome(model)
    assert f"tensor '{name}'" in message and "1 infinite" in message


def test_nan_in_an_offloaded_run_is_found_where_experts_are_read_at_load(model: Path) -> None:
    """quantization=int8 offloaded builds its spill file from every expert during the load: checked there."""
    name = "model.layers.0.mlp.experts.1.up_proj.weight"
    poke_float(model / WEIGHTS, name, 3, float("nan"))
    message = outcome(model, quantization="int8", expert_cache_gb=1e-5)  # 1 of 16 experts cached
    assert f"'{name}'" in message and "1 NaN" in message


def test_duplicate_tensor_name_in_one_file_is_refused(model: Path) -> None:
    path = model / WEIGHTS
    n, header = header_of(path)
    text = path.read_bytes()[8 : 8 + n].decode().rstrip()
    entry = json.dumps(header["model.norm.weight"])
    write_header_text(path, (text[:-1] + f', "model.norm.weight": {entry}}}').encode())
    message = outcome(model)
    assert "'model.norm.weight' appears more than once" in message and WEIGHTS in message


def test_duplicate_tensor_across_shards_is_refused(tiny_checkpoint, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_checkpoint("qwen3_moe")).save_pretrained(folder, max_shard_size="40KB")
    first, second = sorted(folder.glob("model-*.safetensors"))[:2]
    _, a = header_of(first)
    n, b = header_of(second)
    name = next(k for k in a if k != "__metadata__")
    nbytes = a[name]["data_offsets"][1] - a[name]["data_offsets"][0]
    data_len = second.stat().st_size - 8 - n
    second.write_bytes(second.read_bytes() + bytes(nbytes))  # a copy of the tensor's size after the data
    b[name] = {**a[name], "data_offsets": [data_len, data_len + nbytes]}
    rewrite_header(second, b)
    message = outcome(folder)
    assert f"tensor '{name}' is also in" in message and first.name in message and second.name in message


# ------------------------------------------------------------------------------------------- strict JSON
@pytest.mark.parametrize("text, why", [
    ('{"a": 1, "a": 2}', "appears more than once"),
    ('{"a": NaN}', "NaN is not a number"),
    ('{"a": -Infinity}', "-Infinity is not a number"),
    ('{"a": 1e400}', "is not finite"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    (b'{"a": "\xff"}', "utf-8"),
])
def test_strict_json_refuses(text: str | bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        strict_json.loads(text)


def test_strict_json_reads_what_json_reads() -> None:
    text = '{"a": [1, 2.5, -3e-7, {"b": null, "c": true}], "d": "x"}'
    assert strict_json.loads(text) == json.loads(text)


# ------------------------------------------------------------------------------- config bounds, relations
@pytest.mark.parametrize("key, value, why", [
    ("num_hidden_layers", 10**9, "out of range"),
    ("head_dim", 10**7, "out of range"),
    ("vocab_size", 10**12, "out of range"),
    ("hidden_size", 0, "out of range"),
    ("num_experts", True, "must be an integer"),
    ("num_attention_heads", 64.0, "must be an integer"),
    ("num_experts_per_tok", 9, "more than the 8 experts"),
    ("num_key_value_heads", 3, "not a multiple"),
    ("head_dim", 15, "odd"),
    ("rms_norm_eps", 0, "finite number in (0, 1)"),
    ("rms_norm_eps", -1e-6, "finite number in (0, 1)"),
    ("mlp_only_layers", 5, "list of layer numbers"),
    ("mlp_only_layers", [0, 1, 2], "no layer is a MoE layer"),
    ("num_hidden_layers", 2, "holds tensors of layer 2"),
    ("dtype", 5, "must be a string"),
])
def test_config_is_checked_before_anything_is_sized(model: Path, key: str, value, why: str) -> None:
    config = read_config(model)
    config[key] = value
    write_config(model, config)
    ckpt = open_checkpoint(model)
    with pytest.raises(CheckpointError, match=why.replace("(", r"\(").replace(")", r"\)")) as err:
        read_model(ckpt)
    assert str(model / "config.json") in str(err.value)


def test_every_non_expert_shape_is_checked_before_loading(model: Path) -> None:
    config = read_config(model)
    config["vocab_size"] = 299  # the embedding on disk has 300 rows
    write_config(model, config)
    with pytest.raises(CheckpointError, match=r"model.embed_tokens.weight' has shape \[300, 64\].*\[299, 64\]"):
        read_model(open_checkpoint(model))


def test_a_valid_folder_passes_unchanged(model: Path) -> None:
    arch, spec = read_model(open_checkpoint(model))
    assert (spec.num_layers, spec.vocab_size, spec.moe.num_experts) == (3, 300, 8)


# ------------------------------------------------------------------------------------------ header rules
@pytest.mark.parametrize("edit, why", [
    (lambda h: h["model.norm.weight"].update(shape=[-64]), "non-negative integers"),
    (lambda h: h["model.norm.weight"].update(shape=[64.0]), "non-negative integers"),
    (lambda h: h["model.norm.weight"].update(shape=[64] + [1] * 20), "dimensions"),
    (lambda h: h["model.norm.weight"].update(data_offsets=[5, 1]), "begin <= end"),
    (lambda h: h["model.norm.weight"].update(dtype="F4"), "unsupported dtype"),
    (lambda h: h.update(x={"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}), "overlap"),
])
def test_header_entries_are_checked(model: Path, edit, why: str) -> None:
    path = model / WEIGHTS
    _, header = header_of(path)
    edit(header)
    rewrite_header(path, header)
    with pytest.raises(CheckpointError, match=why) as err:
        open_checkpoint(model)
    assert str(path) in str(err.value)


def test_a_tensor_in_the_index_under_another_shard_is_refused(tiny_checkpoint, tmp_path: Path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(tiny_checkpoint("qwen3_moe"), folder)
    _, header = header_of(folder / WEIGHTS)
    weight_map = {k: WEIGHTS for k in header if k != "__metadata__"}
    weight_map["model.norm.weight"] = "../elsewhere.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="not a shard file name"):
        open_checkpoint(folder)


# -------------------------------------------------------------------------------------------- NaN check
FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e5m2]
BAD = [float("nan"), float("inf"), float("-inf")]


@pytest.mark.parametrize("dtype, bad", [(d, b) for d in FLOATS for b in BAD]
                         + [(torch.float8_e4m3fn, float("nan"))])  # e4m3fn has no infinity
def test_is_finite_finds_one_bad_value_anywhere(dtype: torch.dtype, bad: float) -> None:
    t = torch.randn(3, 1000).to(dtype)
    assert is_finite(t)
    for at in (0, 1234, 2999):
        u = t.clone()
        u.view(-1)[at] = bad
        assert not is_finite(u), (dtype, bad, at)
    assert is_finite(torch.full((5,), 7, dtype=torch.int8))  # integer codes cannot be NaN


def test_check_tensor_counts_and_names() -> None:
    t = torch.zeros(10)
    t[[1, 2]] = float("nan")
    t[3] = float("inf")
    with pytest.raises(CheckpointError, match=r"f.safetensors: tensor 'w' holds 2 NaN and 1 infinite of 10 values"):
        check_tensor(t, "w", "f.safetensors")


# ------------------------------------------------------------------------------------------ memory check
def test_a_giant_kv_cache_is_refused_before_allocation(model: Path) -> None:
    config = read_config(model)
    config["max_position_embeddings"] = 2**24
    write_config(model, config)
    # one sequence of 2^24 tokens: 2 x 3 layers x 2^24 x 2 kv heads x 16 dims x 4 bytes = 12 GiB of KV, in 2 GiB
    with pytest.raises(ConfigError, match="does not fit: .*KV of one 16777216-token sequence 12.00 GiB.*lower "
                                          "max_model_len") as err:
        LLM(str(model), skip_tokenizer_init=True, device="cpu", max_model_len=2**24, memory_gb=2)
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------ the other files of a folder
def test_tokenizer_config_not_utf8_is_one_line(tiny_text_model, copy_checkpoint) -> None:
    folder = copy_checkpoint(tiny_text_model)
    (folder / "tokenizer_config.json").write_bytes(b'{"eos_token": "\xff"}')
    with pytest.raises(CheckpointError, match="tokenizer_config.json: invalid JSON") as err:
        LLM(str(folder), device="cpu")
    assert "\n" not in str(err.value)


def test_eos_token_id_of_the_wrong_type_is_one_line(model: Path) -> None:
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": {"id": 2}}))
    message = outcome(model)
    assert "generation_config.json: 'eos_token_id' must be a token id" in message
