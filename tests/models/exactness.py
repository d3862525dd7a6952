"""The shared driver of the model tests' exactness claims: run the engine, keep every step's logits, compare.

Every comparison is bit for bit (`torch.equal` on each engine step's fp32 logits, `==` on the greedy tokens and on
their logprobs) and runs with the settings given (the tests pass none: default settings, the checkpoint's dtype,
kernels auto = C++ where they build, the default thread count):

- `assert_chunked_equals_one_pass`: a prompt prefilled in chunks (several step budgets) == one pass;
- `assert_batched_and_preempted_equal_solo`: sequences of different lengths arriving at given steps (joining others
  mid-decode) in a KV pool too small for all of them (preempted, recomputed) == each one alone;
- `assert_offloaded_equals_resident`: a few expert slots == every expert resident, same schedule;
- `assert_matches_transformers` (fp32: tokens equal, logprobs within 1e-4) and `assert_near_transformers_bf16`
  (bf16: tokens until a near-tie, logprobs within 2 bf16 steps), transformers being the reference.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moeserve import LLM, SamplingParams
from moeserve.state.kv_cache import fixed_pool_bytes
from tests.engine.test_parity_transformers import hf_greedy
from tests.logits_capture import capturing_logits

STEPS = 6
MAX_MODEL_LEN = 512


def random_prompts(seed: int, lengths: tuple[int, ...], vocab: int = 300) -> list[list[int]]:
    """Prompts of the given lengths, random token ids below `vocab` (the tiny checkpoints' 300)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def greedy(steps: int = STEPS, logprobs: int = 3) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=logprobs)


@dataclass
class Run:
    """One engine's numbers: the logits of every engine step ([sequences in the step, vocab], fp32) and, per
    request in order, (greedy token ids, their logprobs)."""

    logits: list[torch.Tensor]
    outs: list[tuple[list[int], list]]
    unit_nbytes: int = 0  # one expert unit of the store
    choices: dict[str, str] = field(default_factory=dict)  # the engine's start-up choices
    pools: tuple = ()  # (KV groups, block bytes, max_num_seqs, max_num_batched_tokens): to size a tight pool
    batch_steps: list[int] = field(default_factory=list)  # engine steps of each batch run one after the other
    misses: int = 0  # expert-store misses (0: every expert resident or cached)
    fused: list[bool] = field(default_factory=list)  # per engine step: run by the fused decode step (decode_stack.py)
    ngram_misses: int = 0  # n-gram table store misses (models/ngram_table.py; 0: none, or every unit held)

    def requests(self, *indices: int) -> Run:
        """Of a `run_alone`: the run of the prompts at `indices`, in that order (their steps' logits, their outputs),
        as a `run_alone` of those prompts gives them."""
        assert len(self.batch_steps) == len(self.outs), "not a run of prompts one by one"
        starts = [sum(self.batch_steps[:i]) for i in range(len(self.batch_steps))]
        spans = [range(starts[i], starts[i] + self.batch_steps[i]) for i in indices]
        return Run([self.logits[s] for span in spans for s in span], [self.outs[i] for i in indices],
                   self.unit_nbytes, self.choices, self.pools, [self.batch_steps[i] for i in indices], self.misses,
                   [self.fused[s] for span in spans for s in span])

    def first(self, steps: int) -> Run:
        """Of one request's run whose every step sampled a token (a prompt in one pass): its first `steps` steps, as a
        run of `steps` tokens gives them."""
        assert len(self.outs) == 1 and len(self.logits) == len(self.outs[0][0]), "not one request in one pass"
        tokens, logprobs = self.outs[0]
        return Run(self.logits[:steps], [(tokens[:steps], logprobs[:steps])], self.unit_nbytes, self.choices,
                   self.pools, [steps], self.misses, self.fused[:steps])

    def kv_cache_gb(self, blocks: int, max_model_len: int, block_size: int = 16) -> float:
        """A kv_cache_gb whose full-attention (or latent) pools hold `blocks` blocks beside the fixed pools
        (recurrent state slots, sliding windows) this run's engine sized."""
        groups, block_bytes, max_num_seqs, batched = self.pools
        fixed, per_token = fixed_pool_bytes(groups, block_bytes, block_size, max_num_seqs, batched, max_model_len)
        return (fixed + blocks * block_size * per_token) / 2**30

    def last(self, steps: int) -> list[torch.Tensor]:
        """The logits of the last `steps` steps (one request: those that sampled its tokens)."""
        return self.logits[-steps:]


def open_llm(folder: Path, **settings: Any) -> LLM:
    return LLM(str(folder), skip_tokenizer_init=True, **{"max_model_len": MAX_MODEL_LEN, **settings})


def _run(folder: Path, batches: list[list[list[int]]], steps: int, settings: dict[str, Any]) -> Run:
    """Each batch of prompts generated together, one batch after the other, in one engine (closed afterwards)."""
    llm = open_llm(folder, **settings)
    engine = llm.engine
    outs, batch_steps = [], []
    try:
        with capturing_logits(engine) as logits, fused_steps(engine, logits) as fused:
            for prompts in batches:
                before = len(logits)
                done = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(steps))
                outs += [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in done]
                batch_steps.append(len(logits) - before)
    finally:
        engine.close()
    pools = (engine.kv_groups, engine.plan.block_bytes, engine.settings.max_num_seqs, engine.max_num_batched_tokens)
    store = engine.model.store
    table = engine.model.ngram_table
    return Run(logits, outs, store.unit_nbytes, dict(engine.choices), pools, batch_steps, store.stats.misses,
               [i in fused for i in range(len(logits))], table.store.stats.misses if table is not None else 0)


