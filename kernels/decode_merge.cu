// Log-sum-exp merge of a split decode's partial results (the per-head, row and chunked kernels
// write them; the row kernel one per CTA, its two splits folded; p.num_splits says how many):
//   out = sum_s 2^(lse_s - M) O_s / sum_s 2^(lse_s - M),  M = max_s lse_s.
//
// One CTA per (query row, head, slice of the head dims). The merge is a few megabytes at most, so
// its time is latency: every global load a thread needs is independent of the others and issued
// before the first one is used (one load of the log-sum-exps per thread, then the partial vectors
// as float4 columns with the splits divided among thread groups), instead of a loop over the
// splits that waits for each load in turn (H200, B = 1, 32 splits: the old loop cost ~8 us per
// decode). With many splits a CTA takes a slice of the dims (merge_dim_slices), so each thread's
// loads stay one batch: at B = 1, 256 splits in one slice were 8 batches, one memory round trip
// each, and the merge's tail after the decode kernel took 10.6 of the 29 us step (H200).
//
// It is launched with programmatic dependent launch on sm_90: its CTAs start while the decode
// grid finishes (each decode CTA allows it after its main loop) and wait in
// wait_for_primary_grid() until the decode's writes are visible, so no launch gap separates them.
#include <cuda_runtime.h>

#include "device_utils.cuh"
#include "dispatch.cuh"
#include "launchers.h"

