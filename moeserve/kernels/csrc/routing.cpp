// moe_route_pairs: MoE routing for one layer in one call: router logits -> the (token, weight) pairs grouped by expert, which is
// what the fused expert ops take. Replaces ~12 torch ops issued from Python per MoE layer (softmax, topk, sum, div,
// casts, argsort, bincount, floor_divide, gather), each costing more in Python dispatch than in work at decode.
//
// Numerics: the weights are those MoEBlock.route computes, bit for bit and with the same tie order (softmax and
// the top-k sum with ATen itself, the rest reproduced exactly: see softmax_topk); the grouping is a counting sort
// that is stable (pairs of an expert in token order, then slot order) exactly like torch.argsort(stable=True) on
// the flattened expert ids.
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

#include <algorithm>
#include <cmath>
#include <tuple>
#include <utility>
#include <vector>

namespace moeserve_routing {

// torch.topk(row, k, largest=True, sorted=True) of one row, ties and NaNs included: ATen's CPU kernel
// (ATen/native/TopKImpl.h) runs these std algorithms with this comparator (NaN first, then larger first) on
// (value, index) pairs, so running them on the same pairs picks the same indices in the same order.
using Pair = std::pair<float, int64_t>;

static void topk_row(const float* row, int64_t e, int64_t k, std::vector<Pair>& q) {
  q.resize(static_cast<size_t>(e));
  for (int64_t j = 0; j < e; ++j) q[j] = {row[j], j};
  const auto first = [](const Pair& a, const Pair& b) {
    return (std::isnan(a.first) && !std::isnan(b.first)) || a.first > b.first;
  };
  if (k * 64 <= e) {
    std::partial_sort(q.begin(), q.begin() + k, q.end(), first);
  } else {
    std::nth_element(q.begin(), q.begin() + k - 1, q.end(), first);
    std::sort(q.begin(), q.begin() + k - 1, first);
  }
}

// Mode 0 without most of the small ATen ops MoEBlock.route issues (topk, div, casts: ~1-2 us each at decode, more
// with the caches cold after a layer's weights streamed through): the softmax and the sum of the top-k (whose
// summation order is ATen's to choose) stay ATen's; the top-k is picked as torch.topk picks it, the division is
// IEEE (as ATen's vectorised div), and the cast rounds to nearest even (as ATen's). Returns the weights [N, k]
// (float32, or the value of the logits' dtype held in float32) and sets `ids`.
static at::Tensor softmax_topk(const at::Tensor& logits, int64_t k, bool norm_topk_prob, bool weights_in_fp32,
                               at::Tensor& ids) {
  const int64_t n = logits.size(0), e = logits.size(1);
  const at::Tensor probs = at::softmax(logits, -1, at::kFloat).contiguous();
  at::Tensor top = at::empty({n, k}, at::kFloat);
  ids = at::empty({n, k}, at::kLong);
  const float* pp = probs.data_ptr<float>();
  float* tp = top.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  std::vector<Pair> q;
  for (int64_t i = 0; i < n; ++i) {
    topk_row(pp + i * e, e, k, q);
    for (int64_t j = 0; j < k; ++j) {
      tp[i * k + j] = q[j].first;
      ip[i * k + j] = q[j].second;
    }
  }
  if (norm_topk_prob && n > 0) {
    const at::Tensor sums = top.sum(-1);  // ATen's summation order, as top.sum(-1, keepdim=True) in MoEBlock.route
    const float* sp = sums.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < k; ++j) tp[i * k + j] = tp[i * k + j] / sp[i];
  }
  const auto dtype = logits.scalar_type();
  if (!weights_in_fp32 && dtype != at::kFloat) {  // .to(logits' dtype): round to nearest even, kept in float32
    for (int64_t i = 0; i < n * k; ++i) {
      if (dtype == at::kBFloat16) tp[i] = static_cast<float>(c10::BFloat16(tp[i]));
      else if (dtype == at::kHalf) tp[i] = static_cast<float>(c10::Half(tp[i]));
      else tp[i] = static_cast<float>(static_cast<double>(tp[i]));  // float64 logits: exact
    }
  }
  return top;
}

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
    weights = softmax_topk(logits, top_k, norm_topk_prob, weights_in_fp32, ids);
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
