// DecodeStack: a whole decode step through every decoder layer in ONE call from Python.
//
// The per-op path (passes.CppLayers, the token mixers, MoEBlock) issues ~10 op calls and ~100 lines of Python per
// layer; at batch 1 on the small bench model that is ~12% of the step (scripts/decode_breakdown.py). This class
// holds each layer's parts once (decode_stack.h: a token mixer part and an FFN part per layer, each a class of its
// own), and `step` runs them with the residual adds and norms of CppLayers in between:
//
//   x = rms_norm(h, layer 0's input norm)
//   per layer:  o = mixer.forward(x)                 x = add_rms_norm_(h, o, post_norm)       (h += o)
//               m = ffn(x)                           x = add_rms_norm_(h, m, next input norm, or the final norm)
//
// Each part calls the same functions as the per-op path in the same order, so the output is bit-identical to it;
// only the Python between them is gone. moeserve/models/decode_stack.py decides eligibility (each Python layer
// part says why it cannot be stacked) and falls back to the per-op path otherwise.
//
// `hits[j]` is increased by the number of experts the j-th MoE layer used (the store's hit count: one per needed
// expert per layer call) for layers holding their units, so the store's statistics stay true.
//
// Offloaded experts (the store moves units between tiers, so no unit can be held here): a MoE layer added with
// `add_moe_external` has its router only, and a step becomes a conversation with the caller, who asks the store:
//
//   ids = begin(h, positions, slot_mappings, block_tables, hits)   runs up to the first such layer's routing; its
//   while ids.numel():                           needed experts (ascending, int64), or an empty tensor at the end
//       layer = MoE layer number waiting_moe_index()
//       for chunk in store.experts(layer, ids):  units as the store yields them, ascending, several calls
//           feed(chunk ids, units...)            the expert op on them, added into the layer's output in order
//       ids = resume()                           the shared expert (if any), the residual add, then on
//   x = result()
//
// The op adds expert after expert whatever the chunking (csrc/moe_experts.cpp), so this too gives the per-op
// path's bits; those layers' hits and misses are the store's own.
//
// Layers whose experts are all in the store's fast tier need not stop: after `set_cached_units(units of each slot,
// slot_of)` (slot_of: int32 [MoE layers, experts], the store's slot of each unit ready in it, -1 otherwise; the
// store keeps it up to date) such a layer runs the op on the slots' units at once and logs its call; begin / resume
// return only at a layer with an expert to read (`waiting_moe_index` says which). The caller hands the log
// (`take_cached_log`: moe index, count, expert ids, ... in order) to the store, which counts the hits and tells its
// policy before its next call, as if each layer had asked it. Only for a store in which nothing else evicts while
// the step runs (no prefetch thread); a miss's reads have all landed when its layer call ends.
//
// Building: add a mixer (add_attention / add_gated_delta / add_mla / add_mamba2 / add_no_mixer), then its FFN
// (add_dense_mlp / add_relu2_mlp / add_no_ffn, or a routing rule (route_by_pairs / route_by_noaux), optionally
// add_shared_expert / add_relu2_shared_expert and use_expert_op, then add_moe / add_moe_external), per layer.

#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>

#include "decode_stack.h"

