// The orthonormal key rotations H_D / sqrt(D) as matrices (turboquant/hadamard_transform.h), built
// once per order and cached.
#pragma once

#include <vector>

namespace turboquant {

// Row-major D x D matrix H_D / sqrt(D), D = m * 2^k with m in {1, 12, 20, 28} (for a power of two,
// entries (-1)^popcount(i & j) / sqrt(D)). Orthonormal and symmetric, so it is its own inverse.
const std::vector<float>& orthonormal_hadamard(int head_dim);

}  // namespace turboquant
