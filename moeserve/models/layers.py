"""The shared layers every architecture is built from. Plain tensors and functions: no nn.Module state.

Numerics follow Hugging Face transformers operation by operation (RMSNorm in fp32 then cast, RoPE tables in fp32
cast to the compute dtype, router softmax in fp32, experts summed in ascending expert order), so tokens match it.

Shapes: N = new tokens in the batch (all sequences flattened), H = hidden size, nh / nkv = query / key-value
heads, d = head dim, E = experts, k = experts per token.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from moeserve.state.kv_cache import KVCache
from moeserve.experts.store import ExpertStore, ExpertWeights
from moeserve.formats.int8 import dequantize_int8_per_channel, quantize_int8_per_channel
from moeserve.memory.hugepages import on_huge_pages
from moeserve.models.spec import AttentionSpec, MoeSpec, RopeSpec


@dataclass
class ForwardBatch:
    """The new tokens of one engine step, flattened over sequences, and where each sequence's KV lives."""

    token_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64, absolute position of each token in its sequence
    slots: list[int]  # KV cache slot per sequence
    starts: list[int]  # tokens already cached per sequence (= position of its first new token)
    num_new: list[int]  # new tokens per sequence; sum == N
    slots_t: torch.Tensor | None = None  # [B] slots on device (decode-only batches)
    starts_t: torch.Tensor | None = None  # [B]
    token_slots: torch.Tensor | None = None  # [N] int64, KV slot of each token (the C++ attention path needs it)

    @cached_property
    def decode_only(self) -> bool:
        return all(n == 1 for n in self.num_new)

    def last_token_index(self) -> list[int]:
        """Index in the flattened batch of each sequence's last new token (the one whose logits we sample)."""
        out, acc = [], 0
        for n in self.num_new:
            acc += n
            out.append(acc - 1)
        return out


# Batch invariance (EngineSettings.batch_invariant): torch's CPU GEMMs pick their blocking by the row count, so a row's
# result changes with the number of rows beside it (measured: F.linear bf16 [1, 2880] x [2880, 5760]^T differs at 33+
# rows). Where moeserve's C++ ops (one fixed order per row) do not apply, torch ops see rows in blocks of exactly
# ROW_BLOCK (the last one zero-padded): one call shape for every batch, and within a call shape a row's result does not
# depend on its position or neighbours (tests/engine/test_batch_invariance.py checks both).
# The block is chosen once per process from the CPU (choose_row_block, logged): with AMX, a 32-row bf16 GEMM costs
# about what a 1-row one does; without it, every padded row is compute.
ROW_BLOCK_AMX, ROW_BLOCK_DEFAULT = 32, 16
ROW_BLOCK = ROW_BLOCK_DEFAULT


def choose_row_block() -> str:
    """Sets ROW_BLOCK for this CPU; returns the reason for the start-up log."""
    global ROW_BLOCK
    try:
        flags = open("/proc/cpuinfo").read()  # noqa: SIM115 - read once at start-up
    except OSError:
        flags = ""
    amx = " amx_bf16" in flags
    ROW_BLOCK = ROW_BLOCK_AMX if amx else ROW_BLOCK_DEFAULT
    return f"{ROW_BLOCK} rows ({'AMX: a padded row costs little' if amx else 'no AMX: padded rows are compute'})"


