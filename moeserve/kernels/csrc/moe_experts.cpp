// Fused SwiGLU MoE experts for decode: one call per MoE layer and chunk of experts.
//
//   for each expert e of the chunk, in the order given (ascending ids), and each token t routed to it:
//     g, u  = (gate_up_e x_t)[:I], (gate_up_e x_t)[I:]      gate_up_e [2I, H], gate rows first
//     a     = silu(g) * u
//     out_t += w_t * (down_e a)                               down_e [H, I], w_t the routing weight
//
// Each weight row is read ONCE for all the tokens routed to its expert (a batch of 8 costs little more than a
// batch of 1), by one thread, as one sequential stream: threads split the gate_up rows of all the chunk's experts,
// then (after a barrier) the H output rows of the down projections, each thread taking the same rows of every
// expert in order. One OpenMP region per call, two barriers.
//
// Numerics. Dot products accumulate in fp32 with a fixed order per token (two accumulators, even and odd
// 32-element chunks, a fixed reduction tree): the result of a token does not depend on the other tokens, the
// thread count or where the weights live. Every other step takes torch's roundings in the compute dtype, as
// `swiglu_expert` + `MoEBlock` do with torch ops: for bf16, g and u are rounded to bf16, silu(g) is rounded, the
// product is rounded, down's output is rounded, times the routing weight rounded, and the add into `out` rounded
// (bf16, expert after expert: the same bits whatever the chunking, so offloaded == resident). For fp32 nothing is
// rounded in between. Only the order of the additions inside each dot product differs from torch's GEMM.
//
// int8 weights (int8 [out, in] + fp32 per-row scales) are read as they are (half the bytes of bf16): the codes are
// converted to bf16 (exact) and multiplied with the bf16 activations by vdpbf16ps (fp32 compute: to fp32, FMA),
// the row's scale applied once to the fp32 sum: dot(codes, x) * scale, then the roundings above. The torch path
// (Int8Kernel) instead rounds codes * scale to a bf16 buffer first and runs a bf16 GEMM, so it carries one extra
// rounding per weight (relative 2^-9): the two agree to a few bf16 steps, not bit for bit; the op is as close to
// the exact result as the torch path (tests/kernels/test_moe_experts.py). Offloaded and resident int8 both run
// this op, so they stay bit-identical.

#include <ATen/ATen.h>

#include "ops.h"
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "int8_codes.h"
#include "moe_interleaved.h"
#include "norm_common.h"

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace moeserve_moe {

constexpr int kMaxGroup = 8;  // tokens per pass over a weight row (more: the row is re-read from L1)


// Weight element kinds.
enum class WKind { kBF16, kF32, kI8 };

// ------------------------------------------------------------------------------------------------ dot kernels
// dot_rows<NT>(w row, K, xs[NT] (activation rows), res[NT]): res[t] = sum_k w[k] * xs[t][k] in fp32 with a fixed
// per-token order. For kBF16 the activations are bf16 (uint16), for kF32 and kI8 they are fp32.

#if defined(__AVX512F__)
inline __m512 load_bf16x16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline __m512 load_bf16x16_mask(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline __m512 load_i8x16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
inline __m512 load_i8x16_mask(const int8_t* p, __mmask16 m) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}
inline __mmask16 tail_mask16(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }
#endif

#ifndef MOESERVE_PF
#define MOESERVE_PF 1024
#endif
constexpr int64_t kPrefetchBytes = MOESERVE_PF;  // software prefetch distance along the weight stream

inline float to_f(float v) { return v; }
inline float to_f(int8_t v) { return static_cast<float>(v); }
inline float to_f(uint16_t v) { return bf16_to_f(v); }

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) { return load_bf16x16(p); }
inline __m512 load16(const int8_t* p) { return load_i8x16(p); }
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const uint16_t* p, __mmask16 m) { return load_bf16x16_mask(p, m); }
inline __m512 load16(const int8_t* p, __mmask16 m) { return load_i8x16_mask(p, m); }
#endif

