// The numeric core of the plain-layout SwiGLU expert ops (moe_swiglu_, moe_swiglu_int8_: units as [out, in]
// matrices, moe_experts.cpp, where the math and the numerics are stated) as plain C++ without ATen, like
// csrc/moe_interleaved.h (whose shared pieces it uses): the ops run it with torch's thread count; a harness can
// build it alone for any ISA.
//
// Each weight row is read ONCE for all the tokens routed to its expert, by one thread, as one sequential stream:
// threads split the gate_up rows of all the chunk's experts, then (after a barrier) the H output rows of the down
// projections, each thread taking the same rows of every expert in order. One OpenMP region per call, two barriers.
// bf16 activations: the canonical dots (csrc/canonical_dot.h, csrc/canonical_int8.h), groups of up to 4 tokens per
// pass over a row, the first pass fetching ahead by hand. fp32 activations: dot_fma.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "canonical_dot.h"
#include "canonical_int8.h"
#include "moe_interleaved.h"

namespace moeserve_moe {

constexpr int kMaxGroup = 8;  // fp32 compute: tokens per pass over a weight row (more: re-read from L1)

// Weight element kinds.
enum class WKind { kBF16, kF32, kI8 };

#ifndef MOESERVE_PF
#define MOESERVE_PF 1024
#endif
constexpr int64_t kPrefetchBytes = MOESERVE_PF;  // software prefetch distance along the weight stream

// ------------------------------------------------------------------------------------ fp32 compute: dot_fma
// dot_fma<NT>(w row, K, xs[NT] (fp32 activation rows), res[NT]): res[t] = sum_k w[k] * xs[t][k] in fp32, weights
// fp32 or int8 codes: two accumulators per token (even / odd 16-element chunks), masked tail, a fixed reduction
// tree with AVX-512; 16 lanes summed pairwise elsewhere (the compiler vectorizes the lane loops).
inline float to_f(float v) { return v; }
inline float to_f(int8_t v) { return static_cast<float>(v); }

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const int8_t* p, __mmask16 m) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p))); }
#endif

template <int NT, typename WT>
inline void dot_fma(const WT* w, int64_t k, const float* const* xs, float* res) {
#if defined(__AVX512F__)
  __m512 a0[NT], a1[NT];
  for (int t = 0; t < NT; ++t) a0[t] = a1[t] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 32 <= k; c += 32) {
    if (kPrefetchBytes > 0 && (c * sizeof(WT)) % 64 == 0) _mm_prefetch(reinterpret_cast<const char*>(w + c) + kPrefetchBytes, _MM_HINT_T0);
    if (kPrefetchBytes > 0 && sizeof(WT) == 4) _mm_prefetch(reinterpret_cast<const char*>(w + c) + kPrefetchBytes + 64, _MM_HINT_T0);
    const __m512 w0 = load16(w + c), w1 = load16(w + c + 16);
    for (int t = 0; t < NT; ++t) {
      a0[t] = _mm512_fmadd_ps(w0, load16(xs[t] + c), a0[t]);
      a1[t] = _mm512_fmadd_ps(w1, load16(xs[t] + c + 16), a1[t]);
    }
  }
  for (; c < k; c += 16) {
    const __mmask16 m = static_cast<__mmask16>((1u << std::min<int64_t>(16, k - c)) - 1u);
    const __m512 w0 = load16(w + c, m);
    for (int t = 0; t < NT; ++t) a0[t] = _mm512_fmadd_ps(w0, load16(xs[t] + c, m), a0[t]);
  }
  for (int t = 0; t < NT; ++t) res[t] = _mm512_reduce_add_ps(_mm512_add_ps(a0[t], a1[t]));
#else
  float acc[NT][16] = {};
  for (int64_t c = 0; c < k; c += 16) {
    const int64_t n = std::min<int64_t>(16, k - c);
    for (int t = 0; t < NT; ++t)
      for (int64_t i = 0; i < n; ++i) acc[t][i] += to_f(w[c + i]) * xs[t][c + i];
  }
  for (int t = 0; t < NT; ++t) {
    for (int s = 8; s >= 1; s /= 2)
      for (int i = 0; i < s; ++i) acc[t][i] += acc[t][i + s];
    res[t] = acc[t][0];
  }
#endif
}

