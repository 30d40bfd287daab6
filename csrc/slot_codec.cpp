// Host implementation of the slot codec (SPEC §4 store_kv arithmetic, all in fp32).
#include "turboquant/slot_codec.h"

#include <cmath>
#include <vector>

#include "turboquant/hadamard_transform.h"
#include "turboquant/numeric.h"
#include "turboquant/packing.h"

namespace turboquant {

void encode_slot(const float* key, const float* value, const SlotLayout& layout,
                 const Codebook* codebook, bool norm_correction, uint8_t* slot) {
  const int d = layout.head_dim;
  std::vector<uint8_t> idx(d);
  if (layout.key_format == KeyFormat::kFp8) {
    for (int i = 0; i < d; ++i) slot[i] = float_to_fp8_e4m3(key[i]);
  } else {
    const float norm = std::sqrt(sum_of_squares_lane_order(key, d));
    const float denom = norm + kKeyNormEpsilon;
    std::vector<float> y(d);
    for (int i = 0; i < d; ++i) y[i] = key[i] / denom;
    hadamard_transform_inplace(y.data(), d);
    const float rsqrt_d = 1.0f / std::sqrt(static_cast<float>(d));
    std::vector<float> c(d);
    for (int i = 0; i < d; ++i) {
      idx[i] = static_cast<uint8_t>(lloyd_max_index(y[i] * rsqrt_d, codebook->midpoint, codebook->levels));
      c[i] = codebook->centroid[idx[i]];
    }
    pack_indices(idx.data(), d, layout.key_bits, slot);
    const float stored =
        norm_correction ? norm / std::sqrt(sum_of_squares_lane_order(c.data(), d)) : norm;
    store_half_field(slot, layout.key_norm_offset, key_norm_half_bits(stored));
  }
  float vmin = value[0], vmax = value[0];
  for (int i = 1; i < d; ++i) {
    vmin = std::fmin(vmin, value[i]);
    vmax = std::fmax(vmax, value[i]);
  }
  const ValueQuantParams p = value_quant_params(vmin, vmax, layout.value_bits);
  for (int i = 0; i < d; ++i) idx[i] = static_cast<uint8_t>(value_code(value[i], p, layout.value_bits));
  pack_indices(idx.data(), d, layout.value_bits, slot + layout.value_data_offset);
  store_half_field(slot, layout.value_scale_offset, p.scale_bits);
  store_half_field(slot, layout.value_zero_offset, p.zero_bits);
}

void decode_key_rotated(const uint8_t* slot, const SlotLayout& layout, const Codebook* codebook,
                        float* out) {
  const int d = layout.head_dim;
  if (layout.key_format == KeyFormat::kFp8) {
    for (int i = 0; i < d; ++i) out[i] = fp8_e4m3_to_float(slot[i]);
    return;
  }
  const float norm = half_bits_to_float(load_half_field(slot, layout.key_norm_offset));
  for (int i = 0; i < d; ++i) {
    out[i] = norm * codebook->centroid[unpack_index(slot, i, layout.key_bits)];
  }
}

void decode_key(const uint8_t* slot, const SlotLayout& layout, const Codebook* codebook,
                float* out) {
  decode_key_rotated(slot, layout, codebook, out);
  if (layout.key_format == KeyFormat::kFp8) return;
  const int d = layout.head_dim;
  hadamard_transform_inplace(out, d);  // symmetric: its own inverse
  const float rsqrt_d = 1.0f / std::sqrt(static_cast<float>(d));
  for (int i = 0; i < d; ++i) out[i] *= rsqrt_d;
}

void decode_value(const uint8_t* slot, const SlotLayout& layout, float* out) {
  const float scale = half_bits_to_float(load_half_field(slot, layout.value_scale_offset));
  const float zero = half_bits_to_float(load_half_field(slot, layout.value_zero_offset));
  const uint8_t* data = slot + layout.value_data_offset;
  for (int i = 0; i < layout.head_dim; ++i) {
    out[i] = value_decode(unpack_index(data, i, layout.value_bits), scale, zero);
  }
}

}  // namespace turboquant
