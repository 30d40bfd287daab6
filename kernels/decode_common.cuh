// Pieces shared by the decode kernels (decode.cu: 8 query columns per CTA, each warp its own
// tiles; decode_rows.cu: a warp per KV head over whole token rows; decode_chunked.cu: 64 columns
// per CTA sharing each tile): the staged slot geometry, pair-table addressing, the query staging
// and the online softmax of a thread's two columns.
#pragma once

#include <cooperative_groups.h>

#include <cmath>

#include "device_utils.cuh"
#include "turboquant/layout.h"
#include "turboquant/query_chunks.h"
#include "turboquant/staging_window.h"

namespace turboquant {

constexpr float kLog2e = 1.4426950408889634f;
// Splits merged inside a cluster (merge_cluster_splits): exactly two. Measured (H200, graph replay, against
// the merge kernel in the same build): 2-CTA clusters at B = 8, L = 1k (128 CTAs) took
// the step from 16.4 to 14.8 us; clusters of 4, 8 and 16 CTAs over 128 CTAs made it 3-7 us slower
// (B = 4 L = 1k 11.5 -> 14.8, B = 1 L = 4k 11.9 -> 15.5, B = 4 L = 4k 19.0 -> 26.6), with or without
// the spread scheduling policy; over 32-64 CTAs they were even. The reason (H200): a cluster's
// CTAs may sit two per SM (cudaOccupancyMaxActiveClusters for the 4bit_nc D = 128 kernel at
// 100,368 bytes: 62 clusters of 4, 248 CTAs), and the slowdowns fit such a placement leaving SMs
// idle; forcing one CTA per SM (more than half an SM's shared memory) leaves fewer clusters than
// one wave of 128 CTAs needs (30 of 4, 15 of 8, 7 of 16: a cluster stays in one GPC), and B = 4
// L = 1k in 4 splits took 18.5 us against 11.8 with the merge kernel (14.7 with clusters two per SM).
constexpr int kClusterSplits = 2;
constexpr int cdiv(int a, int b) { return (a + b - 1) / b; }

// Host helpers of the decode launchers. The query is pre-scaled once per CTA: softmax scale,
// log2(e) (scores in the log2 domain) and, for Lloyd-Max keys, the 1/sqrt(D) of the orthonormal
// rotation (the kernels rotate with the unnormalized FWHT).
template <class C>
float decode_query_multiplier(float scale) {
  return scale * kLog2e * (C::kFp8Key ? 1.0f : 1.0f / sqrtf(static_cast<float>(C::D)));
}

// The packed slot of a preset at compile time: head dim, bit widths, layout.
template <int D_, bool kFp8Key_, int KB_, int VB_>
struct PackedSlot {
  static constexpr int D = D_;
  static constexpr bool kFp8Key = kFp8Key_;
  static constexpr int KB = kFp8Key_ ? 8 : KB_;  // bits per key element
  static constexpr int VB = VB_;
  static constexpr SlotLayout kLayout =
      make_slot_layout(D, kFp8Key ? KeyFormat::kFp8 : KeyFormat::kLloydMax, KB, VB);
  static constexpr int kSlotBytes = kLayout.slot_size_aligned;
  // The PV MMA runs on value codes less this center, with zero + center * scale as the zero term:
  // raw codes (mean about 2^(VB-1) - 1/2) would make sum_t (p_t s_t) q_t a large coherent sum that
  // the zero term then cancels, so the tensor cores' truncating fp32 sums lost accuracy in
  // proportion to the tokens of a split (4.5e-3 at 16,384 tokens in one split, 2e-3 allowed).
  static constexpr int kValueCodeCenter = 1 << (VB - 1);
};

// The packed slot as the per-head decode CTA stages it: the shared-memory row that holds the
// 16-byte chunks from the slot's start rounded down to kWindowAlign (16 or 32) bytes to its end
// (a slot starts at any even address).
template <int D_, bool kFp8Key_, int KB_, int VB_, int kWindowAlign_ = 16>
struct StagedSlot : PackedSlot<D_, kFp8Key_, KB_, VB_> {
  using PackedSlot<D_, kFp8Key_, KB_, VB_>::kSlotBytes;
  static constexpr int kWindowAlign = kWindowAlign_;
  static constexpr int kChunks = window_chunks(kSlotBytes, kWindowAlign);
  static constexpr int kRowBytes = (kChunks % 2 == 0 ? kChunks + 1 : kChunks) * 16;  // odd: no bank conflicts
  static constexpr int kTileBytes = 16 * kRowBytes;  // one 16-token tile
};

namespace device {

// An fp16 field of a slot (2-byte aligned in shared memory) as float.
__device__ __forceinline__ float load_half(const uint8_t* p) {
  return half_bits_to_float(*reinterpret_cast<const uint16_t*>(p));
}

// 2^x with flush-to-zero (one MUFU op; exp2f adds a denormal fix-up around it). 2^-inf = 0.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Byte offset of this lane's copy of pair-table entry `pair` (word pair * 32 + lane), where
// `pair` is the `width`-bit field at bit `bit` of the little-endian stream `w`: the field is
// shifted straight to bit 7 (no separate extract, scale and add), then the lane's bank is or-ed in.
template <int NW>
__device__ __forceinline__ uint32_t pair_entry_offset(const uint32_t (&w)[NW], int bit, int width, uint32_t lane_bytes) {
  const int word = bit >> 5, shift = bit & 31;
  uint32_t x;
  if (shift + width <= 32) {
    x = shift >= 7 ? w[word] >> (shift - 7) : w[word] << (7 - shift);
  } else {  // straddles two words; then shift > 32 - width >= 24, so shift - 7 > 0
    x = __funnelshift_r(w[word], w[word + 1], shift - 7);
  }
  return (x & (((1u << width) - 1u) << 7)) | lane_bytes;
}

// FWHT of one vector of D = 32 * N floats held by a warp, lane l holding dims l + 32e (e < N):
// stages h = 1 .. 16 across lanes (the partner's value by shuffle; the lower lane keeps a + b,
// the upper a - b, each one rounding as an FFMA), then h = 32 .. in registers. The butterflies
// and the stage order of fwht_inplace, so the same floats.
template <int N>
__device__ __forceinline__ void warp_fwht(float (&x)[N], int lane) {
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) {
    const float sign = (lane & m) != 0 ? -1.0f : 1.0f;
#pragma unroll
    for (int e = 0; e < N; ++e) x[e] = __fmaf_rn(x[e], sign, __shfl_xor_sync(kFullMask, x[e], m));
  }
#pragma unroll
  for (int h = 1; h < N; h <<= 1) {
#pragma unroll
    for (int e = 0; e < N; ++e) {
      if ((e & h) == 0) {
        const float a = x[e], b = x[e + h];
        x[e] = a + b;
        x[e + h] = a - b;
      }
    }
  }
}

// j / heads for a query column j < 64 without an integer division (~20 instructions each time):
// the quotient's fraction stays >= 0.5 / heads from an integer, far above the fast reciprocal's
// error.
__device__ __forceinline__ int column_token(int j, int heads) {
  return __float2int_rz(__fdividef(static_cast<float>(j) + 0.5f, static_cast<float>(heads)));
}

// Query staging, every thread of the CTA (kThreads) taking part: warp w stages columns w, w + kWarps,
// ... of qs[kColumns][D] in fp32 (zeros for unused columns), rotated for Lloyd-Max keys by the
// warp FWHT in registers (no barriers: the per-head kernel's shared-memory FWHT took 7 barrier
// rounds and ~400 instructions per warp, ~1.3 us of a 9 us step at short contexts, H200),
// in batches of up to 4 columns whose loads issue before any is used: one global round trip per
// batch instead of one per element group (the loop that guarded each load by its column compiled
// to serialized loads). Batches of 4 keep the chunked kernel's loop free of spills. Unused columns
// read row 0 (a launch with no query rows returns before this) and store zeros.
template <int D, int kColumns, int kThreads>
struct QueryStaging {
  static constexpr int kWarps = kThreads / 32;  // of the CTA (kDecodeWarps, or more in the row kernel)
  static_assert(kColumns % kWarps == 0 && D % 32 == 0, "query staging layout");
  static constexpr int kColumnsPerWarp = kColumns / kWarps, kPerLane = D / 32;
  static constexpr int kBatch = kColumnsPerWarp < 4 ? kColumnsPerWarp : 4;
  static_assert(kColumnsPerWarp % kBatch == 0, "whole batches");
  static_assert(kColumns <= 64, "load: the division-free column -> token");

