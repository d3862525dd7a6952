// The numeric core of the interleaved SwiGLU expert ops (moe_swiglu_interleaved_ and moe_swiglu_int8_interleaved_,
// moe_experts.cpp) as plain C++ without ATen: the ops run it with the thread count torch gives them, and the aarch64
// harness (tests/kernels/harness/) builds it alone, for any ISA, to check its bits against the x86 builds under qemu.
// Also the pieces the plain-layout op (csrc/moe_plain.h) shares: Expert, Scratch, the bf16 roundings, silu, the
// token groups, the SwiGLU rows and the add into `out`.
//
// Units whose gate_up [2I, H] and down [H, I] are stored in the dense GEMV's row-interleaved layout (rows in
// blocks of 4, the 32-element chunks of a block's 4 rows side by side: see csrc/dense_gemv.cpp and
// moeserve.models.layers.base.interleave_rows; 2I, H % 4 == 0 and H, I % 32 == 0, no leftover rows), or for int8 in
// pack_int8_rows' layout (csrc/dense_gemv_int8.cpp) with float32 row scales. A block is ONE sequential stream
// feeding 4 output rows: in a C++ loop shaped like this op (2 threads, alternated in one process) it streamed
// 1.17x faster than one row at a time on the plain layout (28.5 vs 24.3 GB/s), which itself beats 4 plain rows
// side by side (4 streams per thread); the whole op in scripts/bench_gemv.py: 1.07-1.12x.
//
// Numerics: each (token, row) dot product follows the canonical order (csrc/canonical_dot.h: 16 fp32 lanes as
// vdpbf16ps fills them over the 32-element chunks in order, a fixed halving sum; int8 codes through
// csrc/canonical_int8.h: their values, exact in bf16, in the same order; the same bits on every ISA), an int8 row's
// fp32 dot times the row's scale, then exactly the roundings of the plain op (g, u, silu, product, down output,
// times the weight, the add into `out`, expert after expert): the same bits as the plain-layout op on the same
// values. Resident and offloaded units both hold this layout, so they stay bit-identical. Any token count: with more than one token
// an expert's block stays in L1 while groups of 4 tokens pass over it (prefill reads each weight once).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "bf16_bits.h"
#include "canonical_dot.h"
#include "canonical_int8.h"

namespace moeserve_moe {

// bf16 bits <-> float (csrc/bf16_bits.h).
inline float bf16_to_f(uint16_t b) { return moeserve_csrc::bits_to_f(static_cast<uint32_t>(b) << 16); }
inline uint16_t f_to_bf16(float f) { return moeserve_csrc::bf16_bits(f); }

inline float round_bf16(float f) { return bf16_to_f(f_to_bf16(f)); }

struct Expert {
  const void* gate_up;  // [2I, H]
  const void* down;     // [H, I]
  const float* gate_up_scale;  // [2I] (int8) or null
  const float* down_scale;     // [H] (int8) or null
  int64_t lo, hi;              // its (token, weight) pairs: token_of[lo:hi], weight_of[lo:hi]
  int64_t pair0;               // index of its first pair in the scratch rows
};

// Scratch reused across calls by the calling thread (grown, never shrunk): no page faults on the hot path.
struct Scratch {
  std::vector<float> gu;        // [P, 2I] gate_up outputs (rounded as the compute dtype)
  std::vector<float> act_f;     // [P, I] activations (fp32 compute)
  std::vector<uint16_t> act_h;  // [P, I] activations (bf16 compute; rows padded to whole chunks where needed)
  std::vector<uint16_t> x_pad;  // [P, H] token rows padded to whole chunks (plain op, H % 32 != 0)
};

template <typename T>
inline T* grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

// The OpenMP team of the calling region (one thread where OpenMP is not compiled in: the phases then run in turn).
inline int team_size() {
#ifdef _OPENMP
  return omp_get_num_threads();
#else
  return 1;
#endif
}
inline int team_member() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

// fn(t0, std::integral_constant<int, MB>{}) for each group [t0, t0 + MB) of up to 4 of the n rows, in order: the
// row count of the canonical dots (canonical_dot.h, canonical_int8.h) as a template argument.
template <typename Fn>
inline void for_row_groups(int64_t n, Fn&& fn) {
  for (int64_t t0 = 0; t0 < n; t0 += 4) {
    switch (std::min<int64_t>(4, n - t0)) {
      case 1: fn(t0, std::integral_constant<int, 1>{}); break;
      case 2: fn(t0, std::integral_constant<int, 2>{}); break;
      case 3: fn(t0, std::integral_constant<int, 3>{}); break;
      default: fn(t0, std::integral_constant<int, 4>{}); break;
    }
  }
}

// The activations a = silu(g) * u of this thread's share [i0, i1) of the pairs x I values, rounded as torch rounds
// each op in the compute dtype (bf16: silu(g), then the product), into act rows of stride `stride` (>= I).
template <typename AT>
inline void swiglu_rows(const float* gu, AT* act, int64_t isz, int64_t stride, int64_t i0, int64_t i1) {
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t p = i / isz, j = i % isz;
    const float g = gu[p * 2 * isz + j], u = gu[p * 2 * isz + isz + j];
    if constexpr (std::is_same_v<AT, uint16_t>) act[p * stride + j] = f_to_bf16(round_bf16(round_bf16(silu(g)) * u));
    else act[p * stride + j] = silu(g) * u;
  }
}

