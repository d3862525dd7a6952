// The numeric core of the dense GEMV (dense_gemv.cpp: layout, order and speed notes there) as plain C++ without
// ATen: linear_interleaved runs it on threads, and the aarch64 harness (tests/kernels/harness/) builds it alone, for
// any ISA, to check its bits against the x86 builds under qemu.
#pragma once

#include <algorithm>
#include <cstdint>

#include "bf16_bits.h"
#include "canonical_dot.h"

namespace moeserve_dense {

using moeserve_csrc::bf16_bits;

constexpr int64_t kRowTile = 32;  // input rows per pass over the weight
// The first pass over a block fetches the next block (4 rows of 1024 = 8 KiB ahead) by hand: the hardware
// prefetcher alone falls behind. Measured 14 -> 16-19 GB/s at 8 rows; at 1 row, on the 2-core EPYC of
// 2026-11-23 (scripts/bench_gemv.py, variants alternated, 3 rounds): 28-33 -> 37-52 GB/s (an older measurement
// on another day had it cost at 1 row; distances of 1-8 KiB were within noise of each other).
constexpr int64_t kPrefetchBytes = 8192;

inline float finish(float dot, const float* bias, int64_t n) { return bias != nullptr ? dot + bias[n] : dot; }

// Block b of 4 output rows against MB input rows (x, row stride xs).
template <int MB>
inline void blocks4(const uint16_t* x, int64_t xs, const uint16_t* wp, int64_t k, const float* bias, uint16_t* y,
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
inline void plain_rows(const uint16_t* x, int64_t xs, const uint16_t* w, int64_t k, const float* bias, uint16_t* y,
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
inline void tile(const uint16_t* x, int64_t xs, const uint16_t* wp, int64_t n, int64_t k, const float* bias,
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

// Input rows [0, m) against output blocks [u0, u1) (the leftover rows count as block n / 4), kRowTile rows per pass
// over the weight: what one thread of linear_interleaved computes. x [m, k], y [m, n], bias [n] fp32 or null.
inline void gemv_rows(const uint16_t* x, const uint16_t* wp, int64_t m, int64_t n, int64_t k, const float* bias,
                      uint16_t* y, int64_t u0, int64_t u1) {
  for (int64_t m0 = 0; m0 < m; m0 += kRowTile) tile(x, k, wp, n, k, bias, y, n, m0, std::min(m, m0 + kRowTile), u0, u1);
}

}  // namespace moeserve_dense
