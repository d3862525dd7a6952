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
// AVX512-BF16 path: the codes become bf16 exactly (|code| <= 127 needs 7 bits) and are multiplied with the
// bf16 activations by vdpbf16ps (products exact in fp32, pairs summed in fp32); one fp32
// accumulator per (input row, output row), chunks added in order, a fixed reduction at the end, then the row
// scale, the bias (both in fp32) and one rounding to bf16. Portable path: the same products summed in fp32 in a
// fixed order (16 running partial sums). Within a path each output depends only on its own input row: the same
// bits whatever the batch size or the thread count.

#include <ATen/ATen.h>

#include "ops.h"
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "int8_codes.h"
#include "norm_common.h"

namespace moeserve_dense_int8 {

using namespace moeserve_csrc;

constexpr int64_t kRowTile = 32;  // input rows per pass over the weight
// The first pass over a block fetches 8 KiB ahead by hand, as the bf16 op does (the hardware prefetcher alone
// falls behind): at 1 row 31-34 -> 34-42 GB/s of codes (scripts/bench_gemv.py, 2026-11-23).
constexpr int64_t kPrefetchBytes = 8192;

static inline float finish(float dot, const float* scale, const float* bias, int64_t n) {
  const float s = dot * scale[n];
  return bias != nullptr ? s + bias[n] : s;
}

// The AVX512-BF16 path exists only where the build's ISA has it (int8_codes.h): an avx2 or generic build never
// chooses it, whatever the CPU.
#if defined(MOESERVE_HAVE_I8_DECODE)
// 32 plain two's-complement codes at p (a leftover row) -> 32 bf16 values (exact).
MOESERVE_I8_TARGET static inline __m512bh codes_bf16(const int8_t* p) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 hi =
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);  // element i = code i
}

// Blocks [b0, b1) of 4 output rows, MB input rows: MB * 4 accumulators.
template <int MB>
MOESERVE_I8_TARGET static void blocks4(const uint16_t* x, int64_t xs, const int8_t* wp, int64_t k,
                                       const float* scale, const float* bias, uint16_t* y, int64_t ys, int64_t b0,
                                       int64_t b1, bool prefetch) {
  const int64_t chunks = k / 32;
  const Lut lut = make_lut();
  for (int64_t b = b0; b < b1; ++b) {
    __m512 acc[MB][4];
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_setzero_ps();
    const int8_t* blk = wp + b * 4 * k;
    for (int64_t c = 0; c < chunks; ++c) {
      const int8_t* wc = blk + c * 128;
      if (prefetch)
        for (int l = 0; l < 2; ++l) _mm_prefetch(reinterpret_cast<const char*>(wc + kPrefetchBytes + 64 * l), _MM_HINT_T0);
      __m512bh w[4];
      decode_pair(wc, lut, w[0], w[1]);
      decode_pair(wc + 64, lut, w[2], w[3]);
      for (int m = 0; m < MB; ++m) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * xs + c * 32);
        for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], w[r], xv);
      }
    }
    for (int m = 0; m < MB; ++m)
      for (int r = 0; r < 4; ++r)
        y[m * ys + 4 * b + r] = bf16_bits(finish(_mm512_reduce_add_ps(acc[m][r]), scale, bias, 4 * b + r));
  }
}

// Plain rows [n0, n1) (the N % 4 leftover rows), MB input rows.
template <int MB>
MOESERVE_I8_TARGET static void plain_rows(const uint16_t* x, int64_t xs, const int8_t* w, int64_t k,
                                          const float* scale, const float* bias, uint16_t* y, int64_t ys, int64_t n0,
                                          int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    __m512 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t c = 0; c < k / 32; ++c) {
      const __m512bh wv = codes_bf16(w + n * k + c * 32);
      for (int m = 0; m < MB; ++m)
        acc[m] = _mm512_dpbf16_ps(acc[m], wv, (__m512bh)_mm512_loadu_si512(x + m * xs + c * 32));
    }
    for (int m = 0; m < MB; ++m) y[m * ys + n] = bf16_bits(finish(_mm512_reduce_add_ps(acc[m]), scale, bias, n));
  }
}

