// Multi-head latent attention in the DecodeStack (decode_stack.h): models/mixers/mla.py MlaAttention.__call__ for a
// decode-only batch, the same ops on the same shapes in the same order (its norms in the batch-invariant row blocks,
// the absorbed attention by the mla_attention op, ops.h), so the same bits.

#include "decode_stack.h"
#include "ops.h"

namespace moeserve_stack {

namespace {

// layers.rms_norm: fp32, cast back, then scaled (transformers' order).
at::Tensor rms_norm_cast_then_scale(const at::Tensor& x, const at::Tensor& w, double eps) {
  at::Tensor h = x.to(at::kFloat);
  h = h * at::rsqrt(h.pow(2).mean(-1, true) + eps);
  return w * h.to(x.scalar_type());
}

class MlaMixer : public TokenMixerPart {
 public:
  MlaMixer(const StackConfig& cfg, MlaShape shape, std::optional<StackLinear> q_a, std::optional<at::Tensor> q_a_norm,
           StackLinear q, StackLinear kv_a, at::Tensor kv_a_norm, at::Tensor w_uk_t, at::Tensor w_uv, StackLinear o,
           at::Tensor cos, at::Tensor sin, at::Tensor cache)
      : cfg_(cfg), s_(shape), q_a_(std::move(q_a)), q_a_norm_(std::move(q_a_norm)), q_(std::move(q)),
        kv_a_(std::move(kv_a)), kv_a_norm_(std::move(kv_a_norm)), w_uk_t_(std::move(w_uk_t)), w_uv_(std::move(w_uv)),
        o_(std::move(o)), cos_(std::move(cos)), sin_(std::move(sin)), cache_(std::move(cache)) {
    TORCH_CHECK(q_.out == s_.heads * (s_.nope + s_.rope) && kv_a_.out == s_.kv_lora + s_.rope &&
                    o_.out == cfg_.hidden && cache_.dim() == 3 && cache_.size(2) == s_.kv_lora + s_.rope &&
                    q_a_.has_value() == q_a_norm_.has_value(),
                "DecodeStack: latent attention sizes do not match");
  }

  int64_t kv_group() const override { return s_.group; }

  at::Tensor forward(Step& step, const at::Tensor& x) override {
    Timer& t = *cfg_.timer;
    const int64_t n = x.size(0);
    const at::Tensor q = t(kQkv, [&] { return q_a_ ? q_(norm((*q_a_)(x), *q_a_norm_)) : q_(x); });
    const at::Tensor kv = t(kQkv, [&] { return kv_a_(x); });
    const at::Tensor out = t(kAttention, [&] {
      const std::vector<at::Tensor> qs = q.view({n, s_.heads, s_.nope + s_.rope}).split_with_sizes({s_.nope, s_.rope}, -1);
      const std::vector<at::Tensor> kvs = kv.split_with_sizes({s_.kv_lora, s_.rope}, -1);
      const at::Tensor c = norm(kvs[0], kv_a_norm_);
      const at::Tensor q_pe = rope(qs[1], step.positions);
      const at::Tensor k_pe = rope(kvs[1].unsqueeze(1), step.positions).squeeze(1);
      cache_.view({-1, s_.kv_lora + s_.rope}).index_put_({step.slot_mappings[s_.group]}, at::cat({c, k_pe}, -1));
      return moeserve_mla::mla_attention(qs[0], q_pe, cache_, step.block_tables[s_.group], std::nullopt,
                                         step.positions, w_uk_t_, w_uv_, s_.softmax_scale);  // [N, nh, v]
    });
    return t(kOProj, [&] { return o_(out.reshape({n, s_.heads * s_.v_head_dim})); });
  }

 private:
  // MlaAttention._norm: rms_norm, in row blocks when batch-invariant.
  at::Tensor norm(const at::Tensor& x, const at::Tensor& w) const {
    const double eps = cfg_.eps;
    if (cfg_.row_block <= 0) return rms_norm_cast_then_scale(x, w, eps);
    return in_row_blocks([&](const at::Tensor& rows) { return rms_norm_cast_then_scale(rows, w, eps); }, x,
                         cfg_.row_block);
  }

  // MlaAttention._rope: x [N, heads, r] at `positions`: interleaved pairs, or Rotary.apply's half split.
  at::Tensor rope(const at::Tensor& x, const at::Tensor& positions) const {
    if (s_.interleaved_rope) {
      const int64_t half = x.size(-1) / 2;
      const at::Tensor cos = cos_.index_select(0, positions).slice(1, 0, half).contiguous().unsqueeze(1);
      const at::Tensor sin = sin_.index_select(0, positions).slice(1, 0, half).contiguous().unsqueeze(1);
      const at::Tensor even = x.slice(-1, 0, x.size(-1), 2), odd = x.slice(-1, 1, x.size(-1), 2);
      return at::cat({even * cos - odd * sin, odd * cos + even * sin}, -1);
    }
    const at::Tensor cos = cos_.index_select(0, positions).unsqueeze(1);
    const at::Tensor sin = sin_.index_select(0, positions).unsqueeze(1);
    const int64_t r = s_.rotary_dim, half = r / 2;
    const bool whole = r == x.size(-1);
    const at::Tensor rot = whole ? x : x.slice(-1, 0, r);
    const at::Tensor rotated = at::cat({-rot.slice(-1, half), rot.slice(-1, 0, half)}, -1);
    const at::Tensor out = rot * cos + rotated * sin;
    return whole ? out : at::cat({out, x.slice(-1, r)}, -1);
  }

  StackConfig cfg_;
  MlaShape s_;
  std::optional<StackLinear> q_a_;
  std::optional<at::Tensor> q_a_norm_;
  StackLinear q_, kv_a_;
  at::Tensor kv_a_norm_, w_uk_t_, w_uv_;  // mla_attention's [nh, R, nope] and [nh, v, R]
  StackLinear o_;
  at::Tensor cos_, sin_, cache_;
};

}  // namespace

std::unique_ptr<TokenMixerPart> make_mla(const StackConfig& cfg, MlaShape shape, std::optional<StackLinear> q_a,
                                         std::optional<at::Tensor> q_a_norm, StackLinear q, StackLinear kv_a,
                                         at::Tensor kv_a_norm, at::Tensor w_uk_t, at::Tensor w_uv, StackLinear o,
                                         at::Tensor cos, at::Tensor sin, at::Tensor cache) {
  return std::make_unique<MlaMixer>(cfg, shape, std::move(q_a), std::move(q_a_norm), std::move(q), std::move(kv_a),
                                    std::move(kv_a_norm), std::move(w_uk_t), std::move(w_uv), std::move(o),
                                    std::move(cos), std::move(sin), std::move(cache));
}

}  // namespace moeserve_stack
