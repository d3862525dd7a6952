// Expert op on units the plain SwiGLU ops cannot read: 4-bit experts as stored (MXFP4, NVFP4, INT4: q4_codes.cpp), GGUF
// experts as stored (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, MXFP4 blocks: gguf_codes.cpp) and gpt-oss's experts (clamped SwiGLU with biases) in bf16, one call per MoE layer and chunk of experts:
//
//   for each expert e of the chunk, in the order given (ascending ids), and each token t routed to it:
//     gu    = gate_up_e x_t (+ bias)           [R1]: SwiGLU gate rows then up rows; gpt-oss gate/up interleaved
//                                              (a GGUF's gpt-oss, act=gptoss-split: gate rows then up rows);
//                                              relu2 up rows only
//     a     = act(gu)                          [I]
//     out_t += w_t * (down_e a (+ bias))
//
// Numerics. Every (token, row) dot product is canonical_dot.h's order on bf16 weights: a 4-bit weight is the bf16
// value its format's reference decoder writes (q4_codes.cpp), a GGUF weight the bf16 cast of the gguf package's fp32
// dequantized value (gguf_codes.cpp), a bf16 weight itself. So a result depends only on its
// own token row and the weights: not on the other tokens, the thread count, where the unit lives or the ISA
// (AVX512-BF16, AVX2 + FMA and scalar give the same bits: tests/kernels/test_q4_experts.py). fmt=int4-q8
// (quantization="int4"'s units) instead quantizes each token row and each activation row to int8 per 32 elements and
// takes q4_q8.h's integer dots (the same bits on AVX-512 VNNI, AVX2 and scalar builds). Around the dots, the
// roundings of the torch ops the per-expert loop runs (unit_math.py), in bf16:
//   gu     = bf16(dot)                       and, with a bias, bf16(gu + bias)          (x @ W, then + b)
//   swiglu a = bf16(bf16(silu(g)) * u)
//   gptoss g' = min(g, L), u' = clamp(u, -L, L), a = bf16(bf16(u' + 1) * bf16(g' * bf16(sigmoid(bf16(g' alpha)))))
//   relu2  a = bf16(relu(u)^2)
//   d      = bf16(dot) (+ bias: bf16(d + bias)); out_t = bf16(out_t + bf16(d * w_t)), expert after expert
// silu / sigmoid use libm's expf (torch's vectorised exp may differ in the last bit: the op is its own reference).
//
// Work split: threads take the gate_up rows of all the chunk's experts in blocks of 4, then (after a barrier and the
// activation) blocks of down's output rows, each thread the same rows of every expert in order. A 4-bit row is
// decoded chunk by chunk in registers while up to 4 tokens use it; with more tokens (prefill) it is decoded once
// into a row buffer the tokens then read from L1. int4-q8: the token rows quantized first (threads split them), the
// activation rows after the activation (threads split the pairs), each a phase behind a barrier.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "canonical_dot.h"
#include "moe_experts_q4.h"
#include "norm_common.h"
#include "q4_q8.h"

namespace moeserve_q4 {

namespace {

inline float bf(uint16_t b) { return moeserve_csrc::bits_to_f(static_cast<uint32_t>(b) << 16); }
inline float rnd(float f) { return bf(moeserve_csrc::bf16_bits(f)); }

// Per-thread buffers, grown and reused: a row's INT4 tables and a decoded row.
struct RowScratch {
  std::vector<uint16_t> tables, row;
};

// One projection of one expert: its shards' bytes, ready to read (NVFP4 tables made for this call).
struct Matrix {
  struct Shard {
    const uint8_t* codes;
    const uint8_t* scales;
    const uint16_t* tab;  // MXFP4 / NVFP4: [256][16] by scale byte; INT4: null (made per row)
    int64_t row0, rows;
    GType gtype;          // fmt=gguf: this unit's ggml type of the shard
  };
  std::vector<Shard> shards;
  const uint16_t* bias = nullptr;
  int64_t k = 0;

  const Shard& shard_of(int64_t r) const {
    const Shard* sh = &shards[0];
    for (const Shard& c : shards)
      if (r >= c.row0 && r < c.row0 + c.rows) sh = &c;
    return *sh;
  }

