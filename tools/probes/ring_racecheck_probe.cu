// Control for compute-sanitizer racecheck on the row-staged decode's ring (no torch): does
// racecheck understand a bulk-copy ring synchronized by "full" and "empty" mbarriers?
// The same protocol as kernels/decode_rows.cu, with the same wrappers (kernels/device_utils.cuh):
// warp 0 copies tile t into stage t % 4 with cp.async.bulk once all 8 warps freed the stage;
// every warp waits on the stage's full barrier, sums its bytes, frees it; the sums must match the
// host's. If racecheck reports hazards here, where the protocol is the decode kernel's and the
// result is right, it cannot see this synchronization, and its reports on the decode kernel say
// nothing about it. (A variant without the full-barrier wait hung under racecheck: a stage
// refilled before its copy landed breaks the barrier's byte count.)
// H200 (docs/DESIGN.md, "Sanitizers"): the sums match and racecheck reports a hazard.
//   nvcc -O3 -std=c++17 -arch=sm_90 -Ikernels -Iinclude tools/probes/ring_racecheck_probe.cu -o ring_probe
//   compute-sanitizer --tool racecheck ./ring_probe
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "device_utils.cuh"

namespace {

constexpr int kWarps = 8, kStages = 4, kTileBytes = 4096, kTiles = 64;

__global__ void ring_kernel(const uint8_t* src, uint32_t* sums) {
  using namespace turboquant::device;
  extern __shared__ __align__(128) uint8_t smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * kTileBytes);
  uint64_t* empty = full + kStages;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&full[s], 1);
      mbarrier_init(&empty[s], kWarps);
    }
    fence_mbarrier_init();
  }
  __syncthreads();
  auto produce = [&](int t) {
    const int stage = t % kStages;
    if (t >= kStages) {
      if (lane == 0) mbarrier_wait(&empty[stage], ((t / kStages) - 1) & 1);
      __syncwarp();
    }
    if (lane == 0) {
      mbarrier_arrive_expect_bytes(&full[stage], kTileBytes);
      bulk_copy_to_shared(smem + stage * kTileBytes, src + static_cast<size_t>(t) * kTileBytes, kTileBytes, &full[stage]);
    }
    __syncwarp();
  };
  if (warp == 0) {
    for (int t = 0; t < kStages - 1; ++t) produce(t);
  }
  uint32_t sum = 0;
  for (int it = 0; it < kTiles; ++it) {
    if (warp == 0 && it + kStages - 1 < kTiles) produce(it + kStages - 1);
    const int stage = it % kStages;
    mbarrier_wait(&full[stage], (it / kStages) & 1);
    const uint32_t* words = reinterpret_cast<const uint32_t*>(smem + stage * kTileBytes);
    for (int i = lane; i < kTileBytes / 4; i += 32) sum += words[i];
    __syncwarp();
    if (lane == 0) mbarrier_arrive(&empty[stage]);
  }
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(kFullMask, sum, off);
  if (lane == 0) sums[warp] = sum;
}

}  // namespace

int main() {
  std::vector<uint8_t> host(static_cast<size_t>(kTiles) * kTileBytes);
  uint32_t expect = 0;
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<uint8_t>(i * 2654435761u >> 13);
  for (size_t i = 0; i < host.size(); i += 4) {
    uint32_t w;
    std::memcpy(&w, &host[i], 4);
    expect += w;
  }
  uint8_t* src = nullptr;
  uint32_t* sums = nullptr;
  cudaMalloc(&src, host.size());
  cudaMalloc(&sums, kWarps * sizeof(uint32_t));
  cudaMemcpy(src, host.data(), host.size(), cudaMemcpyHostToDevice);
  const int smem = kStages * kTileBytes + 2 * kStages * 8;
  ring_kernel<<<1, kWarps * 32, smem>>>(src, sums);
  std::vector<uint32_t> got(kWarps);
  const cudaError_t err = cudaMemcpy(got.data(), sums, kWarps * sizeof(uint32_t), cudaMemcpyDeviceToHost);
  int ok = 0;
  for (uint32_t s : got) ok += s == expect;
  std::printf("ring: %s, %d of %d warps' sums match\n", cudaGetErrorString(err), ok, kWarps);
  return err == cudaSuccess && ok == kWarps ? 0 : 1;
}
