// Attention pieces of the decode step that torch runs as dozens of small ops per layer:
//
// qk_norm_rope_cache: per-head RMSNorm of q and k (optional), NeoX rotary embedding at each token's position
//   on the first r dims of each head (r = the rotary tables' width, <= d: partial rotary, GLM-4.5; the other
//   d - r dims pass as they are),
//   and the write of k and v into the paged KV cache (row slot_mapping[i] = block * block_size + offset of token
//   i); returns the rotated q [N, heads, d]. Numerics follow
//   moeserve.models.layers.base (rms_norm, then Rotary.apply: x * cos + rotate_half(x) * sin with every product and
//   the sum rounded to the dtype, as torch's bf16 ops round), so only the fp32 sum of squares of the norm may
//   differ from the torch path, by its summation order.
//
// decode_attention: one query token per row against keys [lo, pos] of its sequence (lo = pos - window + 1
//   with a sliding window, else 0), read through the sequence's block table (key p lives in block
//   table[p / block_size], row p % block_size), with grouped-query heads. Keys are visited in ascending position
//   whatever the blocks, so the result is the same bits for any block size or block placement. The softmax follows torch's CPU flash attention
//   for bf16: scores q.k in fp32 times the scale, p = exp(s - max) in fp32, the row sum taken on the fp32 p,
//   p rounded to the dtype before p @ v (fp32 accumulation), then multiplied by 1 / sum and rounded once.
//   With sinks (gpt-oss: one learned fp32 logit per query head), the sink joins the max and the row sum
//   (exp(sink - max)) but has no value row. The op is defined per query token, so it serves prefill and mixed
//   batches too (each token against keys up to its own position, which qk_norm_rope_cache wrote first): a token's
//   result never depends on which other tokens share the call, which is what makes the engine batch-invariant.

#include <ATen/ATen.h>

#include "ops.h"
#include <ATen/Parallel.h>
#include <torch/library.h>

// The AVX-512 attention exists only where the build's ISA has it (-march=native on such a CPU): an avx2 or generic
// build (kernels/__init__.py) never chooses it, and non-x86 compilers have no immintrin.h.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && defined(__FMA__)
#define MOESERVE_HAVE_AVX512_ATTENTION 1
#include <immintrin.h>
#endif

#include <algorithm>
#include <vector>

#include "norm_common.h"

