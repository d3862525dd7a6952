"""Accuracy cost of on-load quantization (quantization="int8" / "int4") on the demo model: teacher-forced perplexity
on held-out text, top-1 agreement with the bf16 engine and the logit differences, for bf16 / int8 experts only
(kernels=torch, dense Linears bf16) / int8 experts + dense Linears (kernels=cpp) / int4 experts + int8 dense Linears (kernels=cpp:
the C++ 4-bit op and int8 GEMV) / int4 experts through torch (kernels=torch: dequantized per call, bf16 GEMMs, dense
Linears bf16).

    python scripts/demo_corpus.py --dump /tmp/austen      # the six novels as text, once
    .venv/bin/python research/quant_accuracy.py --text /tmp/austen/persuasion.txt [--tokens 2048] [--window 256]

The text is the start of the held-out novel (persuasion.txt: never seen by the model nor its tokenizer), in
non-overlapping windows; every position of a window is decoded one token at a time, so each engine predicts
every next token from the same context.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from moeserve import LLM
from moeserve.engine.llm_engine import demo_model_path
from moeserve.models.layers.base import ForwardBatch


@torch.inference_mode()
def window_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """fp32 logits [len(ids), vocab] after each token of `ids`, decoded one token at a time in one sequence's blocks."""
    engine = llm.engine
    blocks = engine.memory.new()
    assert engine.memory.grow(blocks, len(ids)), "the KV pool cannot hold the window"
    bs = engine.kv.block_size
    tables = [torch.tensor([t], dtype=torch.long) for t in blocks.tables]
    try:
        rows = []
        for pos, tok in enumerate(ids):
            t = torch.tensor([tok], dtype=torch.long)
            p = torch.tensor([pos], dtype=torch.long)
            slots = [torch.tensor([tb[pos // bs] * bs + pos % bs], dtype=torch.long) for tb in blocks.tables]
            batch = ForwardBatch(token_ids=t, positions=p, starts=[pos], num_new=[1], slot_mappings=slots,
                                 block_tables=tables, tables=[[tb] for tb in blocks.tables])
            rows.append(engine.model.forward(batch, engine.kv)[0])
        return torch.stack(rows)
    finally:
        engine.memory.free(blocks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", type=Path, required=True,
                    help="held-out text, e.g. persuasion.txt of `python scripts/demo_corpus.py --dump DIR`")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--window", type=int, default=256)
    args = ap.parse_args()
    text = args.text.read_text(encoding="utf-8")
    configs = {
        "bf16": dict(kernels="cpp"),
        "int8 experts": dict(kernels="torch", quantization="int8", int8_cache_dir="off"),
        "int8 experts+dense": dict(kernels="cpp", quantization="int8", int8_cache_dir="off"),
        "int4 experts+dense": dict(kernels="cpp", quantization="int4", int8_cache_dir="off"),
        "int4 experts (torch)": dict(kernels="torch", quantization="int4", int8_cache_dir="off"),
    }
    llms = {name: LLM(str(demo_model_path()), dtype="bfloat16", max_model_len=args.window + 1, **kw)
            for name, kw in configs.items()}
    tok = next(iter(llms.values())).engine.tokenizer
    assert tok is not None
    ids = tok.encode(text[: args.tokens * 8], add_special_tokens=False)[: args.tokens + 1]
    windows = [ids[i : i + args.window + 1] for i in range(0, len(ids) - 1, args.window)]
    logits: dict[str, list[torch.Tensor]] = {name: [] for name in llms}
    for w in windows:
        for name, llm in llms.items():
            logits[name].append(window_logits(llm, w[:-1]))
    targets = torch.cat([torch.tensor(w[1:]) for w in windows])
    ref = torch.cat(logits["bf16"])
    print(f"demo model, {targets.numel()} held-out tokens ({args.text.name}), windows of {args.window}")
    for name in llms:
        lg = torch.cat(logits[name])
        ppl = math.exp(torch.nn.functional.cross_entropy(lg, targets).item())
        top1 = (lg.argmax(-1) == ref.argmax(-1)).float().mean().item()
        diff = (lg - ref).abs()
        print(f"{name:20s} perplexity {ppl:8.3f}  top-1 agreement with bf16 {100 * top1:6.2f}%  "
              f"|logit - bf16 logit| max {diff.max().item():.3f} mean {diff.mean().item():.4f} "
              f"(logits' mean |value| {ref.abs().mean().item():.2f})")


if __name__ == "__main__":
    main()
