"""The shared layers every architecture is built from. Plain tensors and functions: no nn.Module state.

Numerics follow Hugging Face transformers operation by operation (RMSNorm in fp32 then cast, RoPE tables in fp32
cast to the compute dtype, router softmax in fp32, experts summed in ascending expert order), so tokens match it.

Shapes: N = new tokens in the batch (all sequences flattened), H = hidden size, nh / nkv = query / key-value
heads, d = head dim, E = experts, k = experts per token.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F

from moeserve.models.layers.linear import Linear
from moeserve.models.numerics import Numerics
from moeserve.models.spec import RopeSpec
from moeserve.state.kv_cache import PagedKVCache


@dataclass
class ForwardBatch:
    """The new tokens of one engine step, flattened over sequences, and where each sequence's KV lives.

    Per KV group g (state/kv_cache.py): `slot_mappings[g][i]` is the cache row token i is written to,
    `block_tables[g][b]` sequence b's block table (padded with 0 past its end: the ops read only the blocks of
    positions they attend), `tables[g][b]` the same as a list (the torch path)."""

    token_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64, absolute position of each token in its sequence
    starts: list[int]  # tokens already cached per sequence (= position of its first new token)
    num_new: list[int]  # new tokens per sequence; sum == N
    slot_mappings: list[torch.Tensor]  # per group [N] int64
    block_tables: list[torch.Tensor]  # per group [B, max blocks] int64
    tables: list[list[list[int]]]  # per group, per sequence
    rows: torch.Tensor | None = None  # [N] int64: the sequence of each token (None when decode-only: row i)
    # per sequence, its prompt's length (recurrent layers compute prompt tokens in chunks, later ones one by one);
    # empty: a sequence's new tokens are its prompt unless it adds one token to a cached prefix
    prompt_lens: list[int] = field(default_factory=list)
    # DeepSeek Sparse Attention: the rows each aligned query block (sequence, first position) attends, as the last
    # layer with an indexer chose them in this forward (None: every visible row); GLM-5's shared layers read them
    key_choices: dict[tuple[int, int], torch.Tensor | None] = field(default_factory=dict)

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
    "zero_centered": (rms_norm_fp32_scale, torch.float32),  # the weight held as 1 + w (NORM_OFFSETS)
}
# Added to a norm weight once at load: zero-centred norms store w and scale by (1 + w) (transformers computes
# 1.0 + w.float() in fp32 on every call: the same fp32 value).
NORM_OFFSETS: dict[str, float] = {"zero_centered": 1.0}


def scales_in_fp32(norm_style: str) -> bool:
    """Whether the norm multiplies by its weight in fp32 before the cast (the C++ norms' `fp32_scale`)."""
    return RMS_NORMS[norm_style][0] is rms_norm_fp32_scale


class Rotary:
    """NeoX-style (half-split) rotary embedding with cos/sin tables [max_len, r] precomputed in fp32, on the first
    r = spec.rotary_dim(d) dims of each head (all of them unless partial_rotary_factor < 1); the rest pass as they
    are (transformers' apply_rotary_pos_emb)."""

    def __init__(self, spec: RopeSpec, head_dim: int, max_len: int, dtype: torch.dtype, device: torch.device):
        self.rotary_dim = spec.rotary_dim(head_dim)
        inv_freq, scaling = rope_inv_freq(spec, self.rotary_dim)
        pos = torch.arange(max_len, dtype=torch.int64).float()
        freqs = pos[:, None] * inv_freq[None, :]  # [L, d/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [L, d]
        self.cos = (emb.cos() * scaling).to(dtype).to(device)
        self.sin = (emb.sin() * scaling).to(dtype).to(device)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [N, heads, d] rotated at `positions` [N]."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        r = self.rotary_dim
        rot, rest = (x, None) if r == x.shape[-1] else (x[..., :r], x[..., r:])
        half = r // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        out = rot * cos + rotated * sin
        return out if rest is None else torch.cat((out, rest), dim=-1)


def rope_inv_freq(spec: RopeSpec, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [d/2] (fp32) and the attention scaling factor for the rope type."""
    base = 1.0 / (spec.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if spec.rope_type == "proportional":  # Gemma-4: the first angles at the full head's frequencies, the rest 0
        angles = int(spec.partial_rotary_factor * head_dim // 2)
        inv_freq = torch.cat([base[:angles], torch.zeros(head_dim // 2 - angles)])
        return inv_freq / float(spec.param("factor", 1.0)), 1.0
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


class TokenMixer(ABC):
    """The part of a decoder layer that mixes tokens: softmax attention over the KV cache (`Attention`) or linear
    attention over a recurrent state (models/mixers/gated_delta.py)."""

    layer: int

    @abstractmethod
    def __call__(self, x: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        """x [N, H] (normed) -> [N, H]; reads and writes the layer's sequence memory in `kv`."""

    @abstractmethod
    def linears(self) -> list[Linear]: ...

    @abstractmethod
    def why_not_stacked(self) -> str | None:
        """None when the fused decode stack (models/decode_stack.py) can run this part, else why not."""

    @abstractmethod
    def add_to_stack(self, stack: Any, kv: PagedKVCache, input_norm: torch.Tensor, post_norm: torch.Tensor) -> None:
        """Give this part (with its layer's norms) to a torch.classes.moeserve.DecodeStack."""

    def stack_takes(self, batch: ForwardBatch) -> bool:
        """Whether the stack computes this part's tokens of the decode-only `batch` as the per-op path would."""
        return True


class MLP(ABC):
    """The feed-forward part of a decoder layer (dense, or MoE in models/experts/moe.py)."""

    @abstractmethod
    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def linears(self) -> list[Linear]: ...

    @abstractmethod
    def why_not_stacked(self) -> str | None:
        """None when the fused decode stack (models/decode_stack.py) can run this part, else why not."""

    @abstractmethod
    def add_to_stack(self, stack: Any) -> None:
        """Give this part to a torch.classes.moeserve.DecodeStack whose layer it completes."""


class DenseMLP(MLP):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)). Batch-invariant: the whole MLP in fixed blocks of rows, so the
    element-wise ops see one shape too (torch's vectorized loops finish a tensor's tail with scalar code that
    rounds otherwise: which elements fall in the tail must not depend on the batch)."""

    def __init__(self, gate: Linear, up: Linear, down: Linear, numerics: Numerics = Numerics()) -> None:
        self.gate, self.up, self.down = gate, up, down
        self.numerics = numerics

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.numerics.rows(self._mlp, x)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))

    def linears(self) -> list[Linear]:
        return [self.gate, self.up, self.down]

    def why_not_stacked(self) -> str | None:
        if any(lin.bias is not None for lin in self.linears()):
            return "a dense MLP with biases"
        return not_in_gemv_layout(self.linears())

    def add_to_stack(self, stack: Any) -> None:
        stack.add_dense_mlp(*(t for lin in self.linears() for t in lin.gemv_tensors()))

    def add_as_shared(self, stack: Any, gate: tuple[torch.Tensor | None, torch.Tensor | None]) -> None:
        """Give this MLP to the stack as the next MoE layer's shared expert; `gate`: its sigmoid gate's GEMV
        tensors (None, None without one)."""
        stack.add_shared_expert(*(t for lin in self.linears() for t in lin.gemv_tensors()), *gate)


def not_in_gemv_layout(linears: list[Linear]) -> str | None:
    for lin in linears:
        if not lin.in_gemv_layout:
            return f"a dense Linear in the {lin.layout!r} layout (the C++ GEMV layouts are needed)"
    return None


class DecoderLayer:
    """Pre-norm residual layer: h + attn(norm(h)), then h + mlp(norm(h)). `fuses_norms`: passes.CppLayers may run
    it with each residual add fused into the norm after it (a layer of another form says False)."""

    fuses_norms = True

    def __init__(self, attn: TokenMixer, mlp: MLP, input_norm: torch.Tensor, post_norm: torch.Tensor, eps: float,
                 norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = rms_norm) -> None:
        self.attn, self.mlp = attn, mlp
        self.input_norm, self.post_norm, self.eps, self.norm = input_norm, post_norm, eps, norm

    def __call__(self, h: torch.Tensor, batch: ForwardBatch, kv: PagedKVCache) -> torch.Tensor:
        h = h + self.attn(self.norm(h, self.input_norm, self.eps), batch, kv)
        return h + self.mlp(self.norm(h, self.post_norm, self.eps))

    def why_not_stacked(self) -> str | None:
        return self.attn.why_not_stacked() or self.mlp.why_not_stacked()

    def add_to_stack(self, stack: Any, kv: PagedKVCache) -> None:
        self.attn.add_to_stack(stack, kv, self.input_norm, self.post_norm)
        self.mlp.add_to_stack(stack)
