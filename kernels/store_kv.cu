// Fused store: quantizes (token, KV head) vectors and writes their packed slots, one launch for
// the whole batch. A group of G = vector_lanes(D) lanes holds one vector, E = D / G elements per
// lane (32 for D = 64, 128, 256; 24 for D = 96), so a warp stores 32 / G vectors at a time, every
// reduction is log2(G) shuffles and most of the rotation's butterflies stay in registers (the
// earlier split, 16 elements per lane and 15 shuffles per vector instead of 9, was 7 % slower).
// Key: norm (group reduction), Hadamard rotation as an in-register FWHT with shuffles, then
// normalization by one multiply per coordinate, Lloyd-Max bucketing by grid lookup (a
// bank-replicated table), norm correction folded into the stored norm (or FP8 e4m3 by the
// hardware conversion). Value: group min/max, fp16 scale/zero, codes by one reciprocal and an FMA.
// One wave of CTAs loops over the batch; each warp's next vectors arrive in shared memory while it
// works on the current ones (InputStaging). Each lane packs its own piece of the index streams in
// registers. Where vectors are adjacent heads of one token in the cache, their slots are one run
// of bytes: assembled in shared memory and written as 8-byte words; elsewhere each lane writes its
// pieces with 16-bit stores (slots are only 2-byte aligned). The CPU reference's bytes
// (csrc/slot_codec.cpp) up to the store's rounding allowance (docs/DESIGN.md): an index or code may differ where its
// coordinate lies within float rounding of the threshold, and the corrected fp16 norm by one ulp
// where the indices agree (tests/python/test_cuda.py checks exactly that).
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

#include "device_utils.cuh"
#include "dispatch.cuh"
#include "launchers.h"
#include "turboquant/lloyd_max_grid.h"
#include "turboquant/numeric.h"
#include "turboquant/packing.h"

namespace turboquant {
namespace {

constexpr int kStoreWarps = 8;
// CTAs per SM the kernel is built for: up to 128 registers per thread, no spills (at 3 CTAs, 80
// registers, a few instantiations spilled 8-56 bytes and the 4bit_nc store was 2 % slower).
constexpr int kStoreCtasPerSm = 2;

// Each warp's next input vectors, copied one loop iteration ahead into its shared-memory buffer
// with 16-byte cp.async: the copies' DRAM latency overlaps the current vectors' math instead of
// stalling it (the merged store's profile: 16-21 % of stall samples waited on the K/V loads). A
// warp's vectors [first, first + 32 / G) are one contiguous run of keys and one of values; lane l
// copies chunks l, l + 32, ... of each, so a copy instruction covers 512 contiguous bytes (the
// lanes' own 16-byte loads at a 32-byte stride made 45 % of the global sectors excess). The
// buffer holds the runs as they are in memory but for a 16-byte pad after each lane's piece where
// the piece is 2, 4 or 8 chunks: lane l's piece starts at l x kPieceStride. Unpadded, the
// 8 lanes of a 16-byte load's phase would read 64-byte pieces from 2 of the 8 bank groups (4-way
// conflicts: 16 wavefronts per load instead of 4, 96 extra per iteration at D = 128 bf16); padded
// to 80 bytes they read 8 different groups. The pad costs no instruction: a lane's copies still go
// to one per-lane address plus a constant stride. Per lane, the copy source advances by the grid
// stride and the shared addresses stay in registers, so an iteration's copies cost about ten
// instructions. (Bulk copies by one lane took ~50: each moves its addresses to uniform registers
// in an elect loop.)
template <typename T, int D>
struct InputStaging {
  static constexpr int G = vector_lanes(D);
  static constexpr int E = D / G;
  static constexpr int kVectors = 32 / G;  // per warp
  static constexpr int kVectorBytes = D * static_cast<int>(sizeof(T));
  static constexpr int kRunBytes = kVectors * kVectorBytes;  // a warp's keys (or values)
  static constexpr int kChunks = kRunBytes / 16;
  static constexpr int kLaneBytes = E * static_cast<int>(sizeof(T));
  static constexpr int kPieceChunks = kLaneBytes / 16;  // 16-byte chunks of a lane's piece
  // Padded where a piece is 2, 4 or 8 chunks (6, fp32 at D = 96, keeps 2-way conflicts).
  static constexpr int kPadChunks = kPieceChunks == 2 || kPieceChunks == 4 || kPieceChunks == 8;
  static constexpr int kPieceStride = kLaneBytes + 16 * kPadChunks;  // bytes from a lane's piece to the next
  static constexpr int kStagedRunBytes = 32 * kPieceStride;          // a warp's keys (or values) in the buffer
  static constexpr int kWarpBytes = 2 * kStagedRunBytes;             // keys, then values
  // Chunk c of a run sits at chunk c + (c / kPieceChunks) x kPadChunks of the buffer: lane l's
  // copies (chunks l + 32 j) at copy_to + j x kCopyStride.
  static constexpr int kCopyStride = 16 * (32 + (kPadChunks ? 32 / kPieceChunks : 0));
  static_assert(kVectorBytes % 16 == 0 && kLaneBytes % 16 == 0, "16-byte copies and reads");
  static_assert(kRunBytes == 32 * kLaneBytes && (kPadChunks == 0 || 32 % kPieceChunks == 0), "one piece per lane");

