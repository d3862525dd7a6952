"""Ways to break a model folder, for the validation and fuzz tests, and the check of what loading it gives.

`outcome(folder)` loads the folder with `LLM(...)` and generates 3 tokens. It returns "ok" after a correct run
(3 tokens, every log-probability finite) or the message of the MoeserveError it ended in, after asserting that
the message is one line naming a file of the folder. Any other exception escapes (the test fails with it).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from moeserve.engine.llm import LLM
from moeserve.engine.sampling_params import SamplingParams
from moeserve.errors import MoeserveError

WEIGHTS = "model.safetensors"


def outcome(folder: Path, **settings: Any) -> str:
    """'ok' after a correct run, else the one-line error (see the module docstring)."""
    try:
        llm = LLM(str(folder), skip_tokenizer_init=True, device="cpu", threads=1, **settings)
        try:
            out = llm.generate({"prompt_token_ids": [1, 2, 3]},
                               SamplingParams(max_tokens=3, logprobs=1, ignore_eos=True))[0].outputs[0]
        finally:
            llm.engine.close()
    except MoeserveError as err:
        message = str(err)
        assert "\n" not in message, f"not one line: {message!r}"
        assert str(folder) in message, f"names no file of {folder}: {message!r}"
        return message
    assert len(out.token_ids) == 3, out
    values = [lp.logprob for step in out.logprobs or [] for lp in step.values()]
    assert values and all(math.isfinite(v) for v in values), f"a run with non-finite log-probabilities: {values}"
    return "ok"


def read_config(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())


def write_config(folder: Path, config: dict[str, Any]) -> None:
    (folder / "config.json").write_text(json.dumps(config))


def header_of(path: Path) -> tuple[int, dict[str, Any]]:
    """(header length, parsed header) of a safetensors file."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8 : 8 + n])


def write_header_text(path: Path, text: bytes, declared_len: int | None = None) -> None:
    """Replace the header of `path` by `text` (padded to 8 bytes), keeping the data; `declared_len` overrides
    the length field."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    text += b" " * (-len(text) % 8)
    length = len(text) if declared_len is None else declared_len
    path.write_bytes(struct.pack("<Q", length) + text + raw[8 + n :])


def rewrite_header(path: Path, header: dict[str, Any]) -> None:
    write_header_text(path, json.dumps(header).encode())


def tensor_names(path: Path) -> list[str]:
    """Tensor names of `path` in the order of their bytes in the file."""
    _, header = header_of(path)
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    return sorted(entries, key=lambda k: entries[k]["data_offsets"][0])


def poke_float(path: Path, name: str, index: int, value: float) -> None:
    """Set element `index` of the F32 tensor `name` of `path` to `value` (NaN, inf, ...) in place."""
    n, header = header_of(path)
    entry = header[name]
    assert entry["dtype"] == "F32", entry
    at = 8 + n + entry["data_offsets"][0] + 4 * index
    raw = bytearray(path.read_bytes())
    raw[at : at + 4] = struct.pack("<f", value)
    path.write_bytes(bytes(raw))


def flip_bytes(path: Path, offsets: list[int], values: list[int]) -> None:
    raw = bytearray(path.read_bytes())
    for at, value in zip(offsets, values):
        raw[at] = value
    path.write_bytes(bytes(raw))