// res[t] = row . xs[t] for `nt` tokens (any count), in groups of up to kMaxGroup.
template <typename WT>
inline void dot_tokens(const WT* row, int64_t k, const float* const* xs, int64_t nt, float* res) {
  for (int64_t t0 = 0; t0 < nt; t0 += kMaxGroup) {
    const float* const* x = xs + t0;
    float* r = res + t0;
    switch (std::min<int64_t>(kMaxGroup, nt - t0)) {
      case 1: dot_fma<1>(row, k, x, r); break;
      case 2: dot_fma<2>(row, k, x, r); break;
      case 3: dot_fma<3>(row, k, x, r); break;
      case 4: dot_fma<4>(row, k, x, r); break;
      case 5: dot_fma<5>(row, k, x, r); break;
      case 6: dot_fma<6>(row, k, x, r); break;
      case 7: dot_fma<7>(row, k, x, r); break;
      default: dot_fma<8>(row, k, x, r); break;
    }
  }
}

// ---------------------------------------------------------------------------- bf16 compute: canonical dots
// A weight row of k elements as kp (k rounded up to 32) bf16 values, zero-padded, in a per-thread buffer: the
// canonical dot of a row that does not fill its last chunk (int8 codes as their values, exact in bf16).
inline const uint16_t* padded_row(const uint16_t* w, int64_t k, int64_t kp) {
  static thread_local std::vector<uint16_t> buf;
  uint16_t* p = grow(buf, static_cast<size_t>(kp));
  std::memcpy(p, w, k * sizeof(uint16_t));
  std::fill(p + k, p + kp, uint16_t{0});
  return p;
}
inline const uint16_t* padded_row(const int8_t* w, int64_t k, int64_t kp) {
  static thread_local std::vector<uint16_t> buf;
  uint16_t* p = grow(buf, static_cast<size_t>(kp));
  for (int64_t i = 0; i < k; ++i) p[i] = moeserve_i8::plain_code_bf16(w[i]);
  std::fill(p + k, p + kp, uint16_t{0});
  return p;
}

// res[t] = row . xs[t] for `nt` tokens, activation rows of kp elements (k rounded up to 32, zero-padded): groups
// of up to 4 tokens over the row, the first one fetching ahead by hand (the pass that reads memory).
template <typename WT>
inline void dot_tokens(const WT* row, int64_t k, int64_t kp, const uint16_t* const* xs, int64_t nt, float* res) {
  const uint16_t* padded = kp != k ? padded_row(row, k, kp) : nullptr;
  for_row_groups(nt, [&](int64_t t0, auto mb) {
    constexpr int MB = decltype(mb)::value;
    const int64_t pf = t0 == 0 ? kPrefetchBytes : 0;
    if (padded != nullptr) moeserve_canon::row_dots<MB>(padded, kp, xs + t0, res + t0);
    else if constexpr (std::is_same_v<WT, int8_t>) moeserve_i8::row_dots_i8<MB>(row, k, xs + t0, res + t0, pf);
    else moeserve_canon::row_dots<MB>(row, k, xs + t0, res + t0, pf);
  });
}

// ------------------------------------------------------------------------------------------------------- op
// Row strides of the activation rows the dots read: bf16 compute pads them to whole chunks.
template <typename XT>
constexpr int64_t dot_len(int64_t k) {
  return std::is_same_v<XT, uint16_t> ? (k + 31) / 32 * 32 : k;
}

// gate_up's input row of each pair: the token's row of x, or (bf16, H % 32 != 0) its zero-padded copy.
template <typename XT>
std::vector<const XT*> token_rows(const XT* x, int64_t hsz, const std::vector<Expert>& experts,
                                  const int64_t* token_of, int64_t pairs, Scratch& s) {
  std::vector<const XT*> rows(pairs);
  const int64_t hp = dot_len<XT>(hsz);
  for (const Expert& e : experts)
    for (int64_t p = e.lo; p < e.hi; ++p) {
      const XT* row = x + token_of[p] * hsz;
      if constexpr (std::is_same_v<XT, uint16_t>) {
        if (hp != hsz) {
          uint16_t* copy = grow(s.x_pad, static_cast<size_t>(pairs * hp)) + (e.pair0 + p - e.lo) * hp;
          std::memcpy(copy, row, hsz * sizeof(uint16_t));
          std::fill(copy + hsz, copy + hp, uint16_t{0});
          row = copy;
        }
      }
      rows[e.pair0 + p - e.lo] = row;
    }
  return rows;
}

