// Split-KV decode attention directly on the packed paged cache.
//
// One CTA (8 warps) per (sequence, KV head, split) serves all query heads of the GQA group (up
// to 8; larger groups take several CTAs), so each packed byte is read from HBM once. Its 8 MMA
// columns are (query token, head) pairs (turboquant/query_chunks.h): one token per sequence in a
// plain decode, 8 / group tokens of a chunk for varlen queries, each with its causal limit. Per
// warp and 16-token tile:
//   * 16-byte cp.async copies bring the tile's 16 slots into a per-warp shared-memory ring of
//     kStages tiles: where the cache's strides are multiples of 16 (vLLM's layout with 8 KV heads
//     of 134-byte slots), each slot's 16-byte-aligned window, the warp's lanes walking the tile's
//     chunks row by row so one copy instruction touches a few rows (turboquant/staging_window.h:
//     aligned rows); elsewhere the 32-byte-aligned window around each 2-byte-aligned slot, two
//     lanes per token row, each pair's copies one L2 sector. Block ids are loaded 32 tiles
//     ahead, one per lane, so issuing a tile never waits on the block table; the consumer finds
//     each row in its window from one number per tile in a register (the tile's first slot
//     address mod 32; with aligned rows, one offset for every row of the CTA);
//   * the tile math of decode_tile.cuh: S^T = K~ Q^T and O^T += V^T (P*scale)^T on tensor cores
//     with fragments dequantized in registers (read in the interleaved order of
//     turboquant/fragment_order.h, with aligned loads, where the cache's strides give every slot
//     of the KV head the same offset mod 4), online softmax in the log2 domain; the query
//     columns are rotated once per CTA, each by its warp's FWHT in registers, while the first
//     tiles' copies are in flight (DecodeConfig::kQueryApart).
// Where the library chose the split count, each CTA row takes its share of the grid's splits by
// its own context (DecodeParams::split_waves, row_splits_in_grid); CTAs of splits with no tokens
// leave at once.
// Warps combine in shared memory; with several splits the two CTAs of a cluster (2 splits,
// merge_cluster_splits) or the merge kernel (decode_merge.cu) combine the per-split results by
// log-sum-exp. Measurements and what limits the kernel: benchmarks/RESULTS.md.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <type_traits>

#include "decode_common.cuh"
#include "decode_tile.cuh"
#include "device_utils.cuh"
#include "dispatch.cuh"
#include "launchers.h"
#include "turboquant/attention_options.h"
#include "turboquant/numeric.h"
#include "turboquant/split_plan.h"

