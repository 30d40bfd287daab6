// Orthonormal Sylvester Hadamard matrices (H_D / sqrt(D)), built once per order and cached.
#pragma once

#include <vector>

namespace turboquant {

// Row-major D x D matrix with entries (-1)^popcount(i & j) / sqrt(D); D a power of two.
// Orthonormal and symmetric, so it is its own inverse.
const std::vector<float>& orthonormal_hadamard(int head_dim);

}  // namespace turboquant
