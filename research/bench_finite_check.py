"""What the NaN/inf check costs at load: a synthetic Qwen3-MoE checkpoint (moeserve/bench/checkpoints.py)
loaded resident, alternating rounds with the check on and off, plus the time spent inside the check itself.

    .venv/bin/python research/bench_finite_check.py [--layers 4] [--experts 64] [--rounds 3] [--folder /tmp/finite-bench]

Every load reads the file from disk (the reader drops the page cache it used), so the on/off difference is within
the disk's noise; the time inside the check (`is_finite`, summed) is the direct measure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import moeserve.checkpoint.finite as finite
from moeserve.bench.checkpoints import SYNTH_CONFIG, write_synthetic_checkpoint
from moeserve.engine.llm import LLM

REAL_IS_FINITE = finite.is_finite


def load_seconds(folder: Path, check: bool) -> tuple[float, float]:
    """(load seconds, seconds inside the check) of one resident load."""
    inside = [0.0]

    def timed(t):  # noqa: ANN001, ANN202
        t0 = time.perf_counter()
        try:
            return REAL_IS_FINITE(t)
        finally:
            inside[0] += time.perf_counter() - t0

    finite.is_finite = timed if check else (lambda t: True)  # type: ignore[assignment]
    t0 = time.perf_counter()
    llm = LLM(str(folder), skip_tokenizer_init=True, device="cpu", dtype="bfloat16", max_model_len=64,
              max_num_seqs=1)
    seconds = time.perf_counter() - t0
    assert llm.engine.model.store.resident
    llm.engine.close()
    finite.is_finite = REAL_IS_FINITE
    return seconds, inside[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=SYNTH_CONFIG["num_experts"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--folder", default="/tmp/finite-bench")
    args = ap.parse_args()
    folder = Path(args.folder)
    cfg = {**SYNTH_CONFIG, "num_hidden_layers": args.layers, "num_experts": args.experts}
    if not (folder / "config.json").is_file() or json.loads((folder / "config.json").read_text()) != cfg:
        write_synthetic_checkpoint(folder, cfg)
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    on, off, inside = [], [], []
    for _ in range(args.rounds):
        s, c = load_seconds(folder, True)
        on.append(s)
        inside.append(c)
        off.append(load_seconds(folder, False)[0])
    print(f"checkpoint {size / 2**30:.2f} GiB bf16, resident load, {args.rounds} rounds alternated")
    print(f"load with check  {statistics.median(on):.2f} s (median; {', '.join(f'{x:.2f}' for x in on)})")
    print(f"load without     {statistics.median(off):.2f} s (median; {', '.join(f'{x:.2f}' for x in off)})")
    med = statistics.median(inside)
    print(f"inside the check {med:.3f} s = {100 * med / statistics.median(on):.1f}% of the load, "
          f"{size / med / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
