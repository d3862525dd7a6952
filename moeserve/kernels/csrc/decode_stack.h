// The parts of a DecodeStack layer (decode_stack.cpp): each layer is a token mixer part and an FFN part, each an
// implementation of one small interface below, so a new layer kind is a new class, never a branch in the stack.
// Every part calls the same functions as the per-op path (ops.h, or the ATen ops the Python code calls, on the same
// shapes, in the same order), so the stack's logits are the per-op path's bits.
//
//   decode_stack.cpp         the stack: layers in order, the residual adds + norms, begin / feed / resume
//   decode_stack_mixers.cpp  token mixer parts: attention (plain, or gated with a torch per-head norm), Gated DeltaNet
//   decode_stack_mla.cpp     token mixer part: multi-head latent attention (absorbed form, aligned query blocks)
//   decode_stack_mamba2.cpp  token mixer part: Mamba-2's decode step (conv, selective-state update, gated norm);
//                            the parts of one-part blocks (Nemotron-H): no mixer, no FFN
//   decode_stack_ffn.cpp     FFN parts: dense MLPs (SwiGLU, relu2), MoE (routing rules, expert ops, held or fed
//                            units, shared expert)
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "ops.h"

namespace moeserve_stack {

// Phases of a step that `profile` times separately (scripts/decode_breakdown.py prints them).
enum Phase { kQkv, kAttention, kOProj, kNorms, kRouter, kRouting, kExperts, kDenseMlp, kShared, kPhases };
constexpr std::array<const char*, kPhases> kPhaseNames = {
    "qkv GEMV", "q/k norm + rope + KV write + attention", "o_proj GEMV", "residual adds + RMSNorms",
    "router GEMV", "routing (softmax, top-k, grouping)", "experts (fused op)", "dense MLP GEMVs",
    "shared expert"};

// Wall-clock seconds per phase while `on` (a clock read around each call, ~20 ns).
struct Timer {
  bool on = false;
  std::array<double, kPhases> seconds{};

  template <class F>
  auto operator()(Phase phase, F&& f) -> decltype(f()) {
    if (!on) return f();
    const auto t0 = std::chrono::steady_clock::now();
    auto result = f();
    seconds[phase] += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return result;
  }
};

// What every part of the stack shares: the model's sizes and norm rule, the batch-invariant row block, the timer.
struct StackConfig {
  int64_t hidden = 0;
  double eps = 0;
  bool fp32_scale = false;
  int64_t row_block = 0;  // linear.ROW_BLOCK when batch-invariant (torch ops in blocks of exactly that many rows)
  std::shared_ptr<Timer> timer;
};

// fn(x) for a row-wise fn, on zero-padded blocks of exactly `row_block` rows of x [N, ...] (0: on x as it is);
// linear.in_row_blocks op for op, so torch's element-wise ops see the per-op path's shapes.
at::Tensor in_row_blocks(const std::function<at::Tensor(const at::Tensor&)>& fn, const at::Tensor& x,
                         int64_t row_block);

// A Linear as the per-op path holds it: bf16 rows interleaved (linear_interleaved), int8 codes + float32 row scales
// (linear_interleaved_int8), or a plain float32 [out, in] weight (F.linear, in row blocks: an fp32 router).
struct StackLinear {
  at::Tensor weight;
  std::optional<at::Tensor> scale;  // [out] float32 for int8
  std::optional<at::Tensor> bias;
  int64_t out = 0;
  int64_t row_block = 0;  // plain weights only

