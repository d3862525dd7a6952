// Mamba-2 (Nemotron-H) ops over the per-sequence recurrent state (moeserve/models/mixers/mamba2.py, mamba2_ssd.py):
//
// mamba2_conv_(x [N, C], weight [C, K], bias [C]?, history [slots, K-1, C], slots [B], counts [B], fresh [B])
//   The causal depthwise conv of every sequence's new inputs after its last K-1 inputs (history of slot
//   slots[b], zeroed first where fresh[b]; replaced by the last K-1 inputs): per output one fp32 sum over the
//   K taps in order (each product rounded to fp32), plus the bias, rounded once to the compute dtype. This is
//   Mamba2Mixer's torch conv (mamba2_ssd.conv_torch) operation for operation: the same bits. Any number of
//   tokens per sequence: prompt chunks and decode tokens alike.
//
// mamba2_step_(xbc [N, C], dt [N, H], decay [N, H] fp32, d [H], states [slots, H, P, S] fp32, rows [M], slots [M],
//              n_groups) -> y [M, H, P]
//   The selective-state update of the tokens rows[i] (each the next token of the sequence in slots[i], in
//   order), as mamba2_ssd.ssd_step (transformers' torch step) with T the compute dtype:
//     dbx[p][s] = T(T(dt * B[s]) * x[p])                    (xbc = x [H, P], B [G, S], C [G, S]; head h reads
//     state[p][s] = state[p][s] * decay + dbx[p][s]          group h / (H / G))
//     y[p] = T(sum_s T(state[p][s]) * C[s])                  (the sum over s by halving: halving_sum.h)
//     out[p] = T(y[p] + T(x[p] * d))
//   The inputs' transcendentals (silu, softplus, exp) stay in torch, shared with the torch path: no libm here
//   could promise torch's vectorised bits. Multiply-adds are never fused (fp-contract=off): torch rounds each
//   product. Every (head, row) is reduced in one fixed order: the result never depends on the batch or threads.

#include <ATen/ATen.h>

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "halving_sum.h"
#include "norm_common.h"

#pragma GCC optimize("fp-contract=off")

