"""Sampler: logits [B, V] -> one token per sequence, with vLLM's parameters and logprob semantics.

Log-probabilities are those of the model's raw distribution (log-softmax of the logits before penalties and
temperature), as vLLM reports by default. Greedy (temperature 0) is argmax; sampling draws from each sequence's
own generator when it has a seed, so a seeded request gives the same tokens whatever else runs beside it, and
from the engine's generator (seeded with EngineSettings.seed) otherwise.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moeserve.engine.outputs import Logprob
from moeserve.engine.sequence import Sequence


def apply_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """Repetition (prompt + output, multiplicative), presence and frequency (output only) penalties."""
    p = seq.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.all_token_ids)), dtype=torch.long, device=logits.device)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.output_token_ids:
        counts = torch.bincount(torch.tensor(seq.output_token_ids, device=logits.device),
                                minlength=logits.shape[-1])[: logits.shape[-1]].to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens outside top-k, outside the top-p nucleus, or below min_p x the top probability."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop_sorted = cum - torch.softmax(sorted_logits, dim=-1) > top_p  # keep the token that crosses top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return logits


def _plain_greedy(seq: Sequence) -> bool:
    """Greedy, without penalties, logprobs or a logits processor: the token is the argmax of the raw logits."""
    p = seq.params
    return (p.greedy and p.logprobs is None and p.repetition_penalty == 1.0 and not p.presence_penalty
            and not p.frequency_penalty and seq.logits_processor is None)


class Sampler:
    def __init__(self, decode_token: Callable[[int], str | None] | None = None, seed: int | None = None) -> None:
        """`seed` (EngineSettings.seed): the generator of requests without a seed of their own, so two engines
        with the same seed given the same requests in the same order sample the same tokens (None: torch's
        global generator)."""
        self.decode_token = decode_token
        self.generator = None if seed is None else torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[tuple[int, dict[int, Logprob] | None]]:
        """logits: fp32 [B, V], one row per sequence in `seqs`."""
        logits = logits.float().cpu()
        plain = [_plain_greedy(seq) for seq in seqs]
        if all(plain):  # the common decode case: one argmax for the whole batch
            # numpy's argmax: the same answer as torch.argmax (first maximum; a NaN counts as the maximum), ~4x
            # faster on a [B, 32000] row (9 vs 38 us per step measured: torch's reduction is not vectorised here)
            return [(token, None) for token in logits.numpy().argmax(axis=-1).tolist()]
        results: list[tuple[int, dict[int, Logprob] | None]] = []
        for row, seq, is_plain in zip(logits, seqs, plain):
            if is_plain:  # the same argmax it gets in an all-plain batch
                results.append((int(row.numpy().argmax()), None))
                continue
            token = self._sample_one(row.clone(), seq)
            results.append((token, self._logprobs(row, token, seq.params.logprobs)))
        return results

    def _sample_one(self, logits: torch.Tensor, seq: Sequence) -> int:
        p = seq.params
        if seq.logits_processor is not None:
            seq.logits_processor.mask(logits)
        logits = apply_penalties(logits, seq)
        if p.greedy:
            return int(torch.argmax(logits))
        logits = filter_logits(logits / p.temperature, p.top_k, p.top_p, p.min_p)
        probs = torch.softmax(logits, dim=-1)
        if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
            # Extreme parameters can overflow; never let one request's numbers kill the engine.
            return int(torch.argmax(logits))
        return int(torch.multinomial(probs, 1, generator=seq.generator or self.generator))

    def _logprobs(self, logits: torch.Tensor, token: int, k: int | None) -> dict[int, Logprob] | None:
        if k is None:
            return None
        logp = torch.log_softmax(logits, dim=-1)
        chosen = float(logp[token])
        out: dict[int, Logprob] = {}
        if k > 0:
            top_vals, top_ids = torch.topk(logp, k)
            for rank, (v, i) in enumerate(zip(top_vals.tolist(), top_ids.tolist()), start=1):
                out[i] = Logprob(v, rank, self._decode(i))
        if token not in out:
            out[token] = Logprob(chosen, int((logp > logp[token]).sum()) + 1, self._decode(token))
        return out

    def _decode(self, token: int) -> str | None:
        return self.decode_token(token) if self.decode_token is not None else None
