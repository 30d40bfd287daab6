// Split-KV planning shared by the CPU reference and the CUDA decode: how many splits, which
// tokens each split covers, and the log-sum-exp merge of the partial results.
#pragma once

#include <cmath>

#include "turboquant/macros.h"

namespace turboquant {

constexpr int kTokenTile = 16;        // tokens a decode warp processes per step
// Below this a split costs more to merge than it saves (the per-head decode kernel: 128, see
// decode_min_tokens_per_split).
constexpr int kMinTokensPerSplit = 256;

TQ_HD int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Splits for one decode step. Depends only on shapes (never on seq_lens values), so a captured
// CUDA graph stays valid. Enough splits to fill one wave of `resident_ctas` (CTAs the device runs
// at once): more waves only add per-CTA set-up, merge work and tail imbalance (measured on the
// H200, benchmarks/RESULTS.md). Never fewer tokens per split than min_tokens_per_split of the
// largest context the block table can hold: a serving engine whose block tables cover its longest
// model length gets the full wave of splits in the grid at every sequence length; the per-head
// decode kernel then gives each sequence the splits of its own length, or the grid's where those
// would leave it one CTA per SM of a grid sized for two (row_splits_in_grid), the row and chunked
// kernels divide it over all of them (B = 1, 32k-token tables: 16 splits of
// 16 tokens at L = 256, where 2 took 8.6 us and 16 9.7; H200, `benchmarks/sweep_splits.py --short`).
TQ_HD int default_num_splits(int batch, int ctas_per_split, int max_context, int resident_ctas,
                            int min_tokens_per_split = kMinTokensPerSplit) {
  const int base = batch * ctas_per_split;
  int splits = base > 0 ? resident_ctas / base : 1;
  const int cap = ceil_div(max_context > 0 ? max_context : 1, min_tokens_per_split);
  if (splits > cap) splits = cap;
  return splits < 1 ? 1 : splits;
}

// Splits for the decode kernels (kernels/decode.cu, decode_rows.cu), which fit `resident_per_sm`
// CTAs per SM; `warps_per_range` warps divide a split's tiles among them (8 in the per-head
// kernel; 1 in the row-staged one, whose every warp sees all tiles for its own KV head).
// Measured (H200, graph replay, `benchmarks/sweep_splits.py`, per-head kernel with the earlier
// cp.async staging; docs/DESIGN.md, "Split planning"):
//   * FP8 keys gain nothing from a second resident CTA (one CTA per SM was 2 % slower at
//     (32,32,8,8192) with the same grid), so their splits fill one CTA per SM: B=1 L=32k 36.1 ->
//     33.3 us (16 splits instead of 33), B=2 L=16k 35.8 -> 32.8, B=16 L=8k 98.6 -> 92.6 (1 vs 2);
//   * Lloyd-Max keys run 16 % faster with two CTAs per SM, but only once each split is long enough
//     to amortize its set-up (query rotation, pair table) and merge: at B=4 and B=8 (2048 tokens
//     per split, 16 tiles per warp) filling two per SM is 4-5 % faster than one, at B=1 and B=2
//     (about 1000 tokens per split, 8 tiles per warp) one per SM is 3-5 % faster.
//   * With aligned-row staging and the interleaved fragment order (a kernel bound by its
//     per-warp chain rather than by set-up): at B=1 L=32k 33 splits (7.8 tiles per warp) took
//     23.6 us against 16 splits' 26.4, at B=2 L=16k 16 splits (8 tiles) 23.7 against 8's 26.3;
//     FP8 keys still lose (25.4 -> 26.5 at B=1 L=32k). Fewer tiles per warp are not measured.
// So: two per SM only for Lloyd-Max keys whose splits keep each warp min_tiles_two_per_sm tiles:
// 7 in the per-head kernel (the 33- vs 16-split numbers above), 16 in the row kernel (the first rule,
// not re-measured: the row kernel's Lloyd-Max configurations are one CTA of two splits per SM and FP8
// keys are planned one per SM, so none reaches it).
// The fewest tokens per split: one tile per warp where warps divide a split's tiles (the per-head
// kernel: 128 tokens), else kMinTokensPerSplit. Measured (H200, graph replay, L2-resident, 4bit_nc,
// Hq 32 Hkv 8, block tables of exactly L tokens, `sweep_splits.py --short`): B = 1, L = 1k took 10.9 us in 4 splits (the 256-token cap), 10.0 in 8
// and 10.2 in 16; B = 2, L = 1k 11.1 in 4 and 10.6 in 8; at L = 256 one split took 9.1 us and two
// (merged in a cluster) 8.7.
TQ_HD int min_tiles_two_per_sm(int warps_per_range) { return warps_per_range > 1 ? 7 : 16; }
TQ_HD int decode_min_tokens_per_split(int warps_per_range) {
  return warps_per_range > 1 ? kTokenTile * warps_per_range : kMinTokensPerSplit;
}

constexpr int kMaxPlannedSplits = 128;  // splits (or row-kernel CTAs) the library plans per row at most
// Splits a caller may ask for (num_splits), on either device: the CUDA merge combines at most this
// many partial results per (query row, head).
constexpr int kMaxDecodeSplits = 256;

// The split rule in two steps: what the shapes decide (SplitWaves, on the host) and what a
// context length then decides (splits_for_context). The host applies it to the block table's
// capacity to size the grid; the per-head decode kernel applies it again, on the device, to each
// sequence's own length when the library chose the count (DecodeParams::split_waves,
// row_splits_in_grid), so a serving engine's block tables, sized for its longest model length, no
// longer give a short sequence the full wave of 16-token splits (splits keep min_tokens). Both
// give the same count for a table of exactly the sequence's length.
struct SplitWaves {
  int one_per_sm = 1;  // splits that fill one CTA per SM, before the context's cap (at least 1)
  int two_per_sm = 0;  // ... two per SM; 0 where only one is considered (FP8 keys, one resident)
  int min_tokens = kMinTokensPerSplit;  // the fewest tokens a split keeps
  int tokens_per_pass = kTokenTile;     // tokens the CTA's warps take in one step (tiles x warps)
  // Contexts from this one on take every split of the grid (first_context_with_splits), so the
  // device applies the rule only below it; 0 (the default): every context takes the whole grid.
  int full_context = 0;
  // Where a row's own rule fills one CTA per SM in a grid sized for two (row_splits_in_grid):
  // true, the row divides over the grid's splits instead; false, it keeps its own count.
  bool fill_grid = false;
};

TQ_HD SplitWaves decode_split_waves(bool fp8_keys, int batch, int ctas_per_split, int sm_count, int resident_per_sm,
                                    int warps_per_range) {
  const int base = batch * ctas_per_split;
  SplitWaves w;
  w.one_per_sm = base > 0 && sm_count / base > 1 ? sm_count / base : 1;
  w.two_per_sm = fp8_keys || resident_per_sm <= 1 ? 0 : (base > 0 ? sm_count * resident_per_sm / base : 1);
  w.min_tokens = decode_min_tokens_per_split(warps_per_range);
  w.tokens_per_pass = kTokenTile * warps_per_range;
  return w;
}

// The most splits a context of `context` tokens takes: each keeps w.min_tokens (at least 1).
TQ_HD int context_split_cap(const SplitWaves& w, int context) {
  return ceil_div(context > 0 ? context : 1, w.min_tokens);
}

// Splits for a context of `context` tokens (at least 1): the wave's count capped so each split
// keeps w.min_tokens, and two CTAs per SM only where each warp keeps min_tiles_two_per_sm tiles.
TQ_HD int splits_for_context(const SplitWaves& w, int context) {
  const int cap = context_split_cap(w, context);
  const int one = w.one_per_sm < cap ? w.one_per_sm : cap;
  if (w.two_per_sm == 0) return one;
  const int filled = w.two_per_sm < cap ? w.two_per_sm : cap;  // two_per_sm >= 1 here
  const int tiles_per_warp = context / (filled * w.tokens_per_pass);
  return filled > 1 && tiles_per_warp < min_tiles_two_per_sm(w.tokens_per_pass / kTokenTile) ? one : filled;
}

// How many of a grid of `grid_splits` splits a row of `context` tokens takes (the per-head decode kernel, on the
// device, where the library chose the count): its own count (splits_for_context), except where that fills one CTA
// per SM (w.one_per_sm) while the grid is larger, which the rule gives only where a longer capacity (a serving
// engine's block tables) called for two per SM, and w.fill_grid is set: then the whole grid, capped so each split
// keeps w.min_tokens. Per SM that is never more work than before: at most two CTAs with half the tokens each where
// one CTA held them all. Not measured where one_per_sm is clamped to 1 (67-132 CTAs per split, e.g. B = 17-33 at 4
// KV heads: every row past 128 tokens takes both CTAs of a 2-split cluster). Why: the block scheduler does not
// give a grid's first CTAs one SM each. In a grid of 8 x 33 CTAs at two per SM the first 128 in launch order
// landed on 120 SMs, 8 of them holding two (tools/probes/cta_placement_probe.cu, H200), and a
// decode CTA nearly fills an SM alone, so those 8 SMs set the time: B = 1 with 32k-token tables, the decode kernel
// took 18.1 us at L = 16k (16 splits with tokens) where a grid of exactly those 16 splits took 12.5, and 9.0
// against 6.7 at 4k. With this rule (two per SM on every SM, an even load; H200, bench_serving.py and
// sweep_splits.py --table-tokens 32768, 4bit_nc): 18.3 us per step at 16k against 23.9, 15.4 at 8k against 17.9,
// 11.8 at 4k against 13.1-14.4; B = 2 and FP8 keys unchanged. A row short enough to take fewer than one CTA per SM
// keeps its count (64 busy CTAs of 264 landed on 64 SMs).
TQ_HD int row_splits_in_grid(const SplitWaves& w, int context, int grid_splits) {
  const int own = splits_for_context(w, context);
  if (w.fill_grid && own >= w.one_per_sm && grid_splits > own) {
    const int cap = context_split_cap(w, context);
    return grid_splits < cap ? grid_splits : cap;
  }
  return own < grid_splits ? own : grid_splits;
}

// The shortest context in [0, max_context] that takes all of a grid of `num_splits` splits
// (row_splits_in_grid; max_context + 1 if none does). The rule is monotone in the context for the
// per-head kernel's waves (GTest), so every longer context takes the grid's whole count: the device
// skips the rule's divisions there (DecodeParams::split_waves, SplitWaves::full_context). With
// w.fill_grid that is from the capacity's one-per-SM count on (B = 1, 32k-token tables: 4097
// tokens instead of 29568), so rows of 4k-29k tokens skip three dependent divisions before their
// block ids load (about 0.3 us per short step where every row paid them, H200). Host only
// (a binary search).
inline int first_context_with_splits(const SplitWaves& w, int num_splits, int max_context) {
  if (row_splits_in_grid(w, max_context, num_splits) < num_splits) return max_context + 1;
  int lo = 0, hi = max_context;
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    if (row_splits_in_grid(w, mid, num_splits) >= num_splits) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

TQ_HD int decode_num_splits(bool fp8_keys, int batch, int ctas_per_split, int max_context, int sm_count,
                            int resident_per_sm, int warps_per_range) {
  return splits_for_context(
      decode_split_waves(fp8_keys, batch, ctas_per_split, sm_count, resident_per_sm, warps_per_range), max_context);
}

// Whether the row-staged decode (kernels/decode_rows.cu, one CTA per 8 KV heads) takes a plain decode it supports:
// where the batch has at least kMinRowKernelRows (sequence, 8-head group) rows and the kernel can put CTAs on at
// least half of the SMs (rows x the most splits the context allows). Measured (H200, graph replay, against the
// first per-head kernel): at L = 1024 and B = 1..8 (at most 32 CTAs) it took 19-25 us under graph replay where the
// per-head kernel took 11-17; from 128 possible CTAs up (B=1 L=32k .. B=32 L=8k) it was 10-35 % faster. With
// the per-head kernel's aligned-row staging and two CTAs per SM at 8 tiles per warp, the per-head
// kernel is as fast for one or two rows up to 16k tokens and within 2-11 % at 32k: B=1 L=32k 23.6 vs 24.4 us, B=2
// L=16k 23.7 vs 24.6 (4bit_nc; k8v4 25.3 vs 24.8 and 25.3 vs 25.2), B=2 L=32k 35.2 vs 33.6 (k8v4 41.2 vs 37.2);
// and with a serving engine's 32k-token block tables, where a shape-only choice cannot see that sequences are
// short, it is 25-30 % faster up to 4k tokens (B=1 L=256 8.8 vs 12.5 us, B=2 L=1k 9.8 vs 13.5). With those tables
// batches of 3-8 still take the row kernel at every length: at 256-1k tokens it took 12.1-17.6 us where the
// per-head kernel took 9.4-15.1; at 16k-32k the row kernel takes 0-24 % less time (the same at B=3 16k, 13-24 %
// less at B=8; 4bit_nc, H200, bench_serving.py). A mixed decode that launched both kernels, each sequence taking one
// by its own length on the device, lost at every shape but B=3-8 at 256-1k (1-45 % slower elsewhere) and was
// removed (docs/DESIGN.md). Both kernels forced at B=3-8 with those tables (`bench_serving.py --kernels heads
// rows`): per-head 1.3-3.6 us faster where every sequence is short (B=3-4 up to 4k, B=5-8 up to 1k), the row
// kernel 3-37 us faster where the batch holds 16k-32k sequences and 4-35 % faster on every mixed-length batch,
// which is what a serving engine's decode batch is; so 3 rows stay the threshold.
constexpr int kMinRowKernelRows = 3;
TQ_HD bool row_kernel_preferred(int batch, int head_groups, int max_context, int sm_count) {
  const long long rows = static_cast<long long>(batch) * head_groups;
  const int splits = max_context / kMinTokensPerSplit > 1 ? max_context / kMinTokensPerSplit : 1;
  return rows >= kMinRowKernelRows && rows * splits * 2 >= sm_count;
}

// Token range [begin, end) of split `split` for a sequence of `seq_len` tokens; chunks are whole
// token tiles so no tile straddles two splits. Empty when begin >= end.
struct TokenRange {
  int begin;
  int end;
};

TQ_HD TokenRange split_token_range(int seq_len, int num_splits, int split) {
  const int per_split = ceil_div(ceil_div(seq_len, num_splits), kTokenTile) * kTokenTile;
  const int begin = split * per_split;
  int end = begin + per_split;
  if (end > seq_len) end = seq_len;
  return {begin, end > begin ? end : begin};
}

}  // namespace turboquant
