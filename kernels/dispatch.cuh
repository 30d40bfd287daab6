// Runtime (element type, head_dim, key format, preset bit widths) -> compile-time kernel
// parameters: dispatch_slot_kernel for the dequantize, plus VisitPresetBits for the store and the
// decode, which specialize on the bit widths. The single list of head dims the kernels are built for.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>

#include "launchers.h"

namespace turboquant {

// CTAs of `threads` threads and `smem_bytes` of dynamic shared memory that fit on one SM (1 if
// the runtime cannot say).
template <class Kernel>
int resident_ctas_per_sm(Kernel kernel, int threads, int smem_bytes) {
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem_bytes) != cudaSuccess) return 1;
  return blocks > 0 ? blocks : 1;
}

constexpr int kMaxDevices = 64;  // per-device caches of the kernels' one-time set-up

// Every kernel with a shared-memory opt-in (decode, store) and the split merge prefer the SM's
// largest shared-memory carveout, the one the decode kernels need anyway; without a preference the
// driver picks one per kernel, the merge (3 KB of shared memory) a smaller one, and launching a kernel
// whose carveout preference differs from the last "may insert a device-side synchronization point"
// (CUDA driver API, cuKernelSetCacheConfig). Measured (H200, the same build
// with TURBOQUANT_SMEM_CARVEOUT=auto (the driver's choice) and =max in alternating runs, 4bit_nc,
// 32k-token tables, B = 3-8 at 256-4k tokens): graph steps 0.1-0.4 us faster in 9 of 10 (shape,
// round) pairs and 0.1 slower in one; with an exact table B=1 L=1k 10.4 -> 9.2; the kernels' own
// spans unchanged (eager steps fell from 46-50 to 25-30 us there, but were 42-46 again in a later
// call: host-bound and bimodal, not counted). Once per kernel and device;
// TURBOQUANT_SMEM_CARVEOUT=auto (read once per process) leaves the choice to the driver.
template <auto Kernel>
void prefer_max_shared_carveout() {
  static std::atomic<bool> done[kMaxDevices];
  int device = 0;
  if (!smem_carveout_max_requested() || cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices ||
      done[device].load(std::memory_order_relaxed)) {
    return;
  }
  if (cudaFuncSetAttribute(Kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared) !=
      cudaSuccess) {
    cudaGetLastError();  // a preference only: the kernel runs either way
  }
  done[device].store(true, std::memory_order_relaxed);
}

// A kernel's shared-memory opt-in and its resident CTAs per SM, once per device of the process:
// the opt-in applies to the device current when it is made, so a process that launches on
// several GPUs needs it on each. Kernel: the kernel function itself, so each instantiation keeps
// its own table; a kernel is always asked with the same threads and smem_bytes (the answer is
// cached by kernel and device only). A failed opt-in is cached too: it is a property of the
// device and the size, not a transient state.
struct KernelResidency {
  cudaError_t status;  // of the opt-in
  int per_sm;          // CTAs of `threads` that fit on one SM; 0 where the opt-in failed
};
template <auto Kernel>
KernelResidency opt_in_kernel(int threads, int smem_bytes) {
  // Per device: 0 not asked yet, > 0 the CTAs per SM, < 0 minus the opt-in's error.
  static std::atomic<int> cached[kMaxDevices];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) {
    return {cudaErrorInvalidDevice, 0};
  }
  int n = cached[device].load(std::memory_order_relaxed);
  if (n == 0) {  // two threads may both ask: they store the same answer
    prefer_max_shared_carveout<Kernel>();
    const cudaError_t status = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    if (status != cudaSuccess) cudaGetLastError();  // reported through the result, not to the next launch's check
    n = status == cudaSuccess ? resident_ctas_per_sm(Kernel, threads, smem_bytes) : -static_cast<int>(status);
    cached[device].store(n, std::memory_order_relaxed);
  }
  if (n < 0) return {static_cast<cudaError_t>(-n), 0};
  return {cudaSuccess, n};
}

// Whether the build holds sm_90 code for Kernel (sm_90 features compile to traps for older
// targets, and a PTX-only build JIT-compiled for an H200 would run those). Asked once per kernel.
template <auto Kernel>
bool kernel_built_for_sm90() {
  static const bool built = [] {
    cudaFuncAttributes attributes{};
    return cudaFuncGetAttributes(&attributes, Kernel) == cudaSuccess && attributes.ptxVersion >= 90 &&
           attributes.binaryVersion >= 90;
  }();
  return built;
}

