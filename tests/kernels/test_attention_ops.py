"""The C++ attention ops (moeserve/kernels/csrc/attention.cpp) against the torch path of Attention.

The caches here are [slots, kv_heads, max_len, d]: a paged cache with one block of max_len tokens per sequence (block
table [[slot]], cache row slot * max_len + position); test_paged_reads_equal_contiguous_ones scatters the same keys
over 16-token blocks in shuffled order and demands the same bits.

qk_norm_rope_cache takes the torch path's steps and roundings (per-head RMSNorm, rotary products and sum each
rounded to the dtype), so it matches it bit for bit except where the norm's fp32 sum of squares, added in another
order, moves a value by one step. decode_attention is checked against scaled_dot_product_attention and an fp64
reference: it must be as close to the fp64 result as SDPA is.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeserve.models.layers.base import Rotary, rms_norm
from moeserve.models.spec import RopeSpec
from tests.kernels.ops import cpp_ops


@pytest.fixture(scope="module")
def ops():  # noqa: ANN201 - torch's op namespace
    return cpp_ops()


def rotary(d: int, dtype: torch.dtype, max_len: int = 256) -> Rotary:
    return Rotary(RopeSpec(theta=1e6, rope_type="default"), d, max_len, dtype, torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_norm", [True, False])
def test_qk_norm_rope_cache_matches_torch(ops, dtype: torch.dtype, with_norm: bool) -> None:
    nh, nkv, d, slots, max_len, n = 8, 2, 64, 6, 256, 5
    gen = torch.Generator().manual_seed(0)
    rot = rotary(d, dtype, max_len)
    qkv = torch.randn(n, (nh + 2 * nkv) * d, generator=gen).to(dtype)
    q, k, v = qkv.split([nh * d, nkv * d, nkv * d], dim=1)  # strided views, as Attention passes them
    qn = torch.randn(d, generator=gen).to(dtype) if with_norm else None
    kn = torch.randn(d, generator=gen).to(dtype) if with_norm else None
    pos = torch.tensor([0, 7, 100, 255, 3])
    token_slots = torch.tensor([1, 0, 5, 2, 1])
    kc = torch.zeros(slots, nkv, max_len, d, dtype=dtype)
    vc = torch.zeros_like(kc)
    out = ops.qk_norm_rope_cache(q, k, v, qn, kn, rot.cos, rot.sin, pos, token_slots * max_len + pos, kc, vc, 1e-6)

    q_ref, k_ref = q.reshape(n, nh, d), k.reshape(n, nkv, d)
    if with_norm:
        q_ref, k_ref = rms_norm(q_ref, qn, 1e-6), rms_norm(k_ref, kn, 1e-6)
    q_ref, k_ref = rot.apply(q_ref, pos), rot.apply(k_ref, pos)
    k_got = kc[token_slots, :, pos]
    if dtype == torch.bfloat16 or not with_norm:
        assert (out != q_ref).sum() <= out.numel() // 200 and (k_got != k_ref).sum() <= k_got.numel() // 200
    torch.testing.assert_close(out, q_ref, rtol=2**-7 if dtype == torch.bfloat16 else 1e-6, atol=1e-6)
    torch.testing.assert_close(k_got, k_ref, rtol=2**-7 if dtype == torch.bfloat16 else 1e-6, atol=1e-6)
    assert torch.equal(vc[token_slots, :, pos], v.reshape(n, nkv, d))
    written = torch.zeros(slots, max_len, dtype=torch.bool)
    written[token_slots, pos] = True
    assert not kc.abs().sum(dim=(1, 3))[~written].any() and not vc.abs().sum(dim=(1, 3))[~written].any()


def test_qk_norm_rope_cache_rejects_positions_outside_the_cache(ops) -> None:
    rot = rotary(16, torch.float32, 8)  # positions 0..7; cache rows 0..15 (2 blocks of 8)
    q, k, v = torch.randn(1, 32), torch.randn(1, 16), torch.randn(1, 16)
    kc = torch.zeros(2, 1, 8, 16)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.qk_norm_rope_cache(q, k, v, None, None, rot.cos, rot.sin, torch.tensor([8]), torch.tensor([0]),
                               kc, kc.clone(), 1e-6)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.qk_norm_rope_cache(q, k, v, None, None, rot.cos, rot.sin, torch.tensor([0]), torch.tensor([16]),
                               kc, kc.clone(), 1e-6)


def sdpa_decode(q, kc, vc, slots, pos, window, scale):  # noqa: ANN001, ANN201
    """Attention's torch decode path: padded keys of each slot, masked, SDPA with GQA."""
    length = int(pos.max()) + 1
    keys, values = kc[slots, :, :length], vc[slots, :, :length]
    k_pos = torch.arange(length)[None, :]
    visible = k_pos <= pos[:, None]
    if window:
        visible &= k_pos > pos[:, None] - window
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=visible[:, None, None, :],
                                         scale=scale, enable_gqa=True)
    return out.squeeze(2).reshape(q.shape[0], -1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d,nh,nkv", [(64, 16, 4), (24, 16, 4), (128, 12, 2), (256, 8, 1), (16, 4, 4), (48, 6, 2)])
@pytest.mark.parametrize("window", [0, 64])
def test_decode_attention_matches_sdpa(ops, dtype: torch.dtype, d: int, nh: int, nkv: int, window: int) -> None:
    """d = 24 runs the generic loop; the others the AVX-512 one with 1-16 vectors per head and groups of 1-8
    heads (p @ v in register tiles of 16 / (d / 16) heads, so 128 / 12 / 2 has a partial tile)."""
    slots, max_len = 8, 300
    gen = torch.Generator().manual_seed(d + window)
    kc = torch.randn(slots, nkv, max_len, d, generator=gen).to(dtype)
    vc = torch.randn(slots, nkv, max_len, d, generator=gen).to(dtype)
    q = (torch.randn(4, nh, d, generator=gen) * 2).to(dtype)
    slot, pos = torch.tensor([3, 0, 5, 1]), torch.tensor([0, 17, 200, 299])
    got = ops.decode_attention(q, kc, vc, slot[:, None], None, pos, window, d**-0.5)
    ref = sdpa_decode(q, kc, vc, slot, pos, window, d**-0.5)
    exact = sdpa_decode(q.double(), kc.double(), vc.double(), slot, pos, window, d**-0.5)
    err, ref_err = (got.double() - exact).abs().max(), (ref.double() - exact).abs().max()
    assert err <= 1.5 * ref_err + 1e-6, (err, ref_err)  # fp32: within ~8 ulps of 1 of SDPA's own error
    step = 2**-7 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(got, ref, rtol=step, atol=step)


def test_decode_attention_single_key_returns_its_value(ops) -> None:
    """At position 0 the only visible key gets all the weight: the output is that value, per kv head."""
    kc, vc = torch.randn(2, 2, 8, 32), torch.randn(2, 2, 8, 32)
    out = ops.decode_attention(torch.randn(1, 4, 32), kc, vc, torch.tensor([[1]]), None, torch.tensor([0]), 0, 0.1)
    expected = vc[1, :, 0].repeat_interleave(2, dim=0).reshape(1, -1)
    torch.testing.assert_close(out, expected)


def sinks_reference(q, kc, vc, slots, pos, window, scale, sinks):  # noqa: ANN001, ANN201
    """fp64 attention with a per-head sink logit in the softmax (gpt-oss; transformers' eager_attention_forward)."""
    out = []
    group = q.shape[1] // kc.shape[1]
    for i in range(q.shape[0]):
        lo = max(0, int(pos[i]) - window + 1) if window else 0
        keys = kc[slots[i], :, lo : int(pos[i]) + 1].double().repeat_interleave(group, dim=0)  # [nh, L, d]
        values = vc[slots[i], :, lo : int(pos[i]) + 1].double().repeat_interleave(group, dim=0)
        scores = torch.einsum("hd,hld->hl", q[i].double(), keys) * scale
        probs = torch.softmax(torch.cat([scores, sinks.double()[:, None]], dim=-1), dim=-1)[:, :-1]
        out.append(torch.einsum("hl,hld->hd", probs, values).reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [64, 24])
@pytest.mark.parametrize("window", [0, 16])
def test_decode_attention_with_sinks_matches_reference(ops, dtype: torch.dtype, d: int, window: int) -> None:
    """Sinks join the max and the row sum and have no value: against fp64, as close as without sinks."""
    nh, nkv, slots, max_len = 8, 2, 4, 64
    gen = torch.Generator().manual_seed(d + window + 1)
    kc = torch.randn(slots, nkv, max_len, d, generator=gen).to(dtype)
    vc = torch.randn(slots, nkv, max_len, d, generator=gen).to(dtype)
    q = (torch.randn(4, nh, d, generator=gen) * 2).to(dtype)
    sinks = torch.randn(nh, generator=gen) * 3
    slot, pos = torch.tensor([3, 0, 2, 1]), torch.tensor([0, 5, 40, 63])
    got = ops.decode_attention(q, kc, vc, slot[:, None], None, pos, window, d**-0.5, sinks)
    exact = sinks_reference(q, kc, vc, slot, pos, window, d**-0.5, sinks)
    without = ops.decode_attention(q, kc, vc, slot[:, None], None, pos, window, d**-0.5)
    assert (without.double() - exact).abs().max() > 1e-2  # the sinks really change the result
    step = 2**-7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.double(), exact, rtol=step, atol=step)


