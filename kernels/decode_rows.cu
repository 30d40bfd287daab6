// Row-staged decode: one CTA per (sequence, 8 consecutive KV heads, split), one warp per KV head;
// for Lloyd-Max keys one CTA of 16 warps per (sequence, 8 KV heads, two splits), a half per split
// sharing the pair table and the staged queries (RowConfig).
//
// The per-head decode (decode.cu) stages each KV head's 2-byte-aligned slots through 32-byte
// windows with 16-byte cp.async copies: the L2 sees every slot rounded out to whole sectors, the
// sectors at head boundaries twice (41 sectors per 8-head token row of 134-byte slots instead of
// 34), and every lane spends address arithmetic and several copy instructions per tile. In a
// token-major cache the 8 slots of one token and 8 consecutive KV heads are one contiguous run of
// 8 x slot bytes, a multiple of 16: here warp 0 copies a whole 16-token tile of those runs with
// bulk copies (the TMA unit; one per tile when the runs are adjacent, else one per token) into a
// CTA-wide ring, completing on an mbarrier per stage; each warp then runs the tile math of
// decode_tile.cuh on its head's slot of each row and frees the stage on a second mbarrier. A warp
// sees every tile of its split, so it holds its head's whole result at the end: no merge across
// warps. Selected for plain decodes of token-major caches whose KV heads come in 8s, GQA groups
// up to 8 and head dims 64 and 128, on sm_90 builds, where its grid can fill half the SMs
// (decode_rows_supports); TURBOQUANT_DECODE_KERNEL = heads | rows forces a kernel (comparisons in
// one build). Measured against the per-head kernel (H200, bench_decode.py; docs/DESIGN.md): 25-40 %
// faster at the bandwidth-bound shapes (k8v4 at 85-88 % of copy bandwidth).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "decode_common.cuh"
#include "decode_tile.cuh"
#include "device_utils.cuh"
#include "dispatch.cuh"
#include "launchers.h"
#include "turboquant/numeric.h"
#include "turboquant/split_plan.h"

