// CPU implementations of the ops: the reference the CUDA kernels are tested against, and the
// fallback. Same split-KV structure and merge as the CUDA decode, in float/double arithmetic.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "kv_transform.h"
#include "op_checks.h"
#include "turboquant/attention_options.h"
#include "turboquant/hadamard_transform.h"
#include "turboquant/lloyd_max.h"
#include "turboquant/query_chunks.h"
#include "turboquant/slot_codec.h"
#include "turboquant/split_plan.h"

namespace turboquant {
namespace {

// fp32 results -> the output dtype. fp16 outputs saturate finite values past their range with
// the rule the CUDA kernels use (clamp_to_half_range); inf and NaN pass through.
at::Tensor to_output_dtype(at::Tensor f32, at::ScalarType dtype) {
  if (dtype == at::kHalf) {
    f32 = f32.contiguous();
    float* p = f32.data_ptr<float>();
    at::parallel_for(0, f32.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) p[i] = clamp_to_half_range(p[i]);
    });
  }
  return f32.to(dtype);
}

const Codebook* key_codebook(const Preset& p, int head_dim) {
  return p.key_format == KeyFormat::kLloydMax ? &gaussian_codebook(p.key_bits, head_dim) : nullptr;
}

int64_t slot_offset(const CacheGeometry& g, int64_t block, int64_t offset, int64_t head) {
  return block * g.stride_block + offset * g.stride_token + head * g.stride_head;
}

// Byte offset of token `t` of sequence row `bt_row`, or -1 when its block-table entry points
// outside the cache (the token is then skipped).
int64_t token_slot_base(const CacheGeometry& g, const int32_t* bt_row, int64_t t) {
  const int64_t block = bt_row[t / g.block_size];
  if (block < 0 || block >= g.num_blocks) return -1;
  return slot_offset(g, block, t % g.block_size, 0);
}

template <typename T>
std::vector<float> to_float(const T* p, int n) {
  std::vector<float> out(n);
  for (int i = 0; i < n; ++i) out[i] = static_cast<float>(p[i]);
  return out;
}

void store_kv_cpu(const at::Tensor& key_in, const at::Tensor& value_in, at::Tensor& kv_cache,
                  const at::Tensor& slot_mapping, c10::string_view preset, const std::optional<at::Tensor>& key_offset,
                  const std::optional<at::Tensor>& key_scale, const std::optional<at::Tensor>& value_offset) {
  const StoreArgs a = check_store_kv_args(key_in, value_in, kv_cache, slot_mapping, std::string(preset));
  const KVTransformArgs transform = check_kv_transform(key_offset, key_scale, value_offset, a.cache.num_kv_heads,
                                                       a.layout.head_dim, kv_cache.device());
  if (index_checking_enabled()) check_slot_mapping_in_range(slot_mapping, a.cache);
  at::Tensor key = key_in, value = value_in;
  if (transform.any()) std::tie(key, value) = transformed_kv(key_in, value_in, transform);
  const at::Tensor slots = slot_mapping.to(at::kLong);
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
  const int d = a.layout.head_dim;
  const int64_t heads = a.cache.num_kv_heads;
  const int64_t capacity = a.cache.num_blocks * a.cache.block_size;
  const Codebook* cb = key_codebook(*a.preset, d);
  uint8_t* cache = kv_cache.data_ptr<uint8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, key.scalar_type(), "store_kv_cpu", [&] {
    const scalar_t* k = key.data_ptr<scalar_t>();
    const scalar_t* v = value.data_ptr<scalar_t>();
    at::parallel_for(0, a.num_tokens, 16, [&](int64_t begin, int64_t end) {
      std::vector<uint8_t> slot(a.layout.slot_size_aligned, 0);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t s = slot_ptr[i];
        if (s < 0 || s >= capacity) continue;  // padding or out of range: write nothing
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t src = (i * heads + h) * d;
          const std::vector<float> kf = to_float(k + src, d), vf = to_float(v + src, d);
          encode_slot(kf.data(), vf.data(), a.layout, cb, a.preset->norm_correction, slot.data());
          const int64_t dst =
              slot_offset(a.cache, s / a.cache.block_size, s % a.cache.block_size, h);
          std::memcpy(cache + dst, slot.data(), a.layout.slot_size_aligned);
        }
      }
    });
  });
}

// Online-softmax state of one query head over one split, in double.
struct Partial {
  double max = -std::numeric_limits<double>::infinity();
  double sum = 0.0;
  std::vector<double> acc;
};