  const uint8_t* source;  // keys + first * kVectorBytes + 16 * lane
  int64_t value_offset;   // values - keys, in bytes
  uint32_t copy_to;       // this lane's first chunk in the warp's buffer (shared address)
  uint32_t piece;         // this lane's piece of the keys in the buffer

  __device__ __forceinline__ InputStaging(const void* keys, const void* values, uint32_t buffer, int64_t first, int lane)
      : source(static_cast<const uint8_t*>(keys) + first * kVectorBytes + 16 * lane),
        value_offset(static_cast<const uint8_t*>(values) - static_cast<const uint8_t*>(keys)),
        copy_to(device::opaque(buffer + 16 * (lane + (kPadChunks ? lane / kPieceChunks : 0)))),
        piece(device::opaque(buffer + kPieceStride * lane)) {}

  // Copies the keys and values of the warp's vectors [first, first + kVectors) (the source's
  // current position); vectors past the batch copy the last vector again (nothing is written for
  // them; their math only has to read initialized memory). Warp-uniform.
  __device__ __forceinline__ void issue(int64_t first, int64_t vectors, int lane) const {
    if (first + kVectors <= vectors) {
#pragma unroll
      for (int j = 0; j < (kChunks + 31) / 32; ++j) {
        if (kChunks % 32 != 0 && lane + 32 * j >= kChunks) break;
        copy(copy_to + kCopyStride * j, source + 512 * j);
      }
    } else {  // the batch's last warp, once
      const uint8_t* const run = source - 16 * lane;
#pragma unroll
      for (int j = 0; j < (kChunks + 31) / 32; ++j) {
        const int chunk = lane + 32 * j;
        if (kChunks % 32 != 0 && chunk >= kChunks) break;
        const int v = chunk * 16 / kVectorBytes;
        const int64_t past = first + v - (vectors - 1);  // > 0: that many vectors past the last one
        copy(copy_to + kCopyStride * j, run + 16 * chunk - (past > 0 ? past * kVectorBytes : 0));
      }
    }
    device::cp_async_commit();
  }

  // One 16-byte chunk of keys at `from` to `to`, and the values' chunk at the same offsets.
  __device__ __forceinline__ void copy(uint32_t to, const uint8_t* from) const {
    device::cp_async_16(to, from);
    device::cp_async_16(to + kStagedRunBytes, from + value_offset);
  }

  __device__ __forceinline__ void advance(int64_t step) { source += step * kVectorBytes; }

  // Until this lane's copies landed, then the warp's.
  static __device__ __forceinline__ void wait() {
    device::cp_async_wait<0>();
    __syncwarp();
  }

  // This lane's E elements of its key (half 0) or value (half 1), in 16-byte loads (volatile:
  // after the wait, whatever the compiler sees).
  __device__ __forceinline__ void read_words(int half, uint32_t (&w)[kLaneBytes / 4]) const {
#pragma unroll
    for (int j = 0; j < kLaneBytes / 16; ++j) {
      const uint32_t at = piece + half * kStagedRunBytes + 16 * j;
      uint32_t* x = w + 4 * j;
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(x[0]), "=r"(x[1]), "=r"(x[2]), "=r"(x[3]) : "r"(at));
    }
  }

