// FFN parts of the DecodeStack (decode_stack.h): dense MLPs (SwiGLU, relu2), the MoE block (a routing rule, an
// expert op on the routed experts held here or fed by the caller, an optional shared expert) and a block's absent
// FFN, each as its Python class computes it.

#include "decode_stack.h"
#include "moe_experts_q4.h"

namespace moeserve_stack {

namespace {

// fn(a, b) for a row-wise fn of two [N, ...] tensors: the per-op path runs it inside linear.in_row_blocks, so each
// call sees blocks of exactly row_block rows (0: the whole tensors). The GEMVs around it are per row (the same bits
// for any row count) and run on the N rows only; the padding rows' values never reach a real row.
at::Tensor rowwise(const std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>& fn, const at::Tensor& a,
                   const at::Tensor& b, int64_t row_block) {
  if (row_block <= 0) return fn(a, b);
  const int64_t n = a.size(0), pad = (row_block - n % row_block) % row_block;
  auto padded = [&](const at::Tensor& t) {
    if (!pad) return t;
    std::vector<int64_t> shape = t.sizes().vec();
    shape[0] = pad;
    return at::cat({t, t.new_zeros(shape)});
  };
  const at::Tensor pa = padded(a), pb = padded(b);
  std::vector<at::Tensor> outs;
  for (int64_t i = 0; i < n + pad; i += row_block)
    outs.push_back(fn(pa.slice(0, i, i + row_block), pb.slice(0, i, i + row_block)));
  const at::Tensor out = outs.size() == 1 ? outs[0] : at::cat(outs);
  return pad ? out.slice(0, 0, n) : out;
}

// DenseMLP: down(silu(gate(x)) * up(x)).
class SwigluMlp : public DenseFfn {
 public:
  SwigluMlp(const StackConfig& cfg, StackLinear gate, StackLinear up, StackLinear down)
      : row_block_(cfg.row_block), gate_(std::move(gate)), up_(std::move(up)), down_(std::move(down)) {
    TORCH_CHECK(up_.out == gate_.out && down_.out == cfg.hidden, "DecodeStack: SwiGLU MLP sizes do not match");
  }
  at::Tensor operator()(const at::Tensor& x) const override {
    const at::Tensor act = rowwise([](const at::Tensor& g, const at::Tensor& u) { return at::silu(g) * u; },
                                   gate_(x), up_(x), row_block_);
    return down_(act);
  }

 private:
  int64_t row_block_;
  StackLinear gate_, up_, down_;
};

// block_parts.Relu2MLP: down(relu(up(x))^2), the activation in row blocks (the GEMVs are per row).
class Relu2Mlp : public DenseFfn {
 public:
  Relu2Mlp(const StackConfig& cfg, StackLinear up, StackLinear down)
      : row_block_(cfg.row_block), up_(std::move(up)), down_(std::move(down)) {
    TORCH_CHECK(down_.out == cfg.hidden, "DecodeStack: relu2 MLP sizes do not match");
  }
  at::Tensor operator()(const at::Tensor& x) const override {
    return down_(in_row_blocks([](const at::Tensor& u) { return at::square(at::relu(u)); }, up_(x), row_block_));
  }

 private:
  int64_t row_block_;
  StackLinear up_, down_;
};

class DenseMlp : public FfnPart {
 public:
  DenseMlp(const StackConfig& cfg, std::shared_ptr<const DenseFfn> mlp) : cfg_(cfg), mlp_(std::move(mlp)) {}

  bool start(Step&, const at::Tensor& x, at::Tensor& out) override {
    out = (*cfg_.timer)(kDenseMlp, [&] { return (*mlp_)(x); });
    return true;
  }

