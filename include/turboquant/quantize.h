// Per-element quantization rules of SPEC §4 (store_kv), shared by the CPU reference and the CUDA
// kernels: Lloyd-Max bucketing of rotated key coordinates, min/max uniform value codes, and the
// orthonormal Sylvester-Hadamard rotation as an in-place fast Walsh-Hadamard transform.
#pragma once

#include <cstdint>

#include "turboquant/macros.h"
#include "turboquant/numeric.h"

namespace turboquant {

constexpr int kMaxCodebookLevels = 16;  // 4-bit keys at most
constexpr float kKeyNormEpsilon = 1e-8f;

// Centroids and decision thresholds of one key codebook, scaled for a head_dim (levels / sqrt(D)).
// Passed to kernels by value, so it is a plain aggregate.
struct Codebook {
  int bits = 0;
  int levels = 0;                             // 2^bits
  float centroid[kMaxCodebookLevels] = {};    // ascending
  float midpoint[kMaxCodebookLevels - 1] = {};  // midpoint[i] = (centroid[i] + centroid[i+1]) / 2
};

// Index of the Lloyd-Max cell of y: the number of midpoints <= y (a coordinate equal to a midpoint
// goes to the upper cell). Branch-free binary search over the ascending midpoints (levels a power
// of two); NaN compares false everywhere and lands in cell 0.
TQ_HD uint32_t lloyd_max_index(float y, const float* midpoints, int levels) {
  uint32_t idx = 0;
  for (int step = levels >> 1; step > 0; step >>= 1) {
    idx += (midpoints[idx + step - 1] <= y) ? static_cast<uint32_t>(step) : 0u;
  }
  return idx;
}

// The stored fp16 key norm: norms past the fp16 range saturate to 65504 (rather than becoming inf,
// whose decoded key would be NaN after the inverse rotation); NaN stays NaN.
constexpr float kHalfMax = 65504.0f;
TQ_HD uint16_t key_norm_half_bits(float stored_norm) {
  return float_to_half_bits(stored_norm > kHalfMax ? kHalfMax : stored_norm);
}

// Value quantization parameters as stored (fp16-rounded), so encode and decode agree.
struct ValueQuantParams {
  uint16_t scale_bits;
  uint16_t zero_bits;
  float scale;  // value of the stored fp16 scale
  float zero;   // value of the stored fp16 zero
};

TQ_HD ValueQuantParams value_quant_params(float vmin, float vmax, int value_bits) {
  ValueQuantParams p;
  const float levels_minus_one = static_cast<float>((1 << value_bits) - 1);
  p.scale_bits = float_to_half_bits((vmax - vmin) / levels_minus_one);
  p.zero_bits = float_to_half_bits(vmin);
  p.scale = half_bits_to_float(p.scale_bits);
  p.zero = half_bits_to_float(p.zero_bits);
  return p;
}

// q = clamp(floor((v - zero) / scale + 0.5), 0, 2^b - 1); scale == 0 stores 0.
TQ_HD uint32_t value_code(float v, const ValueQuantParams& p, int value_bits) {
  if (p.scale == 0.0f) return 0u;
  const float r = floorf((v - p.zero) / p.scale + 0.5f);
  const float hi = static_cast<float>((1 << value_bits) - 1);
  const float c = r < 0.0f ? 0.0f : (r > hi ? hi : r);  // NaN -> 0 (comparisons are false)
  return r == r ? static_cast<uint32_t>(c) : 0u;
}

// Decoded value of a code: q * scale + zero.
TQ_HD float value_decode(uint32_t code, float scale, float zero) {
  return static_cast<float>(code) * scale + zero;
}

// In-place unnormalized Walsh-Hadamard transform in Sylvester order, H[i][j] = (-1)^popcount(i&j).
// n must be a power of two. Multiply by 1/sqrt(n) for the orthonormal (and symmetric) rotation.
template <typename T>
TQ_HD void fwht_inplace(T* x, int n) {
  for (int h = 1; h < n; h <<= 1) {
    for (int i = 0; i < n; i += 2 * h) {
      for (int j = i; j < i + h; ++j) {
        const T a = x[j];
        const T b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
}

// a * b rounded once: keeps nvcc from contracting a later add into an FMA, so the CPU and the
// GPU round identically.
TQ_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

constexpr int kWarpLanes = 32;

// Sum of squares in the exact order a warp computes it when lane i holds elements
// [i*E, (i+1)*E), E = n/32: each lane sums its squares in order, then an xor butterfly
// (offsets 16, 8, 4, 2, 1) combines the lanes. The CPU reference uses this order too, so both
// sides produce the same norm bits. Falls back to a plain loop when n is not a multiple of 32.
TQ_HD float sum_of_squares_warp_order(const float* x, int n) {
  if (n % kWarpLanes != 0) {
    float s = 0.0f;
    for (int i = 0; i < n; ++i) s += mul_rn(x[i], x[i]);
    return s;
  }
  const int per_lane = n / kWarpLanes;
  float partial[kWarpLanes];
  for (int lane = 0; lane < kWarpLanes; ++lane) {
    float s = 0.0f;
    for (int j = 0; j < per_lane; ++j) s += mul_rn(x[lane * per_lane + j], x[lane * per_lane + j]);
    partial[lane] = s;
  }
  for (int offset = kWarpLanes / 2; offset > 0; offset >>= 1) {
    float next[kWarpLanes];
    for (int lane = 0; lane < kWarpLanes; ++lane) next[lane] = partial[lane] + partial[lane ^ offset];
    for (int lane = 0; lane < kWarpLanes; ++lane) partial[lane] = next[lane];
  }
  return partial[0];
}

TQ_HD bool is_power_of_two(int n) { return n > 0 && (n & (n - 1)) == 0; }

}  // namespace turboquant