  static __device__ __forceinline__ void to_floats(const uint32_t (&words)[kLaneBytes / 4], float (&out)[E]) {
#pragma unroll
    for (int j = 0; j < E / 2; ++j) {  // elements 2j, 2j + 1
      if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        // A bf16 is the high half of its float: one shift or one mask per element (to_float
        // on an element of a pair extracts it first, two instructions for the upper one).
        out[2 * j] = __uint_as_float(words[j] << 16);
        out[2 * j + 1] = __uint_as_float(words[j] & 0xffff0000u);
      } else if constexpr (std::is_same_v<T, __half>) {
        const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&words[j]));
        out[2 * j] = f.x;
        out[2 * j + 1] = f.y;
      } else {
        out[2 * j] = __uint_as_float(words[2 * j]);
        out[2 * j + 1] = __uint_as_float(words[2 * j + 1]);
      }
    }
  }

  // This lane's E key elements.
  __device__ __forceinline__ void read_key(float (&k)[E]) const {
    uint32_t words[kLaneBytes / 4];
    read_words(0, words);
    to_floats(words, k);
  }

  // This lane's E value elements, and their minimum and maximum (fminf / fmaxf semantics: NaN is
  // passed over). For 16-bit types on the packed pairs: 8 instructions (3-input packed min/max)
  // where 30 float ones did.
  __device__ __forceinline__ void read_value(float (&v)[E], float& vmin, float& vmax) const {
    uint32_t words[kLaneBytes / 4];
    read_words(1, words);
    to_floats(words, v);
    if constexpr (std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>) {
      using Pair = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
      Pair lo = *reinterpret_cast<const Pair*>(&words[0]), hi = lo;
#pragma unroll
      for (int j = 1; j < E / 2; ++j) {
        const Pair w = *reinterpret_cast<const Pair*>(&words[j]);
        lo = __hmin2(lo, w);
        hi = __hmax2(hi, w);
      }
      vmin = fminf(device::to_float(lo.x), device::to_float(lo.y));
      vmax = fmaxf(device::to_float(hi.x), device::to_float(hi.y));
    } else {
      vmin = vmax = v[0];
#pragma unroll
      for (int j = 1; j < E; ++j) {
        vmin = fminf(vmin, v[j]);
        vmax = fmaxf(vmax, v[j]);
      }
    }
  }
};

template <typename T, int D>
constexpr int store_dynamic_smem_bytes() {
  return kStoreWarps * InputStaging<T, D>::kWarpBytes;
}

// Writes the first kBytes (even) of a little-endian word stream with 16-bit stores.
template <int kBytes, int NW>
__device__ __forceinline__ void store_halfwords(uint8_t* dst, const uint32_t (&words)[NW]) {
  static_assert(kBytes % 2 == 0 && kBytes <= 4 * NW, "whole halfwords of the packed words");
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
#pragma unroll
  for (int h = 0; h < kBytes / 2; ++h) out[h] = static_cast<uint16_t>(words[h / 2] >> (16 * (h % 2)));
}

// A lane's pieces of its vector's slot at `slot` (in the cache or in shared memory): its key and
// value chunks, and for the group's first lane the fp16 fields and the padding byte.
template <int kKeyChunk, int kValueChunk, bool kFp8Key, int NK, int NV>
__device__ __forceinline__ void write_slot_pieces(uint8_t* slot, int part, const SlotLayout& L, const uint32_t (&key_words)[NK],
                                                  const uint32_t (&value_words)[NV], uint16_t key_norm_bits,
                                                  const ValueQuantParams& q) {
  store_halfwords<kKeyChunk>(slot + part * kKeyChunk, key_words);
  store_halfwords<kValueChunk>(slot + L.value_data_offset + part * kValueChunk, value_words);
  if (part == 0) {
    uint16_t* halves = reinterpret_cast<uint16_t*>(slot);  // fp16 fields sit at even offsets
    if constexpr (!kFp8Key) halves[L.key_norm_offset / 2] = key_norm_bits;
    halves[L.value_scale_offset / 2] = q.scale_bits;
    halves[L.value_zero_offset / 2] = q.zero_bits;
    if (L.slot_size_aligned > L.slot_size) slot[L.slot_size] = 0;  // padding byte
  }
}

// The (token, head) of a lane's vector, advanced by the grid stride each loop iteration without a
// division (one 32-bit division per iteration was ~20 instructions of the store's ~880).
struct VectorCursor {
  int64_t token;
  int head;
  int64_t step_tokens;  // the stride in whole tokens ...
  int step_heads;       // ... and heads
  __device__ __forceinline__ VectorCursor(int64_t item, int64_t step, int heads)
      : token(item / heads), head(static_cast<int>(item % heads)), step_tokens(step / heads),
        step_heads(static_cast<int>(step % heads)) {}
  __device__ __forceinline__ void advance(int heads) {
    token += step_tokens;
    head += step_heads;
    if (head >= heads) {
      head -= heads;
      ++token;
    }
  }
};

