// The expert op of moe_experts_q4.cpp, declared for the decode stack (decode_stack_ffn.cpp), and the spec that says
// how to read its units. Python writes the spec (moeserve/models/experts/fused_spec.py `ExpertOpSpec.encode`), one
// string per model, space-separated key=value words:
//
//   fmt=bf16|mxfp4|nvfp4-ct|nvfp4-mo|int4   the weights: bf16 row-interleaved (canonical_dot.h's block layout), a
//      |gguf|int4-q8                        4-bit format (q4_codes.cpp) or GGUF blocks (gguf_codes.cpp); int4-q8:
//                                            INT4 codes times int8-quantized activations, integer dots (q4_q8.h;
//                                            group 32)
//   group=G                                   elements per scale (4-bit formats)
//   act=swiglu|gptoss|gptoss-split|relu2      the activation (gptoss: clamped SwiGLU on interleaved gate/up rows;
//      alpha=A limit=L                        gptoss-split: on gate rows then up rows, as a GGUF stores them)
//   gu=ROWSxK  dn=ROWSxK                      the two projections [out, in]: gate_up (or up) and down
//   gu.bias=OFF  dn.bias=OFF                  byte offset of a bf16 bias [ROWS] (-1: none)
//   gu.shard=ROWS:CODES:SCALES:TSCALE         one per stored weight, in row order (Qwen's gate then up): byte
//                                            offsets of its codes, group scales and fp32 tensor scale (-1: none)
//   gu.ggml=TYPE[|TYPE...][@OFF]              fmt=gguf, after each shard: its ggml type (q8_0, q4_0, q4_k, q5_k,
//                                            q6_k, mxfp4), or the types its layers store and the byte offset of
//                                            the unit's int32 index into them (a Q4_K_M file's ffn_down_exps)
//
// Offsets are from the data of the projection's first tensor in the unit (the tensor the op is given per expert):
// a unit is one byte buffer (experts/unit.py), so one tensor per projection reaches all of its fields.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "gguf_codes.h"  // GGUF blocks: GType, GRow, gguf_rows4_dots, gguf_decode_row

namespace moeserve_q4 {

// ------------------------------------------------------------------------------ 4-bit codes (q4_codes.cpp)
enum class Fmt { kMxfp4, kNvfp4Div, kNvfp4Mul, kInt4, kGguf, kInt4Q8 };  // kInt4Q8: int8 activations (q4_q8.h)

// One weight row: its codes and the table of each group (16 bf16 values: what each nibble decodes to).
struct QRow {
  const uint8_t* codes;   // K / 2 bytes, element 2j in the low nibble of byte j
  const uint16_t* tab;    // the tables
  const uint8_t* index;   // table of group g = tab + 16 * index[g] (the scale bytes); null: tab + 16 * g
  int64_t group;          // elements per group: 16, or 32 << n (parse_spec checks)
  const uint16_t* table(int64_t g) const { return tab + 16 * (index != nullptr ? index[g] : g); }
  // The tables of chunk c's elements [32c, 32c + 16) and [32c + 16, 32c + 32): a shift, never a division.
  const uint16_t* first(int64_t c) const { return table(group == 16 ? 2 * c : c >> (__builtin_ctzll(group) - 5)); }
  const uint16_t* second(int64_t c) const { return group == 16 ? table(2 * c + 1) : first(c); }
};

const uint16_t* mxfp4_tables();                                              // [256][16] by E8M0 byte
void nvfp4_tables(float tensor_scale, bool divide, uint16_t* out);           // [256][16] by FP8 byte
void int4_tables(const uint16_t* scales, int64_t groups, uint16_t* out);     // [groups][16] by bf16 scale
// res[m][r] = the canonical dot of decoded row r (of 4) with xs[m] (bf16 [k]), m < mb (1..4): 4 rows at once, so
// independent accumulators hide the dot's latency (as canonical_dot.h's block4_dots); the codes fetched ahead by
// hand with `prefetch` (the pass that reads memory).
void rows4_dots(const QRow* rows, int64_t k, const uint16_t* const* xs, int mb, float (*res)[4], bool prefetch);
void decode_row(const QRow& row, int64_t k, uint16_t* w);                    // w[k] = the decoded row (bf16)

// ------------------------------------------------------------------------- the op (moe_experts_q4*.cpp)

enum class Act { kSwiglu, kGptOss, kGptOssSplit, kRelu2 };

struct ShardSpec {
  int64_t rows = 0, codes = 0, scales = -1, tscale = -1;
  // fmt=gguf: the shard's ggml type, or the types its layers store and the byte offset of the unit's int32 index
  // into them (type_at; -1: one type)
  std::vector<GType> types;
  int64_t type_at = -1;
};

struct ProjSpec {
  int64_t rows = 0, k = 0, bias = -1;
  std::vector<ShardSpec> shards;
  int64_t nbytes(bool bf16, Fmt fmt, int64_t group) const;  // bytes from the base pointer the fields reach
};

struct Spec {
  bool bf16 = false;  // fmt=bf16: interleaved bf16 rows, no scales
  Fmt fmt = Fmt::kMxfp4;
  int64_t group = 32;
  Act act = Act::kSwiglu;
  float alpha = 0.0f, limit = 0.0f;
  ProjSpec gu, dn;
  int64_t inter() const { return act == Act::kRelu2 ? gu.rows : gu.rows / 2; }
};

Spec parse_spec(const std::string& text);

// out [N, H] += every expert's output for its tokens times their weights, in ascending expert order (see
// moe_experts_q4.cpp); gate_up[i] / down[i]: expert i's first tensor of each projection.
void run_experts(const Spec& spec, at::Tensor& out, const at::Tensor& x, at::TensorList gate_up, at::TensorList down,
                 const at::Tensor& token_of, const at::Tensor& weight_of, at::IntArrayRef bounds);

}  // namespace moeserve_q4
