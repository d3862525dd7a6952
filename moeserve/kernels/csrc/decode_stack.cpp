// DecodeStack: a whole decode step through every decoder layer in ONE call from Python.
//
// The per-op path (MoeModel._layers_cpp, Attention, MoEBlock) issues ~10 op calls and ~100 lines of Python per
// layer; at batch 1 on the small bench model that is ~12% of the step (scripts/decode_breakdown.py). This class
// holds each layer's resident weights, KV cache and expert units once, and `step` calls the very same C++
// functions (ops.h) in the very same order with the same arguments, so its output is bit-identical to the per-op
// path; only the Python between them is gone.
//
// It covers what the fast path needs and nothing else (moeserve/models/decode_stack.py decides eligibility and
// falls back to the per-op path otherwise): decode-only batches (one new token per sequence), attention without
// sinks or qkv clipping, per-head or no q/k norm, MoE layers without a shared expert (dense SwiGLU MLP layers
// too), experts held here from a resident store as row-interleaved bf16 or int8 units (or fed by the caller from
// an offloaded store: see below), dense Linears in the "interleaved" (bf16) or "int8" layout. Per layer:
//
//   qkv = linear(x)                  q|k|v split          q = qk_norm_rope_cache(...)   (writes k, v to the cache)
//   a   = decode_attention(q)        o = linear(a)        x = add_rms_norm_(h, o, post_norm)       (h += o)
//   logits = linear_router(x)        pairs = moe_route_pairs(logits)
//   m = 0; moe_swiglu[_int8]_interleaved_(m, x, units of the experts with tokens, ascending)
//                                    (a dense layer: m = down(silu(gate(x)) * up(x)), as DenseMLP)
//   x = add_rms_norm_(h, m, next layer's input norm, or the final norm after the last layer)  (h += m)
//
// `hits[j]` is increased by the number of experts the j-th MoE layer used (the store's hit count: one per needed expert per
// layer call), so the store's statistics stay true.
//
// Offloaded experts (the store moves units between tiers, so no unit can be held here): a MoE layer added with
// `add_moe_external` has its router only, and a step becomes a conversation with the caller, who asks the store:
//
//   ids = begin(h, positions, slot_mappings, block_tables, hits)   runs up to the first such layer's routing; its needed experts
//   while ids.numel():                           (ascending, int64), or an empty tensor once every layer ran
//       layer = MoE layer number waiting_moe_index()
//       for chunk in store.experts(layer, ids):  units as the store yields them, ascending, several calls
//           feed(chunk ids, units...)            the expert op on them, added into the layer's output in order
//       ids = resume()                           the residual add, then on to the next such layer
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

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "ops.h"

namespace moeserve_stack {

// A dense Linear in one of the two C++ GEMV layouts: bf16 rows interleaved, or int8 codes + float32 row scales.
struct PackedLinear {
  at::Tensor weight;                 // flat packed weight (bf16) or codes (int8), numel out * in
  std::optional<at::Tensor> scale;   // [out] float32 for int8
  std::optional<at::Tensor> bias;    // [out] bf16
  int64_t out = 0;

