"""turboquant: a 3-4 bit paged KV cache (TurboQuant) with decode attention on the packed cache.

Ops live in ``torch.ops.turboquant`` (store_kv, decode, dequantize); this package loads them and
adds the preset/layout API, cache helpers and typed wrappers.
"""

from ._library import has_cuda_kernels
from .cache import SUPPORTED_BLOCK_SIZES, allocate_kv_cache, boundary_skip_layers, kv_cache_bytes
from .codebook import codebook, hadamard, lloyd_max_gaussian, lloyd_max_sphere
from .ops import decode, decode_varlen, dequantize, dequantize_into, head_dim_for_slot, store_kv
from .presets import PRESETS, PresetInfo, SlotLayout, preset_info, slot_layout

__all__ = [
    "PRESETS", "PresetInfo", "SlotLayout", "SUPPORTED_BLOCK_SIZES", "allocate_kv_cache", "boundary_skip_layers",
    "codebook", "decode", "decode_varlen", "dequantize", "dequantize_into", "hadamard", "has_cuda_kernels", "head_dim_for_slot", "kv_cache_bytes",
    "lloyd_max_gaussian", "lloyd_max_sphere", "preset_info", "slot_layout", "store_kv",
]