// The decode of checked arguments: one query row per block-table row and length (a.batch of them).
// Each row reads the positions its window leaves it (all of [0, seq_len) without one), split into
// `splits` ranges; soft-capping applies to each score, and the sinks join the merge as one more
// partial result per head, of log-sum-exp `sink` and no value. Returns the output and each (row,
// head)'s log-sum-exp of its scores (natural log, fp32; -inf where it attends to nothing).
std::tuple<at::Tensor, at::Tensor> run_decode_cpu(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
                          const at::Tensor& seq_lens, const DecodeArgs& a, double scale, int64_t num_splits,
                          const AttentionOptions& options) {
  const int d = a.layout.head_dim;
  const int64_t hkv = a.cache.num_kv_heads, group = a.num_q_heads / hkv;
  const int64_t max_context = a.max_blocks_per_seq * a.cache.block_size;
  const int read_context = windowed_context(static_cast<int>(max_context), options.window, 1);
  const int splits = num_splits > 0 ? static_cast<int>(num_splits)
                                    : default_num_splits(static_cast<int>(a.batch),
                                                         static_cast<int>(hkv), read_context,
                                                         /*resident_ctas=*/32);
  const Codebook* cb = key_codebook(*a.preset, d);
  const bool rotated = a.preset->key_format == KeyFormat::kLloydMax;
  const float rsqrt_d = 1.0f / std::sqrt(static_cast<float>(d));

  const at::Tensor q = query.to(at::kFloat);
  const float* qp = q.data_ptr<float>();
  const uint8_t* cache = kv_cache.data_ptr<uint8_t>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  // Workspace as the CUDA path lays it out: per-split normalized outputs and log-sum-exp.
  at::Tensor partial_out = at::zeros({a.batch, a.num_q_heads, splits, d}, q.options());
  at::Tensor partial_lse = at::full({a.batch, a.num_q_heads, splits},
                                    -std::numeric_limits<float>::infinity(), q.options());
  float* po = partial_out.data_ptr<float>();
  float* pl = partial_lse.data_ptr<float>();

  at::parallel_for(0, a.batch * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> key(d), val(d);
    std::vector<std::vector<float>> qr(group, std::vector<float>(d));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / hkv, kvh = item % hkv;
      const int seq_len = static_cast<int>(std::clamp<int64_t>(lens[b], 0, max_context));
      const int first = first_attended_position(seq_len, options.window);
      for (int64_t g = 0; g < group; ++g) {
        const float* src = qp + (b * a.num_q_heads + kvh * group + g) * d;
        std::copy(src, src + d, qr[g].begin());
        if (rotated) {  // q . k~ = norm * (R q) . c~ : rotate q once, never the keys
          hadamard_transform_inplace(qr[g].data(), d);
          for (float& x : qr[g]) x *= rsqrt_d;
        }
      }
      for (int s = 0; s < splits; ++s) {
        const TokenRange r = split_token_range(seq_len - first, splits, s);
        std::vector<Partial> part(group);
        for (auto& p : part) p.acc.assign(d, 0.0);
        for (int t = first + r.begin; t < first + r.end; ++t) {
          const int64_t base = token_slot_base(a.cache, bt + b * a.max_blocks_per_seq, t);
          if (base < 0) continue;
          const uint8_t* slot = cache + base + kvh * a.cache.stride_head;
          decode_key_rotated(slot, a.layout, cb, key.data());
          decode_value(slot, a.layout, val.data());
          for (int64_t g = 0; g < group; ++g) {
            double dot = 0.0;
            for (int i = 0; i < d; ++i) dot += static_cast<double>(qr[g][i]) * key[i];
            const double score = softcap_logit(scale * dot, options.softcap);
            Partial& p = part[g];
            const double m = std::max(p.max, score);
            const double alpha = std::exp(p.max - m), w = std::exp(score - m);
            p.sum = p.sum * alpha + w;
            for (int i = 0; i < d; ++i) p.acc[i] = p.acc[i] * alpha + w * val[i];
            p.max = m;
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          const int64_t row = (b * a.num_q_heads + kvh * group + g) * splits + s;
          if (part[g].sum <= 0.0) continue;  // empty split: lse -inf, output 0
          pl[row] = static_cast<float>(part[g].max + std::log(part[g].sum));
          for (int i = 0; i < d; ++i) po[row * d + i] = static_cast<float>(part[g].acc[i] / part[g].sum);
        }
      }
    }
  });

  if (options.sinks.defined()) {  // one more partial per head: log-sum-exp sink, output 0
    at::Tensor sink_lse = options.sinks.view({1, a.num_q_heads, 1}).expand({a.batch, a.num_q_heads, 1});
    partial_lse = at::cat({partial_lse, sink_lse}, 2);
    partial_out = at::cat({partial_out, at::zeros({a.batch, a.num_q_heads, 1, d}, q.options())}, 2);
  }
  // Log-sum-exp merge of the splits; a sequence with no tokens (and no sink) gives zeros.
  at::Tensor lse_max = std::get<0>(partial_lse.max(/*dim=*/2, /*keepdim=*/true));
  at::Tensor finite_max = at::where(at::isinf(lse_max), at::zeros_like(lse_max), lse_max);
  at::Tensor weights = at::exp(partial_lse - finite_max);  // exp(-inf) = 0 for empty splits
  at::Tensor denom = weights.sum(2, /*keepdim=*/true).clamp_min(1e-30);
  at::Tensor out = (partial_out * (weights / denom).unsqueeze(-1)).sum(2);
  return {to_output_dtype(out, query.scalar_type()), at::logsumexp(partial_lse, 2)};
}

