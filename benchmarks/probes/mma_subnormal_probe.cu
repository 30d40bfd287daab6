// Does mma.sync m16n8k16 (fp16 in, fp32 accumulate) take fp16 subnormal A inputs exactly? A
// decode variant (branch wip/value-subnormal, not merged) fed the PV MMA value codes as
// subnormals, one AND per register: code c at bit 0 of a half is c * 2^-24. On the H200
// (2026-12-03) it does not: every result of codes at bit 0 differed (RESULTS.md), so the decode
// keeps codes as fp16 integers. For random codes and random fp16 B, the probe compares
// D = A_sub * B (scaled by 2^24 after) with D = A_int * B (the codes as ordinary fp16 integers),
// bit for bit, over many random tiles and accumulation chains. A flushing or rounding tensor
// core shows as mismatches.
//   nvcc -O3 -std=c++17 -arch=sm_90 -Ikernels -Iinclude benchmarks/probes/mma_subnormal_probe.cu -o mma_probe && ./mma_probe
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "device_utils.cuh"

namespace {
// The variant's conversion: B-bit codes at bit 0 of both halves as fp16 subnormals c * 2^-24.
template <int B>
__device__ __forceinline__ uint32_t low_codes_subnormal(uint32_t x) {
  constexpr uint32_t m = (1u << B) - 1u;
  return x & (m | (m << 16));
}
}  // namespace

namespace {

constexpr int kWarps = 1024, kTiles = 64;

__device__ uint32_t hash(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  return x ^ (x >> 16);
}

// Each warp accumulates kTiles products both ways; mismatches counts differing fp32 results.
__global__ void probe_kernel(unsigned* mismatches) {
  using namespace turboquant::device;
  const int lane = threadIdx.x & 31;
  const uint32_t warp = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
  float sub[4] = {0, 0, 0, 0}, ref[4] = {0, 0, 0, 0};
  for (int t = 0; t < kTiles; ++t) {
    uint32_t a_sub[4], a_int[4];
    for (int r = 0; r < 4; ++r) {
      const uint32_t codes = hash(warp * 7919u + t * 131u + r * 17u + lane) & 0x000f000fu;  // two 4-bit codes
      a_sub[r] = low_codes_subnormal<4>(codes);
      const __half2 h = __halves2half2(__ushort2half_rn(codes & 0xf), __ushort2half_rn(codes >> 16));
      a_int[r] = *reinterpret_cast<const uint32_t*>(&h);
    }
    // B: random fp16 weights in [2^-12, 1), like P * value scale.
    uint32_t b[2];
    for (int r = 0; r < 2; ++r) {
      const uint32_t h = hash(warp * 104729u + t * 31u + r * 7u + lane + 12345u);
      const __half2 v = __floats2half2_rn(ldexpf(1.0f + (h & 0x3ff) / 1024.0f, -1 - static_cast<int>((h >> 10) % 12)),
                                          ldexpf(1.0f + ((h >> 16) & 0x3ff) / 1024.0f, -1 - static_cast<int>((h >> 26) % 12)));
      b[r] = *reinterpret_cast<const uint32_t*>(&v);
    }
    mma_16816(sub, a_sub[0], a_sub[1], a_sub[2], a_sub[3], b[0], b[1]);
    mma_16816(ref, a_int[0], a_int[1], a_int[2], a_int[3], b[0], b[1]);
  }
  unsigned bad = 0;
  for (int e = 0; e < 4; ++e) bad += (sub[e] * 16777216.0f) != ref[e];
  if (bad) atomicAdd(mismatches, bad);
}

}  // namespace

int main() {
  unsigned* d = nullptr;
  cudaMalloc(&d, sizeof(unsigned));
  cudaMemset(d, 0, sizeof(unsigned));
  probe_kernel<<<kWarps / 8, 256>>>(d);
  unsigned bad = 0;
  const cudaError_t err = cudaMemcpy(&bad, d, sizeof(unsigned), cudaMemcpyDeviceToHost);
  std::printf("mma subnormal A: %s, %u of %d fp32 results differ from the integer-code MMA scaled by 2^-24\n",
              cudaGetErrorString(err), bad, kWarps * 32 * 4);
  return err == cudaSuccess && bad == 0 ? 0 : 1;
}