// Where a vector goes: the slot_mapping entry of its token (-1 past the batch) and its head.
// Loaded one loop iteration ahead; whether the slot is inside the cache is asked only when the
// slot is written (inside_cache), so the load's latency is not waited for at once.
struct Destination {
  int64_t slot;
  int head;
};

__device__ __forceinline__ Destination destination_of(const StoreParams& p, const VectorCursor& at, int64_t item,
                                                      int64_t vectors) {
  if (item >= vectors) return {-1, 0};
  const int64_t slot = p.slot_mapping_int64 ? static_cast<const int64_t*>(p.slot_mapping)[at.token]
                                            : static_cast<const int32_t*>(p.slot_mapping)[at.token];
  return {slot, at.head};
}

// The store's per-head transforms (StoreParams) on a lane's E elements of a vector of KV head
// `head`, dims first .. first + E - 1: (key - key_offset) / key_scale, and value - value_offset,
// rounded as the fp32 ATen pass the CPU op runs before its store (IEEE subtraction and division),
// so both quantize the same floats. The vectors are read in 16-byte loads (the glue aligns them):
// with one 4-byte load per element, a warp's load touched 32 cache lines (its 8 vectors' lanes
// read 128 bytes apart) and each transform alone took the 4,096-token store from 13.7 to 30 us
// (all three 65 us; ncu: 27 cycles per issued instruction against 9; H100, bench_transforms.py).
// A missing vector reads as 0 or 1, which leave every element as it is (k - 0 and k / 1 are exact).
__device__ __forceinline__ float4 vector_quad(const float* vector, int64_t at, int quad, float missing) {
  if (vector == nullptr) return make_float4(missing, missing, missing, missing);
  return reinterpret_cast<const float4*>(vector + at)[quad];
}

template <int E, int D>
__device__ __forceinline__ void transform_key(float (&k)[E], const StoreParams& p, int head, int first) {
  static_assert(E % 4 == 0, "whole 16-byte loads");
  const int64_t at = static_cast<int64_t>(head) * D + first;
#pragma unroll
  for (int q = 0; q < E / 4; ++q) {
    const float4 offset = vector_quad(p.key_offset, at, q, 0.0f), scale = vector_quad(p.key_scale, at, q, 1.0f);
    k[4 * q] = __fdiv_rn(__fsub_rn(k[4 * q], offset.x), scale.x);
    k[4 * q + 1] = __fdiv_rn(__fsub_rn(k[4 * q + 1], offset.y), scale.y);
    k[4 * q + 2] = __fdiv_rn(__fsub_rn(k[4 * q + 2], offset.z), scale.z);
    k[4 * q + 3] = __fdiv_rn(__fsub_rn(k[4 * q + 3], offset.w), scale.w);
  }
}
// The values less value_offset, with their new minimum and maximum (fminf / fmaxf: NaN passed over).
template <int E, int D>
__device__ __forceinline__ void transform_value(float (&v)[E], float& vmin, float& vmax, const StoreParams& p, int head,
                                                int first) {
  static_assert(E % 4 == 0, "whole 16-byte loads");
  const int64_t at = static_cast<int64_t>(head) * D + first;
#pragma unroll
  for (int q = 0; q < E / 4; ++q) {
    const float4 offset = vector_quad(p.value_offset, at, q, 0.0f);
    v[4 * q] = __fsub_rn(v[4 * q], offset.x);
    v[4 * q + 1] = __fsub_rn(v[4 * q + 1], offset.y);
    v[4 * q + 2] = __fsub_rn(v[4 * q + 2], offset.z);
    v[4 * q + 3] = __fsub_rn(v[4 * q + 3], offset.w);
  }
  vmin = vmax = v[0];  // as read_value's fp32 path
#pragma unroll
  for (int j = 1; j < E; ++j) {
    vmin = fminf(vmin, v[j]);
    vmax = fmaxf(vmax, v[j]);
  }
}

// Padding (negative) and slots past the cache write nothing.
__device__ __forceinline__ bool inside_cache(const StoreParams& p, int64_t slot) {
  return slot >= 0 && slot < p.cache.num_blocks * p.cache.block_size;
}