// Input rows [m0, m1) against output blocks [b0, b1); block index == blocks stands for the leftover plain rows.
static void tile_bf16(const uint16_t* x, int64_t xs, const int8_t* wp, int64_t n, int64_t k, const float* scale,
                      const float* bias, uint16_t* y, int64_t ys, int64_t m0, int64_t m1, int64_t b0, int64_t b1) {
  const int64_t blocks = n / 4;
  const int64_t bb1 = std::min(b1, blocks);
  for (int64_t b = b0; b < bb1; ++b) {  // one block at a time, so its 4 rows stay in L1 across input rows
    for (int64_t m = m0; m < m1; m += 4) {
      const bool pf = m == m0;
      const uint16_t* xm = x + m * xs;
      uint16_t* ym = y + m * ys;
      switch (std::min<int64_t>(4, m1 - m)) {
        case 1: blocks4<1>(xm, xs, wp, k, scale, bias, ym, ys, b, b + 1, pf); break;
        case 2: blocks4<2>(xm, xs, wp, k, scale, bias, ym, ys, b, b + 1, pf); break;
        case 3: blocks4<3>(xm, xs, wp, k, scale, bias, ym, ys, b, b + 1, pf); break;
        default: blocks4<4>(xm, xs, wp, k, scale, bias, ym, ys, b, b + 1, pf); break;
      }
    }
  }
  if (b1 > blocks && n % 4 != 0) {
    for (int64_t m = m0; m < m1; m += 4) {
      const uint16_t* xm = x + m * xs;
      uint16_t* ym = y + m * ys;
      switch (std::min<int64_t>(4, m1 - m)) {
        case 1: plain_rows<1>(xm, xs, wp, k, scale, bias, ym, ys, blocks * 4, n); break;
        case 2: plain_rows<2>(xm, xs, wp, k, scale, bias, ym, ys, blocks * 4, n); break;
        case 3: plain_rows<3>(xm, xs, wp, k, scale, bias, ym, ys, blocks * 4, n); break;
        default: plain_rows<4>(xm, xs, wp, k, scale, bias, ym, ys, blocks * 4, n); break;
      }
    }
  }
}
#endif  // MOESERVE_HAVE_I8_DECODE

static inline float sign_magnitude(int8_t byte) {
  const auto u = static_cast<uint8_t>(byte);
  const float mag = static_cast<float>(u & 0x7F);
  return (u & 0x80) != 0 ? -mag : mag;
}

// Portable path: the dot product of input row x with one output row, 16 running partial sums over the 32
// elements of each chunk, in order. A block row (first = its first code, layout above: 8 codes, skip 8) or a
// leftover row (contiguous two's-complement codes).
static float dot_portable(const uint16_t* x, const int8_t* first, int64_t k, bool block_row) {
  float acc[16] = {0};
  for (int64_t c = 0; c < k / 32; ++c) {
    const uint16_t* xc = x + c * 32;
    for (int i = 0; i < 32; ++i) {
      const float w = block_row ? sign_magnitude(first[c * 128 + (i / 8) * 16 + i % 8])
                                : static_cast<float>(first[c * 32 + i]);
      acc[i & 15] += w * bits_to_f(static_cast<uint32_t>(xc[i]) << 16);
    }
  }
  float s = 0.0f;
  for (int i = 0; i < 16; ++i) s += acc[i];
  return s;
}

static void tile_portable(const uint16_t* x, int64_t xs, const int8_t* wp, int64_t n, int64_t k, const float* scale,
                          const float* bias, uint16_t* y, int64_t ys, int64_t m0, int64_t m1, int64_t b0,
                          int64_t b1) {
  const int64_t blocks = n / 4;
  for (int64_t b = b0; b < b1; ++b) {
    const bool leftover = b >= blocks;
    const int64_t r_end = leftover ? n - 4 * blocks : 4;
    for (int64_t r = 0; r < r_end; ++r) {
      const int64_t row = 4 * b + r;
      // in a block, row r = 2p + s starts at blk + p * 64 + s * 8; a leftover row is contiguous
      const int8_t* start = leftover ? wp + row * k : wp + b * 4 * k + (r / 2) * 64 + (r % 2) * 8;
      for (int64_t m = m0; m < m1; ++m)
        y[m * ys + row] = bf16_bits(finish(dot_portable(x + m * xs, start, k, !leftover), scale, bias, row));
    }
  }
}

static bool cpu_has_avx512_bf16_vbmi() {
#if defined(MOESERVE_HAVE_I8_DECODE)
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16") &&
                          __builtin_cpu_supports("avx512vbmi");
  return has;
#else
  return false;
#endif
}

// x [..., K] bf16, packed codes (numel N*K, layout above), scale [N] float32, bias [N] bf16 or None,
// force_portable (tests) -> y [..., N] bf16.
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
  const bool fast = cpu_has_avx512_bf16_vbmi() && !force_portable;
  // Threads split the output rows (blocks of 4; the leftover rows count as one more block), at least ~128 KiB of
  // codes each, as the bf16 op does.
  const int64_t units = n / 4 + (n % 4 != 0 ? 1 : 0);
  const int64_t grain = std::max<int64_t>(1, (128 * 1024) / (4 * k));
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    for (int64_t m0 = 0; m0 < m; m0 += kRowTile) {
      const int64_t m1 = std::min(m, m0 + kRowTile);
#if defined(MOESERVE_HAVE_I8_DECODE)
      if (fast) {
        tile_bf16(xp, k, wp, n, k, sp, bp, yp, n, m0, m1, u0, u1);
        continue;
      }
#endif
      tile_portable(xp, k, wp, n, k, sp, bp, yp, n, m0, m1, u0, u1);
    }
  });
  return y;
}

}  // namespace moeserve_dense_int8

TORCH_LIBRARY_FRAGMENT(moeserve, m) {
  m.def("linear_interleaved_int8(Tensor x, Tensor packed, Tensor scale, int n, Tensor? bias, bool force_portable=False)"
        " -> Tensor",
        &moeserve_dense_int8::linear_interleaved_int8);
}
