// Implementation of the shared argument checks.
#include "op_checks.h"

#include "error_message.h"
#include "turboquant/attention_options.h"
#include "turboquant/split_plan.h"

#include <climits>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <optional>
#include <stdexcept>

namespace turboquant {
namespace {

bool is_float_dtype(at::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat;
}

bool is_supported_block_size(int64_t b) { return b == 16 || b == 32 || b == 64 || b == 128; }

CacheGeometry check_kv_cache(const at::Tensor& kv_cache, const SlotLayout& layout,
                             const Preset& preset) {
  TQ_CHECK(kv_cache.scalar_type() == at::kByte, "turboquant: kv_cache must be uint8, got ",
              kv_cache.scalar_type());
  TQ_CHECK(kv_cache.dim() == 4,
              "turboquant: kv_cache must be 4-D [num_blocks, block_size, num_kv_heads, slot], got "
              "shape ",
              kv_cache.sizes());
  TQ_CHECK(kv_cache.size(3) == layout.slot_size_aligned, "turboquant: kv_cache last dim must be ",
              layout.slot_size_aligned, " bytes (preset ", preset.name, ", head_dim ",
              layout.head_dim, "), got ", kv_cache.size(3));
  TQ_CHECK(kv_cache.stride(3) == 1, "turboquant: kv_cache slots must be contiguous (stride(3) == 1), got stride ",
              kv_cache.stride(3));
  TQ_CHECK(is_supported_block_size(kv_cache.size(1)),
              "turboquant: kv_cache block_size (dim 1) must be 16, 32, 64 or 128, got ",
              kv_cache.size(1));
  for (int d = 0; d < 3; ++d) {
    TQ_CHECK(kv_cache.stride(d) >= 0 && kv_cache.stride(d) % 2 == 0,
                "turboquant: kv_cache stride(", d, ") must be even and non-negative, got ",
                kv_cache.stride(d));
  }
  CacheGeometry g;
  g.num_blocks = kv_cache.size(0);
  g.block_size = static_cast<int32_t>(kv_cache.size(1));
  g.num_kv_heads = static_cast<int32_t>(kv_cache.size(2));
  g.slot_bytes = kv_cache.size(3);
  g.stride_block = kv_cache.stride(0);
  g.stride_token = kv_cache.stride(1);
  g.stride_head = kv_cache.stride(2);
  g.span_bytes = kv_cache.numel() == 0 ? 0
                                        : (g.num_blocks - 1) * g.stride_block +
                                              (g.block_size - 1) * g.stride_token +
                                              (g.num_kv_heads - 1) * g.stride_head + g.slot_bytes;
  return g;
}

void check_index_tensor(const at::Tensor& t, const char* name, int dim, bool allow_int64) {
  TQ_CHECK(t.scalar_type() == at::kInt || (allow_int64 && t.scalar_type() == at::kLong),
              "turboquant: ", name, " must be int32", allow_int64 ? " or int64" : "", ", got ",
              t.scalar_type());
  TQ_CHECK(t.dim() == dim, "turboquant: ", name, " must be ", dim, "-D, got shape ", t.sizes());
  TQ_CHECK(t.is_contiguous(), "turboquant: ", name, " must be contiguous");
}

void check_same_device(const at::Tensor& a, const char* an, const at::Tensor& b, const char* bn) {
  TQ_CHECK(a.device() == b.device(), "turboquant: ", an, " and ", bn,
              " must be on the same device, got ", a.device(), " and ", b.device());
}

}  // namespace

const Preset& get_preset(const std::string& name) {
  try {
    return parse_preset(name);
  } catch (const std::invalid_argument& e) {
    TQ_CHECK(false, e.what());
  }
}

static SlotLayout layout_or_throw(const Preset& p, int64_t head_dim) {
  try {
    return slot_layout(p, static_cast<int>(head_dim));
  } catch (const std::invalid_argument& e) {
    TQ_CHECK(false, e.what());
  }
}

StoreArgs check_store_kv_args(const at::Tensor& key, const at::Tensor& value,
                              const at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                              const std::string& preset) {
  StoreArgs a;
  a.preset = &get_preset(preset);
  TQ_CHECK(key.dim() == 3, "turboquant: key must be 3-D [num_tokens, num_kv_heads, head_dim], got shape ",
              key.sizes());
  TQ_CHECK(value.sizes() == key.sizes(), "turboquant: value must have key's shape ", key.sizes(),
              ", got ", value.sizes());
  TQ_CHECK(is_float_dtype(key.scalar_type()),
              "turboquant: key must be float16, bfloat16 or float32, got ", key.scalar_type());
  TQ_CHECK(value.scalar_type() == key.scalar_type(), "turboquant: value dtype must match key (",
              key.scalar_type(), "), got ", value.scalar_type());
  TQ_CHECK(key.is_contiguous() && value.is_contiguous(),
              "turboquant: key and value must be contiguous");
  a.layout = layout_or_throw(*a.preset, key.size(2));
  a.cache = check_kv_cache(kv_cache, a.layout, *a.preset);
  TQ_CHECK(key.size(1) == a.cache.num_kv_heads, "turboquant: key has ", key.size(1),
              " KV heads but kv_cache has ", a.cache.num_kv_heads);
  check_index_tensor(slot_mapping, "slot_mapping", 1, /*allow_int64=*/true);
  TQ_CHECK(slot_mapping.size(0) == key.size(0), "turboquant: slot_mapping must have ",
              key.size(0), " entries (one per token), got ", slot_mapping.size(0));
  check_same_device(key, "key", value, "value");
  check_same_device(key, "key", kv_cache, "kv_cache");
  check_same_device(key, "key", slot_mapping, "slot_mapping");
  a.num_tokens = key.size(0);
  return a;
}

// expected_batch: the sequences the other arguments imply, or none where the block table's rows say it
// (dequantize), read once its rank is checked.
static void check_block_table_and_seq_lens(const at::Tensor& block_table, const at::Tensor& seq_lens,
                                           std::optional<int64_t> expected_batch, int64_t block_size) {
  check_index_tensor(block_table, "block_table", 2, /*allow_int64=*/false);
  check_index_tensor(seq_lens, "seq_lens", 1, /*allow_int64=*/false);
  const int64_t batch = expected_batch.value_or(block_table.size(0));
  TQ_CHECK(block_table.size(0) == batch, "turboquant: block_table must have ", batch,
              " rows (batch), got ", block_table.size(0));
  TQ_CHECK(seq_lens.size(0) == batch, "turboquant: seq_lens must have ", batch,
              " entries (batch), got ", seq_lens.size(0));
  // Token positions are int32 like seq_lens: the kernels clamp lengths to this capacity and split
  // them (split_token_range: a split's end is at most the length plus 16 tokens per split) in 32
  // bits, so 2^30 tokens leave the headroom (2^31 - 1 wrapped; near it 256 splits came out empty).
  TQ_CHECK(block_table.size(1) * block_size <= (int64_t{1} << 30),
           "turboquant: block_table covers at most 2^30 tokens per sequence; got ", block_table.size(1),
           " blocks of ", block_size, " tokens");
}

// Query, cache, block table and lengths of a decode: one query row per sequence, or, with
// query_start_loc (varlen), batch = its length - 1 sequences over the query's rows.
static DecodeArgs check_decode_common(const at::Tensor& query, const at::Tensor& kv_cache,
                                      const at::Tensor& block_table, const at::Tensor& seq_lens,
                                      const at::Tensor* query_start_loc, const std::string& preset,
                                      int64_t num_splits) {
  DecodeArgs a;
  a.preset = &get_preset(preset);
  TQ_CHECK(query.dim() == 3, "turboquant: query must be 3-D ",
              query_start_loc ? "[total_q, num_q_heads, head_dim]" : "[batch, num_q_heads, head_dim]",
              ", got shape ", query.sizes());
  TQ_CHECK(is_float_dtype(query.scalar_type()),
              "turboquant: query must be float16, bfloat16 or float32, got ", query.scalar_type());
  TQ_CHECK(query.is_contiguous(), "turboquant: query must be contiguous");
  a.layout = layout_or_throw(*a.preset, query.size(2));
  a.cache = check_kv_cache(kv_cache, a.layout, *a.preset);
  TQ_CHECK(a.cache.num_kv_heads > 0 && query.size(1) > 0 && query.size(1) % a.cache.num_kv_heads == 0,
              "turboquant: query heads (", query.size(1),
              ") must be a positive multiple of kv_cache heads (", a.cache.num_kv_heads, ")");
  a.batch = query.size(0);
  if (query_start_loc != nullptr) {
    check_index_tensor(*query_start_loc, "query_start_loc", 1, /*allow_int64=*/false);
    TQ_CHECK(query_start_loc->size(0) >= 1, "turboquant: query_start_loc must have batch + 1 >= 1 entries, got 0");
    check_same_device(query, "query", *query_start_loc, "query_start_loc");
    a.batch = query_start_loc->size(0) - 1;
  }
  check_block_table_and_seq_lens(block_table, seq_lens, a.batch, a.cache.block_size);
  TQ_CHECK(num_splits >= 0 && num_splits <= kMaxDecodeSplits, "turboquant: num_splits must be in [0, ",
           kMaxDecodeSplits, "] (0 = the library chooses), got ", num_splits);
  check_same_device(query, "query", kv_cache, "kv_cache");
  check_same_device(query, "query", block_table, "block_table");
  check_same_device(query, "query", seq_lens, "seq_lens");
  a.num_q_heads = query.size(1);
  a.max_blocks_per_seq = block_table.size(1);
  return a;
}

DecodeArgs check_decode_args(const at::Tensor& query, const at::Tensor& kv_cache,
                             const at::Tensor& block_table, const at::Tensor& seq_lens,
                             const std::string& preset, int64_t num_splits) {
  return check_decode_common(query, kv_cache, block_table, seq_lens, nullptr, preset, num_splits);
}

DecodeArgs check_decode_varlen_args(const at::Tensor& query, const at::Tensor& kv_cache,
                                    const at::Tensor& block_table, const at::Tensor& seq_lens,
                                    const at::Tensor& query_start_loc, const std::string& preset,
                                    int64_t num_splits) {
  return check_decode_common(query, kv_cache, block_table, seq_lens, &query_start_loc, preset, num_splits);
}

AttentionOptions check_attention_options(const at::Tensor& query, int64_t window_left, double softcap,
                                         const std::optional<at::Tensor>& sinks) {
  TQ_CHECK(window_left >= -1 && window_left <= INT_MAX - 1,
           "turboquant: window_left must be -1 (no window) or a number of tokens >= 0, got ", window_left);
  // The CUDA kernels take the cap as a float times log2(e): a cap that rounds to 0 or overflows
  // there would silently differ from the CPU's double.
  constexpr double kMaxSoftcap = std::numeric_limits<float>::max() / 2.0;
  TQ_CHECK(softcap == 0.0 || (softcap >= std::numeric_limits<float>::min() && softcap <= kMaxSoftcap),
           "turboquant: softcap must be 0 (no soft-capping) or a finite number in [1.2e-38, 1.7e38], got ", softcap);
  AttentionOptions o;
  o.window = window_span(static_cast<int>(window_left));
  o.softcap = softcap;
  if (sinks.has_value() && sinks->defined()) {
    const at::Tensor& s = *sinks;
    TQ_CHECK(s.scalar_type() == at::kFloat, "turboquant: sinks must be float32, got ", s.scalar_type());
    TQ_CHECK(s.dim() == 1 && s.size(0) == query.size(1), "turboquant: sinks must be 1-D [num_q_heads] = [",
             query.size(1), "], got shape ", s.sizes());
    TQ_CHECK(s.is_contiguous(), "turboquant: sinks must be contiguous");
    check_same_device(query, "query", s, "sinks");
    o.sinks = s;
  }
  return o;
}

void check_query_start_loc_values(const at::Tensor& query_start_loc, int64_t total_q) {
  const at::Tensor s = query_start_loc.to(at::kCPU);
  const int32_t* p = s.data_ptr<int32_t>();
  const int64_t n = s.numel();
  TQ_CHECK(p[0] >= 0, "turboquant: query_start_loc[0] must be >= 0, got ", p[0]);
  for (int64_t i = 1; i < n; ++i) {
    TQ_CHECK(p[i] >= p[i - 1], "turboquant: query_start_loc must be non-decreasing, got query_start_loc[", i,
                "] = ", p[i], " < query_start_loc[", i - 1, "] = ", p[i - 1]);
  }
  TQ_CHECK(p[n - 1] <= total_q, "turboquant: query_start_loc[", n - 1, "] = ", p[n - 1],
              " is past the query's ", total_q, " rows");
}

DecodeArgs check_dequantize_args(const at::Tensor& kv_cache, const at::Tensor& block_table,
                                 const at::Tensor& seq_lens, const std::string& preset,
                                 at::ScalarType dtype) {
  DecodeArgs a;
  a.preset = &get_preset(preset);
  TQ_CHECK(is_float_dtype(dtype), "turboquant: dtype must be float16, bfloat16 or float32, got ",
              dtype);
  TQ_CHECK(kv_cache.dim() == 4, "turboquant: kv_cache must be 4-D [num_blocks, block_size, num_kv_heads, slot], got shape ",
              kv_cache.sizes());
  int64_t head_dim = -1;
  for (int d = 8; d <= kMaxHeadDim; d += 8) {
    const SlotLayout l = make_slot_layout(d, a.preset->key_format, a.preset->key_bits,
                                          a.preset->value_bits);
    if (l.slot_size_aligned == kv_cache.size(3)) head_dim = d;
  }
  TQ_CHECK(head_dim > 0, "turboquant: kv_cache slot size ", kv_cache.size(3),
              " bytes matches no head_dim for preset ", a.preset->name);
  a.layout = layout_or_throw(*a.preset, head_dim);
  a.cache = check_kv_cache(kv_cache, a.layout, *a.preset);
  check_block_table_and_seq_lens(block_table, seq_lens, std::nullopt, a.cache.block_size);
  check_same_device(kv_cache, "kv_cache", block_table, "block_table");
  check_same_device(kv_cache, "kv_cache", seq_lens, "seq_lens");
  a.batch = block_table.size(0);
  a.num_q_heads = 0;
  a.max_blocks_per_seq = block_table.size(1);
  return a;
}

void check_dequantize_outputs(const at::Tensor& key_out, const at::Tensor& value_out, const DecodeArgs& a,
                              const at::Tensor& kv_cache) {
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{key_out, "key_out"},
                                std::pair<const at::Tensor&, const char*>{value_out, "value_out"}}) {
    TQ_CHECK(t.dim() == 4 && t.size(0) == a.batch && t.size(2) == a.cache.num_kv_heads &&
                    t.size(3) == a.layout.head_dim,
                "turboquant: ", name, " must be [", a.batch, ", L, ", a.cache.num_kv_heads, ", ", a.layout.head_dim,
                "], got shape ", t.sizes());
    TQ_CHECK(is_float_dtype(t.scalar_type()), "turboquant: ", name,
                " must be float16, bfloat16 or float32, got ", t.scalar_type());
    TQ_CHECK(t.is_contiguous(), "turboquant: ", name, " must be contiguous");
    check_same_device(t, name, kv_cache, "kv_cache");
  }
  TQ_CHECK(key_out.sizes() == value_out.sizes() && key_out.scalar_type() == value_out.scalar_type(),
              "turboquant: key_out and value_out must have the same shape and dtype");
}