namespace moeserve_stack {

at::Tensor in_row_blocks(const std::function<at::Tensor(const at::Tensor&)>& fn, const at::Tensor& x,
                         int64_t row_block) {
  if (row_block <= 0) return fn(x);
  const int64_t n = x.size(0), pad = (row_block - n % row_block) % row_block;
  at::Tensor padded = x;
  if (pad) {
    std::vector<int64_t> shape = x.sizes().vec();
    shape[0] = pad;
    padded = at::cat({x, x.new_zeros(shape)});
  }
  std::vector<at::Tensor> outs;
  for (int64_t i = 0; i < n + pad; i += row_block) outs.push_back(fn(padded.slice(0, i, i + row_block)));
  at::Tensor out = outs.size() == 1 ? outs[0] : at::cat(outs);
  return pad ? out.slice(0, 0, n) : out;
}

at::Tensor StackLinear::operator()(const at::Tensor& x) const {
  if (scale.has_value()) return moeserve_dense_int8::linear_interleaved_int8(x, weight, *scale, out, bias, false);
  if (weight.dim() == 1) return moeserve_dense::linear_interleaved(x, weight, out, bias);
  return in_row_blocks([&](const at::Tensor& rows) { return at::linear(rows, weight, bias); }, x, row_block);
}

StackLinear stack_linear(const at::Tensor& weight, const std::optional<at::Tensor>& scale,
                         const std::optional<at::Tensor>& bias, int64_t in_features, int64_t row_block,
                         const char* what) {
  TORCH_CHECK(weight.device().is_cpu() && weight.is_contiguous() && in_features > 0 &&
                  weight.numel() % in_features == 0,
              "DecodeStack: ", what, " must be a contiguous CPU weight of out x ", in_features, " elements");
  TORCH_CHECK(scale.has_value() == (weight.scalar_type() == at::kChar),
              "DecodeStack: ", what, " is int8 codes with a scale or bf16 / fp32 without one");
  TORCH_CHECK(weight.dim() == 1 || (weight.dim() == 2 && weight.scalar_type() == at::kFloat && !scale),
              "DecodeStack: ", what, " is packed (flat) or a plain float32 [out, in] matrix");
  return StackLinear{weight, scale, bias, weight.numel() / in_features, weight.dim() == 2 ? row_block : 0};
}

const std::vector<int64_t>& FfnPart::needed() const {
  TORCH_CHECK(false, "DecodeStack: this layer's FFN takes no fed experts");
}
void FfnPart::feed(const at::Tensor&, at::Tensor&, const std::vector<int64_t>&, const Units&) {
  TORCH_CHECK(false, "DecodeStack: this layer's FFN takes no fed experts");
}
void FfnPart::finish(const at::Tensor&, at::Tensor&) {}

struct Layer {
  at::Tensor input_norm, post_norm;
  std::unique_ptr<TokenMixerPart> mixer;
  std::unique_ptr<FfnPart> ffn;
};

class DecodeStack : public torch::CustomClassHolder {
 public:
  // hidden size, the norm rule (eps, fp32_scale), row_block (linear.ROW_BLOCK when batch-invariant, else 0), and
  // the final norm applied after the last layer.
  DecodeStack(int64_t hidden, double eps, bool fp32_scale, int64_t row_block, at::Tensor final_norm)
      : final_norm_(std::move(final_norm)) {
    cfg_.hidden = hidden;
    cfg_.eps = eps;
    cfg_.fp32_scale = fp32_scale;
    cfg_.row_block = row_block;
    cfg_.timer = std::make_shared<Timer>();
    TORCH_CHECK(hidden > 0 && row_block >= 0, "DecodeStack: hidden > 0 and row_block >= 0");
  }

  // A new layer's norms and attention (Attention's C++ path; see AttentionShape in decode_stack.h).
  void add_attention(at::Tensor input_norm, at::Tensor post_norm, at::Tensor qkv, std::optional<at::Tensor> qkv_scale,
                     std::optional<at::Tensor> qkv_bias, at::Tensor o, std::optional<at::Tensor> o_scale,
                     std::optional<at::Tensor> o_bias, std::optional<at::Tensor> q_norm,
                     std::optional<at::Tensor> k_norm, at::Tensor cos, at::Tensor sin, at::Tensor k_cache,
                     at::Tensor v_cache, std::vector<int64_t> sizes, double scale) {
    TORCH_CHECK(sizes.size() == 7, "DecodeStack.add_attention: sizes (heads, kv_heads, head_dim, window, group, "
                "output gate 0/1, torch q/k norm 0/1)");
    const AttentionShape shape{sizes[0], sizes[1], sizes[2], sizes[3], sizes[4], scale, sizes[5] != 0, sizes[6] != 0};
    const int64_t q_size = shape.heads * shape.head_dim;
    add_mixer(std::move(input_norm), std::move(post_norm),
              make_attention(cfg_, shape, linear(qkv, qkv_scale, qkv_bias, cfg_.hidden, "qkv"),
                             linear(o, o_scale, o_bias, q_size, "o_proj"), std::move(q_norm), std::move(k_norm),
                             std::move(cos), std::move(sin), std::move(k_cache), std::move(v_cache)));
  }