@contextmanager
def fused_steps(engine: Any, logits: list[torch.Tensor]) -> Iterator[set[int]]:
    """While inside: the set of the engine steps (indices into `logits`, capturing_logits' list) that the model's
    fused decode step ran (none when it has none)."""
    fused: set[int] = set()
    step = engine.model.decode_step
    if step is None:
        yield fused
        return
    run = step.run

    def counted(*args: Any) -> torch.Tensor:
        fused.add(len(logits))  # this step's logits are appended when the forward returns
        return run(*args)

    step.run = counted
    try:
        yield fused
    finally:
        del step.run  # the class's method again


def assert_decode_steps_fused(run: Run) -> None:
    """Of a run of prompts one by one, each in one pass: every engine step but each prompt's first (its prefill)
    ran the fused decode step."""
    assert "decode-only batch" in run.choices["decode step"], run.choices["decode step"]
    want = [i > 0 for n in run.batch_steps for i in range(n)]
    assert run.fused == want, f"steps run fused {run.fused}, decode steps {want}"


def run_together(folder: Path, prompts: list[list[int]], steps: int = STEPS, **settings: Any) -> Run:
    """`prompts` decoded together."""
    return _run(folder, [prompts], steps, settings)


def run_alone(folder: Path, prompts: list[list[int]], steps: int = STEPS, **settings: Any) -> Run:
    """Each of `prompts` alone, one after the other, in one engine."""
    return _run(folder, [[p] for p in prompts], steps, settings)


def assert_same_run(got: Run, ref: Run, what: str, steps: int | None = None) -> None:
    """Every step's logits `torch.equal` (only the last `steps` steps when given) and the outputs equal."""
    a, b = (got.logits, ref.logits) if steps is None else (got.last(steps), ref.last(steps))
    assert len(a) == len(b), f"{what}: {len(a)} engine steps, {len(b)} expected"
    for step, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and torch.equal(x, y), f"{what}: logits differ at step {step}"
    for i, (x, y) in enumerate(zip(got.outs, ref.outs)):
        assert x[0] == y[0], f"{what}: request {i}'s tokens differ"
        assert x[1] == y[1], f"{what}: request {i}'s logprobs differ"
    assert len(got.outs) == len(ref.outs), what


def assert_chunked_equals_one_pass(folder: Path, prompt: list[int], budgets: tuple[int, ...],
                                   one_pass: Run | None = None, steps: int = STEPS,
                                   **settings: Any) -> dict[int, Run]:
    """`prompt` prefilled under each step budget of `budgets` (max_num_batched_tokens below its length: chunks)
    gives the logits of the steps that sample, and the outputs, of `one_pass` (computed here when None) bit for
    bit. Returns the chunked runs by budget."""
    ref = one_pass or run_together(folder, [prompt], steps, **settings)
    runs = {}
    for budget in budgets:
        got = runs[budget] = run_together(folder, [prompt], steps, max_num_batched_tokens=budget, **settings)
        assert len(got.logits) > len(ref.logits), f"budget {budget}: the prompt was not cut into chunks"
        assert_same_run(got, ref, f"chunks under a budget of {budget} tokens", steps)
    return runs


