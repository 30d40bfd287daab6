// Where a decode CTA copies a packed slot from and where it finds it again (kernels/decode.cu).
// Slots start at any even byte; 16-byte async copies need 16-byte-aligned sources, so a row of
// the staging ring holds the 16-byte chunks of a window: from the slot's start rounded down to
// `align` bytes (16 or 32, a power of two) to the slot's end. With align = 32 a lane pair's two
// chunks lie in one 32-byte sector. Host-testable (tests/cpp/test_staging_window.cpp): the chunks cover the slot, stay
// inside the row, and the offset the consumer derives from one code per tile is the slot's.
#pragma once

#include <cstdint>

#include "turboquant/fragment_order.h"
#include "turboquant/macros.h"

namespace turboquant {

// 16-byte chunks a ring row must hold for slots of slot_bytes starting at any even offset.
TQ_HD constexpr int window_chunks(int slot_bytes, int align) { return (align - 2 + slot_bytes + 15) / 16; }

// Byte offset of the window (relative to the cache base) and the slot's offset inside it.
TQ_HD int64_t window_start(int64_t slot, int align) { return slot & ~static_cast<int64_t>(align - 1); }
TQ_HD int offset_in_window(int64_t slot, int align) { return static_cast<int>(slot & (align - 1)); }

// Whether chunk `chunk` of a window holds bytes of a slot starting at `offset` in it. The first
// test is implied by the second (offset >= 0) but is a compile-time constant per chunk, so the
// copies every slot needs are issued without a run-time comparison.
TQ_HD bool window_chunk_needed(int chunk, int offset, int slot_bytes) {
  return 16 * chunk < slot_bytes || 16 * chunk < offset + slot_bytes;
}

// A tile's code: its row 0's offset in its window, or kMaskedTileCode when its block id is outside
// the cache (negative, and a multiple of every alignment up to 32 so the offsets derived from it
// stay even: a masked row's fp16 fields are still read, then discarded).
constexpr int kMaskedTileCode = -32;
// Where the tile math reads every row at a known offset mod 4 (`misalign`, 0 or 2: the interleaved
// fragment order, head_slot_misalign), a masked tile's rows keep that offset too, or the aligned
// loads around a row would start before it (before the ring for row 0 of the first stage).
TQ_HD int masked_tile_code(int misalign) { return kMaskedTileCode + (misalign > 0 ? misalign : 0); }
TQ_HD int tile_window_code(int64_t row0_slot, int align, int misalign = kUnknownMisalign) {
  return row0_slot >= 0 ? offset_in_window(row0_slot, align) : masked_tile_code(misalign);
}

// Offset in its window of row r of a tile: rows are stride_token bytes apart, so with
// stride_mod = stride_token mod align, (row0 + r * stride_token) mod align =
// (code + r * stride_mod) mod align.
TQ_HD int row_offset_in_window(int tile_code, int r, int stride_mod, int align) {
  return (tile_code + r * stride_mod) & (align - 1);
}

// The offset mod `modulus` (a power of two up to 16) that every slot of one KV head shares
// (head_offset: the head's byte offset in a token row; the cache base is 16-byte aligned), whatever
// its block and token: known where the block and token strides are multiples of it, else -1.
TQ_HD int head_slot_offset(int64_t stride_block, int64_t stride_token, int64_t head_offset, int modulus) {
  return ((stride_block | stride_token) & (modulus - 1)) == 0 ? static_cast<int>(head_offset & (modulus - 1)) : -1;
}
// ... mod 4: 0 or 2, or kUnknownMisalign (the interleaved fragment order needs it known).
TQ_HD int head_slot_misalign(int64_t stride_block, int64_t stride_token, int64_t head_offset) {
  const int misalign = head_slot_offset(stride_block, stride_token, head_offset, 4);
  return misalign >= 0 ? misalign : kUnknownMisalign;
}

// Aligned-row staging: where every slot of a KV head sits at the same offset mod 16 (token and
// block strides multiples of 16: vLLM's layout with 8 KV heads of 134-byte slots, or 4 of 196),
// a tile's 16 rows are copied from the 16-byte-aligned window of each slot, all at that offset,
// with the warp's lanes walking the tile's chunks in row-major order: copy i of a lane takes chunk
// (32 i + lane) of the flattened (row, chunk) grid, so one instruction's 32 chunks lie in three
// or four rows (a few L1 wavefronts) instead of one chunk of each of 16 rows (~23 wavefronts per
// cp.async, ncu, H200), and the consumer finds every row at one offset.
TQ_HD constexpr int aligned_row_chunks(int slot_bytes) { return window_chunks(slot_bytes, 16); }
TQ_HD constexpr int aligned_tile_copies(int slot_bytes) { return (16 * aligned_row_chunks(slot_bytes) + 31) / 32; }
struct RowChunk {
  int row;    // token row of the tile (16 or more: nothing to copy)
  int chunk;  // 16-byte chunk of the row's window
};
TQ_HD RowChunk aligned_tile_copy(int copy, int lane, int slot_bytes) {
  const int flat = 32 * copy + lane, chunks = aligned_row_chunks(slot_bytes);
  return {flat / chunks, flat % chunks};
}
// Whether chunk `chunk` of an aligned row holds bytes of its slot, which starts `offset16` bytes in.
TQ_HD bool aligned_chunk_needed(int chunk, int offset16, int slot_bytes) { return 16 * chunk < offset16 + slot_bytes; }
// Where a copy reads, from the tile's first window (its row-0 slot less offset16: 16-byte aligned),
// and where it writes in the ring's tile (rows row_bytes apart); the consumer then finds row r's
// slot at aligned_slot_offset. 32-bit: the kernel stages aligned rows only for token strides up to
// INT_MAX / 16 (kernels/decode.cu).
TQ_HD int aligned_copy_source(RowChunk c, int stride_token) { return c.row * stride_token + 16 * c.chunk; }
TQ_HD int aligned_copy_dest(RowChunk c, int row_bytes) { return c.row * row_bytes + 16 * c.chunk; }
TQ_HD int aligned_slot_offset(int row, int row_bytes, int offset16) { return row * row_bytes + offset16; }

}  // namespace turboquant
