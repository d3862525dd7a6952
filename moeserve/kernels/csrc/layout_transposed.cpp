// interleave_transposed_into: W^T for a W stored [K, N] (input-major, as gpt-oss stores its experts), copied into
// the row-interleaved layout of the canonical bf16 ops (layout.cpp's interleave_rows_into of W^T [N, K]):
//     dst[((b * K/32 + c) * 4 + r) * 32 + i] = W[32c + i, 4b + r]
// without the transposed copy a torch permute would make. ONE thread, as interleave_rows_into (it runs on the
// expert store's I/O threads for every miss).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>

namespace moeserve_layout {

void interleave_transposed_into(at::Tensor dst, const at::Tensor& src) {
  TORCH_CHECK(src.dim() == 2 && src.is_contiguous() && dst.is_contiguous() && src.element_size() == 2 &&
                  dst.element_size() == 2 && src.device().is_cpu() && dst.device().is_cpu(),
              "interleave_transposed_into: contiguous 2-byte CPU tensors, src [K, N]");
  const int64_t k = src.size(0), n = src.size(1);
  TORCH_CHECK(n % 4 == 0 && k % 32 == 0 && dst.numel() == n * k,
              "interleave_transposed_into: N % 4 == 0, K % 32 == 0 and dst of N*K elements; got [", k, ", ", n,
              "] into ", dst.numel());
  const auto* s = static_cast<const uint16_t*>(src.data_ptr());
  auto* d = static_cast<uint16_t*>(dst.data_ptr());
  const int64_t chunks = k / 32;
  for (int64_t c = 0; c < chunks; ++c)  // 32 source rows at a time, each read left to right
    for (int64_t b = 0; b < n / 4; ++b) {
      uint16_t* out = d + (b * chunks + c) * 128;
      for (int64_t i = 0; i < 32; ++i) {
        const uint16_t* in = s + (32 * c + i) * n + 4 * b;
        for (int64_t r = 0; r < 4; ++r) out[32 * r + i] = in[r];
      }
    }
}

}  // namespace moeserve_layout

TORCH_LIBRARY_FRAGMENT(moeserve, m) {
  m.def("interleave_transposed_into(Tensor(a!) dst, Tensor src) -> ()", &moeserve_layout::interleave_transposed_into);
}