  at::Tensor operator()(const at::Tensor& x) const {
    if (scale.has_value()) return moeserve_dense_int8::linear_interleaved_int8(x, weight, *scale, out, bias, false);
    return moeserve_dense::linear_interleaved(x, weight, out, bias);
  }
};

struct Layer {
  at::Tensor input_norm, post_norm;
  PackedLinear qkv, o;
  std::optional<at::Tensor> q_norm, k_norm;
  at::Tensor k_cache, v_cache;  // [blocks, kv_heads, block_size, d] of the layer's KV group
  int64_t window = 0;           // sliding window, 0 = none
  int64_t group = 0;            // its KV group: which slot mapping and block tables of a step it reads
  // The MLP: a MoE block (router + units per expert; scales empty for bf16 units) or a dense SwiGLU MLP.
  bool moe = false;
  bool external = false;  // a MoE layer whose units the caller feeds at each step (add_moe_external)
  PackedLinear router, gate, up, down;
  std::vector<at::Tensor> gate_up_units, gate_up_scales, down_units, down_scales;
};

PackedLinear packed(const at::Tensor& weight, const std::optional<at::Tensor>& scale,
                    const std::optional<at::Tensor>& bias, int64_t in_features, const char* what) {
  TORCH_CHECK(weight.device().is_cpu() && weight.is_contiguous() && in_features > 0 &&
                  weight.numel() % in_features == 0,
              "DecodeStack: ", what, " must be a contiguous packed CPU weight of out x ", in_features, " elements");
  TORCH_CHECK(scale.has_value() == (weight.scalar_type() == at::kChar),
              "DecodeStack: ", what, " is int8 codes with a scale or bf16 without one");
  return PackedLinear{weight, scale, bias, weight.numel() / in_features};
}

// Phases of a step that `profile` times separately (scripts/decode_breakdown.py prints them).
enum Phase { kQkv, kAttention, kOProj, kNorms, kRouter, kRouting, kExperts, kDenseMlp, kPhases };
constexpr std::array<const char*, kPhases> kPhaseNames = {
    "qkv GEMV", "q/k norm + rope + KV write + attention", "o_proj GEMV", "residual adds + RMSNorms",
    "router GEMV", "routing (softmax, top-k, grouping)", "experts (fused op)", "dense MLP GEMVs"};

class DecodeStack : public torch::CustomClassHolder {
 public:
  DecodeStack(int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t top_k,
              int64_t routing_mode, bool norm_topk_prob, bool weights_in_fp32, double eps, bool fp32_scale,
              double attn_scale, at::Tensor cos, at::Tensor sin, at::Tensor final_norm)
      : hidden_(hidden), heads_(num_heads), kv_heads_(num_kv_heads), head_dim_(head_dim), top_k_(top_k),
        routing_mode_(routing_mode), norm_topk_prob_(norm_topk_prob), weights_in_fp32_(weights_in_fp32), eps_(eps),
        fp32_scale_(fp32_scale), attn_scale_(attn_scale), cos_(std::move(cos)), sin_(std::move(sin)),
        final_norm_(std::move(final_norm)) {
    TORCH_CHECK(routing_mode == 0 || routing_mode == 1, "DecodeStack: routing mode 0 or 1 (see moe_route_pairs)");
  }

  // A layer's norms and attention; then add_moe or add_dense_mlp gives it its MLP.
  void add_layer(at::Tensor input_norm, at::Tensor post_norm, at::Tensor qkv, std::optional<at::Tensor> qkv_scale,
                 std::optional<at::Tensor> qkv_bias, at::Tensor o, std::optional<at::Tensor> o_scale,
                 std::optional<at::Tensor> o_bias, std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm,
                 at::Tensor k_cache, at::Tensor v_cache, int64_t window, int64_t group) {
    TORCH_CHECK(layers_.empty() || layers_.back().moe || layers_.back().down.out > 0,
                "DecodeStack: the previous layer has no MLP yet");
    Layer l;
    l.input_norm = std::move(input_norm);
    l.post_norm = std::move(post_norm);
    l.qkv = packed(qkv, qkv_scale, qkv_bias, hidden_, "qkv");
    l.o = packed(o, o_scale, o_bias, heads_ * head_dim_, "o_proj");
    TORCH_CHECK(l.qkv.out == (heads_ + 2 * kv_heads_) * head_dim_ && l.o.out == hidden_,
                "DecodeStack: qkv / o_proj sizes do not match the attention shape");
    l.q_norm = std::move(q_norm);
    l.k_norm = std::move(k_norm);
    l.k_cache = std::move(k_cache);
    l.v_cache = std::move(v_cache);
    l.window = window;
    TORCH_CHECK(group >= 0, "DecodeStack: negative KV group");
    l.group = group;
    groups_ = std::max(groups_, group + 1);
    layers_.push_back(std::move(l));
  }

  // The last layer's MLP is a MoE block: its router and every expert's unit (int8 units come with row scales).
  void add_moe(at::Tensor router, std::optional<at::Tensor> router_bias, std::vector<at::Tensor> gate_up,
               std::vector<at::Tensor> gate_up_scale, std::vector<at::Tensor> down,
               std::vector<at::Tensor> down_scale) {
    TORCH_CHECK(!layers_.empty() && !layers_.back().moe && layers_.back().down.out == 0,
                "DecodeStack: add_moe needs a layer without an MLP");
    Layer& l = layers_.back();
    l.router = packed(router, std::nullopt, router_bias, hidden_, "router");
    const bool int8 = !gate_up_scale.empty();
    TORCH_CHECK(static_cast<int64_t>(gate_up.size()) == l.router.out && down.size() == gate_up.size() &&
                    (!int8 || (gate_up_scale.size() == gate_up.size() && down_scale.size() == gate_up.size())),
                "DecodeStack: one gate_up and down unit (and scales for int8) per expert of the router");
    TORCH_CHECK(moe_layers_ == 0 || int8 == int8_units_, "DecodeStack: all layers bf16 units or all int8");
    int8_units_ = int8;
    l.gate_up_units = std::move(gate_up);
    l.gate_up_scales = std::move(gate_up_scale);
    l.down_units = std::move(down);
    l.down_scales = std::move(down_scale);
    l.moe = true;
    ++moe_layers_;
  }

