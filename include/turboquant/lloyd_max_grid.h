// Lloyd-Max bucketing by table lookup, for the CUDA store: the same index as lloyd_max_index
// (quantize.h) with one shared-memory load and one comparison per coordinate instead of a
// log2(levels)-step binary search.
//
// A uniform grid of cells covers the midpoints. cell(y) = round(y * scale + offset) is
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

// 256 cells spanning [-kGridReach, kGridReach]: every coordinate of a unit vector lands inside
// without a clamp, and the cells (about 0.008 wide) are narrower than the closest midpoints of the
// preset codebooks (0.016 apart at 4 bits, D = 256).
constexpr int kGridCells = 256;
constexpr float kGridReach = 1.0f + 0x1p-6f;
// Adding 1.5 * 2^23 leaves round(x) in the low mantissa bits of the sum, for |x| < 2^22.
constexpr float kRoundingBias = 12582912.0f;

struct GridCell {
  float midpoint;        // the midpoint whose cell this is; NaN (compares false) when none
  uint32_t below;        // midpoints in lower cells
  float square_below;    // centroid[below]^2, and centroid[below + 1]^2 (or the same when no
  float square_above;    // midpoint is in the cell): the norm correction's terms, without a second lookup
};

// cell(y) = round(y * scale + kGridCells / 2): a function of y alone, the same for every codebook;
// usable says the codebook's midpoints fit (inside the reach, at most one per cell).
struct LloydMaxGrid {
  bool usable = false;
  float scale = static_cast<float>(kGridCells / 2 - 1) / kGridReach;
  float biased_offset = kRoundingBias + static_cast<float>(kGridCells / 2);
  uint32_t rounding_bias_bits = float_bits(kRoundingBias);  // the cell index's offset in the sum's bits
};

// Cell of y, for |y| <= kGridReach (then 1 <= cell <= kGridCells - 1): no clamp. The store only
// looks up finite keys' rotated coordinates divided by a denominator above their norm, which are
// at most 1 + 2^-20 in magnitude (float rounding of an orthonormal transform).
TQ_HD int grid_cell(float y, const LloydMaxGrid& g) {
  return static_cast<int>(float_bits(fma_rn(y, g.scale, g.biased_offset)) - g.rounding_bias_bits);
}

TQ_HD uint32_t lloyd_max_index_on_grid(float y, const GridCell& c) {
  return c.below + (c.midpoint <= y ? 1u : 0u);
}

// The squared centroid of y's index, from the same cell.
TQ_HD float squared_centroid_on_grid(float y, const GridCell& c) {
  return c.midpoint <= y ? c.square_above : c.square_below;
}

// The content of cell t of a codebook's table: computed per CTA by the kernel (a few hundred
// comparisons per thread) and by the GTest, from the codebook's midpoints.
TQ_HD GridCell grid_cell_entry(const Codebook& codebook, const LloydMaxGrid& g, int t) {
  GridCell c{bits_float(0x7fc00000u), 0u, 0.0f, 0.0f};
  bool has_midpoint = false;
  for (int j = 0; j < codebook.levels - 1; ++j) {
    const int cell = grid_cell(codebook.midpoint[j], g);
    if (cell < t) ++c.below;
    if (cell == t) c.midpoint = codebook.midpoint[j], has_midpoint = true;
  }
  const float low = codebook.centroid[c.below];
  const float high = codebook.centroid[has_midpoint ? c.below + 1 : c.below];
  c.square_below = low * low;
  c.square_above = high * high;
  return c;
}

// Whether the grid can hold a codebook: midpoints inside the reach (so their cells are in the
// table), ascending, one per cell. Otherwise the kernel falls back to the binary search.
TQ_HD LloydMaxGrid make_lloyd_max_grid(const Codebook& codebook) {
  LloydMaxGrid g;
  const int mids = codebook.levels - 1;
  if (mids < 1 || mids > kMaxCodebookLevels - 1) return g;
  for (int j = 0; j < mids; ++j) {
    if (!(fabsf(codebook.midpoint[j]) < 1.0f)) return g;
    if (j > 0 && grid_cell(codebook.midpoint[j], g) <= grid_cell(codebook.midpoint[j - 1], g)) return g;
  }
  g.usable = true;
  return g;
}

}  // namespace turboquant