  // Issues the loads of the batch of this warp's columns from its c0-th column on (lane: dims lane + 32e).
  template <typename T>
  __device__ __forceinline__ static void load(T (&raw)[kBatch][kPerLane], const T* query, const QueryColumns& columns,
                                              int c0) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int c = 0; c < kBatch; ++c) {
      const int j = warp + (c0 + c) * kWarps;
      const int64_t row = columns.row(j, column_token(j, columns.heads));  // computed for every column: a select, not a branch
      const int64_t base = (j < columns.count() ? row : 0) * D;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) raw[c][e] = query[base + lane + 32 * e];
    }
  }

  // The batch's key_scale rows (head_vector_of_row; group: query heads per KV head), every load
  // issued before any is used; ones for unused columns and where the decode has none.
  __device__ __forceinline__ static void load_scales(float (&scale)[kBatch][kPerLane], const float* key_scale,
                                                     const QueryColumns& columns, int c0, int group) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int c = 0; c < kBatch; ++c) {
      const int j = warp + (c0 + c) * kWarps;
      const bool scaled = key_scale != nullptr && j < columns.count();  // warp-uniform
      const float* s = scaled ? head_vector_of_row(key_scale, columns.row(j, column_token(j, columns.heads)),
                                                   columns.num_q_heads, group, D)
                              : nullptr;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) scale[c][e] = s != nullptr ? s[lane + 32 * e] : 1.0f;
    }
  }

  // The loaded batch -> qs, times the column's KV head's key_scale where the decode has one
  // (head_vector_of_row; group: query heads per KV head), rotated for Lloyd-Max keys. Each column's
  // key_scale row is loaded where it is used: the chunked kernel's staging, whose loop spills with
  // more registers held (PreloadedQuery loads them with the query instead).
  template <bool kLloydMax, typename T>
  __device__ __forceinline__ static void store(float* qs, const T (&raw)[kBatch][kPerLane], const QueryColumns& columns,
                                               int c0, const float* key_scale, int group) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int c = 0; c < kBatch; ++c) {
      const int j = warp + (c0 + c) * kWarps;
      float x[kPerLane];
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) x[e] = j < columns.count() ? to_float(raw[c][e]) : 0.0f;
      if (key_scale != nullptr && j < columns.count()) {  // warp-uniform
        const float* s = head_vector_of_row(key_scale, columns.row(j, column_token(j, columns.heads)),
                                            columns.num_q_heads, group, D);
#pragma unroll
        for (int e = 0; e < kPerLane; ++e) x[e] *= s[lane + 32 * e];
      }
      put<kLloydMax>(qs, x, j, columns);
    }
  }

  // store with the batch's key_scale rows already loaded (load_scales).
  template <bool kLloydMax, typename T>
  __device__ __forceinline__ static void store_scaled(float* qs, const T (&raw)[kBatch][kPerLane],
                                                      const float (&scale)[kBatch][kPerLane],
                                                      const QueryColumns& columns, int c0) {
    const int warp = threadIdx.x >> 5;
#pragma unroll
    for (int c = 0; c < kBatch; ++c) {
      const int j = warp + (c0 + c) * kWarps;
      float x[kPerLane];
#pragma unroll
      for (int e = 0; e < kPerLane; ++e) x[e] = j < columns.count() ? to_float(raw[c][e]) * scale[c][e] : 0.0f;
      put<kLloydMax>(qs, x, j, columns);
    }
  }

  // Column j's fp32 values -> qs, rotated for Lloyd-Max keys (unused columns stay zeros).
  template <bool kLloydMax>
  __device__ __forceinline__ static void put(float* qs, float (&x)[kPerLane], int j, const QueryColumns& columns) {
    const int lane = threadIdx.x & 31;
    if constexpr (kLloydMax) {
      if (j < columns.count()) warp_fwht(x, lane);  // warp-uniform
    }
#pragma unroll
    for (int e = 0; e < kPerLane; ++e) qs[j * D + lane + 32 * e] = x[e];
  }
};