  // The last layer's MLP is a MoE block whose experts the caller feeds at each step (begin / feed / resume):
  // units in the row-interleaved layout (moe_swiglu[_int8]_interleaved_) or, with `plain`, as [out, in] matrices
  // (moe_swiglu_ / moe_swiglu_int8_); bf16 or int8 as fed (int8 comes with scales).
  void add_moe_external(at::Tensor router, std::optional<at::Tensor> router_bias, bool plain) {
    TORCH_CHECK(!layers_.empty() && !layers_.back().moe && layers_.back().down.out == 0,
                "DecodeStack: add_moe_external needs a layer without an MLP");
    TORCH_CHECK(external_layers_ == 0 || plain == plain_units_, "DecodeStack: fed units all plain or all interleaved");
    Layer& l = layers_.back();
    l.router = packed(router, std::nullopt, router_bias, hidden_, "router");
    l.moe = l.external = true;
    plain_units_ = plain;
    ++moe_layers_;
    ++external_layers_;
  }

  // The last layer's MLP is dense: down(silu(gate(x)) * up(x)).
  void add_dense_mlp(at::Tensor gate, std::optional<at::Tensor> gate_scale, at::Tensor up,
                     std::optional<at::Tensor> up_scale, at::Tensor down, std::optional<at::Tensor> down_scale) {
    TORCH_CHECK(!layers_.empty() && !layers_.back().moe && layers_.back().down.out == 0,
                "DecodeStack: add_dense_mlp needs a layer without an MLP");
    Layer& l = layers_.back();
    l.gate = packed(gate, gate_scale, std::nullopt, hidden_, "dense gate");
    l.up = packed(up, up_scale, std::nullopt, hidden_, "dense up");
    l.down = packed(down, down_scale, std::nullopt, l.gate.out, "dense down");
    TORCH_CHECK(l.up.out == l.gate.out && l.down.out == hidden_, "DecodeStack: dense MLP sizes do not match");
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
                    slot_of.size(0) == moe_layers_ && slot_of.size(1) == layers_.back().router.out,
                "DecodeStack: slot_of must be int32 [MoE layers, experts]");
    slot_gate_up_ = std::move(gate_up);
    slot_gate_up_scale_ = std::move(gate_up_scale);
    slot_down_ = std::move(down);
    slot_down_scale_ = std::move(down_scale);
    slot_of_ = std::move(slot_of);
  }

  // The MoE index (0-based, among MoE layers) of the fed layer waiting for its experts.
  int64_t waiting_moe_index() const {
    TORCH_CHECK(waiting_, "DecodeStack.waiting_moe_index: no layer is waiting for experts");
    return moe_index_ - 1;
  }

  // The fed layers that ran on cached units since the last call, in order: (moe index, count, expert ids...) each.
  at::Tensor take_cached_log() {
    at::Tensor log = at::tensor(cached_log_, at::kLong);
    cached_log_.clear();
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
    TORCH_CHECK(!layers_.empty(), "DecodeStack: no layers");
    TORCH_CHECK(h.dim() == 2 && h.size(1) == hidden_ && h.is_contiguous(), "DecodeStack: h must be contiguous [N, H]");
    TORCH_CHECK(layers_.back().moe || layers_.back().down.out > 0, "DecodeStack: the last layer has no MLP");
    TORCH_CHECK(hits.scalar_type() == at::kLong && hits.is_contiguous() && hits.numel() == moe_layers_,
                "DecodeStack: hits must be int64 [MoE layers]");
    TORCH_CHECK(static_cast<int64_t>(slot_mappings.size()) == groups_ &&
                    static_cast<int64_t>(block_tables.size()) == groups_,
                "DecodeStack: one slot mapping and one block table tensor per KV group");
    h_ = std::move(h);
    positions_ = positions;
    slot_mappings_ = std::move(slot_mappings);
    block_tables_ = std::move(block_tables);
    hits_ = std::move(hits);
    layer_ = 0;
    moe_index_ = 0;
    waiting_ = false;
    cached_log_.clear();  // (a step that failed midway leaves nothing for this one to report)
    x_ = timed(kNorms, [&] { return moeserve_norm::rms_norm(h_, layers_[0].input_norm, eps_, fp32_scale_); });
    return advance();
  }

