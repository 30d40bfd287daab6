// Bit packing of quantization indices (keys and values alike), SPEC §2: a little-endian bit
// stream where index i occupies bits [b*i, b*i + b). For 4 bits byte j = idx[2j] | idx[2j+1] << 4;
// for 3 bits every group of 8 indices is a 24-bit little-endian integer at byte offset 3g.
// These scalar forms are the single definition used by the CPU code and the CUDA kernels'
// unpacking; kernels use word-wide variants of the same rule (bit_extract below; pack_codes for
// the store's per-lane pieces).
#pragma once

#include <cstdint>

#include "turboquant/macros.h"

namespace turboquant {

// Reads index `i` of a `bits`-bit stream (bits in 1..8).
TQ_HD uint32_t unpack_index(const uint8_t* field, int i, int bits) {
  const int bit = i * bits;
  const int byte = bit >> 3;
  const int shift = bit & 7;
  uint32_t window = field[byte];
  if (shift + bits > 8) window |= static_cast<uint32_t>(field[byte + 1]) << 8;
  return (window >> shift) & ((1u << bits) - 1u);
}

// Packs 8 indices of `bits` bits (3 or 4) into `bits` bytes at `out` (one group of the stream).
TQ_HD void pack_group_of_8(const uint8_t* idx, int bits, uint8_t* out) {
  uint32_t word = 0;
  for (int k = 0; k < 8; ++k) word |= static_cast<uint32_t>(idx[k]) << (k * bits);
  for (int b = 0; b < bits; ++b) out[b] = static_cast<uint8_t>(word >> (8 * b));
}

// Packs E consecutive indices of a `kBits`-bit stream, the first at bit 0 of words[0], with the
// same rule as pack_group_of_8: a lane's piece of a field when E * kBits is a whole number of
// bytes. Fully unrolled, so the shifts are constants and the indices stay in registers.
// Codes must be below 2^kBits. Where codes do not straddle words (kBits divides 32) a word is
// built from its top code down, (acc << kBits) + code: one shift-add (LEA on the GPU) per code
// instead of a shift and an OR.
template <int E, int kBits>
TQ_HD void pack_codes(const uint32_t (&codes)[E], uint32_t (&words)[(E * kBits + 31) / 32]) {
  if constexpr (32 % kBits == 0) {
    constexpr int kPerWord = 32 / kBits;
    TQ_UNROLL
    for (int w = 0; w < (E * kBits + 31) / 32; ++w) {
      const int first = w * kPerWord, last = (first + kPerWord < E ? first + kPerWord : E) - 1;
      uint32_t acc = codes[last];
      TQ_UNROLL
      for (int j = last - 1; j >= first; --j) acc = (acc << kBits) + codes[j];
      words[w] = acc;
    }
  } else {
    TQ_UNROLL
    for (int w = 0; w < (E * kBits + 31) / 32; ++w) words[w] = 0;
    TQ_UNROLL
    for (int j = 0; j < E; ++j) {
      const int bit = j * kBits, w = bit >> 5, s = bit & 31;
      words[w] |= codes[j] << s;
      if (s + kBits > 32) words[w + 1] |= codes[j] >> (32 - s);
    }
  }
}

// Packs `count` indices (count a multiple of 8) into a `bits`-bit stream.
TQ_HD void pack_indices(const uint8_t* idx, int count, int bits, uint8_t* out) {
  for (int g = 0; g < count / 8; ++g) pack_group_of_8(idx + 8 * g, bits, out + bits * g);
}

// Bits [offset, offset + width) of a little-endian stream held in 32-bit words (width <= 32).
TQ_HD uint32_t bit_extract(const uint32_t* words, int offset, int width) {
  const int w = offset >> 5;
  const int s = offset & 31;
  uint64_t window = words[w];
  if (s + width > 32) window |= static_cast<uint64_t>(words[w + 1]) << 32;
  return static_cast<uint32_t>(window >> s) & (width == 32 ? 0xffffffffu : ((1u << width) - 1u));
}

}  // namespace turboquant
