// Fused SwiGLU MoE experts: one call per MoE layer and chunk of experts, any token count.
//
//   for each expert e of the chunk, in the order given (ascending ids), and each token t routed to it:
//     g, u  = (gate_up_e x_t)[:I], (gate_up_e x_t)[I:]      gate_up_e [2I, H], gate rows first
//     a     = silu(g) * u
//     out_t += w_t * (down_e a)                               down_e [H, I], w_t the routing weight
//
// This file: the ops' checks and registration. Their numeric cores, plain C++ without ATen: csrc/moe_plain.h (units
// as [out, in] matrices, the "plain" layout: moe_swiglu_, moe_swiglu_int8_) and csrc/moe_interleaved.h (units in
// the dense GEMVs' 4-row interleaved layouts: moe_swiglu_interleaved_, moe_swiglu_int8_interleaved_). Each weight
// row is read ONCE for all the tokens routed to its expert, by one thread, as one sequential stream.
//
// Numerics. bf16 compute: each dot product is the canonical one (csrc/canonical_dot.h: 16 fp32 lanes as vdpbf16ps
// fills them over the 32-element chunks in order, a fixed halving sum), a row whose length is not a multiple of 32
// zero-padded to whole chunks (what a masked vdpbf16ps computes): the same bits on AVX512-BF16, AVX2 and scalar
// builds, and the same as the interleaved op's on the same values. fp32 compute: fp32 FMAs in a fixed order per
// build (dot_fma). Either way a token's result does not depend on the other tokens, the thread count or where the
// weights live. Every other step takes torch's roundings in the compute dtype, as `swiglu_expert` + `MoEBlock` do
// with torch ops: for bf16, g and u are rounded to bf16, silu(g) is rounded, the product is rounded, down's output
// is rounded, times the routing weight rounded, and the add into `out` rounded (bf16, expert after expert: the same
// bits whatever the chunking, so offloaded == resident). For fp32 nothing is rounded in between. Only the order of
// the additions inside each dot product differs from torch's GEMM.
//
// int8 weights (int8 [out, in] + fp32 per-row scales) are read as they are (half the bytes of bf16): with bf16
// activations the canonical int8 dot (csrc/canonical_int8.h: the codes' values, exact in bf16, in the canonical
// order), with fp32 ones dot_fma; the row's scale applied once to the fp32 sum: dot(codes, x) * scale, then the
// roundings above. The torch path (Int8Kernel) instead rounds codes * scale to a bf16 buffer first and runs a bf16
// GEMM, so it carries one extra rounding per weight (relative 2^-9): the two agree to a few bf16 steps, not bit for
// bit; the op is as close to the exact result as the torch path (tests/kernels/test_moe_experts.py). Offloaded and
// resident int8 both run this op, so they stay bit-identical.

#include <ATen/ATen.h>

#include "ops.h"
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "moe_interleaved.h"
#include "moe_plain.h"

namespace moeserve_moe {

// Threads for the ops: torch's count, one inside a torch parallel region.
inline int op_threads() { return at::in_parallel_region() ? 1 : std::max(1, at::get_num_threads()); }

void check_common(const at::Tensor& out, const at::Tensor& x, const at::Tensor& token_of, const at::Tensor& weight_of,
                  const std::vector<int64_t>& bounds, size_t n_exp) {
  TORCH_CHECK(out.device().is_cpu() && x.device().is_cpu(), "moe_swiglu: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && out.sizes() == x.sizes() && out.dtype() == x.dtype(), "moe_swiglu: out and x [N, H]");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous(), "moe_swiglu: out and x must be contiguous");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "moe_swiglu: bf16 or fp32 x");
  TORCH_CHECK(token_of.scalar_type() == at::kLong && token_of.dim() == 1 && token_of.is_contiguous(),
              "moe_swiglu: token_of int64 [P]");
  TORCH_CHECK(weight_of.scalar_type() == at::kFloat && weight_of.dim() == 1 && weight_of.is_contiguous() &&
                  weight_of.numel() == token_of.numel(),
              "moe_swiglu: weight_of float32 [P]");
  TORCH_CHECK(bounds.size() == 2 * n_exp, "moe_swiglu: bounds holds (lo, hi) of each expert");
  const int64_t n = x.size(0), p = token_of.numel();
  for (size_t i = 0; i < n_exp; ++i)
    TORCH_CHECK(0 <= bounds[2 * i] && bounds[2 * i] <= bounds[2 * i + 1] && bounds[2 * i + 1] <= p,
                "moe_swiglu: bounds out of range");
  const int64_t* tp = token_of.data_ptr<int64_t>();
  for (int64_t i = 0; i < p; ++i) TORCH_CHECK(0 <= tp[i] && tp[i] < n, "moe_swiglu: token index out of range");
}

void check_weight(const at::Tensor& w, int64_t rows, int64_t cols, at::ScalarType dtype, const char* what) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == dtype && w.dim() == 2 && w.size(0) == rows &&
                  w.size(1) == cols && w.is_contiguous(),
              "moe_swiglu: ", what, " must be a contiguous ", c10::toString(dtype), " [", rows, ", ", cols,
              "] CPU tensor, got ", w.scalar_type(), " ", w.sizes());
}

