// INT4 weights times int8-quantized activations (`fmt=int4-q8`, quantization="int4"'s experts): integer dot products
// per 32-element block, as llama.cpp computes Q4_0 x Q8_0, in ONE stated order, so every ISA gives the same bits.
// Plain C++ (no ATen): the numeric core builds without torch (standalone harnesses).
//
// Weights: a row of K int4 codes n (element 2j in the low nibble of byte j; value n - 8) and one bf16 scale s_w per
// block of 32 elements (compressed-tensors' pack-quantized INT4, group 32: quantization="int4"'s units).
//
// Activations, per input row x (bf16 [K]) and block b of 32 elements (plain scalar code on every ISA: IEEE
// operations only, so a vectorising compiler cannot change a bit):
//   amax = max |x_i| (NaN if any x_i is NaN);  d_x = amax / 127 (fp32);
//   inv = 127 / amax if 2^-100 <= amax <= FLT_MAX, else 0;  q_i = inv != 0 ? nearbyint(x_i * inv) : 0 (fp32
//   multiply, round half to even: |q_i| <= 127). A block of zeros has d_x = 0; a NaN or an infinity makes
//   d_x NaN or infinite and every q_i 0, so the rows' results are NaN.
//
// The dot of weight row w with x: K padded with zeros to a multiple of 64 (a padded block: codes 8, q 0, both
// scales 0), 16 fp32 lanes, all +0, over spans of 64 elements (blocks A = 2s, B = 2s + 1) in order:
//   lane l = 4h + j + 8p (h: 0 block A, 1 block B; p: 0 even, 1 odd elements; j < 4) owns the 4 elements
//   32h + 2 (4j + i) + p, i < 4, of the span; its integer sum
//     isum_l = sum_i (n_e - 8) q_e                   (exact, |isum| < 2^12)
//   and its block's scale d_l = fp32(s_w * d_x) (one fp32 multiply: bf16 s_w as fp32), then
//     lane[l] = fma(float(isum_l), d_l, lane[l])     (one rounding, IEEE: fmaf)
//   and canonical_dot.h's halving sum of the 16 lanes. The result depends on the row and its own input only
// (batch-invariant). Why this order: the lanes are exactly what one vpdpbusd of a span's 64 nibbles, unpacked as
// [low nibbles of the span's 32 code bytes | high nibbles], against the activations arranged the same way gives.
//
// Activations are stored per span (kSpanBytes): q in that byte order [64 int8], corr [16 int32] = -8 * the sum of
// lane l's 4 q (so isum = corr + sum n q: vpdpbusd's unsigned x signed bytes), d_x per lane [16 fp32].
//
// Implementations, by the build's ISA: AVX-512 VNNI (vpdpbusd on 64 nibbles per row and span), AVX2 (vpmaddubsw then
// vpmaddwd on each half: the same int32 lanes, no saturation as 15 * 127 * 2 < 2^15), NEON with the dot product
// extension (__ARM_FEATURE_DOTPROD: -mcpu=native on Graviton 2+, Grace, Apple M1+; SDOT, 4 lanes of 4 products per
// instruction), NEON without it (any aarch64: SMULL, then ADDP and SADALP summing each lane's 4 products), scalar (the
// reference, any CPU; MOESERVE_Q8_FORCE_SCALAR forces it). Integer sums are exact and the fp32 operations IEEE under
// the caller's FP mode on every path, so the ISAs agree bit for bit (x86 levels and aarch64 under qemu: tests/kernels/
// test_aarch64_qemu.py); the NEON paths are not timed on ARM hardware.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#if (defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)) && !defined(MOESERVE_Q8_FORCE_SCALAR)
#define MOESERVE_Q8_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && !defined(MOESERVE_Q8_FORCE_SCALAR)
#define MOESERVE_Q8_AVX2 1
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_NEON) && !defined(MOESERVE_Q8_FORCE_SCALAR)
#define MOESERVE_Q8_NEON 1
#include <arm_neon.h>
#else
#define MOESERVE_Q8_SCALAR 1
#endif

