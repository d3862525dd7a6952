// moe_route_noaux: DeepSeek-V3's "noaux_tc" routing (DeepSeek-V3, Kimi-K2, GLM-4.5, Nemotron-H) for one layer in one
// call: router logits -> the (token, weight) pairs grouped by expert, as moe_route_pairs returns them. Per row:
//
//   scores = sigmoid(logits) (fp32);  choice = scores + bias  (the layer's e_score_correction_bias)
//   group score = the sum of each group's top-2 choices (n_group groups of E / n_group experts)
//   keep the topk_group best groups; ids = top-k of the choices in kept groups (torch.topk, sorted=False)
//   weights = scores[ids], / (their sum + 1e-20) if norm_topk_prob, * routed_scaling_factor  (fp32)
//
// The same bits as moe.SigmoidGroups (the torch ops), ids in the same order, ties included:
// - sigmoid and the sum of the k weights are ATen's own kernels, called on tensors of the shapes the torch path
//   gives them (row_block > 0: blocks of exactly row_block rows, the last zero-padded, as linear.in_row_blocks does;
//   0: all rows at once). Both kernels' results depend on where an element sits in the tensor (a vectorised body
//   and a scalar tail round differently; a row sum's order depends on the shape), never on other rows' values, so
//   the padded rows' top-k is not computed (their weights are zeros).
// - every top-k is torch.topk's own algorithm (routing_common.h topk_row: the same std algorithms, comparator and
//   (value, index) order), so the unsorted order of the ids, which decides the order of the weights' sum, is torch's.
// - the adds, divisions and products are single IEEE operations, element by element, as in ATen.
// Groups are skipped when topk_group == n_group (all kept: the mask changes nothing, as in torch).
//
// Returns (token_of int64 [N*k], weight_of float32 [N*k], counts int64 [E], ids int64 [N, k]).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "routing_common.h"
#include <torch/library.h>

#include <limits>
#include <tuple>
#include <vector>