namespace turboquant {
namespace {

constexpr int kWarps = kDecodeWarps;  // one pair table and one query rotation serve 8 warps
constexpr int kThreads = kDecodeThreads;
constexpr int kHeads = kDecodeColumns;  // query columns per CTA: the MMA N dimension

// Shared memory of the oldest architecture the build targets (TURBOQUANT_CUDA_MIN_ARCH, from
// CMake; one host-side size serves every architecture of a build): sm_90's 228 KB per SM and 227
// KB per CTA, else at most sm_86/89/120's 100 and 99 KB. The runtime reserves 1 KB per CTA.
#ifndef TURBOQUANT_CUDA_MIN_ARCH
#define TURBOQUANT_CUDA_MIN_ARCH 0
#endif
struct SmemBudget {
  static constexpr bool kSm90 = TURBOQUANT_CUDA_MIN_ARCH >= 90;
  static constexpr int kPerSm = (kSm90 ? 228 : 100) * 1024;
  static constexpr int kPerCta = (kSm90 ? 227 : 99) * 1024;
  // CTAs per SM that `bytes` of shared memory allow, at most `register_limit`.
  static constexpr int ctas_per_sm(int bytes, int register_limit) {
    return kPerSm / (bytes + 1024) < register_limit ? kPerSm / (bytes + 1024) : register_limit;
  }
  // Whether `extra` bytes on top of `bytes` keep the CTA within the limit and as many CTAs per SM.
  static constexpr bool fits_without_losing_a_cta(int bytes, int extra, int register_limit) {
    return bytes + extra <= kPerCta && ctas_per_sm(bytes + extra, register_limit) == ctas_per_sm(bytes, register_limit);
  }
};

// Resident decode CTAs per SM by registers: __launch_bounds__(kThreads, 2) caps a thread at 128,
// and every instantiation takes 103-128 (ptxas, sm_90), so three CTAs never fit.
constexpr int kDecodeCtasByRegisters = 2;

template <int D_, bool kFp8Key_, int KB_, int VB_>
struct DecodeConfig : StagedSlot<D_, kFp8Key_, KB_, VB_, 32> {
  // 32-byte windows: a lane pair's two 16-byte copies then lie in one 32-byte sector (from
  // 16-byte windows, half of them straddled two); 10-19 % faster at the bandwidth-bound shapes
  // (H200, bench_decode.py).
  using Slot = StagedSlot<D_, kFp8Key_, KB_, VB_, 32>;
  using Slot::D, Slot::kFp8Key, Slot::KB, Slot::VB, Slot::kLayout, Slot::kSlotBytes, Slot::kChunks, Slot::kRowBytes,
      Slot::kTileBytes, Slot::kWindowAlign;
  static constexpr int kStages = D > 128 ? 2 : 3;  // ring depth per warp (tiles in flight + 1)
  static constexpr int kKSteps = TileFragments<Slot>::kKSteps;
  static constexpr int kPairTableWords = TileFragments<Slot>::kPairTableWords;
  // Shared memory: staging ring (reused for the final warp merge, and for the query columns
  // where they have no area of their own: kQueryApart).
  static constexpr int kRingBytes = kWarps * kStages * kTileBytes + 16;
  static constexpr int kQueryBytes = kHeads * D * 4;
  static constexpr int kMergeBytes = kWarps * kHeads * (D + 3) * 4;
  // Beside the warps' partials: the CTA's results when its cluster merges the splits (outputs, then log-sum-exps).
  static constexpr int kSplitResultBytes = kHeads * (D + 1) * 4;
  static constexpr int kScratchBytes =
      cdiv(std::max(kRingBytes, std::max(kQueryBytes, kMergeBytes + kSplitResultBytes)), 16) * 16;
  // The query columns get their own area after the pair table where that costs no resident CTA
  // and stays within the per-CTA limit of every architecture built for (SmemBudget): the first
  // tiles' copies are then issued before the query set-up instead of after its two barriers.
  // Otherwise (on sm_90: D = 256 with 4-bit or FP8 keys; builds with an older architecture: D = 128
  // with 4-bit keys too) the query shares the ring's bytes and the copies wait.
  static constexpr int kSharedBytes = kScratchBytes + kPairTableWords * 4;
  static constexpr bool kQueryApart = SmemBudget::fits_without_losing_a_cta(kSharedBytes, kQueryBytes, kDecodeCtasByRegisters);
  static constexpr int kQueryOffset = kQueryApart ? kSharedBytes : 0;
  static constexpr int kSmemBytes = kSharedBytes + (kQueryApart ? kQueryBytes : 0);
};

// The slot offset mod 4 the tile loop of C is instantiated for: `misalign` where the tile math
// reads that offset's interleaved order (turboquant/fragment_order.h: 4-bit keys, FP8 keys at 0,
// 4-bit values) and, for 2, slots of C can start there in a contiguous cache (a slot size that is
// not a multiple of 4); else kUnknownMisalign (the contiguous order, which serves any offset).
template <class C>
constexpr int tile_order_misalign(int misalign) {
  const bool occurs = misalign == 0 || (misalign == 2 && C::kSlotBytes % 4 != 0);
  const bool interleaved = keys_interleaved(C::KB, misalign, C::D) || values_interleaved(C::VB, misalign, C::D);
  return occurs && interleaved ? misalign : kUnknownMisalign;
}

// How a CTA's pipeline stages and reads its slots (both CTA-uniform, from the cache's strides):
// at offset kMisalign mod 4 (tile_order_misalign), and by aligned rows (issue_aligned_tile) or
// 32-byte windows per row (issue_tile).
template <int kMisalign_, bool kAlignedRows_>
struct SlotStaging {
  static constexpr int kMisalign = kMisalign_;
  static constexpr bool kAlignedRows = kAlignedRows_;
};

template <class C, typename T>
__global__ void __launch_bounds__(kThreads, kDecodeCtasByRegisters)
    decode_kernel(const DecodeParams p, const float q_multiplier, const float softcap_log2, const int head_chunks,
                  const bool cluster_splits) {
  using namespace device;
  constexpr int D = C::D;
  extern __shared__ __align__(16) uint8_t smem[];
  uint8_t* scratch = smem;
  uint32_t* pair_table = reinterpret_cast<uint32_t*>(smem + C::kScratchBytes);

  const int tid = static_cast<int>(threadIdx.x);
  const int lane = opaque<int>(tid & 31), warp = opaque<int>(tid >> 5);  // in registers (see decode_rows.cu)
  const int g = lane >> 2, c = lane & 3;  // MMA fragment coordinates
  const int kv_head = blockIdx.x / head_chunks;
  const int head_chunk = blockIdx.x % head_chunks;
  const int split = blockIdx.z;
  const int group = p.num_q_heads / p.cache.num_kv_heads;
  const int head0 = kv_head * group + head_chunk * kHeads;
  const int num_heads = min(kHeads, group - head_chunk * kHeads);  // heads of each query token
  // The query rows of this CTA: column j is head j % num_heads of row row0 + j / num_heads.
  const QueryChunk chunk =
      p.query_start_loc == nullptr
          ? QueryChunk{static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.y), 1, 0, 1}
          : locate_query_chunk(p.query_start_loc, p.batch, p.query_rows, varlen_tokens_per_cta(group), blockIdx.y);
  if (chunk.tokens == 0) return;  // CTA-uniform: a chunk index past its sequence's queries
  const int b = chunk.seq;
  const int block_size = p.cache.block_size;
  const int max_context = p.max_blocks_per_seq * block_size;
  // Set-up: this warp's query column, the sequence length and then the first block ids are all
  // loaded before the query is used. Where the query has its own shared memory (kQueryApart) the
  // first tiles' copies are issued as soon as the block ids arrive, and the warp FWHT, the pair
  // table and the barrier run while they land. Measured at short contexts (H200,
  // bench_decode.py --shapes short): -0.3..+0.3 us per step in one-call graphs, -0.1..+1.0 us (mostly
  // 0.2-0.9 faster) with 16 steps per graph.
  QueryColumns columns{chunk, num_heads, head0, 0, p.num_q_heads};  // seq_len: set once loaded
  PreloadedQuery<D, kHeads, kThreads, T> query;
  query.load(static_cast<const T*>(p.query), columns, p.key_scale, group);
  const int raw_seq_len = p.seq_lens[b];
  columns.seq_len = min(max(raw_seq_len, 0), max_context);
  const int num_columns = columns.count();
  auto limit = [&](int j) { return columns.limit(j, column_token(j, num_heads)); };
  auto out_row = [&](int h) { return columns.row(h, column_token(h, num_heads)); };  // column h's row of out
  // The KV head's value_offset, added where the final output is written (null: none).
  const float* const value_offset = p.value_offset != nullptr ? p.value_offset + kv_head * D : nullptr;
  // The splits this row takes: where the library chose the count and the context is shorter than
  // split_waves.full_context, as many as row_splits_in_grid gives its context (at most the grid's;
  // the rest find no tokens), else all of them. The grid's range first, unconditionally, and the rule
  // only below full_context: the rule costs three dependent integer divisions between seq_len's
  // load and the block ids' (applied to every row it measured about 0.3 us slower per short step,
  // H200, bench_serving.py), while the grid's count is known at launch, so the compiler
  // computes its reciprocal while seq_len is in flight (SASS, sm_90).
  // With a window the row reads from the first tile of its first column's window on (the split plan
  // was made for windowed_context tokens), so its cost tracks the window, not the context.
  const int context = limit(num_columns - 1);
  const int read_begin = p.window == INT_MAX ? 0 : window_first_tile_token(limit(0), p.window);
  const int span = context - read_begin;
  TokenRange range = split_token_range(span, p.num_splits, split);
  if (span < p.split_waves.full_context) {
    range = split_token_range(span, row_splits_in_grid(p.split_waves, span, p.num_splits), split);
  }
  range.begin += read_begin;  // tile-aligned: a tile never straddles a block
  range.end += read_begin;
  if (range.begin >= range.end && p.num_splits > 1 && !cluster_splits) {
    // No tokens for this split (a short sequence, or one split of many past its length): the merge
    // weighs a -inf log-sum-exp 0 and ignores the partial vector (unwritten), so nothing else is needed.
    if (tid < num_columns) {
      p.partial_lse[out_row(tid) * p.num_splits + split] = -INFINITY;
    }
    return;
  }

