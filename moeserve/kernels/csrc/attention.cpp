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
//   table[p / block_size], row p % block_size), with grouped-query heads. Each row and head is computed in the
//   canonical order of attention_core.h (the same bits on every ISA, for any block size or placement, whatever
//   other rows share the call): fp32 scores scaled, p = exp(s - max) rounded to the dtype before p @ v (fp32
//   accumulation), times 1 / row sum, rounded once. With sinks (gpt-oss: one learned fp32 logit per query head),
//   the sink joins the max and the row sum but has no value row. The op is defined per query token, so it serves
//   prefill and mixed batches too (each token against keys up to its own position, which qk_norm_rope_cache wrote
//   first); a prefill's consecutive tokens share each pass over the keys (tiles of up to 16 rows), so its cost per
//   token is the dots', not one read of the context per token.

#include <ATen/ATen.h>

#include "ops.h"
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "attention_core.h"
#include "attention_rows.h"
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

CheckedRows check_rows(const char* op, const at::Tensor& block_tables, const std::optional<at::Tensor>& rows,
                       const at::Tensor& positions, int64_t window, int64_t n, int64_t block_size,
                       int64_t num_blocks) {
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.is_contiguous(),
              op, ": block_tables must be contiguous int64 [sequences, max blocks]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == n, op,
              ": positions must be contiguous int64 [N]");
  TORCH_CHECK(!rows.has_value() || (rows->scalar_type() == at::kLong && rows->is_contiguous() && rows->numel() == n),
              op, ": rows must be contiguous int64 [N]");
  TORCH_CHECK(rows.has_value() || block_tables.size(0) == n, op, ": without rows, one block table per query row");
  CheckedRows cr{block_tables.data_ptr<int64_t>(), positions.data_ptr<int64_t>(), block_tables.size(1), window};
  const int64_t* row = rows.has_value() ? rows->data_ptr<int64_t>() : nullptr;
  const int64_t seqs = block_tables.size(0);
  cr.seq.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = row == nullptr ? i : row[i];
    TORCH_CHECK(r >= 0 && r < seqs, op, ": row ", r, " out of range");
    TORCH_CHECK(cr.pos[i] >= 0 && cr.pos[i] < cr.width * block_size, op, ": position ", cr.pos[i],
                " is past the block table");
    for (int64_t blk = cr.lo(i) / block_size; blk <= cr.pos[i] / block_size; ++blk) {
      const int64_t id = cr.table[r * cr.width + blk];
      TORCH_CHECK(id >= 0 && id < num_blocks, op, ": block ", id, " (position ", blk * block_size,
                  ") out of range");
    }
    cr.seq[i] = r;
    cr.longest = std::max(cr.longest, cr.pos[i] + 1 - cr.lo(i));
    cr.work += cr.pos[i] + 1 - cr.lo(i);
  }
  return cr;
}

}  // namespace moeserve_attention

namespace moeserve_attn {

void for_each_item(int64_t items, bool parallel, const std::function<void(int64_t, Scratch&)>& fn) {
  static thread_local Scratch scratch;  // kept between calls: a prefill's scores reuse the last one's memory
  if (!parallel || items <= 1) {
    for (int64_t i = 0; i < items; ++i) fn(i, scratch);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < items; i = next++) fn(i, scratch);
  });
}

}  // namespace moeserve_attn

namespace moeserve_attention {

int64_t tile_rows(int64_t heads, int64_t longest) {
  return std::clamp<int64_t>((int64_t{1} << 22) / std::max<int64_t>(1, heads * longest), 1, 16);
}

int64_t heads_per_item(int64_t items, int64_t group) {
  const int64_t want = 2 * at::get_num_threads();
  if (items >= want || group <= 4) return group;
  const int64_t chunks = std::min((want + items - 1) / items, (group + 3) / 4);
  return (group + chunks - 1) / chunks;
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
  TORCH_CHECK(k_cache.size(3) == d && nh % nkv == 0, "decode_attention: head dims do not match");
  TORCH_CHECK(!sinks.has_value() || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                                      sinks->numel() == nh),
              "decode_attention: sinks must be contiguous float32 [heads]");
  const CheckedRows cr = check_rows("decode_attention", block_tables, rows, positions, window, b, bs,
                                    k_cache.size(0));
  const int64_t group = nh / nkv, es = q.element_size();
  at::Tensor out = at::empty({b, nh * d}, q.options());
  const auto tiles = moeserve_attn::tiles_of(cr.seq.data(), cr.pos, b, tile_rows(group, cr.longest));
  const int64_t per = heads_per_item(static_cast<int64_t>(tiles.size()) * nkv, group);
  const int64_t chunks = (group + per - 1) / per;
  const float* sink = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  const char *qp = static_cast<const char*>(q.data_ptr()), *kp = static_cast<const char*>(k_cache.data_ptr()),
             *vp = static_cast<const char*>(v_cache.data_ptr());
  char* op = static_cast<char*>(out.data_ptr());
  const auto dt = st == at::kBFloat16 ? moeserve_attn::Dtype::kBF16 : moeserve_attn::Dtype::kF32;
  // Threads only pay off past a few hundred thousand multiply-adds; below that one thread finishes first.
  const bool parallel = cr.work * nh * d > (1 << 18);
  moeserve_attn::for_each_item(static_cast<int64_t>(tiles.size()) * nkv * chunks, parallel,
                               [&](int64_t item, moeserve_attn::Scratch& sc) {
    const moeserve_attn::Tile& tile = tiles[item / (nkv * chunks)];
    const int64_t g = item / chunks % nkv, h0 = item % chunks * per, heads = std::min(per, group - h0);
    const int64_t* table = cr.table + cr.seq[tile.first] * cr.width;
    const moeserve_attn::Problem pb{
        dt, d, d, heads, d, d, static_cast<float>(scale), sink == nullptr ? nullptr : sink + g * group + h0,
        {kp + g * k_cache.stride(1) * es, table, k_cache.stride(0), k_cache.stride(2), bs},
        {vp + g * v_cache.stride(1) * es, table, v_cache.stride(0), v_cache.stride(2), bs}};
    sc.rows.resize(tile.count);
    for (int64_t t = 0; t < tile.count; ++t) {
      const int64_t i = tile.first + t, head = i * nh + g * group + h0;
      sc.rows[t] = {qp + head * d * es, op + head * d * es, cr.lo(i), cr.pos[i] + 1};
    }
    moeserve_attn::attend_rows(pb, sc.rows.data(), tile.count, sc);
  });
  return out;
}

// Which implementation of attention_core.h this library compiled ("avx512", "avx2", "scalar").
std::string attention_isa() { return moeserve_attn::implementation(); }

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
  m.def("attention_isa() -> str", &moeserve_attention::attention_isa);
}
