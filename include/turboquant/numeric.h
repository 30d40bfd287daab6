// Scalar number formats shared by the CPU reference and the CUDA kernels: IEEE binary16 (the
// norm, scale and zero fields) and FP8 e4m3fn (keys of preset k8v4). One definition each, so both
// sides produce the same bytes.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "turboquant/macros.h"

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#endif

namespace turboquant {

TQ_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

TQ_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// float -> binary16 bits, round to nearest even (overflow -> inf, NaN kept).
// On the GPU the bits come out of a packed pair (cvt.rn.f16x2.f32, the other half zero) rather
// than __float2half_rn: ptxas (CUDA 13) compiles `cvt.rn.f16.f32` followed by a byte store of the
// result's low byte as F2I.U8.F16, the half's value converted to an integer, so a store writing a
// slot's fp16 field byte by byte (store_half_field) wrote the norm's integer part as its low byte
// (the generic store's byte tests in tests/python/test_cuda_head_dims.py, on an H100; the SASS of
// kernels/generic_head_dim.cu showed the F2I.U8.F16). NaN is written as the CPU writes it.
TQ_HD uint16_t float_to_half_bits(float f) {
#if defined(__CUDA_ARCH__)
  if (f != f) return static_cast<uint16_t>(((float_bits(f) >> 16) & 0x8000u) | 0x7e00u);  // the CPU's NaN
  uint32_t pair;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(pair) : "f"(0.0f), "f"(f));  // f's half in the low 16 bits
  return static_cast<uint16_t>(pair & 0xffffu);
#else
  const uint32_t x = float_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (abs < 0x38800000u) {  // result is subnormal or zero: units of 2^-24
    const float a = bits_float(abs);
    const uint32_t q = static_cast<uint32_t>(std::nearbyint(a * 16777216.0f));
    return static_cast<uint16_t>(sign | q);
  }
  // Normal: drop 13 mantissa bits with round-to-nearest-even; a carry bumps the exponent.
  const uint32_t rebased = abs - 0x38000000u;  // exponent bias 127 -> 15
  const uint32_t lsb = (rebased >> 13) & 1u;
  return static_cast<uint16_t>(sign | ((rebased + 0x0fffu + lsb) >> 13));
#endif
}

TQ_HD float half_bits_to_float(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0) {
    const float v = static_cast<float>(man) * 5.9604644775390625e-08f;  // 2^-24
    return sign ? -v : v;
  }
  if (exp == 31) return bits_float(sign | 0x7f800000u | (man << 13));
  return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
#endif
}

// Rounds to a binary16 value and back (what a stored fp16 field decodes to).
TQ_HD float round_to_half(float f) { return half_bits_to_float(float_to_half_bits(f)); }

// An fp16 output of a finite result: finite values past the fp16 range clamp to +-65504, inf and
// NaN pass through. A value decoded from fp16 fields can land just past the range (zero + 15 *
// scale rounds up to 65536 for values stored at 65504); it means "the largest magnitude", and an
// fp16 output must not turn it into inf.
TQ_HD float clamp_to_half_range(float x) {
  constexpr float kHalfMax = 65504.0f, kFloatMax = 3.40282347e38f;
  if (x > kHalfMax && x <= kFloatMax) return kHalfMax;
  if (x < -kHalfMax && x >= -kFloatMax) return -kHalfMax;
  return x;
}

// ---- FP8 e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no inf; 0x7f/0xff are NaN;
// largest finite 448. Encoding rounds to nearest even and saturates to +-448 (inf included).
constexpr float kFp8E4M3Max = 448.0f;

TQ_HD uint8_t float_to_fp8_e4m3(float f) {
  const uint32_t sign = (float_bits(f) >> 24) & 0x80u;
  const float a = fabsf(f);
  if (a != a) return static_cast<uint8_t>(sign | 0x7fu);
  if (a >= kFp8E4M3Max) return static_cast<uint8_t>(sign | 0x7eu);
  uint32_t code;
  if (a < 0.015625f) {  // below 2^-6: subnormal steps of 2^-9 (a carry lands on 2^-6 = 0x08)
    code = static_cast<uint32_t>(rintf(a * 512.0f));
  } else {
    const int e = static_cast<int>((float_bits(a) >> 23) & 0xffu) - 127;  // -6..8
    // a / 2^(e-3), as an exact multiply by the power of two (a division costs a dozen GPU instructions)
    const float inv_step = bits_float(static_cast<uint32_t>(3 - e + 127) << 23);
    const uint32_t q = static_cast<uint32_t>(rintf(a * inv_step));  // 8..16
    code = (static_cast<uint32_t>(e + 7) << 3) + (q - 8u);
  }
  if (code > 0x7eu) code = 0x7eu;  // rounding up past 448 saturates
  return static_cast<uint8_t>(sign | code);
}

TQ_HD float fp8_e4m3_to_float(uint8_t v) {
  const uint32_t sign = v & 0x80u;
  const uint32_t exp = (v >> 3) & 0xfu;
  const uint32_t man = v & 0x7u;
  float mag;
  if (exp == 0xfu && man == 0x7u) {
    mag = bits_float(0x7fc00000u);
  } else if (exp == 0) {
    mag = static_cast<float>(man) * 0.001953125f;  // 2^-9
  } else {
    mag = bits_float(((exp + 120u) << 23) | (man << 20));
  }
  return sign ? -mag : mag;
}

}  // namespace turboquant