namespace moeserve_attention {

using namespace moeserve_csrc;

constexpr int64_t kMaxHeadDim = 512;

// bf16 or fp32 (callers check): f is called with a null pointer of the element type.
template <typename F>
static void dispatch_dtype(at::ScalarType st, F&& f) {
  if (st == at::kBFloat16) f(static_cast<at::BFloat16*>(nullptr));
  else f(static_cast<float*>(nullptr));
}

template <typename T, typename W>
static inline void norm_rope_head(const T* x, const W* norm_w, const T* cos, const T* sin, int64_t d, int64_t r,
                                  float eps, T* out) {
  float h[kMaxHeadDim];
  if (norm_w != nullptr) {
    const float inv = 1.0f / std::sqrt(sum_squares(x, d) / static_cast<float>(d) + eps);
    for (int64_t i = 0; i < d; ++i) h[i] = round_as<T>(load(norm_w, i) * round_as<T>(load(x, i) * inv));
  } else {
    for (int64_t i = 0; i < d; ++i) h[i] = load(x, i);
  }
  const int64_t half = r / 2;
  for (int64_t j = 0; j < half; ++j) {
    const float a = h[j], b = h[j + half];
    out[j] = from_f<T>(round_as<T>(a * load(cos, j)) + round_as<T>(-b * load(sin, j)));
    out[j + half] = from_f<T>(round_as<T>(b * load(cos, j + half)) + round_as<T>(a * load(sin, j + half)));
  }
  for (int64_t j = r; j < d; ++j) out[j] = from_f<T>(h[j]);  // exact: h holds values of T
}

at::Tensor qk_norm_rope_cache(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
                              const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                              const at::Tensor& slot_mapping, at::Tensor& k_cache, at::Tensor& v_cache, double eps) {
  TORCH_CHECK(q.dim() == 2 && k.dim() == 2 && v.dim() == 2, "qk_norm_rope_cache: q, k, v must be [N, heads*d]");
  TORCH_CHECK(q.stride(1) == 1 && k.stride(1) == 1 && v.stride(1) == 1, "qk_norm_rope_cache: rows contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "qk_norm_rope_cache: caches must be [blocks, kv_heads, block_size, d] with d contiguous");
  const auto st = q.scalar_type();
  TORCH_CHECK(st == at::kBFloat16 || st == at::kFloat, "qk_norm_rope_cache: bf16 or fp32");
  TORCH_CHECK(k.scalar_type() == st && v.scalar_type() == st && k_cache.scalar_type() == st &&
                  v_cache.scalar_type() == st && cos.scalar_type() == st && sin.scalar_type() == st,
              "qk_norm_rope_cache: one dtype for q, k, v, caches and rotary tables");
  const int64_t n = q.size(0), nkv = k_cache.size(1), d = k_cache.size(3), block_size = k_cache.size(2);
  const int64_t rows = k_cache.size(0) * block_size;
  TORCH_CHECK(d % 2 == 0 && d <= kMaxHeadDim, "qk_norm_rope_cache: even head dim <= 512");
  TORCH_CHECK(k.size(0) == n && v.size(0) == n && k.size(1) == nkv * d && v.size(1) == nkv * d &&
                  q.size(1) % d == 0,
              "qk_norm_rope_cache: shapes of q, k, v do not match the cache");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.size(1) <= d &&
                  cos.size(1) > 0 && cos.size(1) % 2 == 0 && sin.sizes() == cos.sizes(),
              "qk_norm_rope_cache: rotary tables must be contiguous [max_len, r], r even and <= d");
  const int64_t r = cos.size(1);
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
                  positions.is_contiguous() && slot_mapping.is_contiguous() && positions.numel() == n &&
                  slot_mapping.numel() == n,
              "qk_norm_rope_cache: positions and slot_mapping must be contiguous int64 [N]");
  const bool has_norm = q_norm.has_value();
  TORCH_CHECK(has_norm == k_norm.has_value(), "qk_norm_rope_cache: give both norms or neither");
  if (has_norm) {
    TORCH_CHECK(q_norm->is_contiguous() && k_norm->is_contiguous() && q_norm->numel() == d &&
                    k_norm->numel() == d && q_norm->scalar_type() == st && k_norm->scalar_type() == st,
                "qk_norm_rope_cache: per-head norm weights must be [d] in the compute dtype");
  }
  const int64_t nh = q.size(1) / d;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(pos[i] >= 0 && pos[i] < cos.size(0), "qk_norm_rope_cache: position ", pos[i], " out of range");
    TORCH_CHECK(slot[i] >= 0 && slot[i] < rows, "qk_norm_rope_cache: cache row ", slot[i], " out of range");
  }
  at::Tensor out = at::empty({n, nh, d}, q.options());
  dispatch_dtype(st, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>();
    const T* cp = cos.data_ptr<T>();
    const T* sp = sin.data_ptr<T>();
    const T* qn = has_norm ? q_norm->data_ptr<T>() : nullptr;
    const T* kn = has_norm ? k_norm->data_ptr<T>() : nullptr;
    T *kc = k_cache.data_ptr<T>(), *vc = v_cache.data_ptr<T>(), *op = out.data_ptr<T>();
    const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), ks2 = k_cache.stride(2);
    const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1), vs2 = v_cache.stride(2);
    const float e = static_cast<float>(eps);
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const T* c = cp + pos[i] * r;
        const T* s = sp + pos[i] * r;
        for (int64_t hd = 0; hd < nh; ++hd)
          norm_rope_head<T, T>(qp + i * q.stride(0) + hd * d, qn, c, s, d, r, e, op + (i * nh + hd) * d);
        for (int64_t g = 0; g < nkv; ++g) {
          const int64_t blk = slot[i] / block_size, off = slot[i] % block_size;
          norm_rope_head<T, T>(kp + i * k.stride(0) + g * d, kn, c, s, d, r, e,
                               kc + blk * ks0 + g * ks1 + off * ks2);
          std::memcpy(vc + blk * vs0 + g * vs1 + off * vs2, vp + i * v.stride(0) + g * d, d * sizeof(T));
        }
      }
    });
  });
  return out;
}