  // The next `ids.size()` experts the waiting layer needs (in the order `begin` / `resume` listed them), with their
  // units: gate_up and down (plus row scales for int8 units; empty lists for bf16). Runs the expert op on them.
  void feed(std::vector<int64_t> ids, std::vector<at::Tensor> gate_up, std::vector<at::Tensor> gate_up_scale,
            std::vector<at::Tensor> down, std::vector<at::Tensor> down_scale) {
    TORCH_CHECK(waiting_, "DecodeStack.feed: no layer is waiting for experts");
    const size_t k = ids.size();
    TORCH_CHECK(gate_up.size() == k && down.size() == k && gate_up_scale.size() == down_scale.size() &&
                    (gate_up_scale.empty() || gate_up_scale.size() == k),
                "DecodeStack.feed: one gate_up and down unit (and scales for int8) per expert id");
    TORCH_CHECK(fed_ + k <= needed_ids_.size(), "DecodeStack.feed: more experts than the layer needs");
    for (size_t j = 0; j < k; ++j)
      TORCH_CHECK(ids[j] == needed_ids_[fed_ + j], "DecodeStack.feed: expert ", ids[j], " fed where expert ",
                  needed_ids_[fed_ + j], " comes next");
    const std::vector<int64_t> bounds(spans_.begin() + 2 * fed_, spans_.begin() + 2 * (fed_ + k));
    run_experts(m_, x_, gate_up, gate_up_scale, down, down_scale, bounds, plain_units_);
    fed_ += k;
  }

  // After every needed expert was fed: the waiting layer's residual add, then on to the next fed layer (as begin).
  at::Tensor resume() {
    TORCH_CHECK(waiting_, "DecodeStack.resume: no layer is waiting for experts");
    TORCH_CHECK(fed_ == needed_ids_.size(), "DecodeStack.resume: ", needed_ids_.size() - fed_,
                " of the layer's experts were not fed");
    return advance();
  }

  // The final-normed hidden states [N, H] of the step that ran to its end.
  at::Tensor result() const {
    TORCH_CHECK(x_.defined() && !waiting_ && layer_ == layers_.size(), "DecodeStack.result: the step has not ended");
    return x_;
  }

  // Profiling: with it on, each step adds the wall-clock seconds of each phase (a clock read around each call,
  // ~20 ns, so it barely changes what it measures). Returns (phase names, seconds) since it was last turned on.
  void set_profiling(bool on) {
    profiling_ = on;
    if (on) seconds_.fill(0.0);
  }
  std::tuple<std::vector<std::string>, std::vector<double>> profile() const {
    return {std::vector<std::string>(kPhaseNames.begin(), kPhaseNames.end()),
            std::vector<double>(seconds_.begin(), seconds_.end())};
  }

