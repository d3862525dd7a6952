// interleave_rows_into: W [N, K] (2-byte elements, N % 4 == 0, K % 32 == 0) copied into the row-interleaved layout
// of the dense GEMV and the fused expert ops (moeserve.models.layers.base.interleave_rows):
//     dst[((b * K/32 + c) * 4 + r) * 32 + i] = W[4b + r, 32c + i]
// ONE thread, no OpenMP: it runs on the expert store's I/O threads for every miss, where a torch permute-copy
// would start an OpenMP team per I/O thread that spins on the 2 cores the compute threads need (measured: the
// interleaved layout then decoded offloaded at 0.68x the plain one). Each piece is one 64-byte cache line.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>

namespace moeserve_layout {

void interleave_rows_into(at::Tensor dst, const at::Tensor& src) {
  TORCH_CHECK(src.dim() == 2 && src.is_contiguous() && dst.is_contiguous() && src.element_size() == 2 &&
                  dst.element_size() == 2 && src.device().is_cpu() && dst.device().is_cpu(),
              "interleave_rows_into: contiguous 2-byte CPU tensors, src [N, K]");
  const int64_t n = src.size(0), k = src.size(1);
  TORCH_CHECK(n % 4 == 0 && k % 32 == 0 && dst.numel() == n * k,
              "interleave_rows_into: N % 4 == 0, K % 32 == 0 and dst of N*K elements; got [", n, ", ", k, "] into ",
              dst.numel());
  const auto* s = static_cast<const char*>(src.data_ptr());
  auto* d = static_cast<char*>(dst.data_ptr());
  const int64_t chunks = k / 32, row_bytes = k * 2;
  for (int64_t b = 0; b < n / 4; ++b)
    for (int64_t c = 0; c < chunks; ++c)
      for (int64_t r = 0; r < 4; ++r, d += 64) std::memcpy(d, s + (4 * b + r) * row_bytes + c * 64, 64);
}

}  // namespace moeserve_layout

TORCH_LIBRARY_FRAGMENT(moeserve, m) {
  m.def("interleave_rows_into(Tensor(a!) dst, Tensor src) -> ()", &moeserve_layout::interleave_rows_into);
}
