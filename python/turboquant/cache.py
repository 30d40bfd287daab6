"""Helpers a serving stack needs around the packed cache: allocation and layer selection."""

from __future__ import annotations

import torch

from .presets import slot_layout

SUPPORTED_BLOCK_SIZES = (16, 32, 64, 128)


def allocate_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, preset: str,
                      device: str | torch.device = "cpu", head_major: bool = False) -> torch.Tensor:
    """Allocates a zeroed paged cache ``uint8 [num_blocks, block_size, num_kv_heads, slot]``.

    ``head_major=True`` stores it as ``[num_blocks, num_kv_heads, block_size, slot]`` in memory and
    returns the view in the ops' index order (the kernels take strides).
    """
    if block_size not in SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"turboquant: block_size must be one of {SUPPORTED_BLOCK_SIZES}, got {block_size}")
    if num_blocks <= 0 or num_kv_heads <= 0:
        raise ValueError(f"turboquant: num_blocks and num_kv_heads must be positive, got {num_blocks}, {num_kv_heads}")
    slot = slot_layout(preset, head_dim).slot_size_aligned
    if head_major:
        return torch.zeros(num_blocks, num_kv_heads, block_size, slot, dtype=torch.uint8, device=device).transpose(1, 2)
    return torch.zeros(num_blocks, block_size, num_kv_heads, slot, dtype=torch.uint8, device=device)


def kv_cache_bytes(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, preset: str) -> int:
    """Bytes of one layer's cache, for sizing the block pool."""
    return num_blocks * block_size * num_kv_heads * slot_layout(preset, head_dim).slot_size_aligned


def boundary_skip_layers(num_layers: int, n: int = 2) -> list[int]:
    """Attention layers to keep unquantized: the first ``n`` and the last ``n``, capped at half of
    the layers (taken alternately from the front and the back until the cap). Sorted."""
    if num_layers < 0 or n < 0:
        raise ValueError(f"turboquant: num_layers and n must be >= 0, got {num_layers}, {n}")
    budget = num_layers // 2
    front, back = [], []
    for i in range(n):
        if len(front) + len(back) < budget:
            front.append(i)
        if len(front) + len(back) < budget:
            back.append(num_layers - 1 - i)
    return sorted(set(front + back))
