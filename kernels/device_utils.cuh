// Device helpers shared by the kernels: element conversion, reductions and the Walsh-Hadamard
// transform over groups of lanes (the whole warp or a power-of-two part of it), and thin
// wrappers over PTX (mma, movmatrix, fp8 cvt, cp.async).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "turboquant/numeric.h"
#include "turboquant/quantize.h"

namespace turboquant {
namespace device {

constexpr unsigned kFullMask = 0xffffffffu;

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }

template <typename T>
__device__ __forceinline__ T from_float(float v);
// Outputs: finite results past the fp16 range saturate (clamp_to_half_range), as on the CPU.
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(clamp_to_half_range(v)); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }

// The per-head transforms of a decode (DecodeParams::key_scale, value_offset; csrc/kv_transform.h):
// the fp32 [head_dim] vector of `vectors` ([num_kv_heads, head_dim]) for output row `row` (query
// row * num_q_heads + query head: its KV head is the query head / group), or null where the decode
// has none. Asked once per column, not per element.
__device__ __forceinline__ const float* head_vector_of_row(const float* vectors, int64_t row, int num_q_heads,
                                                           int group, int head_dim) {
  if (vectors == nullptr) return nullptr;
  return vectors + static_cast<int64_t>(static_cast<int>(row % num_q_heads) / group) * head_dim;
}
// A final output element in the original basis: out + value_offset[d], where `offset` is the row's
// vector (null for none, and for a row that attended to nothing: its output stays 0). Adding 0.0f
// instead would turn a -0 output into +0.
__device__ __forceinline__ float with_value_offset(float out, const float* offset, int d) {
  return offset != nullptr ? out + offset[d] : out;
}

// Programmatic dependent launch (sm_90+; no-ops elsewhere and for a grid launched without it).
// A primary grid's CTAs allow the dependent grid to be scheduled once they no longer need their
// SM to themselves; the dependent waits for the primary's completion and the visibility of its
// writes before it reads them.
__device__ __forceinline__ void allow_dependent_grid_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_primary_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Reductions over aligned groups of G lanes (G a power of two up to 32; G = 32 is the warp):
// every lane of the group gets the result. All 32 lanes must call them.
template <int G = 32>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int off = G / 2; off > 0; off >>= 1) v = v + __shfl_xor_sync(kFullMask, v, off);
  return v;
}
template <int G = 32>
__device__ __forceinline__ float group_min(float v) {
#pragma unroll
  for (int off = G / 2; off > 0; off >>= 1) v = fminf(v, __shfl_xor_sync(kFullMask, v, off));
  return v;
}
template <int G = 32>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
  for (int off = G / 2; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, off));
  return v;
}

// Sum of squares of a vector held E elements per lane by a group of G lanes, in the order of
// sum_of_squares_lane_order (quantize.h, G = vector_lanes(n)), so CPU and GPU agree bit for bit.
template <int E, int G>
__device__ __forceinline__ float group_sum_of_squares(const float (&x)[E]) {
  float s = 0.0f;
#pragma unroll
  for (int j = 0; j < E; ++j) s = fma_rn(x[j], x[j], s);
  return group_sum<G>(s);
}

