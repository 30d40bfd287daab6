// Cache of the orthonormal key rotations H_D / sqrt(D) (host copies; torch glue caches device ones).
#include "turboquant/hadamard.h"

#include <cmath>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>

#include "turboquant/hadamard_transform.h"

namespace turboquant {

const std::vector<float>& orthonormal_hadamard(int head_dim) {
  if (hadamard_paley_order(head_dim) == 0) {
    throw std::invalid_argument("turboquant: the key rotation needs head_dim = m * 2^k with m in {1, 12, 20, 28}, got " +
                                std::to_string(head_dim));
  }
  static std::mutex mutex;
  static std::map<int, std::vector<float>> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(head_dim);
  if (it != cache.end()) return it->second;
  // Column j is H e_j (the transform of a unit vector: exact, every sum has one nonzero term);
  // H is symmetric, so row j too.
  std::vector<float> h(static_cast<size_t>(head_dim) * head_dim);
  const float s = 1.0f / std::sqrt(static_cast<float>(head_dim));
  std::vector<float> e(head_dim);
  for (int j = 0; j < head_dim; ++j) {
    std::fill(e.begin(), e.end(), 0.0f);
    e[j] = 1.0f;
    hadamard_transform_inplace(e.data(), head_dim);
    for (int i = 0; i < head_dim; ++i) h[static_cast<size_t>(i) * head_dim + j] = e[i] * s;
  }
  return cache.emplace(head_dim, std::move(h)).first->second;
}

}  // namespace turboquant
