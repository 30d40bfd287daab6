// Cache of orthonormal Sylvester Hadamard matrices (host copies; torch glue caches device ones).
#include "turboquant/hadamard.h"

#include <cmath>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>

#include "turboquant/quantize.h"

namespace turboquant {

const std::vector<float>& orthonormal_hadamard(int head_dim) {
  if (!is_power_of_two(head_dim)) {
    throw std::invalid_argument("turboquant: a Sylvester Hadamard matrix needs a power-of-two order, got " +
                                std::to_string(head_dim));
  }
  static std::mutex mutex;
  static std::map<int, std::vector<float>> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(head_dim);
  if (it != cache.end()) return it->second;
  std::vector<float> h(static_cast<size_t>(head_dim) * head_dim);
  const float s = 1.0f / std::sqrt(static_cast<float>(head_dim));
  for (int i = 0; i < head_dim; ++i) {
    for (int j = 0; j < head_dim; ++j) {
      h[static_cast<size_t>(i) * head_dim + j] = (__builtin_popcount(i & j) & 1) ? -s : s;
    }
  }
  return cache.emplace(head_dim, std::move(h)).first->second;
}

}  // namespace turboquant