namespace moeserve_q8 {

constexpr int64_t kSpan = 64;                           // elements per span
constexpr int64_t kSpanBytes = 64 + 16 * 4 + 16 * 4;    // q, corr, d_x lanes
inline int64_t spans(int64_t k) { return (k + kSpan - 1) / kSpan; }
inline int64_t row_bytes(int64_t k) { return spans(k) * kSpanBytes; }

inline const char* implementation() {
#if defined(MOESERVE_Q8_AVX512)
  return "avx512vnni";
#elif defined(MOESERVE_Q8_AVX2)
  return "avx2";
#elif defined(MOESERVE_Q8_NEON) && defined(__ARM_FEATURE_DOTPROD)
  return "neon-dotprod";
#elif defined(MOESERVE_Q8_NEON)
  return "neon";
#else
  return "scalar";
#endif
}

inline float bf16_value(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// x (bf16 [k], k % 32 == 0) -> out [row_bytes(k)], the layout above.
inline void quantize_row(const uint16_t* x, int64_t k, uint8_t* out) {
  for (int64_t s = 0; s < spans(k); ++s) {
    int8_t q[64] = {};
    int32_t corr[16];
    float dx[16];
    for (int h = 0; h < 2; ++h) {
      const int64_t b0 = s * kSpan + 32 * h;
      float d = 0.0f;
      if (b0 < k) {
        float amax = 0.0f;
        bool nan = false;
        for (int i = 0; i < 32; ++i) {
          const float a = std::fabs(bf16_value(x[b0 + i]));
          nan = nan || std::isnan(a);
          amax = a > amax ? a : amax;
        }
        if (nan) amax = std::nanf("");
        d = amax / 127.0f;
        const float inv = amax >= 0x1p-100f && amax <= FLT_MAX ? 127.0f / amax : 0.0f;
        for (int i = 0; i < 32; ++i)
          q[(i & 1) * 32 + h * 16 + (i >> 1)] =
              inv != 0.0f ? static_cast<int8_t>(std::nearbyint(bf16_value(x[b0 + i]) * inv)) : 0;
      }
      for (int j = 0; j < 4; ++j) dx[4 * h + j] = dx[8 + 4 * h + j] = d;
    }
    for (int l = 0; l < 16; ++l) corr[l] = -8 * (q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3]);
    uint8_t* sp = out + s * kSpanBytes;
    std::memcpy(sp, q, 64);
    std::memcpy(sp + 64, corr, 64);
    std::memcpy(sp + 128, dx, 64);
  }
}

// canonical_dot.h's halving sum (destroys l[0..7]).
inline float halving_sum16(float* l) {
  for (int i = 0; i < 8; ++i) l[i] = l[i + 8] + l[i];
  for (int i = 0; i < 4; ++i) l[i] = l[i + 4] + l[i];
  for (int i = 0; i < 2; ++i) l[i] = l[i] + l[i + 2];
  return l[0] + l[1];
}

// One row, the reference: codes (k / 2 bytes), scales (bf16 [k / 32]), a quantized input (quantize_row).
inline float dot_reference(const uint8_t* codes, const uint16_t* scales, int64_t k, const uint8_t* xq) {
  float lanes[16] = {};
  for (int64_t s = 0; s < spans(k); ++s) {
    const uint8_t* sp = xq + s * kSpanBytes;
    const auto* q = reinterpret_cast<const int8_t*>(sp);
    int32_t corr[16];
    float dx[16];
    std::memcpy(corr, sp + 64, 64);
    std::memcpy(dx, sp + 128, 64);
    const bool half = s * kSpan + 32 >= k;  // block B padded
    for (int l = 0; l < 16; ++l) {
      const int h = (l >> 2) & 1, p = l >> 3, j = l & 3;
      int32_t isum = corr[l];
      float sw = 0.0f;
      if (!(half && h == 1)) {
        for (int i = 0; i < 4; ++i) {
          const uint8_t byte = codes[s * 32 + h * 16 + 4 * j + i];
          isum += (p == 0 ? byte & 15 : byte >> 4) * q[p * 32 + h * 16 + 4 * j + i];
        }
        sw = bf16_value(scales[2 * s + h]);
      }
      lanes[l] = std::fma(static_cast<float>(isum), sw * dx[l], lanes[l]);
    }
  }
  return halving_sum16(lanes);
}

// Where the next block of 4 rows lies (rows contiguous: codes k / 2 bytes, scales k / 32 bf16 each), fetched by hand
// as the pass reads memory: 128 bytes of codes per span sweep its 2k bytes exactly, a line of scales while they last.
struct Next {
  const char* codes;
  const char* scales;
  int64_t scale_bytes;
  Next(const uint8_t* c, const uint16_t* s, int64_t k)
      : codes(reinterpret_cast<const char*>(c) + 2 * k), scales(reinterpret_cast<const char*>(s) + k / 4),
        scale_bytes(k / 4) {}
  void fetch(int64_t s) const {
    __builtin_prefetch(codes + 128 * s, 0, 3);
    __builtin_prefetch(codes + 128 * s + 64, 0, 3);
    if (64 * s < scale_bytes) __builtin_prefetch(scales + 64 * s, 0, 3);
  }
};

#if defined(MOESERVE_Q8_AVX512)

// dots4<MB>: res[m][r] = dot(row r, xq[m]) for 4 rows and MB (1..4) inputs; pf: fetch the next block.
template <int MB>
inline void dots4(const uint8_t* const* codes, const uint16_t* const* scales, int64_t k, const uint8_t* const* xq,
                  float (*res)[4], bool pf) {
  __m512 acc[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_setzero_ps();
  const Next next(codes[0], scales[0], k);
  const __m512i low = _mm512_set1_epi8(0x0F);
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const int64_t full = k / kSpan;
  for (int64_t s = 0; s < spans(k); ++s) {
    if (pf) next.fetch(s);
    const bool half = s == full;  // block B padded (k % 64 == 32)
    for (int r = 0; r < 4; ++r) {
      const __m256i c = half ? _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes[r] + 32 * s)))
                             : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes[r] + 32 * s));
      const __m512i w = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(c), _mm256_srli_epi16(c, 4), 1), low);
      uint32_t two;
      std::memcpy(&two, scales[r] + 2 * s, half ? 2 : 4);
      if (half) two &= 0xFFFFu;
      const __m512i b = _mm512_set1_epi32(static_cast<int>(two));
      // lanes of block A (0-3, 8-11): the low scale moved up; block B's: the high one in place
      const __m512 sw = _mm512_castsi512_ps(_mm512_mask_slli_epi32(_mm512_and_si512(b, hi_mask), 0x0F0F, b, 16));
      for (int m = 0; m < MB; ++m) {
        const uint8_t* sp = xq[m] + s * kSpanBytes;
        const __m512i isum = _mm512_dpbusd_epi32(_mm512_loadu_si512(sp + 64), w, _mm512_loadu_si512(sp));
        const __m512 d = _mm512_mul_ps(sw, _mm512_loadu_ps(reinterpret_cast<const float*>(sp + 128)));
        acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), d, acc[m][r]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < 4; ++r) res[m][r] = _mm512_reduce_add_ps(acc[m][r]);
}

