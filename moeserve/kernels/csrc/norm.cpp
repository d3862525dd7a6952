// RMSNorm (and residual add + RMSNorm) for the decode step: one op instead of the ~8 torch ops each norm
// costs (to(fp32), pow, mean, add, rsqrt, mul, to(dtype), mul), which at batch 1 are pure dispatch overhead.
//
// Numerics follow moeserve.models.layers.base.rms_norm / rms_norm_fp32_scale (transformers' order) operation by
// operation: the input is read in fp32, the mean of squares is taken in fp32 (sum, then divided by H),
// r = 1 / sqrt(mean + eps), h = x * r in fp32; then either
//   cast_then_scale: out = dtype(w * dtype(h))   (the weight product rounded once more, as torch's bf16 mul)
//   scale_in_fp32:   out = dtype(w_fp32 * h)
// The residual add rounds x + y to the dtype first, as torch's add does. The only difference from the torch
// functions is the order of the fp32 sum of squares (16 running partial sums here), which can move the result
// by an ulp of fp32 before rounding to bf16.

#include <ATen/ATen.h>

#include "ops.h"
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "norm_common.h"

namespace moeserve_norm {

using namespace moeserve_csrc;

template <typename T, typename W>
static void norm_rows(const T* x, int64_t x_stride, const W* w, T* out, int64_t out_stride, int64_t rows,
                      int64_t h, float eps, bool fp32_scale) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * x_stride;
    T* o = out + r * out_stride;
    const float inv = 1.0f / std::sqrt(sum_squares(xr, h) / static_cast<float>(h) + eps);
    if (fp32_scale) {
      for (int64_t i = 0; i < h; ++i) o[i] = from_f<T>(load(w, i) * (load(xr, i) * inv));
    } else {
      for (int64_t i = 0; i < h; ++i) o[i] = from_f<T>(load(w, i) * round_as<T>(load(xr, i) * inv));
    }
  }
}

template <typename T, typename W>
static void add_norm_rows(T* res, const T* x, const W* w, T* out, int64_t rows, int64_t h, float eps,
                          bool fp32_scale) {
  for (int64_t r = 0; r < rows; ++r) {
    T* rr = res + r * h;
    const T* xr = x + r * h;
    for (int64_t i = 0; i < h; ++i) rr[i] = from_f<T>(load(rr, i) + load(xr, i));
  }
  norm_rows<T, W>(res, h, w, out, h, rows, h, eps, fp32_scale);
}

static void check_norm_args(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "moeserve norm ops run on CPU tensors");
  TORCH_CHECK(x.dim() >= 1 && x.stride(-1) == 1, "rms_norm: the last dim of x must be contiguous");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(-1), "rms_norm: weight must be [H]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "rms_norm: bf16 or fp32 input");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat, "rms_norm: bf16 or fp32 weight");
}

template <typename F>
static void dispatch_types(const at::Tensor& x, const at::Tensor& w, F&& f) {
  const bool xb = x.scalar_type() == at::kBFloat16, wb = w.scalar_type() == at::kBFloat16;
  if (xb && wb) f(static_cast<at::BFloat16*>(nullptr), static_cast<at::BFloat16*>(nullptr));
  else if (xb) f(static_cast<at::BFloat16*>(nullptr), static_cast<float*>(nullptr));
  else if (wb) f(static_cast<float*>(nullptr), static_cast<at::BFloat16*>(nullptr));
  else f(static_cast<float*>(nullptr), static_cast<float*>(nullptr));
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w, double eps, bool fp32_scale) {
  check_norm_args(x_in, w);
  const at::Tensor x = x_in.reshape({-1, x_in.size(-1)});  // a view when rows are evenly strided
  const int64_t rows = x.size(0), h = x.size(1);
  at::Tensor out = at::empty(x_in.sizes(), x_in.options().memory_format(at::MemoryFormat::Contiguous));
  dispatch_types(x, w, [&](auto* tp, auto* wp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    using W = std::remove_pointer_t<decltype(wp)>;
    norm_rows<T, W>(x.data_ptr<T>(), x.stride(0), w.data_ptr<W>(), out.data_ptr<T>(), h, rows, h,
                    static_cast<float>(eps), fp32_scale);
  });
  return out;
}

// residual += x (rounded to the dtype), returns rms_norm(residual). Both [rows, H] contiguous.
at::Tensor add_rms_norm_(at::Tensor& residual, const at::Tensor& x, const at::Tensor& w, double eps,
                         bool fp32_scale) {
  check_norm_args(residual, w);
  TORCH_CHECK(residual.is_contiguous() && x.is_contiguous() && x.sizes() == residual.sizes() &&
                  x.scalar_type() == residual.scalar_type(),
              "add_rms_norm_: residual and x must be contiguous, same shape and dtype");
  const int64_t h = residual.size(-1), rows = residual.numel() / h;
  at::Tensor out = at::empty_like(residual);
  dispatch_types(residual, w, [&](auto* tp, auto* wp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    using W = std::remove_pointer_t<decltype(wp)>;
    add_norm_rows<T, W>(residual.data_ptr<T>(), x.data_ptr<T>(), w.data_ptr<W>(), out.data_ptr<T>(), rows, h,
                        static_cast<float>(eps), fp32_scale);
  });
  return out;
}

}  // namespace moeserve_norm

TORCH_LIBRARY_FRAGMENT(moeserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool fp32_scale) -> Tensor", &moeserve_norm::rms_norm);
  m.def("add_rms_norm_(Tensor(a!) residual, Tensor x, Tensor weight, float eps, bool fp32_scale) -> Tensor",
        &moeserve_norm::add_rms_norm_);
}
