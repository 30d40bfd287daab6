// How fast can a decode CTA *read* a packed paged cache in the decode kernel's access pattern,
// with no attention math? Standalone (CUDA runtime only), the decode's data-movement ceiling:
//
//   nvcc -O3 -std=c++17 -arch=sm_90 tools/probes/paged_read_probe.cu -o /tmp/probe && /tmp/probe
//
// Same grid and tiling as kernels/decode.cu: one 8-warp CTA per (sequence, KV head, split), each
// warp takes 16-token tiles (tile k -> warp k % 8), every tile is 16 slots of `slot` bytes at a
// stride of the token row. Variants: how a tile gets on chip (one TMA bulk copy per token row
// into a per-warp ring on mbarriers, 16-byte cp.async by every lane, or plain 16-byte loads into
// registers), whether the block id is a dependent load at issue time or prefetched a window ahead,
// random vs identity block table, token- vs head-major cache, shared memory footprint (occupancy).
// Each variant only XORs what it read into a sink, so the time is the data movement alone.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "probe_check.h"

enum Mechanism { kBulkPerRow = 0, kCpAsync16 = 1, kLdg16 = 2 };
constexpr int kWarps = 8, kTile = 16, kStages = 3;

struct Probe {
  const uint8_t* data;
  int64_t span, stride_block, stride_token, stride_head;
  const int32_t* block_table;
  int blocks_per_seq, seq_len, slot, num_splits, num_blocks, chunks, row_bytes;
  unsigned* sink;
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n@!done bra WAIT;\n}\n" ::"r"(
          smem_u32(bar)),
      "r"(parity)
      : "memory");
}

template <int MECH, bool PREFETCH_IDS>
__global__ void __launch_bounds__(256) probe_kernel(const Probe p) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int kv_head = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
  const int per_split = ((p.seq_len + p.num_splits - 1) / p.num_splits + kTile - 1) / kTile * kTile;
  const int begin = split * per_split, end = min(begin + per_split, p.seq_len);
  const int num_tiles = end > begin ? (end - begin + kTile - 1) / kTile : 0;
  const int my_tiles = warp < num_tiles ? (num_tiles - warp + kWarps - 1) / kWarps : 0;
  const int stage_bytes = kTile * p.row_bytes;
  uint8_t* ring = smem + warp * kStages * stage_bytes;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + kWarps * kStages * stage_bytes) + warp * kStages;
  const int32_t* block_row = p.block_table + static_cast<int64_t>(b) * p.blocks_per_seq;
  const int64_t head_offset = kv_head * p.stride_head;
  auto tile_token = [&](int local) { return begin + (warp + local * kWarps) * kTile; };
  // Prefetched block ids: lane i holds the block of local tile 32*w + i (window w), next window too.
  int ids_cur = 0, ids_next = 0;
  auto load_ids = [&](int window) {
    const int local = window * 32 + lane;
    return local < my_tiles ? block_row[tile_token(local) / 16] : 0;  // block_size 16
  };
  if (PREFETCH_IDS) {
    ids_cur = load_ids(0);
    ids_next = load_ids(1);
  }
  auto block_of = [&](int local) -> int64_t {
    if (PREFETCH_IDS) return __shfl_sync(0xffffffffu, ids_cur, local & 31);  // window rotated by the caller
    return block_row[tile_token(local) / 16];
  };
  auto row_first = [&](int64_t block, int t0, int r, bool* ok) -> int64_t {
    const int64_t slot = block * p.stride_block + (t0 % 16 + r) * p.stride_token + head_offset;
    *ok = t0 + r < end;
    return slot & ~int64_t(15);
  };
  unsigned acc = 0;

  if (MECH == kLdg16) {
    const int r = lane & 15, half = lane >> 4;
    for (int it = 0; it < my_tiles; ++it) {
      if (PREFETCH_IDS && (it & 31) == 0 && it > 0) {
        ids_cur = ids_next;
        ids_next = load_ids((it >> 5) + 1);
      }
      const int t0 = tile_token(it);
      bool ok;
      const int64_t first = row_first(block_of(it), t0, r, &ok);
      if (ok) {
#pragma unroll 4
        for (int ch = half; ch < p.chunks; ch += 2) {
          if (first + ch * 16 < p.span) {
            const uint4 v = __ldg(reinterpret_cast<const uint4*>(p.data + first + ch * 16));
            acc ^= v.x ^ v.y ^ v.z ^ v.w;
          }
        }
      }
    }
  } else {
    if (lane < kStages) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_u32(bars + lane)));
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    __syncwarp();
    auto issue = [&](int local, int stage) {
      const int t0 = tile_token(local);
      const int64_t block = block_of(local);
      uint8_t* dst = ring + stage * stage_bytes;
      if (MECH == kBulkPerRow) {
        const int r = lane & 15;
        bool ok;
        const int64_t first = row_first(block, t0, r, &ok);
        const int64_t left = p.span - first;
        const uint32_t bytes = (lane < 16 && ok) ? static_cast<uint32_t>(left < p.chunks * 16 ? left : int64_t(p.chunks) * 16) : 0u;
        uint32_t total = bytes;
        for (int off = 8; off > 0; off >>= 1) total += __shfl_xor_sync(0xffffffffu, total, off);
        uint64_t* bar = bars + stage;
        if (lane == 0)
          asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(total) : "memory");
        __syncwarp();
        if (bytes > 0)
          asm volatile(
              "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                  smem_u32(dst + r * p.row_bytes)),
              "l"(p.data + first), "r"(bytes), "r"(smem_u32(bar))
              : "memory");
      } else {
        for (int idx = lane; idx < kTile * p.chunks; idx += 32) {
          const int r = idx / p.chunks, ch = idx % p.chunks;
          bool ok;
          const int64_t src = row_first(block, t0, r, &ok) + ch * 16;
          const int n = ok && src < p.span ? 16 : 0;
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst + r * p.row_bytes + ch * 16)),
                       "l"(p.data + (n ? src : 0)), "r"(n)
                       : "memory");
        }
        asm volatile("cp.async.commit_group;\n" ::: "memory");
      }
    };
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < my_tiles) issue(s, s);
      else if (MECH == kCpAsync16) asm volatile("cp.async.commit_group;\n" ::: "memory");
    }
    for (int it = 0; it < my_tiles; ++it) {
      const int next = it + kStages - 1;
      if (PREFETCH_IDS && (next & 31) == 0 && next > 0) {  // window of `next` begins: rotate
        ids_cur = ids_next;
        ids_next = load_ids((next >> 5) + 1);
      }
      if (next < my_tiles) issue(next, next % kStages);
      else if (MECH == kCpAsync16) asm volatile("cp.async.commit_group;\n" ::: "memory");
      if (MECH == kBulkPerRow) {
        mbar_wait(bars + it % kStages, (it / kStages) & 1);
      } else {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 1) : "memory");
      }
      __syncwarp();
      const uint32_t* words = reinterpret_cast<const uint32_t*>(ring + (it % kStages) * stage_bytes);
