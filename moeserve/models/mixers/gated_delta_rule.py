"""The gated delta rule (Gated DeltaNet linear attention: Qwen3-Next, Qwen3.5), in fp32, one sequence at a time.

Per value head h the state S [dk, dv] is updated token by token:

    S = S * exp(g_t)                       # decay (g_t <= 0)
    S = S + k_t (beta_t (v_t - S^T k_t))^T  # delta rule: move the value read at k_t towards v_t
    o_t = S^T q_t                          # q_t scaled by dk^-0.5; q and k L2-normalised

`recurrent_step` runs that for one token (decode). `chunk_form` computes the same over chunks of CHUNK tokens with
matrix products (prefill): within a chunk the updates are solved as one unit-lower-triangular system (the WY form
of the FLA library; transformers' `torch_chunk_gated_delta_rule` is the reference this is tested against). The two
forms agree to fp32 rounding, not bit for bit, so the engine picks the form of a token by its position only (prompt
tokens: chunk form on a grid of CHUNK positions from 0; generated tokens: the recurrent step), never by how the
scheduler cut the prompt: chunked prefill and recomputation after preemption give the same bits as one pass.

Every call here works on fixed shapes ([Hv, CHUNK, d] per chunk, [Hv, dk, dv] per step), whatever the batch, so a
sequence's numbers never depend on what runs beside it.
"""

from __future__ import annotations

import functools

import torch

CHUNK = 64  # tokens per chunk of the chunk form (transformers' and FLA's default)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (FLA's and transformers' l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_form(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor) -> torch.Tensor:
    """Outputs [n, Hv, dv] (fp32) of n tokens from `state` [Hv, dk, dv] (fp32, updated in place).

    q, k [n, Hv, dk] (L2-normalised, fp32), v [n, Hv, dv], g (log decay) and beta [n, Hv], all fp32. The tokens
    are cut into chunks of CHUNK from the first; the last one is zero-padded (a zero key and beta change nothing)."""
    n = q.shape[0]
    outs = []
    for lo in range(0, n, CHUNK):
        hi = min(lo + CHUNK, n)
        qc, kc, vc, gc, bc = (_pad(t[lo:hi].transpose(0, 1)) for t in (q, k, v, g, beta))  # heads first
        outs.append(_one_chunk(qc, kc, vc, gc, bc, state)[:, : hi - lo].transpose(0, 1))
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def _pad(x: torch.Tensor) -> torch.Tensor:
    """[Hv, c, ...] -> [Hv, CHUNK, ...] with zeros after the c tokens."""
    c = x.shape[1]
    if c == CHUNK:
        return x.contiguous()
    out = x.new_zeros(x.shape[0], CHUNK, *x.shape[2:])
    out[:, :c] = x
    return out


@functools.cache
def _strict_upper(device: torch.device) -> torch.Tensor:
    """The [CHUNK, CHUNK] mask of j > i on `device` (made once per device)."""
    return torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=device).triu(1)


def _one_chunk(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:  # noqa: ANN001 - fp32 [Hv, C, ...]
    """One chunk: q, k [Hv, C, dk], v [Hv, C, dv], g, beta [Hv, C]; returns [Hv, C, dv], updates `state`."""
    q = q * q.shape[-1] ** -0.5
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    cum = g.cumsum(dim=-1)  # [Hv, C]: log decay from the chunk start to each token
    pairs = cum.unsqueeze(-1) - cum.unsqueeze(-2)  # [Hv, C, C]: log decay from token j to token i
    decay = pairs.masked_fill(_strict_upper(g.device), float("-inf")).exp()
    # token i's update sees the updates of tokens j < i of the chunk through S: a unit-lower-triangular system
    system = (k_beta @ k.transpose(-1, -2)) * decay
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    keys = torch.linalg.solve_triangular(system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    inner = (q @ k.transpose(-1, -2)) * decay  # [Hv, C, C], causal (incl. the diagonal)
    v_new = values - keys @ state  # [Hv, C, dv]
    out = (q * cum.exp().unsqueeze(-1)) @ state + inner @ v_new
    last = cum[:, -1:]  # [Hv, 1]
    state.mul_(last.exp().unsqueeze(-1)).add_((k * (last - cum).exp().unsqueeze(-1)).transpose(-1, -2) @ v_new)
    return out


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> torch.Tensor:
    """One token: q, k [Hv, dk] (L2-normalised), v [Hv, dv], decay = exp(g) and beta [Hv], fp32; returns [Hv, dv]
    and updates `state` [Hv, dk, dv] in place. transformers' `torch_recurrent_gated_delta_rule` operation for
    operation, except that the two sums over dk are taken in one fixed pairwise order (`sum_rows`; torch's own sum
    over a middle dim has an order of its own), which the C++ op gated_delta_step_ takes too: the same bits."""
    q = q * q.shape[-1] ** -0.5
    state.mul_(decay[:, None, None])
    read = sum_rows(state * k.unsqueeze(-1))  # [Hv, dv]: S^T k
    delta = (v - read) * beta.unsqueeze(-1)
    state.add_(k.unsqueeze(-1) * delta.unsqueeze(-2))
    return sum_rows(state * q.unsqueeze(-1))


def sum_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., n, d] summed over n by halving: with m = ceil(n / 2), row i becomes x[i] + x[i + m] (rows with no
    partner pass as they are), until one row is left. Each step is an element-wise fp32 add: one order, anywhere."""
    n = x.shape[-2]
    while n > 1:
        m = (n + 1) // 2
        pairs = x[..., : n - m, :] + x[..., m:n, :]
        x = pairs if 2 * m == n else torch.cat([pairs, x[..., n - m : m, :]], dim=-2)
        n = m
    return x[..., 0, :]