namespace moeserve_routing {

struct NoauxRule {
  int64_t e, top_k, n_group, topk_group;
};

// One row: ids [k] in torch.topk's order and weights [k] = the unbiased scores of those experts.
static void route_row(const float* scores, const float* bias, const NoauxRule& r, int64_t* ids, float* w,
                      std::vector<float>& choice, std::vector<float>& group_scores, std::vector<Pair>& q) {
  for (int64_t j = 0; j < r.e; ++j) choice[j] = scores[j] + bias[j];
  if (r.topk_group < r.n_group) {
    const int64_t m = r.e / r.n_group;
    for (int64_t g = 0; g < r.n_group; ++g) {
      topk_row(choice.data() + g * m, m, 2, true, q);
      group_scores[g] = q[0].first + q[1].first;
    }
    topk_row(group_scores.data(), r.n_group, r.topk_group, false, q);
    std::vector<char> kept(static_cast<size_t>(r.n_group), 0);
    for (int64_t g = 0; g < r.topk_group; ++g) kept[q[g].second] = 1;
    for (int64_t g = 0; g < r.n_group; ++g)
      if (!kept[g])
        for (int64_t j = g * m; j < (g + 1) * m; ++j) choice[j] = -std::numeric_limits<float>::infinity();
  }
  topk_row(choice.data(), r.e, r.top_k, false, q);
  for (int64_t j = 0; j < r.top_k; ++j) {
    ids[j] = q[j].second;
    w[j] = scores[q[j].second];
  }
}

static void check_args(const at::Tensor& logits, const at::Tensor& bias, const NoauxRule& r, int64_t row_block) {
  TORCH_CHECK(logits.dim() == 2 && logits.device().is_cpu() && at::isFloatingType(logits.scalar_type()),
              "moe_route_noaux: logits must be a floating [N, E] CPU tensor, got ", logits.sizes());
  TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.numel() == r.e, "moe_route_noaux: bias must be fp32 [E]");
  TORCH_CHECK(1 <= r.top_k && r.top_k <= r.e, "moe_route_noaux: top_k=", r.top_k, " must be in [1, ", r.e, "]");
  TORCH_CHECK(r.n_group >= 1 && r.e % r.n_group == 0 && 1 <= r.topk_group && r.topk_group <= r.n_group &&
                  (r.topk_group == r.n_group || r.e / r.n_group >= 2),
              "moe_route_noaux: n_group must divide E into groups of >= 2 experts, 1 <= topk_group <= n_group");
  TORCH_CHECK(row_block >= 0, "moe_route_noaux: row_block must be >= 0");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_route_noaux(
    const at::Tensor& logits_in, const at::Tensor& bias_in, int64_t top_k, int64_t n_group, int64_t topk_group,
    bool norm_topk_prob, double routed_scaling_factor, int64_t row_block) {
  const int64_t n = logits_in.size(0), e = logits_in.dim() == 2 ? logits_in.size(1) : 0;
  const NoauxRule rule{e, top_k, n_group, topk_group};
  check_args(logits_in, bias_in, rule, row_block);
  if (n == 0)
    return {at::empty({0}, at::kLong), at::empty({0}, at::kFloat), at::zeros({e}, at::kLong),
            at::empty({0, top_k}, at::kLong)};
  const int64_t block = row_block > 0 ? row_block : n;
  const int64_t padded = (n + block - 1) / block * block;
  at::Tensor x = logits_in.to(at::kFloat).contiguous();  // exact from bf16 / fp16
  if (padded > n) x = at::cat({x, at::zeros({padded - n, e}, x.options())});
  std::vector<at::Tensor> blocks;
  for (int64_t b = 0; b < padded; b += block) blocks.push_back(at::sigmoid(x.narrow(0, b, block)));
  const at::Tensor scores = blocks.size() == 1 ? blocks[0] : at::cat(blocks);  // [padded, E] fp32
  const at::Tensor bias = bias_in.contiguous();
  at::Tensor ids = at::empty({n, top_k}, at::kLong);
  at::Tensor weights = at::zeros({padded, top_k}, at::kFloat);
  const float *sp = scores.data_ptr<float>(), *bp = bias.data_ptr<float>();
  int64_t* id = ids.data_ptr<int64_t>();
  float* w = weights.data_ptr<float>();
  at::parallel_for(0, n, 256, [&](int64_t lo, int64_t hi) {  // ~2 us a row: threads only for prefill-sized batches
    std::vector<float> choice(static_cast<size_t>(e)), group_scores(static_cast<size_t>(n_group));
    std::vector<Pair> q;
    for (int64_t i = lo; i < hi; ++i)
      route_row(sp + i * e, bp, rule, id + i * top_k, w + i * top_k, choice, group_scores, q);
  });
  if (norm_topk_prob) {
    const float eps = static_cast<float>(1e-20);  // the Python scalar, cast to the tensor's dtype as ATen does
    for (int64_t b = 0; b < padded; b += block) {
      const at::Tensor sums = at::sum(weights.narrow(0, b, block), {1}).contiguous();  // [block]
      const float* s = sums.data_ptr<float>();
      for (int64_t i = b; i < std::min(b + block, n); ++i)
        for (int64_t j = 0; j < top_k; ++j) w[i * top_k + j] = w[i * top_k + j] / (s[i - b] + eps);
    }
  }
  const float scale = static_cast<float>(routed_scaling_factor);
  for (int64_t p = 0; p < n * top_k; ++p) w[p] = w[p] * scale;
  at::Tensor counts = at::zeros({e}, at::kLong);
  auto [token_of, weight_of] = group_by_expert(id, w, n * top_k, top_k, counts);
  return {token_of, weight_of, counts, ids};
}

}  // namespace moeserve_routing

TORCH_LIBRARY_FRAGMENT(moeserve, m) {
  m.def("moe_route_noaux(Tensor logits, Tensor bias, int top_k, int n_group, int topk_group, bool norm_topk_prob, "
        "float routed_scaling_factor, int row_block) -> (Tensor, Tensor, Tensor, Tensor)",
        &moeserve_routing::moe_route_noaux);
}
