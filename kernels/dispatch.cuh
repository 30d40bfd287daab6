// Runtime (element type, head_dim, key format) -> compile-time kernel parameters, for the
// one-warp-per-slot kernels (store, dequantize) and the decode (which adds the bit widths). The
// single list of head dims the kernels are built for.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "launchers.h"

namespace turboquant {

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