  // ---- per-warp pipeline over 16-token tiles (tile k belongs to warp k % kWarps)
  const int num_tiles = range.end > range.begin ? cdiv(range.end - range.begin, kTokenTile) : 0;
  const int my_tiles = warp < num_tiles ? cdiv(num_tiles - warp, kWarps) : 0;
  uint8_t* ring = scratch + warp * C::kStages * C::kTileBytes;
  const int64_t head_offset = static_cast<int64_t>(kv_head) * p.cache.stride_head;
  const int32_t* block_row = p.block_table + static_cast<int64_t>(b) * p.max_blocks_per_seq;
  const int block_shift = __ffs(block_size) - 1;  // block sizes are powers of two (host-checked)
  // This lane's replica of the pair table: its byte offset in a pair's row, the table's address a
  // uniform base the loads add (pair_entry). 4-bit keys fold the address into the lane's offset
  // instead (the lookup is a PRMT and an add either way): a separate base cost the per-head kernel a
  // register, and a 4-byte spill at D = 128 (ptxas, nvcc 13.0).
  const uint32_t table_base = C::KB == 4 ? 0u : smem_address(pair_table);
  const uint32_t table_lane_bytes = device::pair_table_lane_bytes(lane, C::KB == 4 ? smem_address(pair_table) : 0u);

