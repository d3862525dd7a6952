"""Engines under test: one interface over moeserve and its peers, so the runner times them all the same way.

Each engine is loaded once in its own worker process (see `worker.py`), so its peak RSS is its own. The timed
regions are the same for all: `decode` times the steps after the first token (the prefill is excluded),
`prefill` times the forward that produces the first token of a fresh prompt.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Timing:
    """What one timed run produced."""

    seconds: float
    tokens: int  # tokens produced (decode) or consumed (prefill) in `seconds`
    steps: int  # forward calls in `seconds`
    token_ids: list[list[int]] = field(default_factory=list)  # greedy outputs, to check engines agree
    store: dict[str, float] = field(default_factory=dict)  # expert-store counters over the timed region

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class BenchEngine(ABC):
    """An engine the benchmark can time: load once, then decode and prefill greedy, token ids in and out."""

    name: str = ""
    # (dense, expert) weight bytes per parameter read from the engine's own file (a quantized GGUF's mix of
    # types); None: report.BYTES_PER_PARAM by the engine's name
    bytes_per_param: tuple[float, float] | None = None

    @abstractmethod
    def decode(self, prompts: list[list[int]], new_tokens: int) -> Timing:
        """Prefill `prompts` together (untimed), then time `new_tokens` greedy decode steps of the batch."""

    @abstractmethod
    def prefill(self, prompt: list[int]) -> Timing:
        """Time the forward over `prompt` that yields its first token."""

    def close(self) -> None:  # noqa: B027 - optional hook, most engines hold nothing to release
        """Release what the engine holds."""


class MoeserveEngine(BenchEngine):
    name = "moeserve"

    def __init__(self, model: str, route_trace: str | None = None, **settings: Any) -> None:
        """`route_trace`: a routing trace the model's experts follow instead of its routers (benchmark only:
        bench/route_trace.py)."""
        from moeserve.config import EngineSettings, build_settings
        from moeserve.engine.llm_engine import LLMEngine

        s = build_settings(EngineSettings, {"model": model, "skip_tokenizer_init": True, **settings})
        self.engine = LLMEngine(s)
        if model.endswith(".gguf"):  # experts as the file stores them; the other weights dequantized at load (bf16)
            from moeserve.bench.gguf_file import bytes_per_param

            self.bytes_per_param = (2.0, bytes_per_param(model)[1])
        if route_trace is not None:
            from moeserve.bench.route_trace import install

            install(self.engine.model, route_trace)

    def _params(self, max_tokens: int) -> Any:
        from moeserve.engine.sampling_params import SamplingParams

        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def _store_counters(self) -> dict[str, float]:
        st = self.engine.model.store.stats
        return {"hits": st.hits, "misses": st.misses, "bytes_read": st.bytes_read,
                "bytes_from_disk": st.bytes_from_disk, "bytes_from_host": st.bytes_from_host,
                "prefetched": st.prefetched, "prefetch_used": st.prefetch_used,
                "bypassed": st.bypassed}

    def decode(self, prompts: list[list[int]], new_tokens: int) -> Timing:
        eng = self.engine
        ids = [eng.add_request(p, self._params(new_tokens + 1)) for p in prompts]
        outputs: dict[str, Any] = {}
        # prefill + first token, untimed: as many steps as the chunked prefill takes (max_num_batched_tokens)
        while any(i not in outputs or not outputs[i].outputs[0].token_ids for i in ids):
            for o in eng.step():
                outputs[o.request_id] = o
        before = self._store_counters()
        steps = 0
        t0 = time.perf_counter()
        while eng.has_unfinished_requests():
            for o in eng.step():
                outputs[o.request_id] = o
            steps += 1
        seconds = time.perf_counter() - t0
        after = self._store_counters()
        tokens = [list(outputs[i].outputs[0].token_ids) for i in ids]
        store = {k: after[k] - before[k] for k in after}
        return Timing(seconds, len(prompts) * new_tokens, steps, tokens, store)

    def prefill(self, prompt: list[int]) -> Timing:
        eng = self.engine
        before = self._store_counters()
        t0 = time.perf_counter()
        eng.add_request(prompt, self._params(1))
        while eng.has_unfinished_requests():
            eng.step()
        seconds = time.perf_counter() - t0
        after = self._store_counters()
        return Timing(seconds, len(prompt), 1, [], {k: after[k] - before[k] for k in after})

    def close(self) -> None:
        self.engine.close()


class TransformersEngine(BenchEngine):
    """Hugging Face transformers, all weights resident (or, with `offload_folder`, accelerate disk offload)."""

    name = "transformers"

    def __init__(self, model: str, dtype: str = "bfloat16", threads: int | None = None,
                 offload_folder: str | None = None, max_cpu_memory_bytes: int | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        if threads:
            torch.set_num_threads(threads)
        kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype)}
        if offload_folder is not None:
            # accelerate places what fits in `max_memory` on the CPU and the rest on "disk", loading each
            # offloaded module's weights from the offload folder on every forward.
            self.name = "transformers+accelerate-offload"
            kwargs.update(device_map="auto", offload_folder=offload_folder, offload_state_dict=True,
                          max_memory={"cpu": max_cpu_memory_bytes or 2**30})
        self.model = AutoModelForCausalLM.from_pretrained(model, **kwargs).eval()

    def _greedy(self, input_ids: Any, new_tokens: int) -> tuple[float, int, list[list[int]]]:
        import torch

        with torch.inference_mode():
            out = self.model(input_ids=input_ids, use_cache=True)
            past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1)
            generated = [nxt]
            t0 = time.perf_counter()
            for _ in range(new_tokens):
                out = self.model(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
                past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1)
                generated.append(nxt)
            seconds = time.perf_counter() - t0
        tokens = torch.stack(generated, dim=1).tolist()
        return seconds, new_tokens, tokens

    def decode(self, prompts: list[list[int]], new_tokens: int) -> Timing:
        import torch

        if len({len(p) for p in prompts}) != 1:
            raise ValueError("the transformers peer needs prompts of equal length (no padding)")
        seconds, steps, tokens = self._greedy(torch.tensor(prompts, dtype=torch.long), new_tokens)
        return Timing(seconds, len(prompts) * new_tokens, steps, tokens)

    def prefill(self, prompt: list[int]) -> Timing:
        import torch

        with torch.inference_mode():
            t0 = time.perf_counter()
            self.model(input_ids=torch.tensor([prompt], dtype=torch.long), use_cache=True)
            seconds = time.perf_counter() - t0
        return Timing(seconds, len(prompt), 1)


class LlamaCppEngine(BenchEngine):
    """llama.cpp through llama-cpp-python on a GGUF of the same weights: one sequence through its `Llama` API,
    several through a batched context on the same loaded model (bench/llama_batch.py)."""

    name = "llama.cpp"

    def __init__(self, gguf_path: str, threads: int | None = None, n_ctx: int = 1024) -> None:
        import os

        from llama_cpp import Llama

        from moeserve.bench.gguf_file import bytes_per_param

        self.threads = threads or len(os.sched_getaffinity(0))
        self.n_ctx = n_ctx
        self.llm = Llama(model_path=gguf_path, n_ctx=n_ctx, n_threads=self.threads, n_threads_batch=self.threads,
                         n_batch=512, verbose=False, logits_all=False)
        self.bytes_per_param = bytes_per_param(gguf_path)  # (dense, experts) as this file stores them
        self.batched: Any = None  # LlamaBatchedDecoder, made on the first decode of several sequences

    def decode(self, prompts: list[list[int]], new_tokens: int) -> Timing:
        if len(prompts) != 1:
            return self._decode_batched(prompts, new_tokens)
        import numpy as np

        llm = self.llm
        vocab = llm.n_vocab()

        def last_logits() -> np.ndarray:
            # Without logits_all the binding keeps no scores: read the context's last-token logits directly.
            return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))

        llm.reset()
        llm.eval(prompts[0])
        nxt = int(np.argmax(last_logits()))
        out = [nxt]
        t0 = time.perf_counter()
        for _ in range(new_tokens):
            llm.eval([nxt])
            nxt = int(np.argmax(last_logits()))
            out.append(nxt)
        seconds = time.perf_counter() - t0
        return Timing(seconds, new_tokens, new_tokens, [out])

    def _decode_batched(self, prompts: list[list[int]], new_tokens: int) -> Timing:
        from moeserve.bench.llama_batch import LlamaBatchedDecoder

        if self.batched is None or self.batched.n_seq != len(prompts):
            if self.batched is not None:
                self.batched.close()
            self.batched = LlamaBatchedDecoder(self.llm._model.model, len(prompts), self.n_ctx, self.threads)
        seconds, tokens = self.batched.decode(prompts, new_tokens)
        return Timing(seconds, len(prompts) * new_tokens, new_tokens, tokens)

    def prefill(self, prompt: list[int]) -> Timing:
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(prompt)
        return Timing(time.perf_counter() - t0, len(prompt), 1)

    def close(self) -> None:
        if self.batched is not None:
            self.batched.close()
            self.batched = None


ENGINE_CLASSES: dict[str, type[BenchEngine]] = {
    "moeserve": MoeserveEngine,
    "transformers": TransformersEngine,
    "llama.cpp": LlamaCppEngine,
}
