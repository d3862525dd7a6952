"""Scheduler: which sequences compute how many tokens in the next step. Pure Python (no torch), unit-testable.

Continuous batching with chunked prefill over a paged KV cache (state/manager.py). Each step has a budget of
`max_num_batched_tokens` tokens, filled in this order:

1. every running sequence that decodes (one token each), oldest first;
2. waiting sequences, first come first served, while fewer than `max_num_seqs` run: each starts from its prefix-
   cache hit and computes as much of the rest as the budget leaves (a long prompt: one chunk now, the rest in
   later steps);
3. running sequences still prefilling, oldest first, one chunk each from what is left.

So a decode never waits for a long prompt for more than one step's budget, and a short request arriving during a
long prefill is admitted at the next step. When a running sequence needs a block and the pools are empty, the
newest running sequence is preempted: its blocks are freed and it goes back to the front of the queue, to be
recomputed from its tokens (prompt and output so far) when it is admitted again (vLLM's recompute preemption; the
prefix cache often makes that cheap). The sequences of a request with n > 1 share its prompt through the prefix
cache: the second and later ones are admitted once the first has computed the prompt.

Isolation (`isolate`): after a forward of several requests failed part-way on a model whose sequence memory a
forward overwrites (a recurrent state), the batch's sequences are recomputed, one request at a time: while a request
is isolated only its sequences are scheduled, until each has caught up (decoding again) or ended, so a request whose
recomputation fails again fails alone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from moeserve.engine.sequence import Sequence, Status
from moeserve.state.manager import SequenceMemory


@dataclass
class SchedulerStats:
    preemptions: int = 0
    steps: int = 0
    prefill_tokens: int = 0  # tokens of prefills and recomputations (not decodes)
    last_step_tokens: int = 0
    last_step_prefill_tokens: int = 0


class Scheduler:
    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, memory: SequenceMemory) -> None:
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} cannot hold one decode token of "
                             f"each of max_num_seqs={max_num_seqs} sequences")
        self.max_num_seqs, self.max_num_batched_tokens, self.memory = max_num_seqs, max_num_batched_tokens, memory
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: oldest first
        self.unservable: list[Sequence] = []  # cannot fit the pools even alone: the engine fails their requests
        self.isolated: list[str] = []  # request ids recomputed one at a time (isolate), the current one first
        self.stats = SchedulerStats()

    def add(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            seq.blocks = self.memory.new()
            self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ------------------------------------------------------------------------------------------ schedule
    def schedule(self) -> list[tuple[Sequence, int]]:
        """(sequence, tokens to compute) for the next step, within the token budget and the block pools."""
        budget = self.max_num_batched_tokens
        out: list[tuple[Sequence, int]] = []
        running = self._settle_isolation()
        decoding = [s for s in running if s.length - s.num_cached == 1]
        prefilling = [s for s in running if s.length - s.num_cached > 1]
        preemptions = self.stats.preemptions
        for seq in decoding:
            if budget == 0:
                break
            if seq.status == Status.RUNNING and self._grow(seq, 1):
                out.append((seq, 1))
                budget -= 1
        if self.stats.preemptions == preemptions:  # no admission while the pools are short
            budget = self._admit(budget, out)
        for seq in prefilling:
            if budget == 0:
                break
            n = self._chunk(seq, seq.num_cached, min(seq.length - seq.num_cached, budget))
            if n > 0 and seq.status == Status.RUNNING and self._grow(seq, n):
                out.append((seq, n))
                budget -= n
        out = [(s, n) for s, n in out if s.status == Status.RUNNING]  # a later growth may preempt an earlier one
        self.stats.steps += 1
        self.stats.last_step_tokens = sum(n for _, n in out)
        self.stats.last_step_prefill_tokens = sum(n for s, n in out if s.length - s.num_cached > 1)
        self.stats.prefill_tokens += self.stats.last_step_prefill_tokens
        return out

    def isolate(self, scheduled: list[tuple[Sequence, int]]) -> None:
        """A forward of these sequences failed after it had overwritten part of their memory: recompute each from
        its tokens (recompute preemption), one request at a time, in the batch's order."""
        requests = list(dict.fromkeys(seq.request_id for seq, _ in scheduled))
        for seq, _ in reversed(scheduled):  # each to the front of the queue: the batch's first request first
            if seq.status == Status.RUNNING:
                self._preempt(seq)
        self.isolated = requests + [r for r in self.isolated if r not in requests]

    def _settle_isolation(self) -> list[Sequence]:
        """The running sequences this step may schedule: all, or only the isolated request's while one is (a
        request leaves isolation once none of its sequences waits or is still prefilling)."""
        while self.isolated:
            mine = [s for s in self.running if s.request_id == self.isolated[0]]
            if any(s.request_id == self.isolated[0] for s in self.waiting) or any(
                    s.length - s.num_cached > 1 for s in mine):
                return mine
            self.isolated.pop(0)
        return self.running

    def _next_waiting(self) -> Sequence | None:
        """The sequence admission considers next: the queue's first, or the isolated request's first."""
        if not self.isolated:
            return self.waiting[0] if self.waiting else None
        return next((s for s in self.waiting if s.request_id == self.isolated[0]), None)

    def _chunk(self, seq: Sequence, start: int, n: int) -> int:
        """`n` tokens from `start`, or fewer (0: none this step) where the sequence memory wants the chunk to end (a
        recurrent layer's chunk grid: SequenceMemory.prefill_end), so a prompt in chunks gives the bits of one pass; or
        where the sequence leaves a prefix snapshot of its recurrent state."""
        return self.memory.prefill_end(start, start + n, len(seq.prompt_token_ids), seq.blocks) - start

    def _grow(self, seq: Sequence, n: int) -> bool:
        """Blocks for `n` more tokens of running `seq`, preempting the newest running sequences while the pools
        are short. False when `seq` itself had to go."""
        assert seq.blocks is not None
        while not self.memory.grow(seq.blocks, seq.num_cached + n):
            victim = self.running[-1]
            alone = len(self.running) == 1
            self._preempt(victim)
            if victim is seq:
                if alone:  # nothing else holds blocks: it can never fit
                    self.waiting.remove(seq)
                    self.unservable.append(seq)
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        assert seq.blocks is not None
        self.running.remove(seq)
        self.memory.free(seq.blocks)
        seq.num_cached = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1

    def _admit(self, budget: int, out: list[tuple[Sequence, int]]) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self._next_waiting()
            if seq is None or not self._ready(seq):
                break
            assert seq.blocks is not None
            tokens = seq.all_token_ids
            shared_later = seq.first_sibling is seq and seq.params.n > 1  # its siblings resume from its prompt
            cached = self.memory.admit(seq.blocks, tokens, len(seq.prompt_token_ids), shared_later)
            n = self._chunk(seq, cached, min(seq.length - cached, budget))
            if n == 0:  # no chunk boundary within this step's budget: admitted at a later step
                self.memory.free(seq.blocks)
                break
            if not self.memory.grow(seq.blocks, cached + n):
                self.memory.free(seq.blocks)
                if not self.running:  # the pools are empty of sequences and still too small
                    self.waiting.remove(seq)
                    self.unservable.append(seq)
                    continue
                break
            self.memory.stats.queried_tokens += len(tokens)
            self.memory.stats.hit_tokens += cached
            self.waiting.remove(seq)
            seq.num_cached = cached
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.append((seq, n))
            budget -= n
        return budget

    def _ready(self, seq: Sequence) -> bool:
        """A later sequence of an n > 1 request waits while the first one computes the prompt it will share."""
        first = seq.first_sibling
        if first is None or first is seq or not self.memory.prefix_caching:
            return True
        return not (first.status == Status.RUNNING and first.num_cached < len(first.prompt_token_ids))

    # ------------------------------------------------------------------------------------------ results
    def computed(self, scheduled: list[tuple[Sequence, int]]) -> None:
        """The step ran: each sequence's tokens are in the cache (registered for prefix reuse)."""
        for seq, n in scheduled:
            seq.num_cached += n
            assert seq.blocks is not None
            self.memory.computed(seq.blocks, seq.all_token_ids, seq.num_cached, len(seq.prompt_token_ids))

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        if seq.blocks is not None:
            self.memory.free(seq.blocks)

    def abort(self, request_id: str) -> list[Sequence]:
        """Abort every sequence of `request_id`, waiting or running; returns them."""
        aborted = [s for s in self.waiting if s.request_id == request_id]
        for seq in aborted:
            self.waiting.remove(seq)
        for seq in [s for s in self.running if s.request_id == request_id]:
            self.finish(seq)
            aborted.append(seq)
        for seq in aborted:
            seq.abort()
        return aborted