// The experts with tokens (an expert with none reads nothing), their scales where given (int8: one list each).
std::vector<Expert> collect(at::TensorList gate_up, at::TensorList down, at::TensorList gate_up_scale,
                            at::TensorList down_scale, const std::vector<int64_t>& bounds, int64_t& pairs) {
  TORCH_CHECK(gate_up.size() == down.size(), "moe_swiglu: one gate_up and one down per expert");
  std::vector<Expert> experts;
  pairs = 0;
  for (size_t i = 0; i < gate_up.size(); ++i) {
    Expert e{gate_up[i].data_ptr(), down[i].data_ptr(),
             gate_up_scale.empty() ? nullptr : gate_up_scale[i].data_ptr<float>(),
             down_scale.empty() ? nullptr : down_scale[i].data_ptr<float>(), bounds[2 * i], bounds[2 * i + 1], pairs};
    if (e.hi > e.lo) {
      experts.push_back(e);
      pairs += e.hi - e.lo;
    }
  }
  return experts;
}

template <typename XT>
void dispatch_w(at::Tensor& out, const at::Tensor& x, int64_t isz, std::vector<Expert>& experts,
                const at::Tensor& token_of, const at::Tensor& weight_of, int64_t pairs, WKind kind) {
  XT* o = reinterpret_cast<XT*>(out.data_ptr());
  const XT* xp = reinterpret_cast<const XT*>(x.data_ptr());
  const int64_t h = x.size(1);
  const int64_t* tp = token_of.data_ptr<int64_t>();
  const float* wp = weight_of.data_ptr<float>();
  if (kind == WKind::kI8) run<XT, WKind::kI8>(o, xp, h, isz, experts, tp, wp, pairs, op_threads());
  else if constexpr (std::is_same_v<XT, uint16_t>) run<XT, WKind::kBF16>(o, xp, h, isz, experts, tp, wp, pairs, op_threads());
  else run<XT, WKind::kF32>(o, xp, h, isz, experts, tp, wp, pairs, op_threads());
}

// out += sum over the chunk's experts (see the top of the file). bf16 or fp32 weights of x's dtype.
at::Tensor moe_swiglu_(at::Tensor out, const at::Tensor& x, at::TensorList gate_up, at::TensorList down,
                       const at::Tensor& token_of, const at::Tensor& weight_of, at::IntArrayRef bounds_ref) {
  const std::vector<int64_t> bounds(bounds_ref.begin(), bounds_ref.end());
  check_common(out, x, token_of, weight_of, bounds, gate_up.size());
  const int64_t h = x.size(1);
  for (size_t i = 0; i < gate_up.size(); ++i) {
    check_weight(gate_up[i], gate_up[0].size(0), h, x.scalar_type(), "gate_up");
    check_weight(down[i], h, gate_up[0].size(0) / 2, x.scalar_type(), "down");
  }
  TORCH_CHECK(gate_up.empty() || gate_up[0].size(0) % 2 == 0, "moe_swiglu: gate_up has 2I rows");
  int64_t pairs = 0;
  std::vector<Expert> experts = collect(gate_up, down, {}, {}, bounds, pairs);
  if (experts.empty()) return out;
  const int64_t isz = gate_up[0].size(0) / 2;
  if (x.scalar_type() == at::kBFloat16) dispatch_w<uint16_t>(out, x, isz, experts, token_of, weight_of, pairs, WKind::kBF16);
  else dispatch_w<float>(out, x, isz, experts, token_of, weight_of, pairs, WKind::kF32);
  return out;
}

