// Split-KV planning shared by the CPU reference and the CUDA decode: how many splits, which
// tokens each split covers, and the log-sum-exp merge of the partial results.
#pragma once

#include <cmath>

#include "turboquant/macros.h"

namespace turboquant {

constexpr int kTokenTile = 16;        // tokens a decode warp processes per step
constexpr int kMinTokensPerSplit = 256;  // below this a split costs more to merge than it saves

TQ_HD int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Splits for one decode step. Depends only on shapes (never on seq_lens values), so a captured
// CUDA graph stays valid. Enough splits to fill one wave of `resident_ctas` (CTAs the device runs
// at once): more waves only add per-CTA set-up, merge work and tail imbalance (measured on the
// H200, benchmarks/RESULTS.md). Never fewer tokens per split than kMinTokensPerSplit of the
// largest context the block table can hold.
TQ_HD int default_num_splits(int batch, int ctas_per_split, int max_context, int resident_ctas) {
  const int base = batch * ctas_per_split;
  int splits = base > 0 ? resident_ctas / base : 1;
  const int cap = ceil_div(max_context > 0 ? max_context : 1, kMinTokensPerSplit);
  if (splits > cap) splits = cap;
  return splits < 1 ? 1 : splits;
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
