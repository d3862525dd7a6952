"""Decode speed of this tree against another commit, alternating in one run (A B A B), on a bench shape.

    .venv/bin/python scripts/bench_commits.py HEAD~3 --shape small --tokens 32 --repeats 7

The other commit is checked out in a temporary git worktree. Each tree runs `moeserve.bench.engines.
MoeserveEngine` (the class `moeserve bench` times) in its own process with that tree first on sys.path, loaded once;
the runs then alternate between the two processes, so a shared machine's drift hits both alike. Printed: each run's
tokens/s, and per case the median of the ratios of adjacent runs (this tree / the other). Both trees must have
`MoeserveEngine` with the same constructor (true since the bench exists). Greedy outputs are compared too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

DRIVER = r"""
import json, sys
from moeserve.bench.engines import MoeserveEngine
engine = MoeserveEngine(sys.argv[1], **json.loads(sys.argv[2]))
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    msg = json.loads(line)
    t = engine.decode(msg["prompts"], msg["tokens"])
    print(json.dumps({"seconds": t.seconds, "tokens": t.tokens, "token_ids": t.token_ids}), flush=True)
engine.close()
"""


class Tree:
    """One tree's engine in its own process, driven over stdin/stdout (one JSON line each way per call)."""

    def __init__(self, name: str, root: Path, model: str, settings: dict[str, object]) -> None:
        self.name = name
        env = {**os.environ, "PYTHONPATH": str(root)}
        self.proc = subprocess.Popen([sys.executable, "-c", DRIVER, model, json.dumps(settings)], cwd=root, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._read()  # waits for the load: a readiness line, not a timeout

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name}: the engine process ended (exit {self.proc.wait()})")
        return json.loads(line)

    def decode(self, prompts: list[list[int]], tokens: int) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompts": prompts, "tokens": tokens}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("other", help="the commit to compare with (any git revision)")
    ap.add_argument("--shape", default="small")
    ap.add_argument("--batches", default="1,8", help="comma-separated batch sizes (decode-b1, decode-b8)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--settings", default="{}", help="engine settings as JSON, for both trees")
    args = ap.parse_args()

    sys.path.insert(0, str(REPO))
    from moeserve.bench.runner import make_prompts
    from moeserve.bench.shapes import SHAPES
    from moeserve.bench.synth import ensure_checkpoint

    shape = SHAPES[args.shape]
    model = str(ensure_checkpoint(shape))
    settings = json.loads(args.settings)
    rev = subprocess.run(["git", "rev-parse", "--short", args.other], cwd=REPO, check=True, capture_output=True,
                         text=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, check=True, capture_output=True,
                          text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        other_root = Path(tmp) / "other"
        subprocess.run(["git", "worktree", "add", "--detach", str(other_root), rev], cwd=REPO, check=True,
                       capture_output=True)
        try:
            trees = [Tree(f"this tree ({head}+changes)", REPO, model, settings),
                     Tree(f"other ({rev})", other_root, model, settings)]
            for batch in (int(b) for b in args.batches.split(",")):
                runs: list[list[float]] = [[], []]
                for rep in range(-1, args.repeats):  # -1: warm-up
                    prompts = make_prompts(batch, args.prompt_len, shape.vocab_size, rep + 100)
                    outs = []
                    order = (0, 1) if rep % 2 else (1, 0)  # alternate who goes first
                    for i in order:
                        r = trees[i].decode(prompts, args.tokens if rep >= 0 else 2)
                        outs.append(r["token_ids"])
                        if rep >= 0:
                            runs[i].append(r["tokens"] / r["seconds"])
                    if rep >= 0 and outs[0] != outs[1]:
                        print(f"  note: greedy outputs differ at batch {batch}, run {rep}")
                ratios = [a / b for a, b in zip(*runs)]
                print(f"decode-b{batch}: this {statistics.median(runs[0]):.2f} tok/s, other "
                      f"{statistics.median(runs[1]):.2f} tok/s; ratio this/other median {statistics.median(ratios):.3f} "
                      f"(min {min(ratios):.3f}, max {max(ratios):.3f}, {len(ratios)} pairs)")
                print("  this: " + " ".join(f"{x:.2f}" for x in runs[0]))
                print("  other: " + " ".join(f"{x:.2f}" for x in runs[1]))
            for t in trees:
                t.close()
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(other_root)], cwd=REPO, check=False)


if __name__ == "__main__":
    main()
