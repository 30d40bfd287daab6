// Varlen decode for long query chunks: each key/value tile is loaded and dequantized once per CTA
// and serves every query token of the CTA's chunk.
//
// The decode kernel (decode.cu) gives each warp its own tiles and dequantizes them into MMA
// fragments in registers; its 8 MMA columns serve 8 / group query tokens. Here the 8 warps of a
// CTA share one stream of 64-token steps (4 tiles) instead and each warp owns 8 of the CTA's 64
// query columns ((token, head) pairs, 64 / group tokens per CTA). Per step:
//   * all threads copy the step's 64 slots into a CTA-wide ring (cp.async, one 16-byte chunk per
//     thread and row), S - 1 steps ahead;
//   * all threads dequantize it once into shared memory as fp16: keys in the rotated basis
//     (pair-table lookups or FP8 conversion, natural dim order), values as their integer codes
//     less their center (PackedSlot::kValueCodeCenter; within each group of 4 dims stored as
//     d0 d2 d1 d3, undone when writing the output), plus each row's norm, value scale and zero
//     (+ center * scale);
//   * each warp runs S^T = K~ Q^T and O^T += V^T (P * scale)^T for its 8 columns on tensor cores
//     with ldmatrix fragments (4 independent score chains), and the online softmax of the decode
//     kernel once per step.
// So the dequantize work per tile is paid once per 64 columns instead of once per 8. Head dims
// 64 and 128, GQA groups up to 8. launch_decode takes it for varlen queries once the average
// sequence fills half of its 64 columns (use_chunked_varlen, decode_plan.cu; measured in RESULTS.md).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdlib>
#include <type_traits>

#include "decode_common.cuh"
#include "device_utils.cuh"
#include "dispatch.cuh"
#include "launchers.h"
#include "turboquant/numeric.h"
#include "turboquant/split_plan.h"