  // Row r's blocks (fmt=gguf).
  GRow grow(int64_t r) const {
    const Shard& sh = shard_of(r);
    return GRow{sh.codes + (r - sh.row0) * gguf_row_bytes(sh.gtype, k), sh.gtype};
  }

  // Row r's codes and tables (INT4 tables into slot `slot` of s.tables: one per row of a block of 4).
  QRow row(int64_t r, int64_t group, RowScratch& s, int slot) const {
    const Shard* sh = &shard_of(r);
    const int64_t i = r - sh->row0, groups = k / group;
    const uint8_t* codes = sh->codes + i * (k / 2);
    if (sh->tab != nullptr) return QRow{codes, sh->tab, sh->scales + i * groups, group};
    if (static_cast<int64_t>(s.tables.size()) < 4 * 16 * groups) s.tables.resize(4 * 16 * groups);
    uint16_t* tab = s.tables.data() + slot * 16 * groups;
    int4_tables(reinterpret_cast<const uint16_t*>(sh->scales) + i * groups, groups, tab);
    return QRow{codes, tab, nullptr, group};
  }

  // Row r's codes and bf16 group scales as stored (int4-q8: group 32).
  void raw(int64_t r, const uint8_t*& codes, const uint16_t*& scales) const {
    const Shard* sh = &shards[0];
    for (const Shard& c : shards)
      if (r >= c.row0 && r < c.row0 + c.rows) sh = &c;
    const int64_t i = r - sh->row0;
    codes = sh->codes + i * (k / 2);
    scales = reinterpret_cast<const uint16_t*>(sh->scales) + i * (k / 32);
  }
};

struct Expert {
  Matrix gu, dn;
  int64_t lo, hi, pair0;  // its pairs token_of[lo:hi], and the first one's row in the scratch
};

// fn(t, r, dot) for the tokens xs[0 .. nt) against rows 4b .. 4b + 3 of m: the 4-bit and GGUF kinds.
template <class Fn>
void q4_block(const Spec& spec, const Matrix& m, int64_t b, const uint16_t* const* xs, int64_t nt, RowScratch& s,
              Fn&& fn) {
  const bool gguf = spec.fmt == Fmt::kGguf;
  if (nt <= 4) {  // decode: the 4 rows decoded in registers, once for all the tokens
    float res[4][4];
    if (gguf) {
      const GRow rows[4] = {m.grow(4 * b), m.grow(4 * b + 1), m.grow(4 * b + 2), m.grow(4 * b + 3)};
      gguf_rows4_dots(rows, m.k, xs, static_cast<int>(nt), res, true);
    } else {
      const QRow rows[4] = {m.row(4 * b, spec.group, s, 0), m.row(4 * b + 1, spec.group, s, 1),
                            m.row(4 * b + 2, spec.group, s, 2), m.row(4 * b + 3, spec.group, s, 3)};
      rows4_dots(rows, m.k, xs, static_cast<int>(nt), res, true);
    }
    for (int64_t t = 0; t < nt; ++t)
      for (int r = 0; r < 4; ++r) fn(t, r, res[t][r]);
    return;
  }
  float res[4];  // prefill: each row decoded once into a row buffer the tokens read from L1
  if (static_cast<int64_t>(s.row.size()) < m.k) s.row.resize(m.k);
  for (int r = 0; r < 4; ++r) {
    if (gguf) gguf_decode_row(m.grow(4 * b + r), m.k, s.row.data());
    else decode_row(m.row(4 * b + r, spec.group, s, 0), m.k, s.row.data());
    for (int64_t t0 = 0; t0 < nt; t0 += 4) {
      const uint16_t* const* x = xs + t0;
      switch (std::min<int64_t>(4, nt - t0)) {
        case 1: moeserve_canon::row_dots<1>(s.row.data(), m.k, x, res); break;
        case 2: moeserve_canon::row_dots<2>(s.row.data(), m.k, x, res); break;
        case 3: moeserve_canon::row_dots<3>(s.row.data(), m.k, x, res); break;
        default: moeserve_canon::row_dots<4>(s.row.data(), m.k, x, res); break;
      }
      for (int64_t t = t0; t < std::min<int64_t>(nt, t0 + 4); ++t) fn(t, r, res[t - t0]);
    }
  }
}

// The same for bf16 row-interleaved weights (canonical_dot.h's block4_dots; the block stays in L1 across tokens).
template <class Fn>
void bf16_block(const Matrix& m, int64_t b, const uint16_t* const* xs, int64_t nt, Fn&& fn) {
  const uint16_t* blk = reinterpret_cast<const uint16_t*>(m.shards[0].codes) + b * 4 * m.k;
  float res[4][4];
  for (int64_t t0 = 0; t0 < nt; t0 += 4) {
    const int64_t pf = t0 == 0 ? 4096 : 0, g = std::min<int64_t>(4, nt - t0);
    switch (g) {
      case 1: moeserve_canon::block4_dots<1>(blk, m.k, xs + t0, res, pf); break;
      case 2: moeserve_canon::block4_dots<2>(blk, m.k, xs + t0, res, pf); break;
      case 3: moeserve_canon::block4_dots<3>(blk, m.k, xs + t0, res, pf); break;
      default: moeserve_canon::block4_dots<4>(blk, m.k, xs + t0, res, pf); break;
    }
    for (int64_t t = 0; t < g; ++t)
      for (int r = 0; r < 4; ++r) fn(t0 + t, r, res[t][r]);
  }
}

// The same for int4-q8: the tokens' quantized rows (q4_q8.h), up to 4 per pass over the 4 rows (the first pass
// reads memory, the others find the rows in L1).
template <class Fn>
void q8_block(const Matrix& m, int64_t b, const uint8_t* const* qs, int64_t nt, Fn&& fn) {
  const uint8_t* codes[4];
  const uint16_t* scales[4];
  for (int r = 0; r < 4; ++r) m.raw(4 * b + r, codes[r], scales[r]);
  float res[4][4];
  for (int64_t t0 = 0; t0 < nt; t0 += 4) {
    const int g = static_cast<int>(std::min<int64_t>(4, nt - t0));
    moeserve_q8::rows4_dots(codes, scales, m.k, qs + t0, g, res, t0 == 0);
    for (int t = 0; t < g; ++t)
      for (int r = 0; r < 4; ++r) fn(t0 + t, r, res[t][r]);
  }
}

// A pair list's inputs: bf16 rows, and (int4-q8) their quantized forms.
struct Inputs {
  const uint16_t* const* x;
  const uint8_t* const* q;
};

template <class Fn>
void block(const Spec& spec, const Matrix& m, int64_t b, Inputs in, int64_t nt, RowScratch& s, Fn&& fn) {
  if (spec.bf16) bf16_block(m, b, in.x, nt, fn);
  else if (spec.fmt == Fmt::kInt4Q8) q8_block(m, b, in.q, nt, fn);
  else q4_block(spec, m, b, in.x, nt, s, fn);
}

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }
inline float sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }

