// The shortcuts the CUDA store takes, checked on the CPU against the plain rules they replace:
// division by a shared reciprocal vs IEEE division, Lloyd-Max bucketing on a grid vs the binary
// search, per-lane packing vs the group-of-8 packer, the lane-order sum vs a float64 sum.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "turboquant/lloyd_max.h"
#include "turboquant/lloyd_max_grid.h"
#include "turboquant/packing.h"
#include "turboquant/quantize.h"

using namespace turboquant;

namespace {

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

}  // namespace

TEST(SharedReciprocal, MatchesIeeeDivisionWheneverItsChecksPass) {
  // Dividends and divisors over the whole float range; wherever reciprocal_division_exact and
  // quotients_exact accept, the quotient must be IEEE's bit for bit.
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  std::uniform_int_distribution<int> d_exponent(-125, 124);
  std::uniform_int_distribution<int> x_exponent(-149, 127);
  std::uniform_int_distribution<int> sign(0, 1);
  long mismatches = 0, accepted = 0;
  for (int i = 0; i < 4000; ++i) {
    const float d = std::ldexp(mantissa(rng), d_exponent(rng)) * (sign(rng) ? -1.0f : 1.0f);
    if (!reciprocal_division_exact(d)) continue;
    const float r = 1.0f / d;
    for (int j = 0; j < 1000; ++j) {
      const float x = std::ldexp(mantissa(rng), x_exponent(rng)) * (sign(rng) ? -1.0f : 1.0f);
      const float want = x / d;
      if (!quotients_exact(r, std::fabs(x)) || std::isinf(want)) continue;
      ++accepted;
      mismatches += bits_of(divide_by_reciprocal(x, d, r)) != bits_of(want);
    }
  }
  EXPECT_GT(accepted, 1000000);
  EXPECT_EQ(mismatches, 0);
}

TEST(SharedReciprocal, RejectsTheTinyDividendsThatBreakIt) {
  // A review's reproducers: keys (4, 4, -0x1.fp-145, 0...) and (1, 1, -0x1.8p-146, 0...): the
  // tiny element's quotient came back one ulp off (-0 instead of -2^-149 after the rotation), which
  // moved a coordinate across the midpoint 0. The checks must send such lanes to x / d.
  const float denom_a = std::sqrt(32.0f) + kKeyNormEpsilon, denom_b = std::sqrt(2.0f) + kKeyNormEpsilon;
  EXPECT_FALSE(quotients_exact(1.0f / denom_a, std::fabs(-0x1.fp-145f)));
  EXPECT_FALSE(quotients_exact(1.0f / denom_b, std::fabs(-0x1.8p-146f)));
  EXPECT_FALSE(quotients_exact(1.0f, 0.0f));  // -0 / d would come back +0
  // Some dividends the checks reject really are inexact: the checks are needed, not decoration.
  long wrong = 0;
  for (int e = -149; e <= -110; ++e) {
    for (int m = 0; m < 64; ++m) {
      const float x = std::ldexp(1.0f + m / 64.0f, e), d = 1.37f;
      wrong += bits_of(divide_by_reciprocal(x, d, 1.0f / d)) != bits_of(x / d);
    }
  }
  EXPECT_GT(wrong, 0);
}

TEST(SharedReciprocal, KeyNormalizationAndValueCodesAgree) {
  // The store's two uses: coordinates over (norm + eps), and (v - zero) / scale.
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int t = 0; t < 20000; ++t) {
    float x[128], sq = 0.0f;
    for (float& e : x) e = normal(rng) * 3.0f;
    sq = sum_of_squares_lane_order(x, 128);
    const float denom = std::sqrt(sq) + kKeyNormEpsilon;
    ASSERT_TRUE(reciprocal_division_exact(denom));
    const float r = 1.0f / denom;
    for (float e : x) ASSERT_EQ(bits_of(divide_by_reciprocal(e, denom, r)), bits_of(e / denom)) << e << " / " << denom;
    const ValueQuantParams p = value_quant_params(-4.0f * std::fabs(normal(rng)), 4.0f * std::fabs(normal(rng)), 4);
    const float rs = 1.0f / p.scale;
    for (float e : x) {
      ASSERT_EQ(value_code_of_quotient(divide_by_reciprocal(e - p.zero, p.scale, rs), 4), value_code(e, p, 4));
    }
  }
}

TEST(SharedReciprocal, ValueCodesNeedOnlyTheDivisorCheck) {
  // Where the quotient may be one ulp off (tiny dividends), it codes to 0 like IEEE's.
  for (float scale : {0x1p-24f, 6.1e-5f, 0.013f, 1.0f, 37.5f, 65504.0f}) {
    ASSERT_TRUE(reciprocal_division_exact(scale));
    const float r = 1.0f / scale;
    for (int e = -149; e <= -90; ++e) {
      for (int m = 0; m < 32; ++m) {
        for (float sgn : {1.0f, -1.0f}) {
          const float x = sgn * std::ldexp(1.0f + m / 32.0f, e);
          ASSERT_EQ(value_code_of_quotient(divide_by_reciprocal(x, scale, r), 4), value_code_of_quotient(x / scale, 4))
              << x << " / " << scale;
        }
      }
    }
  }
}

TEST(ValueQuantParams, SignedZerosStoreTheSameBytes) {
  // The min/max reductions may meet +0 and -0 in any order; the stored fields must not care.
  const ValueQuantParams a = value_quant_params(-0.0f, 0.0f, 4), b = value_quant_params(0.0f, -0.0f, 4);
  const ValueQuantParams c = value_quant_params(-0.0f, -0.0f, 4);
  EXPECT_EQ(a.zero_bits, 0);
  EXPECT_EQ(b.zero_bits, 0);
  EXPECT_EQ(c.zero_bits, 0);
  EXPECT_EQ(a.scale_bits, 0);
  EXPECT_EQ(c.scale_bits, 0);
}

