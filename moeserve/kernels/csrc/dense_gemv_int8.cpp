// int8 matrix-vector products for the dense Linears under quantization="int8":
//     y [M, N] = bf16( (x [M, K] . Q[n, :]) * scale[n] + b[n] )
// with Q int8 codes in [-127, 127] (per-output-row symmetric, see moeserve.formats.int8) and scale float32 [N].
//
// Layout (packed once at load by moeserve.models.layers.base.pack_int8_rows): as the bf16 op (csrc/dense_gemv.cpp),
// rows in blocks of 4 with their 32-element chunks side by side, so a block of 4 rows is one sequential stream of
// 4 * K bytes (half the bf16 op's). Within a block, chunk c takes 128 bytes: rows (0, 1) then rows (2, 3), each
// pair as 4 groups of [8 codes of the first row, 8 codes of the second]:
//     packed[b*4K + c*128 + p*64 + g*16 + s*8 + e] = code(Q[4b + 2p + s, 32c + 8g + e])
// and a block code is sign-magnitude (bit 7 the sign, bits 0-6 |q|). The N % 4 leftover rows follow as plain
// two's-complement rows. Why: 64 codes then become 2 x 32 bf16 with 5 instructions (two 128-entry byte table
// lookups by |q| for the low and high bytes of bf16(|q|), the sign OR'ed in, two byte unpacks whose in-lane
// order the layout undoes) instead of 10 (widen to int32, convert to fp32, pack to bf16): measured, the widen-and-
// convert version was bound by those instructions, not by memory.
//
// Numerics (csrc/canonical_int8.h): each output is the canonical bf16 dot (csrc/canonical_dot.h) of the row's code
// values (exact in bf16) with the input row, then times the row scale, plus the bias (both in fp32), one rounding to
// bf16. The same bits on every ISA the kernels build for (AVX512-BF16 + VBMI, AVX2 + FMA, scalar), whatever the batch
// size or the thread count: each output depends only on its own input row. force_portable (tests) runs the scalar
// reference of canonical_int8.h in any build: the same bits again.

#include <ATen/ATen.h>

#include "ops.h"
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include "canonical_int8.h"
#include "norm_common.h"

namespace moeserve_dense_int8 {

using namespace moeserve_csrc;

constexpr int64_t kRowTile = 32;  // input rows per pass over the weight
// The first pass over a block fetches 8 KiB ahead by hand, as the bf16 op does (the hardware prefetcher alone
// falls behind): at 1 row 31-34 -> 34-42 GB/s of codes (scripts/bench_gemv.py, 2026-11-23).
constexpr int64_t kPrefetchBytes = 8192;

// The row scale and the bias as canonical_int8.h states them: fma(dot, scale, bias), one rounding.
static inline float finish(float dot, const float* scale, const float* bias, int64_t n) {
  return bias != nullptr ? std::fma(dot, scale[n], bias[n]) : dot * scale[n];
}

// The dots of this build (kRef = false) or the scalar reference (kRef = true), same bits.
template <bool kRef>
struct Dots {
  template <int MB>
  static void block(const int8_t* blk, int64_t k, const uint16_t* const* xs, float (*res)[4], bool prefetch) {
    if constexpr (kRef) moeserve_i8::block4_reference<MB>(blk, k, xs, res);
    else moeserve_i8::block4_dots_i8<MB>(blk, k, xs, res, prefetch ? kPrefetchBytes : 0);
  }
  template <int MB>
  static void row(const int8_t* w, int64_t k, const uint16_t* const* xs, float* res) {
    if constexpr (kRef) moeserve_i8::row_reference<MB>(w, k, xs, res);
    else moeserve_i8::row_dots_i8<MB>(w, k, xs, res, 0);
  }
};

// fn(std::integral_constant<int, MB>) for MB = min(4, g): the input-row count as a template argument.
template <typename Fn>
static inline void with_rows(int64_t g, Fn&& fn) {
  switch (std::min<int64_t>(4, g)) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 3: fn(std::integral_constant<int, 3>{}); break;
    default: fn(std::integral_constant<int, 4>{}); break;
  }
}