std::tuple<at::Tensor, at::Tensor> decode_lse_cpu(const at::Tensor& query, const at::Tensor& kv_cache,
                                                  const at::Tensor& block_table, const at::Tensor& seq_lens,
                                                  c10::string_view preset, double scale, int64_t num_splits,
                                                  int64_t window_left, double softcap,
                                                  const std::optional<at::Tensor>& sinks,
                                                  const std::optional<at::Tensor>& key_offset,
                                                  const std::optional<at::Tensor>& key_scale,
                                                  const std::optional<at::Tensor>& value_offset) {
  const DecodeArgs a = check_decode_args(query, kv_cache, block_table, seq_lens,
                                         std::string(preset), num_splits);
  const AttentionOptions options = check_attention_options(query, window_left, softcap, sinks);
  const KVTransformArgs transform = check_kv_transform(key_offset, key_scale, value_offset, a.cache.num_kv_heads,
                                                       a.layout.head_dim, kv_cache.device(), softcap,
                                                       options.sinks.defined());
  if (index_checking_enabled()) check_block_table_in_range(block_table, seq_lens, a.cache);
  const auto [out, lse] = run_decode_cpu(transformed_query(query, transform), kv_cache, block_table, seq_lens, a,
                                         scale, num_splits, options);
  return {restored_output(out, transform, seq_lens > 0),
          restored_lse(lse, query, transform, scale)};
}

at::Tensor decode_cpu(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
                      const at::Tensor& seq_lens, c10::string_view preset, double scale, int64_t num_splits,
                      int64_t window_left, double softcap, const std::optional<at::Tensor>& sinks,
                      const std::optional<at::Tensor>& key_offset, const std::optional<at::Tensor>& key_scale,
                      const std::optional<at::Tensor>& value_offset) {
  return std::get<0>(decode_lse_cpu(query, kv_cache, block_table, seq_lens, preset, scale, num_splits, window_left,
                                    softcap, sinks, key_offset, key_scale, value_offset));
}

// Multi-token queries: each query row is one decode row with its sequence's block-table row and
// its own causal length (turboquant/query_chunks.h), so the reference is the decode itself (a
// window counts back from each row's own position). Rows
// outside every sequence's range get length 0, hence zeros.
at::Tensor decode_varlen_cpu(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
                             const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                             c10::string_view preset, double scale, int64_t num_splits, int64_t window_left,
                             double softcap, const std::optional<at::Tensor>& sinks,
                             const std::optional<at::Tensor>& key_offset, const std::optional<at::Tensor>& key_scale,
                             const std::optional<at::Tensor>& value_offset) {
  const DecodeArgs a = check_decode_varlen_args(query, kv_cache, block_table, seq_lens, query_start_loc,
                                                std::string(preset), num_splits);
  const AttentionOptions options = check_attention_options(query, window_left, softcap, sinks);
  const KVTransformArgs transform = check_kv_transform(key_offset, key_scale, value_offset, a.cache.num_kv_heads,
                                                       a.layout.head_dim, kv_cache.device(), softcap,
                                                       options.sinks.defined());
  const int64_t total_q = query.size(0);
  check_query_start_loc_values(query_start_loc, total_q);
  // The caller's tensors, so an error names the caller's entries (not a per-row copy's).
  if (index_checking_enabled()) check_block_table_in_range(block_table, seq_lens, a.cache);
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  at::Tensor row_tables = at::zeros({total_q, a.max_blocks_per_seq}, block_table.options());
  at::Tensor row_lens = at::zeros({total_q}, seq_lens.options());
  int32_t* rt = row_tables.data_ptr<int32_t>();
  int32_t* rl = row_lens.data_ptr<int32_t>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  for (int64_t b = 0; b < a.batch; ++b) {
    const int q_len = starts[b + 1] - starts[b];
    for (int row = starts[b]; row < starts[b + 1]; ++row) {
      std::copy(bt + b * a.max_blocks_per_seq, bt + (b + 1) * a.max_blocks_per_seq, rt + row * a.max_blocks_per_seq);
      rl[row] = causal_limit(lens[b], q_len, row - starts[b]);
    }
  }
  DecodeArgs rows = a;
  rows.batch = total_q;
  const at::Tensor out = std::get<0>(run_decode_cpu(transformed_query(query, transform), kv_cache, row_tables, row_lens,
                                                    rows, scale, num_splits, options));
  return restored_output(out, transform, row_lens > 0);
}

