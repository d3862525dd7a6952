// The canonical int8 dot: an int8 row (codes, int8_codes.h) times bf16 inputs is the canonical bf16 dot
// (canonical_dot.h) of the codes' values as bf16 (exact: |q| <= 127) with the inputs, so it has the same bits
// on every ISA and equals a bf16 row holding those values. Callers then apply the row's scale once, as the
// AVX512-BF16 path always did: dot * scale in fp32, or with a bias (the dense GEMV) fma(dot, scale, bias), one
// rounding (what g++ contracted the former `dot * scale + bias` to wherever FMA exists; written out so that a
// build without FMA rounds the same), then the op's own roundings.
//
// block4_dots_i8<MB>(blk, k, xs, res, pf): res[m][r] = dot(row r of a 4-row block of block codes, xs[m]) for
//   m < MB (1..4); pf > 0 fetches pf bytes ahead along the block's stream (its first pass, the one reading memory).
// row_dots_i8<MB>(w, k, xs, res, pf): res[m] = dot(plain row w of two's complement codes, xs[m]), m < MB (1..4).
// k % 32 == 0 in both. block4_reference / row_reference: the same through canonical_dot.h's scalar code, on any
// build (the ops' force_portable; the tests' in-process reference).
//
// Implementations, by the build's ISA:
// - AVX512-BF16 + VBMI: 64 codes -> 2 x 32 bf16 by table lookups (int8_codes.h), then vdpbf16ps.
// - AVX2 + FMA: the codes straight to the canonical AVX2 lane operands in fp32 (byte shuffles, int -> fp32), then
//   canonical_dot.h's FMAs under DAZ + FTZ: no bf16 in between.
// - anything else (scalar; AVX512-BF16 without VBMI; any ISA canonical_dot.h learns later): the codes decoded to
//   bf16 into a per-thread buffer in the bf16 layouts, then canonical_dot.h's block4_dots / row_dots on it.
// Plain rows on AVX512-BF16 convert 32 codes with cvtepi8 -> fp32 -> bf16 (exact) and use vdpbf16ps.
#pragma once

#include <cstdint>
#include <vector>

#include "canonical_dot.h"
#include "int8_codes.h"

#if defined(MOESERVE_HAVE_I8_DECODE)
#define MOESERVE_I8_BLOCKS_AVX512 1
#elif defined(MOESERVE_CANON_AVX2)
#define MOESERVE_I8_BLOCKS_AVX2 1
#else
#define MOESERVE_I8_BLOCKS_VIA_BF16 1
#endif

namespace moeserve_i8 {

// Which implementation the block dots of this build use (reported by the canonical_int8_isa op).
inline const char* implementation() {
#if defined(MOESERVE_I8_BLOCKS_AVX512)
  return "avx512bf16-vbmi";
#elif defined(MOESERVE_I8_BLOCKS_AVX2)
  return "avx2";
#else
  return moeserve_canon::implementation();  // decoded to bf16, then that ISA's canonical dots
#endif
}

// ------------------------------------------------------------------------------------------ the reference
template <int MB>
inline void block4_reference(const int8_t* blk, int64_t k, const uint16_t* const* xs, float (*res)[4]) {
  float lanes[MB][4][16] = {};
  uint16_t w[32];
  for (int64_t c = 0; c < k / 32; ++c)
    for (int r = 0; r < 4; ++r) {
      block_chunk_row_bf16(blk + c * 128, r, w);
      for (int m = 0; m < MB; ++m) moeserve_canon::chunk_scalar(lanes[m][r], w, xs[m] + c * 32);
    }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < 4; ++r) res[m][r] = moeserve_canon::halving_sum16(lanes[m][r]);
}

template <int MB>
inline void row_reference(const int8_t* w, int64_t k, const uint16_t* const* xs, float* res) {
  float lanes[MB][16] = {};
  uint16_t v[32];
  for (int64_t c = 0; c < k / 32; ++c) {
    for (int i = 0; i < 32; ++i) v[i] = plain_code_bf16(w[c * 32 + i]);
    for (int m = 0; m < MB; ++m) moeserve_canon::chunk_scalar(lanes[m], v, xs[m] + c * 32);
  }
  for (int m = 0; m < MB; ++m) res[m] = moeserve_canon::halving_sum16(lanes[m]);
}

// ------------------------------------------------------------------------------------------- block dots
#if defined(MOESERVE_I8_BLOCKS_AVX512)

template <int MB>
inline void block4_dots_i8(const int8_t* blk, int64_t k, const uint16_t* const* xs, float (*res)[4], int64_t pf) {
  const Lut lut = make_lut();
  __m512 acc[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_setzero_ps();
  const char* bytes = reinterpret_cast<const char*>(blk);
  for (int64_t c = 0; c < k / 32; ++c) {
    if (pf > 0)
      for (int l = 0; l < 2; ++l) _mm_prefetch(bytes + c * 128 + pf + 64 * l, _MM_HINT_T0);
    __m512bh w[4];
    decode_pair(blk + c * 128, lut, w[0], w[1]);
    decode_pair(blk + c * 128 + 64, lut, w[2], w[3]);
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(xs[m] + c * 32);
      for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], w[r], xv);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < 4; ++r) res[m][r] = _mm512_reduce_add_ps(acc[m][r]);
}

#elif defined(MOESERVE_I8_BLOCKS_AVX2)

