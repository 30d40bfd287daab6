// The ops' per-head transforms (the exact ones of turboquant.calibration, docs/QUALITY.md): a
// cache may hold each KV head's keys as (k - key_offset) / key_scale and its values as
// v - value_offset, fp32 [num_kv_heads, head_dim] each, and every op takes the same three vectors
// to work in the original basis:
//   store_kv    stores the transformed K/V;
//   decode*     attend with q * key_scale (q . k = (q * s) . ((k - mu) / s) + q . mu, and the last
//               term is the same for every key of a softmax), add value_offset to each row that
//               attends to something (the weights sum to 1), and report the log-sum-exp with
//               scale * q . key_offset added back;
//   dequantize  returns k~ * key_scale + key_offset and v~ + value_offset within each length.
// key_offset with soft-capping or sinks, and value_offset with sinks, are refused: the cap and
// the sink's logit are not shifted with the scores, so there the identities do not hold.
//
// The checks, and the ATen passes the CPU ops run around their reference code: an elementwise pass
// over the query and output of a decode (the cache's bytes are read as often as without), and one
// over K/V before a store. The CUDA kernels apply the transforms themselves (kernels/launchers.h);
// the CUDA ops share only restore_dequantized.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace turboquant {

struct KVTransformArgs {
  at::Tensor key_offset, key_scale, value_offset;  // undefined: none
  bool any() const { return key_offset.defined() || key_scale.defined() || value_offset.defined(); }
};

// Checks each given vector: float32 [num_kv_heads, head_dim] on `device`. `softcap` and `has_sinks`
// describe the attention it serves (0 and false outside decode).
KVTransformArgs check_kv_transform(const std::optional<at::Tensor>& key_offset,
                                   const std::optional<at::Tensor>& key_scale,
                                   const std::optional<at::Tensor>& value_offset, int64_t num_kv_heads,
                                   int64_t head_dim, const c10::Device& device, double softcap = 0.0,
                                   bool has_sinks = false);

// (key - key_offset) / key_scale and value - value_offset, float32 (the store's input).
std::pair<at::Tensor, at::Tensor> transformed_kv(const at::Tensor& key, const at::Tensor& value,
                                                 const KVTransformArgs& t);

// query [rows, Hq, D] times its KV head's key_scale, in the query's dtype.
at::Tensor transformed_query(const at::Tensor& query, const KVTransformArgs& t);

// A decode's output [rows, Hq, D] in the original basis: value_offset added where `attended`
// ([rows] bool) holds. And its log-sum-exp [rows, Hq] with scale * q . key_offset added where finite.
at::Tensor restored_output(const at::Tensor& out, const KVTransformArgs& t, const at::Tensor& attended);
at::Tensor restored_lse(const at::Tensor& lse, const at::Tensor& query, const KVTransformArgs& t, double scale);

// dequantize's outputs [B, L, Hkv, D] back in the original basis, in place, at positions below
// each sequence's length (min(seq_len, capacity)); zeros elsewhere stay zeros.
void restore_dequantized(at::Tensor& key_out, at::Tensor& value_out, const at::Tensor& seq_lens, int64_t capacity,
                         const KVTransformArgs& t);

}  // namespace turboquant
