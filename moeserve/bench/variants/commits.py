"""Decode speed of this tree against another commit, alternating in one run (A B A B), on a bench shape.

The other commit is checked out in a temporary git worktree (so this needs a git checkout of moeserve). Each tree
runs `moeserve.bench.engines.MoeserveEngine` (the class `moeserve bench` times) in its own process with that tree
first on sys.path, loaded once; the runs then alternate between the two processes, so a shared machine's drift hits
both alike. Printed: each run's tokens/s, and per batch size the median of the ratios of adjacent runs (this tree /
the other). Both trees must have `MoeserveEngine` with the same constructor (true since the bench exists). Greedy
outputs are compared too.

    moeserve bench commits HEAD~3 --shape small --tokens 32 --repeats 7
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
from typing import Any

from moeserve.bench.variants import add_parser, add_repeats_flag, require_positive

# One tree's engine, driven over stdin/stdout: one JSON line each way per call.
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


def register(sub: argparse._SubParsersAction) -> None:
    p = add_parser(sub, "commits", __doc__)
    p.add_argument("other", metavar="OTHER", help="the commit to compare with (any git revision)")
    p.add_argument("--shape", default="small", help="bench shape (moeserve bench --help lists them)")
    p.add_argument("--batches", default="1,8", help="comma-separated batch sizes (decode-b1, decode-b8)")
    p.add_argument("--tokens", type=int, default=32, help="decode steps timed per run")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens before decode")
    add_repeats_flag(p, 7)
    p.add_argument("--settings", default="{}", help="engine settings as JSON, for both trees")
    p.add_argument("--cache-dir", type=Path, default=None, help="where the bench checkpoint is cached")
    p.set_defaults(func=run)


class Tree:
    """One tree's engine in its own process, driven over stdin/stdout (one JSON line each way per call)."""

    def __init__(self, name: str, root: Path, model: str, settings: dict[str, Any]) -> None:
        self.name = name
        env = {**os.environ, "PYTHONPATH": str(root)}
        self.proc = subprocess.Popen([sys.executable, "-c", DRIVER, model, json.dumps(settings)], cwd=root, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._read()  # waits for the load: a readiness line, not a timeout

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name}: the engine process ended (exit {self.proc.wait()})")
        return dict(json.loads(line))

    def decode(self, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompts": prompts, "tokens": tokens}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait()


def _git(repo: Path, *args: str) -> str:
    from moeserve.errors import ConfigError

    proc = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ConfigError(f"git {' '.join(args)} in {repo}: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout.strip()


def _compare(trees: list[Tree], batch: int, args: argparse.Namespace, vocab: int) -> None:
    """Alternate the two trees `args.repeats` times at `batch` (after a warm-up each); print the runs and ratios."""
    from moeserve.bench.runner import make_prompts

    runs: list[list[float]] = [[], []]
    for rep in range(-1, args.repeats):  # -1: warm-up
        prompts = make_prompts(batch, args.prompt_len, vocab, rep + 100)
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


def run(args: argparse.Namespace) -> int:
    import moeserve
    from moeserve.bench.shapes import get_shape
    from moeserve.bench.synth import ensure_checkpoint

    require_positive(tokens=args.tokens, prompt_len=args.prompt_len, repeats=args.repeats)
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    repo = Path(moeserve.__file__).resolve().parents[1]
    rev, head = _git(repo, "rev-parse", "--short", args.other), _git(repo, "rev-parse", "--short", "HEAD")
    shape = get_shape(args.shape)
    model = str(ensure_checkpoint(shape, args.cache_dir))
    settings = json.loads(args.settings)
    with tempfile.TemporaryDirectory() as tmp:
        other_root = Path(tmp) / "other"
        _git(repo, "worktree", "add", "--detach", str(other_root), rev)
        try:
            trees = [Tree(f"this tree ({head}+changes)", repo, model, settings),
                     Tree(f"other ({rev})", other_root, model, settings)]
            for batch in batches:
                _compare(trees, batch, args, shape.vocab_size)
            for t in trees:
                t.close()
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(other_root)], cwd=repo, check=False)
    return 0
