// The kernels for head dims without a tiled instantiation (every head_dim the presets take but 64,
// 128, 256 and FP8 keys' 96): the rotated presets at 80, 96, 112, 160, 192 (H_m (x) H_{2^k}, a dense
// stage across the Sylvester blocks) and FP8 keys at any multiple of 8. The head dim is a runtime
// value, so one instantiation per element type serves them all and the build stays the size it was.
//
// One warp per vector (store, dequantize) or per query row and head (decode), shared memory for
// the vectors, and the CPU reference's per-element rules called as they are (quantize.h,
// packing.h, numeric.h, the rotation's two steps in hadamard_transform.h), so the store writes the
// CPU's bytes exactly (no rounding allowance: the same operations in the same order) and
// dequantize returns the CPU's floats. Decode keeps an online softmax per warp over its tokens, a
// lane holding dims lane, lane + 32, ...; splits of a long context merge through the workspace and
// the split merge like the tiled kernels'. The attention options (windows, soft-capping, sinks)
// apply as in the per-head kernel. Simpler than the tiled kernels: decode reads each slot once per
// query head (not once per GQA group) and does not overlap loads with math;
// benchmarks/bench_head_dims.py times it against SDPA on the same shapes.
#include <cuda_runtime.h>

#include <algorithm>

#include "decode_common.cuh"
#include "device_utils.cuh"
#include "launchers.h"
#include "turboquant/attention_options.h"
#include "turboquant/hadamard_transform.h"
#include "turboquant/numeric.h"
#include "turboquant/packing.h"
#include "turboquant/query_chunks.h"
#include "turboquant/slot_codec.h"

