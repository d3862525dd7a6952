// The canonical attention (attention_core.h states the order) on the ISA the build targets: 16-lane vectors V16 of
// one __m512 (AVX-512F), two __m256 (AVX2 + FMA: lanes 0-7, 8-15) or 16 floats (scalar, any CPU); the bf16 q.k
// dots are canonical_dot.h's. The rows given together (one sequence's tokens: prefill) take three passes:
//   A) their scores against each block of kBlock positions (the block's key rows loaded once for every row and head),
//   B) per row and head: max, exp, row sum, probabilities (in place of the scores),
//   C) p @ v, each block of value rows loaded once for every row, heads x value vectors in register tiles.
// No operation of a row depends on the others: tiling only shares loads.

#include "attention_core.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "canonical_dot.h"

#if defined(__AVX512F__)
#define MOESERVE_ATTN_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define MOESERVE_ATTN_AVX2 1
#include <immintrin.h>
#endif

namespace moeserve_attn {
namespace {

using bf16 = uint16_t;  // bf16 bits

constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693145751953125f, kLn2Lo = 1.428606765330187045e-06f;
constexpr float kExpMin = -87.0f;
// exp_canon's polynomial, highest degree first: p = kPoly[0], then p = fma(p, r, kPoly[i])
constexpr float kPoly[8] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
constexpr int64_t kBlock = 64;  // positions per pass over the keys / values (their rows stay in L1 / L2)

inline float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
// fp32 -> bf16 bits, nearest-even, NaN -> the quiet NaN 0x7FC0 (norm_common.h bf16_bits)
inline bf16 bf16_of(float f) {
  const uint32_t u = to_bits(f);
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? bf16(0x7FC0) : bf16((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
inline float load1(const float* p, int64_t i) { return p[i]; }
inline float load1(const bf16* p, int64_t i) { return from_bits(static_cast<uint32_t>(p[i]) << 16); }

// -------------------------------------------------------------------------------------------------- V16
#if defined(MOESERVE_ATTN_AVX512)
constexpr const char* kIsa = "avx512";
constexpr int kTileHeads = 4, kTileVecs = 4;  // p @ v accumulators: 16 of the 32 zmm
struct V16 {
  __m512 v;
};
inline V16 zero16() { return {_mm512_setzero_ps()}; }
inline V16 set16(float x) { return {_mm512_set1_ps(x)}; }
inline V16 load16(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V16 load16(const bf16* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
}
inline void store16(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline V16 add16(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 sub16(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V16 max16(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline V16 fma16(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline float sum16(V16 a) { return _mm512_reduce_add_ps(a.v); }  // the halving sum of attention_core.h
inline float max_of16(V16 a) { return _mm512_reduce_max_ps(a.v); }
inline V16 round_bf16(V16 a) {
  const __m512i u = _mm512_castps_si512(a.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
  return {_mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))))};
}
inline V16 exp16(V16 x) {
  const __m512 lo = _mm512_set1_ps(kExpMin);
  const __mmask16 zero = _mm512_cmp_ps_mask(x.v, lo, _CMP_LT_OQ);
  const __m512 xc = _mm512_max_ps(x.v, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kPoly[0]);
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kPoly[i]));
  const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
  const __m512 pow2 = _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
  return {_mm512_maskz_mov_ps(static_cast<__mmask16>(~zero), _mm512_mul_ps(p, pow2))};
}

#elif defined(MOESERVE_ATTN_AVX2)
constexpr const char* kIsa = "avx2";
constexpr int kTileHeads = 4, kTileVecs = 1;  // 8 of the 16 ymm accumulate
struct V16 {
  __m256 lo, hi;
};
inline V16 zero16() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 set16(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V16 load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 widen8(const bf16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline V16 load16(const bf16* p) { return {widen8(p), widen8(p + 8)}; }
inline void store16(float* p, V16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline V16 add16(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 sub16(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 max16(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V16 fma16(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline float sum16(V16 a) { return moeserve_canon::halving_sum(a.lo, a.hi); }
inline float max_of16(V16 a) {
  alignas(32) float l[8];
  _mm256_store_ps(l, _mm256_max_ps(a.lo, a.hi));
  return *std::max_element(l, l + 8);
}
inline __m256 round8(__m256 a) {
  const __m256i u = _mm256_castps_si256(a);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline V16 round_bf16(V16 a) { return {round8(a.lo), round8(a.hi)}; }
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(kExpMin);
  const __m256 zero = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  const __m256 xc = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kPoly[0]);
  for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kPoly[i]));
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_andnot_ps(zero, _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23))));
}
inline V16 exp16(V16 x) { return {exp8(x.lo), exp8(x.hi)}; }

#else  // scalar: the reference, any CPU (std::fma is one rounding wherever it runs)
constexpr const char* kIsa = "scalar";
constexpr int kTileHeads = 1, kTileVecs = 1;
struct V16 {
  float l[16];
};
template <typename F>
inline V16 each(F&& f) {
  V16 r;
  for (int i = 0; i < 16; ++i) r.l[i] = f(i);
  return r;
}
inline V16 zero16() { return each([](int) { return 0.0f; }); }
inline V16 set16(float x) { return each([x](int) { return x; }); }
inline V16 load16(const float* p) { return each([p](int i) { return p[i]; }); }
inline V16 load16(const bf16* p) { return each([p](int i) { return load1(p, i); }); }
inline void store16(float* p, V16 a) { std::memcpy(p, a.l, sizeof(a.l)); }
inline V16 add16(V16 a, V16 b) { return each([&](int i) { return a.l[i] + b.l[i]; }); }
inline V16 sub16(V16 a, V16 b) { return each([&](int i) { return a.l[i] - b.l[i]; }); }
inline V16 max16(V16 a, V16 b) { return each([&](int i) { return a.l[i] > b.l[i] ? a.l[i] : b.l[i]; }); }
inline V16 fma16(V16 a, V16 b, V16 c) { return each([&](int i) { return std::fma(a.l[i], b.l[i], c.l[i]); }); }
inline float sum16(V16 a) { return moeserve_canon::halving_sum16(a.l); }
inline float max_of16(V16 a) { return *std::max_element(a.l, a.l + 16); }
inline V16 round_bf16(V16 a) {
  return each([&](int i) {
    const uint32_t u = to_bits(a.l[i]);
    return from_bits((u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u);
  });
}
inline float exp1(float x) {
  const bool zero = x < kExpMin;
  const float xc = x > kExpMin ? x : kExpMin;  // MAXPS: a NaN x reads as the bound
  const float n = std::nearbyint(xc * kLog2e);
  float r = std::fma(-n, kLn2Hi, xc);
  r = std::fma(-n, kLn2Lo, r);
  float p = kPoly[0];
  for (int i = 1; i < 8; ++i) p = std::fma(p, r, kPoly[i]);
  const float pow2 = from_bits(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
  return zero ? 0.0f : p * pow2;
}
inline V16 exp16(V16 x) { return each([&](int i) { return exp1(x.l[i]); }); }
#endif

inline float exp_one(float x) {  // exp_canon of one value, by the vector code
  float l[16];
  store16(l, exp16(set16(x)));
  return l[0];
}

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

template <typename T>
std::vector<T>& query_buf(Scratch& sc) {
  if constexpr (std::is_same_v<T, bf16>) return sc.qh; else return sc.qf;
}
template <typename T>
std::vector<T>& key_buf(Scratch& sc) {
  if constexpr (std::is_same_v<T, bf16>) return sc.kh; else return sc.kf;
}

// ------------------------------------------------------------------------------------------------ pass A
// The queries as the dots read them: [n, heads, dkp], zero-padded past dk.
template <typename T>
const T* stage_queries(const Problem& pb, const QueryRow* rows, int64_t n, int64_t dkp, Scratch& sc) {
  std::vector<T>& buf = query_buf<T>(sc);
  buf.assign(n * pb.heads * dkp, T(0));
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < pb.heads; ++h)
      std::memcpy(buf.data() + (t * pb.heads + h) * dkp, static_cast<const T*>(rows[t].q) + h * pb.q_stride,
                  pb.dk * sizeof(T));
  return buf.data();
}

// out[p - b0] = the row of position p in [b0, b1); with padded > width, a zero-padded copy in `pad`.
template <typename T>
void gather(const PagedRows& pr, int64_t b0, int64_t b1, int64_t width, int64_t padded, std::vector<T>& pad,
            std::vector<const void*>& out) {
  out.resize(b1 - b0);
  if (padded != width) pad.assign((b1 - b0) * padded, T(0));
  for (int64_t p = b0; p < b1; ++p) {
    const int64_t b = p / pr.block_size;
    const T* row = static_cast<const T*>(pr.base) + pr.table[b] * pr.block_stride + (p - b * pr.block_size) * pr.row_stride;
    if (padded != width) {
      std::memcpy(pad.data() + (p - b0) * padded, row, width * sizeof(T));
      row = pad.data() + (p - b0) * padded;
    }
    out[p - b0] = row;
  }
}

// res[m] = dot(w, xs[m]) for m < mb <= 4, w and xs [kp] (kp a multiple of 32 / 16): step 1's order.
inline void dots(const bf16* w, int64_t kp, const bf16* const* xs, int64_t mb, float* res) {
  switch (mb) {
    case 4: moeserve_canon::row_dots<4>(w, kp, xs, res); break;
    case 3: moeserve_canon::row_dots<3>(w, kp, xs, res); break;
    case 2: moeserve_canon::row_dots<2>(w, kp, xs, res); break;
    default: moeserve_canon::row_dots<1>(w, kp, xs, res); break;
  }
}
inline void dots(const float* w, int64_t kp, const float* const* xs, int64_t mb, float* res) {
  for (int64_t m = 0; m < mb; ++m) {
    V16 lanes = zero16();
    for (int64_t c = 0; c < kp; c += 16) lanes = fma16(load16(xs[m] + c), load16(w + c), lanes);
    res[m] = sum16(lanes);
  }
}

// s[h * stride] = dot(k, q_h) * scale for h < heads (the queries [heads, dkp]).
template <typename T>
void key_scores(const T* k, const T* q, int64_t heads, int64_t dkp, float scale, float* s, int64_t stride) {
  const T* xs[4];
  float res[4];
  for (int64_t h = 0; h < heads; h += 4) {
    const int64_t mb = std::min<int64_t>(4, heads - h);
    for (int64_t m = 0; m < mb; ++m) xs[m] = q + (h + m) * dkp;
    dots(k, dkp, xs, mb, res);
    for (int64_t m = 0; m < mb; ++m) s[(h + m) * stride] = res[m] * scale;
  }
}

// Per-call layout of the scratch: scores [n, heads, width] (row t, head h at (t * heads + h) * width, position
// lo_t + j at j), accumulators [n, heads, dv], 1 / row sums [n, heads].
struct Layout {
  int64_t kmin, kmax, width, dkp;
};

template <typename T>
void pass_scores(const Problem& pb, const QueryRow* rows, int64_t n, const Layout& lay, const T* q, Scratch& sc) {
  for (int64_t b0 = lay.kmin; b0 < lay.kmax; b0 += kBlock) {
    const int64_t b1 = std::min(b0 + kBlock, lay.kmax);
    gather<T>(pb.keys, b0, b1, pb.dk, lay.dkp, key_buf<T>(sc), sc.krow);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t j0 = std::max(b0, rows[t].lo), j1 = std::min(b1, rows[t].hi);
      float* s = sc.scores.data() + t * pb.heads * lay.width - rows[t].lo;
      const T* qt = q + t * pb.heads * lay.dkp;
      for (int64_t j = j0; j < j1; ++j)
        key_scores<T>(static_cast<const T*>(sc.krow[j - b0]), qt, pb.heads, lay.dkp, pb.scale, s + j, lay.width);
    }
  }
}

// ------------------------------------------------------------------------------------------------ pass B
// One row and head: scores s [len] -> probabilities (rounded to T) in place; returns 1 / row sum.
template <typename T>
float softmax_row(float* s, int64_t len, const float* sink) {
  const int64_t padded = round_up(len, 16);
  for (int64_t j = len; j < padded; ++j) s[j] = -std::numeric_limits<float>::infinity();  // e = +0: adds nothing
  V16 mx = set16(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < padded; j += 16) mx = max16(mx, load16(s + j));
  float m = max_of16(mx);
  if (sink != nullptr) m = std::max(m, *sink);
  const V16 mv = set16(m);
  V16 lanes = zero16();
  for (int64_t j = 0; j < padded; j += 16) {
    const V16 e = exp16(sub16(load16(s + j), mv));
    lanes = add16(lanes, e);
    store16(s + j, std::is_same_v<T, bf16> ? round_bf16(e) : e);
  }
  float sum = sum16(lanes);
  if (sink != nullptr) sum = sum + exp_one(*sink - m);
  return 1.0f / sum;
}

// ------------------------------------------------------------------------------------------------ pass C
// TG heads x SV vectors of 16 outputs from column c0: acc[t] (+)= sum_j p[t][j] v_j, j ascending, one fma each.
template <typename T, int TG, int SV>
void pv_tile(const void* const* vrow, int64_t nj, int64_t c0, const float* p, int64_t pstride, float* acc,
             int64_t astride, bool first) {
  V16 a[TG][SV];
  for (int t = 0; t < TG; ++t)
    for (int s = 0; s < SV; ++s) a[t][s] = first ? zero16() : load16(acc + t * astride + c0 + 16 * s);
  for (int64_t j = 0; j < nj; ++j) {
    const T* v = static_cast<const T*>(vrow[j]) + c0;
    V16 vv[SV];
    for (int s = 0; s < SV; ++s) vv[s] = load16(v + 16 * s);
    for (int t = 0; t < TG; ++t) {
      const V16 w = set16(p[t * pstride + j]);
      for (int s = 0; s < SV; ++s) a[t][s] = fma16(w, vv[s], a[t][s]);
    }
  }
  for (int t = 0; t < TG; ++t)
    for (int s = 0; s < SV; ++s) store16(acc + t * astride + c0 + 16 * s, a[t][s]);
}

// TG heads, every vector of 16 outputs (kTileVecs at a time, then the rest), then the dv % 16 tail one by one.
template <typename T, int TG>
void pv_heads(const void* const* vrow, int64_t nj, int64_t dv, const float* p, int64_t pstride, float* acc,
              int64_t astride, bool first) {
  const int64_t nv = dv / 16;
  int64_t c = 0;
  for (; c + kTileVecs <= nv; c += kTileVecs) pv_tile<T, TG, kTileVecs>(vrow, nj, 16 * c, p, pstride, acc, astride, first);
  if constexpr (kTileVecs > 1) {
    for (; c < nv; ++c) pv_tile<T, TG, 1>(vrow, nj, 16 * c, p, pstride, acc, astride, first);
  }
  for (int t = 0; t < TG; ++t)
    for (int64_t i = 16 * nv; i < dv; ++i) {
      float o = first ? 0.0f : acc[t * astride + i];
      for (int64_t j = 0; j < nj; ++j) o = std::fma(p[t * pstride + j], load1(static_cast<const T*>(vrow[j]), i), o);
      acc[t * astride + i] = o;
    }
}

template <typename T, int TG>
void pv_rest(int64_t rest, const void* const* vrow, int64_t nj, int64_t dv, const float* p, int64_t pstride,
             float* acc, int64_t astride, bool first) {
  if constexpr (TG > 0) {
    if (rest == TG) pv_heads<T, TG>(vrow, nj, dv, p, pstride, acc, astride, first);
    else pv_rest<T, TG - 1>(rest, vrow, nj, dv, p, pstride, acc, astride, first);
  }
}

template <typename T>
void pass_values(const Problem& pb, const QueryRow* rows, int64_t n, const Layout& lay, Scratch& sc) {
  for (int64_t b0 = lay.kmin; b0 < lay.kmax; b0 += kBlock) {
    const int64_t b1 = std::min(b0 + kBlock, lay.kmax);
    gather<T>(pb.values, b0, b1, pb.dv, pb.dv, key_buf<T>(sc), sc.vrow);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t j0 = std::max(b0, rows[t].lo), j1 = std::min(b1, rows[t].hi);
      if (j0 >= j1) continue;
      const float* p = sc.scores.data() + t * pb.heads * lay.width + (j0 - rows[t].lo);
      float* acc = sc.acc.data() + t * pb.heads * pb.dv;
      const void* const* vr = sc.vrow.data() + (j0 - b0);
      const bool first = j0 == rows[t].lo;
      int64_t h = 0;
      for (; h + kTileHeads <= pb.heads; h += kTileHeads)
        pv_heads<T, kTileHeads>(vr, j1 - j0, pb.dv, p + h * lay.width, lay.width, acc + h * pb.dv, pb.dv, first);
      pv_rest<T, kTileHeads - 1>(pb.heads - h, vr, j1 - j0, pb.dv, p + h * lay.width, lay.width, acc + h * pb.dv,
                                 pb.dv, first);
    }
  }
}

template <typename T>
void attend(const Problem& pb, const QueryRow* rows, int64_t n, Scratch& sc) {
  Layout lay{std::numeric_limits<int64_t>::max(), 0, 0, round_up(pb.dk, std::is_same_v<T, bf16> ? 32 : 16)};
  for (int64_t t = 0; t < n; ++t) {
    lay.kmin = std::min(lay.kmin, rows[t].lo);
    lay.kmax = std::max(lay.kmax, rows[t].hi);
    lay.width = std::max(lay.width, round_up(rows[t].hi - rows[t].lo, 16));
  }
  sc.scores.resize(n * pb.heads * lay.width);
  sc.acc.resize(n * pb.heads * pb.dv);
  sc.inv.resize(n * pb.heads);
  const T* q = stage_queries<T>(pb, rows, n, lay.dkp, sc);
  pass_scores<T>(pb, rows, n, lay, q, sc);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < pb.heads; ++h)
      sc.inv[t * pb.heads + h] = softmax_row<T>(sc.scores.data() + (t * pb.heads + h) * lay.width,
                                                rows[t].hi - rows[t].lo, pb.sinks == nullptr ? nullptr : pb.sinks + h);
  pass_values<T>(pb, rows, n, lay, sc);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < pb.heads; ++h) {
      const float* a = sc.acc.data() + (t * pb.heads + h) * pb.dv;
      const float inv = sc.inv[t * pb.heads + h];
      T* out = static_cast<T*>(rows[t].out) + h * pb.out_stride;
      for (int64_t i = 0; i < pb.dv; ++i) {
        if constexpr (std::is_same_v<T, bf16>) out[i] = bf16_of(a[i] * inv);
        else out[i] = a[i] * inv;
      }
    }
}

template <typename T>
void rows_dot_t(const T* w, int64_t n, int64_t k, const void* const* xs_in, void* const* outs, int64_t count,
                Scratch& sc) {
  const int64_t kp = round_up(k, std::is_same_v<T, bf16> ? 32 : 16);
  std::vector<T>& xpad = query_buf<T>(sc);
  std::vector<T>& wpad = key_buf<T>(sc);
  if (kp != k) {  // zero-padded copies of the inputs, and of each row below
    xpad.assign(count * kp, T(0));
    for (int64_t m = 0; m < count; ++m) std::memcpy(xpad.data() + m * kp, xs_in[m], k * sizeof(T));
    wpad.assign(kp, T(0));
  }
  const T* xs[4];
  float res[4];
  for (int64_t i = 0; i < n; ++i) {
    const T* wi = w + i * k;
    if (kp != k) {
      std::memcpy(wpad.data(), wi, k * sizeof(T));
      wi = wpad.data();
    }
    for (int64_t m0 = 0; m0 < count; m0 += 4) {
      const int64_t mb = std::min<int64_t>(4, count - m0);
      for (int64_t m = 0; m < mb; ++m)
        xs[m] = kp != k ? xpad.data() + (m0 + m) * kp : static_cast<const T*>(xs_in[m0 + m]);
      dots(wi, kp, xs, mb, res);
      for (int64_t m = 0; m < mb; ++m) {
        if constexpr (std::is_same_v<T, bf16>) static_cast<T*>(outs[m0 + m])[i] = bf16_of(res[m]);
        else static_cast<T*>(outs[m0 + m])[i] = res[m];
      }
    }
  }
}

}  // namespace

void rows_dot(Dtype dtype, const void* w, int64_t n, int64_t k, const void* const* xs, void* const* outs, int64_t count,
              Scratch& scratch) {
  if (dtype == Dtype::kBF16) rows_dot_t(static_cast<const bf16*>(w), n, k, xs, outs, count, scratch);
  else rows_dot_t(static_cast<const float*>(w), n, k, xs, outs, count, scratch);
}

std::vector<Tile> tiles_of(const int64_t* seq, const int64_t* pos, int64_t n, int64_t max_rows) {
  std::vector<Tile> tiles;
  for (int64_t i = 0; i < n; ++i) {
    if (!tiles.empty()) {
      Tile& last = tiles.back();
      const int64_t prev = last.first + last.count - 1;
      if (last.count < max_rows && seq[i] == seq[prev] && pos[i] == pos[prev] + 1) {
        ++last.count;
        continue;
      }
    }
    tiles.push_back({i, 1});
  }
  return tiles;
}

void attend_rows(const Problem& pb, const QueryRow* rows, int64_t n, Scratch& scratch) {
  if (n <= 0) return;
  if (pb.dtype == Dtype::kBF16) attend<bf16>(pb, rows, n, scratch);
  else attend<float>(pb, rows, n, scratch);
}

const char* implementation() { return kIsa; }

}  // namespace moeserve_attn