// Unnormalized Walsh-Hadamard transform of a vector of G*E elements held by a group of G lanes,
// lane i of the group holding [i*E, (i+1)*E). Same stage order and the same (a + b, a - b)
// butterflies as fwht_inplace, so the results are bit-identical.
template <int E, int G = 32>
__device__ __forceinline__ void group_fwht(float (&x)[E], int lane) {
#pragma unroll
  for (int h = 1; h < E; h <<= 1) {
#pragma unroll
    for (int j = 0; j < E; ++j) {
      if ((j & h) == 0) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
#pragma unroll
  for (int m = 1; m < G; m <<= 1) {
    // Upper lanes keep a - b = fma(b, -1, a), lower lanes a + b = fma(a, 1, b): one rounding
    // each, the same results as the two branches, in one FFMA instead of two adds and a select.
    const float sign = (lane & m) != 0 ? -1.0f : 1.0f;
#pragma unroll
    for (int j = 0; j < E; ++j) x[j] = __fmaf_rn(x[j], sign, __shfl_xor_sync(kFullMask, x[j], m));
  }
}

// D = C + A * B with A 16x16 (row), B 16x8 (col), fp16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Transposes an 8x8 matrix of 16-bit elements held in the mma fragment layout.
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// Two e4m3 bytes (low byte first) -> half2 (low half first), hardware conversion on sm_89+.
__device__ __forceinline__ uint32_t fp8x2_to_half2(uint32_t two_bytes) {
  uint32_t out;
  const unsigned short in = static_cast<unsigned short>(two_bytes);
  asm volatile("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(out) : "h"(in));
  return out;
}

// Four floats -> four e4m3 bytes (the first lowest), rounded to nearest even and saturating at
// +-448 as float_to_fp8_e4m3 does (numeric.h), with two hardware conversions (sm_89+; elsewhere
// that function per element). A NaN becomes a NaN byte (low seven bits all ones) whose sign is the
// hardware's choice: callers that need the CPU's bytes for NaN check for those.
__device__ __forceinline__ uint32_t floats_to_fp8x4(float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned short lo, hi;  // cvt packs its first source into the upper byte
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
#else
  return float_to_fp8_e4m3(a) | (float_to_fp8_e4m3(b) << 8) | (float_to_fp8_e4m3(c) << 16) |
         (static_cast<uint32_t>(float_to_fp8_e4m3(d)) << 24);
#endif
}

// Whether any byte of w has its low seven bits all ones (an e4m3 NaN).
__device__ __forceinline__ bool has_fp8_nan(uint32_t w) {
  return (((w & 0x7f7f7f7fu) + 0x01010101u) & 0x80808080u) != 0;
}

// (x & mask) | bias in one LOP3 (the compiler splits it in two when both are immediates).
__device__ __forceinline__ uint32_t and_or(uint32_t x, uint32_t mask, uint32_t bias) {
  uint32_t y;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(y) : "r"(x), "r"(mask), "r"(bias));
  return y;
}

// The B-bit codes at bits [0, B) of both 16-bit halves of x, less kCenter, -> half2, exactly:
// 0x6400 | c is the fp16 1024 + c, so one mask-or and one subtraction (of 1024 + kCenter, an fp16
// integer; c - kCenter is one too).
template <int B, int kCenter = 0>
__device__ __forceinline__ uint32_t low_codes_to_half2(uint32_t x) {
  constexpr uint32_t m = (1u << B) - 1u;
  const uint32_t biased = and_or(x, m | (m << 16), 0x64006400u);
  const __half b = __float2half(static_cast<float>(1024 + kCenter));
  const __half2 h = __hsub2(*reinterpret_cast<const __half2*>(&biased), __half2(b, b));
  return *reinterpret_cast<const uint32_t*>(&h);
}

// The B-bit codes at bits [B, 2B) of both halves, less kCenter, -> half2, exactly and without a
// shift: the bias 2^(10 - B) has a unit in the last place of 2^-B, so bits [B, 2B) of its mantissa
// count whole units (and 2^(10 - B) + kCenter is an fp16 integer).
template <int B, int kCenter = 0>
__device__ __forceinline__ uint32_t high_codes_to_half2(uint32_t x) {
  constexpr uint32_t m = ((1u << B) - 1u) << B;
  constexpr uint32_t bias = static_cast<uint32_t>(15 + 10 - B) << 10;  // fp16 bits of 2^(10 - B)
  const uint32_t biased = and_or(x, m | (m << 16), bias | (bias << 16));
  const __half b = __float2half(static_cast<float>((1u << (10 - B)) + kCenter));
  const __half2 h = __hsub2(*reinterpret_cast<const __half2*>(&biased), __half2(b, b));
  return *reinterpret_cast<const uint32_t*>(&h);
}

// The 16 bits at bit `off` of the little-endian stream w (off a compile-time constant after
// unrolling: one shift or funnel shift).
template <int NW>
__device__ __forceinline__ uint32_t window16(const uint32_t (&w)[NW], int off) {
  const int word = off >> 5, shift = off & 31;
  if (shift + 16 <= 32) return w[word] >> shift;
  return __funnelshift_r(w[word], w[word + 1], shift);
}

// Loads NW 32-bit words of a little-endian byte stream starting at any byte address in shared
// memory (reads one word past the end: callers keep slack after their buffers).
template <int NW>
__device__ __forceinline__ void load_unaligned_words(const uint8_t* p, uint32_t (&out)[NW]) {
  // Step back with pointer arithmetic (not an integer round trip) so the compiler keeps the
  // shared address space and emits LDS rather than generic loads.
  const uint32_t misalign = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(p) & 3u);
  const uint32_t* w = reinterpret_cast<const uint32_t*>(p - misalign);
  const uint32_t shift = misalign * 8u;
  uint32_t cur = w[0];
#pragma unroll
  for (int k = 0; k < NW; ++k) {
    const uint32_t next = w[k + 1];
    out[k] = __funnelshift_r(cur, next, shift);
    cur = next;
  }
}

// Bits [off, off + width) of a little-endian stream held in registers. Call it inside fully
// unrolled loops so `off` folds to a constant and `w` stays in registers.
template <int NW>
__device__ __forceinline__ uint32_t extract_bits(const uint32_t (&w)[NW], int off, int width) {
  const int word = off >> 5, shift = off & 31;
  const uint32_t mask = width == 32 ? 0xffffffffu : ((1u << width) - 1u);
  if (shift + width <= 32) return (w[word] >> shift) & mask;
  return __funnelshift_r(w[word], w[word + 1], shift) & mask;
}

// v behind a move the compiler cannot see through: it keeps v in a register instead of re-deriving
// it (from the thread index or the shared window base, say) at every use inside a loop.
template <typename T>
__device__ __forceinline__ T opaque(T v) {
  static_assert(sizeof(T) == 4, "32-bit values");
  T r;
  asm("mov.b32 %0, %1;" : "=r"(r) : "r"(v));
  return r;
}

// ---- 16-byte asynchronous global -> shared copies (cp.async, L2 only), in per-thread groups.
__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// Both addresses 16-byte aligned; dst as a shared-memory address (smem_address) or a pointer.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_16(void* dst, const void* src) { cp_async_16(smem_address(dst), src); }
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most `kPending` of this thread's newest groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// ---- Bulk asynchronous copies (the TMA unit, sm_90+) completing on shared-memory mbarriers.
// The kernels that use them are selected by the host only where the device and the build have
// sm_90 code; compiled for older targets the waits and copies trap.
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_address(bar)), "r"(arrivals) : "memory");
#endif
}
// Makes initialized mbarriers visible to the async proxy before first use.
__device__ __forceinline__ void fence_mbarrier_init() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
// Orders this thread's earlier generic shared-memory accesses before later bulk copies into the
// same bytes.
__device__ __forceinline__ void fence_proxy_async_shared() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}
// The barrier and copy wrappers take shared-memory addresses (smem_address), so that a kernel can
// keep them in registers across its loop (a pointer's conversion re-reads the CTA's shared window
// base each time); the pointer forms convert.
// Arrives on the barrier and raises the bytes its current phase waits for.
__device__ __forceinline__ void mbarrier_arrive_expect_bytes(uint32_t bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
#endif
}
// Waits until the barrier's phase of this parity (0 for its first use, then alternating) completed.
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t done = 0;
  do {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
#else
  __trap();
#endif
}
// `bytes` (a multiple of 16) from global to shared memory, both 16-byte aligned, completing on `bar`.
__device__ __forceinline__ void bulk_copy_to_shared(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
               : "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void mbarrier_arrive_expect_bytes(uint64_t* bar, uint32_t bytes) {
  mbarrier_arrive_expect_bytes(smem_address(bar), bytes);
}
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) { mbarrier_arrive(smem_address(bar)); }
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) { mbarrier_wait(smem_address(bar), parity); }
__device__ __forceinline__ void bulk_copy_to_shared(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  bulk_copy_to_shared(smem_address(dst), src, bytes, smem_address(bar));
}

// A split's weight in a merge of log-sum-exps whose maximum is mx: 0 for a split that saw no
// token (lse = -inf, also when every split is empty), NaN for a NaN split whatever mx is.
__device__ __forceinline__ float split_weight(float lse, float mx) { return lse == -INFINITY ? 0.0f : exp2f(lse - mx); }

}  // namespace device
}  // namespace turboquant