// FMA in fp32 of weights WT (fp32, bf16 or int8 codes) and activations XT (fp32 or bf16): two accumulators per
// token (even / odd 16-element chunks), masked tail, a fixed reduction tree.
template <int NT, typename WT, typename XT>
inline void dot_fma(const WT* w, int64_t k, const XT* const* xs, float* res) {
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
    const __mmask16 m = tail_mask16(std::min<int64_t>(16, k - c));
    const __m512 w0 = load16(w + c, m);
    for (int t = 0; t < NT; ++t) a0[t] = _mm512_fmadd_ps(w0, load16(xs[t] + c, m), a0[t]);
  }
  for (int t = 0; t < NT; ++t) res[t] = _mm512_reduce_add_ps(_mm512_add_ps(a0[t], a1[t]));
#else
  // Portable: 16 lanes per token, summed pairwise at the end (the compiler vectorizes the lane loops).
  float acc[NT][16] = {};
  for (int64_t c = 0; c < k; c += 16) {
    const int64_t n = std::min<int64_t>(16, k - c);
    for (int t = 0; t < NT; ++t)
      for (int64_t i = 0; i < n; ++i) acc[t][i] += to_f(w[c + i]) * to_f(xs[t][c + i]);
  }
  for (int t = 0; t < NT; ++t) {
    for (int s = 8; s >= 1; s /= 2)
      for (int i = 0; i < s; ++i) acc[t][i] += acc[t][i + s];
    res[t] = acc[t][0];
  }
#endif
}

template <int NT>
inline void dot_bf16(const uint16_t* w, int64_t k, const uint16_t* const* xs, float* res) {
#if defined(__AVX512BF16__)
  __m512 a0[NT], a1[NT];
  for (int t = 0; t < NT; ++t) a0[t] = a1[t] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 64 <= k; c += 64) {
    if constexpr (kPrefetchBytes > 0) {
      _mm_prefetch(reinterpret_cast<const char*>(w + c) + kPrefetchBytes, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + c) + kPrefetchBytes + 64, _MM_HINT_T0);
    }
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + c);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + c + 32);
    for (int t = 0; t < NT; ++t) {
      a0[t] = _mm512_dpbf16_ps(a0[t], w0, (__m512bh)_mm512_loadu_si512(xs[t] + c));
      a1[t] = _mm512_dpbf16_ps(a1[t], w1, (__m512bh)_mm512_loadu_si512(xs[t] + c + 32));
    }
  }
  if (c + 32 <= k) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + c);
    for (int t = 0; t < NT; ++t) a0[t] = _mm512_dpbf16_ps(a0[t], w0, (__m512bh)_mm512_loadu_si512(xs[t] + c));
    c += 32;
  }
  if (c < k) {
    const __mmask32 m = static_cast<__mmask32>((1ull << (k - c)) - 1ull);
    const __m512bh w1 = (__m512bh)_mm512_maskz_loadu_epi16(m, w + c);
    for (int t = 0; t < NT; ++t)
      a1[t] = _mm512_dpbf16_ps(a1[t], w1, (__m512bh)_mm512_maskz_loadu_epi16(m, xs[t] + c));
  }
  for (int t = 0; t < NT; ++t) res[t] = _mm512_reduce_add_ps(_mm512_add_ps(a0[t], a1[t]));
#else
  dot_fma<NT>(w, k, xs, res);
#endif
}

template <int NT>
inline void dot_f32(const float* w, int64_t k, const float* const* xs, float* res) { dot_fma<NT>(w, k, xs, res); }

template <int NT>
inline void dot_i8(const int8_t* w, int64_t k, const float* const* xs, float* res) { dot_fma<NT>(w, k, xs, res); }