// The keys (or values) of one (sequence, kv head): block table `table`, rows `row_stride` apart inside a block,
// blocks `block_stride` apart; `base` points at the head's rows of block 0.
template <typename T>
struct Rows {
  const T* base;
  const int64_t* table;
  int64_t block_stride, row_stride, block_size;
};

// f(j, row) for the rows of positions lo .. hi-1 in order (j = position - lo), one block at a time.
template <typename T, typename F>
static inline __attribute__((always_inline)) void for_rows(const Rows<T>& r, int64_t lo, int64_t hi, F&& f) {
  int64_t p = lo;
  while (p < hi) {
    const int64_t b = p / r.block_size, off = p - b * r.block_size;
    const int64_t end = std::min(hi, (b + 1) * r.block_size);
    const T* row = r.base + r.table[b] * r.block_stride + off * r.row_stride;
    for (; p < end; ++p, row += r.row_stride) f(p - lo, row);
  }
}

// The scratch of one (sequence, kv head) item: the group's queries in fp32 [group, d], then their output
// accumulators [group, d] zeroed, then room for the scores [group, len]. Returns the queries.
template <typename T>
static inline float* stage_query(const T* q, int64_t group, int64_t d, float* scratch) {
  for (int64_t i = 0; i < group * d; ++i) {
    scratch[i] = load(q, i);
    scratch[group * d + i] = 0.0f;
  }
  return scratch;
}

// One (sequence, kv head) pair: its `group` query heads against keys [lo, hi) of the slot.
template <typename T>
static inline __attribute__((always_inline)) void attend_group(const T* q, const Rows<T>& kr, const Rows<T>& vr,
                                                                int64_t lo, int64_t hi, int64_t group, int64_t d,
                                                                float scale, const float* sinks, float* scratch,
                                                                T* out) {
  const int64_t len = hi - lo;
  float* qf = stage_query(q, group, d, scratch);
  float* acc = qf + group * d;
  float* p = acc + group * d;
  for_rows(kr, lo, hi, [&](int64_t j, const T* kj) {
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf + g * d;
      float part[16] = {0};
      int64_t i = 0;
      for (; i + 16 <= d; i += 16)
        for (int l = 0; l < 16; ++l) part[l] += qg[i + l] * load(kj, i + l);
      for (; i < d; ++i) part[0] += qg[i] * load(kj, i);
      for (int w = 8; w >= 1; w /= 2)
        for (int l = 0; l < w; ++l) part[l] += part[l + w];
      p[g * len + j] = part[0] * scale;
    }
  });
  for (int64_t g = 0; g < group; ++g) {
    float* pg = p + g * len;
    float mx = -INFINITY;
    for (int64_t j = 0; j < len; ++j) mx = std::max(mx, pg[j]);
    if (sinks != nullptr) mx = std::max(mx, sinks[g]);
    float sum = 0.0f;
    for (int64_t j = 0; j < len; ++j) {
      const float e = std::exp(pg[j] - mx);
      sum += e;
      pg[j] = round_as<T>(e);
    }
    float* ag = acc + g * d;
    for_rows(vr, lo, hi, [&](int64_t j, const T* vj) {
      const float w = pg[j];
      for (int64_t i = 0; i < d; ++i) ag[i] += w * load(vj, i);
    });
    if (sinks != nullptr) sum += std::exp(sinks[g] - mx);
    const float inv = 1.0f / sum;
    for (int64_t i = 0; i < d; ++i) out[g * d + i] = from_f<T>(ag[i] * inv);
  }
}

#define MOESERVE_ATTEND_ARGS                                                                                  \
  const T *q, const Rows<T> &kr, const Rows<T> &vr, int64_t lo, int64_t hi, int64_t group, int64_t d,          \
      float scale, const float *sinks, float *scratch, T *out