// The codebook's pair table for Lloyd-Max keys of kKeyBits bits, replicated once per bank (word
// pair * kPairStrideWords + lane; a stride of 64 words: see pair_entry in decode_tile.cuh). Four
// replicas per 16-byte store (pair_table is 16-byte aligned): 8 stores per thread for 4-bit keys
// instead of 32 single-word ones, a quarter of the centroid reads.
template <int kKeyBits, int kPairStrideWords, int kThreads>
__device__ __forceinline__ void stage_pair_table(uint32_t* pair_table, const Codebook& codebook) {
  constexpr uint32_t mask = (1u << kKeyBits) - 1u;
  constexpr int kQuads = (1 << (2 * kKeyBits)) * 32 / 4;
  static_assert(kQuads % kThreads == 0, "whole rounds of quads");
#pragma unroll 2
  for (int i = threadIdx.x; i < kQuads; i += kThreads) {
    const uint32_t pair = static_cast<uint32_t>(i) >> 3;  // words 4i .. 4i + 3: replicas of one pair
    const uint32_t w = pack_half2(codebook.centroid[pair & mask], codebook.centroid[pair >> kKeyBits]);
    const int at = kPairStrideWords == 32 ? i : static_cast<int>(pair) * (kPairStrideWords / 4) + (i & 7);
    reinterpret_cast<uint4*>(pair_table)[at] = make_uint4(w, w, w, w);
  }
}

