// The shortcuts the CUDA store takes, checked on the CPU against the plain rules they replace:
// Lloyd-Max bucketing on a grid vs the binary search, per-lane packing vs the group-of-8 packer,
// the lane-order sum vs a float64 sum; and the divisor range of its value-code reciprocal.
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
  expect_lane_pieces_match_the_stream<32, 3>();  // the store's lanes at D = 64, 128, 256
  expect_lane_pieces_match_the_stream<32, 4>();
  expect_lane_pieces_match_the_stream<32, 8>();
  expect_lane_pieces_match_the_stream<24, 4>();  // D = 96
  expect_lane_pieces_match_the_stream<24, 8>();
}

TEST(LaneOrderSum, GroupSplitAndCloseToFloat64) {
  EXPECT_EQ(vector_lanes(64), 2);
  EXPECT_EQ(vector_lanes(96), 4);
  EXPECT_EQ(vector_lanes(128), 4);
  EXPECT_EQ(vector_lanes(256), 8);
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
