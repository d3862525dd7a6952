// 4-bit weight codes (MXFP4, NVFP4, compressed-tensors INT4) decoded in registers and fed to the canonical bf16 dot
// (canonical_dot.h), for the 4-bit expert op (moe_experts_q4.cpp).
//
// Every format stores a row of K weights as K/2 bytes, element 2j in the LOW nibble of byte j and 2j + 1 in the high
// one, and one scale per group of G elements along the row. What a weight IS, here, is exactly what the format's
// reference decoder (moeserve/formats/) writes into a bf16 buffer:
//   MXFP4 (G 32)   bf16(E2M1[n] * 2^(s - 127))                 exact: 2 significant bits, exponent in bf16's range
//   NVFP4 (G 16)   bf16(fp32(E2M1[n] * gs)), gs = fp32(fp8 scale) / global (compressed-tensors) or * global
//                  (ModelOpt), each an fp32 operation: two roundings, as the reference's fp32 product then its cast
//   INT4  (G any)  bf16(fp32((n - 8) * fp32(bf16 scale)))     the fp32 product is exact (4 x 8 bits), then one cast
// with bf16(.) torch's cast (nearest-even, NaN -> 0x7FC0; fp32 denormals rounded like normals). So a group's 16
// possible weights form a TABLE of 16 bf16 values, made from its scale alone, and decoding is a table lookup per
// nibble: the decoded weights are bf16 values, so the dot of a decoded row with an input row is canonical_dot.h's
// order on them, unchanged. (A decoded bf16 denormal then reads as zero, as in any canonical dot: a reference that
// dequantizes with the format's decoder and runs the stated order gets the same bits.)
//
// Tables: MXFP4's depend on the scale byte only (one [256][16] table for the process); NVFP4's on the scale byte and
// the tensor's global scale ([256][16] per weight, made per call); INT4's on a bf16 scale (made per row, before
// the row's dots, with the caller's floating-point environment: the AVX2 dots run under DAZ/FTZ).
//
// Decoding, per ISA (the same values: integer moves and table lookups only):
//   AVX512-BF16  32 nibbles -> 32 word indices, one vpermw over the two 16-entry tables of the chunk's halves
//   AVX2 + FMA   8 bytes -> the (odd, even) fp32 pairs of canonical_dot.h: two vpermps over each table half,
//                blended on the nibble's top bit
//   scalar       byte by byte into 32 bf16, then canonical_dot.h's chunk_scalar
#include <cmath>
#include <cstdint>
#include <cstring>

#include "canonical_dot.h"
#include "moe_experts_q4.h"

