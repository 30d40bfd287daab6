// Split-KV decode attention directly on the packed paged cache.
//
// One CTA (8 warps) per (sequence, KV head, split) serves all query heads of the GQA group (up
// to 8; larger groups take several CTAs), so each packed byte is read from HBM once. Per warp and
// 16-token tile:
//   * TMA bulk copies bring the tile's 16 slots (the aligned 16-byte chunks around each
//     2-byte-aligned slot, one copy per token) into a per-warp shared-memory ring, completing
//     on one mbarrier per stage;
//   * S^T = K~ Q^T on tensor cores (mma m16n8k16: tokens are the M dimension, heads the N), with
//     A fragments dequantized straight into registers: a pair of Lloyd-Max indices indexes a
//     bank-replicated half2 table, FP8 pairs use the hardware e4m3x2 -> f16x2 conversion. The
//     head dim is permuted so that each thread reads one contiguous chunk of the slot; the query
//     fragments (rotated once per CTA by an FWHT in shared memory) use the same permutation;
//   * scores times the stored norm, online softmax in the log2 domain;
//   * O^T += V^T (P*scale)^T on tensor cores with the raw integer value codes as A
//     (sum_t p_t (q_t s_t + z_t) = sum_t (p_t s_t) q_t + sum_t p_t z_t), P transposed in
//     registers by movmatrix.
// Warps combine in shared memory; with several splits a merge kernel combines the per-split
// results by log-sum-exp.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "device_utils.cuh"
#include "launchers.h"
#include "turboquant/numeric.h"
#include "turboquant/split_plan.h"