  // A new layer's norms and Gated DeltaNet mixer (its decode step; sizes: k heads, v heads, k dim, v dim, group).
  void add_gated_delta(at::Tensor input_norm, at::Tensor post_norm, at::Tensor in_proj,
                       std::optional<at::Tensor> in_scale, at::Tensor out_proj, std::optional<at::Tensor> out_scale,
                       at::Tensor conv_weight, at::Tensor a_log, at::Tensor dt_bias, at::Tensor norm,
                       at::Tensor conv_states, at::Tensor states, std::vector<int64_t> sizes) {
    TORCH_CHECK(sizes.size() == 5, "DecodeStack.add_gated_delta: sizes (k heads, v heads, k dim, v dim, group)");
    const GatedDeltaShape shape{sizes[0], sizes[1], sizes[2], sizes[3], sizes[4]};
    add_mixer(std::move(input_norm), std::move(post_norm),
              make_gated_delta(cfg_, shape, linear(in_proj, in_scale, std::nullopt, cfg_.hidden, "in_proj"),
                               linear(out_proj, out_scale, std::nullopt, shape.num_v_heads * shape.v_head_dim,
                                      "out_proj"),
                               std::move(conv_weight), std::move(a_log), std::move(dt_bias), std::move(norm),
                               std::move(conv_states), std::move(states)));
  }

  // A new layer's norms and latent attention (MlaAttention; q_a / q_a_norm absent without q_lora_rank; sizes:
  // heads, nope, rope, kv_lora, v dim, group, rotary dim, query block (unused: mla_attention attends each row alone),
  // interleaved rope 0/1; w_uk_t [nh, R, nope] and w_uv [nh, v, R] as mla_attention takes them).
  void add_mla(at::Tensor input_norm, at::Tensor post_norm, std::optional<at::Tensor> q_a,
               std::optional<at::Tensor> q_a_scale, std::optional<at::Tensor> q_a_bias,
               std::optional<at::Tensor> q_a_norm, at::Tensor q, std::optional<at::Tensor> q_scale,
               std::optional<at::Tensor> q_bias, at::Tensor kv_a, std::optional<at::Tensor> kv_a_scale,
               std::optional<at::Tensor> kv_a_bias, at::Tensor kv_a_norm, at::Tensor w_uk_t, at::Tensor w_uv,
               at::Tensor o, std::optional<at::Tensor> o_scale, std::optional<at::Tensor> o_bias, at::Tensor cos,
               at::Tensor sin, at::Tensor cache, std::vector<int64_t> sizes, double softmax_scale) {
    TORCH_CHECK(sizes.size() == 9, "DecodeStack.add_mla: sizes (heads, nope, rope, kv_lora, v dim, group, rotary "
                "dim, query block, interleaved rope 0/1)");
    const MlaShape shape{sizes[0], sizes[1], sizes[2], sizes[3], sizes[4], sizes[5], sizes[6], sizes[7],
                         softmax_scale, sizes[8] != 0};
    std::optional<StackLinear> qa;
    if (q_a.has_value()) qa = linear(*q_a, q_a_scale, q_a_bias, cfg_.hidden, "q_a_proj");
    const int64_t q_in = qa.has_value() ? qa->out : cfg_.hidden;
    add_mixer(std::move(input_norm), std::move(post_norm),
              make_mla(cfg_, shape, std::move(qa), std::move(q_a_norm), linear(q, q_scale, q_bias, q_in, "q_proj"),
                       linear(kv_a, kv_a_scale, kv_a_bias, cfg_.hidden, "kv_a_proj"), std::move(kv_a_norm),
                       std::move(w_uk_t), std::move(w_uv),
                       linear(o, o_scale, o_bias, shape.heads * shape.v_head_dim, "o_proj"), std::move(cos),
                       std::move(sin), std::move(cache)));
  }

