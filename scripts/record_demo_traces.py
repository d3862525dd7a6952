"""Record decode routing traces of the bundled demo model (a trained Qwen3-MoE router, 4 layers x 8 experts, top-2)
for the expert-cache policy study (docs/policies.md): one at batch 1 (prompts one after another) and one batched
(`--batch` prompts decoded together). Sampled at temperature 0.8, so each prompt's continuation differs.

    .venv/bin/python scripts/record_demo_traces.py --out /tmp/demo-traces --tokens 192 --prompts 12 --batch 8

Writes ``batch1.jsonl`` and ``batchN.jsonl`` (docs/trace-format.md) and prints their step counts.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from moeserve import LLM, SamplingParams

PROMPTS = [
    "Once upon a time", "It is a truth universally acknowledged, that", "Mr. Darcy walked into the room and",
    "The letter from Bath arrived", "Emma could not help thinking", "Her sister said nothing, but",
    "The ball at Netherfield", "Captain Wentworth", "When the carriage stopped at the door,",
    "Lady Catherine was", "In the morning the weather", "Anne Elliot had been",
    "Colonel Brandon", "Marianne played the pianoforte", "A single man of large fortune", "The garden at Pemberley",
]


def record(out: Path, prompts: list[str], batch: int, tokens: int) -> None:
    llm = LLM(dtype="bfloat16", threads=1, max_num_seqs=batch, record_trace=str(out), record_trace_format="jsonl")
    params = SamplingParams(temperature=0.8, max_tokens=tokens, ignore_eos=True, seed=7)
    for start in range(0, len(prompts), batch):
        llm.generate(prompts[start : start + batch], params)
    del llm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=192)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = (PROMPTS * 4)[: args.prompts]
    for batch in (1, args.batch):
        path = args.out / f"batch{batch}.jsonl"
        record(path, prompts, batch, args.tokens)
        print(f"{path}: {sum(1 for _ in path.open())} lines")


if __name__ == "__main__":
    main()
