// Split-KV planning (include/turboquant/split_plan.h): one wave of resident CTAs, capped by the
// context, and token ranges that tile a sequence in whole 16-token tiles.
#include <gtest/gtest.h>

#include <algorithm>

#include "turboquant/split_plan.h"

namespace turboquant {
namespace {

TEST(SplitPlan, FillsOneWaveOfResidentCtas) {
  // 132 SMs x 2 resident CTAs = 264 slots.
  EXPECT_EQ(default_num_splits(32, 8, 8192, 264), 1);    // 256 CTAs already fill the wave
  EXPECT_EQ(default_num_splits(8, 8, 8192, 264), 4);     // 64 per split -> 4 splits, 256 CTAs
  EXPECT_EQ(default_num_splits(1, 8, 32768, 264), 33);   // floor(264 / 8)
  EXPECT_EQ(default_num_splits(300, 8, 8192, 264), 1);   // more CTAs than slots: never 0
}

TEST(SplitPlan, NeverBelowMinimumTokensPerSplit) {
  EXPECT_EQ(default_num_splits(1, 8, 1024, 264), 1024 / kMinTokensPerSplit);
  EXPECT_EQ(default_num_splits(1, 8, 1, 264), 1);
  EXPECT_EQ(default_num_splits(1, 8, 0, 264), 1);  // empty block table
  EXPECT_EQ(default_num_splits(0, 8, 8192, 264), 1);
}

TEST(SplitPlan, DecodeFillsTwoPerSmOnlyForLongLloydMaxSplits) {
  // 132 SMs, 2 resident decode CTAs each. The per-head kernel: 8 KV heads x 1 head chunk per
  // sequence, 8 warps per split's tiles.
  EXPECT_EQ(decode_num_splits(false, 4, 8, 16384, 132, 2, 8), 8);  // 2048 tokens per split: two per SM
  EXPECT_EQ(decode_num_splits(false, 8, 8, 8192, 132, 2, 8), 4);
  EXPECT_EQ(decode_num_splits(false, 16, 8, 8192, 132, 2, 8), 2);
  EXPECT_EQ(decode_num_splits(false, 1, 8, 32768, 132, 2, 8), 33);  // 7.8 tiles per warp: two per SM
  EXPECT_EQ(decode_num_splits(false, 2, 8, 16384, 132, 2, 8), 16);  // 8 tiles per warp
  EXPECT_EQ(decode_num_splits(false, 1, 8, 16384, 132, 2, 8), 16);  // 33 would leave 3.9: one per SM
  EXPECT_EQ(decode_num_splits(false, 32, 8, 8192, 132, 2, 8), 1);  // the grid fills the SMs unsplit
  // Short contexts: the per-head kernel's splits keep one 16-token tile per warp (128 tokens).
  EXPECT_EQ(decode_num_splits(false, 1, 8, 1024, 132, 2, 8), 8);  // one per SM would allow 16
  EXPECT_EQ(decode_num_splits(true, 1, 8, 1024, 132, 2, 8), 8);
  EXPECT_EQ(decode_num_splits(false, 2, 8, 1024, 132, 2, 8), 8);
  EXPECT_EQ(decode_num_splits(false, 1, 8, 256, 132, 2, 8), 2);
  EXPECT_EQ(decode_num_splits(false, 1, 8, 100, 132, 2, 8), 1);
  EXPECT_EQ(decode_num_splits(false, 4, 8, 1024, 132, 2, 8), 4);  // one wave at one per SM: 132 / 32
  EXPECT_EQ(decode_num_splits(false, 1, 8, 32768, 132, 1, 8), 16);  // one resident CTA: nothing to choose
  // FP8 keys: always one per SM.
  EXPECT_EQ(decode_num_splits(true, 1, 8, 32768, 132, 2, 8), 16);
  EXPECT_EQ(decode_num_splits(true, 4, 8, 16384, 132, 2, 8), 4);
  EXPECT_EQ(decode_num_splits(true, 16, 8, 8192, 132, 2, 8), 1);
  // The row-staged kernel: one CTA per 8 KV heads, every warp sees all of its split's tiles, planned
  // one resident CTA per SM (decode_plan.cu; a Lloyd-Max CTA then serves two of these splits).
  EXPECT_EQ(decode_num_splits(false, 32, 1, 8192, 132, 1, 1), 4);  // 132 / 32 CTAs: 128 tiles per warp
  EXPECT_EQ(decode_num_splits(false, 1, 1, 4096, 132, 1, 1), 16);  // the 256-token cap: 16 tiles per warp
  EXPECT_EQ(decode_num_splits(false, 1, 1, 1024, 132, 1, 1), 1024 / kMinTokensPerSplit);
  // Two resident CTAs change nothing for FP8 keys (the same count as one) ...
  EXPECT_EQ(decode_num_splits(true, 32, 1, 8192, 132, 2, 1), 4);
  EXPECT_EQ(decode_num_splits(true, 32, 1, 8192, 132, 1, 1), 4);
  // ... and for Lloyd-Max keys fill two per SM where each warp keeps 16 tiles (min_tiles_two_per_sm): 8 of 64.
  EXPECT_EQ(decode_num_splits(false, 32, 1, 8192, 132, 2, 1), 8);
}

TEST(SplitPlan, RowKernelFromThreeRowsWhereItsGridFillsHalfTheSms) {
  EXPECT_TRUE(row_kernel_preferred(3, 1, 32768, 132));  // up to 128 splits per row
  EXPECT_TRUE(row_kernel_preferred(32, 1, 8192, 132));
  EXPECT_TRUE(row_kernel_preferred(2, 4, 4096, 132));   // 32 KV heads: 4 head groups
  EXPECT_TRUE(row_kernel_preferred(1, 4, 32768, 132));
  // One or two (sequence, 8-head group) rows: the per-head kernel, whatever the context.
  EXPECT_FALSE(row_kernel_preferred(1, 1, 32768, 132));
  EXPECT_FALSE(row_kernel_preferred(2, 1, 131072, 132));
  EXPECT_FALSE(row_kernel_preferred(1, 2, 32768, 132));
  EXPECT_FALSE(row_kernel_preferred(8, 1, 1024, 132));  // 32 CTAs at most
  EXPECT_FALSE(row_kernel_preferred(1, 1, 1024, 132));
  EXPECT_FALSE(row_kernel_preferred(1, 1, 0, 132));     // empty block table: one split
}

// The split rule written as one function: the reference that decode_split_waves and
// splits_for_context together must equal.
int reference_decode_num_splits(bool fp8_keys, int batch, int ctas_per_split, int max_context, int sm_count,
                                int resident_per_sm, int warps_per_range) {
  const int min_tokens = warps_per_range > 1 ? kTokenTile * warps_per_range : kMinTokensPerSplit;
  const int one_per_sm = default_num_splits(batch, ctas_per_split, max_context, sm_count, min_tokens);
  if (fp8_keys || resident_per_sm <= 1) return one_per_sm;
  const int filled = default_num_splits(batch, ctas_per_split, max_context, sm_count * resident_per_sm, min_tokens);
  const int tiles_per_warp = max_context / filled / (kTokenTile * warps_per_range);
  return filled > 1 && tiles_per_warp < min_tiles_two_per_sm(warps_per_range) ? one_per_sm : filled;
}

TEST(SplitPlan, AContextGetsTheSplitsOfItsOwnLength) {
  // B = 1 at 8 KV heads, the per-head kernel on 132 SMs with two CTAs per SM possible: the grid is
  // sized by a serving engine's 32k-token block table, each sequence by its own length.
  const SplitWaves w = decode_split_waves(false, 1, 8, 132, 2, 8);
  EXPECT_EQ(splits_for_context(w, 32768), 33);  // 7.8 tiles per warp: two per SM
  EXPECT_EQ(splits_for_context(w, 16384), 16);  // 33 would leave 3.9: one per SM
  EXPECT_EQ(splits_for_context(w, 256), 2);     // 128 tokens each, as a table of exactly 256 gets
  EXPECT_EQ(splits_for_context(w, 1024), 8);
  EXPECT_EQ(splits_for_context(w, 1), 1);
  EXPECT_EQ(splits_for_context(w, 0), 1);
  // The device skips the rule from the first context that takes the whole grid on.
  EXPECT_EQ(first_context_with_splits(w, 16, 32768), 15 * 128 + 1);
  EXPECT_EQ(first_context_with_splits(w, 33, 32768), 33 * 7 * 128);  // from 7 tiles per warp on
  EXPECT_EQ(first_context_with_splits(w, 2, 256), 129);
  EXPECT_EQ(first_context_with_splits(w, 1, 32768), 0);
  EXPECT_EQ(first_context_with_splits(w, 34, 32768), 32769) << "a count the rule never gives: the rule everywhere";
  for (int batch : {1, 3, 8}) {
    const SplitWaves waves = decode_split_waves(false, batch, 8, 132, 2, 8);
    for (int capacity : {256, 1000, 32768}) {
      const int grid = splits_for_context(waves, capacity);
      const int first = first_context_with_splits(waves, grid, capacity);
      for (int context = 0; context <= capacity; context += 13) {
        EXPECT_EQ(splits_for_context(waves, context) >= grid, context >= first) << context << " of " << capacity;
      }
    }
  }
  // Two per SM once each warp keeps 7 tiles: B = 4 fills 8 splits of 4096 tokens.
  EXPECT_EQ(splits_for_context(decode_split_waves(false, 4, 8, 132, 2, 8), 32768), 8);
  EXPECT_EQ(splits_for_context(decode_split_waves(false, 4, 8, 132, 2, 8), 1024), 4);
  for (bool fp8 : {false, true}) {
    for (int batch : {0, 1, 2, 4, 8, 32, 300}) {
      for (int resident : {1, 2}) {
        for (int warps : {1, 8}) {
          const SplitWaves waves = decode_split_waves(fp8, batch, 8, 132, resident, warps);
          int previous = 1;
          for (int context = 0; context <= 70000; context += 7) {
            const int splits = splits_for_context(waves, context);
            EXPECT_EQ(splits, reference_decode_num_splits(fp8, batch, 8, context, 132, resident, warps))
                << context << " tokens, batch " << batch;
            // The per-head kernel (8 warps per range) applies the rule per sequence: never more
            // splits for a shorter context, so a sequence shorter than the table's capacity takes
            // at most the grid's count (row_splits_in_grid's min still caps it where the planner's
            // kMaxPlannedSplits leaves the grid below a long row's own count). The row kernel's
            // rule (1 warp) is not monotone (B = 1: 17 splits at 4352 tokens, 16 at 4353) and is
            // applied to the capacity only.
            if (warps == 8) EXPECT_GE(splits, previous) << context << " tokens, batch " << batch;
            previous = splits;
          }
        }
      }
    }
  }
}

TEST(SplitPlan, ARowThatWouldFillOneCtaPerSmOfATwoPerSmGridTakesTheGrid) {
  // B = 1 at 8 KV heads with a 32k-token table: a grid of 33 splits (two CTAs per SM).
  SplitWaves w = decode_split_waves(false, 1, 8, 132, 2, 8);
  const int grid = splits_for_context(w, 32768);
  ASSERT_EQ(grid, 33);
  w.fill_grid = true;
  EXPECT_EQ(row_splits_in_grid(w, 16384, grid), 33);  // its own rule: 16, one per SM
  EXPECT_EQ(row_splits_in_grid(w, 4096, grid), 32);   // capped: 128 tokens per split
  EXPECT_EQ(row_splits_in_grid(w, 2048, grid), 16);   // the cap is its own count
  EXPECT_EQ(row_splits_in_grid(w, 1024, grid), 8);    // fewer than one per SM: its own
  EXPECT_EQ(row_splits_in_grid(w, 256, grid), 2);
  EXPECT_EQ(row_splits_in_grid(w, 0, grid), 1);
  EXPECT_EQ(row_splits_in_grid(w, 16384, 16), 16) << "a table of exactly 16k tokens: the grid is its own count";
  // The device skips the rule where rows take the whole grid: with fill_grid from 33 x 128 tokens
  // on rather than from 7 tiles per warp (33 x 7 x 128).
  EXPECT_EQ(first_context_with_splits(w, grid, 32768), 32 * 128 + 1);
  // Without fill_grid (TURBOQUANT_ROW_SPLITS=own) and for FP8 keys (one CTA per SM, no second
  // wave to fill): the row's own count.
  SplitWaves own = w;
  own.fill_grid = false;
  EXPECT_EQ(row_splits_in_grid(own, 16384, grid), 16);
  EXPECT_EQ(row_splits_in_grid(own, 4096, grid), 16);
  SplitWaves fp8 = decode_split_waves(true, 1, 8, 132, 2, 8);
  fp8.fill_grid = true;
  EXPECT_EQ(row_splits_in_grid(fp8, 4096, splits_for_context(fp8, 32768)), 16);
  // B = 25 at 4 KV heads (100 CTAs per split): one CTA per SM is 1 split, the grid 2 (merged in a
  // cluster), so a row of more than 128 tokens takes both.
  SplitWaves wide = decode_split_waves(false, 25, 4, 132, 2, 8);
  wide.fill_grid = true;
  ASSERT_EQ(splits_for_context(wide, 32768), 2);
  EXPECT_EQ(row_splits_in_grid(wide, 1000, 2), 2);
  EXPECT_EQ(row_splits_in_grid(wide, 128, 2), 1);
  // Everywhere: between 1 and the grid, never below the row's own count (capped by the grid),
  // never a split of fewer than min_tokens tokens beyond the own count's, and never fewer splits
  // for a longer context (so full_context still marks where rows take the whole grid).
  for (bool fp8_keys : {false, true}) {
    // 8 KV heads, and 1 (B = 1: a grid capped at kMaxPlannedSplits as decode_plan.cu's planner caps
    // it, below a long row's own count of 132)
    const int shapes[][2] = {{1, 8}, {2, 8}, {3, 8}, {4, 8}, {8, 8}, {17, 8}, {1, 1}, {2, 1}, {4, 1}};
    for (const auto& shape : shapes) {
      const int batch = shape[0], heads = shape[1];
      SplitWaves waves = decode_split_waves(fp8_keys, batch, heads, 132, 2, 8);
      waves.fill_grid = true;
      for (int capacity : {256, 4096, 32768, 131072}) {
        const int grid_splits = std::min(splits_for_context(waves, capacity), kMaxPlannedSplits);
        const int full_context = first_context_with_splits(waves, grid_splits, capacity);
        int previous = 1;
        for (int context = 0; context <= capacity; context += 61) {
          const int splits = row_splits_in_grid(waves, context, grid_splits);
          const int own_splits = std::min(splits_for_context(waves, context), grid_splits);
          EXPECT_GE(splits, 1);
          EXPECT_LE(splits, grid_splits);
          EXPECT_GE(splits, own_splits) << context << " tokens, batch " << batch;
          if (splits > own_splits) EXPECT_LE(splits, ceil_div(context, waves.min_tokens)) << context;
          EXPECT_GE(splits, previous) << context << " tokens, batch " << batch << ", capacity " << capacity;
          // The device skips the rule from full_context on and takes the whole grid: the rule
          // must give the grid there too.
          if (context >= full_context) {
            EXPECT_EQ(splits, grid_splits) << context << " tokens, batch " << batch << ", capacity " << capacity;
          }
          previous = splits;
        }
      }
    }
  }
}

TEST(SplitPlan, RangesTileTheSequenceInWholeTiles) {
  // Up to the longest context the argument checks accept (2^30 tokens: op_checks.cpp) and the
  // most splits (256), where the 32-bit split ends must not wrap.
  for (int seq_len : {0, 1, 15, 16, 17, 1000, 8192, 131149, (1 << 30) - 4097, (1 << 30) - 1, 1 << 30}) {
    for (int splits : {1, 3, 7, 33, 255, kMaxDecodeSplits}) {
      int covered = 0;
      for (int s = 0; s < splits; ++s) {
        const TokenRange r = split_token_range(seq_len, splits, s);
        ASSERT_LE(r.begin, r.end);
        if (r.end > r.begin) {
          EXPECT_EQ(r.begin, covered) << "ranges are contiguous";
          EXPECT_EQ(r.begin % kTokenTile, 0) << "a tile never straddles two splits";
          covered = r.end;
        }
      }
      EXPECT_EQ(covered, seq_len) << seq_len << " tokens, " << splits << " splits";
    }
  }
}

}  // namespace
}  // namespace turboquant