namespace turboquant {
namespace {

constexpr int kGenericWarps = 4;
constexpr int kGenericThreads = kGenericWarps * 32;
constexpr int kMaxDimsPerLane = kMaxHeadDim / 32;

__device__ __forceinline__ float half_field(const uint8_t* slot, int offset) {
  return half_bits_to_float(load_half_field(slot, offset));
}

// Unnormalized x := H_D x by one warp, x and scratch in shared memory (d floats each): the
// Sylvester stages over every block at once, then the H_m stage into scratch and back. The adds
// of hadamard_transform_inplace in its order, so the CPU's floats.
__device__ void warp_hadamard(float* x, float* scratch, int d, const HadamardFactors& f, int lane) {
  for (int h = 1; h < f.block; h <<= 1) {
    for (int t = lane; t < d / 2; t += 32) {
      const int i = sylvester_butterfly_index(t, h);
      const float a = x[i], b = x[i + h];
      x[i] = a + b;
      x[i + h] = a - b;
    }
    __syncwarp();
  }
  if (f.m == 1) return;
  for (int i = lane; i < d; i += 32) scratch[i] = paley_stage_element(x, f, i);
  __syncwarp();
  for (int i = lane; i < d; i += 32) x[i] = scratch[i];
  __syncwarp();
}

__device__ __forceinline__ uint8_t* slot_address(const CacheView& c, int64_t block, int token_in_block, int head) {
  return c.data + block * c.stride_block + static_cast<int64_t>(token_in_block) * c.stride_token + head * c.stride_head;
}

// ---- store: one warp per (token, KV head) vector, encode_slot's steps (csrc/slot_codec.cpp).
template <typename T>
__global__ void __launch_bounds__(kGenericThreads) store_kv_generic_kernel(const StoreParams p, const HadamardFactors f,
                                                                           const float rsqrt_d) {
  extern __shared__ float smem[];  // [kGenericWarps][2][D]
  const int d = p.layout.head_dim, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* k = smem + warp * 2 * d;
  float* scratch = k + d;
  const SlotLayout& L = p.layout;
  const bool fp8 = L.key_format == KeyFormat::kFp8;
  const int heads = p.cache.num_kv_heads;
  const int64_t vectors = p.num_tokens * heads;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kGenericWarps;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * kGenericWarps + warp; item < vectors; item += step) {
    const int64_t token = item / heads;
    const int head = static_cast<int>(item % heads);
    const int64_t slot_index = p.slot_mapping_int64 ? static_cast<const int64_t*>(p.slot_mapping)[token]
                                                    : static_cast<const int32_t*>(p.slot_mapping)[token];
    if (slot_index < 0 || slot_index >= p.cache.num_blocks * p.cache.block_size) continue;  // warp-uniform
    uint8_t* slot = slot_address(p.cache, slot_index / p.cache.block_size,
                                 static_cast<int>(slot_index % p.cache.block_size), head);
    const T* key = static_cast<const T*>(p.key) + item * d;
    const T* value = static_cast<const T*>(p.value) + item * d;
    if (fp8) {
      for (int i = lane; i < d; i += 32) slot[i] = float_to_fp8_e4m3(device::to_float(key[i]));
    } else {
      for (int i = lane; i < d; i += 32) k[i] = device::to_float(key[i]);
      __syncwarp();
      const float norm = __shfl_sync(device::kFullMask, lane == 0 ? sqrtf(sum_of_squares_lane_order(k, d)) : 0.0f, 0);
      const float denom = norm + kKeyNormEpsilon;
      for (int i = lane; i < d; i += 32) k[i] = k[i] / denom;
      __syncwarp();
      warp_hadamard(k, scratch, d, f, lane);
      // Lane l packs the groups of 8 indices l, l + 32, ... and keeps their centroids for the
      // norm correction.
      for (int g = lane; g < d / 8; g += 32) {
        uint8_t idx[8];
        for (int r = 0; r < 8; ++r) {
          idx[r] = static_cast<uint8_t>(lloyd_max_index(k[8 * g + r] * rsqrt_d, p.codebook.midpoint, p.codebook.levels));
          scratch[8 * g + r] = p.codebook.centroid[idx[r]];
        }
        pack_group_of_8(idx, L.key_bits, slot + g * L.key_bits);
      }
      __syncwarp();
      if (lane == 0) {
        const float stored = p.norm_correction ? norm / sqrtf(sum_of_squares_lane_order(scratch, d)) : norm;
        store_half_field(slot, L.key_norm_offset, key_norm_half_bits(stored));
      }
    }
    float vmin = INFINITY, vmax = -INFINITY;  // fminf / fmaxf pass NaN over, as the CPU's fmin / fmax
    for (int i = lane; i < d; i += 32) {
      const float v = device::to_float(value[i]);
      vmin = fminf(vmin, v);
      vmax = fmaxf(vmax, v);
    }
    vmin = device::group_min(vmin);
    vmax = device::group_max(vmax);
    if (vmin > vmax) vmin = vmax = NAN;  // every element NaN: the CPU's fmin chain gives NaN
    const ValueQuantParams q = value_quant_params(vmin, vmax, L.value_bits);
    uint8_t* const value_field = slot + L.value_data_offset;
    for (int g = lane; g < d / 8; g += 32) {
      uint8_t codes[8];
      for (int r = 0; r < 8; ++r) codes[r] = static_cast<uint8_t>(value_code(device::to_float(value[8 * g + r]), q, L.value_bits));
      pack_group_of_8(codes, L.value_bits, value_field + g * L.value_bits);
    }
    if (lane == 0) {
      store_half_field(slot, L.value_scale_offset, q.scale_bits);
      store_half_field(slot, L.value_zero_offset, q.zero_bits);
      if (L.slot_size_aligned > L.slot_size) slot[L.slot_size] = 0;  // padding byte
    }
    __syncwarp();  // k and scratch are reused by the warp's next vector
  }
}

// ---- dequantize: one warp per (sequence, position, KV head), decode_key / decode_value's steps.
template <typename T>
__global__ void __launch_bounds__(kGenericThreads) dequantize_generic_kernel(const DequantizeParams p,
                                                                             const HadamardFactors f, const float rsqrt_d) {
  extern __shared__ float smem[];  // [kGenericWarps][2][D]
  const int d = p.layout.head_dim, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* k = smem + warp * 2 * d;
  float* scratch = k + d;
  const SlotLayout& L = p.layout;
  const int heads = p.cache.num_kv_heads, block_size = p.cache.block_size;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kGenericWarps + warp;
  if (item >= static_cast<int64_t>(p.batch) * p.max_seq_len * heads) return;  // warp-uniform
  const int head = static_cast<int>(item % heads);
  const int64_t bt = item / heads;
  const int t = static_cast<int>(bt % p.max_seq_len);
  const int b = static_cast<int>(bt / p.max_seq_len);
  const int seq_len = min(p.seq_lens[b], p.max_blocks_per_seq * block_size);
  if (t >= seq_len) return;
  const int64_t block = p.block_table[static_cast<int64_t>(b) * p.max_blocks_per_seq + t / block_size];
  if (block < 0 || block >= p.cache.num_blocks) return;
  const uint8_t* slot = slot_address(p.cache, block, t % block_size, head);
  T* kout = static_cast<T*>(p.key_out) + item * d;
  T* vout = static_cast<T*>(p.value_out) + item * d;
  if (L.key_format == KeyFormat::kFp8) {
    for (int i = lane; i < d; i += 32) kout[i] = device::from_float<T>(fp8_e4m3_to_float(slot[i]));
  } else {
    const float norm = half_field(slot, L.key_norm_offset);
    for (int i = lane; i < d; i += 32) k[i] = norm * p.codebook.centroid[unpack_index(slot, i, L.key_bits)];
    __syncwarp();
    warp_hadamard(k, scratch, d, f, lane);  // R is symmetric: its own inverse
    for (int i = lane; i < d; i += 32) kout[i] = device::from_float<T>(k[i] * rsqrt_d);
  }
  const float scale = half_field(slot, L.value_scale_offset), zero = half_field(slot, L.value_zero_offset);
  for (int i = lane; i < d; i += 32) {
    vout[i] = device::from_float<T>(value_decode(unpack_index(slot + L.value_data_offset, i, L.value_bits), scale, zero));
  }
}

// ---- decode: one CTA per (query row, query head, split). Grid x: sequences (plain decode) or the
// varlen chunks of one token each (query_chunks.h), y: query heads, z: splits. Each split takes an
// equal share of the row's attended positions [first attended, causal limit).
template <typename T>
__global__ void __launch_bounds__(kGenericThreads) decode_generic_kernel(const DecodeParams p, const HadamardFactors f,
                                                                         const float rsqrt_d) {
  extern __shared__ float smem[];  // q [D], scratch [D], per warp: acc [D], then max and sum
  const int d = p.layout.head_dim, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* q = smem;
  float* scratch = q + d;
  float* warp_acc = scratch + d;                      // [kGenericWarps][D]
  float* warp_max = warp_acc + kGenericWarps * d;     // [kGenericWarps]
  float* warp_sum = warp_max + kGenericWarps;         // [kGenericWarps]
  __shared__ float centroid[kMaxCodebookLevels];
  const SlotLayout& L = p.layout;
  const bool fp8 = L.key_format == KeyFormat::kFp8;
  int seq, row, pos, q_len;
  if (p.query_start_loc == nullptr) {
    seq = row = blockIdx.x;
    pos = 0;
    q_len = 1;
  } else {
    const QueryChunk chunk = locate_query_chunk(p.query_start_loc, p.batch, p.query_rows, 1, blockIdx.x);
    if (chunk.tokens == 0) return;  // CTA-uniform: the row is not served (the caller zero-filled it)
    seq = chunk.seq;
    row = chunk.row0;
    pos = chunk.pos0;
    q_len = chunk.q_len;
  }
  const int head = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
  const int kv_head = head / (p.num_q_heads / p.cache.num_kv_heads);
  const int block_size = p.cache.block_size;
  const int seq_len = max(0, min(p.seq_lens[seq], p.max_blocks_per_seq * block_size));
  const int limit = causal_limit(seq_len, q_len, pos);
  const int start = first_attended_position(limit, p.window);
  const int share = (limit - start + splits - 1) / splits;
  const int lo = min(limit, start + split * share), hi = min(limit, lo + share);

  const int64_t out_row = static_cast<int64_t>(row) * p.num_q_heads + head;
  const T* query = static_cast<const T*>(p.query) + out_row * d;
  for (int i = threadIdx.x; i < d; i += kGenericThreads) q[i] = device::to_float(query[i]);
  if (threadIdx.x < kMaxCodebookLevels) centroid[threadIdx.x] = p.codebook.centroid[threadIdx.x];
  __syncthreads();
  if (!fp8) {  // q.k = (R q).(norm c~): the query rotated once
    if (warp == 0) {
      warp_hadamard(q, scratch, d, f, lane);
      for (int i = lane; i < d; i += 32) q[i] *= rsqrt_d;
    }
    __syncthreads();
  }
  float qr[kMaxDimsPerLane], acc[kMaxDimsPerLane];
#pragma unroll
  for (int e = 0; e < kMaxDimsPerLane; ++e) {
    qr[e] = lane + 32 * e < d ? q[lane + 32 * e] : 0.0f;
    acc[e] = 0.0f;
  }
  // Online softmax in the natural domain: running max m, sum l of e^(s - m), acc of e^(s - m) v.
  float m = -INFINITY, l = 0.0f;
  const int32_t* block_row = p.block_table + static_cast<int64_t>(seq) * p.max_blocks_per_seq;
  for (int t = lo + warp; t < hi; t += kGenericWarps) {
    const int64_t block = block_row[t / block_size];
    if (block < 0 || block >= p.cache.num_blocks) continue;  // warp-uniform; such a token is masked
    const uint8_t* slot = slot_address(p.cache, block, t % block_size, kv_head);
    float dot = 0.0f;
#pragma unroll
    for (int e = 0; e < kMaxDimsPerLane; ++e) {
      const int i = lane + 32 * e;
      if (i < d) dot += qr[e] * (fp8 ? fp8_e4m3_to_float(slot[i]) : centroid[unpack_index(slot, i, L.key_bits)]);
    }
    dot = device::group_sum(dot);
    float s = p.scale * (fp8 ? dot : dot * half_field(slot, L.key_norm_offset));
    s = softcap_logit(s, p.softcap);
    const float m_new = fmaxf(m, s);
    const float correction = __expf(m - m_new);  // 0 for the first token (m = -inf)
    const float weight = __expf(s - m_new);
    l = l * correction + weight;
    const float scale = half_field(slot, L.value_scale_offset), zero = half_field(slot, L.value_zero_offset);
#pragma unroll
    for (int e = 0; e < kMaxDimsPerLane; ++e) {
      const int i = lane + 32 * e;
      if (i < d) {
        const float v = value_decode(unpack_index(slot + L.value_data_offset, i, L.value_bits), scale, zero);
        acc[e] = acc[e] * correction + weight * v;
      }
    }
    m = m_new;
  }
#pragma unroll
  for (int e = 0; e < kMaxDimsPerLane; ++e) {
    if (lane + 32 * e < d) warp_acc[warp * d + lane + 32 * e] = acc[e];
  }
  if (lane == 0) {
    warp_max[warp] = m;
    warp_sum[warp] = l;
  }
  __syncthreads();
  // The warps' states merged; split 0 adds the head's sink to its denominator.
  float total_max = warp_max[0];
  for (int w = 1; w < kGenericWarps; ++w) total_max = fmaxf(total_max, warp_max[w]);
  const bool sink = p.sinks != nullptr && split == 0;
  const float sink_logit = sink ? p.sinks[head] : -INFINITY;
  const float merged_max = fmaxf(total_max, sink_logit);
  float weights[kGenericWarps], total = sink ? __expf(sink_logit - merged_max) : 0.0f;
#pragma unroll
  for (int w = 0; w < kGenericWarps; ++w) {
    weights[w] = warp_max[w] == -INFINITY ? 0.0f : __expf(warp_max[w] - merged_max);
    total += warp_sum[w] * weights[w];
  }
  const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
  for (int i = threadIdx.x; i < d; i += kGenericThreads) {
    float o = 0.0f;
#pragma unroll
    for (int w = 0; w < kGenericWarps; ++w) o += warp_acc[w * d + i] * weights[w];
    o *= inverse;
    if (splits == 1) {
      static_cast<T*>(p.out)[out_row * d + i] = device::from_float<T>(o);
    } else {
      p.partial_out[(out_row * splits + split) * d + i] = o;
    }
  }
  if (splits > 1 && threadIdx.x == 0) {  // log2 domain, as the merge takes it
    p.partial_lse[out_row * splits + split] = total > 0.0f ? merged_max * kLog2e + log2f(total) : -INFINITY;
  }
}

// Calls launch(T{}) with the element type of `type` (float only where allowed).
template <class Launch>
cudaError_t by_element_type(ElementType type, bool allow_float, const Launch& launch) {
  switch (type) {
    case ElementType::kHalf: launch(__half{}); break;
    case ElementType::kBFloat16: launch(__nv_bfloat16{}); break;
    case ElementType::kFloat:
      if (!allow_float) return cudaErrorInvalidValue;
      launch(float{});
      break;
  }
  return cudaGetLastError();
}

float rsqrt_head_dim(int d) { return 1.0f / sqrtf(static_cast<float>(d)); }  // the CPU's expression

// Dynamic shared memory stays under the 48 KB that needs no opt-in at every head dim up to
// kMaxHeadDim (1024): the store and dequantize 2 x 4 x D floats (32 KB), decode (2 + 4) D + 8 (24.6 KB).
int vector_smem_bytes(int d) { return kGenericWarps * 2 * d * static_cast<int>(sizeof(float)); }
int decode_smem_bytes(int d) { return (2 * d + kGenericWarps * (d + 2)) * static_cast<int>(sizeof(float)); }

}  // namespace

