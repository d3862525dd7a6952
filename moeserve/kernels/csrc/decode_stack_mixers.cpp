// Token mixer parts of the DecodeStack (decode_stack.h): each the decode-only path of its Python TokenMixer, the
// same functions (ops.h, or ATen ops on the same shapes) in the same order.

#include "decode_stack.h"

namespace moeserve_stack {

namespace {

// rms_norm_fp32_scale (models/layers/base.py) op for op: the weight applied in fp32 before the cast back.
at::Tensor rms_norm_fp32_scale(const at::Tensor& x, const at::Tensor& w, double eps) {
  const at::Tensor h = x.to(at::kFloat);
  const at::Tensor normed = h * at::rsqrt(h.pow(2).mean(-1, true) + eps);
  return (w * normed).to(x.scalar_type());
}

// Attention.__call__ + _cpp_attention for a decode-only batch.
class AttentionMixer : public TokenMixerPart {
 public:
  AttentionMixer(const StackConfig& cfg, AttentionShape shape, StackLinear qkv, StackLinear o,
                 std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm, at::Tensor cos, at::Tensor sin,
                 at::Tensor k_cache, at::Tensor v_cache)
      : cfg_(cfg), s_(shape), qkv_(std::move(qkv)), o_(std::move(o)), q_norm_(std::move(q_norm)),
        k_norm_(std::move(k_norm)), cos_(std::move(cos)), sin_(std::move(sin)), k_cache_(std::move(k_cache)),
        v_cache_(std::move(v_cache)) {
    const int64_t q_size = s_.heads * s_.head_dim, kv_size = s_.kv_heads * s_.head_dim;
    split_ = {q_size, kv_size, kv_size};
    if (s_.output_gate) split_.push_back(q_size);
    int64_t total = 0;
    for (const int64_t w : split_) total += w;
    TORCH_CHECK(qkv_.out == total && o_.out == cfg_.hidden, "DecodeStack: qkv / o_proj sizes do not match the attention");
    TORCH_CHECK(!s_.torch_qk_norm || (q_norm_ && k_norm_), "DecodeStack: a torch q/k norm needs both norm weights");
  }

  int64_t kv_group() const override { return s_.group; }

  at::Tensor forward(Step& step, const at::Tensor& x) override {
    Timer& t = *cfg_.timer;
    const int64_t n = x.size(0), q_size = s_.heads * s_.head_dim;
    const at::Tensor qkv_out = t(kQkv, [&] { return qkv_(x); });
    std::vector<at::Tensor> parts = qkv_out.split_with_sizes(split_, -1);  // q, k, v (views) [, gate]
    const at::Tensor a = t(kAttention, [&] {
      at::Tensor q = parts[0], k = parts[1];
      std::optional<at::Tensor> qn = q_norm_, kn = k_norm_;
      if (s_.torch_qk_norm) {  // Attention._per_head_norms: a norm the C++ op does not do
        q = rms_norm_fp32_scale(q.reshape({n, s_.heads, s_.head_dim}), *q_norm_, cfg_.eps).reshape({n, -1});
        k = rms_norm_fp32_scale(k.reshape({n, s_.kv_heads, s_.head_dim}), *k_norm_, cfg_.eps).reshape({n, -1});
        qn = kn = std::nullopt;
      }
      const at::Tensor q_out = moeserve_attention::qk_norm_rope_cache(
          q, k, parts[2], qn, kn, cos_, sin_, step.positions, step.slot_mappings[s_.group], k_cache_, v_cache_,
          cfg_.eps);
      return moeserve_attention::decode_attention(q_out, k_cache_, v_cache_, step.block_tables[s_.group],
                                                  std::nullopt, step.positions, s_.window, s_.scale);
    });
    at::Tensor out = a.reshape({n, q_size});
    if (s_.output_gate) out = t(kAttention, [&] { return gated(out, parts[3]); });
    return t(kOProj, [&] { return o_(out); });
  }

 private:
  // Attention._gated: out * sigmoid(gate); batch-invariant in row blocks of [out | gate] side by side.
  at::Tensor gated(const at::Tensor& out, const at::Tensor& gate) const {
    if (cfg_.row_block <= 0) return out * at::sigmoid(gate);
    const int64_t w = out.size(1);
    const at::Tensor both = at::cat({out, gate}, -1);
    return in_row_blocks([w](const at::Tensor& rows) { return rows.slice(1, 0, w) * at::sigmoid(rows.slice(1, w)); },
                         both, cfg_.row_block);
  }

