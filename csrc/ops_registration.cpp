// The op schemas (SPEC §4): the stable public contract. Implementations register per device key
// next to their code (ops_cpu.cpp, ops_cuda.cpp); fake implementations live in Python.
#include <torch/library.h>

TORCH_LIBRARY(turboquant, m) {
  // Every op takes a cache's per-head transforms (kv_transform.h): key_offset, key_scale and
  // value_offset, fp32 [num_kv_heads, head_dim] or None; the same three for every op on a cache.
  m.def(
      "store_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, str preset, "
      "Tensor? key_offset=None, Tensor? key_scale=None, Tensor? value_offset=None) -> ()");
  // Attention options (turboquant/attention_options.h): window_left -1 = no window, softcap 0 = none,
  // sinks fp32 [num_q_heads] or None.
  m.def(
      "decode(Tensor query, Tensor kv_cache, Tensor block_table, Tensor seq_lens, str preset, "
      "float scale, int num_splits=0, int window_left=-1, float softcap=0.0, Tensor? sinks=None, "
      "Tensor? key_offset=None, Tensor? key_scale=None, Tensor? value_offset=None) -> Tensor");
  // decode, and each (sequence, query head)'s log-sum-exp of its attended scores (natural log, fp32
  // [batch, num_q_heads], the sink included; -inf where nothing is attended): the weight to merge
  // this attention with one over other keys (a few tokens kept exact, a shared prefix).
  m.def(
      "decode_lse(Tensor query, Tensor kv_cache, Tensor block_table, Tensor seq_lens, str preset, "
      "float scale, int num_splits=0, int window_left=-1, float softcap=0.0, Tensor? sinks=None, "
      "Tensor? key_offset=None, Tensor? key_scale=None, Tensor? value_offset=None) -> (Tensor, Tensor)");
  // Several query tokens per sequence (continuation chunks, speculative verification):
  // query [total_q, Hq, D], query_start_loc int32 [batch + 1]; query row i of sequence b attends
  // to positions < seq_len_b - q_len_b + 1 + i. Rows outside every sequence's range are zeros.
  m.def(
      "decode_varlen(Tensor query, Tensor kv_cache, Tensor block_table, Tensor seq_lens, "
      "Tensor query_start_loc, str preset, float scale, int num_splits=0, int window_left=-1, "
      "float softcap=0.0, Tensor? sinks=None, Tensor? key_offset=None, Tensor? key_scale=None, "
      "Tensor? value_offset=None) -> Tensor");
  m.def(
      "dequantize(Tensor kv_cache, Tensor block_table, Tensor seq_lens, str preset, "
      "ScalarType dtype, Tensor? key_offset=None, Tensor? key_scale=None, Tensor? value_offset=None) "
      "-> (Tensor, Tensor)");
  // Same as dequantize, into caller-provided [B, L, Hkv, D] buffers (zeros past each length;
  // positions >= L are not written), so a serving stack can reserve them once.
  m.def(
      "dequantize_into(Tensor kv_cache, Tensor block_table, Tensor seq_lens, str preset, "
      "Tensor(a!) key_out, Tensor(b!) value_out, Tensor? key_offset=None, Tensor? key_scale=None, "
      "Tensor? value_offset=None) -> ()");
}
