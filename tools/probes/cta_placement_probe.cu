// Where do a grid's CTAs run, and what do CTAs with no work cost the ones with work? Standalone
// (CUDA runtime only), the evidence behind the per-head kernel's serving-table split rule:
//
//   nvcc -O3 -std=c++17 -arch=sm_90 tools/probes/cta_placement_probe.cu -o /tmp/cta && /tmp/cta
//
// Why: the per-head decode kernel with a serving engine's 32k-token block tables launches a grid
// of 8 KV heads x 33 splits (two CTAs per SM), and a B = 1 sequence of 16k tokens gives work to
// the first 16 splits only (the 128 CTAs first in launch order); the other 136 leave at once. Its
// decode kernel took 18.1 us where a grid of exactly those 128 CTAs took 12.5 (H200,
// decode_breakdown.py --table-tokens 32768). This probe launches grids of the same shape, 256
// threads and the same shared memory per CTA, where busy CTAs run a fixed amount of work (ALU
// only, or streaming reads that mostly hit the L2 after the first run) and the others exit, and
// prints the kernel's duration (median of 20 runs) and, from the last run, how many SMs the busy
// CTAs landed on and how many of them held two busy CTAs (every grid here fits one wave, so CTAs
// on one SM ran side by side).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <map>
#include <vector>

#include "probe_check.h"

struct Record {
  unsigned smid;
  unsigned busy;
  unsigned long long start, end;
};

__device__ unsigned smid() {
  unsigned id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}
__device__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// busy_first: CTAs 0 .. busy-1 in launch order (x fastest, then y, then z) have work; else the
// even ones 0, 2, ..., 2 (busy - 1). mode 0: `work` rounds of dependent FMAs per thread;
// mode 1: the CTA streams `work` 16-byte vectors per thread from its own stretch of `data`.
__global__ void __launch_bounds__(256, 2) probe(Record* records, int busy, int busy_first, int mode, int work,
                                                const uint4* data, unsigned* sink) {
  extern __shared__ uint4 smem[];
  const unsigned long long start = global_ns();
  const int cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const bool has_work = busy_first ? cta < busy : (cta % 2 == 0 && cta / 2 < busy);
  unsigned acc = threadIdx.x;
  if (has_work) {
    if (mode == 0) {
      float a = threadIdx.x * 1e-3f, b = 1.0001f;
      for (int i = 0; i < work; ++i) {
        a = fmaf(a, b, 0.5f);
        b = fmaf(b, a, -0.25f);
      }
      acc ^= __float_as_uint(a + b);
    } else {
      const int item = busy_first ? cta : cta / 2;
      const uint4* mine = data + static_cast<size_t>(item) * work * 256;
      for (int i = 0; i < work; ++i) {
        const uint4 v = mine[i * 256 + threadIdx.x];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
      }
    }
    smem[threadIdx.x] = make_uint4(acc, 0, 0, 0);  // touch shared memory so it is really allocated
    __syncthreads();
    acc ^= smem[(threadIdx.x + 1) & 255].x;
  }
  if (acc == 0x12345678u) sink[0] = acc;
  if (threadIdx.x == 0) records[cta] = {smid(), has_work ? 1u : 0u, start, global_ns()};
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int smem = 100 * 1024;  // two per SM (the decode kernel's occupancy), not three
  CHECK(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, probe, 256, smem));
  const int max_ctas = 8 * 64;
  Record* records;
  unsigned* sink;
  uint4* data;
  const int max_vectors = 64;  // per thread in mode 1
  CHECK(cudaMalloc(&records, max_ctas * sizeof(Record)));
  CHECK(cudaMalloc(&sink, 4));
  CHECK(cudaMalloc(&data, static_cast<size_t>(max_ctas) * max_vectors * 256 * sizeof(uint4)));
  CHECK(cudaMemset(data, 1, static_cast<size_t>(max_ctas) * max_vectors * 256 * sizeof(uint4)));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  std::printf("%d SMs, %d CTAs of 256 threads and %d KB shared memory per SM\n\n", sms, per_sm, smem / 1024);
  std::printf("| grid (x,y,z) | busy CTAs | order | work | kernel us (events, median of 20) | busy span us (first start .. last end) | SMs with busy CTAs | SMs with 2 busy | busy CTA us min / median / max |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  struct Case { int z, busy, first, mode, work; };
  std::vector<Case> cases;
  for (int mode : {0, 1}) {
    const int work = mode == 0 ? 20000 : 48;
    cases.push_back({16, 128, 1, mode, work});
    cases.push_back({33, 264, 1, mode, work / 2});
    for (int first : {1, 0}) {
      cases.push_back({33, 128, first, mode, work});
      cases.push_back({33, 64, first, mode, work});
    }
  }
  for (const Case& c : cases) {
    const dim3 grid(8, 1, c.z);
    const int ctas = 8 * c.z;
    if (ctas > sms * per_sm) {  // the per-SM counts below assume one wave
      std::printf("grid of %d CTAs does not fit one wave of %d\n", ctas, sms * per_sm);
      return 1;
    }
    CHECK(cudaMemset(records, 0, ctas * sizeof(Record)));
    std::vector<float> times;
    std::vector<Record> host(ctas);
    for (int rep = 0; rep < 21; ++rep) {
      CHECK(cudaEventRecord(e0));
      probe<<<grid, 256, smem>>>(records, c.busy, c.first, c.mode, c.work, data, sink);
      CHECK(cudaGetLastError());
      CHECK(cudaEventRecord(e1));
      CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (rep > 0) times.push_back(ms * 1000.f);
    }
    CHECK(cudaMemcpy(host.data(), records, ctas * sizeof(Record), cudaMemcpyDeviceToHost));
    std::sort(times.begin(), times.end());
    std::map<unsigned, int> busy_per_sm;
    unsigned long long first = ~0ull, last = 0;
    std::vector<double> busy_us;
    for (const Record& r : host) {
      if (!r.busy) continue;
      ++busy_per_sm[r.smid];
      first = std::min(first, r.start);
      last = std::max(last, r.end);
      busy_us.push_back((r.end - r.start) * 1e-3);
    }
    int doubled = 0;
    for (const auto& kv : busy_per_sm) doubled += kv.second > 1;
    std::sort(busy_us.begin(), busy_us.end());
    std::printf("| (8,1,%d) | %d | %s | %s %d | %.1f | %.1f | %zu | %d | %.1f / %.1f / %.1f |\n", c.z, c.busy,
                c.first ? "first" : "even", c.mode == 0 ? "fma" : "read", c.work, times[times.size() / 2],
                (last - first) * 1e-3, busy_per_sm.size(), doubled, busy_us.front(), busy_us[busy_us.size() / 2],
                busy_us.back());
  }
  // Where launch order puts CTAs: the SM of each of the first 40 CTAs of the (8,1,33) grid, last run.
  std::printf("\nSM of CTAs 0..39 in launch order, the last case's grid:");
  std::vector<Record> host(8 * 33);
  CHECK(cudaMemcpy(host.data(), records, host.size() * sizeof(Record), cudaMemcpyDeviceToHost));
  for (int i = 0; i < 40; ++i) std::printf(" %u", host[i].smid);
  std::printf("\n");
  return 0;
}
