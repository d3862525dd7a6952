"""FLAME-MoE routing CSVs -> moeserve traces.

The FLAME-MoE sample traces (see /work/shared/traces/flame-moe-290m/README.md) hold one directory per MoE
layer, ``Layer_<N>/<anything>.csv``, each CSV with the header ``layer_id,token_id,expert_0..expert_<E-1>``
and one row per token whose top-k router scores are non-zero (the rest are 0.0). The ``layer_id`` column is
not reliable, so the layer comes from the directory name.

Conversion treats each token as one forward step (batch-1 decode semantics: every MoE layer, in ascending
layer order, routes that one token), with each token's experts in descending score order.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from moeserve.experts.traces.jsonl import write_trace_file
from moeserve.experts.traces.moetrace import LayerRecord, Step, TraceError, TraceHeader

_LAYER_DIR = re.compile(r"^Layer_(\d+)$")


def find_layer_dirs(root: str | Path) -> dict[int, Path]:
    """``{layer: csv file}`` for a directory holding ``Layer_N/`` folders (directly or one level down)."""
    root = Path(root)
    candidates = [root] + sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    found: dict[Path, dict[int, Path]] = {}
    for base in candidates:
        layers = {}
        for sub in base.iterdir():
            match = _LAYER_DIR.match(sub.name)
            if match and sub.is_dir():
                csvs = sorted(sub.glob("*.csv"))
                if len(csvs) != 1:
                    raise TraceError(f"{sub}: expected exactly one .csv file, found {len(csvs)}")
                layers[int(match.group(1))] = csvs[0]
        if layers:
            found[base] = layers
    if not found:
        raise TraceError(f"{root}: no Layer_<N>/ folders with FLAME-MoE CSVs found")
    if len(found) > 1:
        names = ", ".join(str(p) for p in found)
        raise TraceError(f"{root}: several FLAME trace sets ({names}); pass one of them")
    return next(iter(found.values()))


def _read_csv(path: Path) -> tuple[np.ndarray, int]:
    """One layer's CSV -> ([tokens, top_k] expert ids by descending score, num_experts)."""
    try:
        table = np.loadtxt(path, delimiter=",", skiprows=1, ndmin=2)  # [tokens, 2 + experts]
    except ValueError as err:
        raise TraceError(f"{path}: not a FLAME routing CSV ({err})") from err
    scores = table[:, 2:]  # [tokens, experts]
    token_ids = table[:, 1].astype(np.int64)
    if scores.shape[0] == 0 or not np.array_equal(token_ids, np.arange(len(token_ids))):
        raise TraceError(f"{path}: token_id must run 0, 1, 2, ... with one row per token")
    nonzero = np.count_nonzero(scores, axis=1)
    top_k = int(nonzero[0])
    if top_k == 0 or np.any(nonzero != top_k):
        raise TraceError(f"{path}: every row must have the same number of non-zero scores (top-k)")
    order = np.argsort(-scores, axis=1, kind="stable")[:, :top_k]  # [tokens, top_k]
    return order, scores.shape[1]


def load_flame(root: str | Path) -> tuple[TraceHeader, list[Step]]:
    """Read a FLAME trace set into a header and one step per token."""
    files = find_layer_dirs(root)
    layers = sorted(files)
    per_layer = {layer: _read_csv(files[layer]) for layer in layers}
    shapes = {ids.shape for ids, _ in per_layer.values()}
    num_experts = {n for _, n in per_layer.values()}
    if len(shapes) != 1 or len(num_experts) != 1:
        raise TraceError(f"{root}: layers disagree on tokens, top-k or number of experts")
    tokens, top_k = shapes.pop()
    header = TraceHeader(
        model=_model_name(files[layers[0]]),
        num_layers=layers[-1] + 1,
        num_experts=num_experts.pop(),
        top_k=top_k,
        moe_layers=tuple(layers),
        extra={"source": "FLAME-MoE routing CSVs", "path": str(root), "steps": "one token per step"},
    )
    ids = np.stack([per_layer[layer][0] for layer in layers], axis=1).astype(np.uint16)  # [tokens, layers, k]
    steps = [
        [LayerRecord(layer, ids[t, i : i + 1, :]) for i, layer in enumerate(layers)] for t in range(tokens)
    ]
    return header, steps


def convert_flame(root: str | Path, dest: str | Path) -> TraceHeader:
    """Write a FLAME trace set as a moeserve trace file at ``dest``."""
    header, steps = load_flame(root)
    write_trace_file(dest, header, steps, "moetrace")
    return header


def write_flame(dest: str | Path, header: TraceHeader, steps: Iterable[Step]) -> int:
    """Write ``steps`` as a FLAME-MoE CSV folder (``dest/Layer_<N>/<model>_layer<N>.csv``); returns the tokens.

    The format holds one token per step and every MoE layer in every step, so other traces are refused. It holds
    router scores, which a routing trace does not: each token's experts get the scores ``k, k-1, ..., 1`` over
    ``k(k+1)/2``, in its order, so reading the folder back gives the same experts in the same order.
    """
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise TraceError(f"{dest}: exists and is not empty; FLAME output needs a new folder")
    layers = header.moe_layers
    rows: list[np.ndarray] = []  # per token: [layers, top_k] expert ids
    for number, step in enumerate(steps):
        if [rec.layer for rec in step] != list(layers) or any(rec.topk_ids.shape[0] != 1 for rec in step):
            raise TraceError(
                f"step {number}: FLAME CSVs hold one token per step in every MoE layer {list(layers)}, in order; "
                f"this step has layers {[rec.layer for rec in step]} with {[len(rec.topk_ids) for rec in step]} tokens"
            )
        rows.append(np.stack([rec.topk_ids[0] for rec in step]))
    if not rows:
        raise TraceError("the trace has no steps to write as FLAME CSVs")
    ids = np.stack(rows).astype(np.int64)  # [tokens, layers, top_k]
    tokens, _, top_k = ids.shape
    rank_scores = np.arange(top_k, 0, -1) / (top_k * (top_k + 1) / 2)  # [top_k], descending, sum 1
    columns = "layer_id,token_id," + ",".join(f"expert_{e}" for e in range(header.num_experts))
    name = header.model.replace("_", "-").replace("/", "-") or "trace"
    for i, layer in enumerate(layers):
        table = np.zeros((tokens, 2 + header.num_experts))  # [tokens, 2 + experts]
        table[:, 0] = layer
        table[:, 1] = np.arange(tokens)
        np.put_along_axis(table[:, 2:], ids[:, i, :], rank_scores[None, :], axis=1)
        folder = dest / f"Layer_{layer}"
        folder.mkdir(parents=True)
        np.savetxt(folder / f"{name}_layer{layer}.csv", table, delimiter=",", header=columns, comments="", fmt="%.6g")
    return tokens


def _model_name(csv: Path) -> str:
    # File names look like "flame-moe-290m_runid..."; the name is only a label, never used to infer config.
    return csv.name.split("_", 1)[0] or "flame-moe"