#elif defined(MOESERVE_Q8_AVX2)

// Lanes 0-7 (low nibbles) and 8-15 (high nibbles) in two __m256: the same int32 lanes by vpmaddubsw + vpmaddwd.
template <int MB>
inline void dots4(const uint8_t* const* codes, const uint16_t* const* scales, int64_t k, const uint8_t* const* xq,
                  float (*res)[4], bool pf) {
  __m256 acc[MB][4][2];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < 4; ++r) acc[m][r][0] = acc[m][r][1] = _mm256_setzero_ps();
  const Next next(codes[0], scales[0], k);
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const int64_t full = k / kSpan;
  for (int64_t s = 0; s < spans(k); ++s) {
    if (pf) next.fetch(s);
    const bool half = s == full;
    for (int r = 0; r < 4; ++r) {
      const __m256i c = half ? _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes[r] + 32 * s)))
                             : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes[r] + 32 * s));
      const __m256i w[2] = {_mm256_and_si256(c, low), _mm256_and_si256(_mm256_srli_epi16(c, 4), low)};
      uint32_t two;
      std::memcpy(&two, scales[r] + 2 * s, half ? 2 : 4);
      if (half) two &= 0xFFFFu;
      const __m256i b = _mm256_set1_epi32(static_cast<int>(two));
      // lanes 0-3 (and 8-11) block A: the low scale moved up; 4-7 (and 12-15) block B: the high one in place
      const __m256 sw = _mm256_castsi256_ps(_mm256_blend_epi32(_mm256_slli_epi32(b, 16), _mm256_and_si256(b, hi_mask), 0xF0));
      for (int m = 0; m < MB; ++m) {
        const uint8_t* sp = xq[m] + s * kSpanBytes;
        for (int p = 0; p < 2; ++p) {
          const __m256i prod = _mm256_madd_epi16(
              _mm256_maddubs_epi16(w[p], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp + 32 * p))), ones);
          const __m256i isum = _mm256_add_epi32(prod, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sp + 64 + 32 * p)));
          const __m256 d = _mm256_mul_ps(sw, _mm256_loadu_ps(reinterpret_cast<const float*>(sp + 128 + 32 * p)));
          acc[m][r][p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), d, acc[m][r][p]);
        }
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < 4; ++r) {
      alignas(32) float lanes[16];
      _mm256_store_ps(lanes, acc[m][r][0]);
      _mm256_store_ps(lanes + 8, acc[m][r][1]);
      res[m][r] = halving_sum16(lanes);
    }
}

