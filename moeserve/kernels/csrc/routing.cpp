// moe_route_pairs: MoE routing for one layer in one call: router logits -> the (token, weight) pairs grouped by expert, which is
// what the fused expert ops take. Replaces ~12 torch ops issued from Python per MoE layer (softmax, topk, sum, div,
// casts, argsort, bincount, floor_divide, gather), each costing more in Python dispatch than in work at decode.
//
// Numerics: the weights are computed with the very ATen ops MoEBlock.route calls (at::softmax, at::topk, sum,
// div, casts: same kernels, same bits, same tie order); only the grouping is done here, as a counting sort that
// is stable (pairs of an expert in token order, then slot order) exactly like torch.argsort(stable=True) on the
// flattened expert ids.
//
//   mode 0 ("softmax_topk"): probs = softmax(logits, fp32); top, ids = topk(probs, k);
//                            top /= top.sum(-1) if norm_topk_prob; weights = top, cast to logits' dtype unless
//                            weights_in_fp32
//   mode 1 ("topk_softmax"): top, ids = topk(logits, k); weights = softmax(top) in logits' dtype
//
// Returns (token_of int64 [N*k], weight_of float32 [N*k], counts int64 [E], ids int64 [N, k]).

#include <ATen/ATen.h>

#include "ops.h"
#include <torch/library.h>

#include <tuple>
#include <vector>

namespace moeserve_routing {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_route_pairs(const at::Tensor& logits, int64_t top_k,
                                                                      int64_t mode, bool norm_topk_prob,
                                                                      bool weights_in_fp32) {
  TORCH_CHECK(logits.dim() == 2 && logits.device().is_cpu() && at::isFloatingType(logits.scalar_type()),
              "moe_route_pairs: logits must be a floating [N, E] CPU tensor, got ", logits.sizes());
  const int64_t n = logits.size(0), e = logits.size(1);
  TORCH_CHECK(1 <= top_k && top_k <= e, "moe_route_pairs: top_k=", top_k, " must be in [1, ", e, "]");
  TORCH_CHECK(mode == 0 || mode == 1, "moe_route_pairs: mode 0 (softmax then topk) or 1 (topk then softmax)");
  at::Tensor weights, ids;
  if (mode == 1) {
    auto [top, idx] = at::topk(logits, top_k, -1);
    weights = at::softmax(top, -1, top.scalar_type());
    ids = idx;
  } else {
    const at::Tensor probs = at::softmax(logits, -1, at::kFloat);
    auto [top, idx] = at::topk(probs, top_k, -1);
    if (norm_topk_prob) top = top / top.sum(-1, /*keepdim=*/true);
    weights = weights_in_fp32 ? top : top.to(logits.scalar_type());
    ids = idx;
  }
  const at::Tensor w = weights.to(at::kFloat).contiguous();
  ids = ids.contiguous();
  const int64_t pairs = n * top_k;
  at::Tensor counts = at::zeros({e}, at::kLong);
  at::Tensor token_of = at::empty({pairs}, at::kLong);
  at::Tensor weight_of = at::empty({pairs}, at::kFloat);
  const int64_t* id = ids.data_ptr<int64_t>();
  const float* wp = w.data_ptr<float>();
  int64_t* cnt = counts.data_ptr<int64_t>();
  for (int64_t p = 0; p < pairs; ++p) cnt[id[p]] += 1;
  std::vector<int64_t> next(static_cast<size_t>(e));
  for (int64_t x = 0, start = 0; x < e; ++x) {
    next[x] = start;
    start += cnt[x];
  }
  int64_t* tok = token_of.data_ptr<int64_t>();
  float* wo = weight_of.data_ptr<float>();
  for (int64_t p = 0; p < pairs; ++p) {  // ascending p: a stable counting sort by expert id
    const int64_t at_ = next[id[p]]++;
    tok[at_] = p / top_k;
    wo[at_] = wp[p];
  }
  return {token_of, weight_of, counts, ids};
}

}  // namespace moeserve_routing

TORCH_LIBRARY_FRAGMENT(moeserve, m) {
  m.def("moe_route_pairs(Tensor logits, int top_k, int mode, bool norm_topk_prob, bool weights_in_fp32) "
        "-> (Tensor, Tensor, Tensor, Tensor)",
        &moeserve_routing::moe_route_pairs);
}
