"""Every research script (research/*.py) and every `moeserve bench` variant and `moeserve trace` tool that came out of
scripts/ runs to the end on tiny inputs and prints its figures: so none of them rots while the package changes under
it. Seconds each (the tiny bench shape, tiny random checkpoints, the demo model's recorded trace, one round); the
figures themselves are not checked.

A script runs as a subprocess, or in this process (IN_PROCESS: as `python research/NAME.py ARGS` does, __main__,
its argv, its stdout) where it leaves nothing behind that the tests after it would see (PROCESS_WIDE: no kernel
library of its own choosing, thread count, RNG seed, environment variable or patched class). A subprocess costs ~3 s
of CPU to import torch and the package before the script's own work."""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from moeserve.bench.checkpoints import write_tiny_checkpoint
from moeserve.bench.variants import VARIANTS

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RESEARCH = ROOT / "research"
TRACE = ROOT / "tests" / "experts" / "data" / "demo-batch1.jsonl"  # the demo model's decode trace, 4 x 8 experts

# research script -> (its arguments, a line fragment its figures print); {placeholders} are the fixtures' paths
SCRIPTS: dict[str, tuple[str, str]] = {
    "admission_demo": ("--experts 6 --batch 2 --tokens 8", "same tokens: True"),
    "bench_attention": ("--before . --rounds 1 --threads 1", "(min median max)"),
    "bench_canonical_gemv": ("--rounds 1 --threads 1", "experts plain:"),
    "bench_finite_check": ("--layers 1 --experts 4 --rounds 1 --folder {tmp}/finite", "inside the check"),
    "bench_gated_delta": ("--rounds 1 --tokens 64 --threads 1", "chunk form torch"),
    "bench_gemv": ("--rounds 1 --threads 1", "fused MoE op"),
    "bench_mamba2_chunk": ("--rounds 1 --calls 1 --tokens 64 --threads 1", "scan       torch"),
    "bench_mamba2_step": ("--rounds 1 --calls 1 --threads 1", "kernels    torch"),
    "bench_q4_experts": ("--rounds 1 --threads 1", "(min median max)"),
    "bench_routing_noaux": ("--rounds 1 --calls 1 --batches 1", "batch     1: torch"),
    "decode_breakdown": ("{shape} --rounds 1 --tokens 4", "decode step"),
    "quant_accuracy": ("--text {text} --tokens 16 --window 8", "int4 experts+dense   perplexity"),
    "policy_bench_replay": ("--shape tiny --fraction 0.5 --route-trace {trace} --prompts 1 --tokens 4 --prompt-len 4 "
                            "--cache-dir {cache}", "policy: 8 slots, engine hit rate"),
    "policy_cost": ("{trace} --capacity 8 --rounds 1", "reuse (deferred)"),
    "policy_lookahead": ("{trace} --capacity 8 --lookahead 0,1", "lookahead"),
    "policy_table": ("{trace} --capacity 8,16 --policy lru,lfru,belady --prefetch none --cache-mode shared",
                     "| capacity | Belady (demand, shared)"),
    "prefetch_opportunity": ("{shape} --expert-cache-gb 0.001 --tokens 8 --distances 1,2",
                             "guess 1 layer(s) ahead: misses caught"),
    "profile_decode": ("{shape} --steps 2 --rows 5", "Self CPU time total"),
    "serve_invariance_check": ("--model {qwen3_moe} --concurrency 2 --rounds 1 --max-tokens 4",
                               "round 1: 0 of 2 concurrent requests differ from their solo run"),
    "trace_predictability": ("{trace}", "previous layer, out of sample"),
}

