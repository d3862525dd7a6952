// The project's ONE per-row reduction order for bf16 dot products (the dense GEMV, dense_gemv.cpp, and the
// row-interleaved bf16 expert op, moe_experts.cpp): the order AVX512-BF16 computes them in, stated so that every
// ISA gives the same bits. For a row w and an input x of K = 32 * C elements (bf16):
//
//   16 fp32 lanes, all +0; lane i owns elements 2i and 2i + 1 of every 32-element chunk.
//   for each chunk c = 0 .. C-1, in order, and each lane i (Intel's VDPBF16PS pseudo-code, odd element first):
//       lane[i] = F(w[32c + 2i + 1], x[32c + 2i + 1], lane[i])
//       lane[i] = F(w[32c + 2i],     x[32c + 2i],     lane[i])
//     F(a, b, acc) = acc + a * b as VDPBF16PS does it, whatever MXCSR holds: a bf16 with a zero exponent (a
//     denormal) reads as a zero of its sign (DAZ); the exact a * b + acc is rounded ONCE to fp32, nearest-even;
//     a result whose magnitude, rounded with an unbounded exponent, is below 2^-126 becomes a zero of its sign
//     (FTZ, tininess after rounding, as x86 detects it). The lanes are therefore never denormal.
//   then the fixed halving sum of GCC's _mm512_reduce_add_ps (avx512fintrin.h), in plain fp32 adds (the caller's
//   MXCSR, like any other fp32 code): s8[i] = lane[i+8] + lane[i], s4[i] = s8[i+4] + s8[i],
//   s2[i] = s4[i] + s4[i+2], dot = s2[0] + s2[1].
//
// Callers then add their bias (fp32) and round once to bf16 (NaN -> the one quiet NaN, so NaN payloads, the only
// thing the operand order of an add could change, never reach an output).
//
// Implementations, chosen at compile time by the build's ISA (kernels/__init__.py: native, avx2, generic):
// - AVX512-BF16: vdpbf16ps does F on 16 lanes, 32 elements per instruction.
// - AVX2 + FMA: the 16 lanes in two __m256 (lanes 0-7: the chunk's first 16 elements, 8-15: the next 16), bf16
//   -> fp32 by a mask (odd elements: the high halves of the 32-bit words) and a shift (even ones). F is
//   vfmadd (one rounding) under MXCSR DAZ + FTZ + round-to-nearest, set around the lane loop and restored before
//   the halving sum: x86's FTZ is the same flush (after rounding) and DAZ the same zeroing (bf16 denormals are
//   fp32 denormals; the lanes never are). Checked against vdpbf16ps on edge inputs (tests/kernels/
//   test_canonical_isa.py). A product of two bf16 is exact in fp32 only when it is normal: a mul then add
//   would round a denormal product first, so the FMA is needed.
// - scalar (any CPU, the reference): F in double (the product of two 8-bit significands is exact, the sum rounded
//   once to 53 bits, then to 24: correct, as 53 >= 2 * 24 + 2), the flush decided on the value rounded with an
//   unbounded exponent (scaled by 2^100 into the normal range). Independent of the FP environment.
// - NEON (every aarch64 build: Advanced SIMD is part of armv8-a): the 16 lanes as four float32x4 (quad j: the
//   chunk's elements 8j .. 8j + 7), bf16 -> fp32 by the same mask and shift, F as vfmaq_f32 (FMLA: one rounding)
//   under FPCR.FZ = 1, round to nearest, AH = FIZ = 0. FZ zeroes denormal inputs exactly as DAZ does, but flushes a
//   result whose EXACT value is below 2^-126 (tininess before rounding, ARM ARM FPRoundBase), where x86 flushes
//   on the value rounded with an unbounded exponent: an exact value in [2^-126 (1 - 2^-25), 2^-126) is 2^-126
//   on x86 and 0 under FZ. Every such flush sets FPSR.UFC (FPRoundBase again; no other result under FZ does: an
//   exact value of at least 2^-126 rounds as on x86, an exact zero is no underflow), so the lane loop clears
//   FPSR.UFC, runs, and where UFC came up, redoes those rows with the scalar reference: the same bits, a slow path
//   only where an FMA's exact result fell below 2^-126 (never in real weights and activations). FEAT_AFP's
//   FPCR.AH = 1 would flush after rounding as x86 does, but also changes input flushing and NaN rules and is not
//   on every ARM CPU: not used. With FEAT_BF16 (__ARM_FEATURE_BF16_VECTOR_ARITHMETIC: -mcpu=native on Graviton 3/4,
//   Grace, Apple M2+), BFMLALT then BFMLALB do the two F of a quad directly from the bf16 vectors: each is a
//   widening FMA "without intermediate rounding", under FPCR and recorded in FPSR like FMLA (ARM ARM C3.8.29.1),
//   so the same bits with no shifts. BFDOT and BFMMLA may NOT be used: they add the two products of a pair (and
//   BFMMLA four) before the accumulator, rounding to odd with FPCR ignored unless FEAT_EBF16's FPCR.EBF is set,
//   and even then as one fused pair sum, not the two sequential FMAs of the canonical order.
//   Checked under qemu-aarch64 against the x86 builds (tests/kernels/test_aarch64_qemu.py); not timed on ARM
//   hardware.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "bf16_bits.h"

