// The decode's plan from shapes alone (CUDA-graph safe): which kernel serves a decode (the
// per-head kernel, decode.cu; the row-staged one, decode_rows.cu; the chunked varlen one,
// decode_chunked.cu), how many splits its grid has and how each row shares them
// (turboquant/split_plan.h), the workspace they merge through, and the launch.
#include <cuda_runtime.h>

#include <algorithm>

#include "launchers.h"
#include "turboquant/attention_options.h"
#include "turboquant/query_chunks.h"
#include "turboquant/split_plan.h"

namespace turboquant {

// Which kernel serves varlen queries. The chunked kernel (decode_chunked.cu) shares each
// dequantized tile across 64 query columns but pays its dequantize, two barriers per 64-token
// step and a 64-column query set-up even for a few columns; the decode kernel's 8 columns win for
// decode-like rows. Rule: the chunked kernel once the average sequence brings (token, head)
// columns to fill half of its 64, total_q * group >= 32 * batch. Measured (H200, GQA 4, one
// sequence, bench_continuation.py, benchmarks/RESULTS.md): at 8 tokens (32 columns) the chunked kernel is
// faster at every context (2k 30.1 vs 32.6 us, 8k 30.7 vs 39.1, 32k 73.8 vs 92.8), at 4 tokens
// the decode kernel (32k 56.1 vs 66.2 us; 8k 3.5 us slower); the former rule (64 columns) left
// the 8-token rows on the decode kernel. The host sees only shapes, so the choice is CUDA-graph
// safe. TURBOQUANT_VARLEN_KERNEL=decode|chunked forces one where the chunked kernel supports the
// shape (tests and benchmarks of each kernel; read once per process, other values warn).
static bool use_chunked_varlen(const DecodeParams& p) {
  if (p.query_start_loc == nullptr || !decode_chunked_supports(p)) return false;
  // 0: by shape, 1: decode kernel, 2: chunked kernel
  static const int forced = env_kernel_choice("TURBOQUANT_VARLEN_KERNEL", "decode", "chunked");
  if (forced != 0) return forced == 2;
  const int64_t group = p.num_q_heads / p.cache.num_kv_heads;
  return 2 * static_cast<int64_t>(p.query_rows) * group >= static_cast<int64_t>(kChunkedColumns) * p.batch;
}

// The shape-only part of the per-head kernel's split rule (turboquant/split_plan.h): CTAs per
// split from the busy CTA rows (sequences, or varlen chunks with tokens) and head chunks.
static SplitWaves per_head_split_waves(const DecodeParams& p) {
  const int per_sm = decode_heads_resident_ctas(p);
  const int group = p.num_q_heads / p.cache.num_kv_heads;
  const int busy = p.query_start_loc == nullptr ? p.batch
                                                : varlen_busy_chunks(p.query_rows, p.batch, varlen_tokens_per_cta(group));
  return decode_split_waves(p.layout.key_format == KeyFormat::kFp8, busy, p.cache.num_kv_heads * decode_head_chunks(p),
                            device_sm_count(), per_sm, kDecodeWarps);
}

// Whether a short row fills a grid sized for two CTAs per SM (SplitWaves::fill_grid,
// row_splits_in_grid): TURBOQUANT_ROW_SPLITS=fill (the default) or own (each row keeps the count
// of its own length; read once per process, for comparisons and tests).
static bool short_rows_fill_grid() {
  static const int choice = env_kernel_choice("TURBOQUANT_ROW_SPLITS", "own", "fill");
  return choice != 1;
}

// The per-head kernel's plan for contexts up to `capacity` tokens (the block table's): the grid's
// splits, and each row's share of them by its own context (p.split_waves). Returns the grid's count.
static int plan_per_head_splits(DecodeParams& p, int capacity) {
  SplitWaves w = per_head_split_waves(p);
  const int splits = std::min(splits_for_context(w, capacity), kMaxPlannedSplits);
  w.fill_grid = short_rows_fill_grid();
  w.full_context = first_context_with_splits(w, splits, capacity);  // after fill_grid, which it depends on
  p.split_waves = w;
  return splits;
}

// Decodes with attention options (windows, soft-capping, sinks) take the per-head kernel, the one
// that implements them; the row and chunked kernels serve plain causal attention.
DecodeKernel choose_decode_kernel(const DecodeParams& p) {
  if (!cuda_supports_head_dim(p.layout)) return DecodeKernel::kGeneric;
  if (p.has_attention_options()) return DecodeKernel::kHeads;
  if (use_chunked_varlen(p)) return DecodeKernel::kChunked;
  return decode_rows_supports(p) ? DecodeKernel::kRows : DecodeKernel::kHeads;
}

// Splits fill one wave with the CTAs that have work (the per-head kernel: one or two CTAs per SM
// by its split waves, each row taking its share of them by its own context (row_splits_in_grid); the row kernel:
// decode_num_splits; turboquant/split_plan.h; the chunked kernel: two): for varlen queries the grid's empty
// alignment chunks (varlen_query_chunks) are left out of the count, or a single chunk would get
// too few splits (H200, L = 32k, GQA 4, chunked kernel: 16 tokens got 16 splits instead of 33,
// 128 tokens 3 instead of 4).
void choose_decode_splits(DecodeParams& p, DecodeKernel kernel) {
  const int group = p.num_q_heads / p.cache.num_kv_heads;
  const int max_context = p.max_blocks_per_seq * p.cache.block_size;
  p.split_waves = SplitWaves{};  // every row divided into num_splits, unless the per-head kernel serves p
  if (kernel == DecodeKernel::kGeneric) {  // one CTA per (row, slice of a GQA group, split), several per SM
    const int busy = p.query_start_loc == nullptr ? p.batch : varlen_busy_chunks(p.query_rows, p.batch, 1);
    p.num_splits = std::min(default_num_splits(busy, decode_generic_head_slices(p), windowed_context(max_context, p.window, 1),
                                               device_sm_count() * kGenericCtasPerSm, kGenericMinTokensPerSplit),
                            kMaxPlannedSplits);
  } else if (kernel == DecodeKernel::kChunked) {  // 2 CTAs per SM (shared memory, 128 registers)
    const int busy = varlen_busy_chunks(p.query_rows, p.batch, chunked_tokens_per_cta(group));
    p.num_splits =
        std::min(default_num_splits(busy, p.cache.num_kv_heads, max_context, device_sm_count() * 2), kMaxPlannedSplits);
  } else if (kernel == DecodeKernel::kRows) {  // one CTA per 8 KV heads; each warp sees every tile of its split
    // Planned in CTAs: where one CTA serves two splits (Lloyd-Max keys), whole pairs of splits, so no
    // CTA has an idle half and one wave stays one wave. A CTA keeps at least kMinTokensPerSplit
    // tokens (its set-up, the pair table and the queries, is per CTA), a half at least 128. Known
    // cost (H200, bench_decode.py): B = 1 at L = 32k takes 31.3-31.8 us in 128 paired CTAs (30.8-31.0
    // with 256-token halves in 64) where the earlier one-split CTAs took 27.5; the shapes of 8 and
    // more sequences gained 2-9 %. At most 128 CTAs, as other plans' 128 splits.
    // One resident CTA per SM: Lloyd-Max keys' 16-warp CTAs are one per SM by design (RowConfig: a grid
    // of at most one per SM keeps the block scheduler from pairing busy CTAs), and FP8 keys' 8-warp
    // CTAs, though two fit, are planned one per SM as in the per-head kernel (decode_split_waves).
    const int per_cta = decode_rows_splits_per_cta(p);
    const int splits = per_cta * decode_num_splits(p.layout.key_format == KeyFormat::kFp8, p.batch,
                                                   p.cache.num_kv_heads / kRowHeads, max_context, device_sm_count(),
                                                   /*resident_per_sm=*/1, /*warps_per_range=*/1);
    p.num_splits = std::min(splits, kMaxPlannedSplits * per_cta);  // kMaxDecodeSplits at 2 per CTA
  } else {  // the per-head kernel: the grid from the tokens a CTA reads at most (the table's capacity,
            // or its window), each row's share from its own
    const int tokens_per_cta = p.query_start_loc == nullptr ? 1 : varlen_tokens_per_cta(group);
    p.num_splits = plan_per_head_splits(p, windowed_context(max_context, p.window, tokens_per_cta));
  }
}

// The chunked and row kernels merge through the workspace, the per-head kernel unless its splits
// merge in a cluster.
bool decode_uses_split_workspace(const DecodeParams& p, DecodeKernel kernel) {
  if (p.num_splits < 2) return false;
  return kernel != DecodeKernel::kHeads || !decode_heads_merge_in_cluster(p);
}

cudaError_t launch_decode(const DecodeParams& p, DecodeKernel kernel, cudaStream_t stream) {
  if (p.num_splits < 1 || p.num_splits > kMaxDecodeSplits) return cudaErrorInvalidValue;
  if (p.batch == 0 || p.num_q_heads == 0 || p.query_rows == 0) return cudaSuccess;
  if (kernel == DecodeKernel::kChunked) return launch_decode_chunked(p, stream);
  if (kernel == DecodeKernel::kGeneric) return launch_decode_generic(p, stream);
  if (decode_query_chunks(p) > 65535) return cudaErrorInvalidConfiguration;  // grid y (the row kernel: z)
  if (kernel == DecodeKernel::kRows) return launch_decode_rows(p, stream);
  if (p.query_start_loc == nullptr && forced_decode_kernel() == 2 && !p.has_attention_options()) {
    return cudaErrorNotSupported;
  }
  return launch_decode_heads(p, stream);
}

}  // namespace turboquant