// int8 codes with bf16 activations: with AVX512-BF16 the codes are converted to bf16 (exact: |code| <= 127 needs 7
// bits) and multiplied with vdpbf16ps, 32 per instruction, so a batch of tokens costs one conversion per weight
// (the fp32 FMA path converts once too, but then needs twice the multiply instructions). Products are exact either
// way; only the order of the fp32 additions differs.
template <int NT>
inline void dot_i8(const int8_t* w, int64_t k, const uint16_t* const* xs, float* res) {
#if defined(__AVX512BF16__)
  __m512 a0[NT], a1[NT];
  for (int t = 0; t < NT; ++t) a0[t] = a1[t] = _mm512_setzero_ps();
  auto codes32 = [](const int8_t* p, __mmask32 m) {
    const __m256i b = _mm256_maskz_loadu_epi8(m, p);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
    return _mm512_cvtne2ps_pbh(hi, lo);  // element i = code i
  };
  int64_t c = 0;
  for (; c + 64 <= k; c += 64) {
    if constexpr (kPrefetchBytes > 0) _mm_prefetch(reinterpret_cast<const char*>(w + c) + kPrefetchBytes, _MM_HINT_T0);
    const __m512bh w0 = codes32(w + c, ~__mmask32(0)), w1 = codes32(w + c + 32, ~__mmask32(0));
    for (int t = 0; t < NT; ++t) {
      a0[t] = _mm512_dpbf16_ps(a0[t], w0, (__m512bh)_mm512_loadu_si512(xs[t] + c));
      a1[t] = _mm512_dpbf16_ps(a1[t], w1, (__m512bh)_mm512_loadu_si512(xs[t] + c + 32));
    }
  }
  for (; c < k; c += 32) {
    const __mmask32 m = k - c >= 32 ? ~__mmask32(0) : static_cast<__mmask32>((1ull << (k - c)) - 1ull);
    const __m512bh w0 = codes32(w + c, m);
    for (int t = 0; t < NT; ++t)
      a0[t] = _mm512_dpbf16_ps(a0[t], w0, (__m512bh)_mm512_maskz_loadu_epi16(m, xs[t] + c));
  }
  for (int t = 0; t < NT; ++t) res[t] = _mm512_reduce_add_ps(_mm512_add_ps(a0[t], a1[t]));
#else
  dot_fma<NT>(w, k, xs, res);
#endif
}

// res[t] = row . xs[t] for `nt` tokens (any count), in groups of up to kMaxGroup.
template <WKind W, typename XT>
inline void dot_tokens(const void* row, int64_t k, const XT* const* xs, int64_t nt, float* res) {
  for (int64_t t0 = 0; t0 < nt; t0 += kMaxGroup) {
    const int64_t g = std::min<int64_t>(kMaxGroup, nt - t0);
    const XT* const* x = xs + t0;
    float* r = res + t0;
#define MOESERVE_DOT_CASE(N)                                                                   \
  case N:                                                                                      \
    if constexpr (W == WKind::kBF16) dot_bf16<N>(static_cast<const uint16_t*>(row), k, x, r); \
    else if constexpr (W == WKind::kF32) dot_f32<N>(static_cast<const float*>(row), k, x, r); \
    else dot_i8<N>(static_cast<const int8_t*>(row), k, x, r);                                  \
    break;
    switch (g) {
      MOESERVE_DOT_CASE(1)
      MOESERVE_DOT_CASE(2)
      MOESERVE_DOT_CASE(3)
      MOESERVE_DOT_CASE(4)
      MOESERVE_DOT_CASE(5)
      MOESERVE_DOT_CASE(6)
      MOESERVE_DOT_CASE(7)
      MOESERVE_DOT_CASE(8)
    }
#undef MOESERVE_DOT_CASE
  }
}

// ------------------------------------------------------------------------------------------------------- op

