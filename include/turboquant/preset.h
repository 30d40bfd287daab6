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

// The largest head_dim a cache may have: slot sizes and offsets stay far inside int, and a cache's
// head_dim is recovered from its slot size by a search up to here (dequantize).
constexpr int kMaxHeadDim = 1024;

// Throws unless head_dim is supported by the preset: a multiple of 8 in [8, kMaxHeadDim], and a
// power of two for rotated (Lloyd-Max) keys, since the rotation is a Sylvester Hadamard matrix.
void check_head_dim(const Preset& preset, int head_dim);

// Slot layout of a preset at a head_dim (validated).
SlotLayout slot_layout(const Preset& preset, int head_dim);

}  // namespace turboquant