// Input rows [m0, m1) (x, row stride k) against output blocks [b0, b1); block index == blocks stands for the
// leftover plain rows (right after the blocks: row n at n * K).
template <typename D>
static void tile(const uint16_t* x, const int8_t* wp, int64_t n, int64_t k, const float* scale, const float* bias,
                 uint16_t* y, int64_t m0, int64_t m1, int64_t b0, int64_t b1) {
  const int64_t blocks = n / 4;
  for (int64_t b = b0; b < std::min(b1, blocks); ++b)  // one block at a time: its 4 rows stay in L1
    for (int64_t m = m0; m < m1; m += 4)
      with_rows(m1 - m, [&](auto mb) {
        constexpr int MB = decltype(mb)::value;
        const uint16_t* xr[MB];
        for (int i = 0; i < MB; ++i) xr[i] = x + (m + i) * k;
        float res[MB][4];
        D::template block<MB>(wp + b * 4 * k, k, xr, res, m == m0);  // the first pass reads memory
        for (int i = 0; i < MB; ++i)
          for (int r = 0; r < 4; ++r) y[(m + i) * n + 4 * b + r] = bf16_bits(finish(res[i][r], scale, bias, 4 * b + r));
      });
  if (b1 <= blocks) return;
  for (int64_t m = m0; m < m1; m += 4)
    with_rows(m1 - m, [&](auto mb) {
      constexpr int MB = decltype(mb)::value;
      const uint16_t* xr[MB];
      for (int i = 0; i < MB; ++i) xr[i] = x + (m + i) * k;
      for (int64_t row = 4 * blocks; row < n; ++row) {
        float res[MB];
        D::template row<MB>(wp + row * k, k, xr, res);
        for (int i = 0; i < MB; ++i) y[(m + i) * n + row] = bf16_bits(finish(res[i], scale, bias, row));
      }
    });
}

// The canonical int8 dot compiles on every ISA: the op is always there. Which implementation this build runs.
std::string canonical_int8_isa() { return moeserve_i8::implementation(); }

// x [..., K] bf16, packed codes (numel N*K, layout above), scale [N] float32, bias [N] bf16 or None,
// force_portable (tests: the scalar reference, the same bits) -> y [..., N] bf16.
at::Tensor linear_interleaved_int8(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scale_in,
                                   int64_t n, const std::optional<at::Tensor>& bias, bool force_portable) {
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kChar &&
                  scale_in.scalar_type() == at::kFloat && x_in.device().is_cpu() && packed.device().is_cpu() &&
                  packed.is_contiguous(),
              "linear_interleaved_int8: x bf16, packed int8 (contiguous), scale float32, all on CPU");
  const int64_t k = x_in.size(-1);
  TORCH_CHECK(k % 32 == 0 && packed.numel() == n * k && scale_in.numel() == n,
              "linear_interleaved_int8: K must be a multiple of 32, codes N*K, scale [N]");
  const at::Tensor x = x_in.reshape({-1, k}).contiguous();
  const at::Tensor scale = scale_in.contiguous();
  const int64_t m = x.size(0);
  at::Tensor y = empty_with_last_dim(x_in, n);
  if (m == 0 || n == 0) return y;
  const std::vector<float> b = bias_as_float(bias, n, "linear_interleaved_int8");
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = packed.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const float* bp = b.empty() ? nullptr : b.data();
  // Threads split the output rows (blocks of 4; the leftover rows count as one more block), at least ~128 KiB of
  // codes each, as the bf16 op does.
  const int64_t units = n / 4 + (n % 4 != 0 ? 1 : 0);
  const int64_t grain = std::max<int64_t>(1, (128 * 1024) / (4 * k));
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    for (int64_t m0 = 0; m0 < m; m0 += kRowTile) {
      const int64_t m1 = std::min(m, m0 + kRowTile);
      if (force_portable) tile<Dots<true>>(xp, wp, n, k, sp, bp, yp, m0, m1, u0, u1);
      else tile<Dots<false>>(xp, wp, n, k, sp, bp, yp, m0, m1, u0, u1);
    }
  });
  return y;
}

}  // namespace moeserve_dense_int8

TORCH_LIBRARY_FRAGMENT(moeserve, m) {
  m.def("linear_interleaved_int8(Tensor x, Tensor packed, Tensor scale, int n, Tensor? bias, bool force_portable=False)"
        " -> Tensor",
        &moeserve_dense_int8::linear_interleaved_int8);
  m.def("canonical_int8_isa() -> str", &moeserve_dense_int8::canonical_int8_isa);
}