# `moeserve ...` command -> (its arguments, a line fragment it prints)
COMMANDS: dict[str, tuple[str, str]] = {
    "bench offload": ("--model {tmp}/synth --layers 2 --experts 8 --tokens 4 --policies lru,static",
                      "static (prefetch off): hit rate"),
    "bench serve": ("--concurrency 2 --tokens 4 --prompt-len 8", "aggregate speed-up with 2 concurrent streams"),
    "bench route-trace": ("--shape tiny --trace {trace} --fractions 0.5 --peers moeserve-lru --tokens 2 --repeats 1 "
                          "--cache-dir {cache} --out-dir {tmp}/route", "decode-b1  moeserve-lru"),
    "bench sequence-memory": ("--quick --items 2 --cache-dir {cache}", "2. prefill, 2nd request"),
    "bench prefix-recurrent": ("--model {qwen3_next} --shared 64 --repeats 1", "off / snapshots, paired per round"),
    "bench batch-invariance": ("--model {qwen3_moe} --repeats 1 --tokens 2", "prefill-256  invariant"),
    "bench structured": ("--repeats 1 --tokens 4 --walks 1", "tok/s with one"),
    "bench checksum": ("--unit-mb 1 --units 2 --repeats 1 --dir {tmp}", "checksum / read per miss"),
    "bench commits": ("HEAD --shape tiny --batches 1 --tokens 2 --repeats 1 --cache-dir {cache}", "decode-b1: this"),
    "trace record": ("--out {tmp}/traces --tokens 4 --prompts 2 --batch 2", "batch2.jsonl: 17 lines"),
}


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The placeholders of SCRIPTS and COMMANDS: the tiny bench shape's checkpoint and its cache, tiny random
    checkpoints (attention-only and hybrid), a text, the demo trace, a scratch folder."""
    from moeserve.bench.shapes import get_shape
    from moeserve.bench.synth import ensure_checkpoint

    tmp = tmp_path_factory.mktemp("research")
    cache = tmp / "cache"
    text = tmp / "text.txt"
    text.write_text("It was a bright cold day in April, and the clocks were striking thirteen. " * 20)
    return {"tmp": str(tmp), "cache": str(cache), "trace": str(TRACE), "text": str(text),
            "shape": str(ensure_checkpoint(get_shape("tiny"), cache)),
            "qwen3_moe": str(write_tiny_checkpoint(tmp / "qwen3_moe", "qwen3_moe", "bfloat16")),
            "qwen3_next": str(write_tiny_checkpoint(tmp / "qwen3_next", "qwen3_next", "bfloat16"))}


# the scripts that touch no process-wide state (the module docstring): run in this process
IN_PROCESS = {"admission_demo", "bench_finite_check", "quant_accuracy", "policy_bench_replay", "policy_cost",
              "policy_lookahead", "policy_table", "serve_invariance_check", "trace_predictability"}
# what a script must not contain to run here: the benchmarks' kernel and thread set-up, a seed, an environment
# variable, a class or torch.ops patched in place (decode_breakdown and prefetch_opportunity patch them to time or
# record: subprocesses)
PROCESS_WIDE = ("kernel_setup", "set_num_threads", "manual_seed", "os.environ[", "__call__ =", "torch.ops.__dict__",
                "setattr(")


def _run_here(script: Path, args: list[str], printed: str, monkeypatch: pytest.MonkeyPatch,
              capsys: pytest.CaptureFixture[str]) -> None:
    """`python script args` in this process: exit status 0 (or none) and `printed` in what it printed."""
    monkeypatch.setattr(sys, "argv", [str(script), *args])
    monkeypatch.chdir(ROOT)
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as done:
        assert done.code in (0, None), f"{script.name} {' '.join(args)} exited {done.code}"
    out = capsys.readouterr().out
    assert printed in out, f"{script.name} {' '.join(args)} did not print {printed!r}:\n{out[-3000:]}"


def _run(argv: list[str], printed: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    assert printed in proc.stdout, f"{' '.join(argv)} did not print {printed!r}:\n{proc.stdout[-3000:]}"


def test_every_research_script_and_variant_is_run_here() -> None:
    assert {p.stem for p in RESEARCH.glob("*.py")} == set(SCRIPTS)
    assert {f"bench {v.replace('_', '-')}" for v in VARIANTS} <= set(COMMANDS)


def test_the_scripts_run_here_exist() -> None:
    assert IN_PROCESS <= set(SCRIPTS)
    for name in IN_PROCESS:  # none sets what kernel_setup sets (the module docstring)
        text = (RESEARCH / f"{name}.py").read_text()
        assert not any(w in text for w in PROCESS_WIDE), name


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_research_script_runs_and_prints_its_figures(name: str, paths: dict[str, str], monkeypatch, capsys) -> None:
    args, printed = SCRIPTS[name]
    if name in IN_PROCESS:
        _run_here(RESEARCH / f"{name}.py", args.format(**paths).split(), printed, monkeypatch, capsys)
    else:
        _run([sys.executable, str(RESEARCH / f"{name}.py"), *args.format(**paths).split()], printed)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_command_runs_and_prints_its_figures(command: str, paths: dict[str, str]) -> None:
    args, printed = COMMANDS[command]
    _run([sys.executable, "-m", "moeserve", *command.split(), *args.format(**paths).split()], printed)
