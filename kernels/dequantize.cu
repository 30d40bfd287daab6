// Dequantize: packed pages -> dense K and V [batch, max_seq_len, Hkv, D] in the original basis.
// One warp per (sequence, position, KV head): indices -> centroids x stored norm, the inverse
// rotation as the same in-register FWHT the store uses (R is symmetric), values -> code * scale +
// zero. Positions past a sequence's length, or whose block-table entry is out of range, are left
// as the caller filled them (zeros).
#include <cuda_runtime.h>

#include "device_utils.cuh"
#include "dispatch.cuh"
#include "launchers.h"
#include "turboquant/numeric.h"
#include "turboquant/packing.h"

namespace turboquant {
namespace {

constexpr int kWarpsPerBlock = 8;

__device__ __forceinline__ float load_half_field(const uint8_t* p) {
  return half_bits_to_float(static_cast<uint16_t>(p[0] | (p[1] << 8)));
}

template <typename T, int D, bool kFp8Key>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) dequantize_kernel(const DequantizeParams p, const float rsqrt_d) {
  constexpr int E = D / 32;
  const int lane = threadIdx.x & 31;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  const int heads = p.cache.num_kv_heads;
  if (item >= static_cast<int64_t>(p.batch) * p.max_seq_len * heads) return;
  const int head = static_cast<int>(item % heads);
  const int64_t bt = item / heads;
  const int t = static_cast<int>(bt % p.max_seq_len);
  const int b = static_cast<int>(bt / p.max_seq_len);
  const int block_size = p.cache.block_size;
  const int seq_len = min(p.seq_lens[b], p.max_blocks_per_seq * block_size);
  if (t >= seq_len) return;
  const int64_t block = p.block_table[static_cast<int64_t>(b) * p.max_blocks_per_seq + t / block_size];
  if (block < 0 || block >= p.cache.num_blocks) return;
  const uint8_t* slot = p.cache.data + block * p.cache.stride_block +
                        static_cast<int64_t>(t % block_size) * p.cache.stride_token + head * p.cache.stride_head;
  const SlotLayout& L = p.layout;
  float k[E], v[E];
  if constexpr (kFp8Key) {
#pragma unroll
    for (int j = 0; j < E; ++j) k[j] = fp8_e4m3_to_float(slot[lane * E + j]);
  } else {
    const float norm = load_half_field(slot + L.key_norm_offset);
#pragma unroll
    for (int j = 0; j < E; ++j) k[j] = norm * p.codebook.centroid[unpack_index(slot, lane * E + j, L.key_bits)];
    device::group_fwht<E, 32>(k, lane);
#pragma unroll
    for (int j = 0; j < E; ++j) k[j] *= rsqrt_d;
  }
  const float scale = load_half_field(slot + L.value_scale_offset);
  const float zero = load_half_field(slot + L.value_zero_offset);
#pragma unroll
  for (int j = 0; j < E; ++j) v[j] = value_decode(unpack_index(slot + L.value_data_offset, lane * E + j, L.value_bits), scale, zero);
  T* kout = static_cast<T*>(p.key_out) + item * D + lane * E;
  T* vout = static_cast<T*>(p.value_out) + item * D + lane * E;
#pragma unroll
  for (int j = 0; j < E; ++j) {
    kout[j] = device::from_float<T>(k[j]);
    vout[j] = device::from_float<T>(v[j]);
  }
}

struct DequantizeLaunch {
  const DequantizeParams& p;
  cudaStream_t stream;
  template <typename T, int D, bool kFp8Key>
  cudaError_t run() const {
    const int64_t items = static_cast<int64_t>(p.batch) * p.max_seq_len * p.cache.num_kv_heads;
    if (items == 0) return cudaSuccess;
    const int64_t blocks = (items + kWarpsPerBlock - 1) / kWarpsPerBlock;
    dequantize_kernel<T, D, kFp8Key><<<static_cast<unsigned>(blocks), kWarpsPerBlock * 32, 0, stream>>>(
        p, 1.0f / sqrtf(static_cast<float>(D)));
    return cudaGetLastError();
  }
};

}  // namespace

cudaError_t launch_dequantize(const DequantizeParams& p, cudaStream_t stream) {
  if (!cuda_supports_head_dim(p.layout)) {
    return cuda_generic_supports(p.layout) ? launch_dequantize_generic(p, stream) : cudaErrorInvalidValue;
  }
  return dispatch_slot_kernel(p.dtype, p.layout, DequantizeLaunch{p, stream});
}

}  // namespace turboquant