 private:
  StackConfig cfg_;
  std::shared_ptr<const DenseFfn> mlp_;
};

// NoMLP (a block with a mixer only): zeros, as the per-op path adds them.
class NoFfn : public FfnPart {
 public:
  bool start(Step&, const at::Tensor& x, at::Tensor& out) override {
    out = at::zeros_like(x);
    return true;
  }
};

// expert_kernels._FusedSwiGLU: the fused C++ SwiGLU op on [out, in] units (`plain`) or row-interleaved ones, bf16
// or int8 codes with row scales.
class FusedSwigluOp : public ExpertOp {
 public:
  explicit FusedSwigluOp(bool plain) : plain_(plain) {}
  void run(at::Tensor& out, const at::Tensor& x, const Units& u, const at::Tensor& token_of,
           const at::Tensor& weight_of, const std::vector<int64_t>& bounds) const override {
    const bool int8 = !u.gate_up_scale.empty();
    if (plain_ && int8)
      moeserve_moe::moe_swiglu_int8_(out, x, u.gate_up, u.gate_up_scale, u.down, u.down_scale, token_of, weight_of,
                                     bounds);
    else if (plain_)
      moeserve_moe::moe_swiglu_(out, x, u.gate_up, u.down, token_of, weight_of, bounds);
    else if (int8)
      moeserve_moe::moe_swiglu_int8_interleaved_(out, x, u.gate_up, u.gate_up_scale, u.down, u.down_scale, token_of,
                                                 weight_of, bounds);
    else
      moeserve_moe::moe_swiglu_interleaved_(out, x, u.gate_up, u.down, token_of, weight_of, bounds);
  }

 private:
  bool plain_;
};

// expert_kernels.CppQ4Experts: moe_q4_experts_ (4-bit units as stored, gpt-oss units) by its spec, parsed once; the
// units are each projection's first tensor (fused_spec.py).
class Q4Op : public ExpertOp {
 public:
  explicit Q4Op(const std::string& spec) : spec_(moeserve_q4::parse_spec(spec)) {}
  void run(at::Tensor& out, const at::Tensor& x, const Units& u, const at::Tensor& token_of,
           const at::Tensor& weight_of, const std::vector<int64_t>& bounds) const override {
    TORCH_CHECK(u.gate_up_scale.empty() && u.down_scale.empty(), "DecodeStack: q4 units carry their scales");
    moeserve_q4::run_experts(spec_, out, x, u.gate_up, u.down, token_of, weight_of, bounds);
  }

 private:
  moeserve_q4::Spec spec_;
};

// unit_math.expert_linear: F.linear on an [out, in] weight, else x @ w^T.
at::Tensor expert_linear(const at::Tensor& x, const at::Tensor& w) {
  return w.dim() == 2 ? at::linear(x, w) : at::matmul(x, w.mT());
}

// expert_kernels.TorchExperts on unit_math.Relu2Math units (up [I, H], down [H, I] in the compute dtype): per expert
// in order, its tokens' rows in row blocks through down(relu(up(x))^2), times their weights, added into out.
class Relu2LoopOp : public ExpertOp {
 public:
  explicit Relu2LoopOp(int64_t row_block) : row_block_(row_block) {}
  void run(at::Tensor& out, const at::Tensor& x, const Units& u, const at::Tensor& token_of,
           const at::Tensor& weight_of, const std::vector<int64_t>& bounds) const override {
    TORCH_CHECK(u.gate_up_scale.empty() && bounds.size() == 2 * u.gate_up.size(),
                "DecodeStack: relu2 units are up and down, one span each");
    for (size_t i = 0; i < u.gate_up.size(); ++i) {
      const at::Tensor &up = u.gate_up[i], &down = u.down[i];
      const int64_t lo = bounds[2 * i], hi = bounds[2 * i + 1];
      const at::Tensor tokens = token_of.slice(0, lo, hi);
      const at::Tensor rows = x.index({tokens});
      const at::Tensor y = in_row_blocks(
          [&](const at::Tensor& r) { return expert_linear(at::square(at::relu(expert_linear(r, up))), down); }, rows,
          row_block_);
      at::Tensor sum = out.index({tokens});  // out[tokens] += y: one rounding per add, as the torch loop
      sum += (y * weight_of.slice(0, lo, hi).unsqueeze(1)).to(out.scalar_type());
      out.index_put_({tokens}, sum);
    }
  }

