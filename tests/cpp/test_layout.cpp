// Slot layout (the compatibility contract of SPEC §2), preset parsing and bit packing.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "turboquant/packing.h"
#include "turboquant/preset.h"

using namespace turboquant;

TEST(SlotLayout, SlotSizesMatchSpecTable) {
  const std::vector<std::pair<std::string, std::vector<int>>> table = {
      {"turboquant_k8v4", {100, 148, 196, 388}},
      {"turboquant_4bit_nc", {70, 102, 134, 262}},
      {"turboquant_k3v4_nc", {62, 90, 118, 230}},
      {"turboquant_3bit_nc", {54, 78, 102, 198}},
  };
  const int dims[] = {64, 96, 128, 256};
  for (const auto& [name, sizes] : table) {
    const Preset& p = parse_preset(name);
    for (int i = 0; i < 4; ++i) {
      // D=96 is not a power of two: rotated presets refuse it, but the byte layout is defined.
      const SlotLayout l = make_slot_layout(dims[i], p.key_format, p.key_bits, p.value_bits);
      EXPECT_EQ(l.slot_size_aligned, sizes[i]) << name << " D=" << dims[i];
      EXPECT_EQ(l.slot_size_aligned % 2, 0);
    }
  }
}

TEST(SlotLayout, D128FieldSizes) {
  const std::vector<std::tuple<std::string, int, int>> detail = {
      {"turboquant_k8v4", 128, 68}, {"turboquant_4bit_nc", 66, 68},
      {"turboquant_k3v4_nc", 50, 68}, {"turboquant_3bit_nc", 50, 52}};
  for (const auto& [name, key, value] : detail) {
    const SlotLayout l = slot_layout(parse_preset(name), 128);
    EXPECT_EQ(l.key_packed_size, key) << name;
    EXPECT_EQ(l.value_packed_size, value) << name;
    EXPECT_EQ(l.value_data_offset, l.key_packed_size);
    EXPECT_EQ(l.value_scale_offset, l.value_data_offset + l.value_data_bytes);
    EXPECT_EQ(l.value_zero_offset, l.value_scale_offset + 2);
  }
  EXPECT_EQ(slot_layout(parse_preset("turboquant_4bit_nc"), 128).key_norm_offset, 64);
  EXPECT_EQ(slot_layout(parse_preset("turboquant_k8v4"), 128).key_norm_offset, -1);
}

TEST(Preset, UnknownNameListsValidOnes) {
  try {
    parse_preset("turboquant_2bit");
    FAIL() << "expected std::invalid_argument";
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("turboquant_2bit"), std::string::npos);
    for (const Preset& p : all_presets()) EXPECT_NE(msg.find(p.name), std::string::npos) << msg;
  }
}

TEST(Preset, HeadDimRules) {
  EXPECT_THROW(slot_layout(parse_preset("turboquant_4bit_nc"), 72), std::invalid_argument);  // odd part 9
  EXPECT_THROW(slot_layout(parse_preset("turboquant_4bit_nc"), 120), std::invalid_argument);  // odd part 15
  EXPECT_THROW(slot_layout(parse_preset("turboquant_k8v4"), 100), std::invalid_argument);
  EXPECT_NO_THROW(slot_layout(parse_preset("turboquant_k8v4"), 72));
  EXPECT_NO_THROW(slot_layout(parse_preset("turboquant_k8v4"), 80));
  for (int d : {64, 80, 96, 112, 128, 160, 192, 256}) EXPECT_NO_THROW(slot_layout(parse_preset("turboquant_3bit_nc"), d));
}

TEST(Packing, FourBitByteRule) {
  const uint8_t idx[8] = {1, 2, 3, 4, 15, 0, 7, 9};
  uint8_t out[4];
  pack_indices(idx, 8, 4, out);
  for (int j = 0; j < 4; ++j) EXPECT_EQ(out[j], idx[2 * j] | (idx[2 * j + 1] << 4));
}

TEST(Packing, ThreeBitGroupRule) {
  const uint8_t idx[8] = {1, 7, 3, 0, 5, 6, 2, 4};
  uint8_t out[3];
  pack_indices(idx, 8, 3, out);
  uint32_t word = 0;
  for (int k = 0; k < 8; ++k) word |= idx[k] << (3 * k);
  EXPECT_EQ(out[0], word & 0xff);
  EXPECT_EQ(out[1], (word >> 8) & 0xff);
  EXPECT_EQ(out[2], (word >> 16) & 0xff);
}

TEST(Packing, RoundTripEveryHeadDim) {
  std::mt19937 rng(7);
  for (int bits : {3, 4}) {
    for (int d : {64, 96, 128, 256}) {
      std::vector<uint8_t> idx(d), packed(packed_bytes(d, bits) + 4, 0);
      for (auto& v : idx) v = static_cast<uint8_t>(rng() % (1u << bits));
      pack_indices(idx.data(), d, bits, packed.data());
      std::vector<uint32_t> words((packed.size() + 3) / 4 + 1, 0);
      std::memcpy(words.data(), packed.data(), packed.size());
      for (int i = 0; i < d; ++i) {
        ASSERT_EQ(unpack_index(packed.data(), i, bits), idx[i]) << bits << " " << d << " " << i;
        ASSERT_EQ(bit_extract(words.data(), i * bits, bits), idx[i]);
      }
    }
  }
}