// a[j] of one pair from its gate_up outputs gu[R1] (bf16 values as fp32), j < I.
inline float activation(const Spec& spec, const float* gu, int64_t j, int64_t isz) {
  switch (spec.act) {
    case Act::kSwiglu: return rnd(rnd(silu(gu[j])) * gu[isz + j]);
    case Act::kRelu2: {
      const float u = gu[j] > 0.0f || std::isnan(gu[j]) ? gu[j] : 0.0f;
      return rnd(u * u);
    }
    case Act::kGptOss:
    case Act::kGptOssSplit: break;
  }
  const bool split = spec.act == Act::kGptOssSplit;  // gate rows then up rows, else interleaved
  const float graw = split ? gu[j] : gu[2 * j], uraw = split ? gu[isz + j] : gu[2 * j + 1];
  const float lim = rnd(spec.limit);  // torch.clamp casts its bound to the tensor's dtype
  const float g = std::isnan(graw) ? graw : std::min(graw, lim);
  const float u = std::isnan(uraw) ? uraw : std::min(std::max(uraw, -lim), lim);
  const float glu = rnd(g * rnd(sigmoid(rnd(g * spec.alpha))));
  return rnd(rnd(u + 1.0f) * glu);
}

struct Scratch {
  std::vector<float> gu;
  std::vector<uint16_t> act;
  std::vector<uint8_t> xq, aq;  // int4-q8: the quantized token rows and activation rows
};