  StackConfig cfg_;
  AttentionShape s_;
  StackLinear qkv_, o_;
  std::optional<at::Tensor> q_norm_, k_norm_;
  at::Tensor cos_, sin_, k_cache_, v_cache_;
  std::vector<int64_t> split_;
};

// GatedDeltaNet._rowwise: fn(*parts) for a row-wise fn of [N, ...] tensors of one dtype; batch-invariant in row
// blocks of the parts side by side, each block's outputs carried as fp32 and returned in their own dtypes.
std::vector<at::Tensor> rowwise(const std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>& fn,
                                const std::vector<at::Tensor>& parts, int64_t row_block) {
  if (row_block <= 0) return fn(parts);
  std::vector<int64_t> widths;
  for (const at::Tensor& p : parts) widths.push_back(p.size(1));
  std::vector<std::pair<std::vector<int64_t>, at::ScalarType>> layout;  // each output's row shape and dtype
  auto block = [&](const at::Tensor& t) {
    const std::vector<at::Tensor> pieces = fn(at::split_with_sizes(t, widths, -1));
    layout.clear();
    std::vector<at::Tensor> flat;
    for (const at::Tensor& p : pieces) {
      layout.emplace_back(p.sizes().slice(1).vec(), p.scalar_type());
      flat.push_back(p.reshape({p.size(0), -1}).to(at::kFloat));
    }
    return at::cat(flat, -1);
  };
  const at::Tensor flat = in_row_blocks(block, at::cat(parts, -1), row_block);
  std::vector<int64_t> sizes;
  for (const auto& [shape, dtype] : layout) sizes.push_back(c10::multiply_integers(shape));
  const std::vector<at::Tensor> cols = flat.split_with_sizes(sizes, -1);
  std::vector<at::Tensor> outs;
  for (size_t i = 0; i < cols.size(); ++i) {
    std::vector<int64_t> shape{-1};
    shape.insert(shape.end(), layout[i].first.begin(), layout[i].first.end());
    outs.push_back(cols[i].reshape(shape).to(layout[i].second));
  }
  return outs;
}

// l2norm (models/mixers/gated_delta_rule.py): x / sqrt(sum(x^2) + 1e-6) over the last dim.
at::Tensor l2norm(const at::Tensor& x) { return x * at::rsqrt((x * x).sum(-1, true) + 1e-6); }

// GatedDeltaNet.__call__ for a decode-only batch of tokens after their prompts (the C++ recurrent step).
class GatedDeltaMixer : public TokenMixerPart {
 public:
  GatedDeltaMixer(const StackConfig& cfg, GatedDeltaShape shape, StackLinear in_proj, StackLinear out_proj,
                  at::Tensor conv_weight, at::Tensor a_log, at::Tensor dt_bias, at::Tensor norm,
                  at::Tensor conv_states, at::Tensor states)
      : cfg_(cfg), s_(shape), in_proj_(std::move(in_proj)), out_proj_(std::move(out_proj)),
        conv_weight_(std::move(conv_weight)), a_log_(std::move(a_log)), dt_bias_(std::move(dt_bias)),
        norm_(std::move(norm)), conv_states_(std::move(conv_states)), states_(std::move(states)) {
    key_dim_ = s_.num_k_heads * s_.k_head_dim;
    value_dim_ = s_.num_v_heads * s_.v_head_dim;
    split_ = {2 * key_dim_ + value_dim_, value_dim_, s_.num_v_heads, s_.num_v_heads};
    TORCH_CHECK(in_proj_.out == split_[0] + split_[1] + split_[2] + split_[3] && out_proj_.out == cfg_.hidden &&
                    conv_weight_.dim() == 2 && conv_weight_.size(0) == split_[0] &&
                    s_.num_v_heads % s_.num_k_heads == 0,
                "DecodeStack: Gated DeltaNet sizes do not match");
  }

  int64_t kv_group() const override { return s_.group; }

  at::Tensor forward(Step& step, const at::Tensor& x) override {
    Timer& t = *cfg_.timer;
    const int64_t n = x.size(0);
    const at::Tensor proj = t(kQkv, [&] { return in_proj_(x); });
    const std::vector<at::Tensor> parts = proj.split_with_sizes(split_, -1);  // mixed, z, b, a
    const at::Tensor slots = step.block_tables[s_.group].select(1, 0);        // each sequence's state slot
    const at::Tensor core = t(kAttention, [&] {
      const at::Tensor mixed = conv(parts[0], slots, step.positions);
      const std::vector<at::Tensor> act = rowwise(
          [this](const std::vector<at::Tensor>& p) { return activate(p[0], p[1]); },
          {mixed, at::cat({parts[2], parts[3]}, -1)}, cfg_.row_block);  // qkv, beta, g, decay
      const at::Tensor qkv = act[0].to(at::kFloat);
      const std::vector<at::Tensor> qkv_parts = qkv.split_with_sizes({key_dim_, key_dim_, value_dim_}, -1);
      const int64_t rep = s_.num_v_heads / s_.num_k_heads;
      const at::Tensor q = l2norm(qkv_parts[0].reshape({n, s_.num_k_heads, s_.k_head_dim})).repeat_interleave(rep, 1);
      const at::Tensor k = l2norm(qkv_parts[1].reshape({n, s_.num_k_heads, s_.k_head_dim})).repeat_interleave(rep, 1);
      const at::Tensor v = qkv_parts[2].reshape({n, s_.num_v_heads, s_.v_head_dim});
      return moeserve_gated_delta::gated_delta_step_(q, k, v, act[3], act[1], states_, slots);
    });
    const at::Tensor gated = t(kAttention, [&] {
      return rowwise([this](const std::vector<at::Tensor>& p) { return gated_norm(p[0], p[1]); },
                     {core.to(x.scalar_type()).reshape({n, -1}), parts[1]}, cfg_.row_block)[0];
    });
    return t(kOProj, [&] { return out_proj_(gated); });
  }

