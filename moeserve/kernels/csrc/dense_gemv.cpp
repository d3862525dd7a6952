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

#include "canonical_dot.h"
#include "norm_common.h"

namespace moeserve_dense {

using namespace moeserve_csrc;

constexpr int64_t kRowTile = 32;  // input rows per pass over the weight
// The first pass over a block fetches the next block (4 rows of 1024 = 8 KiB ahead) by hand: the hardware
// prefetcher alone falls behind. Measured 14 -> 16-19 GB/s at 8 rows; at 1 row, on the 2-core EPYC of
// 2026-11-23 (scripts/bench_gemv.py, variants alternated, 3 rounds): 28-33 -> 37-52 GB/s (an older measurement
// on another day had it cost at 1 row; distances of 1-8 KiB were within noise of each other).
constexpr int64_t kPrefetchBytes = 8192;

static inline float finish(float dot, const float* bias, int64_t n) { return bias != nullptr ? dot + bias[n] : dot; }

// Block b of 4 output rows against MB input rows (x, row stride xs).
template <int MB>
static void blocks4(const uint16_t* x, int64_t xs, const uint16_t* wp, int64_t k, const float* bias, uint16_t* y,
                    int64_t ys, int64_t b, bool prefetch) {
  const uint16_t* xr[MB];
  for (int m = 0; m < MB; ++m) xr[m] = x + m * xs;
  float res[MB][4];
  moeserve_canon::block4_dots<MB>(wp + b * 4 * k, k, xr, res, prefetch ? kPrefetchBytes : 0);
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < 4; ++r) y[m * ys + 4 * b + r] = bf16_bits(finish(res[m][r], bias, 4 * b + r));
}

// Plain rows [n0, n1) (the N % 4 leftover rows), MB input rows.
template <int MB>
static void plain_rows(const uint16_t* x, int64_t xs, const uint16_t* w, int64_t k, const float* bias, uint16_t* y,
                       int64_t ys, int64_t n0, int64_t n1) {
  const uint16_t* xr[MB];
  for (int m = 0; m < MB; ++m) xr[m] = x + m * xs;
  for (int64_t n = n0; n < n1; ++n) {
    float res[MB];
    moeserve_canon::row_dots<MB>(w + n * k, k, xr, res);
    for (int m = 0; m < MB; ++m) y[m * ys + n] = bf16_bits(finish(res[m], bias, n));
  }
}

// Input rows [m0, m1) (at most kRowTile) against output blocks [b0, b1); the last "block" index == blocks
// stands for the leftover plain rows.
static void tile(const uint16_t* x, int64_t xs, const uint16_t* wp, int64_t n, int64_t k, const float* bias,
                 uint16_t* y, int64_t ys, int64_t m0, int64_t m1, int64_t b0, int64_t b1) {
  const int64_t blocks = n / 4;
  const int64_t bb1 = std::min(b1, blocks);
  for (int64_t b = b0; b < bb1; ++b) {  // one block at a time, so its 4 rows stay in L1 across input rows
    for (int64_t m = m0; m < m1; m += 4) {
      const bool pf = m == m0;  // the first pass over the block is the one reading memory
      const uint16_t* xm = x + m * xs;
      uint16_t* ym = y + m * ys;
      switch (std::min<int64_t>(4, m1 - m)) {
        case 1: blocks4<1>(xm, xs, wp, k, bias, ym, ys, b, pf); break;
        case 2: blocks4<2>(xm, xs, wp, k, bias, ym, ys, b, pf); break;
        case 3: blocks4<3>(xm, xs, wp, k, bias, ym, ys, b, pf); break;
        default: blocks4<4>(xm, xs, wp, k, bias, ym, ys, b, pf); break;
      }
    }
  }
  if (b1 > blocks && n % 4 != 0) {
    const uint16_t* rest = wp;  // leftover row n sits at n * K, right after the blocks
    for (int64_t m = m0; m < m1; m += 4) {
      const uint16_t* xm = x + m * xs;
      uint16_t* ym = y + m * ys;
      switch (std::min<int64_t>(4, m1 - m)) {
        case 1: plain_rows<1>(xm, xs, rest, k, bias, ym, ys, blocks * 4, n); break;
        case 2: plain_rows<2>(xm, xs, rest, k, bias, ym, ys, blocks * 4, n); break;
        case 3: plain_rows<3>(xm, xs, rest, k, bias, ym, ys, blocks * 4, n); break;
        default: plain_rows<4>(xm, xs, rest, k, bias, ym, ys, blocks * 4, n); break;
      }
    }
  }
}

// The canonical order compiles on every ISA (AVX512-BF16, AVX2 + FMA, scalar): the op is always there.
bool gemv_supported() { return true; }

// Which implementation of the canonical order this build runs: "avx512bf16", "avx2" or "scalar".
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
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    for (int64_t m0 = 0; m0 < m; m0 += kRowTile)
      tile(xp, k, wp, n, k, bp, yp, n, m0, std::min(m, m0 + kRowTile), u0, u1);
  });
  return y;
}

}  // namespace moeserve_dense

TORCH_LIBRARY_FRAGMENT(moeserve, m) {
  m.def("linear_interleaved(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor",
        &moeserve_dense::linear_interleaved);
  m.def("gemv_bf16_supported() -> bool", &moeserve_dense::gemv_supported);
  m.def("canonical_dot_isa() -> str", &moeserve_dense::canonical_dot_isa);
}