  // Every slot of this CTA's KV head sits at the same offset mod 4 where the block and token strides
  // are multiples of 4 (vLLM's layout at an even KV head count, or slot sizes that are): the tile
  // math then reads keys and values in the interleaved order of turboquant/fragment_order.h with
  // aligned shared-memory loads instead of funnel-shifting every word of six rows per tile. Other
  // layouts (and presets the order does not cover) take the contiguous order, for any offset.
  const int slot_misalign =
      tile_order_misalign<C>(head_slot_misalign(p.cache.stride_block, p.cache.stride_token, head_offset));
  // ... and where the strides are multiples of 16, at one offset in their 16-byte windows: the
  // aligned-row staging (issue_aligned_tile). -1 elsewhere, and for token strides whose 16 rows'
  // offsets would pass 32 bits (a view with the token dimension outside the blocks').
  const int offset16 = p.cache.stride_token <= INT_MAX / kTokenTile
                           ? head_slot_offset(p.cache.stride_block, p.cache.stride_token, head_offset, 16)
                           : -1;

  // Tile addresses, 32 tiles per window: lane i holds the byte offset of row 0 of local tile
  // 32 * window + i (its block's base plus the tile's offset in the block and the KV head's),
  // or -1 for a block id outside the cache. The block ids of the next window are loaded when the
  // current one starts, so their latency hides behind 32 tiles, and each tile then costs two
  // shuffles and an add instead of 64-bit index math.
  auto tile_start = [&](int local_tile) { return range.begin + (warp + local_tile * kWarps) * kTokenTile; };
  auto load_block_id = [&](int window) -> int {
    const int local = window * 32 + lane;
    return local < my_tiles ? block_row[tile_start(local) >> block_shift] : -1;
  };
  auto tile_base = [&](int window, int block) -> int64_t {
    const int t0 = tile_start(window * 32 + lane);
    return block >= 0 && block < p.cache.num_blocks
               ? block * p.cache.stride_block + (t0 & (block_size - 1)) * p.cache.stride_token + head_offset
               : int64_t(-1);
  };
  const int first_block_id = load_block_id(0);  // in flight during the query's FWHT unless kQueryApart
  int next_block_id = load_block_id(1);

  // The query columns in shared memory (fp32, rotated for Lloyd-Max keys), staged by the pipeline.
  float* qs = reinterpret_cast<float*>(smem + C::kQueryOffset);  // [kHeads][D]
  // This thread's score columns' limits: only the tile loop needs them.
  const int limit0 = limit(2 * c), limit1 = limit(2 * c + 1);
  int64_t tile_bases = -1;  // set by the pipeline, after the query set-up where that comes first

