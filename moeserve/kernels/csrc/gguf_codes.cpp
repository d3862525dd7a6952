// GGUF's quantized blocks (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, MXFP4) decoded in registers and fed to the canonical bf16
// dot (canonical_dot.h), for the expert op (moe_experts_q4.cpp, fmt=gguf).
//
// What a weight IS, here, is exactly what the `gguf` package's reference dequantizer (and moeserve's torch copy of it,
// checkpoint/gguf/quants.py) writes in fp32, then torch's cast to bf16: the same fp32 operations in the same order
// (a scale product, then `* q`, then `- dm`: each rounded, never fused; g++ contracts `a * b - c` into an FMA even
// under -std=c++20, so every product meant to be rounded passes through `rounded`). The dot of a decoded row with an
// input row is then canonical_dot.h's order on those bf16 values, unchanged: a reference that dequantizes with the
// torch decoder, casts to bf16 and runs the stated order gets the same bits (tests/kernels/test_gguf_experts.py).
//
// Every product is exact or a normal fp32 (scales are f16, so a nonzero weight is at least 2^-24 in magnitude; MXFP4's
// exact products are tabled, `mxfp4_gguf_tables`), so the AVX-512 cast (vcvtne2ps2bf16: nearest-even, denormals to zero)
// gives torch's bits; a NaN scale gives a NaN weight whose payload may differ, which no dot result shows (an output
// NaN is the one quiet NaN).
//
// Block layouts (ggml-common.h; chunk c = values [32c, 32c + 32) of a row):
//   Q8_0  34 B / 32   f16 d, 32 int8 q                                  x = q * d
//   Q4_0  18 B / 32   f16 d, 16 B: value j low nibble of byte j, 16 + j its high nibble      x = d * (q - 8)
//   MXFP4 17 B / 32   E8M0 e, 16 B as Q4_0                              x = 2^(e - 128) * (2 E2M1[q])
//   Q4_K 144 B / 256  f16 d, f16 dmin, 12 B of 6-bit scales / mins, 128 B nibbles: sub-block s = 2g + h (32 values) is
//                     nibble h of bytes [32g, 32g + 32)                x = (d * sc[s]) * q - dmin * m[s]
//   Q5_K 176 B / 256  as Q4_K with 32 B of fifth bits (bit s of byte i: value i of sub-block s) before the nibbles
//   Q6_K 210 B / 256  128 B low nibbles, 64 B two high bits, 16 int8 scales (one per 16 values), f16 d
//                     x = (d * sc[s]) * (q - 32)
// A chunk is one block (32-value types) or one 32-value sub-block of a 256-value one (Q6_K: two scales).
//
// Per ISA:
//   AVX512-BF16  a chunk of 4 rows decoded to 4 x 32 bf16 in registers (MXFP4: one vpermw over the exponent's table
//                of 16 bf16), then vdpbf16ps for up to 4 inputs
//   NEON         the 4 rows decoded by NEON (the scalar reference's operations on 4 lanes, the same bits) into a
//                per-thread 4-row block (canonical_dot.h's block layout), then canonical_dot.h's NEON block4_dots
//   any other    the same with the scalar reference's decode: AVX2 and scalar dots
// gguf_implementation() names the decode. Every ISA gives the same bits: the x86 levels and aarch64 under qemu
// (tests/kernels/test_aarch64_qemu.py, which builds this file alone); the NEON path is not timed on ARM hardware.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "canonical_dot.h"
#include "gguf_codes.h"