 private:
  // GatedDeltaNet._conv per sequence (one new token each; a sequence at position 0 starts from zeros).
  at::Tensor conv(const at::Tensor& mixed, const at::Tensor& slots, const at::Tensor& positions) {
    const int64_t k = conv_weight_.size(1);
    const at::Tensor slots_c = slots.contiguous();
    const int64_t *slot = slots_c.data_ptr<int64_t>(), *pos = positions.data_ptr<int64_t>();
    std::vector<at::Tensor> outs;
    for (int64_t i = 0; i < mixed.size(0); ++i) {
      at::Tensor history = conv_states_.select(0, slot[i]);  // [K-1, C], updated in place
      if (pos[i] == 0) history.zero_();
      const at::Tensor padded = at::cat({history, mixed.slice(0, i, i + 1)});
      at::Tensor acc = padded.slice(0, 0, 1).to(at::kFloat) * conv_weight_.select(1, 0);
      for (int64_t j = 1; j < k; ++j) acc = acc + padded.slice(0, j, j + 1).to(at::kFloat) * conv_weight_.select(1, j);
      history.copy_(padded.slice(0, padded.size(0) - (k - 1)));
      outs.push_back(acc.to(mixed.scalar_type()));
    }
    return at::cat(outs);
  }

  // GatedDeltaNet._activate: silu of the conv outputs; beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)
  // and exp(g), per value head (fp32).
  std::vector<at::Tensor> activate(const at::Tensor& mixed, const at::Tensor& gates) const {
    const int64_t h = s_.num_v_heads;
    const auto dtype = dt_bias_.scalar_type();
    const at::Tensor b = gates.slice(1, 0, h).to(dtype), a = gates.slice(1, h).to(dtype);
    const at::Tensor beta = b.sigmoid().to(at::kFloat);
    const at::Tensor g = -a_log_.to(at::kFloat).exp() * at::softplus(a.to(at::kFloat) + dt_bias_);
    return {at::silu(mixed.to(dtype)), beta, g, g.exp()};
  }

  // GatedDeltaNet._gated_norm: per value head RMSNorm(core) * w, times silu(z) in fp32, in the compute dtype.
  std::vector<at::Tensor> gated_norm(const at::Tensor& core, const at::Tensor& z) const {
    const int64_t n = core.size(0), hv = s_.num_v_heads, dv = s_.v_head_dim;
    const auto dtype = norm_.scalar_type();
    at::Tensor h = core.to(dtype).reshape({n, hv, dv}).to(at::kFloat);
    h = h * at::rsqrt(h.pow(2).mean(-1, true) + cfg_.eps);
    h = norm_ * h.to(dtype);
    const at::Tensor out = h * at::silu(z.to(dtype).reshape({n, hv, dv}).to(at::kFloat));
    return {out.to(dtype).reshape({n, -1})};
  }

  StackConfig cfg_;
  GatedDeltaShape s_;
  StackLinear in_proj_, out_proj_;
  at::Tensor conv_weight_, a_log_, dt_bias_, norm_, conv_states_, states_;
  int64_t key_dim_ = 0, value_dim_ = 0;
  std::vector<int64_t> split_;
};

}  // namespace

std::unique_ptr<TokenMixerPart> make_attention(const StackConfig& cfg, AttentionShape shape, StackLinear qkv,
                                               StackLinear o, std::optional<at::Tensor> q_norm,
                                               std::optional<at::Tensor> k_norm, at::Tensor cos, at::Tensor sin,
                                               at::Tensor k_cache, at::Tensor v_cache) {
  return std::make_unique<AttentionMixer>(cfg, shape, std::move(qkv), std::move(o), std::move(q_norm),
                                          std::move(k_norm), std::move(cos), std::move(sin), std::move(k_cache),
                                          std::move(v_cache));
}

std::unique_ptr<TokenMixerPart> make_gated_delta(const StackConfig& cfg, GatedDeltaShape shape, StackLinear in_proj,
                                                 StackLinear out_proj, at::Tensor conv_weight, at::Tensor a_log,
                                                 at::Tensor dt_bias, at::Tensor norm, at::Tensor conv_states,
                                                 at::Tensor states) {
  return std::make_unique<GatedDeltaMixer>(cfg, shape, std::move(in_proj), std::move(out_proj),
                                           std::move(conv_weight), std::move(a_log), std::move(dt_bias),
                                           std::move(norm), std::move(conv_states), std::move(states));
}

}  // namespace moeserve_stack
