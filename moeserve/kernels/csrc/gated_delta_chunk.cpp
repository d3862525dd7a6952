// gated_delta_chunk_: the chunk form of the gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5) for the prompt
//   tokens of one sequence, against its recurrent state (updated in place). The same computation as
//   moeserve.models.mixers.gated_delta_rule.chunk_form (the WY form of the FLA library; transformers'
//   torch_chunk_gated_delta_rule): tokens cut into chunks of 64 from the first, and per value head and chunk
//     cum = cumsum(g);  A[i][j] = (beta_i k_i . k_j) exp(cum_i - cum_j)  for j < i
//     (I + A) [U | W] = [beta v | beta k exp(cum)]      (forward substitution)
//     v_new = U - W S;  out = (q s exp(cum)) S + (q s k^T * exp(cum_i - cum_j), j <= i) v_new   (s = dk^-0.5)
//     S = S exp(cum_last) + (k exp(cum_last - cum))^T v_new
//   Not the torch form's bits (its products run in oneDNN/MKL GEMMs with their own blocking, and it solves with
//   torch.linalg.solve_triangular): within fp32 rounding of it and of transformers' (tests/kernels/
//   test_gated_delta_chunk.py). Consistent with itself: every product below is a sum over its inner index in
//   ascending order, each (head, chunk) is computed by one thread with fixed shapes, so the result depends only on
//   the sequence's own tokens and where its chunks start, never on the batch or the thread count; the engine
//   chooses this form or the torch one once for the whole process (GatedDeltaNet, `cpp`).
//
// Shapes: q, k [n, Hv, dk] (L2-normalised), v [n, Hv, dv], g (log decay), beta [n, Hv], state [Hv, dk, dv], all
// fp32; returns out [n, Hv, dv] fp32.

#include <ATen/ATen.h>

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <vector>

#include "ordered_matmul.h"