  // A new layer's norms and Mamba-2 mixer (its decode step; a [H] fp32 = -exp(A_log); sizes: heads, head dim,
  // groups, state size, group; norm_eps: its gated group norm's).
  void add_mamba2(at::Tensor input_norm, at::Tensor post_norm, at::Tensor in_proj, std::optional<at::Tensor> in_scale,
                  std::optional<at::Tensor> in_bias, at::Tensor out_proj, std::optional<at::Tensor> out_scale,
                  std::optional<at::Tensor> out_bias, at::Tensor conv_weight, std::optional<at::Tensor> conv_bias,
                  at::Tensor a, at::Tensor d, at::Tensor dt_bias, at::Tensor norm, at::Tensor conv_states,
                  at::Tensor states, std::vector<int64_t> sizes, double norm_eps) {
    TORCH_CHECK(sizes.size() == 5, "DecodeStack.add_mamba2: sizes (heads, head dim, groups, state size, group)");
    const Mamba2Shape shape{sizes[0], sizes[1], sizes[2], sizes[3], sizes[4], norm_eps};
    add_mixer(std::move(input_norm), std::move(post_norm),
              make_mamba2(cfg_, shape, linear(in_proj, in_scale, in_bias, cfg_.hidden, "in_proj"),
                          linear(out_proj, out_scale, out_bias, shape.heads * shape.head_dim, "out_proj"),
                          std::move(conv_weight), std::move(conv_bias), std::move(a), std::move(d),
                          std::move(dt_bias), std::move(norm), std::move(conv_states), std::move(states)));
  }

  // A new layer without a token mixer (a one-part block: its FFN follows).
  void add_no_mixer(at::Tensor input_norm, at::Tensor post_norm) {
    add_mixer(std::move(input_norm), std::move(post_norm), make_no_mixer());
  }

  // The last layer's FFN is dense: down(silu(gate(x)) * up(x)).
  void add_dense_mlp(at::Tensor gate, std::optional<at::Tensor> gate_scale, at::Tensor up,
                     std::optional<at::Tensor> up_scale, at::Tensor down, std::optional<at::Tensor> down_scale) {
    set_ffn(make_dense_mlp(cfg_, swiglu(gate, gate_scale, up, up_scale, down, down_scale, "dense")));
  }

  // The last layer's FFN is a dense relu2 MLP: down(relu(up(x))^2).
  void add_relu2_mlp(at::Tensor up, std::optional<at::Tensor> up_scale, at::Tensor down,
                     std::optional<at::Tensor> down_scale) {
    set_ffn(make_dense_mlp(cfg_, relu2(up, up_scale, down, down_scale, "dense")));
  }

  // The last layer has no FFN (a one-part block).
  void add_no_ffn() { set_ffn(make_no_ffn()); }

  // The next MoE layer routes by moe_route_pairs `mode` (softmax then top-k, or top-k then softmax).
  void route_by_pairs(at::Tensor router, std::optional<at::Tensor> router_scale, std::optional<at::Tensor> router_bias,
                      int64_t top_k, int64_t mode, bool norm_topk_prob, bool weights_in_fp32) {
    routing_ = make_pairs_routing(cfg_, linear(router, router_scale, router_bias, cfg_.hidden, "router"), top_k, mode,
                                  norm_topk_prob, weights_in_fp32);
  }

  // The next MoE layer routes by noaux_tc (moe_route_noaux) with its correction bias [E] fp32.
  void route_by_noaux(at::Tensor router, std::optional<at::Tensor> router_bias, at::Tensor correction_bias,
                      int64_t top_k, int64_t n_group, int64_t topk_group, bool norm_topk_prob,
                      double routed_scaling_factor) {
    routing_ = make_noaux_routing(cfg_, linear(router, std::nullopt, router_bias, cfg_.hidden, "router"),
                                  std::move(correction_bias), top_k, n_group, topk_group, norm_topk_prob,
                                  routed_scaling_factor);
  }