// XT: element type of x / out (uint16_t for bf16, float). W: weight kind.
template <typename XT, WKind W>
void run(XT* out, const XT* x, int64_t hsz, int64_t isz, const std::vector<Expert>& experts, const int64_t* token_of,
         const float* weight_of, int64_t pairs) {
  constexpr bool kBF16 = std::is_same_v<XT, uint16_t>;
  static thread_local Scratch s;
  float* gu = grow(s.gu, static_cast<size_t>(pairs * 2 * isz));
  // Activation rows (down's input, in the compute dtype: bf16 values are rounded anyway) and gate_up's input
  // rows (the token rows themselves), per pair.
  using AT = XT;
  AT* act = nullptr;
  if constexpr (kBF16) act = grow(s.act_h, static_cast<size_t>(pairs * isz));
  else act = grow(s.act_f, static_cast<size_t>(pairs * isz));
  std::vector<const AT*> xrows(pairs);
  for (const Expert& e : experts)
    for (int64_t p = e.lo; p < e.hi; ++p) xrows[e.pair0 + p - e.lo] = x + token_of[p] * hsz;
  std::vector<const AT*> arows(pairs);
  for (int64_t p = 0; p < pairs; ++p) arows[p] = act + p * isz;

  const int64_t n_exp = static_cast<int64_t>(experts.size());
  const int64_t rows1 = n_exp * 2 * isz;
  constexpr int64_t wsize = W == WKind::kBF16 ? 2 : W == WKind::kF32 ? 4 : 1;
  const int nthreads = at::in_parallel_region() ? 1 : std::max(1, at::get_num_threads());
  const int64_t max_t = std::max<int64_t>(1, [&] {
    int64_t m = 0;
    for (const Expert& e : experts) m = std::max(m, e.hi - e.lo);
    return m;
  }());

#pragma omp parallel num_threads(nthreads)
  {
    const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
    std::vector<float> res(static_cast<size_t>(max_t));
    // Phase 1: gate_up rows of every expert, split evenly across threads.
    {
      const int64_t r0 = rows1 * tid / nt, r1 = rows1 * (tid + 1) / nt;
      for (int64_t r = r0; r < r1; ++r) {
        const Expert& e = experts[r / (2 * isz)];
        const int64_t row = r % (2 * isz), nt_e = e.hi - e.lo;
        const char* wrow = static_cast<const char*>(e.gate_up) + row * hsz * wsize;
        dot_tokens<W, AT>(wrow, hsz, xrows.data() + e.pair0, nt_e, res.data());
        const float scale = W == WKind::kI8 ? e.gate_up_scale[row] : 1.0f;
        for (int64_t t = 0; t < nt_e; ++t) {
          const float v = W == WKind::kI8 ? res[t] * scale : res[t];
          gu[(e.pair0 + t) * 2 * isz + row] = kBF16 ? round_bf16(v) : v;
        }
      }
    }
#pragma omp barrier
    // Activation: a = silu(g) * u, rounded as torch rounds each op.
    {
      const int64_t n = pairs * isz, i0 = n * tid / nt, i1 = n * (tid + 1) / nt;
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t p = i / isz, j = i % isz;
        const float g = gu[p * 2 * isz + j], u = gu[p * 2 * isz + isz + j];
        float a;
        if constexpr (kBF16) a = round_bf16(round_bf16(silu(g)) * u);
        else a = silu(g) * u;
        if constexpr (kBF16) act[i] = f_to_bf16(a);
        else act[i] = a;
      }
    }
#pragma omp barrier
    // Phase 2: output rows h split across threads; each thread runs its rows of every expert in order.
    {
      const int64_t h0 = hsz * tid / nt, h1 = hsz * (tid + 1) / nt;
      for (const Expert& e : experts) {
        const int64_t nt_e = e.hi - e.lo;
        for (int64_t h = h0; h < h1; ++h) {
          const char* wrow = static_cast<const char*>(e.down) + h * isz * wsize;
          dot_tokens<W, AT>(wrow, isz, arows.data() + e.pair0, nt_e, res.data());
          const float scale = W == WKind::kI8 ? e.down_scale[h] : 1.0f;
          for (int64_t t = 0; t < nt_e; ++t) {
            XT* o = out + token_of[e.lo + t] * hsz + h;
            const float d = W == WKind::kI8 ? res[t] * scale : res[t];
            if constexpr (kBF16) {
              const float y = round_bf16(round_bf16(d) * weight_of[e.lo + t]);
              *o = f_to_bf16(bf16_to_f(*o) + y);
            } else {
              *o = *o + d * weight_of[e.lo + t];
            }
          }
        }
      }
    }
  }
}

// --------------------------------------------------------------------------- interleaved units (bf16 or int8)
// The layout, the numerics and run_interleaved: csrc/moe_interleaved.h (Bf16Block there). int8 units decode their
// codes to bf16 (exact) with AVX512-VBMI and multiply them with vdpbf16ps, so they exist only where those do.

// Threads for the interleaved op: torch's count, one inside a torch parallel region.
inline int op_threads() { return at::in_parallel_region() ? 1 : std::max(1, at::get_num_threads()); }