// MOESERVE_CANON_FORCE_SCALAR (tests: the reference on any CPU) overrides the ISA's choice.
#if defined(MOESERVE_CANON_FORCE_SCALAR)
#define MOESERVE_CANON_SCALAR 1
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define MOESERVE_CANON_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define MOESERVE_CANON_AVX2 1
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define MOESERVE_CANON_NEON 1
#else
#define MOESERVE_CANON_SCALAR 1
#endif

#if defined(MOESERVE_CANON_AVX512) || defined(MOESERVE_CANON_AVX2)
#include <immintrin.h>
#elif defined(MOESERVE_CANON_NEON)
#include <arm_neon.h>
#endif

namespace moeserve_canon {

// Which implementation this translation unit compiled (reported by the canonical_dot_isa op).
inline const char* implementation() {
#if defined(MOESERVE_CANON_AVX512)
  return "avx512bf16";
#elif defined(MOESERVE_CANON_AVX2)
  return "avx2";
#elif defined(MOESERVE_CANON_NEON) && defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)
  return "neon-bf16";
#elif defined(MOESERVE_CANON_NEON)
  return "neon";
#else
  return "scalar";
#endif
}

// ------------------------------------------------------------------------------------------- scalar reference
using moeserve_csrc::bits_to_f;

// bf16 -> fp32 with DAZ: a zero exponent reads as a zero of the same sign.
inline float daz_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  return bits_to_f((b & 0x7F80u) == 0 ? (u & 0x80000000u) : u);
}

// F(a, b, acc) of the header comment, a and b already through daz_bf16, acc never denormal.
inline float fma_ftz(float a, float b, float acc) {
  const double s = static_cast<double>(acc) + static_cast<double>(a) * static_cast<double>(b);
  if (!(s < 0x1p-126 && s > -0x1p-126)) return static_cast<float>(s);  // normal (or inf / NaN): one rounding
  // |s| < 2^-126: the fp32 rounding with an unbounded exponent, in the normal range once scaled by 2^100
  const float scaled = static_cast<float>(s * 0x1p100);
  if (scaled < 0x1p-26f && scaled > -0x1p-26f) return std::signbit(s) ? -0.0f : 0.0f;  // flushed (or zero)
  return s < 0 ? -0x1p-126f : 0x1p-126f;  // rounded up to the smallest normal
}

// The halving sum (destroys l[0..7]).
inline float halving_sum16(float* l) {
  for (int i = 0; i < 8; ++i) l[i] = l[i + 8] + l[i];
  for (int i = 0; i < 4; ++i) l[i] = l[i + 4] + l[i];
  for (int i = 0; i < 2; ++i) l[i] = l[i] + l[i + 2];
  return l[0] + l[1];
}