def in_row_blocks(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) for a row-wise fn, computed on blocks of exactly ROW_BLOCK rows of x [N, ...]."""
    n, block = x.shape[0], ROW_BLOCK
    pad = -n % block
    if pad:
        x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
    outs = [fn(x[i : i + block]) for i in range(0, n + pad, block)]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out[:n] if pad else out


class Linear:
    """y = x W^T (+ b). W [out, in] in the compute dtype, kept in one of three layouts chosen once at load:

    - "interleaved" (the moeserve C++ kernels are on, bf16, CPU with AVX512-BF16, in % 32 == 0): rows in blocks
      of 4 with their 32-element chunks side by side, read by `torch.ops.moeserve.linear_interleaved` as one
      sequential stream per block (see csrc/dense_gemv.cpp). Measured at batch 1 on the bench machine: 20-30 GB/s
      against 13-20 GB/s for oneDNN's packed GEMV, and 5 us against 26 us for a router-sized [32, 1024] one. Each
      output is one fp32 dot product rounded once, whatever the batch size.
    - "onednn" (bf16 on a CPU where oneDNN computes bf16 natively, without the C++ kernels): reordered into
      oneDNN's blocked layout; ~1.6x the speed of F.linear on the plain layout, bit-identical to it (tests in
      tests/models/test_linear_packing.py).
    - "int8" (quantization="int8" with the C++ kernels on, bf16 compute, in % 32 == 0): per-output-row symmetric
      int8 codes (moeserve.formats.int8) in a layout like "interleaved" (pack_int8_rows) plus float32 scales, read by
      `torch.ops.moeserve.linear_interleaved_int8` (csrc/dense_gemv_int8.cpp): half the bytes of "interleaved";
      each output is one fp32 dot product of the exact codes with x, times the row scale, rounded once.
    - "plain": F.linear.

    `weight` gives a plain copy for inspection (dequantized for "int8"), never used on the hot path.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, cpp: bool = False,
                 int8: bool = False) -> None:
        self.out_features, self.in_features = weight.shape[0], weight.shape[-1]
        self.bias = bias
        self._scale: torch.Tensor | None = None
        if cpp and int8 and can_quantize_int8(weight, bias):
            self.layout = "int8"
            codes, self._scale = quantize_int8_per_channel(weight)
            self._weight = on_huge_pages(pack_int8_rows(codes))
            self._dtype = weight.dtype
        elif cpp and _can_interleave(weight, bias):
            self.layout = "interleaved"
            self._weight = on_huge_pages(interleave_rows(weight))  # streamed every step: 2 MiB pages
        elif _can_pack(weight):
            self.layout = "onednn"
            self._weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        else:
            self.layout = "plain"
            self._weight = weight
        self.invariant = False  # "onednn" / "plain" in fixed row blocks (see ROW_BLOCK); MoeModel.use_batch_invariance

    @property
    def packed(self) -> bool:
        """True when the weight is in oneDNN's blocked layout."""
        return self.layout == "onednn"

    @property
    def weight(self) -> torch.Tensor:
        """W [out, in] as a plain tensor (a copy unless the layout is plain)."""
        if self.layout == "interleaved":
            return deinterleave_rows(self._weight, self.out_features, self.in_features)
        if self.layout == "int8":
            assert self._scale is not None
            out = torch.empty(self.out_features, self.in_features, dtype=self._dtype)
            dequantize_int8_per_channel(unpack_int8_rows(self._weight, self.out_features, self.in_features),
                                        self._scale, out)
            return out
        return self._weight.to_dense() if self.layout == "onednn" else self._weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout == "int8":
            return torch.ops.moeserve.linear_interleaved_int8(x, self._weight, self._scale, self.out_features,
                                                              self.bias)
        if self.layout == "interleaved":
            return torch.ops.moeserve.linear_interleaved(x, self._weight, self.out_features, self.bias)
        if self.invariant and x.dim() == 2:
            return in_row_blocks(self._torch_linear, x)
        return self._torch_linear(x)

    def _torch_linear(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout == "onednn":
            x2 = x.reshape(-1, x.shape[-1])  # oneDNN's linear takes [rows, in]
            y = torch.ops.mkldnn._linear_pointwise(x2, self._weight, self.bias, "none", [], "")
            return y.view(*x.shape[:-1], y.shape[-1])
        return F.linear(x, self._weight, self.bias)

    @property
    def nbytes(self) -> int:
        n = self._weight.numel() * self._weight.element_size()
        if self._scale is not None:
            n += self._scale.numel() * self._scale.element_size()
        return n + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())