 private:
  // Runs layers from layer_ on (first finishing the one waiting for fed experts) until a fed layer has routed
  // (returns its needed experts) or the last layer is done (returns an empty tensor).
  at::Tensor advance() {
    const int64_t n = h_.size(0), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    int64_t* hit = hits_.data_ptr<int64_t>();
    for (; layer_ < layers_.size(); ++layer_) {
      Layer& l = layers_[layer_];
      at::Tensor m;
      if (waiting_) {  // the fed layer's output is complete
        waiting_ = false;
        m = std::move(m_);
      } else {
        // Attention (Attention.__call__ + _cpp_attention).
        const at::Tensor qkv_out = timed(kQkv, [&] { return l.qkv(x_); });
        const at::Tensor a = timed(kAttention, [&] {
          const std::vector<at::Tensor> qkv = qkv_out.split_with_sizes({q_size, kv_size, kv_size}, -1);
          const at::Tensor q = moeserve_attention::qk_norm_rope_cache(qkv[0], qkv[1], qkv[2], l.q_norm, l.k_norm,
                                                                      cos_, sin_, positions_,
                                                                      slot_mappings_[l.group], l.k_cache, l.v_cache,
                                                                      eps_);
          return moeserve_attention::decode_attention(q, l.k_cache, l.v_cache, block_tables_[l.group], std::nullopt,
                                                      positions_, l.window, attn_scale_);
        });
        const at::Tensor o = timed(kOProj, [&] { return l.o(a.reshape({n, q_size})); });
        x_ = timed(kNorms, [&] { return moeserve_norm::add_rms_norm_(h_, o, l.post_norm, eps_, fp32_scale_); });
        if (l.moe && l.external) {
          ++moe_index_;  // its hits and misses are the store's
          route(l, x_);
          m = at::zeros_like(x_);
          if (!run_cached(m)) {  // an expert to read: the caller asks the store (feed / resume)
            m_ = std::move(m);
            fed_ = 0;
            waiting_ = true;
            return at::tensor(needed_ids_, at::kLong);
          }
        } else {
          m = l.moe ? experts(l, x_, hit[moe_index_++])
                    : timed(kDenseMlp, [&] { return l.down(at::silu(l.gate(x_)) * l.up(x_)); });
        }
      }
      const at::Tensor& next_norm = layer_ + 1 < layers_.size() ? layers_[layer_ + 1].input_norm : final_norm_;
      x_ = timed(kNorms, [&] { return moeserve_norm::add_rms_norm_(h_, m, next_norm, eps_, fp32_scale_); });
    }
    return at::empty({0}, at::kLong);
  }

  // A layer's router and routing: keeps its (token, weight) pairs grouped by expert, the experts with tokens
  // (ascending) and each one's span of the pairs.
  void route(const Layer& l, const at::Tensor& x) {
    const at::Tensor logits = timed(kRouter, [&] { return l.router(x); });
    auto [token_of, weight_of, counts, ids] = timed(kRouting, [&] {
      return moeserve_routing::moe_route_pairs(logits, top_k_, routing_mode_, norm_topk_prob_, weights_in_fp32_);
    });
    token_of_ = std::move(token_of);
    weight_of_ = std::move(weight_of);
    const int64_t* cnt = counts.data_ptr<int64_t>();
    needed_ids_.clear();
    spans_.clear();
    for (int64_t e = 0, start = 0; e < counts.numel(); ++e) {
      if (cnt[e] == 0) continue;
      needed_ids_.push_back(e);
      spans_.push_back(start);
      spans_.push_back(start + cnt[e]);
      start += cnt[e];
    }
  }

  // The expert op on `bounds`' experts of the routed pairs, added into m (int8 units come with scales).
  void run_experts(at::Tensor& m, const at::Tensor& x, const std::vector<at::Tensor>& gate_up,
                   const std::vector<at::Tensor>& gate_up_scale, const std::vector<at::Tensor>& down,
                   const std::vector<at::Tensor>& down_scale, const std::vector<int64_t>& bounds, bool plain) const {
    timed(kExperts, [&] {
      const bool int8 = !gate_up_scale.empty();
      if (plain && int8)
        moeserve_moe::moe_swiglu_int8_(m, x, gate_up, gate_up_scale, down, down_scale, token_of_, weight_of_, bounds);
      else if (plain)
        moeserve_moe::moe_swiglu_(m, x, gate_up, down, token_of_, weight_of_, bounds);
      else if (int8)
        moeserve_moe::moe_swiglu_int8_interleaved_(m, x, gate_up, gate_up_scale, down, down_scale, token_of_,
                                                   weight_of_, bounds);
      else
        moeserve_moe::moe_swiglu_interleaved_(m, x, gate_up, down, token_of_, weight_of_, bounds);
      return 0;
    });
  }

  // A routed fed layer (moe_index_ - 1) whose needed experts are all in the store's slots: the op on their units
  // into m, and the call logged for the store. False (nothing done) when one is not cached or no slots were set.
  bool run_cached(at::Tensor& m) {
    if (!slot_of_.defined()) return false;
    const int32_t* slot = slot_of_.data_ptr<int32_t>() + (moe_index_ - 1) * slot_of_.size(1);
    for (const int64_t e : needed_ids_)
      if (slot[e] < 0) return false;
    std::vector<at::Tensor> gate_up, gate_up_scale, down, down_scale;
    for (const int64_t e : needed_ids_) {
      gate_up.push_back(slot_gate_up_[slot[e]]);
      down.push_back(slot_down_[slot[e]]);
      if (!slot_gate_up_scale_.empty()) {
        gate_up_scale.push_back(slot_gate_up_scale_[slot[e]]);
        down_scale.push_back(slot_down_scale_[slot[e]]);
      }
    }
    run_experts(m, x_, gate_up, gate_up_scale, down, down_scale, spans_, plain_units_);
    cached_log_.push_back(moe_index_ - 1);
    cached_log_.push_back(static_cast<int64_t>(needed_ids_.size()));
    cached_log_.insert(cached_log_.end(), needed_ids_.begin(), needed_ids_.end());
    return true;
  }

