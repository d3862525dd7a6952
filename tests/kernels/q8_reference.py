"""The int4-q8 dot (csrc/q4_q8.h) written plainly in torch: activations quantized to int8 per 32-element block,
integer sums of 4 products per lane, one fp32 fma per lane and span, the halving sum. The kernels' own scalar code is
not used: this is the independent statement the AVX-512 VNNI, AVX2 and scalar builds must equal bit for bit."""

from __future__ import annotations

import torch

FLT_MAX = torch.finfo(torch.float32).max


def quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x bf16 [M, K] -> (q float64 [M, K] holding integers in [-127, 127], d_x fp32 [M, K / 32])."""
    m, k = x.shape
    xf = x.float().reshape(m, k // 32, 32)
    amax = xf.abs().amax(-1)  # NaN propagates
    d = amax / 127.0
    ok = (amax >= 2.0**-100) & (amax <= FLT_MAX)
    inv = torch.where(ok, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.where(ok[..., None], torch.round(xf * inv[..., None]), torch.zeros_like(xf))  # half to even
    return q.reshape(m, k).double(), d


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 fma(a, b, c), one rounding: a * b exact in fp64 (a an integer below 2^12, b 24 bits), the sum rounded to
    odd in fp64 (TwoSum's error decides the sticky bit), then to fp32 nearest-even: correct, as 53 >= 24 + 2."""
    p = a.double() * b.double()
    cd = c.double()
    s = p + cd
    bb = s - p
    err = (p - (s - bb)) + (cd - bb)
    bits = s.view(torch.int64)
    inexact = (err != 0) & torch.isfinite(s) & ((bits & 1) == 0)
    toward = torch.where(err > 0, torch.full_like(s, float("inf")), torch.full_like(s, float("-inf")))
    s = torch.where(inexact, torch.nextafter(s, toward), s)
    return s.float()


def q8_dots(codes: torch.Tensor, scales: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[M, N] fp32 dots of x (bf16 [M, K]) with INT4 rows: codes uint8 [N, K / 2] (element 2j the low nibble of byte
    j), scales bf16 [N, K / 32]."""
    n, k = codes.shape[0], 2 * codes.shape[1]
    m = x.shape[0]
    nib = torch.stack([codes & 15, codes >> 4], -1).reshape(n, k).double() - 8
    q, dx = quantize_q8(x)
    sw = scales.float()
    if k % 64:  # a padded block: codes 8 (value 0), q 0, both scales 0
        nib = torch.cat([nib, torch.zeros(n, 32, dtype=torch.float64)], 1)
        q = torch.cat([q, torch.zeros(m, 32, dtype=torch.float64)], 1)
        sw = torch.cat([sw, torch.zeros(n, 1)], 1)
        dx = torch.cat([dx, torch.zeros(m, 1)], 1)
    spans = nib.shape[1] // 64
    # element 32h + 8j + 2i + p of a span -> lane 8p + 4h + j, summed over i
    isum = torch.einsum("nshjip,mshjip->mnsphj", nib.reshape(n, spans, 2, 4, 4, 2), q.reshape(m, spans, 2, 4, 4, 2))
    isum = isum.reshape(m, n, spans, 16).float()
    d = (sw.reshape(1, n, spans, 1, 2, 1) * dx.reshape(m, 1, spans, 1, 2, 1)).expand(m, n, spans, 2, 2, 4)
    d = d.reshape(m, n, spans, 16)
    lanes = torch.zeros(m, n, 16)
    for s in range(spans):
        lanes = fma32(isum[:, :, s], d[:, :, s], lanes)
    s8 = lanes[..., 8:] + lanes[..., :8]
    s4 = s8[..., 4:] + s8[..., :4]
    s2 = s4[..., :2] + s4[..., 2:]
    return s2[..., 0] + s2[..., 1]
