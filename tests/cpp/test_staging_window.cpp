// The decode's staging-window rules (turboquant/staging_window.h): which 16-byte chunks a CTA
// copies for a slot, and where the consumer finds the slot again from one code per tile. A wrong
// rule here reads a slot's bytes from outside its window or at an odd offset (the first GPU run of
// the 32-byte windows faulted on exactly that for masked tiles).
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <set>

#include "turboquant/preset.h"
#include "turboquant/staging_window.h"

using namespace turboquant;

namespace {

std::set<int> slot_sizes() {
  std::set<int> sizes;
  for (const Preset& p : all_presets()) {
    for (int d : {64, 96, 128, 256}) sizes.insert(make_slot_layout(d, p.key_format, p.key_bits, p.value_bits).slot_size_aligned);
  }
  return sizes;
}

}  // namespace

TEST(StagingWindow, NeededChunksCoverTheSlotAndStayInTheRow) {
  for (int align : {16, 32}) {
    for (int slot_bytes : slot_sizes()) {
      const int chunks = window_chunks(slot_bytes, align);
      for (int offset = 0; offset < align; offset += 2) {  // slots start at even addresses
        EXPECT_LE(offset + slot_bytes, 16 * chunks) << "row too short: align " << align << " slot " << slot_bytes;
        int copied = 0;
        for (int c = 0; c < chunks; ++c) {
          const bool holds_slot_bytes = 16 * c < offset + slot_bytes;  // chunk c starts before the slot ends
          EXPECT_EQ(window_chunk_needed(c, offset, slot_bytes), holds_slot_bytes)
              << "align " << align << " slot " << slot_bytes << " offset " << offset << " chunk " << c;
          copied += holds_slot_bytes;
        }
        EXPECT_EQ(copied, (offset + slot_bytes + 15) / 16);
      }
      // The widest window needs every chunk of the row: none is allocated for nothing.
      EXPECT_TRUE(window_chunk_needed(chunks - 1, align - 2, slot_bytes)) << align << " " << slot_bytes;
    }
  }
}

TEST(StagingWindow, WindowStartIsAlignedAndHoldsTheSlotStart) {
  std::mt19937_64 rng(7);
  for (int i = 0; i < 10000; ++i) {
    const int64_t slot = static_cast<int64_t>(rng() >> 20) * 2;  // even, past 2^31 too
    for (int align : {16, 32}) {
      const int64_t start = window_start(slot, align);
      EXPECT_EQ(start % align, 0);
      EXPECT_EQ(slot - start, offset_in_window(slot, align));
      EXPECT_GE(offset_in_window(slot, align), 0);
      EXPECT_LT(offset_in_window(slot, align), align);
    }
  }
}

TEST(StagingWindow, RowOffsetsFromTheTileCodeEqualTheSlotsOwn) {
  std::mt19937_64 rng(11);
  const int slot_bytes[] = {54, 100, 134, 196, 262, 388};
  for (int i = 0; i < 20000; ++i) {
    const int64_t row0 = static_cast<int64_t>(rng() >> 22) * 2;
    const int heads = 1 + static_cast<int>(rng() % 16);
    const int slot = slot_bytes[rng() % 6];
    // token-major: tokens num_kv_heads slots apart; head-major: adjacent slots.
    const int64_t stride = rng() % 2 ? static_cast<int64_t>(heads) * slot : slot;
    for (int align : {16, 32}) {
      const int code = tile_window_code(row0, align);
      const int stride_mod = static_cast<int>(stride & (align - 1));
      for (int r = 0; r < 16; ++r) {
        EXPECT_EQ(row_offset_in_window(code, r, stride_mod, align), offset_in_window(row0 + r * stride, align))
            << "row0 " << row0 << " stride " << stride << " r " << r << " align " << align;
      }
    }
  }
}

TEST(StagingWindow, MaskedTilesGiveEvenOffsetsInsideTheWindow) {
  EXPECT_LT(kMaskedTileCode, 0);
  EXPECT_EQ(tile_window_code(-1, 32), kMaskedTileCode);
  EXPECT_EQ(tile_window_code(-1000, 16), kMaskedTileCode);
  for (int align : {16, 32}) {
    for (int stride_mod = 0; stride_mod < align; stride_mod += 2) {
      for (int r = 0; r < 16; ++r) {
        const int offset = row_offset_in_window(kMaskedTileCode, r, stride_mod, align);
        EXPECT_EQ(offset % 2, 0) << "fp16 fields of a masked row must stay 2-byte aligned";
        EXPECT_GE(offset, 0);
        EXPECT_LT(offset, align);
      }
    }
  }
}

TEST(StagingWindow, HeadSlotMisalignIsEverySlotsOffsetModFour) {
  std::mt19937_64 rng(13);
  const int slot_bytes[] = {54, 100, 134, 196, 262, 388};
  int known = 0;
  for (int i = 0; i < 5000; ++i) {
    const int slot = slot_bytes[rng() % 6];
    const int heads = 1 + static_cast<int>(rng() % 16);
    const int block_size = 16 << (rng() % 4);
    const bool head_major = rng() % 2;
    const int64_t stride_head = head_major ? static_cast<int64_t>(block_size) * slot : slot;
    const int64_t stride_token = head_major ? slot : static_cast<int64_t>(heads) * slot;
    const int64_t stride_block = static_cast<int64_t>(block_size) * heads * slot;
    const int head = static_cast<int>(rng() % heads);
    const int misalign = head_slot_misalign(stride_block, stride_token, head * stride_head);
    if (misalign == kUnknownMisalign) {
      EXPECT_NE((stride_block | stride_token) & 3, 0) << "known whenever both strides are multiples of 4";
      continue;
    }
    ++known;
    for (int k = 0; k < 8; ++k) {
      const int64_t address = static_cast<int64_t>(rng() % 100000) * stride_block +
                              static_cast<int64_t>(rng() % block_size) * stride_token + head * stride_head;
      EXPECT_EQ(address & 3, misalign) << "slot " << slot << " heads " << heads << " head " << head;
    }
  }
  EXPECT_GT(known, 1000);  // the known case was exercised, at both offsets (134-byte slots, odd heads)
  EXPECT_EQ(head_slot_misalign(16 * 8 * 134, 8 * 134, 134), 2);
  EXPECT_EQ(head_slot_misalign(16 * 8 * 134, 8 * 134, 2 * 134), 0);
  EXPECT_EQ(head_slot_misalign(16 * 134, 134, 0), kUnknownMisalign);  // one KV head: rows alternate
}

TEST(StagingWindow, MaskedTilesKeepAKnownOffsetModFour) {
  EXPECT_EQ(tile_window_code(-1, 32, kUnknownMisalign), kMaskedTileCode);
  for (int misalign : {0, 2}) {
    const int code = tile_window_code(-5, 32, misalign);
    EXPECT_LT(code, 0) << "still masked";
    EXPECT_EQ(tile_window_code(70, 32, misalign), 70 % 32) << "a valid tile's code does not depend on it";
    for (int align : {16, 32}) {
      for (int stride_mod = 0; stride_mod < align; stride_mod += 4) {  // known offsets: strides multiples of 4
        for (int r = 0; r < 16; ++r) {
          const int offset = row_offset_in_window(code, r, stride_mod, align);
          EXPECT_EQ(offset % 4, misalign) << "align " << align << " stride_mod " << stride_mod << " r " << r;
          EXPECT_GE(offset, 0);
          EXPECT_LT(offset, align);
        }
      }
    }
  }
}
