"""GGUF files opened as checkpoints (moeserve/checkpoint/gguf/): `inspect` and `plan` read the header and nothing
else; split files and a folder holding them open as the one file does; bad files, architectures, keys and types are
refused in one line naming the file and what is wrong."""

from __future__ import annotations

import builtins
import io
from pathlib import Path

import pytest

from moeserve.checkpoint.folder import open_checkpoint
from moeserve.checkpoint.gguf.header import read_header
from moeserve.checkpoint.safetensors_file import FileReader
from moeserve.cli import main
from moeserve.engine.llm_engine import demo_model_path
from moeserve.errors import CheckpointError, UnsupportedModelError
from tests.fixtures.gguf_files import write_gguf


@pytest.fixture(scope="module")
def src() -> Path:
    return demo_model_path()  # a Qwen3-MoE in bf16 safetensors, 4 layers (no transformers import needed)


@pytest.fixture(scope="module")
def one_file(src: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(src, tmp_path_factory.mktemp("gguf_one") / "tiny.gguf", "Q8_0", "Q8_0")


def test_inspect_and_plan_read_only_the_header(one_file: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    data_start = read_header(one_file).data_start
    read: list[int] = []
    real_open = builtins.open

    class Counting(io.BufferedReader):
        def read(self, n: int | None = -1) -> bytes:  # type: ignore[override]
            data = super().read(n)
            read.append(len(data))
            return data

    def counting_open(file, mode="r", *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if str(file).endswith(".gguf") and "b" in mode:
            return Counting(io.FileIO(file, "rb"))
        return real_open(file, mode, *args, **kwargs)

    def no_tensor_reads(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("a tensor was read")

    monkeypatch.setattr(builtins, "open", counting_open)
    monkeypatch.setattr(FileReader, "read_run", no_tensor_reads)
    assert main(["inspect", str(one_file)]) == 0
    assert main(["plan", str(one_file), "--no-probe"]) == 0
    out = capsys.readouterr().out
    assert "gguf-q8_0" in out and "architecture:     Qwen3MoeForCausalLM" in out and "memory budget:" in out
    assert read and sum(read) <= 2 * data_start  # the header, once for inspect and once for plan; no tensor data


def test_split_files_and_their_folder_open_as_the_one_file(src: Path, one_file: Path, tmp_path: Path) -> None:
    first = write_gguf(src, tmp_path / "tiny.gguf", "Q8_0", "Q8_0", split_max_tensors=20)
    shards = sorted(tmp_path.glob("tiny-*-of-*.gguf"))
    assert len(shards) > 2 and first == shards[0]
    one, split = open_checkpoint(one_file), open_checkpoint(first)
    assert split.config == one.config and split.tensors.keys() == one.tensors.keys()
    assert {r.path for r in split.tensors.values()} == set(shards)
    for name, ref in one.tensors.items():  # the same bytes, decoded the same way
        assert one.reader.read(ref).equal(split.reader.read(split.tensors[name])), name
    for path in (shards[1], tmp_path):  # any shard, or the folder: the same checkpoint
        other = open_checkpoint(path)
        assert other.config == split.config and other.tensors == split.tensors
    shards[1].unlink()
    with pytest.raises(CheckpointError, match=r"split GGUF of \d+ files; missing tiny-00002-of"):
        open_checkpoint(first)


def test_a_folder_of_two_models_names_them(one_file: Path, tmp_path: Path) -> None:
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(one_file.read_bytes())
    with pytest.raises(CheckpointError, match="holds 2 GGUF models \\(a.gguf, b.gguf\\); pass the file"):
        open_checkpoint(tmp_path)


def _minimal(path: Path, arch: str, keys: dict[str, float], tensors: dict[str, tuple[str, tuple[int, ...]]]) -> Path:
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(path, arch)
    for key, value in keys.items():
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"{arch}.{key}", value)
    for name, (type_name, shape) in tensors.items():
        q = gguf.GGMLQuantizationType[type_name]
        block_elems, block_bytes = gguf.GGML_QUANT_SIZES[q]
        data = np.zeros((*shape[:-1], shape[-1] // block_elems * block_bytes), dtype=np.uint8)
        w.add_tensor(name, data, raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_bad_files_architectures_keys_and_types_are_one_line(tmp_path: Path, one_file: Path) -> None:
    cases = [
        (_minimal(tmp_path / "ds.gguf", "gemma3", {}, {}), UnsupportedModelError,
         r"general.architecture='gemma3' is not read by moeserve; supported: deepseek2, glm4moe, gpt-oss, llama, olmoe"),
        (_minimal(tmp_path / "nokey.gguf", "qwen3moe", {}, {"token_embd.weight": ("F16", (8, 32))}), CheckpointError,
         r"metadata key 'qwen3moe.block_count' is missing"),
    ]
    keys = {"block_count": 1, "embedding_length": 32, "attention.head_count": 2, "context_length": 64,
            "expert_used_count": 1, "expert_count": 2, "expert_feed_forward_length": 256,
            "attention.layer_norm_rms_epsilon": 1e-6}
    iq = _minimal(tmp_path / "q2k.gguf", "qwen3moe", keys, {"token_embd.weight": ("F16", (8, 32)),
                                                             "blk.0.ffn_gate_exps.weight": ("Q2_K", (2, 32, 256))})
    cases.append((iq, UnsupportedModelError, r"tensor 'blk.0.ffn_gate_exps.weight' is stored as Q2_K; moeserve reads"))
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(one_file.read_bytes()[:-100])
    cases.append((truncated, CheckpointError, r"cut.gguf: tensor '.+' .*runs past the end of the \d+-byte file"))
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"GGML" + bytes(60))
    cases.append((not_gguf, CheckpointError, r"x.gguf: not a GGUF file \(no GGUF magic\)"))
    for path, error, message in cases:
        with pytest.raises(error, match=message) as info:
            open_checkpoint(path)
        assert "\n" not in str(info.value) and str(path) in str(info.value)