namespace moeserve_gated_delta {

using moeserve_csrc::matmul;

constexpr int64_t CHUNK = 64;  // gated_delta_rule.CHUNK

struct Work {  // one thread's buffers for one (head, chunk)
  std::vector<float> q, kb, kT, rhs, x, a, inner, prod, v_new, kdT, update;
  std::vector<float> cum;
  Work(int64_t dk, int64_t dv)
      : q(CHUNK * dk), kb(CHUNK * dk), kT(dk * CHUNK), rhs(CHUNK * (dv + dk)), x(CHUNK * (dv + dk)),
        a(CHUNK * CHUNK), inner(CHUNK * CHUNK), prod(CHUNK * (dv + dk)), v_new(CHUNK * dv), kdT(dk * CHUNK),
        update(std::max(dk, CHUNK) * dv), cum(CHUNK) {}  // update: inner v_new [c, dv], then [dk, dv]
};

struct Head {  // one value head's inputs: token t's row at base + t * stride
  const float *q, *k, *v, *g, *beta;
  int64_t qk_stride, v_stride, gb_stride;
  float* out;
};

// One chunk of c tokens of one head: out rows written, S [dk, dv] updated.
static void chunk(const Head& h, int64_t c, int64_t dk, int64_t dv, float scale, float* S, Work& w) {
  const int64_t wide = dv + dk;  // rhs / x rows: [beta v | beta k exp(cum)]
  double run = 0.0;              // torch's CPU cumsum accumulates fp32 in double
  for (int64_t i = 0; i < c; ++i) w.cum[i] = static_cast<float>(run += h.g[i * h.gb_stride]);
  for (int64_t i = 0; i < c; ++i) {
    const float* k = h.k + i * h.qk_stride;
    const float* q = h.q + i * h.qk_stride;
    const float* v = h.v + i * h.v_stride;
    const float b = h.beta[i * h.gb_stride], e = std::exp(w.cum[i]);
    for (int64_t j = 0; j < dv; ++j) w.rhs[i * wide + j] = v[j] * b;
    for (int64_t p = 0; p < dk; ++p) {
      const float kb = k[p] * b;
      w.kb[i * dk + p] = kb;
      w.rhs[i * wide + dv + p] = kb * e;
      w.kT[p * CHUNK + i] = k[p];
      w.q[i * dk + p] = q[p] * scale;
    }
  }
  matmul(w.kb.data(), dk, w.kT.data(), CHUNK, c, dk, c, w.a.data(), CHUNK);     // kb k^T
  matmul(w.q.data(), dk, w.kT.data(), CHUNK, c, dk, c, w.inner.data(), CHUNK);  // q k^T
  for (int64_t i = 0; i < c; ++i)
    for (int64_t j = 0; j < c; ++j) {
      const float d = j <= i ? std::exp(w.cum[i] - w.cum[j]) : 0.0f;
      w.a[i * CHUNK + j] = j < i ? w.a[i * CHUNK + j] * d : 0.0f;
      w.inner[i * CHUNK + j] = j <= i ? w.inner[i * CHUNK + j] * d : 0.0f;
    }
  // forward substitution: x[i] = rhs[i] - sum_{j < i} a[i][j] x[j]
  for (int64_t i = 0; i < c; ++i) {
    matmul(w.a.data() + i * CHUNK, CHUNK, w.x.data(), wide, 1, i, wide, w.prod.data(), wide);
    for (int64_t j = 0; j < wide; ++j) w.x[i * wide + j] = w.rhs[i * wide + j] - w.prod[j];
  }
  matmul(w.x.data() + dv, wide, S, dv, c, dk, dv, w.prod.data(), dv);  // W S
  for (int64_t i = 0; i < c; ++i)
    for (int64_t j = 0; j < dv; ++j) w.v_new[i * dv + j] = w.x[i * wide + j] - w.prod[i * dv + j];
  for (int64_t i = 0; i < c; ++i) {  // q s exp(cum)
    const float e = std::exp(w.cum[i]);
    for (int64_t p = 0; p < dk; ++p) w.q[i * dk + p] = w.q[i * dk + p] * e;
  }
  matmul(w.q.data(), dk, S, dv, c, dk, dv, w.prod.data(), dv);  // (q s exp(cum)) S
  matmul(w.inner.data(), CHUNK, w.v_new.data(), dv, c, c, dv, w.update.data(), dv);  // inner v_new
  for (int64_t i = 0; i < c; ++i)
    for (int64_t j = 0; j < dv; ++j) h.out[i * h.v_stride + j] = w.prod[i * dv + j] + w.update[i * dv + j];
  const float last = w.cum[c - 1];
  for (int64_t i = 0; i < c; ++i) {
    const float d = std::exp(last - w.cum[i]);
    for (int64_t p = 0; p < dk; ++p) w.kdT[p * CHUNK + i] = w.kT[p * CHUNK + i] * d;
  }
  matmul(w.kdT.data(), CHUNK, w.v_new.data(), dv, dk, c, dv, w.update.data(), dv);
  const float decay = std::exp(last);
  for (int64_t i = 0; i < dk * dv; ++i) S[i] = S[i] * decay + w.update[i];
}

at::Tensor gated_delta_chunk_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                              const at::Tensor& beta, at::Tensor& state) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &k, &v, &g, &beta, &state})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu(), "gated_delta_chunk_: fp32 CPU tensors");
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && g.dim() == 2 && beta.sizes() == g.sizes() &&
                  state.dim() == 3,
              "gated_delta_chunk_: q, k [n, Hv, dk], v [n, Hv, dv], g, beta [n, Hv], state [Hv, dk, dv]");
  const int64_t n = q.size(0), H = q.size(1), dk = q.size(2), dv = v.size(2);
  TORCH_CHECK(v.size(0) == n && v.size(1) == H && g.size(0) == n && g.size(1) == H && state.size(0) == H &&
                  state.size(1) == dk && state.size(2) == dv && state.is_contiguous(),
              "gated_delta_chunk_: shapes disagree (or state not contiguous)");
  const auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), gc = g.contiguous();
  const auto bc = beta.contiguous();
  auto out = at::empty({n, H, dv}, q.options());
  const float scale = static_cast<float>(std::pow(static_cast<double>(dk), -0.5));
  const float *qp = qc.data_ptr<float>(), *kp = kc.data_ptr<float>(), *vp = vc.data_ptr<float>();
  const float *gp = gc.data_ptr<float>(), *bp = bc.data_ptr<float>();
  float *st = state.data_ptr<float>(), *op = out.data_ptr<float>();
  at::parallel_for(0, H, 1, [&](int64_t lo, int64_t hi) {
    Work w(dk, dv);
    for (int64_t h = lo; h < hi; ++h)
      for (int64_t t0 = 0; t0 < n; t0 += CHUNK) {
        const Head head{qp + (t0 * H + h) * dk, kp + (t0 * H + h) * dk, vp + (t0 * H + h) * dv, gp + t0 * H + h,
                        bp + t0 * H + h, H * dk, H * dv, H, op + (t0 * H + h) * dv};
        chunk(head, std::min(CHUNK, n - t0), dk, dv, scale, st + h * dk * dv, w);
      }
  });
  return out;
}

}  // namespace moeserve_gated_delta

TORCH_LIBRARY_FRAGMENT(moeserve, m) {
  m.def("gated_delta_chunk_(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) state) -> Tensor",
        &moeserve_gated_delta::gated_delta_chunk_);
}