#if defined(MOESERVE_HAVE_I8_DECODE)  // int8_codes.h: the build's ISA has AVX512-BF16 and VBMI
// res[m][r] = dot(row r of the block, xs[m]) for MB tokens, the block's rows decoded by dec.rows (vdpbf16ps: the
// canonical order on the decoded bf16).
template <int MB, typename B>
inline void block_dots(const B& dec, const typename B::T* blk, int64_t k, const uint16_t* const* xs, float (*res)[4],
                       bool prefetch) {
  __m512 acc[MB][4];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_setzero_ps();
  const char* bytes = reinterpret_cast<const char*>(blk);
  for (int64_t c = 0; c < k / 32; ++c) {
    if (prefetch)
      for (int64_t l = 0; l < B::kChunkBytes; l += 64) _mm_prefetch(bytes + c * B::kChunkBytes + l + 4096, _MM_HINT_T0);
    __m512bh w[4];
    dec.rows(blk, c, w);
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(xs[m] + c * 32);
      for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], w[r], xv);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < 4; ++r) res[m][r] = _mm512_reduce_add_ps(acc[m][r]);
}

struct Int8Block {  // sign-magnitude codes in pack_int8_rows' layout (see csrc/dense_gemv_int8.cpp)
  using T = int8_t;
  static constexpr int64_t kChunkBytes = 4 * 32;
  moeserve_csrc::Lut lut = moeserve_csrc::make_lut();
  void rows(const T* blk, int64_t c, __m512bh* w) const {
    moeserve_csrc::decode_pair(blk + c * 128, lut, w[0], w[1]);
    moeserve_csrc::decode_pair(blk + c * 128 + 64, lut, w[2], w[3]);
  }
  template <int MB>
  void dots(const T* blk, int64_t k, const uint16_t* const* xs, float (*res)[4], bool prefetch) const {
    block_dots<MB>(*this, blk, k, xs, res, prefetch);
  }
};
#endif

// bf16 units: the canonical order compiles on every ISA, so the op is always there.
bool interleaved_supported() { return true; }

bool int8_interleaved_supported() {
#if defined(MOESERVE_HAVE_I8_DECODE)  // int8_codes.h: the build's ISA has AVX512-BF16 and VBMI
  return true;
#else
  return false;
#endif
}

void check_common(const at::Tensor& out, const at::Tensor& x, const at::Tensor& token_of, const at::Tensor& weight_of,
                  const std::vector<int64_t>& bounds, size_t n_exp) {
  TORCH_CHECK(out.device().is_cpu() && x.device().is_cpu(), "moe_swiglu: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && out.sizes() == x.sizes() && out.dtype() == x.dtype(), "moe_swiglu: out and x [N, H]");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous(), "moe_swiglu: out and x must be contiguous");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "moe_swiglu: bf16 or fp32 x");
  TORCH_CHECK(token_of.scalar_type() == at::kLong && token_of.dim() == 1 && token_of.is_contiguous(),
              "moe_swiglu: token_of int64 [P]");
  TORCH_CHECK(weight_of.scalar_type() == at::kFloat && weight_of.dim() == 1 && weight_of.is_contiguous() &&
                  weight_of.numel() == token_of.numel(),
              "moe_swiglu: weight_of float32 [P]");
  TORCH_CHECK(bounds.size() == 2 * n_exp, "moe_swiglu: bounds holds (lo, hi) of each expert");
  const int64_t n = x.size(0), p = token_of.numel();
  for (size_t i = 0; i < n_exp; ++i)
    TORCH_CHECK(0 <= bounds[2 * i] && bounds[2 * i] <= bounds[2 * i + 1] && bounds[2 * i + 1] <= p,
                "moe_swiglu: bounds out of range");
  const int64_t* tp = token_of.data_ptr<int64_t>();
  for (int64_t i = 0; i < p; ++i) TORCH_CHECK(0 <= tp[i] && tp[i] < n, "moe_swiglu: token index out of range");
}

void check_weight(const at::Tensor& w, int64_t rows, int64_t cols, at::ScalarType dtype, const char* what) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == dtype && w.dim() == 2 && w.size(0) == rows &&
                  w.size(1) == cols && w.is_contiguous(),
              "moe_swiglu: ", what, " must be a contiguous ", c10::toString(dtype), " [", rows, ", ", cols,
              "] CPU tensor, got ", w.scalar_type(), " ", w.sizes());
}

