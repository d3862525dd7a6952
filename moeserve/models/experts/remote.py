"""Expert parallelism's expert kernel: the head computes its own experts and sends every other expert's tokens to
the rank that owns it (moeserve/parallel/), then combines in the single-process order.

    shares = split_pairs(routed, owners)      # per rank: its pairs, and which lead their token
    for each worker: isend its rows           # overlapped with ...
    local  = compute_share(own kernel, own store's units)
    out    = combine(routed, shares, results) # bit for bit the one-process sum

Exactness. One process gives token t with experts e1 < ... < ek the output (((0 + c1) + c2) + ...) + ck, one
rounding per add, each contribution c = the expert's weighted output as its kernel computes it (every kernel adds in
ascending expert id: kernels.py). Summing per-rank partial sums instead regroups that sum, which changes bits once a
token has 3 or more experts. Here every rank computes each of its pairs' c alone, into zeros (0 + c = c; each
expert on all its rows in one call, the same rows in the same order as in one process, on the same numerics: the
start-up handshake compares them), so each c has the one-process bits. The owner of e1 adds the token's leading run
e1..ej (its experts before another rank's first) from 0, in order: exactly the single-process prefix. Every later
(t, e) comes back as its own row c, and the head adds those in ascending id, one rounding each (the same add as the
kernels': models/experts/hybrid.py relies on it too).

Wire format of one layer call, head -> worker: an int64 header [1, layer, rows, pairs, lead tokens, batch tokens,
weight dtype, row dtype], then one payload (`pack`, each part padded to 8 bytes): int64 [3, pairs] (the worker's
local expert index, the row, lead or not), in the routed pair order; weights [pairs]; x rows [rows, H] (the tokens
its pairs need, ascending). Back, one message: an int64 status (0, or 1 and then a JSON error) and
[lead tokens + rest pairs, H]. Header [0, ...]: the worker stops.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from moeserve.errors import ExpertLoadError, MoeserveError
from moeserve.experts.store import ExpertStore
from moeserve.models.experts.kernels import Chunk, ExpertKernel, RoutedTokens, add_in_expert_order
from moeserve.parallel.link import Link, PeerLost

HEADER, PAYLOAD, REPLY, ERROR = range(10, 14)  # gloo tags, one per message of a call
DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # of the rows and the weights, by code
STOP = torch.zeros(8, dtype=torch.int64)


@dataclass(frozen=True)
class EpShare:
    """What the head's model is built with under expert parallelism: the link and owners[e], e's rank."""

    link: Link
    owners: tuple[int, ...]

    @property
    def mine(self) -> list[int]:
        """The experts this rank owns, ascending (its store's local ids 0, 1, ... in that order)."""
        return [e for e, r in enumerate(self.owners) if r == self.link.rank]


@dataclass(frozen=True)
class Share:
    """One rank's part of a layer call: its pairs (indices into the routed pair order, ascending) and which of
    them are in their token's leading run."""

    pairs: torch.Tensor  # [P] int64
    lead: torch.Tensor  # [P] bool

    def lead_tokens(self, token_of: torch.Tensor) -> torch.Tensor:
        """The tokens this rank returns a leading sum for, ascending."""
        return torch.unique(token_of[self.pairs[self.lead]])


def split_pairs(routed: RoutedTokens, owners: torch.Tensor, ranks: int) -> list[Share]:
    """Each rank's pairs of `routed` (owners[e] = the rank owning expert e), and which lead: a pair is in its
    token's leading run when its expert and every lower expert of that token belong to one rank."""
    expert_of = torch.empty(len(routed.token_of), dtype=torch.int64)
    for e, (lo, hi) in routed.spans.items():
        expert_of[lo:hi] = e
    owner = owners[expert_of]
    token_of = routed.token_of.long()
    order = torch.sort(token_of, stable=True).indices  # each token's pairs together, in expert order
    by_token, owner_sorted = token_of[order], owner[order]
    start = torch.searchsorted(by_token, by_token)  # where each pair's token begins
    broken = (owner_sorted != owner_sorted[start]).long().cumsum(0)
    before = torch.where(start > 0, broken[start - 1], torch.zeros_like(start))
    lead = torch.empty_like(owner, dtype=torch.bool)
    lead[order] = broken == before  # no other owner yet in this token's run
    return [Share(torch.nonzero(owner == r).flatten(), lead[owner == r]) for r in range(ranks)]


def compute_share(kernel: ExpertKernel, chunks: Iterable[Chunk], x_rows: torch.Tensor, local_expert: torch.Tensor,
                  row: torch.Tensor, lead: torch.Tensor, weights: torch.Tensor, batch_tokens: int) -> torch.Tensor:
    """[lead tokens + rest pairs, H]: the leading sums (from 0, one per lead token, ascending) then each other
    pair's contribution alone, in pair order. Every pair is computed alone into zeros (0 + c = c), each expert on
    all its rows in one call as in one process; the leading sums add those in ascending expert id, one rounding
    each, as the kernels do. `chunks`: the store's units of `local_expert`'s ids, ascending."""
    x_pairs = x_rows[row]  # one row per pair
    routed = _routed(x_pairs, local_expert, torch.arange(len(row)), weights, batch_tokens)
    y = x_rows.new_zeros(x_pairs.shape)
    for chunk in chunks:
        kernel.run(y, routed, [chunk])
    lead_rows = torch.unique(row[lead])
    out_lead = x_rows.new_zeros(len(lead_rows), x_rows.shape[1])
    add_in_expert_order(out_lead, torch.searchsorted(lead_rows, row[lead]), y[lead])
    return torch.cat([out_lead, y[~lead]])


def _routed(x: torch.Tensor, experts: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor,
            batch_tokens: int) -> RoutedTokens:
    """RoutedTokens of pairs already grouped by expert (ascending) over rows of x; `batch_tokens` stands for the
    whole batch's token count, so a kernel choosing by batch size chooses as in one process."""
    ids, counts = torch.unique_consecutive(experts, return_counts=True)
    spans, start = {}, 0
    for e, c in zip(ids.tolist(), counts.tolist()):
        spans[e] = (start, start + c)
        start += c
    return RoutedTokens(x.contiguous(), torch.empty(0), rows, weights, spans, batch_tokens)


class ExpertParallel(ExpertKernel):
    """The head's kernel: its own experts through `local` on its own store (local ids), every other expert on its
    owner over `link` (module docstring)."""

    name = "expert-parallel"

    def __init__(self, local: ExpertKernel, link: Link, owners: Sequence[int]) -> None:
        super().__init__(local.math)
        self.local, self.link = local, link
        self.owners = torch.tensor(list(owners), dtype=torch.int64)
        # each expert's index among its owner's experts (what that rank's store is keyed by)
        local_of = [0] * len(owners)
        seen = [0] * link.size
        for e, r in enumerate(owners):
            local_of[e], seen[r] = seen[r], seen[r] + 1
        self.local_of = torch.tensor(local_of, dtype=torch.int64)
        # layer calls, activation bytes each way, seconds in the calls and seconds waiting on other ranks after the
        # head's own experts were done (the exchange's cost beyond the overlap): scripts/ep_bench.py prints them
        self.stats: dict[str, float] = {"calls": 0, "bytes_sent": 0, "bytes_received": 0, "call_s": 0.0,
                                        "wait_s": 0.0}

    def run(self, out: torch.Tensor, routed: RoutedTokens, chunks: Iterable[Chunk]) -> None:
        raise NotImplementedError("expert parallelism computes through `compute` (its store holds only its share)")

    def compute(self, out: torch.Tensor, routed: RoutedTokens, store: ExpertStore, layer: int,
                prefetch: tuple[int, Sequence[int]] | None = None) -> None:
        t0 = time.perf_counter()
        shares = split_pairs(routed, self.owners, self.link.size)
        pending = [self._send(routed, layer, r, shares[r]) for r in range(1, self.link.size)]
        local_error: MoeserveError | None = None
        try:
            local = self._compute_local(routed, store, layer, shares[0], prefetch)
        except MoeserveError as err:  # an expert read failed here: still take every answer, so the link stays in step
            local, local_error = None, err
        t1 = time.perf_counter()
        answers = [self._receive(r, p) for r, p in enumerate(pending, start=1)]
        if local_error is not None:
            raise local_error
        failed = [a for a in answers if isinstance(a, str)]
        if failed:
            raise ExpertLoadError(failed[0])  # only the requests that need that expert fail (LLMEngine._step_apart)
        combine(out, routed, shares, [local, *(a for a in answers if not isinstance(a, str))])
        t2 = time.perf_counter()
        self.stats["calls"] += 1
        self.stats["call_s"] += t2 - t0
        self.stats["wait_s"] += t2 - t1

    def _message(self, routed: RoutedTokens, share: Share) -> tuple[torch.Tensor, ...]:
        """(x rows, their token ids, int64 [3, pairs], weights) of one rank's share."""
        tokens = routed.token_of[share.pairs].long()
        rows = torch.unique(tokens)
        expert = self.local_of[_experts_of(routed, share.pairs)]
        ints = torch.stack([expert, torch.searchsorted(rows, tokens), share.lead.long()])
        return routed.x[rows], rows, ints, routed.weight_of[share.pairs]

    def _compute_local(self, routed: RoutedTokens, store: ExpertStore, layer: int, share: Share,
                       prefetch: tuple[int, Sequence[int]] | None) -> torch.Tensor | None:
        if not len(share.pairs):
            return None
        x_rows, _, ints, weights = self._message(routed, share)
        wanted = torch.unique(ints[0]).tolist()
        hint = None
        if prefetch is not None:
            mine = [int(self.local_of[e]) for e in prefetch[1] if int(self.owners[e]) == 0]
            hint = (prefetch[0], mine) if mine else None
        return compute_share(self.local, store.experts(layer, wanted, prefetch=hint), x_rows, ints[0], ints[1],
                             ints[2].bool(), weights, routed.num_tokens)

    def _send(self, routed: RoutedTokens, layer: int, rank: int, share: Share) -> tuple[Any, ...] | None:
        """Start sending `rank` its share (nothing when it has none) and post the receive of its answer."""
        if not len(share.pairs):
            return None
        x_rows, _, ints, weights = self._message(routed, share)
        n_lead = len(share.lead_tokens(routed.token_of.long()))
        n_rest = int((~share.lead).sum())
        header = torch.tensor([1, layer, len(x_rows), len(share.pairs), n_lead, routed.num_tokens,
                               DTYPES.index(weights.dtype), DTYPES.index(x_rows.dtype)], dtype=torch.int64)
        link, payload = self.link, pack([ints, weights, x_rows])
        sends = [link.isend(header, rank, HEADER), link.isend(payload, rank, PAYLOAD)]
        reply = torch.empty(8 + (n_lead + n_rest) * x_rows.shape[1] * x_rows.element_size(), dtype=torch.uint8)
        self.stats["bytes_sent"] += header.numel() * 8 + payload.numel()
        shape = (n_lead + n_rest, x_rows.shape[1])
        return sends, reply, link.irecv(reply, rank, REPLY), shape, x_rows.dtype, layer

    def _receive(self, rank: int, pending: tuple[Any, ...] | None) -> torch.Tensor | str | None:
        """`rank`'s answer: its rows, its error (a read error of one of its experts), or None when it had no
        pairs."""
        if pending is None:
            return None
        sends, reply, reply_work, shape, dtype, layer = pending
        link = self.link
        for work in sends:
            link.wait(work, f"sending layer {layer}'s tokens to rank {rank}")
        link.wait(reply_work, f"layer {layer}'s experts from rank {rank}")
        self.stats["bytes_received"] += reply.numel()
        if int(reply[:8].view(torch.int64)) != 0:  # the status word
            return f"rank {rank}: {link.recv_json(rank, ERROR, f'layer {layer} error from rank {rank}')}"
        return reply[8:].view(dtype).view(shape)

    def why_not_stacked(self) -> str | None:
        return ("expert parallelism: the fused decode step runs every layer in one C++ call, and this kernel sends "
                "each MoE layer's tokens to other ranks between the layers")

    def describe(self) -> str:
        return (f"expert-parallel ({self.link.size} ranks over gloo; own experts: {self.local.describe()}; "
                "combined in ascending expert order, as one process)")

    def close(self) -> None:
        """Tell every worker to stop (best effort: one may be gone already), then drop the link."""
        if self.link.group is None:
            return
        for rank in range(1, self.link.size):
            try:
                self.link.send(STOP, rank, HEADER, f"stopping rank {rank}")
            except PeerLost:
                pass
        self.link.close()


def _experts_of(routed: RoutedTokens, pairs: torch.Tensor) -> torch.Tensor:
    """The expert of each pair (indices into the routed pair order)."""
    starts = torch.tensor([lo for lo, _ in routed.spans.values()], dtype=torch.int64)
    ids = torch.tensor(list(routed.spans), dtype=torch.int64)
    return ids[torch.searchsorted(starts, pairs, right=True) - 1]


def combine(out: torch.Tensor, routed: RoutedTokens, shares: Sequence[Share],
            results: Sequence[torch.Tensor | None]) -> None:
    """out [N, H] (zeros) = every token's single-process sum: its leading sum, then its other pairs' rows added in
    ascending expert id, one rounding each."""
    token_of = routed.token_of.long()
    rest_pairs, rest_rows = [], []
    for share, result in zip(shares, results):
        if result is None:
            continue
        lead_tokens = share.lead_tokens(token_of)
        out[lead_tokens] = result[: len(lead_tokens)].to(out.dtype)
        rest_pairs.append(share.pairs[~share.lead])
        rest_rows.append(result[len(lead_tokens) :])
    pairs = torch.cat(rest_pairs)
    if not len(pairs):
        return
    order = torch.argsort(pairs)  # the routed pair order: ascending expert, each expert's tokens ascending
    add_in_expert_order(out, token_of[pairs[order]], torch.cat(rest_rows)[order])


def packed_nbytes(shapes: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> int:
    """Bytes of `pack` of tensors of these (shape, dtype): each padded to 8 bytes."""
    total = 0
    for shape, dtype in shapes:
        n = dtype.itemsize
        for d in shape:
            n *= d
        total += -(-n // 8) * 8
    return total


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One uint8 message of `tensors`' bytes, each padded to 8 bytes (so every part stays aligned for its view)."""
    parts = []
    for t in tensors:
        raw = t.contiguous().view(-1).view(torch.uint8)
        parts.append(raw)
        if raw.numel() % 8:
            parts.append(raw.new_zeros(8 - raw.numel() % 8))
    return torch.cat(parts)


def unpack(blob: torch.Tensor, shapes: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """The tensors `pack` put in `blob` (views, no copies), given their (shape, dtype)."""
    out, at = [], 0
    for shape, dtype in shapes:
        n = packed_nbytes([(shape, dtype)])
        count = 1
        for d in shape:
            count *= d
        out.append(blob[at : at + count * dtype.itemsize].view(dtype).view(shape))
        at += n
    return out


def serve_layer_calls(link: Link, kernel: ExpertKernel, store: ExpertStore, hidden: int) -> None:
    """A worker's loop: each layer call of the head computed on this rank's store (local expert ids) and answered,
    until the head sends STOP. A read error of an expert is answered as one (the head fails the requests that
    needed it, as on one machine); a lost head raises PeerLost."""
    header = torch.empty(8, dtype=torch.int64)
    while True:
        link.recv(header, 0, HEADER, "waiting for the head", timeout_s=0)  # idle as long as the head is
        op, layer, rows, pairs, _, batch_tokens, weight_code, x_code = header.tolist()
        if op == 0:
            return
        shapes = [((3, pairs), torch.int64), ((pairs,), DTYPES[weight_code]), ((rows, hidden), DTYPES[x_code])]
        payload = torch.empty(packed_nbytes(shapes), dtype=torch.uint8)
        link.recv(payload, 0, PAYLOAD, f"layer {layer}'s tokens from the head")
        ints, weights, x_rows = unpack(payload, shapes)
        status = torch.zeros(1, dtype=torch.int64)
        try:
            wanted = torch.unique(ints[0]).tolist()
            y = compute_share(kernel, store.experts(layer, wanted), x_rows, ints[0], ints[1], ints[2].bool(), weights,
                              batch_tokens)
        except MoeserveError as err:  # the same bytes as an answer, with status 1, then the error
            n_reply = int(header[4]) + int((ints[2] == 0).sum())
            link.send(pack([status + 1, x_rows.new_zeros(n_reply, hidden)]), 0, REPLY, f"layer {layer}'s error")
            link.send_json(str(err), 0, ERROR, f"layer {layer}'s error")
            continue
        link.send(pack([status, y]), 0, REPLY, f"layer {layer}'s answer")
