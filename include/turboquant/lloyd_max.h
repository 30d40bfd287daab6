// Lloyd-Max optimal fixed-rate scalar quantizer (SPEC §3) and the codebook cache.
#pragma once

#include <vector>

#include "turboquant/quantize.h"

namespace turboquant {

struct LloydMaxResult {
  std::vector<double> levels;      // 2^bits reconstruction levels, ascending
  std::vector<double> thresholds;  // 2^bits - 1 decision thresholds (midpoints of the levels)
  double mse = 0.0;                // E[(x - Q(x))^2] under the density
  int iterations = 0;
  double last_change = 0.0;  // largest level change of the final iteration
};

// Optimal quantizer for the unit Gaussian, with closed-form cell integrals
// (int x phi = phi(a) - phi(b), int phi = Phi(b) - Phi(a) via erfc), iterated from a uniform start
// until the largest level change is below `tolerance`.
LloydMaxResult solve_lloyd_max_gaussian(int bits, double tolerance = 1e-12,
                                        int max_iterations = 100000);

// Largest |level - centroid of its cell| for the unit Gaussian: 0 at the exact fixed point.
double gaussian_fixed_point_residual(const std::vector<double>& levels);

// Optimal quantizer for one coordinate of a uniformly random unit vector in R^D, density
// proportional to (1 - t^2)^((D-3)/2) on [-1, 1] (numerical integration). Offered only as the
// explicitly named "sphere" codebook; the presets use the Gaussian one.
LloydMaxResult solve_lloyd_max_sphere(int bits, int head_dim, double tolerance = 1e-12,
                                      int max_iterations = 100000);

// fp32 codebook for keys of a head_dim: the converged unit-Gaussian levels / sqrt(head_dim),
// built once per (bits, head_dim) and cached. bits in 1..4.
const Codebook& gaussian_codebook(int bits, int head_dim);

}  // namespace turboquant