  // Lanes r and r + 16 copy token row r of the tile: chunks (lane >> 4) + 2k of the 16-byte
  // chunks from the slot's start rounded down to 32 bytes to its end. Every lane commits one
  // cp.async group per tile (empty or not), so "all but the newest kStages - 1 groups" is always
  // "this tile and older". Returns the tile's code, the same in every lane: its row 0's address
  // mod 32, or masked_tile_code(slot misalign) for a block id outside the cache
  // (turboquant/staging_window.h).
  // The consumer derives each row's offset in its window from it: no per-row codes to gather,
  // and the code stays in a register until the tile is consumed, so no shared-memory load heads
  // the chain.
  const int r = lane & 15, half = lane >> 4;
  const int64_t row_offset = static_cast<int64_t>(r) * p.cache.stride_token;
  // Slots whose windows end inside the cache view copy without a per-chunk bound check.
  const int64_t all_chunks_limit = p.cache.span_bytes - 16 * C::kChunks;
  uint8_t* const ring_row = ring + r * C::kRowBytes + 16 * half;
  // Row 0's slot offset of a local tile, or -1 (a block id outside the cache); tiles are issued
  // in order, so the first tile of each window moves the block ids on.
  auto issued_tile_base = [&](int local_tile) -> int64_t {
    if ((local_tile & 31) == 0 && local_tile > 0) {  // warp-uniform: a new window of tiles
      const int window = local_tile >> 5;
      tile_bases = tile_base(window, next_block_id);
      next_block_id = load_block_id(window + 1);
    }
    return __shfl_sync(kFullMask, tile_bases, local_tile & 31);
  };
  auto issue_tile = [&](int local_tile, int dst_stage) -> int {
    const int64_t base = issued_tile_base(local_tile);
    const bool row_ok = base >= 0 && tile_start(local_tile) + r < range.end;  // a tile never straddles blocks
    const int64_t slot = base + row_offset;
    const int64_t first = window_start(slot, C::kWindowAlign);
    if (row_ok) {
      const uint8_t* src = p.cache.data + first + 16 * half;
      uint8_t* dst = ring_row + dst_stage * C::kTileBytes;
      // Chunks past the slot's end are skipped: the last one or two of the window, depending on
      // where in its 32 bytes the slot starts.
      const int offset = offset_in_window(slot, C::kWindowAlign);
      auto needed = [&](int chunk) { return window_chunk_needed(chunk, offset, C::kSlotBytes); };
      if (first <= all_chunks_limit) {
#pragma unroll
        for (int k = 0; k < cdiv(C::kChunks, 2); ++k) {
          const int chunk = half + 2 * k;
          if (chunk < C::kChunks && needed(chunk)) cp_async_16(dst + 32 * k, src + 32 * k);
        }
      } else {
        // The host guarantees span_bytes is a multiple of 16: a chunk is wholly inside or out.
        const int chunks = static_cast<int>((p.cache.span_bytes - first) >> 4);
#pragma unroll
        for (int k = 0; k < cdiv(C::kChunks, 2); ++k) {
          const int chunk = half + 2 * k;
          if (chunk < chunks && needed(chunk)) cp_async_16(dst + 32 * k, src + 32 * k);
        }
      }
    }
    cp_async_commit();
    return tile_window_code(base, C::kWindowAlign, slot_misalign);
  };
  // Aligned-row staging (turboquant/staging_window.h), where every slot of the head sits offset16
  // bytes into its 16-byte window: this lane's copies take the same (row, chunk) in every tile, so
  // only the tile's base and its rows with tokens vary. Same group and code rules as issue_tile;
  // the consumer reads every row at offset16 and looks only at the code's sign.
  // 32-bit row offsets: a copy's row is below 16 and offset16 >= 0 only for token strides up to
  // INT_MAX / 16; the tile's base stays 64-bit (caches past 2 GiB).
  const int stride_token32 = static_cast<int>(p.cache.stride_token);
  auto issue_aligned_tile = [&](int local_tile, int dst_stage) -> int {
    const int64_t base = issued_tile_base(local_tile);
    if (base >= 0) {
      const uint8_t* src = p.cache.data + (base - offset16);
      uint8_t* dst = ring + dst_stage * C::kTileBytes;
      const int rows = range.end - tile_start(local_tile);  // the range's rows in this tile (the rest not copied)
#pragma unroll
      for (int i = 0; i < aligned_tile_copies(C::kSlotBytes); ++i) {
        const RowChunk copy = aligned_tile_copy(i, lane, C::kSlotBytes);
        if (copy.row < kTokenTile && copy.row < rows && aligned_chunk_needed(copy.chunk, offset16, C::kSlotBytes)) {
          cp_async_16(dst + aligned_copy_dest(copy, C::kRowBytes), src + aligned_copy_source(copy, stride_token32));
        }
      }
    }
    cp_async_commit();
    return base >= 0 ? offset16 : kMaskedTileCode;
  };

