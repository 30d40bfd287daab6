// Argument validation shared by the CPU and CUDA implementations of every op. Each check names
// the argument, what was expected and what was given (SPEC §4 "Bad input").
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>

#include "turboquant/layout.h"
#include "turboquant/preset.h"

namespace turboquant {

using CacheGeometry = PagedCacheGeometry;  // validated view of a kv_cache tensor

struct StoreArgs {
  const Preset* preset;
  SlotLayout layout;
  CacheGeometry cache;
  int64_t num_tokens;
};

struct DecodeArgs {
  const Preset* preset;
  SlotLayout layout;
  CacheGeometry cache;
  int64_t batch, num_q_heads, max_blocks_per_seq;
};

// Preset lookup as a torch error (unknown names list the valid ones).
const Preset& get_preset(const std::string& name);

StoreArgs check_store_kv_args(const at::Tensor& key, const at::Tensor& value,
                              const at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                              const std::string& preset);

DecodeArgs check_decode_args(const at::Tensor& query, const at::Tensor& kv_cache,
                             const at::Tensor& block_table, const at::Tensor& seq_lens,
                             const std::string& preset, int64_t num_splits);

// decode_varlen: query [total_q, Hq, D], query_start_loc int32 [batch + 1] (shape and device only;
// the values are checked by check_query_start_loc_values, a host copy).
DecodeArgs check_decode_varlen_args(const at::Tensor& query, const at::Tensor& kv_cache,
                                    const at::Tensor& block_table, const at::Tensor& seq_lens,
                                    const at::Tensor& query_start_loc, const std::string& preset,
                                    int64_t num_splits);
void check_query_start_loc_values(const at::Tensor& query_start_loc, int64_t total_q);

// The attention options of decode and decode_varlen (turboquant/attention_options.h), checked:
// window_left -1 or >= 0, softcap 0 or a normal float the kernels can scale by log2(e), sinks fp32
// [num_q_heads] on the query's device.
struct AttentionOptions {
  int window = INT_MAX;  // window_span(window_left): INT_MAX for no window
  double softcap = 0.0;  // 0: none
  at::Tensor sinks;      // undefined: none
};
AttentionOptions check_attention_options(const at::Tensor& query, int64_t window_left, double softcap,
                                         const std::optional<at::Tensor>& sinks);

// dequantize has no head_dim argument: it is recovered from the cache's slot size.
DecodeArgs check_dequantize_args(const at::Tensor& kv_cache, const at::Tensor& block_table,
                                 const at::Tensor& seq_lens, const std::string& preset,
                                 at::ScalarType dtype);

// Output buffers of dequantize_into: [batch, L, num_kv_heads, head_dim], contiguous, one float dtype.
void check_dequantize_outputs(const at::Tensor& key_out, const at::Tensor& value_out, const DecodeArgs& a,
                              const at::Tensor& kv_cache);

// Checking mode (TURBOQUANT_CHECK_INDICES=1): copy indices to the host and raise on any entry
// that points outside the cache, instead of the kernels' silent skip/mask.
bool index_checking_enabled();
void check_slot_mapping_in_range(const at::Tensor& slot_mapping, const CacheGeometry& cache);
void check_block_table_in_range(const at::Tensor& block_table, const at::Tensor& seq_lens,
                                const CacheGeometry& cache);

}  // namespace turboquant
