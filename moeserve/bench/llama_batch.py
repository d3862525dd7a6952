"""Batched greedy decode on llama.cpp (llama-cpp-python's low-level API): its `Llama` class decodes one sequence,
so the llama.cpp peer's decode-b8 runs here, as llama.cpp's own `llama-batched` example does: one context with
`n_seq_max` sequences over the model the `Llama` already loaded, every sequence's prompt in one `llama_batch`
(logits of its last token only), then one batch of one token per sequence per step."""

from __future__ import annotations

import time
from typing import Any


class LlamaBatchedDecoder:
    """A second llama.cpp context on `model` (a llama-cpp-python `_LlamaModel`'s `.model` pointer) holding
    `n_seq` sequences of up to `n_ctx_seq` tokens each, for `decode` of that many prompts together."""

    def __init__(self, model: Any, n_seq: int, n_ctx_seq: int, threads: int) -> None:
        import llama_cpp

        self.lib = llama_cpp
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_seq * n_ctx_seq
        params.n_batch = params.n_ubatch = max(512, n_seq)
        params.n_seq_max = n_seq
        params.n_threads = params.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context of {n_seq} sequences")
        self.n_seq = n_seq
        self.vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        self.batch_size = params.n_batch
        self.batch = llama_cpp.llama_batch_init(params.n_batch, 0, 1)

    def _run(self, tokens: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) entries."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(tokens)
        rc = self.lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, index: int) -> int:
        import numpy as np

        ptr = self.lib.llama_get_logits_ith(self.ctx, index)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(self.vocab,))))

    def decode(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
        """Prefill `prompts` (untimed, in batches of whole prompts), then time `new_tokens` steps of one token per
        sequence: (seconds, each sequence's greedy tokens, the first one included)."""
        if len(prompts) > self.n_seq:
            raise ValueError(f"{len(prompts)} prompts for a context of {self.n_seq} sequences")
        if max(map(len, prompts)) > self.batch_size:
            raise ValueError(f"a prompt of {max(map(len, prompts))} tokens: over the batch of {self.batch_size}")
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        nxt: list[int] = []
        for s, p in enumerate(prompts):  # one prompt per llama_decode: a prompt fits one batch (n_ctx_seq)
            self._run([(t, j, s, j == len(p) - 1) for j, t in enumerate(p)])
            nxt.append(self._argmax(len(p) - 1))
        out = [[t] for t in nxt]
        t0 = time.perf_counter()
        for step in range(new_tokens):
            self._run([(nxt[s], len(p) + step, s, True) for s, p in enumerate(prompts)])
            nxt = [self._argmax(s) for s in range(len(prompts))]
            for s, t in enumerate(nxt):
                out[s].append(t)
        return time.perf_counter() - t0, out

    def close(self) -> None:
        if self.ctx:
            self.lib.llama_batch_free(self.batch)
            self.lib.llama_free(self.ctx)
            self.ctx = None
