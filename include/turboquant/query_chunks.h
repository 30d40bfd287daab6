// Which query rows one decode CTA serves. Shared by the CUDA launch (grid size), the kernel (its
// CTA's rows) and the host tests that walk the whole grid.
//
// A decode CTA multiplies each key tile by 8 query columns (the MMA's N dimension). In a plain
// decode the columns are the query heads of one GQA group (one token per sequence). For
// multi-token queries (varlen: continuation chunks, speculative verification) a CTA serves
// `tokens_per_cta` consecutive query tokens of one sequence, each with all heads of its group,
// so every key tile it reads serves tokens_per_cta x group columns instead of group.
#pragma once

#include <cstdint>

#include "turboquant/macros.h"

namespace turboquant {

constexpr int kDecodeColumns = 8;  // query columns per decode CTA (mma m16n8k16: N = 8)
constexpr int kDecodeWarps = 8;    // per CTA of the decode kernels (a row-kernel CTA: per split it serves)
constexpr int kDecodeThreads = kDecodeWarps * 32;

// Query tokens per CTA for a GQA group: as many whole groups as fit in the columns. Groups
// larger than the columns take several CTAs per token (head chunks), one token each.
TQ_HD int varlen_tokens_per_cta(int group) {
  return group >= kDecodeColumns ? 1 : kDecodeColumns / group;
}

// The chunked varlen kernel (kernels/decode_chunked.cu, GQA groups up to 8): 64 columns per CTA,
// 8 per warp, so each key tile it loads and dequantizes serves 64 / group query tokens.
constexpr int kChunkedColumns = 64;
TQ_HD int chunked_tokens_per_cta(int group) { return kChunkedColumns / group; }

// Chunk index space of a varlen launch: sequence b owns chunks [F_b, F_{b+1}) with
// F_b = start_b / T + b. F_{b+1} - F_b = floor(end_b / T) - floor(start_b / T) + 1 >= ceil(q_len_b / T),
// so every token gets a chunk, F strictly increases (a chunk belongs to one sequence), and the
// count depends only on shapes (total_q, batch): the launch is CUDA-graph capturable.
TQ_HD int varlen_query_chunks(int total_q, int batch, int tokens_per_cta) {
  return total_q / tokens_per_cta + batch;
}

// Chunks of a varlen launch that hold query tokens, as far as shapes tell: max(ceil(total_q / T),
// min(batch, total_q)). A lower bound of the busy chunks when every sequence has a token and every
// row belongs to a sequence (GTest); empty sequences or rows past the last sequence can make it
// larger. The rest of the grid (the alignment slack of varlen_query_chunks) exits at once, so the
// split heuristic sizes the launch by this count, not by the grid; an undercount only overfills
// the wave.
TQ_HD int varlen_busy_chunks(int total_q, int batch, int tokens_per_cta) {
  const int by_tokens = (total_q + tokens_per_cta - 1) / tokens_per_cta;
  const int by_sequences = batch < total_q ? batch : total_q;
  return by_tokens > by_sequences ? by_tokens : by_sequences;
}

struct QueryChunk {
  int seq;     // sequence index
  int row0;    // first query row (index into the [total_q, Hq, D] query)
  int tokens;  // rows row0 .. row0 + tokens - 1 (0: nothing to do)
  int pos0;    // row0's position in its sequence's chunk of queries
  int q_len;   // query tokens of the sequence
};

// query_start_loc[i] clamped into [0, total_q], so rows stay in bounds whatever the input.
TQ_HD int clamped_start(const int32_t* query_start_loc, int i, int total_q) {
  const int s = query_start_loc[i];
  return s < 0 ? 0 : (s > total_q ? total_q : s);
}

// The rows of chunk `chunk` (0 <= chunk < varlen_query_chunks). Binary search over the sequences
// (log2(batch) loads of query_start_loc). Garbage starts (decreasing, out of range) give
// arbitrary but in-bounds rows.
TQ_HD QueryChunk locate_query_chunk(const int32_t* query_start_loc, int batch, int total_q,
                                           int tokens_per_cta, int chunk) {
  const int t = tokens_per_cta;
  int lo = 0, hi = batch - 1;
  while (lo < hi) {  // largest b with F_b <= chunk
    const int mid = (lo + hi + 1) / 2;
    if (clamped_start(query_start_loc, mid, total_q) / t + mid <= chunk) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  const int start = clamped_start(query_start_loc, lo, total_q);
  const int end = clamped_start(query_start_loc, lo + 1, total_q);
  const int first = start / t + lo;
  const int row0 = start + (chunk - first) * t;
  const int last = end < row0 + t ? end : row0 + t;
  const int q_len = end > start ? end - start : 0;
  return {lo, row0, last > row0 && chunk >= first ? last - row0 : 0, row0 - start, q_len};
}

// Causal limit of query row `pos` of a sequence with `q_len` query tokens and `seq_len` cached
// tokens (the chunk's own included): it sees positions [0, limit).
TQ_HD int causal_limit(int seq_len, int q_len, int pos) {
  const int limit = seq_len - q_len + 1 + pos;
  return limit < 0 ? 0 : (limit > seq_len ? seq_len : limit);
}

// The query columns of a decode CTA: column j is query head head0 + j % heads of query row
// chunk.row0 + j / heads and sees cached positions [0, limit(j)); columns from count() on are
// unused (limit 0: every score masked).
struct QueryColumns {
  QueryChunk chunk;
  int heads;        // query heads of each token in this CTA
  int head0;        // the first of them
  int seq_len;      // cached tokens of the sequence, the chunk's own included (clamped)
  int num_q_heads;  // row stride of the query, in heads
  TQ_HD int count() const { return chunk.tokens * heads; }
  TQ_HD int limit(int j) const { return limit(j, j / heads); }
  TQ_HD int limit(int j, int token) const {  // the same, given token = j / heads
    return j < count() ? causal_limit(seq_len, chunk.q_len, chunk.pos0 + token) : 0;
  }
  TQ_HD int64_t row(int j) const { return row(j, j / heads); }  // index of the column's [head_dim] vector in query and out
  TQ_HD int64_t row(int j, int token) const {  // the same, given token = j / heads
    return static_cast<int64_t>(chunk.row0 + token) * num_q_heads + head0 + (j - token * heads);
  }
};

}  // namespace turboquant
