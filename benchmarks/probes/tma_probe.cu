// Standalone check of a rule the decode kernel's staging depends on (no torch): can one 3-D TMA
// box (row_bytes x 16 tokens x 1 block) of a dense token-major uint8 cache start at any byte of
// a token row? The box starts at x bytes into token 0 of block 1, completes on an mbarrier, and
// its bytes are compared with the source. An illegal-instruction fault ends the CUDA context, so
// each x runs in its own process:
//   nvcc -O3 -std=c++17 -arch=sm_90 benchmarks/probes/tma_probe.cu -L/usr/local/cuda/lib64/stubs -lcuda -o tma_probe
//   for x in 0 16 144 2 8 134; do ./tma_probe $x; done
// H200, driver of 2026-12 (benchmarks/RESULTS.md): x = 0, 16, 144 copy exactly; x = 2 faults
// with "an illegal instruction was encountered". A box must start 16-byte aligned, so a slot of
// 134 bytes (4bit_nc, D = 128) cannot be the start of a box for 15 of every 16 (token, head) slots.
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

__global__ void box_kernel(const __grid_constant__ CUtensorMap map, int x, int y, int z, int bytes, uint8_t* out) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ __align__(8) uint64_t bar;
  const uint32_t bar_addr = static_cast<uint32_t>(__cvta_generic_to_shared(&bar));
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar_addr));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar_addr), "r"(bytes) : "memory");
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
        ::"r"(dst), "l"(&map), "r"(x), "r"(y), "r"(z), "r"(bar_addr) : "memory");
    uint32_t done = 0;
    while (!done) {
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
                   : "=r"(done) : "r"(bar_addr) : "memory");
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < bytes; i += blockDim.x) out[i] = smem[i];
}

int main(int argc, char** argv) {
  const int x = argc > 1 ? atoi(argv[1]) : 0;  // box start in bytes within the token row
  const int heads = 8, slot = 134, row = 144, block_size = 16, blocks = 4;
  const int token_bytes = heads * slot;  // 1072, a multiple of 16 as the tensor map requires
  const size_t total = static_cast<size_t>(blocks) * block_size * token_bytes;
  std::vector<uint8_t> host(total);
  for (size_t i = 0; i < total; ++i) host[i] = static_cast<uint8_t>(i * 7 + i / 251);
  uint8_t *cache = nullptr, *out = nullptr;
  cudaMalloc(&cache, total);
  cudaMalloc(&out, row * 16);
  cudaMemcpy(cache, host.data(), total, cudaMemcpyHostToDevice);
  CUtensorMap map{};
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(token_bytes), static_cast<cuuint64_t>(block_size),
                              static_cast<cuuint64_t>(blocks)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(token_bytes),
                                 static_cast<cuuint64_t>(token_bytes) * block_size};
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(row), 16, 1}, element_strides[3] = {1, 1, 1};
  const CUresult encoded = cuTensorMapEncodeTiled(
      &map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, cache, dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (encoded != CUDA_SUCCESS) {
    printf("| %d | encoding refused (%d) |\n", x, static_cast<int>(encoded));
    return 1;
  }
  box_kernel<<<1, 128, row * 16>>>(map, x, 0, 1, row * 16, out);
  const cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    printf("| %d | %s |\n", x, cudaGetErrorString(err));
    return 1;
  }
  std::vector<uint8_t> got(row * 16);
  cudaMemcpy(got.data(), out, got.size(), cudaMemcpyDeviceToHost);
  int bad = 0;
  for (int t = 0; t < 16; ++t) {
    for (int b = 0; b < row; ++b) {
      const size_t src = (static_cast<size_t>(1) * block_size + t) * token_bytes + x + b;
      const uint8_t want = x + b < token_bytes ? host[src] : 0;  // past the row: zero fill
      bad += got[t * row + b] != want;
    }
  }
  printf("| %d | %d of %d bytes differ |\n", x, bad, row * 16);
  return bad == 0 ? 0 : 1;
}