template <typename XT>
void dispatch_w(at::Tensor& out, const at::Tensor& x, int64_t isz, std::vector<Expert>& experts,
                const at::Tensor& token_of, const at::Tensor& weight_of, int64_t pairs, WKind kind) {
  XT* o = reinterpret_cast<XT*>(out.data_ptr());
  const XT* xp = reinterpret_cast<const XT*>(x.data_ptr());
  const int64_t h = x.size(1);
  const int64_t* tp = token_of.data_ptr<int64_t>();
  const float* wp = weight_of.data_ptr<float>();
  if (kind == WKind::kI8) run<XT, WKind::kI8>(o, xp, h, isz, experts, tp, wp, pairs);
  else if constexpr (std::is_same_v<XT, uint16_t>) run<XT, WKind::kBF16>(o, xp, h, isz, experts, tp, wp, pairs);
  else run<XT, WKind::kF32>(o, xp, h, isz, experts, tp, wp, pairs);
}

std::vector<Expert> collect(const at::Tensor& x, at::TensorList gate_up, at::TensorList down,
                            const std::vector<int64_t>& bounds, int64_t& isz, int64_t& pairs) {
  TORCH_CHECK(gate_up.size() == down.size(), "moe_swiglu: one gate_up and one down per expert");
  std::vector<Expert> experts;
  experts.reserve(gate_up.size());
  isz = gate_up.empty() ? 0 : gate_up[0].size(0) / 2;
  pairs = 0;
  for (size_t i = 0; i < gate_up.size(); ++i) {
    Expert e{gate_up[i].data_ptr(), down[i].data_ptr(), nullptr, nullptr, bounds[2 * i], bounds[2 * i + 1], pairs};
    if (e.hi > e.lo) {  // an expert with no tokens reads nothing
      experts.push_back(e);
      pairs += e.hi - e.lo;
    }
  }
  return experts;
}

// out += sum over the chunk's experts (see the top of the file). bf16 or fp32 weights of x's dtype.
at::Tensor moe_swiglu_(at::Tensor out, const at::Tensor& x, at::TensorList gate_up, at::TensorList down,
                       const at::Tensor& token_of, const at::Tensor& weight_of, at::IntArrayRef bounds_ref) {
  const std::vector<int64_t> bounds(bounds_ref.begin(), bounds_ref.end());
  check_common(out, x, token_of, weight_of, bounds, gate_up.size());
  int64_t isz = 0, pairs = 0;
  const int64_t h = x.size(1);
  for (size_t i = 0; i < gate_up.size(); ++i) {
    check_weight(gate_up[i], gate_up[0].size(0), h, x.scalar_type(), "gate_up");
    check_weight(down[i], h, gate_up[0].size(0) / 2, x.scalar_type(), "down");
  }
  TORCH_CHECK(gate_up.empty() || gate_up[0].size(0) % 2 == 0, "moe_swiglu: gate_up has 2I rows");
  std::vector<Expert> experts = collect(x, gate_up, down, bounds, isz, pairs);
  if (experts.empty()) return out;
  if (x.scalar_type() == at::kBFloat16) dispatch_w<uint16_t>(out, x, isz, experts, token_of, weight_of, pairs, WKind::kBF16);
  else dispatch_w<float>(out, x, isz, experts, token_of, weight_of, pairs, WKind::kF32);
  return out;
}