  // The next MoE layer has a shared expert (a dense SwiGLU MLP; with `gate` given, times sigmoid(gate(x))).
  void add_shared_expert(at::Tensor gate, std::optional<at::Tensor> gate_scale, at::Tensor up,
                         std::optional<at::Tensor> up_scale, at::Tensor down, std::optional<at::Tensor> down_scale,
                         std::optional<at::Tensor> sigmoid_gate, std::optional<at::Tensor> sigmoid_gate_scale) {
    set_shared(swiglu(gate, gate_scale, up, up_scale, down, down_scale, "shared"), sigmoid_gate,
               sigmoid_gate_scale);
  }

  // The next MoE layer has a relu2 shared expert (Nemotron-H), optionally times sigmoid(gate(x)).
  void add_relu2_shared_expert(at::Tensor up, std::optional<at::Tensor> up_scale, at::Tensor down,
                               std::optional<at::Tensor> down_scale, std::optional<at::Tensor> sigmoid_gate,
                               std::optional<at::Tensor> sigmoid_gate_scale) {
    set_shared(relu2(up, up_scale, down, down_scale, "shared"), sigmoid_gate, sigmoid_gate_scale);
  }

  // The next MoE layer computes its experts by the op of this name (ExpertOp in decode_stack.h; "fused" if not set).
  void use_expert_op(std::string name) { op_name_ = std::move(name); }

  // The last layer's FFN is a MoE block holding every expert's unit (int8 units come with row scales).
  void add_moe(std::vector<at::Tensor> gate_up, std::vector<at::Tensor> gate_up_scale, std::vector<at::Tensor> down,
               std::vector<at::Tensor> down_scale) {
    auto routing = take_routing();
    TORCH_CHECK(static_cast<int64_t>(gate_up.size()) == routing->experts() && down.size() == gate_up.size() &&
                    (gate_up_scale.empty() ||
                     (gate_up_scale.size() == gate_up.size() && down_scale.size() == gate_up.size())),
                "DecodeStack: one gate_up and down unit (and scales for int8) per expert of the router");
    set_ffn(make_held_moe(cfg_, std::move(routing), take_shared(), take_op(false),
                          Units{std::move(gate_up), std::move(gate_up_scale), std::move(down), std::move(down_scale)}));
    ++moe_layers_;
  }