namespace turboquant {
namespace {

constexpr int kMergeThreads = 128;
constexpr int kMergeWarps = kMergeThreads / 32;
constexpr int kMaxMergeSplits = 2 * kMergeThreads;  // two log-sum-exps per thread
constexpr int kMergeBatch = 8;  // partial-vector loads a thread has in flight
static_assert(kMaxMergeSplits >= kMaxDecodeSplits, "every split's log-sum-exp needs a thread");

// Block-wide max or sum of one value per thread; every thread gets the result.
template <bool kMax>
__device__ __forceinline__ float block_reduce(float v, float* scratch) {
  using namespace device;
  v = kMax ? group_max(v) : group_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = scratch[0];
#pragma unroll
  for (int w = 1; w < kMergeWarps; ++w) v = kMax ? fmaxf(v, scratch[w]) : v + scratch[w];
  __syncthreads();  // scratch is reused by the next reduction
  return v;
}

// The explicit minimum of one CTA per SM lets ptxas use 64 registers: with the default it kept
// to 32 and issued the partial-vector loads two at a time.
template <typename T>
__global__ void __launch_bounds__(kMergeThreads, 1) merge_splits_kernel(const float* __restrict__ partial_out,
                                                                     const float* __restrict__ partial_lse,
                                                                     T* __restrict__ out, const int num_splits,
                                                                     const int head_dim,
                                                                     const float* __restrict__ value_offset,
                                                                     const int num_q_heads, const int gqa_group) {
  __shared__ float weight[kMaxMergeSplits];
  __shared__ float4 group_sums[kMergeThreads];
  __shared__ float scratch[kMergeWarps];
  const int64_t row = blockIdx.x;  // query row * num_q_heads + head
  const int t = threadIdx.x;
  // Thread t sums the float4 column t % columns of the CTA's slice (blockIdx.y of gridDim.y) over
  // splits t / columns, t / columns + groups, ... (head_dim is a multiple of 4), kMergeBatch loads in
  // flight before the first is used.
  const int columns = head_dim / 4 / gridDim.y, groups = kMergeThreads / columns;
  const int first_column = blockIdx.y * columns;
  const int column = t % columns, group = t / columns;
  const bool summing = group < groups;
  const float4* part = reinterpret_cast<const float4*>(partial_out + row * num_splits * head_dim) + first_column + column;
  const int64_t part_stride = head_dim / 4;  // float4s from one split's vector to the next
  float4 x[kMergeBatch];
  auto load_batch = [&](int s0) {
#pragma unroll
    for (int k = 0; k < kMergeBatch; ++k) {
      // Past the last split: load the last one again (unconditional loads issue together); its
      // weight is 0.
      x[k] = part[min(s0 + k * groups, num_splits - 1) * part_stride];
    }
  };
  device::wait_for_primary_grid();

  // The first batch of partial vectors is loaded with the log-sum-exps, before the weights are
  // known: one memory round trip instead of two (the merge's time is latency).
  const float* lse = partial_lse + row * num_splits;
  const float lse0 = t < num_splits ? lse[t] : -INFINITY;
  const float lse1 = t + kMergeThreads < num_splits ? lse[t + kMergeThreads] : -INFINITY;
  if (summing) load_batch(group);

  // Weights of the splits: 0 for a split that saw no token (lse = -inf) or for every split of a
  // row no CTA served.
  const float mx = block_reduce<true>(fmaxf(lse0, lse1), scratch);
  const float w0 = device::split_weight(lse0, mx), w1 = device::split_weight(lse1, mx);
  weight[t] = w0;
  weight[t + kMergeThreads] = w1;
  const float total = block_reduce<false>(w0 + w1, scratch);  // its barriers publish weight[]

  // A zero weight selects 0 rather than multiplying: the partial vector of a row no CTA served is
  // never written.
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (summing) {
    for (int s0 = group;;) {
#pragma unroll
      for (int k = 0; k < kMergeBatch; ++k) {
        const int s = s0 + k * groups;
        const float w = s < num_splits ? weight[s] : 0.0f;
        acc.x += w != 0.0f ? w * x[k].x : 0.0f;
        acc.y += w != 0.0f ? w * x[k].y : 0.0f;
        acc.z += w != 0.0f ? w * x[k].z : 0.0f;
        acc.w += w != 0.0f ? w * x[k].w : 0.0f;
      }
      s0 += kMergeBatch * groups;
      if (s0 >= num_splits) break;
      load_batch(s0);
    }
  }
  group_sums[t] = acc;
  __syncthreads();
  if (t < columns) {
    for (int k = 1; k < groups; ++k) {
      const float4 x = group_sums[k * columns + t];
      acc.x += x.x;
      acc.y += x.y;
      acc.z += x.z;
      acc.w += x.w;
    }
    const float inv_total = total > 0.0f ? 1.0f / total : 0.0f;
    // The decode's value_offset (DecodeParams) for a row that attended to something.
    const float* offset = total > 0.0f ? device::head_vector_of_row(value_offset, row, num_q_heads, gqa_group, head_dim)
                                       : nullptr;
    const int d = 4 * (first_column + t);
    T* o = out + row * head_dim + d;
    o[0] = device::from_float<T>(device::with_value_offset(acc.x * inv_total, offset, d));
    o[1] = device::from_float<T>(device::with_value_offset(acc.y * inv_total, offset, d + 1));
    o[2] = device::from_float<T>(device::with_value_offset(acc.z * inv_total, offset, d + 2));
    o[3] = device::from_float<T>(device::with_value_offset(acc.w * inv_total, offset, d + 3));
  }
}

// Slices of the head dims, one CTA each: the fewest (halving while a slice has more than 4 float4
// columns and an even count: D = 96 ends at 3) that keep every thread's partial loads to one batch
// of kMergeBatch.
// D = 128 (32 float4 columns): 1 up to 32 splits, 2 to 64, 4 to 128, 8 to 256.
int merge_dim_slices(int num_splits, int head_dim) {
  int slices = 1;
  while (head_dim / 4 / slices % 2 == 0 && head_dim / 4 / slices > 4 &&
         num_splits * (head_dim / 4 / slices) > kMergeThreads * kMergeBatch) {
    slices *= 2;
  }
  return slices;
}

template <typename T>
cudaError_t launch_merge(const DecodeParams& p, cudaStream_t stream) {
  prefer_max_shared_carveout<merge_splits_kernel<T>>();
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(static_cast<int64_t>(p.query_rows) * p.num_q_heads),
                        merge_dim_slices(p.num_splits, p.layout.head_dim));
  config.blockDim = dim3(kMergeThreads);
  config.stream = stream;
  cudaLaunchAttribute overlap = dependent_launch_attribute();
  if (device_supports_dependent_launch()) {
    config.attrs = &overlap;
    config.numAttrs = 1;
  }
  return cudaLaunchKernelEx(&config, merge_splits_kernel<T>, static_cast<const float*>(p.partial_out),
                            static_cast<const float*>(p.partial_lse), static_cast<T*>(p.out), p.num_splits,
                            p.layout.head_dim, p.value_offset, p.num_q_heads, p.num_q_heads / p.cache.num_kv_heads);
}

}  // namespace

cudaError_t launch_decode_merge(const DecodeParams& p, cudaStream_t stream) {
  if (p.num_splits > kMaxMergeSplits || p.layout.head_dim % 4 != 0 || p.layout.head_dim / 4 > kMergeThreads) {
    return cudaErrorInvalidValue;
  }
  switch (p.dtype) {
    case ElementType::kHalf: return launch_merge<__half>(p, stream);
    case ElementType::kBFloat16: return launch_merge<__nv_bfloat16>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace turboquant
