// GGUF's quantized blocks read as stored (gguf_codes.cpp), declared without ATen: the expert op (moe_experts_q4.h)
// and the aarch64 harness (tests/kernels/harness/), which builds gguf_codes.cpp alone for any ISA, use these.
#pragma once

#include <cstdint>

namespace moeserve_q4 {

enum class GType { kQ8_0, kQ4_0, kQ4_K, kQ5_K, kQ6_K, kMxfp4 };

// One weight row of a GGUF type: its blocks as stored.
struct GRow {
  const uint8_t* bytes;
  GType type;
};

int64_t gguf_row_bytes(GType t, int64_t k);  // bytes of a row of k values
int64_t gguf_block_elems(GType t);           // values per block: 32 or 256
// res[m][r] = the canonical dot of decoded row r (of 4 consecutive rows of one tensor, one type) with xs[m] (bf16
// [k]), m < mb (1..4); `prefetch`: fetch the next 4 rows by hand (the pass that reads memory).
void gguf_rows4_dots(const GRow* rows, int64_t k, const uint16_t* const* xs, int mb, float (*res)[4], bool prefetch);
void gguf_decode_row(const GRow& row, int64_t k, uint16_t* w);  // w[k] = the decoded row (bf16)
// How this build decodes the blocks: "avx512bf16" (in registers, vdpbf16ps), "neon" (NEON into a 4-row block, then
// canonical_dot.h's dots) or "scalar" (the scalar reference into the block, then canonical_dot.h's dots).
const char* gguf_implementation();

}  // namespace moeserve_q4
