// Pieces shared by the routing ops (routing.cpp: softmax / top-k rules; routing_noaux.cpp: DeepSeek-V3's noaux_tc).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

namespace moeserve_routing {

using Pair = std::pair<float, int64_t>;

// torch.topk(row, k, largest=True, sorted) of one row: the top k (value, index) pairs in q[0, k), in the order torch
// returns them. ATen's CPU kernel (ATen/native/TopKImpl.h) runs these std algorithms with this comparator on
// (value, index) pairs listed in index order, so ties, NaNs and the unsorted order come out the same.
inline void topk_row(const float* row, int64_t e, int64_t k, bool sorted, std::vector<Pair>& q) {
  q.resize(static_cast<size_t>(e));
  for (int64_t j = 0; j < e; ++j) q[j] = {row[j], j};
  const auto first = [](const Pair& a, const Pair& b) {
    return (std::isnan(a.first) && !std::isnan(b.first)) || a.first > b.first;
  };
  if (k * 64 <= e) {
    std::partial_sort(q.begin(), q.begin() + k, q.end(), first);
  } else {
    std::nth_element(q.begin(), q.begin() + k - 1, q.end(), first);
    if (sorted) std::sort(q.begin(), q.begin() + k - 1, first);
  }
}

// The (token, expert) pairs of ids [n, k] grouped by expert: a stable counting sort (pairs of an expert in token
// order, then slot order), exactly like torch.argsort(stable=True) on the flattened ids. Returns token_of int64
// [n*k] and weight_of float32 [n*k] (w [n*k] in pair order), and fills counts int64 [E] (zeros on entry).
inline std::pair<at::Tensor, at::Tensor> group_by_expert(const int64_t* id, const float* w, int64_t pairs,
                                                         int64_t top_k, at::Tensor& counts) {
  const int64_t e = counts.numel();
  at::Tensor token_of = at::empty({pairs}, at::kLong);
  at::Tensor weight_of = at::empty({pairs}, at::kFloat);
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
    wo[at_] = w[p];
  }
  return {token_of, weight_of};
}

}  // namespace moeserve_routing
