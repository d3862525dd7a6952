// int8 codes -> the exact values the canonical dot multiplies (csrc/canonical_int8.h), for the dense int8 GEMV
// (dense_gemv_int8.cpp, where the block layout is described) and the int8 expert ops (moe_experts.cpp).
//
// Two kinds of code, one value each (|value| <= 127: exact in bf16, 7 significant bits):
// - a block code (pack_int8_rows' 4-row blocks) is sign-magnitude: bit 7 the sign, bits 0-6 |q|; 0x80 reads -0
//   (pack_int8_rows never writes it; the decoders all give -0 for it, so even a hand-made code has one value);
// - a plain code (a leftover row, or an [out, in] matrix of the plain expert op) is two's complement.
// The decoders below, one per ISA, give exactly those values: bf16 bits (scalar, AVX512-VBMI) or fp32 (AVX2).
// Plain C++ (no ATen): the numeric cores must build without torch (the cross-ISA harnesses).
#pragma once

#include <cstdint>

#include "canonical_dot.h"

namespace moeserve_i8 {

// bf16 bits of the integer m, 0 <= m < 256 (exact: the fp32 value's top half, its low half being zero).
constexpr uint16_t int_bf16(int m) {
  if (m == 0) return 0;
  int e = 7;
  while ((m >> e) == 0) --e;                                   // m = 2^e * 1.f
  const uint32_t mant = (static_cast<uint32_t>(m) << (23 - e)) & 0x7FFFFFu;
  return static_cast<uint16_t>(((static_cast<uint32_t>(127 + e) << 23) | mant) >> 16);
}

// A block code's value as bf16 bits (0x80 -> -0).
constexpr uint16_t block_code_bf16(uint8_t c) {
  return static_cast<uint16_t>((c & 0x80u) << 8) | int_bf16(c & 0x7F);
}

// A plain code's value as bf16 bits (-128 included).
constexpr uint16_t plain_code_bf16(int8_t q) {
  return q < 0 ? static_cast<uint16_t>(0x8000u | int_bf16(-static_cast<int>(q))) : int_bf16(q);
}

// Row r (0..3) of chunk c of a block (128 codes per chunk: rows (0, 1) then (2, 3), each pair as 4 groups of
// [8 codes of its first row, 8 of its second]) -> its 32 values as bf16 bits.
inline void block_chunk_row_bf16(const int8_t* chunk, int r, uint16_t* out) {
  const auto* p = reinterpret_cast<const uint8_t*>(chunk) + (r / 2) * 64 + (r % 2) * 8;
  for (int g = 0; g < 4; ++g)
    for (int e = 0; e < 8; ++e) out[8 * g + e] = block_code_bf16(p[16 * g + e]);
}

}  // namespace moeserve_i8

// ------------------------------------------------------------------------------------- AVX512-BF16 + VBMI
// canonical_dot.h's AVX512-BF16 level (not under MOESERVE_CANON_FORCE_SCALAR) plus VL and VBMI.
#if defined(MOESERVE_CANON_AVX512) && defined(__AVX512VL__) && defined(__AVX512VBMI__)
#define MOESERVE_HAVE_I8_DECODE 1