// out_row[h] += w * d in bf16 as MoEBlock rounds it: down's output d rounded, times the routing weight rounded,
// the add rounded (expert after expert: the same bits whatever the chunking).
inline void add_bf16(uint16_t* o, float d, float w) { *o = f_to_bf16(bf16_to_f(*o) + round_bf16(round_bf16(d) * w)); }

// The first pass over a block (the one reading memory) fetches 4 KiB ahead by hand, whatever the token count: at
// 1 token the op streamed at 30-31 GB/s without it and 38-52 GB/s with it, the same as the dense GEMV and the
// plain-layout op (scripts/bench_gemv.py, variants alternated, 2026-11-23).
constexpr int64_t kBlockPrefetchBytes = 4096;

// The block kinds: dots<MB>(blk, k, xs, res, pf) gives res[m][r] = dot(row r of the block, xs[m]), m < MB, on any
// ISA: bf16 blocks (csrc/canonical_dot.h), int8 blocks of sign-magnitude codes in pack_int8_rows' layout
// (csrc/canonical_int8.h; each row's dot then times its scale).
struct Bf16Block {
  using T = uint16_t;
  static constexpr bool kScaled = false;
  template <int MB>
  static void dots(const T* blk, int64_t k, const uint16_t* const* xs, float (*res)[4], int64_t pf) {
    moeserve_canon::block4_dots<MB>(blk, k, xs, res, pf);
  }
};

struct Int8Block {
  using T = int8_t;
  static constexpr bool kScaled = true;
  template <int MB>
  static void dots(const T* blk, int64_t k, const uint16_t* const* xs, float (*res)[4], int64_t pf) {
    moeserve_i8::block4_dots_i8<MB>(blk, k, xs, res, pf);
  }
};

// fn(t0, g, res) for each group of up to 4 of the nt tokens xs against one block.
template <typename B, typename Fn>
inline void over_token_groups(const typename B::T* blk, int64_t k, const uint16_t* const* xs, int64_t nt, Fn&& fn) {
  for_row_groups(nt, [&](int64_t t0, auto mb) {
    constexpr int MB = decltype(mb)::value;
    float res[4][4];
    B::template dots<MB>(blk, k, xs + t0, res, t0 == 0 ? kBlockPrefetchBytes : 0);
    fn(t0, MB, res);
  });
}

// B: Bf16Block (scales unused) or Int8Block (each row's fp32 dot times the row's scale, then the same roundings).
template <typename B>
void run_interleaved(uint16_t* out, const uint16_t* x, int64_t hsz, int64_t isz, const std::vector<Expert>& experts,
                     const int64_t* token_of, const float* weight_of, int64_t pairs, int nthreads) {
  using T = typename B::T;
  static thread_local Scratch s;
  float* gu = grow(s.gu, static_cast<size_t>(pairs * 2 * isz));
  uint16_t* act = grow(s.act_h, static_cast<size_t>(pairs * isz));
  std::vector<const uint16_t*> xrows(pairs), arows(pairs);
  for (const Expert& e : experts)
    for (int64_t p = e.lo; p < e.hi; ++p) xrows[e.pair0 + p - e.lo] = x + token_of[p] * hsz;
  for (int64_t p = 0; p < pairs; ++p) arows[p] = act + p * isz;
  const int64_t n_exp = static_cast<int64_t>(experts.size());
  const int64_t blocks_gu = 2 * isz / 4, blocks1 = n_exp * blocks_gu, blocks_h = hsz / 4;

#pragma omp parallel num_threads(nthreads)
  {
    const int nt = team_size(), tid = team_member();
    // Phase 1: the gate_up blocks of every expert, split evenly across threads.
    for (int64_t u = blocks1 * tid / nt, u1 = blocks1 * (tid + 1) / nt; u < u1; ++u) {
      const Expert& e = experts[u / blocks_gu];
      const int64_t b = u % blocks_gu;
      const T* blk = static_cast<const T*>(e.gate_up) + b * 4 * hsz;
      over_token_groups<B>(blk, hsz, xrows.data() + e.pair0, e.hi - e.lo, [&](int64_t t0, int g, float (*res)[4]) {
        for (int m = 0; m < g; ++m)
          for (int r = 0; r < 4; ++r) {
            const float v = B::kScaled ? res[m][r] * e.gate_up_scale[4 * b + r] : res[m][r];
            gu[(e.pair0 + t0 + m) * 2 * isz + 4 * b + r] = round_bf16(v);
          }
      });
    }
#pragma omp barrier
    swiglu_rows(gu, act, isz, isz, pairs * isz * tid / nt, pairs * isz * (tid + 1) / nt);
#pragma omp barrier
    // Phase 2: blocks of 4 output rows split across threads; each thread adds its rows' experts in order.
    for (const Expert& e : experts)
      for (int64_t b = blocks_h * tid / nt, b1 = blocks_h * (tid + 1) / nt; b < b1; ++b) {
        const T* blk = static_cast<const T*>(e.down) + b * 4 * isz;
        over_token_groups<B>(blk, isz, arows.data() + e.pair0, e.hi - e.lo, [&](int64_t t0, int g, float (*res)[4]) {
          for (int m = 0; m < g; ++m) {
            const int64_t p = e.lo + t0 + m;
            for (int r = 0; r < 4; ++r)
              add_bf16(out + token_of[p] * hsz + 4 * b + r,
                       B::kScaled ? res[m][r] * e.down_scale[4 * b + r] : res[m][r], weight_of[p]);
          }
        });
      }
  }
}

}  // namespace moeserve_moe
