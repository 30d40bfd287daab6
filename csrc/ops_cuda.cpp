// CUDA implementations of the ops: argument checks (shared with the CPU path), device guard,
// current stream, then the torch-free launchers in kernels/.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <limits>
#include <tuple>

#include "error_message.h"
#include "kv_transform.h"
#include "launchers.h"
#include "op_checks.h"
#include "turboquant/lloyd_max.h"

namespace turboquant {
namespace {

ElementType element_type(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return ElementType::kHalf;
    case at::kBFloat16: return ElementType::kBFloat16;
    default: return ElementType::kFloat;
  }
}

CacheView cache_view(const at::Tensor& kv_cache, const CacheGeometry& g) {
  CacheView v;
  static_cast<PagedCacheGeometry&>(v) = g;
  v.data = kv_cache.data_ptr<uint8_t>();
  return v;
}

Codebook codebook_for(const Preset& preset, int head_dim) {
  return preset.key_format == KeyFormat::kLloydMax ? gaussian_codebook(preset.key_bits, head_dim) : Codebook{};
}

// Every op has a kernel for every layout the presets take (the tiled ones or the generic ones);
// this guards the launchers' contract, not a user-facing limit.
void check_cuda_head_dim(const SlotLayout& layout) {
  TQ_CHECK(cuda_supports_head_dim(layout) || cuda_generic_supports(layout), "turboquant: no CUDA kernel for head_dim ",
           layout.head_dim);
}

void check_launch(cudaError_t err, const char* op) {
  TQ_CHECK(err == cudaSuccess, "turboquant: ", op, " CUDA launch failed: ", cudaGetErrorString(err));
}

// A per-head transform's vector for the kernels (check_kv_transform made it contiguous), or null.
const float* vector_ptr(const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

// The store reads the vectors in 16-byte loads: a view at another offset is copied (the copy lives
// until the op returns, after the launch, as the stream-ordered allocator allows).
at::Tensor aligned16(const at::Tensor& t) {
  return !t.defined() || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 ? t : t.clone();
}

// The kernels apply the per-head transforms themselves (launchers.h): the store on the K/V it
// reads, a decode where it stages the query and writes the output.
void store_kv_cuda(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache,
                   const at::Tensor& slot_mapping, c10::string_view preset, const std::optional<at::Tensor>& key_offset,
                   const std::optional<at::Tensor>& key_scale, const std::optional<at::Tensor>& value_offset) {
  const StoreArgs a = check_store_kv_args(key, value, kv_cache, slot_mapping, std::string(preset));
  check_cuda_head_dim(a.layout);
  const KVTransformArgs transform = check_kv_transform(key_offset, key_scale, value_offset, a.cache.num_kv_heads,
                                                       a.layout.head_dim, kv_cache.device());
  if (index_checking_enabled()) check_slot_mapping_in_range(slot_mapping, a.cache);
  TQ_CHECK(reinterpret_cast<uintptr_t>(kv_cache.data_ptr()) % 2 == 0, "turboquant: kv_cache must be 2-byte aligned");
  TQ_CHECK(reinterpret_cast<uintptr_t>(key.data_ptr()) % 16 == 0 && reinterpret_cast<uintptr_t>(value.data_ptr()) % 16 == 0,
              "turboquant: CUDA store_kv needs 16-byte aligned key and value (16-byte copies); got a view with an odd offset");
  const c10::cuda::CUDAGuard guard(key.device());
  StoreParams p;
  p.key = key.data_ptr();
  p.value = value.data_ptr();
  p.dtype = element_type(key.scalar_type());
  p.num_tokens = a.num_tokens;
  p.slot_mapping = slot_mapping.data_ptr();
  p.slot_mapping_int64 = slot_mapping.scalar_type() == at::kLong;
  p.cache = cache_view(kv_cache, a.cache);
  p.layout = a.layout;
  p.codebook = codebook_for(*a.preset, a.layout.head_dim);
  p.norm_correction = a.preset->norm_correction;
  const at::Tensor key_offset16 = aligned16(transform.key_offset), key_scale16 = aligned16(transform.key_scale),
                   value_offset16 = aligned16(transform.value_offset);
  p.key_offset = vector_ptr(key_offset16);
  p.key_scale = vector_ptr(key_scale16);
  p.value_offset = vector_ptr(value_offset16);
  check_launch(launch_store_kv(p, c10::cuda::getCurrentCUDAStream()), "store_kv");
}

// Checks shared by decode and decode_varlen on CUDA (the kernel's dtype and alignment needs).
void check_cuda_decode_inputs(const at::Tensor& query, const at::Tensor& kv_cache, const DecodeArgs& a) {
  check_cuda_head_dim(a.layout);
  TQ_CHECK(query.scalar_type() == at::kHalf || query.scalar_type() == at::kBFloat16,
              "turboquant: CUDA decode takes a float16 or bfloat16 query, got ", query.scalar_type());
  TQ_CHECK(reinterpret_cast<uintptr_t>(kv_cache.data_ptr()) % 16 == 0,
              "turboquant: kv_cache must be 16-byte aligned for CUDA decode (a freshly allocated cache is)");
  TQ_CHECK(a.cache.span_bytes % 16 == 0,
              "turboquant: CUDA decode copies whole 16-byte chunks, so the kv_cache view must end on a 16-byte ",
              "boundary (a whole allocated cache does); got a view spanning ", a.cache.span_bytes, " bytes");
}

// One launch of the decode kernel (plus the split merge). query_start_loc undefined: plain decode.
// With `lse`, also each (row, head)'s log-sum-exp (natural log), from the splits' own: the call then
// takes a kernel that writes one per split (the per-head or the generic one) and at least the splits
// that go through the workspace (3 for the per-head kernel, whose 2 merge inside a cluster).
at::Tensor run_decode_cuda(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
                           const at::Tensor& seq_lens, const at::Tensor& query_start_loc, const DecodeArgs& a,
                           double scale, int64_t num_splits, const AttentionOptions& options,
                           const KVTransformArgs& transform, at::Tensor* lse = nullptr) {
  const bool varlen = query_start_loc.defined();
  const c10::cuda::CUDAGuard guard(query.device());
  // Varlen rows outside every sequence's range are never written: zeros.
  at::Tensor out = varlen ? at::zeros_like(query) : at::empty_like(query);
  DecodeParams p;
  p.query = query.data_ptr();
  p.out = out.data_ptr();
  p.dtype = element_type(query.scalar_type());
  p.batch = static_cast<int>(a.batch);
  p.query_rows = static_cast<int>(query.size(0));
  p.query_start_loc = varlen ? query_start_loc.data_ptr<int32_t>() : nullptr;
  p.num_q_heads = static_cast<int>(a.num_q_heads);
  p.cache = cache_view(kv_cache, a.cache);
  p.block_table = block_table.data_ptr<int32_t>();
  p.max_blocks_per_seq = static_cast<int>(a.max_blocks_per_seq);
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.layout = a.layout;
  p.codebook = codebook_for(*a.preset, a.layout.head_dim);
  p.scale = static_cast<float>(scale);
  p.window = options.window;
  p.softcap = static_cast<float>(options.softcap);
  p.sinks = options.sinks.defined() ? options.sinks.data_ptr<float>() : nullptr;
  p.key_offset = vector_ptr(transform.key_offset);
  p.key_scale = vector_ptr(transform.key_scale);
  p.value_offset = vector_ptr(transform.value_offset);
  DecodeKernel kernel = choose_decode_kernel(p);
  if (lse != nullptr && kernel != DecodeKernel::kGeneric) kernel = DecodeKernel::kHeads;
  if (num_splits > 0) {
    p.num_splits = static_cast<int>(num_splits);  // as asked: every sequence is divided into that many
  } else {
    choose_decode_splits(p, kernel);
  }
  const int lse_splits = kernel == DecodeKernel::kGeneric ? 2 : 3;
  if (lse != nullptr && p.num_splits < lse_splits) {
    p.num_splits = lse_splits;
    p.split_waves = SplitWaves{};  // every row divided into them
  }
  at::Tensor partial_out, partial_lse;
  if (decode_uses_split_workspace(p, kernel)) {  // not where one split or a cluster merge needs none
    const auto f32 = query.options().dtype(at::kFloat);
    const int64_t rows = query.size(0);
    partial_out = at::empty({rows, a.num_q_heads, p.num_splits, a.layout.head_dim}, f32);
    // -inf: rows no CTA serves (outside every sequence) merge to zeros.
    partial_lse = varlen ? at::full({rows, a.num_q_heads, p.num_splits}, -std::numeric_limits<float>::infinity(), f32)
                         : at::empty({rows, a.num_q_heads, p.num_splits}, f32);
    p.partial_out = partial_out.data_ptr<float>();
    p.partial_lse = partial_lse.data_ptr<float>();
  }
  const cudaError_t err = launch_decode(p, kernel, c10::cuda::getCurrentCUDAStream());
  TQ_CHECK(err != cudaErrorInvalidConfiguration, "turboquant: decode_varlen supports at most 65535 query chunks ",
              "(query rows / tokens per CTA + batch); got ", query.size(0), " query rows in ", a.batch, " sequences");
  check_launch(err, varlen ? "decode_varlen" : "decode");
  constexpr float kLn2 = 0.6931471805599453f;  // the splits' log-sum-exps are in the log2 domain
  if (lse != nullptr) {
    *lse = at::logsumexp(partial_lse * kLn2, 2);
    // The per-head kernel adds a head's sink in split 0's epilogue, which a row with no position
    // to attend (empty, or its window past the context) never runs: its log-sum-exp is the sink's.
    if (options.sinks.defined()) *lse = at::where(at::isneginf(*lse), options.sinks.view({1, -1}), *lse);
  }
  return out;
}

// decode and decode_lse: `lse` null for decode.
at::Tensor checked_decode_cuda(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
                               const at::Tensor& seq_lens, c10::string_view preset, double scale, int64_t num_splits,
                               int64_t window_left, double softcap, const std::optional<at::Tensor>& sinks,
                               const std::optional<at::Tensor>& key_offset, const std::optional<at::Tensor>& key_scale,
                               const std::optional<at::Tensor>& value_offset, at::Tensor* lse) {
  const DecodeArgs a = check_decode_args(query, kv_cache, block_table, seq_lens, std::string(preset), num_splits);
  const AttentionOptions options = check_attention_options(query, window_left, softcap, sinks);
  const KVTransformArgs transform = check_kv_transform(key_offset, key_scale, value_offset, a.cache.num_kv_heads,
                                                       a.layout.head_dim, kv_cache.device(), softcap,
                                                       options.sinks.defined());
  check_cuda_decode_inputs(query, kv_cache, a);
  TQ_CHECK(a.batch <= 65535, "turboquant: CUDA decode supports a batch of at most 65535 sequences, got ", a.batch);
  if (index_checking_enabled()) check_block_table_in_range(block_table, seq_lens, a.cache);
  const c10::cuda::CUDAGuard guard(query.device());
  return run_decode_cuda(query, kv_cache, block_table, seq_lens, at::Tensor(), a, scale, num_splits, options,
                         transform, lse);
}

at::Tensor decode_cuda(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
                       const at::Tensor& seq_lens, c10::string_view preset, double scale, int64_t num_splits,
                       int64_t window_left, double softcap, const std::optional<at::Tensor>& sinks,
                       const std::optional<at::Tensor>& key_offset, const std::optional<at::Tensor>& key_scale,
                       const std::optional<at::Tensor>& value_offset) {
  return checked_decode_cuda(query, kv_cache, block_table, seq_lens, preset, scale, num_splits, window_left, softcap,
                             sinks, key_offset, key_scale, value_offset, nullptr);
}

std::tuple<at::Tensor, at::Tensor> decode_lse_cuda(const at::Tensor& query, const at::Tensor& kv_cache,
                                                   const at::Tensor& block_table, const at::Tensor& seq_lens,
                                                   c10::string_view preset, double scale, int64_t num_splits,
                                                   int64_t window_left, double softcap,
                                                   const std::optional<at::Tensor>& sinks,
                                                   const std::optional<at::Tensor>& key_offset,
                                                   const std::optional<at::Tensor>& key_scale,
                                                   const std::optional<at::Tensor>& value_offset) {
  at::Tensor lse;
  at::Tensor out = checked_decode_cuda(query, kv_cache, block_table, seq_lens, preset, scale, num_splits, window_left,
                                       softcap, sinks, key_offset, key_scale, value_offset, &lse);
  return {out, lse};
}

// query_start_loc's values are read on the device (clamped into the query's rows, never a host
// sync); TURBOQUANT_CHECK_INDICES=1 also checks them on the host.
at::Tensor decode_varlen_cuda(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
                              const at::Tensor& seq_lens, const at::Tensor& query_start_loc, c10::string_view preset,
                              double scale, int64_t num_splits, int64_t window_left, double softcap,
                              const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& key_offset,
                              const std::optional<at::Tensor>& key_scale,
                              const std::optional<at::Tensor>& value_offset) {
  const DecodeArgs a = check_decode_varlen_args(query, kv_cache, block_table, seq_lens, query_start_loc,
                                                std::string(preset), num_splits);
  const AttentionOptions options = check_attention_options(query, window_left, softcap, sinks);
  const KVTransformArgs transform = check_kv_transform(key_offset, key_scale, value_offset, a.cache.num_kv_heads,
                                                       a.layout.head_dim, kv_cache.device(), softcap,
                                                       options.sinks.defined());
  check_cuda_decode_inputs(query, kv_cache, a);
  if (index_checking_enabled()) {
    check_block_table_in_range(block_table, seq_lens, a.cache);
    check_query_start_loc_values(query_start_loc, query.size(0));
  }
  const c10::cuda::CUDAGuard guard(query.device());
  return run_decode_cuda(query, kv_cache, block_table, seq_lens, query_start_loc, a, scale, num_splits, options,
                         transform);
}

void dequantize_into_cuda(const at::Tensor& kv_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
                          c10::string_view preset, at::Tensor& key_out, at::Tensor& value_out,
                          const std::optional<at::Tensor>& key_offset, const std::optional<at::Tensor>& key_scale,
                          const std::optional<at::Tensor>& value_offset) {
  const DecodeArgs a = check_dequantize_args(kv_cache, block_table, seq_lens, std::string(preset), key_out.scalar_type());
  check_dequantize_outputs(key_out, value_out, a, kv_cache);
  check_cuda_head_dim(a.layout);
  const KVTransformArgs transform = check_kv_transform(key_offset, key_scale, value_offset, a.cache.num_kv_heads,
                                                       a.layout.head_dim, kv_cache.device());
  if (index_checking_enabled()) check_block_table_in_range(block_table, seq_lens, a.cache);
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  key_out.zero_();  // zeros past each length; the kernel writes the tokens that exist
  value_out.zero_();
  DequantizeParams p;
  p.cache = cache_view(kv_cache, a.cache);
  p.block_table = block_table.data_ptr<int32_t>();
  p.max_blocks_per_seq = static_cast<int>(a.max_blocks_per_seq);
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.batch = static_cast<int>(a.batch);
  p.max_seq_len = static_cast<int>(key_out.size(1));
  p.key_out = key_out.data_ptr();
  p.value_out = value_out.data_ptr();
  p.dtype = element_type(key_out.scalar_type());
  p.layout = a.layout;
  p.codebook = codebook_for(*a.preset, a.layout.head_dim);
  check_launch(launch_dequantize(p, c10::cuda::getCurrentCUDAStream()), "dequantize");
  restore_dequantized(key_out, value_out, seq_lens, a.max_blocks_per_seq * a.cache.block_size, transform);
}

std::tuple<at::Tensor, at::Tensor> dequantize_cuda(const at::Tensor& kv_cache, const at::Tensor& block_table,
                                                   const at::Tensor& seq_lens, c10::string_view preset,
                                                   at::ScalarType dtype, const std::optional<at::Tensor>& key_offset,
                                                   const std::optional<at::Tensor>& key_scale,
                                                   const std::optional<at::Tensor>& value_offset) {
  const DecodeArgs a = check_dequantize_args(kv_cache, block_table, seq_lens, std::string(preset), dtype);
  // The output shape depends on the lengths: one host sync (dequantize_into avoids it).
  const int64_t max_len = a.batch > 0 ? std::max<int64_t>(seq_lens.max().item<int32_t>(), 0) : 0;
  at::Tensor keys = at::empty({a.batch, max_len, a.cache.num_kv_heads, a.layout.head_dim}, kv_cache.options().dtype(dtype));
  at::Tensor values = at::empty_like(keys);
  dequantize_into_cuda(kv_cache, block_table, seq_lens, preset, keys, values, key_offset, key_scale, value_offset);
  return {keys, values};
}

}  // namespace

TORCH_LIBRARY_IMPL(turboquant, CUDA, m) {
  m.impl("store_kv", &store_kv_cuda);
  m.impl("decode", &decode_cuda);
  m.impl("decode_lse", &decode_lse_cuda);
  m.impl("decode_varlen", &decode_varlen_cuda);
  m.impl("dequantize", &dequantize_cuda);
  m.impl("dequantize_into", &dequantize_into_cuda);
}

}  // namespace turboquant
