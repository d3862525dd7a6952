"""LLMEngine: build what the start-up plan says, then run `step()` = schedule -> forward -> sample -> update.

Single-threaded by design: the HTTP server drives it from one background thread (see moeserve.server), the
offline `LLM` drives it in a loop. Every choice is made before anything is allocated, by engine/plan.py
`make_engine_plan` (the function `moeserve plan` prints from), and logged with its reason.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from types import MappingProxyType

import torch

from moeserve.checkpoint.folder import Checkpoint, open_checkpoint
from moeserve.config import EngineSettings
from moeserve.engine.choices import kv_cache_line
from moeserve.engine.ep import numerics_id, start_head
from moeserve.engine.grammar import GrammarCompiler
from moeserve.engine.outputs import RequestOutput
from moeserve.engine.plan import EnginePlan, StartupProbe, make_engine_plan
from moeserve.engine.sampler import Sampler
from moeserve.engine.sampling_params import SamplingParams
from moeserve.engine.scheduler import Scheduler
from moeserve.engine.sequence import Sequence, Status
from moeserve.engine.startup_log import CHOICES_LOG, LoadProgress, startup_summary
from moeserve.errors import CheckpointError, ExpertLoadError, MoeserveError, RequestError
from moeserve.experts.traces.jsonl import open_trace_writer
from moeserve.experts.traces.moetrace import FailSafeWriter, TraceHeader
from moeserve.memory.rss import fix_mmap_threshold
from moeserve.models.experts.remote import EpShare
from moeserve.models.layers.base import ForwardBatch
from moeserve.models.model import MoeModel, build_model
from moeserve.models.spec import ModelSpec
from moeserve.models.validate import read_model
from moeserve.preflight import check_engine_settings
from moeserve.state.kv_cache import KVGroup, PagedKVCache
from moeserve.state.manager import SequenceMemory
from moeserve.tokenizer import Tokenizer

log = logging.getLogger("moeserve")
choices_log = logging.getLogger(CHOICES_LOG)


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
        self._choices: dict[str, str] = {}
        # every choice made at start-up, by name, as the log printed it (value and reason): read-only
        self.choices = MappingProxyType(self._choices)
        model_path = s.model or str(demo_model_path())
        if s.model is None:
            log.info("model: none given, using the bundled demo model %s", model_path)
        self.checkpoint = ckpt = open_checkpoint(model_path)
        self.arch, self.spec = read_model(ckpt)  # config bounds and tensor shapes checked: nothing sized yet
        probe = StartupProbe(fix_mmap_threshold())  # before the tokenizer and the weights allocate
        self.tokenizer = None
        if not s.skip_tokenizer_init:
            self.tokenizer = Tokenizer(Path(s.tokenizer) if s.tokenizer else ckpt.path, s.chat_template)
        self.eos_token_ids = eos_token_ids(ckpt, self.tokenizer)
        # after the tokenizer: the split charges the process's RSS (memory_gb), the tokenizer's included
        # expert parallelism: the workers join and the experts are split before anything is sized (engine/ep.py)
        self.ep = start_head(s, ckpt, self.spec.moe.num_experts) if s.ep_workers else None
        if self.ep is not None:
            for i, line in enumerate(self.ep.lines):
                self._chose("expert parallelism" if i == 0 else f"expert parallelism, rank {i - 1}", line)
        held = self.ep.held(self.spec) if self.ep is not None else None
        self.plan = plan = make_engine_plan(ckpt, self.arch, self.spec, s, probe, self._chose, held)
        if self.ep is not None:
            self.ep.confirm(numerics_id(plan.numerics, plan.cpp_kernels, s.cpu_isa, plan.expert_plan, plan.dtype),
                            plan.device)
        self.kernel_seconds = probe.kernel_seconds  # a first build takes minutes: kept out of the load time
        torch.set_num_threads(plan.threads)
        self.device, self.dtype, self.dtype_name = plan.device, plan.dtype, plan.dtype_name
        self.max_model_len, self.max_num_batched_tokens = plan.max_model_len, plan.max_num_batched_tokens
        self.kv_groups: list[KVGroup] = list(plan.kv_groups)
        self._build(plan, model_path)
        self.scheduler = Scheduler(s.max_num_seqs, self.max_num_batched_tokens, self.memory)
        self.sampler = Sampler(_token_decoder(self.tokenizer), s.seed)
        self.requests: dict[str, Request] = {}
        self._next_id = 0
        self.load_seconds = time.monotonic() - t0 - self.kernel_seconds
        _log_loaded(self.model, self.load_seconds, self.kernel_seconds, self.dtype_name)
        log.info("%s", startup_summary(self.spec.architecture, plan))

    def _build(self, plan: EnginePlan, model_path: str) -> None:
        """The model (its weights streamed with a progress bar), the trace writer, the KV cache and the sequence
        memory, as `plan` sizes them; each built part's choices logged."""
        s, spec = self.settings, self.spec
        with LoadProgress(plan.load_bytes) as advance:
            options = plan.model_options
            if self.ep is not None:
                options = replace(options, ep=EpShare(self.ep.link, tuple(self.ep.owners)))
            self.model = build_model(self.checkpoint, self.arch, spec, plan.dtype, plan.device, plan.max_model_len,
                                     plan.expert_plan, plan.expert_capacity, s.cache_policy, advance,
                                     plan.store_options, options)
        for name, text in [("expert store", self.model.store.describe()), *self.model.choices]:
            self._chose(name, text)
        self.trace = open_trace(s.record_trace, s.record_trace_format, model_path, spec, self.model)
        if self.trace is not None:
            weakref.finalize(self, self.trace.close)  # flushed at exit even when nobody calls close()
        a = spec.attention
        self.kv = PagedKVCache(plan.kv_groups, plan.kv_blocks, s.block_size, a.num_kv_heads, a.head_dim, plan.dtype,
                               plan.device)
        self.memory = SequenceMemory([g.kind for g in plan.kv_groups], plan.kv_blocks, s.block_size,
                                     s.enable_prefix_caching)
        kv_line = kv_cache_line(self.kv.describe(), plan.dtype, self.memory.prefix_caching, plan.kv_groups,
                                s.enable_prefix_caching)
        for name, text in [("KV cache", kv_line), *plan.kv_choices]:
            self._chose(name, text)

    def _chose(self, name: str, text: str) -> None:
        """A choice made at start-up: logged at INFO on its own logger ("name: value (reason)"; CHOICES_LOG, which
        `chat` quiets) and kept in `choices`; the one-line summary follows them (engine/startup_log.py)."""
        choices_log.info("%s: %s", name, text)
        self._choices[name] = text

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
        batch = build_batch(scheduled, self.kv_groups, self.kv.block_size, self.device)
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