namespace turboquant {
namespace {

template <int D_, bool kFp8Key_, int KB_, int VB_>
struct RowConfig : PackedSlot<D_, kFp8Key_, KB_, VB_> {
  using Slot = PackedSlot<D_, kFp8Key_, KB_, VB_>;
  using Slot::D, Slot::kFp8Key, Slot::KB, Slot::VB, Slot::kLayout, Slot::kSlotBytes;
  static constexpr int kRowBytes = kRowHeads * kSlotBytes;  // slots are even: a multiple of 16
  static constexpr int kTileBytes = kTokenTile * kRowBytes;
  // 4-bit keys: the pair table at 64 words per pair, so a lookup's address is one PRMT
  // (pair_entry): 32 instructions fewer per tile, for 64 KB of table instead of 32. Two CTAs of
  // 8 warps would then leave room for 2 ring stages only (3 need 2 x (117,168 + 1,024 reserved)
  // bytes, past the SM's 233,472), so one CTA of 16 warps per SM serves two splits of the same
  // (sequence, 8 KV heads), a half of 8 warps each: the halves share the table and the staged
  // queries, and each has its own 4-stage ring (203,008 bytes at D = 128).
  // 3-bit keys, whose 32-word table would let two CTAs of 8 warps share an SM, are served the same
  // way: in a grid sized for two CTAs per SM the block scheduler puts some of the first CTAs in
  // launch order, the ones with tokens when a serving engine's long block tables hold short rows,
  // two to an SM (tools/probes/cta_placement_probe.cu), and one CTA per SM rules that out. The halves also share
  // the set-up, and the merge reads one partial per CTA instead of two. Measured (H200, bench_serving.py,
  // 3bit_nc, 32k-token tables, one build with and without): B = 3 and 8 at 256 tokens 0.9-2.6 us
  // per step faster (B = 3: 14.5-15.9 -> 13.6), 1k 0.1-2.1, 16k-32k 0.1-2.7 (0.3-3.3 %; B = 8
  // L = 32k 106.4-106.9 -> 103.7-104.4), 4k equal within 0.3.
  static constexpr int kPairStrideWords = !kFp8Key && KB == 4 ? 64 : 32;
  static constexpr int kSplitsPerCta = kFp8Key ? 1 : 2;
  static_assert(kPairStrideWords == 32 || kSplitsPerCta == 2, "a 64-word pair table fits one CTA per SM");
  static constexpr int kWarps = kSplitsPerCta * kRowHeads;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kCtasPerSm = 2 / kSplitsPerCta;  // the launch bound: 128 registers per thread
  // Per half: tiles in flight + the one being read. Four (H200, A/B against three in
  // alternating processes): 3-bit halves 0.5-1.0 us per step faster at B = 8, 1k-4k tokens in 32k-token
  // tables, 4-bit halves 0.5-1 % at the bandwidth-bound shapes; neither slower beyond a round's
  // spread. The stages below the staged queries also start before the query staging (early_tiles).
  static constexpr int kStages = 4;
  static constexpr int kKSteps = TileFragments<Slot>::kKSteps;
  static constexpr int kColumns = kRowHeads * kDecodeColumns;  // query columns staged per CTA
  // Shared memory: [ring: one per half (+16: the tile math reads a word past a slot) | query
  // columns, aliased by the rings | the results on the way out and their log-sum-exps (at
  // kOutBytes), aliased too] [pair table] [full and empty barriers, per half].
  static constexpr int kHalfRingBytes = kStages * kTileBytes;
  static constexpr int kRingBytes = kSplitsPerCta * kHalfRingBytes + 16;
  static constexpr int kQueryBytes = kColumns * D * 4;
  static constexpr int kOutBytes = kWarps * kDecodeColumns * D * 4;
  static constexpr int kScratchBytes = cdiv(std::max(kRingBytes, std::max(kQueryBytes, kOutBytes)), 128) * 128;
  // The query columns sit at the scratch region's end, so the stages below them can take their
  // tiles while the queries are staged: tiles 0 .. early_tiles(half) - 1 are issued before it.
  static constexpr int kQueryOffset = kScratchBytes - kQueryBytes;
  static constexpr int early_tiles(int half) {
    const int below = kQueryOffset - half * kHalfRingBytes;  // bytes of the half's ring below qs
    const int tiles = below > 0 ? below / kTileBytes : 0;
    return tiles < kStages - 1 ? tiles : kStages - 1;
  }
  static constexpr int kPairTableWords = TileFragments<Slot>::kPairs * kPairStrideWords;
  static constexpr int kBarrierOffset = kScratchBytes + kPairTableWords * 4;
  static constexpr int kSmemBytes = kBarrierOffset + kSplitsPerCta * 2 * kStages * 8;
  static_assert(kSmemBytes <= 227 * 1024, "past sm_90's opt-in shared memory per CTA");
  static_assert(kRowBytes % 16 == 0, "bulk copies move multiples of 16 bytes");
  static_assert(D <= 128 && D % 64 == 0, "head dims of the row-staged kernel");
};

template <class C, typename T>
__global__ void __launch_bounds__(C::kThreads, C::kCtasPerSm) decode_rows_kernel(const DecodeParams p,
                                                                                  const float q_multiplier,
                                                                                  const bool adjacent_rows) {
  using namespace device;
  constexpr int D = C::D;
  extern __shared__ __align__(128) uint8_t smem[];
  uint32_t* const pair_table = reinterpret_cast<uint32_t*>(smem + C::kScratchBytes);

  // Lane indices in registers (opaque): derived from the thread index they are recomputed per tile.
  const int lane = opaque<int>(threadIdx.x & 31), warp_of_cta = opaque<int>(threadIdx.x >> 5);
  const int g = opaque(lane >> 2), c = opaque(lane & 3);
  // The CTA's half (its split) and the warp's KV head within the CTA's 8: `warp` below.
  const int half = warp_of_cta / kRowHeads, warp = warp_of_cta % kRowHeads;
  uint8_t* const ring = smem + half * C::kHalfRingBytes;  // this half's ring
  uint64_t* const full = reinterpret_cast<uint64_t*>(smem + C::kBarrierOffset) + half * 2 * C::kStages;  // a stage's bytes landed
  uint64_t* const empty = full + C::kStages;  // every warp of the half is done with it
  const int head_group = blockIdx.x, split = blockIdx.y * C::kSplitsPerCta + half, b = blockIdx.z;
  const bool has_split = split < p.num_splits;  // the last CTA's second half may have none (l stays 0)
  const int group = p.num_q_heads / p.cache.num_kv_heads;  // <= 8 (decode_rows_supports)
  const int block_size = p.cache.block_size;
  const int max_context = p.max_blocks_per_seq * block_size;
  // The CTA's query heads, kRowHeads * group consecutive ones, as the columns of one token: warp w
  // owns columns w * group .. w * group + group - 1 (its KV head's group). Their loads go out first:
  // they need no sequence length, and warp 0 waits for the length and then the block ids before it
  // issues the first copies, so loaded after those they added a third memory
  // round trip to its path to the staging barrier, which every other warp then waited at (ncu, B = 3
  // and 8 at 256-1k tokens with 32k-token tables: that barrier and the next took 20-28 % of the
  // busy CTAs' warp samples). A/B in alternating processes (H200): B = 8 at 1k and 4k 1.1-1.2 us
  // faster, k8v4 B = 8 L = 256 0.6; B = 3 L = 256 equal, B = 3 L = 1k 0.4 slower.
  QueryColumns columns{QueryChunk{b, b, 1, 0, 1}, kRowHeads * group, head_group * kRowHeads * group, 0, p.num_q_heads};
  PreloadedQuery<D, C::kColumns, C::kThreads, T> query;
  query.load(static_cast<const T*>(p.query), columns, p.key_scale, group);
  const int seq_len = min(max(p.seq_lens[b], 0), max_context);
  columns.seq_len = seq_len;
  const int first_column = warp * group;
  const int limit0 = 2 * c < group ? seq_len : 0, limit1 = 2 * c + 1 < group ? seq_len : 0;
  const TokenRange range = has_split ? split_token_range(seq_len, p.num_splits, split) : TokenRange{0, 0};
  const int num_tiles = range.end > range.begin ? cdiv(range.end - range.begin, kTokenTile) : 0;
  // A CTA whose first split finds no tokens has none in its others either (later splits start
  // later): a short sequence in a block table sized for long ones. Where a merge follows, its
  // partial is marked empty (-inf log-sum-exps: the merge weighs it 0 and ignores the vectors)
  // and it leaves before the set-up, as the per-head kernel's empty CTAs do; they ran the whole
  // set-up and epilogue and stored zero partials (16 KB per CTA at D = 128 and GQA 4; ncu, B = 3
  // L = 256 with 32k-token tables: 120 of the 132 CTAs, most of the warp samples).
  // A/B in alternating processes (H200): B = 3 L = 256 0.65 us and B = 8 L = 256 0.9 us faster.
  if (gridDim.y > 1 && split_token_range(seq_len, p.num_splits, blockIdx.y * C::kSplitsPerCta).begin >= seq_len) {
    if (threadIdx.x < kRowHeads * group) {
      p.partial_lse[columns.row(threadIdx.x) * gridDim.y + blockIdx.y] = -INFINITY;
    }
    return;
  }

  if (warp == 0 && lane == 0) {  // each half's producer sets up its half's barriers
    for (int s = 0; s < C::kStages; ++s) {
      mbarrier_init(&full[s], 1);
      mbarrier_init(&empty[s], kRowHeads);
    }
    fence_mbarrier_init();
  }
  __syncwarp();  // the producer's lanes copy on these barriers next; the other warps see them after the query staging's barrier
  // Block ids, 32 tiles per window: lane i holds the id of tile 32 * window + i (-1 past the
  // range). Every warp keeps the current window and the next, so neither the producer (up to
  // kStages - 1 tiles ahead, never more than one window) nor a consumer waits on the block table.
  const int32_t* block_row = p.block_table + static_cast<int64_t>(b) * p.max_blocks_per_seq;
  const int block_shift = __ffs(block_size) - 1;  // block sizes are powers of two (host-checked)
  auto tile_start = [&](int tile) { return range.begin + tile * kTokenTile; };
  auto load_block_ids = [&](int window) -> int {
    const int tile = window * 32 + lane;
    return tile < num_tiles ? block_row[tile_start(tile) >> block_shift] : -1;
  };
  int ids = load_block_ids(0), next_ids = load_block_ids(1);
  auto block_ok = [&](int block) { return block >= 0 && block < p.cache.num_blocks; };

  // Warp 0 of the half issues tile t into stage t % kStages once every warp of the half has freed
  // it (tile t - kStages).
  // The expected bytes are announced before any copy is issued; a tile whose block id is outside
  // the cache copies nothing and completes its phase on the arrival alone (its rows are masked).
  const int64_t head_group_offset = static_cast<int64_t>(head_group) * C::kRowBytes;
  // Shared addresses of the ring and the barriers, held in registers across the tile loop.
  const uint32_t ring_address = opaque(smem_address(ring));
  const uint32_t full_bar = opaque(smem_address(full)), empty_bar = full_bar + 8 * C::kStages;
  auto produce = [&](int t, int window_ids) {
    const int stage = t % C::kStages;
    const int block = __shfl_sync(kFullMask, window_ids, t & 31);
    if (t >= C::kStages) {
      if (lane == 0) mbarrier_wait(empty_bar + 8 * stage, ((t / C::kStages) - 1) & 1);
      __syncwarp();
    }
    const bool ok = block_ok(block);
    if (lane == 0) mbarrier_arrive_expect_bytes(full_bar + 8 * stage, ok ? C::kTileBytes : 0);
    __syncwarp();
    if (!ok) return;
    const uint8_t* src = p.cache.data + block * p.cache.stride_block +
                         (tile_start(t) & (block_size - 1)) * p.cache.stride_token + head_group_offset;
    const uint32_t dst = ring_address + stage * C::kTileBytes;
    if (adjacent_rows) {
      if (lane == 0) bulk_copy_to_shared(dst, src, C::kTileBytes, full_bar + 8 * stage);
    } else if (lane < kTokenTile) {
      bulk_copy_to_shared(dst + lane * C::kRowBytes, src + lane * p.cache.stride_token, C::kRowBytes, full_bar + 8 * stage);
    }
  };
  // The first tiles' copies go out before the query staging, into stages clear of qs: their
  // memory latency overlaps the rest of the query loads' (issued first, above), the rotation and
  // the pair table.
  if (warp == 0) {
    for (int t = 0; t < C::early_tiles(half) && t < num_tiles; ++t) produce(t, ids);
  }

  // ---- query columns (fp32, times key_scale, rotated for Lloyd-Max keys) and the pair table; ends
  // in a barrier that also publishes the mbarriers.
  float* qs = reinterpret_cast<float*>(smem + C::kQueryOffset);  // [kColumns][D], at the scratch region's end
  query.template stage<!C::kFp8Key, C::KB, C::kPairStrideWords>(qs, pair_table, columns, p.codebook);
  // A warp's slots all sit at (warp * slot bytes) mod 4 in their rows (rows are 16-byte multiples),
  // so the tile math reads them in the interleaved order (fragment_order.h) for that offset.
  const int slot_misalign = (warp * C::kSlotBytes) & 3;
  // B fragments from the warp's columns. Rows past its group hold other warps' columns (or zeros);
  // their scores are masked by limit 0. The last warp reads at most row 7 * group + 7 < kColumns.
  uint32_t qf[C::kKSteps][2];
  if (slot_misalign == 0) {
    query_fragments<D, C::KB, 0>(qs + first_column * D, g, c, q_multiplier, qf);
  } else {
    query_fragments<D, C::KB, 2>(qs + first_column * D, g, c, q_multiplier, qf);
  }
  // The ring's later stages reuse qs, and bulk copies (the async proxy) write them: every thread
  // orders its generic accesses of qs before them, then the barrier.
  fence_proxy_async_shared();
  __syncthreads();
  if (warp == 0) {
    for (int t = C::early_tiles(half); t < C::kStages - 1 && t < num_tiles; ++t) produce(t, ids);
  }

  // This lane's table replica: its byte offset in a pair's row; the table's address is a uniform
  // base the loads add.
  const uint32_t table_lane_bytes = device::pair_table_lane_bytes(lane), table_base = smem_address(pair_table);
  TileAttention<C::kKSteps> st;
  const uint8_t* const my_slots = ring + warp * C::kSlotBytes;  // this warp's head in every row
  // The tile loop for slots at kMisalign mod 4 (one instantiation per offset a warp can have).
  auto tile_loop = [&](auto misalign) {
    constexpr int kMisalign = decltype(misalign)::value;
    for (int it = 0; it < num_tiles; ++it) {
      if ((it & 31) == 0 && it > 0) {  // uniform in the half: the next window of block ids
        ids = next_ids;
        next_ids = load_block_ids((it >> 5) + 1);
      }
      const int t = it + C::kStages - 1;
      if (warp == 0 && t < num_tiles) produce(t, (t >> 5) == (it >> 5) ? ids : next_ids);

      const int stage = it % C::kStages;
      mbarrier_wait(full_bar + 8 * stage, (it / C::kStages) & 1);
      const uint8_t* rows = my_slots + stage * C::kTileBytes;
      auto slot_ptr = [&](int r) { return rows + r * C::kRowBytes; };
      const bool tile_ok = block_ok(__shfl_sync(kFullMask, ids, it & 31));
      const int pos_lo = tile_start(it) + g;
      attend_tile<C, kMisalign, C::kPairStrideWords>(lane, slot_ptr, pos_lo, tile_ok && pos_lo < range.end,
                                                     tile_ok && pos_lo + 8 < range.end, limit0, limit1, table_lane_bytes,
                                                     table_base, qf, st);
      __syncwarp();  // every lane's reads of the stage are done
      if (lane == 0) mbarrier_arrive(empty_bar + 8 * stage);
    }
  };
  if constexpr (C::kSlotBytes % 4 == 0) {
    tile_loop(std::integral_constant<int, 0>{});
  } else if (slot_misalign == 0) {  // warp-uniform
    tile_loop(std::integral_constant<int, 0>{});
  } else {
    tile_loop(std::integral_constant<int, 2>{});
  }

  allow_dependent_grid_launch();  // the split merge may start its CTAs (decode_merge.cu)

  // ---- this warp's columns are complete for the split: (acc + z) / l and the log-sum-exp (log2
  // domain). The results leave through shared memory as whole rows: straight from the MMA layout a
  // lane's two dims sit 32 bytes from the next lane's, so the L2 took each 32-byte sector of the
  // partials four times (ncu, (16,64,8,16384) 4bit_nc: 969 k sectors written for 8.4 MB of
  // partials, all at the end of the one wave of CTAs). In a CTA of two halves the halves' results
  // for the same columns are folded here into one partial (the merge's rule, fold_split_results),
  // so the CTA writes one partial per column, and none at all where its two splits are the row's
  // only ones: the merge reads half as many (H200: its tail was 9.4 of 94 us at
  // (128,32,8,2048), two splits in one CTA, and 10.6 of 29 at B = 1). After the barrier every
  // warp is past its last tile and no bulk copy is in flight: the rings are free.
  sum_over_column_lanes(st.l);
  sum_over_column_lanes(st.z);
  __syncthreads();
  static_assert(C::kOutBytes + C::kWarps * kDecodeColumns * 4 <= C::kScratchBytes,
                "every warp's columns and log-sum-exps fit the scratch region");
  // A warp's staged columns, [column][D], and their log-sum-exps, [warp of the CTA][column].
  auto staged_of = [&](int w) { return reinterpret_cast<float*>(smem) + w * kDecodeColumns * D; };
  float* const staged = staged_of(warp_of_cta);
  float* const staged_lse = reinterpret_cast<float*>(smem + C::kOutBytes);
  // The 16-byte chunks of column col sit XOR-swizzled by swizzle(col): rows are a multiple of 32
  // words apart, and a store instruction's lanes (4 columns, 8 dims pairs) would otherwise meet in
  // 2 or 4 of the 8 bank groups (8-16 wavefronts for 2 ideal); swizzled, 4-8. The row reads
  // below stay one permuted chunk per lane, conflict-free.
  auto swizzle = [](int col) { return ((col >> 1) & 1) | (((col >> 2) & 1) << 2); };
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int col = 2 * c + k;  // MMA column: this warp's group head
    if (col >= group) continue;
    // A half without a split (the last CTA's second, for an odd split count) saw no token: l = 0.
    // Not m = -inf: a split whose only scores are NaN keeps m = -inf (fmaxf skips a NaN) with a
    // NaN l, and must come out NaN, not empty (column_saw_tokens).
    const bool any = column_saw_tokens(st.l[k]);
    const float inv = any ? 1.0f / st.l[k] : 0.0f;
#pragma unroll
    for (int i = 0; i < C::kKSteps; ++i) {
      const int d = 2 * value_pair(g, i, D, C::VB, value_misalign(slot_misalign, C::kLayout.value_data_offset));
      const float o0 = any ? (st.acc[i][k] + st.z[k]) * inv : 0.0f;
      const float o1 = any ? (st.acc[i][2 + k] + st.z[k]) * inv : 0.0f;
      *reinterpret_cast<float2*>(staged + col * D + (((d >> 2) ^ swizzle(col)) << 2) + (d & 3)) = make_float2(o0, o1);
    }
    if (g == 0) staged_lse[warp_of_cta * kDecodeColumns + col] = any ? st.m[k] + log2f(st.l[k]) : -INFINITY;
  }
  if constexpr (C::kSplitsPerCta == 2) {
    __syncthreads();   // the other half's columns are staged
    if (half != 0) return;  // half 0's warps write the CTA's folded columns
  } else {
    __syncwarp();
  }
  // One partial per CTA: grid.y of them per row (launch_decode_merge combines that many).
  const int num_partials = gridDim.y, partial = blockIdx.y;
  // Lane l writes dims 4l .. 4l + 3 of each column (D = 64: lanes 0-15).
  if (4 * lane < D) {
    for (int col = 0; col < group; ++col) {
      const int64_t row = columns.row(first_column + col);
      const int chunk = lane ^ swizzle(col);
      float4 o = reinterpret_cast<const float4*>(staged + col * D)[chunk];
      float lse = staged_lse[warp_of_cta * kDecodeColumns + col];
      if constexpr (C::kSplitsPerCta == 2) {  // the same columns of the other half's warp
        const int other = warp_of_cta + kRowHeads;
        fold_split_results(o, lse, reinterpret_cast<const float4*>(staged_of(other) + col * D)[chunk],
                           staged_lse[other * kDecodeColumns + col]);
      }
      if (num_partials == 1) {
        if (p.value_offset != nullptr && lse != -INFINITY) {  // the KV head of columns warp * group ..: warp's
          const float* offset = p.value_offset + static_cast<int64_t>(head_group * kRowHeads + warp) * D + 4 * lane;
          o = make_float4(o.x + offset[0], o.y + offset[1], o.z + offset[2], o.w + offset[3]);
        }
        alignas(8) T four[4] = {from_float<T>(o.x), from_float<T>(o.y), from_float<T>(o.z), from_float<T>(o.w)};
        *reinterpret_cast<uint2*>(static_cast<T*>(p.out) + row * D + 4 * lane) = *reinterpret_cast<const uint2*>(four);
      } else {
        *reinterpret_cast<float4*>(p.partial_out + (row * num_partials + partial) * D + 4 * lane) = o;
        if (lane == 0) p.partial_lse[row * num_partials + partial] = lse;
      }
    }
  }
}

// Once per instantiation and device: the shared memory opt-in and the resident CTAs.
template <class C, typename T>
KernelResidency prepare_rows_kernel() {
  return opt_in_kernel<decode_rows_kernel<C, T>>(C::kThreads, C::kSmemBytes);
}

// Visitors over the row kernel's configurations (D <= 128: the others report unsupported).
struct RowsBuilt {
  bool* built;
  template <class C, typename T>
  cudaError_t run() const {
    // sm_90 code for its bulk copies and barriers in the build, and the device grants its shared
    // memory (a smaller per-block limit fails the opt-in).
    *built = kernel_built_for_sm90<decode_rows_kernel<C, T>>() && prepare_rows_kernel<C, T>().status == cudaSuccess;
    return cudaSuccess;
  }
};

struct RowsSplitsPerCta {
  int* splits;
  template <class C, typename T>
  cudaError_t run() const {
    *splits = C::kSplitsPerCta;
    return cudaSuccess;
  }
};

struct LaunchRows {
  const DecodeParams& p;
  cudaStream_t stream;
  template <class C, typename T>
  cudaError_t run() const {
    cudaError_t err = prepare_rows_kernel<C, T>().status;
    if (err != cudaSuccess) return err;
    const float q_multiplier = decode_query_multiplier<C>(p.scale);
    const bool adjacent_rows = p.cache.stride_token == C::kRowBytes;
    const dim3 grid(p.cache.num_kv_heads / kRowHeads, cdiv(p.num_splits, C::kSplitsPerCta), p.batch);
    decode_rows_kernel<C, T><<<grid, C::kThreads, C::kSmemBytes, stream>>>(p, q_multiplier, adjacent_rows);
    err = cudaGetLastError();
    if (err != cudaSuccess || grid.y == 1) return err;
    // One partial per CTA (its halves folded): the workspace, sized for p.num_splits per row, holds
    // grid.y per row, and the merge combines those.
    DecodeParams partials = p;
    partials.num_splits = static_cast<int>(grid.y);
    return launch_decode_merge(partials, stream);
  }
};

template <class Visit>
struct AsRowConfig {
  const Visit& visit;
  template <typename T, int D, int kKeyBits, int kValueBits>
  cudaError_t run() const {
    if constexpr (D > 128 || D % 64 != 0) {  // D = 96 (FP8 keys): no whole rounds of interleaved value words
      return cudaErrorNotSupported;
    } else {
      return visit.template run<RowConfig<D, kKeyBits == 8, kKeyBits, kValueBits>, T>();
    }
  }
};

template <class Visit>
cudaError_t visit_rows_config(const DecodeParams& p, const Visit& visit) {
  if (!cuda_supports_head_dim(p.layout) || p.layout.head_dim > 128 || p.layout.head_dim % 64 != 0) {
    return cudaErrorNotSupported;
  }
  const AsRowConfig<Visit> as_config{visit};
  const VisitPresetBits<AsRowConfig<Visit>> preset{p.layout, as_config};
  switch (p.dtype) {
    case ElementType::kHalf: return dispatch_head_dim<__half>(p.layout, preset);
    case ElementType::kBFloat16: return dispatch_head_dim<__nv_bfloat16>(p.layout, preset);
    default: return cudaErrorNotSupported;
  }
}

}  // namespace