namespace turboquant {
namespace {

// What the scores and the value accumulation need of each dequantized row (16 bytes: one
// shared-memory vector load).
struct __align__(16) RowScalars {
  float norm;   // key norm (1 for FP8 keys)
  float scale;  // value scale
  float zero;   // value zero
  float valid;  // 0 for masked rows (past the range, bad block id)
};

template <int D_, bool kFp8Key_, int KB_, int VB_>
struct ChunkedConfig : StagedSlot<D_, kFp8Key_, KB_, VB_> {
  using Slot = StagedSlot<D_, kFp8Key_, KB_, VB_>;
  using Slot::D, Slot::kFp8Key, Slot::KB, Slot::VB, Slot::kLayout, Slot::kChunks, Slot::kRowBytes, Slot::kTileBytes;
  // A loop step is kStepTiles 16-token tiles between one pair of barriers: the barriers, the
  // softmax max reduction and the accumulator rescale are paid once per 64 tokens, and a warp
  // runs kStepTiles independent score MMA chains.
  static constexpr int kStepTiles = 4;
  static constexpr int kStepTokens = kStepTiles * kTokenTile;
  static constexpr int kStages = 3;  // steps in flight + 1
  static constexpr int kStepBytes = kStepTiles * kTileBytes;
  static constexpr int kDimsPerThread = D / 16;  // 16 threads per token row in the dequantize
  static constexpr int kTileStride = D + 8;      // halves per dequantized row: ldmatrix without bank conflicts
  static constexpr int kStepHalves = kStepTokens * kTileStride;
  static constexpr int kPairs = kFp8Key ? 0 : 1 << (2 * KB);
  static constexpr int kPairTableWords = kPairs * 32;
  // Shared memory: [ring | K step, V step (dequantized) | row scalars | stage metadata], aliased
  // by the query rotation at set-up; then the pair table.
  static constexpr int kRingBytes = kStages * kStepBytes;
  static constexpr int kStepTileBytes = 2 * kStepHalves * 2;
  static constexpr int kRowScalarBytes = kStepTokens * 16;  // RowScalars per row
  static constexpr int kStageMetaBytes = kStages * kStepTokens * 4;
  static constexpr int kLoopBytes = kRingBytes + kStepTileBytes + kRowScalarBytes + kStageMetaBytes;
  static constexpr int kQueryBytes = kChunkedColumns * D * 4;
  static constexpr int kScratchBytes = cdiv(kLoopBytes > kQueryBytes ? kLoopBytes : kQueryBytes, 16) * 16;
  static constexpr int kSmemBytes = kScratchBytes + kPairTableWords * 4;
  static_assert(kChunks <= 16, "one 16-byte chunk per thread and row");
  static_assert(D == 64 || D == 128, "head dims of the chunked kernel");
  // Two CTAs per SM (the split heuristic assumes it): 228 KB per SM, 1 KB of it reserved per CTA.
  static_assert(2 * (kSmemBytes + 1024) <= 228 * 1024, "two CTAs per SM");
};

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(device::smem_address(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(device::smem_address(p)));
}

// Stored value position -> head dim: within each group of 4 dims the tile holds d0 d2 d1 d3.
__device__ __forceinline__ int value_dim_of_position(int pos) {
  return (pos & ~3) | ((pos & 1) << 1) | ((pos >> 1) & 1);
}

template <class C, typename T>
__global__ void __launch_bounds__(kDecodeThreads, 2)
    decode_chunked_kernel(const DecodeParams p, const float q_multiplier) {
  using namespace device;
  constexpr int D = C::D;
  extern __shared__ __align__(16) uint8_t smem[];
  uint8_t* ring = smem;
  __half* k_step = reinterpret_cast<__half*>(smem + C::kRingBytes);  // [kStepTokens][kTileStride]
  __half* v_step = k_step + C::kStepHalves;
  RowScalars* row_scalars = reinterpret_cast<RowScalars*>(smem + C::kRingBytes + C::kStepTileBytes);  // [kStepTokens]
  int* stage_rows = reinterpret_cast<int*>(smem + C::kRingBytes + C::kStepTileBytes + C::kRowScalarBytes);  // [S][kStepTokens]
  uint32_t* pair_table = reinterpret_cast<uint32_t*>(smem + C::kScratchBytes);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int kv_head = blockIdx.x;
  const int split = blockIdx.y;
  const int group = p.num_q_heads / p.cache.num_kv_heads;  // <= 8 (host-checked)
  const int head0 = kv_head * group;
  const QueryChunk chunk = locate_query_chunk(p.query_start_loc, p.batch, p.query_rows,
                                              chunked_tokens_per_cta(group), blockIdx.z);
  if (chunk.tokens == 0) return;  // CTA-uniform
  const int b = chunk.seq;
  const int block_size = p.cache.block_size;
  const QueryColumns columns{chunk, group, head0, min(max(p.seq_lens[b], 0), p.max_blocks_per_seq * block_size),
                             p.num_q_heads};
  const int num_columns = columns.count();
  const int my_col0 = warp * 8;  // this warp's columns [my_col0, my_col0 + 8)
  const int limit0 = columns.limit(my_col0 + 2 * c), limit1 = columns.limit(my_col0 + 2 * c + 1);
  const TokenRange range = split_token_range(columns.limit(num_columns - 1), p.num_splits, split);

  // ---- set-up: query columns (fp32, times key_scale, rotated for Lloyd-Max keys) -> B fragments; pair table
  stage_query_columns<D, kChunkedColumns, !C::kFp8Key, C::KB>(reinterpret_cast<float*>(smem), pair_table,
                                                               static_cast<const T*>(p.query), columns, p.codebook,
                                                               p.key_scale, group);
  // B fragments of Q^T for this warp's columns: k (2c, 2c+1 | 2c+8, 2c+9) of step j = dims 16j + ..
  uint32_t qf[D / 16][2];
  {
    const float* q = reinterpret_cast<const float*>(smem) + (my_col0 + g) * D;
#pragma unroll
    for (int j = 0; j < D / 16; ++j) {
      qf[j][0] = pack_half2(q[16 * j + 2 * c] * q_multiplier, q[16 * j + 2 * c + 1] * q_multiplier);
      qf[j][1] = pack_half2(q[16 * j + 2 * c + 8] * q_multiplier, q[16 * j + 2 * c + 9] * q_multiplier);
    }
  }
  __syncthreads();  // the loop's buffers reuse the query's

  // ---- the CTA's steps: copy (thread t: row t / 16 of each tile, chunk t % 16), S - 1 steps ahead
  const int num_steps = range.end > range.begin ? cdiv(range.end - range.begin, C::kStepTokens) : 0;
  const int copy_row = threadIdx.x >> 4, copy_chunk = threadIdx.x & 15;
  const int64_t head_offset = static_cast<int64_t>(kv_head) * p.cache.stride_head;
  const int32_t* block_row = p.block_table + static_cast<int64_t>(b) * p.max_blocks_per_seq;
  const int block_shift = __ffs(block_size) - 1;
  // Block ids of a step's tiles (a tile starts at a multiple of 16 tokens, so it lies in one
  // block); -1 past the range.
  using StepBlocks = int[C::kStepTiles];
  auto step_blocks = [&](int step, StepBlocks& blocks) {
#pragma unroll
    for (int t = 0; t < C::kStepTiles; ++t) {
      const int t0 = range.begin + step * C::kStepTokens + t * kTokenTile;
      blocks[t] = step < num_steps && t0 < range.end ? block_row[t0 >> block_shift] : -1;
    }
  };
  // Issues step `step` (its tiles' block ids `blocks`) into ring stage step % S; thread (row,
  // chunk 0) records where each of its rows' slot starts inside the row's 16-byte-aligned window
  // (turboquant/staging_window.h), or -1 when the row is masked.
  auto issue_step = [&](int step, const StepBlocks& blocks) {
    const int stage = step % C::kStages;
#pragma unroll
    for (int t = 0; t < C::kStepTiles; ++t) {
      const int row = t * kTokenTile + copy_row;
      const int pos = range.begin + step * C::kStepTokens + row;
      const int block = blocks[t];
      if (block >= 0 && block < p.cache.num_blocks && pos < range.end) {
        const int64_t slot = block * p.cache.stride_block +
                             static_cast<int64_t>(pos & (block_size - 1)) * p.cache.stride_token + head_offset;
        const int64_t first = window_start(slot, C::kWindowAlign);
        const int64_t chunk_at = first + 16 * copy_chunk;
        // Whole 16-byte chunks inside the view only (span_bytes is a multiple of 16, host-checked).
        if (copy_chunk < C::kChunks && chunk_at + 16 <= p.cache.span_bytes) {
          cp_async_16(ring + stage * C::kStepBytes + row * C::kRowBytes + 16 * copy_chunk, p.cache.data + chunk_at);
        }
        if (copy_chunk == 0) stage_rows[stage * C::kStepTokens + row] = offset_in_window(slot, C::kWindowAlign);
      } else if (copy_chunk == 0) {
        stage_rows[stage * C::kStepTokens + row] = -1;
      }
    }
    cp_async_commit();
  };

  // Dequantizes row `row` of the step in ring stage `stage` into k_step, v_step and row_scalars
  // (this thread: dims [part * kDimsPerThread, +kDimsPerThread)).
  const uint8_t* table_bytes = reinterpret_cast<const uint8_t*>(pair_table);
  const uint32_t lane_bytes = lane * 4u;
  auto dequantize_row = [&](int stage, int row, int part) {
    const int at = stage_rows[stage * C::kStepTokens + row];
    __half* k_out = k_step + row * C::kTileStride;
    __half* v_out = v_step + row * C::kTileStride;
    const int dim0 = part * C::kDimsPerThread;
    // A masked row gets zeros everywhere (its scores are masked; zeros keep NaN out of the MMA).
    uint32_t kh[C::kDimsPerThread / 2] = {}, vh[C::kDimsPerThread / 2] = {};
    float norm = 0.0f, scale = 0.0f, zero = 0.0f;
    if (at >= 0) {
      const uint8_t* slot = ring + stage * C::kStepBytes + row * C::kRowBytes + at;
      // This thread's indices start at bit dim0 * bits: a whole byte except for 3-bit codes at
      // D = 64 (12 bits per thread), where odd parts start mid-byte.
      constexpr bool kKeyBytes = (C::kDimsPerThread * C::KB) % 8 == 0;
      constexpr bool kValueBytes = (C::kDimsPerThread * C::VB) % 8 == 0;
      const int key_bit0 = kKeyBytes ? 0 : (dim0 * C::KB) & 7;
      const int value_bit0 = kValueBytes ? 0 : (dim0 * C::VB) & 7;
      constexpr int kKeyWords = cdiv(C::kDimsPerThread * C::KB + 7, 32) + 1;
      uint32_t kw[kKeyWords];
      load_unaligned_words(slot + dim0 * C::KB / 8, kw);
#pragma unroll
      for (int i = 0; i < C::kDimsPerThread / 2; ++i) {
        if constexpr (C::kFp8Key) {
          kh[i] = fp8x2_to_half2(extract_bits(kw, 16 * i, 16));
        } else {
          kh[i] = *reinterpret_cast<const uint32_t*>(
              table_bytes + pair_entry_offset(kw, key_bit0 + 2 * i * C::KB, 2 * C::KB, lane_bytes));
        }
      }
      // values: pairs (2i, 2i+1) of dims, two pairs per half2 word: (d0, d2) and (d1, d3)
      constexpr int kValueWords = cdiv(C::kDimsPerThread * C::VB + 7, 32) + 1;
      uint32_t vw[kValueWords];
      load_unaligned_words(slot + C::kLayout.value_data_offset + dim0 * C::VB / 8, vw);
#pragma unroll
      for (int q4 = 0; q4 < C::kDimsPerThread / 4; ++q4) {
        const int bit = value_bit0 + 4 * q4 * C::VB;
        const uint32_t x = __byte_perm(window16(vw, bit), window16(vw, bit + 2 * C::VB), 0x5410);
        vh[2 * q4] = low_codes_to_half2<C::VB, C::kValueCodeCenter>(x);  // centered: PackedSlot
        vh[2 * q4 + 1] = high_codes_to_half2<C::VB, C::kValueCodeCenter>(x);
      }
      if constexpr (C::kFp8Key) {
        norm = 1.0f;
      } else {
        norm = load_half(slot + C::kLayout.key_norm_offset);
      }
      scale = load_half(slot + C::kLayout.value_scale_offset);
      zero = fmaf(static_cast<float>(C::kValueCodeCenter), scale, load_half(slot + C::kLayout.value_zero_offset));
    }
    if (part == 0) row_scalars[row] = RowScalars{norm, scale, zero, at < 0 ? 0.0f : 1.0f};
    // One 16-byte (D = 128) or 8-byte (D = 64) store per tile row piece.
    using Piece = std::conditional_t<C::kDimsPerThread == 8, uint4, uint2>;
    *reinterpret_cast<Piece*>(k_out + dim0) = *reinterpret_cast<const Piece*>(kh);
    *reinterpret_cast<Piece*>(v_out + dim0) = *reinterpret_cast<const Piece*>(vh);
  };

  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, z[2] = {0.0f, 0.0f};
  float acc[D / 16][4];
#pragma unroll
  for (int i = 0; i < D / 16; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;

  // A warp whose 8 columns are all past the chunk's (short chunks) only copies and dequantizes.
  const bool warp_has_columns = my_col0 < num_columns;
  StepBlocks next_blocks;  // block ids of the next step to issue, one load ahead
  step_blocks(C::kStages - 1, next_blocks);
#pragma unroll
  for (int st = 0; st < C::kStages - 1; ++st) {
    StepBlocks blocks;
    step_blocks(st, blocks);
    issue_step(st, blocks);
  }
  const int k_row = (lane & 7) + ((lane >> 3) & 1) * 8, k_col = (lane >> 4) * 8;  // ldmatrix addresses
  const int v_row = (lane & 7) + ((lane >> 4) & 1) * 8, v_col = ((lane >> 3) & 1) * 8;
  for (int step = 0; step < num_steps; ++step) {
    StepBlocks blocks;
#pragma unroll
    for (int t = 0; t < C::kStepTiles; ++t) blocks[t] = next_blocks[t];
    step_blocks(step + C::kStages, next_blocks);
    // Into the stage step - 1 used, dequantized before the previous iteration's barrier B.
    issue_step(step + C::kStages - 1, blocks);
    cp_async_wait<C::kStages - 1>();
    __syncthreads();  // (A) this step's copies are visible, and every warp is done with the last step
#pragma unroll 2
    for (int t = 0; t < C::kStepTiles; ++t) dequantize_row(step % C::kStages, t * kTokenTile + copy_row, copy_chunk);
    __syncthreads();  // (B) the dequantized step is visible
    if (!warp_has_columns) continue;  // warp-uniform

    // S^T = K~ Q^T: one independent MMA chain per tile of the step
    float sc[C::kStepTiles][4];
#pragma unroll
    for (int t = 0; t < C::kStepTiles; ++t) sc[t][0] = sc[t][1] = sc[t][2] = sc[t][3] = 0.0f;
#pragma unroll
    for (int j = 0; j < D / 16; ++j) {
#pragma unroll
      for (int t = 0; t < C::kStepTiles; ++t) {
        uint32_t a[4];
        ldmatrix_x4(a, k_step + (t * kTokenTile + k_row) * C::kTileStride + 16 * j + k_col);
        mma_16816(sc[t], a[0], a[1], a[2], a[3], qf[j][0], qf[j][1]);
      }
    }
    float s[C::kStepTiles][4];
    // Value scale and zero of rows g (lo) and g + 8 (hi) of each tile
    float scale_lo[C::kStepTiles], zero_lo[C::kStepTiles], scale_hi[C::kStepTiles], zero_hi[C::kStepTiles];
#pragma unroll
    for (int t = 0; t < C::kStepTiles; ++t) {
      const int pos_lo = range.begin + step * C::kStepTokens + t * kTokenTile + g, pos_hi = pos_lo + 8;
      const RowScalars lo = row_scalars[t * kTokenTile + g], hi = row_scalars[t * kTokenTile + g + 8];
      s[t][0] = lo.valid != 0.0f && pos_lo < limit0 ? sc[t][0] * lo.norm : -INFINITY;
      s[t][1] = lo.valid != 0.0f && pos_lo < limit1 ? sc[t][1] * lo.norm : -INFINITY;
      s[t][2] = hi.valid != 0.0f && pos_hi < limit0 ? sc[t][2] * hi.norm : -INFINITY;
      s[t][3] = hi.valid != 0.0f && pos_hi < limit1 ? sc[t][3] * hi.norm : -INFINITY;
      scale_lo[t] = lo.scale;
      zero_lo[t] = lo.zero;
      scale_hi[t] = hi.scale;
      zero_hi[t] = hi.zero;
    }
    float pr[C::kStepTiles][4], alpha[2];
    online_softmax_tiles(s, m, l, acc, pr, alpha);  // decode_common.cuh
    float z0 = 0.0f, z1 = 0.0f;
    uint32_t pb[C::kStepTiles][2];
#pragma unroll
    for (int t = 0; t < C::kStepTiles; ++t) {
      z0 += pr[t][0] * zero_lo[t] + pr[t][2] * zero_hi[t];
      z1 += pr[t][1] * zero_lo[t] + pr[t][3] * zero_hi[t];
      pb[t][0] = movmatrix_trans(pack_half2(pr[t][0] * scale_lo[t], pr[t][1] * scale_lo[t]));
      pb[t][1] = movmatrix_trans(pack_half2(pr[t][2] * scale_hi[t], pr[t][3] * scale_hi[t]));
    }
    z[0] = z[0] * alpha[0] + z0;
    z[1] = z[1] * alpha[1] + z1;
    // O^T += V^T (P * scale)^T, the step's tiles one after another on each accumulator
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
#pragma unroll
      for (int t = 0; t < C::kStepTiles; ++t) {
        uint32_t a[4];
        ldmatrix_x4_trans(a, v_step + (t * kTokenTile + v_row) * C::kTileStride + 16 * i + v_col);
        mma_16816(acc[i], a[0], a[1], a[2], a[3], pb[t][0], pb[t][1]);
      }
    }
  }

  device::allow_dependent_grid_launch();  // the split merge may start its CTAs (decode_merge.cu)

  // ---- this warp's 8 columns: reduce l and z over the 8 lanes sharing c, then write
  sum_over_column_lanes(l);
  sum_over_column_lanes(z);
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int column = my_col0 + 2 * c + k;
    if (column >= num_columns) continue;
    const int64_t row = columns.row(column);
    const bool any = column_saw_tokens(l[k]);
    const float inv = any ? 1.0f / l[k] : 0.0f;
    const float* final_offset = any && p.value_offset != nullptr ? p.value_offset + kv_head * D : nullptr;
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // C rows g and g + 8 of block i
        const int dim = value_dim_of_position(16 * i + g + 8 * h);
        const float out = any ? (acc[i][2 * h + k] + z[k]) * inv : 0.0f;
        if (p.num_splits == 1) {
          static_cast<T*>(p.out)[row * D + dim] = from_float<T>(with_value_offset(out, final_offset, dim));
        } else {
          p.partial_out[(row * p.num_splits + split) * D + dim] = out;
        }
      }
    }
    if (p.num_splits > 1 && g == 0) {
      p.partial_lse[row * p.num_splits + split] = any ? m[k] + log2f(l[k]) : -INFINITY;
    }
  }
}