// One 32-element chunk into the 16 lanes.
inline void chunk_scalar(float* lanes, const uint16_t* w, const uint16_t* x) {
  for (int i = 0; i < 16; ++i) {
    lanes[i] = fma_ftz(daz_bf16(w[2 * i + 1]), daz_bf16(x[2 * i + 1]), lanes[i]);
    lanes[i] = fma_ftz(daz_bf16(w[2 * i]), daz_bf16(x[2 * i]), lanes[i]);
  }
}

// The canonical dot of a row w with x [k], k % 32 == 0, the row's chunk c at w + c * stride (32: a plain row, 128:
// a row of a 4-row block): the reference every path must equal.
inline float dot_scalar(const uint16_t* w, const uint16_t* x, int64_t k, int64_t stride = 32) {
  float lanes[16] = {};
  for (int64_t c = 0; c < k / 32; ++c) chunk_scalar(lanes, w + stride * c, x + 32 * c);
  return halving_sum16(lanes);
}


// ------------------------------------------------------------------------------------------ the kernels
// block4_dots<MB>(blk, k, xs, res, pf): res[m][r] = dot(row r of a 4-row block in the row-interleaved layout
//   (chunk c of row r at blk + c * 128 + 32 * r, see dense_gemv.cpp), xs[m]) for m < MB (1..4); pf > 0 fetches
//   pf bytes ahead along the block's stream by hand (the first pass over a block, the one reading memory).
// row_dots<MB>(w, k, xs, res, pf): res[m] = dot(plain row w, xs[m]) for m < MB (1..4); pf > 0 fetches pf bytes
//   ahead along the row by hand (the plain-layout expert op: one row, one stream).
// k % 32 == 0 in both.

#if defined(MOESERVE_CANON_AVX512)

template <int MB>
inline void block4_dots(const uint16_t* blk, int64_t k, const uint16_t* const* xs, float (*res)[4], int64_t pf) {
  __m512 acc[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_setzero_ps();
  const char* bytes = reinterpret_cast<const char*>(blk);
  for (int64_t c = 0; c < k / 32; ++c) {
    if (pf > 0)
      for (int l = 0; l < 4; ++l) _mm_prefetch(bytes + c * 256 + pf + 64 * l, _MM_HINT_T0);
    __m512bh w[4];
    for (int r = 0; r < 4; ++r) w[r] = (__m512bh)_mm512_loadu_si512(blk + c * 128 + 32 * r);
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(xs[m] + c * 32);
      for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], w[r], xv);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < 4; ++r) res[m][r] = _mm512_reduce_add_ps(acc[m][r]);
}

template <int MB>
inline void row_dots(const uint16_t* w, int64_t k, const uint16_t* const* xs, float* res, int64_t pf = 0) {
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t c = 0; c < k / 32; ++c) {
    if (pf > 0) _mm_prefetch(reinterpret_cast<const char*>(w + c * 32) + pf, _MM_HINT_T0);
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + c * 32);
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_dpbf16_ps(acc[m], wv, (__m512bh)_mm512_loadu_si512(xs[m] + c * 32));
  }
  for (int m = 0; m < MB; ++m) res[m] = _mm512_reduce_add_ps(acc[m]);
}

#elif defined(MOESERVE_CANON_AVX2)

// MXCSR for the lane FMAs: DAZ (bit 6), FTZ (bit 15), round to nearest (bits 13-14 clear); returns the caller's.
inline unsigned enter_lane_mode() {
  const unsigned saved = _mm_getcsr();
  _mm_setcsr((saved & ~0x6000u) | 0x8040u);
  return saved;
}

// Pins v between two MXCSR writes: the compiler may not move the FMAs that make or use it across them.
inline void pin(__m256& v) { asm volatile("" : "+x"(v)); }

