// The kernels for head dims without a tiled instantiation (every head_dim the presets take but 64,
// 128, 256 and FP8 keys' 96): the rotated presets at 80, 96, 112, 160, 192 (H_m (x) H_{2^k}, a dense
// stage across the Sylvester blocks) and FP8 keys at any multiple of 8. The head dim is a runtime
// value: one instantiation per element type (and, for decode, per bound on the dims a lane holds)
// serves them all.
//
// The store and dequantize take one warp per vector, in shared memory, and call the CPU reference's
// per-element rules as they are (quantize.h, packing.h, numeric.h, the rotation's two steps in
// hadamard_transform.h), so the store writes the CPU's bytes exactly (no rounding allowance: the
// same operations in the same order) and dequantize returns the CPU's floats. Decode takes a CTA
// per KV head and a slice of its query heads (below); splits of a long context merge through the
// workspace and the split merge like the tiled kernels', and the attention options (windows,
// soft-capping, sinks) apply as in the per-head kernel. What they cost next to the tiled kernels
// and SDPA: benchmarks/bench_head_dims.py, RESULTS.md "Head dims without tiles".
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>

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

// sum_of_squares_lane_order (quantize.h) of x in shared memory by a warp, in that rule's order: lane
// i < L = vector_lanes(n) chains the squares of its n / L elements with FMAs, then the xor butterfly
// over the L lanes; so the CPU's bits, every lane getting them. (One lane summing all n in that
// order, as the store did first, kept a lane's local arrays and a serial chain of n FMAs.)
__device__ float warp_sum_of_squares_lane_order(const float* x, int n, int lane) {
  const int lanes = vector_lanes(n);
  if (n % lanes != 0) return __shfl_sync(device::kFullMask, lane == 0 ? sum_of_squares_lane_order(x, n) : 0.0f, 0);
  const int per_lane = n / lanes;
  float s = 0.0f;
  if (lane < lanes) {
    for (int j = 0; j < per_lane; ++j) s = fma_rn(x[lane * per_lane + j], x[lane * per_lane + j], s);
  }
  for (int offset = lanes / 2; offset > 0; offset >>= 1) s = s + __shfl_xor_sync(device::kFullMask, s, offset);
  return __shfl_sync(device::kFullMask, s, 0);
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
    // The per-head transforms (StoreParams), rounded as the tiled store's transform_key / _value.
    const int64_t head_at = static_cast<int64_t>(head) * d;
    auto key_at = [&](int i) {
      float x = device::to_float(key[i]);
      if (p.key_offset != nullptr) x = __fsub_rn(x, p.key_offset[head_at + i]);
      if (p.key_scale != nullptr) x = __fdiv_rn(x, p.key_scale[head_at + i]);
      return x;
    };
    auto value_at = [&](int i) {
      const float x = device::to_float(value[i]);
      return p.value_offset != nullptr ? __fsub_rn(x, p.value_offset[head_at + i]) : x;
    };
    if (fp8) {
      for (int i = lane; i < d; i += 32) slot[i] = float_to_fp8_e4m3(key_at(i));
    } else {
      for (int i = lane; i < d; i += 32) k[i] = key_at(i);
      __syncwarp();
      const float norm = sqrtf(warp_sum_of_squares_lane_order(k, d, lane));
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
      const float centroid_norm = p.norm_correction ? sqrtf(warp_sum_of_squares_lane_order(scratch, d, lane)) : 1.0f;
      if (lane == 0) {
        const float stored = p.norm_correction ? norm / centroid_norm : norm;
        store_half_field(slot, L.key_norm_offset, key_norm_half_bits(stored));
      }
    }
    float vmin = INFINITY, vmax = -INFINITY;  // fminf / fmaxf pass NaN over, as the CPU's fmin / fmax
    for (int i = lane; i < d; i += 32) {
      const float v = value_at(i);
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
      for (int r = 0; r < 8; ++r) codes[r] = static_cast<uint8_t>(value_code(value_at(8 * g + r), q, L.value_bits));
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

// ---- decode: one CTA per (query row, KV head's slice of query heads, split). Grid x: sequences
// (plain decode) or the varlen chunks of one token each (query_chunks.h), y: KV heads x the slices
// of their GQA group (generic_decode_head_slices), z: splits. Each split takes an equal share of the
// row's attended positions [first attended, causal limit); each warp takes tiles of 32 of them.
//
// A tile is read twice from the cache, once per phase, each time by the lanes in the pattern that
// phase needs: for the scores, lane j takes token j and dots its whole key with every query of
// the slice (the queries rotated once, in shared memory, read as broadcasts; the centroids in
// shared memory, one bank each); for the values, the lanes take the head dims (lane, lane + 32,
// ...) and walk the tile's tokens. A slot is thus read once per GQA slice, not once per query head,
// and the softmax costs one exp per (token, head), not one per lane. The earlier design (a warp per
// query head, one token at a time, every lane doing every step) took 505 us where SDPA takes 19.8
// (D = 96, B = 1, L = 8k; RESULTS.md, "Head dims without tiles").
//
// E bounds the head dims a lane holds (D <= 32 E) and generic_heads_per_cta(E) the query heads a
// slice takes: the output accumulators, heads x E floats a lane, stay at 32 registers.
constexpr int generic_heads_per_cta(int dims_per_lane) { return dims_per_lane >= 32 ? 1 : dims_per_lane >= 8 ? 4 : 8; }
// Tokens whose value codes a lane loads at once: B x E codes, 16 registers.
constexpr int generic_token_batch(int dims_per_lane) { return dims_per_lane >= 16 ? 1 : 16 / dims_per_lane; }

// The 8 indices of group g of a key field (packing.h: key_bits bytes at key_bits * g) as one word,
// read with 16-bit loads where the bytes allow (a slot, and so its key field, is 2-byte aligned).
// A lane scoring its own token reads its own slot, one L1 wavefront per lane and load: on the
// H100 the byte-wide loads (4 per group of 4-bit keys) bounded the decode at B = 8 (bench_head_dims.py).
__device__ __forceinline__ uint32_t key_group_word(const uint8_t* field, int g, int bits) {
  const uint16_t* pairs = reinterpret_cast<const uint16_t*>(field);
  if (bits == 4) return pairs[2 * g] | (static_cast<uint32_t>(pairs[2 * g + 1]) << 16);
  const int b = bits * g;  // 3 bits: bytes b, b + 1, b + 2
  if ((b & 1) == 0) return pairs[b / 2] | (static_cast<uint32_t>(field[b + 2]) << 16);
  return field[b] | (static_cast<uint32_t>(pairs[(b + 1) / 2]) << 8);
}

__device__ __forceinline__ uintptr_t shfl_address(uintptr_t a, int lane) {
  const uint32_t lo = __shfl_sync(device::kFullMask, static_cast<uint32_t>(a), lane);
  const uint32_t hi = __shfl_sync(device::kFullMask, static_cast<uint32_t>(static_cast<uint64_t>(a) >> 32), lane);
  return static_cast<uintptr_t>((static_cast<uint64_t>(hi) << 32) | lo);
}

template <typename T, int E>
__global__ void __launch_bounds__(kGenericThreads) decode_generic_kernel(const DecodeParams p, const HadamardFactors f,
                                                                         const float rsqrt_d) {
  constexpr int H = generic_heads_per_cta(E);
  extern __shared__ float smem[];  // q [H][D]; per warp: acc [H][D] (before the tiles, the rotation's
                                   // scratch); per warp and head: max, sum; per head: merge weights
  const int d = p.layout.head_dim, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* q = smem;
  float* warp_acc = q + H * d;                             // [kGenericWarps][H][D]
  float* warp_max = warp_acc + kGenericWarps * H * d;      // [kGenericWarps][H]
  float* warp_sum = warp_max + kGenericWarps * H;          // [kGenericWarps][H]
  float* merge_weight = warp_sum + kGenericWarps * H;      // [kGenericWarps][H]
  float* merge_inverse = merge_weight + kGenericWarps * H; // [H]
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
  const int group = p.num_q_heads / p.cache.num_kv_heads, slices = (group + H - 1) / H;
  const int kv_head = blockIdx.y / slices;
  const int head0 = kv_head * group + (blockIdx.y % slices) * H;
  const int heads = min(H, (kv_head + 1) * group - head0);
  const int split = blockIdx.z, splits = gridDim.z;
  const int block_size = p.cache.block_size;
  const int seq_len = max(0, min(p.seq_lens[seq], p.max_blocks_per_seq * block_size));
  const int limit = causal_limit(seq_len, q_len, pos);
  const int start = first_attended_position(limit, p.window);
  const int share = (limit - start + splits - 1) / splits;
  const int lo = min(limit, start + split * share), hi = min(limit, lo + share);

  const int64_t out_row0 = static_cast<int64_t>(row) * p.num_q_heads + head0;  // the slice's heads are adjacent
  const T* query = static_cast<const T*>(p.query) + out_row0 * d;
  // Times the KV head's key_scale where the decode has one (DecodeParams).
  const float* key_scale = p.key_scale != nullptr ? p.key_scale + static_cast<int64_t>(kv_head) * d : nullptr;
  for (int i = threadIdx.x; i < heads * d; i += kGenericThreads) {
    q[i] = key_scale != nullptr ? device::to_float(query[i]) * key_scale[i % d] : device::to_float(query[i]);
  }
  if (threadIdx.x < kMaxCodebookLevels) centroid[threadIdx.x] = p.codebook.centroid[threadIdx.x];
  __syncthreads();
  if (!fp8) {  // q.k = (R q).(norm c~): each query rotated once
    for (int h = warp; h < heads; h += kGenericWarps) {
      warp_hadamard(q + h * d, warp_acc + warp * H * d, d, f, lane);
      for (int i = lane; i < d; i += 32) q[h * d + i] *= rsqrt_d;
    }
    __syncthreads();
  }

  // Online softmax in the natural domain per head: the running max m (warp-uniform), and this
  // lane's share of the sum of e^(s - m) (l) and of e^(s - m) * zero (z: the values' offsets, added
  // to every dim at the end); acc holds e^(s - m) * scale * code for the lane's dims.
  float acc[H][E], m[H], l[H], z[H];
#pragma unroll
  for (int h = 0; h < H; ++h) {
    m[h] = -INFINITY;
    l[h] = z[h] = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[h][e] = 0.0f;
  }
  const int32_t* block_row = p.block_table + static_cast<int64_t>(seq) * p.max_blocks_per_seq;
  const uint32_t key_mask = (1u << L.key_bits) - 1u;
  for (int base = lo + warp * 32; base < hi; base += kGenericWarps * 32) {
    // Scores: lane j, token base + j.
    const int t = base + lane;
    const uint8_t* slot = nullptr;
    if (t < hi) {
      const int64_t block = block_row[t / block_size];
      if (block >= 0 && block < p.cache.num_blocks) slot = slot_address(p.cache, block, t % block_size, kv_head);
    }
    const unsigned valid = __ballot_sync(device::kFullMask, slot != nullptr);
    if (valid == 0) continue;  // warp-uniform: the tile's blocks are all outside the cache
    float s[H], vscale = 0.0f, vzero = 0.0f;
#pragma unroll
    for (int h = 0; h < H; ++h) s[h] = 0.0f;
    if (slot != nullptr) {
#pragma unroll 2
      for (int g = 0; g < d / 8; ++g) {
        float k8[8];
        if (fp8) {
          const uint16_t* pairs = reinterpret_cast<const uint16_t*>(slot) + 4 * g;
#pragma unroll
          for (int r = 0; r < 8; r += 2) {
            const uint16_t two = pairs[r / 2];
            k8[r] = fp8_e4m3_to_float(static_cast<uint8_t>(two & 0xff));
            k8[r + 1] = fp8_e4m3_to_float(static_cast<uint8_t>(two >> 8));
          }
        } else {
          const uint32_t word = key_group_word(slot, g, L.key_bits);
#pragma unroll
          for (int r = 0; r < 8; ++r) k8[r] = centroid[(word >> (r * L.key_bits)) & key_mask];
        }
#pragma unroll
        for (int h = 0; h < H; ++h) {
          if (h < heads) {
            const float4 a = *reinterpret_cast<const float4*>(q + h * d + 8 * g);
            const float4 b = *reinterpret_cast<const float4*>(q + h * d + 8 * g + 4);
            s[h] += a.x * k8[0] + a.y * k8[1] + a.z * k8[2] + a.w * k8[3] + b.x * k8[4] + b.y * k8[5] + b.z * k8[6] +
                    b.w * k8[7];
          }
        }
      }
      const float norm = fp8 ? 1.0f : half_field(slot, L.key_norm_offset);
#pragma unroll
      for (int h = 0; h < H; ++h) s[h] = softcap_logit(p.scale * (s[h] * norm), p.softcap);
      vscale = half_field(slot, L.value_scale_offset);
      vzero = half_field(slot, L.value_zero_offset);
    }
    float w[H];  // e^(s - m) * scale of this lane's token
#pragma unroll
    for (int h = 0; h < H; ++h) {
      if (h < heads) {
        const float tile_max = device::group_max(slot != nullptr ? s[h] : -INFINITY);
        const float m_new = fmaxf(m[h], tile_max);
        const float correction = m_new == -INFINITY ? 1.0f : __expf(m[h] - m_new);  // 0 while m = -inf
        const float weight = slot != nullptr ? __expf(s[h] - m_new) : 0.0f;
        l[h] = l[h] * correction + weight;
        z[h] = z[h] * correction + weight * vzero;
        w[h] = weight * vscale;
#pragma unroll
        for (int e = 0; e < E; ++e) acc[h][e] *= correction;
        m[h] = m_new;
      }
    }
    // Values: the lanes take the dims and the tile's tokens in batches of B, every code of a batch
    // loaded before any is used (B x E loads in flight rather than one token's). A lane without a
    // token lends the first one's slot at weight 0, so a batch needs no per-token test.
    constexpr int B = generic_token_batch(E);
    const uintptr_t own = reinterpret_cast<uintptr_t>(slot);
    const uintptr_t lent = shfl_address(own, __ffs(valid) - 1);
    const uintptr_t address = slot != nullptr ? own : lent;
    const int tokens = 32 - __clz(valid);  // none past the last valid lane
    for (int j0 = 0; j0 < tokens; j0 += B) {
      float code[B][E];
#pragma unroll
      for (int u = 0; u < B; ++u) {
        const uint8_t* field = reinterpret_cast<const uint8_t*>(shfl_address(address, (j0 + u) & 31)) + L.value_data_offset;
#pragma unroll
        for (int e = 0; e < E; ++e) {
          const int i = lane + 32 * e;
          code[u][e] = i < d ? static_cast<float>(unpack_index(field, i, L.value_bits)) : 0.0f;
        }
      }
#pragma unroll
      for (int u = 0; u < B; ++u) {
#pragma unroll
        for (int h = 0; h < H; ++h) {
          if (h < heads) {  // a token past the tile's last (j0 + u >= tokens) repeats one at weight 0
            const float wj = j0 + u < tokens ? __shfl_sync(device::kFullMask, w[h], (j0 + u) & 31) : 0.0f;
#pragma unroll
            for (int e = 0; e < E; ++e) acc[h][e] = fmaf(wj, code[u][e], acc[h][e]);
          }
        }
      }
    }
  }

  // The warps' states (the lanes' sums added up), then merged per head; split 0 adds the head's
  // sink to its denominator.
  float* my_acc = warp_acc + warp * H * d;
#pragma unroll
  for (int h = 0; h < H; ++h) {
    if (h < heads) {
      l[h] = device::group_sum(l[h]);
      z[h] = device::group_sum(z[h]);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        if (lane + 32 * e < d) my_acc[h * d + lane + 32 * e] = acc[h][e] + z[h];
      }
      if (lane == 0) {
        warp_max[warp * H + h] = m[h];
        warp_sum[warp * H + h] = l[h];
      }
    }
  }
  // key_offset's shift of each head's log-sum-exp (key_offset_lse_shift), for the partial ones below.
  __shared__ float lse_shift[H];
  if (splits > 1 && p.key_offset != nullptr) {  // CTA-uniform
    for (int h = warp; h < heads; h += kGenericWarps) {
      const float shift =
          device::key_offset_lse_shift(query + h * d, p.key_offset + static_cast<int64_t>(kv_head) * d, d, p.scale, lane);
      if (lane == 0) lse_shift[h] = shift;
    }
  }
  __syncthreads();
  const bool sink = p.sinks != nullptr && split == 0;
  if (threadIdx.x < heads) {
    const int h = threadIdx.x;
    float total_max = warp_max[h];
    for (int w = 1; w < kGenericWarps; ++w) total_max = fmaxf(total_max, warp_max[w * H + h]);
    const float sink_logit = sink ? p.sinks[head0 + h] : -INFINITY;
    const float merged_max = fmaxf(total_max, sink_logit);
    float total = sink ? __expf(sink_logit - merged_max) : 0.0f;
    for (int w = 0; w < kGenericWarps; ++w) {
      const float weight = warp_max[w * H + h] == -INFINITY ? 0.0f : __expf(warp_max[w * H + h] - merged_max);
      merge_weight[w * H + h] = weight;
      total += warp_sum[w * H + h] * weight;
    }
    merge_inverse[h] = total > 0.0f ? 1.0f / total : 0.0f;
    if (splits > 1) {  // log2 domain, as the merge takes it
      const float shift = p.key_offset != nullptr ? lse_shift[h] : 0.0f;
      p.partial_lse[(out_row0 + h) * splits + split] =
          total > 0.0f ? merged_max * kLog2e + log2f(total) + shift : -INFINITY;
    }
  }
  __syncthreads();
  for (int k = threadIdx.x; k < heads * d; k += kGenericThreads) {
    const int h = k / d, i = k - h * d;
    float o = 0.0f;
#pragma unroll
    for (int w = 0; w < kGenericWarps; ++w) o += warp_acc[(w * H + h) * d + i] * merge_weight[w * H + h];
    o *= merge_inverse[h];
    const int64_t out_row = out_row0 + h;
    if (splits == 1) {
      // value_offset for a row that attended to something (merge_inverse 0: none)
      const float* offset = p.value_offset != nullptr && merge_inverse[h] != 0.0f
                                ? p.value_offset + static_cast<int64_t>(kv_head) * d
                                : nullptr;
      static_cast<T*>(p.out)[out_row * d + i] = device::from_float<T>(device::with_value_offset(o, offset, i));
    } else {
      p.partial_out[(out_row * splits + split) * d + i] = o;
    }
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

// The generic decode's instantiations by the head dims a lane holds: E = 4 up to D = 128, 8 up to
// 256, 32 up to kMaxHeadDim; each serves generic_heads_per_cta(E) query heads a CTA.
int generic_dims_per_lane(int d) { return d <= 128 ? 4 : d <= 256 ? 8 : 32; }

template <class Launch>
void by_dims_per_lane(int d, const Launch& launch) {
  switch (generic_dims_per_lane(d)) {
    case 4: launch(std::integral_constant<int, 4>{}); break;
    case 8: launch(std::integral_constant<int, 8>{}); break;
    default: launch(std::integral_constant<int, 32>{}); break;
  }
}

// Dynamic shared memory stays under the 48 KB that needs no opt-in at every head dim up to
// kMaxHeadDim (1024): the store and dequantize 2 x 4 x D floats (32 KB); decode (1 + 4) x heads x D
// floats, heads x D <= 1024 (20 KB), and 13 per head.
int vector_smem_bytes(int d) { return kGenericWarps * 2 * d * static_cast<int>(sizeof(float)); }
int decode_smem_bytes(int d) {
  const int heads = generic_heads_per_cta(generic_dims_per_lane(d));
  return ((1 + kGenericWarps) * heads * d + (3 * kGenericWarps + 1) * heads) * static_cast<int>(sizeof(float));
}

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

int decode_generic_head_slices(const DecodeParams& p) {
  const int group = p.num_q_heads / p.cache.num_kv_heads;
  const int heads = generic_heads_per_cta(generic_dims_per_lane(p.layout.head_dim));
  return p.cache.num_kv_heads * ((group + heads - 1) / heads);
}

cudaError_t launch_decode_generic(const DecodeParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(decode_generic_query_chunks(p)), static_cast<unsigned>(decode_generic_head_slices(p)),
                  static_cast<unsigned>(p.num_splits));
  const int d = p.layout.head_dim, smem = decode_smem_bytes(d);
  const HadamardFactors f = hadamard_factors(d);
  const cudaError_t err = by_element_type(p.dtype, false, [&](auto element) {
    by_dims_per_lane(d, [&](auto dims_per_lane) {
      decode_generic_kernel<decltype(element), decltype(dims_per_lane)::value>
          <<<grid, kGenericThreads, smem, stream>>>(p, f, rsqrt_head_dim(d));
    });
  });
  if (err != cudaSuccess || p.num_splits == 1) return err;
  return launch_decode_merge(p, stream);
}

}  // namespace turboquant