namespace moeserve_mamba2 {

using namespace moeserve_csrc;

template <typename T>
static void conv_sequence(const T* x, const float* w_t, const float* bias, T* hist, T* out, int64_t n, int64_t K,
                          int64_t C, int64_t lo, int64_t hi, std::vector<float>& acc) {
  // padded input i of the sequence: history row i for i < K-1, else new token i - (K-1)
  auto row = [&](int64_t i) -> const T* { return i < K - 1 ? hist + i * C : x + (i - (K - 1)) * C; };
  for (int64_t t = 0; t < n; ++t) {
    const T* r0 = row(t);
    for (int64_t c = lo; c < hi; ++c) acc[c - lo] = load(r0, c) * w_t[c];
    for (int64_t j = 1; j < K; ++j) {
      const T* rj = row(t + j);
      const float* wj = w_t + j * C;
      for (int64_t c = lo; c < hi; ++c) {
        const float p = round_as<float>(load(rj, c) * wj[c]);
        acc[c - lo] = acc[c - lo] + p;
      }
    }
    if (bias != nullptr)
      for (int64_t c = lo; c < hi; ++c) acc[c - lo] = acc[c - lo] + bias[c];
    for (int64_t c = lo; c < hi; ++c) out[t * C + c] = from_f<T>(acc[c - lo]);
  }
  for (int64_t i = 0; i < K - 1; ++i) {  // ascending: row(n + i) is never a history row already rewritten
    const T* src = row(n + i);
    for (int64_t c = lo; c < hi; ++c) hist[i * C + c] = src[c];
  }
}

template <typename T>
static void run_conv(const at::Tensor& x, const at::Tensor& w_t, const float* bias, at::Tensor& history,
                     at::Tensor& out, const int64_t* slots, const int64_t* counts, const bool* fresh,
                     const std::vector<int64_t>& offsets, int64_t B, int64_t K, int64_t C) {
  const T* xp = x.data_ptr<T>();
  const float* wp = w_t.data_ptr<float>();
  T *hp = history.data_ptr<T>(), *op = out.data_ptr<T>();
  at::parallel_for(0, (C + 63) / 64, 1, [&](int64_t begin, int64_t end) {  // blocks of 64 channels
    const int64_t lo = begin * 64, hi = std::min(C, end * 64);
    std::vector<float> acc(hi - lo);
    for (int64_t b = 0; b < B; ++b) {
      T* hist = hp + slots[b] * (K - 1) * C;
      if (fresh[b])
        for (int64_t i = 0; i < K - 1; ++i)
          for (int64_t c = lo; c < hi; ++c) hist[i * C + c] = from_f<T>(0.0f);
      conv_sequence<T>(xp + offsets[b] * C, wp, bias, hist, op + offsets[b] * C, counts[b], K, C, lo, hi, acc);
    }
  });
}

at::Tensor mamba2_conv_(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                        at::Tensor& history, const at::Tensor& slots, const at::Tensor& counts,
                        const at::Tensor& fresh) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && history.dim() == 3, "mamba2_conv_: x [N, C], weight [C, K], "
              "history [slots, K-1, C]");
  const int64_t N = x.size(0), C = x.size(1), K = weight.size(1), B = slots.numel();
  TORCH_CHECK(weight.size(0) == C && history.size(1) == K - 1 && history.size(2) == C && K >= 2,
              "mamba2_conv_: shapes disagree");
  TORCH_CHECK(x.scalar_type() == history.scalar_type() && (x.scalar_type() == at::kFloat ||
              x.scalar_type() == at::kBFloat16), "mamba2_conv_: x and history in one dtype, bf16 or fp32");
  TORCH_CHECK(history.is_contiguous(), "mamba2_conv_: history must be contiguous");
  TORCH_CHECK(counts.numel() == B && fresh.numel() == B, "mamba2_conv_: slots, counts, fresh [B]");
  const auto xc = x.contiguous();
  const auto w_t = weight.to(at::kFloat).t().contiguous();  // [K, C]: tap j of every channel side by side
  at::Tensor b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == C, "mamba2_conv_: bias [C]");
    b = bias->to(at::kFloat).contiguous();
  }
  const auto sl = slots.to(at::kLong).contiguous(), cn = counts.to(at::kLong).contiguous();
  const auto fr = fresh.to(at::kBool).contiguous();
  const int64_t *sp = sl.data_ptr<int64_t>(), *np = cn.data_ptr<int64_t>();
  const bool* fp = fr.data_ptr<bool>();
  std::vector<int64_t> offsets(B);
  int64_t total = 0;
  for (int64_t i = 0; i < B; ++i) {
    TORCH_CHECK(sp[i] >= 0 && sp[i] < history.size(0), "mamba2_conv_: slot out of range");
    TORCH_CHECK(np[i] >= 0, "mamba2_conv_: negative count");
    offsets[i] = total;
    total += np[i];
  }
  TORCH_CHECK(total == N, "mamba2_conv_: counts must add up to the rows of x");
  auto out = at::empty_like(xc);
  const float* bp = bias.has_value() ? b.data_ptr<float>() : nullptr;
  AT_DISPATCH_SWITCH(x.scalar_type(), "mamba2_conv_",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      run_conv<float>(xc, w_t, bp, history, out, sp, np, fp, offsets, B, K, C);
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      run_conv<at::BFloat16>(xc, w_t, bp, history, out, sp, np, fp, offsets, B, K, C);
    }));
  return out;
}

// v rounded to T, read back as float (fp32: v itself; contraction is off in this file, so nothing fuses it)
template <typename T>
inline float rnd(float v) { return round_as<T>(v); }
template <>
inline float rnd<float>(float v) { return v; }

struct StepWork {
  std::vector<float> dtb, prod;
};

// One token of one head: x [P], b / c [S] (its group's), state [P, S] updated in place, out [P]. One pass over
// the state, row p by row p: update it, then y[p] = its products with C summed by halving in place (the order
// of halving_sum.h, taken along the row).
template <typename T>
static void step_head(const T* x, const T* b, const T* c, float dt, float decay, float d, float* state, T* out,
                      int64_t P, int64_t S, StepWork& w) {
  float* prod = w.prod.data();
  for (int64_t s = 0; s < S; ++s) w.dtb[s] = rnd<T>(dt * load(b, s));
  for (int64_t p = 0; p < P; ++p) {
    const float xp = load(x, p);
    float* row = state + p * S;
    for (int64_t s = 0; s < S; ++s) {
      const float dbx = rnd<T>(w.dtb[s] * xp);
      const float decayed = row[s] * decay;
      row[s] = decayed + dbx;
    }
    for (int64_t s = 0; s < S; ++s) prod[s] = rnd<T>(row[s]) * load(c, s);
    float y;
    sum_rows_halving(prod, S, 1, &y);
    out[p] = from_f<T>(rnd<T>(y) + rnd<T>(xp * d));
  }
}

