// mamba2_scan_: the SSD chunk scan of Mamba-2 (Nemotron-H) for the prompt tokens of a batch of sequences, each
// against its own state slot (read, then replaced by the state after its tokens). The same computation as
// moeserve.models.mixers.mamba2_ssd.ssd_chunk (transformers' mamba2_chunk_scan, with the state carried from chunk to
// chunk): a sequence's tokens cut on a grid of `chunk` positions from 0 (a piece starting off the grid first
// finishes its chunk), per head and chunk of c tokens, with da = dt A, cum = cumsum(da),
//   seg[l][s] = sum of da[s+1 .. l]              (summed from the inputs, as transformers' segment_sum)
//   y[l] = sum_s (C_l . B_s) exp(seg[l][s]) dt_s x_s  +  (C_l . state) exp(cum[l])  +  D x_l      (s <= l)
//   state = state exp(cum[c-1]) + sum_l B_l exp(cum[c-1] - cum[l]) dt_l x_l
// Not the torch form's bits (its products run in oneDNN/MKL GEMMs with their own blocking, its exp is torch's):
// within fp32 rounding of it and of transformers' (tests/kernels/test_mamba2_chunk.py). Consistent with itself:
// every product is a sum over its inner index in ascending order (ordered_matmul.h), each (group, chunk) of
// C . B and each (sequence, head) of the scan is computed by one thread with the same code, so a token's result
// depends only on its sequence's tokens and the grid, never on the batch or the thread count; the engine
// chooses this scan or the torch one once for the whole process (mamba2_ssd.CppMamba2).
//
// Shapes: xbc [N, H*P + 2*G*S] (bf16 or fp32: x, then B and C per group; SiLU'd), dt [N, H] fp32 (softplus'd and
// clamped), a, d [H] fp32, states [slots, H, P, S] fp32, y [N, H, P] fp32 (the pieces' rows written, others
// untouched); pieces: offsets, counts, starts (position of the first token), slots [B].

#include <ATen/ATen.h>

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "norm_common.h"
#include "ordered_matmul.h"