namespace moeserve_q4 {

namespace {

// v as rounded by its own operation: the compiler may not fuse it into a following add (see the header comment).
inline float rounded(float v) {
#if defined(__x86_64__) || defined(__i386__)
  asm("" : "+x"(v));
#elif defined(__aarch64__)
  asm("" : "+w"(v));
#else
  volatile float keep = v;
  v = keep;
#endif
  return v;
}

// IEEE binary16 (little-endian bytes) -> fp32, exact, denormals and NaN payloads as torch's Half -> float.
inline float f16(const uint8_t* p) {
  const uint32_t h = p[0] | (static_cast<uint32_t>(p[1]) << 8);
  const uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  if (e == 0) {  // a subnormal (or zero): m * 2^-24, exact
    const float v = static_cast<float>(m) * 0x1p-24f;
    return sign != 0 ? -v : v;
  }
  return moeserve_csrc::bits_to_f(sign | (e == 0x1F ? 0x7F800000u | (m << 13) : ((e + 112) << 23) | (m << 13)));
}

// Q4_K / Q5_K: the 6-bit scale and min of sub-block j (ggml's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* s, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// The doubled E2M1 values ggml decodes MXFP4 with (kvalues_mxfp4).
constexpr float kMxfp4Doubled[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// MXFP4's scale 2^(e - 128) as the reference makes it (the f32 bits 0x00200000 << e below e = 2: denormals).
inline float mxfp4_scale(uint8_t e) {
  return e < 2 ? std::ldexp(1.0f, e - 128) : moeserve_csrc::bits_to_f((e - 1u) << 23);
}

// [256][16] bf16: table[e][n] = the bf16 of 2^(e - 128) * (2 E2M1[n]) (not q4_codes.cpp's MXFP4 tables: ggml's
// code 8 is +0, OCP's E2M1 -0).
[[maybe_unused]] const uint16_t* mxfp4_gguf_tables() {
  static const struct T {
    uint16_t v[256 * 16];
    T() {
      for (int e = 0; e < 256; ++e)
        for (int n = 0; n < 16; ++n)
          v[16 * e + n] = moeserve_csrc::bf16_bits(mxfp4_scale(static_cast<uint8_t>(e)) * kMxfp4Doubled[n]);
    }
  } tables;
  return tables.v;
}

// ------------------------------------------------------------------------------------- the scalar reference
// w[32] = the bf16 weights of chunk c of `row` (values as fp32 first, then torch's cast).
[[maybe_unused]] void decode_chunk_scalar(GType t, const uint8_t* row, int64_t c, uint16_t* w) {
  float v[32];
  switch (t) {
    case GType::kQ8_0: {
      const uint8_t* b = row + 34 * c;
      const float d = f16(b);
      for (int i = 0; i < 32; ++i) v[i] = static_cast<float>(static_cast<int8_t>(b[2 + i])) * d;
      break;
    }
    case GType::kQ4_0:
    case GType::kMxfp4: {
      const bool q4 = t == GType::kQ4_0;
      const uint8_t* b = row + (q4 ? 18 : 17) * c;
      const uint8_t* qs = b + (q4 ? 2 : 1);
      const float scale = q4 ? f16(b) : mxfp4_scale(b[0]);
      for (int i = 0; i < 32; ++i) {
        const int n = (qs[i & 15] >> (i < 16 ? 0 : 4)) & 15;
        v[i] = q4 ? scale * static_cast<float>(n - 8) : scale * kMxfp4Doubled[n];
      }
      break;
    }
    case GType::kQ4_K:
    case GType::kQ5_K: {
      const bool q5 = t == GType::kQ5_K;
      const int j = static_cast<int>(c & 7);
      const uint8_t* b = row + (q5 ? 176 : 144) * (c >> 3);
      int sc, m;
      scale_min_k4(j, b + 4, sc, m);
      const float d = f16(b) * static_cast<float>(sc), dm = f16(b + 2) * static_cast<float>(m);
      const uint8_t* qs = b + (q5 ? 48 : 16) + 32 * (j >> 1);
      for (int i = 0; i < 32; ++i) {
        int q = (qs[i] >> (4 * (j & 1))) & 15;
        if (q5) q |= ((b[16 + i] >> j) & 1) << 4;
        v[i] = rounded(d * static_cast<float>(q)) - dm;
      }
      break;
    }
    case GType::kQ6_K: {
      const uint8_t* b = row + 210 * (c >> 3);
      const int e0 = 32 * static_cast<int>(c & 7), half = e0 >> 7, within = e0 & 127;
      const uint8_t* ql = b + 64 * half + (within & 63);
      const uint8_t* qh = b + 128 + 32 * half;
      const float d = f16(b + 208);
      for (int i = 0; i < 32; ++i) {
        const int q = (((ql[i] >> (4 * (within >> 6))) & 15) | (((qh[i] >> (2 * (within >> 5))) & 3) << 4)) - 32;
        v[i] = (d * static_cast<float>(static_cast<int8_t>(b[192 + (e0 + i) / 16]))) * static_cast<float>(q);
      }
      break;
    }
  }
  for (int i = 0; i < 32; ++i) w[i] = moeserve_csrc::bf16_bits(v[i]);
}

// The pass that reads memory fetches the next block of 4 rows (contiguous: the rows of a shard follow each other) as
// it goes, in step with the chunks.
struct NextRows {
  const char* at;
  int64_t bytes, chunks, fetched = 0;
  NextRows(const GRow* rows, int64_t row_bytes, int64_t k)
      : at(reinterpret_cast<const char*>(rows[0].bytes) + 4 * row_bytes), bytes(4 * row_bytes), chunks(k / 32) {}
  void fetch(int64_t c) {  // during chunk c
    for (const int64_t end = bytes * (c + 1) / chunks; fetched < end; fetched += 64) __builtin_prefetch(at + fetched, 0, 3);
  }
};

#if defined(MOESERVE_CANON_AVX512)

inline __m512 widen(__m128i bytes, bool is_signed) {
  return _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes));
}
inline __m128i lo128(__m256i v) { return _mm256_castsi256_si128(v); }
inline __m128i hi128(__m256i v) { return _mm256_extracti128_si256(v, 1); }
inline __m512 rounded(__m512 v) {
  asm("" : "+v"(v));
  return v;
}

constexpr bool is_k(GType t) { return t == GType::kQ4_K || t == GType::kQ5_K || t == GType::kQ6_K; }
constexpr int64_t k_block_bytes(GType t) { return t == GType::kQ4_K ? 144 : t == GType::kQ5_K ? 176 : 210; }

// A 256-value block's scale products, made once for its 8 chunks (the scalar reference's products, 16 lanes at once):
// Q4_K / Q5_K pre[j] = d * sc[j], pre[8 + j] = dmin * m[j]; Q6_K pre[i] = d * sc[i] (16 sub-blocks of 16).
template <GType T>
inline void prepare(const uint8_t* b, float* pre) {
  if constexpr (T == GType::kQ6_K) {
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
    _mm512_storeu_ps(pre, _mm512_mul_ps(_mm512_set1_ps(f16(b + 208)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc))));
  } else {
    // the 8 scales then the 8 mins as bytes (ggml's get_scale_min_k4 on 32-bit words, as its dot products do)
    uint32_t u[4];
    std::memcpy(u, b + 4, 12);
    u[3] = ((u[2] >> 4) & 0x0F0F0F0Fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    const uint32_t mins_lo = u[1] & 0x3F3F3F3Fu;
    u[1] = (u[2] & 0x0F0F0F0Fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    u[2] = mins_lo;
    u[0] &= 0x3F3F3F3Fu;
    const __m512 values = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u))));
    const __m512 scale = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(f16(b))),
                                                             _mm256_castps_pd(_mm256_set1_ps(f16(b + 2))), 1));
    _mm512_storeu_ps(pre, _mm512_mul_ps(scale, values));  // d * sc[j], then dmin * m[j]
  }
}

