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
//   AVX2 + FMA   the tables kept SPLIT (a group's 16 low bytes, then its 16 high bytes: `kSplit`): a chunk's 32
//                nibbles -> its 32 bf16 by two vpshufb (low and high bytes) and a byte interleave, which leaves
//                elements 0-7 | 16-23 and 8-15 | 24-31 in two registers: accumulated in that lane order and put
//                back in canonical_dot.h's before the halving sum (the same lanes, each in the same order)
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

// E2M1 code values (bit 3 the sign), as the references' table (formats/fp4.py); INT4's (n - 8).
constexpr float kE2m1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
constexpr float kInt4[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
inline float e2m1(int n) { return kE2m1[n]; }

// FP8 E4M3 (fn: no infinities, 0x7F / 0xFF NaN) -> fp32, exact.
inline float fp8_e4m3(uint8_t b) {
  const int e = (b >> 3) & 0xF, m = b & 7;
  if (e == 0xF && m == 7) return std::nanf("");
  const float mag = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
  return (b & 0x80) ? -mag : mag;
}

}  // namespace

namespace {

// AVX2 builds keep every group's table split: its 16 entries' low bytes, then their high bytes (the vpshufb operands).
#if defined(MOESERVE_CANON_AVX2)
constexpr bool kSplit = true;
#else
constexpr bool kSplit = false;
#endif

// Entry n of a table as stored (split or as 16 bf16).
inline uint16_t entry(const uint16_t* t, int n) {
  if constexpr (kSplit) {
    const uint8_t* b = reinterpret_cast<const uint8_t*>(t);
    return static_cast<uint16_t>(b[n] | (b[16 + n] << 8));
  }
  return t[n];
}

// A table of 16 bf16 rewritten as stored (split where kSplit).
inline void store_form(uint16_t* t) {
  if constexpr (kSplit) {
    uint8_t b[32];
    for (int n = 0; n < 16; ++n) {
      b[n] = static_cast<uint8_t>(t[n] & 0xFF);
      b[16 + n] = static_cast<uint8_t>(t[n] >> 8);
    }
    std::memcpy(t, b, 32);
  }
}

}  // namespace

// MXFP4: table[s][n] = bf16(E2M1[n] * 2^(s - 127)), for every scale byte s. Computed as formats/mxfp4.py does it
// ((2 E2M1[n]) * 2^(s - 128): 2^(s - 127) overflows fp32 at s = 255) in double, exact, then cast.
const uint16_t* mxfp4_tables() {
  static const struct T {
    uint16_t v[256 * 16];
    T() {
      for (int s = 0; s < 256; ++s) {
        for (int n = 0; n < 16; ++n)
          v[16 * s + n] = bf16_rne(static_cast<float>(std::ldexp(2.0 * e2m1(n), s - 128)));
        store_form(v + 16 * s);
      }
    }
  } tables;
  return tables.v;
}

namespace {

// out[n] = bf16_rne(vals[n] * scale), n < 16: one group's table. The product is one fp32 multiply in the caller's
// floating-point environment (as the reference decoders' torch ops); the rounding is integer work on the bits, so
// the vector forms give the scalar form's bits.
#if defined(MOESERVE_CANON_AVX512)
inline void scaled_table(const __m512& vals, float scale, uint16_t* out) {
  const __m512 v = _mm512_mul_ps(vals, _mm512_set1_ps(scale));
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(r));
}
struct Values {
  __m512 v;
  explicit Values(const float* p) : v(_mm512_loadu_ps(p)) {}
};
inline void scaled_table(const Values& vals, float scale, uint16_t* out) { scaled_table(vals.v, scale, out); }
#elif defined(MOESERVE_CANON_AVX2)
inline __m256i rounded8(__m256 vals, float scale) {
  const __m256 v = _mm256_mul_ps(vals, _mm256_set1_ps(scale));
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
struct Values {
  __m256 lo, hi;
  explicit Values(const float* p) : lo(_mm256_loadu_ps(p)), hi(_mm256_loadu_ps(p + 8)) {}
};
inline void scaled_table(const Values& vals, float scale, uint16_t* out) {
  // packus (values <= 0xFFFF) interleaves 128-bit lanes: entries 0-3 8-11 | 4-7 12-15; each lane's low bytes then
  // its high bytes (vpshufb), then the quadwords in order: the split table (kSplit)
  const __m256i packed = _mm256_packus_epi32(rounded8(vals.lo, scale), rounded8(vals.hi, scale));
  const __m256i bytes = _mm256_shuffle_epi8(packed, _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11,
                                                                      13, 15, 0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7,
                                                                      9, 11, 13, 15));
  // quadwords now: lo(0-3 8-11) hi(0-3 8-11) | lo(4-7 12-15) hi(4-7 12-15), as dwords lo0-3 lo8-11 hi0-3 hi8-11 ...
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permutevar8x32_epi32(bytes, order));
}
#else
struct Values {
  const float* p;
  explicit Values(const float* q) : p(q) {}
};
inline void scaled_table(const Values& vals, float scale, uint16_t* out) {
  for (int n = 0; n < 16; ++n) out[n] = bf16_rne(vals.p[n] * scale);
}
#endif

}  // namespace