namespace turboquant {
namespace {

constexpr int kWarps = 8;  // one pair table and one query rotation serve 8 warps
constexpr int kThreads = kWarps * 32;
constexpr int kHeads = kDecodeMaxHeadsPerCta;  // MMA N dimension
constexpr int kMaxSplits = 256;
constexpr float kLog2e = 1.4426950408889634f;

constexpr int cdiv(int a, int b) { return (a + b - 1) / b; }

template <int D_, bool kFp8Key_, int KB_, int VB_>
struct DecodeConfig {
  static constexpr int D = D_;
  static constexpr bool kFp8Key = kFp8Key_;
  static constexpr int KB = kFp8Key_ ? 8 : KB_;  // bits per key element
  static constexpr int VB = VB_;
  static constexpr SlotLayout kLayout =
      make_slot_layout(D, kFp8Key ? KeyFormat::kFp8 : KeyFormat::kLloydMax, KB, VB);
  static constexpr int kSlotBytes = kLayout.slot_size_aligned;
  // A slot starts at any even address: the aligned 16-byte chunks around it.
  static constexpr int kChunks = cdiv(14 + kSlotBytes, 16);
  static constexpr int kRowBytes = (kChunks % 2 == 0 ? kChunks + 1 : kChunks) * 16;  // odd: no bank conflicts
  static constexpr int kStageBytes = 16 * kRowBytes;
  static constexpr int kStages = D > 128 ? 2 : 3;  // TMA ring depth per warp
  // Per-thread contiguous chunks of one slot.
  static constexpr int kKeyChunkBytes = (D / 4) * KB / 8;  // QK: thread c owns dims [c D/4, (c+1) D/4)
  static constexpr int kKeyWords = cdiv(kKeyChunkBytes, 4);
  static constexpr int kValueChunkBytes = (D / 8) * VB / 8;  // PV: thread g owns dims [g D/8, (g+1) D/8)
  static constexpr int kValueWords = cdiv(kValueChunkBytes, 4);
  static constexpr int kKSteps = D / 16;
  static constexpr int kPairTableWords = kFp8Key ? 0 : (1 << (2 * KB)) * 32;
  // Shared memory: staging ring (reused for the query rotation and the final warp merge).
  static constexpr int kRingBytes = kWarps * kStages * kStageBytes + 16;
  static constexpr int kQueryBytes = kHeads * D * 4;
  static constexpr int kMergeBytes = kWarps * kHeads * (D + 3) * 4;
  static constexpr int kScratchBytes =
      cdiv(std::max(kRingBytes, std::max(kQueryBytes, kMergeBytes)), 16) * 16;
  static constexpr int kShiftBytes = kWarps * kStages * 16 * 2;
  static constexpr int kBarrierBytes = kWarps * kStages * 8;  // one mbarrier per warp and stage
  static constexpr int kSmemBytes = kScratchBytes + kPairTableWords * 4 + kShiftBytes + kBarrierBytes;
};

__device__ __forceinline__ float load_half(const uint8_t* p) {
  return half_bits_to_float(*reinterpret_cast<const uint16_t*>(p));
}

template <class C, typename T>
__global__ void __launch_bounds__(kThreads) decode_kernel(const DecodeParams p, const float q_multiplier,
                                                          const int head_chunks) {
  using namespace device;
  constexpr int D = C::D;
  extern __shared__ __align__(16) uint8_t smem[];
  uint8_t* scratch = smem;
  uint32_t* pair_table = reinterpret_cast<uint32_t*>(smem + C::kScratchBytes);
  int16_t* shifts = reinterpret_cast<int16_t*>(smem + C::kScratchBytes + C::kPairTableWords * 4);
  uint64_t* barriers = reinterpret_cast<uint64_t*>(smem + C::kScratchBytes + C::kPairTableWords * 4 + C::kShiftBytes);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;  // MMA fragment coordinates
  const int kv_head = blockIdx.x / head_chunks;
  const int head_chunk = blockIdx.x % head_chunks;
  const int split = blockIdx.y, b = blockIdx.z;
  const int group = p.num_q_heads / p.cache.num_kv_heads;
  const int head0 = kv_head * group + head_chunk * kHeads;
  const int num_heads = min(kHeads, group - head_chunk * kHeads);
  const int block_size = p.cache.block_size;
  const int max_context = p.max_blocks_per_seq * block_size;
  const int seq_len = min(max(p.seq_lens[b], 0), max_context);
  const TokenRange range = split_token_range(seq_len, p.num_splits, split);

  // ---- query heads -> shared memory (fp32), rotated for Lloyd-Max keys; pair table
  float* qs = reinterpret_cast<float*>(scratch);  // [kHeads][D]
  const T* query = static_cast<const T*>(p.query) + (static_cast<int64_t>(b) * p.num_q_heads + head0) * D;
  for (int i = threadIdx.x; i < kHeads * D; i += kThreads) qs[i] = i / D < num_heads ? to_float(query[i]) : 0.0f;
  if constexpr (!C::kFp8Key) {
    constexpr uint32_t mask = (1u << C::KB) - 1u;
    for (int i = threadIdx.x; i < C::kPairTableWords; i += kThreads) {
      const uint32_t pair = static_cast<uint32_t>(i) >> 5;  // replicated once per bank
      pair_table[i] = pack_half2(p.codebook.centroid[pair & mask], p.codebook.centroid[pair >> C::KB]);
    }
  }
  if (threadIdx.x < kWarps * C::kStages) mbarrier_init(barriers + threadIdx.x, 1);
  fence_mbarrier_init();
  __syncthreads();
  if constexpr (!C::kFp8Key) {
    for (int h = 1; h < D; h <<= 1) {  // same butterflies as fwht_inplace, one row per head
      for (int t = threadIdx.x; t < kHeads * (D / 2); t += kThreads) {
        const int row = t / (D / 2), k = t % (D / 2);
        const int j = (k / h) * 2 * h + (k % h);
        float* r = qs + row * D;
        const float x = r[j], y = r[j + h];
        r[j] = x + y;
        r[j + h] = x - y;
      }
      __syncthreads();
    }
  }
  // B fragments of Q^T: logical k (2c, 2c+1 | 2c+8, 2c+9) of step j = physical dims c*D/4 + 4j + (0,1 | 2,3).
  uint32_t qf[C::kKSteps][2];
#pragma unroll
  for (int j = 0; j < C::kKSteps; ++j) {
    const float* r = qs + g * D + c * (D / 4) + 4 * j;
    qf[j][0] = pack_half2(r[0] * q_multiplier, r[1] * q_multiplier);
    qf[j][1] = pack_half2(r[2] * q_multiplier, r[3] * q_multiplier);
  }
  fence_proxy_async_shared();  // generic qs accesses before TMA writes the ring
  __syncthreads();  // the ring reuses qs

  // ---- per-warp pipeline over 16-token tiles (tile k belongs to warp k % kWarps)
  const int num_tiles = range.end > range.begin ? cdiv(range.end - range.begin, kTokenTile) : 0;
  const int my_tiles = warp < num_tiles ? cdiv(num_tiles - warp, kWarps) : 0;
  uint8_t* ring = scratch + warp * C::kStages * C::kStageBytes;
  int16_t* my_shifts = shifts + warp * C::kStages * 16;
  const int64_t head_offset = static_cast<int64_t>(kv_head) * p.cache.stride_head;
  const int32_t* block_row = p.block_table + static_cast<int64_t>(b) * p.max_blocks_per_seq;
  const uint32_t* lane_table = pair_table + lane;  // this lane's bank of the replicated table

  auto issue_tile = [&](int local_tile, int stage) {
    const int t0 = range.begin + (warp + local_tile * kWarps) * kTokenTile;
    const int64_t block = block_row[t0 / block_size];  // a tile never straddles blocks
    const bool block_ok = block >= 0 && block < p.cache.num_blocks;
    const int64_t tile_base = block * p.cache.stride_block + static_cast<int64_t>(t0 % block_size) * p.cache.stride_token + head_offset;
    uint8_t* dst_stage = ring + stage * C::kStageBytes;
    const int r = lane & 15;
    const bool row_ok = lane < 16 && block_ok && t0 + r < range.end;
    const int64_t slot = tile_base + r * p.cache.stride_token;
    const int64_t first = slot & ~int64_t(15);  // the aligned 16-byte chunks around the slot
    // One TMA bulk copy per token row (the host guarantees span_bytes is a multiple of 16).
    const int64_t left = p.cache.span_bytes - first;
    const uint32_t bytes = row_ok ? static_cast<uint32_t>(left < C::kChunks * 16 ? left : C::kChunks * 16) : 0u;
    uint32_t total = bytes;
#pragma unroll
    for (int off = 8; off > 0; off >>= 1) total += __shfl_xor_sync(kFullMask, total, off);
    uint64_t* barrier = barriers + warp * C::kStages + stage;
    if (lane == 0) mbarrier_arrive_expect_tx(barrier, total);
    __syncwarp();
    if (bytes > 0) bulk_copy_to_shared(dst_stage + r * C::kRowBytes, p.cache.data + first, bytes, barrier);
    if (lane < 16) my_shifts[stage * 16 + r] = row_ok ? static_cast<int16_t>(slot & 15) : int16_t(-1);
  };

  float m[2] = {-INFINITY, -INFINITY};  // running max (log2 domain) of heads 2c, 2c+1
  float l[2] = {0.0f, 0.0f};            // this thread's share of the softmax denominators
  float z[2] = {0.0f, 0.0f};            // this thread's share of sum_t p_t * zero_t
  float acc[C::kKSteps][4];             // O^T fragments: dims g*D/8 + 2i (+1), heads 2c, 2c+1
#pragma unroll
  for (int i = 0; i < C::kKSteps; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;

#pragma unroll
  for (int s = 0; s < C::kStages - 1; ++s) {
    if (s < my_tiles) issue_tile(s, s);
  }
  for (int it = 0; it < my_tiles; ++it) {
    const int next = it + C::kStages - 1;
    if (next < my_tiles) issue_tile(next, next % C::kStages);
    mbarrier_wait_parity(barriers + warp * C::kStages + it % C::kStages, (it / C::kStages) & 1);
    __syncwarp();  // the row shifts written by lanes 0-15

    const int stage = it % C::kStages;
    const uint8_t* rows = ring + stage * C::kStageBytes;
    const int16_t* sh = my_shifts + stage * 16;
    auto slot_ptr = [&](int r) { return rows + r * C::kRowBytes + max(static_cast<int>(sh[r]), 0); };
    const bool valid_lo = sh[g] >= 0, valid_hi = sh[g + 8] >= 0;
    const uint8_t* slot_lo = slot_ptr(g);
    const uint8_t* slot_hi = slot_ptr(g + 8);

    // S^T = K~ Q^T for tokens g, g+8 and heads 2c, 2c+1
    uint32_t key_lo[C::kKeyWords], key_hi[C::kKeyWords];
    load_unaligned_words(slot_lo + c * C::kKeyChunkBytes, key_lo);
    load_unaligned_words(slot_hi + c * C::kKeyChunkBytes, key_hi);
    float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < C::kKSteps; ++j) {
      uint32_t a0, a1, a2, a3;
      if constexpr (C::kFp8Key) {
        a0 = fp8x2_to_half2(extract_bits(key_lo, 32 * j, 16));
        a2 = fp8x2_to_half2(extract_bits(key_lo, 32 * j + 16, 16));
        a1 = fp8x2_to_half2(extract_bits(key_hi, 32 * j, 16));
        a3 = fp8x2_to_half2(extract_bits(key_hi, 32 * j + 16, 16));
      } else {
        a0 = lane_table[extract_bits(key_lo, 4 * j * C::KB, 2 * C::KB) << 5];
        a2 = lane_table[extract_bits(key_lo, (4 * j + 2) * C::KB, 2 * C::KB) << 5];
        a1 = lane_table[extract_bits(key_hi, 4 * j * C::KB, 2 * C::KB) << 5];
        a3 = lane_table[extract_bits(key_hi, (4 * j + 2) * C::KB, 2 * C::KB) << 5];
      }
      mma_16816(sc, a0, a1, a2, a3, qf[j][0], qf[j][1]);
    }
    float norm_lo = 1.0f, norm_hi = 1.0f;
    if constexpr (!C::kFp8Key) {
      norm_lo = load_half(slot_lo + C::kLayout.key_norm_offset);
      norm_hi = load_half(slot_hi + C::kLayout.key_norm_offset);
    }
    // Masked tokens get -inf by selection, so garbage in their bytes cannot leak in.
    const float s0 = valid_lo ? sc[0] * norm_lo : -INFINITY;
    const float s1 = valid_lo ? sc[1] * norm_lo : -INFINITY;
    const float s2 = valid_hi ? sc[2] * norm_hi : -INFINITY;
    const float s3 = valid_hi ? sc[3] * norm_hi : -INFINITY;

    // online softmax per head (a head's 16 tokens live in the 8 lanes sharing c)
    float t0 = fmaxf(s0, s2), t1 = fmaxf(s1, s3);
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
      t0 = fmaxf(t0, __shfl_xor_sync(kFullMask, t0, off));
      t1 = fmaxf(t1, __shfl_xor_sync(kFullMask, t1, off));
    }
    const float m0 = fmaxf(m[0], t0), m1 = fmaxf(m[1], t1);
    const float base0 = m0 == -INFINITY ? 0.0f : m0, base1 = m1 == -INFINITY ? 0.0f : m1;
    const float alpha0 = exp2f(m[0] - base0), alpha1 = exp2f(m[1] - base1);
    const float p0 = exp2f(s0 - base0), p1 = exp2f(s1 - base1);
    const float p2 = exp2f(s2 - base0), p3 = exp2f(s3 - base1);
    m[0] = m0;
    m[1] = m1;
    l[0] = l[0] * alpha0 + (p0 + p2);
    l[1] = l[1] * alpha1 + (p1 + p3);
    const float vs_lo = valid_lo ? load_half(slot_lo + C::kLayout.value_scale_offset) : 0.0f;
    const float vz_lo = valid_lo ? load_half(slot_lo + C::kLayout.value_zero_offset) : 0.0f;
    const float vs_hi = valid_hi ? load_half(slot_hi + C::kLayout.value_scale_offset) : 0.0f;
    const float vz_hi = valid_hi ? load_half(slot_hi + C::kLayout.value_zero_offset) : 0.0f;
    z[0] = z[0] * alpha0 + (p0 * vz_lo + p2 * vz_hi);
    z[1] = z[1] * alpha1 + (p1 * vz_lo + p3 * vz_hi);
    if (__any_sync(kFullMask, alpha0 != 1.0f || alpha1 != 1.0f)) {  // rare once the max settles
#pragma unroll
      for (int i = 0; i < C::kKSteps; ++i) {
        acc[i][0] *= alpha0;
        acc[i][1] *= alpha1;
        acc[i][2] *= alpha0;
        acc[i][3] *= alpha1;
      }
    }
    // B = (P * value_scale)^T: transpose the C-layout tiles (tokens x heads) in registers.
    const uint32_t pb0 = movmatrix_trans(pack_half2(p0 * vs_lo, p1 * vs_lo));
    const uint32_t pb1 = movmatrix_trans(pack_half2(p2 * vs_hi, p3 * vs_hi));

    // O^T += V^T B with raw codes: rows = dims of chunk g, columns = tokens 2c, 2c+1, 2c+8, 2c+9
    uint32_t vw[4][C::kValueWords];
    const int value_at = C::kLayout.value_data_offset + g * C::kValueChunkBytes;
    load_unaligned_words(slot_ptr(2 * c) + value_at, vw[0]);
    load_unaligned_words(slot_ptr(2 * c + 1) + value_at, vw[1]);
    load_unaligned_words(slot_ptr(2 * c + 8) + value_at, vw[2]);
    load_unaligned_words(slot_ptr(2 * c + 9) + value_at, vw[3]);
#pragma unroll
    for (int i = 0; i < C::kKSteps; ++i) {
      uint32_t a0, a1, a2, a3;
      if constexpr (C::VB == 4) {
        // Byte i of each token's chunk holds dims 2i (low nibble, row g) and 2i + 1 (high
        // nibble, row g + 8): interleave the two tokens' bytes, then one mask per nibble.
        const int w = i >> 2, byte = i & 3;
        const uint32_t sel = byte | (byte << 4) | ((byte + 4) << 8) | ((byte + 4) << 12);
        const uint32_t x01 = __byte_perm(vw[0][w], vw[1][w], sel);
        const uint32_t x23 = __byte_perm(vw[2][w], vw[3][w], sel);
        a0 = nibbles_to_half2(x01);
        a1 = nibbles_to_half2(x01 >> 4);
        a2 = nibbles_to_half2(x23);
        a3 = nibbles_to_half2(x23 >> 4);
      } else {
        const int d0 = 2 * i * C::VB, d1 = (2 * i + 1) * C::VB;
        a0 = codes_to_half2(extract_bits(vw[0], d0, C::VB), extract_bits(vw[1], d0, C::VB));
        a1 = codes_to_half2(extract_bits(vw[0], d1, C::VB), extract_bits(vw[1], d1, C::VB));
        a2 = codes_to_half2(extract_bits(vw[2], d0, C::VB), extract_bits(vw[3], d0, C::VB));
        a3 = codes_to_half2(extract_bits(vw[2], d1, C::VB), extract_bits(vw[3], d1, C::VB));
      }
      mma_16816(acc[i], a0, a1, a2, a3, pb0, pb1);
    }
    // This stage is refilled by the next iteration: every lane's reads of it have completed (their
    // values fed the MMAs above) before the barrier below, as in CUTLASS's TMA pipelines.
    __syncwarp();
  }