// The query columns staged (QueryStaging; key_scale and group as there) and the pair table for
// Lloyd-Max keys. Every thread of the CTA calls it; qs and the table are visible to all when it
// returns.
template <int D, int kColumns, bool kLloydMax, int kKeyBits, int kPairStrideWords = 32, int kThreads = kDecodeThreads,
          typename T>
__device__ __forceinline__ void stage_query_columns(float* qs, uint32_t* pair_table, const T* query,
                                                    const QueryColumns& columns, const Codebook& codebook,
                                                    const float* key_scale, int group) {
  using Staging = QueryStaging<D, kColumns, kThreads>;
#pragma unroll 1
  for (int c0 = 0; c0 < Staging::kColumnsPerWarp; c0 += Staging::kBatch) {
    T raw[Staging::kBatch][Staging::kPerLane];
    Staging::load(raw, query, columns, c0);
    Staging::template store<kLloydMax>(qs, raw, columns, c0, key_scale, group);
  }
  if constexpr (kLloydMax) stage_pair_table<kKeyBits, kPairStrideWords, kThreads>(pair_table, codebook);
  __syncthreads();
}

// stage_query_columns in two steps, for a kernel that issues the query loads first thing (every
// batch of the warp's columns into registers, and their KV heads' key_scale rows), so their
// latency overlaps the loads of the sequence length and the block ids instead of following them,
// and stages them later. Loaded at staging instead, the key_scale rows were one more memory round
// trip per column on the way to the staging barrier: a calibrated decode took 1.5-1.6 us longer
// than a plain one, and 0.6-1.0 us with them preloaded, plain decode unchanged (H100, B = 1-32;
// RESULTS.md, "Per-head transforms").
template <int D, int kColumns, int kThreads, typename T>
struct PreloadedQuery {
  using Staging = QueryStaging<D, kColumns, kThreads>;
  static constexpr int kBatches = Staging::kColumnsPerWarp / Staging::kBatch;
  T raw[kBatches][Staging::kBatch][Staging::kPerLane];
  float scale[kBatches][Staging::kBatch][Staging::kPerLane];

