// bf16 matrix-vector products for the dense Linears (q/k/v, o, routers, LM head): y [M, N] = x [M, K] W^T + b.
//
// The weight is stored "row-interleaved" (packed once at load, see moeserve.models.layers.base.Linear): rows in
// blocks of 4, and within a block the 32-element chunks of the 4 rows side by side,
//     packed[((b * K/32 + c) * 4 + r) * 32 + i] = W[4b + r, 32c + i]
// followed by the N % 4 leftover rows as they are. A block is then ONE sequential stream that feeds 4 output
// rows. Measured on the 2-core bench machine: one sequential stream reads at ~25 GB/s per thread, while 2 or 4
// rows read side by side from the plain layout (or oneDNN's packed GEMV) reach 11-13 GB/s.
//
// Dot products follow the project's one canonical order (csrc/canonical_dot.h: 16 fp32 lanes as AVX512-BF16's
// vdpbf16ps fills them, chunks in order, a fixed halving sum; AVX512-BF16, AVX2 + FMA and scalar code give the same
// bits), one per (input row, output row); then the bias in fp32 and one rounding to bf16. Each output therefore
// depends only on its own input row: the same bits whatever the batch size, the thread count or the ISA. Input rows
// go 4 at a time over a block held in L1, in tiles of 32 rows per pass over the weight (prefill reads the weight
// once per 32 tokens).

#include <ATen/ATen.h>

#include "ops.h"
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <vector>

#include "dense_gemv_core.h"
#include "norm_common.h"

namespace moeserve_dense {

using namespace moeserve_csrc;

// The canonical order compiles on every ISA (AVX512-BF16, AVX2 + FMA, NEON, scalar): the op is always there.
bool gemv_supported() { return true; }

// Which implementation of the canonical order this build runs: "avx512bf16", "avx2", "neon", "neon-bf16" or "scalar".
std::string canonical_dot_isa() { return moeserve_canon::implementation(); }

// x [..., K] bf16, packed weight (numel N*K, layout above), bias [N] bf16 or None -> y [..., N] bf16.
at::Tensor linear_interleaved(const at::Tensor& x_in, const at::Tensor& packed, int64_t n,
                              const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 &&
                  x_in.device().is_cpu() && packed.is_contiguous(),
              "linear_interleaved: bf16 CPU tensors, packed weight contiguous");
  const int64_t k = x_in.size(-1);
  TORCH_CHECK(k % 32 == 0 && packed.numel() == n * k, "linear_interleaved: K must be a multiple of 32, weight N*K");
  const at::Tensor x = x_in.reshape({-1, k}).contiguous();
  const int64_t m = x.size(0);
  at::Tensor y = empty_with_last_dim(x_in, n);
  if (m == 0 || n == 0) return y;
  const std::vector<float> b = bias_as_float(bias, n, "linear_interleaved");
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const float* bp = b.empty() ? nullptr : b.data();
  // Threads split the output rows (blocks of 4; the leftover rows count as one more block), at least ~128 KiB of
  // weight each: a router-sized Linear (64 KiB, ~3 us) stays on one thread rather than pay a fork and join.
  const int64_t units = n / 4 + (n % 4 != 0 ? 1 : 0);
  const int64_t grain = std::max<int64_t>(1, (128 * 1024) / (4 * k * 2));
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) { gemv_rows(xp, wp, m, n, k, bp, yp, u0, u1); });
  return y;
}

}  // namespace moeserve_dense

TORCH_LIBRARY_FRAGMENT(moeserve, m) {
  m.def("linear_interleaved(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor",
        &moeserve_dense::linear_interleaved);
  m.def("gemv_bf16_supported() -> bool", &moeserve_dense::gemv_supported);
  m.def("canonical_dot_isa() -> str", &moeserve_dense::canonical_dot_isa);
}