  // ---- combine the warps
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) {
    l[0] += __shfl_xor_sync(kFullMask, l[0], off);
    l[1] += __shfl_xor_sync(kFullMask, l[1], off);
    z[0] += __shfl_xor_sync(kFullMask, z[0], off);
    z[1] += __shfl_xor_sync(kFullMask, z[1], off);
  }
  __syncthreads();  // every warp is done with the ring
  float* merge = reinterpret_cast<float*>(scratch);  // [kWarps][kHeads][D + 3]: acc, m, l, z
  constexpr int kRow = D + 3;
  float* mine = merge + warp * kHeads * kRow;
#pragma unroll
  for (int i = 0; i < C::kKSteps; ++i) {
    const int d = g * (D / 8) + 2 * i;
    mine[(2 * c) * kRow + d] = acc[i][0];
    mine[(2 * c + 1) * kRow + d] = acc[i][1];
    mine[(2 * c) * kRow + d + 1] = acc[i][2];
    mine[(2 * c + 1) * kRow + d + 1] = acc[i][3];
  }
  if (g == 0) {
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      mine[(2 * c + k) * kRow + D] = m[k];
      mine[(2 * c + k) * kRow + D + 1] = l[k];
      mine[(2 * c + k) * kRow + D + 2] = z[k];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < num_heads * D; idx += kThreads) {
    const int h = idx / D, d = idx % D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, merge[(w * kHeads + h) * kRow + D]);
    float out = 0.0f, lse = -INFINITY;
    if (mx != -INFINITY) {
      float num = 0.0f, den = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float* r = merge + (w * kHeads + h) * kRow;
        const float wt = exp2f(r[D] - mx);  // 0 for a warp that saw no token
        num += wt * (r[d] + r[D + 2]);
        den += wt * r[D + 1];
      }
      out = num / den;
      lse = mx + log2f(den);
    }
    const int64_t row = static_cast<int64_t>(b) * p.num_q_heads + head0 + h;
    if (p.num_splits == 1) {
      static_cast<T*>(p.out)[row * D + d] = from_float<T>(out);
    } else {
      p.partial_out[(row * p.num_splits + split) * D + d] = out;
      if (d == 0) p.partial_lse[row * p.num_splits + split] = lse;
    }
  }
}