bool index_checking_enabled() {
  const char* v = std::getenv("TURBOQUANT_CHECK_INDICES");
  return v != nullptr && v[0] != '\0' && v[0] != '0';
}

void check_slot_mapping_in_range(const at::Tensor& slot_mapping, const CacheGeometry& cache) {
  const at::Tensor s = slot_mapping.to(at::kCPU, at::kLong);
  const int64_t capacity = cache.num_blocks * cache.block_size;
  const int64_t* p = s.data_ptr<int64_t>();
  for (int64_t i = 0; i < s.numel(); ++i) {
    TQ_CHECK(p[i] < capacity, "turboquant: slot_mapping[", i, "] = ", p[i],
                " is outside the cache (", capacity, " slots = ", cache.num_blocks, " blocks x ",
                cache.block_size, ")");
  }
}

void check_block_table_in_range(const at::Tensor& block_table, const at::Tensor& seq_lens,
                                const CacheGeometry& cache) {
  const at::Tensor bt = block_table.to(at::kCPU);
  const at::Tensor sl = seq_lens.to(at::kCPU);
  const int64_t batch = bt.size(0), width = bt.size(1);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = sl.data_ptr<int32_t>()[b];
    TQ_CHECK(len >= 0 && len <= width * cache.block_size, "turboquant: seq_lens[", b, "] = ", len,
                " is outside [0, ", width * cache.block_size, "] (block_table width ", width,
                " x block_size ", cache.block_size, ")");
    const int64_t used = (len + cache.block_size - 1) / cache.block_size;
    for (int64_t j = 0; j < used; ++j) {
      const int32_t blk = bt.data_ptr<int32_t>()[b * width + j];
      TQ_CHECK(blk >= 0 && blk < cache.num_blocks, "turboquant: block_table[", b, ", ", j,
                  "] = ", blk, " is outside [0, ", cache.num_blocks, ")");
    }
  }
}

}  // namespace turboquant