void run(const Spec& spec, uint16_t* out, const uint16_t* x, int64_t n, const std::vector<Expert>& experts,
         const int64_t* token_of, const float* weight_of, int64_t pairs) {
  static thread_local Scratch sc;
  const int64_t hsz = spec.gu.k, r1 = spec.gu.rows, isz = spec.inter();
  const bool q8 = !spec.bf16 && spec.fmt == Fmt::kInt4Q8;
  const int64_t xqb = moeserve_q8::row_bytes(hsz), aqb = moeserve_q8::row_bytes(isz);
  if (static_cast<int64_t>(sc.gu.size()) < pairs * r1) sc.gu.resize(pairs * r1);
  if (static_cast<int64_t>(sc.act.size()) < pairs * isz) sc.act.resize(pairs * isz);
  if (q8 && static_cast<int64_t>(sc.xq.size()) < n * xqb) sc.xq.resize(n * xqb);
  if (q8 && static_cast<int64_t>(sc.aq.size()) < pairs * aqb) sc.aq.resize(pairs * aqb);
  float* gu = sc.gu.data();
  uint16_t* act = sc.act.data();
  uint8_t *xq = sc.xq.data(), *aq = sc.aq.data();  // (the calling thread's scratch: the team's threads use these)
  std::vector<const uint16_t*> xrows(pairs), arows(pairs);
  std::vector<const uint8_t*> xqrows(q8 ? pairs : 0), aqrows(q8 ? pairs : 0);
  for (const Expert& e : experts)
    for (int64_t p = e.lo; p < e.hi; ++p) {
      xrows[e.pair0 + p - e.lo] = x + token_of[p] * hsz;
      if (q8) xqrows[e.pair0 + p - e.lo] = xq + token_of[p] * xqb;
    }
  for (int64_t p = 0; p < pairs; ++p) {
    arows[p] = act + p * isz;
    if (q8) aqrows[p] = aq + p * aqb;
  }
  const int64_t blocks_gu = r1 / 4, blocks1 = static_cast<int64_t>(experts.size()) * blocks_gu, blocks_h = hsz / 4;
  const int nthreads = at::in_parallel_region() ? 1 : std::max(1, at::get_num_threads());

#pragma omp parallel num_threads(nthreads)
  {
    const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
    static thread_local RowScratch rs;
    if (q8) {  // every token row quantized once (rows no pair reads too: at most the batch)
      for (int64_t t = n * tid / nt, t1 = n * (tid + 1) / nt; t < t1; ++t)
        moeserve_q8::quantize_row(x + t * hsz, hsz, xq + t * xqb);
#pragma omp barrier
    }
    for (int64_t u = blocks1 * tid / nt, u1 = blocks1 * (tid + 1) / nt; u < u1; ++u) {
      const Expert& e = experts[u / blocks_gu];
      const int64_t b = u % blocks_gu;
      const Inputs in{xrows.data() + e.pair0, q8 ? xqrows.data() + e.pair0 : nullptr};
      block(spec, e.gu, b, in, e.hi - e.lo, rs, [&](int64_t t, int r, float dot) {
        const int64_t row = 4 * b + r;
        const float v = rnd(dot);
        gu[(e.pair0 + t) * r1 + row] = e.gu.bias != nullptr ? rnd(v + bf(e.gu.bias[row])) : v;
      });
    }
#pragma omp barrier
    for (int64_t i = pairs * isz * tid / nt, i1 = pairs * isz * (tid + 1) / nt; i < i1; ++i)
      act[i] = moeserve_csrc::bf16_bits(activation(spec, gu + (i / isz) * r1, i % isz, isz));
#pragma omp barrier
    if (q8) {
      for (int64_t p = pairs * tid / nt, p1 = pairs * (tid + 1) / nt; p < p1; ++p)
        moeserve_q8::quantize_row(act + p * isz, isz, aq + p * aqb);
#pragma omp barrier
    }
    for (const Expert& e : experts)
      for (int64_t b = blocks_h * tid / nt, b1 = blocks_h * (tid + 1) / nt; b < b1; ++b)
        block(spec, e.dn, b, Inputs{arows.data() + e.pair0, q8 ? aqrows.data() + e.pair0 : nullptr}, e.hi - e.lo,
              rs, [&](int64_t t, int r, float dot) {
          const int64_t p = e.lo + t, h = 4 * b + r;
          float d = rnd(dot);
          if (e.dn.bias != nullptr) d = rnd(d + bf(e.dn.bias[h]));
          uint16_t* o = out + token_of[p] * hsz + h;
          *o = moeserve_csrc::bf16_bits(bf(*o) + rnd(d * weight_of[p]));
        });
  }
}