// TURBOQUANT_DECODE_KERNEL=heads|rows, read once per process: 0 by shape, 1 the per-head kernel,
// 2 the row-staged kernel for every plain decode (launch_decode fails where it cannot serve one,
// so a test run with it forced proves which kernel ran).
int forced_decode_kernel() {
  static const int forced = env_kernel_choice("TURBOQUANT_DECODE_KERNEL", "heads", "rows");
  return forced;
}

bool decode_rows_supports(const DecodeParams& p) {
  const int forced = forced_decode_kernel();
  if (forced == 1) return false;
  const CacheView& c = p.cache;
  if (p.query_start_loc != nullptr || c.num_kv_heads % kRowHeads != 0) return false;
  if (p.num_q_heads % c.num_kv_heads != 0 || p.num_q_heads / c.num_kv_heads > kDecodeColumns) return false;
  // Token-major with a token's KV heads adjacent; bulk copies need 16-byte aligned sources.
  if (c.stride_head != p.layout.slot_size_aligned || c.stride_token % 16 != 0 || c.stride_block % 16 != 0 ||
      reinterpret_cast<uintptr_t>(c.data) % 16 != 0 || c.block_size % kTokenTile != 0) {
    return false;
  }
  bool built = false;
  if (visit_rows_config(p, RowsBuilt{&built}) != cudaSuccess || !built) return false;
  const int max_context = p.max_blocks_per_seq * c.block_size;
  // By default only from 3 (sequence, 8-head group) rows where its grid can fill half the SMs
  // (row_kernel_preferred, split_plan.h: at short contexts and small batches the per-head
  // kernel's 8x more CTAs win).
  return forced == 2 || row_kernel_preferred(p.batch, c.num_kv_heads / kRowHeads, max_context, device_sm_count());
}

int decode_rows_splits_per_cta(const DecodeParams& p) {
  int splits = 1;
  visit_rows_config(p, RowsSplitsPerCta{&splits});
  return splits;
}

cudaError_t launch_decode_rows(const DecodeParams& p, cudaStream_t stream) {
  return visit_rows_config(p, LaunchRows{p, stream});
}

}  // namespace turboquant
