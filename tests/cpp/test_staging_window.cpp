// The decode's staging-window rules (turboquant/staging_window.h): which 16-byte chunks a CTA
// copies for a slot, and where the consumer finds the slot again from one code per tile. A wrong
// rule here reads a slot's bytes from outside its window or at an odd offset (the first GPU run of
// the 32-byte windows faulted on exactly that for masked tiles).
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <set>
#include <utility>
#include <vector>

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
  int known = 0, known_at_2 = 0;
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
    known_at_2 += misalign == 2;
    for (int k = 0; k < 8; ++k) {
      const int64_t address = static_cast<int64_t>(rng() % 100000) * stride_block +
                              static_cast<int64_t>(rng() % block_size) * stride_token + head * stride_head;
      EXPECT_EQ(address & 3, misalign) << "slot " << slot << " heads " << heads << " head " << head;
    }
  }
  EXPECT_GT(known, 1000);  // the known case was exercised, at both offsets (134-byte slots, odd heads)
  EXPECT_GT(known_at_2, 100);
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

// Aligned-row staging: a warp's copies of one tile cover exactly the chunks holding slot bytes of
// every row, each once, and stay inside the ring row of the 32-byte-window staging (same ring).
TEST(StagingWindow, AlignedTileCopiesCoverEveryRowsSlotOnce) {
  for (int slot_bytes : slot_sizes()) {
    const int chunks = aligned_row_chunks(slot_bytes);
    EXPECT_LE(chunks, window_chunks(slot_bytes, 32)) << "fits the ring rows sized for 32-byte windows";
    EXPECT_GE(32 * aligned_tile_copies(slot_bytes), 16 * chunks);
    for (int offset16 = 0; offset16 < 16; offset16 += 2) {
      EXPECT_LE(offset16 + slot_bytes, 16 * chunks) << "slot " << slot_bytes << " at " << offset16;
      std::set<std::pair<int, int>> copied;
      for (int copy = 0; copy < aligned_tile_copies(slot_bytes); ++copy) {
        for (int lane = 0; lane < 32; ++lane) {
          const RowChunk c = aligned_tile_copy(copy, lane, slot_bytes);
          if (c.row >= 16 || !aligned_chunk_needed(c.chunk, offset16, slot_bytes)) continue;
          EXPECT_GE(c.chunk, 0);
          EXPECT_LT(c.chunk, chunks);
          EXPECT_TRUE(copied.insert({c.row, c.chunk}).second) << "chunk copied twice";
        }
      }
      // Needed: every chunk that starts before the slot's end (a 16-byte-aligned cache view's
      // span ends on a chunk boundary, so none of them reads past it).
      const int needed = (offset16 + slot_bytes + 15) / 16;
      EXPECT_EQ(static_cast<int>(copied.size()), 16 * needed) << "slot " << slot_bytes << " at " << offset16;
      for (int row = 0; row < 16; ++row) {
        for (int chunk = 0; chunk < needed; ++chunk) EXPECT_TRUE(copied.count({row, chunk})) << row << " " << chunk;
      }
    }
  }
  // One instruction's 32 chunks lie in few rows: 4 for 134-byte slots (10 chunks a row).
  for (int copy = 0; copy < aligned_tile_copies(134); ++copy) {
    std::set<int> rows;
    for (int lane = 0; lane < 32; ++lane) rows.insert(aligned_tile_copy(copy, lane, 134).row);
    EXPECT_LE(static_cast<int>(rows.size()), 4);
  }
}

TEST(StagingWindow, HeadSlotOffsetModSixteen) {
  EXPECT_EQ(head_slot_offset(16 * 8 * 134, 8 * 134, 3 * 134, 16), (3 * 134) % 16);  // 8 heads: 1072-byte rows
  EXPECT_EQ(head_slot_offset(16 * 4 * 134, 4 * 134, 134, 16), -1);                  // 536-byte rows
  EXPECT_EQ(head_slot_offset(16 * 4 * 196, 4 * 196, 196, 16), 196 % 16);            // k8v4, 4 heads
  EXPECT_EQ(head_slot_offset(16 * 4 * 134, 4 * 134, 134, 4), 2);
}

// The aligned-row staging end to end on the host, as a warp of decode.cu runs it: every lane's
// copies of one tile from a byte-numbered cache into a ring tile, then the consumer's view of each
// row's slot must be the cache's slot of that token and KV head, and no copy may leave the cache
// view or its ring row.
TEST(StagingWindow, AlignedRowsStageEverySlotWhereTheConsumerReadsIt) {
  std::mt19937_64 rng(17);
  for (int slot_bytes : slot_sizes()) {
    const int row_bytes = 16 * window_chunks(slot_bytes, 32) + 16;  // a ring row of decode.cu's size or more
    for (int heads : {8, 16}) {
      const int block_size = 16, num_blocks = 5;
      const int stride_token = heads * slot_bytes, stride_block = block_size * stride_token;
      if (stride_token % 16 != 0) continue;  // not an aligned-row layout
      const int64_t span = static_cast<int64_t>(num_blocks) * stride_block;
      std::vector<uint8_t> cache(span);
      for (int64_t i = 0; i < span; ++i) cache[i] = static_cast<uint8_t>(i * 131 + (i >> 8));
      for (int trial = 0; trial < 20; ++trial) {
        const int head = static_cast<int>(rng() % heads), block = static_cast<int>(rng() % num_blocks);
        const int rows = 1 + static_cast<int>(rng() % 16);  // tokens of the tile before the range's end
        const int64_t head_offset = static_cast<int64_t>(head) * slot_bytes;
        const int offset16 = head_slot_offset(stride_block, stride_token, head_offset, 16);
        ASSERT_GE(offset16, 0);
        const int64_t tile_slot = static_cast<int64_t>(block) * stride_block + head_offset;  // the block's first tile
        std::vector<int> ring(16 * row_bytes, -1);
        for (int copy = 0; copy < aligned_tile_copies(slot_bytes); ++copy) {
          for (int lane = 0; lane < 32; ++lane) {
            const RowChunk c = aligned_tile_copy(copy, lane, slot_bytes);
            if (c.row >= 16 || c.row >= rows || !aligned_chunk_needed(c.chunk, offset16, slot_bytes)) continue;
            const int64_t src = tile_slot - offset16 + aligned_copy_source(c, stride_token);
            const int dst = aligned_copy_dest(c, row_bytes);
            ASSERT_EQ(src % 16, 0);
            ASSERT_GE(src, 0);
            ASSERT_LE(src + 16, span) << "a copy past the cache view";
            ASSERT_LE(dst + 16, (c.row + 1) * row_bytes) << "a copy past its ring row";
            for (int k = 0; k < 16; ++k) ring[dst + k] = cache[src + k];
          }
        }
        for (int r = 0; r < rows; ++r) {
          const int at = aligned_slot_offset(r, row_bytes, offset16);
          const int64_t slot = tile_slot + static_cast<int64_t>(r) * stride_token;
          for (int k = 0; k < slot_bytes; ++k) {
            ASSERT_EQ(ring[at + k], cache[slot + k]) << "slot " << slot_bytes << " heads " << heads << " head " << head
                                                      << " row " << r << " byte " << k;
          }
        }
      }
    }
  }
}
