// The query rows of an attention op (decode_attention, mla_attention) checked against their block tables once:
// each row's sequence (its block table row), position and first visible key. Defined in attention.cpp.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <optional>
#include <vector>

namespace moeserve_attention {

struct CheckedRows {
  const int64_t* table;  // [sequences, width] block ids
  const int64_t* pos;    // [N]
  int64_t width, window;
  std::vector<int64_t> seq;  // [N] the block table row of each query row
  int64_t longest = 0, work = 0;  // the most keys one row attends; keys attended by all rows together

  int64_t lo(int64_t i) const { return window > 0 ? std::max<int64_t>(0, pos[i] - window + 1) : 0; }
};

// Checks (TORCH_CHECK, messages prefixed by `op`) that every row's table row, position and the blocks of its keys
// [lo, pos] exist: rows [N] gives each row's table row (none: row i uses table row i).
CheckedRows check_rows(const char* op, const at::Tensor& block_tables, const std::optional<at::Tensor>& rows,
                       const at::Tensor& positions, int64_t window, int64_t n, int64_t block_size,
                       int64_t num_blocks);

// Rows per tile of a prefill (one pass over the keys serves them all): 16, fewer where their scores
// ([rows, heads, longest] fp32) would pass 16 MB.
int64_t tile_rows(int64_t heads, int64_t longest);

// Query heads per work item: all `group` heads of a kv head, or fewer where `items` (tiles x kv heads) would not
// keep every thread busy twice over (decode at batch 1; MLA's one latent head for all heads). The bits do not
// depend on it.
int64_t heads_per_item(int64_t items, int64_t group);

}  // namespace moeserve_attention