  device::TileAttention<C::kKSteps> st;  // running softmax statistics and O^T fragments
  // The query fragments, the first tiles' copies and the tile loop for slots at kMisalign mod 4,
  // staged by issue_aligned_tile where kAlignedRows, else by issue_tile.
  auto pipeline = [&](auto staging) {
    constexpr int kMisalign = decltype(staging)::kMisalign;
    constexpr bool kAlignedRows = decltype(staging)::kAlignedRows;
    auto issue = [&](int local_tile, int dst_stage) {
      if constexpr (kAlignedRows) return issue_aligned_tile(local_tile, dst_stage);
      else return issue_tile(local_tile, dst_stage);
    };
    // The query columns -> shared memory (fp32, times key_scale, rotated for Lloyd-Max keys), the
    // pair table, then B fragments of Q^T in the key order of kMisalign (decode_tile.cuh): before
    // the first tiles are issued where the query shares the ring's bytes, after it where it has its
    // own area (kQueryApart).
    uint32_t qf[C::kKSteps][2];
    auto stage_query = [&] {
      query.template stage<!C::kFp8Key, C::KB, 32>(qs, pair_table, columns, p.codebook);
      device::query_fragments<D, C::KB, kMisalign>(qs, g, c, q_multiplier, qf);
      if constexpr (!C::kQueryApart) __syncthreads();  // the ring reuses qs
    };
    if constexpr (!C::kQueryApart) stage_query();
    tile_bases = tile_base(0, first_block_id);

    // Codes of the tiles in flight, oldest first (register FIFO: indices fold to constants).
    int codes[C::kStages - 1];
#pragma unroll
    for (int s = 0; s < C::kStages - 1; ++s) {
      if (s < my_tiles) {
        codes[s] = issue(s, s);
      } else {
        cp_async_commit();
        codes[s] = kMaskedTileCode;
      }
    }
    if constexpr (C::kQueryApart) stage_query();  // the first tiles' copies are in flight meanwhile
    const int stride_mod = static_cast<int>(p.cache.stride_token & (C::kWindowAlign - 1));
    int stage = 0, next_stage = C::kStages - 1;  // ring slots of tiles it and it + kStages - 1
    for (int it = 0; it < my_tiles; ++it) {
      const int next = it + C::kStages - 1;
      const int tile_code = codes[0];
      int next_codes = kMaskedTileCode;
      if (next < my_tiles) next_codes = issue(next, next_stage);
      else cp_async_commit();
#pragma unroll
      for (int s = 0; s + 1 < C::kStages - 1; ++s) codes[s] = codes[s + 1];
      codes[C::kStages - 2] = next_codes;
      next_stage = next_stage == C::kStages - 1 ? 0 : next_stage + 1;
      cp_async_wait<C::kStages - 1>();  // this lane's copies of tile `it` have landed
      __syncwarp();  // ... and every lane's

      const uint8_t* rows = ring + stage * C::kTileBytes;
      auto slot_ptr = [&](int r) {
        if constexpr (kAlignedRows) return rows + aligned_slot_offset(r, C::kRowBytes, offset16);
        else return rows + r * C::kRowBytes + row_offset_in_window(tile_code, r, stride_mod, C::kWindowAlign);
      };
      const int pos_lo = tile_start(it) + g;
      const bool tile_ok = tile_code >= 0;
      device::attend_tile<C, kMisalign>(lane, slot_ptr, pos_lo, tile_ok && pos_lo < range.end,
                                        tile_ok && pos_lo + 8 < range.end, limit0, limit1, table_lane_bytes,
                                        table_base, qf, st, p.window, softcap_log2);
      // The next iteration refills this stage: every lane's reads of it are done before that.
      __syncwarp();
      stage = stage == C::kStages - 1 ? 0 : stage + 1;
    }
  };
  // CTA-uniform; slot_misalign is 0 or 2 only where that order is instantiated. Aligned rows at an
  // unknown offset mod 4 only for configurations without an interleaved order: with one, a cache of
  // 16-byte strides knows the offset, unless it is one the configuration does not instantiate (an
  // FP8-key slot at 2, from an odd head stride), and that rare layout is staged per row.
  auto run_pipeline = [&](auto misalign) {
    constexpr int kMisalign = decltype(misalign)::value;
    if constexpr (kMisalign >= 0 || tile_order_misalign<C>(0) == kUnknownMisalign) {
      if (offset16 >= 0) {
        pipeline(SlotStaging<kMisalign, true>{});
        return;
      }
    }
    pipeline(SlotStaging<kMisalign, false>{});
  };
  if (slot_misalign == 0) {
    if constexpr (tile_order_misalign<C>(0) == 0) run_pipeline(std::integral_constant<int, 0>{});
  } else if (slot_misalign == 2) {
    if constexpr (tile_order_misalign<C>(2) == 2) run_pipeline(std::integral_constant<int, 2>{});
  } else {
    run_pipeline(std::integral_constant<int, kUnknownMisalign>{});
  }

  device::allow_dependent_grid_launch();  // the split merge may start its CTAs (decode_merge.cu)

