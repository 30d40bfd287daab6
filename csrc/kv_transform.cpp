// The ops' per-head transforms (kv_transform.h): checks and the ATen passes around the kernels.
#include "kv_transform.h"

#include <limits>

#include "error_message.h"

namespace turboquant {
namespace {

at::Tensor checked_vector(const std::optional<at::Tensor>& v, const char* name, int64_t num_kv_heads,
                          int64_t head_dim, const c10::Device& device) {
  if (!v.has_value() || !v->defined()) return at::Tensor();
  const at::Tensor& t = *v;
  TQ_CHECK(t.scalar_type() == at::kFloat, "turboquant: ", name, " must be float32, got ", t.scalar_type());
  TQ_CHECK(t.dim() == 2 && t.size(0) == num_kv_heads && t.size(1) == head_dim, "turboquant: ", name,
           " must be [num_kv_heads, head_dim] = [", num_kv_heads, ", ", head_dim, "], got shape ", t.sizes());
  TQ_CHECK(t.device() == device, "turboquant: ", name, " must be on the cache's device ", device, ", got ",
           t.device());
  return t.contiguous();  // the CUDA kernels index it as [num_kv_heads][head_dim]
}

// [1, Hkv, 1, D] view of a per-head vector, to broadcast over [rows, Hkv, group, D].
at::Tensor per_query_group(const at::Tensor& v) { return v.view({1, v.size(0), 1, v.size(1)}); }

}  // namespace

KVTransformArgs check_kv_transform(const std::optional<at::Tensor>& key_offset,
                                   const std::optional<at::Tensor>& key_scale,
                                   const std::optional<at::Tensor>& value_offset, int64_t num_kv_heads,
                                   int64_t head_dim, const c10::Device& device, double softcap, bool has_sinks) {
  KVTransformArgs t;
  t.key_offset = checked_vector(key_offset, "key_offset", num_kv_heads, head_dim, device);
  t.key_scale = checked_vector(key_scale, "key_scale", num_kv_heads, head_dim, device);
  t.value_offset = checked_vector(value_offset, "value_offset", num_kv_heads, head_dim, device);
  TQ_CHECK(!t.key_offset.defined() || (softcap == 0.0 && !has_sinks),
           "turboquant: key_offset cannot be combined with softcap or sinks (the cap and the sink's logit do not "
           "shift with the scores, so the attention would change); store uncentered keys for such layers");
  TQ_CHECK(!t.value_offset.defined() || !has_sinks,
           "turboquant: value_offset cannot be combined with sinks (a sink's weight carries no value, so the "
           "offset would not add back whole); store uncentered values for such layers");
  return t;
}

std::pair<at::Tensor, at::Tensor> transformed_kv(const at::Tensor& key, const at::Tensor& value,
                                                 const KVTransformArgs& t) {
  // Each step promotes to float32 in the kernel it runs (bf16 - fp32 -> fp32): one pass per step.
  // (Never in place on `key`: key.to(kFloat) is `key` itself when it is float32 already.)
  at::Tensor k;
  if (t.key_offset.defined()) {
    k = key - t.key_offset;  // [N, Hkv, D] against [Hkv, D]
    if (t.key_scale.defined()) k.div_(t.key_scale);
  } else {
    k = t.key_scale.defined() ? key / t.key_scale : key.to(at::kFloat);
  }
  const at::Tensor v = t.value_offset.defined() ? value - t.value_offset : value.to(at::kFloat);
  return {k.contiguous(), v.contiguous()};
}

at::Tensor transformed_query(const at::Tensor& query, const KVTransformArgs& t) {
  if (!t.key_scale.defined()) return query;
  const int64_t rows = query.size(0), hq = query.size(1), d = query.size(2), hkv = t.key_scale.size(0);
  const at::Tensor q = query.view({rows, hkv, hq / hkv, d}) * per_query_group(t.key_scale);  // in float32
  return q.view({rows, hq, d}).to(query.scalar_type());
}

at::Tensor restored_output(const at::Tensor& out, const KVTransformArgs& t, const at::Tensor& attended) {
  if (!t.value_offset.defined()) return out;
  const int64_t rows = out.size(0), hq = out.size(1), d = out.size(2), hkv = t.value_offset.size(0);
  const at::Tensor offset = per_query_group(t.value_offset) * attended.view({rows, 1, 1, 1});  // [rows, Hkv, 1, D]
  if (out.scalar_type() != at::kHalf) {  // one pass: added in float32, rounded once into the output
    out.view({rows, hkv, hq / hkv, d}).add_(offset);
    return out;
  }
  // fp16: finite results stay finite, as the ops' outputs do
  constexpr double kHalfMax = 65504.0;
  const at::Tensor restored = (out.view({rows, hkv, hq / hkv, d}) + offset).view({rows, hq, d});
  return at::where(at::isfinite(restored), restored.clamp(-kHalfMax, kHalfMax), restored).to(at::kHalf);
}

at::Tensor restored_lse(const at::Tensor& lse, const at::Tensor& query, const KVTransformArgs& t, double scale) {
  if (!t.key_offset.defined()) return lse;
  const int64_t rows = query.size(0), hq = query.size(1), d = query.size(2), hkv = t.key_offset.size(0);
  const at::Tensor shift =
      (query.to(at::kFloat).view({rows, hkv, hq / hkv, d}) * per_query_group(t.key_offset)).sum(-1).view({rows, hq}) *
      scale;
  return at::where(at::isneginf(lse), lse, lse + shift);
}

void restore_dequantized(at::Tensor& key_out, at::Tensor& value_out, const at::Tensor& seq_lens, int64_t capacity,
                         const KVTransformArgs& t) {
  if (!t.any()) return;
  const int64_t batch = key_out.size(0), length = key_out.size(1), hkv = key_out.size(2), d = key_out.size(3);
  const at::Tensor within = (at::arange(length, seq_lens.options().dtype(at::kLong)).view({1, length}) <
                             seq_lens.to(at::kLong).clamp(0, capacity).view({batch, 1}))
                                .to(at::kFloat)
                                .view({batch, length, 1, 1});
  if (t.key_offset.defined() || t.key_scale.defined()) {
    at::Tensor k = key_out.to(at::kFloat);
    if (t.key_scale.defined()) k = k * t.key_scale.view({1, 1, hkv, d});
    if (t.key_offset.defined()) k = k + t.key_offset.view({1, 1, hkv, d}) * within;
    key_out.copy_(k);
  }
  if (t.value_offset.defined()) {
    value_out.copy_(value_out.to(at::kFloat) + t.value_offset.view({1, 1, hkv, d}) * within);
  }
}

}  // namespace turboquant