// NVFP4: out[s][n] = bf16(fp32(E2M1[n] * gs(s))), gs(s) = fp32(fp8(s)) / tensor_scale (divide) or * tensor_scale.
void nvfp4_tables(float tensor_scale, bool divide, uint16_t* out) {
  const Values vals(kE2m1);
  for (int s = 0; s < 256; ++s) {
    const float f = fp8_e4m3(static_cast<uint8_t>(s));
    scaled_table(vals, divide ? f / tensor_scale : f * tensor_scale, out + 16 * s);
  }
}

// INT4: out[g][n] = bf16(fp32((n - 8) * scale[g])) for a row's `groups` bf16 scales.
void int4_tables(const uint16_t* scales, int64_t groups, uint16_t* out) {
  const Values vals(kInt4);
  for (int64_t g = 0; g < groups; ++g) {
    const uint32_t u = static_cast<uint32_t>(scales[g]) << 16;
    float s;
    std::memcpy(&s, &u, 4);
    scaled_table(vals, s, out + 16 * g);
  }
}

namespace {

// The pass that reads memory fetches the NEXT block of 4 rows by hand as it goes: a block's rows are contiguous (K / 2
// bytes of codes each, K / G scale bytes), so the pass over rows[0 .. n) (n = 4, or 2 on AVX2's two passes) fetches
// the same n rows 4 rows on, 16 n bytes of codes per 32-element chunk (what the chunk reads of the n rows: the sweep
// covers them exactly) and, while it lasts, a line of their scales. Fetching each row 2 KiB ahead of itself (the first
// version) left 4 streams a row apart to the hardware prefetcher: 11-12 GB/s on one Zen 4 core where this reads
// 17-20 (a plain read of the same bytes 19-23; docs/design/kernels.md). Any address is harmless: a prefetch past a
// unit's end reads nothing the op uses and cannot fault.
struct NextBlock {
  const char* codes;   // the n rows' codes 4 rows on
  const char* scales;  // their scales (null: INT4, whose tables are made per row from bf16 scales, read then)
  int64_t code_step, scale_bytes;
  NextBlock(const QRow* rows, int n, int64_t k)
      : codes(reinterpret_cast<const char*>(rows[0].codes) + 2 * k),
        scales(rows[0].index != nullptr ? reinterpret_cast<const char*>(rows[0].index) + 4 * (k / rows[0].group)
                                        : nullptr),
        code_step(16 * n), scale_bytes(scales != nullptr ? n * (k / rows[0].group) : 0) {}
  void fetch(int64_t c) const {  // during chunk c
    if ((code_step * c) % 64 == 0) __builtin_prefetch(codes + code_step * c, 0, 3);
    if (64 * c < scale_bytes) __builtin_prefetch(scales + 64 * c, 0, 3);
  }
};

// decode_chunk_scalar(row, c, w): w[32] = the bf16 weights of chunk c (any ISA: the reference form).
inline void decode_chunk_scalar(const QRow& row, int64_t c, uint16_t* w) {
  const uint8_t* p = row.codes + 16 * c;
  const uint16_t* t[2] = {row.first(c), row.second(c)};
  for (int j = 0; j < 16; ++j) {
    w[2 * j] = entry(t[j / 8], p[j] & 15);
    w[2 * j + 1] = entry(t[j / 8], p[j] >> 4);
  }
}

// ----------------------------------------------------------------------------------------------- the kernels
// dots4<MB>(rows, k, xs, res, pf): res[m][r] = canonical dot of decoded row r (of 4) with xs[m] (bf16 [k]),
//   m < MB (1..4); pf: fetch the codes ahead by hand (the pass that reads memory). k % 32 == 0.
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

// dots4<MB>: 4 rows, 4 * MB independent accumulators (each row's chunks still in order).
template <int MB>
inline void dots4(const QRow* rows, int64_t k, const uint16_t* const* xs, float (*res)[4], bool pf) {
  __m512 acc[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_setzero_ps();
  const NextBlock next(rows, 4, k);
  for (int64_t c = 0; c < k / 32; ++c) {
    if (pf) next.fetch(c);
    __m512bh w[4];
    for (int r = 0; r < 4; ++r) w[r] = decode_chunk(rows[r], c);
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(xs[m] + 32 * c);
      for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], w[r], xv);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < 4; ++r) res[m][r] = _mm512_reduce_add_ps(acc[m][r]);
}

inline void decode(const QRow& row, int64_t k, uint16_t* w) {
  for (int64_t c = 0; c < k / 32; ++c) _mm512_storeu_si512(w + 32 * c, (__m512i)decode_chunk(row, c));
}

#elif defined(MOESERVE_CANON_AVX2)

