// Scalar helpers shared by norm.cpp and attention.cpp: fp32 loads of bf16/fp32 values, round-to-nearest-even
// bf16 stores (what torch does after every bf16 op on CPU), written so the compiler can vectorize the loops.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "bf16_bits.h"

namespace moeserve_csrc {

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const at::BFloat16* p, int64_t i) {
  return bits_to_f(static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16);
}

template <typename T>
inline T from_f(float v);
template <>
inline float from_f<float>(float v) { return v; }
template <>
inline at::BFloat16 from_f<at::BFloat16>(float v) { return at::BFloat16(bf16_bits(v), at::BFloat16::from_bits()); }

// v rounded to T and read back as float (identity for fp32): the rounding torch applies between two bf16 ops.
template <typename T>
inline float round_as(float v);
// For fp32 nothing to round, but the empty asm keeps the compiler from fusing the product that made v into an
// FMA with the following add (torch rounds the product first; -march=native would contract it otherwise).
template <>
inline float round_as<float>(float v) {
  asm("" : "+x"(v));
  return v;
}
template <>
inline float round_as<at::BFloat16>(float v) { return bits_to_f(static_cast<uint32_t>(bf16_bits(v)) << 16); }

// sum of x[i]^2 in fp32 over 16 running partial sums (vectorizes without reassociating).
template <typename T>
inline float sum_squares(const T* x, int64_t n) {
  float acc[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) {
      const float v = load(x, i + j);
      acc[j] += v * v;
    }
  for (; i < n; ++i) {
    const float v = load(x, i);
    acc[0] += v * v;
  }
  for (int w = 8; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) acc[j] += acc[j + w];
  return acc[0];
}

// The optional bias [n] (bf16) of a dense op as fp32, checked; empty when there is none.
inline std::vector<float> bias_as_float(const std::optional<at::Tensor>& bias, int64_t n, const char* op) {
  std::vector<float> b;
  if (!bias.has_value()) return b;
  TORCH_CHECK(bias->numel() == n && bias->scalar_type() == at::kBFloat16, op, ": bias [N] bf16");
  const at::Tensor bc = bias->contiguous();
  b.resize(n);
  for (int64_t i = 0; i < n; ++i) b[i] = load(bc.data_ptr<at::BFloat16>(), i);
  return b;
}

// An uninitialised output shaped as x [..., K] with its last dimension n.
inline at::Tensor empty_with_last_dim(const at::Tensor& x, int64_t n) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return at::empty(shape, x.options());
}

}  // namespace moeserve_csrc
