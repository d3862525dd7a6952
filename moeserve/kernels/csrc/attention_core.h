// THE canonical order of moeserve's attention (decode_attention in attention.cpp, mla_attention in mla_attention.cpp):
// every ISA the kernels build for (attention_core.cpp: AVX-512F, AVX2 + FMA, scalar) computes each query row in
// these steps, so the same inputs give the same bits on all of them, whatever the batch, the block size or the
// tiling of rows and keys. One query row = one head's query q [dk] at position pos, keys and values of positions
// lo .. hi-1 (hi = pos + 1; lo = hi - window with a sliding window, else 0), len = hi - lo, j = position - lo.
//
// 1. Scores, in ascending j: s_j = dot(q, k_j) * scale (one fp32 multiply).
//    bf16: canonical_dot.h's order (16 lanes, lane i takes elements 2i + 1 then 2i of each 32-element chunk with
//    VDPBF16PS's DAZ / FTZ semantics, the halving sum), over q and k_j padded with zeros to a multiple of 32.
//    fp32: 16 lanes from +0, lane i = fma(q[16c + i], k[16c + i], lane i) for chunks c in order (the last chunk
//    padded with zeros to 16), then the same halving sum (s8[i] = l[i + 8] + l[i], s4[i] = s8[i + 4] + s8[i],
//    s2[i] = s4[i] + s4[i + 2], s2[0] + s2[1]).
// 2. m = the largest of the s_j (and of the sink logit, gpt-oss): a max, so its order is free.
// 3. e_j = exp_canon(s_j - m); the row sum in 16 lanes from +0, lane i = lane i + e_j for j = i, i + 16, ... in
//    order, then the halving sum, then + exp_canon(sink - m) with a sink. exp_canon(x): zero = x < -87;
//    x = max(x, -87) (MAXPS: a NaN reads as -87); n = nearest-even integer of fp32 (x * 1.44269504088896341f);
//    r = fma(-n, 0.693145751953125f, x); r = fma(-n, 1.428606765330187045e-06f, r); p = 1/5040, then
//    p = fma(p, r, c) for c = 1/720, 1/120, 1/24, 1/6, 1/2, 1, 1 (each c the fp32 constant 1.0f / k); result
//    p * 2^n (exact: x >= -87 keeps it normal), or +0 where zero. (Taylor to degree 7 on |r| <= ln2/2: relative
//    error < 1e-8, below an fp32 ulp.)
// 4. p_j = e_j rounded to the dtype (bf16: nearest-even); fp32 keeps e_j.
// 5. o[i] = fma(p_j, v_j[i], o[i]) from +0 for j ascending, one fma per position (values of the dtype read as fp32);
//    out[i] = o[i] * (1.0f / sum), rounded once to the dtype.
//
// FMA and the adds and multiplies are IEEE fp32 under the caller's MXCSR (the engine never sets FTZ / DAZ); only the
// bf16 score dots have VDPBF16PS's flushes, as canonical_dot.h states. Batch invariance follows: no step of a row
// reads another row, and the tiling (rows of a sequence sharing one pass over a block of keys, heads in register
// tiles) changes which loads are shared, never an operation of a row.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace moeserve_attn {

enum class Dtype { kBF16, kF32 };

// The rows (keys or values) of one kv head in a paged cache: position p at element
// base + table[p / block_size] * block_stride + (p % block_size) * row_stride.
struct PagedRows {
  const void* base;
  const int64_t* table;
  int64_t block_stride, row_stride, block_size;
};

// One kv head's problem: `heads` query heads share its keys [dk] and values [dv] (values may be the first dv
// elements of the key rows: MLA's latent cache).
struct Problem {
  Dtype dtype;
  int64_t dk, dv, heads;
  int64_t q_stride, out_stride;  // elements between one head's query (output) and the next
  float scale;
  const float* sinks;  // [heads] or null
  PagedRows keys, values;
};

// One query row (a token) of the problem: head h's query at q + h * q_stride, its output at out + h * out_stride,
// keys [lo, hi).
struct QueryRow {
  const void* q;
  void* out;
  int64_t lo, hi;
};

// A thread's working memory for attend_rows (it grows as needed; reuse one per thread).
struct Scratch {
  std::vector<float> scores, acc, inv;     // [n, heads, len], [n, heads, dv], [n, heads]
  std::vector<float> qf, kf;               // fp32 queries and key rows, padded with zeros to a multiple of 16
  std::vector<uint16_t> qh, kh;            // bf16 queries and key rows, padded with zeros to a multiple of 32
  std::vector<const void*> krow, vrow;      // the rows of one block of positions
  std::vector<QueryRow> rows;               // for the ops' callers: one tile's rows
};

// Attends rows[0 .. n) (one sequence's rows: the same block table), each in the canonical order above. The rows
// share each pass over a block of keys (prefill: a tile of queries per pass).
void attend_rows(const Problem& pb, const QueryRow* rows, int64_t n, Scratch& scratch);

// out[m][i] = dot(w row i, xs[m]) in the order of step 1 (bf16: canonical_dot.h's, fp32: the 16 fma lanes), rounded
// once to the dtype, for rows i < n of w [n, k] and inputs m < count (MLA's absorbed projections, per head).
void rows_dot(Dtype dtype, const void* w, int64_t n, int64_t k, const void* const* xs, void* const* outs, int64_t count,
              Scratch& scratch);

// A call's rows cut into tiles: runs of consecutive rows of one sequence (seq[i]) at consecutive positions, at most
// max_rows each. {first row, count} per tile.
struct Tile {
  int64_t first, count;
};
std::vector<Tile> tiles_of(const int64_t* seq, const int64_t* pos, int64_t n, int64_t max_rows);

// fn(item, scratch) for item < items, on the ATen threads when `parallel` (items taken one by one from a shared
// counter, so costly and cheap ones balance), each thread with its own Scratch kept between calls (attention.cpp).
void for_each_item(int64_t items, bool parallel, const std::function<void(int64_t, Scratch&)>& fn);

// Which implementation this build compiled: "avx512", "avx2" or "scalar" (the q.k dots: canonical_dot.h's).
const char* implementation();

}  // namespace moeserve_attn