// The 16 bf16 at p as (odd elements, even elements) in fp32: lane j of each holds elements 2j + 1 and 2j.
struct Pairs {
  __m256 odd, even;
};
inline Pairs load_pairs(const uint16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)))),
          _mm256_castsi256_ps(_mm256_slli_epi32(v, 16))};
}

// acc = F(w odd, x odd, acc) then F(w even, x even, acc): lanes of one half-chunk.
inline __m256 pair_step(__m256 acc, const Pairs& w, const Pairs& x) {
  return _mm256_fmadd_ps(w.even, x.even, _mm256_fmadd_ps(w.odd, x.odd, acc));
}

// _mm512_reduce_add_ps's tree on lanes 0-7 (lo) and 8-15 (hi).
inline float halving_sum(__m256 lo, __m256 hi) {
  const __m256 t3 = _mm256_add_ps(hi, lo);
  const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(_mm_add_ss(t8, _mm_shuffle_ps(t8, t8, 1)));
}

// The end of every AVX2 lane loop (here, canonical_int8.h, q4_codes.cpp): pins the N accumulator pairs (pair i:
// lanes 0-7 and 8-15 of result i) where the FMAs left them, restores the caller's MXCSR `saved` (the halving sums
// run in the caller's mode, as after vdpbf16ps), then res[i] = the halving sum of pair i.
template <int N>
inline void finish_lanes(__m256 (&acc)[N][2], unsigned saved, float* res) {
  for (int i = 0; i < N; ++i)
    for (int h = 0; h < 2; ++h) pin(acc[i][h]);
  _mm_setcsr(saved);
  for (int i = 0; i < N; ++i) {
    pin(acc[i][0]);
    pin(acc[i][1]);
    res[i] = halving_sum(acc[i][0], acc[i][1]);
  }
}

// Up to 2 input rows at once: 8 * MB accumulators, the x pairs of a chunk in registers (16 ymm at MB = 1).
template <int MB>
inline void block4_avx2(const uint16_t* blk, int64_t k, const uint16_t* const* xs, float (*res)[4], int64_t pf) {
  __m256 acc[4 * MB][2];  // pair 4 m + r: input m, row r
  const unsigned saved = enter_lane_mode();
  for (int i = 0; i < 4 * MB; ++i)
    for (int h = 0; h < 2; ++h) pin(acc[i][h] = _mm256_setzero_ps());
  const char* bytes = reinterpret_cast<const char*>(blk);
  for (int64_t c = 0; c < k / 32; ++c) {
    if (pf > 0)
      for (int l = 0; l < 4; ++l) _mm_prefetch(bytes + c * 256 + pf + 64 * l, _MM_HINT_T0);
    Pairs xv[MB][2];
    for (int m = 0; m < MB; ++m)
      for (int h = 0; h < 2; ++h) xv[m][h] = load_pairs(xs[m] + c * 32 + 16 * h);
    for (int r = 0; r < 4; ++r)
      for (int h = 0; h < 2; ++h) {
        const Pairs wv = load_pairs(blk + c * 128 + 32 * r + 16 * h);
        for (int m = 0; m < MB; ++m) acc[4 * m + r][h] = pair_step(acc[4 * m + r][h], wv, xv[m][h]);
      }
  }
  finish_lanes(acc, saved, &res[0][0]);
}

template <int MB>
inline void block4_dots(const uint16_t* blk, int64_t k, const uint16_t* const* xs, float (*res)[4], int64_t pf) {
  if constexpr (MB <= 2) {
    block4_avx2<MB>(blk, k, xs, res, pf);
  } else {  // 3 or 4 rows: two passes, the second over the block the first left in L1/L2
    block4_avx2<2>(blk, k, xs, res, pf);
    block4_avx2<MB - 2>(blk, k, xs + 2, res + 2, 0);
  }
}