// The same with int8 weights [out, in] and float32 per-row scales [out].
at::Tensor moe_swiglu_int8_(at::Tensor out, const at::Tensor& x, at::TensorList gate_up, at::TensorList gate_up_scale,
                            at::TensorList down, at::TensorList down_scale, const at::Tensor& token_of,
                            const at::Tensor& weight_of, at::IntArrayRef bounds_ref) {
  const std::vector<int64_t> bounds(bounds_ref.begin(), bounds_ref.end());
  check_common(out, x, token_of, weight_of, bounds, gate_up.size());
  TORCH_CHECK(gate_up_scale.size() == gate_up.size() && down_scale.size() == down.size(),
              "moe_swiglu_int8: one scale vector per weight");
  const int64_t h = x.size(1);
  for (size_t i = 0; i < gate_up.size(); ++i) {
    const int64_t r = gate_up[0].size(0);
    check_weight(gate_up[i], r, h, at::kChar, "gate_up");
    check_weight(down[i], h, r / 2, at::kChar, "down");
    TORCH_CHECK(gate_up_scale[i].scalar_type() == at::kFloat && gate_up_scale[i].numel() == r &&
                    gate_up_scale[i].is_contiguous() && down_scale[i].scalar_type() == at::kFloat &&
                    down_scale[i].numel() == h && down_scale[i].is_contiguous(),
                "moe_swiglu_int8: scales are contiguous float32 [rows]");
  }
  int64_t pairs = 0;
  std::vector<Expert> experts = collect(gate_up, down, gate_up_scale, down_scale, bounds, pairs);
  if (experts.empty()) return out;
  const int64_t isz = gate_up[0].size(0) / 2;
  if (x.scalar_type() == at::kBFloat16) dispatch_w<uint16_t>(out, x, isz, experts, token_of, weight_of, pairs, WKind::kI8);
  else dispatch_w<float>(out, x, isz, experts, token_of, weight_of, pairs, WKind::kI8);
  return out;
}

// Both canonical orders compile on every ISA (AVX512-BF16, AVX2 + FMA, scalar), so both ops are always there.
bool interleaved_supported() { return true; }
bool int8_interleaved_supported() { return true; }

// The checks of both ops: bf16 x, H and I multiples of 32, every unit `dtype` with 2I*H and H*I elements.
int64_t check_interleaved(const at::Tensor& x, at::TensorList gate_up, at::TensorList down, at::ScalarType dtype,
                          const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, op, ": bf16 x");
  TORCH_CHECK(down.size() == gate_up.size(), op, ": one gate_up and one down per expert");
  const int64_t h = x.size(1);
  const int64_t isz = gate_up.empty() ? 0 : gate_up[0].numel() / (2 * h);
  TORCH_CHECK(h % 32 == 0 && isz % 32 == 0, op, ": H and I must be multiples of 32");
  for (size_t i = 0; i < gate_up.size(); ++i) {
    for (const at::Tensor& w : {gate_up[i], down[i]})
      TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == dtype && w.is_contiguous(), op,
                  ": gate_up and down must be contiguous ", c10::toString(dtype), " CPU tensors");
    TORCH_CHECK(gate_up[i].numel() == 2 * isz * h && down[i].numel() == h * isz, op, ": expert ", i,
                " has gate_up of ", gate_up[i].numel(), " and down of ", down[i].numel(),
                " elements; expected 2I*H = ", 2 * isz * h, " and H*I = ", h * isz);
  }
  return isz;
}

// out += sum over the chunk's experts (moe_experts.cpp), bf16 units: gate_up and down as flat bf16 [2I*H], [H*I].
at::Tensor moe_swiglu_interleaved_(at::Tensor out, const at::Tensor& x, at::TensorList gate_up, at::TensorList down,
                                   const at::Tensor& token_of, const at::Tensor& weight_of, at::IntArrayRef bounds_ref) {
  const std::vector<int64_t> bounds(bounds_ref.begin(), bounds_ref.end());
  check_common(out, x, token_of, weight_of, bounds, gate_up.size());
  const int64_t isz = check_interleaved(x, gate_up, down, at::kBFloat16, "moe_swiglu_interleaved_");
  int64_t pairs = 0;
  std::vector<Expert> experts = collect(gate_up, down, {}, {}, bounds, pairs);
  if (experts.empty()) return out;
  run_interleaved<Bf16Block>(reinterpret_cast<uint16_t*>(out.data_ptr()), reinterpret_cast<const uint16_t*>(x.data_ptr()),
                             x.size(1), isz, experts, token_of.data_ptr<int64_t>(), weight_of.data_ptr<float>(), pairs,
                             op_threads());
  return out;
}