namespace moeserve_i8 {

// Low and high bytes of bf16(m) for m = 0..127, two registers each (the 7-bit index of vpermt2b).
struct Lut {
  __m512i lo_a, lo_b, hi_a, hi_b;
};

struct LutBytes {
  alignas(64) uint8_t lo[128];
  alignas(64) uint8_t hi[128];
  constexpr LutBytes() : lo(), hi() {
    for (int m = 0; m < 128; ++m) {
      lo[m] = static_cast<uint8_t>(int_bf16(m) & 0xFF);
      hi[m] = static_cast<uint8_t>(int_bf16(m) >> 8);
    }
  }
};
inline constexpr LutBytes kLut{};

inline Lut make_lut() {
  return {_mm512_load_si512(kLut.lo), _mm512_load_si512(kLut.lo + 64), _mm512_load_si512(kLut.hi),
          _mm512_load_si512(kLut.hi + 64)};
}

// 64 block codes at p (one row pair of one chunk) -> the pair's two rows of 32 bf16 (exact): two 128-entry byte
// table lookups by |q| for the low and high bytes of bf16(|q|), the sign OR'ed in (0x80 -> -0), two byte unpacks
// whose in-lane order the layout undoes. 5 instructions for 64 codes.
inline void decode_pair(const int8_t* p, const Lut& t, __m512bh& first, __m512bh& second) {
  const __m512i c = _mm512_loadu_si512(p);
  const __m512i lo = _mm512_permutex2var_epi8(t.lo_a, c, t.lo_b);  // index: bits 0-6 = |q|
  __m512i hi = _mm512_permutex2var_epi8(t.hi_a, c, t.hi_b);
  hi = _mm512_ternarylogic_epi32(hi, c, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // hi | (c & 0x80)
  first = (__m512bh)_mm512_unpacklo_epi8(lo, hi);   // bytes 0-7 of each 16-byte lane: the first row's codes
  second = (__m512bh)_mm512_unpackhi_epi8(lo, hi);  // bytes 8-15: the second row's
}

}  // namespace moeserve_i8
#endif

// ----------------------------------------------------------------------------------------------- AVX2 + FMA
#if defined(MOESERVE_CANON_AVX2)
namespace moeserve_i8 {

// The values of 8 codes as fp32, from dwords whose byte 0 and byte 3 both hold a block code: |q| converted,
// the sign bit OR'ed in (0x80 -> -0).
inline __m256 block_values(__m256i d) {
  const __m256 mag = _mm256_cvtepi32_ps(_mm256_and_si256(d, _mm256_set1_epi32(0x7F)));
  return _mm256_or_ps(mag, _mm256_castsi256_ps(_mm256_and_si256(d, _mm256_set1_epi32(static_cast<int>(0x80000000u)))));
}

// In each 128-bit lane, dword i <- byte b(i) into bytes 0 and 3 (-1: zero).
#define MOESERVE_I8_PICK(b) b, -1, -1, b
#define MOESERVE_I8_PICK4(o) MOESERVE_I8_PICK(o), MOESERVE_I8_PICK(o + 2), MOESERVE_I8_PICK(o + 4), MOESERVE_I8_PICK(o + 6)

// 32 block codes at p (groups 2h and 2h + 1 of a row pair: elements 16h .. 16h + 15 of both rows) -> the canonical
// AVX2 half-chunk operands (canonical_dot.h Pairs: lane j = elements 2j + 1 / 2j) of the pair's two rows. Each
// 128-bit lane holds one group, [8 codes of the first row, 8 of the second]: lanes 0-3 of a row come from the
// first group, 4-7 from the second, so in-lane byte shuffles place them.
inline void decode_half_pair(const int8_t* p, moeserve_canon::Pairs& first, moeserve_canon::Pairs& second) {
  const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i odd0 = _mm256_setr_epi8(MOESERVE_I8_PICK4(1), MOESERVE_I8_PICK4(1));
  const __m256i even0 = _mm256_setr_epi8(MOESERVE_I8_PICK4(0), MOESERVE_I8_PICK4(0));
  const __m256i odd1 = _mm256_setr_epi8(MOESERVE_I8_PICK4(9), MOESERVE_I8_PICK4(9));
  const __m256i even1 = _mm256_setr_epi8(MOESERVE_I8_PICK4(8), MOESERVE_I8_PICK4(8));
  first = {block_values(_mm256_shuffle_epi8(c, odd0)), block_values(_mm256_shuffle_epi8(c, even0))};
  second = {block_values(_mm256_shuffle_epi8(c, odd1)), block_values(_mm256_shuffle_epi8(c, even1))};
}

// 16 plain (two's complement) codes at p -> the canonical AVX2 half-chunk operands: the 16 bytes in both lanes,
// lane 0 picks codes 0-7, lane 1 codes 8-15, each into byte 3 of a dword, sign-extended by a shift.
inline moeserve_canon::Pairs decode_plain_half(const int8_t* p) {
  const __m256i c = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#define MOESERVE_I8_HI(b) -1, -1, -1, b
#define MOESERVE_I8_HI4(o) MOESERVE_I8_HI(o), MOESERVE_I8_HI(o + 2), MOESERVE_I8_HI(o + 4), MOESERVE_I8_HI(o + 6)
  const __m256i odd = _mm256_setr_epi8(MOESERVE_I8_HI4(1), MOESERVE_I8_HI4(9));
  const __m256i even = _mm256_setr_epi8(MOESERVE_I8_HI4(0), MOESERVE_I8_HI4(8));
#undef MOESERVE_I8_HI4
#undef MOESERVE_I8_HI
  return {_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_shuffle_epi8(c, odd), 24)),
          _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_shuffle_epi8(c, even), 24))};
}

#undef MOESERVE_I8_PICK4
#undef MOESERVE_I8_PICK

}  // namespace moeserve_i8
#endif