#define MOESERVE_ATTEND_CALL q, kr, vr, lo, hi, group, d, scale, sinks, scratch, out

#if defined(MOESERVE_HAVE_AVX512_ATTENTION)
#define MOESERVE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))

MOESERVE_AVX512 static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
MOESERVE_AVX512 static inline __m512 load16(const at::BFloat16* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

// Round to bf16 and back (round to nearest even; the inputs here are finite).
MOESERVE_AVX512 static inline __m512 round16(__m512 v, const at::BFloat16*) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
MOESERVE_AVX512 static inline __m512 round16(__m512 v, const float*) { return v; }

// exp(x) for x <= 0: x = n ln2 + r, |r| <= ln2/2, e^r by its Taylor series to degree 7 (relative error < 1e-8,
// below an fp32 ulp), times 2^n. Below -87 the result is flushed to 0.
MOESERVE_AVX512 static inline __m512 exp16(__m512 x) {
  const __m512 tiny = _mm512_set1_ps(-87.0f);
  const __mmask16 zero = _mm512_cmp_ps_mask(x, tiny, _CMP_LT_OQ);
  x = _mm512_max_ps(x, tiny);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~zero), _mm512_scalef_ps(p, n));
}

// attend_group with AVX-512 intrinsics, for head dims d = 16 * NV (up to 256). Same steps and roundings; the exp
// and the order of the fp32 sums of q.k differ in the last bits. Each key row is loaded once for all the group's
// heads; p @ v keeps its accumulators in registers, heads in tiles of TG (TG * NV <= 16 accumulators), each value
// row loaded once per tile: the accumulation order per output (positions ascending, one FMA each) is the scalar
// loop's, so the bits are too. (Accumulating through memory instead made each position wait on a store-to-load
// round trip: ~10x slower at a few thousand positions.)
template <typename T, int NV>
MOESERVE_AVX512 static void attend_avx512(MOESERVE_ATTEND_ARGS) {
  constexpr int TG = NV >= 16 ? 1 : 16 / NV;
  const int64_t len = hi - lo;
  float* qf = stage_query(q, group, d, scratch);
  float* p = qf + 2 * group * d;      // scores, then probabilities [group, len]
  float* inv = p + group * len;       // 1 / row sum per head [group]
  __m512 kv[NV];
  for (int64_t pos = lo; pos < hi;) {  // for_rows, spelt out: a lambda here would need the target attribute too
    const int64_t b = pos / kr.block_size, end = std::min(hi, (b + 1) * kr.block_size);
    const T* kj = kr.base + kr.table[b] * kr.block_stride + (pos - b * kr.block_size) * kr.row_stride;
    for (; pos < end; ++pos, kj += kr.row_stride) {
      const int64_t j = pos - lo;
      for (int c = 0; c < NV; ++c) kv[c] = load16(kj + 16 * c);
      for (int64_t g = 0; g < group; ++g) {
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qf + g * d), kv[0]);
        for (int c = 1; c < NV; ++c) a = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * d + 16 * c), kv[c], a);
        p[g * len + j] = _mm512_reduce_add_ps(a) * scale;
      }
    }
  }
  const T* tag = nullptr;
  for (int64_t g = 0; g < group; ++g) {
    float* pg = p + g * len;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 16 <= len; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(pg + j));
    float m = _mm512_reduce_max_ps(mx);
    for (; j < len; ++j) m = std::max(m, pg[j]);
    if (sinks != nullptr) m = std::max(m, sinks[g]);
    const __m512 mv = _mm512_set1_ps(m);
    __m512 sv = _mm512_setzero_ps();
    for (j = 0; j < len; j += 16) {
      const __mmask16 k = len - j >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (len - j)) - 1);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, pg + j), mv));
      sv = _mm512_add_ps(sv, _mm512_maskz_mov_ps(k, e));
      _mm512_mask_storeu_ps(pg + j, k, round16(e, tag));
    }
    float sum = _mm512_reduce_add_ps(sv);
    if (sinks != nullptr) sum += std::exp(sinks[g] - m);
    inv[g] = 1.0f / sum;
  }
  for (int64_t g0 = 0; g0 < group; g0 += TG) {
    const int tg = static_cast<int>(std::min<int64_t>(TG, group - g0));
    __m512 acc[TG][NV];
    for (int t = 0; t < TG; ++t)
      for (int c = 0; c < NV; ++c) acc[t][c] = _mm512_setzero_ps();
    for (int64_t pos = lo; pos < hi;) {
      const int64_t b = pos / vr.block_size, end = std::min(hi, (b + 1) * vr.block_size);
      const T* vj = vr.base + vr.table[b] * vr.block_stride + (pos - b * vr.block_size) * vr.row_stride;
      for (; pos < end; ++pos, vj += vr.row_stride) {
        const int64_t j = pos - lo;
        __m512 v[NV];
        for (int c = 0; c < NV; ++c) v[c] = load16(vj + 16 * c);
        for (int t = 0; t < TG; ++t) {
          if (t >= tg) break;
          const __m512 w = _mm512_set1_ps(p[(g0 + t) * len + j]);
          for (int c = 0; c < NV; ++c) acc[t][c] = _mm512_fmadd_ps(w, v[c], acc[t][c]);
        }
      }
    }
    for (int t = 0; t < tg; ++t) {
      alignas(64) float lanes[16];
      for (int c = 0; c < NV; ++c) {
        _mm512_store_ps(lanes, acc[t][c]);
        for (int i = 0; i < 16; ++i) out[(g0 + t) * d + 16 * c + i] = from_f<T>(lanes[i] * inv[g0 + t]);
      }
    }
  }
}