// Grid z: the varlen chunks of 64 / group query tokens.
int decode_chunked_query_chunks(const DecodeParams& p) {
  return varlen_query_chunks(p.query_rows, p.batch, chunked_tokens_per_cta(p.num_q_heads / p.cache.num_kv_heads));
}

struct LaunchChunked {
  const DecodeParams& p;
  cudaStream_t stream;
  template <typename T, int D, int kKeyBits, int kValueBits>
  cudaError_t run() const {
    if constexpr (D != 64 && D != 128) {
      return cudaErrorNotSupported;
    } else {
      using C = ChunkedConfig<D, kKeyBits == 8, kKeyBits, kValueBits>;
      const cudaError_t attr = opt_in_kernel<decode_chunked_kernel<C, T>>(kDecodeThreads, C::kSmemBytes).status;
      if (attr != cudaSuccess) return attr;
      const float q_multiplier = decode_query_multiplier<C>(p.scale);
      const dim3 grid(p.cache.num_kv_heads, p.num_splits, decode_chunked_query_chunks(p));
      decode_chunked_kernel<C, T><<<grid, kDecodeThreads, C::kSmemBytes, stream>>>(p, q_multiplier);
      const cudaError_t err = cudaGetLastError();
      if (err != cudaSuccess || p.num_splits == 1) return err;
      return launch_decode_merge(p, stream);
    }
  }
};

