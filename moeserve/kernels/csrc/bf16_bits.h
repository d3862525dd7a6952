// bf16 <-> fp32 bits without ATen: used by the ops (through norm_common.h) and by the plain-C++ numeric cores
// (canonical_dot.h, dense_gemv_core.h, moe_interleaved.h) that the aarch64 harness builds without torch.
#pragma once

#include <cstdint>
#include <cstring>

namespace moeserve_csrc {

inline float bits_to_f(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint32_t f_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// float -> bf16 bits, round to nearest even; NaN stays a (quiet) NaN. Same result as c10::BFloat16(float).
inline uint16_t bf16_bits(float f) {
  const uint32_t u = f_to_bits(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(rounded);
}

}  // namespace moeserve_csrc
