// Token mixer parts of the DecodeStack (decode_stack.h) for Nemotron-H's blocks: Mamba-2's decode step (the
// decode-only path of models/mixers/mamba2.py Mamba2Mixer with the C++ kernels: the same ops, ATen ones on the same shapes
// in the same row blocks, in the same order), and the absent mixer of a block that has only an FFN.

#include "decode_stack.h"

namespace moeserve_stack {

namespace {

// Mamba2Mixer.__call__ for a decode-only batch of tokens after their prompts (CppMamba2's conv and step):
//   z, xBC, dt = in_proj(x); xBC = silu(conv(xBC)); dt = softplus(dt + dt_bias); decay = exp(dt * A)
//   y = mamba2_step_(...) (fp32 copy); out = out_proj(gated_norm([y | z | stepped flag]))
class Mamba2Mixer : public TokenMixerPart {
 public:
  Mamba2Mixer(const StackConfig& cfg, Mamba2Shape shape, StackLinear in_proj, StackLinear out_proj,
              at::Tensor conv_weight, std::optional<at::Tensor> conv_bias, at::Tensor a, at::Tensor d,
              at::Tensor dt_bias, at::Tensor norm, at::Tensor conv_states, at::Tensor states)
      : cfg_(cfg), s_(shape), in_proj_(std::move(in_proj)), out_proj_(std::move(out_proj)),
        conv_weight_(std::move(conv_weight)), conv_bias_(std::move(conv_bias)), a_(std::move(a)), d_(std::move(d)),
        dt_bias_(std::move(dt_bias)), norm_(std::move(norm)), conv_states_(std::move(conv_states)),
        states_(std::move(states)) {
    inner_ = s_.heads * s_.head_dim;
    const int64_t conv_dim = inner_ + 2 * s_.n_groups * s_.state;
    split_ = {inner_, conv_dim, s_.heads};
    TORCH_CHECK(in_proj_.out == inner_ + conv_dim + s_.heads && out_proj_.out == cfg_.hidden &&
                    conv_weight_.dim() == 2 && conv_weight_.size(0) == conv_dim && norm_.numel() == inner_ &&
                    a_.scalar_type() == at::kFloat && a_.numel() == s_.heads && s_.heads % s_.n_groups == 0,
                "DecodeStack: Mamba-2 sizes do not match");
  }

  int64_t kv_group() const override { return s_.group; }

  at::Tensor forward(Step& step, const at::Tensor& x) override {
    Timer& t = *cfg_.timer;
    const int64_t n = x.size(0);
    const at::Tensor proj = t(kQkv, [&] { return in_proj_(x); });
    const std::vector<at::Tensor> parts = proj.split_with_sizes(split_, -1);  // z, xBC, dt (views)
    const at::Tensor y = t(kAttention, [&] { return ssm(step, parts[1], parts[2]); });  // [N, inner] fp32
    const at::Tensor normed = t(kAttention, [&] {
      const at::Tensor flags = at::ones({n, 1}, y.options());  // every token stepped
      return in_row_blocks([this](const at::Tensor& rows) { return gated_norm(rows); },
                           at::cat({y, parts[0].to(at::kFloat), flags}, -1), cfg_.row_block);
    });
    return t(kOProj, [&] { return out_proj_(normed.to(x.scalar_type())); });
  }

 private:
  // The conv, activations and selective-state update of each sequence's one new token -> y [N, inner] fp32.
  at::Tensor ssm(const Step& step, const at::Tensor& xbc_in, const at::Tensor& dt_in) {
    const int64_t n = xbc_in.size(0);
    const at::Tensor slots = step.block_tables[s_.group].select(1, 0).contiguous();  // each sequence's state slot
    const at::Tensor fresh = step.positions.eq(0).to(at::kLong);
    const int64_t *slot = slots.data_ptr<int64_t>(), *is_fresh = fresh.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i)
      if (is_fresh[i]) states_.select(0, slot[i]).zero_();  // a sequence's first token starts from a zero state
    const at::Tensor conv = moeserve_mamba2::mamba2_conv_(xbc_in, conv_weight_, conv_bias_, conv_states_, slots,
                                                          at::ones({n}, at::kLong), fresh);
    const int64_t rb = cfg_.row_block;
    const at::Tensor xbc = in_row_blocks([](const at::Tensor& r) { return at::silu(r); }, conv, rb);
    const at::Tensor dt = in_row_blocks([this](const at::Tensor& r) { return at::softplus(r + dt_bias_); }, dt_in, rb);
    const at::Tensor decay = in_row_blocks([this](const at::Tensor& r) { return at::exp(r.to(at::kFloat) * a_); },
                                           dt, rb);
    const at::Tensor y = moeserve_mamba2::mamba2_step_(xbc, dt, decay, d_, states_, at::arange(n, at::kLong), slots,
                                                       s_.n_groups);
    return y.to(at::kFloat).reshape({n, -1});
  }

  // Mamba2Mixer._gated_norm on rows [n, 2 inner + 1] = (y fp32, z, stepped flag): y * silu(z) RMS-normed per group,
  // times the weight (rounded to the compute dtype for stepped tokens, in fp32 otherwise).
  at::Tensor gated_norm(const at::Tensor& rows) const {
    const int64_t n = rows.size(0);
    const std::vector<at::Tensor> p = rows.split_with_sizes({inner_, inner_, 1}, -1);  // y, z, stepped
    at::Tensor h = (p[0] * at::silu(p[1])).reshape({n, s_.n_groups, -1});
    h = (h * at::rsqrt(h.pow(2).mean(-1, true) + s_.norm_eps)).reshape({n, inner_});
    const at::Tensor rounded = norm_ * h.to(norm_.scalar_type());
    return at::where(p[2] > 0, rounded.to(at::kFloat), norm_.to(at::kFloat) * h);
  }

  StackConfig cfg_;
  Mamba2Shape s_;
  StackLinear in_proj_, out_proj_;
  at::Tensor conv_weight_;
  std::optional<at::Tensor> conv_bias_;
  at::Tensor a_, d_, dt_bias_, norm_, conv_states_, states_;
  int64_t inner_ = 0;
  std::vector<int64_t> split_;
};

// NoMixer (a block with an FFN only): zeros, as the per-op path adds them.
class NoMixer : public TokenMixerPart {
 public:
  at::Tensor forward(Step&, const at::Tensor& x) override { return at::zeros_like(x); }
};

}  // namespace

std::unique_ptr<TokenMixerPart> make_mamba2(const StackConfig& cfg, Mamba2Shape shape, StackLinear in_proj,
                                            StackLinear out_proj, at::Tensor conv_weight,
                                            std::optional<at::Tensor> conv_bias, at::Tensor a, at::Tensor d,
                                            at::Tensor dt_bias, at::Tensor norm, at::Tensor conv_states,
                                            at::Tensor states) {
  return std::make_unique<Mamba2Mixer>(cfg, shape, std::move(in_proj), std::move(out_proj), std::move(conv_weight),
                                       std::move(conv_bias), std::move(a), std::move(d), std::move(dt_bias),
                                       std::move(norm), std::move(conv_states), std::move(states));
}

std::unique_ptr<TokenMixerPart> make_no_mixer() { return std::make_unique<NoMixer>(); }

}  // namespace moeserve_stack