  // MoEBlock.pairs + _fused_interleaved on a resident store: the experts with tokens, ascending, in one op call;
  // `hits` += how many.
  at::Tensor experts(const Layer& l, const at::Tensor& x, int64_t& hits) {
    route(l, x);
    std::vector<at::Tensor> gate_up, gate_up_scale, down, down_scale;
    for (const int64_t e : needed_ids_) {
      gate_up.push_back(l.gate_up_units[e]);
      down.push_back(l.down_units[e]);
      if (int8_units_) {
        gate_up_scale.push_back(l.gate_up_scales[e]);
        down_scale.push_back(l.down_scales[e]);
      }
    }
    hits += static_cast<int64_t>(needed_ids_.size());
    at::Tensor m = at::zeros_like(x);
    run_experts(m, x, gate_up, gate_up_scale, down, down_scale, spans_, false);
    return m;
  }

  template <class F>
  auto timed(Phase phase, F&& f) const -> decltype(f()) {
    if (!profiling_) return f();
    const auto t0 = std::chrono::steady_clock::now();
    auto result = f();
    seconds_[phase] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return result;
  }

  int64_t hidden_, heads_, kv_heads_, head_dim_, top_k_, routing_mode_;
  bool norm_topk_prob_, weights_in_fp32_;
  double eps_;
  bool fp32_scale_;
  double attn_scale_;
  at::Tensor cos_, sin_, final_norm_;
  std::vector<Layer> layers_;
  int64_t moe_layers_ = 0, external_layers_ = 0;
  bool int8_units_ = false, plain_units_ = false;
  // The step in progress (begin .. result): its tensors, the next layer to run, and the fed layer's state.
  at::Tensor h_, positions_, hits_, x_, m_, token_of_, weight_of_;
  std::vector<at::Tensor> slot_mappings_, block_tables_;  // per KV group
  int64_t groups_ = 0;
  size_t layer_ = 0;
  int64_t moe_index_ = 0;
  bool waiting_ = false;
  std::vector<int64_t> needed_ids_, spans_;
  size_t fed_ = 0;
  // The store's fast tier (set_cached_units): each slot's unit fields, its slot table, and the calls run on them.
  std::vector<at::Tensor> slot_gate_up_, slot_gate_up_scale_, slot_down_, slot_down_scale_;
  at::Tensor slot_of_;
  std::vector<int64_t> cached_log_;
  bool profiling_ = false;
  mutable std::array<double, kPhases> seconds_{};
};

}  // namespace moeserve_stack

TORCH_LIBRARY_FRAGMENT(moeserve, m) {
  m.class_<moeserve_stack::DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool, bool, double, bool, double,
                       at::Tensor, at::Tensor, at::Tensor>())
      .def("add_layer", &moeserve_stack::DecodeStack::add_layer)
      .def("add_moe", &moeserve_stack::DecodeStack::add_moe)
      .def("add_dense_mlp", &moeserve_stack::DecodeStack::add_dense_mlp)
      .def("num_layers", &moeserve_stack::DecodeStack::num_layers)
      .def("add_moe_external", &moeserve_stack::DecodeStack::add_moe_external)
      .def("step", &moeserve_stack::DecodeStack::step)
      .def("begin", &moeserve_stack::DecodeStack::begin)
      .def("feed", &moeserve_stack::DecodeStack::feed)
      .def("resume", &moeserve_stack::DecodeStack::resume)
      .def("result", &moeserve_stack::DecodeStack::result)
      .def("set_cached_units", &moeserve_stack::DecodeStack::set_cached_units)
      .def("waiting_moe_index", &moeserve_stack::DecodeStack::waiting_moe_index)
      .def("take_cached_log", &moeserve_stack::DecodeStack::take_cached_log)
      .def("set_profiling", &moeserve_stack::DecodeStack::set_profiling)
      .def("profile", &moeserve_stack::DecodeStack::profile);
}
