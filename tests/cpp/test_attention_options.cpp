// Attention options (include/turboquant/attention_options.h): the one-comparison window rule is the
// windowed causal rule, and a decode CTA's token range (from its first column's window to its last
// column's limit) holds every position its columns attend to, within the tokens the split plan
// was made for.
#include <gtest/gtest.h>

#include <climits>
#include <cmath>

#include "turboquant/attention_options.h"
#include "turboquant/query_chunks.h"

namespace turboquant {
namespace {

constexpr int kWindows[] = {0, 1, 3, 15, 16, 37, 100, INT_MAX};

TEST(AttentionOptions, AttendsIsTheWindowedCausalRule) {
  for (int window : kWindows) {
    for (int limit = 0; limit <= 70; ++limit) {
      for (int pos = 0; pos <= 80; ++pos) {
        const bool expected = pos < limit && (window == INT_MAX || pos >= limit - 1 - window);
        ASSERT_EQ(attends(pos, limit, window), expected) << window << " " << limit << " " << pos;
      }
      const int start = first_attended_position(limit, window);
      for (int pos = 0; pos < limit; ++pos) ASSERT_EQ(attends(pos, limit, window), pos >= start);
    }
  }
  EXPECT_EQ(window_span(-1), INT_MAX);
  EXPECT_EQ(window_span(0), 0);
  EXPECT_EQ(window_span(4095), 4095);
}

TEST(AttentionOptions, CtaRangeHoldsEveryAttendedPositionWithinThePlannedContext) {
  const int max_context = 320;
  for (int window : kWindows) {
    for (int tokens_per_cta : {1, 2, 4, 8}) {
      const int planned = windowed_context(max_context, window, tokens_per_cta);
      ASSERT_LE(planned, max_context);
      for (int seq_len = 0; seq_len <= 300; ++seq_len) {
        for (int q_len = 1; q_len <= 20 && q_len <= seq_len; ++q_len) {
          for (int pos0 = 0; pos0 < q_len; pos0 += tokens_per_cta) {
            const int last = pos0 + tokens_per_cta - 1 < q_len ? pos0 + tokens_per_cta - 1 : q_len - 1;
            const int first = window_first_tile_token(causal_limit(seq_len, q_len, pos0), window);
            const int context = causal_limit(seq_len, q_len, last);
            ASSERT_EQ(first % kTokenTile, 0);
            ASSERT_LE(context - first, planned) << window << " " << seq_len << " " << q_len;
            for (int token = pos0; token <= last; ++token) {
              const int limit = causal_limit(seq_len, q_len, token);
              for (int pos = 0; pos < seq_len; ++pos) {
                if (attends(pos, limit, window)) ASSERT_TRUE(first <= pos && pos < context);
              }
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(windowed_context(32768, window_span(-1), 1), 32768);
  EXPECT_EQ(windowed_context(32768, 4095, 1), 4095 + 1 + kTokenTile - 1);
}

TEST(AttentionOptions, SoftcapIsCapTimesTanhOfTheLogitOverCap) {
  EXPECT_EQ(softcap_logit(3.0, 0.0), 3.0);
  EXPECT_DOUBLE_EQ(softcap_logit(3.0, 50.0), 50.0 * std::tanh(3.0 / 50.0));
  EXPECT_NEAR(softcap_logit(1e6, 30.0), 30.0, 1e-12);
  EXPECT_NEAR(softcap_logit(-1e6, 30.0), -30.0, 1e-12);
  EXPECT_FLOAT_EQ(softcap_logit(2.0f, 4.0f), 4.0f * std::tanh(0.5f));
}

}  // namespace
}  // namespace turboquant