  // ---- combine the warps
  sum_over_column_lanes(st.l);
  sum_over_column_lanes(st.z);
  __syncthreads();  // every warp is done with the ring
  float* merge = reinterpret_cast<float*>(scratch);  // [kWarps][kHeads][D + 3]: acc, m, l, z
  constexpr int kRow = D + 3;
  float* mine = merge + warp * kHeads * kRow;
  float* split_outs = merge + kWarps * kHeads * kRow;  // [kHeads][D], then split_lses [kHeads]: cluster_splits only
  float* split_lses = split_outs + kHeads * D;
#pragma unroll
  for (int i = 0; i < C::kKSteps; ++i) {
    const int d = 2 * value_pair(g, i, D, C::VB, value_misalign(slot_misalign, C::kLayout.value_data_offset));
    mine[(2 * c) * kRow + d] = st.acc[i][0];
    mine[(2 * c + 1) * kRow + d] = st.acc[i][1];
    mine[(2 * c) * kRow + d + 1] = st.acc[i][2];
    mine[(2 * c + 1) * kRow + d + 1] = st.acc[i][3];
  }
  if (g == 0) {
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      mine[(2 * c + k) * kRow + D] = st.m[k];
      mine[(2 * c + k) * kRow + D + 1] = st.l[k];
      mine[(2 * c + k) * kRow + D + 2] = st.z[k];
    }
  }
  __syncthreads();
  // Warp w combines column w (and w + kWarps, ...; a decode at GQA 4 has 4): the warps' weights
  // once per column, then D / 32 dims per lane. (One element per thread and iteration recomputed
  // the 8 weights and divided for every element: two 226-instruction iterations per thread at GQA 4,
  // SASS, sm_90.)
  for (int h = warp; h < num_columns; h += kWarps) {
    const float* col = merge + h * kRow;  // warp w's partials of the column at col + w * kWarpStride
    constexpr int kWarpStride = kHeads * kRow;
    // The head's attention sink (log2 domain) joins the denominator once, in split 0: its
    // log-sum-exp then carries the sink's mass into whichever merge follows, exactly.
    const int token = column_token(h, num_heads);
    const float sink = p.sinks != nullptr && split == 0 ? p.sinks[head0 + h - token * num_heads] * kLog2e : -INFINITY;
    float mx = sink;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, col[w * kWarpStride + D]);
    // The combined softmax sum den decides, as in the tile loop (column_saw_tokens): a warp that
    // saw no token weighs 0 with l = 0; one whose only scores were NaN has m = -inf too, but its
    // NaN l and acc reach den and num through the zero weight (0 x NaN), also where every warp's m
    // is -inf (the base is then 0, as in online_softmax_tiles).
    const float base = mx == -INFINITY ? 0.0f : mx;
    float wt[kWarps], zero[kWarps], den = exp2f(sink - base);  // 0 without a sink
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      wt[w] = exp2f(col[w * kWarpStride + D] - base);
      den += wt[w] * col[w * kWarpStride + D + 1];
      zero[w] = col[w * kWarpStride + D + 2];
    }
    const bool any = column_saw_tokens(den);
    const float inv_den = 1.0f / den;  // one division per column (a NaN den makes every output NaN)
    const float lse = any ? base + log2f(den) : -INFINITY;
    const int64_t row = columns.row(h, token);
    const float* final_offset = any ? value_offset : nullptr;  // for the one-split output
#pragma unroll
    for (int e = 0; e < D / 32; ++e) {
      const int d = lane + 32 * e;
      float num = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) num += wt[w] * (col[w * kWarpStride + d] + zero[w]);
      const float out = any ? num * inv_den : 0.0f;
      if (cluster_splits) {
        split_outs[h * D + d] = out;
      } else if (p.num_splits == 1) {
        static_cast<T*>(p.out)[row * D + d] = from_float<T>(with_value_offset(out, final_offset, d));
      } else {
        p.partial_out[(row * p.num_splits + split) * D + d] = out;
      }
    }
    if (lane == 0 && cluster_splits) split_lses[h] = lse;
    if (!cluster_splits && p.num_splits != 1) {
      const float shift = p.key_offset != nullptr && any  // warp-uniform
                              ? key_offset_lse_shift(static_cast<const T*>(p.query) + row * D,
                                                     p.key_offset + kv_head * D, D, p.scale, lane)
                              : 0.0f;
      if (lane == 0) p.partial_lse[row * p.num_splits + split] = lse + shift;
    }
  }
  if (cluster_splits) {  // CTA-uniform, and the same in every CTA of the cluster
    merge_cluster_splits<D, kThreads>(split_outs, split_lses, num_columns, [&](int h, int d, float v, bool attended) {
      const float* offset = attended ? value_offset : nullptr;
      static_cast<T*>(p.out)[out_row(h) * D + d] = from_float<T>(with_value_offset(v, offset, d));
    });
  }
}

// Once per instantiation and device: the shared memory opt-in and the resident CTAs.
template <class C, typename T>
KernelResidency prepare_decode_kernel() {
  return opt_in_kernel<decode_kernel<C, T>>(kThreads, C::kSmemBytes);
}

// Whether the per-head kernel may merge kClusterSplits splits inside a cluster rather than with
// the merge kernel: yes unless TURBOQUANT_SPLIT_MERGE=kernel (tests and A/B runs in one build;
// read once per process; =cluster is the default, still only where cluster_launch_fits).
static bool merge_splits_in_cluster() {
  static const int forced = env_kernel_choice("TURBOQUANT_SPLIT_MERGE", "cluster", "kernel");
  return forced != 2;
}

// Whether the per-head kernel of configuration C merges p's splits inside clusters: the launcher
// and the workspace query (decode_uses_split_workspace) ask this one question.
template <class C, typename T>
bool merges_in_cluster(const DecodeParams& p) {
  return p.num_splits == kClusterSplits && merge_splits_in_cluster() &&
         prepare_decode_kernel<C, T>().status == cudaSuccess &&
         cluster_launch_fits<decode_kernel<C, T>, kClusterSplits>(kThreads, C::kSmemBytes);
}

