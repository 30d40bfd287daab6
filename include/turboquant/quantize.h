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
// goes to the upper cell). Binary search over the ascending midpoints (levels a power of two),
// branch-free: the comparison's 0 or 1 scales the step (written as a select, gcc -O3 branched on
// it, and random coordinates mispredicted about half the branches: 60 % of the CPU store's time);
// NaN compares false everywhere and lands in cell 0.
TQ_HD uint32_t lloyd_max_index(float y, const float* midpoints, int levels) {
  uint32_t idx = 0;
  for (int step = levels >> 1; step > 0; step >>= 1) {
    idx += static_cast<uint32_t>(midpoints[idx + step - 1] <= y) * static_cast<uint32_t>(step);
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

// vmin and vmax as min/max reductions found them; + 0.0f turns -0 into +0, so the order in which
// a reduction met +0 and -0 (which fminf/fmaxf leave unspecified) cannot change the stored bytes.
TQ_HD ValueQuantParams value_quant_params(float vmin, float vmax, int value_bits) {
  vmin = vmin + 0.0f;
  vmax = vmax + 0.0f;
  ValueQuantParams p;
  const float levels_minus_one = static_cast<float>((1 << value_bits) - 1);
  p.scale_bits = float_to_half_bits((vmax - vmin) / levels_minus_one);
  p.zero_bits = float_to_half_bits(vmin);
  p.scale = half_bits_to_float(p.scale_bits);
  p.zero = half_bits_to_float(p.zero_bits);
  return p;
}

// clamp(floor(u), 0, 2^b - 1), NaN -> 0: the code of a value whose quotient plus one half is u.
// The GPU converts with floor to unsigned in one instruction (negative values and NaN convert to
// 0, the destination range saturates), then takes one min: the same result.
TQ_HD uint32_t value_code_of_rounded(float u, int value_bits) {
  const uint32_t hi = (1u << value_bits) - 1u;
#if defined(__CUDA_ARCH__)
  return min(__float2uint_rd(u), hi);
#else
  const float r = floorf(u);
  const float c = r < 0.0f ? 0.0f : (r > static_cast<float>(hi) ? static_cast<float>(hi) : r);
  return r == r ? static_cast<uint32_t>(c) : 0u;
#endif
}

// The code of a value whose quotient (v - zero) / scale is t: clamp(floor(t + 0.5), 0, 2^b - 1).
TQ_HD uint32_t value_code_of_quotient(float t, int value_bits) { return value_code_of_rounded(t + 0.5f, value_bits); }

// q = clamp(floor((v - zero) / scale + 0.5), 0, 2^b - 1); scale == 0 stores 0.
TQ_HD uint32_t value_code(float v, const ValueQuantParams& p, int value_bits) {
  if (p.scale == 0.0f) return 0u;
  return value_code_of_quotient((v - p.zero) / p.scale, value_bits);
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

// a * b + c rounded once, on both sides.
TQ_HD float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fmaf(a, b, c);
#endif
}

// Whether d and 1/d are normal floats: the CUDA store codes values with one reciprocal of the
// scale per vector (kernels/store_kv.cu) only then, else with the IEEE division per element.
TQ_HD bool reciprocal_division_exact(float d) {
  const float a = fabsf(d);
  return a >= 0x1p-125f && a <= 0x1p125f;  // NaN fails both
}

// Lanes of a warp that hold one head vector in the CUDA store: the smallest power of two giving
// each lane at most 32 elements, so a warp stores several vectors, most of the rotation's
// butterflies stay in registers and the reductions are short. n = 64: 2 lanes x 32; 96: 4 x 24;
// 128: 4 x 32; 256: 8 x 32. The norm's summation order follows this split.
TQ_HD constexpr int vector_lanes(int n) {
  int lanes = 1;
  while (lanes < 32 && lanes * 32 < n) lanes *= 2;
  return lanes;
}

// Sum of squares in the exact order the CUDA store computes it when lane i of a group of
// L = vector_lanes(n) lanes holds elements [i*E, (i+1)*E), E = n/L: each lane accumulates its
// squares in order with FMAs (one instruction per element on the GPU), then an xor butterfly
// (offsets L/2, ..., 2, 1) combines the lanes. The CPU reference uses this order too, so both
// sides produce the same norm bits. A plain loop when L does not divide n.
TQ_HD float sum_of_squares_lane_order(const float* x, int n) {
  constexpr int kMaxLanes = 32;
  const int lanes = vector_lanes(n);
  if (n % lanes != 0) {
    float s = 0.0f;
    for (int i = 0; i < n; ++i) s = fma_rn(x[i], x[i], s);
    return s;
  }
  const int per_lane = n / lanes;
  float partial[kMaxLanes];
  for (int lane = 0; lane < lanes; ++lane) {
    float s = 0.0f;
    for (int j = 0; j < per_lane; ++j) s = fma_rn(x[lane * per_lane + j], x[lane * per_lane + j], s);
    partial[lane] = s;
  }
  for (int offset = lanes / 2; offset > 0; offset >>= 1) {
    float next[kMaxLanes];
    for (int lane = 0; lane < lanes; ++lane) next[lane] = partial[lane] + partial[lane ^ offset];
    for (int lane = 0; lane < lanes; ++lane) partial[lane] = next[lane];
  }
  return partial[0];
}

TQ_HD bool is_power_of_two(int n) { return n > 0 && (n & (n - 1)) == 0; }

}  // namespace turboquant