// The bytes a tensor's data pointer reaches in its storage.
int64_t reachable(const at::Tensor& t) {
  return static_cast<int64_t>(t.storage().nbytes()) - t.storage_offset() * static_cast<int64_t>(t.element_size());
}

// One projection of one expert from its first tensor; NVFP4 tables made into `tables` (kept for the call).
Matrix matrix(const Spec& spec, const ProjSpec& p, const at::Tensor& base, std::vector<std::vector<uint16_t>>& tables,
              const char* what) {
  TORCH_CHECK(base.device().is_cpu(), "moe_q4_experts_: ", what, " units must be CPU tensors");
  TORCH_CHECK(reachable(base) >= p.nbytes(spec.bf16, spec.fmt, spec.group), "moe_q4_experts_: a ", what,
              " tensor reaches ", reachable(base), " bytes; the spec reads ", p.nbytes(spec.bf16, spec.fmt, spec.group));
  const uint8_t* at = static_cast<const uint8_t*>(base.data_ptr());
  Matrix m;
  m.k = p.k;
  m.bias = p.bias >= 0 ? reinterpret_cast<const uint16_t*>(at + p.bias) : nullptr;
  int64_t row0 = 0;
  for (const ShardSpec& sh : p.shards) {
    const uint16_t* tab = nullptr;
    if (!spec.bf16 && spec.fmt == Fmt::kMxfp4) tab = mxfp4_tables();
    if (!spec.bf16 && (spec.fmt == Fmt::kNvfp4Div || spec.fmt == Fmt::kNvfp4Mul)) {
      float ts;
      std::memcpy(&ts, at + sh.tscale, 4);
      tables.emplace_back(256 * 16);
      nvfp4_tables(ts, spec.fmt == Fmt::kNvfp4Div, tables.back().data());
      tab = tables.back().data();
    }
    const bool gguf = !spec.bf16 && spec.fmt == Fmt::kGguf;
    GType gtype = GType::kQ8_0;
    if (gguf) {
      int32_t index = 0;
      if (sh.type_at >= 0) std::memcpy(&index, at + sh.type_at, 4);
      TORCH_CHECK(index >= 0 && index < static_cast<int32_t>(sh.types.size()), "moe_q4_experts_: a ", what,
                  " unit's ggml type index is ", index, "; its spec lists ", sh.types.size(), " types");
      gtype = sh.types[index];
    }
    m.shards.push_back({at + sh.codes, spec.bf16 || gguf ? nullptr : at + sh.scales, tab, row0, sh.rows, gtype});
    row0 += sh.rows;
  }
  return m;
}

}  // namespace