// res[t] for the nt_e tokens of one weight row of `k` elements (kind W, bf16 or fp32 activations XT).
template <typename XT, WKind W>
inline void expert_row_dots(const void* wrow, int64_t k, const XT* const* xs, int64_t nt_e, float* res) {
  using WT = std::conditional_t<W == WKind::kI8, int8_t, std::conditional_t<W == WKind::kBF16, uint16_t, float>>;
  const WT* w = static_cast<const WT*>(wrow);
  if constexpr (std::is_same_v<XT, uint16_t>) dot_tokens(w, k, dot_len<XT>(k), xs, nt_e, res);
  else dot_tokens(w, k, xs, nt_e, res);
}

// XT: element type of x / out (uint16_t for bf16, float). W: weight kind.
template <typename XT, WKind W>
void run(XT* out, const XT* x, int64_t hsz, int64_t isz, const std::vector<Expert>& experts, const int64_t* token_of,
         const float* weight_of, int64_t pairs, int nthreads) {
  constexpr bool kBF16 = std::is_same_v<XT, uint16_t>;
  static thread_local Scratch s;
  float* gu = grow(s.gu, static_cast<size_t>(pairs * 2 * isz));
  // down's input rows per pair, in the compute dtype (bf16 values are rounded anyway), padded to whole chunks
  // for the canonical dots (zeros after the I values)
  const int64_t ip = dot_len<XT>(isz);
  XT* act = nullptr;
  if constexpr (kBF16) act = grow(s.act_h, static_cast<size_t>(pairs * ip));
  else act = grow(s.act_f, static_cast<size_t>(pairs * ip));
  for (int64_t p = 0; p < pairs && ip != isz; ++p) std::fill(act + p * ip + isz, act + (p + 1) * ip, XT{0});
  const std::vector<const XT*> xrows = token_rows(x, hsz, experts, token_of, pairs, s);
  std::vector<const XT*> arows(pairs);
  for (int64_t p = 0; p < pairs; ++p) arows[p] = act + p * ip;

  const int64_t rows1 = static_cast<int64_t>(experts.size()) * 2 * isz;
  constexpr int64_t wsize = W == WKind::kBF16 ? 2 : W == WKind::kF32 ? 4 : 1;
  int64_t max_t = 1;
  for (const Expert& e : experts) max_t = std::max(max_t, e.hi - e.lo);

#pragma omp parallel num_threads(nthreads)
  {
    const int nt = team_size(), tid = team_member();
    std::vector<float> res(static_cast<size_t>(max_t));
    // Phase 1: gate_up rows of every expert, split evenly across threads.
    for (int64_t r = rows1 * tid / nt, r1 = rows1 * (tid + 1) / nt; r < r1; ++r) {
      const Expert& e = experts[r / (2 * isz)];
      const int64_t row = r % (2 * isz), nt_e = e.hi - e.lo;
      expert_row_dots<XT, W>(static_cast<const char*>(e.gate_up) + row * hsz * wsize, hsz, xrows.data() + e.pair0, nt_e,
                      res.data());
      for (int64_t t = 0; t < nt_e; ++t) {
        const float v = W == WKind::kI8 ? res[t] * e.gate_up_scale[row] : res[t];
        gu[(e.pair0 + t) * 2 * isz + row] = kBF16 ? round_bf16(v) : v;
      }
    }
#pragma omp barrier
    swiglu_rows(gu, act, isz, ip, pairs * isz * tid / nt, pairs * isz * (tid + 1) / nt);
#pragma omp barrier
    // Phase 2: output rows h split across threads; each thread runs its rows of every expert in order.
    for (const Expert& e : experts) {
      const int64_t nt_e = e.hi - e.lo;
      for (int64_t h = hsz * tid / nt, h1 = hsz * (tid + 1) / nt; h < h1; ++h) {
        expert_row_dots<XT, W>(static_cast<const char*>(e.down) + h * isz * wsize, isz, arows.data() + e.pair0, nt_e,
                        res.data());
        for (int64_t t = 0; t < nt_e; ++t) {
          XT* o = out + token_of[e.lo + t] * hsz + h;
          const float d = W == WKind::kI8 ? res[t] * e.down_scale[h] : res[t];
          if constexpr (kBF16) add_bf16(o, d, weight_of[e.lo + t]);
          else *o = *o + d * weight_of[e.lo + t];
        }
      }
    }
  }
}

}  // namespace moeserve_moe