  // The last layer's FFN is a MoE block whose experts the caller feeds at each step (begin / feed / resume): units
  // in the row-interleaved layout or, with `plain`, as [out, in] matrices; bf16 or int8 as fed.
  void add_moe_external(bool plain) {
    auto routing = take_routing();
    experts_ = routing->experts();
    set_ffn(make_fed_moe(cfg_, std::move(routing), take_shared(), take_op(plain), cached_));
    ++moe_layers_;
    ++external_layers_;
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // The units of every slot of the store's fast tier (fields as `feed` takes them; scales empty for bf16) and its
  // table slot_of [MoE layers, experts] int32 (see the header): fed layers whose experts are all cached run here.
  void set_cached_units(std::vector<at::Tensor> gate_up, std::vector<at::Tensor> gate_up_scale,
                        std::vector<at::Tensor> down, std::vector<at::Tensor> down_scale, at::Tensor slot_of) {
    TORCH_CHECK(external_layers_ == moe_layers_ && moe_layers_ > 0, "DecodeStack: cached units need fed MoE layers");
    TORCH_CHECK(down.size() == gate_up.size() && gate_up_scale.size() == down_scale.size() &&
                    (gate_up_scale.empty() || gate_up_scale.size() == gate_up.size()),
                "DecodeStack: one gate_up and down unit (and scales for int8) per slot");
    TORCH_CHECK(slot_of.scalar_type() == at::kInt && slot_of.is_contiguous() && slot_of.dim() == 2 &&
                    slot_of.size(0) == moe_layers_ && slot_of.size(1) == experts_,
                "DecodeStack: slot_of must be int32 [MoE layers, experts]");
    cached_->slots = Units{std::move(gate_up), std::move(gate_up_scale), std::move(down), std::move(down_scale)};
    cached_->slot_of = std::move(slot_of);
  }

  // The MoE index (0-based, among MoE layers) of the fed layer waiting for its experts.
  int64_t waiting_moe_index() const {
    TORCH_CHECK(waiting_, "DecodeStack.waiting_moe_index: no layer is waiting for experts");
    return step_.moe_index - 1;
  }

  // The fed layers that ran on cached units since the last call, in order: (moe index, count, expert ids...) each.
  at::Tensor take_cached_log() {
    at::Tensor log = at::tensor(step_.cached_log, at::kLong);
    step_.cached_log.clear();
    return log;
  }

  // h [N, H] (one new token per sequence, hidden states after the embedding; updated in place to the residual
  // stream after the last layer), positions int64 [N], per KV group the cache row of each token (slot_mappings,
  // int64 [N]) and each sequence's block table (int64 [N, max blocks]), hits int64 [MoE layers] (added to).
  // Returns the final-normed hidden states [N, H]. Every MoE layer's units must be held here (add_moe).
  at::Tensor step(at::Tensor h, const at::Tensor& positions, std::vector<at::Tensor> slot_mappings,
                  std::vector<at::Tensor> block_tables, at::Tensor hits) {
    TORCH_CHECK(external_layers_ == 0, "DecodeStack.step: some MoE layers are fed by the caller (begin/feed/resume)");
    begin(std::move(h), positions, std::move(slot_mappings), std::move(block_tables), std::move(hits));
    return result();
  }

  // Starts a step (arguments as `step`) and runs it up to the first layer added with add_moe_external: returns the
  // experts that layer needs (int64, ascending), or an empty tensor when the step ran to its end (then `result`).
  at::Tensor begin(at::Tensor h, const at::Tensor& positions, std::vector<at::Tensor> slot_mappings,
                   std::vector<at::Tensor> block_tables, at::Tensor hits) {
    TORCH_CHECK(!layers_.empty() && layers_.back().ffn, "DecodeStack: no layers, or the last one has no FFN");
    TORCH_CHECK(h.dim() == 2 && h.size(1) == cfg_.hidden && h.is_contiguous(),
                "DecodeStack: h must be contiguous [N, H]");
    TORCH_CHECK(hits.scalar_type() == at::kLong && hits.is_contiguous() && hits.numel() == moe_layers_,
                "DecodeStack: hits must be int64 [MoE layers]");
    TORCH_CHECK(static_cast<int64_t>(slot_mappings.size()) == groups_ &&
                    static_cast<int64_t>(block_tables.size()) == groups_,
                "DecodeStack: one slot mapping and one block table tensor per KV group");
    h_ = std::move(h);
    hits_ = std::move(hits);
    step_ = Step{positions, std::move(slot_mappings), std::move(block_tables), hits_.data_ptr<int64_t>(), 0, {}};
    layer_ = 0;
    waiting_ = false;
    x_ = timed(kNorms, [&] { return moeserve_norm::rms_norm(h_, layers_[0].input_norm, cfg_.eps, cfg_.fp32_scale); });
    return advance();
  }

  // The next `ids.size()` experts the waiting layer needs (in the order `begin` / `resume` listed them), with their
  // units: gate_up and down (plus row scales for int8 units; empty lists for bf16). Runs the expert op on them.
  void feed(std::vector<int64_t> ids, std::vector<at::Tensor> gate_up, std::vector<at::Tensor> gate_up_scale,
            std::vector<at::Tensor> down, std::vector<at::Tensor> down_scale) {
    TORCH_CHECK(waiting_, "DecodeStack.feed: no layer is waiting for experts");
    layers_[layer_].ffn->feed(x_, m_, ids,
                              Units{std::move(gate_up), std::move(gate_up_scale), std::move(down),
                                    std::move(down_scale)});
  }

  // After every needed expert was fed: the waiting layer's shared expert and residual add, then on (as begin).
  at::Tensor resume() {
    TORCH_CHECK(waiting_, "DecodeStack.resume: no layer is waiting for experts");
    layers_[layer_].ffn->finish(x_, m_);
    return advance();
  }

  // The final-normed hidden states [N, H] of the step that ran to its end.
  at::Tensor result() const {
    TORCH_CHECK(x_.defined() && !waiting_ && layer_ == layers_.size(), "DecodeStack.result: the step has not ended");
    return x_;
  }

  // Profiling: with it on, each step adds the wall-clock seconds of each phase. Returns (phase names, seconds) since
  // it was last turned on.
  void set_profiling(bool on) {
    cfg_.timer->on = on;
    if (on) cfg_.timer->seconds.fill(0.0);
  }
  std::tuple<std::vector<std::string>, std::vector<double>> profile() const {
    return {std::vector<std::string>(kPhaseNames.begin(), kPhaseNames.end()),
            std::vector<double>(cfg_.timer->seconds.begin(), cfg_.timer->seconds.end())};
  }

 private:
  StackLinear linear(const at::Tensor& w, const std::optional<at::Tensor>& scale,
                     const std::optional<at::Tensor>& bias, int64_t in_features, const char* what) const {
    return stack_linear(w, scale, bias, in_features, cfg_.row_block, what);
  }

  std::shared_ptr<const DenseFfn> swiglu(const at::Tensor& gate, const std::optional<at::Tensor>& gate_scale,
                                         const at::Tensor& up, const std::optional<at::Tensor>& up_scale,
                                         const at::Tensor& down, const std::optional<at::Tensor>& down_scale,
                                         const std::string& what) const {
    StackLinear g = linear(gate, gate_scale, std::nullopt, cfg_.hidden, (what + " gate").c_str());
    StackLinear u = linear(up, up_scale, std::nullopt, cfg_.hidden, (what + " up").c_str());
    StackLinear d = linear(down, down_scale, std::nullopt, g.out, (what + " down").c_str());
    return make_swiglu(cfg_, std::move(g), std::move(u), std::move(d));
  }

  std::shared_ptr<const DenseFfn> relu2(const at::Tensor& up, const std::optional<at::Tensor>& up_scale,
                                        const at::Tensor& down, const std::optional<at::Tensor>& down_scale,
                                        const std::string& what) const {
    StackLinear u = linear(up, up_scale, std::nullopt, cfg_.hidden, (what + " up").c_str());
    StackLinear d = linear(down, down_scale, std::nullopt, u.out, (what + " down").c_str());
    return make_relu2(cfg_, std::move(u), std::move(d));
  }

  void set_shared(std::shared_ptr<const DenseFfn> mlp, const std::optional<at::Tensor>& sigmoid_gate,
                  const std::optional<at::Tensor>& sigmoid_gate_scale) {
    SharedExpert s{std::move(mlp), std::nullopt};
    if (sigmoid_gate.has_value())
      s.gate_linear = linear(*sigmoid_gate, sigmoid_gate_scale, std::nullopt, cfg_.hidden, "shared expert gate");
    shared_ = std::move(s);
  }

  std::shared_ptr<const ExpertOp> take_op(bool plain) {
    std::shared_ptr<const ExpertOp> op = make_expert_op(cfg_, op_name_, plain);
    op_name_ = "fused";
    return op;
  }

  void add_mixer(at::Tensor input_norm, at::Tensor post_norm, std::unique_ptr<TokenMixerPart> mixer) {
    TORCH_CHECK(layers_.empty() || layers_.back().ffn, "DecodeStack: the previous layer has no FFN yet");
    groups_ = std::max(groups_, mixer->kv_group() + 1);
    layers_.push_back(Layer{std::move(input_norm), std::move(post_norm), std::move(mixer), nullptr});
  }

  void set_ffn(std::unique_ptr<FfnPart> ffn) {
    TORCH_CHECK(!layers_.empty() && !layers_.back().ffn, "DecodeStack: an FFN needs a layer without one");
    layers_.back().ffn = std::move(ffn);
  }

  std::unique_ptr<RoutingRule> take_routing() {
    TORCH_CHECK(routing_, "DecodeStack: a MoE layer needs its routing first (route_by_pairs / route_by_noaux)");
    return std::move(routing_);
  }

  std::optional<SharedExpert> take_shared() {
    std::optional<SharedExpert> s = std::move(shared_);
    shared_.reset();
    return s;
  }

  // Runs layers from layer_ on (first finishing the one waiting for fed experts) until a fed layer has routed
  // (returns its needed experts) or the last layer is done (returns an empty tensor).
  at::Tensor advance() {
    for (; layer_ < layers_.size(); ++layer_) {
      Layer& l = layers_[layer_];
      if (waiting_) {
        waiting_ = false;  // the fed layer's output is complete
      } else {
        const at::Tensor o = l.mixer->forward(step_, x_);
        x_ = timed(kNorms, [&] { return moeserve_norm::add_rms_norm_(h_, o, l.post_norm, cfg_.eps, cfg_.fp32_scale); });
        if (!l.ffn->start(step_, x_, m_)) {  // an expert to read: the caller asks the store (feed / resume)
          waiting_ = true;
          return at::tensor(l.ffn->needed(), at::kLong);
        }
      }
      const at::Tensor& next_norm = layer_ + 1 < layers_.size() ? layers_[layer_ + 1].input_norm : final_norm_;
      x_ = timed(kNorms,
                 [&] { return moeserve_norm::add_rms_norm_(h_, m_, next_norm, cfg_.eps, cfg_.fp32_scale); });
    }
    return at::empty({0}, at::kLong);
  }

  template <class F>
  auto timed(Phase phase, F&& f) const -> decltype(f()) {
    return (*cfg_.timer)(phase, std::forward<F>(f));
  }

  StackConfig cfg_;
  at::Tensor final_norm_;
  std::vector<Layer> layers_;
  int64_t moe_layers_ = 0, external_layers_ = 0, experts_ = 0, groups_ = 0;
  std::unique_ptr<RoutingRule> routing_;      // the next MoE layer's (route_by_*)
  std::optional<SharedExpert> shared_;        // the next MoE layer's (add_shared_expert)
  std::string op_name_ = "fused";             // the next MoE layer's (use_expert_op)
  std::shared_ptr<CachedUnits> cached_ = std::make_shared<CachedUnits>();
  // The step in progress (begin .. result): its tensors, the next layer to run, a fed layer's partial output.
  Step step_;
  at::Tensor h_, hits_, x_, m_;
  size_t layer_ = 0;
  bool waiting_ = false;
};

}  // namespace moeserve_stack

TORCH_LIBRARY_FRAGMENT(moeserve, m) {
  using moeserve_stack::DecodeStack;
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, double, bool, int64_t, at::Tensor>())
      .def("add_attention", &DecodeStack::add_attention)
      .def("add_gated_delta", &DecodeStack::add_gated_delta)
      .def("add_mla", &DecodeStack::add_mla)
      .def("add_mamba2", &DecodeStack::add_mamba2)
      .def("add_no_mixer", &DecodeStack::add_no_mixer)
      .def("add_dense_mlp", &DecodeStack::add_dense_mlp)
      .def("add_relu2_mlp", &DecodeStack::add_relu2_mlp)
      .def("add_no_ffn", &DecodeStack::add_no_ffn)
      .def("route_by_pairs", &DecodeStack::route_by_pairs)
      .def("route_by_noaux", &DecodeStack::route_by_noaux)
      .def("add_shared_expert", &DecodeStack::add_shared_expert)
      .def("add_relu2_shared_expert", &DecodeStack::add_relu2_shared_expert)
      .def("use_expert_op", &DecodeStack::use_expert_op)
      .def("add_moe", &DecodeStack::add_moe)
      .def("add_moe_external", &DecodeStack::add_moe_external)
      .def("num_layers", &DecodeStack::num_layers)
      .def("step", &DecodeStack::step)
      .def("begin", &DecodeStack::begin)
      .def("feed", &DecodeStack::feed)
      .def("resume", &DecodeStack::resume)
      .def("result", &DecodeStack::result)
      .def("set_cached_units", &DecodeStack::set_cached_units)
      .def("waiting_moe_index", &DecodeStack::waiting_moe_index)
      .def("take_cached_log", &DecodeStack::take_cached_log)
      .def("set_profiling", &DecodeStack::set_profiling)
      .def("profile", &DecodeStack::profile);
}
