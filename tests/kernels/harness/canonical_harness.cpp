// The canonical ops' numeric cores without torch, for any ISA: the dense GEMV on the row-interleaved layout
// (csrc/dense_gemv_core.h, what linear_interleaved runs), the interleaved SwiGLU expert op (csrc/moe_interleaved.h,
// what moe_swiglu_interleaved_ runs) and silu on every bf16 value. tests/kernels/test_aarch64_qemu.py builds it for
// each x86 ISA level and, cross-compiled, for aarch64 (run under qemu-user), and compares the outputs bit for bit.
//
//   canonical_harness IN OUT [THREADS]
//
// IN (little-endian): "MSHARN01", int64 records, then per record int64 kind and
//   kind 0, linear:  int64 m, n, k, has_bias; uint16 x [m, k]; uint16 packed [n * k]; float32 bias [n] if has_bias
//   kind 1, experts: int64 h, isz, tokens, n_exp, pairs; uint16 x [tokens, h]; uint16 out [tokens, h]; per expert
//                    uint16 gate_up [2 isz * h] and down [h * isz] (interleaved); int64 token_of [pairs];
//                    float32 weight_of [pairs]; int64 bounds [n_exp, 2]
//   kind 2, silu:    nothing (the output: bf16(silu(v)) for the 65536 bf16 bit patterns v, as the expert op rounds)
// OUT: "MSHARO01", int64 length + the bf16 dot implementation's name, then per record int64 count + uint16 [count].
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "dense_gemv_core.h"
#include "moe_interleaved.h"

namespace {

struct Reader {
  FILE* f;
  template <typename T>
  std::vector<T> read(int64_t n) {
    std::vector<T> v(static_cast<size_t>(n));
    if (n > 0 && std::fread(v.data(), sizeof(T), v.size(), f) != v.size()) fail("truncated input");
    return v;
  }
  int64_t i64() { return read<int64_t>(1)[0]; }
  [[noreturn]] static void fail(const char* what) {
    std::fprintf(stderr, "canonical_harness: %s\n", what);
    std::exit(2);
  }
};

std::vector<uint16_t> linear(Reader& in) {
  const int64_t m = in.i64(), n = in.i64(), k = in.i64(), has_bias = in.i64();
  const auto x = in.read<uint16_t>(m * k);
  const auto packed = in.read<uint16_t>(n * k);
  const auto bias = in.read<float>(has_bias ? n : 0);
  std::vector<uint16_t> y(static_cast<size_t>(m * n));
  const int64_t units = n / 4 + (n % 4 != 0 ? 1 : 0);
  moeserve_dense::gemv_rows(x.data(), packed.data(), m, n, k, has_bias ? bias.data() : nullptr, y.data(), 0, units);
  return y;
}

std::vector<uint16_t> experts(Reader& in, int threads) {
  const int64_t h = in.i64(), isz = in.i64(), tokens = in.i64(), n_exp = in.i64(), pairs = in.i64();
  const auto x = in.read<uint16_t>(tokens * h);
  auto out = in.read<uint16_t>(tokens * h);
  std::vector<std::vector<uint16_t>> gate_up, down;
  for (int64_t e = 0; e < n_exp; ++e) {
    gate_up.push_back(in.read<uint16_t>(2 * isz * h));
    down.push_back(in.read<uint16_t>(h * isz));
  }
  const auto token_of = in.read<int64_t>(pairs);
  const auto weight_of = in.read<float>(pairs);
  const auto bounds = in.read<int64_t>(2 * n_exp);
  std::vector<moeserve_moe::Expert> list;  // as moe_swiglu_interleaved_ collects them: experts with tokens, in order
  int64_t p = 0;
  for (int64_t e = 0; e < n_exp; ++e)
    if (bounds[2 * e + 1] > bounds[2 * e]) {
      list.push_back({gate_up[e].data(), down[e].data(), nullptr, nullptr, bounds[2 * e], bounds[2 * e + 1], p});
      p += bounds[2 * e + 1] - bounds[2 * e];
    }
  if (!list.empty())
    moeserve_moe::run_interleaved<moeserve_moe::Bf16Block>(out.data(), x.data(), h, isz, list, token_of.data(),
                                                           weight_of.data(), p, threads);
  return out;
}

std::vector<uint16_t> silu_table() {
  std::vector<uint16_t> y(65536);
  for (uint32_t v = 0; v < 65536; ++v)
    y[v] = moeserve_moe::f_to_bf16(moeserve_moe::silu(moeserve_moe::bf16_to_f(static_cast<uint16_t>(v))));
  return y;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) Reader::fail("usage: canonical_harness IN OUT [THREADS]");
  const int threads = argc > 3 ? std::atoi(argv[3]) : 1;
  Reader in{std::fopen(argv[1], "rb")};
  FILE* out = std::fopen(argv[2], "wb");
  if (in.f == nullptr || out == nullptr) Reader::fail("cannot open the input or the output");
  char magic[8];
  if (std::fread(magic, 1, 8, in.f) != 8 || std::memcmp(magic, "MSHARN01", 8) != 0) Reader::fail("not a harness input");
  const std::string isa = moeserve_canon::implementation();
  const int64_t len = static_cast<int64_t>(isa.size());
  std::fwrite("MSHARO01", 1, 8, out);
  std::fwrite(&len, 8, 1, out);
  std::fwrite(isa.data(), 1, isa.size(), out);
  for (int64_t i = 0, records = in.i64(); i < records; ++i) {
    const int64_t kind = in.i64();
    const std::vector<uint16_t> y = kind == 0 ? linear(in) : kind == 1 ? experts(in, threads) : kind == 2 ? silu_table()
                                                                                              : (Reader::fail("bad kind"), std::vector<uint16_t>());
    const int64_t count = static_cast<int64_t>(y.size());
    std::fwrite(&count, 8, 1, out);
    std::fwrite(y.data(), 2, y.size(), out);
  }
  return std::fclose(out) == 0 ? 0 : 2;
}