def run_arrivals(llm: LLM, arrivals: list[tuple[int, list[int]]], steps: int) -> list[tuple[list[int], list]]:
    """Add each (engine step, prompt) when the engine reaches that step; run to the end. The outputs in the order
    of `arrivals`."""
    engine = llm.engine
    pending = sorted(enumerate(arrivals), key=lambda x: x[1][0])
    done: dict[str, tuple[list[int], list]] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt) = pending.pop(0)
            engine.add_request(prompt, greedy(steps), request_id=f"r{i}")
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (list(out.outputs[0].token_ids), out.outputs[0].logprobs)
        step += 1
    return [done[f"r{i}"] for i in range(len(arrivals))]


def assert_batched_and_preempted_equal_solo(folder: Path, arrivals: list[tuple[int, list[int]]], kv_blocks: int,
                                            steps: int, max_model_len: int = 128, solo: Run | None = None,
                                            step_tokens: int | None = None, **settings: Any) -> None:
    """The prompts of `arrivals` ((engine step, prompt)) run together in a pool of `kv_blocks` blocks (too small
    for all of them: at least one preemption asserted), under a step budget of `step_tokens` (None: the default;
    a small one cuts prompts into chunks beside the others' decode tokens), end with the tokens and logprobs each
    gets alone (`solo`: `run_alone` of the prompts in order at the default budget, computed here when None)."""
    prompts = [p for _, p in arrivals]
    solo = solo or run_alone(folder, prompts, steps, max_model_len=max_model_len, **settings)
    tight = open_llm(folder, max_model_len=max_model_len, max_num_batched_tokens=step_tokens,
                     kv_cache_gb=solo.kv_cache_gb(kv_blocks, max_model_len), **settings)
    try:
        together = run_arrivals(tight, arrivals, steps)
        assert tight.engine.scheduler.stats.preemptions > 0, "the pool was meant to be too small for all of them"
    finally:
        tight.engine.close()
    for i, (a, b) in enumerate(zip(together, solo.outs)):
        assert a[0] == b[0] and a[1] == b[1], f"request {i} (prompt of {len(prompts[i])} tokens, arrives at step " \
                                              f"{arrivals[i][0]})"


def assert_prefix_hit_equals_cold(folder: Path, first: list[int], second: list[int], shared: int,
                                  **settings: Any) -> dict[str, str]:
    """`second` (its first `shared` tokens those of `first`) run after `first` takes at least `shared` tokens from
    the prefix cache and gets the tokens and logprobs of a run without prefix caching. Returns the engine's choices."""
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=2)
    llm = open_llm(folder, **settings)
    llm.generate([{"prompt_token_ids": first}], params)
    hit = llm.generate([{"prompt_token_ids": second}], params)[0].outputs[0]
    choices, hit_tokens = dict(llm.engine.choices), llm.engine.memory.stats.hit_tokens
    llm.engine.close()
    assert hit_tokens >= shared, hit_tokens
    cold_llm = open_llm(folder, enable_prefix_caching=False, **settings)
    cold = cold_llm.generate([{"prompt_token_ids": second}], params)[0].outputs[0]
    cold_llm.engine.close()
    assert hit.token_ids == cold.token_ids and hit.logprobs == cold.logprobs
    return choices


def assert_offloaded_equals_resident(folder: Path, prompts: list[list[int]], resident: Run | None = None,
                                     units: int = 3, steps: int = STEPS, one_by_one: bool = False,
                                     **settings: Any) -> Run:
    """`units` expert slots give `resident`'s logits of every step and outputs bit for bit (`resident`: the
    prompts together, or one by one, computed here when None). Returns the offloaded run."""
    run = run_alone if one_by_one else run_together
    ref = resident or run(folder, prompts, steps, **settings)
    got = run(folder, prompts, steps, expert_cache_gb=units * ref.unit_nbytes / 2**30 * 1.001, **settings)
    assert ref.misses == 0 and got.misses > 0, (ref.misses, got.misses)
    assert_same_run(got, ref, f"{units} expert slots")
    return got