// The same with int8 weights [out, in] and float32 per-row scales [out].
at::Tensor moe_swiglu_int8_(at::Tensor out, const at::Tensor& x, at::TensorList gate_up, at::TensorList gate_up_scale,
                            at::TensorList down, at::TensorList down_scale, const at::Tensor& token_of,
                            const at::Tensor& weight_of, at::IntArrayRef bounds_ref) {
  const std::vector<int64_t> bounds(bounds_ref.begin(), bounds_ref.end());
  check_common(out, x, token_of, weight_of, bounds, gate_up.size());
  TORCH_CHECK(gate_up_scale.size() == gate_up.size() && down_scale.size() == down.size(),
              "moe_swiglu_int8: one scale vector per weight");
  const int64_t h = x.size(1);
  for (size_t i = 0; i < gate_up.size(); ++i) {
    const int64_t r = gate_up[0].size(0);
    check_weight(gate_up[i], r, h, at::kChar, "gate_up");
    check_weight(down[i], h, r / 2, at::kChar, "down");
    TORCH_CHECK(gate_up_scale[i].scalar_type() == at::kFloat && gate_up_scale[i].numel() == r &&
                    gate_up_scale[i].is_contiguous() && down_scale[i].scalar_type() == at::kFloat &&
                    down_scale[i].numel() == h && down_scale[i].is_contiguous(),
                "moe_swiglu_int8: scales are contiguous float32 [rows]");
  }
  int64_t isz = 0, pairs = 0;
  std::vector<Expert> experts;
  {
    int64_t p = 0;
    isz = gate_up.empty() ? 0 : gate_up[0].size(0) / 2;
    for (size_t i = 0; i < gate_up.size(); ++i) {
      Expert e{gate_up[i].data_ptr(), down[i].data_ptr(), gate_up_scale[i].data_ptr<float>(),
               down_scale[i].data_ptr<float>(), bounds[2 * i], bounds[2 * i + 1], p};
      if (e.hi > e.lo) {
        experts.push_back(e);
        p += e.hi - e.lo;
      }
    }
    pairs = p;
  }
  if (experts.empty()) return out;
  if (x.scalar_type() == at::kBFloat16) dispatch_w<uint16_t>(out, x, isz, experts, token_of, weight_of, pairs, WKind::kI8);
  else dispatch_w<float>(out, x, isz, experts, token_of, weight_of, pairs, WKind::kI8);
  return out;
}

// The same on units in the row-interleaved layout (see above): gate_up and down as flat bf16 [2I*H] and [H*I].
at::Tensor moe_swiglu_interleaved_(at::Tensor out, const at::Tensor& x, at::TensorList gate_up, at::TensorList down,
                                   const at::Tensor& token_of, const at::Tensor& weight_of, at::IntArrayRef bounds_ref) {
  const std::vector<int64_t> bounds(bounds_ref.begin(), bounds_ref.end());
  check_common(out, x, token_of, weight_of, bounds, gate_up.size());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "moe_swiglu_interleaved_: bf16 x");
  const int64_t h = x.size(1);
  const int64_t isz = gate_up.empty() ? 0 : gate_up[0].numel() / (2 * h);
  TORCH_CHECK(h % 32 == 0 && isz % 32 == 0, "moe_swiglu_interleaved_: H and I must be multiples of 32");
  for (size_t i = 0; i < gate_up.size(); ++i) {
    for (const at::Tensor& w : {gate_up[i], down[i]})
      TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kBFloat16 && w.is_contiguous(),
                  "moe_swiglu_interleaved_: gate_up and down must be contiguous bf16 CPU tensors");
    TORCH_CHECK(gate_up[i].numel() == 2 * isz * h && down[i].numel() == h * isz,
                "moe_swiglu_interleaved_: expert ", i, " has gate_up of ", gate_up[i].numel(), " and down of ",
                down[i].numel(), " elements; expected 2I*H = ", 2 * isz * h, " and H*I = ", h * isz);
  }
  int64_t unused_isz = 0, pairs = 0;
  std::vector<Expert> experts = collect(x, gate_up, down, bounds, unused_isz, pairs);
  if (experts.empty()) return out;
  run_interleaved<Bf16Block>(reinterpret_cast<uint16_t*>(out.data_ptr()), reinterpret_cast<const uint16_t*>(x.data_ptr()), h,
                  isz, experts, token_of.data_ptr<int64_t>(), weight_of.data_ptr<float>(), pairs, op_threads());
  return out;
}

