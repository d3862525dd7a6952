// The spec of the 4-bit / gpt-oss expert op (moe_experts_q4.h): parsed once per model (the decode stack) or per call
// (the op from Python), checked against the units before any byte is read.

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdlib>
#include <sstream>

#include "moe_experts_q4.h"

namespace moeserve_q4 {

namespace {

int64_t to_int(const std::string& key, const std::string& v) {
  char* end = nullptr;
  const long long n = std::strtoll(v.c_str(), &end, 10);
  TORCH_CHECK(end != v.c_str() && *end == '\0', "expert op spec: ", key, "=", v, " is not an integer");
  return n;
}

float to_float(const std::string& key, const std::string& v) {
  char* end = nullptr;
  const double d = std::strtod(v.c_str(), &end);  // Python writes float.hex(): read exactly
  TORCH_CHECK(end != v.c_str() && *end == '\0', "expert op spec: ", key, "=", v, " is not a number");
  return static_cast<float>(d);
}

// "ROWSxK"
void read_shape(const std::string& key, const std::string& v, ProjSpec& p) {
  const size_t x = v.find('x');
  TORCH_CHECK(x != std::string::npos, "expert op spec: ", key, "=", v, " is not ROWSxK");
  p.rows = to_int(key, v.substr(0, x));
  p.k = to_int(key, v.substr(x + 1));
}

// "ROWS:CODES:SCALES:TSCALE"
ShardSpec read_shard(const std::string& key, const std::string& v) {
  int64_t f[4];
  size_t at = 0;
  for (int i = 0; i < 4; ++i) {
    const size_t end = i < 3 ? v.find(':', at) : v.size();
    TORCH_CHECK(end != std::string::npos, "expert op spec: ", key, "=", v, " is not ROWS:CODES:SCALES:TSCALE");
    f[i] = to_int(key, v.substr(at, end - at));
    at = end + 1;
  }
  return ShardSpec{f[0], f[1], f[2], f[3]};
}

// "TYPE[|TYPE...][@OFF]" of the projection's last shard (fmt=gguf)
void read_ggml(const std::string& key, const std::string& v, ProjSpec& p) {
  TORCH_CHECK(!p.shards.empty(), "expert op spec: ", key, " before any shard");
  ShardSpec& sh = p.shards.back();
  TORCH_CHECK(sh.types.empty(), "expert op spec: two ", key, " words for one shard");
  const size_t at = v.find('@');
  if (at != std::string::npos) sh.type_at = to_int(key, v.substr(at + 1));
  const std::string names = v.substr(0, at);
  for (size_t i = 0; i <= names.size();) {
    const size_t end = std::min(names.find('|', i), names.size());
    const std::string t = names.substr(i, end - i);
    if (t == "q8_0") sh.types.push_back(GType::kQ8_0);
    else if (t == "q4_0") sh.types.push_back(GType::kQ4_0);
    else if (t == "q4_k") sh.types.push_back(GType::kQ4_K);
    else if (t == "q5_k") sh.types.push_back(GType::kQ5_K);
    else if (t == "q6_k") sh.types.push_back(GType::kQ6_K);
    else if (t == "mxfp4") sh.types.push_back(GType::kMxfp4);
    else TORCH_CHECK(false, "expert op spec: unknown ggml type '", t, "' (q8_0, q4_0, q4_k, q5_k, q6_k, mxfp4)");
    i = end + 1;
  }
  TORCH_CHECK((sh.types.size() > 1) == (sh.type_at >= 0), "expert op spec: ", key, "=", v,
              ": several types need the offset of the unit's type index, one type none");
}

void read_format(const std::string& v, Spec& s) {
  if (v == "bf16") s.bf16 = true;
  else if (v == "gguf") s.fmt = Fmt::kGguf;
  else if (v == "mxfp4") s.fmt = Fmt::kMxfp4;
  else if (v == "nvfp4-ct") s.fmt = Fmt::kNvfp4Div;
  else if (v == "nvfp4-mo") s.fmt = Fmt::kNvfp4Mul;
  else if (v == "int4") s.fmt = Fmt::kInt4;
  else if (v == "int4-q8") s.fmt = Fmt::kInt4Q8;
  else TORCH_CHECK(false, "expert op spec: unknown fmt '", v, "' (bf16, mxfp4, nvfp4-ct, nvfp4-mo, int4, gguf, int4-q8)");
}

void read_act(const std::string& v, Spec& s) {
  if (v == "swiglu") s.act = Act::kSwiglu;
  else if (v == "gptoss") s.act = Act::kGptOss;
  else if (v == "gptoss-split") s.act = Act::kGptOssSplit;
  else if (v == "relu2") s.act = Act::kRelu2;
  else TORCH_CHECK(false, "expert op spec: unknown act '", v, "' (swiglu, gptoss, gptoss-split, relu2)");
}

void check_proj(const Spec& s, const ProjSpec& p, const char* name) {
  TORCH_CHECK(p.rows > 0 && p.rows % 4 == 0 && p.k > 0 && p.k % 32 == 0, "expert op spec: ", name, " is ", p.rows,
              "x", p.k, "; rows must be a multiple of 4 and columns of 32");
  TORCH_CHECK(!p.shards.empty(), "expert op spec: ", name, " has no shard");
  int64_t rows = 0;
  const bool gguf = !s.bf16 && s.fmt == Fmt::kGguf;
  for (const ShardSpec& sh : p.shards) {
    TORCH_CHECK(sh.rows > 0 && sh.codes >= 0, "expert op spec: a shard of ", name, " is empty or has no codes");
    if (!s.bf16 && !gguf) TORCH_CHECK(sh.scales >= 0, "expert op spec: a shard of ", name, " has no scales");
    TORCH_CHECK(gguf != sh.types.empty(), "expert op spec: a shard of ", name,
                gguf ? " has no ggml type (fmt=gguf)" : " has a ggml type (not fmt=gguf)");
    for (const GType t : sh.types)
      TORCH_CHECK(p.k % gguf_block_elems(t) == 0, "expert op spec: ", name, " rows of ", p.k,
                  " values do not hold whole ", gguf_block_elems(t), "-value blocks");
    rows += sh.rows;
  }
  TORCH_CHECK(rows == p.rows, "expert op spec: the shards of ", name, " hold ", rows, " rows, not ", p.rows);
  if (s.bf16) TORCH_CHECK(p.shards.size() == 1, "expert op spec: bf16 ", name, " is one interleaved matrix");
  if (!s.bf16 && (s.fmt == Fmt::kNvfp4Div || s.fmt == Fmt::kNvfp4Mul))
    for (const ShardSpec& sh : p.shards) TORCH_CHECK(sh.tscale >= 0, "expert op spec: NVFP4 needs a tensor scale");
  if (!s.bf16 && !gguf) TORCH_CHECK(p.k % s.group == 0, "expert op spec: ", name, " columns ", p.k, " % group ", s.group);
}

}  // namespace

int64_t ProjSpec::nbytes(bool bf16, Fmt fmt, int64_t group) const {
  int64_t end = bias >= 0 ? bias + 2 * rows : 0;
  const int64_t scale_bytes = fmt == Fmt::kInt4 || fmt == Fmt::kInt4Q8 ? 2 : 1;
  for (const ShardSpec& sh : shards) {
    if (!bf16 && fmt == Fmt::kGguf) {
      for (const GType t : sh.types) end = std::max(end, sh.codes + sh.rows * gguf_row_bytes(t, k));
      if (sh.type_at >= 0) end = std::max(end, sh.type_at + 4);
      continue;
    }
    end = std::max(end, sh.codes + (bf16 ? 2 * sh.rows * k : sh.rows * k / 2));
    if (!bf16) end = std::max(end, sh.scales + sh.rows * (k / group) * scale_bytes);
    if (sh.tscale >= 0) end = std::max(end, sh.tscale + 4);
  }
  return end;
}

Spec parse_spec(const std::string& text) {
  Spec s;
  std::istringstream in(text);
  std::string word;
  while (in >> word) {
    const size_t eq = word.find('=');
    TORCH_CHECK(eq != std::string::npos, "expert op spec: '", word, "' is not key=value");
    const std::string key = word.substr(0, eq), v = word.substr(eq + 1);
    if (key == "fmt") read_format(v, s);
    else if (key == "group") s.group = to_int(key, v);
    else if (key == "act") read_act(v, s);
    else if (key == "alpha") s.alpha = to_float(key, v);
    else if (key == "limit") s.limit = to_float(key, v);
    else if (key == "gu") read_shape(key, v, s.gu);
    else if (key == "dn") read_shape(key, v, s.dn);
    else if (key == "gu.bias") s.gu.bias = to_int(key, v);
    else if (key == "dn.bias") s.dn.bias = to_int(key, v);
    else if (key == "gu.shard") s.gu.shards.push_back(read_shard(key, v));
    else if (key == "dn.shard") s.dn.shards.push_back(read_shard(key, v));
    else if (key == "gu.ggml") read_ggml(key, v, s.gu);
    else if (key == "dn.ggml") read_ggml(key, v, s.dn);
    else TORCH_CHECK(false, "expert op spec: unknown key '", key, "'");
  }
  TORCH_CHECK(s.bf16 || s.group == 16 || (s.group >= 32 && (s.group & (s.group - 1)) == 0),
              "expert op spec: group ", s.group, " (16, or 32 times a power of two)");
  TORCH_CHECK(s.bf16 || s.fmt != Fmt::kMxfp4 || s.group == 32, "expert op spec: MXFP4 groups are 32");
  TORCH_CHECK(s.bf16 || s.fmt != Fmt::kInt4Q8 || s.group == 32, "expert op spec: int4-q8 groups are 32");
  TORCH_CHECK(s.bf16 || (s.fmt != Fmt::kNvfp4Div && s.fmt != Fmt::kNvfp4Mul) || s.group == 16,
              "expert op spec: NVFP4 groups are 16");
  check_proj(s, s.gu, "gu");
  check_proj(s, s.dn, "dn");
  TORCH_CHECK(s.act == Act::kRelu2 || s.gu.rows % 2 == 0, "expert op spec: gate_up has 2I rows");
  TORCH_CHECK(s.dn.k == s.inter() && s.gu.k == s.dn.rows, "expert op spec: gu ", s.gu.rows, "x", s.gu.k, " and dn ",
              s.dn.rows, "x", s.dn.k, " do not chain");
  return s;
}

}  // namespace moeserve_q4