// The grid table holds kGridReplicas copies of each 16-byte cell side by side, and lane l reads
// copy l % kGridReplicas: the 8 lanes of each phase of a 16-byte shared load then use 8 different
// bank groups whatever cells they look up. (One copy per cell made 9.9-way bank conflicts: the
// cells around 0 take most lookups, and 16-byte cells fall into only 8 bank groups.)
constexpr int kGridReplicas = 8;
constexpr uint32_t kGridRowBytes = kGridReplicas * sizeof(GridCell);

// The grid cell of coordinate y (|y| <= kGridReach), one 16-byte shared load from this lane's
// copy (cells_biased: see the kernel). The "memory" clobber orders it after the barrier that ends
// the table's construction, whatever the compiler learns about y's inputs.
__device__ __forceinline__ GridCell load_grid_cell(uint32_t cells_biased, float y, const LloydMaxGrid& grid) {
  const uint32_t address = cells_biased + float_bits(fma_rn(y, grid.scale, grid.biased_offset)) * kGridRowBytes;
  GridCell c;
  asm("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
      : "=f"(c.midpoint), "=r"(c.below), "=f"(c.square_below), "=f"(c.square_above)
      : "r"(address)
      : "memory");
  return c;
}

template <typename T, int D, int kKeyBits, int kValueBits>
__global__ void __launch_bounds__(kStoreWarps * 32, kStoreCtasPerSm)
    store_kv_kernel(const StoreParams p, const LloydMaxGrid grid, const float rsqrt_d, const int block_shift) {
  constexpr bool kFp8Key = kKeyBits == 8;
  constexpr int G = vector_lanes(D);  // lanes per vector
  constexpr int E = D / G;            // elements per lane
  constexpr int kVectorsPerWarp = 32 / G;
  constexpr int kKeyChunk = E * kKeyBits / 8, kValueChunk = E * kValueBits / 8;  // bytes per lane
  static_assert(G * E == D && kKeyChunk % 2 == 0 && kValueChunk % 2 == 0, "lane pieces are whole halfwords");
  // The slots of a warp's vectors, assembled in shared memory in vector order and written to the
  // cache as runs of 8-byte words where they can be (see run_vectors).
  constexpr SlotLayout kLayout = make_slot_layout(D, kFp8Key ? KeyFormat::kFp8 : KeyFormat::kLloydMax, kKeyBits, kValueBits);
  constexpr int kWarpSlotBytes = kVectorsPerWarp * kLayout.slot_size_aligned;
  __shared__ __align__(16) uint8_t runs[kStoreWarps][(kWarpSlotBytes + 7) / 8 * 8];

  __shared__ float centroid[kMaxCodebookLevels], midpoint[kMaxCodebookLevels];
  __shared__ __align__(16) GridCell cells[kGridCells * kGridReplicas];
  extern __shared__ __align__(16) uint8_t staging[];  // [kStoreWarps][InputStaging::kWarpBytes]
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const int64_t vectors = p.num_tokens * p.cache.num_kv_heads;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kStoreWarps * kVectorsPerWarp;
  int64_t first = (static_cast<int64_t>(blockIdx.x) * kStoreWarps + warp) * kVectorsPerWarp;
  InputStaging<T, D> input(p.key, p.value,
                           device::smem_address(staging) + warp * InputStaging<T, D>::kWarpBytes, first, lane);
  // The first vectors' copies and slot go out before the tables are built, overlapping them.
  if (first < vectors) input.issue(first, vectors, lane);
  VectorCursor cursor(first + lane / G, step, p.cache.num_kv_heads);
  Destination next_dst = destination_of(p, cursor, first + lane / G, vectors);

  if constexpr (!kFp8Key) {
    if (grid.usable) {
      for (int t = threadIdx.x; t < kGridCells; t += blockDim.x) {
        const GridCell c = grid_cell_entry(p.codebook, grid, t);
#pragma unroll
        for (int r = 0; r < kGridReplicas; ++r) cells[t * kGridReplicas + r] = c;
      }
    }
    if (threadIdx.x < kMaxCodebookLevels) {
      centroid[threadIdx.x] = p.codebook.centroid[threadIdx.x];
      midpoint[threadIdx.x] = threadIdx.x < kMaxCodebookLevels - 1 ? p.codebook.midpoint[threadIdx.x] : INFINITY;
    }
    __syncthreads();
  }
  // This lane's copy of the table, less the grid's rounding bias, so a cell is read at
  // cells_biased + kGridRowBytes * float_bits(fma(y, scale, biased offset)) (uint32 arithmetic
  // wraps). The bias comes from the kernel's parameters: as a constant, the compiler re-adds it in
  // every lookup.
  const uint32_t cells_biased = device::smem_address(cells) + (threadIdx.x % kGridReplicas) * sizeof(GridCell) -
                                grid.rounding_bias_bits * kGridRowBytes;
  const int part = lane & (G - 1);  // which E elements of its vector this lane holds
  // A run: consecutive vectors of the warp whose slots are one range of bytes in the cache. Where
  // the heads of a token are adjacent (token-major view), the largest power of two dividing both
  // the KV heads and the warp's vectors: the warp's first vector is a multiple of the warp's
  // vectors and a token's first a multiple of the heads, so a run never straddles two tokens
  // (8 heads at D = 128: the warp's 8 vectors; 4 heads: two runs of 4). Otherwise one slot. Runs
  // of whole 8-byte words only, else the lanes write their pieces straight to the cache: slots
  // are 4 or 6 mod 8 bytes (134 for 4bit_nc at D = 128), so runs of 1 or 2 (head-major views;
  // 1, 2, 3 or 6 heads) take that path for every preset but FP8 keys' runs of 2.
  const int heads = p.cache.num_kv_heads;
  const int run_vectors = p.cache.stride_head == kLayout.slot_size_aligned ? std::min(kVectorsPerWarp, heads & -heads) : 1;
  const int run_words = run_vectors * kLayout.slot_size_aligned / 8;
  const int run_lanes = run_vectors * G;
  const bool runs_of_words = run_vectors * kLayout.slot_size_aligned % 8 == 0;

  // Warp-uniform loop: every lane reaches every shuffle; lanes past the batch compute on a copy of
  // the last vector and write nothing.
  for (; first < vectors; first += step) {
    float k[E];
    input.wait();
    input.read_key(k);
    const Destination dst = next_dst;
    if (p.key_offset != nullptr || p.key_scale != nullptr) transform_key<E, D>(k, p, dst.head, part * E);  // uniform

    // ---- key
    uint32_t key_words[(E * kKeyBits + 31) / 32];
    uint16_t key_norm_bits = 0;
    if constexpr (kFp8Key) {
      // Hardware conversions (about 20 instructions per element in software); where an element is
      // NaN, the CPU's rule element by element, which keeps the element's sign.
      static_assert(E % 4 == 0, "whole words of FP8 bytes");
      bool nan = false;
#pragma unroll
      for (int w = 0; w < E / 4; ++w) {
        key_words[w] = device::floats_to_fp8x4(k[4 * w], k[4 * w + 1], k[4 * w + 2], k[4 * w + 3]);
        nan |= device::has_fp8_nan(key_words[w]);
      }
      if (nan) {
        uint32_t codes[E];
#pragma unroll
        for (int j = 0; j < E; ++j) codes[j] = float_to_fp8_e4m3(k[j]);
        pack_codes<E, 8>(codes, key_words);
      }
    } else {
      const float norm = sqrtf(device::group_sum_of_squares<E, G>(k));
      const float denom = norm + kKeyNormEpsilon;
      // Rotation first, normalization after: H (k / denom) * rsqrt_d = (H k) * (rsqrt_d / denom),
      // one multiply per coordinate instead of a division and a multiply. The coordinates differ
      // from the CPU's (which divides first) only by float rounding, so an index can differ only
      // where a coordinate lies within rounding of a midpoint (the allowance is < 1e-4 of them;
      // tests/python/test_cuda.py checks both). A non-finite key, or a codebook the grid cannot
      // hold, takes the CPU's own order: division, rotation, binary search. (A finite norm is
      // below 2^64, where the sum of squares overflows, so |H k|_j <= sqrt(D) * norm cannot
      // overflow; the bound below also keeps __fdividef in range.)
      const bool folded = norm <= 0x1p120f && grid.usable;  // false for NaN and inf
      if (!folded) {
#pragma unroll
        for (int j = 0; j < E; ++j) k[j] = k[j] / denom;
      }
      device::group_fwht<E, G>(k, lane);
      uint32_t idx[E];
      float centroid_squares = -0.0f;  // this lane's part of |c|^2 (-0: x + -0 is x, no extra add)
      if (folded) {
        // A fast division (two instructions; denom <= 2^121): the coordinates need not round as
        // the CPU's do, only to within a few ulps.
        const float coordinate_scale = __fdividef(rsqrt_d, denom);
#pragma unroll
        for (int j = 0; j < E; ++j) {
          const float y = mul_rn(k[j], coordinate_scale);
          const GridCell cell = load_grid_cell(cells_biased, y, grid);
          idx[j] = lloyd_max_index_on_grid(y, cell);
          centroid_squares += squared_centroid_on_grid(y, cell);
        }
      } else {
#pragma unroll
        for (int j = 0; j < E; ++j) {
          idx[j] = lloyd_max_index(mul_rn(k[j], rsqrt_d), midpoint, 1 << kKeyBits);
          centroid_squares = fma_rn(centroid[idx[j]], centroid[idx[j]], centroid_squares);
        }
      }
      pack_codes<E, kKeyBits>(idx, key_words);
      float stored = norm;
      // rsqrtf's couple of ulps (and squares summed in another order than the CPU's) move the
      // fp16 norm by one ulp at most (the allowance is one).
      if (p.norm_correction) stored = norm * rsqrtf(device::group_sum<G>(centroid_squares));
      key_norm_bits = key_norm_half_bits(stored);
    }

    // ---- value (read after the key, so the two never hold registers at once)
    float v[E], vmin, vmax;
    input.read_value(v, vmin, vmax);
    if (p.value_offset != nullptr) transform_value<E, D>(v, vmin, vmax, p, dst.head, part * E);
    __syncwarp();  // every lane read its piece: the buffer takes the next vectors
    if (first + step < vectors) {  // warp-uniform
      input.advance(step);
      input.issue(first + step, vectors, lane);
      cursor.advance(p.cache.num_kv_heads);
      next_dst = destination_of(p, cursor, first + step + lane / G, vectors);
    }
    const ValueQuantParams q =
        value_quant_params(device::group_min<G>(vmin), device::group_max<G>(vmax), kValueBits);
    uint32_t codes[E];
    // One reciprocal per vector and one FMA per code: floor((v - zero) * (1 / scale) + 0.5) is the
    // CPU's floor((v - zero) / scale + 0.5) up to float rounding of the quotient, so a code can
    // differ only where the quotient lies within rounding of a half-integer (the tests check it).
    if (q.scale != 0.0f && reciprocal_division_exact(q.scale) && isfinite(q.zero)) {
      const float reciprocal = __fdividef(1.0f, q.scale);  // within an ulp: fine for codes
#pragma unroll
      for (int j = 0; j < E; ++j) codes[j] = value_code_of_rounded(fma_rn(v[j] - q.zero, reciprocal, 0.5f), kValueBits);
    } else {
#pragma unroll
      for (int j = 0; j < E; ++j) codes[j] = value_code(v[j], q, kValueBits);
    }
    uint32_t value_words[(E * kValueBits + 31) / 32];
    pack_codes<E, kValueBits>(codes, value_words);

    // ---- write the slot: each lane its pieces, the group's first lane the fp16 fields.
    const int64_t slot_index = inside_cache(p, dst.slot) ? dst.slot : -1;
    uint8_t* const slot = slot_index < 0 ? p.cache.data
                                         : p.cache.data + (slot_index >> block_shift) * p.cache.stride_block +
                                               (slot_index & (p.cache.block_size - 1)) * p.cache.stride_token +
                                               dst.head * p.cache.stride_head;
    // Every vector written and every run 8-byte aligned: the runs go out as whole 8-byte words,
    // each by its own vectors' lanes, and fill their sectors (16-bit pieces straight to the cache
    // touched each sector several times: 63 % of the store's global sectors were excess in its
    // profile). The lanes of a run all hold its start.
    uint8_t* const run = slot - ((lane / G) & (run_vectors - 1)) * kLayout.slot_size_aligned;
    const bool whole_run = runs_of_words && slot_index >= 0 && (reinterpret_cast<uintptr_t>(run) & 7) == 0;
    if (__all_sync(device::kFullMask, whole_run)) {
      uint8_t* staged = runs[warp] + (lane / G) * kLayout.slot_size_aligned;
      write_slot_pieces<kKeyChunk, kValueChunk, kFp8Key>(staged, part, kLayout, key_words, value_words, key_norm_bits, q);
      __syncwarp();
      const uint2* from = reinterpret_cast<const uint2*>(runs[warp]) + (lane / run_lanes) * run_words;
      // A run's words over its lanes: slot_size_aligned / (8 G) each, rounded up, whatever the
      // run's length.
      constexpr int kWordsPerLane = (kLayout.slot_size_aligned + 8 * G - 1) / (8 * G);
#pragma unroll
      for (int i = 0; i < kWordsPerLane; ++i) {
        const int w = (lane & (run_lanes - 1)) + i * run_lanes;
        if (w < run_words) reinterpret_cast<uint2*>(run)[w] = from[w];
      }
      __syncwarp();  // the next iteration's pieces overwrite the runs
      continue;
    }
    // Otherwise straight to the cache (every shuffle of this iteration is done: lanes with
    // nothing to write may leave early).
    if (slot_index < 0) continue;
    write_slot_pieces<kKeyChunk, kValueChunk, kFp8Key>(slot, part, kLayout, key_words, value_words, key_norm_bits, q);
  }
}