#pragma unroll 4
      for (int r = 0; r < kTile; ++r) acc ^= words[r * (p.row_bytes / 4) + lane % (p.row_bytes / 4)];
      __syncwarp();
    }
  }
  if (acc == 0x12345679u) p.sink[0] = acc;  // never true in practice; keeps the loads alive
}

struct Variant {
  const char* name;
  int mech;
  bool prefetch;
  bool random_table;
  bool head_major;
  int slot;
  int splits;
  int smem_kb;  // dynamic shared memory per CTA (occupancy knob); 0: what the ring needs
};

int main() {
  const int B = 32, Hkv = 8, L = 8192;
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int64_t max_slot = 256;
  const int64_t num_blocks = int64_t(B) * (L / 16);
  const int64_t span = num_blocks * 16 * Hkv * max_slot + 4096;
  uint8_t* data;
  CHECK(cudaMalloc(&data, span));
  CHECK(cudaMemset(data, 0x5a, span));
  unsigned* sink;
  CHECK(cudaMalloc(&sink, 16));
  std::vector<int32_t> random_ids(num_blocks), identity_ids(num_blocks);
  std::iota(identity_ids.begin(), identity_ids.end(), 0);
  random_ids = identity_ids;
  std::shuffle(random_ids.begin(), random_ids.end(), std::mt19937(0));
  int32_t *d_random, *d_identity;
  CHECK(cudaMalloc(&d_random, num_blocks * 4));
  CHECK(cudaMalloc(&d_identity, num_blocks * 4));
  CHECK(cudaMemcpy(d_random, random_ids.data(), num_blocks * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_identity, identity_ids.data(), num_blocks * 4, cudaMemcpyHostToDevice));

  cudaEvent_t t0, t1;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));
  auto time_ms = [&](auto&& launch) {
    for (int i = 0; i < 3; ++i) launch();
    CHECK(cudaEventRecord(t0));
    const int reps = 20;
    for (int i = 0; i < reps; ++i) launch();
    CHECK(cudaEventRecord(t1));
    CHECK(cudaEventSynchronize(t1));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, t0, t1));
    return ms / reps;
  };
  // Copy bandwidth (read + write) on 1 GiB, the same yardstick as benchmarks/timing.py.
  const size_t copy_bytes = size_t(1) << 30;
  uint8_t *a, *c;
  CHECK(cudaMalloc(&a, copy_bytes));
  CHECK(cudaMalloc(&c, copy_bytes));
  const float copy_ms = time_ms([&] { CHECK(cudaMemcpyAsync(c, a, copy_bytes, cudaMemcpyDeviceToDevice)); });
  const double copy_gbs = 2.0 * copy_bytes / (copy_ms * 1e-3) / 1e9;
  CHECK(cudaFree(a));
  CHECK(cudaFree(c));
  std::printf("%s, %d SMs; copy %.0f GB/s (read+write); shape B=%d Hkv=%d L=%d, block_size 16\n", prop.name,
              prop.multiProcessorCount, copy_gbs, B, Hkv, L);
  std::printf("| variant | slot B | splits | smem KB | CTAs/SM | us | GB/s useful | %% copy |\n|---|---|---|---|---|---|---|---|\n");

  const Variant variants[] = {
      {"bulk/row, dependent ids (as decode.cu)", kBulkPerRow, false, true, false, 134, 3, 100},
      {"bulk/row, dependent ids, identity table", kBulkPerRow, false, false, false, 134, 3, 100},
      {"bulk/row, prefetched ids", kBulkPerRow, true, true, false, 134, 3, 100},
      {"bulk/row, prefetched ids, ring-only smem", kBulkPerRow, true, true, false, 134, 3, 0},
      {"bulk/row, prefetched ids, 48 KB (4 CTAs/SM)", kBulkPerRow, true, true, false, 134, 3, 48},
      {"bulk/row, prefetched ids, head-major", kBulkPerRow, true, true, true, 134, 3, 100},
      {"bulk/row, prefetched ids, slot 196 (k8v4)", kBulkPerRow, true, true, false, 196, 3, 100},
      {"bulk/row, prefetched ids, splits 6", kBulkPerRow, true, true, false, 134, 6, 100},
      {"cp.async 16B, dependent ids", kCpAsync16, false, true, false, 134, 3, 100},
      {"cp.async 16B, prefetched ids", kCpAsync16, true, true, false, 134, 3, 100},
      {"cp.async 16B, prefetched ids, ring-only smem", kCpAsync16, true, true, false, 134, 3, 0},
      {"ldg 16B, dependent ids", kLdg16, false, true, false, 134, 3, 0},
      {"ldg 16B, prefetched ids", kLdg16, true, true, false, 134, 3, 0},
      {"ldg 16B, prefetched ids, 100 KB smem", kLdg16, true, true, false, 134, 3, 100},
  };
  for (const Variant& v : variants) {
    Probe p{};
    p.data = data;
    p.span = span;
    p.slot = v.slot;
    p.stride_head = v.head_major ? 16 * v.slot : v.slot;
    p.stride_token = v.head_major ? v.slot : int64_t(Hkv) * v.slot;
    p.stride_block = int64_t(16) * Hkv * v.slot;
    p.block_table = v.random_table ? d_random : d_identity;
    p.blocks_per_seq = L / 16;
    p.seq_len = L;
    p.num_splits = v.splits;
    p.num_blocks = static_cast<int>(num_blocks);
    p.chunks = (14 + v.slot + 15) / 16;
    p.row_bytes = ((p.chunks % 2 == 0) ? p.chunks + 1 : p.chunks) * 16;
    p.sink = sink;
    const int ring = kWarps * kStages * kTile * p.row_bytes + kWarps * kStages * 8;
    const int smem = v.mech == kLdg16 && v.smem_kb == 0 ? 0 : std::max(ring, v.smem_kb * 1024);
    void (*kernel)(Probe) = nullptr;
    if (v.mech == kBulkPerRow) kernel = v.prefetch ? probe_kernel<kBulkPerRow, true> : probe_kernel<kBulkPerRow, false>;
    if (v.mech == kCpAsync16) kernel = v.prefetch ? probe_kernel<kCpAsync16, true> : probe_kernel<kCpAsync16, false>;
    if (v.mech == kLdg16) kernel = v.prefetch ? probe_kernel<kLdg16, true> : probe_kernel<kLdg16, false>;
    CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    int per_sm = 0;
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 256, smem));
    const dim3 grid(Hkv, v.splits, B);
    const float ms = time_ms([&] {
      kernel<<<grid, 256, smem>>>(p);
      CHECK(cudaGetLastError());
    });
    const double useful = double(B) * Hkv * L * v.slot;
    const double gbs = useful / (ms * 1e-3) / 1e9;
    std::printf("| %s | %d | %d | %d | %d | %.1f | %.0f | %.0f%% |\n", v.name, v.slot, v.splits, smem / 1024, per_sm,
                ms * 1e3, gbs, 100.0 * gbs / copy_gbs);
  }
  return 0;
}
