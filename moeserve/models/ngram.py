"""The rows of an n-gram table a token reads (Qwen4-Exp PLE), as transformers' Qwen4ExpTextNGramEmbedding picks them.

For the token at position p of a sequence and each k-gram order (k = 2..ngram_size), the ids t[p], t[p-1], ...,
t[p-k+1] are multiplied by the layer's hash multipliers and XOR-ed; a position before the sequence's start, or one
reached by walking back across an end-of-text token, reads the end-of-text id instead (n-grams never span
documents). Each of the order's heads_per_ngram heads takes the hash modulo its prime vocabulary, plus the head's
first row in the table. A token needs only the ngram_size - 1 tokens before it (`context`), so a sequence's rows do
not depend on how its tokens are split into steps: chunked == unchunked, prefix hit == miss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.models.ngram_hash import layer_multipliers
from moeserve.models.spec import NgramSpec


@dataclass(frozen=True)
class NgramHash:
    """One PLE layer's hash: multipliers [ngram_size], each head's vocabulary size and first row [heads] (int64)."""

    multipliers: torch.Tensor
    sizes: torch.Tensor
    offsets: torch.Tensor
    ngram_size: int
    heads_per_ngram: int
    eos: int

    @staticmethod
    def of(spec: NgramSpec, vocab_size: int, ple_index: int) -> NgramHash:
        sizes = spec.head_vocab_sizes[ple_index]
        offsets = [sum(sizes[:h]) for h in range(len(sizes))]
        return NgramHash(torch.tensor(layer_multipliers(vocab_size, spec.ngram_size, ple_index, spec.seed)),
                         torch.tensor(sizes), torch.tensor(offsets), spec.ngram_size, spec.heads_per_ngram,
                         spec.eos_token_id)

    def rows(self, context: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Table rows [n, heads] (int64) of one sequence's `tokens` [n], after `context` [ngram_size - 1]: the tokens
        before them, end-of-text ids where the sequence has none (its start)."""
        history = torch.cat([context, tokens]).long()
        back = self.ngram_size - 1
        n = tokens.shape[0]
        shifted = [history[back:]]
        stopped = torch.zeros(n, dtype=torch.bool)  # an end-of-text token seen between p - s + 1 and p - 1
        for s in range(1, self.ngram_size):
            previous = history[back - s + 1: back - s + 1 + n]  # t[p - s + 1]
            if s > 1:
                stopped = stopped | (previous == self.eos)
            shifted.append(torch.where(stopped, self.eos, history[back - s: back - s + n]))
        blocks = []
        for k in range(2, self.ngram_size + 1):
            mixed = shifted[0] * self.multipliers[0]
            for position in range(1, k):
                mixed = torch.bitwise_xor(mixed, shifted[position] * self.multipliers[position])
            heads = slice((k - 2) * self.heads_per_ngram, (k - 1) * self.heads_per_ngram)
            blocks.append(torch.remainder(mixed.unsqueeze(-1), self.sizes[heads]) + self.offsets[heads])
        return torch.cat(blocks, dim=-1)

    def next_context(self, context: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The context of the tokens after `tokens`: the last ngram_size - 1 of context + tokens."""
        return torch.cat([context, tokens.long()])[-(self.ngram_size - 1):]

    def start_context(self) -> torch.Tensor:
        return torch.full((self.ngram_size - 1,), self.eos, dtype=torch.long)