// The shared memory opt-in (for Lloyd-Max keys the staging and the static tables pass the 48 KB
// default; fp32 inputs at D = 64 take about 113 KB, past the 99 KB per block of sm_86/sm_89 but
// inside sm_90's 227 KB, and two such CTAs fill an SM's 228 KB to within 256 bytes) and the CTAs
// that fit on one SM, once per device.
template <typename T, int D, int kKeyBits, int kValueBits>
KernelResidency store_residency() {
  return opt_in_kernel<store_kv_kernel<T, D, kKeyBits, kValueBits>>(kStoreWarps * 32, store_dynamic_smem_bytes<T, D>());
}

struct StoreLaunch {
  const StoreParams& p;
  const LloydMaxGrid& grid;
  cudaStream_t stream;
  template <typename T, int D, int kKeyBits, int kValueBits>
  cudaError_t run() const {
    const int64_t vectors = p.num_tokens * p.cache.num_kv_heads;
    if (vectors == 0) return cudaSuccess;
    const KernelResidency residency = store_residency<T, D, kKeyBits, kValueBits>();
    if (residency.status != cudaSuccess) return residency.status;  // the shared memory opt-in failed
    const int per_sm = residency.per_sm;  // >= 1 once the opt-in succeeded
    constexpr int kVectorsPerCta = kStoreWarps * 32 / vector_lanes(D);
    const int64_t needed = (vectors + kVectorsPerCta - 1) / kVectorsPerCta;
    // One wave of CTAs; the grid-stride loop covers the rest, so each CTA builds its tables once
    // (with 4 waves the table construction was 3.6 % of the store's instructions).
    const int64_t blocks = std::min<int64_t>(needed, static_cast<int64_t>(device_sm_count()) * per_sm);
    int block_shift = 0;  // block sizes are powers of two (the glue checks 16..128)
    while ((1 << block_shift) < p.cache.block_size) ++block_shift;
    const float rsqrt_d = 1.0f / sqrtf(static_cast<float>(D));  // same expression as the CPU
    store_kv_kernel<T, D, kKeyBits, kValueBits><<<static_cast<unsigned>(blocks), kStoreWarps * 32,
                                                  store_dynamic_smem_bytes<T, D>(), stream>>>(p, grid, rsqrt_d, block_shift);
    return cudaGetLastError();
  }
};

}  // namespace

