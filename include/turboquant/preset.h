// KV-cache presets (the vLLM `--kv-cache-dtype turboquant_*` names) and their slot layouts.
// Host-only: parsing throws std::invalid_argument with a message meant for the caller.
#pragma once

#include <string>
#include <vector>

#include "turboquant/layout.h"

namespace turboquant {

struct Preset {
  std::string name;
  KeyFormat key_format;
  int key_bits;  // 8 for FP8
  int value_bits;
  bool norm_correction;
};

// The four presets of SPEC §2, in table order.
const std::vector<Preset>& all_presets();

// Looks a preset up by name; unknown names throw, listing the valid ones.
const Preset& parse_preset(const std::string& name);

// Throws unless head_dim is supported by the preset: a positive multiple of 8, and a power of two
// for rotated (Lloyd-Max) keys, since the rotation is a Sylvester Hadamard matrix.
void check_head_dim(const Preset& preset, int head_dim);

// Slot layout of a preset at a head_dim (validated).
SlotLayout slot_layout(const Preset& preset, int head_dim);

}  // namespace turboquant
