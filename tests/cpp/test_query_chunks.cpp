// Varlen query chunks (include/turboquant/query_chunks.h): walking the whole launch grid on the
// host, every query row of every sequence is served exactly once, by a chunk of its own sequence,
// with its position in the sequence's chunk; garbage starts stay in bounds.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "turboquant/query_chunks.h"

namespace turboquant {
namespace {

TEST(QueryChunks, TokensPerCtaFillTheColumnsWithWholeGroups) {
  EXPECT_EQ(varlen_tokens_per_cta(1), 8);
  EXPECT_EQ(varlen_tokens_per_cta(2), 4);
  EXPECT_EQ(varlen_tokens_per_cta(3), 2);  // 6 of 8 columns
  EXPECT_EQ(varlen_tokens_per_cta(4), 2);
  EXPECT_EQ(varlen_tokens_per_cta(5), 1);
  EXPECT_EQ(varlen_tokens_per_cta(8), 1);
  EXPECT_EQ(varlen_tokens_per_cta(16), 1);  // head chunks of 8, one token each
  EXPECT_EQ(chunked_tokens_per_cta(4), 16);
  EXPECT_EQ(chunked_tokens_per_cta(3), 21);  // 63 of 64 columns
  EXPECT_EQ(chunked_tokens_per_cta(1), 64);
}

TEST(QueryChunks, GridServesEveryRowOnceWithItsPosition) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 400; ++trial) {
    const int batch = 1 + static_cast<int>(rng() % 9);
    const int group = 1 + static_cast<int>(rng() % 17);
    std::vector<int32_t> starts{0};
    for (int b = 0; b < batch; ++b) {
      const int q_len = rng() % 4 == 0 ? 0 : 1 + static_cast<int>(rng() % 130);
      starts.push_back(starts.back() + q_len);
    }
    const int total_q = starts.back();
    // Both kernels' chunk sizes: the decode kernel's 8 columns, the chunked kernel's 64.
    const int t = trial % 2 == 0 || group > 8 ? varlen_tokens_per_cta(group) : chunked_tokens_per_cta(group);
    std::vector<int> served(total_q, 0);
    const int chunks = varlen_query_chunks(total_q, batch, t);
    for (int chunk = 0; chunk < chunks; ++chunk) {
      const QueryChunk c = locate_query_chunk(starts.data(), batch, total_q, t, chunk);
      ASSERT_LE(c.tokens, t);
      for (int i = 0; i < c.tokens; ++i) {
        const int row = c.row0 + i;
        ASSERT_GE(row, starts[c.seq]);
        ASSERT_LT(row, starts[c.seq + 1]) << "a chunk crossed into the next sequence";
        EXPECT_EQ(c.pos0 + i, row - starts[c.seq]);
        EXPECT_EQ(c.q_len, starts[c.seq + 1] - starts[c.seq]);
        ++served[row];
      }
    }
    for (int row = 0; row < total_q; ++row) ASSERT_EQ(served[row], 1) << "row " << row << " trial " << trial;
  }
}

TEST(QueryChunks, BusyChunkEstimateNeverExceedsTheChunksThatHoldTokens) {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 400; ++trial) {
    const int batch = 1 + static_cast<int>(rng() % 9);
    const int t = trial % 2 == 0 ? varlen_tokens_per_cta(1 + static_cast<int>(rng() % 8))
                                 : chunked_tokens_per_cta(1 + static_cast<int>(rng() % 8));
    std::vector<int32_t> starts{0};
    for (int b = 0; b < batch; ++b) starts.push_back(starts.back() + 1 + static_cast<int>(rng() % 130));
    const int total_q = starts.back();
    int busy = 0;
    for (int chunk = 0; chunk < varlen_query_chunks(total_q, batch, t); ++chunk) {
      busy += locate_query_chunk(starts.data(), batch, total_q, t, chunk).tokens > 0;
    }
    const int estimate = varlen_busy_chunks(total_q, batch, t);
    EXPECT_LE(estimate, busy);  // never fewer splits than one wave of the busy chunks needs
    EXPECT_GE(estimate, (total_q + t - 1) / t);
    if (batch == 1) EXPECT_EQ(estimate, busy);  // one sequence: exact
  }
}

TEST(QueryChunks, PlainDecodeIsOneTokenPerSequence) {
  const std::vector<int32_t> starts{0, 1, 2, 3};
  for (int chunk = 0; chunk < varlen_query_chunks(3, 3, 8); ++chunk) {
    const QueryChunk c = locate_query_chunk(starts.data(), 3, 3, 8, chunk);
    if (c.tokens > 0) {
      EXPECT_EQ(c.row0, c.seq);
      EXPECT_EQ(c.tokens, 1);
    }
  }
}

TEST(QueryChunks, GarbageStartsStayInBounds) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    const int batch = 1 + static_cast<int>(rng() % 6), total_q = static_cast<int>(rng() % 50);
    std::vector<int32_t> starts(batch + 1);
    for (auto& s : starts) s = static_cast<int32_t>(rng() % 200) - 100;
    const int t = varlen_tokens_per_cta(1 + static_cast<int>(rng() % 8));
    for (int chunk = 0; chunk < varlen_query_chunks(total_q, batch, t); ++chunk) {
      const QueryChunk c = locate_query_chunk(starts.data(), batch, total_q, t, chunk);
      ASSERT_GE(c.seq, 0);
      ASSERT_LT(c.seq, batch);
      if (c.tokens > 0) {
        ASSERT_GE(c.row0, 0);
        ASSERT_LE(c.row0 + c.tokens, total_q);
      }
    }
  }
}

TEST(QueryChunks, CausalLimits) {
  EXPECT_EQ(causal_limit(100, 4, 0), 97);   // first chunk token sees the context and itself
  EXPECT_EQ(causal_limit(100, 4, 3), 100);  // last sees everything
  EXPECT_EQ(causal_limit(2, 5, 0), 0);      // seq_len < q_len: early rows see nothing
  EXPECT_EQ(causal_limit(2, 5, 4), 2);
  EXPECT_EQ(causal_limit(0, 1, 0), 0);
}

}  // namespace
}  // namespace turboquant
