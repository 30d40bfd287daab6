// Byte layout of one packed slot (one token's K and V for one KV head), SPEC §2.
//
//   [ key data | key norm (fp16, MSE keys only) | value data | value scale (fp16) | value zero (fp16) ]
//
// key data   = D bytes (FP8 e4m3) or ceil(D * key_bits / 8) bytes (Lloyd-Max indices)
// value data = ceil(D * value_bits / 8) bytes
// The slot is padded to an even size; fp16 fields are little-endian binary16.
#pragma once

#include <cstdint>

#include "turboquant/macros.h"

namespace turboquant {

enum class KeyFormat : int32_t { kFp8 = 0, kLloydMax = 1 };

// Bytes a little-endian bit stream of `count` indices of `bits` bits occupies.
TQ_HD constexpr int packed_bytes(int count, int bits) { return (count * bits + 7) / 8; }

struct SlotLayout {
  int head_dim = 0;
  KeyFormat key_format = KeyFormat::kFp8;
  int key_bits = 0;    // 8 for FP8 keys
  int value_bits = 0;
  int key_data_bytes = 0;
  int key_norm_offset = -1;  // -1: no norm (FP8 keys)
  int value_data_offset = 0;
  int value_data_bytes = 0;
  int value_scale_offset = 0;
  int value_zero_offset = 0;
  int key_packed_size = 0;    // key data + norm
  int value_packed_size = 0;  // value data + scale + zero
  int slot_size = 0;
  int slot_size_aligned = 0;  // rounded up to even
};

TQ_HD constexpr SlotLayout make_slot_layout(int head_dim, KeyFormat key_format, int key_bits,
                                            int value_bits) {
  SlotLayout l{};
  l.head_dim = head_dim;
  l.key_format = key_format;
  l.key_bits = key_format == KeyFormat::kFp8 ? 8 : key_bits;
  l.value_bits = value_bits;
  l.key_data_bytes =
      key_format == KeyFormat::kFp8 ? head_dim : packed_bytes(head_dim, key_bits);
  l.key_norm_offset = key_format == KeyFormat::kFp8 ? -1 : l.key_data_bytes;
  l.key_packed_size = l.key_data_bytes + (key_format == KeyFormat::kFp8 ? 0 : 2);
  l.value_data_offset = l.key_packed_size;
  l.value_data_bytes = packed_bytes(head_dim, value_bits);
  l.value_scale_offset = l.value_data_offset + l.value_data_bytes;
  l.value_zero_offset = l.value_scale_offset + 2;
  l.value_packed_size = l.value_data_bytes + 4;
  l.slot_size = l.key_packed_size + l.value_packed_size;
  l.slot_size_aligned = (l.slot_size + 1) & ~1;
  return l;
}

// Geometry of a paged cache indexed [num_blocks, block_size, num_kv_heads, slot] with byte strides
// (any strides for the first three dims, so a head-major tensor viewed in that order works too).
struct PagedCacheGeometry {
  int64_t num_blocks = 0;
  int32_t block_size = 0;
  int32_t num_kv_heads = 0;
  int64_t slot_bytes = 0;
  int64_t stride_block = 0;
  int64_t stride_token = 0;
  int64_t stride_head = 0;
  int64_t span_bytes = 0;  // bytes from the first byte to the end of the last slot: loads never pass it
};

}  // namespace turboquant