namespace moeserve_mamba2_chunk {

using moeserve_csrc::load;
using moeserve_csrc::matmul;

struct Chunk {
  int64_t piece, row, count;  // the piece it belongs to, its first row of xbc, its tokens
};

struct Dims {
  int64_t H, P, G, S, C, inner, chunk;
};

// The chunks of every piece on the grid, piece after piece; first[b] = index of piece b's first chunk.
static std::vector<Chunk> cut(const int64_t* offsets, const int64_t* counts, const int64_t* starts, int64_t B,
                              int64_t chunk, std::vector<int64_t>& first) {
  std::vector<Chunk> chunks;
  for (int64_t b = 0; b < B; ++b) {
    first[b] = static_cast<int64_t>(chunks.size());
    for (int64_t lo = 0; lo < counts[b];) {
      const int64_t hi = std::min(counts[b], lo + chunk - (starts[b] + lo) % chunk);
      chunks.push_back({b, offsets[b] + lo, hi - lo});
      lo = hi;
    }
  }
  first[B] = static_cast<int64_t>(chunks.size());
  return chunks;
}

// cb [c, c] = C . B of group g over one chunk (row l: its C, column s: its B)
template <typename T>
static void group_scores(const T* xbc, const Chunk& k, int64_t g, const Dims& d, float* cb, std::vector<float>& c_rows,
                         std::vector<float>& b_cols) {
  const int64_t n = k.count;
  for (int64_t l = 0; l < n; ++l) {
    const T* row = xbc + (k.row + l) * d.C + d.inner;
    for (int64_t s = 0; s < d.S; ++s) {
      b_cols[s * n + l] = load(row + g * d.S, s);
      c_rows[l * d.S + s] = load(row + (d.G + g) * d.S, s);
    }
  }
  matmul(c_rows.data(), d.S, b_cols.data(), n, n, d.S, n, cb, n);
}

struct HeadWork {  // one thread's buffers for one (sequence, head): chunk-sized, the state transposed [S, P]
  std::vector<float> xdt, x, c_rows, bd_cols, m, y_diag, y_off, update, state_t, cum, da;
  HeadWork(const Dims& d)
      : xdt(d.chunk * d.P), x(d.chunk * d.P), c_rows(d.chunk * d.S), bd_cols(d.S * d.chunk), m(d.chunk * d.chunk),
        y_diag(d.chunk * d.P), y_off(d.chunk * d.P), update(d.S * d.P), state_t(d.S * d.P), cum(d.chunk),
        da(d.chunk) {}
};

// One chunk of head h: y rows written, w.state_t advanced. cb: the chunk's C . B of the head's group.
template <typename T>
static void head_chunk(const T* xbc, const float* dt, float a, float dskip, const Chunk& k, int64_t h,
                       const float* cb, const Dims& d, float* y, HeadWork& w) {
  const int64_t n = k.count, P = d.P, S = d.S, g = h / (d.H / d.G);
  double run = 0.0;  // torch's CPU cumsum accumulates fp32 in double
  for (int64_t l = 0; l < n; ++l) {
    const T* row = xbc + (k.row + l) * d.C;
    const float t = dt[(k.row + l) * d.H + h];
    w.da[l] = t * a;
    w.cum[l] = static_cast<float>(run += w.da[l]);
    for (int64_t p = 0; p < P; ++p) {
      w.x[l * P + p] = load(row + h * P, p);
      w.xdt[l * P + p] = w.x[l * P + p] * t;
    }
    for (int64_t s = 0; s < S; ++s) w.c_rows[l * S + s] = load(row + d.inner + (d.G + g) * S, s);
  }
  for (int64_t s = 0; s < n; ++s) {  // m[l][s] = cb[l][s] exp(seg[l][s]) for s <= l, 0 above the diagonal
    double seg = 0.0;
    for (int64_t l = 0; l < s; ++l) w.m[l * n + s] = 0.0f;
    w.m[s * n + s] = cb[s * n + s];
    for (int64_t l = s + 1; l < n; ++l) {
      seg += w.da[l];
      w.m[l * n + s] = cb[l * n + s] * std::exp(static_cast<float>(seg));
    }
  }
  matmul(w.m.data(), n, w.xdt.data(), P, n, n, P, w.y_diag.data(), P);
  matmul(w.c_rows.data(), S, w.state_t.data(), P, n, S, P, w.y_off.data(), P);
  for (int64_t l = 0; l < n; ++l) {
    const float e = std::exp(w.cum[l]);
    float* out = y + ((k.row + l) * d.H + h) * P;
    for (int64_t p = 0; p < P; ++p) out[p] = (w.y_diag[l * P + p] + w.y_off[l * P + p] * e) + dskip * w.x[l * P + p];
  }
  const float last = w.cum[n - 1];
  for (int64_t l = 0; l < n; ++l) {
    const float to_end = std::exp(last - w.cum[l]);
    const T* row = xbc + (k.row + l) * d.C + d.inner + g * S;
    for (int64_t s = 0; s < S; ++s) w.bd_cols[s * n + l] = load(row, s) * to_end;
  }
  matmul(w.bd_cols.data(), n, w.xdt.data(), P, S, n, P, w.update.data(), P);
  const float decay = std::exp(last);
  for (int64_t i = 0; i < S * P; ++i) w.state_t[i] = w.state_t[i] * decay + w.update[i];
}

template <typename T>
static void run_scan(const at::Tensor& xbc, const float* dt, const float* a, const float* dskip, float* states,
                     float* y, const int64_t* slots, const std::vector<Chunk>& chunks,
                     const std::vector<int64_t>& first, int64_t B, const Dims& d) {
  const T* xp = xbc.data_ptr<T>();
  const int64_t K = static_cast<int64_t>(chunks.size()), area = d.chunk * d.chunk;
  std::vector<float> cb(K * d.G * area);  // C . B per (chunk, group): shared by the group's heads
  at::parallel_for(0, K * d.G, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> c_rows(d.chunk * d.S), b_cols(d.S * d.chunk);
    for (int64_t i = lo; i < hi; ++i)
      group_scores<T>(xp, chunks[i / d.G], i % d.G, d, cb.data() + i * area, c_rows, b_cols);
  });
  at::parallel_for(0, B * d.H, 1, [&](int64_t lo, int64_t hi) {
    HeadWork w(d);
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t b = i / d.H, h = i % d.H;
      float* state = states + (slots[b] * d.H + h) * d.P * d.S;  // [P, S]; worked on as [S, P]
      for (int64_t p = 0; p < d.P; ++p)
        for (int64_t s = 0; s < d.S; ++s) w.state_t[s * d.P + p] = state[p * d.S + s];
      const int64_t g = h / (d.H / d.G);
      for (int64_t k = first[b]; k < first[b + 1]; ++k)
        head_chunk<T>(xp, dt, a[h], dskip[h], chunks[k], h, cb.data() + (k * d.G + g) * area, d, y, w);
      for (int64_t p = 0; p < d.P; ++p)
        for (int64_t s = 0; s < d.S; ++s) state[p * d.S + s] = w.state_t[s * d.P + p];
    }
  });
}

