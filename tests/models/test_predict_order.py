"""MoEBlock.predict (the next router applied to this layer's input): the guesses come most
often chosen first, and among equally often chosen ones (every guess of a single token) the likelier first, so a
store that reads only the first guesses reads the likeliest."""

from __future__ import annotations

import torch

from moeserve import LLM


def test_next_router_guesses_in_order_of_count_then_chance() -> None:
    llm = LLM(dtype="bfloat16", threads=1, prefetch=True, expert_cache_gb=0.007)
    try:
        model = llm.engine.model
        block, nxt = model.moe_blocks[0], model.moe_blocks[1]
        assert block.predict_next is nxt
        gen = torch.Generator().manual_seed(0)
        hidden = model.spec.hidden_size
        for _ in range(20):  # single tokens: every guess chosen once, so the order is the next router's
            x = torch.randn(1, hidden, generator=gen).to(torch.bfloat16)
            logits = nxt.routing.logits(nxt.router, x).float()[0]
            expected = torch.argsort(logits, descending=True)[: model.spec.moe.top_k].tolist()
            assert block.predict(x) == expected
        x = torch.randn(9, hidden, generator=gen).to(torch.bfloat16)  # a batch: counts first
        top = torch.topk(nxt.routing.logits(nxt.router, x).float(), model.spec.moe.top_k, dim=-1).indices
        counts = torch.bincount(top.reshape(-1), minlength=model.spec.moe.num_experts)
        guesses = block.predict(x)
        assert sorted(guesses) == sorted(torch.nonzero(counts).reshape(-1).tolist())
        assert [int(counts[e]) for e in guesses] == sorted((int(counts[e]) for e in guesses), reverse=True)
    finally:
        llm.engine.close()