void run_experts(const Spec& spec, at::Tensor& out, const at::Tensor& x, at::TensorList gate_up, at::TensorList down,
                 const at::Tensor& token_of, const at::Tensor& weight_of, at::IntArrayRef bounds) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous() &&
                  x.size(1) == spec.gu.k,
              "moe_q4_experts_: x must be a contiguous bf16 CPU [N, ", spec.gu.k, "]");
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == at::kBFloat16 && out.is_contiguous(),
              "moe_q4_experts_: out must be a contiguous bf16 tensor shaped as x");
  TORCH_CHECK(token_of.scalar_type() == at::kLong && token_of.dim() == 1 && token_of.is_contiguous(),
              "moe_q4_experts_: token_of int64 [P]");
  TORCH_CHECK(weight_of.scalar_type() == at::kFloat && weight_of.is_contiguous() &&
                  weight_of.numel() == token_of.numel(),
              "moe_q4_experts_: weight_of float32 [P]");
  TORCH_CHECK(gate_up.size() == down.size() && bounds.size() == 2 * gate_up.size(),
              "moe_q4_experts_: one gate_up, one down and a (lo, hi) span per expert");
  const int64_t n = x.size(0), np = token_of.numel();
  const int64_t* tp = token_of.data_ptr<int64_t>();
  for (int64_t i = 0; i < np; ++i) TORCH_CHECK(0 <= tp[i] && tp[i] < n, "moe_q4_experts_: token index out of range");
  std::vector<std::vector<uint16_t>> tables;
  tables.reserve(2 * gate_up.size() * (spec.gu.shards.size() + spec.dn.shards.size()));  // pointers stay put
  std::vector<Expert> experts;
  int64_t pairs = 0;
  for (size_t i = 0; i < gate_up.size(); ++i) {
    const int64_t lo = bounds[2 * i], hi = bounds[2 * i + 1];
    TORCH_CHECK(0 <= lo && lo <= hi && hi <= np, "moe_q4_experts_: bounds out of range");
    if (hi == lo) continue;  // an expert with no tokens reads nothing
    experts.push_back({matrix(spec, spec.gu, gate_up[i], tables, "gate_up"),
                       matrix(spec, spec.dn, down[i], tables, "down"), lo, hi, pairs});
    pairs += hi - lo;
  }
  if (experts.empty()) return;
  run(spec, reinterpret_cast<uint16_t*>(out.data_ptr()), reinterpret_cast<const uint16_t*>(x.data_ptr()), n,
      experts, tp, weight_of.data_ptr<float>(), pairs);
}

at::Tensor moe_q4_experts_(at::Tensor out, const at::Tensor& x, at::TensorList gate_up, at::TensorList down,
                           const at::Tensor& token_of, const at::Tensor& weight_of, at::IntArrayRef bounds,
                           const std::string& spec) {
  run_experts(parse_spec(spec), out, x, gate_up, down, token_of, weight_of, bounds);
  return out;
}

// The decoded bf16 weights of rows [0, rows) of one projection (tests: the decoder against formats/).
at::Tensor q4_decode(const at::Tensor& base, const std::string& spec_text, bool down) {
  const Spec spec = parse_spec(spec_text);
  TORCH_CHECK(!spec.bf16, "q4_decode: a 4-bit spec");
  const ProjSpec& p = down ? spec.dn : spec.gu;
  std::vector<std::vector<uint16_t>> tables;
  tables.reserve(p.shards.size());
  const Matrix m = matrix(spec, p, base, tables, "q4_decode");
  at::Tensor w = at::empty({p.rows, p.k}, base.options().dtype(at::kBFloat16));
  RowScratch s;
  for (int64_t r = 0; r < p.rows; ++r) {
    uint16_t* dst = reinterpret_cast<uint16_t*>(w.data_ptr()) + r * p.k;
    if (spec.fmt == Fmt::kGguf) gguf_decode_row(m.grow(r), p.k, dst);
    else decode_row(m.row(r, spec.group, s, 0), p.k, dst);
  }
  return w;
}

}  // namespace moeserve_q4

TORCH_LIBRARY_FRAGMENT(moeserve, m) {
  m.def("moe_q4_experts_(Tensor(a!) out, Tensor x, Tensor[] gate_up, Tensor[] down, Tensor token_of, "
        "Tensor weight_of, int[] bounds, str spec) -> Tensor(a!)",
        &moeserve_q4::moe_q4_experts_);
  m.def("q4_decode(Tensor base, str spec, bool down) -> Tensor", &moeserve_q4::q4_decode);
}
