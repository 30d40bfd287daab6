// FP8 e4m3fn and binary16 conversions shared by CPU and CUDA code.
#include <gtest/gtest.h>

#include <cmath>

#include "turboquant/numeric.h"

using namespace turboquant;

TEST(Fp8, DecodesAll256Codes) {
  for (int code = 0; code < 256; ++code) {
    const int sign = code >> 7, exp = (code >> 3) & 15, man = code & 7;
    const float got = fp8_e4m3_to_float(static_cast<uint8_t>(code));
    if (exp == 15 && man == 7) {
      EXPECT_TRUE(std::isnan(got)) << code;
      continue;
    }
    const double mag = exp == 0 ? std::ldexp(man, -9) : std::ldexp(1.0 + man / 8.0, exp - 7);
    EXPECT_EQ(got, static_cast<float>(sign ? -mag : mag)) << code;
  }
  EXPECT_EQ(fp8_e4m3_to_float(0x7e), 448.0f);
}

TEST(Fp8, EncodeRoundTripsEveryFiniteCode) {
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7f) == 0x7f) continue;
    const float v = fp8_e4m3_to_float(static_cast<uint8_t>(code));
    if (v == 0.0f) continue;  // -0 and +0 both fine
    EXPECT_EQ(float_to_fp8_e4m3(v), code) << v;
  }
}

TEST(Fp8, RoundsToNearestEvenAndSaturates) {
  // Between 1.0 (0x38) and 1.125 (0x39): the tie goes to the even mantissa (0x38).
  EXPECT_EQ(float_to_fp8_e4m3(1.0625f), 0x38);
  // Between 1.125 (0x39) and 1.25 (0x3a): tie to even 0x3a.
  EXPECT_EQ(float_to_fp8_e4m3(1.1875f), 0x3a);
  EXPECT_EQ(float_to_fp8_e4m3(1.05f), 0x38);
  EXPECT_EQ(float_to_fp8_e4m3(1.07f), 0x39);
  EXPECT_EQ(float_to_fp8_e4m3(1.18f), 0x39);
  // Subnormal tie: 1.5 * 2^-9 -> 2 * 2^-9 (even).
  EXPECT_EQ(float_to_fp8_e4m3(std::ldexp(1.5f, -9)), 0x02);
  EXPECT_EQ(float_to_fp8_e4m3(std::ldexp(0.5f, -9)), 0x00);
  // Largest normal below the subnormal boundary rounds up into 2^-6.
  EXPECT_EQ(float_to_fp8_e4m3(std::ldexp(7.6f, -9)), 0x08);
  EXPECT_EQ(float_to_fp8_e4m3(448.0f), 0x7e);
  EXPECT_EQ(float_to_fp8_e4m3(464.0f), 0x7e);
  EXPECT_EQ(float_to_fp8_e4m3(1e9f), 0x7e);
  EXPECT_EQ(float_to_fp8_e4m3(-1e9f), 0xfe);
  EXPECT_EQ(float_to_fp8_e4m3(INFINITY), 0x7e);
  EXPECT_EQ(float_to_fp8_e4m3(-INFINITY), 0xfe);
  EXPECT_EQ(float_to_fp8_e4m3(NAN) & 0x7f, 0x7f);
}

TEST(Half, EveryHalfRoundTripsAndTiesGoToEven) {
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const uint16_t bits = static_cast<uint16_t>(h);
    const float f = half_bits_to_float(bits);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(half_bits_to_float(float_to_half_bits(f))));
      continue;
    }
    ASSERT_EQ(float_to_half_bits(f), bits) << h;
    // The midpoint to the next half (same sign, finite) rounds to whichever is even.
    const uint32_t mag = h & 0x7fffu;
    if (mag < 0x7bffu) {
      const float next = half_bits_to_float(static_cast<uint16_t>(h + 1));
      const double mid = 0.5 * (static_cast<double>(f) + static_cast<double>(next));
      const uint16_t expected = (h & 1u) ? static_cast<uint16_t>(h + 1) : bits;
      ASSERT_EQ(float_to_half_bits(static_cast<float>(mid)), expected) << h;
    }
  }
  EXPECT_EQ(float_to_half_bits(65520.0f), 0x7c00);
  EXPECT_EQ(float_to_half_bits(65519.0f), 0x7bff);
}