// d / 16 -> the attend_avx512 instance for that head dim.
template <typename T>
static void attend_wide(MOESERVE_ATTEND_ARGS) {
  switch (d / 16) {
#define MOESERVE_NV(n) \
  case n: attend_avx512<T, n>(MOESERVE_ATTEND_CALL); break;
    MOESERVE_NV(1) MOESERVE_NV(2) MOESERVE_NV(3) MOESERVE_NV(4) MOESERVE_NV(5) MOESERVE_NV(6) MOESERVE_NV(7)
    MOESERVE_NV(8) MOESERVE_NV(9) MOESERVE_NV(10) MOESERVE_NV(11) MOESERVE_NV(12) MOESERVE_NV(13) MOESERVE_NV(14)
    MOESERVE_NV(15) MOESERVE_NV(16)
#undef MOESERVE_NV
    default: TORCH_CHECK(false, "decode_attention: head dim ", d, " is not 16..256 in steps of 16");
  }
}

#endif  // MOESERVE_HAVE_AVX512_ATTENTION

template <typename T>
static void attend_generic(MOESERVE_ATTEND_ARGS) {
  attend_group<T>(MOESERVE_ATTEND_CALL);
}

static bool cpu_has_avx512() {
#if defined(MOESERVE_HAVE_AVX512_ATTENTION)
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
  return has;
#else
  return false;
#endif
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const std::optional<at::Tensor>& rows,
                            const at::Tensor& positions, int64_t window, double scale,
                            const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "decode_attention: q must be contiguous [N, heads, d]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1 &&
                  k_cache.sizes() == v_cache.sizes(),
              "decode_attention: caches must be [blocks, kv_heads, block_size, d] with d contiguous");
  const auto st = q.scalar_type();
  TORCH_CHECK((st == at::kBFloat16 || st == at::kFloat) && k_cache.scalar_type() == st &&
                  v_cache.scalar_type() == st,
              "decode_attention: bf16 or fp32, one dtype");
  const int64_t b = q.size(0), nh = q.size(1), d = q.size(2), nkv = k_cache.size(1), bs = k_cache.size(2);
  const int64_t num_blocks = k_cache.size(0);
  TORCH_CHECK(k_cache.size(3) == d && nh % nkv == 0, "decode_attention: head dims do not match");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.is_contiguous(),
              "decode_attention: block_tables must be contiguous int64 [sequences, max blocks]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == b,
              "decode_attention: positions must be contiguous int64 [N]");
  TORCH_CHECK(!rows.has_value() || (rows->scalar_type() == at::kLong && rows->is_contiguous() && rows->numel() == b),
              "decode_attention: rows must be contiguous int64 [N]");
  TORCH_CHECK(rows.has_value() || block_tables.size(0) == b,
              "decode_attention: without rows, one block table per query row");
  TORCH_CHECK(!sinks.has_value() || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                                      sinks->numel() == nh),
              "decode_attention: sinks must be contiguous float32 [heads]");
  const float* sink = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  const int64_t* table = block_tables.data_ptr<int64_t>();
  const int64_t* row = rows.has_value() ? rows->data_ptr<int64_t>() : nullptr;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t width = block_tables.size(1), seqs = block_tables.size(0);
  int64_t work = 0, longest = 0;
  for (int64_t i = 0; i < b; ++i) {
    const int64_t r = row == nullptr ? i : row[i];
    TORCH_CHECK(r >= 0 && r < seqs, "decode_attention: row ", r, " out of range");
    TORCH_CHECK(pos[i] >= 0 && pos[i] < width * bs, "decode_attention: position ", pos[i],
                " is past the block table");
    const int64_t lo = window > 0 ? std::max<int64_t>(0, pos[i] - window + 1) : 0;
    for (int64_t blk = lo / bs; blk <= pos[i] / bs; ++blk) {
      const int64_t id = table[r * width + blk];
      TORCH_CHECK(id >= 0 && id < num_blocks, "decode_attention: block ", id, " (position ", blk * bs,
                  ") out of range");
    }
    longest = std::max(longest, pos[i] + 1 - lo);
    work += (pos[i] + 1 - lo) * nh * d;
  }
  const int64_t group = nh / nkv;
  at::Tensor out = at::empty({b, nh * d}, q.options());
  const bool wide = cpu_has_avx512();
  // Threads only pay off past a few hundred thousand multiply-adds; below that one thread finishes first.
  const int64_t grain = work > (1 << 18) ? 1 : b * nkv;
  dispatch_dtype(st, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T *qp = q.data_ptr<T>(), *kp = k_cache.data_ptr<T>(), *vp = v_cache.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const float sc = static_cast<float>(scale);
    at::parallel_for(0, b * nkv, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch(2 * group * d + group * longest + group);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t i = item / nkv, g = item % nkv;
        const int64_t lo = window > 0 ? std::max<int64_t>(0, pos[i] - window + 1) : 0, hi = pos[i] + 1;
        const int64_t* t = table + (row == nullptr ? i : row[i]) * width;
        const T* qg = qp + (i * nh + g * group) * d;
        const Rows<T> kr{kp + g * k_cache.stride(1), t, k_cache.stride(0), k_cache.stride(2), bs};
        const Rows<T> vr{vp + g * v_cache.stride(1), t, v_cache.stride(0), v_cache.stride(2), bs};
        T* o = op + (i * nh + g * group) * d;
        const float* sk = sink == nullptr ? nullptr : sink + g * group;
#if defined(MOESERVE_HAVE_AVX512_ATTENTION)
        if (wide && d % 16 == 0 && d <= 256) {
          attend_wide<T>(qg, kr, vr, lo, hi, group, d, sc, sk, scratch.data(), o);
          continue;
        }
#endif
        attend_generic<T>(qg, kr, vr, lo, hi, group, d, sc, sk, scratch.data(), o);
      }
    });
  });
  return out;
}

}  // namespace moeserve_attention

TORCH_LIBRARY_FRAGMENT(moeserve, m) {
  m.def(
      "qk_norm_rope_cache(Tensor q, Tensor k, Tensor v, Tensor? q_norm, Tensor? k_norm, Tensor cos, Tensor sin, "
      "Tensor positions, Tensor slot_mapping, Tensor(a!) k_cache, Tensor(b!) v_cache, float eps) -> Tensor",
      &moeserve_attention::qk_norm_rope_cache);
  m.def(
      "decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor? rows, "
      "Tensor positions, int window, float scale, Tensor? sinks=None) -> Tensor",
      &moeserve_attention::decode_attention);
}
