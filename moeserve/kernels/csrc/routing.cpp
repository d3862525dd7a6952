// moe_route_pairs: MoE routing for one layer in one call: router logits -> the (token, weight) pairs grouped by expert,
// which is what the fused expert ops take. Replaces ~12 torch ops issued from Python per MoE layer (softmax, topk,
// sum, div, casts, argsort, bincount, floor_divide, gather), and needs no ATen op at all: at decode each small ATen
// call costs 1-3 us (more with the caches cold after a layer's weights streamed through), ~20 us per layer in all,
// against ~2 us for this loop.
//
//   mode 0 ("softmax_topk"): probs = softmax(logits) in fp32; top, ids = topk(probs, k);
//                            top /= sum(top) if norm_topk_prob; weights = top, rounded to the logits' dtype unless
//                            weights_in_fp32
//   mode 1 ("topk_softmax"): top, ids = topk(logits, k); weights = softmax(top) rounded to the logits' dtype
//
// Numerics against MoEBlock.route (the torch ops): the top-k is picked exactly as torch.topk picks it, ties and NaNs
// included (ATen's CPU kernel, ATen/native/TopKImpl.h, runs these std algorithms with this comparator on
// (value, index) pairs; equal logits give equal probabilities here too, so ties stay ties). The softmax is computed
// here (max, exp, a sequential fp32 sum, one division per element) where ATen uses a vectorised exp, a tree sum
// and a multiplication by 1/sum: fp32 weights may differ by an ulp or two, and the expert choice only where two
// probabilities are that close. Every C++ path (per op, fused decode step, offloaded or resident) calls this
// same code, so they stay bit-identical to each other; tests/kernels/test_routing_op.py checks it against the
// torch ops and float64.
//
// The grouping is a counting sort that is stable (pairs of an expert in token order, then slot order) exactly like
// torch.argsort(stable=True) on the flattened expert ids.
//
// Returns (token_of int64 [N*k], weight_of float32 [N*k], counts int64 [E], ids int64 [N, k]).

#include <ATen/ATen.h>

#include "ops.h"
#include "routing_common.h"
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

namespace moeserve_routing {

// p[0, n) <- softmax(v[0, n)) in fp32: exp(v - max) / sum, the sum taken in order.
static void softmax_row(const float* v, int64_t n, float* p) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) m = std::isnan(v[j]) || v[j] > m ? v[j] : m;
  float s = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    p[j] = std::exp(v[j] - m);
    s += p[j];
  }
  for (int64_t j = 0; j < n; ++j) p[j] = p[j] / s;
}

// v rounded to the logits' dtype (nearest even, as ATen's casts), kept in float.
static float as_dtype(float v, at::ScalarType dtype) {
  if (dtype == at::kBFloat16) return static_cast<float>(c10::BFloat16(v));
  if (dtype == at::kHalf) return static_cast<float>(c10::Half(v));
  return v;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_route_pairs(const at::Tensor& logits_in, int64_t top_k,
                                                                      int64_t mode, bool norm_topk_prob,
                                                                      bool weights_in_fp32) {
  TORCH_CHECK(logits_in.dim() == 2 && logits_in.device().is_cpu() && at::isFloatingType(logits_in.scalar_type()),
              "moe_route_pairs: logits must be a floating [N, E] CPU tensor, got ", logits_in.sizes());
  const int64_t n = logits_in.size(0), e = logits_in.size(1);
  TORCH_CHECK(1 <= top_k && top_k <= e, "moe_route_pairs: top_k=", top_k, " must be in [1, ", e, "]");
  TORCH_CHECK(mode == 0 || mode == 1, "moe_route_pairs: mode 0 (softmax then topk) or 1 (topk then softmax)");
  const at::ScalarType dtype = logits_in.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "moe_route_pairs: float32, bfloat16 or float16 logits");
  const at::Tensor logits = logits_in.contiguous();
  const int64_t pairs = n * top_k;
  at::Tensor ids = at::empty({n, top_k}, at::kLong);
  at::Tensor counts = at::zeros({e}, at::kLong);
  int64_t* id = ids.data_ptr<int64_t>();
  std::vector<float> w(static_cast<size_t>(pairs)), row(static_cast<size_t>(e)), probs(static_cast<size_t>(e));
  std::vector<float> top(static_cast<size_t>(top_k));
  std::vector<Pair> q;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < e; ++j) {  // the row in float (exact from bf16 / fp16)
      if (dtype == at::kFloat) row[j] = logits.data_ptr<float>()[i * e + j];
      else if (dtype == at::kBFloat16) row[j] = static_cast<float>(logits.data_ptr<at::BFloat16>()[i * e + j]);
      else row[j] = static_cast<float>(logits.data_ptr<at::Half>()[i * e + j]);
    }
    float* wi = w.data() + i * top_k;
    if (mode == 0) {
      softmax_row(row.data(), e, probs.data());
      topk_row(probs.data(), e, top_k, true, q);
      float sum = 0.0f;
      for (int64_t j = 0; j < top_k; ++j) sum += q[j].first;
      for (int64_t j = 0; j < top_k; ++j) {
        const float v = norm_topk_prob ? q[j].first / sum : q[j].first;
        wi[j] = weights_in_fp32 ? v : as_dtype(v, dtype);
      }
    } else {
      topk_row(row.data(), e, top_k, true, q);
      for (int64_t j = 0; j < top_k; ++j) top[j] = q[j].first;
      softmax_row(top.data(), top_k, wi);
      for (int64_t j = 0; j < top_k; ++j) wi[j] = as_dtype(wi[j], dtype);
    }
    for (int64_t j = 0; j < top_k; ++j) id[i * top_k + j] = q[j].second;
  }
  auto [token_of, weight_of] = group_by_expert(id, w.data(), pairs, top_k, counts);
  return {token_of, weight_of, counts, ids};
}

}  // namespace moeserve_routing

TORCH_LIBRARY_FRAGMENT(moeserve, m) {
  m.def("moe_route_pairs(Tensor logits, int top_k, int mode, bool norm_topk_prob, bool weights_in_fp32) "
        "-> (Tensor, Tensor, Tensor, Tensor)",
        &moeserve_routing::moe_route_pairs);
}