namespace moeserve_q4 {

namespace {

inline uint32_t f_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// torch's fp32 -> bf16 cast (c10::BFloat16): nearest-even on the bits, denormals included; any NaN -> 0x7FC0.
inline uint16_t bf16_rne(float f) {
  const uint32_t u = f_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// E2M1 code values (bit 3 the sign), as the references' table (formats/fp4.py).
inline float e2m1(int n) {
  static constexpr float kValues[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                                        -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  return kValues[n];
}

// FP8 E4M3 (fn: no infinities, 0x7F / 0xFF NaN) -> fp32, exact.
inline float fp8_e4m3(uint8_t b) {
  const int e = (b >> 3) & 0xF, m = b & 7;
  if (e == 0xF && m == 7) return std::nanf("");
  const float mag = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
  return (b & 0x80) ? -mag : mag;
}

}  // namespace

// MXFP4: table[s][n] = bf16(E2M1[n] * 2^(s - 127)), for every scale byte s. Computed as formats/mxfp4.py does it
// ((2 E2M1[n]) * 2^(s - 128): 2^(s - 127) overflows fp32 at s = 255) in double, exact, then cast.
const uint16_t* mxfp4_tables() {
  static const struct T {
    uint16_t v[256 * 16];
    T() {
      for (int s = 0; s < 256; ++s)
        for (int n = 0; n < 16; ++n)
          v[16 * s + n] = bf16_rne(static_cast<float>(std::ldexp(2.0 * e2m1(n), s - 128)));
    }
  } tables;
  return tables.v;
}

// NVFP4: out[s][n] = bf16(fp32(E2M1[n] * gs(s))), gs(s) = fp32(fp8(s)) / tensor_scale (divide) or * tensor_scale.
void nvfp4_tables(float tensor_scale, bool divide, uint16_t* out) {
  for (int s = 0; s < 256; ++s) {
    const float f = fp8_e4m3(static_cast<uint8_t>(s));
    const float gs = divide ? f / tensor_scale : f * tensor_scale;
    for (int n = 0; n < 16; ++n) out[16 * s + n] = bf16_rne(e2m1(n) * gs);
  }
}

// INT4: out[g][n] = bf16(fp32((n - 8) * scale[g])) for a row's `groups` bf16 scales.
void int4_tables(const uint16_t* scales, int64_t groups, uint16_t* out) {
  for (int64_t g = 0; g < groups; ++g) {
    uint32_t u = static_cast<uint32_t>(scales[g]) << 16;
    float s;
    std::memcpy(&s, &u, 4);
    for (int n = 0; n < 16; ++n) out[16 * g + n] = bf16_rne(static_cast<float>(n - 8) * s);
  }
}

namespace {

constexpr int64_t kPrefetch = 2048;  // bytes of codes fetched ahead by hand on the pass that reads memory

// decode_chunk_scalar(row, c, w): w[32] = the bf16 weights of chunk c (any ISA: the reference form).
inline void decode_chunk_scalar(const QRow& row, int64_t c, uint16_t* w) {
  const uint8_t* p = row.codes + 16 * c;
  const uint16_t* t[2] = {row.first(c), row.second(c)};
  for (int j = 0; j < 16; ++j) {
    w[2 * j] = t[j / 8][p[j] & 15];
    w[2 * j + 1] = t[j / 8][p[j] >> 4];
  }
}

// ----------------------------------------------------------------------------------------------- the kernels
// dots<MB>(row, k, xs, res, pf): res[m] = canonical dot of the decoded row with xs[m] (bf16 [k]), m < MB (1..4);
//   pf: fetch the codes ahead by hand (the pass that reads memory). k % 32 == 0.
// decode(row, k, w): w[k] = the decoded row (bf16), for canonical_dot.h's row_dots over many inputs.

#if defined(MOESERVE_CANON_AVX512)

// Chunk c's 32 weights: word 2j of the index is byte j's low nibble, word 2j + 1 its high nibble, plus 16 for the
// bytes 8..15 (their table is the upper half of the vpermw table).
inline __m512bh decode_chunk(const QRow& row, int64_t c) {
  const __m512i tabs = _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row.first(c)))),
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row.second(c))), 1);
  const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row.codes + 16 * c)));
  const __m512i half = _mm512_set_epi32(0x00100010, 0x00100010, 0x00100010, 0x00100010, 0x00100010, 0x00100010,
                                        0x00100010, 0x00100010, 0, 0, 0, 0, 0, 0, 0, 0);
  // (d | d << 12) & 0x000F000F: the two nibbles of byte j in the words of dword j
  const __m512i nib = _mm512_ternarylogic_epi32(d, _mm512_slli_epi32(d, 12), _mm512_set1_epi32(0x000F000F), 0xA8);
  return (__m512bh)_mm512_permutexvar_epi16(_mm512_or_si512(nib, half), tabs);
}

template <int MB>
inline void dots(const QRow& row, int64_t k, const uint16_t* const* xs, float* res, bool pf) {
  __m512 acc[MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t c = 0; c < k / 32; ++c) {
    if (pf && (c & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(row.codes + 16 * c + kPrefetch), _MM_HINT_T0);
    const __m512bh w = decode_chunk(row, c);
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_dpbf16_ps(acc[m], w, (__m512bh)_mm512_loadu_si512(xs[m] + 32 * c));
  }
  for (int m = 0; m < MB; ++m) res[m] = _mm512_reduce_add_ps(acc[m]);
}

inline void decode(const QRow& row, int64_t k, uint16_t* w) {
  for (int64_t c = 0; c < k / 32; ++c) _mm512_storeu_si512(w + 32 * c, (__m512i)decode_chunk(row, c));
}

#elif defined(MOESERVE_CANON_AVX2)

// A table's 16 bf16 as fp32: entries 0-7 and 8-15.
struct Table {
  __m256 lo, hi;
};
inline Table load_table(const uint16_t* t) {
  auto half = [](const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  };
  return {half(t), half(t + 8)};
}

// Bytes p[0..7] -> canonical_dot.h's pairs: lane j odd = the high nibble of byte j, even = the low one. vpermps
// reads an index's low 3 bits; blendv takes the upper half where the nibble's bit 3 (moved to bit 31) is set.
inline moeserve_canon::Pairs decode8(const uint8_t* p, const Table& t) {
  const __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i hi = _mm256_srli_epi32(d, 4);
  const __m256 odd = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t.lo, hi), _mm256_permutevar8x32_ps(t.hi, hi),
                                      _mm256_castsi256_ps(_mm256_slli_epi32(d, 24)));
  const __m256 even = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t.lo, d), _mm256_permutevar8x32_ps(t.hi, d),
                                       _mm256_castsi256_ps(_mm256_slli_epi32(d, 28)));
  return {odd, even};
}