 private:
  int64_t row_block_;
};

// moe_route_pairs: softmax then top-k (mode 0) or top-k then softmax (mode 1) of router(x).
class PairsRouting : public RoutingRule {
 public:
  PairsRouting(const StackConfig& cfg, StackLinear router, int64_t top_k, int64_t mode, bool norm, bool fp32)
      : cfg_(cfg), router_(std::move(router)), top_k_(top_k), mode_(mode), norm_(norm), fp32_(fp32) {
    TORCH_CHECK(mode == 0 || mode == 1, "DecodeStack: routing mode 0 or 1 (see moe_route_pairs)");
  }
  int64_t experts() const override { return router_.out; }

  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> route(const at::Tensor& x) override {
    Timer& t = *cfg_.timer;
    const at::Tensor logits = t(kRouter, [&] { return router_(x); });
    return t(kRouting, [&] { return moeserve_routing::moe_route_pairs(logits, top_k_, mode_, norm_, fp32_); });
  }

 private:
  StackConfig cfg_;
  StackLinear router_;
  int64_t top_k_, mode_;
  bool norm_, fp32_;
};

// noaux_tc (moe.CppSigmoidGroups): fp32 logits of an fp32 router, then moe_route_noaux.
class NoauxRouting : public RoutingRule {
 public:
  NoauxRouting(const StackConfig& cfg, StackLinear router, at::Tensor bias, int64_t top_k, int64_t n_group,
               int64_t topk_group, bool norm, double scale)
      : cfg_(cfg), router_(std::move(router)), bias_(std::move(bias)), top_k_(top_k), n_group_(n_group),
        topk_group_(topk_group), norm_(norm), scale_(scale) {}
  int64_t experts() const override { return router_.out; }

  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> route(const at::Tensor& x) override {
    Timer& t = *cfg_.timer;
    const at::Tensor logits = t(kRouter, [&] { return router_(x.to(at::kFloat)); });
    return t(kRouting, [&] {
      return moeserve_routing::moe_route_noaux(logits, bias_, top_k_, n_group_, topk_group_, norm_, scale_,
                                               cfg_.row_block);
    });
  }

 private:
  StackConfig cfg_;
  StackLinear router_;
  at::Tensor bias_;
  int64_t top_k_, n_group_, topk_group_;
  bool norm_;
  double scale_;
};

// MoEBlock: the routed experts (how their units come is the subclass's), then the shared expert, in that order.
class MoeFfn : public FfnPart {
 public:
  MoeFfn(const StackConfig& cfg, std::unique_ptr<RoutingRule> routing, std::optional<SharedExpert> shared,
         std::shared_ptr<const ExpertOp> op)
      : cfg_(cfg), routing_(std::move(routing)), shared_(std::move(shared)), op_(std::move(op)) {}
  bool is_moe() const override { return true; }

  // out + the shared expert of x (MoEBlock.__call__'s last lines).
  void finish(const at::Tensor& x, at::Tensor& out) override {
    if (!shared_) return;
    out = (*cfg_.timer)(kShared, [&] {
      const SharedExpert& s = *shared_;
      const at::Tensor mlp = (*s.mlp)(x);
      if (!s.gate_linear) return out + mlp;
      const at::Tensor gate = (*s.gate_linear)(x);  // [N, 1]
      return out + rowwise([](const at::Tensor& g, const at::Tensor& m) { return at::sigmoid(g) * m; }, gate, mlp,
                           cfg_.row_block);
    });
  }

 protected:
  // Routes x: keeps its (token, weight) pairs grouped by expert, the experts with tokens (ascending) and each
  // one's span of the pairs.
  void route(const at::Tensor& x) {
    auto [token_of, weight_of, counts, ids] = routing_->route(x);
    token_of_ = std::move(token_of);
    weight_of_ = std::move(weight_of);
    const int64_t* cnt = counts.data_ptr<int64_t>();
    needed_.clear();
    spans_.clear();
    for (int64_t e = 0, start = 0; e < counts.numel(); ++e) {
      if (cnt[e] == 0) continue;
      needed_.push_back(e);
      spans_.push_back(start);
      spans_.push_back(start + cnt[e]);
      start += cnt[e];
    }
  }