// int8 units: flat codes [2I*H] and [H*I] in pack_int8_rows' layout, float32 row scales [2I] and [H]: the same
// on half the bytes. bf16 x only.
at::Tensor moe_swiglu_int8_interleaved_(at::Tensor out, const at::Tensor& x, at::TensorList gate_up,
                                        at::TensorList gate_up_scale, at::TensorList down, at::TensorList down_scale,
                                        const at::Tensor& token_of, const at::Tensor& weight_of,
                                        at::IntArrayRef bounds_ref) {
  const std::vector<int64_t> bounds(bounds_ref.begin(), bounds_ref.end());
  check_common(out, x, token_of, weight_of, bounds, gate_up.size());
  const int64_t isz = check_interleaved(x, gate_up, down, at::kChar, "moe_swiglu_int8_interleaved_");
  TORCH_CHECK(gate_up_scale.size() == gate_up.size() && down_scale.size() == gate_up.size(),
              "moe_swiglu_int8_interleaved_: one gate_up and one down scale vector per expert");
  for (size_t i = 0; i < gate_up.size(); ++i)
    TORCH_CHECK(gate_up_scale[i].scalar_type() == at::kFloat && gate_up_scale[i].numel() == 2 * isz &&
                    gate_up_scale[i].is_contiguous() && down_scale[i].scalar_type() == at::kFloat &&
                    down_scale[i].numel() == x.size(1) && down_scale[i].is_contiguous(),
                "moe_swiglu_int8_interleaved_: scales are contiguous float32 [2I] and [H]");
  int64_t pairs = 0;
  std::vector<Expert> experts = collect(gate_up, down, gate_up_scale, down_scale, bounds, pairs);
  if (experts.empty()) return out;
  run_interleaved<Int8Block>(reinterpret_cast<uint16_t*>(out.data_ptr()), reinterpret_cast<const uint16_t*>(x.data_ptr()),
                             x.size(1), isz, experts, token_of.data_ptr<int64_t>(), weight_of.data_ptr<float>(), pairs,
                             op_threads());
  return out;
}

}  // namespace moeserve_moe

TORCH_LIBRARY_FRAGMENT(moeserve, m) {
  m.def("moe_swiglu_(Tensor(a!) out, Tensor x, Tensor[] gate_up, Tensor[] down, Tensor token_of, "
        "Tensor weight_of, int[] bounds) -> Tensor(a!)",
        &moeserve_moe::moe_swiglu_);
  m.def("moe_swiglu_int8_(Tensor(a!) out, Tensor x, Tensor[] gate_up, Tensor[] gate_up_scale, Tensor[] down, "
        "Tensor[] down_scale, Tensor token_of, Tensor weight_of, int[] bounds) -> Tensor(a!)",
        &moeserve_moe::moe_swiglu_int8_);
  m.def("moe_swiglu_interleaved_(Tensor(a!) out, Tensor x, Tensor[] gate_up, Tensor[] down, Tensor token_of, "
        "Tensor weight_of, int[] bounds) -> Tensor(a!)",
        &moeserve_moe::moe_swiglu_interleaved_);
  m.def("moe_swiglu_int8_interleaved_(Tensor(a!) out, Tensor x, Tensor[] gate_up, Tensor[] gate_up_scale, "
        "Tensor[] down, Tensor[] down_scale, Tensor token_of, Tensor weight_of, int[] bounds) -> Tensor(a!)",
        &moeserve_moe::moe_swiglu_int8_interleaved_);
  m.def("moe_interleaved_supported() -> bool", &moeserve_moe::interleaved_supported);
  m.def("moe_int8_interleaved_supported() -> bool", &moeserve_moe::int8_interleaved_supported);
}
