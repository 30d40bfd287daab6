// The op schemas (SPEC §4): the stable public contract. Implementations register per device key
// next to their code (ops_cpu.cpp, ops_cuda.cpp); fake implementations live in Python.
#include <torch/library.h>

TORCH_LIBRARY(turboquant, m) {
  m.def(
      "store_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, str preset) "
      "-> ()");
  m.def(
      "decode(Tensor query, Tensor kv_cache, Tensor block_table, Tensor seq_lens, str preset, "
      "float scale, int num_splits=0) -> Tensor");
  m.def(
      "dequantize(Tensor kv_cache, Tensor block_table, Tensor seq_lens, str preset, "
      "ScalarType dtype) -> (Tensor, Tensor)");
}