// Chunk c's 32 weights as bf16, for each type (the scalar reference's operations, 16 lanes at a time); `pre`: the
// chunk's 256-value block's `prepare`d products (K-quants), `mxfp4`: mxfp4_gguf_tables().
template <GType T>
inline __m512bh decode_chunk(const uint8_t* row, int64_t c, const uint16_t* mxfp4, const float* pre) {
  if constexpr (T == GType::kQ8_0) {
    const uint8_t* b = row + 34 * c;
    const __m512 d = _mm512_set1_ps(f16(b));
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
    return _mm512_cvtne2ps_pbh(_mm512_mul_ps(widen(hi128(q), true), d), _mm512_mul_ps(widen(lo128(q), true), d));
  } else if constexpr (T == GType::kQ4_0) {
    const uint8_t* b = row + 18 * c;
    const __m512 d = _mm512_set1_ps(f16(b));
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)), m4 = _mm_set1_epi8(15);
    const __m512 eight = _mm512_set1_ps(8.0f);
    const __m512 lo = _mm512_sub_ps(widen(_mm_and_si128(v, m4), false), eight);  // exact: small integers
    const __m512 hi = _mm512_sub_ps(widen(_mm_and_si128(_mm_srli_epi16(v, 4), m4), false), eight);
    return _mm512_cvtne2ps_pbh(_mm512_mul_ps(d, hi), _mm512_mul_ps(d, lo));
  } else if constexpr (T == GType::kMxfp4) {
    const uint8_t* b = row + 17 * c;
    const __m512i tab = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mxfp4 + 16 * b[0])));
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 1)), m4 = _mm_set1_epi8(15);
    const __m256i idx = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4));
    return (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(idx), tab);
  } else if constexpr (T == GType::kQ4_K || T == GType::kQ5_K) {
    constexpr bool q5 = T == GType::kQ5_K;
    const int j = static_cast<int>(c & 7);
    const uint8_t* b = row + (q5 ? 176 : 144) * (c >> 3);
    const __m512 d = _mm512_set1_ps(pre[j]), dm = _mm512_set1_ps(pre[8 + j]);
    __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + (q5 ? 48 : 16) + 32 * (j >> 1)));
    if (j & 1) q = _mm256_srli_epi16(q, 4);
    q = _mm256_and_si256(q, _mm256_set1_epi8(15));
    if constexpr (q5) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
      const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(j)), _mm256_set1_epi8(1));
      q = _mm256_or_si256(q, _mm256_slli_epi16(bit, 4));  // bit 4 of each byte: no carry between bytes
    }
    const __m512 lo = _mm512_sub_ps(rounded(_mm512_mul_ps(d, widen(lo128(q), false))), dm);
    const __m512 hi = _mm512_sub_ps(rounded(_mm512_mul_ps(d, widen(hi128(q), false))), dm);
    return _mm512_cvtne2ps_pbh(hi, lo);
  } else {  // Q6_K
    const uint8_t* b = row + 210 * (c >> 3);
    const int e0 = 32 * static_cast<int>(c & 7), half = e0 >> 7, within = e0 & 127;
    const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * half + (within & 63)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * half));
    const __m256i low = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (within >> 6))), _mm256_set1_epi8(15));
    const __m256i high = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * (within >> 5))), _mm256_set1_epi8(3));
    const __m256i q = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), _mm256_set1_epi8(32));
    const __m512 d0 = _mm512_set1_ps(pre[e0 / 16]), d1 = _mm512_set1_ps(pre[e0 / 16 + 1]);
    return _mm512_cvtne2ps_pbh(_mm512_mul_ps(d1, widen(hi128(q), true)), _mm512_mul_ps(d0, widen(lo128(q), true)));
  }
}