def assert_a_miss_reads_one_expert(folder: Path, prompts: list[list[int]], expert: str,
                                   not_read: tuple[str, ...] = ()) -> int:
    """One expert slot: every miss reads exactly the stored tensors of one expert (named `expert` + role, those ending
    in `not_read` left out, e.g. activation scales), nothing more. `expert` may name the layer "{L}" (experts whose
    stored size differs by layer: a miss of layer L reads layer L's). Returns the bytes of the first MoE layer's."""
    llm = LLM(str(folder), skip_tokenizer_init=True, expert_cache_gb=1e-9)
    engine, store = llm.engine, llm.engine.model.store
    before = engine.checkpoint.reader.bytes_read
    llm.generate([{"prompt_token_ids": p} for p in prompts], greedy())
    stored = {layer: sum(r.nbytes for n, r in engine.checkpoint.tensors.items()
                         if n.startswith(expert.replace("{L}", str(layer))) and not n.endswith(not_read))
              for layer in store.layers}
    read = engine.checkpoint.reader.bytes_read - before
    engine.close()
    misses = sum(store.stats.layer(layer).misses * stored[layer] for layer in store.layers)
    assert store.capacity == 1 and store.stats.misses > 0 and read == misses
    return stored[store.layers[0]]


def assert_matches_transformers(folder: Path, ref_model: Any, prompts: list[list[int]], steps: int = STEPS,
                                **settings: Any) -> dict[str, str]:
    """fp32, prompts decoded together: transformers' greedy tokens, log-probabilities within 1e-4. Returns the
    engine's start-up choices."""
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", **settings)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(steps, logprobs=3))
    llm.engine.close()
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_logps = hf_greedy(ref_model, prompt, steps)
        assert out.outputs[0].token_ids == ref_tokens, f"prompt of {len(prompt)} tokens"
        for lp, ref in zip(out.outputs[0].logprobs, ref_logps):
            for token_id, entry in lp.items():
                assert abs(entry.logprob - float(ref[token_id])) < 1e-4, (len(prompt), token_id)
    return dict(llm.engine.choices)


def assert_outs_match_transformers(outs: list[tuple[list[int], list]], ref_model: Any, prompts: list[list[int]],
                                   steps: int = STEPS) -> None:
    """A run's (tokens, logprobs) per prompt (Run.outs, fp32): transformers' greedy tokens, log-probabilities within
    1e-4."""
    for prompt, (tokens, logprobs) in zip(prompts, outs, strict=True):
        ref_tokens, ref_logps = hf_greedy(ref_model, prompt, steps)
        assert tokens == ref_tokens, f"prompt of {len(prompt)} tokens"
        for lp, ref in zip(logprobs, ref_logps, strict=True):
            for token_id, entry in lp.items():
                assert abs(entry.logprob - float(ref[token_id])) < 1e-4, (len(prompt), token_id)


def assert_near_transformers_bf16(outs: list[tuple[list[int], list]], ref_model: Any, prompts: list[list[int]],
                                  steps: int) -> None:
    """bf16: transformers' greedy tokens until a near-tie (the two engines round bf16 differently inside their
    GEMMs: where the paths part, transformers' own top two are within 0.5), at least half the steps the same,
    log-probabilities within 2 bf16 steps (0.5) while they agree."""
    for prompt, (tokens, logprobs) in zip(prompts, outs):
        ref_tokens, ref_logps = hf_greedy(ref_model, prompt, steps)
        same = 0
        while same < steps and tokens[same] == ref_tokens[same]:
            same += 1
        if same < steps:
            ref = ref_logps[same]
            assert float(ref[ref_tokens[same]] - ref[tokens[same]]) < 0.5, f"diverged at step {same}"
        assert same >= steps // 2, f"greedy paths part at step {same}"
        for lp, ref in zip(logprobs[:same], ref_logps):
            for token_id, entry in lp.items():
                assert abs(entry.logprob - float(ref[token_id])) < 0.5
