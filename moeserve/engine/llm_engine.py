"""LLMEngine: load a model, then run `step()` = schedule -> forward -> sample -> update.

Single-threaded by design: the HTTP server drives it from one background thread (see moeserve.server), the
offline `LLM` drives it in a loop. Every choice made on the user's behalf is logged with its reason.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from moeserve import kernels
from moeserve.checkpoint.folder import open_checkpoint
from moeserve.config import EngineSettings, did_you_mean
from moeserve.engine.grammar import GrammarCompiler
from moeserve.engine.outputs import RequestOutput
from moeserve.engine.sampler import Sampler
from moeserve.engine.sampling_params import SamplingParams
from moeserve.engine.scheduler import Scheduler
from moeserve.engine.sequence import Sequence, Status
from moeserve.engine.sizing import memory_needs, spec_kv_groups
from moeserve.errors import CheckpointError, ConfigError, ExpertLoadError, MoeserveError, RequestError
from moeserve.experts.calls import static_policy_options
from moeserve.experts.policies import ONLINE_POLICY_NAMES
from moeserve.experts.spill import default_spill_root
from moeserve.experts.store import StoreOptions
from moeserve.experts.traces.jsonl import open_trace_writer
from moeserve.experts.traces.moetrace import FailSafeWriter, TraceHeader
from moeserve.memory.budget import ExpertBudget
from moeserve.memory.rss import fix_mmap_threshold
from moeserve.memory.sizing import size_tiers
from moeserve.memory.topology import detect_topology
from moeserve.models.experts.plans import (
    can_interleave_experts,
    expert_plan,
    int8_expert_plan,
    interleaved_expert_plan,
)
from moeserve.models.inventory import resident_nbytes
from moeserve.models.layers.base import ForwardBatch
from moeserve.models.mixers.mla import kv_per_token_line
from moeserve.models.model import ModelOptions, build_model
from moeserve.models.numerics import choose_numerics
from moeserve.models.validate import read_model
from moeserve.preflight import check_engine_settings
from moeserve.state.kv_cache import (
    PagedKVCache,
    group_block_bytes,
    prefix_snapshots,
    size_pools,
    snapshot_line,
)
from moeserve.state.manager import SequenceMemory
from moeserve.tokenizer import Tokenizer

log = logging.getLogger("moeserve")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CODE_TO_NAME = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


def demo_model_path() -> Path:
    return Path(__file__).resolve().parent.parent / "demo_model"


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None  # of the latest token sampled (time.monotonic(), as the two above)

    def output(self) -> RequestOutput:
        finished = all(s.status == Status.FINISHED for s in self.seqs)
        metrics = {"arrival_time": self.arrival_time}
        if self.first_token_time is not None:
            metrics["first_token_time"] = self.first_token_time
        if self.last_token_time is not None:
            metrics["last_token_time"] = self.last_token_time
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             [s.output() for s in self.seqs], finished, metrics)


class LLMEngine:
    def __init__(self, settings: EngineSettings) -> None:
        t0 = time.monotonic()
        self.closed = False  # close(): the weights are gone
        check_engine_settings(settings)  # a bad setting or path: one line now, not after the weights are read
        self.settings = s = settings
        self._choices: dict[str, str] = {}  # every start-up choice, by name: see `choices`
        model_path = s.model or str(demo_model_path())
        if s.model is None:
            log.info("model: none given, using the bundled demo model %s", model_path)
        self.checkpoint = ckpt = open_checkpoint(model_path)
        self.arch, self.spec = read_model(ckpt)  # config bounds and tensor shapes checked: nothing sized yet
        spec = self.spec
        self.device = self._choose_device(s.device)
        self.dtype = self._choose_dtype(s.dtype, spec.config_dtype, ckpt.stored_dtype())
        self._choose_threads(s.threads)
        self._chose("allocator", fix_mmap_threshold())
        self.max_model_len: int = self._choose_max_model_len(s.max_model_len, spec.max_position_embeddings)  # type: ignore[assignment]
        self.tokenizer = None
        if not s.skip_tokenizer_init:
            self.tokenizer = Tokenizer(Path(s.tokenizer) if s.tokenizer else ckpt.path, s.chat_template)
        self.eos_token_ids = self._eos_ids()

        self.cpp_kernels = self._choose_kernels(s.kernels)
        self.max_num_batched_tokens = self._choose_batched_tokens(s.max_num_batched_tokens, s.max_num_seqs)
        self.kv_groups = spec_kv_groups(spec, prefix_snapshots(s.max_num_seqs, s.enable_prefix_caching))
        step = max(g.kind.prefill_step for g in self.kv_groups)
        if self.max_num_batched_tokens < step + s.max_num_seqs:
            raise ConfigError(f"max_num_batched_tokens={self.max_num_batched_tokens} is too small for this model: its "
                              f"recurrent layers compute prompts in chunks of {step} positions, so a step needs room "
                              f"for one chunk beside max_num_seqs={s.max_num_seqs} decode tokens (set at least "
                              f"{step + s.max_num_seqs})")
        self._block_bytes = group_block_bytes(self.kv_groups, s.block_size, spec.attention.num_kv_heads,
                                              spec.attention.head_dim, self.dtype)
        plan, budget, store_options, load_bytes, kv_bytes = self._plan_memory(ckpt, spec, s)
        numerics, numerics_reason = choose_numerics(self.cpp_kernels, s.batch_invariant, self.dtype, self.device)
        with _progress(load_bytes) as advance:
            self.model = build_model(ckpt, self.arch, spec, self.dtype, self.device, self.max_model_len,
                                     plan, budget.capacity, s.cache_policy, advance, store_options,
                                     ModelOptions(numerics, numerics_reason, s.quantization == "int8", s.decode_step))
        self._chose("expert store", self.model.store.describe())
        for name, reason in self.model.choices:
            self._chose(name, reason)
        self.trace = self._open_trace(s.record_trace, s.record_trace_format, model_path)
        num_blocks = size_pools(self.kv_groups, self._block_bytes, kv_bytes, s.block_size, s.max_num_seqs,
                                self.max_num_batched_tokens, self.max_model_len)
        self.kv = PagedKVCache(self.kv_groups, num_blocks, s.block_size, spec.attention.num_kv_heads,
                               spec.attention.head_dim, self.dtype, self.device)
        self.memory = SequenceMemory([g.kind for g in self.kv_groups], num_blocks, s.block_size,
                                     s.enable_prefix_caching)
        no_reuse = [g.kind.name for g in self.kv_groups if not g.kind.caches_prefixes]
        why = (f" ({no_reuse[0]} layers: a state is valid only at the position it was left at)"
               if no_reuse and s.enable_prefix_caching else "")
        self._chose("KV cache", f"paged: {self.kv.describe()} ({self.dtype_name}); prefix caching "
                                f"{'on' if self.memory.prefix_caching else 'off'}{why}")
        snapshots = snapshot_line(self.kv_groups, self._block_bytes, s.max_num_seqs, s.block_size)
        if snapshots is not None:
            self._chose("prefix snapshots", snapshots)
        kv_line = kv_per_token_line(spec, self.dtype.itemsize)
        if kv_line is not None:
            self._chose("KV per token", kv_line)
        self.scheduler = Scheduler(s.max_num_seqs, self.max_num_batched_tokens, self.memory)
        decode_token = None
        if self.tokenizer is not None:
            tok = self.tokenizer
            decode_token = lambda i: tok.decode([i], skip_special_tokens=False)  # noqa: E731
        self.sampler = Sampler(decode_token, s.seed)
        self.requests: dict[str, Request] = {}
        self._next_id = 0
        self.load_seconds = time.monotonic() - t0 - self.kernel_seconds
        build = f"; the C++ kernels took {self.kernel_seconds:.0f} s more" if self.kernel_seconds >= 1 else ""
        log.info("Loading weights took %.2f seconds (resident %.1f MiB, expert cache %.1f MiB%s)",
                 self.load_seconds, self.model.resident_bytes / 2**20, self.model.store.cache_nbytes / 2**20, build)
        if self.model.dequantized_linears:
            log.info("dense layers: %d quantized Linears (attention, shared/dense MLPs) dequantized to %s at load",
                     len(self.model.dequantized_linears), self.dtype_name)

    def _chose(self, name: str, text: str) -> None:
        """A choice made at start-up: logged ("name: value (reason)") and kept in `choices`."""
        log.info("%s: %s", name, text)
        self._choices[name] = text

    @property
    def choices(self) -> Mapping[str, str]:
        """Every choice made at start-up, by name, as the log printed it (value and reason): read-only."""
        return MappingProxyType(self._choices)

    @cached_property
    def grammar_compiler(self) -> GrammarCompiler | None:
        """Compiles structured-output constraints for this tokenizer (None without one); built on first use."""
        if self.tokenizer is None:
            return None
        return GrammarCompiler(self.tokenizer.backend_json(), self.spec.vocab_size, sorted(self.eos_token_ids))

    def start_reference_scan(self) -> None:
        """Offloaded experts: the store records each unit's checksum in the background while no request runs
        (experts/verify.py). The scan's thread holds the engine only weakly and stops when it is collected.
        Started by the server (AsyncEngine), where files may change under a long-running process; an offline
        `LLM` relies on each unit's first read, so its disk traffic is only what its requests need."""
        engine = weakref.ref(self)

        def idle() -> bool:
            e = engine()
            return e is not None and not e.scheduler.has_work()

        scan = self.model.store.start_reference_scan(idle)
        if scan is not None:
            weakref.finalize(self, scan.stop, False)

    # ---------------------------------------------------------------------------------------- choices
    def _plan_memory(self, ckpt, spec, s: EngineSettings):  # noqa: ANN001, ANN202 - internal
        """Expert plan, fast-tier budget, store options and bytes to load, each choice logged with its reason."""
        dense_plan = plan = expert_plan(ckpt, self.arch, spec, self.dtype)
        spill = None if s.int8_cache_dir == "off" else Path(s.int8_cache_dir or default_spill_root()).expanduser()
        if s.quantization == "int8":
            plan = int8_expert_plan(dense_plan, self.dtype, spill)
        nonexpert = resident_nbytes(ckpt, plan, self.dtype)  # quantized Linears at their dequantized size
        total_experts = len(plan.sources)
        needs = memory_needs(spec, s, self.dtype, nonexpert, plan.layout.nbytes, total_experts,
                             self.max_num_batched_tokens)
        # every tier sized by the function `moeserve plan` calls (memory/sizing.py), its lines logged as printed there
        sizes = size_tiers(needs, detect_topology(self.device, s.unified_memory), s)
        for name, line in sizes.lines:
            self._chose(name, line)
        split, host = sizes.split, sizes.host
        self.max_model_len, kv_bytes = split.max_model_len, split.kv_bytes
        budget = ExpertBudget(split.expert_capacity, split.expert_bytes, split.lines[2][1])
        self._staging_estimate = split.staging_bytes
        # the layout holds the same bytes per unit, so the budget above stands
        if self._choose_expert_layout(dense_plan, s.quantization, s.expert_layout):
            plan = (int8_expert_plan(dense_plan, self.dtype, spill, interleaved=True) if s.quantization == "int8"
                    else interleaved_expert_plan(dense_plan))
        self._chose("experts", f"{plan.description} (quantization={s.quantization})")
        store_options = self._store_options(s, budget.capacity, host.capacity)

        preloaded = total_experts * plan.layout.nbytes if budget.capacity >= total_experts else 0
        load_bytes = nonexpert + preloaded
        return plan, budget, store_options, load_bytes, kv_bytes

    def _choose_expert_layout(self, plan, quantization: str, want: str) -> bool:  # noqa: ANN001 - ExpertPlan
        """True: hold the experts row-interleaved for the fused C++ ops (logged with the reason either way);
        expert_layout=interleaved raises ConfigError where it cannot apply.

        The choice never depends on where the experts live: the plain and interleaved ops round bf16 differently
        once a row spans several blocks, so an offloaded run must use the layout (and op) a resident one uses, or
        offloading would change the numbers. Offloaded bf16 misses are permuted to the interleaved layout as they
        leave the read buffer (interleaved measured 0.96-1.05x plain there), int8 ones are read interleaved."""
        if want == "plain":
            self._chose("expert layout", "plain (set)")
            return False
        why_not = None if self.cpp_kernels else "kernels=torch or the C++ kernels are unavailable"
        why_not = why_not or can_interleave_experts(plan, self.dtype)
        if why_not is None:
            op = "moe_int8_interleaved_supported" if quantization == "int8" else "moe_interleaved_supported"
            if not bool(getattr(torch.ops.moeserve, op)()):
                why_not = "the kernels were built without AVX512-BF16" + ("/VBMI" if quantization == "int8" else "")
        if why_not is not None and want == "interleaved":
            raise ConfigError(f"expert_layout=interleaved is not possible here: {why_not} (use auto or plain)")
        self._chose("expert layout", ("rows interleaved in blocks of 4 (the fused C++ op streams each block; "
                                       f"{'set' if want == 'interleaved' else 'auto'})") if why_not is None
                 else f"plain ({why_not})")
        return why_not is None

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def _choose_device(self, want: str) -> torch.device:
        if want == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device=cuda but no CUDA device is available (use device=cpu or auto)")
        if want == "auto":
            dev = "cuda" if torch.cuda.is_available() else "cpu"
            self._chose("device", f"{dev} (auto: {'CUDA available' if dev == 'cuda' else 'no CUDA device'})")
            return torch.device(dev)
        self._chose("device", f"{want} (set)")
        return torch.device(want)

    def _choose_dtype(self, want: str, config_dtype: str | None, stored_code: str) -> torch.dtype:
        if want != "auto":
            self._chose("dtype", f"{want} (set)")
            return DTYPES[want]
        name = config_dtype if config_dtype in DTYPES else _CODE_TO_NAME.get(stored_code, "bfloat16")
        why = "config.json dtype" if config_dtype in DTYPES else f"most weights are stored as {stored_code}"
        self._chose("dtype", f"{name} (auto: {why})")
        return DTYPES[str(name)]

    def _choose_threads(self, want: int | None) -> None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        n = want or cores
        torch.set_num_threads(n)
        self._chose("threads", f"{n} ({'set' if want else f'auto: all {cores} usable cores'})")

    def _choose_kernels(self, want: str) -> bool:
        """The moeserve C++ ops (norms, attention, dense GEMVs; each where its dtype applies) or torch's only;
        kernels=cpp raises ConfigError when they cannot be built or run here."""
        t0 = time.monotonic()
        use, reason = kernels.choose(want, self.device.type)
        self.kernel_seconds = time.monotonic() - t0  # a first build takes minutes: kept out of the load time
        self._chose("kernels", f"{'cpp' if use else 'torch'} ({want}: {reason})")
        return use

    def _choose_max_model_len(self, want: int | None, model_max: int) -> int | None:
        """The set max_model_len checked against the model's; None: memory/split.py picks it (logged there)."""
        if want is not None and want > model_max:
            raise ConfigError(f"max_model_len={want} exceeds the model's max_position_embeddings={model_max}")
        return want

    def _choose_batched_tokens(self, want: int | None, max_num_seqs: int) -> int:
        n = want if want is not None else max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_num_seqs)
        if n < max_num_seqs:
            raise ConfigError(f"max_num_batched_tokens={n} cannot hold one decode token of each of "
                              f"max_num_seqs={max_num_seqs} sequences: raise it or lower max_num_seqs")
        self._chose("max_num_batched_tokens", f"{n} ({'set' if want is not None else 'default'}): longer prompts "
                    "are prefilled in chunks of this many tokens between decode steps")
        return n

    def _eos_ids(self) -> set[int]:
        gen = self.checkpoint.generation_config.get("eos_token_id")
        cfg = self.checkpoint.config.get("eos_token_id")
        for value, file in ((gen, "generation_config.json"), (cfg, "config.json")):
            if value is not None:
                ids = value if isinstance(value, list) else [value]
                if any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
                    raise CheckpointError(f"{self.checkpoint.path / file}: 'eos_token_id' must be a token id or a "
                                          f"list of token ids, got {str(value)[:40]}")
                return set(ids)
        tok_eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        return {tok_eos} if tok_eos is not None else set()

    def _store_options(self, s: EngineSettings, capacity: int, host_capacity: int) -> StoreOptions:
        if s.cache_policy not in ONLINE_POLICY_NAMES:
            hint = did_you_mean(s.cache_policy, list(ONLINE_POLICY_NAMES))
            raise ConfigError(f"unknown cache_policy '{s.cache_policy}'{hint}")
        options: dict[str, Any] = {}
        if s.cache_policy == "static":
            if s.cache_trace is None:
                raise ConfigError("cache_policy=static pins the most used experts of a recorded trace: set "
                                  "cache_trace=FILE (record one with record_trace=FILE)")
            options = static_policy_options(s.cache_trace, capacity)
        return StoreOptions(policy=s.cache_policy, policy_options=options, host_capacity=host_capacity,
                            prefetch=s.prefetch is not False, prefetch_auto=s.prefetch == "auto",
                            cache_mode=s.expert_cache_mode, admission=s.expert_admission)

    def _open_trace(self, path: str | None, fmt: str, model_path: str) -> FailSafeWriter | None:
        """--record-trace: which experts each token used in each MoE layer (and the prefetch guesses)."""
        if path is None:
            return None
        spec = self.spec
        header = TraceHeader(model=Path(model_path).name, num_layers=spec.num_layers,
                             num_experts=spec.moe.num_experts, top_k=spec.moe.top_k,
                             moe_layers=tuple(spec.moe_layer_ids))
        # A failing write (full disk) disables recording with one error line; it never stops generation.
        model = self.model  # not `self`: the writer's callback would make a cycle through the engine
        writer = FailSafeWriter(open_trace_writer(path, header, fmt), path, lambda: model.set_trace_hook(None))
        weakref.finalize(self, writer.close)  # flushed at exit even when nobody calls close()
        model.set_trace_hook(lambda layer, ids, predicted: writer.record(layer, ids.cpu().numpy(), predicted))
        log.info("record_trace: writing routing of every step to %s (%s)", path, fmt)
        return writer

    # ------------------------------------------------------------------------------------------ requests
    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                    prompt_text: str | None = None) -> str:
        """Queue a prompt (text, or token ids with optionally the text they came from, for reporting).
        Raises RequestError if it cannot be served."""
        self._check_open()
        if request_id is None:
            request_id = str(self._next_id)
            self._next_id += 1
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use", param="request_id")
        text = prompt if isinstance(prompt, str) else prompt_text
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("text prompts need a tokenizer (skip_tokenizer_init=True was set): "
                                   "pass {'prompt_token_ids': [...]}", param="prompt")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        self.check_prompt(ids)
        seqs = [Sequence(request_id, i, ids, params, self.max_model_len, self.eos_token_ids)
                for i in range(params.n)]
        for seq in seqs:
            seq.first_sibling = seqs[0]
        self.requests[request_id] = Request(request_id, text, ids, seqs)
        self.scheduler.add(seqs)
        return request_id

    def check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise RequestError("the prompt is empty", param="prompt")
        if len(ids) >= self.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt has "
                f"{len(ids)} tokens, which leaves no room for a completion. Please reduce the length of the "
                "prompt.", param="prompt", code="context_length_exceeded")
        bad = [t for t in ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is out of range for vocabulary size {self.spec.vocab_size}",
                               param="prompt")

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its KV blocks. Returns its final output, or None if unknown."""
        self.scheduler.abort(request_id)
        req = self.requests.pop(request_id, None)
        return req.output() if req is not None else None

    def health_problem(self) -> str | None:
        """None, or one line: expert units that failed verification (experts/verify.py); requests needing them fail."""
        verifier = self.model.store.loader.verifier
        return verifier.degraded() if verifier is not None else None

    def sequence_memory_stats(self) -> dict[str, float]:
        """KV blocks, preemptions, prefix-cache hits and prefill tokens per step, for /metrics and --stats."""
        usage = self.memory.usage()
        used, total = sum(u for _, u, _ in usage), sum(t for _, _, t in usage)
        sched, prefix = self.scheduler.stats, self.memory.stats
        return {
            "kv_blocks_used": used, "kv_blocks_total": total, "kv_usage": used / total if total else 0.0,
            "preemptions": sched.preemptions, "steps": sched.steps, "prefill_tokens": sched.prefill_tokens,
            "last_step_prefill_tokens": sched.last_step_prefill_tokens,
            "prefix_queried_tokens": prefix.queried_tokens, "prefix_hit_tokens": prefix.hit_tokens,
            "prefix_hit_rate": prefix.hit_rate, "prefix_evictions": sum(p.evictions for p in self.memory.pools),
            "prefix_snapshots_saved": prefix.snapshots_saved, "prefix_snapshots_restored": prefix.snapshots_restored,
        }

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    # ---------------------------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """One engine step: schedule -> forward -> sample -> update. Returns outputs of advanced requests.
        An expert that cannot be read (ExpertLoadError) fails only the requests that need it: each request of the
        batch runs again alone (`_step_apart`), or, where the failed forward had already overwritten part of the
        sequences' memory (a recurrent state), is recomputed from its tokens alone (`Scheduler.isolate`)."""
        self._check_open()
        scheduled = self.scheduler.schedule()
        outputs = self._fail_unservable()
        if not scheduled:
            return outputs
        try:
            return outputs + self._run_step(scheduled)
        except ExpertLoadError as err:
            requests = {seq.request_id for seq, _ in scheduled}
            if len(requests) < 2:
                if not set(self.scheduler.isolated) & requests:
                    raise  # the batch is one request: it fails (its caller aborts it)
                return outputs + self._fail_request(scheduled[0][0].request_id, err)
        if self.memory.written_in_place:
            self.scheduler.isolate(scheduled)
            return outputs
        return outputs + self._step_apart(scheduled)

    def _fail_request(self, request_id: str, err: ExpertLoadError) -> list[RequestOutput]:
        """End `request_id` at once (aborted, its blocks freed) with `err` in its output."""
        log.warning("request %s failed: %s", request_id, err)
        out = self.abort_request(request_id)
        if out is None:
            return []
        out.error = err
        return [out]

    def _fail_unservable(self) -> list[RequestOutput]:
        """Sequences the KV pools cannot hold even alone (the memory split prevents it; a last guard)."""
        outputs = []
        while self.scheduler.unservable:
            seq = self.scheduler.unservable.pop()
            out = self.abort_request(seq.request_id)
            if out is not None:
                out.error = RequestError(f"the sequence ({seq.length} tokens) does not fit in the KV cache "
                                         f"({self.kv.describe()}): lower max_tokens or raise kv_cache_gb",
                                         param="messages", code="context_length_exceeded")
                outputs.append(out)
        return outputs

    def _run_step(self, scheduled: list[tuple[Sequence, int]]) -> list[RequestOutput]:
        batch = self._build_batch(scheduled)
        self.kv.copy_blocks(self.memory.take_copies())  # recurrent prefix snapshots restored into new slots
        logits = self.model.forward(batch, self.kv)
        if self.trace is not None:
            self.trace.end_step()
        self.scheduler.computed(scheduled)
        self.kv.copy_blocks(self.memory.take_copies())  # snapshots saved where a prompt chunk ended
        done = [i for i, (seq, _) in enumerate(scheduled) if seq.num_cached == seq.length]  # else: a prefill chunk
        if not done:
            return []
        seqs = [scheduled[i][0] for i in done]
        samples = self.sampler(logits[done] if len(done) < len(scheduled) else logits, seqs)
        return self._update(seqs, samples)

    def _step_apart(self, scheduled: list[tuple[Sequence, int]]) -> list[RequestOutput]:
        """A step of several requests failed reading an expert (corrupt or unreadable: experts/verify.py). Which
        request needed it is not known, so each request runs alone: one that fails again ends at once (aborted,
        its KV blocks freed) with the error in its output's `error`; the others advance as in any step. Repeating
        the step is safe where no kind is written in place: a failed forward changed no sequence, and the K/V it
        wrote are written again."""
        groups: dict[str, list[tuple[Sequence, int]]] = {}
        for item in scheduled:
            groups.setdefault(item[0].request_id, []).append(item)
        outputs: list[RequestOutput] = []
        for request_id, group in groups.items():
            try:
                outputs += self._run_step(group)
            except ExpertLoadError as err:
                outputs += self._fail_request(request_id, err)
        return outputs

    def _build_batch(self, scheduled: list[tuple[Sequence, int]]) -> ForwardBatch:
        """The step's tokens and, per KV group, their cache rows and the sequences' block tables."""
        bs = self.kv.block_size
        tokens: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        groups = range(len(self.kv_groups))
        slots: list[list[int]] = [[] for _ in groups]
        for b, (seq, n) in enumerate(scheduled):
            start = seq.num_cached
            tokens += seq.tokens_to_compute(n)
            span = range(start, start + n)
            positions += span
            rows += [b] * n
            assert seq.blocks is not None
            for g in groups:
                table, kind = seq.blocks.tables[g], self.kv_groups[g].kind
                slots[g] += [kind.slot_of(table, p, bs) for p in span]
        tables = [[seq.blocks.tables[g] for seq, _ in scheduled] for g in groups]  # type: ignore[union-attr]
        dev = self.device
        decode_only = len(tokens) == len(scheduled)
        return ForwardBatch(
            token_ids=torch.tensor(tokens, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            starts=[seq.num_cached for seq, _ in scheduled],
            num_new=[n for _, n in scheduled],
            slot_mappings=[torch.tensor(m, dtype=torch.long, device=dev) for m in slots],
            block_tables=[_table_tensor(t, dev) for t in tables],
            tables=tables,
            rows=None if decode_only else torch.tensor(rows, dtype=torch.long, device=dev),
            prompt_lens=[len(seq.prompt_token_ids) for seq, _ in scheduled],
        )

    def _update(self, seqs: list[Sequence], samples: list) -> list[RequestOutput]:
        now = time.monotonic()
        touched: dict[str, Request] = {}
        for seq, (token, logprobs) in zip(seqs, samples):
            req = self.requests[seq.request_id]
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            detok = None
            if self.tokenizer is not None:
                tok, skip = self.tokenizer, seq.params.skip_special_tokens
                detok = lambda ids, tok=tok, skip=skip: tok.decode(ids, skip_special_tokens=skip)  # noqa: E731
            seq.append(token, logprobs, detok)
            if seq.status == Status.FINISHED:
                self.scheduler.finish(seq)
            touched[req.request_id] = req
        outputs = []
        for req in touched.values():
            out = req.output()
            if out.finished:
                del self.requests[req.request_id]
            outputs.append(out)
        return outputs

    def close(self) -> None:
        """Stop the store's threads, close the trace and free the weights, the expert store's pool and the KV cache
        now, not at Python's next cycle collection (MoeModel.close). Idempotent; the engine serves nothing after:
        `add_request` and `step` raise a one-line MoeserveError."""
        if self.closed:
            return
        self.closed = True
        self.model.close()
        # an empty cache in its place: the pools are freed now (the fused step's stack held them too: gone above)
        self.kv = PagedKVCache([], [], self.kv.block_size, 0, 0, self.dtype, self.device)
        if self.trace is not None:
            self.trace.close()

    def _check_open(self) -> None:
        if self.closed:
            raise MoeserveError("this engine was closed (LLMEngine.close()): open a new one")


def _table_tensor(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """Block tables as int64 [B, longest], padded (and freed entries, -1) with block 0: never read (the ops read
    only the blocks of the positions they attend)."""
    width = max(1, max(len(t) for t in tables))
    return torch.tensor([[max(b, 0) for b in t] + [0] * (width - len(t)) for t in tables], dtype=torch.long,
                        device=device)


class _progress:
    """A tqdm bar over bytes actually read (context manager yielding the advance callback)."""

    def __init__(self, total_bytes: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="Loading weights",
                        disable=None, leave=False)

    def __enter__(self) -> Callable[[int], None]:
        return self.bar.update

    def __exit__(self, *exc: object) -> None:
        self.bar.close()