  __device__ __forceinline__ void load(const T* query, const QueryColumns& columns, const float* key_scale, int group) {
#pragma unroll
    for (int i = 0; i < kBatches; ++i) Staging::load(raw[i], query, columns, i * Staging::kBatch);
#pragma unroll
    for (int i = 0; i < kBatches; ++i) Staging::load_scales(scale[i], key_scale, columns, i * Staging::kBatch, group);
  }
  // -> qs (fp32, times key_scale, rotated for Lloyd-Max keys) and the pair table, visible to every
  // thread on return.
  template <bool kLloydMax, int kKeyBits, int kPairStrideWords>
  __device__ __forceinline__ void stage(float* qs, uint32_t* pair_table, const QueryColumns& columns,
                                        const Codebook& codebook) const {
#pragma unroll
    for (int i = 0; i < kBatches; ++i) {
      Staging::template store_scaled<kLloydMax>(qs, raw[i], scale[i], columns, i * Staging::kBatch);
    }
    if constexpr (kLloydMax) stage_pair_table<kKeyBits, kPairStrideWords, kThreads>(pair_table, codebook);
    __syncthreads();
  }
};

// The online softmax's exponent base m is raised to kSoftmaxHeadroom (log2 domain) above the
// largest score so far, never to the score itself: a later score up to a factor 2^headroom larger
// needs no rescale of the O^T fragments (32 FMULs, three shuffle rounds), and the weights stay
// <= 1 (at most a factor 2 below what a base at the max gives: one bit of the fp16 P*scale
// operand's range, none of its precision above fp16's subnormals). The results do not depend on
// the base: out = (acc + z) / l and lse = m + log2(l) (the merges) hold for any base.
constexpr float kSoftmaxHeadroom = 1.0f;

// kTiles 16-token tiles of the online softmax for this thread's score columns 2c and 2c + 1
// (scores s[t] in the mma C layout: tokens g, g + 8 of tile t x columns 2c, 2c + 1; log2 domain,
// masked ones -inf; a column's tokens live in the 8 lanes sharing c). While no score of the tiles
// exceeds the base m, the rescale factors are exactly 1 and the cross-lane reduction (three
// dependent shuffle rounds at the head of the chain) is skipped; a warp-uniform vote picks the
// path. Rescales acc (the O^T fragments of the same columns) and l, returns the weights p and the
// factors alpha.
template <int kTiles, int kKSteps>
__device__ __forceinline__ void online_softmax_tiles(const float (&s)[kTiles][4], float (&m)[2], float (&l)[2],
                                                     float (&acc)[kKSteps][4], float (&p)[kTiles][4],
                                                     float (&alpha)[2]) {
  float t0 = fmaxf(s[0][0], s[0][2]), t1 = fmaxf(s[0][1], s[0][3]);
#pragma unroll
  for (int t = 1; t < kTiles; ++t) {
    t0 = fmaxf(t0, fmaxf(s[t][0], s[t][2]));
    t1 = fmaxf(t1, fmaxf(s[t][1], s[t][3]));
  }
  alpha[0] = alpha[1] = 1.0f;
  if (__any_sync(kFullMask, t0 > m[0] || t1 > m[1])) {
    float r0 = t0, r1 = t1;
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
      r0 = fmaxf(r0, __shfl_xor_sync(kFullMask, r0, off));
      r1 = fmaxf(r1, __shfl_xor_sync(kFullMask, r1, off));
    }
    const float m0 = fmaxf(m[0], r0 + kSoftmaxHeadroom), m1 = fmaxf(m[1], r1 + kSoftmaxHeadroom);
    alpha[0] = exp2_ftz(m[0] - (m0 == -INFINITY ? 0.0f : m0));
    alpha[1] = exp2_ftz(m[1] - (m1 == -INFINITY ? 0.0f : m1));
    m[0] = m0;
    m[1] = m1;
#pragma unroll
    for (int i = 0; i < kKSteps; ++i) {
      acc[i][0] *= alpha[0];
      acc[i][1] *= alpha[1];
      acc[i][2] *= alpha[0];
      acc[i][3] *= alpha[1];
    }
  }
  const float base0 = m[0] == -INFINITY ? 0.0f : m[0], base1 = m[1] == -INFINITY ? 0.0f : m[1];
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    p[t][0] = exp2_ftz(s[t][0] - base0);
    p[t][1] = exp2_ftz(s[t][1] - base1);
    p[t][2] = exp2_ftz(s[t][2] - base0);
    p[t][3] = exp2_ftz(s[t][3] - base1);
  }
  float sum0 = p[0][0] + p[0][2], sum1 = p[0][1] + p[0][3];
