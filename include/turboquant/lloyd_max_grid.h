// Lloyd-Max bucketing by table lookup, for the CUDA store: the same index as lloyd_max_index
// (quantize.h) with one shared-memory load and one comparison per coordinate instead of a
// log2(levels)-step binary search.
//
// A uniform grid of cells covers the midpoints. cell(y) = clamp(round(y * scale + offset)) is
// non-decreasing in y (an FMA and a rounding are monotone), so for a midpoint m:
//   cell(m) < cell(y)  implies  m <= y   (m > y would give cell(m) >= cell(y)),
//   cell(m) > cell(y)  implies  m >  y.
// Hence lloyd_max_index(y) = (midpoints in lower cells) + (the midpoint in y's own cell <= y), as
// long as no cell holds two midpoints (make_lloyd_max_grid checks this; the kernel falls back to
// the binary search otherwise). The table stores both numbers per cell.
#pragma once

#include <cstdint>

#include "turboquant/macros.h"
#include "turboquant/numeric.h"
#include "turboquant/quantize.h"

namespace turboquant {

constexpr int kGridCells = 64;
// Adding 1.5 * 2^23 leaves round(x) in the low mantissa bits of the sum, for |x| < 2^22.
constexpr float kRoundingBias = 12582912.0f;

struct GridCell {
  float midpoint;     // the midpoint whose cell this is; NaN (compares false) when none
  uint32_t below;     // midpoints in lower cells
};

struct LloydMaxGrid {
  bool usable = false;
  float scale = 0.0f;
  float biased_offset = 0.0f;  // offset + kRoundingBias
  GridCell cell[kGridCells] = {};
};

// Valid for |y| * scale < 2^21, i.e. any coordinate of a unit vector (the store only uses the
// grid for finite keys, whose normalized rotated coordinates are at most 1 in magnitude). A NaN y
// lands in some cell and gets an index there, unlike lloyd_max_index's 0: another reason the
// kernel takes the binary search for non-finite keys.
TQ_HD int grid_cell(float y, float scale, float biased_offset) {
  const float biased = fma_rn(y, scale, biased_offset);
  const int cell = static_cast<int>(float_bits(biased) - float_bits(kRoundingBias));
  return cell < 0 ? 0 : (cell > kGridCells - 1 ? kGridCells - 1 : cell);
}

TQ_HD uint32_t lloyd_max_index_on_grid(float y, const GridCell& c) {
  return c.below + (c.midpoint <= y ? 1u : 0u);
}

// The grid of a codebook: cells centered on 0 (0 lands in cell 32), the outermost midpoints in
// cells 1 and 63. Unusable (kernel falls back to the binary search) for codebooks it cannot hold.
TQ_HD LloydMaxGrid make_lloyd_max_grid(const Codebook& codebook) {
  LloydMaxGrid g;
  const int mids = codebook.levels - 1;
  if (mids < 1 || mids > kMaxCodebookLevels - 1) return g;
  float reach = 0.0f;
  for (int j = 0; j < mids; ++j) reach = fmaxf(reach, fabsf(codebook.midpoint[j]));
  // Midpoints of a unit vector's coordinates, spread enough that |y| <= 1 keeps |y| * scale < 2^21.
  if (!(reach >= 0x1p-15f && reach < 1.0f)) return g;
  g.scale = static_cast<float>(kGridCells / 2 - 1) / reach;
  g.biased_offset = kRoundingBias + static_cast<float>(kGridCells / 2);
  int cell_of[kMaxCodebookLevels];
  for (int j = 0; j < mids; ++j) {
    cell_of[j] = grid_cell(codebook.midpoint[j], g.scale, g.biased_offset);
    if (j > 0 && cell_of[j] <= cell_of[j - 1]) return g;  // two midpoints share a cell
  }
  for (int t = 0; t < kGridCells; ++t) {
    g.cell[t].midpoint = bits_float(0x7fc00000u);
    g.cell[t].below = 0;
    for (int j = 0; j < mids; ++j) {
      if (cell_of[j] < t) ++g.cell[t].below;
      if (cell_of[j] == t) g.cell[t].midpoint = codebook.midpoint[j];
    }
  }
  g.usable = true;
  return g;
}

}  // namespace turboquant
