// One warp's attention over one 16-token tile of staged slots, for 8 query columns: the math the
// per-head decode kernel (decode.cu) and the row-staged one (decode_rows.cu) share. They differ in
// how slots reach shared memory and where a row's slot lies; both hand that over as slot_ptr(r).
//   * S^T = K~ Q^T on tensor cores (mma m16n8k16: tokens are the M dimension, columns the N),
//     with A fragments dequantized straight into registers: a pair of Lloyd-Max indices indexes a
//     bank-replicated half2 table (addressed in bytes, two ALU ops per lookup), FP8 pairs use the
//     hardware e4m3x2 -> f16x2 conversion. The head dim is permuted (turboquant/fragment_order.h:
//     contiguous runs per thread, or interleaved words where the slot alignment is known); the
//     query fragments use the same permutation;
//   * scores times the stored norm, online softmax in the log2 domain;
//   * O^T += V^T (P*scale)^T on tensor cores with the integer value codes less their center as A
//     (sum_t p_t (q_t s_t + z_t) = sum_t (p_t s_t) (q_t - c) + sum_t p_t (z_t + c s_t), c =
//     kValueCodeCenter), P transposed in registers by movmatrix.
#pragma once

#include <climits>
#include <cmath>

#include "decode_common.cuh"
#include "device_utils.cuh"
#include "turboquant/attention_options.h"
#include "turboquant/fragment_order.h"