#pragma unroll
  for (int t = 1; t < kTiles; ++t) {
    sum0 += p[t][0] + p[t][2];
    sum1 += p[t][1] + p[t][3];
  }
  l[0] = l[0] * alpha[0] + sum0;
  l[1] = l[1] * alpha[1] + sum1;
}

// One tile (the decode kernel's step).
template <int kKSteps>
__device__ __forceinline__ void online_softmax_tile(const float (&s)[4], float (&m)[2], float (&l)[2],
                                                    float (&acc)[kKSteps][4], float (&p)[4], float (&alpha)[2]) {
  online_softmax_tiles<1, kKSteps>(reinterpret_cast<const float(&)[1][4]>(s), m, l, acc,
                                   reinterpret_cast<float(&)[1][4]>(p), alpha);
}

// Sums of a thread's two column partials (l or z) over the 8 lanes sharing c.
__device__ __forceinline__ void sum_over_column_lanes(float (&v)[2]) {
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) {
    v[0] += __shfl_xor_sync(kFullMask, v[0], off);
    v[1] += __shfl_xor_sync(kFullMask, v[1], off);
  }
}

// Whether a column's softmax saw a token, from its sum l: 0 for none, > 0 once a score is finite
// (the largest weighs at least 2^-kSoftmaxHeadroom), NaN once a score is NaN. The running max m
// cannot tell: fmaxf skips a NaN, so a split whose only scores are NaN ends with m = -inf like an
// empty one, and testing m turned such a column into zeros where the CPU gives NaN (tests/python/test_decode_rows.py).
__device__ __forceinline__ bool column_saw_tokens(float l) { return l != 0.0f; }

// Folds a second split's result (normalized output o1 and log-sum-exp lse1, log2 domain) into
// the first (o, lse), by the merge's rule (decode_merge.cu): weights 2^(lse - max); a split that
// saw no token (lse = -inf) weighs 0 and is selected away, so its output is never multiplied in;
// both empty: zeros and -inf. A NaN on either side (a NaN key) reaches o and lse, so the merge
// after it passes it on: fmaxf ignores a NaN, so with the other side empty mx is -inf, and the
// test for "both empty" must look at both log-sum-exps, not at mx (testing mx turned a NaN row
// into zeros with one split, the row kernel forced).
__device__ __forceinline__ void fold_split_results(float4& o, float& lse, const float4 o1, const float lse1) {
  if (lse == -INFINITY && lse1 == -INFINITY) {
    o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    return;
  }
  const float mx = fmaxf(lse, lse1);
  const float w0 = split_weight(lse, mx), w1 = split_weight(lse1, mx);  // one is 1 unless a NaN
  const float inv = 1.0f / (w0 + w1);
  auto fold = [&](float a, float b) { return ((w0 != 0.0f ? w0 * a : 0.0f) + (w1 != 0.0f ? w1 * b : 0.0f)) * inv; };
  o = make_float4(fold(o.x, o1.x), fold(o.y, o1.y), fold(o.z, o1.z), fold(o.w, o1.w));
  lse = mx + log2f(w0 + w1);
}