// res[m][r] = the canonical dot of decoded row r (of 4) with xs[m], m < MB: 4 * MB independent accumulators.
template <GType T, int MB>
void dots4(const GRow* rows, int64_t k, int64_t row_bytes, const uint16_t* const* xs, float (*res)[4], bool pf) {
  __m512 acc[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_setzero_ps();
  NextRows next(rows, row_bytes, k);
  const uint16_t* mxfp4 = T == GType::kMxfp4 ? mxfp4_gguf_tables() : nullptr;
  float pre[4][16];
  for (int64_t c = 0; c < k / 32; ++c) {
    if (pf) next.fetch(c);
    if (is_k(T) && (c & 7) == 0)
      for (int r = 0; r < 4; ++r) prepare<T>(rows[r].bytes + k_block_bytes(T) * (c >> 3), pre[r]);
    __m512bh w[4];
    for (int r = 0; r < 4; ++r) w[r] = decode_chunk<T>(rows[r].bytes, c, mxfp4, pre[r]);
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(xs[m] + 32 * c);
      for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], w[r], xv);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < 4; ++r) res[m][r] = _mm512_reduce_add_ps(acc[m][r]);
}

template <GType T>
void dots4_any(const GRow* rows, int64_t k, int64_t row_bytes, const uint16_t* const* xs, int mb, float (*res)[4],
               bool pf) {
  switch (mb) {
    case 1: dots4<T, 1>(rows, k, row_bytes, xs, res, pf); break;
    case 2: dots4<T, 2>(rows, k, row_bytes, xs, res, pf); break;
    case 3: dots4<T, 3>(rows, k, row_bytes, xs, res, pf); break;
    default: dots4<T, 4>(rows, k, row_bytes, xs, res, pf); break;
  }
}