// Combines the splits of one (sequence, query head): out = sum_s 2^(lse_s - M) O_s / sum_s 2^(lse_s - M).
template <typename T>
__global__ void __launch_bounds__(128) merge_splits_kernel(const DecodeParams p, const int head_dim) {
  __shared__ float weight[kMaxSplits];
  __shared__ float inv_total;
  const int64_t row = blockIdx.x;  // b * num_q_heads + h
  const float* lse = p.partial_lse + row * p.num_splits;
  float mx = -INFINITY;
  for (int s = 0; s < p.num_splits; ++s) mx = fmaxf(mx, lse[s]);
  for (int s = threadIdx.x; s < p.num_splits; s += blockDim.x) weight[s] = mx == -INFINITY ? 0.0f : exp2f(lse[s] - mx);
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.0f;
    for (int s = 0; s < p.num_splits; ++s) total += weight[s];
    inv_total = total > 0.0f ? 1.0f / total : 0.0f;
  }
  __syncthreads();
  const float* part = p.partial_out + row * p.num_splits * head_dim;
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float acc = 0.0f;
    for (int s = 0; s < p.num_splits; ++s) {
      if (weight[s] != 0.0f) acc += weight[s] * part[s * head_dim + d];
    }
    static_cast<T*>(p.out)[row * head_dim + d] = device::from_float<T>(acc * inv_total);
  }
}