  at::Tensor operator()(const at::Tensor& x) const;
};
StackLinear stack_linear(const at::Tensor& weight, const std::optional<at::Tensor>& scale,
                         const std::optional<at::Tensor>& bias, int64_t in_features, int64_t row_block,
                         const char* what);

// One decode step's inputs (every part may read them) and its MoE bookkeeping (the MoE parts add to it).
struct Step {
  at::Tensor positions;                                // int64 [N]
  std::vector<at::Tensor> slot_mappings, block_tables;  // per KV group
  int64_t* hits = nullptr;                             // [MoE layers]: needed experts of held MoE layers
  int64_t moe_index = 0;                               // MoE layers started so far in this step
  std::vector<int64_t> cached_log;                     // fed layers run on cached units: (index, count, ids...)
};

// The part of a layer that mixes tokens.
class TokenMixerPart {
 public:
  virtual ~TokenMixerPart() = default;
  // x [N, H] (the layer's normed input) -> the mixer's output [N, H]; reads and writes its sequence memory.
  virtual at::Tensor forward(Step& step, const at::Tensor& x) = 0;
  // Its KV group (which slot mapping and block tables of a step it reads), or -1 when it reads none.
  virtual int64_t kv_group() const { return -1; }
};

// Grouped-query attention over the paged KV cache (Attention's C++ path). With `torch_qk_norm` the per-head q/k
// norm is rms_norm_fp32_scale in ATen ops before the C++ op (a zero-centred norm); with `output_gate` the qkv
// Linear has a fourth part, the gate: out * sigmoid(gate) before o_proj (Qwen3-Next).
struct AttentionShape {
  int64_t heads = 0, kv_heads = 0, head_dim = 0, window = 0, group = 0;
  double scale = 0;
  bool output_gate = false, torch_qk_norm = false;
};
std::unique_ptr<TokenMixerPart> make_attention(const StackConfig& cfg, AttentionShape shape, StackLinear qkv,
                                               StackLinear o, std::optional<at::Tensor> q_norm,
                                               std::optional<at::Tensor> k_norm, at::Tensor cos, at::Tensor sin,
                                               at::Tensor k_cache, at::Tensor v_cache);

// Gated DeltaNet's decode step (models/mixers/gated_delta.py, a decode-only batch of tokens after their prompts).
struct GatedDeltaShape {
  int64_t num_k_heads = 0, num_v_heads = 0, k_head_dim = 0, v_head_dim = 0, group = 0;
};
std::unique_ptr<TokenMixerPart> make_gated_delta(const StackConfig& cfg, GatedDeltaShape shape, StackLinear in_proj,
                                                 StackLinear out_proj, at::Tensor conv_weight, at::Tensor a_log,
                                                 at::Tensor dt_bias, at::Tensor norm, at::Tensor conv_states,
                                                 at::Tensor states);

// Multi-head latent attention (models/mixers/mla.py MlaAttention, decode-only): sizes per head, the latent cache
// [blocks, block_size, kv_lora + rope] of its group, W_UK [nh, nope, R] and W_UV^T [nh, R, v].
struct MlaShape {
  int64_t heads = 0, nope = 0, rope = 0, kv_lora = 0, v_head_dim = 0, group = 0, rotary_dim = 0, query_block = 0;
  double softmax_scale = 0;
  bool interleaved_rope = false;
};
std::unique_ptr<TokenMixerPart> make_mla(const StackConfig& cfg, MlaShape shape, std::optional<StackLinear> q_a,
                                         std::optional<at::Tensor> q_a_norm, StackLinear q, StackLinear kv_a,
                                         at::Tensor kv_a_norm, at::Tensor w_uk_t, at::Tensor w_uv, StackLinear o,
                                         at::Tensor cos, at::Tensor sin, at::Tensor cache);

// Mamba-2's decode step (models/mixers/mamba2.py Mamba2Mixer, a decode-only batch of tokens after their prompts): sizes
// per head, its group norm's eps; in_proj rows [z (inner), xBC (conv channels), dt (heads)].
struct Mamba2Shape {
  int64_t heads = 0, head_dim = 0, n_groups = 0, state = 0, group = 0;
  double norm_eps = 0;
};
std::unique_ptr<TokenMixerPart> make_mamba2(const StackConfig& cfg, Mamba2Shape shape, StackLinear in_proj,
                                            StackLinear out_proj, at::Tensor conv_weight,
                                            std::optional<at::Tensor> conv_bias, at::Tensor a, at::Tensor d,
                                            at::Tensor dt_bias, at::Tensor norm, at::Tensor conv_states,
                                            at::Tensor states);
// The absent part of a one-part block (block_parts.NoMixer / NoMLP): zeros, so the residual add keeps h.
std::unique_ptr<TokenMixerPart> make_no_mixer();

// Expert units as the store lends them: gate_up and down per expert, plus row scales for int8 (empty for bf16).
struct Units {
  std::vector<at::Tensor> gate_up, gate_up_scale, down, down_scale;
};

// The units of every slot of the store's fast tier and its slot table (int32 [MoE layers, experts], -1 = not
// ready), shared by the fed MoE layers (DecodeStack.set_cached_units).
struct CachedUnits {
  Units slots;
  at::Tensor slot_of;
};

// The feed-forward part of a layer.
class FfnPart {
 public:
  virtual ~FfnPart() = default;
  virtual bool is_moe() const { return false; }
  // x [N, H] (normed) -> out [N, H]. False when out still lacks experts the caller must feed: needed() lists them
  // (ascending), feed() computes them as they come, finish() completes out.
  virtual bool start(Step& step, const at::Tensor& x, at::Tensor& out) = 0;
  virtual const std::vector<int64_t>& needed() const;
  virtual void feed(const at::Tensor& x, at::Tensor& out, const std::vector<int64_t>& ids, const Units& units);
  virtual void finish(const at::Tensor& x, at::Tensor& out);
};

// A MoE layer's routing: x [N, H] -> (token_of, weight_of, counts, ids) as moe_route_pairs returns them.
class RoutingRule {
 public:
  virtual ~RoutingRule() = default;
  virtual std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> route(const at::Tensor& x) = 0;
  virtual int64_t experts() const = 0;
};

// A dense MLP x [N, H] -> [N, H] (layers.DenseMLP's SwiGLU, block_parts.Relu2MLP's relu2), as a layer's FFN or
// a MoE layer's shared expert.
class DenseFfn {
 public:
  virtual ~DenseFfn() = default;
  virtual at::Tensor operator()(const at::Tensor& x) const = 0;
};
std::shared_ptr<const DenseFfn> make_swiglu(const StackConfig& cfg, StackLinear gate, StackLinear up,
                                            StackLinear down);
std::shared_ptr<const DenseFfn> make_relu2(const StackConfig& cfg, StackLinear up, StackLinear down);

// The shared expert of a MoE layer, with or without its sigmoid gate (MoEBlock, in the same order).
struct SharedExpert {
  std::shared_ptr<const DenseFfn> mlp;
  std::optional<StackLinear> gate_linear;
};

// How a MoE layer computes its routed experts (the Python ExpertKernel's op): out [N, H] += each unit's expert of
// its tokens (the routed pairs token_of / weight_of, unit i's span bounds[2i] .. bounds[2i+1]), in unit order.
class ExpertOp {
 public:
  virtual ~ExpertOp() = default;
  virtual void run(at::Tensor& out, const at::Tensor& x, const Units& units, const at::Tensor& token_of,
                   const at::Tensor& weight_of, const std::vector<int64_t>& bounds) const = 0;
};
// The ops by the name FusedUnits.stack_op gives: "fused" (the fused SwiGLU op of expert_kernels._FusedSwiGLU on
// [out, in] units with `plain`, else row-interleaved; int8 with scales), "relu2-loop" (TorchExperts on Relu2Math),
// "q4 <spec>" (moe_q4_experts_ of expert_kernels.CppQ4Experts: 4-bit units as stored, gpt-oss units).
std::shared_ptr<const ExpertOp> make_expert_op(const StackConfig& cfg, const std::string& name, bool plain);

std::unique_ptr<FfnPart> make_dense_mlp(const StackConfig& cfg, std::shared_ptr<const DenseFfn> mlp);
std::unique_ptr<FfnPart> make_no_ffn();
std::unique_ptr<RoutingRule> make_pairs_routing(const StackConfig& cfg, StackLinear router, int64_t top_k,
                                                int64_t mode, bool norm_topk_prob, bool weights_in_fp32);
std::unique_ptr<RoutingRule> make_noaux_routing(const StackConfig& cfg, StackLinear router, at::Tensor bias,
                                                int64_t top_k, int64_t n_group, int64_t topk_group,
                                                bool norm_topk_prob, double routed_scaling_factor);
// A MoE layer holding every expert's unit (a resident store; int8 units with scales).
std::unique_ptr<FfnPart> make_held_moe(const StackConfig& cfg, std::unique_ptr<RoutingRule> routing,
                                       std::optional<SharedExpert> shared, std::shared_ptr<const ExpertOp> op,
                                       Units units);
// A MoE layer whose units the caller feeds at each step, or that runs at once on the store's cached units when all
// it needs are there.
std::unique_ptr<FfnPart> make_fed_moe(const StackConfig& cfg, std::unique_ptr<RoutingRule> routing,
                                      std::optional<SharedExpert> shared, std::shared_ptr<const ExpertOp> op,
                                      std::shared_ptr<const CachedUnits> cached);

}  // namespace moeserve_stack
