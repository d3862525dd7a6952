// gated_delta_step_: one decode token of Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5) for a batch of
//   sequences, each against its own recurrent state slot (updated in place). Per sequence b and value head h, with
//   S = states[slots[b], h] ([dk, dv], fp32):
//     S = S * decay                      (decay = exp(g), computed by the caller)
//     read[j] = sum_i S[i][j] * k[i]     (each product rounded to fp32, then summed pairwise: sum_rows)
//     delta[j] = (v[j] - read[j]) * beta
//     S[i][j] = S[i][j] + k[i] * delta[j]
//     out[j] = sum_i S[i][j] * (q[i] * dk^-0.5)
//   which is moeserve.models.mixers.gated_delta_rule.recurrent_step operation for operation, its sums over i in the order
//   of gated_delta_rule.sum_rows (halving: row i += row i + ceil(n/2)), so the two give the same bits
//   (tests/kernels/test_gated_delta_step.py).
//   Multiply-adds are never fused here (fp-contract=off below): torch rounds the product first. Every (b, h) is independent and reduced in one fixed
//   order: the result never depends on the batch or the thread count.

#include <ATen/ATen.h>

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "halving_sum.h"

#pragma GCC optimize("fp-contract=off")

namespace moeserve_gated_delta {

using moeserve_csrc::sum_rows_halving;  // gated_delta_rule.sum_rows's order

static void step_head(const float* q, const float* k, const float* v, float decay, float beta, float scale,
                      float* S, float* out, int64_t dk, int64_t dv, std::vector<float>& work) {
  std::vector<float> read(dv);
  for (int64_t i = 0; i < dk * dv; ++i) S[i] = S[i] * decay;
  for (int64_t i = 0; i < dk; ++i)
    for (int64_t j = 0; j < dv; ++j) work[i * dv + j] = S[i * dv + j] * k[i];
  sum_rows_halving(work.data(), dk, dv, read.data());
  for (int64_t j = 0; j < dv; ++j) read[j] = (v[j] - read[j]) * beta;  // delta
  for (int64_t i = 0; i < dk; ++i)
    for (int64_t j = 0; j < dv; ++j) {
      const float p = k[i] * read[j];
      S[i * dv + j] = S[i * dv + j] + p;
    }
  for (int64_t i = 0; i < dk; ++i) {
    const float qs = q[i] * scale;
    for (int64_t j = 0; j < dv; ++j) work[i * dv + j] = S[i * dv + j] * qs;
  }
  sum_rows_halving(work.data(), dk, dv, out);
}

at::Tensor gated_delta_step_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& decay,
                             const at::Tensor& beta, at::Tensor& states, const at::Tensor& slots) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
                  decay.scalar_type() == at::kFloat && beta.scalar_type() == at::kFloat &&
                  states.scalar_type() == at::kFloat, "gated_delta_step_: fp32 inputs and states");
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && states.dim() == 4 && slots.dim() == 1,
              "gated_delta_step_: q, k [B, Hv, dk], v [B, Hv, dv], states [slots, Hv, dk, dv], slots [B]");
  TORCH_CHECK(states.is_contiguous(), "gated_delta_step_: states must be contiguous");
  const auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const auto dc = decay.contiguous(), bc = beta.contiguous();
  const auto sl = slots.to(at::kLong).contiguous();
  const int64_t B = q.size(0), H = q.size(1), dk = q.size(2), dv = v.size(2);
  TORCH_CHECK(states.size(1) == H && states.size(2) == dk && states.size(3) == dv && v.size(0) == B &&
                  v.size(1) == H && dc.numel() == B * H && bc.numel() == B * H && sl.numel() == B,
              "gated_delta_step_: shapes disagree");
  auto out = at::empty({B, H, dv}, q.options());
  const float scale = static_cast<float>(std::pow(static_cast<double>(dk), -0.5));
  const float *qp = qc.data_ptr<float>(), *kp = kc.data_ptr<float>(), *vp = vc.data_ptr<float>();
  const float *dp = dc.data_ptr<float>(), *bp = bc.data_ptr<float>();
  const int64_t* sp = sl.data_ptr<int64_t>();
  float *st = states.data_ptr<float>(), *op = out.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(sp[b] >= 0 && sp[b] < states.size(0), "gated_delta_step_: slot out of range");
  at::parallel_for(0, B * H, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> work(dk * dv);
    for (int64_t bh = lo; bh < hi; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      float* S = st + (sp[b] * H + h) * dk * dv;
      step_head(qp + bh * dk, kp + bh * dk, vp + bh * dv, dp[bh], bp[bh], scale, S, op + bh * dv, dk, dv, work);
    }
  });
  return out;
}

}  // namespace moeserve_gated_delta

TORCH_LIBRARY_FRAGMENT(moeserve, m) {
  m.def("gated_delta_step_(Tensor q, Tensor k, Tensor v, Tensor decay, Tensor beta, Tensor(a!) states, Tensor slots)"
        " -> Tensor", &moeserve_gated_delta::gated_delta_step_);
}