template <int MB>
inline void row_dots(const uint16_t* w, int64_t k, const uint16_t* const* xs, float* res, int64_t pf = 0) {
  __m256 acc[MB][2];
  const unsigned saved = enter_lane_mode();
  for (int m = 0; m < MB; ++m)
    for (int h = 0; h < 2; ++h) pin(acc[m][h] = _mm256_setzero_ps());
  for (int64_t c = 0; c < k / 32; ++c) {
    if (pf > 0) _mm_prefetch(reinterpret_cast<const char*>(w + c * 32) + pf, _MM_HINT_T0);
    for (int h = 0; h < 2; ++h) {
      const Pairs wv = load_pairs(w + c * 32 + 16 * h);
      for (int m = 0; m < MB; ++m) acc[m][h] = pair_step(acc[m][h], wv, load_pairs(xs[m] + c * 32 + 16 * h));
    }
  }
  finish_lanes(acc, saved, res);
}

#elif defined(MOESERVE_CANON_NEON)

// FPCR for the lane FMAs: FZ (bit 24) set; RMode (bits 22-23) round to nearest; AH and FIZ (bits 1, 0, FEAT_AFP;
// RES0 without it) clear. FPSR cleared, so that UFC (bit 3) afterwards tells whether any lane result was flushed.
struct LaneMode {
  uint64_t fpcr, fpsr;  // the caller's
};
inline LaneMode enter_lane_mode() {
  LaneMode saved;
  asm volatile("mrs %0, fpcr" : "=r"(saved.fpcr));
  asm volatile("mrs %0, fpsr" : "=r"(saved.fpsr));
  asm volatile("msr fpcr, %0" : : "r"((saved.fpcr & ~((3ull << 22) | 3ull)) | (1ull << 24)));
  asm volatile("msr fpsr, %0" : : "r"(0ull));
  return saved;
}
// Restores the caller's FPCR and FPSR; true when a lane result was flushed (FPSR.UFC).
inline bool leave_lane_mode(const LaneMode& saved) {
  uint64_t fpsr;
  asm volatile("mrs %0, fpsr" : "=r"(fpsr));
  asm volatile("msr fpcr, %0" : : "r"(saved.fpcr));
  asm volatile("msr fpsr, %0" : : "r"(saved.fpsr));
#if defined(MOESERVE_CANON_TEST_IGNORE_UFC)  // the negative control of tests/kernels/test_aarch64_qemu.py only
  return false;
#else
  return (fpsr & 8u) != 0;
#endif
}

// Pins v between two system register accesses: the compiler may not move the FMAs that make or use it across them.
inline void pin(float32x4_t& v) { asm volatile("" : "+w"(v)); }

// The 8 bf16 at p as fp32 (odd elements, even elements): lane j of each holds elements 2j + 1 and 2j.
inline float32x4_t odd_of(uint16x8_t v) {
  return vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_u16(v), vdupq_n_u32(0xFFFF0000u)));
}
inline float32x4_t even_of(uint16x8_t v) { return vreinterpretq_f32_u32(vshlq_n_u32(vreinterpretq_u32_u16(v), 16)); }

// acc = F(w odd, x odd, acc) then F(w even, x even, acc) on one quad: lanes 4j .. 4j + 3 of a chunk.
inline float32x4_t quad_step(float32x4_t acc, uint16x8_t w, uint16x8_t x) {
#if defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)
  const bfloat16x8_t wb = vreinterpretq_bf16_u16(w), xb = vreinterpretq_bf16_u16(x);
  return vbfmlalbq_f32(vbfmlaltq_f32(acc, wb, xb), wb, xb);  // BFMLALT (odd), then BFMLALB (even)
#else
  return vfmaq_f32(vfmaq_f32(acc, odd_of(w), odd_of(x)), even_of(w), even_of(x));
#endif
}