// Only integer moves, lookups and blends before the FMAs: the lane mode's DAZ/FTZ cannot change a weight (a bf16
// denormal weight becomes an fp32 denormal, which DAZ reads as zero, as vdpbf16ps does).
template <int MB>
inline void dots(const QRow& row, int64_t k, const uint16_t* const* xs, float* res, bool pf) {
  using moeserve_canon::pin;
  __m256 acc[MB][2];
  const unsigned saved = moeserve_canon::enter_lane_mode();
  for (int m = 0; m < MB; ++m)
    for (int h = 0; h < 2; ++h) pin(acc[m][h] = _mm256_setzero_ps());
  for (int64_t c = 0; c < k / 32; ++c) {
    if (pf && (c & 3) == 0) _mm_prefetch(reinterpret_cast<const char*>(row.codes + 16 * c + kPrefetch), _MM_HINT_T0);
    const uint16_t* t0 = row.first(c);
    const uint16_t* t1 = row.second(c);
    const Table tab0 = load_table(t0);
    const Table tab1 = t1 == t0 ? tab0 : load_table(t1);
    for (int h = 0; h < 2; ++h) {
      const moeserve_canon::Pairs wv = decode8(row.codes + 16 * c + 8 * h, h == 0 ? tab0 : tab1);
      for (int m = 0; m < MB; ++m)
        acc[m][h] = moeserve_canon::pair_step(acc[m][h], wv, moeserve_canon::load_pairs(xs[m] + 32 * c + 16 * h));
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int h = 0; h < 2; ++h) pin(acc[m][h]);
  _mm_setcsr(saved);
  for (int m = 0; m < MB; ++m) {
    pin(acc[m][0]);
    pin(acc[m][1]);
    res[m] = moeserve_canon::halving_sum(acc[m][0], acc[m][1]);
  }
}

inline void decode(const QRow& row, int64_t k, uint16_t* w) {
  for (int64_t c = 0; c < k / 32; ++c) decode_chunk_scalar(row, c, w + 32 * c);
}

#else  // scalar

template <int MB>
inline void dots(const QRow& row, int64_t k, const uint16_t* const* xs, float* res, bool) {
  float lanes[MB][16] = {};
  uint16_t w[32];
  for (int64_t c = 0; c < k / 32; ++c) {
    decode_chunk_scalar(row, c, w);
    for (int m = 0; m < MB; ++m) moeserve_canon::chunk_scalar(lanes[m], w, xs[m] + 32 * c);
  }
  for (int m = 0; m < MB; ++m) res[m] = moeserve_canon::halving_sum16(lanes[m]);
}

inline void decode(const QRow& row, int64_t k, uint16_t* w) {
  for (int64_t c = 0; c < k / 32; ++c) decode_chunk_scalar(row, c, w + 32 * c);
}

#endif

}  // namespace

void row_dots(const QRow& row, int64_t k, const uint16_t* const* xs, int mb, float* res, bool prefetch) {
  switch (mb) {
    case 1: dots<1>(row, k, xs, res, prefetch); break;
    case 2: dots<2>(row, k, xs, res, prefetch); break;
    case 3: dots<3>(row, k, xs, res, prefetch); break;
    default: dots<4>(row, k, xs, res, prefetch); break;
  }
}

void decode_row(const QRow& row, int64_t k, uint16_t* w) { decode(row, k, w); }

}  // namespace moeserve_q4
