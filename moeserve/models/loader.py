"""WeightLoader: reads named tensors from the checkpoint into their final buffers, in the layout chosen at load.

Loading streams one tensor at a time straight into its final buffer (a dtype conversion costs one tensor of
transient memory, never more). Quantized dense Linears are dequantized here, once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moeserve.checkpoint.finite import check_tensor
from moeserve.checkpoint.folder import Checkpoint
from moeserve.models.layers.linear import Linear
from moeserve.models.numerics import Numerics
from moeserve.models.quantized import checkpoint_scheme, dequantize_at_load, is_stored_dense, linear_format


class WeightLoader:
    """Reads named tensors from the checkpoint into the compute dtype on the compute device."""

    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype, device: torch.device,
                 progress: Callable[[int], None] | None = None, numerics: Numerics = Numerics(),
                 int8: bool = False) -> None:
        self.ckpt, self.dtype, self.device, self.progress = ckpt, dtype, device, progress
        self.numerics = numerics  # every Linear's: the C++ GEMV's layout where it applies, batch invariance
        self.int8 = int8  # quantization="int8": dense Linears (but routers, gates) as int8 codes (see Linear)
        self.int8_linears = 0  # how many Linears were quantized to int8 at load
        self.resident_bytes = 0
        self.scheme = checkpoint_scheme(ckpt)
        self.dequantized_linears: list[str] = []  # quantized dense Linears, dequantized at load

    def tensor(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        ref = self.ckpt.ref(name, shape)
        dtype = dtype or self.dtype
        if ref.dtype == dtype and self.device.type == "cpu":
            out = torch.empty(ref.shape, dtype=dtype)
            self.ckpt.reader.read_into(ref, out)  # straight into the final buffer: no transient
        else:
            out = self.ckpt.reader.read(ref).to(device=self.device, dtype=dtype)
        check_tensor(out, name, ref.path, converted=ref.dtype != dtype)  # NaN/inf: refused at load
        if self.progress is not None:
            self.progress(ref.nbytes)
        self.resident_bytes += out.numel() * out.element_size()
        return out

    def linear_weight(self, prefix: str, out_features: int, in_features: int) -> torch.Tensor:
        """The [out, in] weight of the Linear at `prefix` in the compute dtype; a quantized one (per the
        checkpoint's quantization scheme) is read in its format and dequantized here, once, at load."""
        fmt = linear_format(self.ckpt, self.scheme, prefix)
        if is_stored_dense(fmt):
            return self.tensor(prefix + ".weight", (out_features, in_features))
        weight, stored_nbytes = dequantize_at_load(self.ckpt, fmt, prefix, (out_features, in_features), self.dtype)
        stored_in = self.ckpt.ref(fmt.stored_name(prefix, fmt.roles[0])).path
        check_tensor(weight, prefix, stored_in, note=f" ({fmt.name} weight, dequantized with its scales)")
        weight = weight.to(self.device)
        self.dequantized_linears.append(prefix)
        if self.progress is not None:
            self.progress(stored_nbytes)
        self.resident_bytes += weight.numel() * weight.element_size()
        return weight

    def make_linear(self, weight: torch.Tensor, b: torch.Tensor | None, quantize: bool = True) -> Linear:
        """A Linear of `weight` (already counted in resident_bytes at its loaded size); int8 when this load
        quantizes dense Linears and `quantize` (routers and gates pass False), with resident_bytes corrected."""
        lin = Linear(weight, b, self.numerics, int8=self.int8 and quantize)
        if lin.layout == "int8":
            self.int8_linears += 1
            self.resident_bytes += lin.nbytes - weight.numel() * weight.element_size() - (
                0 if b is None else b.numel() * b.element_size())
        return lin

    def linear(self, prefix: str, out_features: int, in_features: int, bias: bool = False,
               quantize: bool = True) -> Linear:
        weight = self.linear_weight(prefix, out_features, in_features)
        b = self.tensor(prefix + ".bias", (out_features,)) if bias else None
        return self.make_linear(weight, b, quantize)

    def stacked_linear(self, parts: list[tuple[str, int]], in_features: int, bias: bool = False) -> Linear:
        """One Linear whose output is the outputs of the Linears at `parts` ((prefix, out_features) each) side by
        side: their weights stacked along the output dim (one GEMV instead of several; each output row is the
        same dot product, so the same bits). Transient memory: the parts, once."""
        weight = torch.cat([self.linear_weight(p, out, in_features) for p, out in parts])
        b = torch.cat([self.tensor(p + ".bias", (out,)) for p, out in parts]) if bias else None
        return self.make_linear(weight, b)