// _mm512_reduce_add_ps's tree on the four quads (lanes 0-3, 4-7, 8-11, 12-15).
inline float halving_sum(const float32x4_t* q) {
  const float32x4_t s4 = vaddq_f32(vaddq_f32(q[3], q[1]), vaddq_f32(q[2], q[0]));  // s8[i + 4] + s8[i]
  const float32x2_t s2 = vadd_f32(vget_low_f32(s4), vget_high_f32(s4));          // s4[i] + s4[i + 2]
  return vget_lane_f32(s2, 0) + vget_lane_f32(s2, 1);
}

// R rows against MB input rows: row r's chunk c at base + c * stride + 32 * r (a 4-row block: R = 4, stride 128; a
// plain row: R = 1, stride 32); res[m * R + r] = the canonical dot of row r with xs[m]. One input row per pass
// (16 accumulators and x's chunk in registers; later passes read the rows from L1), one FPCR switch per call: an
// FPCR write may wait for the FP pipeline on some cores. If any lane flushed, every dot of the call is redone in
// scalar. The halving sums run after the caller's FPCR is back, as on x86. GCC 12's scheduler before register
// allocation hoists all 16 weight loads of a chunk and then spills 6 accumulators (12 stack accesses per chunk in
// the -O3 loop, counted in the generated code); without that pass, none. Not timed: no ARM hardware here.
template <int R, int MB>
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("no-schedule-insns")))
#endif
inline void rows_neon(const uint16_t* base, int64_t stride, int64_t k, const uint16_t* const* xs, float* res, int64_t pf) {
  float32x4_t lanes[MB][R][4];
  const LaneMode saved = enter_lane_mode();
  const char* bytes = reinterpret_cast<const char*>(base);
  for (int m = 0; m < MB; ++m) {
    float32x4_t acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) pin(acc[r][j] = vdupq_n_f32(0.0f));
    const uint16_t* x = xs[m];
    for (int64_t c = 0; c < k / 32; ++c) {
      if (pf > 0 && m == 0)  // the first pass is the one reading memory
        for (int64_t l = 0; l < 2 * stride; l += 64) __builtin_prefetch(bytes + c * 2 * stride + pf + l, 0, 3);
      uint16x8_t xv[4];
      for (int j = 0; j < 4; ++j) xv[j] = vld1q_u16(x + 32 * c + 8 * j);
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < 4; ++j) acc[r][j] = quad_step(acc[r][j], vld1q_u16(base + c * stride + 32 * r + 8 * j), xv[j]);
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) pin(lanes[m][r][j] = acc[r][j]);
  }
  const bool flushed = leave_lane_mode(saved);
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < 4; ++j) pin(lanes[m][r][j]);
      res[m * R + r] = flushed ? dot_scalar(base + 32 * r, xs[m], k, stride) : halving_sum(lanes[m][r]);
    }
}

template <int MB>
inline void block4_dots(const uint16_t* blk, int64_t k, const uint16_t* const* xs, float (*res)[4], int64_t pf) {
  rows_neon<4, MB>(blk, 128, k, xs, &res[0][0], pf);
}

template <int MB>
inline void row_dots(const uint16_t* w, int64_t k, const uint16_t* const* xs, float* res, int64_t pf = 0) {
  rows_neon<1, MB>(w, 32, k, xs, res, pf);
}

#else  // scalar

template <int MB>
inline void block4_dots(const uint16_t* blk, int64_t k, const uint16_t* const* xs, float (*res)[4], int64_t) {
  float lanes[MB][4][16] = {};
  for (int64_t c = 0; c < k / 32; ++c)  // chunk after chunk: the block read as one stream
    for (int r = 0; r < 4; ++r)
      for (int m = 0; m < MB; ++m) chunk_scalar(lanes[m][r], blk + c * 128 + 32 * r, xs[m] + c * 32);
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < 4; ++r) res[m][r] = halving_sum16(lanes[m][r]);
}

template <int MB>
inline void row_dots(const uint16_t* w, int64_t k, const uint16_t* const* xs, float* res, int64_t = 0) {
  for (int m = 0; m < MB; ++m) res[m] = dot_scalar(w, xs[m], k);
}

#endif

}  // namespace moeserve_canon