void dequantize_into_cpu(const at::Tensor& kv_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
                         c10::string_view preset, at::Tensor& key_out, at::Tensor& value_out,
                         const std::optional<at::Tensor>& key_offset, const std::optional<at::Tensor>& key_scale,
                         const std::optional<at::Tensor>& value_offset) {
  const DecodeArgs a = check_dequantize_args(kv_cache, block_table, seq_lens, std::string(preset), key_out.scalar_type());
  check_dequantize_outputs(key_out, value_out, a, kv_cache);
  const KVTransformArgs transform = check_kv_transform(key_offset, key_scale, value_offset, a.cache.num_kv_heads,
                                                       a.layout.head_dim, kv_cache.device());
  if (index_checking_enabled()) check_block_table_in_range(block_table, seq_lens, a.cache);
  const int d = a.layout.head_dim;
  const int64_t hkv = a.cache.num_kv_heads, out_len = key_out.size(1);
  const int64_t max_context = a.max_blocks_per_seq * a.cache.block_size;
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  at::Tensor keys = at::zeros({a.batch, out_len, hkv, d}, at::kFloat);
  at::Tensor values = at::zeros_like(keys);
  const Codebook* cb = key_codebook(*a.preset, d);
  const uint8_t* cache = kv_cache.data_ptr<uint8_t>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  float* kp = keys.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  at::parallel_for(0, a.batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = std::min(std::clamp<int64_t>(lens[b], 0, max_context), out_len);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t base = token_slot_base(a.cache, bt + b * a.max_blocks_per_seq, t);
        if (base < 0) continue;
        for (int64_t h = 0; h < hkv; ++h) {
          const uint8_t* slot = cache + base + h * a.cache.stride_head;
          const int64_t dst = ((b * out_len + t) * hkv + h) * d;
          decode_key(slot, a.layout, cb, kp + dst);
          decode_value(slot, a.layout, vp + dst);
        }
      }
    }
  });
  restore_dequantized(keys, values, seq_lens, max_context, transform);
  key_out.copy_(to_output_dtype(keys, key_out.scalar_type()));
  value_out.copy_(to_output_dtype(values, value_out.scalar_type()));
}

std::tuple<at::Tensor, at::Tensor> dequantize_cpu(const at::Tensor& kv_cache, const at::Tensor& block_table,
                                                  const at::Tensor& seq_lens, c10::string_view preset,
                                                  at::ScalarType dtype, const std::optional<at::Tensor>& key_offset,
                                                  const std::optional<at::Tensor>& key_scale,
                                                  const std::optional<at::Tensor>& value_offset) {
  const DecodeArgs a = check_dequantize_args(kv_cache, block_table, seq_lens, std::string(preset), dtype);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  int64_t max_len = 0;
  for (int64_t b = 0; b < a.batch; ++b) max_len = std::max<int64_t>(max_len, lens[b]);
  at::Tensor keys = at::empty({a.batch, max_len, a.cache.num_kv_heads, a.layout.head_dim}, at::TensorOptions().dtype(dtype));
  at::Tensor values = at::empty_like(keys);
  dequantize_into_cpu(kv_cache, block_table, seq_lens, preset, keys, values, key_offset, key_scale, value_offset);
  return {keys, values};
}

}  // namespace

TORCH_LIBRARY_IMPL(turboquant, CPU, m) {
  m.impl("store_kv", &store_kv_cpu);
  m.impl("decode", &decode_cpu);
  m.impl("decode_lse", &decode_lse_cpu);
  m.impl("decode_varlen", &decode_varlen_cpu);
  m.impl("dequantize", &dequantize_cpu);
  m.impl("dequantize_into", &dequantize_into_cpu);
}

}  // namespace turboquant