int device_sm_count() {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 132;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return 132;
  return sms;
}

int head_chunks_of(const DecodeParams& p) {
  return cdiv(p.num_q_heads / p.cache.num_kv_heads, kHeads);
}

template <class C, typename T>
cudaError_t launch_decode_typed(const DecodeParams& p, cudaStream_t stream) {
  auto kernel = decode_kernel<C, T>;
  static const cudaError_t attribute_status =  // once per instantiation (and process)
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmemBytes);
  cudaError_t err = attribute_status;
  if (err != cudaSuccess) return err;
  const int head_chunks = head_chunks_of(p);
  const float q_multiplier = p.scale * kLog2e * (C::kFp8Key ? 1.0f : 1.0f / sqrtf(static_cast<float>(C::D)));
  const dim3 grid(p.cache.num_kv_heads * head_chunks, p.num_splits, p.batch);
  kernel<<<grid, kThreads, C::kSmemBytes, stream>>>(p, q_multiplier, head_chunks);
  err = cudaGetLastError();
  if (err != cudaSuccess || p.num_splits == 1) return err;
  merge_splits_kernel<T><<<p.batch * p.num_q_heads, 128, 0, stream>>>(p, C::D);
  return cudaGetLastError();
}

template <int D, typename T>
cudaError_t launch_decode_preset(const DecodeParams& p, cudaStream_t stream) {
  const SlotLayout& L = p.layout;
  if (L.key_format == KeyFormat::kFp8 && L.value_bits == 4) return launch_decode_typed<DecodeConfig<D, true, 8, 4>, T>(p, stream);
  if constexpr (D != 96) {
    if (L.key_bits == 4 && L.value_bits == 4) return launch_decode_typed<DecodeConfig<D, false, 4, 4>, T>(p, stream);
    if (L.key_bits == 3 && L.value_bits == 4) return launch_decode_typed<DecodeConfig<D, false, 3, 4>, T>(p, stream);
    if (L.key_bits == 3 && L.value_bits == 3) return launch_decode_typed<DecodeConfig<D, false, 3, 3>, T>(p, stream);
  }
  return cudaErrorInvalidValue;
}

