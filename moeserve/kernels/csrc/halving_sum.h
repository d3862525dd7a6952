// The one fixed summation order of the recurrent-state ops (gated_delta.cpp, mamba2.cpp), the same as the torch
// steps they must equal bit for bit (models/gated_delta_rule.sum_rows, models/mamba2_ssd.ssd_sum_last): n rows of
// w floats summed into one by halving, with m = ceil(n / 2): row i += row i + m for i < n - m, until one row is
// left. Each step is an element-wise fp32 add, so the order is the same vectorized or not.
#pragma once

#include <cstdint>

namespace moeserve_csrc {

// rows [n, w] summed into out [w] (destroys rows)
inline void sum_rows_halving(float* rows, int64_t n, int64_t w, float* out) {
  while (n > 1) {
    const int64_t m = (n + 1) / 2;
    for (int64_t i = 0; i < n - m; ++i)
      for (int64_t j = 0; j < w; ++j) rows[i * w + j] = rows[i * w + j] + rows[(i + m) * w + j];
    n = m;
  }
  for (int64_t j = 0; j < w; ++j) out[j] = rows[j];
}

}  // namespace moeserve_csrc
