// C++ entry points of the moeserve ops, for code in this library that composes them (decode_stack.cpp) without
// going through the dispatcher or Python. Each is defined, documented and registered as an op in the file named.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace moeserve_norm {  // norm.cpp
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w, double eps, bool fp32_scale);
at::Tensor add_rms_norm_(at::Tensor& residual, const at::Tensor& x, const at::Tensor& w, double eps, bool fp32_scale);
}  // namespace moeserve_norm

namespace moeserve_dense {  // dense_gemv.cpp
at::Tensor linear_interleaved(const at::Tensor& x_in, const at::Tensor& packed, int64_t n,
                              const std::optional<at::Tensor>& bias);
}  // namespace moeserve_dense

namespace moeserve_dense_int8 {  // dense_gemv_int8.cpp
at::Tensor linear_interleaved_int8(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scale_in,
                                   int64_t n, const std::optional<at::Tensor>& bias, bool force_portable);
}  // namespace moeserve_dense_int8

namespace moeserve_attention {  // attention.cpp
at::Tensor qk_norm_rope_cache(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
                              const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                              const at::Tensor& slot_mapping, at::Tensor& k_cache, at::Tensor& v_cache, double eps);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const std::optional<at::Tensor>& rows,
                            const at::Tensor& positions, int64_t window, double scale,
                            const std::optional<at::Tensor>& sinks = std::nullopt);
}  // namespace moeserve_attention

namespace moeserve_mla {  // mla_attention.cpp
at::Tensor mla_attention(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& cache,
                         const at::Tensor& block_tables, const std::optional<at::Tensor>& rows,
                         const at::Tensor& positions, const at::Tensor& w_uk_t, const at::Tensor& w_uv, double scale);
}  // namespace moeserve_mla

namespace moeserve_routing {  // routing.cpp
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_route_pairs(const at::Tensor& logits, int64_t top_k,
                                                                      int64_t mode, bool norm_topk_prob,
                                                                      bool weights_in_fp32);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_route_noaux(  // routing_noaux.cpp
    const at::Tensor& logits_in, const at::Tensor& bias_in, int64_t top_k, int64_t n_group, int64_t topk_group,
    bool norm_topk_prob, double routed_scaling_factor, int64_t row_block);
}  // namespace moeserve_routing

namespace moeserve_gated_delta {  // gated_delta.cpp
at::Tensor gated_delta_step_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& decay,
                             const at::Tensor& beta, at::Tensor& states, const at::Tensor& slots);
}  // namespace moeserve_gated_delta

namespace moeserve_mamba2 {  // mamba2.cpp
at::Tensor mamba2_conv_(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                        at::Tensor& history, const at::Tensor& slots, const at::Tensor& counts,
                        const at::Tensor& fresh);
at::Tensor mamba2_step_(const at::Tensor& xbc, const at::Tensor& dt, const at::Tensor& decay, const at::Tensor& d,
                        at::Tensor& states, const at::Tensor& rows, const at::Tensor& slots, int64_t n_groups);
}  // namespace moeserve_mamba2

namespace moeserve_moe {  // moe_experts.cpp
bool interleaved_supported();
bool int8_interleaved_supported();
at::Tensor moe_swiglu_(at::Tensor out, const at::Tensor& x, at::TensorList gate_up, at::TensorList down,
                       const at::Tensor& token_of, const at::Tensor& weight_of, at::IntArrayRef bounds_ref);
at::Tensor moe_swiglu_int8_(at::Tensor out, const at::Tensor& x, at::TensorList gate_up, at::TensorList gate_up_scale,
                            at::TensorList down, at::TensorList down_scale, const at::Tensor& token_of,
                            const at::Tensor& weight_of, at::IntArrayRef bounds_ref);
at::Tensor moe_swiglu_interleaved_(at::Tensor out, const at::Tensor& x, at::TensorList gate_up, at::TensorList down,
                                   const at::Tensor& token_of, const at::Tensor& weight_of, at::IntArrayRef bounds_ref);
at::Tensor moe_swiglu_int8_interleaved_(at::Tensor out, const at::Tensor& x, at::TensorList gate_up,
                                        at::TensorList gate_up_scale, at::TensorList down, at::TensorList down_scale,
                                        const at::Tensor& token_of, const at::Tensor& weight_of,
                                        at::IntArrayRef bounds_ref);
}  // namespace moeserve_moe