template <typename T>
cudaError_t launch_decode_dtype(const DecodeParams& p, cudaStream_t stream) {
  switch (p.layout.head_dim) {
    case 64: return launch_decode_preset<64, T>(p, stream);
    case 96: return launch_decode_preset<96, T>(p, stream);
    case 128: return launch_decode_preset<128, T>(p, stream);
    case 256: return launch_decode_preset<256, T>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

int decode_default_num_splits(const DecodeParams& p) {
  const int splits = default_num_splits(p.batch, p.cache.num_kv_heads * head_chunks_of(p),
                                        p.max_blocks_per_seq * p.cache.block_size, device_sm_count());
  return std::min(splits, 128);
}

cudaError_t launch_decode(const DecodeParams& p, cudaStream_t stream) {
  if (!cuda_supports_head_dim(p.layout) || p.num_splits < 1 || p.num_splits > kMaxSplits) return cudaErrorInvalidValue;
  if (p.batch == 0 || p.num_q_heads == 0) return cudaSuccess;
  if (p.batch > 65535) return cudaErrorInvalidConfiguration;  // grid z
  switch (p.dtype) {
    case ElementType::kHalf: return launch_decode_dtype<__half>(p, stream);
    case ElementType::kBFloat16: return launch_decode_dtype<__nv_bfloat16>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace turboquant
