// The attention options of decode and decode_varlen, one definition for the CPU reference and the
// CUDA kernels: sliding windows, logit soft-capping and attention sinks (SPEC §4).
//
//   window_left  a query at position p attends to positions [p - window_left, p]: FlashAttention's
//                window_size[0]; -1 means no window. transformers' sliding_window W
//                (Mistral, Gemma 2/3, gpt-oss: a query sees its W most recent tokens, itself
//                included) is window_left = W - 1.
//   softcap      logits s = scale * q.k become softcap * tanh(s / softcap) before the softmax (Gemma 2's
//                attn_logit_softcapping); 0 means none.
//   sinks        one logit per query head that joins every softmax's denominator and carries no value
//                (gpt-oss): out = sum_i e^{s_i} v_i / (e^{sink} + sum_i e^{s_i}).
#pragma once

#include <climits>
#include <cmath>

#include "turboquant/macros.h"
#include "turboquant/split_plan.h"

namespace turboquant {

// The window as the kernels compare it: window_left, or INT_MAX for none.
TQ_HD int window_span(int window_left) { return window_left < 0 ? INT_MAX : window_left; }

// Whether a query that sees positions [0, limit) causally (query_chunks.h: causal_limit) attends to
// position `pos` under `window` (window_span): limit - 1 - window <= pos < limit, as one unsigned
// comparison, so a windowed tile loop costs what the causal one did.
TQ_HD bool attends(int pos, int limit, int window) {
  return static_cast<unsigned>(limit - 1 - pos) <= static_cast<unsigned>(window);
}

// The first position such a query attends to.
TQ_HD int first_attended_position(int limit, int window) {
  const int start = limit - 1 - window;  // no overflow: limit >= 0 and window <= INT_MAX
  return start > 0 ? start : 0;
}

// The first token a decode reads for queries whose smallest causal limit is `limit`: the window's
// start rounded down to a whole token tile (a tile never straddles a block; the tokens before the
// window's start are masked by attends).
TQ_HD int window_first_tile_token(int limit, int window) {
  return first_attended_position(limit, window) / kTokenTile * kTokenTile;
}

// The most tokens one decode row (or CTA of `query_tokens` consecutive query tokens) reads under
// `window`, for a split plan made from shapes alone: a windowed decode's grid tracks its window,
// not its block table's capacity.
TQ_HD int windowed_context(int max_context, int window, int query_tokens) {
  if (window == INT_MAX) return max_context;
  const long long span = static_cast<long long>(window) + query_tokens + kTokenTile - 1;  // start rounded down a tile
  return span < max_context ? static_cast<int>(span) : max_context;
}

// A logit after soft-capping (cap <= 0: unchanged). The kernels apply it in the log2 domain with
// the cap scaled by log2(e), which is the same function of the natural-domain logit.
template <typename T>
TQ_HD T softcap_logit(T s, T cap) {
#if !defined(__CUDA_ARCH__)
  using std::tanh;
#endif
  return cap > T(0) ? cap * tanh(s / cap) : s;
}

}  // namespace turboquant