#elif defined(MOESERVE_Q8_NEON)

// Lanes 4j .. 4j + 3 of a span: isum = corr + the sums of 4 products of the quad's 16 code and q bytes (lane order).
inline int32x4_t quad_isum(int8x16_t w, int8x16_t q, int32x4_t corr) {
#if defined(__ARM_FEATURE_DOTPROD)
  return vdotq_s32(corr, w, q);  // SDOT
#else  // products of byte pairs summed (|sum| <= 2 * 15 * 127: no overflow), then pairs of those into corr
  return vpadalq_s16(corr, vpaddq_s16(vmull_s8(vget_low_s8(w), vget_low_s8(q)), vmull_high_s8(w, q)));
#endif
}

// One input per pass over the 4 rows (16 quads of accumulators; later passes read the rows from L1). The lanes'
// FMLA and FMUL run under the caller's FPCR, as the x86 paths under the caller's MXCSR.
template <int MB>
inline void dots4(const uint8_t* const* codes, const uint16_t* const* scales, int64_t k, const uint8_t* const* xq,
                  float (*res)[4], bool pf) {
  const Next next(codes[0], scales[0], k);
  const uint8x16_t low = vdupq_n_u8(0x0F);
  const int64_t full = k / kSpan;
  for (int m = 0; m < MB; ++m) {
    float32x4_t acc[4][4];
    for (auto& row : acc)
      for (auto& quad : row) quad = vdupq_n_f32(0.0f);
    for (int64_t s = 0; s < spans(k); ++s) {
      if (pf && m == 0) next.fetch(s);
      const bool half = s == full;  // block B padded: its codes read as 0, its scale 0
      const uint8_t* sp = xq[m] + s * kSpanBytes;
      int8x16_t q[4];
      int32x4_t corr[4];
      for (int j = 0; j < 4; ++j) {
        q[j] = vld1q_s8(reinterpret_cast<const int8_t*>(sp) + 16 * j);
        corr[j] = vld1q_s32(reinterpret_cast<const int32_t*>(sp + 64) + 4 * j);
      }
      float dx[16];
      std::memcpy(dx, sp + 128, 64);
      for (int r = 0; r < 4; ++r) {
        const uint8x16_t c0 = vld1q_u8(codes[r] + 32 * s), c1 = half ? vdupq_n_u8(0) : vld1q_u8(codes[r] + 32 * s + 16);
        // quads 0-3: low nibbles of block A, of block B, high nibbles of A, of B (lanes l = 4h + j + 8p)
        const uint8x16_t w[4] = {vandq_u8(c0, low), vandq_u8(c1, low), vshrq_n_u8(c0, 4), vshrq_n_u8(c1, 4)};
        const float sw[2] = {bf16_value(scales[r][2 * s]), half ? 0.0f : bf16_value(scales[r][2 * s + 1])};
        for (int j = 0; j < 4; ++j) {
          const float32x4_t d = vmulq_f32(vdupq_n_f32(sw[j & 1]), vld1q_f32(dx + 4 * j));
          acc[r][j] = vfmaq_f32(acc[r][j], vcvtq_f32_s32(quad_isum(vreinterpretq_s8_u8(w[j]), q[j], corr[j])), d);
        }
      }
    }
    for (int r = 0; r < 4; ++r) {
      float lanes[16];
      for (int j = 0; j < 4; ++j) vst1q_f32(lanes + 4 * j, acc[r][j]);
      res[m][r] = halving_sum16(lanes);
    }
  }
}

#else

template <int MB>
inline void dots4(const uint8_t* const* codes, const uint16_t* const* scales, int64_t k, const uint8_t* const* xq,
                  float (*res)[4], bool) {
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < 4; ++r) res[m][r] = dot_reference(codes[r], scales[r], k, xq[m]);
}

#endif

// res[m][r] = the dot of row r (of 4) with input m (< mb, 1..4).
inline void rows4_dots(const uint8_t* const* codes, const uint16_t* const* scales, int64_t k, const uint8_t* const* xq,
                       int mb, float (*res)[4], bool pf) {
  switch (mb) {
    case 1: dots4<1>(codes, scales, k, xq, res, pf); break;
    case 2: dots4<2>(codes, scales, k, xq, res, pf); break;
    case 3: dots4<3>(codes, scales, k, xq, res, pf); break;
    default: dots4<4>(codes, scales, k, xq, res, pf); break;
  }
}

}  // namespace moeserve_q8