TEST(SharedReciprocal, RejectsDivisorsOutsideTheNormalRange) {
  EXPECT_FALSE(reciprocal_division_exact(0.0f));
  EXPECT_FALSE(reciprocal_division_exact(INFINITY));
  EXPECT_FALSE(reciprocal_division_exact(NAN));
  EXPECT_FALSE(reciprocal_division_exact(1e-38f));
  EXPECT_FALSE(reciprocal_division_exact(1e38f));
  EXPECT_TRUE(reciprocal_division_exact(6e-8f));  // smallest fp16 scale
  EXPECT_TRUE(std::isnan(divide_by_reciprocal(NAN, 3.0f, 1.0f / 3.0f)));
}

TEST(LloydMaxGrid, SameIndexAsBinarySearchForEveryPresetCodebook) {
  std::mt19937 rng(3);
  for (int bits : {3, 4}) {
    for (int d : {64, 128, 256}) {
      const Codebook& cb = gaussian_codebook(bits, d);
      const LloydMaxGrid g = make_lloyd_max_grid(cb);
      ASSERT_TRUE(g.usable) << bits << " bits, D=" << d;
      std::vector<GridCell> table(kGridCells);  // as each store CTA builds it
      for (int t = 0; t < kGridCells; ++t) table[t] = grid_cell_entry(cb, g, t);
      auto check = [&](float y) {
        const uint32_t want = lloyd_max_index(y, cb.midpoint, cb.levels);
        const int cell = grid_cell(y, g);
        ASSERT_TRUE(cell >= 1 && cell <= kGridCells - 1) << "y=" << y;
        const uint32_t got = lloyd_max_index_on_grid(y, table[cell]);
        ASSERT_EQ(got, want) << "y=" << y << " bits=" << bits << " D=" << d;
        const float c = cb.centroid[want];
        ASSERT_EQ(squared_centroid_on_grid(y, table[cell]), c * c) << "y=" << y;
      };
      // Every midpoint and its float neighbours (the ties and near-ties), zero and both signs.
      for (int j = 0; j < cb.levels - 1; ++j) {
        float y = cb.midpoint[j];
        for (int k = 0; k < 4; ++k) y = std::nextafter(y, -1.0f);
        for (int k = 0; k < 9; ++k, y = std::nextafter(y, 1.0f)) check(y);
      }
      check(0.0f);
      check(-0.0f);
      check(1.0f);
      check(-1.0f);
      check(kGridReach);  // the reach's ends still land inside the table
      check(-kGridReach);
      // Coordinates of unit vectors: Gaussian around 1/sqrt(D), and uniform over [-1, 1].
      std::normal_distribution<float> coordinate(0.0f, 1.0f / std::sqrt(static_cast<float>(d)));
      std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
      for (int i = 0; i < 200000; ++i) {
        check(coordinate(rng));
        check(uniform(rng));
      }
    }
  }
}

TEST(LloydMaxGrid, UnusableWhenTwoMidpointsShareACell) {
  Codebook cb;
  cb.bits = 2;
  cb.levels = 4;
  const float mids[3] = {-0.5f, 0.5f, 0.5f + 1e-7f};
  for (int j = 0; j < 3; ++j) cb.midpoint[j] = mids[j];
  EXPECT_FALSE(make_lloyd_max_grid(cb).usable);
}

template <int E, int kBits>
void expect_lane_pieces_match_the_stream() {
  std::mt19937 rng(kBits * 100 + E);
  constexpr int kLanes = 8, kBytes = E * kBits / 8;
  std::vector<uint8_t> idx(E * kLanes);
  for (uint8_t& i : idx) i = static_cast<uint8_t>(rng() & ((1u << kBits) - 1u));
  std::vector<uint8_t> stream(kBytes * kLanes + 4, 0);
  if (kBits == 8) {
    std::memcpy(stream.data(), idx.data(), idx.size());  // FP8 keys: one byte per element
  } else {
    pack_indices(idx.data(), E * kLanes, kBits, stream.data());
  }
  for (int lane = 0; lane < kLanes; ++lane) {
    uint32_t codes[E];
    for (int j = 0; j < E; ++j) codes[j] = idx[lane * E + j];
    uint32_t words[(E * kBits + 31) / 32];
    pack_codes<E, kBits>(codes, words);
    uint8_t bytes[sizeof(words)];
    std::memcpy(bytes, words, sizeof(words));
    for (int b = 0; b < kBytes; ++b) ASSERT_EQ(bytes[b], stream[lane * kBytes + b]) << "lane " << lane << " byte " << b;
  }
}

TEST(PackCodes, LanePiecesAreTheStreamBytes) {
  expect_lane_pieces_match_the_stream<16, 3>();
  expect_lane_pieces_match_the_stream<16, 4>();
  expect_lane_pieces_match_the_stream<16, 8>();
  expect_lane_pieces_match_the_stream<12, 4>();
  expect_lane_pieces_match_the_stream<12, 8>();
}

TEST(LaneOrderSum, GroupSplitAndCloseToFloat64) {
  EXPECT_EQ(vector_lanes(64), 4);
  EXPECT_EQ(vector_lanes(96), 8);
  EXPECT_EQ(vector_lanes(128), 8);
  EXPECT_EQ(vector_lanes(256), 16);
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int d : {64, 96, 128, 256}) {
    std::vector<float> x(d);
    double exact = 0.0;
    for (float& e : x) {
      e = normal(rng);
      exact += static_cast<double>(e) * e;
    }
    EXPECT_NEAR(sum_of_squares_lane_order(x.data(), d), exact, 1e-5 * exact) << d;
  }
}
