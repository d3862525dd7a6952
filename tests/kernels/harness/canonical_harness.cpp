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
//   kind 3, int4-q8: int64 m, n, k; uint16 x [m, k]; uint8 codes [n, k / 2]; uint16 scales [n, k / 32] (csrc/q4_q8.h;
//                    n % 4 == 0). The output: each x row quantized (q4_q8.h's bytes as uint16 pairs), then the dots.
//   kind 4, gguf:    int64 type (moeserve_q4::GType), m, n, k; uint16 x [m, k]; uint8 rows [n, row bytes]
//                    (csrc/gguf_codes.cpp; n % 4 == 0). The output: the decoded rows (bf16 [n, k]), then the dots.
//                    Dots (kinds 3, 4): for mb = 1 .. 4, [m, n] fp32 as uint16 pairs, each block of 4 rows against
//                    the inputs in groups of mb (the last one smaller), as the expert op calls them.
//                    A NaN (dot or decoded weight) is written as the one quiet NaN: only its payload may differ.
// OUT: "MSHARO01", int64 length + the implementations' names ("<bf16 dot> <int4-q8 dot> <gguf decode>"), then per
// record int64 count + uint16 [count].
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "dense_gemv_core.h"
#include "gguf_codes.h"
#include "moe_interleaved.h"
#include "q4_q8.h"

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

void put_f32(std::vector<uint16_t>& y, float v) {
  const uint32_t u = std::isnan(v) ? 0x7FC00000u : moeserve_csrc::f_to_bits(v);
  y.push_back(static_cast<uint16_t>(u & 0xFFFFu));
  y.push_back(static_cast<uint16_t>(u >> 16));
}

// The dots section of kinds 3 and 4: dots4(block, inputs, count, res) computes one call's [count][4].
template <typename Dots4>
void dots_by_group(std::vector<uint16_t>& y, int64_t m, int64_t n, Dots4&& dots4) {
  std::vector<float> d(static_cast<size_t>(m * n));
  for (int mb = 1; mb <= 4; ++mb) {
    for (int64_t b = 0; b < n / 4; ++b)
      for (int64_t t0 = 0; t0 < m; t0 += mb) {
        const int g = static_cast<int>(std::min<int64_t>(mb, m - t0));
        float res[4][4];
        dots4(b, t0, g, res);
        for (int t = 0; t < g; ++t)
          for (int r = 0; r < 4; ++r) d[(t0 + t) * n + 4 * b + r] = res[t][r];
      }
    for (const float v : d) put_f32(y, v);
  }
}

std::vector<uint16_t> int4_q8(Reader& in) {
  const int64_t m = in.i64(), n = in.i64(), k = in.i64();
  const auto x = in.read<uint16_t>(m * k);
  const auto codes = in.read<uint8_t>(n * k / 2);
  const auto scales = in.read<uint16_t>(n * k / 32);
  const int64_t qb = moeserve_q8::row_bytes(k);
  std::vector<uint8_t> xq(static_cast<size_t>(m * qb));
  for (int64_t t = 0; t < m; ++t) moeserve_q8::quantize_row(x.data() + t * k, k, xq.data() + t * qb);
  std::vector<uint16_t> y(xq.size() / 2);
  std::memcpy(y.data(), xq.data(), xq.size());
  dots_by_group(y, m, n, [&](int64_t b, int64_t t0, int g, float (*res)[4]) {
    const uint8_t* c[4];
    const uint16_t* s[4];
    const uint8_t* q[4];
    for (int r = 0; r < 4; ++r) {
      c[r] = codes.data() + (4 * b + r) * k / 2;
      s[r] = scales.data() + (4 * b + r) * k / 32;
    }
    for (int t = 0; t < g; ++t) q[t] = xq.data() + (t0 + t) * qb;
    moeserve_q8::rows4_dots(c, s, k, q, g, res, t0 == 0);
  });
  return y;
}

std::vector<uint16_t> gguf(Reader& in) {
  const auto type = static_cast<moeserve_q4::GType>(in.i64());
  const int64_t m = in.i64(), n = in.i64(), k = in.i64(), row_bytes = moeserve_q4::gguf_row_bytes(type, k);
  const auto x = in.read<uint16_t>(m * k);
  const auto rows = in.read<uint8_t>(n * row_bytes);
  std::vector<uint16_t> y(static_cast<size_t>(n * k));
  for (int64_t r = 0; r < n; ++r) moeserve_q4::gguf_decode_row({rows.data() + r * row_bytes, type}, k, y.data() + r * k);
  for (uint16_t& w : y)
    if ((w & 0x7FFFu) > 0x7F80u) w = 0x7FC0u;
  dots_by_group(y, m, n, [&](int64_t b, int64_t t0, int g, float (*res)[4]) {
    moeserve_q4::GRow g4[4];
    const uint16_t* xs[4];
    for (int r = 0; r < 4; ++r) g4[r] = {rows.data() + (4 * b + r) * row_bytes, type};
    for (int t = 0; t < g; ++t) xs[t] = x.data() + (t0 + t) * k;
    moeserve_q4::gguf_rows4_dots(g4, k, xs, g, res, t0 == 0);
  });
  return y;
}

std::vector<uint16_t> record(Reader& in, int threads) {
  switch (in.i64()) {
    case 0: return linear(in);
    case 1: return experts(in, threads);
    case 2: return silu_table();
    case 3: return int4_q8(in);
    case 4: return gguf(in);
    default: Reader::fail("bad kind");
  }
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
  const std::string isa = std::string(moeserve_canon::implementation()) + " " + moeserve_q8::implementation() + " " +
                          moeserve_q4::gguf_implementation();
  const int64_t len = static_cast<int64_t>(isa.size());
  std::fwrite("MSHARO01", 1, 8, out);
  std::fwrite(&len, 8, 1, out);
  std::fwrite(isa.data(), 1, isa.size(), out);
  for (int64_t i = 0, records = in.i64(); i < records; ++i) {
    const std::vector<uint16_t> y = record(in, threads);
    const int64_t count = static_cast<int64_t>(y.size());
    std::fwrite(&count, 8, 1, out);
    std::fwrite(y.data(), 2, y.size(), out);
  }
  return std::fclose(out) == 0 ? 0 : 2;
}
