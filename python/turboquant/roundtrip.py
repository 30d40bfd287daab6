"""Quantize-then-dequantize round trips: what a cache hands back for K/V, without its kernels.

``packed`` stores tokens through a TurboQuant preset and reads them back (the library's own ops);
``fp8_e4m3`` and ``int4_per_token`` are the baselines a user might pick instead, at their bytes.
Used by the quality benchmarks, the real-model evaluation and the tests' references.
"""

from __future__ import annotations

import torch

from .cache import allocate_kv_cache
from .ops import dequantize, store_kv

_BLOCK = 16


def packed(preset: str, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V ``[N, H, D]`` (tokens first) -> what a packed cache of ``preset`` decodes them to,
    float32, same shape."""
    tokens, heads, dim = key.shape
    blocks = max(1, -(-tokens // _BLOCK))
    cache = allocate_kv_cache(blocks, _BLOCK, heads, dim, preset, key.device)
    store_kv(key, value, cache, torch.arange(tokens, device=key.device), preset)
    table = torch.arange(blocks, dtype=torch.int32, device=key.device)[None]
    k, v = dequantize(cache, table, torch.tensor([tokens], dtype=torch.int32, device=key.device), preset, torch.float32)
    return k[0], v[0]


def fp8_e4m3(x: torch.Tensor) -> torch.Tensor:
    """FP8 e4m3 with a unit scale (vLLM's fp8 KV cache default), saturating at +-448."""
    return x.clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype)


def int4_per_token(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """Asymmetric 4-bit min/max per token and group of ``group`` channels, no rotation (KIVI-style
    grouping), scale and zero rounded to fp16 as they would be stored."""
    shape = x.shape
    g = x.double().reshape(*shape[:-1], shape[-1] // group, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).half().double().clamp_min(1e-8)
    lo = lo.half().double()
    q = ((g - lo) / scale).round().clamp(0, 15)
    return (q * scale + lo).reshape(shape).to(x.dtype)
