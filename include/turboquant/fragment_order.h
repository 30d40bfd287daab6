// Which packed bytes of a staged slot each thread of the decode's tile math reads
// (kernels/decode_tile.cuh), and which head dims they are. Host-testable
// (tests/cpp/test_fragment_order.cpp): the orders are permutations, and the words a thread loads
// hold exactly the bytes these functions name.
//
// The MMA needs thread (g, c) of a warp to hold, per 16-dim k-step j of the scores, 4 key dims
// of token rows g and g + 8 (two pairs: A fragments a0/a1 and a2/a3), and per value MMA i 2 dims of
// 4 tokens. Which physical dims those are is free, as long as the query fragments use the same
// order (keys) and the output is written back in it (values). Two orders:
//   * contiguous: thread c reads one run of D/4 key dims (a 16-byte run for 4-bit keys), thread g
//     one run of D/8 value dims. Any slot alignment (the per-head kernel: a slot lies at any even
//     offset of its staging row, one funnel shift per word). With rows a multiple of 16 bytes
//     apart, every key word load hits 8 of the 32 banks (4 wavefronts; ncu, H200).
//   * interleaved: thread c reads key words c, c + 4, c + 8, ... and thread g value words g, g + 8:
//     the 32 lanes' loads then hit 32 banks (rows 16 bytes apart in the bank space, c or g adding
//     one word). Needs the slot's offset mod 4 known at compile time (the row-staged kernel: a
//     warp's KV head fixes it). When a region starts 2 bytes off a word, the thread reads the
//     aligned words around it instead: word k then holds the region's halfwords 2k - 1 and 2k, and
//     the first thread takes the last halfword (2R - 1, from word R) in place of the -1st.
//     Interleaved keys: 4-bit (halfword steps) at either offset, FP8 (word steps) aligned only;
//     interleaved values: 4-bit.
#pragma once

#include <cstdint>

#include "turboquant/macros.h"

namespace turboquant {

constexpr int kUnknownMisalign = -1;  // the slot's offset mod 4 is not known: contiguous order

// Interleaved words need whole rounds of them: D/32 key words per thread for 4-bit keys (D a
// multiple of 32), D/16 for FP8, D/64 value words per thread (D a multiple of 64; D = 96 keeps
// the contiguous value order).
TQ_HD constexpr bool keys_interleaved(int key_bits, int slot_misalign, int head_dim) {
  return head_dim % 32 == 0 && ((key_bits == 4 && slot_misalign >= 0) || (key_bits == 8 && slot_misalign == 0));
}
TQ_HD constexpr bool values_interleaved(int value_bits, int slot_misalign, int head_dim) {
  return head_dim % 64 == 0 && value_bits == 4 && slot_misalign >= 0;
}
// Offset mod 4 of the value codes of a slot at offset slot_misalign mod 4.
TQ_HD constexpr int value_misalign(int slot_misalign, int value_data_offset) {
  return slot_misalign < 0 ? kUnknownMisalign : (slot_misalign + value_data_offset) & 3;
}

// Key dims 4q .. 4q + 3 feed k-step j of thread c: a0/a1 dims 4q, 4q + 1 and a2/a3 dims 4q + 2,
// 4q + 3 (turboquant's key codes are little-endian bit streams in dim order).
TQ_HD constexpr int key_quad(int c, int j, int head_dim, int key_bits, int slot_misalign) {
  if (!keys_interleaved(key_bits, slot_misalign, head_dim)) return c * (head_dim / 16) + j;
  if (key_bits == 8) return c + 4 * j;  // word c + 4j: one k-step
  // 4-bit: halfword (j & 1) of word j / 2, i.e. halfword 2 (c + 4 (j / 2)) + (j & 1), one back
  // when the region starts 2 bytes off a word (modulo its D / 4 halfwords: the wrapped first one).
  const int quads = head_dim / 4;
  const int h = 2 * (c + 4 * (j / 2)) + (j & 1) - (slot_misalign == 2 ? 1 : 0);
  return (h + quads) % quads;
}

// Value dims 2p (MMA row g) and 2p + 1 (row g + 8) feed value MMA i of thread g; for 4-bit codes
// p is the byte that holds both.
TQ_HD constexpr int value_pair(int g, int i, int head_dim, int value_bits, int misalign) {
  if (!values_interleaved(value_bits, misalign, head_dim)) return g * (head_dim / 16) + i;
  const int bytes = head_dim / 2;
  const int b = 4 * (g + 8 * (i / 4)) + (i & 3) - (misalign == 2 ? 2 : 0);
  return (b + bytes) % bytes;
}

// Two tokens' value codes for one PV MMA in the contiguous order (the two VB-bit codes at bit `bit`
// of each token's chunk, held as little-endian words) gathered into one word by one PRMT and a
// shift: token A's codes at bits [0, 2 VB) of the low half, token B's of the high half (the bits
// above them may be the other token's: the code masks never read them). 3-bit pairs sit every 6
// bits, so of a D = 128 chunk's 8 pairs one (bits 30-35) straddles two words; there (`fits` false)
// each token's 16-bit window is shifted out and the two combined by a PRMT: three ops per two
// tokens, against one (a pair in one byte at bit 0) or two here.
struct CodePairGather {
  bool fits;
  int word;           // the word of each token's chunk that holds the codes' bytes
  uint32_t selector;  // PRMT(A, B): A's byte b and b + 1 low, B's high (one byte needed: b twice)
  int shift;          // then right by this many bits
};
TQ_HD constexpr CodePairGather code_pair_gather(int bit, int value_bits) {
  const int byte = bit >> 3, shift = bit & 7, b = byte & 3;
  const bool one_byte = shift + 2 * value_bits <= 8;
  const int second = one_byte ? b : b + 1;
  return {one_byte || b <= 2, byte >> 2,
          static_cast<uint32_t>(b | (second << 4) | ((b + 4) << 8) | ((second + 4) << 12)), shift};
}

// The words of an interleaved region for the thread at `index` (c for keys, g for values): words
// index + kStride * k of a region of R words that starts kMisalign (0 or 2) bytes after the word
// `words` points at; off a word, the aligned words around the region, the first thread's first
// word taking its low half (the region's last halfword) from word R.
template <int kMisalign, int kStride, int R, int NW>
TQ_HD void load_interleaved_words(const uint32_t* words, int index, uint32_t (&out)[NW]) {
  static_assert(kMisalign == 0 || kMisalign == 2, "regions start at even offsets");
  for (int k = 0; k < NW; ++k) out[k] = words[index + kStride * k];
  if (kMisalign == 2 && index == 0) out[0] = (out[0] & 0xffff0000u) | (words[R] & 0xffffu);
}

}  // namespace turboquant