def eos_token_ids(ckpt: Checkpoint, tokenizer: Tokenizer | None) -> set[int]:
    """The ids that end a sequence: generation_config.json's eos_token_id, else config.json's, else the
    tokenizer's. CheckpointError when the file's value is not a token id or a list of them."""
    gen = ckpt.generation_config.get("eos_token_id")
    cfg = ckpt.config.get("eos_token_id")
    for value, file in ((gen, "generation_config.json"), (cfg, "config.json")):
        if value is not None:
            ids = value if isinstance(value, list) else [value]
            if any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
                raise CheckpointError(f"{ckpt.path / file}: 'eos_token_id' must be a token id or a "
                                      f"list of token ids, got {str(value)[:40]}")
            return set(ids)
    tok_eos = tokenizer.eos_token_id if tokenizer is not None else None
    return {tok_eos} if tok_eos is not None else set()


def open_trace(path: str | None, fmt: str, model_path: str, spec: ModelSpec, model: MoeModel) -> FailSafeWriter | None:
    """--record-trace: which experts each token used in each MoE layer (and the prefetch guesses); None without."""
    if path is None:
        return None
    header = TraceHeader(model=Path(model_path).name, num_layers=spec.num_layers, num_experts=spec.moe.num_experts,
                         top_k=spec.moe.top_k, moe_layers=tuple(spec.moe_layer_ids))
    # A failing write (full disk) disables recording with one error line; it never stops generation.
    writer = FailSafeWriter(open_trace_writer(path, header, fmt), path, lambda: model.set_trace_hook(None))
    model.set_trace_hook(lambda layer, ids, predicted: writer.record(layer, ids.cpu().numpy(), predicted))
    log.info("record_trace: writing routing of every step to %s (%s)", path, fmt)
    return writer


def _token_decoder(tokenizer: Tokenizer | None) -> Callable[[int], str] | None:
    """One token id -> its text, special tokens kept (the sampler's logprob entries); None without a tokenizer."""
    if tokenizer is None:
        return None
    return lambda i: tokenizer.decode([i], skip_special_tokens=False)


def _log_loaded(model: MoeModel, load_seconds: float, kernel_seconds: float, dtype_name: str) -> None:
    build = f"; the C++ kernels took {kernel_seconds:.0f} s more" if kernel_seconds >= 1 else ""
    log.info("Loading weights took %.2f seconds (resident %.1f MiB, expert cache %.1f MiB%s)",
             load_seconds, model.resident_bytes / 2**20, model.store.cache_nbytes / 2**20, build)
    if model.dequantized_linears:
        log.info("dense layers: %d quantized Linears (attention, shared/dense MLPs) dequantized to %s at load",
                 len(model.dequantized_linears), dtype_name)


def build_batch(scheduled: list[tuple[Sequence, int]], kv_groups: list[KVGroup], block_size: int,
                device: torch.device) -> ForwardBatch:
    """The step's tokens and, per KV group, their cache rows and the sequences' block tables."""
    tokens: list[int] = []
    positions: list[int] = []
    rows: list[int] = []
    groups = range(len(kv_groups))
    slots: list[list[int]] = [[] for _ in groups]
    for b, (seq, n) in enumerate(scheduled):
        start = seq.num_cached
        tokens += seq.tokens_to_compute(n)
        span = range(start, start + n)
        positions += span
        rows += [b] * n
        assert seq.blocks is not None
        for g in groups:
            table, kind = seq.blocks.tables[g], kv_groups[g].kind
            slots[g] += [kind.slot_of(table, p, block_size) for p in span]
    tables = [[seq.blocks.tables[g] for seq, _ in scheduled] for g in groups]  # type: ignore[union-attr]
    decode_only = len(tokens) == len(scheduled)
    return ForwardBatch(
        token_ids=torch.tensor(tokens, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        starts=[seq.num_cached for seq, _ in scheduled],
        num_new=[n for _, n in scheduled],
        slot_mappings=[torch.tensor(m, dtype=torch.long, device=device) for m in slots],
        block_tables=[_table_tensor(t, device) for t in tables],
        tables=tables,
        rows=None if decode_only else torch.tensor(rows, dtype=torch.long, device=device),
        prompt_lens=[len(seq.prompt_token_ids) for seq, _ in scheduled],
    )


def _table_tensor(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """Block tables as int64 [B, longest], padded (and freed entries, -1) with block 0: never read (the ops read
    only the blocks of the positions they attend)."""
    width = max(1, max(len(t) for t in tables))
    return torch.tensor([[max(b, 0) for b in t] + [0] * (width - len(t)) for t in tables], dtype=torch.long,
                        device=device)
