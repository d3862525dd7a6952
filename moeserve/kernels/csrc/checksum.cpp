// unit_checksum: a 32-bit checksum of an expert unit's bytes, made when a unit is first read and checked on every
// later read from a slower tier (moeserve/experts/verify.py), so a changed or corrupted byte on disk becomes a clear
// error instead of a wrong answer.
//
// Definition (the Python reference in tests/experts/test_verify.py computes the same): the buffer is cut into 4
// stripes (3 of floor(n / 32) * 8 bytes, the last one takes the rest); each stripe's CRC-32C (Castagnoli, the iSCSI
// polynomial, initial value and final xor 0xFFFFFFFF) is taken, and the result is the CRC-32C of the 16 bytes of
// the four stripe CRCs, little-endian. Four stripes are four independent dependency chains of the crc32 instruction
// (latency 3, throughput 1), so the hash runs at several times one chain's speed; every single-bit error and every
// burst up to 32 bits within a stripe changes it. SSE4.2 where the CPU has it, a table otherwise (same values).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace moeserve_checksum {

constexpr uint32_t kPoly = 0x82F63B78u;  // CRC-32C, reflected

static const std::array<uint32_t, 256>& table() {
  static const std::array<uint32_t, 256> t = [] {
    std::array<uint32_t, 256> v{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ ((c & 1u) ? kPoly : 0u);
      v[i] = c;
    }
    return v;
  }();
  return t;
}

// Raw CRC update (no initial/final xor) of `n` bytes.
static uint32_t crc_soft(uint32_t c, const uint8_t* p, int64_t n) {
  const auto& t = table();
  for (int64_t i = 0; i < n; ++i) c = t[(c ^ p[i]) & 0xFFu] ^ (c >> 8);
  return c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static void crc4_hw(const uint8_t* const* p, const int64_t* n, uint32_t* c) {
  // The three equal stripes in lockstep, 8 bytes each per round, then each stripe's tail and the last stripe.
  uint64_t c0 = c[0], c1 = c[1], c2 = c[2], c3 = c[3];
  const int64_t words = n[0] / 8;  // stripes 0-2 have the same length, a multiple of 8
  const int64_t last_words = n[3] / 8;
  const int64_t common = std::min(words, last_words);
  for (int64_t i = 0; i < common; ++i) {
    uint64_t w0, w1, w2, w3;
    std::memcpy(&w0, p[0] + 8 * i, 8);
    std::memcpy(&w1, p[1] + 8 * i, 8);
    std::memcpy(&w2, p[2] + 8 * i, 8);
    std::memcpy(&w3, p[3] + 8 * i, 8);
    c0 = _mm_crc32_u64(c0, w0);
    c1 = _mm_crc32_u64(c1, w1);
    c2 = _mm_crc32_u64(c2, w2);
    c3 = _mm_crc32_u64(c3, w3);
  }
  uint64_t* cs[4] = {&c0, &c1, &c2, &c3};
  for (int s = 0; s < 4; ++s) {
    const int64_t w = s < 3 ? words : last_words;
    for (int64_t i = common; i < w; ++i) {
      uint64_t v;
      std::memcpy(&v, p[s] + 8 * i, 8);
      *cs[s] = _mm_crc32_u64(*cs[s], v);
    }
    uint32_t r = static_cast<uint32_t>(*cs[s]);
    for (int64_t i = 8 * w; i < n[s]; ++i) r = _mm_crc32_u8(r, p[s][i]);
    c[s] = r;
  }
}
#endif

// Also bounded by the build's ISA: a generic build (kernels/__init__.py, no SSE4.2) takes the table (same values).
static bool has_sse42() {
#if defined(__x86_64__) && defined(__SSE4_2__)
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
#else
  return false;
#endif
}

int64_t unit_checksum(const at::Tensor& bytes) {
  TORCH_CHECK(bytes.device().is_cpu() && bytes.is_contiguous() && bytes.scalar_type() == at::kByte,
              "unit_checksum: a contiguous CPU uint8 tensor");
  const uint8_t* data = bytes.data_ptr<uint8_t>();
  const int64_t n = bytes.numel();
  const int64_t stripe = (n / 32) * 8;
  const uint8_t* p[4] = {data, data + stripe, data + 2 * stripe, data + 3 * stripe};
  const int64_t len[4] = {stripe, stripe, stripe, n - 3 * stripe};
  uint32_t c[4] = {0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu};
#if defined(__x86_64__)
  if (has_sse42()) {
    crc4_hw(p, len, c);
  } else
#endif
  {
    for (int s = 0; s < 4; ++s) c[s] = crc_soft(c[s], p[s], len[s]);
  }
  uint8_t tail[16];
  for (int s = 0; s < 4; ++s) {
    const uint32_t v = c[s] ^ 0xFFFFFFFFu;
    for (int b = 0; b < 4; ++b) tail[4 * s + b] = static_cast<uint8_t>(v >> (8 * b));
  }
  return static_cast<int64_t>(crc_soft(0xFFFFFFFFu, tail, 16) ^ 0xFFFFFFFFu);
}

int64_t crc32c(const at::Tensor& bytes) {
  TORCH_CHECK(bytes.device().is_cpu() && bytes.is_contiguous() && bytes.scalar_type() == at::kByte,
              "crc32c: a contiguous CPU uint8 tensor");
  return static_cast<int64_t>(crc_soft(0xFFFFFFFFu, bytes.data_ptr<uint8_t>(), bytes.numel()) ^ 0xFFFFFFFFu);
}

}  // namespace moeserve_checksum

TORCH_LIBRARY_FRAGMENT(moeserve, m) {
  m.def("unit_checksum(Tensor bytes) -> int", &moeserve_checksum::unit_checksum);
  m.def("crc32c(Tensor bytes) -> int", &moeserve_checksum::crc32c);
}