template <GType T>
void decode_into(const uint8_t* row, int64_t k, uint16_t* w) {
  const uint16_t* mxfp4 = T == GType::kMxfp4 ? mxfp4_gguf_tables() : nullptr;
  float pre[16];
  for (int64_t c = 0; c < k / 32; ++c) {
    if (is_k(T) && (c & 7) == 0) prepare<T>(row + k_block_bytes(T) * (c >> 3), pre);
    _mm512_storeu_si512(w + 32 * c, (__m512i)decode_chunk<T>(row, c, mxfp4, pre));
  }
}

#else  // decoded into a 4-row block (by NEON, or by the scalar reference), then canonical_dot.h's dots
#if defined(MOESERVE_CANON_NEON)

inline float32x4_t rounded(float32x4_t v) {
  asm("" : "+w"(v));
  return v;
}

// w[8] = bf16_bits of a's then b's 4 lanes (nearest even on the bits; any NaN -> 0x7FC0).
inline void store_bf16(uint16_t* w, float32x4_t a, float32x4_t b) {
  uint32x4_t r[2];
  for (int h = 0; h < 2; ++h) {
    const uint32x4_t u = vreinterpretq_u32_f32(h == 0 ? a : b);
    const uint32x4_t up = vaddq_u32(u, vaddq_u32(vdupq_n_u32(0x7FFFu), vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1u))));
    const uint32x4_t nan = vcgtq_u32(vandq_u32(u, vdupq_n_u32(0x7FFFFFFFu)), vdupq_n_u32(0x7F800000u));
    r[h] = vbslq_u32(nan, vdupq_n_u32(0x7FC00000u), up);
  }
  vst1q_u16(w, vuzp2q_u16(vreinterpretq_u16_u32(r[0]), vreinterpretq_u16_u32(r[1])));  // the high halves
}

// w[32] = the bf16 of s_h * float(q_i) (h = i / 16: q[h] holds values 16h .. 16h + 15), minus *sub after rounding
// when sub is given: the scalar reference's operations, 4 lanes at a time.
inline void scale_store(uint16_t* w, const int8x16_t* q, float s0, float s1, const float* sub) {
  for (int h = 0; h < 2; ++h) {
    const int16x8_t lo = vmovl_s8(vget_low_s8(q[h])), hi = vmovl_high_s8(q[h]);
    const float32x4_t s = vdupq_n_f32(h == 0 ? s0 : s1);
    float32x4_t v[4] = {vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), vcvtq_f32_s32(vmovl_high_s16(lo)),
                        vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))), vcvtq_f32_s32(vmovl_high_s16(hi))};
    for (float32x4_t& e : v) {
      e = vmulq_f32(s, e);
      if (sub != nullptr) e = vsubq_f32(rounded(e), vdupq_n_f32(*sub));
    }
    store_bf16(w + 16 * h, v[0], v[1]);
    store_bf16(w + 16 * h + 8, v[2], v[3]);
  }
}

