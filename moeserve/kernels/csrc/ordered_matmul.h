// Small fp32 matrix products in ONE fixed summation order (the chunk forms: gated_delta_chunk.cpp,
// mamba2_chunk.cpp): every output is a sum over the inner index in ascending order, accumulated in registers, with
// the same code for every shape, so a result depends only on its operands, never on the batch, the blocking or the
// thread count (each call runs on one thread).
#pragma once

#include <cstdint>
#include <cstring>

namespace moeserve_csrc {

typedef float v16 __attribute__((vector_size(64)));

static inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

static inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }

// out[r][j0, j0 + 16V) = sum_{p < inner} a[r][p] * b[p][j0, ...) for R rows, p ascending; accumulators in registers.
template <int R, int V>
static void tile(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t inner, float* out, int64_t ldo) {
  v16 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = v16{};
  for (int64_t p = 0; p < inner; ++p) {
    v16 bv[V];
    for (int v = 0; v < V; ++v) bv[v] = load16(b + p * ldb + 16 * v);
    for (int r = 0; r < R; ++r) {
      const float s = a[r * lda + p];
      for (int v = 0; v < V; ++v) acc[r][v] += s * bv[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) store16(out + r * ldo + 16 * v, acc[r][v]);
}

template <int V>
static void column_block(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t rows, int64_t inner,
                         float* out, int64_t ldo) {
  int64_t i = 0;
  for (; i + 4 <= rows; i += 4) tile<4, V>(a + i * lda, lda, b, ldb, inner, out + i * ldo, ldo);
  for (; i < rows; ++i) tile<1, V>(a + i * lda, lda, b, ldb, inner, out + i * ldo, ldo);
}

// out [rows, cols] = a [rows, inner] @ b [inner, cols] (row strides lda, ldb, ldo), each sum over p ascending.
static inline void matmul(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t rows, int64_t inner,
                          int64_t cols, float* out, int64_t ldo) {
  int64_t j = 0;
  for (; j + 64 <= cols; j += 64) column_block<4>(a, lda, b + j, ldb, rows, inner, out + j, ldo);
  for (; j + 16 <= cols; j += 16) column_block<1>(a, lda, b + j, ldb, rows, inner, out + j, ldo);
  for (; j < cols; ++j)
    for (int64_t i = 0; i < rows; ++i) {
      float acc = 0.0f;
      for (int64_t p = 0; p < inner; ++p) acc += a[i * lda + p] * b[p * ldb + j];
      out[i * ldo + j] = acc;
    }
}

}  // namespace moeserve_csrc