static void check(const at::Tensor& xbc, const at::Tensor& dt, const at::Tensor& a, const at::Tensor& d,
                  const at::Tensor& states, const at::Tensor& y, int64_t n_groups, int64_t chunk) {
  TORCH_CHECK(states.dim() == 4 && states.scalar_type() == at::kFloat && states.is_contiguous(),
              "mamba2_scan_: states [slots, H, P, S] fp32, contiguous");
  const int64_t H = states.size(1), P = states.size(2), S = states.size(3), N = xbc.size(0);
  TORCH_CHECK(n_groups >= 1 && H % n_groups == 0, "mamba2_scan_: heads must be a multiple of n_groups");
  TORCH_CHECK(chunk >= 1 && chunk <= 1024, "mamba2_scan_: chunk in [1, 1024]");
  TORCH_CHECK(xbc.dim() == 2 && xbc.size(1) == H * P + 2 * n_groups * S, "mamba2_scan_: xbc [N, H*P + 2*G*S]");
  TORCH_CHECK(xbc.scalar_type() == at::kFloat || xbc.scalar_type() == at::kBFloat16,
              "mamba2_scan_: xbc bf16 or fp32");
  TORCH_CHECK(dt.dim() == 2 && dt.size(0) == N && dt.size(1) == H && a.numel() == H && d.numel() == H,
              "mamba2_scan_: dt [N, H], a and d [H]");
  for (const at::Tensor* t : {&dt, &a, &d, &y})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "mamba2_scan_: dt, a, d and y fp32");
  TORCH_CHECK(y.dim() == 3 && y.size(0) == N && y.size(1) == H && y.size(2) == P && y.is_contiguous(),
              "mamba2_scan_: y [N, H, P] contiguous");
}

void mamba2_scan_(const at::Tensor& xbc, const at::Tensor& dt, const at::Tensor& a, const at::Tensor& d,
                  at::Tensor& states, at::Tensor& y, const at::Tensor& offsets, const at::Tensor& counts,
                  const at::Tensor& starts, const at::Tensor& slots, int64_t n_groups, int64_t chunk) {
  check(xbc, dt, a, d, states, y, n_groups, chunk);
  const int64_t B = slots.numel(), N = xbc.size(0);
  TORCH_CHECK(offsets.numel() == B && counts.numel() == B && starts.numel() == B,
              "mamba2_scan_: offsets, counts, starts, slots [B]");
  const auto of = offsets.to(at::kLong).contiguous(), cn = counts.to(at::kLong).contiguous();
  const auto st = starts.to(at::kLong).contiguous(), sl = slots.to(at::kLong).contiguous();
  const int64_t *op = of.data_ptr<int64_t>(), *np = cn.data_ptr<int64_t>();
  const int64_t *pp = st.data_ptr<int64_t>(), *sp = sl.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(np[b] >= 1 && op[b] >= 0 && op[b] + np[b] <= N, "mamba2_scan_: piece rows out of range");
    TORCH_CHECK(pp[b] >= 0, "mamba2_scan_: negative start");
    TORCH_CHECK(sp[b] >= 0 && sp[b] < states.size(0), "mamba2_scan_: slot out of range");
    for (int64_t e = 0; e < b; ++e) TORCH_CHECK(sp[e] != sp[b], "mamba2_scan_: two pieces in one slot");
  }
  const int64_t H = states.size(1), P = states.size(2), S = states.size(3);
  const Dims dims{H, P, n_groups, S, xbc.size(1), H * P, chunk};
  std::vector<int64_t> first(B + 1);
  const auto chunks = cut(op, np, pp, B, chunk, first);
  const auto xc = xbc.contiguous(), tc = dt.contiguous(), ac = a.contiguous(), dc = d.contiguous();
  const float *tp = tc.data_ptr<float>(), *ap = ac.data_ptr<float>(), *dp = dc.data_ptr<float>();
  float *stp = states.data_ptr<float>(), *yp = y.data_ptr<float>();
  AT_DISPATCH_SWITCH(xbc.scalar_type(), "mamba2_scan_",
    AT_DISPATCH_CASE(at::kFloat, [&] { run_scan<float>(xc, tp, ap, dp, stp, yp, sp, chunks, first, B, dims); })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      run_scan<at::BFloat16>(xc, tp, ap, dp, stp, yp, sp, chunks, first, B, dims);
    }));
}

}  // namespace moeserve_mamba2_chunk

TORCH_LIBRARY_FRAGMENT(moeserve, m) {
  m.def("mamba2_scan_(Tensor xbc, Tensor dt, Tensor a, Tensor d, Tensor(a!) states, Tensor(b!) y, Tensor offsets, "
        "Tensor counts, Tensor starts, Tensor slots, int n_groups, int chunk) -> ()",
        &moeserve_mamba2_chunk::mamba2_scan_);
}