template <typename T>
static void run_step(const at::Tensor& xbc, const at::Tensor& dt, const at::Tensor& decay, const at::Tensor& d,
                     at::Tensor& states, const int64_t* rows, const int64_t* slots, int64_t M, int64_t G,
                     at::Tensor& out) {
  const int64_t H = states.size(1), P = states.size(2), S = states.size(3), C = xbc.size(1), inner = H * P;
  const T *xp = xbc.data_ptr<T>(), *tp = dt.data_ptr<T>(), *dp = d.data_ptr<T>();
  const float* ep = decay.data_ptr<float>();
  float* st = states.data_ptr<float>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, H, 1, [&](int64_t lo, int64_t hi) {
    StepWork w{std::vector<float>(S), std::vector<float>(S)};
    for (int64_t h = lo; h < hi; ++h) {
      const int64_t g = h / (H / G);
      for (int64_t i = 0; i < M; ++i) {  // in order: a slot's later token sees its earlier one's state
        const T* row = xp + rows[i] * C;
        step_head<T>(row + h * P, row + inner + g * S, row + inner + (G + g) * S, load(tp, rows[i] * H + h),
                     ep[rows[i] * H + h], load(dp, h), st + ((slots[i] * H + h) * P) * S, op + (i * H + h) * P, P, S,
                     w);
      }
    }
  });
}

at::Tensor mamba2_step_(const at::Tensor& xbc, const at::Tensor& dt, const at::Tensor& decay, const at::Tensor& d,
                        at::Tensor& states, const at::Tensor& rows, const at::Tensor& slots, int64_t n_groups) {
  TORCH_CHECK(states.dim() == 4 && states.scalar_type() == at::kFloat && states.is_contiguous(),
              "mamba2_step_: states [slots, H, P, S] fp32, contiguous");
  const int64_t H = states.size(1), P = states.size(2), S = states.size(3), N = xbc.size(0), M = rows.numel();
  TORCH_CHECK(n_groups >= 1 && H % n_groups == 0, "mamba2_step_: heads must be a multiple of n_groups");
  TORCH_CHECK(xbc.dim() == 2 && xbc.size(1) == H * P + 2 * n_groups * S, "mamba2_step_: xbc [N, H*P + 2*G*S]");
  TORCH_CHECK(dt.dim() == 2 && dt.size(0) == N && dt.size(1) == H && decay.sizes() == dt.sizes() &&
              d.numel() == H && slots.numel() == M, "mamba2_step_: dt, decay [N, H], d [H], rows and slots [M]");
  TORCH_CHECK((xbc.scalar_type() == at::kFloat || xbc.scalar_type() == at::kBFloat16) &&
              dt.scalar_type() == xbc.scalar_type() && d.scalar_type() == xbc.scalar_type() &&
              decay.scalar_type() == at::kFloat, "mamba2_step_: xbc, dt, d in one dtype (bf16 or fp32), decay fp32");
  const auto xc = xbc.contiguous(), tc = dt.contiguous(), ec = decay.contiguous(), dc = d.contiguous();
  const auto rw = rows.to(at::kLong).contiguous(), sl = slots.to(at::kLong).contiguous();
  const int64_t *rp = rw.data_ptr<int64_t>(), *sp = sl.data_ptr<int64_t>();
  for (int64_t i = 0; i < M; ++i) {
    TORCH_CHECK(rp[i] >= 0 && rp[i] < N, "mamba2_step_: row out of range");
    TORCH_CHECK(sp[i] >= 0 && sp[i] < states.size(0), "mamba2_step_: slot out of range");
  }
  auto out = at::empty({M, H, P}, xbc.options());
  AT_DISPATCH_SWITCH(xbc.scalar_type(), "mamba2_step_",
    AT_DISPATCH_CASE(at::kFloat, [&] { run_step<float>(xc, tc, ec, dc, states, rp, sp, M, n_groups, out); })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      run_step<at::BFloat16>(xc, tc, ec, dc, states, rp, sp, M, n_groups, out);
    }));
  return out;
}

}  // namespace moeserve_mamba2

TORCH_LIBRARY_FRAGMENT(moeserve, m) {
  m.def("mamba2_conv_(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) history, Tensor slots, Tensor counts, "
        "Tensor fresh) -> Tensor", &moeserve_mamba2::mamba2_conv_);
  m.def("mamba2_step_(Tensor xbc, Tensor dt, Tensor decay, Tensor d, Tensor(a!) states, Tensor rows, Tensor slots, "
        "int n_groups) -> Tensor", &moeserve_mamba2::mamba2_step_);
}
