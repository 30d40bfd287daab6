// Whole-slot encode/decode on the host: the CPU reference of store_kv / decode / dequantize.
// The CUDA kernels implement the same steps in parallel (the store: a group of lanes per vector)
// with the same per-element rules (quantize.h, packing.h, numeric.h), with shortcuts shown equal
// to them (the bucketing grid, lloyd_max_grid.h; tests/cpp/test_store_rules.cpp), and with
// reorderings that round differently within the store's rounding allowance (docs/DESIGN.md) (rotation before normalization,
// one reciprocal for the value codes; tests/python/test_cuda.py checks them index by index).
#pragma once

#include <cstdint>

#include "turboquant/layout.h"
#include "turboquant/quantize.h"

namespace turboquant {

// Quantizes one token's key and value (head_dim floats each) into `slot` (layout.slot_size bytes).
// `codebook` is unused for FP8 keys. `norm_correction` folds ||c~|| into the stored norm.
void encode_slot(const float* key, const float* value, const SlotLayout& layout,
                 const Codebook* codebook, bool norm_correction, uint8_t* slot);

// Key in the rotated basis as decode uses it: stored_norm * c~ (MSE keys), or the FP8 key.
void decode_key_rotated(const uint8_t* slot, const SlotLayout& layout, const Codebook* codebook,
                        float* out);

// Key in the original basis: stored_norm * R c~ (R symmetric orthonormal), or the FP8 key.
void decode_key(const uint8_t* slot, const SlotLayout& layout, const Codebook* codebook,
                float* out);

// Value: code * scale + zero.
void decode_value(const uint8_t* slot, const SlotLayout& layout, float* out);

// Reads/writes a little-endian binary16 field at a byte offset of a slot (slots are only 2-byte
// aligned, so byte by byte; the generic CUDA kernels use them too).
TQ_HD uint16_t load_half_field(const uint8_t* slot, int offset) {
  return static_cast<uint16_t>(slot[offset] | (slot[offset + 1] << 8));
}
TQ_HD void store_half_field(uint8_t* slot, int offset, uint16_t bits) {
  slot[offset] = static_cast<uint8_t>(bits & 0xff);
  slot[offset + 1] = static_cast<uint8_t>(bits >> 8);
}

}  // namespace turboquant