bool cuda_generic_supports(const SlotLayout& layout) {
  const int d = layout.head_dim;
  return d > 0 && d % 8 == 0 && d <= kMaxHeadDim &&
         (layout.key_format == KeyFormat::kFp8 || hadamard_paley_order(d) != 0);
}

cudaError_t launch_store_kv_generic(const StoreParams& p, cudaStream_t stream) {
  const int64_t vectors = p.num_tokens * p.cache.num_kv_heads;
  if (vectors == 0) return cudaSuccess;
  // A grid-stride loop over the vectors: 16 CTAs of 4 warps per SM at most.
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((vectors + kGenericWarps - 1) / kGenericWarps,
                                                          static_cast<int64_t>(device_sm_count()) * 16)));
  const int d = p.layout.head_dim, smem = vector_smem_bytes(d);
  const HadamardFactors f = hadamard_factors(d);
  return by_element_type(p.dtype, true, [&](auto element) {
    store_kv_generic_kernel<decltype(element)><<<grid, kGenericThreads, smem, stream>>>(p, f, rsqrt_head_dim(d));
  });
}

cudaError_t launch_dequantize_generic(const DequantizeParams& p, cudaStream_t stream) {
  const int64_t items = static_cast<int64_t>(p.batch) * p.max_seq_len * p.cache.num_kv_heads;
  if (items == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((items + kGenericWarps - 1) / kGenericWarps));
  const int d = p.layout.head_dim, smem = vector_smem_bytes(d);
  const HadamardFactors f = hadamard_factors(d);
  return by_element_type(p.dtype, true, [&](auto element) {
    dequantize_generic_kernel<decltype(element)><<<grid, kGenericThreads, smem, stream>>>(p, f, rsqrt_head_dim(d));
  });
}

int decode_generic_query_chunks(const DecodeParams& p) {
  return p.query_start_loc == nullptr ? p.batch : varlen_query_chunks(p.query_rows, p.batch, 1);
}

cudaError_t launch_decode_generic(const DecodeParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(decode_generic_query_chunks(p)), static_cast<unsigned>(p.num_q_heads),
                  static_cast<unsigned>(p.num_splits));
  const int d = p.layout.head_dim, smem = decode_smem_bytes(d);
  const HadamardFactors f = hadamard_factors(d);
  const cudaError_t err = by_element_type(p.dtype, false, [&](auto element) {
    decode_generic_kernel<decltype(element)><<<grid, kGenericThreads, smem, stream>>>(p, f, rsqrt_head_dim(d));
  });
  if (err != cudaSuccess || p.num_splits == 1) return err;
  return launch_decode_merge(p, stream);
}

}  // namespace turboquant