// The launch attribute for clusters of `cluster_z` CTAs along the grid's z.
inline cudaLaunchAttribute cluster_z_attribute(int cluster_z) {
  cudaLaunchAttribute a = {};
  a.id = cudaLaunchAttributeClusterDimension;
  a.val.clusterDim.x = 1;
  a.val.clusterDim.y = 1;
  a.val.clusterDim.z = static_cast<unsigned>(cluster_z);
  return a;
}

// Whether the device can run clusters of kClusterZ CTAs (grid z) of Kernel (opted in already,
// `threads` and `smem_bytes` as always): an sm_90 or later device, sm_90 code in the build, and
// room for a whole cluster on one GPC. Asked once per device.
template <auto Kernel, int kClusterZ>
bool cluster_launch_fits(int threads, int smem_bytes) {
  static std::atomic<int> cached[kMaxDevices];  // 0 not asked yet, 1 fits, 2 does not
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) return false;
  int answer = cached[device].load(std::memory_order_relaxed);
  if (answer == 0) {
    answer = 2;
    if (device_supports_dependent_launch() && kernel_built_for_sm90<Kernel>()) {
      cudaLaunchConfig_t config = {};
      config.gridDim = dim3(1, 1, kClusterZ);
      config.blockDim = dim3(threads);
      config.dynamicSmemBytes = smem_bytes;
      cudaLaunchAttribute cluster = cluster_z_attribute(kClusterZ);
      config.attrs = &cluster;
      config.numAttrs = 1;
      int clusters = 0;
      const cudaError_t status = cudaOccupancyMaxActiveClusters(&clusters, Kernel, &config);
      if (status != cudaSuccess) cudaGetLastError();  // a refusal is an answer, not an error for the next launch
      answer = status == cudaSuccess && clusters > 0 ? 1 : 2;
    }
    cached[device].store(answer, std::memory_order_relaxed);
  }
  return answer == 1;
}

// Calls launch.run<T, D, kFp8Key>(); unsupported combinations give cudaErrorInvalidValue (the
// glue checks cuda_supports_head_dim first and raises a clear error).
template <typename T, class Launch>
cudaError_t dispatch_head_dim(const SlotLayout& layout, const Launch& launch) {
  const bool fp8 = layout.key_format == KeyFormat::kFp8;
  switch (layout.head_dim) {
    case 64: return fp8 ? launch.template run<T, 64, true>() : launch.template run<T, 64, false>();
    case 96: return fp8 ? launch.template run<T, 96, true>() : cudaErrorInvalidValue;  // no Sylvester H_96
    case 128: return fp8 ? launch.template run<T, 128, true>() : launch.template run<T, 128, false>();
    case 256: return fp8 ? launch.template run<T, 256, true>() : launch.template run<T, 256, false>();
    default: return cudaErrorInvalidValue;
  }
}

// The preset's bit widths made compile-time on top of dispatch_head_dim: calls
// visit.run<T, D, kKeyBits, kValueBits>() with kKeyBits 8 for FP8 keys. The presets of SPEC §2:
// k8v4, 4bit_nc (4, 4), k3v4_nc (3, 4), 3bit_nc (3, 3).
template <class Visit>
struct VisitPresetBits {
  const SlotLayout& layout;
  const Visit& visit;
  template <typename T, int D, bool kFp8Key>
  cudaError_t run() const {
    if constexpr (kFp8Key) {
      if (layout.value_bits == 4) return visit.template run<T, D, 8, 4>();
    } else {
      if (layout.key_bits == 4 && layout.value_bits == 4) return visit.template run<T, D, 4, 4>();
      if (layout.key_bits == 3 && layout.value_bits == 4) return visit.template run<T, D, 3, 4>();
      if (layout.key_bits == 3 && layout.value_bits == 3) return visit.template run<T, D, 3, 3>();
    }
    return cudaErrorInvalidValue;
  }
};

template <class Launch>
cudaError_t dispatch_slot_kernel(ElementType dtype, const SlotLayout& layout, const Launch& launch) {
  switch (dtype) {
    case ElementType::kHalf: return dispatch_head_dim<__half>(layout, launch);
    case ElementType::kBFloat16: return dispatch_head_dim<__nv_bfloat16>(layout, launch);
    case ElementType::kFloat: return dispatch_head_dim<float>(layout, launch);
  }
  return cudaErrorInvalidValue;
}

}  // namespace turboquant
