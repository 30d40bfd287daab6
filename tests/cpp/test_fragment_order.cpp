// The decode's fragment orders (include/turboquant/fragment_order.h): each is a permutation of
// the slot's key quads and value pairs, and the words load_interleaved_words fetches hold exactly
// the bytes key_quad / value_pair name, for a region at either offset mod 4.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "turboquant/fragment_order.h"

namespace turboquant {
namespace {

TEST(FragmentOrder, KeyQuadsArePermutations) {
  for (int d : {64, 96, 128, 256}) {
    for (int bits : {3, 4, 8}) {
      for (int misalign : {kUnknownMisalign, 0, 2}) {
        std::vector<int> seen(d / 4, 0);
        for (int c = 0; c < 4; ++c) {
          for (int j = 0; j < d / 16; ++j) {
            const int q = key_quad(c, j, d, bits, misalign);
            ASSERT_GE(q, 0);
            ASSERT_LT(q, d / 4);
            ++seen[q];
          }
        }
        for (int q = 0; q < d / 4; ++q) EXPECT_EQ(seen[q], 1) << "D=" << d << " bits=" << bits << " misalign=" << misalign;
      }
    }
  }
}

TEST(FragmentOrder, ValuePairsArePermutations) {
  for (int d : {64, 96, 128, 256}) {
    for (int bits : {3, 4}) {
      for (int misalign : {kUnknownMisalign, 0, 2}) {
        std::vector<int> seen(d / 2, 0);
        for (int g = 0; g < 8; ++g) {
          for (int i = 0; i < d / 16; ++i) {
            const int p = value_pair(g, i, d, bits, misalign);
            ASSERT_GE(p, 0);
            ASSERT_LT(p, d / 2);
            ++seen[p];
          }
        }
        for (int p = 0; p < d / 2; ++p) EXPECT_EQ(seen[p], 1) << "D=" << d << " bits=" << bits << " misalign=" << misalign;
      }
    }
  }
}

// A region of `bytes` distinct bytes starting `misalign` bytes after a word boundary, with junk
// around it, as words from that boundary.
std::vector<uint32_t> region_words(int bytes, int misalign, std::vector<uint8_t>* region) {
  std::vector<uint8_t> raw(bytes + 16, 0xee);
  region->resize(bytes);
  for (int b = 0; b < bytes; ++b) raw[misalign + b] = (*region)[b] = static_cast<uint8_t>(b * 7 + 3);
  std::vector<uint32_t> words(raw.size() / 4);
  std::memcpy(words.data(), raw.data(), words.size() * 4);
  return words;
}

template <int D>
void check_four_bit_keys(int misalign) {
  // 4-bit keys: k-step j reads bits 16j .. 16j + 15 of the thread's words: a0/a1 the low byte
  // (dims 4q, 4q + 1), a2/a3 the high byte (4q + 2, 4q + 3), where q = key_quad(c, j).
  constexpr int kBytes = D / 2, kWords = D / 32;
  std::vector<uint8_t> region;
  const std::vector<uint32_t> words = region_words(kBytes, misalign, &region);
  for (int c = 0; c < 4; ++c) {
    uint32_t w[kWords];
    if (misalign == 0) {
      load_interleaved_words<0, 4, kBytes / 4>(words.data(), c, w);
    } else {
      load_interleaved_words<2, 4, kBytes / 4>(words.data(), c, w);
    }
    for (int j = 0; j < D / 16; ++j) {
      const int q = key_quad(c, j, D, 4, misalign);
      const uint32_t half = (w[j / 2] >> (16 * (j % 2))) & 0xffffu;
      EXPECT_EQ(half & 0xffu, region[2 * q]) << "D=" << D << " misalign " << misalign << " c " << c << " j " << j;
      EXPECT_EQ(half >> 8, region[2 * q + 1]) << "D=" << D << " misalign " << misalign << " c " << c << " j " << j;
    }
  }
}

template <int D>
void check_fp8_keys() {
  // FP8 keys: k-step j reads word j: dims 4q .. 4q + 3 in byte order.
  constexpr int kBytes = D, kWords = D / 16;
  std::vector<uint8_t> region;
  const std::vector<uint32_t> words = region_words(kBytes, 0, &region);
  for (int c = 0; c < 4; ++c) {
    uint32_t w[kWords];
    load_interleaved_words<0, 4, kBytes / 4>(words.data(), c, w);
    for (int j = 0; j < D / 16; ++j) {
      const int q = key_quad(c, j, D, 8, 0);
      for (int b = 0; b < 4; ++b) EXPECT_EQ((w[j] >> (8 * b)) & 0xffu, region[4 * q + b]) << "c " << c << " j " << j;
    }
  }
}

template <int D>
void check_four_bit_values(int misalign) {
  // 4-bit values: MMA i reads byte i of the thread's words (low nibble: row g, high: row g + 8).
  constexpr int kBytes = D / 2, kWords = D / 64;
  std::vector<uint8_t> region;
  const std::vector<uint32_t> words = region_words(kBytes, misalign, &region);
  for (int g = 0; g < 8; ++g) {
    uint32_t w[kWords];
    if (misalign == 0) {
      load_interleaved_words<0, 8, kBytes / 4>(words.data(), g, w);
    } else {
      load_interleaved_words<2, 8, kBytes / 4>(words.data(), g, w);
    }
    for (int i = 0; i < D / 16; ++i) {
      const int p = value_pair(g, i, D, 4, misalign);
      EXPECT_EQ((w[i / 4] >> (8 * (i % 4))) & 0xffu, region[p]) << "D=" << D << " misalign " << misalign << " g " << g;
    }
  }
}

TEST(FragmentOrder, InterleavedWordsHoldTheNamedBytes) {
  for (int misalign : {0, 2}) {
    check_four_bit_keys<64>(misalign);
    check_four_bit_keys<128>(misalign);
    check_four_bit_keys<256>(misalign);
    check_four_bit_values<64>(misalign);
    check_four_bit_values<128>(misalign);
    check_four_bit_values<256>(misalign);
  }
  check_fp8_keys<64>();
  check_fp8_keys<96>();
  check_fp8_keys<128>();
}

TEST(FragmentOrder, ContiguousOrderIsThePerThreadRun) {
  // The per-head kernel's order: thread c's run of D/4 key dims, thread g's run of D/8 value dims.
  EXPECT_EQ(key_quad(2, 3, 128, 4, kUnknownMisalign), 2 * 8 + 3);
  EXPECT_EQ(key_quad(1, 0, 128, 3, 0), 8);  // 3-bit keys keep the contiguous order
  EXPECT_EQ(key_quad(1, 0, 128, 8, 2), 8);  // FP8 keys off a word keep it too
  EXPECT_EQ(value_pair(5, 7, 128, 4, kUnknownMisalign), 5 * 8 + 7);
  EXPECT_EQ(value_pair(5, 7, 128, 3, 0), 5 * 8 + 7);  // 3-bit values keep it
  EXPECT_EQ(value_pair(5, 4, 96, 4, 0), 5 * 6 + 4);   // D = 96: 12 value words, no whole rounds of 8
}

// PRMT as the hardware does it for selectors 0-7 (no sign replication): byte k of the result is
// byte (selector nibble k) of the 8 bytes {a, b}.
uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t selector) {
  const uint64_t bytes = (static_cast<uint64_t>(b) << 32) | a;
  uint32_t r = 0;
  for (int k = 0; k < 4; ++k) r |= static_cast<uint32_t>((bytes >> (8 * ((selector >> (4 * k)) & 7))) & 0xff) << (8 * k);
  return r;
}

TEST(FragmentOrder, CodePairGatherPutsTwoTokensCodesInOneWord) {
  uint32_t state = 12345u;
  auto next = [&] { return state = state * 1664525u + 1013904223u; };
  for (int d : {64, 128, 256}) {
    for (int bits : {3}) {
      const int chunk_bits = d / 8 * bits, words = (chunk_bits + 31) / 32;
      int fits = 0;
      for (int trial = 0; trial < 20; ++trial) {
        std::vector<uint32_t> a(words + 1), b(words + 1);  // + 1: a window may read one word past
        for (int w = 0; w <= words; ++w) {
          a[w] = next();
          b[w] = next();
        }
        auto field = [&](const std::vector<uint32_t>& t, int bit) {  // 2 * bits at `bit`, the reference
          const uint64_t two = (static_cast<uint64_t>(t[bit / 32 + 1]) << 32) | t[bit / 32];
          return static_cast<uint32_t>(two >> (bit % 32)) & ((1u << (2 * bits)) - 1u);
        };
        for (int i = 0; i < d / 16; ++i) {
          const int bit = 2 * i * bits;
          const CodePairGather gather = code_pair_gather(bit, bits);
          if (!gather.fits) continue;
          fits += trial == 0;
          ASSERT_LT(gather.word, words);
          const uint32_t x = byte_perm(a[gather.word], b[gather.word], gather.selector) >> gather.shift;
          const uint32_t mask = (1u << (2 * bits)) - 1u;
          EXPECT_EQ(x & mask, field(a, bit)) << "D=" << d << " pair " << i;
          EXPECT_EQ((x >> 16) & mask, field(b, bit)) << "D=" << d << " pair " << i;
        }
      }
      EXPECT_EQ(fits, d / 16 - d / 128) << "D=" << d << ": every pair but those straddling two words";
    }
  }
}

}  // namespace
}  // namespace turboquant