@pytest.mark.parametrize("d", [128, 24])
def test_attention_of_a_token_does_not_depend_on_the_other_tokens(ops, d: int) -> None:
    """Prefill, decode and mixed calls: each query row's output is the same bits whatever rows share the call
    (the engine's batch invariance rests on this)."""
    nh, nkv, slots, max_len = 16, 4, 6, 512
    gen = torch.Generator().manual_seed(d)
    kc = torch.randn(slots, nkv, max_len, d, generator=gen).to(torch.bfloat16)
    vc = torch.randn(slots, nkv, max_len, d, generator=gen).to(torch.bfloat16)
    n = 40
    q = torch.randn(n, nh, d, generator=gen).to(torch.bfloat16)
    slot = torch.randint(0, slots, (n,), generator=gen)
    pos = torch.randint(0, max_len, (n,), generator=gen)
    sinks = torch.randn(nh, generator=gen)
    for s in (None, sinks):
        whole = ops.decode_attention(q, kc, vc, torch.arange(slots)[:, None], slot, pos, 0, d**-0.5, s)
        for i in range(0, n, 7):
            alone = ops.decode_attention(q[i : i + 1].contiguous(), kc, vc, slot[i : i + 1, None].contiguous(), None,
                                         pos[i : i + 1].contiguous(), 0, d**-0.5, s)
            assert torch.equal(alone[0], whole[i])