// ---- the split merge inside a thread-block cluster (the per-head kernel with kClusterSplits
// splits): the cluster's two CTAs are the splits of one (query chunk, head group), and they merge
// over distributed shared memory at the end instead of through a workspace and a second launch,
// whose tail after the decode kernel took 1.7-2.8 us of a 10-17 us short-context step (graph
// replay, H200).

// Both splits' normalized outputs outs[column][D] and log-sum-exps lses[column] (log2 domain), in
// the shared memory of each CTA of the cluster -> the merged outputs, folded by
// fold_split_results (the merge kernel's rule), each CTA half of the (column, dim) elements,
// written through store(column, dim, value, attended) (attended: whether the column saw a token).
// outs is 16-byte aligned. Every thread of both CTAs calls it.
template <int D, int kThreads, class Store>
__device__ __forceinline__ void merge_cluster_splits(const float* outs, const float* lses, int num_columns,
                                                     const Store& store) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900  // clusters: sm_90 on (the launcher checks the build)
  static_assert(kClusterSplits == 2 && D % 4 == 0, "a pair of splits, four dims per step");
  const cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  cluster.sync();  // both splits' results are in their shared memory
  const float4* outs0 = reinterpret_cast<const float4*>(cluster.map_shared_rank(outs, 0));
  const float4* outs1 = reinterpret_cast<const float4*>(cluster.map_shared_rank(outs, 1));
  const float* lses0 = cluster.map_shared_rank(lses, 0);
  const float* lses1 = cluster.map_shared_rank(lses, 1);
  const int quads = num_columns * (D / 4), per_rank = cdiv(quads, kClusterSplits);
  const int rank = static_cast<int>(cluster.block_rank()), end = min(quads, (rank + 1) * per_rank);
  for (int q = rank * per_rank + static_cast<int>(threadIdx.x); q < end; q += kThreads) {
    const int column = q / (D / 4);
    float4 o = outs0[q];
    float lse = lses0[column];
    fold_split_results(o, lse, outs1[q], lses1[column]);
    const int d = 4 * q - column * D;
    const bool attended = lse != -INFINITY;  // a NaN lse (a NaN key) counts: NaN stays NaN
    store(column, d, o.x, attended);
    store(column, d + 1, o.y, attended);
    store(column, d + 2, o.z, attended);
    store(column, d + 3, o.w, attended);
  }
  // Neither CTA leaves while the other still reads its shared memory. A relaxed arrive: the
  // reads it waits for have returned (their values are already in the stores above), and
  // cluster.sync()'s release arrive compiles to MEMBAR.ALL.GPU (sm_90, nvcc 13.0), which would
  // wait for those output stores to reach memory before the CTA may finish. So every load from
  // the partner's shared memory above must feed a store before this point (a relaxed arrive
  // does not order loads whose values are unused).
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
#else
  __trap();
#endif
}

// The log-sum-exp shift (log2 domain) of a query row under key_offset (DecodeParams): every score
// of the row moves by scale * q . key_offset, so its log-sum-exp does, while the softmax does not.
// The kernels that write partial log-sum-exps add it there, so the merged one (decode_lse's) is the
// original scores'. The warp's lanes share the head dims of `query` (the row's, T[head_dim]) and
// `key_offset` (its KV head's); every lane gets the result.
template <typename T>
__device__ __forceinline__ float key_offset_lse_shift(const T* query, const float* key_offset, int head_dim,
                                                      float scale, int lane) {
  float dot = 0.0f;
  for (int i = lane; i < head_dim; i += 32) dot = fmaf(to_float(query[i]), key_offset[i], dot);
  return group_sum(dot) * scale * kLog2e;
}

}  // namespace device
}  // namespace turboquant