namespace turboquant {

// What a thread of the tile math reads of a slot and holds in registers, for a staged slot type S
// (StagedSlot or any type with D, kFp8Key, KB, VB and kLayout).
template <class S>
struct TileFragments {
  static constexpr int D = S::D;
  static constexpr int kKeyChunkBytes = (D / 4) * S::KB / 8;  // QK: thread c owns dims [c D/4, (c+1) D/4)
  static constexpr int kKeyWords = cdiv(kKeyChunkBytes, 4);
  static constexpr int kValueChunkBytes = (D / 8) * S::VB / 8;  // PV: thread g owns dims [g D/8, (g+1) D/8)
  static constexpr int kValueWords = cdiv(kValueChunkBytes, 4);
  static constexpr int kKSteps = D / 16;
  static constexpr int kPairs = S::kFp8Key ? 0 : 1 << (2 * S::KB);  // pair-table entries (code pairs)
  static constexpr int kPairTableWords = kPairs * 32;                 // a replica per bank (32 words per pair)
};

namespace device {

// B fragments of Q^T from the fp32 query rows of the warp's 8 columns (row j: column j, rotated
// for Lloyd-Max keys), in the key order of turboquant/fragment_order.h: logical k (2c, 2c+1 |
// 2c+8, 2c+9) of step j = physical dims 4q + (0,1 | 2,3), q = key_quad(c, j).
template <int D, int KB, int kSlotMisalign = kUnknownMisalign>
__device__ __forceinline__ void query_fragments(const float* columns, int g, int c, float q_multiplier,
                                                uint32_t (&qf)[D / 16][2]) {
#pragma unroll
  for (int j = 0; j < D / 16; ++j) {
    const float* r = columns + g * D + 4 * key_quad(c, j, D, KB, kSlotMisalign);
    qf[j][0] = pack_half2(r[0] * q_multiplier, r[1] * q_multiplier);
    qf[j][1] = pack_half2(r[2] * q_multiplier, r[3] * q_multiplier);
  }
}

// load_interleaved_words (fragment_order.h) of the region at `region` (kMisalign = its address mod 4).
template <int kMisalign, int kStride, int R, int NW>
__device__ __forceinline__ void load_region_words(const uint8_t* region, int index, uint32_t (&out)[NW]) {
  load_interleaved_words<kMisalign, kStride, R>(reinterpret_cast<const uint32_t*>(region - kMisalign), index, out);
}

// A warp's running attention state for its 8 columns: thread (g, c) holds the statistics of
// columns 2c, 2c + 1 and the O^T fragments of dims 2 value_pair(g, i) (+1) (fragment_order.h: g*D/8
// + 2i in the contiguous order).
template <int kKSteps>
struct TileAttention {
  float m[2] = {-INFINITY, -INFINITY};  // running max (log2 domain) of columns 2c, 2c+1
  float l[2] = {0.0f, 0.0f};            // this thread's share of the softmax denominators
  float z[2] = {0.0f, 0.0f};            // this thread's share of sum_t p_t * zero_t
  float acc[kKSteps][4];                // O^T fragments: dims 2 value_pair(g, i) (+1), columns 2c, 2c+1
  __device__ __forceinline__ TileAttention() {
#pragma unroll
    for (int i = 0; i < kKSteps; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  }
};

// This lane's byte offset in a pair's row of the pair table (entry `pair` of lane l is word
// pair * kPairStrideWords + l), hidden from the compiler behind a move: otherwise it re-derives the
// lane from the thread index inside every lookup (two extra ALU ops each, SASS of nvcc 13.0). The
// table's address is a separate, uniform base that the loads add themselves (LDS [R + UR]), or
// where a kernel folds it in, `plus`.
__device__ __forceinline__ uint32_t pair_table_lane_bytes(int lane, uint32_t plus = 0u) {
  return opaque(plus + 4u * static_cast<uint32_t>(lane));
}

// A shared-memory word by address. Not volatile and without a memory clobber: only for data that
// no longer changes once the loop runs (the pair table, written before the staging barrier).
__device__ __forceinline__ uint32_t load_shared_word(uint32_t address) {
  uint32_t v;
  asm("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(address));
  return v;
}

// The half2 pair-table entry for the pair of key codes at `bit` of w, from the table at the
// uniform shared address table_base and this lane's lane_bytes (pair_table_lane_bytes). The load
// adds the uniform base itself, so only the offset (pair * stride + lane * 4) costs ALU ops:
//   * 4-bit keys, 64 words per pair (twice the table): one PRMT builds (pair << 8) | lane_bytes
//     from the key word: 1 op;
//   * 4-bit keys, 32 words per pair: one PRMT isolates the pair's byte, one LEA scales and adds: 2;
//   * other widths: one shift (or funnel shift) to bit 7, one LOP3 masks and ors lane_bytes in: 2
//     (with the lane's replica address in place of lane_bytes the add was a third op, 32 per tile).
template <int KB, int kPairStrideWords = 32, int NW>
__device__ __forceinline__ uint32_t pair_entry(const uint32_t (&w)[NW], int bit, uint32_t lane_bytes,
                                               uint32_t table_base) {
  if constexpr (KB == 4 && kPairStrideWords == 64) {
    const uint32_t selector = 0x5504u | (static_cast<uint32_t>((bit >> 3) & 3) << 4);
    return load_shared_word(table_base + __byte_perm(w[bit >> 5], lane_bytes, selector));
  } else if constexpr (KB == 4) {
    const uint32_t pair = __byte_perm(w[bit >> 5], 0u, 0x4440u | static_cast<uint32_t>((bit >> 3) & 3));
    return load_shared_word(table_base + ((pair << 7) + lane_bytes));
  } else {
    static_assert(kPairStrideWords == 32, "pair_entry_offset scales pairs by 32 words");
    return load_shared_word(table_base + pair_entry_offset(w, bit, 2 * KB, lane_bytes));
  }
}

// The tile step: slot_ptr(r) is row r's slot in shared memory (2-byte aligned, one readable word
// past its end; kSlotMisalign: its address mod 4 where every row's is the same and known, which
// picks the interleaved fragment order of turboquant/fragment_order.h); tokens g and g + 8 of the
// tile are at positions pos_lo and pos_lo + 8 and count when valid_lo / valid_hi and below the
// column's limit (limit0, limit1: columns 2c, 2c + 1); lane_bytes is pair_table_lane_bytes and
// table_base the pair table's shared address (pair_entry);
// lane is the caller's lane index, kept in a register (derived from the thread index here, it is
// recomputed in every tile). Masked tokens get -inf by selection, so garbage in their bytes
// cannot leak in. The attention options (turboquant/attention_options.h): `window` (window_span)
// masks positions before each column's window; `softcap_log2` > 0 soft-caps the scores in the log2
// domain (the logit cap times log2(e)). The defaults are plain causal attention.
template <class S, int kSlotMisalign = kUnknownMisalign, int kPairStrideWords = 32, class SlotPtr>
__device__ __forceinline__ void attend_tile(int lane, const SlotPtr& slot_ptr, int pos_lo, bool valid_lo,
                                            bool valid_hi, int limit0, int limit1, uint32_t lane_bytes,
                                            uint32_t table_base, const uint32_t (&qf)[S::D / 16][2],
                                            TileAttention<TileFragments<S>::kKSteps>& st, int window = INT_MAX,
                                            float softcap_log2 = 0.0f) {
  using F = TileFragments<S>;
  constexpr SlotLayout kLayout = S::kLayout;
  const int g = lane >> 2, c = lane & 3;
  const int pos_hi = pos_lo + 8;
  const uint8_t* slot_lo = slot_ptr(g);
  const uint8_t* slot_hi = slot_ptr(g + 8);

  // S^T = K~ Q^T for tokens g, g+8 and columns 2c, 2c+1
  uint32_t key_lo[F::kKeyWords], key_hi[F::kKeyWords];
  if constexpr (keys_interleaved(S::KB, kSlotMisalign, S::D)) {
    constexpr int kRegionWords = S::D * S::KB / 32;
    load_region_words<kSlotMisalign, 4, kRegionWords>(slot_lo, c, key_lo);
    load_region_words<kSlotMisalign, 4, kRegionWords>(slot_hi, c, key_hi);
  } else {
    load_unaligned_words(slot_lo + c * F::kKeyChunkBytes, key_lo);
    load_unaligned_words(slot_hi + c * F::kKeyChunkBytes, key_hi);
  }
  // Two accumulators halve the chain of dependent MMAs.
  float sc_even[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sc_odd[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  auto lookup = [&](const uint32_t (&w)[F::kKeyWords], int bit) {
    return pair_entry<S::KB, kPairStrideWords>(w, bit, lane_bytes, table_base);
  };
#pragma unroll
  for (int j = 0; j < F::kKSteps; ++j) {
    uint32_t a0, a1, a2, a3;
    if constexpr (S::kFp8Key) {
      a0 = fp8x2_to_half2(extract_bits(key_lo, 32 * j, 16));
      a2 = fp8x2_to_half2(extract_bits(key_lo, 32 * j + 16, 16));
      a1 = fp8x2_to_half2(extract_bits(key_hi, 32 * j, 16));
      a3 = fp8x2_to_half2(extract_bits(key_hi, 32 * j + 16, 16));
    } else {
      a0 = lookup(key_lo, 4 * j * S::KB);
      a2 = lookup(key_lo, (4 * j + 2) * S::KB);
      a1 = lookup(key_hi, 4 * j * S::KB);
      a3 = lookup(key_hi, (4 * j + 2) * S::KB);
    }
    mma_16816(j % 2 == 0 ? sc_even : sc_odd, a0, a1, a2, a3, qf[j][0], qf[j][1]);
  }
  float sc[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) sc[i] = sc_even[i] + sc_odd[i];
  float norm_lo = 1.0f, norm_hi = 1.0f;
  if constexpr (!S::kFp8Key) {
    norm_lo = load_half(slot_lo + kLayout.key_norm_offset);
    norm_hi = load_half(slot_hi + kLayout.key_norm_offset);
  }
  float logit[4] = {sc[0] * norm_lo, sc[1] * norm_lo, sc[2] * norm_hi, sc[3] * norm_hi};
  if (softcap_log2 > 0.0f) {  // uniform: a launch parameter
#pragma unroll
    for (int i = 0; i < 4; ++i) logit[i] = softcap_logit(logit[i], softcap_log2);
  }
  const float s0 = valid_lo && attends(pos_lo, limit0, window) ? logit[0] : -INFINITY;
  const float s1 = valid_lo && attends(pos_lo, limit1, window) ? logit[1] : -INFINITY;
  const float s2 = valid_hi && attends(pos_hi, limit0, window) ? logit[2] : -INFINITY;
  const float s3 = valid_hi && attends(pos_hi, limit1, window) ? logit[3] : -INFINITY;

  // Online softmax per column (decode_common.cuh).
  const float s[4] = {s0, s1, s2, s3};
  float pr[4], alpha[2];
  online_softmax_tile(s, st.m, st.l, st.acc, pr, alpha);
  const float p0 = pr[0], p1 = pr[1], p2 = pr[2], p3 = pr[3];
  const float vs_lo = valid_lo ? load_half(slot_lo + kLayout.value_scale_offset) : 0.0f;
  constexpr float kCenter = static_cast<float>(S::kValueCodeCenter);
  const float vz_lo = valid_lo ? fmaf(kCenter, vs_lo, load_half(slot_lo + kLayout.value_zero_offset)) : 0.0f;
  const float vs_hi = valid_hi ? load_half(slot_hi + kLayout.value_scale_offset) : 0.0f;
  const float vz_hi = valid_hi ? fmaf(kCenter, vs_hi, load_half(slot_hi + kLayout.value_zero_offset)) : 0.0f;
  st.z[0] = st.z[0] * alpha[0] + (p0 * vz_lo + p2 * vz_hi);
  st.z[1] = st.z[1] * alpha[1] + (p1 * vz_lo + p3 * vz_hi);
  // B = (P * value_scale)^T: transpose the C-layout tiles (tokens x columns) in registers.
  const uint32_t pb0 = movmatrix_trans(pack_half2(p0 * vs_lo, p1 * vs_lo));
  const uint32_t pb1 = movmatrix_trans(pack_half2(p2 * vs_hi, p3 * vs_hi));

  // O^T += V^T B with centered codes: rows = dims of chunk g, columns = tokens 2c, 2c+1, 2c+8, 2c+9
  uint32_t vw[4][F::kValueWords];
  if constexpr (values_interleaved(S::VB, kSlotMisalign, S::D)) {
    constexpr int kMisalign = value_misalign(kSlotMisalign, kLayout.value_data_offset);
    constexpr int kRegionWords = S::D * S::VB / 32;
    const int at = kLayout.value_data_offset;
    load_region_words<kMisalign, 8, kRegionWords>(slot_ptr(2 * c) + at, g, vw[0]);
    load_region_words<kMisalign, 8, kRegionWords>(slot_ptr(2 * c + 1) + at, g, vw[1]);
    load_region_words<kMisalign, 8, kRegionWords>(slot_ptr(2 * c + 8) + at, g, vw[2]);
    load_region_words<kMisalign, 8, kRegionWords>(slot_ptr(2 * c + 9) + at, g, vw[3]);
  } else {
    const int value_at = kLayout.value_data_offset + g * F::kValueChunkBytes;
    load_unaligned_words(slot_ptr(2 * c) + value_at, vw[0]);
    load_unaligned_words(slot_ptr(2 * c + 1) + value_at, vw[1]);
    load_unaligned_words(slot_ptr(2 * c + 8) + value_at, vw[2]);
    load_unaligned_words(slot_ptr(2 * c + 9) + value_at, vw[3]);
  }
#pragma unroll
  for (int i = 0; i < F::kKSteps; ++i) {
    uint32_t a0, a1, a2, a3;
    if constexpr (S::VB == 4) {
      // Byte i of each token's chunk holds dims 2i (low nibble, row g) and 2i + 1 (high
      // nibble, row g + 8): interleave the two tokens' bytes, then one mask per nibble.
      const int w = i >> 2, byte = i & 3;
      const uint32_t sel = byte | (byte << 4) | ((byte + 4) << 8) | ((byte + 4) << 12);
      const uint32_t x01 = __byte_perm(vw[0][w], vw[1][w], sel);
      const uint32_t x23 = __byte_perm(vw[2][w], vw[3][w], sel);
      a0 = low_codes_to_half2<4, S::kValueCodeCenter>(x01);
      a1 = high_codes_to_half2<4, S::kValueCodeCenter>(x01);
      a2 = low_codes_to_half2<4, S::kValueCodeCenter>(x23);
      a3 = high_codes_to_half2<4, S::kValueCodeCenter>(x23);
    } else {
      // Dims 2i (row g) and 2i + 1 (row g + 8) are the two VB-bit codes at bit 2i VB of each
      // token's chunk: two tokens' codes in one word, by one PRMT of the byte(s) holding them and
      // a shift (code_pair_gather, fragment_order.h), or where those bytes straddle two words a
      // 16-bit window per token and a PRMT; then one mask per dim as in the nibble path.
      static_assert(2 * S::VB <= 16, "two codes must fit a 16-bit window");
      const int bit = 2 * i * S::VB;
      const CodePairGather gather = code_pair_gather(bit, S::VB);  // constant once the loop unrolls
      uint32_t x01, x23;
      if (gather.fits) {
        x01 = __byte_perm(vw[0][gather.word], vw[1][gather.word], gather.selector) >> gather.shift;
        x23 = __byte_perm(vw[2][gather.word], vw[3][gather.word], gather.selector) >> gather.shift;
      } else {
        x01 = __byte_perm(window16(vw[0], bit), window16(vw[1], bit), 0x5410);
        x23 = __byte_perm(window16(vw[2], bit), window16(vw[3], bit), 0x5410);
      }
      a0 = low_codes_to_half2<S::VB, S::kValueCodeCenter>(x01);
      a1 = high_codes_to_half2<S::VB, S::kValueCodeCenter>(x01);
      a2 = low_codes_to_half2<S::VB, S::kValueCodeCenter>(x23);
      a3 = high_codes_to_half2<S::VB, S::kValueCodeCenter>(x23);
    }
    mma_16816(st.acc[i], a0, a1, a2, a3, pb0, pb1);
  }
}

}  // namespace device
}  // namespace turboquant