def _can_pack(weight: torch.Tensor) -> bool:
    """A 2-D bf16 CPU weight, on a build and CPU where oneDNN computes bf16 natively."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _can_interleave(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """A 2-D bf16 CPU weight whose rows split into 32-element chunks, on a CPU the C++ GEMV runs on."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[1] % 32 == 0 and (bias is None or bias.dtype == torch.bfloat16)
            and bool(torch.ops.moeserve.gemv_bf16_supported()))


def can_quantize_int8(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """A 2-D bf16 CPU weight whose rows split into 32-element chunks: what the int8 GEMV takes (its AVX512-BF16
    path, or a portable one elsewhere)."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[1] % 32 == 0 and (bias is None or bias.dtype == torch.bfloat16))


def interleave_rows(w: torch.Tensor) -> torch.Tensor:
    """W [N, K] (K % 32 == 0) -> flat [N*K]: blocks of 4 rows with their 32-element chunks side by side
    (packed[((b * K/32 + c) * 4 + r) * 32 + i] = W[4b + r, 32c + i]), then the N % 4 leftover rows as they are."""
    n, k = w.shape
    n4 = n // 4 * 4
    blocks = w[:n4].reshape(n4 // 4, 4, k // 32, 32).permute(0, 2, 1, 3).reshape(-1)
    return torch.cat([blocks, w[n4:].reshape(-1)])


def pack_int8_rows(q: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] (K % 32 == 0, in [-127, 127]) -> flat int8 [N*K] in linear_interleaved_int8's layout
    (csrc/dense_gemv_int8.cpp): blocks of 4 rows, chunk c of a block = rows (0, 1) then (2, 3), each pair as 4 groups
    of [8 codes of its first row, 8 of its second], codes in sign-magnitude; then the N % 4 leftover rows as they
    are (two's complement)."""
    n, k = q.shape
    n4 = n // 4 * 4
    head = q[:n4]
    mag = head.abs().to(torch.uint8)
    sm = torch.where(head < 0, mag | 0x80, mag)
    blocks = sm.reshape(n4 // 4, 2, 2, k // 32, 4, 8).permute(0, 3, 1, 4, 2, 5).reshape(-1).view(torch.int8)
    return torch.cat([blocks, q[n4:].reshape(-1)])


def unpack_int8_rows(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of pack_int8_rows: int8 codes [N, K]."""
    n4 = n // 4 * 4
    sm = packed[: n4 * k].view(torch.uint8).reshape(n4 // 4, k // 32, 2, 4, 2, 8).permute(0, 2, 4, 1, 3, 5)
    mag = (sm & 0x7F).to(torch.int16).reshape(n4, k)
    head = torch.where(sm.reshape(n4, k) >= 0x80, -mag, mag).to(torch.int8)
    return torch.cat([head, packed[n4 * k :].reshape(n - n4, k)])


def deinterleave_rows(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of interleave_rows: W [N, K]."""
    n4 = n // 4 * 4
    blocks = packed[: n4 * k].reshape(n4 // 4, k // 32, 4, 32).permute(0, 2, 1, 3).reshape(n4, k)
    return torch.cat([blocks, packed[n4 * k :].reshape(n - n4, k)])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, cast back, then scaled (transformers' order)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rms_norm_fp32_scale(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with the (fp32) weight applied in fp32 before the cast back (gpt-oss, transformers' order)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(dtype)


# ModelSpec.norm_style -> the norm function and the dtype its weight is kept in (None = the compute dtype).
RMS_NORMS: dict[str, tuple[Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor], torch.dtype | None]] = {
    "cast_then_scale": (rms_norm, None),
    "scale_in_fp32": (rms_norm_fp32_scale, torch.float32),
}


class Rotary:
    """NeoX-style (half-split) rotary embedding with cos/sin tables [max_len, d] precomputed in fp32."""

    def __init__(self, spec: RopeSpec, head_dim: int, max_len: int, dtype: torch.dtype, device: torch.device):
        inv_freq, scaling = rope_inv_freq(spec, head_dim)
        pos = torch.arange(max_len, dtype=torch.int64).float()
        freqs = pos[:, None] * inv_freq[None, :]  # [L, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [L, d]
        self.cos = (emb.cos() * scaling).to(dtype).to(device)
        self.sin = (emb.sin() * scaling).to(dtype).to(device)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [N, heads, d] rotated at `positions` [N]."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


def rope_inv_freq(spec: RopeSpec, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [d/2] (fp32) and the attention scaling factor for the rope type."""
    base = 1.0 / (spec.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if spec.rope_type == "default":
        return base, 1.0
    if spec.rope_type == "linear":
        return base / float(spec.param("factor", 1.0)), 1.0
    # YaRN: blend interpolated and extrapolated frequencies over a ramp between two correction dims.
    factor = float(spec.param("factor"))
    original = float(spec.param("original_max_position_embeddings"))
    beta_fast, beta_slow = float(spec.param("beta_fast", 32.0)), float(spec.param("beta_slow", 1.0))

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(spec.theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if spec.param("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    inv_freq = (base / factor) * (1 - extrapolation_factor) + base * extrapolation_factor
    mscale = spec.param("attention_factor")
    if mscale is None:
        mscale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
    return inv_freq, float(mscale)


class Attention:
    """Grouped-query attention over a slot-based KV cache; optional q/k norm, biases, sinks, sliding window.

    q, k and v come from one fused Linear (weights stacked at load: one GEMV instead of three, the same bits).
    With `cpp` set (the moeserve C++ ops are loaded), the per-head q/k norm, the rotary embedding and the KV
    write run as one op, and decode-only batches attend with one op; the torch path is kept operation for
    operation as transformers computes it and is what `kernels=torch` runs.
    """

    def __init__(
        self,
        spec: AttentionSpec,
        layer: int,
        qkv: Linear,
        o: Linear,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
        sinks: torch.Tensor | None,
        rotary: Rotary,
        eps: float,
    ) -> None:
        self.spec, self.layer = spec, layer
        self.qkv, self.o = qkv, o
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.split = [q_size, kv_size, kv_size]
        self.q_norm, self.k_norm, self.sinks = q_norm, k_norm, sinks
        self._sinks_f32 = None if sinks is None else sinks.float().contiguous()  # the C++ op's form
        self.rotary, self.eps = rotary, eps
        self.window = spec.sliding_window[layer]
        self.scale = spec.head_dim**-0.5
        self.cpp = False  # set by MoeModel.use_cpp_kernels
        self.invariant = False  # torch path: every batch sequence by sequence (MoeModel.use_batch_invariance)

    def __call__(self, x: torch.Tensor, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        s = self.spec
        n = x.shape[0]
        q, k, v = self.qkv(x).split_with_sizes(self.split, dim=-1)  # [N, nh*d], [N, nkv*d], [N, nkv*d] (views)
        if s.qk_norm == "full":
            assert self.q_norm is not None and self.k_norm is not None
            q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        if s.clip_qkv is not None:
            q, k, v = (t.clamp(-s.clip_qkv, s.clip_qkv) for t in (q, k, v))
        if self.cpp and batch.token_slots is not None:
            out = self._cpp_attention(q, k, v, batch, kv)
            return self.o(out.reshape(n, s.num_heads * s.head_dim))
        q = q.view(n, s.num_heads, s.head_dim)
        k = k.view(n, s.num_kv_heads, s.head_dim)
        v = v.view(n, s.num_kv_heads, s.head_dim)
        if s.qk_norm == "per_head":
            assert self.q_norm is not None and self.k_norm is not None
            q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        q = self.rotary.apply(q, batch.positions)
        k = self.rotary.apply(k, batch.positions)
        if batch.decode_only and len(batch.slots) > 1 and not self.invariant:
            out = self._decode_batched(q, k, v, batch, kv)
        else:
            out = self._per_sequence(q, k, v, batch, kv)
        return self.o(out.reshape(n, s.num_heads * s.head_dim))

    def linears(self) -> list[Linear]:
        return [self.qkv, self.o]

    def _cpp_attention(self, q, k, v, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """One op normalises (per head), rotates and caches; a second attends every token (batch-invariant)."""
        per_head = self.spec.qk_norm == "per_head"
        kc, vc = kv.layer(self.layer)
        q = torch.ops.moeserve.qk_norm_rope_cache(
            q, k, v, self.q_norm if per_head else None, self.k_norm if per_head else None, self.rotary.cos,
            self.rotary.sin, batch.positions, batch.token_slots, kc, vc, self.eps)  # [N, nh, d]
        # Every token, prefill or decode, alone or beside others: one op that attends each query row on its own
        # (keys up to its position), with one fixed reduction order, so a request's numbers never depend on the batch.
        # batch_invariant=False: prefill and mixed batches take torch's attention (flash SDPA) as before.
        if not self.invariant and not batch.decode_only:
            return self._per_sequence(q, None, None, batch, kv)
        return torch.ops.moeserve.decode_attention(q, kc, vc, batch.token_slots, batch.positions, self.window or 0,
                                                   self.scale, self._sinks_f32)

    def _per_sequence(self, q, k, v, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Prefill or mixed batches: attend sequence by sequence against its cached prefix. k and v are None
        when the new tokens' keys and values are in the cache already."""
        kc, vc = kv.layer(self.layer)  # [slots, nkv, max_len, d]
        outs, off = [], 0
        for slot, start, num in zip(batch.slots, batch.starts, batch.num_new):
            end = start + num
            if k is not None and v is not None:
                kc[slot, :, start:end] = k[off : off + num].transpose(0, 1)
                vc[slot, :, start:end] = v[off : off + num].transpose(0, 1)
            q_s = q[off : off + num].transpose(0, 1).unsqueeze(0)  # [1, nh, num, d]
            lo = 0 if self.window is None else max(0, end - num - self.window + 1)
            keys = kc[slot, :, lo:end].unsqueeze(0)  # [1, nkv, L, d]
            values = vc[slot, :, lo:end].unsqueeze(0)
            q_pos = torch.arange(start, end, device=q.device)[:, None]
            k_pos = torch.arange(lo, end, device=q.device)[None, :]
            visible = k_pos <= q_pos
            if self.window is not None:
                visible &= k_pos > q_pos - self.window
            outs.append(self._attend(q_s, keys, values, visible)[0].transpose(0, 1))  # [num, nh, d]
            off += num
        return torch.cat(outs, dim=0) if len(outs) > 1 else outs[0]

    def _decode_batched(self, q, k, v, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        """Every sequence adds one token: one padded attention call for the whole batch."""
        kc, vc = kv.layer(self.layer)
        assert batch.slots_t is not None and batch.starts_t is not None
        slots, pos = batch.slots_t, batch.starts_t  # [B]
        kc[slots, :, pos] = k  # k [B, nkv, d]
        vc[slots, :, pos] = v
        length = max(batch.starts) + 1
        keys, values = kc[slots, :, :length], vc[slots, :, :length]  # [B, nkv, L, d]
        k_pos = torch.arange(length, device=q.device)[None, :]
        visible = k_pos <= pos[:, None]  # [B, L]
        if self.window is not None:
            visible &= k_pos > pos[:, None] - self.window
        out = self._attend(q.unsqueeze(2), keys, values, visible[:, None, None, :])  # [B, nh, 1, d]
        return out.squeeze(2)

    def _attend(self, q, keys, values, visible: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T * scale + mask) v, with GQA; with sinks, an extra per-head logit joins the softmax."""
        if self.sinks is None:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=self.scale,
                                                  enable_gqa=True)
        group = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        scores = torch.matmul(q, keys.transpose(-1, -2)) * self.scale
        scores = scores.masked_fill(~visible, float("-inf"))
        sinks = self.sinks.view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1).to(scores.dtype)
        combined = torch.cat([scores, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1)[..., :-1]
        return torch.matmul(probs.to(values.dtype), values)


class DenseMLP:
    """SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, gate: Linear, up: Linear, down: Linear) -> None:
        self.gate, self.up, self.down = gate, up, down
        self.invariant = False  # set with the other parts; nothing batch-dependent of its own (its Linears are)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))

    def linears(self) -> list[Linear]:
        return [self.gate, self.up, self.down]


# An expert kernel computes one expert's output for the tokens routed to it: (x [T, H], weights) -> [T, H].
ExpertKernel = Callable[[torch.Tensor, ExpertWeights], torch.Tensor]


def swiglu_expert(x: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
    """Unit fields: gate_up [2I, H] (gate rows first), down [H, I]."""
    gate_up, down = w[0], w[1]
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


def clamped_swiglu(gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss activation on INTERLEAVED rows of gate_up [T, 2I] (even = gate, odd = up) -> [T, I].

    gate is clamped above only, up on both sides; out = gate * sigmoid(alpha * gate) * (up + 1).
    """
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def gpt_oss_expert_math(x: torch.Tensor, gate_up_t: torch.Tensor, gate_up_bias: torch.Tensor,
                        down_t: torch.Tensor, down_bias: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """One gpt-oss expert, operation by operation as transformers: x [T, H] @ gate_up_t [H, 2I] + bias,
    clamped SwiGLU, @ down_t [I, H] + bias -> [T, H]. The weights may be transposed views."""
    gate_up = x @ gate_up_t + gate_up_bias
    return clamped_swiglu(gate_up, limit, alpha) @ down_t + down_bias


# Batches of more tokens than this run the per-expert torch loop (oneDNN GEMMs) instead of the fused C++ op, which
# is built for decode: it reads each weight row once for all of an expert's tokens, but re-reads the tokens per row.
FUSED_MAX_TOKENS = 64


class MoEBlock:
    """Router + experts (from the store) + optional shared expert with a sigmoid gate."""

    def __init__(
        self,
        spec: MoeSpec,
        layer: int,
        router: Linear,
        store: ExpertStore,
        kernel: ExpertKernel,
        shared: DenseMLP | None = None,
        shared_gate: Linear | None = None,
    ) -> None:
        self.spec, self.layer, self.router, self.store = spec, layer, router, store
        self.kernel, self.shared, self.shared_gate = kernel, shared, shared_gate
        # The fused C++ expert op (torch.ops.moeserve.moe_swiglu_ / moe_swiglu_int8_) replaces the per-expert
        # loop when `cpp` is set (MoeModel.use_cpp_kernels) and the kernel supports it: `swiglu_expert` on bf16 /
        # fp32 units, or a kernel with a `fused_int8_fields` attribute (int8 units of the SwiGLU plan).
        self.cpp = False
        self.invariant = False  # MoeModel.use_batch_invariance: see ROW_BLOCK and __call__
        # (layer, topk ids [N, k], experts predicted for the next MoE layer or None): --record-trace
        self.trace_hook: Callable[[int, torch.Tensor, list[int] | None], None] | None = None
        # (next MoE layer, its router): set when the store prefetches, so this block can predict that layer
        self.predict_next: tuple[int, Linear] | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [N, k], expert ids [N, k]) for the tokens x [N, H]."""
        s = self.spec
        logits = self.router(x)  # [N, E]
        if s.routing == "topk_softmax":
            top, ids = torch.topk(logits, s.top_k, dim=-1)
            return torch.softmax(top, dim=-1, dtype=top.dtype), ids
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, s.top_k, dim=-1)
        if s.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return (top if s.weights_in_fp32 else top.to(logits.dtype)), ids

    def predict(self, x: torch.Tensor) -> list[int]:
        """The next MoE layer's experts for x [N, H], most often chosen first: its router applied to this
        layer's input (hidden states change little from one layer to the next). A guess; only costs I/O."""
        assert self.predict_next is not None
        router = self.predict_next[1]
        top = torch.topk(router(x), self.spec.top_k, dim=-1).indices  # [N, k]
        counts = torch.bincount(top.reshape(-1), minlength=self.spec.num_experts)  # [E]
        order = torch.argsort(counts, descending=True, stable=True)
        return order[counts[order] > 0].tolist()

    def pairs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """The (token, slot) pairs of x [N, H] grouped by expert, ascending, each expert's in token order:
        (expert ids [N, k], token_of [N*k], weight_of [N*k] (the routing weights' values), count per expert)."""
        s = self.spec
        if self.cpp:  # one C++ call: the same ATen softmax/topk kernels, then a stable counting sort
            mode = 1 if s.routing == "topk_softmax" else 0
            token_of, weight_of, counts, ids = torch.ops.moeserve.moe_route_pairs(self.router(x), s.top_k, mode,
                                                                            s.norm_topk_prob, s.weights_in_fp32)
            return ids, token_of, weight_of, counts.tolist()  # tolist: the one host sync per layer
        weights, ids = self.route(x)
        flat = ids.reshape(-1)  # [N*k]
        order = torch.argsort(flat, stable=True)
        counts_list = torch.bincount(flat, minlength=s.num_experts).tolist()
        return ids, order // ids.shape[1], weights.reshape(-1)[order], counts_list

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ids, token_of, weight_of, counts = self.pairs(x)
        # The next router's guess costs a GEMV over the next layer's router and a top-k: only when something uses
        # it (the store prefetching the caller's hints, or a trace recording it), not with the store's own predictor.
        wanted = self.trace_hook is not None or getattr(self.store, "predictor", None) is None
        predicted = self.predict(x) if self.predict_next is not None and wanted else None
        if self.trace_hook is not None:
            self.trace_hook(self.layer, ids, predicted)
        bounds, start = {}, 0
        for e, c in enumerate(counts):
            if c:
                bounds[e] = (start, start + c)
                start += c
        out = torch.zeros_like(x)
        # Experts are added in ascending id order whatever the chunking, so offloading never changes a bit.
        hint = (self.predict_next[0], predicted) if self.predict_next is not None and predicted else None
        chunks = self.store.experts(self.layer, list(bounds), prefetch=hint)
        if getattr(self.kernel, "fused_interleaved", False):  # units held row-interleaved: the op, any batch
            self._fused_interleaved(out, x.contiguous(), chunks, bounds, token_of, weight_of.float(),
                                    getattr(self.kernel, "fused_int8_fields", None))
            return self._add_shared(out, x)
        # Batch-invariant: the fused op (per-token order) at any batch size, never the loop for some sizes only
        fits = x.shape[0] <= FUSED_MAX_TOKENS or self.invariant
        if self.cpp and fits and x.dtype in (torch.bfloat16, torch.float32):
            int8_fields = getattr(self.kernel, "fused_int8_fields", None)
            if self.kernel is swiglu_expert or int8_fields is not None:
                self._fused(out, x.contiguous(), chunks, bounds, token_of, weight_of.float(), int8_fields)
                return self._add_shared(out, x)
        for chunk in chunks:
            for e, w in chunk:
                lo, hi = bounds[e]
                tokens = token_of[lo:hi]
                y = self._expert(x[tokens], w) * weight_of[lo:hi, None]
                # A token picks an expert at most once, so `tokens` has no repeats and a gathered add is the
                # same single rounding as index_add_, whose CPU kernel is slow for bf16 (40% of decode, profiled).
                out[tokens] += y.to(out.dtype)
        return self._add_shared(out, x)

    def _fused(self, out: torch.Tensor, x: torch.Tensor, chunks, bounds: dict[int, tuple[int, int]],  # noqa: ANN001
               token_of: torch.Tensor, weight_of: torch.Tensor, int8_fields: tuple[int, int, int, int] | None,
               ) -> None:
        """One C++ call per chunk of experts: every expert's SwiGLU for its tokens, weighted, added into `out`
        in ascending expert order with the roundings of the loop above (see csrc/moe_experts.cpp)."""
        ops = torch.ops.moeserve
        for chunk in chunks:
            spans: list[int] = []
            if int8_fields is None:
                gate_up, down = [], []
                for e, w in chunk:
                    gate_up.append(w[0])
                    down.append(w[1])
                    spans += bounds[e]
                ops.moe_swiglu_(out, x, gate_up, down, token_of, weight_of, spans)
            else:
                gu, gus, dn, dns = int8_fields
                fields: tuple[list[torch.Tensor], ...] = ([], [], [], [])
                for e, w in chunk:
                    for lst, i in zip(fields, (gu, gus, dn, dns)):
                        lst.append(w[i])
                    spans += bounds[e]
                ops.moe_swiglu_int8_(out, x, *fields, token_of, weight_of, spans)

    def _fused_interleaved(self, out: torch.Tensor, x: torch.Tensor, chunks, bounds: dict[int, tuple[int, int]],  # noqa: ANN001
                           token_of: torch.Tensor, weight_of: torch.Tensor,
                           int8_fields: tuple[int, int, int, int] | None) -> None:
        """One C++ call per chunk on row-interleaved units (bf16, or int8 codes + scales at `int8_fields`)."""
        ops = torch.ops.moeserve
        for chunk in chunks:
            spans = [i for e, _ in chunk for i in bounds[e]]
            if int8_fields is None:
                ops.moe_swiglu_interleaved_(out, x, [w[0] for _, w in chunk], [w[1] for _, w in chunk], token_of,
                                            weight_of, spans)
            else:
                fields = [[w[i] for _, w in chunk] for i in int8_fields]  # gate_up, its scales, down, its scales
                ops.moe_swiglu_int8_interleaved_(out, x, *fields, token_of, weight_of, spans)

    def _expert(self, rows: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
        """The kernel on one expert's rows; batch-invariant: in fixed blocks of rows (see ROW_BLOCK)."""
        if not self.invariant:
            return self.kernel(rows, w)
        bind = getattr(self.kernel, "bind", None)  # per-unit work (dequantization) once, not once per block
        if bind is not None:
            return in_row_blocks(bind(w), rows)
        kernel = self.kernel
        return in_row_blocks(lambda t: kernel(t, w), rows)

    def linears(self) -> list[Linear]:
        shared = [] if self.shared is None else self.shared.linears()
        return [self.router, *shared] + ([] if self.shared_gate is None else [self.shared_gate])

    def _add_shared(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.shared is not None and self.shared_gate is not None:
            out = out + torch.sigmoid(self.shared_gate(x)) * self.shared(x)
        return out


class DecoderLayer:
    def __init__(self, attn: Attention, mlp: DenseMLP | MoEBlock, input_norm, post_norm, eps: float,
                 norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = rms_norm) -> None:
        self.attn, self.mlp = attn, mlp
        self.input_norm, self.post_norm, self.eps, self.norm = input_norm, post_norm, eps, norm

    def __call__(self, h: torch.Tensor, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        h = h + self.attn(self.norm(h, self.input_norm, self.eps), batch, kv)
        return h + self.mlp(self.norm(h, self.post_norm, self.eps))
