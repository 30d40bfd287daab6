// Properties of the current device that the launchers size their grids by.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "launchers.h"

namespace turboquant {

int device_sm_count() {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 132;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return 132;
  return sms;
}

bool device_supports_dependent_launch() {
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return false;
  return major >= 9;
}

int env_kernel_choice(const char* variable, const char* first, const char* second) {
  const char* v = std::getenv(variable);
  if (v == nullptr) return 0;
  if (std::strcmp(v, first) == 0) return 1;
  if (std::strcmp(v, second) == 0) return 2;
  std::fprintf(stderr, "turboquant: %s=%s ignored (expected %s or %s)\n", variable, v, first, second);
  return 0;
}

bool smem_carveout_max_requested() {
  static const bool requested = env_kernel_choice("TURBOQUANT_SMEM_CARVEOUT", "auto", "max") != 1;
  return requested;
}

}  // namespace turboquant