struct LaunchDecode {
  const DecodeParams& p;
  cudaStream_t stream;
  template <class C, typename T>
  cudaError_t run() const {
    cudaError_t err = prepare_decode_kernel<C, T>().status;
    if (err != cudaSuccess) return err;
    const int head_chunks = decode_head_chunks(p);
    const float q_multiplier = decode_query_multiplier<C>(p.scale);
    const float softcap_log2 = p.softcap * kLog2e;  // the kernel's scores are log2(e) x the logits
    // Splits vary slowest: where rows take fewer splits than the grid (DecodeParams::split_waves),
    // the CTAs with tokens come first in launch order and so spread over the SMs (splits in y put
    // batch 2's busy CTAs beside batch 1's, two per SM: B = 2..8 at L = 256 with 32k-token block
    // tables took 13.3-14.1 us against B = 1's 10.0, H200, bench_serving.py), though not one per SM
    // each: the block scheduler doubles some up before every SM has one (row_splits_in_grid).
    const dim3 grid(p.cache.num_kv_heads * head_chunks, decode_query_chunks(p), p.num_splits);
    if (merges_in_cluster<C, T>(p)) {
      // The splits of each (query chunk, head group) as one cluster, merged in it: no merge launch.
      cudaLaunchConfig_t config = {};
      config.gridDim = grid;
      config.blockDim = dim3(kThreads);
      config.dynamicSmemBytes = C::kSmemBytes;
      config.stream = stream;
      cudaLaunchAttribute cluster = cluster_z_attribute(p.num_splits);
      config.attrs = &cluster;
      config.numAttrs = 1;
      return cudaLaunchKernelEx(&config, decode_kernel<C, T>, p, q_multiplier, softcap_log2, head_chunks, true);
    }
    decode_kernel<C, T><<<grid, kThreads, C::kSmemBytes, stream>>>(p, q_multiplier, softcap_log2, head_chunks,
                                                                   false);
    err = cudaGetLastError();
    if (err != cudaSuccess || p.num_splits == 1) return err;
    return launch_decode_merge(p, stream);
  }
};

struct MergesInCluster {
  const DecodeParams& p;
  bool* merges;
  template <class C, typename T>
  cudaError_t run() const {
    *merges = merges_in_cluster<C, T>(p);
    return cudaSuccess;
  }
};

// How many CTAs of this configuration fit on one multiprocessor at once (registers, shared memory).
struct ResidentCtas {
  int* per_sm;
  template <class C, typename T>
  cudaError_t run() const {
    const int n = prepare_decode_kernel<C, T>().per_sm;
    *per_sm = n > 0 ? n : 1;
    return cudaSuccess;
  }
};

// Adapts VisitPresetBits (dispatch.cuh) to the decode visitors: visit.run<DecodeConfig<...>, T>().
template <class Visit>
struct AsDecodeConfig {
  const Visit& visit;
  template <typename T, int D, int kKeyBits, int kValueBits>
  cudaError_t run() const {
    return visit.template run<DecodeConfig<D, kKeyBits == 8, kKeyBits, kValueBits>, T>();
  }
};

// Calls visit.run<C, T>() with the kernel configuration of p (preset, head_dim, query type).
template <class Visit>
cudaError_t visit_decode_config(const DecodeParams& p, const Visit& visit) {
  if (!cuda_supports_head_dim(p.layout)) return cudaErrorInvalidValue;
  const AsDecodeConfig<Visit> as_config{visit};
  const VisitPresetBits<AsDecodeConfig<Visit>> preset{p.layout, as_config};
  switch (p.dtype) {
    case ElementType::kHalf: return dispatch_head_dim<__half>(p.layout, preset);
    case ElementType::kBFloat16: return dispatch_head_dim<__nv_bfloat16>(p.layout, preset);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

// The per-head kernel's answers to the planner (decode_plan.cu).
int decode_head_chunks(const DecodeParams& p) {
  return cdiv(p.num_q_heads / p.cache.num_kv_heads, kHeads);
}

// Grid y: one CTA row per sequence (plain decode) or per chunk of query tokens (varlen).
int decode_query_chunks(const DecodeParams& p) {
  if (p.query_start_loc == nullptr) return p.batch;
  return varlen_query_chunks(p.query_rows, p.batch, varlen_tokens_per_cta(p.num_q_heads / p.cache.num_kv_heads));
}

int decode_heads_resident_ctas(const DecodeParams& p) {
  int per_sm = 1;
  visit_decode_config(p, ResidentCtas{&per_sm});
  return per_sm;
}

bool decode_heads_merge_in_cluster(const DecodeParams& p) {
  bool merges = false;
  visit_decode_config(p, MergesInCluster{p, &merges});
  return merges;
}

cudaError_t launch_decode_heads(const DecodeParams& p, cudaStream_t stream) {
  return visit_decode_config(p, LaunchDecode{p, stream});
}

}  // namespace turboquant