  // The expert op on `bounds`' experts of the routed pairs, added into out.
  void run_experts(at::Tensor& out, const at::Tensor& x, const Units& u, const std::vector<int64_t>& bounds) const {
    (*cfg_.timer)(kExperts, [&] {
      op_->run(out, x, u, token_of_, weight_of_, bounds);
      return 0;
    });
  }

  // The units of the needed experts, picked from `all` by unit index (index_of(expert)).
  template <class IndexOf>
  static Units pick(const Units& all, const std::vector<int64_t>& experts, IndexOf index_of) {
    Units u;
    for (const int64_t e : experts) {
      const int64_t i = index_of(e);
      u.gate_up.push_back(all.gate_up[i]);
      u.down.push_back(all.down[i]);
      if (!all.gate_up_scale.empty()) {
        u.gate_up_scale.push_back(all.gate_up_scale[i]);
        u.down_scale.push_back(all.down_scale[i]);
      }
    }
    return u;
  }

  StackConfig cfg_;
  std::unique_ptr<RoutingRule> routing_;
  std::optional<SharedExpert> shared_;
  std::shared_ptr<const ExpertOp> op_;
  at::Tensor token_of_, weight_of_;
  std::vector<int64_t> needed_, spans_;
};

// Every expert's unit held for the process's life (a resident store): the whole layer in one go; hits counted.
class HeldMoe : public MoeFfn {
 public:
  HeldMoe(const StackConfig& cfg, std::unique_ptr<RoutingRule> routing, std::optional<SharedExpert> shared,
          std::shared_ptr<const ExpertOp> op, Units units)
      : MoeFfn(cfg, std::move(routing), std::move(shared), std::move(op)), units_(std::move(units)) {}

  bool start(Step& step, const at::Tensor& x, at::Tensor& out) override {
    route(x);
    step.hits[step.moe_index++] += static_cast<int64_t>(needed_.size());
    out = at::zeros_like(x);
    run_experts(out, x, pick(units_, needed_, [](int64_t e) { return e; }), spans_);
    finish(x, out);
    return true;
  }

 private:
  Units units_;
};

// Units fed by the caller from the store at each step, or taken from the store's cached slots when all are there.
class FedMoe : public MoeFfn {
 public:
  FedMoe(const StackConfig& cfg, std::unique_ptr<RoutingRule> routing, std::optional<SharedExpert> shared,
         std::shared_ptr<const ExpertOp> op, std::shared_ptr<const CachedUnits> cached)
      : MoeFfn(cfg, std::move(routing), std::move(shared), std::move(op)), cached_(std::move(cached)) {}

  bool start(Step& step, const at::Tensor& x, at::Tensor& out) override {
    const int64_t index = step.moe_index++;  // its hits and misses are the store's
    route(x);
    out = at::zeros_like(x);
    fed_ = 0;
    if (!run_cached(step, index, x, out)) return false;
    finish(x, out);
    return true;
  }

  const std::vector<int64_t>& needed() const override { return needed_; }

  void feed(const at::Tensor& x, at::Tensor& out, const std::vector<int64_t>& ids, const Units& u) override {
    const size_t k = ids.size();
    TORCH_CHECK(u.gate_up.size() == k && u.down.size() == k && u.gate_up_scale.size() == u.down_scale.size() &&
                    (u.gate_up_scale.empty() || u.gate_up_scale.size() == k),
                "DecodeStack.feed: one gate_up and down unit (and scales for int8) per expert id");
    TORCH_CHECK(fed_ + k <= needed_.size(), "DecodeStack.feed: more experts than the layer needs");
    for (size_t j = 0; j < k; ++j)
      TORCH_CHECK(ids[j] == needed_[fed_ + j], "DecodeStack.feed: expert ", ids[j], " fed where expert ",
                  needed_[fed_ + j], " comes next");
    const std::vector<int64_t> bounds(spans_.begin() + 2 * fed_, spans_.begin() + 2 * (fed_ + k));
    run_experts(out, x, u, bounds);
    fed_ += k;
  }

  void finish(const at::Tensor& x, at::Tensor& out) override {
    TORCH_CHECK(fed_ == needed_.size(), "DecodeStack.resume: ", needed_.size() - fed_,
                " of the layer's experts were not fed");
    MoeFfn::finish(x, out);
  }