// Up to 2 input rows at once (8 accumulators per row); the block's codes decoded once per pass.
template <int MB>
inline void block4_i8_avx2(const int8_t* blk, int64_t k, const uint16_t* const* xs, float (*res)[4], int64_t pf) {
  using namespace moeserve_canon;
  __m256 acc[4 * MB][2];  // pair 4 m + r: input m, row r
  const unsigned saved = enter_lane_mode();
  for (int i = 0; i < 4 * MB; ++i)
    for (int h = 0; h < 2; ++h) pin(acc[i][h] = _mm256_setzero_ps());
  const char* bytes = reinterpret_cast<const char*>(blk);
  for (int64_t c = 0; c < k / 32; ++c) {
    if (pf > 0)
      for (int l = 0; l < 2; ++l) _mm_prefetch(bytes + c * 128 + pf + 64 * l, _MM_HINT_T0);
    for (int h = 0; h < 2; ++h) {
      Pairs xv[MB];
      for (int m = 0; m < MB; ++m) xv[m] = load_pairs(xs[m] + c * 32 + 16 * h);
      for (int p = 0; p < 2; ++p) {
        Pairs first, second;
        decode_half_pair(blk + c * 128 + 64 * p + 32 * h, first, second);
        for (int m = 0; m < MB; ++m) {
          acc[4 * m + 2 * p][h] = pair_step(acc[4 * m + 2 * p][h], first, xv[m]);
          acc[4 * m + 2 * p + 1][h] = pair_step(acc[4 * m + 2 * p + 1][h], second, xv[m]);
        }
      }
    }
  }
  finish_lanes(acc, saved, &res[0][0]);
}

template <int MB>
inline void block4_dots_i8(const int8_t* blk, int64_t k, const uint16_t* const* xs, float (*res)[4], int64_t pf) {
  if constexpr (MB <= 2) {
    block4_i8_avx2<MB>(blk, k, xs, res, pf);
  } else {  // 3 or 4 rows: two passes, the second over the block the first left in L1/L2
    block4_i8_avx2<2>(blk, k, xs, res, pf);
    block4_i8_avx2<MB - 2>(blk, k, xs + 2, res + 2, 0);
  }
}

#else  // via bf16

// The block's codes as a bf16 block in the bf16 interleaved layout (chunk c of row r at c * 128 + 32 * r).
inline const uint16_t* block_as_bf16(const int8_t* blk, int64_t k) {
  static thread_local std::vector<uint16_t> buf;
  if (buf.size() < static_cast<size_t>(4 * k)) buf.resize(4 * k);
  for (int64_t c = 0; c < k / 32; ++c)
    for (int r = 0; r < 4; ++r) block_chunk_row_bf16(blk + c * 128, r, buf.data() + c * 128 + 32 * r);
  return buf.data();
}

template <int MB>
inline void block4_dots_i8(const int8_t* blk, int64_t k, const uint16_t* const* xs, float (*res)[4], int64_t) {
  moeserve_canon::block4_dots<MB>(block_as_bf16(blk, k), k, xs, res, 0);
}

#endif

// --------------------------------------------------------------------------------------------- row dots
#if defined(MOESERVE_CANON_AVX512)

template <int MB>
inline void row_dots_i8(const int8_t* w, int64_t k, const uint16_t* const* xs, float* res, int64_t pf) {
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t c = 0; c < k / 32; ++c) {
    if (pf > 0) _mm_prefetch(reinterpret_cast<const char*>(w + c * 32) + pf, _MM_HINT_T0);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c * 32))));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c * 32 + 16))));
    const __m512bh wv = _mm512_cvtne2ps_pbh(hi, lo);  // element i = code i (exact)
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_dpbf16_ps(acc[m], wv, (__m512bh)_mm512_loadu_si512(xs[m] + c * 32));
  }
  for (int m = 0; m < MB; ++m) res[m] = _mm512_reduce_add_ps(acc[m]);
}

#elif defined(MOESERVE_CANON_AVX2)

template <int MB>
inline void row_dots_i8(const int8_t* w, int64_t k, const uint16_t* const* xs, float* res, int64_t pf) {
  using namespace moeserve_canon;
  __m256 acc[MB][2];
  const unsigned saved = enter_lane_mode();
  for (int m = 0; m < MB; ++m)
    for (int h = 0; h < 2; ++h) pin(acc[m][h] = _mm256_setzero_ps());
  for (int64_t c = 0; c < k / 32; ++c) {
    if (pf > 0) _mm_prefetch(reinterpret_cast<const char*>(w + c * 32) + pf, _MM_HINT_T0);
    for (int h = 0; h < 2; ++h) {
      const Pairs wv = decode_plain_half(w + c * 32 + 16 * h);
      for (int m = 0; m < MB; ++m) acc[m][h] = pair_step(acc[m][h], wv, load_pairs(xs[m] + c * 32 + 16 * h));
    }
  }
  finish_lanes(acc, saved, res);
}

#else  // via bf16

template <int MB>
inline void row_dots_i8(const int8_t* w, int64_t k, const uint16_t* const* xs, float* res, int64_t) {
  static thread_local std::vector<uint16_t> buf;
  if (buf.size() < static_cast<size_t>(k)) buf.resize(k);
  for (int64_t i = 0; i < k; ++i) buf[i] = plain_code_bf16(w[i]);
  moeserve_canon::row_dots<MB>(buf.data(), k, xs, res);
}

#endif

}  // namespace moeserve_i8