// Chunk c's 32 weights as bf16 in two registers: lo = elements 0-7 | 16-23, hi = 8-15 | 24-31 (the byte interleave
// works within 128-bit lanes). Nibbles in element order (lane 0: elements 0-15, lane 1: 16-31), each lane looked up
// in its half's split table (low bytes, then high bytes), the two bytes of each weight interleaved.
struct Words {
  __m256i lo, hi;
};
inline Words decode_chunk(const QRow& row, int64_t c) {
  const uint8_t* t0 = reinterpret_cast<const uint8_t*>(row.first(c));
  const uint8_t* t1 = reinterpret_cast<const uint8_t*>(row.second(c));
  auto lanes = [](const uint8_t* a, const uint8_t* b) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
                                   _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
  };
  const __m256i tl = lanes(t0, t1), th = lanes(t0 + 16, t1 + 16);
  const __m128i m4 = _mm_set1_epi8(0x0F);
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row.codes + 16 * c));
  const __m128i lo = _mm_and_si128(v, m4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
  const __m256i nib = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi8(lo, hi)),
                                              _mm_unpackhi_epi8(lo, hi), 1);
  const __m256i lb = _mm256_shuffle_epi8(tl, nib), hb = _mm256_shuffle_epi8(th, nib);
  return {_mm256_unpacklo_epi8(lb, hb), _mm256_unpackhi_epi8(lb, hb)};
}

// 16 bf16 as canonical_dot.h's (odd, even) fp32 pairs.
inline moeserve_canon::Pairs pairs_of(__m256i w) {
  return {_mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)))),
          _mm256_castsi256_ps(_mm256_slli_epi32(w, 16))};
}

// Only integer moves and lookups before the FMAs: the lane mode's DAZ/FTZ cannot change a weight (a bf16 denormal
// weight becomes an fp32 denormal, which DAZ reads as zero, as vdpbf16ps does).
// Two rows against one input at once, then the next two. Accumulator 0 holds canonical lanes 0-3 | 8-11 (the
// pairs of elements 0-7 | 16-23), accumulator 1 lanes 4-7 | 12-15; x is loaded in the same arrangement, and the
// lanes are put back in canonical order before the halving sum: each lane sees the same products in the same order.
inline void dots2x1(const QRow* rows, int64_t k, const uint16_t* x, float* res, bool pf) {
  using moeserve_canon::pin;
  __m256 acc[2][2];
  const unsigned saved = moeserve_canon::enter_lane_mode();
  for (int r = 0; r < 2; ++r)
    for (int h = 0; h < 2; ++h) pin(acc[r][h] = _mm256_setzero_ps());
  const NextBlock next(rows, 2, k);
  for (int64_t c = 0; c < k / 32; ++c) {
    if (pf) next.fetch(c);
    const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32 * c));
    const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32 * c + 16));
    const moeserve_canon::Pairs xv[2] = {pairs_of(_mm256_permute2x128_si256(x0, x1, 0x20)),
                                         pairs_of(_mm256_permute2x128_si256(x0, x1, 0x31))};
    for (int r = 0; r < 2; ++r) {
      const Words w = decode_chunk(rows[r], c);
      acc[r][0] = moeserve_canon::pair_step(acc[r][0], pairs_of(w.lo), xv[0]);
      acc[r][1] = moeserve_canon::pair_step(acc[r][1], pairs_of(w.hi), xv[1]);
    }
  }
  __m256 lanes[2][2];
  for (int r = 0; r < 2; ++r) {
    pin(acc[r][0]);
    pin(acc[r][1]);
    lanes[r][0] = _mm256_permute2f128_ps(acc[r][0], acc[r][1], 0x20);  // canonical lanes 0-7
    lanes[r][1] = _mm256_permute2f128_ps(acc[r][0], acc[r][1], 0x31);  // and 8-15
  }
  moeserve_canon::finish_lanes(lanes, saved, res);
}

template <int MB>
inline void dots4(const QRow* rows, int64_t k, const uint16_t* const* xs, float (*res)[4], bool pf) {
  for (int m = 0; m < MB; ++m)  // the later inputs find the 4 rows' codes in L1 / L2
    for (int r = 0; r < 4; r += 2) dots2x1(rows + r, k, xs[m], res[m] + r, pf && m == 0);
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

template <int MB>
inline void dots4(const QRow* rows, int64_t k, const uint16_t* const* xs, float (*res)[4], bool pf) {
  for (int r = 0; r < 4; ++r) {
    float one[MB];
    dots<MB>(rows[r], k, xs, one, pf);
    for (int m = 0; m < MB; ++m) res[m][r] = one[m];
  }
}

#endif

}  // namespace

void rows4_dots(const QRow* rows, int64_t k, const uint16_t* const* xs, int mb, float (*res)[4], bool prefetch) {
  switch (mb) {
    case 1: dots4<1>(rows, k, xs, res, prefetch); break;
    case 2: dots4<2>(rows, k, xs, res, prefetch); break;
    case 3: dots4<3>(rows, k, xs, res, prefetch); break;
    default: dots4<4>(rows, k, xs, res, prefetch); break;
  }
}

void decode_row(const QRow& row, int64_t k, uint16_t* w) { decode(row, k, w); }

}  // namespace moeserve_q4
