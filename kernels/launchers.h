// Torch-free launch API of the CUDA kernels: raw pointers, sizes and byte strides in, a
// cudaError_t out. The torch glue (csrc/ops_cuda.cpp) validates arguments before calling.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "turboquant/layout.h"
#include "turboquant/query_chunks.h"
#include "turboquant/quantize.h"
#include "turboquant/split_plan.h"

namespace turboquant {

enum class ElementType : int { kHalf = 0, kBFloat16 = 1, kFloat = 2 };

// The paged cache as the kernels see it: its geometry and the base pointer.
struct CacheView : PagedCacheGeometry {
  uint8_t* data = nullptr;  // 16-byte aligned for decode (it copies aligned 16-byte chunks)
};

struct StoreParams {
  const void* key = nullptr;    // [num_tokens, num_kv_heads, head_dim]
  const void* value = nullptr;  // [num_tokens, num_kv_heads, head_dim]
  ElementType dtype = ElementType::kHalf;
  int64_t num_tokens = 0;
  const void* slot_mapping = nullptr;  // [num_tokens], int32 or int64; < 0 or past the cache: skip
  bool slot_mapping_int64 = false;
  CacheView cache;
  SlotLayout layout;
  Codebook codebook;  // unused for FP8 keys
  bool norm_correction = false;
  // Per-head transforms (csrc/kv_transform.h), fp32 [num_kv_heads, head_dim] each, or none: the
  // store quantizes (key - key_offset) / key_scale and value - value_offset, computed in fp32 from
  // the inputs as it reads them (the bytes of an fp32 pass before the store, without its traffic).
  // 16-byte aligned (the tiled store reads them in 16-byte loads).
  const float* key_offset = nullptr;
  const float* key_scale = nullptr;
  const float* value_offset = nullptr;
};

struct DecodeParams {
  const void* query = nullptr;  // [query_rows, num_q_heads, head_dim]
  void* out = nullptr;          // [query_rows, num_q_heads, head_dim], query's dtype
  ElementType dtype = ElementType::kHalf;
  int batch = 0;       // sequences
  int query_rows = 0;  // query tokens: batch for a plain decode, total_q for varlen
  // Varlen (multi-token) queries: [batch + 1] cumulative starts of each sequence's query rows,
  // query row i of sequence b attends to positions < seq_len_b - q_len_b + 1 + i
  // (turboquant/query_chunks.h). Null for a plain decode (row b = sequence b, one token each).
  // Rows outside every sequence's range are not written (the caller zero-fills).
  const int32_t* query_start_loc = nullptr;
  int num_q_heads = 0;
  CacheView cache;
  const int32_t* block_table = nullptr;  // [batch, max_blocks_per_seq]
  int max_blocks_per_seq = 0;
  const int32_t* seq_lens = nullptr;  // [batch]
  SlotLayout layout;
  Codebook codebook;
  float scale = 1.0f;
  // Attention options (turboquant/attention_options.h); only the per-head kernel applies them
  // (choose_decode_kernel sends every decode that sets one there).
  int window = INT_MAX;           // window_span(window_left)
  float softcap = 0.0f;           // 0: none
  const float* sinks = nullptr;   // [num_q_heads] fp32 logits, or none
  bool has_attention_options() const { return window != INT_MAX || softcap != 0.0f || sinks != nullptr; }
  // Per-head transforms (csrc/kv_transform.h), fp32 [num_kv_heads, head_dim] each, or none: every
  // kernel stages its query columns times their KV head's key_scale, and adds value_offset to each
  // output row that attends to something where it writes the final output (its epilogue, the
  // cluster merge or the split merge; partial outputs stay without it). key_offset moves a row's
  // log-sum-exp by scale * q . key_offset (key_offset_lse_shift): the per-head and generic kernels,
  // which serve decode_lse, add it to the partial log-sum-exps they write; the others ignore it
  // (a shift shared by every split of a row leaves the merge's weights as they are).
  const float* key_offset = nullptr;
  const float* key_scale = nullptr;
  const float* value_offset = nullptr;
  int num_splits = 1;
  // Set where the library chose num_splits for the per-head kernel (choose_decode_splits):
  // each CTA row then takes row_splits_in_grid(split_waves, its context, num_splits) of the
  // grid's splits, so a short sequence in a block table sized for long ones keeps the splits its
  // own length calls for (or, where those would fill one CTA per SM of a grid sized for two, the
  // grid's), and the CTAs of the other splits exit at once. Unset (full_context 0): every
  // sequence is divided into num_splits.
  SplitWaves split_waves;
  // Workspace for num_splits > 1, sized for num_splits partials per row; a kernel may write fewer
  // (the row kernel: one per CTA, its two splits folded) and merge that many, at that stride.
  float* partial_out = nullptr;  // [query_rows, num_q_heads, partials, head_dim]
  float* partial_lse = nullptr;  // [query_rows, num_q_heads, partials], log2 domain; -inf-filled
                                 // by the caller for varlen (rows no CTA serves merge to zeros)
};

struct DequantizeParams {
  CacheView cache;
  const int32_t* block_table = nullptr;  // [batch, max_blocks_per_seq]
  int max_blocks_per_seq = 0;
  const int32_t* seq_lens = nullptr;  // [batch]
  int batch = 0;
  int max_seq_len = 0;
  void* key_out = nullptr;    // [batch, max_seq_len, num_kv_heads, head_dim], zero-filled by caller
  void* value_out = nullptr;  // same
  ElementType dtype = ElementType::kHalf;
  SlotLayout layout;
  Codebook codebook;
};

// Head dims the tiled kernels are compiled for: 64, 128, 256 (FP8 keys also 96: no rotation needed).
bool cuda_supports_head_dim(const SlotLayout& layout);
// Every other head dim a preset takes runs on the generic kernels (generic_head_dim.cu): one
// instantiation per element type for all of them, the CPU's per-element rules, a warp per vector.
bool cuda_generic_supports(const SlotLayout& layout);
// A split of the generic decode keeps at least one 32-token tile per warp: its CTAs are latency-
// bound (a warp's loads wait on the cache), so more of them resident beat longer splits.
constexpr int kGenericMinTokensPerSplit = 128;
constexpr int kGenericCtasPerSm = 4;  // the generic decode's 4-warp CTAs resident per SM (at most 128 registers a thread on sm_90)
cudaError_t launch_store_kv_generic(const StoreParams& p, cudaStream_t stream);
cudaError_t launch_dequantize_generic(const DequantizeParams& p, cudaStream_t stream);
int decode_generic_query_chunks(const DecodeParams& p);  // grid x: sequences, or varlen rows + batch
int decode_generic_head_slices(const DecodeParams& p);   // grid y: KV heads x the slices of their GQA group
cudaError_t launch_decode_generic(const DecodeParams& p, cudaStream_t stream);

// Multiprocessors of the current device (132 if it cannot be asked).
int device_sm_count();

// Whether kernels may be launched with programmatic dependent launch (sm_90 and newer).
bool device_supports_dependent_launch();

// The programmatic dependent launch attribute: the launched kernel's CTAs may start once every CTA
// of the kernel before it in the stream has let them (griddepcontrol.launch_dependents) or exited,
// and wait in griddepcontrol.wait for its completion. Attach it only where
// device_supports_dependent_launch().
inline cudaLaunchAttribute dependent_launch_attribute() {
  cudaLaunchAttribute a = {};
  a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a.val.programmaticStreamSerializationAllowed = 1;
  return a;
}

// A kernel forced by environment variable `variable` (tests and A/B runs): 1 when it equals
// `first`, 2 when it equals `second`, 0 when unset (other values warn and count as unset). Callers
// read it once per process.
int env_kernel_choice(const char* variable, const char* first, const char* second);
// Whether the kernels prefer the largest shared-memory carveout (prefer_max_shared_carveout,
// dispatch.cuh): yes unless TURBOQUANT_SMEM_CARVEOUT=auto (read once per process).
bool smem_carveout_max_requested();

// The kernel that serves a decode, from its shapes alone (decode_plan.cu): the chunked kernel for
// varlen queries with enough columns per chunk, the row-staged kernel where it supports and is
// preferred for the shape, else the per-head kernel; the generic kernel for head dims without
// tiles. Chosen once per call; the split plan, the workspace query and the launch all take the
// choice, so they cannot disagree.
enum class DecodeKernel { kHeads, kRows, kChunked, kGeneric };
DecodeKernel choose_decode_kernel(const DecodeParams& p);
// The library's split plan for these shapes on the current device: sets p.num_splits and, where
// the per-head kernel serves p, p.split_waves (each row's share of the grid by its context).
void choose_decode_splits(DecodeParams& p, DecodeKernel kernel);
// Whether launch_decode(p, kernel) uses p.partial_out and p.partial_lse (sized for p.num_splits
// partials per row): not for one split, nor where the per-head kernel merges its splits inside a cluster.
bool decode_uses_split_workspace(const DecodeParams& p, DecodeKernel kernel);

cudaError_t launch_store_kv(const StoreParams& p, cudaStream_t stream);
cudaError_t launch_decode(const DecodeParams& p, DecodeKernel kernel, cudaStream_t stream);
// Log-sum-exp merge of a split decode's partial results into p.out (decode_merge.cu).
cudaError_t launch_decode_merge(const DecodeParams& p, cudaStream_t stream);

// Varlen queries with 64 query columns per CTA (decode_chunked.cu): each key tile dequantized
// once per CTA. launch_decode takes it when total_q * group >= 32 * batch (use_chunked_varlen).
bool decode_chunked_supports(const DecodeParams& p);
cudaError_t launch_decode_chunked(const DecodeParams& p, cudaStream_t stream);

// Plain decodes of token-major caches with KV heads in 8s (decode_rows.cu): one CTA per kRowHeads
// KV heads stages whole token rows by bulk copies. choose_decode_kernel takes it where it supports
// the shape and its grid fills half the SMs with 3 or more rows (row_kernel_preferred, turboquant/split_plan.h).
constexpr int kRowHeads = kDecodeWarps;  // KV heads per row-kernel CTA (per half), one warp each
bool decode_rows_supports(const DecodeParams& p);
int decode_rows_splits_per_cta(const DecodeParams& p);  // 2 for Lloyd-Max keys (one CTA of 16 warps), else 1
int forced_decode_kernel();  // TURBOQUANT_DECODE_KERNEL: 0 unset, 1 heads, 2 rows (decode_rows.cu)
cudaError_t launch_decode_rows(const DecodeParams& p, cudaStream_t stream);

// The per-head decode kernel (decode.cu): one CTA (8 warps) per (sequence or varlen chunk, KV
// head, split), the kernel for every decode the others do not take (decode_plan.cu).
int decode_heads_resident_ctas(const DecodeParams& p);  // CTAs per SM
int decode_head_chunks(const DecodeParams& p);  // CTAs per KV head: GQA groups of more than 8 take several
int decode_query_chunks(const DecodeParams& p);  // grid y: sequences, or varlen chunks of query tokens
bool decode_heads_merge_in_cluster(const DecodeParams& p);  // its splits merge inside clusters (no workspace)
cudaError_t launch_decode_heads(const DecodeParams& p, cudaStream_t stream);

cudaError_t launch_dequantize(const DequantizeParams& p, cudaStream_t stream);

}  // namespace turboquant