struct AsHalfOrBf16 {
  const LaunchChunked& launch;
  const SlotLayout& layout;
  template <typename T, int D, bool kFp8Key>
  cudaError_t run() const {
    return VisitPresetBits<LaunchChunked>{layout, launch}.template run<T, D, kFp8Key>();
  }
};

}  // namespace

bool decode_chunked_supports(const DecodeParams& p) {
  const int group = p.num_q_heads / p.cache.num_kv_heads;
  return p.query_start_loc != nullptr && group >= 1 && group <= 8 &&
         (p.layout.head_dim == 64 || p.layout.head_dim == 128) &&
         (p.dtype == ElementType::kHalf || p.dtype == ElementType::kBFloat16);
}

cudaError_t launch_decode_chunked(const DecodeParams& p, cudaStream_t stream) {
  if (!decode_chunked_supports(p)) return cudaErrorNotSupported;
  if (p.num_splits < 1 || p.num_splits > 256) return cudaErrorInvalidValue;
  if (decode_chunked_query_chunks(p) > 65535) return cudaErrorInvalidConfiguration;
  const LaunchChunked launch{p, stream};
  const AsHalfOrBf16 visit{launch, p.layout};
  switch (p.dtype) {
    case ElementType::kHalf: return dispatch_head_dim<__half>(p.layout, visit);
    case ElementType::kBFloat16: return dispatch_head_dim<__nv_bfloat16>(p.layout, visit);
    default: return cudaErrorNotSupported;
  }
}

}  // namespace turboquant
