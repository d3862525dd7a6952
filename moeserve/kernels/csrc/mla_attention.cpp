// mla_attention: multi-head latent attention's absorbed form (models/mixers/mla.py MlaAttention) for any query rows
// (prefill, decode, mixed: each against its own sequence's cached rows up to its position), every product in the
// canonical order of attention_core.h, so the same bits on every ISA and whatever rows share the call:
//   q_lat[h] = W_UK[h]^T q_nope[h], rounded to the dtype        (R dots of length nope per head: rows_dot)
//   o_lat[h] = attention of the query [q_lat[h], q_pe[h]] over the cached rows [c, k_pe] (dk = R + rope), the
//              values being their latents c (dv = R, the rows' first R elements): one kv head for every query head
//   out[h]   = W_UV[h] o_lat[h], rounded to the dtype           (v dots of length R per head)
// Shapes: q_nope [N, nh, nope], q_pe [N, nh, rope] (last dim contiguous), cache [blocks, bs, R + rope], w_uk_t
// [nh, R, nope] and w_uv [nh, v, R] contiguous (kv_b_proj's weight per head: its key rows transposed, its value
// rows as they are); returns [N, nh, v]. The per-head keys and values of the context are never expanded, and no
// query is padded to a block of rows: the torch path's bf16 bmm / matmul on 16-row blocks is gone.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "attention_core.h"
#include "attention_rows.h"
#include "ops.h"

namespace moeserve_mla {

using moeserve_attn::Dtype;

namespace {

// out[t][h] = round(w[h] x[t][h]) for every row t and head h: w [nh, n, k]; x rows at x + t * xs0 + h * xs1,
// outputs at out + t * os0 + h * os1 (elements). One item per head: its weights read once for all rows.
void project(Dtype dt, const char* w, int64_t n, int64_t k, const char* x, int64_t xs0, int64_t xs1, char* out,
             int64_t os0, int64_t os1, int64_t rows, int64_t heads, int64_t es) {
  const bool parallel = rows * heads * n * k > (1 << 18);
  moeserve_attn::for_each_item(heads, parallel, [&](int64_t h, moeserve_attn::Scratch& sc) {
    std::vector<const void*> xs(rows);
    std::vector<void*> outs(rows);
    for (int64_t t = 0; t < rows; ++t) {
      xs[t] = x + (t * xs0 + h * xs1) * es;
      outs[t] = out + (t * os0 + h * os1) * es;
    }
    moeserve_attn::rows_dot(dt, w + h * n * k * es, n, k, xs.data(), outs.data(), rows, sc);
  });
}

}  // namespace

at::Tensor mla_attention(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& cache,
                         const at::Tensor& block_tables, const std::optional<at::Tensor>& rows,
                         const at::Tensor& positions, const at::Tensor& w_uk_t, const at::Tensor& w_uv, double scale) {
  const auto st = q_nope.scalar_type();
  TORCH_CHECK(st == at::kBFloat16 || st == at::kFloat, "mla_attention: bf16 or fp32");
  TORCH_CHECK(q_pe.scalar_type() == st && cache.scalar_type() == st && w_uk_t.scalar_type() == st &&
                  w_uv.scalar_type() == st, "mla_attention: one dtype");
  TORCH_CHECK(q_nope.dim() == 3 && q_pe.dim() == 3 && q_nope.stride(2) == 1 && q_pe.stride(2) == 1,
              "mla_attention: q_nope, q_pe must be [N, heads, dims] with the last dim contiguous");
  TORCH_CHECK(w_uk_t.dim() == 3 && w_uv.dim() == 3 && w_uk_t.is_contiguous() && w_uv.is_contiguous(),
              "mla_attention: w_uk_t [heads, R, nope] and w_uv [heads, v, R] must be contiguous");
  const int64_t n = q_nope.size(0), nh = q_nope.size(1), nope = q_nope.size(2), rope = q_pe.size(2);
  const int64_t r = w_uk_t.size(1), v = w_uv.size(1), width = r + rope;
  TORCH_CHECK(q_pe.size(0) == n && q_pe.size(1) == nh && w_uk_t.size(0) == nh && w_uk_t.size(2) == nope &&
                  w_uv.size(0) == nh && w_uv.size(2) == r,
              "mla_attention: the query and weight shapes do not match");
  TORCH_CHECK(cache.dim() == 3 && cache.size(2) == width && cache.stride(2) == 1,
              "mla_attention: cache must be [blocks, block_size, kv_lora_rank + rope] with rows contiguous");
  const int64_t bs = cache.size(1), es = q_nope.element_size();
  const moeserve_attention::CheckedRows cr =
      moeserve_attention::check_rows("mla_attention", block_tables, rows, positions, 0, n, bs, cache.size(0));
  const Dtype dt = st == at::kBFloat16 ? Dtype::kBF16 : Dtype::kF32;

  at::Tensor q = at::empty({n, nh, width}, q_nope.options());  // [q_lat, q_pe] per head
  q.slice(2, r).copy_(q_pe);
  at::Tensor o_lat = at::empty({n, nh, r}, q_nope.options());
  at::Tensor out = at::empty({n, nh, v}, q_nope.options());
  project(dt, static_cast<const char*>(w_uk_t.data_ptr()), r, nope, static_cast<const char*>(q_nope.data_ptr()),
          q_nope.stride(0), q_nope.stride(1), static_cast<char*>(q.data_ptr()), nh * width, width, n, nh, es);

  const auto tiles = moeserve_attn::tiles_of(cr.seq.data(), cr.pos, n, moeserve_attention::tile_rows(nh, cr.longest));
  const int64_t per = moeserve_attention::heads_per_item(static_cast<int64_t>(tiles.size()), nh);
  const int64_t chunks = (nh + per - 1) / per;
  const char* qp = static_cast<const char*>(q.data_ptr());
  char* op = static_cast<char*>(o_lat.data_ptr());
  const moeserve_attn::PagedRows latent{cache.data_ptr(), nullptr, cache.stride(0), cache.stride(1), bs};
  moeserve_attn::for_each_item(static_cast<int64_t>(tiles.size()) * chunks, cr.work * nh * width > (1 << 18),
                               [&](int64_t item, moeserve_attn::Scratch& sc) {
    const moeserve_attn::Tile& tile = tiles[item / chunks];
    const int64_t h0 = item % chunks * per, heads = std::min(per, nh - h0);
    moeserve_attn::PagedRows rows_of = latent;
    rows_of.table = cr.table + cr.seq[tile.first] * cr.width;
    const moeserve_attn::Problem pb{dt, width, r, heads, width, r, static_cast<float>(scale), nullptr, rows_of,
                                    rows_of};
    sc.rows.resize(tile.count);
    for (int64_t t = 0; t < tile.count; ++t) {
      const int64_t i = tile.first + t;
      sc.rows[t] = {qp + (i * nh + h0) * width * es, op + (i * nh + h0) * r * es, 0, cr.pos[i] + 1};
    }
    moeserve_attn::attend_rows(pb, sc.rows.data(), tile.count, sc);
  });

  project(dt, static_cast<const char*>(w_uv.data_ptr()), v, r, op, nh * r, r, static_cast<char*>(out.data_ptr()),
          nh * v, v, n, nh, es);
  return out;
}

}  // namespace moeserve_mla

TORCH_LIBRARY_FRAGMENT(moeserve, m) {
  m.def(
      "mla_attention(Tensor q_nope, Tensor q_pe, Tensor cache, Tensor block_tables, Tensor? rows, Tensor positions, "
      "Tensor w_uk_t, Tensor w_uv, float scale) -> Tensor",
      &moeserve_mla::mla_attention);
}