bool cuda_supports_head_dim(const SlotLayout& layout) {
  const int d = layout.head_dim;
  return d == 64 || d == 128 || d == 256 || (d == 96 && layout.key_format == KeyFormat::kFp8);
}

cudaError_t launch_store_kv(const StoreParams& p, cudaStream_t stream) {
  if (p.cache.block_size <= 0 || (p.cache.block_size & (p.cache.block_size - 1)) != 0) return cudaErrorInvalidValue;
  if (!cuda_supports_head_dim(p.layout)) {
    return cuda_generic_supports(p.layout) ? launch_store_kv_generic(p, stream) : cudaErrorInvalidValue;
  }
  const bool fp8 = p.layout.key_format == KeyFormat::kFp8;
  // The kernel's binary search takes 2^key_bits levels from its template: the codebook must agree.
  if (!fp8 && p.codebook.levels != (1 << p.layout.key_bits)) return cudaErrorInvalidValue;
  const LloydMaxGrid grid = fp8 ? LloydMaxGrid{} : make_lloyd_max_grid(p.codebook);
  const StoreLaunch launch{p, grid, stream};
  return dispatch_slot_kernel(p.dtype, p.layout, VisitPresetBits<StoreLaunch>{p.layout, launch});
}

}  // namespace turboquant
