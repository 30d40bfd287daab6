// Hadamard rotation and the host slot codec.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "turboquant/hadamard.h"
#include "turboquant/hadamard_transform.h"
#include "turboquant/lloyd_max.h"
#include "turboquant/preset.h"
#include "turboquant/slot_codec.h"

using namespace turboquant;

TEST(Hadamard, PaleyFactorsAreSymmetricHadamardMatrices) {
  for (int m : {12, 20, 28}) {
    auto entry = [&](int r, int c) { return ((paley_row(m, r) >> c) & 1u) ? -1 : 1; };
    for (int r = 0; r < m; ++r) {
      ASSERT_EQ(paley_row(m, r) >> m, 0u);  // no bits past the order
      for (int s = 0; s < m; ++s) {
        ASSERT_EQ(entry(r, s), entry(s, r));
        int dot = 0;
        for (int c = 0; c < m; ++c) dot += entry(r, c) * entry(s, c);
        ASSERT_EQ(dot, r == s ? m : 0) << m << " " << r << " " << s;
      }
    }
  }
}

TEST(Hadamard, OrdersAreAPowerOfTwoTimesOneOfTheFactors) {
  EXPECT_EQ(hadamard_paley_order(64), 1);
  EXPECT_EQ(hadamard_paley_order(96), 12);
  EXPECT_EQ(hadamard_paley_order(24), 12);
  EXPECT_EQ(hadamard_paley_order(80), 20);
  EXPECT_EQ(hadamard_paley_order(160), 20);
  EXPECT_EQ(hadamard_paley_order(112), 28);
  EXPECT_EQ(hadamard_paley_order(224), 28);
  EXPECT_EQ(hadamard_paley_order(12), 12);
  for (int d : {0, 6, 9, 10, 14, 72, 120, 144, 200}) EXPECT_EQ(hadamard_paley_order(d), 0) << d;
}

TEST(Hadamard, OrthonormalAndSymmetric) {
  for (int d : {8, 24, 40, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256}) {
    const std::vector<float>& h = orthonormal_hadamard(d);
    for (int i = 0; i < d; ++i) {
      for (int j = 0; j < d; ++j) {
        ASSERT_EQ(h[i * d + j], h[j * d + i]);
        double dot = 0;
        for (int k = 0; k < d; ++k) dot += double(h[i * d + k]) * h[j * d + k];
        ASSERT_NEAR(dot, i == j ? 1.0 : 0.0, 1e-6);
      }
    }
  }
  EXPECT_THROW(orthonormal_hadamard(72), std::invalid_argument);
}

// The matrix is built from the transform, so this checks the transform's linearity and the
// normalization; the independent check of the construction is tests/python/test_presets.py, against
// Paley matrices built from the GF(q) definition.
TEST(Hadamard, TransformEqualsMatrixProduct) {
  std::mt19937 rng(1);
  std::normal_distribution<float> n;
  for (int d : {64, 80, 96, 112, 128, 160, 192, 256}) {
    std::vector<float> x(d), y(d);
    for (auto& v : x) v = n(rng);
    y = x;
    hadamard_transform_inplace(y.data(), d);
    const std::vector<float>& h = orthonormal_hadamard(d);
    for (int i = 0; i < d; ++i) {
      double ref = 0;
      for (int k = 0; k < d; ++k) ref += double(h[i * d + k]) * x[k];
      ASSERT_NEAR(y[i] / std::sqrt(float(d)), ref, 1e-4);
    }
  }
}

TEST(SlotCodec, RoundTripPreservesKeyNormAndValueRange) {
  std::mt19937 rng(3);
  std::normal_distribution<float> n;
  for (const Preset& p : all_presets()) {
    const int d = 128;
    const SlotLayout l = slot_layout(p, d);
    const Codebook* cb = p.key_format == KeyFormat::kLloydMax ? &gaussian_codebook(p.key_bits, d) : nullptr;
    std::vector<float> k(d), v(d), kd(d), vd(d);
    for (auto& x : k) x = n(rng);
    for (auto& x : v) x = n(rng);
    std::vector<uint8_t> slot(l.slot_size_aligned, 0);
    encode_slot(k.data(), v.data(), l, cb, p.norm_correction, slot.data());
    decode_key(slot.data(), l, cb, kd.data());
    decode_value(slot.data(), l, vd.data());
    double kn = 0, dn = 0, err = 0, vmax_err = 0, vmin = 1e9, vmax = -1e9;
    for (int i = 0; i < d; ++i) {
      kn += double(k[i]) * k[i];
      dn += double(kd[i]) * kd[i];
      err += double(k[i] - kd[i]) * (k[i] - kd[i]);
      vmin = std::min<double>(vmin, v[i]);
      vmax = std::max<double>(vmax, v[i]);
    }
    for (int i = 0; i < d; ++i) vmax_err = std::max<double>(vmax_err, std::fabs(v[i] - vd[i]));
    const double step = (vmax - vmin) / ((1 << p.value_bits) - 1);
    EXPECT_LE(vmax_err, 0.5 * step * 1.01 + 1e-3) << p.name;
    if (p.norm_correction) EXPECT_NEAR(std::sqrt(dn) / std::sqrt(kn), 1.0, 2e-3) << p.name;
    EXPECT_LT(err / kn, p.key_bits == 3 ? 0.06 : 0.02) << p.name;
  }
}