// int8 units in pack_int8_rows' layout (flat codes [2I*H] and [H*I], sign-magnitude in blocks of 4 rows) with
// float32 row scales [2I] and [H]: the interleaved op on half the bytes. bf16 x only.
at::Tensor moe_swiglu_int8_interleaved_(at::Tensor out, const at::Tensor& x, at::TensorList gate_up,
                                        at::TensorList gate_up_scale, at::TensorList down, at::TensorList down_scale,
                                        const at::Tensor& token_of, const at::Tensor& weight_of,
                                        at::IntArrayRef bounds_ref) {
  TORCH_CHECK(int8_interleaved_supported(), "moe_swiglu_int8_interleaved_: built without AVX512-BF16/VBMI");
  const std::vector<int64_t> bounds(bounds_ref.begin(), bounds_ref.end());
  check_common(out, x, token_of, weight_of, bounds, gate_up.size());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "moe_swiglu_int8_interleaved_: bf16 x");
  TORCH_CHECK(gate_up_scale.size() == gate_up.size() && down.size() == gate_up.size() &&
                  down_scale.size() == gate_up.size(),
              "moe_swiglu_int8_interleaved_: one gate_up, down and scale vector of each per expert");
  const int64_t h = x.size(1);
  const int64_t isz = gate_up.empty() ? 0 : gate_up[0].numel() / (2 * h);
  TORCH_CHECK(h % 32 == 0 && isz % 32 == 0, "moe_swiglu_int8_interleaved_: H and I must be multiples of 32");
  std::vector<Expert> experts;
  int64_t pairs = 0;
  for (size_t i = 0; i < gate_up.size(); ++i) {
    for (const at::Tensor& w : {gate_up[i], down[i]})
      TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kChar && w.is_contiguous(),
                  "moe_swiglu_int8_interleaved_: gate_up and down must be contiguous int8 CPU tensors");
    TORCH_CHECK(gate_up[i].numel() == 2 * isz * h && down[i].numel() == h * isz,
                "moe_swiglu_int8_interleaved_: expert ", i, " has gate_up of ", gate_up[i].numel(), " and down of ",
                down[i].numel(), " codes; expected 2I*H = ", 2 * isz * h, " and H*I = ", h * isz);
    TORCH_CHECK(gate_up_scale[i].scalar_type() == at::kFloat && gate_up_scale[i].numel() == 2 * isz &&
                    gate_up_scale[i].is_contiguous() && down_scale[i].scalar_type() == at::kFloat &&
                    down_scale[i].numel() == h && down_scale[i].is_contiguous(),
                "moe_swiglu_int8_interleaved_: scales are contiguous float32 [2I] and [H]");
    Expert e{gate_up[i].data_ptr(), down[i].data_ptr(), gate_up_scale[i].data_ptr<float>(),
             down_scale[i].data_ptr<float>(), bounds[2 * i], bounds[2 * i + 1], pairs};
    if (e.hi > e.lo) {
      experts.push_back(e);
      pairs += e.hi - e.lo;
    }
  }
  if (experts.empty()) return out;
#if defined(MOESERVE_HAVE_I8_DECODE)  // int8_codes.h: the build's ISA has AVX512-BF16 and VBMI
  run_interleaved<Int8Block>(reinterpret_cast<uint16_t*>(out.data_ptr()), reinterpret_cast<const uint16_t*>(x.data_ptr()),
                             h, isz, experts, token_of.data_ptr<int64_t>(), weight_of.data_ptr<float>(), pairs,
                             op_threads());
#endif
  return out;
}

}  // namespace moeserve_moe

TORCH_LIBRARY_FRAGMENT(moeserve, m) {
  m.def("moe_swiglu_(Tensor(a!) out, Tensor x, Tensor[] gate_up, Tensor[] down, Tensor token_of, "
        "Tensor weight_of, int[] bounds) -> Tensor(a!)",
        &moeserve_moe::moe_swiglu_);
  m.def("moe_swiglu_int8_(Tensor(a!) out, Tensor x, Tensor[] gate_up, Tensor[] gate_up_scale, Tensor[] down, "
        "Tensor[] down_scale, Tensor token_of, Tensor weight_of, int[] bounds) -> Tensor(a!)",
        &moeserve_moe::moe_swiglu_int8_);
  m.def("moe_swiglu_interleaved_(Tensor(a!) out, Tensor x, Tensor[] gate_up, Tensor[] down, Tensor token_of, "
        "Tensor weight_of, int[] bounds) -> Tensor(a!)",
        &moeserve_moe::moe_swiglu_interleaved_);
  m.def("moe_swiglu_int8_interleaved_(Tensor(a!) out, Tensor x, Tensor[] gate_up, Tensor[] gate_up_scale, "
        "Tensor[] down, Tensor[] down_scale, Tensor token_of, Tensor weight_of, int[] bounds) -> Tensor(a!)",
        &moeserve_moe::moe_swiglu_int8_interleaved_);
  m.def("moe_interleaved_supported() -> bool", &moeserve_moe::interleaved_supported);
  m.def("moe_int8_interleaved_supported() -> bool", &moeserve_moe::int8_interleaved_supported);
}