def to_pages(cache: torch.Tensor, bs: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A [slots, nkv, max_len, d] cache cut into blocks of `bs` tokens placed in a shuffled pool (one spare block
    of noise between), and the block tables [slots, max_len / bs] that find them."""
    slots, nkv, max_len, d = cache.shape
    per = max_len // bs
    order = torch.randperm(2 * slots * per, generator=gen)[: slots * per]
    pool = torch.randn(2 * slots * per, nkv, bs, d, generator=gen).to(cache.dtype)
    blocks = cache.reshape(slots, nkv, per, bs, d).permute(0, 2, 1, 3, 4).reshape(slots * per, nkv, bs, d)
    pool[order] = blocks
    return pool, order.reshape(slots, per)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d,window,sinks", [(64, 0, False), (128, 40, True), (24, 0, True)])
def test_paged_reads_equal_contiguous_ones(ops, dtype: torch.dtype, d: int, window: int, sinks: bool) -> None:
    """Keys read through block tables (16-token blocks, shuffled, noise around) give the same bits as the same
    keys in one contiguous block per sequence, prefill-style rows included (rows = the sequence of each query)."""
    nh, nkv, slots, max_len, bs = 8, 2, 3, 320, 16
    gen = torch.Generator().manual_seed(d + window)
    kc = torch.randn(slots, nkv, max_len, d, generator=gen).to(dtype)
    vc = torch.randn(slots, nkv, max_len, d, generator=gen).to(dtype)
    k_pages, table = to_pages(kc, bs, gen)
    v_pages = torch.empty_like(k_pages).copy_(k_pages)
    v_pages[table.reshape(-1)] = vc.reshape(slots, nkv, max_len // bs, bs, d).permute(0, 2, 1, 3, 4).reshape(
        -1, nkv, bs, d)
    n = 30
    q = torch.randn(n, nh, d, generator=gen).to(dtype)
    seq = torch.randint(0, slots, (n,), generator=gen)
    pos = torch.cat([torch.tensor([0, 15, 16, 17, 319]), torch.randint(0, max_len, (n - 5,), generator=gen)])
    s = torch.randn(nh, generator=gen) if sinks else None
    contiguous = ops.decode_attention(q, kc, vc, torch.arange(slots)[:, None], seq, pos, window, d**-0.5, s)
    paged = ops.decode_attention(q, k_pages, v_pages, table.contiguous(), seq, pos, window, d**-0.5, s)
    assert torch.equal(paged, contiguous)


def test_paged_write_lands_in_its_block_row(ops) -> None:
    """qk_norm_rope_cache writes token i to row slot_mapping[i] = block * block_size + offset, nowhere else."""
    bs, d, nkv = 4, 16, 2
    rot = rotary(d, torch.float32, 64)
    q, k, v = torch.randn(3, 2 * d), torch.randn(3, nkv * d), torch.randn(3, nkv * d)
    kc, vc = torch.zeros(5, nkv, bs, d), torch.zeros(5, nkv, bs, d)
    rows = torch.tensor([3 * bs + 1, 0 * bs + 3, 4 * bs + 0])
    ops.qk_norm_rope_cache(q, k, v, None, None, rot.cos, rot.sin, torch.tensor([9, 40, 2]), rows, kc, vc, 1e-6)
    for i, (blk, off) in enumerate([(3, 1), (0, 3), (4, 0)]):
        assert torch.equal(vc[blk, :, off], v[i].reshape(nkv, d))
    assert int((vc.abs().sum(dim=(1, 3)) > 0).sum()) == 3


def test_decode_attention_rejects_a_block_outside_the_pool(ops) -> None:
    kc = torch.zeros(2, 1, 4, 16)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.decode_attention(torch.randn(1, 1, 16), kc, kc.clone(), torch.tensor([[0, 5]]), None,
                             torch.tensor([6]), 0, 0.25)
