// Preset table and validation (SPEC §2, §3 "Hadamard cache").
#include "turboquant/preset.h"

#include <stdexcept>

#include "turboquant/hadamard_transform.h"

namespace turboquant {

const std::vector<Preset>& all_presets() {
  static const std::vector<Preset> presets = {
      {"turboquant_k8v4", KeyFormat::kFp8, 8, 4, false},
      {"turboquant_4bit_nc", KeyFormat::kLloydMax, 4, 4, true},
      {"turboquant_k3v4_nc", KeyFormat::kLloydMax, 3, 4, true},
      {"turboquant_3bit_nc", KeyFormat::kLloydMax, 3, 3, true},
  };
  return presets;
}

const Preset& parse_preset(const std::string& name) {
  std::string valid;
  for (const Preset& p : all_presets()) {
    if (p.name == name) return p;
    valid += (valid.empty() ? "" : ", ") + p.name;
  }
  throw std::invalid_argument("turboquant: unknown preset '" + name + "'; valid presets: " + valid);
}

void check_head_dim(const Preset& preset, int head_dim) {
  if (head_dim <= 0 || head_dim % 8 != 0 || head_dim > kMaxHeadDim) {
    throw std::invalid_argument("turboquant: head_dim must be a multiple of 8 in [8, " + std::to_string(kMaxHeadDim) +
                                "], got " + std::to_string(head_dim));
  }
  if (preset.key_format == KeyFormat::kLloydMax && hadamard_paley_order(head_dim) == 0) {
    throw std::invalid_argument(
        "turboquant: preset " + preset.name + " rotates keys with a Hadamard matrix of order head_dim = m * 2^k, " +
        "m in {1, 12, 20, 28} (a power of two times 1, 3, 5 or 7); got head_dim " + std::to_string(head_dim) +
        " (supported up to 256: 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256; "
        "turboquant_k8v4 accepts any multiple of 8)");
  }
}

SlotLayout slot_layout(const Preset& preset, int head_dim) {
  check_head_dim(preset, head_dim);
  return make_slot_layout(head_dim, preset.key_format, preset.key_bits, preset.value_bits);
}

}  // namespace turboquant