inline uint8x16_t shr(uint8x16_t v, int n) { return vshlq_u8(v, vdupq_n_s8(static_cast<int8_t>(-n))); }
inline int8x16_t s8(uint8x16_t v) { return vreinterpretq_s8_u8(v); }
constexpr int8_t kMxfp4DoubledI8[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// decode_chunk_scalar's bits: the codes of chunk c as int8 (q[0]: values 0-15, q[1]: 16-31), then scale_store.
void decode_chunk(GType t, const uint8_t* row, int64_t c, uint16_t* w) {
  const uint8x16_t m4 = vdupq_n_u8(15);
  int8x16_t q[2];
  if (t == GType::kQ8_0) {
    const uint8_t* b = row + 34 * c;
    for (int h = 0; h < 2; ++h) q[h] = vld1q_s8(reinterpret_cast<const int8_t*>(b + 2 + 16 * h));
    scale_store(w, q, f16(b), f16(b), nullptr);
  } else if (t == GType::kQ4_0 || t == GType::kMxfp4) {
    const bool q4 = t == GType::kQ4_0;
    const uint8_t* b = row + (q4 ? 18 : 17) * c;
    const uint8x16_t v = vld1q_u8(b + (q4 ? 2 : 1)), n[2] = {vandq_u8(v, m4), vshrq_n_u8(v, 4)};
    for (int h = 0; h < 2; ++h) q[h] = q4 ? vsubq_s8(s8(n[h]), vdupq_n_s8(8)) : vqtbl1q_s8(vld1q_s8(kMxfp4DoubledI8), n[h]);
    const float scale = q4 ? f16(b) : mxfp4_scale(b[0]);
    scale_store(w, q, scale, scale, nullptr);
  } else if (t == GType::kQ4_K || t == GType::kQ5_K) {
    const bool q5 = t == GType::kQ5_K;
    const int j = static_cast<int>(c & 7);
    const uint8_t* b = row + (q5 ? 176 : 144) * (c >> 3);
    int sc, m;
    scale_min_k4(j, b + 4, sc, m);
    const float d = f16(b) * static_cast<float>(sc), dm = f16(b + 2) * static_cast<float>(m);
    for (int h = 0; h < 2; ++h) {
      uint8x16_t u = vandq_u8(shr(vld1q_u8(b + (q5 ? 48 : 16) + 32 * (j >> 1) + 16 * h), 4 * (j & 1)), m4);
      if (q5) u = vorrq_u8(u, vshlq_n_u8(vandq_u8(shr(vld1q_u8(b + 16 + 16 * h), j), vdupq_n_u8(1)), 4));
      q[h] = s8(u);
    }
    scale_store(w, q, d, d, &dm);
  } else {  // Q6_K
    const uint8_t* b = row + 210 * (c >> 3);
    const int e0 = 32 * static_cast<int>(c & 7), half = e0 >> 7, within = e0 & 127;
    for (int h = 0; h < 2; ++h) {
      const uint8x16_t lo = vandq_u8(shr(vld1q_u8(b + 64 * half + (within & 63) + 16 * h), 4 * (within >> 6)), m4);
      const uint8x16_t hi = vandq_u8(shr(vld1q_u8(b + 128 + 32 * half + 16 * h), 2 * (within >> 5)), vdupq_n_u8(3));
      q[h] = vsubq_s8(s8(vorrq_u8(lo, vshlq_n_u8(hi, 4))), vdupq_n_s8(32));
    }
    const float d = f16(b + 208);
    const auto* sc = reinterpret_cast<const int8_t*>(b + 192 + e0 / 16);
    scale_store(w, q, d * static_cast<float>(sc[0]), d * static_cast<float>(sc[1]), nullptr);
  }
}

#else

inline void decode_chunk(GType t, const uint8_t* row, int64_t c, uint16_t* w) { decode_chunk_scalar(t, row, c, w); }

#endif

template <int MB>
void block_dots(const uint16_t* blk, int64_t k, const uint16_t* const* xs, float (*res)[4]) {
  moeserve_canon::block4_dots<MB>(blk, k, xs, res, 0);
}

#endif

}  // namespace

