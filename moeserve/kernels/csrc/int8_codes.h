// Sign-magnitude int8 codes in the row-interleaved block layout -> bf16 (exact), shared by the dense int8 GEMV
// (dense_gemv_int8.cpp, where the layout is described) and the fused int8 expert op (moe_experts.cpp).
// Compiled only where the build's ISA has AVX512-BF16 and VBMI (native on such a CPU): an avx2 or generic build
// (kernels/__init__.py) must never choose this code, and non-x86 compilers have no immintrin.h.
#pragma once

#include <cstdint>

#include "norm_common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__) && \
    defined(__AVX512VBMI__)
#define MOESERVE_HAVE_I8_DECODE 1
#include <immintrin.h>

#define MOESERVE_I8_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi,fma")))

namespace moeserve_csrc {

// Low and high bytes of bf16(m) for m = 0..127, two registers each (the 7-bit index of vpermt2b).
struct Lut {
  __m512i lo_a, lo_b, hi_a, hi_b;
};

struct LutBytes {
  alignas(64) uint8_t lo[128];
  alignas(64) uint8_t hi[128];
  LutBytes() {
    for (int m = 0; m < 128; ++m) {
      const uint16_t bits = bf16_bits(static_cast<float>(m));
      lo[m] = static_cast<uint8_t>(bits & 0xFF);
      hi[m] = static_cast<uint8_t>(bits >> 8);
    }
  }
};
static const LutBytes kLut;  // built once when the library loads

MOESERVE_I8_TARGET static inline Lut make_lut() {
  return {_mm512_load_si512(kLut.lo), _mm512_load_si512(kLut.lo + 64), _mm512_load_si512(kLut.hi),
          _mm512_load_si512(kLut.hi + 64)};
}

// 64 block codes at p (one row pair of one chunk, layout in dense_gemv_int8.cpp) -> the pair's two rows of 32 bf16 (exact).
MOESERVE_I8_TARGET static inline void decode_pair(const int8_t* p, const Lut& t, __m512bh& first, __m512bh& second) {
  const __m512i c = _mm512_loadu_si512(p);
  const __m512i lo = _mm512_permutex2var_epi8(t.lo_a, c, t.lo_b);  // index: bits 0-6 = |q|
  __m512i hi = _mm512_permutex2var_epi8(t.hi_a, c, t.hi_b);
  hi = _mm512_ternarylogic_epi32(hi, c, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // hi | (c & 0x80)
  first = (__m512bh)_mm512_unpacklo_epi8(lo, hi);   // bytes 0-7 of each 16-byte lane: the first row's codes
  second = (__m512bh)_mm512_unpackhi_epi8(lo, hi);  // bytes 8-15: the second row's
}

}  // namespace moeserve_csrc

#endif  // MOESERVE_HAVE_I8_DECODE
