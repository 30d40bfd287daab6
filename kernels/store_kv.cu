// Fused store: one warp quantizes one (token, KV head) and writes its packed slot, in a single
// launch for the whole batch. Key: norm (warp reduction), normalize, Hadamard rotation as an
// in-register FWHT with shuffles, Lloyd-Max bucketing, norm correction folded into the stored
// norm (or FP8 e4m3). Value: warp min/max, fp16 scale/zero, codes. Packed bytes are assembled in
// shared memory and written with 16-bit stores (slots are only 2-byte aligned).
#include <cuda_runtime.h>

#include "device_utils.cuh"
#include "dispatch.cuh"
#include "launchers.h"
#include "turboquant/numeric.h"
#include "turboquant/packing.h"

namespace turboquant {
namespace {

constexpr int kStoreWarpsPerBlock = 8;
constexpr int kMaxSlotBytes = 400;  // D=256 k8v4 slot is 388

// Loads E consecutive elements (E * sizeof(T) bytes, aligned to that: the glue checks 16-byte
// aligned inputs) with the widest vector load that fits.
template <typename T, int E>
__device__ __forceinline__ void load_elements(const T* src, float (&out)[E]) {
  constexpr int kBytes = E * static_cast<int>(sizeof(T));
  T vals[E];
  if constexpr (kBytes % 16 == 0) {
#pragma unroll
    for (int k = 0; k < kBytes / 16; ++k) reinterpret_cast<uint4*>(vals)[k] = reinterpret_cast<const uint4*>(src)[k];
  } else if constexpr (kBytes % 8 == 0) {
#pragma unroll
    for (int k = 0; k < kBytes / 8; ++k) reinterpret_cast<uint2*>(vals)[k] = reinterpret_cast<const uint2*>(src)[k];
  } else {
#pragma unroll
    for (int k = 0; k < E; ++k) vals[k] = src[k];
  }
#pragma unroll
  for (int j = 0; j < E; ++j) out[j] = device::to_float(vals[j]);
}

struct alignas(4) WarpScratch {
  uint8_t slot[kMaxSlotBytes];
  uint8_t index[256];  // quantization indices of the current field, one byte each
};

template <int E>
__device__ __forceinline__ void pack_indices_to_slot(WarpScratch& ws, int lane, int bits, int offset) {
  // Lane g packs group g (8 indices -> `bits` bytes), the same rule as the CPU (packing.h).
  __syncwarp();
  constexpr int kGroups = E * 32 / 8;
#pragma unroll
  for (int g = lane; g < kGroups; g += 32) pack_group_of_8(ws.index + 8 * g, bits, ws.slot + offset + bits * g);
}

template <typename T, int D, bool kFp8Key>
__global__ void __launch_bounds__(kStoreWarpsPerBlock * 32)
    store_kv_kernel(const StoreParams p, const float rsqrt_d) {
  constexpr int E = D / 32;  // elements per lane
  __shared__ WarpScratch scratch[kStoreWarpsPerBlock];
  __shared__ float centroid[kMaxCodebookLevels], midpoint[kMaxCodebookLevels];
  if (threadIdx.x < kMaxCodebookLevels) {
    centroid[threadIdx.x] = p.codebook.centroid[threadIdx.x];
    midpoint[threadIdx.x] = threadIdx.x < kMaxCodebookLevels - 1 ? p.codebook.midpoint[threadIdx.x] : INFINITY;
  }
  __syncthreads();
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kStoreWarpsPerBlock + warp;
  const int heads = p.cache.num_kv_heads;
  if (item >= p.num_tokens * heads) return;
  const int64_t token = item / heads;
  const int head = static_cast<int>(item % heads);
  const int64_t slot_index = p.slot_mapping_int64 ? static_cast<const int64_t*>(p.slot_mapping)[token]
                                                  : static_cast<const int32_t*>(p.slot_mapping)[token];
  if (slot_index < 0 || slot_index >= p.cache.num_blocks * p.cache.block_size) return;  // padding / out of range
  WarpScratch& ws = scratch[warp];
  const SlotLayout& L = p.layout;

  float k[E], v[E];
  load_elements<T, E>(static_cast<const T*>(p.key) + item * D + lane * E, k);
  load_elements<T, E>(static_cast<const T*>(p.value) + item * D + lane * E, v);

  // ---- key
  uint16_t key_norm_bits = 0;
  if constexpr (kFp8Key) {
#pragma unroll
    for (int j = 0; j < E; ++j) ws.slot[lane * E + j] = float_to_fp8_e4m3(k[j]);
  } else {
    const float norm = sqrtf(device::warp_sum_of_squares<E>(k));
    const float denom = norm + kKeyNormEpsilon;
#pragma unroll
    for (int j = 0; j < E; ++j) k[j] = k[j] / denom;
    device::warp_fwht<E>(k, lane);
    float c[E];
#pragma unroll
    for (int j = 0; j < E; ++j) {
      const uint32_t idx = lloyd_max_index(k[j] * rsqrt_d, midpoint, p.codebook.levels);
      ws.index[lane * E + j] = static_cast<uint8_t>(idx);
      c[j] = centroid[idx];
    }
    const float stored = p.norm_correction ? norm / sqrtf(device::warp_sum_of_squares<E>(c)) : norm;
    pack_indices_to_slot<E>(ws, lane, L.key_bits, 0);
    key_norm_bits = key_norm_half_bits(stored);
  }

  // ---- value
  float vmin = v[0], vmax = v[0];
#pragma unroll
  for (int j = 1; j < E; ++j) {
    vmin = fminf(vmin, v[j]);
    vmax = fmaxf(vmax, v[j]);
  }
  vmin = device::warp_min(vmin);
  vmax = device::warp_max(vmax);
  const ValueQuantParams q = value_quant_params(vmin, vmax, L.value_bits);
  __syncwarp();  // key packing finished reading ws.index
#pragma unroll
  for (int j = 0; j < E; ++j) ws.index[lane * E + j] = static_cast<uint8_t>(value_code(v[j], q, L.value_bits));
  pack_indices_to_slot<E>(ws, lane, L.value_bits, L.value_data_offset);
  __syncwarp();  // every packed byte is in place
  if (lane == 0) {
    // The fp16 fields sit at even offsets: one 16-bit store each, after all byte packing.
    uint16_t* halves = reinterpret_cast<uint16_t*>(ws.slot);
    if constexpr (!kFp8Key) halves[L.key_norm_offset / 2] = key_norm_bits;
    halves[L.value_scale_offset / 2] = q.scale_bits;
    halves[L.value_zero_offset / 2] = q.zero_bits;
    if (L.slot_size_aligned > L.slot_size) ws.slot[L.slot_size] = 0;  // padding byte
  }
  __syncwarp();

  // ---- write the slot with 16-bit stores (slot_size_aligned is even, slots 2-byte aligned)
  const int64_t block = slot_index / p.cache.block_size;
  const int64_t offset = slot_index % p.cache.block_size;
  uint16_t* dst = reinterpret_cast<uint16_t*>(p.cache.data + block * p.cache.stride_block +
                                              offset * p.cache.stride_token + head * p.cache.stride_head);
  const uint16_t* src = reinterpret_cast<const uint16_t*>(ws.slot);
  for (int w = lane; w < L.slot_size_aligned / 2; w += 32) dst[w] = src[w];
}

struct StoreLaunch {
  const StoreParams& p;
  cudaStream_t stream;
  template <typename T, int D, bool kFp8Key>
  cudaError_t run() const {
    const int64_t items = p.num_tokens * p.cache.num_kv_heads;
    if (items == 0) return cudaSuccess;
    const int64_t blocks = (items + kStoreWarpsPerBlock - 1) / kStoreWarpsPerBlock;
    const float rsqrt_d = 1.0f / sqrtf(static_cast<float>(D));  // same expression as the CPU
    store_kv_kernel<T, D, kFp8Key><<<static_cast<unsigned>(blocks), kStoreWarpsPerBlock * 32, 0, stream>>>(p, rsqrt_d);
    return cudaGetLastError();
  }
};

}  // namespace

bool cuda_supports_head_dim(const SlotLayout& layout) {
  const int d = layout.head_dim;
  return d == 64 || d == 128 || d == 256 || (d == 96 && layout.key_format == KeyFormat::kFp8);
}

cudaError_t launch_store_kv(const StoreParams& p, cudaStream_t stream) {
  if (!cuda_supports_head_dim(p.layout)) return cudaErrorInvalidValue;
  return dispatch_slot_kernel(p.dtype, p.layout, StoreLaunch{p, stream});
}

}  // namespace turboquant