int64_t gguf_row_bytes(GType t, int64_t k) {
  switch (t) {
    case GType::kQ8_0: return k / 32 * 34;
    case GType::kQ4_0: return k / 32 * 18;
    case GType::kMxfp4: return k / 32 * 17;
    case GType::kQ4_K: return k / 256 * 144;
    case GType::kQ5_K: return k / 256 * 176;
    case GType::kQ6_K: return k / 256 * 210;
  }
  return 0;
}

const char* gguf_implementation() {
#if defined(MOESERVE_CANON_AVX512)
  return "avx512bf16";
#elif defined(MOESERVE_CANON_NEON)
  return "neon";
#else
  return "scalar";
#endif
}

int64_t gguf_block_elems(GType t) {
  return t == GType::kQ4_K || t == GType::kQ5_K || t == GType::kQ6_K ? 256 : 32;
}

void gguf_rows4_dots(const GRow* rows, int64_t k, const uint16_t* const* xs, int mb, float (*res)[4], bool prefetch) {
  const GType t = rows[0].type;  // the 4 rows of a block lie in one shard: one type
  const int64_t row_bytes = gguf_row_bytes(t, k);
#if defined(MOESERVE_CANON_AVX512)
  switch (t) {
    case GType::kQ8_0: dots4_any<GType::kQ8_0>(rows, k, row_bytes, xs, mb, res, prefetch); break;
    case GType::kQ4_0: dots4_any<GType::kQ4_0>(rows, k, row_bytes, xs, mb, res, prefetch); break;
    case GType::kMxfp4: dots4_any<GType::kMxfp4>(rows, k, row_bytes, xs, mb, res, prefetch); break;
    case GType::kQ4_K: dots4_any<GType::kQ4_K>(rows, k, row_bytes, xs, mb, res, prefetch); break;
    case GType::kQ5_K: dots4_any<GType::kQ5_K>(rows, k, row_bytes, xs, mb, res, prefetch); break;
    case GType::kQ6_K: dots4_any<GType::kQ6_K>(rows, k, row_bytes, xs, mb, res, prefetch); break;
  }
#else
  static thread_local std::vector<uint16_t> blk;
  if (static_cast<int64_t>(blk.size()) < 4 * k) blk.resize(4 * k);
  NextRows next(rows, row_bytes, k);
  for (int64_t c = 0; c < k / 32; ++c) {
    if (prefetch) next.fetch(c);
    for (int r = 0; r < 4; ++r) decode_chunk(t, rows[r].bytes, c, blk.data() + 128 * c + 32 * r);
  }
  switch (mb) {
    case 1: block_dots<1>(blk.data(), k, xs, res); break;
    case 2: block_dots<2>(blk.data(), k, xs, res); break;
    case 3: block_dots<3>(blk.data(), k, xs, res); break;
    default: block_dots<4>(blk.data(), k, xs, res); break;
  }
#endif
}

void gguf_decode_row(const GRow& row, int64_t k, uint16_t* w) {
#if defined(MOESERVE_CANON_AVX512)
  switch (row.type) {
    case GType::kQ8_0: decode_into<GType::kQ8_0>(row.bytes, k, w); break;
    case GType::kQ4_0: decode_into<GType::kQ4_0>(row.bytes, k, w); break;
    case GType::kMxfp4: decode_into<GType::kMxfp4>(row.bytes, k, w); break;
    case GType::kQ4_K: decode_into<GType::kQ4_K>(row.bytes, k, w); break;
    case GType::kQ5_K: decode_into<GType::kQ5_K>(row.bytes, k, w); break;
    case GType::kQ6_K: decode_into<GType::kQ6_K>(row.bytes, k, w); break;
  }
#else
  for (int64_t c = 0; c < k / 32; ++c) decode_chunk(row.type, row.bytes, c, w + 32 * c);
#endif
}

}  // namespace moeserve_q4