 private:
  // All needed experts in the store's slots: the op on their units into out, and the call logged for the store.
  // False (nothing done) when one is not cached or no slots were set.
  bool run_cached(Step& step, int64_t index, const at::Tensor& x, at::Tensor& out) {
    if (!cached_->slot_of.defined()) return false;
    const int32_t* slot = cached_->slot_of.data_ptr<int32_t>() + index * cached_->slot_of.size(1);
    for (const int64_t e : needed_)
      if (slot[e] < 0) return false;
    run_experts(out, x, pick(cached_->slots, needed_, [slot](int64_t e) { return slot[e]; }), spans_);
    fed_ = needed_.size();
    step.cached_log.push_back(index);
    step.cached_log.push_back(static_cast<int64_t>(needed_.size()));
    step.cached_log.insert(step.cached_log.end(), needed_.begin(), needed_.end());
    return true;
  }

  std::shared_ptr<const CachedUnits> cached_;
  size_t fed_ = 0;
};

}  // namespace

std::shared_ptr<const DenseFfn> make_swiglu(const StackConfig& cfg, StackLinear gate, StackLinear up,
                                            StackLinear down) {
  return std::make_shared<SwigluMlp>(cfg, std::move(gate), std::move(up), std::move(down));
}

std::shared_ptr<const DenseFfn> make_relu2(const StackConfig& cfg, StackLinear up, StackLinear down) {
  return std::make_shared<Relu2Mlp>(cfg, std::move(up), std::move(down));
}

std::unique_ptr<FfnPart> make_dense_mlp(const StackConfig& cfg, std::shared_ptr<const DenseFfn> mlp) {
  return std::make_unique<DenseMlp>(cfg, std::move(mlp));
}

std::unique_ptr<FfnPart> make_no_ffn() { return std::make_unique<NoFfn>(); }

std::shared_ptr<const ExpertOp> make_expert_op(const StackConfig& cfg, const std::string& name, bool plain) {
  if (name == "fused") return std::make_shared<FusedSwigluOp>(plain);
  if (name == "relu2-loop") return std::make_shared<Relu2LoopOp>(cfg.row_block);
  if (name.rfind("q4 ", 0) == 0) return std::make_shared<Q4Op>(name.substr(3));
  TORCH_CHECK(false, "DecodeStack: unknown expert op '", name, "' (fused, relu2-loop, q4 <spec>)");
}

std::unique_ptr<RoutingRule> make_pairs_routing(const StackConfig& cfg, StackLinear router, int64_t top_k,
                                                int64_t mode, bool norm_topk_prob, bool weights_in_fp32) {
  return std::make_unique<PairsRouting>(cfg, std::move(router), top_k, mode, norm_topk_prob, weights_in_fp32);
}

std::unique_ptr<RoutingRule> make_noaux_routing(const StackConfig& cfg, StackLinear router, at::Tensor bias,
                                                int64_t top_k, int64_t n_group, int64_t topk_group,
                                                bool norm_topk_prob, double routed_scaling_factor) {
  return std::make_unique<NoauxRouting>(cfg, std::move(router), std::move(bias), top_k, n_group, topk_group,
                                        norm_topk_prob, routed_scaling_factor);
}

std::unique_ptr<FfnPart> make_held_moe(const StackConfig& cfg, std::unique_ptr<RoutingRule> routing,
                                       std::optional<SharedExpert> shared, std::shared_ptr<const ExpertOp> op,
                                       Units units) {
  return std::make_unique<HeldMoe>(cfg, std::move(routing), std::move(shared), std::move(op), std::move(units));
}

std::unique_ptr<FfnPart> make_fed_moe(const StackConfig& cfg, std::unique_ptr<RoutingRule> routing,
                                      std::optional<SharedExpert> shared, std::shared_ptr<const ExpertOp> op,
                                      std::shared_ptr<const CachedUnits> cached) {
  return std::make_unique<FedMoe>(cfg, std::move(routing), std::move(shared), std::move(op), std::move(cached));
}

}  // namespace moeserve_stack
