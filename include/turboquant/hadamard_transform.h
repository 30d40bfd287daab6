// The key rotation of the Lloyd-Max presets for every supported head_dim: the Hadamard matrix
// H_D = H_m (x) H_{2^k} of order D = m * 2^k, with H_{2^k} Sylvester's ((-1)^popcount(i & j)) and H_m
// for m in {12, 20, 28} the symmetric Paley II matrix below (m = 1: H_D is Sylvester's alone). The
// rotation is H_D / sqrt(D): orthonormal and symmetric, so it is its own inverse. docs/DESIGN.md
// ("Rotation") writes the construction down; tests rebuild it independently.
#pragma once

#include <cstdint>

#include "turboquant/macros.h"
#include "turboquant/preset.h"
#include "turboquant/quantize.h"

namespace turboquant {

// Paley's second construction for q = 5, 9, 13 (m = 2(q + 1)): the conference matrix C of order
// q + 1 (C[0][j] = C[j][0] = 1 for j > 0, C[0][0] = 0, C[i + 1][j + 1] = chi(x_i - x_j) with chi the
// quadratic character of GF(q); GF(9) = GF(3)[i] with i^2 = -1, element a + 3b <-> a + b i), then
// H = C (x) [[1, -1], [-1, -1]] + I (x) [[1, 1], [1, -1]]. Row r as a mask: bit c set where
// H[r][c] = -1.
constexpr uint32_t kPaley12[12] = {0x0000aa8, 0x0000ffe, 0x0000962, 0x0000c3b, 0x000058a, 0x00000ef,
                                   0x0000626, 0x00003b3, 0x0000896, 0x0000ec3, 0x000025a, 0x0000b0f};
constexpr uint32_t kPaley20[20] = {0x00aaaa8, 0x00ffffe, 0x00596a2, 0x000c3fb, 0x006598a, 0x0030cef, 0x009652a,
                                   0x00c30bf, 0x005a85a, 0x000fe0f, 0x0066266, 0x0033b33, 0x0094a96, 0x00c2fc3,
                                   0x00a165a, 0x00f830f, 0x0089966, 0x00ecc33, 0x002a596, 0x00bf0c3};
constexpr uint32_t kPaley28[28] = {0xaaaaaa8, 0xffffffe, 0x9a55a62, 0xcf00f3b, 0x695698a, 0x3c03cef, 0xa55a626,
                                   0xf00f3b3, 0x956989a, 0xc03cecf, 0x55a626a, 0x00f3b3f, 0x56989a6, 0x03cecf3,
                                   0x5a62696, 0x0f3b3c3, 0x6989a56, 0x3cecf03, 0xa626956, 0xf3b3c03, 0x989a55a,
                                   0xcecf00f, 0x626956a, 0x3b3c03f, 0x89a55a6, 0xecf00f3, 0x269569a, 0xb3c03cf};
constexpr int kMaxPaleyOrder = 28;

// The factor m of d = m * 2^k: 1, 12, 20 or 28 by d's odd part (1, 3, 5, 7); 0 where d has none.
TQ_HD constexpr int hadamard_paley_order(int d) {
  if (d <= 0) return 0;
  int odd = d;
  while (odd % 2 == 0) odd /= 2;
  const int m = odd == 1 ? 1 : odd == 3 ? 12 : odd == 5 ? 20 : odd == 7 ? 28 : 0;
  return m != 0 && d % m == 0 ? m : 0;
}

// Row r of H_m as a mask of its -1 entries (m = 12, 20 or 28). Host code: device code reads the rows
// from a HadamardFactors passed to its kernel.
inline uint32_t paley_row(int m, int r) {
  return m == 12 ? kPaley12[r] : m == 20 ? kPaley20[r] : kPaley28[r];
}

// H_D = H_m (x) H_{2^k} as a transform reads it: m blocks of `block` = 2^k contiguous elements, and
// H_m's rows (masks of their -1 entries; none for m = 1).
struct HadamardFactors {
  int m = 0;
  int block = 0;
  uint32_t rows[kMaxPaleyOrder] = {};
};

inline HadamardFactors hadamard_factors(int d) {
  HadamardFactors f;
  f.m = hadamard_paley_order(d);
  f.block = f.m > 0 ? d / f.m : 0;
  for (int r = 0; f.m > 1 && r < f.m; ++r) f.rows[r] = paley_row(f.m, r);
  return f;
}

// Butterfly t (0 <= t < d / 2) of a Sylvester stage of span h: it combines elements i and i + h with
// i the t-th index whose bit h is clear. Blocks of 2^k are multiples of 2h, so no butterfly
// straddles two blocks: the stage of H_{2^k} on every block at once.
TQ_HD int sylvester_butterfly_index(int t, int h) { return (t / h) * 2 * h + t % h; }

// Element i of the H_m stage over x (the blocks already Sylvester-transformed): the sum over the
// blocks c = 0, 1, ... in order of +-x[c * block + b], (a, b) = (i / block, i % block), the sign
// from H_m's row a. Adds and subtracts only, in this order, so every caller gets the same floats.
template <typename T>
TQ_HD T paley_stage_element(const T* x, const HadamardFactors& f, int i) {
  const int a = i / f.block, b = i - a * f.block;
  const uint32_t row = f.rows[a];
  T acc = (row & 1u) ? -x[b] : x[b];
  for (int c = 1; c < f.m; ++c) {
    const T e = x[c * f.block + b];
    acc = ((row >> c) & 1u) ? acc - e : acc + e;
  }
  return acc;
}

// Unnormalized x := H_D x for d = m * 2^k (hadamard_paley_order(d) = m != 0): Sylvester's transform
// of each of the m contiguous blocks of 2^k elements (fwht_inplace's butterflies), then the H_m
// stage (paley_stage_element). The CUDA kernels that rotate at other head_dims than 64, 128 and
// 256 (kernels/generic_head_dim.cu) run the same two steps a warp at a time.
template <typename T>
void hadamard_transform_inplace(T* x, int d) {
  const HadamardFactors f = hadamard_factors(d);
  for (int a = 0; a < f.m; ++a) fwht_inplace(x + a * f.block, f.block);
  if (f.m == 1) return;
  T blocks[kMaxHeadDim];
  for (int i = 0; i < d; ++i) blocks[i] = x[i];
  for (int i = 0; i < d; ++i) x[i] = paley_stage_element(blocks, f, i);
}

}  // namespace turboquant
